"""Data-parallel gradient averaging in buckets, overlapped with the backward pass.

Parameters are grouped, in reverse registration order (roughly the order the backward produces
their gradients), into buckets of about `bucket_size` elements. Each bucket owns one flat buffer,
and each parameter's `main_grad` is a view of its place in it (Megatron's main_grad): the buffer
is where gradients ACCUMULATE over micro batches, in fp32 when `grad_dtype` is fp32 (Megatron's
`accumulate_allreduce_grads_in_fp32`, forced on for bf16), so many bf16 micro batches lose
nothing. A post-accumulate-grad hook copies the iteration's first `param.grad` into `main_grad`
(no fill beforehand), adds the later ones, and frees it, so no second full copy of the gradients
lives on. When every parameter of a bucket is ready during the backward of the LAST micro batch, the buffer is
divided by the data-parallel size and reduced asynchronously while the backward goes on; the micro batches before it
run under `no_sync()` and only accumulate. `zero_grad_buffer()` starts the next iteration.

Two kinds of reduction, one bucket layout:
- "all_reduce" (plain DP): after `finish_grad_sync()` every `param.main_grad` holds the DP average.
- "reduce_scatter" (the distributed optimizer, ZeRO-1): each bucket is padded to a multiple of
  the DP size and DP rank r keeps the r-th equal slice of the summed bucket (`bucket.grad_shard`).

Some gradients need a model-parallel reduction before the DP one: parameters marked
`sequence_parallel` (LayerNorms and row-parallel biases see only their sequence chunk: sum
over TP) and the tied word embeddings on the first and last pipeline stage (sum over the
embedding group). Those parameters live in "late" buckets that the hooks never launch;
`finish_grad_sync()` first does the model-parallel sums, then reduces the late buckets, so
either reduction kind sees complete gradients.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterable, Literal, Optional

import torch
import torch.distributed as dist

from megatron_core import parallel_state as ps

ReduceKind = Literal["all_reduce", "reduce_scatter"]


def _reduce_scatter(output: torch.Tensor, source: torch.Tensor, group, async_op: bool):
    return dist.reduce_scatter_tensor(output, source, group=group, async_op=async_op)


def all_gather_into(output: torch.Tensor, shard: torch.Tensor, group, async_op: bool = False):
    return dist.all_gather_into_tensor(output, shard, group=group, async_op=async_op)


def gradient(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """Where a parameter's gradient of this iteration is: its main_grad under a GradSync, else .grad."""
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


def allreduce_sequence_parallel_grads(params: Iterable[torch.nn.Parameter]) -> None:
    """Sum over TP the grads of parameters marked `sequence_parallel` (each TP rank saw 1/tp of the sequence)."""
    if ps.get_tensor_model_parallel_world_size() == 1:
        return
    grads = [g for p in params if getattr(p, "sequence_parallel", False) and (g := gradient(p)) is not None]
    _allreduce_coalesced(grads, ps.get_tensor_model_parallel_group())


def allreduce_embedding_grads(shared_params: Iterable[torch.nn.Parameter]) -> None:
    """Sum the tied word-embedding grads of the first and last pipeline stage (PP > 1)."""
    if ps.get_pipeline_model_parallel_world_size() == 1 or ps.get_embedding_group() is None:
        return
    grads = []
    for param in shared_params:
        if gradient(param) is None:
            param.grad = torch.zeros_like(param)
        grads.append(gradient(param))
    _allreduce_coalesced(grads, ps.get_embedding_group())


def _allreduce_coalesced(grads: list[torch.Tensor], group) -> None:
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()


@dataclass
class Bucket:
    """A group of parameters whose gradients accumulate and are reduced in one flat buffer."""

    params: list[torch.nn.Parameter]
    offsets: list[int]  # start of each param in the flat buffer
    numel: int  # elements used
    padded_numel: int  # buffer length (a multiple of the DP size for reduce_scatter)
    late: bool  # launched by finish_grad_sync after the model-parallel sums, never by a hook
    buffer: torch.Tensor = field(repr=False, default=None)
    grad_shard: Optional[torch.Tensor] = field(repr=False, default=None)
    ready: set = field(default_factory=set)
    handle: object = None
    launched: bool = False

    def shard_range(self, dp_rank: int, dp_size: int) -> tuple[int, int]:
        size = self.padded_numel // dp_size
        return dp_rank * size, (dp_rank + 1) * size


