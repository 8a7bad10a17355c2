"""The all-reductions the vocab-parallel cross entropy needs, shared by its torch backend
(fusions/cross_entropy.py) and its Triton backend (triton_kernels/cross_entropy.py). It sits below both, so
the kernels never import the dispatching module above them."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _group_size(group) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def all_reduce_max(tensor: torch.Tensor, group) -> torch.Tensor:
    """In-place MAX all-reduce over `group` (no-op for a single process); returns `tensor`."""
    if _group_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


def all_reduce_sum(tensor: torch.Tensor, group) -> torch.Tensor:
    """In-place SUM all-reduce over `group` (no-op for a single process); returns `tensor`."""
    if _group_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor
