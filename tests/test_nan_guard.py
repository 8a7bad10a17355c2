"""The NaN/inf guard in the real loop (issue 32): a non-finite loss or grad norm skips the update in every
precision and is counted; training.max_consecutive_nan_steps of them in a row stop the run with a one-line
error (exit 2); no checkpoint is written from non-finite weights; metrics.jsonl and summary.json stay strict
JSON (null, never NaN); an evaluation with a NaN loss prints no finite PPL."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from megatron_core import checkpoint_format
from megatron_core.pretrain_gpt import main as train_main
from megatron_core.pretrain_gpt import train
from megatron_core.training.logging import RunLogger
from megatron_core.training.trainer import NonFiniteTrainingError
from training_fixtures import TINY_OVERRIDES, VOCAB_SIZE, fixture_corpus, fixture_one_thread, tiny_recipe  # noqa: F401 - fixtures

QUICK = ("train_iters=10", "eval_iters=0", "hidden_dropout=0.0", "attention_dropout=0.0")


def _reject_constant(name: str):
    raise ValueError(f"bare {name} in JSON")


def strict_records(path: Path) -> list[dict]:
    """Every line of a JSON-lines file, parsed as strict JSON (NaN/Infinity refused)."""
    return [json.loads(line, parse_constant=_reject_constant) for line in path.read_text().splitlines() if line.strip()]


def poison_gradients(monkeypatch, at_iterations, snapshots=None, what="grad"):
    """Make the loop's forward_backward put a NaN into one gradient element (what="grad") or one weight
    (what="weight") at the given training iterations (1-based); record the weights each iteration saw
    before its own update in `snapshots` (iteration -> {name: tensor})."""
    import megatron_core.pipeline_parallel as pipeline
    from megatron_core.distributed.grad_sync import gradient

    real = pipeline.get_forward_backward_func()
    calls = {"train": 0}

    def poisoned(*args, forward_only=False, **kwargs):
        out = real(*args, forward_only=forward_only, **kwargs)
        if forward_only:
            return out
        calls["train"] += 1
        model = args[2]
        if snapshots is not None:
            snapshots[calls["train"]] = {n: p.detach().clone() for n, p in model.named_parameters()}
        if calls["train"] in at_iterations:
            with torch.no_grad():
                param = next(p for p in model.parameters() if gradient(p) is not None)
                (gradient(param) if what == "grad" else param).view(-1)[3] = float("nan")
        return out

    monkeypatch.setattr(pipeline, "get_forward_backward_func", lambda: poisoned)


def all_checkpoint_tensors_finite(save: Path) -> list[str]:
    """The checkpoint files under `save` that hold a non-finite float tensor (none expected)."""
    bad = []
    for path in sorted(save.rglob("*.pt")):
        stack = [torch.load(path, map_location="cpu", weights_only=False)]
        while stack:
            item = stack.pop()
            if isinstance(item, dict):
                stack.extend(item.values())
            elif isinstance(item, (list, tuple)):
                stack.extend(item)
            elif torch.is_tensor(item) and item.is_floating_point() and not torch.isfinite(item).all():
                bad.append(str(path))
                break
    return bad


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_one_nan_gradient_is_skipped_counted_and_training_goes_on(monkeypatch, corpus, tmp_path, precision):
    snapshots: dict = {}
    poison_gradients(monkeypatch, {6}, snapshots)
    overrides = QUICK + (("bf16=true",) if precision == "bf16" else ())
    summary = train(tiny_recipe(*overrides, "save_interval=5"), tmp_path, corpus, vocab_size=VOCAB_SIZE)
    # the weights the 7th iteration started from are the 6th's: the poisoned step changed nothing
    assert all(torch.equal(snapshots[6][n], snapshots[7][n]) for n in snapshots[6])
    assert not all(torch.equal(snapshots[5][n], snapshots[6][n]) for n in snapshots[5])
    records = {r["iteration"]: r for r in strict_records(tmp_path / "metrics.jsonl") if r["type"] == "train"}
    six = records[6]
    assert (six["skipped"], six["nan"], six["lm_loss"], six["grad_norm"]) == (1, 1, None, None)
    assert all(r["skipped"] == r["nan"] == 0 and math.isfinite(r["lm_loss"]) for it, r in records.items() if it != 6)
    assert records[10]["lm_loss"] < records[1]["lm_loss"]
    assert records[6]["lr"] == records[5]["lr"]  # a skipped step does not advance the schedule
    assert (summary["skipped_iterations"], summary["nan_iterations"], summary["iteration"]) == (1, 1, 10)
    assert json.loads((tmp_path / "summary.json").read_text(), parse_constant=_reject_constant)["nan_iterations"] == 1
    assert all_checkpoint_tensors_finite(tmp_path / "checkpoints") == []


def test_consecutive_nan_steps_stop_the_run_with_exit_2_and_no_nan_checkpoint(monkeypatch, corpus, tmp_path, capsys):
    """NaN from iteration 5 on: iterations 5, 6 and 7 are skipped, the third stops the run (default 3). The
    save at 6 holds iteration 4's finite weights; nothing is saved after the stop."""
    poison_gradients(monkeypatch, set(range(5, 11)))
    sets = [arg for item in (*TINY_OVERRIDES, *QUICK, "save_interval=3") for arg in ("--set", item)]
    rc = train_main(
        ["--recipe", "smoke", *sets, "--data-path", corpus, "--vocab-size", str(VOCAB_SIZE), "--run-dir", str(tmp_path)]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err == [err[0]] and err[0].startswith(
        "error: iteration 7: the loss or gradient norm was NaN/inf in 3 "
        "iterations in a row (training.max_consecutive_nan_steps=3)"
    )
    assert "those of iteration 4" in err[0]
    records = [r for r in strict_records(tmp_path / "metrics.jsonl") if r["type"] == "train"]
    assert [r["iteration"] for r in records] == list(range(1, 8))
    assert [r["nan"] for r in records] == [0, 0, 0, 0, 1, 1, 1]
    save = tmp_path / "checkpoints"
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    assert not (save / "iter_0000007").exists() and not (tmp_path / "summary.json").exists()
    assert all_checkpoint_tensors_finite(save) == []
    state = checkpoint_format.load_checkpoint_file(save / "iter_0000006" / "mp_rank_00" / "model_optim_rng.pt")
    assert state["train_counters"] == {"skipped_iterations": 2, "nan_iterations": 2}


def test_a_diverging_init_stops_at_the_limit_without_a_checkpoint(corpus, tmp_path, capsys):
    """model.init_method_std=1e30: every loss is non-finite from the start; with the limit at 2 the run stops
    at iteration 2, exit 2, no checkpoint, losses null in metrics.jsonl."""
    sets = [
        arg
        for item in (*TINY_OVERRIDES, *QUICK, "init_method_std=1e30", "max_consecutive_nan_steps=2")
        for arg in ("--set", item)
    ]
    rc = train_main(
        ["--recipe", "smoke", *sets, "--data-path", corpus, "--vocab-size", str(VOCAB_SIZE), "--run-dir", str(tmp_path)]
    )
    assert rc == 2
    assert capsys.readouterr().err.startswith("error: iteration 2: the loss or gradient norm was NaN/inf in 2 ")
    records = strict_records(tmp_path / "metrics.jsonl")
    assert [(r["iteration"], r["lm_loss"], r["nan"]) for r in records] == [(1, None, 1), (2, None, 1)]
    assert not (tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt").exists()
    assert not list((tmp_path / "checkpoints").glob("iter_*"))


def test_non_finite_weights_are_never_saved(monkeypatch, corpus, tmp_path):
    """A NaN that reaches a weight some other way than a step (here: written into it) is refused at the save:
    no iteration directory, the tracker keeps the last good checkpoint."""
    poison_gradients(monkeypatch, {7}, what="weight")
    with pytest.raises(NonFiniteTrainingError, match=r"^iteration 8: the weights hold NaN/inf values \("):
        train(tiny_recipe(*QUICK, "save_interval=4"), tmp_path, corpus, vocab_size=VOCAB_SIZE)
    save = tmp_path / "checkpoints"
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert not (save / "iter_0000008").exists()
    assert all_checkpoint_tensors_finite(save) == []


def test_an_evaluation_with_a_nan_loss_prints_no_finite_perplexity(tmp_path, capsys):
    logger = RunLogger(tmp_path, writer=True, tensorboard=False)
    record = logger.evaluation("valid", 8, float("nan"))
    assert record == {"type": "valid", "iteration": 8, "lm_loss": None, "ppl": None}
    assert "lm loss value: NAN | lm loss PPL: NAN |" in capsys.readouterr().out
    assert strict_records(tmp_path / "metrics.jsonl") == [record]


def _pp2_nan_on_one_stage(run_dir: str, corpus: str) -> dict:
    """PP 2: at iteration 2 only the last stage's loss is NaN (its gradients are finite); from iteration 5 on
    only the first stage's gradient is. Every rank must skip the same iterations and stop at the same one."""
    import torch.distributed as dist

    import megatron_core.pipeline_parallel as pipeline
    from megatron_core import parallel_state as ps
    from megatron_core.distributed.grad_sync import gradient

    original = pipeline.get_forward_backward_func
    rank, calls, snapshots = dist.get_rank(), {"train": 0}, {}

    def wrap(real):
        def poisoned(*args, forward_only=False, **kwargs):
            out = real(*args, forward_only=forward_only, **kwargs)
            if forward_only:
                return out
            calls["train"] += 1
            it, model = calls["train"], args[2]
            snapshots[it] = [p.detach().clone() for p in model.parameters()]
            if it == 2 and out:  # the last stage holds the losses
                out[0]["lm loss"] = torch.tensor(float("nan"))
            if it >= 5 and rank == 0:
                with torch.no_grad():
                    next(gradient(p) for p in model.parameters() if gradient(p) is not None).view(-1)[0] = float("nan")
            return out

        return poisoned

    pipeline.get_forward_backward_func = lambda: wrap(original())
    recipe = tiny_recipe(*QUICK, "world_size=2", "pipeline_model_parallel_size=2", "save_interval=null")
    try:
        with pytest.raises(NonFiniteTrainingError) as caught:
            train(recipe, run_dir, corpus, vocab_size=VOCAB_SIZE)
    finally:
        pipeline.get_forward_backward_func = original
        ps.destroy_model_parallel()
    unchanged = [
        it for it in sorted(snapshots)[:-1] if all(torch.equal(a, b) for a, b in zip(snapshots[it], snapshots[it + 1]))
    ]
    return {"error": str(caught.value).split(":")[0], "unchanged_after": unchanged}


@pytest.mark.slow
def test_every_pipeline_stage_skips_and_stops_together(corpus, tmp_path):
    from distributed_utils import run_distributed

    ranks = run_distributed(_pp2_nan_on_one_stage, 2, str(tmp_path), corpus)
    # 1: warmup's first step has lr 0; 2: the first stage skips too, though only the last saw the NaN loss
    assert ranks == [{"error": "iteration 7", "unchanged_after": [1, 2, 5, 6]}] * 2
    records = [r for r in strict_records(tmp_path / "metrics.jsonl") if r["type"] == "train"]
    assert [r["nan"] for r in records] == [0, 1, 0, 0, 1, 1, 1]
