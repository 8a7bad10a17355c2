"""Megatron legacy checkpoints: keys and shapes, nesting, safe loading, atomic saves, and exact
resume (from a mid-run checkpoint, after SIGKILL, after SIGTERM) on CPU fp32."""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_core import checkpoint_format as cf
from megatron_core.pretrain_gpt import train
from megatron_core.training import checkpointing as ckpt
from megatron_core.training.logging import read_metrics
from training_fixtures import VOCAB_SIZE, checkpoint_file, tiny_recipe, train_losses
from training_fixtures import fixture_corpus, fixture_one_thread  # noqa: F401 - fixtures

TESTS_DIR = Path(__file__).resolve().parent
ITERS = 16


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus):
    """The uninterrupted run: 16 iterations, checkpoints at 8 and 16."""
    run_dir = tmp_path_factory.mktemp("reference")
    train(tiny_recipe(f"train_iters={ITERS}"), run_dir, corpus, vocab_size=VOCAB_SIZE)
    return run_dir


def _assert_same_losses(run_dir: Path, reference: Path, after: int) -> None:
    for kind in ("train", "valid", "test"):
        got, want = train_losses(read_metrics(run_dir), kind), train_losses(read_metrics(reference), kind)
        assert {k: v for k, v in want.items() if k > after}, f"nothing to compare after {after}"
        assert {k: v for k, v in got.items() if k > after} == {k: v for k, v in want.items() if k > after}, kind


# -- layout, keys, shapes ----------------------------------------------------------------------------


def test_checkpoint_layout_keys_and_shapes(reference):
    save = reference / "checkpoints"
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
    # No tokenizer files: trained from token ids.
    assert sorted(p.name for p in save.iterdir()) == [
        "iter_0000008",
        "iter_0000016",
        "latest_checkpointed_iteration.txt",
        "recipe.yaml",
    ]
    state = cf.load_checkpoint_file(save / "iter_0000016" / "mp_rank_00" / "model_optim_rng.pt")
    assert set(state) >= {
        "args",
        "checkpoint_version",
        "iteration",
        "model",
        "optimizer",
        "opt_param_scheduler",
        "rng_state",
        "recipe",
        "recipe_hash",
        "consumed_train_samples",
    }
    assert state["checkpoint_version"] == 3.0 and state["iteration"] == ITERS
    assert state["consumed_train_samples"] == ITERS * 4
    args = state["args"]
    assert isinstance(args, argparse.Namespace)
    assert (
        args.padded_vocab_size,
        args.max_position_embeddings,
        args.hidden_size,
        args.num_layers,
        args.num_attention_heads,
        args.ffn_hidden_size,
    ) == (128, 32, 32, 2, 2, 128)
    assert args.bias_gelu_fusion is True and args.openai_gelu is False and args.tokenizer_type == "GPT2BPETokenizer"
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.seq_length, args.params_dtype) == (
        1,
        1,
        32,
        "float32",
    )
    lm = state["model"]["language_model"]
    assert set(state["model"]) == {"language_model"} and set(lm) == {"embedding", "encoder"}
    assert lm["embedding"]["word_embeddings"]["weight"].shape == (128, 32)
    assert lm["embedding"]["position_embeddings"]["weight"].shape == (32, 32)
    enc = lm["encoder"]
    expected = {
        "input_layernorm.weight": (32,),
        "input_layernorm.bias": (32,),
        "self_attention.query_key_value.weight": (96, 32),
        "self_attention.query_key_value.bias": (96,),
        "self_attention.dense.weight": (32, 32),
        "self_attention.dense.bias": (32,),
        "post_attention_layernorm.weight": (32,),
        "post_attention_layernorm.bias": (32,),
        "mlp.dense_h_to_4h.weight": (128, 32),
        "mlp.dense_h_to_4h.bias": (128,),
        "mlp.dense_4h_to_h.weight": (32, 128),
        "mlp.dense_4h_to_h.bias": (32,),
    }
    want = {f"layers.{i}.{k}": v for i in range(2) for k, v in expected.items()}
    want.update({"final_layernorm.weight": (32,), "final_layernorm.bias": (32,)})
    assert {k: tuple(v.shape) for k, v in enc.items()} == want
    assert set(state["opt_param_scheduler"]) >= {"max_lr", "min_lr", "num_steps", "lr_decay_style"}
    assert state["opt_param_scheduler"]["num_steps"] == ITERS * 4  # samples, as Megatron counts (global batch 4)
    rng = state["rng_state"][0]
    assert set(rng) >= {"random_rng_state", "np_rng_state", "torch_rng_state", "cuda_rng_state", "rng_tracker_states"}


