"""GPT training samples over a `.bin/.idx` dataset, with Megatron's document, sample and shuffle indices.

The shuffle happens once, before training: three index arrays decide which tokens every
sample holds and in which order samples are read. They follow megatron-core's `GPTDataset`
exactly (same arrays, same dtypes, same random stream), so a run here reads the same samples in
the same order as a Megatron-LM run over the same files:

- document index: the split's sequence ids repeated once per epoch, shuffled (int32);
- sample index: [num_samples + 1, 2] rows (position in the document index, token offset);
  sample k is the seq_length + 1 tokens starting at row k, the last of them shared with k + 1;
- shuffle index: a permutation of the samples (uint32 unless too large).

They are built once (rank 0), saved as `.npy` under `cache_dir` with a name hashed from every
input that determines them, and memory-mapped by every rank and every later run.

Megatron builds the sample index with a compiled C++ loop; here the same loop over the documents is
compiled by numba (about 0.1 s for CodeParrot's 28.8 million samples), tested equal to megatron-core's
helper.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from megatron_core import parallel_state
from megatron_core.data import blending
from megatron_core.errors import UserError
from megatron_core.files import replace_atomically
from megatron_core.log import get_logger

_LOG = get_logger(__name__, tag="gpt_dataset")

SPLIT_NAMES = ("train", "valid", "test")

# Bump when the on-disk meaning of the cached arrays changes, so stale caches are never reused.
INDEX_FORMAT_VERSION = 1

# Megatron separates the last epoch from the global shuffle when it would supply fewer than
# this fraction of a full epoch's samples (so a short tail is not smeared over the whole run).
SEPARATE_LAST_EPOCH_THRESHOLD = 0.80


class GPTDatasetError(UserError):
    """Bad arguments for the GPT dataset (split string, sample counts, data that is too small)."""


def log(message: str) -> None:
    """Progress lines, printed once (rank 0) when torch.distributed runs."""
    if _rank() == 0:
        _LOG.info(message)


def _rank() -> int:
    return torch.distributed.get_rank() if _distributed() else 0


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


# --------------------------------------------------------------------------------------------
# Sample counts and split


def samples_per_split(
    train_iters: int, global_batch_size: int, eval_interval: int, eval_iters: int
) -> Tuple[int, int, int]:
    """Samples requested per split, as Megatron-LM's training loop asks for them."""
    n_train = train_iters * global_batch_size
    n_valid = (train_iters // eval_interval + 1) * eval_iters * global_batch_size
    n_test = eval_iters * global_batch_size
    return n_train, n_valid, n_test


def parse_split(split: str) -> List[Optional[Tuple[float, float]]]:
    """ "969,30,1" -> [(0, a), (a, a+b), (a+b, 1)] with None for an empty part (megatron-core's float math)."""
    text = str(split)
    parts = re.findall(r"[.0-9]+", text)
    if not parts or len(parts) > 3 or re.sub(r"[.0-9,/\s]", "", text):
        raise GPTDatasetError(f"split {split!r} must be up to three non-negative numbers, e.g. '969,30,1'")
    try:
        numbers = [float(p) for p in parts] + [0.0] * (3 - len(parts))
    except ValueError:
        raise GPTDatasetError(f"split {split!r}: {parts} are not all numbers; write e.g. '969,30,1'") from None
    if sum(numbers) <= 0:
        raise GPTDatasetError(f"split {split!r} sums to zero; give at least one positive part, e.g. '969,30,1'")
    fractions = blending.normalize(numbers)
    bounds = functools.reduce(lambda acc, x: acc + [acc[-1] + x], fractions, [0])
    return [(lo, hi) if hi > lo else None for lo, hi in zip(bounds[:-1], bounds[1:])]


def split_sequence_ranges(split: str, num_sequences: int) -> List[Optional[Tuple[int, int]]]:
    """Per split, the [begin, end) range of sequence ids it owns, or None for an empty part.

    Like megatron-core's GPTDataset the unit is the sequence (one per document unless the
    data was sentence-split): boundaries are int(round(fraction * num_sequences)).
    """
    return [
        None
        if part is None
        else (int(round(part[0] * float(num_sequences))), int(round(part[1] * float(num_sequences))))
        for part in parse_split(split)
    ]


# --------------------------------------------------------------------------------------------
# The three indices (pure numpy; docs/dataset-indices.md)


@dataclasses.dataclass(frozen=True)
class EpochPlan:
    tokens_per_epoch: int
    num_epochs: int
    separate_last_epoch: bool
    samples_before_last_epoch: int  # samples from the first num_epochs - 1 epochs (shuffled apart when separate)


def plan_epochs(tokens_per_epoch: int, num_samples: Optional[int], seq_length: int) -> EpochPlan:
    """Epochs needed so that num_samples samples of seq_length + 1 tokens fit, and the 80% rule."""
    if num_samples is None:
        return EpochPlan(tokens_per_epoch, 1, False, 0)
    needed = num_samples * seq_length + 1
    num_epochs = max(1, -(-needed // tokens_per_epoch))
    if num_epochs == 1:
        return EpochPlan(tokens_per_epoch, 1, False, 0)
    before_last = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    from_last = num_samples - before_last
    per_epoch = (tokens_per_epoch - 1) // seq_length
    assert 0 <= from_last <= per_epoch + 1, (from_last, per_epoch)
    separate = from_last < int(SEPARATE_LAST_EPOCH_THRESHOLD * per_epoch)
    return EpochPlan(tokens_per_epoch, num_epochs, separate, before_last)


def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_last_epoch: bool
) -> np.ndarray:
    """num_epochs copies of `documents` (int32), shuffled together; the last copy alone when separate."""
    if not separate_last_epoch or num_epochs == 1:
        document_index = np.tile(documents.astype(np.int32, copy=False), num_epochs)
        rng.shuffle(document_index)
        return document_index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


INT32_INDEX_LIMIT = np.iinfo(np.int32).max  # beyond it the sample index is int64


def build_sample_index(
    sequence_lengths: np.ndarray, document_index: np.ndarray, seq_length: int, tokens_in_index: int
) -> np.ndarray:
    """[num_samples + 1, 2] rows (position in document_index, token offset), num_samples = (tokens-1)//S.

    Row k marks flat token position k * seq_length of the documents concatenated in
    document-index order: the document holding that token and the offset inside it. Equal to
    megatron-core's `build_sample_idx` (drop the last partial sample, one extra token per sample).
    """
    if seq_length < 2:
        raise GPTDatasetError(f"seq_length {seq_length} must be at least 2")
    kernel = _compiled_sample_index_kernel()
    size = (tokens_in_index - 1) // seq_length + 1
    wide = max(document_index.shape[0], int(sequence_lengths.max()), size) > INT32_INDEX_LIMIT
    sample_index = np.empty((size, 2), dtype=np.int64 if wide else np.int32)
    written = kernel(sequence_lengths.astype(np.int64), document_index, seq_length, sample_index)
    assert written == size, (written, size)
    return sample_index


@functools.lru_cache(maxsize=None)
def _compiled_sample_index_kernel():
    """The compiled loop (numba is imported here, when first needed: it takes a while)."""
    import numba

    def fill(sequence_lengths, document_index, seq_length, out):
        # Walk the documents in document-index order; row k takes the document p that holds flat
        # token k * S (start <= k * S < end, so empty documents hold none) and the offset inside it.
        size = out.shape[0]
        k = 0
        start = 0
        for p in range(document_index.shape[0]):
            end = start + sequence_lengths[document_index[p]]
            while k < size and k * seq_length < end:
                out[k, 0] = p
                out[k, 1] = k * seq_length - start
                k += 1
            start = end
        out[0, 0] = 0  # Megatron's first row is (0, 0) even when the first documents are empty
        out[0, 1] = 0
        return k

    try:  # the machine code is cached beside this module, so later processes skip the compile
        return numba.njit(cache=True, nogil=True)(fill)
    except RuntimeError:  # a read-only installation: no cache, compiled once per process
        return numba.njit(nogil=True)(fill)


def build_shuffle_index(num_first: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """Permutation of range(total): [0, num_first) and [num_first, total) shuffled apart."""
    dtype = np.int64 if total >= np.iinfo(np.uint32).max - 1 else np.uint32
    first = np.arange(num_first, dtype=dtype)
    rng.shuffle(first)
    if num_first == total:
        return first
    last = np.arange(num_first, total, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


@dataclasses.dataclass
class GPTIndices:
    document_index: np.ndarray
    sample_index: np.ndarray
    shuffle_index: np.ndarray

    def arrays(self) -> Dict[str, np.ndarray]:
        """By name, not copied (dataclasses.asdict deep-copies arrays: half a second at this size)."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}


def build_gpt_indices(
    sequence_lengths: np.ndarray, documents: np.ndarray, seq_length: int, num_samples: Optional[int], seed: int
) -> GPTIndices:
    """The three indices for one split: documents are its sequence ids, sequence_lengths the whole dataset's."""
    tokens_per_epoch = int(np.sum(sequence_lengths[documents], dtype=np.int64))
    if tokens_per_epoch < 2:
        raise GPTDatasetError(
            f"the split has {len(documents)} documents with {tokens_per_epoch} tokens; a sample needs "
            "at least 2; use more data or give this split a larger share"
        )
    plan = plan_epochs(tokens_per_epoch, num_samples, seq_length)
    rng = np.random.RandomState(seed)

    start = time.perf_counter()
    document_index = build_document_index(documents, plan.num_epochs, rng, plan.separate_last_epoch)
    t_doc = time.perf_counter()
    sample_index = build_sample_index(sequence_lengths, document_index, seq_length, plan.num_epochs * tokens_per_epoch)
    t_sample = time.perf_counter()
    total = sample_index.shape[0] - 1
    num_first = plan.samples_before_last_epoch if plan.separate_last_epoch else total
    shuffle_index = build_shuffle_index(num_first, total, rng)
    t_shuffle = time.perf_counter()
    log(
        f"  {plan.num_epochs} epoch(s) of {tokens_per_epoch} tokens, separate last epoch: "
        f"{plan.separate_last_epoch}, {total} samples; document index {t_doc - start:.2f} s, "
        f"sample index {t_sample - t_doc:.2f} s, shuffle index {t_shuffle - t_sample:.2f} s"
    )
    return GPTIndices(document_index, sample_index, shuffle_index)


# --------------------------------------------------------------------------------------------
# Cache: .npy files under a hashed name, written atomically by rank 0, memory-mapped by all


def _file_identity(path: str) -> Dict[str, int]:
    stat = os.stat(path)
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _save_npy_atomic(path: str, array: np.ndarray) -> None:
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as handle:
            np.save(handle, array, allow_pickle=False)

    replace_atomically(Path(path), write)


class IndexCache:
    """Named arrays stored as `{cache_dir}/{hash}-{kind}-{name}.npy`, complete once `-description.json` exists."""

    def __init__(self, cache_dir: Optional[str], description: dict, kind: str, names: Sequence[str]):
        self.cache_dir = cache_dir
        self.description = description
        text = json.dumps(description, sort_keys=True)
        self.key = hashlib.sha256(text.encode()).hexdigest()[:20]
        self.base = f"{self.key}-{kind}"
        self.names = tuple(names)

    def path(self, name: str) -> str:
        return os.path.join(self.cache_dir, f"{self.base}-{name}.npy")

    @property
    def description_path(self) -> str:
        return os.path.join(self.cache_dir, f"{self.base}-description.json")

    def is_complete(self) -> bool:
        return (
            self.cache_dir is not None
            and os.path.isfile(self.description_path)
            and all(os.path.isfile(self.path(n)) for n in self.names)
        )

    def save(self, arrays: Dict[str, np.ndarray]) -> None:
        """Writes the arrays, then the description."""
        os.makedirs(self.cache_dir, exist_ok=True)
        for name in self.names:
            _save_npy_atomic(self.path(name), arrays[name])
        # The description goes last: its presence says every array before it is complete.
        text = json.dumps(self.description, indent=2, sort_keys=True)
        replace_atomically(Path(self.description_path), lambda tmp: tmp.write_text(text))

    def load(self) -> Dict[str, np.ndarray]:
        return {name: np.load(self.path(name), mmap_mode="r", allow_pickle=False) for name in self.names}

    def damage(self) -> Optional[str]:
        """Why a complete-looking cache cannot be used (a truncated or garbled .npy), or None."""
        for name in self.names:
            try:
                np.load(self.path(name), mmap_mode="r", allow_pickle=False)
            except (ValueError, OSError, EOFError) as exc:
                return f"{self.path(name)} is damaged ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
        return None

    def discard(self) -> None:
        """Forget the cache (its description first: without it the arrays are never read)."""
        for path in (self.description_path, *map(self.path, self.names)):
            if os.path.exists(path):
                os.remove(path)


def load_or_build(cache: IndexCache, build, what: str) -> Dict[str, np.ndarray]:
    """Each node's local rank 0 builds and saves what the cache lacks; after a barrier every rank
    memory-maps it. Nodes need not share a filesystem; on a shared one two nodes may build the same
    files at once: each writes under its own temporary name and renames identical bytes into place."""
    if cache.cache_dir is None:
        log(f"{what}: no cache_dir, building in memory (nothing saved)")
        return _timed_build(build, what)
    if parallel_state.is_local_rank_zero() and cache.is_complete():
        damage = cache.damage()
        if damage:
            log(f"{what}: {damage}; rebuilding the index cache")
            cache.discard()
    if parallel_state.is_local_rank_zero() and not cache.is_complete():
        arrays = _timed_build(build, what)
        cache.save(arrays)
        log(f"{what}: saved {cache.base}-*.npy in {cache.cache_dir}")
    if _distributed():
        torch.distributed.barrier()
    if not cache.is_complete():
        raise RuntimeError(
            f"{what}: index files {cache.base}-* missing in {cache.cache_dir} after this node built them"
        )
    if _rank() == 0:
        log(f"{what}: memory-mapping {cache.base}-*.npy")
    return cache.load()


def _timed_build(build, what: str) -> Dict[str, np.ndarray]:
    log(f"{what}: building indices")
    start = time.perf_counter()
    arrays = build()
    log(f"{what}: built in {time.perf_counter() - start:.2f} s")
    return arrays


# --------------------------------------------------------------------------------------------
# Datasets


class GPTDataset(torch.utils.data.Dataset):
    """Shuffled GPT samples of one split: dicts of int64 tensors, each seq_length long."""

    def __init__(
        self,
        indexed_dataset,
        indices: Dict[str, np.ndarray],
        seq_length: int,
        split_name: str,
        eod_mask_token: Optional[int] = None,
        vocab_size: Optional[int] = None,
    ):
        self.indexed_dataset = indexed_dataset
        self.vocab_size = vocab_size  # token ids at or above it are refused (they would index past the embedding)
        self.document_index = indices["document_index"]
        self.sample_index = indices["sample_index"]
        self.shuffle_index = indices["shuffle_index"]
        self.seq_length = seq_length
        self.split_name = split_name
        self.eod_mask_token = eod_mask_token
        self._position_ids = torch.arange(seq_length, dtype=torch.int64)
        self.cache_key: Optional[str] = None

    def __len__(self) -> int:
        return int(self.sample_index.shape[0]) - 1

    def sample_tokens(self, idx: int) -> np.ndarray:
        """The seq_length + 1 tokens of shuffled sample idx."""
        if not 0 <= idx < len(self):
            raise IndexError(f"{self.split_name} sample {idx} out of range [0, {len(self)})")
        sample = int(self.shuffle_index[idx])
        first_pos, first_offset = (int(x) for x in self.sample_index[sample])
        last_pos, last_offset = (int(x) for x in self.sample_index[sample + 1])
        get = self.indexed_dataset.get
        if first_pos == last_pos:
            return get(int(self.document_index[first_pos]), offset=first_offset, length=last_offset - first_offset + 1)
        parts = [get(int(self.document_index[first_pos]), offset=first_offset)]
        parts += [get(int(self.document_index[p])) for p in range(first_pos + 1, last_pos)]
        parts.append(get(int(self.document_index[last_pos]), offset=0, length=last_offset + 1))
        return np.concatenate(parts)

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        sample = self.sample_tokens(int(idx))
        if self.vocab_size is not None and sample.size and int(sample.max()) >= self.vocab_size:
            raise GPTDatasetError(
                f"{self.indexed_dataset.path_prefix}.bin holds token id {int(sample.max())} "
                f"(in {self.split_name} sample {idx}), not below the padded vocabulary size {self.vocab_size}: "
                "it was tokenized with another vocabulary; re-run `invoke preprocess` with this run's tokenizer"
            )
        text = torch.from_numpy(sample.astype(np.int64))
        tokens = text[:-1].contiguous()
        loss_mask = torch.ones(self.seq_length, dtype=torch.int64)
        if self.eod_mask_token is not None:
            loss_mask[tokens == self.eod_mask_token] = 0
        return {
            "tokens": tokens,
            "labels": text[1:].contiguous(),
            "loss_mask": loss_mask,
            "position_ids": self._position_ids.clone(),
        }


def _open_indexed_dataset(prefix: str):
    from megatron_core.data.indexed_dataset import IndexedDataset  # written beside this module

    for suffix in (".bin", ".idx"):
        if not os.path.isfile(prefix + suffix):
            raise GPTDatasetError(
                f"data file {prefix + suffix} not found; give the prefix of a preprocessed "
                ".bin/.idx pair (without the suffix)"
            )
    return IndexedDataset(prefix)


def _gpt_split_datasets(
    prefix: str,
    indexed,
    split: str,
    seq_length: int,
    sizes: Sequence[Optional[int]],
    seed: int,
    cache_dir: Optional[str],
    eod_mask_token: Optional[int],
    vocab_size: Optional[int] = None,
) -> List[Optional[GPTDataset]]:
    sequence_lengths = np.asarray(indexed.sequence_lengths)
    ranges = split_sequence_ranges(split, len(sequence_lengths))
    identity = _file_identity(prefix + ".idx")
    out: List[Optional[GPTDataset]] = []
    for name, bounds, size in zip(SPLIT_NAMES, ranges, sizes):
        if bounds is None:
            out.append(None)
            continue
        begin, end = bounds
        if end <= begin:
            raise GPTDatasetError(
                f"split {split!r} gives the {name} split 0 of {len(sequence_lengths)} documents in {prefix}; "
                "use more data or a split with a larger (or zero) share for it"
            )
        description = {
            "format": INDEX_FORMAT_VERSION,
            "class": "GPTDataset",
            "path_prefix": os.path.realpath(prefix),
            "idx_file": identity,
            "split": name,
            "begin": begin,
            "end": end,
            "seed": seed,
            "seq_length": seq_length,
            "num_samples": size,
        }
        cache = IndexCache(cache_dir, description, f"gpt-{name}", ("document_index", "sample_index", "shuffle_index"))
        documents = np.arange(begin, end, dtype=np.int32)

        def build(documents=documents, size=size):
            return build_gpt_indices(sequence_lengths, documents, seq_length, size, seed).arrays()

        indices = load_or_build(cache, build, f"{name} split of {os.path.basename(prefix)} ({size} samples)")
        dataset = GPTDataset(indexed, indices, seq_length, name, eod_mask_token, vocab_size)
        dataset.cache_key = cache.key  # names this split's indices; a blend's cache name builds on it
        out.append(dataset)
    return out


def build_gpt_datasets(
    data_prefix,
    *,
    split: str,
    seq_length: int,
    num_samples: Tuple[Optional[int], Optional[int], Optional[int]],
    seed: int,
    cache_dir: Optional[str],
    eod_mask_token: Optional[int] = None,
    vocab_size: Optional[int] = None,
) -> Tuple[Optional[torch.utils.data.Dataset], Optional[torch.utils.data.Dataset], Optional[torch.utils.data.Dataset]]:
    """(train, valid, test) datasets, None for a split whose share is zero.

    data_prefix: a `.bin/.idx` prefix, or a blend [w1, prefix1, w2, prefix2, ...]. num_samples:
    samples requested per split (None: one epoch). eod_mask_token: when given, the loss mask is
    0 where the input token is that id (Megatron's --eod-mask-loss; off by default). vocab_size:
    when given, a sample holding a token id at or above it is refused in one line naming the file.
    """
    if len(num_samples) != 3:
        raise GPTDatasetError(f"num_samples {num_samples!r} must be three counts (train, valid, test)")
    if any(n is not None and n < 0 for n in num_samples):
        raise GPTDatasetError(f"num_samples {num_samples!r} must not be negative")
    prefixes, weights = blending.parse_data_prefix(data_prefix)
    if weights is None:
        indexed = _open_indexed_dataset(prefixes[0])
        return tuple(
            _gpt_split_datasets(
                prefixes[0], indexed, split, seq_length, num_samples, seed, cache_dir, eod_mask_token, vocab_size
            )
        )
    return tuple(
        _blended_datasets(
            prefixes, weights, split, seq_length, num_samples, seed, cache_dir, eod_mask_token, vocab_size
        )
    )


def _blended_datasets(
    prefixes, weights, split, seq_length, num_samples, seed, cache_dir, eod_mask_token, vocab_size=None
):
    if any(n is None for n in num_samples):
        raise GPTDatasetError(f"a weighted blend needs a sample count for every split, got {num_samples!r}")
    normalized = blending.normalize(weights)
    targets = [blending.samples_per_component(normalized, n) for n in num_samples]
    buffers = [blending.samples_per_component(normalized, n, blending.MID_LEVEL_DATASET_SURPLUS) for n in num_samples]
    components = []  # per prefix: [train, valid, test]
    for d, prefix in enumerate(prefixes):
        indexed = _open_indexed_dataset(prefix)
        sizes = [buffers[i][d] for i in range(3)]
        components.append(
            _gpt_split_datasets(prefix, indexed, split, seq_length, sizes, seed, cache_dir, eod_mask_token, vocab_size)
        )
    blend_weights = blending.normalize(normalized)  # megatron-core normalizes again inside BlendedDataset
    out = []
    for i, name in enumerate(SPLIT_NAMES):
        parts = [c[i] for c in components]
        if parts[0] is None:
            out.append(None)
            continue
        size = sum(targets[i])
        description = {
            "format": INDEX_FORMAT_VERSION,
            "class": "BlendedDataset",
            "split": name,
            "size": size,
            "weights": blend_weights,
            "component_cache_keys": [part.cache_key for part in parts],
        }
        cache = IndexCache(cache_dir, description, f"blend-{name}", ("dataset_index", "dataset_sample_index"))

        def build(size=size):
            dataset_index, dataset_sample_index = blending.timed_blending_indices(blend_weights, size, log)
            return {"dataset_index": dataset_index, "dataset_sample_index": dataset_sample_index}

        arrays = load_or_build(cache, build, f"{name} blend of {len(prefixes)} datasets ({size} samples)")
        blending.check_blend_fits(parts, arrays["dataset_index"], name)
        out.append(blending.BlendedDataset(parts, arrays["dataset_index"], arrays["dataset_sample_index"]))
    return out
