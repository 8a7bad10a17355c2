"""Checkpoint faults (issue 32): flipped bytes, lost or damaged trackers, a crash between the steps of a
publish, pruning, an unwritable or full disk. Each fault is injected and its effect checked on disk,
in the weights and in metrics.jsonl."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from megatron_core import checkpoint_format as cf
from megatron_core.errors import UserError
from megatron_core.pretrain_gpt import train
from megatron_core.training import checkpointing as ckpt
from megatron_core.training.logging import read_metrics
from training_fixtures import VOCAB_SIZE, checkpoint_file, tiny_recipe
from training_fixtures import fixture_corpus, fixture_one_thread  # noqa: F401 - fixtures

ITERS = 12
RECIPE = (f"train_iters={ITERS}", "save_interval=4", "eval_iters=1", "eval_interval=4")


@pytest.fixture(scope="module")
def finished(tmp_path_factory, corpus):
    """A run of 12 iterations saved every 4: iter_4 is pruned (keep_last_checkpoints 2), 8 and 12 stay."""
    run_dir = tmp_path_factory.mktemp("finished")
    train(tiny_recipe(*RECIPE), run_dir, corpus, vocab_size=VOCAB_SIZE)
    return run_dir


@pytest.fixture
def run(finished, tmp_path) -> Path:
    """A private copy of the finished run to damage."""
    shutil.copytree(finished, tmp_path / "run")
    return tmp_path / "run"


def _embedding(state: dict) -> torch.Tensor:
    return state["model"]["language_model"]["embedding"]["word_embeddings"]["weight"]


def _saved_embedding(save: Path, iteration: int) -> torch.Tensor:
    return _embedding(torch.load(checkpoint_file(save, iteration), weights_only=False))


def _flip_bytes(path: Path, count: int = 16) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + count] = bytes(b ^ 0xFF for b in data[middle : middle + count])
    path.write_bytes(bytes(data))


def _iterations_in_metrics(run_dir: Path) -> list[int]:
    return [m["iteration"] for m in read_metrics(run_dir) if m["type"] == "train"]


# -- manifest and pruning -----------------------------------------------------------------------------


def test_manifest_lists_every_file_and_old_iterations_are_pruned(finished):
    save = finished / "checkpoints"
    assert sorted(p.name for p in save.glob("iter_*")) == ["iter_0000008", "iter_0000012"]
    for iteration in (8, 12):
        where = cf.iteration_dir(save, iteration)
        manifest = json.loads((where / cf.MANIFEST_FILENAME).read_text())
        files = sorted(p.relative_to(where).as_posix() for p in where.rglob("*") if p.is_file())
        assert (
            sorted(manifest["files"])
            == [f for f in files if f != cf.MANIFEST_FILENAME]
            == ["mp_rank_00/model_optim_rng.pt"]
        )
        size, crc = cf._crc32_file(where / "mp_rank_00" / "model_optim_rng.pt")
        assert manifest["files"]["mp_rank_00/model_optim_rng.pt"] == {"size": size, "crc32": f"{crc:08x}"}


@pytest.mark.parametrize("keep_last, kept", [(1, [12]), (0, [4, 8, 12]), (None, [4, 8, 12])])
def test_keep_last_checkpoints(tmp_path, keep_last, kept):
    save = tmp_path / "save"
    for iteration in (4, 8, 12):
        _write_tiny(save, iteration, keep_last=keep_last)
    assert sorted(cf.published_iterations(save)) == kept and not list(save.glob("*.pruned"))


# -- verification and fallback ------------------------------------------------------------------------


def test_flipped_bytes_fall_back_to_the_previous_iteration(run, corpus, capsys):
    save = run / "checkpoints"
    _flip_bytes(checkpoint_file(save, 12))
    lines: list[str] = []
    iteration, state = ckpt.load_latest(save, log=lines.append)
    assert iteration == 8 and torch.equal(_embedding(state), _saved_embedding(save, 8))
    assert any("iter_0000012" in line and "fails verification" in line for line in lines), lines
    assert lines[-1].startswith("falling back to") and "iter_0000008" in lines[-1]
    # The trainer resumes from 8, trains 9..12 again (metrics not duplicated) and re-saves a good 12.
    train(tiny_recipe(*RECIPE), run, corpus, vocab_size=VOCAB_SIZE)
    assert "falling back to" in capsys.readouterr().out
    assert _iterations_in_metrics(run) == list(range(1, ITERS + 1))
    assert ckpt.load_latest(save)[0] == 12


def test_no_fallback_refuses_a_checkpoint_that_fails_verification(run, corpus):
    save = run / "checkpoints"
    _flip_bytes(checkpoint_file(save, 12))
    with pytest.raises(cf.CheckpointError, match="--no-fallback") as info:
        train(tiny_recipe(*RECIPE), run, corpus, vocab_size=VOCAB_SIZE, fallback=False)
    assert "\n" not in str(info.value)
    assert cf.read_tracker(save) == 12 and _iterations_in_metrics(run) == list(range(1, ITERS + 1))


def test_a_truncated_rank_file_of_an_old_checkpoint_without_manifest_falls_back(run):
    """Checkpoints written before manifests load unverified; an unreadable one still falls back."""
    save = run / "checkpoints"
    for iteration in (8, 12):
        (cf.iteration_dir(save, iteration) / cf.MANIFEST_FILENAME).unlink()
    path = checkpoint_file(save, 12)
    path.write_bytes(path.read_bytes()[:1000])
    lines: list[str] = []
    assert ckpt.load_latest(save, log=lines.append)[0] == 8
    assert any("cannot read checkpoint" in line for line in lines), lines
    # loading without verification is said, not silent
    assert (
        lines[-1] == f"{cf.iteration_dir(save, 8)} has no manifest: its files are loaded without checksum verification"
    ), lines


def test_every_iteration_damaged_refuses_unless_from_scratch(run, corpus):
    save = run / "checkpoints"
    for iteration in (8, 12):
        _flip_bytes(checkpoint_file(save, iteration))
    with pytest.raises(cf.CheckpointError, match="none loads .*--from-scratch"):
        ckpt.load_latest(save)
    summary = train(tiny_recipe(*RECIPE), run, corpus, vocab_size=VOCAB_SIZE, from_scratch=True)
    assert summary["iteration"] == ITERS and _iterations_in_metrics(run) == list(range(1, ITERS + 1))
    assert ckpt.load_latest(save)[0] == 12


# -- tracker-free recovery ----------------------------------------------------------------------------


def test_deleted_tracker_resumes_from_the_newest_iteration(run, corpus, capsys):
    save = run / "checkpoints"
    (save / cf.TRACKER_FILENAME).unlink()
    summary = train(tiny_recipe(*RECIPE[1:], "train_iters=16"), run, corpus, vocab_size=VOCAB_SIZE)
    out = capsys.readouterr().out
    assert "no latest_checkpointed_iteration.txt" in out and "resumed from" in out and "iteration 12" in out
    assert summary["iteration"] == 16
    assert _iterations_in_metrics(run) == list(range(1, 17))  # 1..12 kept once, 13..16 new
    assert sorted(cf.published_iterations(save)) == [12, 16]


@pytest.mark.parametrize("tracker", [b"garbage\n", b"\xff\xfe\x00\x81", b"20\n"])
def test_a_bad_tracker_resumes_from_the_newest_iteration(run, tracker):
    save = run / "checkpoints"
    (save / cf.TRACKER_FILENAME).write_bytes(tracker)
    lines: list[str] = []
    iteration, state = ckpt.load_latest(save, log=lines.append)
    assert iteration == 12 and torch.equal(_embedding(state), _saved_embedding(save, 12))
    assert len(lines) == 1 and "newest complete iteration" in lines[0] and cf.TRACKER_FILENAME in lines[0], lines


def test_from_scratch_ignores_good_checkpoints_and_moves_them_aside(run, corpus):
    old = sorted(p.name for p in (run / "checkpoints").iterdir())
    summary = train(tiny_recipe(*RECIPE[1:], "train_iters=4"), run, corpus, vocab_size=VOCAB_SIZE, from_scratch=True)
    assert summary["iteration"] == 4 and _iterations_in_metrics(run) == [1, 2, 3, 4]
    # the old run's later iterations are not left beside the new ones, where a resume would pick them ...
    assert ckpt.load_latest(run / "checkpoints")[0] == 4
    assert all(int(p.name[5:]) <= 4 for p in (run / "checkpoints").glob("iter_*"))
    # ... and nothing is lost: they are all in the directory set aside
    aside = list(run.glob("checkpoints.before-from-scratch-*"))
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == old


# -- publishing without a gap -------------------------------------------------------------------------


class Killed(BaseException):
    """Stands for the process dying at this point."""


def _write_tiny(save: Path, iteration, value: float = 0.0, keep_last=None) -> None:
    """A model-only checkpoint whose one weight is filled with `value`."""
    weights = {"embedding.word_embeddings.weight": torch.full((4, 3), float(value))}
    cf.write_rank_file(
        save, iteration, 0, 0, 1, {"args": None, "iteration": iteration, "model": cf.nest_model_state(weights)}
    )
    cf.publish_iteration(save, iteration, keep_last=keep_last)


def _count_steps(monkeypatch) -> list[str]:
    """Record every rename and tree removal (the filesystem steps of a publish)."""
    steps: list[str] = []
    real_replace, real_rmtree = os.replace, shutil.rmtree

    def replace(src, dst):
        steps.append(f"replace {Path(src).name} -> {Path(dst).name}")
        return real_replace(src, dst)

    def rmtree(path, *args, **kwargs):
        steps.append(f"rmtree {Path(path).name}")
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    return steps


def _kill_at_step(monkeypatch, step: int) -> None:
    calls = [0]
    real_replace, real_rmtree = os.replace, shutil.rmtree

    def dying(real):
        def call(*args, **kwargs):
            calls[0] += 1
            if calls[0] == step:
                raise Killed
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(os, "replace", dying(real_replace))
    monkeypatch.setattr(shutil, "rmtree", dying(real_rmtree))


def _resumable(save: Path):
    """(iteration, weight value) that resume finds; its files must be complete and verified."""
    iteration, state = ckpt.load_latest(save)
    where = cf.published_iterations(save)[iteration]
    cf.check_complete(where)
    for path in where.glob("mp_rank_*/*.pt"):
        cf.verify_file(path)
    return iteration, float(_embedding(state)[0, 0])


@pytest.mark.parametrize("history", [[8], [4, 8]], ids=["only-iteration", "with-previous"])
def test_a_crash_between_any_two_publish_steps_leaves_a_complete_iteration(tmp_path, monkeypatch, history):
    """Re-saving the iteration the tracker names (a finished run started again), killed before each
    rename and removal in turn: resume always finds a complete, verified iteration (the old or the new
    copy of 8, or 4 while 8 is swapped), and the next save completes."""
    reference = tmp_path / "reference"
    for iteration in history:
        _write_tiny(reference, iteration, value=1.0)
    counted = tmp_path / "counted"
    shutil.copytree(reference, counted)
    with monkeypatch.context() as patch:
        steps = _count_steps(patch)
        _write_tiny(counted, 8, value=2.0)
    assert len(steps) >= 5, steps
    for step in range(1, len(steps) + 1):
        save = tmp_path / f"killed-{step}"
        shutil.copytree(reference, save)
        with monkeypatch.context() as patch:
            _kill_at_step(patch, step)
            with pytest.raises(Killed):
                _write_tiny(save, 8, value=2.0)
        tracker = cf.read_tracker(save)
        assert tracker is None or cf.iteration_dir(save, tracker).is_dir(), f"step {step}: the tracker names a gap"
        assert _resumable(save) in {(8, 1.0), (8, 2.0), (4, 1.0)}, f"killed at step {step} ({steps[step - 1]})"
        _write_tiny(save, 8, value=2.0)
        assert _resumable(save) == (8, 2.0) and not list(save.glob("*.old")) and not list(save.glob("*.tmp"))


# -- fail fast and a full disk -------------------------------------------------------------------------


def test_unwritable_run_directory_is_refused_before_the_first_iteration(tmp_path, corpus):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(UserError, match="cannot create the run directory"):
        train(tiny_recipe(*RECIPE), blocker / "run", corpus, vocab_size=VOCAB_SIZE)


def test_unwritable_save_directory_is_refused_before_the_first_iteration(tmp_path, corpus, monkeypatch):
    save = tmp_path / "save"
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path) != save and real_access(path, mode, **kw))
    with pytest.raises(UserError, match=f"checkpoint directory {save} is not writable"):
        train(tiny_recipe(*RECIPE), tmp_path / "run", corpus, save=save, vocab_size=VOCAB_SIZE)
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and not list(save.iterdir())


def test_too_little_free_space_is_refused_before_the_first_iteration(tmp_path, corpus, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: shutil._ntuple_diskusage(10**12, 10**12 - 1000, 1000))
    with pytest.raises(UserError, match="has 0.00 GiB free but one checkpoint needs about"):
        train(tiny_recipe(*RECIPE), tmp_path / "run", corpus, vocab_size=VOCAB_SIZE)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0"),
        OSError(errno.ENOSPC, "No space left on device"),
    ],
    ids=["torch", "oserror"],
)
def test_disk_full_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(run, monkeypatch, error):
    save = run / "checkpoints"
    good = torch.load(checkpoint_file(save, 12), weights_only=False)

    def full_disk(_obj, f, *_args, **_kwargs):
        Path(f).write_bytes(b"half a checkpoint")
        raise error

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(cf.CheckpointError, match="no space left on device") as info:
        ckpt.save_checkpoint(
            save,
            16,
            model_state=cf.flatten_model_state(good["model"]),
            args=good["args"],
            recipe=tiny_recipe(*RECIPE),
            consumed_train_samples=64,
        )
    monkeypatch.undo()
    assert "\n" not in str(info.value) and str(cf.staging_dir(save, 16)) in str(info.value)
    assert not cf.staging_dir(save, 16).exists() and not cf.iteration_dir(save, 16).exists()
    iteration, state = ckpt.load_latest(save)
    assert iteration == 12 and torch.equal(_embedding(state), _embedding(good))
