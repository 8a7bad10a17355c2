"""Extending a run (issue 36, item 5): a raised train_iters continues the run in its own directory, as raising
--train-iters does in Megatron; convert and evaluate find that run without the same --set."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_core import workflow
from megatron_core.checkpoint_format import read_tracker
from megatron_core.config import RESUME_SAFE_KEYS, load_recipe
from megatron_core.config.resume import RUN_EXTENDING_KEYS
from megatron_core.evaluate.runner import converted_iteration
from megatron_core.training.checkpointing import lr_schedule_note
from megatron_core.training.logging import read_metrics

ROOT = Path(__file__).resolve().parents[1]
N = 4  # iterations of the first run; the extension trains on to 2N


def invoke(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "invoke", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def test_the_run_directory_leaves_out_only_how_long_and_how_visibly_a_run_trains():
    base = load_recipe("smoke")
    longer = load_recipe(
        "smoke",
        [
            "train_iters=2000",
            "save_interval=50",
            "eval_interval=50",
            "training.log_interval=7",
            "evaluate.humaneval_num_samples=8",
        ],
    )
    assert longer.hash != base.hash  # the recipe hash (checkpoints, goldens) still sees every key
    assert longer.stage_hash("train") == base.stage_hash("train")
    for other in (["lr=5e-3"], ["seed=3"], ["world_size=2", "tensor_model_parallel_size=2"], ["device=auto"]):
        assert load_recipe("smoke", other).stage_hash("train") != base.stage_hash("train"), other
    assert RUN_EXTENDING_KEYS <= RESUME_SAFE_KEYS  # a run directory never holds checkpoints its resume refuses


def test_the_lr_note_says_where_the_decay_now_ends():
    saved = load_recipe("smoke", ["train_iters=900"]).to_dict()
    note = lr_schedule_note(load_recipe("smoke", ["train_iters=2000"]), saved, 900)
    assert note.startswith(
        "lr_decay_iters follows train_iters: 900 -> 2000; the learning rate now decays to "
        "min_lr at 2000 (at iteration 900 it is "
    )
    assert lr_schedule_note(load_recipe("smoke", ["train_iters=900"]), saved, 900) is None  # nothing moved
    fixed = load_recipe("smoke", ["train_iters=2000", "lr_decay_iters=900"])  # the user pinned the schedule
    assert lr_schedule_note(fixed, saved, 900) is None


@pytest.mark.slow
def test_raising_train_iters_continues_the_finished_run_and_convert_finds_it(tmp_path):
    every = ("--set", "training.log_interval=1")  # a metrics record per iteration
    first = invoke("train", "--recipe", "smoke", "--set", f"train_iters={N}", *every, "--workdir", str(tmp_path))
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    run = workflow.run_dir(load_recipe("smoke", [f"train_iters={N}"]), tmp_path)
    assert read_tracker(run / "checkpoints") == N

    extended = invoke("train", "--recipe", "smoke", "--set", f"train_iters={2 * N}", *every, "--workdir", str(tmp_path))
    out = extended.stdout + extended.stderr
    assert extended.returncode == 0, out[-3000:]
    assert f"run directory: {run}" in out and f"at iteration {N} " in out
    assert (
        f"lr_decay_iters follows train_iters: {N} -> {2 * N}; the learning rate now decays to min_lr at {2 * N}" in out
    )
    assert "train_iters changed: the data indices are sized for the new length" in out  # the data order, said
    assert list((run.parent).iterdir()) == [run]  # no second run directory
    assert read_tracker(run / "checkpoints") == 2 * N
    trained = [m["iteration"] for m in read_metrics(run) if m["type"] == "train"]
    assert trained == list(range(1, 2 * N + 1))  # 1..2N once: resumed, not restarted
    assert json.loads((run / "summary.json").read_text())["iteration"] == 2 * N

    lowered = invoke("train", "--recipe", "smoke", "--set", f"train_iters={N}", "--workdir", str(tmp_path))
    assert (
        lowered.returncode == 2 and f"has trained {2 * N} iterations, past training.train_iters {N}" in lowered.stderr
    ), lowered.stderr[-1500:]
    assert read_tracker(run / "checkpoints") == 2 * N  # refused before any work

    converted = invoke("convert", "--recipe", "smoke", "--workdir", str(tmp_path))  # no --set: the same run
    assert converted.returncode == 0, converted.stdout[-2000:] + converted.stderr[-2000:]
    assert converted_iteration(run / "hf") == 2 * N  # the extended run's last checkpoint


def test_convert_without_a_trained_run_names_load_not_save(tmp_path):
    proc = invoke("convert", "--recipe", "smoke", "--workdir", str(tmp_path))
    assert proc.returncode == 2, proc.stdout[-1500:] + proc.stderr[-1500:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: recipe smoke has no trained run in ") and "--load CKPT_DIR" in line
    assert "--save" not in line


def test_a_missing_load_names_load(tmp_path):
    from megatron_core.convert.shards import read_checkpoint
    from megatron_core.errors import UserError

    with pytest.raises(UserError, match="give --load a run's checkpoints"):
        read_checkpoint(tmp_path / "no-such-dir")
