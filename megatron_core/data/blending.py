"""Weighted, deterministic blending of several GPT datasets (Megatron's `BlendedDataset`).

`--data-path w1 p1 w2 p2 ...` mixes datasets so that after i samples dataset d has contributed
about w_d * i of them. The choice is Megatron's greedy rule: for output sample i pick the
dataset with the largest `w_d * max(i, 1) - count_d` (ties to the lowest index), computed in
float64 exactly as megatron-core's C++ helper does, so both pick the same sequence.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Dict, List, Sequence, Tuple

import numpy as np
import torch

from megatron_core.errors import UserError

# Megatron builds each component a little larger than its share so the greedy picks,
# which may run one sample ahead of w_d * size, never run off its end
# (`mid_level_dataset_surplus` in megatron-core, default 0.005).
MID_LEVEL_DATASET_SURPLUS = 0.005


class BlendError(UserError):
    """A data-path blend that cannot be read."""


def parse_data_prefix(data_prefix) -> Tuple[List[str], List[float] | None]:
    """`"prefix"` or `["prefix"]` -> ([prefix], None); `[w1, p1, w2, p2, ...]` -> (prefixes, weights)."""
    if isinstance(data_prefix, (str, bytes)) or hasattr(data_prefix, "__fspath__"):
        return [str(data_prefix)], None
    items = list(data_prefix)
    if len(items) == 1:
        return [str(items[0])], None
    if not items or len(items) % 2:
        raise BlendError(
            f"data path {items!r} is neither one prefix nor weight/prefix pairs; "
            "give 'prefix' or [w1, prefix1, w2, prefix2, ...]"
        )
    weights, prefixes = [], []
    for weight, prefix in zip(items[0::2], items[1::2]):
        try:
            value = float(weight)
        except (TypeError, ValueError):
            raise BlendError(
                f"blend weight {weight!r} (before {prefix!r}) is not a number; "
                "write the blend as [w1, prefix1, w2, prefix2, ...]"
            ) from None
        if not value > 0 or not math.isfinite(value):
            raise BlendError(f"blend weight {weight!r} for {prefix!r} must be a positive number")
        weights.append(value)
        prefixes.append(str(prefix))
    return prefixes, weights


def normalize(weights: Sequence[float]) -> List[float]:
    """Weights divided by their sum, in float64 the way megatron-core does it (bit-identical)."""
    array = np.array(weights, dtype=np.float64)
    return (array / np.sum(array)).tolist()


def samples_per_component(normalized_weights: Sequence[float], size: int, surplus: float = 0.0) -> List[int]:
    """Samples each component must offer for a blend of `size`: ceil(ceil(size*w) * (1+surplus))."""
    return [int(math.ceil(math.ceil(size * w) * (1 + surplus))) for w in normalized_weights]


def build_blending_indices(weights: Sequence[float], size: int) -> Tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16, dataset_sample_index int64) of length `size`, greedy by largest error.

    This is a sequential rule (each pick changes the next), so it runs as a plain loop over
    Python floats; the arithmetic is the same float64 as Megatron's helper.
    """
    num_datasets = len(weights)
    w = [float(x) for x in weights]
    counts = [0] * num_datasets
    dataset_index = np.empty(size, dtype=np.int16)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    chosen_ids = [0] * size
    chosen_positions = [0] * size
    for i in range(size):
        t = float(max(i, 1))
        best, best_error = 0, w[0] * t - counts[0]
        for d in range(1, num_datasets):
            error = w[d] * t - counts[d]
            if error > best_error:
                best, best_error = d, error
        chosen_ids[i] = best
        chosen_positions[i] = counts[best]
        counts[best] += 1
    dataset_index[:] = chosen_ids
    dataset_sample_index[:] = chosen_positions
    return dataset_index, dataset_sample_index


class BlendedDataset(torch.utils.data.Dataset):
    """Sample i is `datasets[dataset_index[i]][dataset_sample_index[i]]`."""

    def __init__(self, datasets: Sequence, dataset_index: np.ndarray, dataset_sample_index: np.ndarray):
        self.datasets = list(datasets)
        self.dataset_index = dataset_index
        self.dataset_sample_index = dataset_sample_index

    def __len__(self) -> int:
        return int(self.dataset_index.shape[0])

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]


def check_blend_fits(datasets: Sequence, dataset_index: np.ndarray, split_name: str) -> None:
    """Each component must hold at least as many samples as the blend draws from it."""
    ids, drawn = np.unique(dataset_index, return_counts=True)
    for d, n in zip(ids.tolist(), drawn.tolist()):
        if len(datasets[d]) < n:
            raise RuntimeError(
                f"the {split_name} blend draws {n} samples from component {d}, which has only "
                f"{len(datasets[d])}; the surplus margin ({MID_LEVEL_DATASET_SURPLUS}) is too small"
            )


def timed_blending_indices(
    weights: Sequence[float], size: int, log: Callable[[str], None]
) -> Tuple[np.ndarray, np.ndarray]:
    log(f"building blending indices for {size} samples over {len(weights)} datasets")
    start = time.perf_counter()
    result = build_blending_indices(weights, size)
    log(f"blending indices built in {time.perf_counter() - start:.2f} s")
    return result
