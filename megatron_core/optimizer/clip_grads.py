"""The gradient arithmetic both optimizers share: which parameters a norm counts, the global L2
norm, and the fp16 overflow check, each one fused call over all gradients (torch._foreach_norm,
torch._amp_foreach_non_finite_check_and_unscale_) instead of a Python loop over parameters."""

from __future__ import annotations

import math
from typing import Iterable, Sequence, Union

import torch
import torch.distributed as dist

from megatron_core import parallel_state as ps


def counts_for_norm(param: torch.Tensor) -> bool:
    """Count every weight once per model replica (Megatron's `param_is_not_shared` and
    `param_is_not_tensor_parallel_duplicate`): parameters replicated over TP ranks (norms,
    row-parallel biases) on TP rank 0 only; the last pipeline stage's copy of the tied word
    embedding not at all (the first stage counts it)."""
    if getattr(param, "shared_embedding", False) and not ps.is_pipeline_first_stage():
        return False
    return getattr(param, "tensor_model_parallel", False) or ps.get_tensor_model_parallel_rank() == 0


def flat_spans(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The same elements as fewer, longer 1-D tensors, for a norm or a scale, where order does not matter:
    contiguous tensors that lie back to back in one storage (the main_grad views of a gradient bucket)
    become one view of their span. Over two buckets that is 2 kernels instead of one per parameter (148
    at 12 layers: 25 ms of a CPU step for the norm, against about 10 for the same bytes in two passes).
    Nothing is merged that overlaps or has a gap; the rest stays as it is."""
    # Storages in the order they first appear, never by address: the spans' order is the order the norm's
    # partial sums are added in, and an order that followed the allocator would change a resumed run's bits.
    first_seen: dict = {}
    for t in tensors:
        first_seen.setdefault((t.untyped_storage().data_ptr(), str(t.dtype), str(t.device)), len(first_seen))

    def place(t: torch.Tensor):
        return t.untyped_storage().data_ptr(), str(t.dtype), str(t.device), t.storage_offset()

    flat = sorted(
        (t for t in tensors if t.is_contiguous()), key=lambda t: (first_seen[place(t)[:3]], t.storage_offset())
    )
    spans: list[torch.Tensor] = [t for t in tensors if not t.is_contiguous()]
    run, run_place, run_end = None, None, None
    for t in flat:
        storage, dtype, device, offset = place(t)
        if run is not None and run_place == (storage, dtype, device) and offset == run_end:
            run = run.as_strided((run.numel() + t.numel(),), (1,), run.storage_offset())
        else:
            if run is not None:
                spans.append(run)
            run = t.reshape(-1)
        run_place, run_end = (storage, dtype, device), offset + t.numel()
    if run is not None:
        spans.append(run)
    return spans


# A rank's "my loss was not finite": a host bool, or a 0-dim bool tensor on the device (the training loop's,
# so that reading the loss is no extra host sync: the flag rides in the reduction that follows).
Poison = Union[bool, torch.Tensor]


def _poisoned(value: torch.Tensor, poison: Poison, fill: float) -> torch.Tensor:
    """`value`, or `fill` in its place where `poison` holds."""
    if isinstance(poison, torch.Tensor):
        return torch.where(poison.to(value.device), torch.full_like(value, fill), value)
    return torch.full_like(value, fill) if poison else value


def _all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> None:
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


def global_grad_norm(
    grads: Sequence[torch.Tensor], groups: Iterable, device: torch.device, poison: Poison = False
) -> float:
    """L2 norm of `grads` (the ones counts_for_norm keeps), squared sums added over each group.
    `device` is where the collective's tensor lives (the training device: NCCL refuses a CPU tensor),
    also on a rank that holds no gradient. `poison` (this rank's loss was not finite) makes the norm NaN
    on every rank of the groups, so all of them skip the step together. The one host sync: the norm's read."""
    if grads:
        norms = torch._foreach_norm([g.float() if g.dtype != torch.float32 else g for g in flat_spans(grads)], 2)
        total = torch.stack(norms).square().sum()
    else:
        total = torch.zeros((), dtype=torch.float32, device=device)
    total = _poisoned(total, poison, float("nan"))
    for group in groups:
        _all_reduce(total, group)
    return float(total.sqrt())


# What unscale_and_check_overflow's reduced flag holds: the MAX over ranks says which happened.
OVERFLOW, NONFINITE_LOSS = 1.0, 2.0


def unscale_and_check_overflow(
    grads: Sequence[torch.Tensor], loss_scale: float, group, device: torch.device, poison: Poison = False
) -> float:
    """Divide fp32 `grads` by the loss scale in place. 0.0 when every rank of `group` (the ranks that
    must skip the step together) holds finite grads; OVERFLOW when any holds inf/NaN; NONFINITE_LOSS when
    any rank passed `poison` (its loss was not finite). `device`: as for global_grad_norm."""
    found_inf = torch.zeros((), dtype=torch.float32, device=device)
    if grads:
        inverse = torch.full((), 1.0 / loss_scale, dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(list(grads), found_inf, inverse)
    found_inf = _poisoned(found_inf, poison, NONFINITE_LOSS)
    _all_reduce(found_inf, group, dist.ReduceOp.MAX)
    return float(found_inf.item())


def clip_by_norm_(grads: Sequence[torch.Tensor], grad_norm: float, max_norm: float) -> None:
    """Megatron's clip: scale every gradient by max_norm / (norm + 1e-6) when that is below one."""
    if max_norm > 0 and grads and math.isfinite(grad_norm):
        coeff = max_norm / (grad_norm + 1.0e-6)
        if coeff < 1.0:
            torch._foreach_mul_(flat_spans(grads), coeff)
