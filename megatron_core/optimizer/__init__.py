"""Optimizers with fp32 master weights: MegatronOptimizer (one replica per DP rank) and the
DistributedOptimizer (ZeRO-1, master weights and Adam state sharded over DP), the loss scalers,
and the gradient norm / overflow routines both share."""

from megatron_core.optimizer.clip_grads import counts_for_norm, global_grad_norm, unscale_and_check_overflow
from megatron_core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron_core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron_core.optimizer.optimizer import AdamSettings, MegatronOptimizer, build_adam, param_groups

__all__ = [
    "AdamSettings",
    "ConstantGradScaler",
    "DistributedOptimizer",
    "DynamicGradScaler",
    "MegatronOptimizer",
    "build_adam",
    "counts_for_norm",
    "global_grad_norm",
    "param_groups",
    "unscale_and_check_overflow",
]
