"""The training loop end to end on a tiny GPT (CPU, fp32): loss goes down, runs are deterministic,
gradient accumulation matches one big batch, outputs are written, bad values are refused."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_core.errors import UserError
from megatron_core.pretrain_gpt import main as train_main
from megatron_core.pretrain_gpt import train
from megatron_core.training.logging import read_metrics
from training_fixtures import (  # noqa: F401 - fixtures
    VOCAB_SIZE,
    fixture_corpus,
    fixture_one_thread,
    tiny_recipe,
    train_below_checks,
    train_losses,
    write_corpus,
)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, corpus):
    run_dir = tmp_path_factory.mktemp("run-a")
    summary = train(tiny_recipe("train_iters=24", "save_interval=null"), run_dir, corpus, vocab_size=VOCAB_SIZE)
    return run_dir, summary


def test_loss_decreases_and_outputs_are_written(first_run):
    run_dir, summary = first_run
    metrics = read_metrics(run_dir)
    losses = train_losses(metrics)
    assert sorted(losses) == list(range(1, 25))
    assert losses[24] < losses[1] - 0.5, losses
    assert math.log(VOCAB_SIZE) - 0.3 < losses[1] < math.log(128) + 0.3  # starts near uniform
    record = next(m for m in metrics if m["type"] == "train")
    assert set(record) >= {
        "type",
        "iteration",
        "consumed_samples",
        "lm_loss",
        "lr",
        "grad_norm",
        "loss_scale",
        "elapsed_ms",
        "tokens_per_s",
        "tflops",
        "skipped",
        "nan",
    }
    assert "mfu" not in record  # CPU: no peak known, none invented
    assert record["consumed_samples"] == 4 and record["loss_scale"] == 1.0
    valid = [m for m in metrics if m["type"] == "valid"]
    assert [v["iteration"] for v in valid] == [8, 16, 24]
    assert valid[-1]["ppl"] == pytest.approx(math.exp(valid[-1]["lm_loss"]))
    assert [m["type"] for m in metrics].count("test") == 1
    assert summary["valid"]["lm_loss"] == valid[-1]["lm_loss"]
    assert (run_dir / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "24"


def test_same_seed_same_losses(first_run, corpus, tmp_path):
    run_dir, _ = first_run
    train(tiny_recipe("train_iters=24", "save_interval=null"), tmp_path, corpus, vocab_size=VOCAB_SIZE)
    assert train_losses(read_metrics(tmp_path)) == train_losses(read_metrics(run_dir))
    assert train_losses(read_metrics(tmp_path), "valid") == train_losses(read_metrics(run_dir), "valid")


def test_gradient_accumulation_matches_one_batch(corpus, tmp_path):
    """global 4 as 2 micro batches of 2 == 1 micro batch of 4 (dropout off)."""
    common = ("train_iters=4", "hidden_dropout=0.0", "attention_dropout=0.0", "save_interval=null", "eval_iters=0")
    train(tiny_recipe(*common, "micro_batch_size=2"), tmp_path / "acc", corpus, vocab_size=VOCAB_SIZE)
    train(tiny_recipe(*common, "micro_batch_size=4"), tmp_path / "one", corpus, vocab_size=VOCAB_SIZE)
    acc, one = (train_losses(read_metrics(tmp_path / d)) for d in ("acc", "one"))
    for it in range(1, 5):
        assert acc[it] == pytest.approx(one[it], rel=1e-5)


def test_fp16_loop_skips_injected_inf_and_recovers(corpus, tmp_path, monkeypatch):
    """fp16's dynamic loss scaling in the real loop, below train() (which refuses fp16 on a CPU)."""
    import megatron_core.pipeline_parallel as pipeline
    from megatron_core.distributed.grad_sync import gradient

    real = pipeline.get_forward_backward_func()
    calls = {"train": 0}

    def poisoned(*args, forward_only=False, **kwargs):
        out = real(*args, forward_only=forward_only, **kwargs)
        if not forward_only:
            calls["train"] += 1
            if calls["train"] == 6:
                next(gradient(p) for p in args[2].parameters() if gradient(p) is not None).view(-1)[0] = float("inf")
        return out

    monkeypatch.setattr(pipeline, "get_forward_backward_func", lambda: poisoned)
    recipe = tiny_recipe(
        "train_iters=16", "fp16=true", "initial_loss_scale=1024", "hysteresis=1", "save_interval=null", "eval_iters=0"
    )
    train_below_checks(recipe, tmp_path, corpus)
    metrics = [m for m in read_metrics(tmp_path) if m["type"] == "train"]
    by_it = {m["iteration"]: m for m in metrics}
    assert sorted(by_it) == list(range(1, 17)) and by_it[6]["skipped"] == 1
    assert by_it[5]["loss_scale"] == 1024.0 and by_it[6]["loss_scale"] == 512.0
    assert by_it[6]["lr"] == by_it[5]["lr"]  # a skipped step does not advance the schedule
    assert all(m["skipped"] == 0 for m in metrics if m["iteration"] != 6)
    assert by_it[16]["lm_loss"] < by_it[7]["lm_loss"] < by_it[1]["lm_loss"]


