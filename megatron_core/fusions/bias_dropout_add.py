"""residual + dropout(x + bias), the tail of each Megatron transformer sub-layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_core.errors import UserError
from megatron_core.fusions.backends import choose_backend


def bias_dropout_add_reference(
    x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float, training: bool
) -> torch.Tensor:
    """The torch backend; the mask comes from torch's default generator of x's device."""
    z = x if bias is None else x + bias
    if training and p > 0.0:
        z = F.dropout(z, p=p, training=True)
    return residual + z


def bias_dropout_add(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    p: float,
    training: bool,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """residual + dropout(x + bias) with drop probability p when `training`; bias [hidden] or None."""
    if not 0.0 <= float(p) <= 1.0:
        raise UserError(f"dropout probability p={p} is outside [0, 1]")
    if residual.shape != x.shape:
        raise UserError(f"bias_dropout_add residual {tuple(residual.shape)} must have the shape of x {tuple(x.shape)}")
    if bias is not None and bias.shape != (x.shape[-1],):
        raise UserError(f"bias_dropout_add bias {tuple(bias.shape)} must be [{x.shape[-1]}] or None")
    choose_backend("bias_dropout_add", backend, x.device)  # checks the name: torch is the one implementation
    return bias_dropout_add_reference(x, bias, residual, float(p), training)
