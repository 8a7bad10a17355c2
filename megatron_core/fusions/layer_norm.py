"""LayerNorm over the last dimension, with weight and bias (Megatron's FusedLayerNorm semantics)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_core.errors import UserError
from megatron_core.fusions.apex import apex_layer_norm
from megatron_core.fusions.backends import choose_backend


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """The torch backend: torch's own layer norm (fp32 statistics inside on CUDA, x's dtype out)."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5, backend: str = "auto"
) -> torch.Tensor:
    """LayerNorm of `x` over its last dimension, scaled by weight, shifted by bias."""
    if weight is None or bias is None:
        raise UserError("layer_norm needs both weight and bias tensors of shape [hidden]")
    if weight.shape != (x.shape[-1],) or bias.shape != (x.shape[-1],):
        raise UserError(
            f"layer_norm weight {tuple(weight.shape)} and bias {tuple(bias.shape)} must both be "
            f"[{x.shape[-1]}], the last dimension of x {tuple(x.shape)}"
        )
    chosen = choose_backend("layer_norm", backend, x.device)
    if chosen == "apex":
        return apex_layer_norm(x, weight, bias, eps)
    return layer_norm_reference(x, weight, bias, eps)
