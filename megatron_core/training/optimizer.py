"""MegatronOptimizer: AdamW with fp32 master weights, loss scaling and global-norm clipping.

The interface the training loop talks to (the distributed optimizer implements the same one):

    scale_loss(loss) -> loss * loss_scale      loss_scale -> float (1.0 unless fp16)
    zero_grad()                                step() -> (ok, grad_norm, num_zeros)
    param_groups (the lr scheduler writes 'lr') state_dict() / load_state_dict(state)

`step()` copies model grads into fp32 master grads, unscales them, skips the update when fp16
grads overflowed (ok=False; the loss scaler backs off), clips by the global L2 norm, runs the
inner Adam on the fp32 master weights and copies them back into the (fp16/bf16) model params.
The norm is reduced over the model-parallel group, counting parameters replicated across TP
ranks (norm weights, row-parallel biases: no `tensor_model_parallel` attribute) on TP rank 0
only and parameters marked `shared` (the tied head copy on the last stage) not at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from megatron_core import parallel_state
from megatron_core.training.loss_scaler import ConstantGradScaler, DynamicGradScaler


def no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Megatron's rule: biases and norm weights (every 1-D parameter) are not decayed."""
    return name.endswith(".bias") or param.dim() == 1


def param_groups(named_params: Iterable[tuple[str, torch.Tensor]], weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, param in named_params:
        if param.requires_grad:
            (no_decay if no_weight_decay(name, param) else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


@dataclass(frozen=True)
class AdamSettings:
    lr: float
    weight_decay: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8


def build_adam(groups: list[dict], settings: AdamSettings, device: torch.device, fused_adam_cls=None):
    """(inner optimizer, description). Apex FusedAdam (decoupled wd) when given and on CUDA, else
    torch AdamW fused on CUDA, foreach on CPU."""
    kwargs = dict(lr=settings.lr, betas=(settings.beta1, settings.beta2), eps=settings.eps,
                  weight_decay=settings.weight_decay)
    if device.type == "cuda" and fused_adam_cls is not None:
        return fused_adam_cls(groups, adam_w_mode=True, **kwargs), "apex.optimizers.FusedAdam (adam_w_mode)"
    if device.type == "cuda":
        return torch.optim.AdamW(groups, fused=True, **kwargs), "torch.optim.AdamW(fused=True)"
    return torch.optim.AdamW(groups, foreach=True, **kwargs), "torch.optim.AdamW(foreach=True)"


def _counts_for_norm(param: torch.Tensor) -> bool:
    if getattr(param, "shared", False):
        return False
    return getattr(param, "tensor_model_parallel", False) or parallel_state.get_tensor_model_parallel_rank() == 0


def global_grad_norm(grads_for_norm: list[torch.Tensor]) -> float:
    """L2 norm of the given grads, summed over the model-parallel group (TP x PP)."""
    device = grads_for_norm[0].device if grads_for_norm else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    for grad in grads_for_norm:
        total += grad.detach().float().pow(2).sum()
    group = parallel_state.get_model_parallel_group()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return float(total.sqrt())


class MegatronOptimizer:
    def __init__(self, model: torch.nn.Module, settings: AdamSettings, *, precision: str = "fp32",
                 clip_grad: float = 1.0, grad_scaler=None, device: Optional[torch.device] = None,
                 fused_adam_cls=None) -> None:
        if precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"precision {precision!r} is not fp32, bf16 or fp16")
        self.precision = precision
        self.clip_grad = float(clip_grad)
        self.grad_scaler = grad_scaler or (DynamicGradScaler() if precision == "fp16" else ConstantGradScaler())
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.model_params = [p for _, p in named]
        device = device or (self.model_params[0].device if self.model_params else torch.device("cpu"))
        # fp32 master copies of half-precision params; fp32 params are their own master.
        if precision == "fp32":
            self.master_params = self.model_params
        else:
            self.master_params = []
            for p in self.model_params:
                master = p.detach().clone().float()
                master.requires_grad_(True)
                for attr in ("tensor_model_parallel", "shared"):
                    if hasattr(p, attr):
                        setattr(master, attr, getattr(p, attr))
                self.master_params.append(master)
        master_by_model = {id(p): m for p, m in zip(self.model_params, self.master_params)}
        groups = param_groups(((n, master_by_model[id(p)]) for n, p in named), settings.weight_decay)
        self.optimizer, self.description = build_adam(groups, settings, device, fused_adam_cls)
        if precision == "fp16":
            self.description += ", fp16 with fp32 master weights and dynamic loss scaling"
        elif precision == "bf16":
            self.description += ", bf16 with fp32 master weights"

    # -- the loop's interface ------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def loss_scale(self) -> float:
        return self.grad_scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.loss_scale

    def zero_grad(self) -> None:
        for p in self.model_params:
            p.grad = None
        if self.master_params is not self.model_params:
            for m in self.master_params:
                m.grad = None

    def step(self, count_zeros: bool = False) -> tuple[bool, Optional[float], Optional[int]]:
        """(ok, grad_norm, num_zeros): ok is False when the step was skipped for inf/NaN grads."""
        grads = self._master_grads_unscaled()
        if self.precision == "fp16":
            found_inf = self._found_inf(grads)
            self.grad_scaler.update(found_inf)
            if found_inf:
                return False, None, None
        grad_norm = global_grad_norm([g for m, g in zip(self.master_params, grads)
                                      if g is not None and _counts_for_norm(m)])
        if self.clip_grad > 0 and math.isfinite(grad_norm):
            coeff = self.clip_grad / (grad_norm + 1.0e-6)
            if coeff < 1.0:
                torch._foreach_mul_([g for g in grads if g is not None], coeff)
        num_zeros = sum(int((g == 0).sum()) for g in grads if g is not None) if count_zeros else None
        self.optimizer.step()
        if self.master_params is not self.model_params:
            with torch.no_grad():
                for p, m in zip(self.model_params, self.master_params):
                    p.copy_(m)
        return True, grad_norm, num_zeros

    def _master_grads_unscaled(self) -> list[Optional[torch.Tensor]]:
        inverse = 1.0 / self.loss_scale
        grads = []
        for p, m in zip(self.model_params, self.master_params):
            if p.grad is None:
                grads.append(None)
                continue
            if m is not p:
                m.grad = p.grad.detach().float()
            if inverse != 1.0:
                m.grad.mul_(inverse)
            grads.append(m.grad)
        return grads

    def _found_inf(self, grads: list[Optional[torch.Tensor]]) -> bool:
        present = [g for g in grads if g is not None]
        device = present[0].device if present else torch.device("cpu")
        found = torch.zeros((), dtype=torch.float32, device=device)
        for g in present:
            found = torch.maximum(found, (~torch.isfinite(g)).any().float())
        group = parallel_state.get_model_parallel_group()
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        return bool(found.item() > 0)

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        state = {"optimizer": self.optimizer.state_dict(), "grad_scaler": self.grad_scaler.state_dict()}
        if self.master_params is not self.model_params:
            # Megatron's name for the fp32 master copies of half-precision params.
            state["fp32_from_fp16_params"] = [m.detach().clone() for m in self.master_params]
        return state

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.grad_scaler.load_state_dict(state["grad_scaler"])
        if "fp32_from_fp16_params" in state and self.master_params is not self.model_params:
            with torch.no_grad():
                for m, saved in zip(self.master_params, state["fp32_from_fp16_params"]):
                    m.copy_(saved)