def test_bf16_trains_close_to_fp32_with_bf16_weights_and_fp32_master(first_run, corpus, tmp_path):
    """bf16: the model's parameters are bf16, the optimizer steps fp32 master copies, and the losses follow
    the fp32 run within bf16's precision."""
    from megatron_core import checkpoint_format
    from megatron_core.training import checkpointing as ckpt

    recipe = tiny_recipe("train_iters=24", "save_interval=null", "bf16=true")
    summary = train(recipe, tmp_path, corpus, vocab_size=VOCAB_SIZE)
    bf16 = train_losses(read_metrics(tmp_path))
    fp32 = train_losses(read_metrics(first_run[0]))
    assert summary["skipped_iterations"] == 0 and bf16[24] < bf16[1] - 0.5
    for it in (1, 12, 24):
        assert bf16[it] == pytest.approx(fp32[it], rel=3e-2), it
    state = ckpt.load_latest(tmp_path / "checkpoints")[1]
    weights = checkpoint_format.flatten_model_state(state["model"])
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert state["args"].params_dtype == "bfloat16"
    masters = {name: entry["fp32_param"] for name, entry in state["optimizer"]["param_state"].items()}
    assert masters.keys() == weights.keys() and {m.dtype for m in masters.values()} == {torch.float32}


@pytest.mark.parametrize(
    "override, message",
    [
        ("lr=0 min_lr=0", "training.lr must be > 0"),
        ("clip_grad=-1", "training.clip_grad must be >= 0"),
        ("eval_iters=-2", "training.eval_iters must be >= 0"),
        ("save_interval=0", "training.save_interval must be >= 1"),
        ("adam_beta2=1.0", "training.adam_beta2 must be in [0, 1)"),
        ("world_size=2", "the recipe's parallel.world_size is 2 but 1 processes were started"),
        ("fp16=true", "training.fp16 needs a CUDA GPU but training.device is cpu"),
    ],
)
def test_bad_recipe_values_refused_at_start(corpus, tmp_path, override, message):
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        train(tiny_recipe(*override.split()), tmp_path, corpus, vocab_size=VOCAB_SIZE)
    assert not (tmp_path / "metrics.jsonl").exists()


FP16_ON_CPU = (
    "cannot train this recipe: training.fp16 needs a CUDA GPU but training.device is cpu: fp16 is for "
    "GPUs (no fast fp16 matmuls on a CPU); on a CPU use --set fp16=false --set bf16=true (or fp32), or "
    "train on a GPU with --set device=cuda"
)


def test_fp16_on_a_cpu_is_refused_in_one_line_by_every_entry_and_writes_nothing(corpus, tmp_path, capsys):
    """train(), `python -m megatron_core.pretrain_gpt` and `invoke train` refuse fp16 on the CPU
    device with one line naming the keys and the fix, before anything is written (invoke: before the
    data steps run)."""
    import invoke

    import tasks

    with pytest.raises(UserError) as refused:
        train(tiny_recipe("fp16=true"), tmp_path / "run", corpus, vocab_size=VOCAB_SIZE)
    assert str(refused.value) == FP16_ON_CPU
    rc = train_main(
        [
            "--recipe",
            "smoke",
            "--set",
            "fp16=true",
            "--data-path",
            corpus,
            "--vocab-size",
            "100",
            "--run-dir",
            str(tmp_path / "cli"),
        ]
    )
    assert rc == 2 and capsys.readouterr().err == f"error: {FP16_ON_CPU}\n"
    with pytest.raises(invoke.Exit) as ended:
        tasks.train(invoke.Context(), recipe="smoke", set_=["fp16=true"], workdir=str(tmp_path / "work"))
    assert (ended.value.code, ended.value.message) == (2, f"error: {FP16_ON_CPU}")
    assert list(tmp_path.iterdir()) == []


