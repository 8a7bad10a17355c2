"""Batches in Megatron's order, resumable from a sample count.

Megatron's pretraining sampler: the dataset is already shuffled (GPT indices), so samples are
taken in index order; each global step of `micro_batch_size x dp` samples is split by DP rank.
Starting at `consumed_samples` is all a resume needs to continue exactly where it stopped.
"""

from __future__ import annotations

from typing import Iterator

import torch


def batch_iterator(dataset, *, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                   device: torch.device, wrap: bool = False) -> Iterator[dict]:
    """Micro batches (dicts of [micro_batch_size, ...] tensors on `device`). With wrap=True the index
    runs round the dataset (validation, whose size Megatron sizes for every evaluation anyway)."""
    step = micro_batch_size * dp_size
    start = consumed_samples
    size = len(dataset)
    while True:
        if not wrap and start + step > size:
            return
        indices = [(start + dp_rank * micro_batch_size + i) % size for i in range(micro_batch_size)]
        items = [dataset[i] for i in indices]
        yield {key: torch.stack([item[key] for item in items]).to(device) for key in items[0]}
        start += step