def test_nest_and_flatten_are_inverse_for_every_stage_kind():
    t = torch.zeros(1)
    last_stage = {
        "encoder.layers.0.mlp.dense_4h_to_h.bias": t,
        "encoder.final_layernorm.weight": t,
        "word_embeddings_for_head.weight": t,
    }
    nested = cf.nest_model_state(last_stage)
    assert nested == {
        "language_model": {"encoder": {"layers.0.mlp.dense_4h_to_h.bias": t, "final_layernorm.weight": t}},
        "word_embeddings_for_head": {"weight": t},
    }
    untied = {
        "embedding.word_embeddings.weight": t,
        "embedding.position_embeddings.weight": t,
        "output_layer.weight": t,
    }
    assert cf.nest_model_state(untied)["language_model"]["output_layer"] == {"weight": t}
    for flat in (last_stage, untied):
        assert cf.flatten_model_state(cf.nest_model_state(flat)) == flat
    with pytest.raises(ValueError, match="no place"):
        cf.nest_model_state({"lm_head.weight": t})


class Sneaky:
    """Not on the allow-list."""


def test_load_refuses_unlisted_globals_and_garbage(tmp_path):
    torch.save({"x": Sneaky()}, tmp_path / "bad.pt")
    with pytest.raises(cf.CheckpointError, match="cannot read checkpoint"):
        cf.load_checkpoint_file(tmp_path / "bad.pt")
    (tmp_path / "cut.pt").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(cf.CheckpointError, match="cannot read checkpoint"):
        cf.load_checkpoint_file(tmp_path / "cut.pt")
    with pytest.raises(cf.CheckpointError, match="does not exist"):
        cf.load_checkpoint_file(tmp_path / "missing.pt")


# -- resume ------------------------------------------------------------------------------------------