def test_fp16_is_accepted_where_it_trains_on_a_gpu(monkeypatch):
    """The check is a function of the recipe (and, for device auto, of whether CUDA is visible): fp16
    on device cuda passes it on any host; auto is refused only where it would run on the CPU."""
    from megatron_core.pretrain_gpt import check_training_values

    check_training_values(tiny_recipe("fp16=true", "device=cuda"))
    check_training_values(tiny_recipe("bf16=true"))  # bf16 on the CPU is fine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    check_training_values(tiny_recipe("fp16=true", "device=auto"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match=r"training.device is auto \(no CUDA GPU visible, so cpu\)"):
        check_training_values(tiny_recipe("fp16=true", "device=auto"))


def test_cli_reports_errors_for_people(tmp_path, capsys):
    rc = train_main(
        [
            "--recipe",
            "smoke",
            "--set",
            "lr=0",
            "--set",
            "min_lr=0",
            "--data-path",
            str(tmp_path / "nothing"),
            "--vocab-size",
            "100",
            "--run-dir",
            str(tmp_path / "run"),
        ]
    )
    assert rc == 2
    assert "error: training.lr must be > 0 (got 0.0)" in capsys.readouterr().err


_RECORD = {
    "iteration": 10,
    "consumed_samples": 320,
    "elapsed_ms": 123.45,
    "tflops": 1.23,
    "lr": 3e-3,
    "global_batch_size": 32,
    "lm_loss": 5.4321,
    "loss_scale": 1.0,
    "grad_norm": 0.75,
    "skipped": 0,
    "nan": 0,
}


def test_megatron_log_line_format():
    from megatron_core.training.logging import megatron_train_line

    line = megatron_train_line(_RECORD, train_iters=300)
    assert line.endswith(
        "] iteration       10/     300 | consumed samples:          320 | elapsed time per "
        "iteration (ms): 123.5 | throughput per GPU (TFLOP/s/GPU): 1.2 | learning rate: "
        "3.000000E-03 | global batch size:    32 | lm loss: 5.432100E+00 | loss scale: 1.0 | "
        "grad norm: 0.750 | number of skipped iterations:   0 | number of nan iterations:   0 |"
    )
    assert line.startswith(" [20")
    ours = megatron_train_line(
        {
            **_RECORD,
            "tokens_per_s": 4823.4,
            "batch_generator_ms": 1.25,
            "mfu": 0.1234,
            "lm_loss": None,
            "grad_norm": None,
        },
        train_iters=300,
    )
    assert ours.endswith(
        "| global batch size:    32 | loss scale: 1.0 | number of skipped iterations:   0 |"
        " number of nan iterations:   0 | tokens/s: 4823 | batch-generator: 1.2 ms | MFU: 12.3% |"
    )


