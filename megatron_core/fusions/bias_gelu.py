"""GeLU (tanh approximation, Megatron's fused bias-GeLU / HF "gelu_new") of x + bias."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from megatron_core.errors import UserError
from megatron_core.fusions.backends import choose_backend

# tanh-GeLU(h) = 0.5 h (1 + tanh(z)) with z = sqrt(2/pi) (h + 0.044715 h^3); since 0.5 (1 + tanh z) =
# sigmoid(2z), it is h * sigmoid(h (C1 + C3 h^2)) exactly, with the constants below.
_C1 = 2.0 * math.sqrt(2.0 / math.pi)
_C3 = _C1 * 0.044715


def bias_gelu_reference(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return F.gelu(x + bias, approximate="tanh")


def _times_c1_plus(h: torch.Tensor, c3: float) -> torch.Tensor:
    """h (C1 + c3 h^2) in two passes over h: addcmul makes C1 + c3 h^2 in one (a 0-dim C1 in h's dtype
    broadcasts for free), where h*h, *c3, +C1 took three. With c3 = C3 it is the sigmoid's argument w,
    with 3 C3 it is h dw/dh."""
    return torch.addcmul(h.new_full((), _C1), h, h, value=c3).mul_(h)


def _gelu_forward(x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tanh-GeLU(h), h) for h = x + bias, through the sigmoid identity."""
    h = x + bias
    return _times_c1_plus(h, _C3).sigmoid_().mul_(h), h


def _gelu_backward(h: torch.Tensor, grad: torch.Tensor, bias_grad: bool):
    # d/dh [h s] = s + h s (1 - s) dw, with w = h (C1 + C3 h^2), s = sigmoid(w), dw = C1 + 3 C3 h^2:
    # two buffers, everything else in place (a fresh CPU buffer costs more than a pass over it).
    s = _times_c1_plus(h, _C3).sigmoid_()
    t = _times_c1_plus(h, 3.0 * _C3)  # h dw
    t.addcmul_(t, s, value=-1.0)  # h dw (1 - s)
    grad_h = t.add_(1.0).mul_(s).mul_(grad)
    return grad_h, (grad_h.reshape(-1, grad_h.shape[-1]).sum(0) if bias_grad else None)


class _BiasGeluSigmoid(torch.autograd.Function):
    """tanh-GeLU(x + bias) through the sigmoid identity, written for CPUs: torch's CPU tanh runs about 3.5x
    slower than its sigmoid, so this form, in-place passes and all, takes half of F.gelu(approximate="tanh")'s
    time. Like Megatron's fused bias-GeLU it saves only x + bias and recomputes the rest in the backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        y, h = _gelu_forward(x, bias)
        ctx.save_for_backward(h)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        (h,) = ctx.saved_tensors
        return _gelu_backward(h, grad, ctx.needs_input_grad[1])


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """tanh-approximate GeLU(x + bias); bias [hidden] broadcast over the rows of x [..., hidden]."""
    if bias is None or bias.shape != (x.shape[-1],):
        raise UserError(
            f"bias_gelu bias must be a [{x.shape[-1]}] tensor (the last dimension of x "
            f"{tuple(x.shape)}), got {None if bias is None else tuple(bias.shape)}"
        )
    choose_backend("bias_gelu", backend, x.device)  # checks the name: torch is the one implementation
    if x.device.type == "cpu" and x.dtype == bias.dtype and x.dtype in (torch.float32, torch.float64):
        # (16-bit inputs keep F.gelu, which computes in fp32 and rounds once; these in-place passes
        # would round at every step: 4x the bf16 gradient error.)
        return _BiasGeluSigmoid.apply(x, bias)
    return bias_gelu_reference(x, bias)
