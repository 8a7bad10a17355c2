"""residual + dropout(x + bias), the tail of each Megatron transformer sub-layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_core.errors import UserError
from megatron_core.fusions.backends import choose_backend


def bias_dropout_add_reference(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float,
                               training: bool, generator_seed: int | None = None) -> torch.Tensor:
    """The torch backend. With a seed the mask comes from a torch.Generator seeded with it (same seed, same
    mask); without one, from torch's default generator of x's device. Masks differ from the Triton ones."""
    z = x if bias is None else x + bias
    if training and p > 0.0:
        if generator_seed is None:
            z = F.dropout(z, p=p, training=True)
        else:
            generator = torch.Generator(device=x.device)
            generator.manual_seed(int(generator_seed))
            keep = torch.rand(z.shape, generator=generator, device=x.device) >= p
            z = z * keep * (0.0 if p >= 1.0 else 1.0 / (1.0 - p))
    return residual + z


def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float, training: bool,
                     *, generator_seed: int | None = None, backend: str = "auto") -> torch.Tensor:
    """residual + dropout(x + bias) with drop probability p when `training`; bias [hidden] or None.
    Same `generator_seed` (with the same backend and shape) gives the same mask; None draws a seed from
    the default generator of x's device. Non-contiguous inputs are accepted (copied contiguous)."""
    if not 0.0 <= float(p) <= 1.0:
        raise UserError(f"dropout probability p={p} is outside [0, 1]")
    if residual.shape != x.shape:
        raise UserError(f"bias_dropout_add residual {tuple(residual.shape)} must have the shape of x {tuple(x.shape)}")
    if bias is not None and bias.shape != (x.shape[-1],):
        raise UserError(f"bias_dropout_add bias {tuple(bias.shape)} must be [{x.shape[-1]}] or None")
    chosen = choose_backend("bias_dropout_add", backend, x.device)
    if chosen == "triton":
        # Lazy: the kernel module imports triton (optional; its import fixes TRITON_INTERPRET for the process).
        from megatron_core.fusions.triton_kernels.bias_dropout_add import bias_dropout_add as triton_bda

        return triton_bda(x, bias, residual, float(p), training, generator_seed)
    return bias_dropout_add_reference(x, bias, residual, float(p), training, generator_seed)