def _checkpoint_copy(reference: Path, target: Path, iteration: int) -> Path:
    """A run directory holding only the reference's checkpoint at `iteration` and its metrics up to it."""
    save = target / "checkpoints"
    save.mkdir(parents=True)
    shutil.copytree(reference / "checkpoints" / f"iter_{iteration:07d}", save / f"iter_{iteration:07d}")
    (save / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")
    return save


def test_resume_from_mid_run_checkpoint_is_exact(reference, corpus, tmp_path):
    _checkpoint_copy(reference, tmp_path, 8)
    summary = train(tiny_recipe(f"train_iters={ITERS}"), tmp_path, corpus, vocab_size=VOCAB_SIZE)
    assert summary["iteration"] == ITERS
    assert min(train_losses(read_metrics(tmp_path))) == 9
    _assert_same_losses(tmp_path, reference, after=8)


def test_resume_with_changed_recipe_is_refused_unless_safe(reference, corpus, tmp_path):
    _checkpoint_copy(reference, tmp_path, 8)
    with pytest.raises(cf.CheckpointError, match=r"changed keys that alter training: training\.lr, training\.min_lr"):
        train(tiny_recipe(f"train_iters={ITERS}", "lr=1e-3", "min_lr=1e-4"), tmp_path, corpus, vocab_size=VOCAB_SIZE)
    summary = train(
        tiny_recipe(f"train_iters={ITERS}", "training.log_interval=4", "save_interval=null"),
        tmp_path,
        corpus,
        vocab_size=VOCAB_SIZE,
    )
    assert summary["iteration"] == ITERS


@pytest.mark.usefixtures("reference")
def test_no_save_optim_writes_model_only(corpus, tmp_path):
    train(
        tiny_recipe("train_iters=3", "lr_warmup_iters=1", "save_interval=null", "eval_iters=0"),
        tmp_path,
        corpus,
        vocab_size=VOCAB_SIZE,
        save_optim=False,
    )
    state = cf.load_checkpoint_file(checkpoint_file(tmp_path / "checkpoints", 3))
    assert "optimizer" not in state and "opt_param_scheduler" not in state and "model" in state


_CHILD = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    torch.set_num_threads(1)
    from megatron_core.pretrain_gpt import train
    from training_fixtures import VOCAB_SIZE, tiny_recipe
    train(tiny_recipe("train_iters={iters}", "save_interval=2"), {run_dir!r}, {corpus!r}, vocab_size=VOCAB_SIZE)
    print("child finished", flush=True)
""")


def _start_child(run_dir: Path, corpus: str) -> subprocess.Popen:
    code = _CHILD.format(tests=str(TESTS_DIR), iters=ITERS, run_dir=str(run_dir), corpus=corpus)
    return subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _wait_for_checkpoint(run_dir: Path, child: subprocess.Popen, at_least: int, timeout: float = 90.0) -> int:
    tracker = run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if tracker.exists() and int(tracker.read_text()) >= at_least:
            return int(tracker.read_text())
        if child.poll() is not None:
            pytest.fail("training child ended before its first checkpoint:\n" + child.stdout.read())
        time.sleep(0.01)
    child.kill()
    pytest.fail("no checkpoint within the timeout")


def test_resume_after_sigkill_is_exact(reference, corpus, tmp_path):
    child = _start_child(tmp_path, corpus)
    _wait_for_checkpoint(tmp_path, child, at_least=4)
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    killed_at = cf.read_tracker(tmp_path / "checkpoints")
    assert killed_at < ITERS, "the child finished before it was killed; the test proved nothing"
    train(tiny_recipe(f"train_iters={ITERS}", "save_interval=2"), tmp_path, corpus, vocab_size=VOCAB_SIZE)
    _assert_same_losses(tmp_path, reference, after=killed_at)


def test_sigterm_saves_exits_zero_and_resumes_exactly(reference, corpus, tmp_path):
    child = _start_child(tmp_path, corpus)
    _wait_for_checkpoint(tmp_path, child, at_least=2)
    child.send_signal(signal.SIGTERM)
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 0, out
    assert "received SIGTERM: saved checkpoint at iteration" in out
    assert "child finished" in out
    stopped_at = cf.read_tracker(tmp_path / "checkpoints")
    assert f"saved checkpoint at iteration {stopped_at} to {tmp_path / 'checkpoints' / f'iter_{stopped_at:07d}'}" in out
    assert stopped_at < ITERS
    train(tiny_recipe(f"train_iters={ITERS}", "save_interval=2"), tmp_path, corpus, vocab_size=VOCAB_SIZE)
    _assert_same_losses(tmp_path, reference, after=stopped_at)


# -- atomicity ---------------------------------------------------------------------------------------


class Killed(BaseException):
    """Stands for the process dying at this point."""


@pytest.mark.parametrize("where", ["mid-file", "before-rename", "before-tracker"])
def test_save_killed_midway_leaves_previous_checkpoint_loadable(reference, tmp_path, monkeypatch, where):
    save = _checkpoint_copy(reference, tmp_path, 8)
    good = cf.load_checkpoint_file(checkpoint_file(save, 8))
    real_replace = os.replace

    def dying_torch_save(_obj, f, *_args, **_kwargs):
        Path(f).write_bytes(b"half a checkpoint")
        raise Killed

    def dying_replace(src, dst):
        if str(dst).endswith("iter_0000012"):
            raise Killed
        return real_replace(src, dst)

    def dying_tracker(_path, _text):
        raise Killed

    patch = {
        "mid-file": (torch, "save", dying_torch_save),
        "before-rename": (os, "replace", dying_replace),
        "before-tracker": (cf, "atomic_write_text", dying_tracker),
    }[where]
    monkeypatch.setattr(*patch)
    with pytest.raises(Killed):
        ckpt.save_checkpoint(
            save,
            12,
            model_state=cf.flatten_model_state(good["model"]),
            args=good["args"],
            recipe=tiny_recipe(f"train_iters={ITERS}"),
            consumed_train_samples=48,
        )
    monkeypatch.undo()
    assert cf.read_tracker(save) == 8
    iteration, state = ckpt.load_latest(save)
    assert iteration == 8 and torch.equal(
        state["model"]["language_model"]["embedding"]["word_embeddings"]["weight"],
        good["model"]["language_model"]["embedding"]["word_embeddings"]["weight"],
    )
    # The next save cleans up and completes.
    ckpt.save_checkpoint(
        save,
        12,
        model_state=cf.flatten_model_state(good["model"]),
        args=good["args"],
        recipe=tiny_recipe(f"train_iters={ITERS}"),
        consumed_train_samples=48,
    )
    assert cf.read_tracker(save) == 12 and not list(save.glob("*.tmp"))
    assert ckpt.load_latest(save)[1]["consumed_train_samples"] == 48


@pytest.mark.parametrize("where", ["mid-file", "before-tracker"])
def test_model_only_writer_killed_midway_leaves_previous_checkpoint(reference, tmp_path, monkeypatch, where):
    """import-hf and the converters write through the same staging and publishing as training."""
    save = _checkpoint_copy(reference, tmp_path, 8)
    good = cf.load_checkpoint_file(checkpoint_file(save, 8))

    def dying(*_args, **_kwargs):
        raise Killed

    monkeypatch.setattr(
        *{"mid-file": (torch, "save", dying), "before-tracker": (cf, "atomic_write_text", dying)}[where]
    )
    with pytest.raises(Killed):
        cf.write_checkpoint(save, {(0, 0): good["model"]}, good["args"], "release")
    monkeypatch.undo()
    assert cf.read_tracker(save) == 8 and ckpt.load_latest(save)[0] == 8
    cf.write_checkpoint(save, {(0, 0): good["model"]}, good["args"], "release")
    assert cf.read_tracker(save) == "release" and not list(save.glob("*.tmp"))


# -- the distributed optimizer's shards (DP 2, gloo) -------------------------------------------------


def _dp2_train(run_dir: str, corpus: str, iters: int) -> dict:
    from megatron_core import parallel_state as ps

    recipe = tiny_recipe(
        f"train_iters={iters}",
        f"lr_decay_iters={ITERS}",
        "world_size=2",
        "use_distributed_optimizer=true",
        "save_interval=4",
        "eval_iters=0",
    )
    try:
        train(recipe, run_dir, corpus, vocab_size=VOCAB_SIZE)
    finally:
        ps.destroy_model_parallel()
    return train_losses(read_metrics(Path(run_dir))) if (Path(run_dir) / "metrics.jsonl").exists() else {}


def test_distributed_optimizer_shards_saved_beside_and_resumed_exactly(corpus, tmp_path):
    from distributed_utils import run_distributed

    full = run_distributed(_dp2_train, 2, str(tmp_path / "full"), corpus, 8)[0]
    rank_dir = tmp_path / "full" / "checkpoints" / "iter_0000004" / "mp_rank_00"
    pieces = [cf.load_checkpoint_file(rank_dir / cf.distrib_optim_filename(r))["param_state"] for r in (0, 1)]
    weights = cf.flatten_model_state(cf.load_checkpoint_file(rank_dir / cf.MODEL_FILENAME)["model"])
    # each DP rank wrote its own pieces (nothing gathered); together they cover every weight once
    assert {n: sum(p[n]["exp_avg"].numel() for p in pieces if n in p) for n in weights} == {
        n: w.numel() for n, w in weights.items()
    }
    _checkpoint_copy(tmp_path / "full", tmp_path / "resumed", 4)
    resumed = run_distributed(_dp2_train, 2, str(tmp_path / "resumed"), corpus, 8)[0]
    assert {k: v for k, v in resumed.items() if k > 4} == {k: v for k, v in full.items() if k > 4}
    assert min(resumed) == 5


def test_megatron_lm_rng_state_with_numpy_arrays_loads_safely(tmp_path):
    """Megatron-LM stores np.random.get_state() (an ndarray inside) in rng_state; the allow-list takes
    plain numpy arrays (arbitrary objects stay refused: test_load_refuses_unlisted_globals_and_garbage)."""
    state = {
        "args": argparse.Namespace(num_layers=2),
        "iteration": 7,
        "rng_state": [
            {
                "random_rng_state": random.getstate(),
                "np_rng_state": np.random.get_state(),
                "torch_rng_state": torch.get_rng_state(),
            }
        ],
    }
    torch.save(state, tmp_path / "megatron_lm.pt")
    loaded = cf.load_checkpoint_file(tmp_path / "megatron_lm.pt")
    np_state = loaded["rng_state"][0]["np_rng_state"]
    assert np_state[0] == "MT19937" and np.array_equal(np_state[1], np.random.get_state()[1])


def _dp2_signal_one_rank(run_dir: str, corpus: str) -> dict:
    """DP 2 where only rank 1 receives SIGTERM (after its 3rd iteration): both ranks must stop together."""
    import os

    import torch.distributed as dist

    from megatron_core import parallel_state as ps
    from megatron_core.training import trainer as trainer_lib

    original = trainer_lib.Trainer.train_step

    def train_step(self, data_iterator):
        result = original(self, data_iterator)
        if dist.get_rank() == 1 and self.state.iteration == 2:  # the loop counts this step as iteration 3
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    trainer_lib.Trainer.train_step = train_step
    recipe = tiny_recipe("train_iters=12", "world_size=2", "save_interval=null", "eval_iters=0")
    try:
        summary = train(recipe, run_dir, corpus, vocab_size=VOCAB_SIZE)
    finally:
        trainer_lib.Trainer.train_step = original
        ps.destroy_model_parallel()
    return {"iteration": summary["iteration"], "stopped_by": summary["stopped_by"]}


def test_a_signal_on_one_rank_stops_every_rank_after_the_same_iteration(corpus, tmp_path):
    from distributed_utils import run_distributed

    ranks = run_distributed(_dp2_signal_one_rank, 2, str(tmp_path), corpus)
    assert ranks == [{"iteration": 3, "stopped_by": "SIGTERM"}] * 2
    assert cf.read_tracker(tmp_path / "checkpoints") == 3


def _latest_on_each_rank(root: str):
    import torch.distributed as dist

    from megatron_core import parallel_state as ps

    ps.initialize_model_parallel(1, 1)
    try:
        own = Path(root) / f"node{dist.get_rank()}"  # no shared filesystem: each rank its own directory
        own.mkdir(parents=True, exist_ok=True)
        if dist.get_rank() == 0:
            (own / cf.TRACKER_FILENAME).write_text("6\n")
        try:
            ckpt.load_latest(own)
        except cf.CheckpointError as exc:
            return str(exc)
        return None
    finally:
        ps.destroy_model_parallel()


def test_ranks_that_found_different_latest_checkpoints_are_stopped(tmp_path):
    """A node whose disk lacks the tracker must not start from scratch beside ranks that resume."""
    from distributed_utils import run_distributed

    errors = run_distributed(_latest_on_each_rank, 2, str(tmp_path))
    assert all(e is not None and "different latest checkpoints" in e and "from none to 6" in e for e in errors), errors
