"""GeLU (tanh approximation) of x + bias, element-wise over the flattened input; bias indexed by column.

The backward recomputes x + bias from the saved inputs (as Megatron's fused bias-GeLU does) instead of
saving the pre-activation."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_core.fusions.triton_kernels import _common

ELEMENTWISE_BLOCK = 4096
ELEMENTWISE_WARPS = _common.warps_for(ELEMENTWISE_BLOCK)  # 16: 8 elements per thread (4 warps spilled)
_SQRT_2_OVER_PI = 0.7978845608028654
_GELU_CUBIC = 0.044715


@triton.jit
def _tanh(u):
    # tanh via the logistic function (tl has no portable tanh across backends); |u| <= 15 already gives
    # tanh = +-1 in fp32, and the clamp keeps exp from overflowing.
    u = tl.minimum(tl.maximum(u, -15.0), 15.0)
    return 2.0 * tl.sigmoid(2.0 * u) - 1.0


@triton.jit
def _bias_gelu_fwd_kernel(X, B, Y, numel, hidden, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offsets = start + tl.arange(0, BLOCK)
    live = offsets < numel
    z = tl.load(X + offsets, mask=live, other=0.0).to(tl.float32)
    z += tl.load(B + _common.bias_columns(start, hidden, BLOCK), mask=live, other=0.0).to(tl.float32)
    t = _tanh(0.7978845608028654 * (z + 0.044715 * z * z * z))
    tl.store(Y + offsets, (0.5 * z * (1.0 + t)).to(Y.dtype.element_ty), mask=live)


@triton.jit
def _bias_gelu_bwd_kernel(DY, X, B, DX, numel, hidden, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offsets = start + tl.arange(0, BLOCK)
    live = offsets < numel
    z = tl.load(X + offsets, mask=live, other=0.0).to(tl.float32)
    z += tl.load(B + _common.bias_columns(start, hidden, BLOCK), mask=live, other=0.0).to(tl.float32)
    dy = tl.load(DY + offsets, mask=live, other=0.0).to(tl.float32)
    t = _tanh(0.7978845608028654 * (z + 0.044715 * z * z * z))
    dt_dz = (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * z * z)
    dgelu = 0.5 * (1.0 + t) + 0.5 * z * dt_dz
    tl.store(DX + offsets, (dy * dgelu).to(DX.dtype.element_ty), mask=live)


def _grid(numel: int):
    return (triton.cdiv(numel, ELEMENTWISE_BLOCK),)


def _bias_gelu_fwd(x, bias, launch) -> torch.Tensor:
    y = _common.new_output(x.shape, x.dtype, x.device)
    if x.numel():
        launch(_common.Launch(_bias_gelu_fwd_kernel, _grid(x.numel()), (x, bias, y, x.numel(), x.shape[-1]),
                              dict(BLOCK=ELEMENTWISE_BLOCK), ELEMENTWISE_WARPS))
    return y


@_common.kernel_op("megatron_fusions::bias_gelu_fwd")
def bias_gelu_fwd(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """x: contiguous [rows, hidden]; bias: [hidden]."""
    return _bias_gelu_fwd(x, bias, _common.run)


@bias_gelu_fwd.register_fake
def _(x, bias):
    return torch.empty_like(x)


def _bias_gelu_bwd(dy, x, bias, launch) -> tuple[torch.Tensor, torch.Tensor]:
    dx = _common.new_output(x.shape, x.dtype, x.device)
    if x.numel():
        launch(_common.Launch(_bias_gelu_bwd_kernel, _grid(x.numel()), (dy, x, bias, dx, x.numel(), x.shape[-1]),
                              dict(BLOCK=ELEMENTWISE_BLOCK), ELEMENTWISE_WARPS))
    dbias = torch.sum(dx, dim=0, dtype=torch.float32).to(bias.dtype)
    return dx, dbias


@_common.kernel_op("megatron_fusions::bias_gelu_bwd")
def bias_gelu_bwd(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns dx (x's dtype) and dbias (bias's dtype; summed over rows in fp32)."""
    return _bias_gelu_bwd(dy, x, bias, _common.run)


@bias_gelu_bwd.register_fake
def _(dy, x, bias):
    return torch.empty_like(x), torch.empty_like(bias)


class BiasGeluFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias):
        x2d = x.reshape(-1, x.shape[-1]).contiguous()
        bias = bias.contiguous()
        ctx.save_for_backward(x2d, bias)
        return bias_gelu_fwd(x2d, bias).view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2d, bias = ctx.saved_tensors
        dx, dbias = bias_gelu_bwd(dy.reshape(x2d.shape).contiguous(), x2d, bias)
        return dx.view(dy.shape), dbias


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    _common.check_float("bias_gelu x", x)
    _common.check_float("bias_gelu bias", bias)
    return BiasGeluFunction.apply(x, bias)
