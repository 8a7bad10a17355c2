"""The .bin/.idx writer and reader: byte layouts, megatron-core conformance, atomicity."""

import os
import struct
import warnings

import numpy as np
import pytest

from megatron_core.data.indexed_dataset import (
    DTYPE_CODES,
    IndexedDataset,
    IndexedDatasetBuilder,
    best_token_dtype,
)
from megatron_core.errors import UserError

# Documents of sequences, with an empty document and an empty sequence among them.
DOCUMENTS = [
    [[5, 6, 7], [8]],
    [],
    [[1, 2, 3, 4, 65000]],
    [[], [9, 9]],
    [[42]],
]


def _build(prefix, documents=DOCUMENTS, dtype=np.uint16, impl="mmap"):
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype, impl=impl)
    for doc in documents:  # a document: its sequences
        builder.add_document([token for sequence in doc for token in sequence], [len(s) for s in doc])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def _flat(documents):
    return [seq for doc in documents for seq in doc]


def _document_indices(documents):
    out = [0]
    for doc in documents:
        out.append(out[-1] + len(doc))
    return out


def _megatron_core():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import indexed_dataset as mc
    return mc


def test_dtype_codes_and_token_dtype_rule():
    assert DTYPE_CODES[1] == np.uint8 and DTYPE_CODES[4] == np.int32 and DTYPE_CODES[8] == np.uint16
    assert DTYPE_CODES[6] == np.float64 and DTYPE_CODES[7] == np.float32
    assert best_token_dtype(50257) == np.uint16
    assert best_token_dtype(65499) == np.uint16
    assert best_token_dtype(65500) == np.int32
    assert best_token_dtype(None) == np.int32


def test_mmap_index_byte_layout(tmp_path):
    prefix = _build(tmp_path / "d")
    raw = open(f"{prefix}.idx", "rb").read()
    seqs = _flat(DOCUMENTS)
    s, d = len(seqs), len(DOCUMENTS) + 1
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<QBQQ", raw[9:34]) == (1, 8, s, d)
    lengths = np.frombuffer(raw, "<i4", s, 34)
    pointers = np.frombuffer(raw, "<i8", s, 34 + 4 * s)
    docs = np.frombuffer(raw, "<i8", d, 34 + 12 * s)
    assert lengths.tolist() == [len(x) for x in seqs]
    assert pointers.tolist() == np.concatenate([[0], np.cumsum(lengths[:-1]) * 2]).tolist()
    assert docs.tolist() == _document_indices(DOCUMENTS)
    assert len(raw) == 34 + 12 * s + 8 * d
    data = np.fromfile(f"{prefix}.bin", dtype="<u2")
    assert data.tolist() == [t for x in seqs for t in x]


@pytest.mark.parametrize("impl", ["lazy", "cached"])
def test_legacy_index_byte_layout(tmp_path, impl):
    prefix = _build(tmp_path / "d", dtype=np.int32, impl=impl)
    raw = open(f"{prefix}.idx", "rb").read()
    seqs = _flat(DOCUMENTS)
    n, docs = len(seqs), len(DOCUMENTS) + 1
    assert raw[:8] == b"TNTIDX\x00\x00"
    assert struct.unpack("<6Q", raw[8:56]) == (1, 4, 4, n, n, docs)
    longs = np.frombuffer(raw, "<i8", offset=56)
    assert len(longs) == 2 * (n + 1) + n + docs
    assert longs[: n + 1].tolist() == list(range(n + 1))  # dim offsets
    lengths = [len(x) for x in seqs]
    assert longs[n + 1 : 2 * n + 2].tolist() == np.concatenate([[0], np.cumsum(lengths)]).tolist()  # elements
    assert longs[2 * n + 2 : 3 * n + 2].tolist() == lengths
    assert longs[3 * n + 2 :].tolist() == _document_indices(DOCUMENTS)
    assert np.fromfile(f"{prefix}.bin", dtype="<i4").tolist() == [t for x in seqs for t in x]


