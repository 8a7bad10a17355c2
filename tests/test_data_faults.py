"""Bad data found at open (issue 32): a truncated .bin, a damaged .idx, token ids beyond the vocabulary,
a damaged index cache, and staging directories of killed data steps. Each fault is injected into real
files and the error (one line, naming the file and the fix) or the repair is checked."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_core import workflow
from megatron_core.data import gpt_dataset
from megatron_core.data.gpt_dataset import GPTDatasetError, build_gpt_datasets
from megatron_core.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron_core.errors import UserError
from megatron_core.pretrain_gpt import train
from training_fixtures import VOCAB_SIZE, fixture_one_thread, tiny_recipe, write_corpus  # noqa: F401 - fixtures

HEADER = 34  # MMIDIDX: magic, version, dtype code, sequence count, document count


@pytest.fixture
def prefix(tmp_path) -> str:
    return write_corpus(tmp_path / "corpus", documents=20)


def _patch_idx(prefix: str, offset: int, fmt: str, change) -> None:
    path = Path(prefix + ".idx")
    data = bytearray(path.read_bytes())
    (value,) = struct.unpack_from(fmt, data, offset)
    struct.pack_into(fmt, data, offset, change(value))
    path.write_bytes(bytes(data))


def _open_error(prefix: str) -> str:
    with pytest.raises(UserError) as info:
        IndexedDataset(prefix)
    message = str(info.value)
    assert "\n" not in message and "invoke preprocess" in message, message
    return message


def test_truncated_bin_is_refused_at_open(prefix):
    path = Path(prefix + ".bin")
    path.write_bytes(path.read_bytes()[:-10])
    assert f"{path} is truncated" in _open_error(prefix)


def test_damaged_pointer_is_refused_at_open(prefix):
    n = len(IndexedDataset(prefix))
    _patch_idx(prefix, HEADER + 4 * n + 8 * 5, "<q", lambda v: v + 2)  # sequence 5's pointer
    assert "corpus.idx is damaged: sequence 5 points at byte" in _open_error(prefix)


def test_damaged_length_is_refused_at_open(prefix):
    _patch_idx(prefix, HEADER + 4 * 7, "<i", lambda v: v + 3)  # sequence 7's length
    assert "corpus.idx is damaged: sequence 8 points at byte" in _open_error(prefix)


def test_damaged_last_length_is_refused_by_the_bin_size(prefix):
    n = len(IndexedDataset(prefix))
    _patch_idx(prefix, HEADER + 4 * (n - 1), "<i", lambda v: v + 3)
    assert "corpus.bin is truncated" in _open_error(prefix)


def test_damaged_document_boundaries_are_refused_at_open(prefix):
    n = len(IndexedDataset(prefix))
    _patch_idx(prefix, HEADER + 12 * n + 8 * 3, "<q", lambda _v: 10**6)  # document 3's first sequence
    assert "document boundaries" in _open_error(prefix)


def test_token_id_at_or_above_the_vocabulary_stops_training_in_one_line(tmp_path):
    prefix = str(tmp_path / "wide")
    with IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16) as builder:
        for doc in range(40):
            builder.add_document(np.arange(60) % 97 + (200 if doc == 3 else 0), [60])  # padded vocab is 128
        builder.finalize(prefix + ".idx")
    with pytest.raises(GPTDatasetError) as info:
        train(
            tiny_recipe("train_iters=40", "eval_iters=0", "save_interval=null"),
            tmp_path / "run",
            prefix,
            vocab_size=VOCAB_SIZE,
        )
    message = str(info.value)
    assert "\n" not in message and f"{prefix}.bin holds token id" in message and "vocabulary size 128" in message
    assert not (tmp_path / "run" / "checkpoints" / "latest_checkpointed_iteration.txt").exists()


def test_truncated_index_cache_is_rebuilt(prefix, tmp_path, capsys, monkeypatch):
    def build():
        return build_gpt_datasets(
            prefix,
            split="100,0,0",
            seq_length=16,
            num_samples=(50, None, None),
            seed=1,
            cache_dir=str(tmp_path / "cache"),
        )[0]

    first = build()
    expected = [first.sample_tokens(i).copy() for i in range(len(first))]
    (shuffle,) = (tmp_path / "cache").glob("*-shuffle_index.npy")
    shuffle.write_bytes(shuffle.read_bytes()[:-8])
    builds, real = [], gpt_dataset.build_gpt_indices
    monkeypatch.setattr(gpt_dataset, "build_gpt_indices", lambda *args, **kw: builds.append(args) or real(*args, **kw))
    capsys.readouterr()
    again = build()
    assert len(builds) == 1  # only the damaged split's indices are built again
    assert f"{shuffle} is damaged" in capsys.readouterr().out
    assert len(again) == len(expected) and all(
        np.array_equal(again.sample_tokens(i), want) for i, want in enumerate(expected)
    )


def test_staging_of_a_killed_data_step_is_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    step = workflow.Step("corpus", tmp_path / "corpus-abc")
    stale = step.directory.with_name(f"{step.directory.name}.tmp-{dead.pid}")
    alive = step.directory.with_name(f"{step.directory.name}.tmp-1")  # init: a live process's staging
    for directory in (stale, alive):
        directory.mkdir()
        (directory / "corpus.jsonl").write_text("{}\n")
    recipe = tiny_recipe()
    workflow._build(step, recipe, lambda _tmp: {})
    assert not stale.exists() and alive.exists() and step.done
