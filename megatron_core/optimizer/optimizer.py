"""MegatronOptimizer: AdamW with fp32 master weights, loss scaling and global-norm clipping.

The interface the training loop talks to (the distributed optimizer implements the same one):

    scale_loss(loss) -> loss * loss_scale      loss_scale -> float (1.0 unless fp16)
    zero_grad()                                step(nonfinite_loss=False) -> (ok, grad_norm, num_zeros)
    param_groups (the lr scheduler writes 'lr') state_dict() / load_state_dict(state)
    load_param_state({name: {fp32_param, exp_avg, exp_avg_sq}}, step): whole tensors of this rank's
        parameters by model state-dict name (what a resume under any layout hands back)

`step()` copies model grads into fp32 master grads, unscales them, skips the update when fp16
grads overflowed (ok=False, grad_norm None; the loss scaler backs off), clips by the global L2 norm,
runs the inner Adam on the fp32 master weights and copies them back into the (fp16/bf16) model params.
The NaN guard (Megatron's check_for_nan_in_loss_and_grad), in every precision: a non-finite gradient
norm, or `nonfinite_loss` passed by any rank (a bool, or a device bool tensor that rides in the norm's
reduction so the loop never reads its loss per iteration), skips the update on every rank (ok=False, grad_norm the
non-finite value), so no weight ever takes a NaN/inf step. Counting those steps is the loop's job.
The norm is reduced over the model-parallel group and counts each weight once per replica
(clip_grads.counts_for_norm, the rule the distributed optimizer uses too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from megatron_core import parallel_state
from megatron_core.distributed.grad_sync import gradient
from megatron_core.optimizer.clip_grads import (
    NONFINITE_LOSS,
    Poison,
    clip_by_norm_,
    counts_for_norm,
    global_grad_norm,
    unscale_and_check_overflow,
)
from megatron_core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler

ADAM_STATE_KEYS = ("exp_avg", "exp_avg_sq")


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


def build_adam(groups: list[dict], settings: AdamSettings, fused_adam_cls=None):
    """(inner optimizer, description). Apex FusedAdam (decoupled wd) when given (the caller checked it runs
    on this device: `training.optimizer: apex`), else torch AdamW fused (one kernel over all tensors) on
    CUDA and on a CPU too: on a CPU, 88M fp32 params take ~60 ms a step fused against 150-430 ms with foreach."""
    kwargs = dict(
        lr=settings.lr, betas=(settings.beta1, settings.beta2), eps=settings.eps, weight_decay=settings.weight_decay
    )
    if fused_adam_cls is not None:
        return fused_adam_cls(groups, adam_w_mode=True, **kwargs), "apex.optimizers.FusedAdam (adam_w_mode)"
    return torch.optim.AdamW(groups, fused=True, **kwargs), "torch.optim.AdamW(fused=True)"


def step_tensor(optimizer: torch.optim.Optimizer, param: torch.Tensor, step: float) -> torch.Tensor:
    """Adam's per-parameter `step` where the inner optimizer expects it (torch's policy for loaded
    state): on the parameter's device for fused or capturable kernels, a CPU float32 otherwise;
    never where the checkpoint file happened to be written."""
    group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
    on_device = group.get("fused", False) or group.get("capturable", False)
    return torch.tensor(float(step), dtype=torch.float32, device=param.device if on_device else "cpu")


class FP32MasterOptimizer:
    """What both optimizers share: an inner Adam over fp32 master weights and a loss scaler.
    Subclasses set self.optimizer and self.grad_scaler and copy weights both ways."""

    optimizer: torch.optim.Optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def loss_scale(self) -> float:
        return self.grad_scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.loss_scale

    def reload_model_params(self) -> None:
        """Rebuild the fp32 master weights from the model's weights (Megatron's name): after the
        model was loaded from a checkpoint, before or without that checkpoint's optimizer state."""
        raise NotImplementedError

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What does not depend on the layout: hyperparameters, Adam's step count, the loss scaler.
        The per-parameter state is `param_state()` (its form is the subclass's)."""
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        return {"param_groups": groups, "step": self._step_count(), "grad_scaler": self.grad_scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """The lr, the loss scaler and, when present, `param_state` in whole tensors of this rank's
        parameters (what a resume under any layout hands in). Of the saved param_groups only the lr
        (one for all groups) is taken: the rest comes from the recipe, so a rank whose groups differ
        from the writer's (the distributed optimizer's slices, another device) cannot take a wrong one."""
        for group in self.optimizer.param_groups:
            group["lr"] = state["param_groups"][0]["lr"]
        self.grad_scaler.load_state_dict(state["grad_scaler"])
        if "param_state" in state:
            self.load_param_state(state["param_state"], int(state["step"]))

    def load_param_state(self, state: dict, step: int) -> None:
        raise NotImplementedError

    def _step_count(self) -> int:
        """Adam's step: torch counts per tensor, Apex per group; a resume writes both, and only the
        counting one moves on, so the largest is the current count."""
        steps = [
            int(value["step"])
            for value in [*self.optimizer.param_groups, *self.optimizer.state.values()]
            if "step" in value
        ]
        return max(steps, default=0)

    @torch.no_grad()
    def _load_adam_state(self, master: torch.Tensor, entry: dict, step: int) -> None:
        """One master tensor's saved fp32 value and Adam moments (already cut to its shape) and the
        step count where the inner Adam keeps it: per tensor (torch; `step_tensor` places it) and
        per group (Apex FusedAdam; torch ignores the key)."""
        if "fp32_param" in entry:  # absent: an fp32 model param is its own master
            master.copy_(entry["fp32_param"])
        inner = self.optimizer.state[master]
        for key in ADAM_STATE_KEYS:
            inner[key] = entry[key].to(master.device, torch.float32).clone()
        inner["step"] = step_tensor(self.optimizer, master, step)
        for group in self.optimizer.param_groups:
            group["step"] = step

    def _adam_state(self, master: torch.Tensor, with_master: bool = True) -> dict[str, torch.Tensor]:
        """Host copies of one master's fp32 value and Adam moments: a save never allocates on the GPU
        (a clone there would cost 12 bytes/param at every save), and training may go on changing the
        live tensors while the copies are written."""
        state = self.optimizer.state.get(master, {})
        out = {"fp32_param": _host_copy(master)} if with_master else {}
        for key in ADAM_STATE_KEYS:
            out[key] = _host_copy(state[key]) if key in state else torch.zeros(master.shape, dtype=torch.float32)
        return out

    def _guard(
        self, grads: list[torch.Tensor], group, nonfinite_loss: Poison
    ) -> Optional[tuple[bool, Optional[float]]]:
        """Unscale `grads`; (False, norm) when the step must be skipped (see step()), else None."""
        if self.precision == "fp16":
            found = unscale_and_check_overflow(grads, self.loss_scale, group, self.device, poison=nonfinite_loss)
            self.grad_scaler.update(found > 0)
            if found == NONFINITE_LOSS:
                return False, float("nan")
            if found:
                return False, None
        elif self.loss_scale != 1.0 and grads:
            torch._foreach_mul_(grads, 1.0 / self.loss_scale)
        return None


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)


class MegatronOptimizer(FP32MasterOptimizer):
    def __init__(
        self,
        model: torch.nn.Module,
        settings: AdamSettings,
        *,
        precision: str = "fp32",
        clip_grad: float = 1.0,
        grad_scaler=None,
        device: Optional[torch.device] = None,
        fused_adam_cls=None,
    ) -> None:
        if precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"precision {precision!r} is not fp32, bf16 or fp16")
        self.precision = precision
        self.clip_grad = float(clip_grad)
        self.grad_scaler = grad_scaler or (DynamicGradScaler() if precision == "fp16" else ConstantGradScaler())
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.model_params = [p for _, p in named]
        device = device or (self.model_params[0].device if self.model_params else torch.device("cpu"))
        self.device = torch.device(device)  # where the norm and overflow collectives run
        # fp32 master copies of half-precision params; fp32 params are their own master.
        if precision == "fp32":
            self.master_params = self.model_params
        else:
            self.master_params = []
            for p in self.model_params:
                master = p.detach().clone().float()
                master.requires_grad_(True)
                self.master_params.append(master)
        master_by_model = {id(p): m for p, m in zip(self.model_params, self.master_params)}
        groups = param_groups(((n, master_by_model[id(p)]) for n, p in named), settings.weight_decay)
        self.optimizer, self.description = build_adam(groups, settings, fused_adam_cls)
        if precision == "fp16":
            self.description += ", fp16 with fp32 master weights and dynamic loss scaling"
        elif precision == "bf16":
            self.description += ", bf16 with fp32 master weights"

    # -- the loop's interface ------------------------------------------------------------------
    @torch.no_grad()
    def reload_model_params(self) -> None:
        if self.master_params is not self.model_params:
            torch._foreach_copy_(self.master_params, self.model_params)

    def zero_grad(self) -> None:
        for p in self.model_params:
            p.grad = None
        if self.master_params is not self.model_params:
            for m in self.master_params:
                m.grad = None

    def step(
        self, count_zeros: bool = False, *, nonfinite_loss: Poison = False
    ) -> tuple[bool, Optional[float], Optional[int]]:
        """(ok, grad_norm, num_zeros). ok is False when the step was skipped, the same on every rank:
        grad_norm None for an fp16 overflow (the loss scaler backed off), the non-finite norm for the
        NaN guard (a non-finite gradient norm, or `nonfinite_loss` on any rank). `nonfinite_loss` may be a
        0-dim bool tensor on the device: it is folded into the norm's reduction, read with it, no extra sync."""
        pairs = self._master_grads()
        grads = [g for _, g in pairs]
        group = parallel_state.get_model_parallel_group()  # DP replicas hold the same reduced grads
        try:
            skipped = self._guard(grads, group, nonfinite_loss)
            if skipped is not None:
                return skipped[0], skipped[1], None
            grad_norm = global_grad_norm(
                [g for p, g in pairs if counts_for_norm(p)], [group], self.device, poison=nonfinite_loss
            )
            if not math.isfinite(grad_norm):
                return False, grad_norm, None
            clip_by_norm_(grads, grad_norm, self.clip_grad)
            num_zeros = sum(int((g == 0).sum()) for g in grads) if count_zeros else None
            self.optimizer.step()
            if self.master_params is not self.model_params:
                with torch.no_grad():
                    torch._foreach_copy_(self.model_params, self.master_params)
            return True, grad_norm, num_zeros
        finally:
            if self.master_params is self.model_params:
                # an fp32 param's .grad is its main_grad view: drop it, or the next backward would add into it
                for p, _ in pairs:
                    if getattr(p, "main_grad", None) is not None:
                        p.grad = None

    def _master_grads(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(model param, its master's fp32 grad) for every param that got a gradient. Under a
        GradSync the gradient is the param's main_grad (already fp32 when accumulated in fp32:
        no copy); otherwise .grad."""
        pairs = []
        for p, m in zip(self.model_params, self.master_params):
            grad = gradient(p)
            if grad is None:
                continue
            m.grad = grad if grad.dtype == torch.float32 else grad.float()
            pairs.append((p, m.grad))
        return pairs

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything, in model_optim_rng.pt: per parameter (by model state-dict name) its Adam
        moments and, when the model is fp16/bf16, its fp32 master (an fp32 model is its own master)."""
        param_state = {}
        for name, param, master in zip(self.names, self.model_params, self.master_params):
            param_state[name] = self._adam_state(master, with_master=master is not param)
        return {**super().state_dict(), "param_state": param_state}

    def load_param_state(self, state: dict, step: int) -> None:
        for name, master in zip(self.names, self.master_params):
            self._load_adam_state(master, state[name], step)