@pytest.mark.parametrize("impl", ["mmap", "lazy", "cached"])
def test_reader_roundtrip_every_impl(tmp_path, impl):
    prefix = _build(tmp_path / "d", impl=impl)
    ds = IndexedDataset(prefix, impl="infer" if impl != "cached" else "cached")
    seqs = _flat(DOCUMENTS)
    assert len(ds) == len(seqs)
    assert ds.dtype == np.uint16
    assert [ds[i].tolist() for i in range(len(ds))] == seqs
    assert [x.tolist() for x in ds[1:3]] == seqs[1:3]
    assert ds[-1].tolist() == seqs[-1]
    assert ds.get(2, offset=1, length=3).tolist() == [2, 3, 4]
    assert ds.get(2, offset=3).tolist() == [4, 65000]
    assert ds.sequence_lengths.dtype == np.int32
    assert ds.document_indices.dtype == np.int64
    assert ds.document_indices.tolist() == _document_indices(DOCUMENTS)
    assert ds.sequence_pointers.tolist() == (np.concatenate([[0], np.cumsum(ds.sequence_lengths[:-1])]) * 2).tolist()
    with pytest.raises(IndexError):
        ds[len(ds)]
    with pytest.raises(IndexError):
        ds.get(0, offset=2, length=5)


def test_infer_reads_legacy_as_lazy_and_refuses_wrong_impl(tmp_path):
    legacy = _build(tmp_path / "legacy", impl="lazy")
    modern = _build(tmp_path / "modern")
    assert IndexedDataset(legacy).impl == "lazy"
    assert IndexedDataset(modern).impl == "mmap"
    with pytest.raises(UserError, match="MMIDIDX"):
        IndexedDataset(legacy, impl="mmap")
    with pytest.raises(UserError, match="TNTIDX"):
        IndexedDataset(modern, impl="lazy")


def test_pickles_by_path(tmp_path):
    import pickle

    ds = IndexedDataset(_build(tmp_path / "d"))
    clone = pickle.loads(pickle.dumps(ds))
    assert len(pickle.dumps(ds)) < 200
    assert [clone[i].tolist() for i in range(len(clone))] == _flat(DOCUMENTS)


def test_megatron_core_reads_our_mmap_output(tmp_path):
    mc = _megatron_core()
    rng = np.random.default_rng(0)
    documents = [
        [rng.integers(0, 50000, rng.integers(0, 40)).tolist() for _ in range(rng.integers(0, 4))] for _ in range(50)
    ]
    prefix = _build(tmp_path / "ours", documents)
    theirs = mc.IndexedDataset(prefix)
    seqs = _flat(documents)
    assert len(theirs) == len(seqs)
    assert [theirs[i].tolist() for i in range(len(theirs))] == seqs
    assert theirs.document_indices.tolist() == _document_indices(documents)
    assert theirs.sequence_lengths.tolist() == [len(x) for x in seqs]
    assert theirs.index.dtype == np.uint16


def test_we_read_what_megatron_core_writes(tmp_path):
    import torch

    mc = _megatron_core()
    prefix = str(tmp_path / "theirs")
    builder = mc.IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for doc in DOCUMENTS:
        for seq in doc:
            builder.add_item(torch.tensor(seq, dtype=torch.int64))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    ours = IndexedDataset(prefix)
    assert ours.dtype == np.int32
    assert [ours[i].tolist() for i in range(len(ours))] == _flat(DOCUMENTS)
    assert ours.document_indices.tolist() == _document_indices(DOCUMENTS)
    # And our writer makes the very same bytes for the same content.
    _build(tmp_path / "ours", dtype=np.int32)
    for ext in ("bin", "idx"):
        assert open(f"{prefix}.{ext}", "rb").read() == open(tmp_path / f"ours.{ext}", "rb").read()


def test_unfinished_build_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedDatasetBuilder(tmp_path / "d.bin", dtype=np.uint16) as builder:
            builder.add_document([1, 2, 3], [3])
            assert not (tmp_path / "d.bin").exists()  # only a temporary name while writing
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


def test_bad_files_give_user_errors(tmp_path):
    with pytest.raises(UserError, match="no indexed dataset"):
        IndexedDataset(tmp_path / "missing")
    prefix = _build(tmp_path / "d")
    raw = open(f"{prefix}.idx", "rb").read()
    open(f"{prefix}.idx", "wb").write(raw[:-8])
    with pytest.raises(UserError, match="truncated"):
        IndexedDataset(prefix)
    open(f"{prefix}.idx", "wb").write(b"NOTANIDX" + raw[8:])
    with pytest.raises(UserError, match="not a Megatron index"):
        IndexedDataset(prefix)


def test_empty_dataset(tmp_path):
    prefix = _build(tmp_path / "e", [[], []])
    ds = IndexedDataset(prefix)
    assert len(ds) == 0 and ds.document_indices.tolist() == [0, 0, 0]
    assert os.path.getsize(f"{prefix}.bin") == 0
