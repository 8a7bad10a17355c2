"""The distributed optimizer (ZeRO-1): fp32 master weights and Adam state sharded over DP ranks.

The model is wrapped in `DistributedDataParallel(..., reduce_kind="reduce_scatter")`: each grad
bucket is padded to a multiple of the DP size and DP rank r owns the r-th slice of every bucket.
The slice cuts parameters into pieces; each piece gets an fp32 master copy (a leaf tensor) that
the inner AdamW (the same `build_adam` / decay groups as MegatronOptimizer) updates, so Adam
state exists only for the owned 1/DP of the model. A step: the reduce-scattered grad slice
becomes the pieces' grads -> unscale, inf check and global-norm clip (norm summed over DP and
the model-parallel group) -> Adam on the pieces -> each bucket's updated slice is all-gathered
over DP into the model parameters.

Interface: the MegatronOptimizer one (scale_loss, loss_scale, zero_grad, step(nonfinite_loss=False)
-> (ok, grad_norm, num_zeros) with the same NaN guard, param_groups, state_dict/load_state_dict,
load_param_state), plus for checkpoints:

    param_state() -> {name: {"start", "fp32_param", "exp_avg", "exp_avg_sq"}}: this DP rank's
        pieces (flat, `start` = first element in the flattened parameter), host copies; not
        collective: each DP rank writes its own file (distrib_optim_dp_XXX.pt), nothing is gathered.
    state_dict() / load_state_dict(): param-group hyperparameters, step and the loss scaler (what
        goes under "optimizer" in model_optim_rng.pt).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_core import parallel_state as ps
from megatron_core.distributed import DistributedDataParallel
from megatron_core.distributed.grad_sync import Bucket, all_gather_into
from megatron_core.optimizer.clip_grads import Poison, clip_by_norm_, counts_for_norm, global_grad_norm
from megatron_core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron_core.optimizer.optimizer import AdamSettings, FP32MasterOptimizer, build_adam, no_weight_decay


@dataclass
class _Piece:
    """The part of one parameter that falls in this rank's slice of one bucket."""

    name: str
    param: torch.nn.Parameter
    bucket: Bucket
    param_start: int  # first element in the flattened parameter
    shard_start: int  # first element in this rank's bucket slice
    numel: int
    master: torch.Tensor  # fp32 leaf, what Adam updates


def _all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


