"""megatron_core.files: every rename that publishes something is made durable before the next step."""

import os
from pathlib import Path

import numpy as np
import pytest

from megatron_core import files
from megatron_core.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder


def _record_disk_steps(monkeypatch) -> list[tuple[str, str]]:
    """("rename", target name) and ("fsync", what the descriptor names) in the order they happen."""
    steps: list[tuple[str, str]] = []
    real_replace, real_fsync = os.replace, os.fsync

    def replace(src, dst):
        steps.append(("rename", Path(dst).name))
        return real_replace(src, dst)

    def fsync(fd):
        steps.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}")).name))
        return real_fsync(fd)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "fsync", fsync)
    return steps


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names descriptors through /proc")
def test_publish_directory_sets_the_old_one_aside_and_syncs_each_rename(tmp_path, monkeypatch):
    final, staged, aside = tmp_path / "iter", tmp_path / "iter.tmp", tmp_path / "iter.old"
    for where, text in ((final, "old"), (staged, "new"), (aside, "older")):
        where.mkdir()
        (where / "f").write_text(text)
    steps = _record_disk_steps(monkeypatch)
    files.publish_directory(staged, final, set_aside=aside)
    assert (final / "f").read_text() == "new" and (aside / "f").read_text() == "old" and not staged.exists()
    # A crash after any step leaves the old copy or the new one findable: the set-aside is on disk
    # before the new directory takes the name.
    assert steps == [("rename", "iter.old"), ("fsync", tmp_path.name), ("rename", "iter"), ("fsync", tmp_path.name)]


def test_publish_directory_without_set_aside_replaces_the_old_one(tmp_path):
    final, staged = tmp_path / "step", tmp_path / "step.tmp-1"
    for where, text in ((final, "old"), (staged, "new")):
        where.mkdir()
        (where / "f").write_text(text)
    files.publish_directory(staged, final)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step"] and (final / "f").read_text() == "new"


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names descriptors through /proc")
def test_a_finished_dataset_is_on_disk_before_its_names_appear(tmp_path, monkeypatch):
    """The builder's .bin and .idx contents are fsynced before each is renamed into place, so a machine
    that crashes right after finalize cannot leave a valid-looking index over a torn .bin."""
    builder = IndexedDatasetBuilder(tmp_path / "d.bin", dtype=np.uint16)
    builder.add_item([1, 2, 3])
    builder.end_document()
    steps = _record_disk_steps(monkeypatch)
    builder.finalize(tmp_path / "d.idx")
    bin_tmp, idx_tmp = f"d.bin.tmp-{os.getpid()}", f"d.idx.tmp-{os.getpid()}"
    assert steps == [
        ("fsync", bin_tmp),
        ("rename", "d.bin"),
        ("fsync", tmp_path.name),
        ("fsync", idx_tmp),
        ("rename", "d.idx"),
        ("fsync", tmp_path.name),
    ]
    assert IndexedDataset(tmp_path / "d")[0].tolist() == [1, 2, 3]