def build_buckets(
    params: list[torch.nn.Parameter],
    late_ids: set[int],
    bucket_size: int,
    pad_to: int,
    device: torch.device,
    grad_dtype: torch.dtype = torch.float32,
) -> list[Bucket]:
    """Ordinary parameters in reverse order cut into buckets of ~bucket_size elements, then the late ones."""
    buckets: list[Bucket] = []

    def close(group: list[torch.nn.Parameter], late: bool) -> None:
        if not group:
            return
        offsets, total = [], 0
        for param in group:
            offsets.append(total)
            total += param.numel()
        padded = -(-total // pad_to) * pad_to
        buckets.append(
            Bucket(
                params=list(group),
                offsets=offsets,
                numel=total,
                padded_numel=padded,
                late=late,
                buffer=torch.zeros(padded, dtype=grad_dtype, device=device),
            )
        )

    for late in (False, True):
        group, size = [], 0
        for param in reversed(params):
            if (id(param) in late_ids) != late:
                continue
            group.append(param)
            size += param.numel()
            if size >= bucket_size:
                close(group, late)
                group, size = [], 0
        close(group, late)
    return buckets


class GradSync:
    """Hooks, buckets and the reductions of one model replica's parameters over its DP group."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        *,
        bucket_size: int,
        reduce_kind: ReduceKind,
        sequence_parallel: bool,
        shared_embedding_params: list[torch.nn.Parameter],
        grad_dtype: Optional[torch.dtype] = None,
    ):
        self.params = [p for p in params if p.requires_grad]
        self.reduce_kind = reduce_kind
        self.group = ps.get_data_parallel_group()
        self.dp_size, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        self.sequence_parallel = sequence_parallel
        self.shared_embedding_params = list(shared_embedding_params)
        late = {id(p) for p in self.shared_embedding_params}
        if sequence_parallel:
            late |= {id(p) for p in self.params if getattr(p, "sequence_parallel", False)}
        device = self.params[0].device if self.params else torch.device("cpu")
        pad_to = self.dp_size if reduce_kind == "reduce_scatter" else 1
        # fp32 unless told otherwise (fp16 without accumulate_allreduce_grads_in_fp32: the params' dtype)
        self.grad_dtype = grad_dtype or torch.float32
        self.buckets = build_buckets(self.params, late, max(int(bucket_size), 1), pad_to, device, self.grad_dtype)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        for bucket in self.buckets:
            for param, offset in zip(bucket.params, bucket.offsets):
                param.main_grad = bucket.buffer[offset : offset + param.numel()].view_as(param)
        self.sync_enabled = True
        self.pending = False  # a backward produced gradients that are not reduced yet
        self.reduced = False  # the buffers hold a finished iteration's gradients (zeroed by the next backward)
        self._unwritten: set[int] = set()  # params whose main_grad holds nothing of this iteration yet
        for param in self.params:
            param.register_post_accumulate_grad_hook(self._on_grad_ready)

    # -- the backward side ---------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (micro batches before the last one)."""
        previous, self.sync_enabled = self.sync_enabled, False
        try:
            yield
        finally:
            self.sync_enabled = previous

    def zero_grad_buffer(self) -> None:
        """Start an iteration: every main_grad counts as zero. The first backward after a finished iteration
        does it too, so a caller that forgets cannot sum two iterations."""
        self._start_iteration()
        for param in self.params:
            param.grad = None

    def _start_iteration(self) -> None:
        # No fill: a parameter's first gradient of the iteration is copied into its main_grad, later ones
        # are added, and finish() zeroes whatever got none: zeroing the buffers and then adding the first
        # micro batch into them would be two more passes over them than this copy.
        self._unwritten = {id(p) for p in self.params}
        self.reduced = False

    def _zero_unwritten(self) -> None:
        """The main_grads no backward wrote this iteration are zero, as if the buffers had been filled."""
        for param in self.params:
            if id(param) in self._unwritten:
                param.main_grad.zero_()
        self._unwritten.clear()

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        if self.reduced:
            self._start_iteration()
        self.pending = True
        bucket = self._bucket_of[id(param)]
        if bucket.launched:
            raise RuntimeError(
                "a parameter's gradient was accumulated again after its bucket was reduced "
                "(is a parameter used in two recompute segments?); this would lose gradient"
            )
        if id(param) in self._unwritten:  # in the buffer's dtype, then free the micro batch's grad
            param.main_grad.copy_(param.grad)
            self._unwritten.discard(id(param))
        else:
            param.main_grad.add_(param.grad)
        param.grad = None
        if not self.sync_enabled:
            return
        bucket.ready.add(id(param))
        if not bucket.late and len(bucket.ready) == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        flat = bucket.buffer  # already the sum over this iteration's micro batches
        bucket.launched = True
        if self.dp_size > 1:
            flat.div_(self.dp_size)
        if self.reduce_kind == "all_reduce":
            if self.dp_size > 1:
                bucket.handle = dist.all_reduce(flat, group=self.group, async_op=True)
            return
        start, end = bucket.shard_range(self.dp_rank, self.dp_size)
        if bucket.grad_shard is None:
            bucket.grad_shard = torch.empty(end - start, dtype=flat.dtype, device=flat.device)
        if self.dp_size > 1:
            bucket.handle = _reduce_scatter(bucket.grad_shard, flat, self.group, async_op=True)
        else:
            bucket.grad_shard.copy_(flat)

    # -- after the backward --------------------------------------------------------------------
    def finish(self) -> None:
        """Complete this iteration's reductions (idempotent until the next backward)."""
        self._zero_unwritten()  # before any reduction reads them (also with no backward at all)
        if not self.pending:
            return
        if self.sequence_parallel:
            allreduce_sequence_parallel_grads(self.params)
        allreduce_embedding_grads(self.shared_embedding_params)
        for bucket in self.buckets:
            if not bucket.launched:  # late buckets, and any whose params got no gradient this time
                self._launch(bucket)
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
                bucket.handle = None
            bucket.ready.clear()
            bucket.launched = False
        self.pending = False
        self.reduced = True