def test_one_train_record_reaches_every_sink(tmp_path, capsys):
    """A key added to the record (and no other change) reaches the line, metrics.jsonl and TensorBoard; None and
    non-finite values are left out of TensorBoard, null in metrics.jsonl; the printed line is the record's."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_core.training.logging import RunLogger

    logger = RunLogger(tmp_path, writer=True)
    logger.train({**_RECORD, "grad_norm": None, "brand_new_metric": 2.5, "tflops": float("inf")}, train_iters=300)
    logger.evaluation("valid", 10, 4.0)
    logger.close()
    [line] = [text for text in capsys.readouterr().out.splitlines() if " iteration       10/" in text]
    assert "| lm loss: 5.432100E+00 | loss scale: 1.0 | number of skipped" in line
    assert line.endswith("| number of nan iterations:   0 | brand new metric: 2.5 |")
    train_record = read_metrics(tmp_path)[0]
    assert train_record["brand_new_metric"] == 2.5 and train_record["grad_norm"] is None
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "train/brand_new_metric",
        "train/lm_loss",
        "train/lr",
        "train/global_batch_size",
        "train/nan",
        "valid/lm_loss",
        "valid/ppl",
    } <= tags
    assert not tags & {"train/grad_norm", "train/tflops", "train/iteration", "train/type"}
    [point] = events.Scalars("train/brand_new_metric")
    assert (point.step, point.value) == (10, 2.5)


def test_compile_true_trains_like_eager(corpus, tmp_path, capsys):
    """`compile: true` (each layer through inductor on this CPU) runs the same training as eager: same losses
    within fp32 noise (dropout off: compiled kernels draw their own masks)."""
    losses = {}
    for name in ("false", "true"):
        run_dir = tmp_path / name
        train(
            tiny_recipe(
                "train_iters=6",
                "save_interval=null",
                "eval_interval=6",
                "hidden_dropout=0",
                "attention_dropout=0",
                f"training.compile={name}",
            ),
            run_dir,
            corpus,
            vocab_size=VOCAB_SIZE,
        )
        losses[name] = train_losses(read_metrics(run_dir))
    assert "; compile: True" in capsys.readouterr().out  # the start-up log names what ran
    assert sorted(losses["true"]) == sorted(losses["false"]) == list(range(1, 7))
    for it, loss in losses["true"].items():
        assert loss == pytest.approx(losses["false"][it], rel=1e-4), it


@pytest.mark.parametrize("device, backend", [("cpu", "gloo"), ("auto", None)])
def test_backend_follows_the_recipe_device_even_where_cuda_is_visible(monkeypatch, corpus, tmp_path, device, backend):
    """A CPU recipe (the smoke runs) joins its ranks with gloo on a GPU host too; NCCL only for GPU training
    (None: init_distributed picks NCCL when CUDA is there)."""
    import megatron_core.distributed

    seen = {}

    def fake_init(backend=None, **_):
        seen["backend"] = backend
        raise RuntimeError("stop here")

    monkeypatch.setattr(megatron_core.distributed, "init_distributed", fake_init)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="stop here"):
        train(tiny_recipe(f"device={device}"), tmp_path, corpus, vocab_size=VOCAB_SIZE)
    assert seen["backend"] == backend


def test_fp16_skipped_iterations_are_reported_as_skipped_not_as_nan_losses(corpus, tmp_path):
    """fp16 at the recipes' own loss scaling (2^32, hysteresis 2): the first iterations overflow until the
    scale comes down. They are counted as skipped, their intervals' lm_loss is null (never NaN: strict JSON),
    the NaN counter stays 0, and the golden `sanity` check judges the iterations that stepped."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from ci import golden

    def strict(text: str) -> dict:
        return json.loads(text, parse_constant=lambda name: pytest.fail(f"bare {name} in JSON"))

    recipe = tiny_recipe("train_iters=30", "fp16=true", "save_interval=null", "eval_iters=0", "training.log_interval=3")
    assert (recipe.training.initial_loss_scale, recipe.training.hysteresis) == (2.0**32, 2)
    train_below_checks(recipe, tmp_path, corpus)
    records = [strict(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    all_skipped = [r["iteration"] for r in records if r["skipped"] == 3]
    assert all_skipped[:2] == [3, 6] and all(r["lm_loss"] is None for r in records if r["iteration"] in all_skipped)
    assert all(r["nan"] == 0 for r in records)
    stepped = [r["lm_loss"] for r in records if r["lm_loss"] is not None]
    assert len(stepped) >= 3 and stepped[-1] < stepped[0]
    summary = strict((tmp_path / "summary.json").read_text())
    assert summary["skipped_iterations"] == sum(r["skipped"] for r in records) >= 6 and summary["nan_iterations"] == 0
    verdict = golden.sanity(tmp_path / "metrics.jsonl")
    assert verdict.startswith(f"sane: {len(stepped)} train values")
    assert f"{summary['skipped_iterations']} iterations skipped" in verdict


@pytest.mark.parametrize("extra, rc", [((), 0), (("--set", "world_size=2"), 2)])
def test_main_destroys_the_process_group_it_started(monkeypatch, corpus, tmp_path, extra, rc):
    """Under torchrun's environment (a 1-rank gloo group here) `python -m megatron_core.pretrain_gpt` destroys
    the process group it created before it returns, after a finished run and after an error alike."""
    import torch.distributed as dist

    from distributed_utils import free_port
    from training_fixtures import TINY_OVERRIDES

    for name, value in {
        "WORLD_SIZE": "1",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }.items():
        monkeypatch.setenv(name, value)
    sets = [
        arg
        for item in (*TINY_OVERRIDES, "train_iters=3", "eval_iters=0", "save_interval=null")
        for arg in ("--set", item)
    ]
    try:
        assert (
            train_main(
                [
                    "--recipe",
                    "smoke",
                    *sets,
                    *extra,
                    "--data-path",
                    corpus,
                    "--vocab-size",
                    "100",
                    "--run-dir",
                    str(tmp_path),
                ]
            )
            == rc
        )
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