class DistributedOptimizer(FP32MasterOptimizer):
    def __init__(
        self,
        model: DistributedDataParallel,
        settings: AdamSettings,
        *,
        precision: str = "fp32",
        clip_grad: float = 1.0,
        grad_scaler=None,
        device: Optional[torch.device] = None,
        fused_adam_cls=None,
    ) -> None:
        if not isinstance(model, DistributedDataParallel) or model.grad_sync.reduce_kind != "reduce_scatter":
            raise TypeError(
                "DistributedOptimizer needs the model wrapped in "
                "DistributedDataParallel(module, parallel, reduce_kind='reduce_scatter')"
            )
        if precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"precision {precision!r} is not fp32, bf16 or fp16")
        grad_sync = model.grad_sync
        self.grad_sync, self.precision, self.clip_grad = grad_sync, precision, float(clip_grad)
        self.grad_scaler = grad_scaler or (DynamicGradScaler() if precision == "fp16" else ConstantGradScaler())
        self.dp_group, self.dp_rank, self.dp_size = grad_sync.group, grad_sync.dp_rank, grad_sync.dp_size
        names = {id(p): n for n, p in model.module.named_parameters()}
        self.model_params = grad_sync.params
        self.pieces: list[_Piece] = []
        for bucket in grad_sync.buckets:
            lo, hi = bucket.shard_range(self.dp_rank, self.dp_size)
            for param, offset in zip(bucket.params, bucket.offsets):
                start, end = max(offset, lo), min(offset + param.numel(), hi)
                if start >= end:
                    continue
                master = param.detach().reshape(-1)[start - offset : end - offset].clone().float()
                master.requires_grad_(True)
                self.pieces.append(
                    _Piece(names[id(param)], param, bucket, start - offset, start - lo, end - start, master)
                )
        decay, no_decay = [], []
        for piece in self.pieces:
            (no_decay if no_weight_decay(piece.name, piece.param) else decay).append(piece.master)
        groups = [
            g
            for g in (
                {"params": decay, "weight_decay": settings.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            )
            if g["params"]
        ]
        if not groups:  # more DP ranks than elements: this rank owns only padding
            groups = [{"params": [torch.zeros(0, requires_grad=True)], "weight_decay": 0.0}]
        device = device or (self.model_params[0].device if self.model_params else torch.device("cpu"))
        self.device = torch.device(device)  # where the norm, overflow and zero-count collectives run
        self.optimizer, inner = build_adam(groups, settings, fused_adam_cls)
        self.description = f"distributed optimizer (ZeRO-1 over DP {self.dp_size}) around {inner}"
        self._gather_buffers = {
            id(b): torch.empty(b.padded_numel, dtype=b.params[0].dtype, device=device) for b in grad_sync.buckets
        }

    # -- the loop's interface ------------------------------------------------------------------
    @torch.no_grad()
    def reload_model_params(self) -> None:
        for piece in self.pieces:
            piece.master.copy_(piece.param.detach().reshape(-1)[piece.param_start : piece.param_start + piece.numel])

    def zero_grad(self) -> None:
        for param in self.model_params:
            param.grad = None
        for piece in self.pieces:
            piece.master.grad = None

    def step(
        self, count_zeros: bool = False, *, nonfinite_loss: Poison = False
    ) -> tuple[bool, Optional[float], Optional[int]]:
        """As MegatronOptimizer.step (ok False: skipped; grad_norm None for an fp16 overflow, the
        non-finite norm for the NaN guard)."""
        self.grad_sync.finish()  # no-op when the schedule already finished this iteration's sync
        grads = []
        for piece in self.pieces:
            if piece.bucket.grad_shard is None:
                raise RuntimeError("step() before any backward: no reduce-scattered gradients exist")
            shard = piece.bucket.grad_shard[piece.shard_start : piece.shard_start + piece.numel]
            piece.master.grad = shard if shard.dtype == torch.float32 else shard.float()  # fp16 buffers: fp32 master
            grads.append(piece.master.grad)
        # fp16's overflow flag over every rank of the world: each DP rank holds other pieces of the gradients.
        skipped = self._guard(grads, dist.group.WORLD if dist.is_initialized() else None, nonfinite_loss)
        if skipped is not None:
            return skipped[0], skipped[1], None
        grad_norm = global_grad_norm(
            [p.master.grad for p in self.pieces if counts_for_norm(p.param)],
            [self.dp_group, ps.get_model_parallel_group()],
            self.device,
            poison=nonfinite_loss,
        )
        if not math.isfinite(grad_norm):  # the NaN guard: the same verdict on every rank
            return False, grad_norm, None
        clip_by_norm_(grads, grad_norm, self.clip_grad)
        num_zeros = None
        if count_zeros:
            zeros = torch.tensor(float(sum(int((g == 0).sum()) for g in grads)), device=self.device)
            _all_reduce(zeros, self.dp_group)
            num_zeros = int(zeros.item())
        self.optimizer.step()
        self._all_gather_params()
        return True, grad_norm, num_zeros

    @torch.no_grad()
    def _all_gather_params(self) -> None:
        """Every DP rank's updated slice of each bucket -> the full model parameters everywhere."""
        for bucket in self.grad_sync.buckets:
            lo, hi = bucket.shard_range(self.dp_rank, self.dp_size)
            full = self._gather_buffers[id(bucket)]
            shard = full[lo:hi]
            for piece in self.pieces:
                if piece.bucket is bucket:
                    shard[piece.shard_start : piece.shard_start + piece.numel].copy_(piece.master)
            if self.dp_size > 1:
                all_gather_into(full, shard.clone(), self.dp_group)
            for param, offset in zip(bucket.params, bucket.offsets):
                param.data.view(-1).copy_(full[offset : offset + param.numel()])

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Not the pieces (param_state() goes into this DP rank's own file)."""
        return {**super().state_dict(), "distributed_optimizer": True}

    def param_state(self) -> dict[str, dict]:
        """This DP rank's pieces: fp32 master and Adam moments, flat, with their start in the parameter."""
        return {p.name: {"start": p.param_start, **self._adam_state(p.master)} for p in self.pieces}

    @torch.no_grad()
    def load_param_state(self, state: dict, step: int) -> None:
        """Take this rank's slice of every parameter's saved master weight and Adam moments."""
        for piece in self.pieces:
            sl = slice(piece.param_start, piece.param_start + piece.numel)
            self._load_adam_state(piece.master, {k: t.reshape(-1)[sl] for k, t in state[piece.name].items()}, step)
        self._all_gather_params()
