"""Continuing from a checkpoint keeps the weights in every precision (issue: a bf16 run continued from a
model-only checkpoint went back to its random initialization, because the fp32 master weights were
copied from the initial model before the checkpoint was loaded and were never rebuilt)."""

from __future__ import annotations

import shutil

import pytest

from megatron_core import checkpoint_format
from megatron_core.pretrain_gpt import train
from megatron_core.training.logging import read_metrics
from training_fixtures import (  # noqa: F401 - fixtures
    VOCAB_SIZE,
    checkpoint_file,
    fixture_corpus,
    fixture_one_thread,
    tiny_recipe,
    train_below_checks,
    train_losses,
    write_corpus,
)

PRECISIONS = {"fp32": (), "bf16": ("bf16=true",), "fp16": ("fp16=true", "initial_loss_scale=1024")}
ITERS, AT = 20, 12  # the runs are 20 iterations long; continuations start from the checkpoint at 12
COMMON = (
    f"train_iters={ITERS}",
    f"save_interval={AT}",
    "eval_iters=0",
    "hidden_dropout=0.0",
    "attention_dropout=0.0",
    "lr=3e-2",
    "min_lr=1e-3",
)


def _recipe(precision: str):
    return tiny_recipe(*COMMON, *PRECISIONS[precision])


def _runner(precision: str):
    """train() itself, except for fp16, which train() refuses on a CPU: its run goes through the same
    Trainer, model, optimizer, loss scaler and checkpoint code one level below (train_below_checks)."""
    return train_below_checks if precision == "fp16" else train


def _copy_iteration(run_dir, to) -> None:
    """A run directory holding only run_dir's checkpoint at AT, as if training had stopped there."""
    source = checkpoint_format.iteration_dir(run_dir / "checkpoints", AT)
    shutil.copytree(source, checkpoint_format.iteration_dir(to / "checkpoints", AT))
    (to / "checkpoints" / checkpoint_format.TRACKER_FILENAME).write_text(f"{AT}\n")


def _losses(run_dir) -> dict[int, float]:
    return train_losses(read_metrics(run_dir))


def _continues(before: float, after: list[float], fresh: float) -> bool:
    """The losses of the steps after the first update (the first loss is computed before any step)
    stay on the loaded model's side, far from a fresh model's: a restarted Adam's first steps shake
    the loss, a model back at its initialization stays at `fresh`."""
    return sum(after) / len(after) < before + 0.5 * (fresh - before)


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_continuation_keeps_the_weights(precision, corpus, tmp_path):
    run = _runner(precision)
    straight, model_only = tmp_path / "straight", tmp_path / "model-only"
    run(_recipe(precision), straight, corpus, vocab_size=VOCAB_SIZE)
    losses = _losses(straight)
    fresh, before = losses[1], losses[AT]
    assert before < fresh - 0.5, f"the model must have learned something to keep: {losses}"

    # Full checkpoint: resuming at AT gives the uninterrupted run's losses bit for bit.
    _copy_iteration(straight, tmp_path / "full")
    run(_recipe(precision), tmp_path / "full", corpus, vocab_size=VOCAB_SIZE)
    after = {k: v for k, v in losses.items() if k > AT}
    assert {k: v for k, v in _losses(tmp_path / "full").items() if k > AT} == after

    # Model-only checkpoint (--no-save-optim): a fresh optimizer, the loaded weights.
    run(_recipe(precision), model_only, corpus, vocab_size=VOCAB_SIZE, save_optim=False)
    _copy_iteration(model_only, tmp_path / "continued")
    run(_recipe(precision), tmp_path / "continued", corpus, vocab_size=VOCAB_SIZE, save_optim=False)
    continued = _losses(tmp_path / "continued")
    assert _continues(before, [continued[AT + i] for i in (2, 3, 4)], fresh), (before, continued)

    # import-hf's `release` (weights only, no recipe): the model starts from them, the rest from zero.
    state = checkpoint_format.load_checkpoint_file(checkpoint_file(straight / "checkpoints", AT))
    checkpoint_format.write_checkpoint(tmp_path / "release", {(0, 0): state["model"]}, state["args"], "release")
    run(_recipe(precision), tmp_path / "from-release", corpus, load=tmp_path / "release", vocab_size=VOCAB_SIZE)
    from_release = _losses(tmp_path / "from-release")
    assert _continues(before, [from_release[i] for i in (2, 3, 4)], fresh), (before, from_release)
