"""The conjugate communication pairs of tensor parallelism, as autograd functions.

Each function's backward is the conjugate of its forward (identity <-> all-reduce,
split <-> all-gather, reduce-scatter <-> all-gather). TP regions split the LAST dimension
(hidden); sequence-parallel regions split the FIRST dimension (sequence, layout [s, b, h]).
With a TP world of 1 (or no process group) every function is the identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_core import parallel_state


def _tp_world() -> int:
    return parallel_state.get_tensor_model_parallel_world_size()


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _tp_world() == 1:
        return x
    x = x.clone(memory_format=torch.contiguous_format)  # never sum into a tensor autograd may share
    dist.all_reduce(x, group=parallel_state.get_tensor_model_parallel_group())
    return x


def _split(x: torch.Tensor, dim: int) -> torch.Tensor:
    world = _tp_world()
    if world == 1:
        return x
    if x.size(dim) % world:
        raise ValueError(f"cannot split dim {dim} of size {x.size(dim)} across {world} tensor-parallel ranks")
    return x.chunk(world, dim=dim)[parallel_state.get_tensor_model_parallel_rank()].contiguous()


def _gather(x: torch.Tensor, dim: int) -> torch.Tensor:
    world = _tp_world()
    if world == 1:
        return x
    # all_gather_into_tensor concatenates along dim 0; move `dim` there and back.
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((world * moved.size(0),) + moved.shape[1:])
    dist.all_gather_into_tensor(out, moved, group=parallel_state.get_tensor_model_parallel_group())
    return out.movedim(0, dim).contiguous()


def _reduce_scatter_first_dim(x: torch.Tensor) -> torch.Tensor:
    world = _tp_world()
    if world == 1:
        return x
    if x.size(0) % world:
        raise ValueError(f"cannot reduce-scatter dim 0 of size {x.size(0)} across {world} tensor-parallel ranks")
    x = x.contiguous()
    out = x.new_empty((x.size(0) // world,) + x.shape[1:])
    dist.reduce_scatter_tensor(out, x, group=parallel_state.get_tensor_model_parallel_group())
    return out


class _CopyToTensorModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(_ctx, x):
        return x

    @staticmethod
    def backward(_ctx, grad):
        return _all_reduce(grad)


class _ReduceFromTensorModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(_ctx, x):
        return _all_reduce(x)

    @staticmethod
    def backward(_ctx, grad):
        return grad


class _ScatterToTensorModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(_ctx, x):
        return _split(x, -1)

    @staticmethod
    def backward(_ctx, grad):
        return _gather(grad, -1)


class _GatherFromTensorModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(_ctx, x):
        return _gather(x, -1)

    @staticmethod
    def backward(_ctx, grad):
        return _split(grad, -1)


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(_ctx, x):
        return _split(x, 0)

    @staticmethod
    def backward(_ctx, grad):
        return _gather(grad, 0)


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tensor_parallel_output_grad):
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return _gather(x, 0)

    @staticmethod
    def backward(ctx, grad):
        # The consumer is TP-parallel (a column-parallel linear): each rank holds a partial
        # gradient of the full sequence, so sum them while splitting. Otherwise just split.
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_first_dim(grad), None
        return _split(grad, 0), None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(_ctx, x):
        return _reduce_scatter_first_dim(x)

    @staticmethod
    def backward(_ctx, grad):
        return _gather(grad, 0)


def copy_to_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Forward identity, backward all-reduce (Megatron's f)."""
    return _CopyToTensorModelParallelRegion.apply(x)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Forward all-reduce, backward identity (Megatron's g)."""
    return _ReduceFromTensorModelParallelRegion.apply(x)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Forward keep this rank's chunk of the last dim, backward all-gather it."""
    return _ScatterToTensorModelParallelRegion.apply(x)


def gather_from_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Forward all-gather along the last dim, backward keep this rank's chunk."""
    return _GatherFromTensorModelParallelRegion.apply(x)


def scatter_to_sequence_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Forward keep this rank's chunk of dim 0 (sequence), backward all-gather it."""
    return _ScatterToSequenceParallelRegion.apply(x)


def gather_from_sequence_parallel_region(x: torch.Tensor, tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """Forward all-gather along dim 0; backward reduce-scatter (or split when the consumer is replicated)."""
    return _GatherFromSequenceParallelRegion.apply(x, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Forward reduce-scatter along dim 0, backward all-gather."""
    return _ReduceScatterToSequenceParallelRegion.apply(x)
