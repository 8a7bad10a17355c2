"""Megatron's indexed dataset: token sequences in a `.bin`, their layout in an `.idx`.

Two on-disk index formats (byte layouts in docs/data-format.md):

- `mmap` (magic `MMIDIDX`): what Megatron-LM and megatron-core write today; both files are
  memory-mapped by the reader.
- `lazy` / `cached` (magic `TNTIDX`): the legacy index of Megatron-LM before core. `lazy` reads
  each item from the file when asked for it; `cached` reads the whole `.bin` into memory once.

Writers put everything under temporary names and rename only in `finalize`, `.bin` first and
`.idx` last, so an interrupted run never leaves an index that looks valid.
"""

from __future__ import annotations

import os
import struct
from array import array
from typing import Optional, Sequence, Union

import numpy as np

from megatron_core.errors import UserError
from megatron_core.files import publish_file

MMAP_MAGIC = b"MMIDIDX\x00\x00"
LEGACY_MAGIC = b"TNTIDX\x00\x00"
INDEX_VERSION = 1
IMPLS = ("mmap", "cached", "lazy")

# Megatron's dtype codes; the same numbers in both index formats.
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_CODE_OF_DTYPE = {dtype: code for code, dtype in DTYPE_CODES.items()}

PathLike = Union[str, os.PathLike]


def dtype_code(dtype) -> int:
    dtype = np.dtype(dtype)
    if dtype not in _CODE_OF_DTYPE:
        raise UserError(f"dtype {dtype} has no Megatron dtype code; use one of {sorted(map(str, _CODE_OF_DTYPE))}")
    return _CODE_OF_DTYPE[dtype]


def best_token_dtype(vocab_size: Optional[int]) -> np.dtype:
    """Megatron's rule: uint16 while every id fits with room to spare, else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def idx_path(prefix: PathLike) -> str:
    return f"{os.fspath(prefix)}.idx"


def bin_path(prefix: PathLike) -> str:
    return f"{os.fspath(prefix)}.bin"


def _temp_name(path: str) -> str:
    return f"{path}.tmp-{os.getpid()}"


# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------


class IndexedDatasetBuilder:
    """Appends sequences to a `.bin` and writes the `.idx` on `finalize`.

    impl "mmap" writes an MMIDIDX index, "lazy" and "cached" the legacy TNTIDX one (the `.bin`
    is the same for all three). Use as a context manager, or call `abort()` on failure, to
    remove the temporary files of an unfinished build.
    """

    def __init__(self, bin_path: PathLike, dtype=np.int32, impl: str = "mmap") -> None:
        if impl not in IMPLS:
            raise UserError(f"unknown dataset impl {impl!r}; use one of {', '.join(IMPLS)}")
        self.bin_path = os.fspath(bin_path)
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)  # refuse dtypes the index cannot name, before writing anything
        self.impl = impl
        self._bin_tmp = _temp_name(self.bin_path)
        self._idx_tmp: Optional[str] = None
        self._data = open(self._bin_tmp, "wb")
        # Compact arrays, not lists of Python ints: a big corpus has millions of sequences.
        self._lengths = array("q")
        self._document_indices = array("q", [0])
        self._finalized = False

    # -- adding -----------------------------------------------------------------------------

    def add_item(self, tokens: Union[Sequence[int], np.ndarray]) -> None:
        """Append one sequence (it joins the current document)."""
        arr = np.asarray(tokens, dtype=self.dtype)
        if arr.ndim != 1:
            raise ValueError(f"a sequence is one-dimensional, got shape {arr.shape}")
        self._data.write(arr.tobytes(order="C"))
        self._lengths.append(arr.size)

    def end_document(self) -> None:
        """Close the current document (a document may hold zero sequences)."""
        self._document_indices.append(len(self._lengths))

    def add_document(self, tokens: np.ndarray, lengths: Sequence[int]) -> None:
        """Append one whole document given as its concatenated tokens and sequence lengths (Megatron's
        add_document; one write per document)."""
        arr = np.asarray(tokens, dtype=self.dtype)
        if arr.size != sum(lengths):
            raise ValueError(f"{arr.size} tokens do not match sequence lengths summing to {sum(lengths)}")
        self._data.write(arr.tobytes(order="C"))
        self._lengths.extend(lengths)
        self.end_document()

    # -- finishing --------------------------------------------------------------------------

    @property
    def num_sequences(self) -> int:
        return len(self._lengths)

    @property
    def num_documents(self) -> int:
        return len(self._document_indices) - 1

    def finalize(self, idx_path: PathLike) -> None:
        """Write the index, then move `.bin` and `.idx` to their final names (index last)."""
        idx_path = os.fspath(idx_path)
        self._data.close()
        self._idx_tmp = _temp_name(idx_path)
        lengths = np.frombuffer(self._lengths, dtype=np.int64) if self._lengths else np.zeros(0, np.int64)
        documents = np.frombuffer(self._document_indices, dtype=np.int64)
        with open(self._idx_tmp, "wb") as f:
            if self.impl == "mmap":
                _write_mmap_index(f, self.dtype, lengths, documents)
            else:
                _write_legacy_index(f, self.dtype, lengths, documents)
        if os.path.exists(idx_path):
            os.remove(idx_path)  # an older .idx must never sit beside the new .bin, even for a moment
        publish_file(self._bin_tmp, self.bin_path)
        publish_file(self._idx_tmp, idx_path)
        self._finalized = True

    def abort(self) -> None:
        """Remove the temporary files of an unfinished build."""
        if not self._data.closed:
            self._data.close()
        for path in (self._bin_tmp, self._idx_tmp):
            if path is not None and os.path.exists(path):
                os.remove(path)

    def __enter__(self) -> "IndexedDatasetBuilder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None or not self._finalized:
            self.abort()


def _write_mmap_index(f, dtype: np.dtype, lengths: np.ndarray, documents: np.ndarray) -> None:
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1] * dtype.itemsize, out=pointers[1:])
    f.write(MMAP_MAGIC)
    f.write(struct.pack("<Q", INDEX_VERSION))
    f.write(struct.pack("<B", dtype_code(dtype)))
    f.write(struct.pack("<Q", len(lengths)))
    f.write(struct.pack("<Q", len(documents)))
    f.write(lengths.astype("<i4").tobytes())
    f.write(pointers.astype("<i8").tobytes())
    f.write(documents.astype("<i8").tobytes())


def _write_legacy_index(f, dtype: np.dtype, lengths: np.ndarray, documents: np.ndarray) -> None:
    n = len(lengths)
    # One-dimensional items: item i owns dimension i, and its data starts at the running sum
    # of lengths (counted in elements, not bytes, in this format).
    dim_offsets = np.arange(n + 1, dtype=np.int64)
    data_offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=data_offsets[1:])
    f.write(LEGACY_MAGIC)
    f.write(struct.pack("<Q", INDEX_VERSION))
    f.write(struct.pack("<QQ", dtype_code(dtype), dtype.itemsize))
    f.write(struct.pack("<QQ", n, n))
    f.write(struct.pack("<Q", len(documents)))
    f.write(dim_offsets.astype("<i8").tobytes())
    f.write(data_offsets.astype("<i8").tobytes())
    f.write(lengths.astype("<i8").tobytes())
    f.write(documents.astype("<i8").tobytes())


# ----------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------


def infer_impl(prefix: PathLike) -> str:
    """'mmap' or 'lazy' from the magic at the start of the `.idx`."""
    path = idx_path(prefix)
    if not os.path.exists(path) or not os.path.exists(bin_path(prefix)):
        raise UserError(
            f"no indexed dataset at {os.fspath(prefix)} (need {path} and {bin_path(prefix)}); "
            "check the data path, it is the prefix without .bin/.idx"
        )
    with open(path, "rb") as f:
        head = f.read(9)
    if head == MMAP_MAGIC:
        return "mmap"
    if head[:8] == LEGACY_MAGIC:
        return "lazy"
    raise UserError(f"{path} is not a Megatron index (unknown magic {head[:8]!r}); rebuild it with preprocess")


class _Index:
    """The parsed `.idx`: dtype, sequence lengths/pointers (bytes), document indices."""

    dtype: np.dtype
    sequence_lengths: np.ndarray
    sequence_pointers: np.ndarray
    document_indices: np.ndarray


def _read_mmap_index(path: str) -> _Index:
    index = _Index()
    if os.path.getsize(path) < 34:
        raise UserError(f"{path} is truncated (shorter than the MMIDIDX header); rebuild it with preprocess")
    buffer = np.memmap(path, dtype=np.uint8, mode="r")
    header = bytes(buffer[:34])
    if header[:9] != MMAP_MAGIC:
        raise UserError(f"{path} is truncated or not an MMIDIDX index; rebuild it with preprocess")
    (version,) = struct.unpack("<Q", header[9:17])
    if version != INDEX_VERSION:
        raise UserError(f"{path} has index version {version}; only version {INDEX_VERSION} is known")
    index.dtype = _dtype_of_code(header[17], path)
    num_sequences, num_documents = struct.unpack("<QQ", header[18:34])
    expected = 34 + 12 * num_sequences + 8 * num_documents
    if len(buffer) < expected:
        raise UserError(f"{path} is truncated ({len(buffer)} bytes, the header promises {expected})")
    offset = 34
    index.sequence_lengths = np.frombuffer(buffer, dtype="<i4", count=num_sequences, offset=offset)
    offset += 4 * num_sequences
    index.sequence_pointers = np.frombuffer(buffer, dtype="<i8", count=num_sequences, offset=offset)
    offset += 8 * num_sequences
    index.document_indices = np.frombuffer(buffer, dtype="<i8", count=num_documents, offset=offset)
    return index


def _read_legacy_index(path: str) -> _Index:
    index = _Index()
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 56 or raw[:8] != LEGACY_MAGIC:
        raise UserError(f"{path} is truncated or not a TNTIDX index; rebuild it with preprocess")
    version, code, element_size, n, s, num_documents = struct.unpack("<6Q", raw[8:56])
    if version != INDEX_VERSION:
        raise UserError(f"{path} has index version {version}; only version {INDEX_VERSION} is known")
    index.dtype = _dtype_of_code(code, path)
    if element_size != index.dtype.itemsize:
        raise UserError(f"{path}: element size {element_size} does not match dtype {index.dtype}")
    expected = 56 + 8 * (2 * (n + 1) + s + num_documents)
    if len(raw) < expected:
        raise UserError(f"{path} is truncated ({len(raw)} bytes, the header promises {expected})")
    arrays = np.frombuffer(raw, dtype="<i8", offset=56, count=2 * (n + 1) + s + num_documents)
    dim_offsets = arrays[: n + 1]
    data_offsets = arrays[n + 1 : 2 * (n + 1)]
    sizes = arrays[2 * (n + 1) : 2 * (n + 1) + s]
    if not np.array_equal(np.diff(dim_offsets), np.ones(n, dtype=np.int64)):
        raise UserError(f"{path} holds multi-dimensional items; only token sequences (1-D) are supported")
    index.sequence_lengths = sizes.astype(np.int32)
    index.sequence_pointers = data_offsets[:-1] * element_size
    index.document_indices = arrays[2 * (n + 1) + s :].copy()
    return index


def check_index(index: _Index, prefix: str, bin_size: int) -> None:
    """Refuse, at open, an index that does not describe its `.bin` (vectorised: fast on big corpora):
    non-negative lengths, pointers that tile the `.bin` in order, document boundaries that rise from 0
    to the number of sequences, and a `.bin` exactly as long as the index says."""
    lengths, pointers = index.sequence_lengths.astype(np.int64), index.sequence_pointers
    documents, itemsize = index.document_indices, index.dtype.itemsize
    fix = "re-run `invoke preprocess` (or the preprocessing that wrote it)"
    where = idx_path(prefix)
    if len(lengths) and lengths.min() < 0:
        raise UserError(f"{where} is damaged: sequence {int(np.argmax(lengths < 0))} has a negative length; {fix}")
    expected = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1] * itemsize, out=expected[1:])
    wrong = np.flatnonzero(pointers != expected)
    if len(wrong):
        i = int(wrong[0])
        raise UserError(
            f"{where} is damaged: sequence {i} points at byte {int(pointers[i])}, its position in the "
            f".bin is byte {int(expected[i])}; {fix}"
        )
    if (
        len(documents) == 0
        or documents[0] != 0
        or documents[-1] != len(lengths)
        or (len(documents) > 1 and np.diff(documents).min() < 0)
    ):
        raise UserError(
            f"{where} is damaged: its document boundaries do not rise from 0 to its {len(lengths)} sequences; {fix}"
        )
    needed = int(lengths.sum()) * itemsize
    if bin_size != needed:
        what = "truncated" if bin_size < needed else "longer than its index says"
        raise UserError(f"{bin_path(prefix)} is {what} ({bin_size} bytes, {where} describes {needed}); {fix}")


def _dtype_of_code(code: int, path: str) -> np.dtype:
    if code not in DTYPE_CODES:
        raise UserError(f"{path} has unknown dtype code {code}; it was not written by Megatron")
    return DTYPE_CODES[code]


class IndexedDataset:
    """Reads a `.bin/.idx` pair of any impl; item i is sequence i as a numpy array.

    `impl="infer"` looks at the index's magic: MMIDIDX opens as "mmap", TNTIDX as "lazy"
    (ask for "cached" explicitly to hold the whole `.bin` in memory).
    """

    def __init__(self, path_prefix: PathLike, impl: str = "infer") -> None:
        self.path_prefix = os.fspath(path_prefix)
        self._open(impl)

    def _open(self, impl: str) -> None:
        found = infer_impl(self.path_prefix)
        if impl == "infer":
            impl = found
        elif impl not in IMPLS:
            raise UserError(f"unknown dataset impl {impl!r}; use one of infer, {', '.join(IMPLS)}")
        elif (impl == "mmap") != (found == "mmap"):
            wanted = "MMIDIDX" if impl == "mmap" else "TNTIDX"
            raise UserError(
                f"{idx_path(self.path_prefix)} is not a {wanted} index as dataset impl {impl!r} needs; use impl 'infer'"
            )
        self.impl = impl
        path = idx_path(self.path_prefix)
        self._index = _read_mmap_index(path) if impl == "mmap" else _read_legacy_index(path)
        check_index(self._index, self.path_prefix, os.path.getsize(bin_path(self.path_prefix)))
        self._file = None
        self._bin: Optional[np.ndarray] = None
        if impl == "lazy":
            self._file = open(bin_path(self.path_prefix), "rb")
        elif os.path.getsize(bin_path(self.path_prefix)) == 0:
            self._bin = np.zeros(0, dtype=np.uint8)  # numpy cannot map an empty file
        elif impl == "mmap":
            self._bin = np.memmap(bin_path(self.path_prefix), dtype=np.uint8, mode="r")
        else:  # cached
            self._bin = np.fromfile(bin_path(self.path_prefix), dtype=np.uint8)

    # -- metadata ---------------------------------------------------------------------------

    @property
    def dtype(self) -> np.dtype:
        return self._index.dtype

    @property
    def sequence_lengths(self) -> np.ndarray:
        return self._index.sequence_lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        return self._index.sequence_pointers

    @property
    def document_indices(self) -> np.ndarray:
        return self._index.document_indices

    def __len__(self) -> int:
        return len(self._index.sequence_lengths)

    # -- data -------------------------------------------------------------------------------

    def _read(self, byte_offset: int, count: int) -> np.ndarray:
        if self._file is not None:
            self._file.seek(byte_offset)
            data = self._file.read(count * self.dtype.itemsize)
            return np.frombuffer(data, dtype=self.dtype, count=count)
        return np.frombuffer(self._bin, dtype=self.dtype, count=count, offset=byte_offset)

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence idx (to its end without length)."""
        idx = self._check_index(idx)
        size = int(self._index.sequence_lengths[idx])
        if not 0 <= offset <= size:
            raise IndexError(f"offset {offset} outside sequence {idx} of length {size}")
        if length is None:
            length = size - offset
        if length < 0 or offset + length > size:
            raise IndexError(f"offset {offset} + length {length} outside sequence {idx} of length {size}")
        pointer = int(self._index.sequence_pointers[idx]) + offset * self.dtype.itemsize
        return self._read(pointer, length)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            return [self.get(i) for i in range(start, stop, step)]
        return self.get(idx)

    def _check_index(self, idx) -> int:
        n = len(self)
        idx = int(idx)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(f"sequence index {idx} out of range for a dataset of {n} sequences")
        return idx

    # -- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._bin = None

    @staticmethod
    def exists(path_prefix: PathLike) -> bool:
        return os.path.exists(idx_path(path_prefix)) and os.path.exists(bin_path(path_prefix))

    # Pickle by path (DataLoader workers, spawn): re-open instead of copying mapped memory.
    def __getstate__(self):
        return {"path_prefix": self.path_prefix, "impl": self.impl}

    def __setstate__(self, state) -> None:
        self.path_prefix = state["path_prefix"]
        self._open(state["impl"])
