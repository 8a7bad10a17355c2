"""GeLU (tanh approximation, Megatron's fused bias-GeLU / HF "gelu_new") of x + bias."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_core.errors import UserError
from megatron_core.fusions.backends import choose_backend


def bias_gelu_reference(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return F.gelu(x + bias, approximate="tanh")


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """tanh-approximate GeLU(x + bias); bias [hidden] broadcast over the rows of x [..., hidden].
    Non-contiguous x is accepted (the Triton path makes a contiguous copy)."""
    if bias is None or bias.shape != (x.shape[-1],):
        raise UserError(f"bias_gelu bias must be a [{x.shape[-1]}] tensor (the last dimension of x "
                        f"{tuple(x.shape)}), got {None if bias is None else tuple(bias.shape)}")
    chosen = choose_backend("bias_gelu", backend, x.device)
    if chosen == "triton":
        # Lazy: the kernel module imports triton (optional; its import fixes TRITON_INTERPRET for the process).
        from megatron_core.fusions.triton_kernels.bias_gelu import bias_gelu as triton_bias_gelu

        return triton_bias_gelu(x, bias)
    return bias_gelu_reference(x, bias)
