"""residual + dropout(x + bias) with a counter-based mask: element i is kept when
philox(seed, i) >= p, so the backward regenerates the mask from the seed instead of storing it, and the
same seed always gives the same mask. The seed lives in a 1-element int64 device tensor, so drawing it
from the device's generator (respecting a forked CUDA RNG state) needs no host synchronisation."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_core.fusions.triton_kernels import _common

ELEMENTWISE_BLOCK = 4096
ELEMENTWISE_WARPS = _common.warps_for(ELEMENTWISE_BLOCK)  # 16: 8 elements per thread (4 warps spilled)
_INT32_LIMIT = 2**31 - 1


@triton.jit
def _kept(seed_ptr, offsets, p, WIDE_OFFSETS: tl.constexpr):
    seed = tl.load(seed_ptr)
    if WIDE_OFFSETS:
        uniform = tl.rand(seed, offsets)
    else:
        uniform = tl.rand(seed, offsets.to(tl.int32))  # 32-bit Philox counters: cheaper, enough below 2**31
    return uniform >= p


@triton.jit
def _bias_dropout_add_fwd_kernel(X, B, R, Y, Seed, numel, hidden, p, scale, HAS_BIAS: tl.constexpr,
                                 DROPOUT: tl.constexpr, WIDE_OFFSETS: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offsets = start + tl.arange(0, BLOCK)
    live = offsets < numel
    z = tl.load(X + offsets, mask=live, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(B + _common.bias_columns(start, hidden, BLOCK), mask=live, other=0.0).to(tl.float32)
    if DROPOUT:
        z = tl.where(_kept(Seed, offsets, p, WIDE_OFFSETS), z * scale, 0.0)
    y = tl.load(R + offsets, mask=live, other=0.0).to(tl.float32) + z
    tl.store(Y + offsets, y.to(Y.dtype.element_ty), mask=live)


@triton.jit
def _dropout_bwd_kernel(DY, DX, Seed, numel, p, scale, WIDE_OFFSETS: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offsets < numel
    dy = tl.load(DY + offsets, mask=live, other=0.0).to(tl.float32)
    dx = tl.where(_kept(Seed, offsets, p, WIDE_OFFSETS), dy * scale, 0.0)
    tl.store(DX + offsets, dx.to(DX.dtype.element_ty), mask=live)


@triton.jit
def _keep_mask_kernel(M, Seed, numel, p, WIDE_OFFSETS: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    kept = _kept(Seed, offsets, p, WIDE_OFFSETS)
    tl.store(M + offsets, kept.to(tl.int8), mask=offsets < numel)


def _grid(numel: int):
    return (triton.cdiv(numel, ELEMENTWISE_BLOCK),)


def _scale(p: float) -> float:
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


def _bias_dropout_add_fwd(x, bias, residual, seed, p: float, dropout: bool, launch) -> torch.Tensor:
    y = _common.new_output(x.shape, x.dtype, x.device)
    numel = x.numel()
    if numel:
        launch(_common.Launch(
            _bias_dropout_add_fwd_kernel, _grid(numel),
            (x, bias if bias is not None else x, residual, y, seed, numel, x.shape[-1], p, _scale(p)),
            dict(HAS_BIAS=bias is not None, DROPOUT=dropout, WIDE_OFFSETS=numel > _INT32_LIMIT,
                 BLOCK=ELEMENTWISE_BLOCK), ELEMENTWISE_WARPS))
    return y


@_common.kernel_op("megatron_fusions::bias_dropout_add_fwd")
def bias_dropout_add_fwd(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, seed: torch.Tensor,
                         p: float, dropout: bool) -> torch.Tensor:
    """x, residual: contiguous [rows, hidden]; bias: [hidden] or None; seed: int64 [1] on x's device."""
    return _bias_dropout_add_fwd(x, bias, residual, seed, p, dropout, _common.run)


@bias_dropout_add_fwd.register_fake
def _(x, bias, residual, seed, p, dropout):
    return torch.empty_like(x)


def _dropout_bwd(dy, seed, p: float, launch) -> torch.Tensor:
    dx = _common.new_output(dy.shape, dy.dtype, dy.device)
    numel = dy.numel()
    if numel:
        launch(_common.Launch(_dropout_bwd_kernel, _grid(numel), (dy, dx, seed, numel, p, _scale(p)),
                              dict(WIDE_OFFSETS=numel > _INT32_LIMIT, BLOCK=ELEMENTWISE_BLOCK), ELEMENTWISE_WARPS))
    return dx


@_common.kernel_op("megatron_fusions::dropout_bwd")
def dropout_bwd(dy: torch.Tensor, seed: torch.Tensor, p: float) -> torch.Tensor:
    """Gradient through the dropout: dy * mask / (1 - p), the mask regenerated from `seed`."""
    return _dropout_bwd(dy, seed, p, _common.run)


@dropout_bwd.register_fake
def _(dy, seed, p):
    return torch.empty_like(dy)


def _keep_mask(shape, p: float, seed: torch.Tensor, launch) -> torch.Tensor:
    numel = 1
    for size in shape:
        numel *= size
    mask = _common.new_output((numel,), torch.int8, seed.device)
    if numel:
        launch(_common.Launch(_keep_mask_kernel, _grid(numel), (mask, seed, numel, p),
                              dict(WIDE_OFFSETS=numel > _INT32_LIMIT, BLOCK=ELEMENTWISE_BLOCK), ELEMENTWISE_WARPS))
    return mask.view(shape).bool()


def keep_mask(shape, p: float, seed: torch.Tensor) -> torch.Tensor:
    """The boolean keep-mask the kernels use for `seed` (for tests and debugging)."""
    return _keep_mask(shape, p, seed, _common.run)


def seed_tensor(generator_seed: int | None, device: torch.device) -> torch.Tensor:
    """The kernel seed: the given integer, or a fresh draw from the default generator of `device`."""
    if generator_seed is None:
        return torch.randint(0, _INT32_LIMIT, (1,), dtype=torch.int64, device=device)
    return torch.tensor([int(generator_seed)], dtype=torch.int64, device=device)


class BiasDropoutAddFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, residual, p, dropout, seed):
        x2d = x.reshape(-1, x.shape[-1]).contiguous()
        residual2d = residual.reshape(x2d.shape).contiguous()
        y = bias_dropout_add_fwd(x2d, None if bias is None else bias.contiguous(), residual2d, seed, p, dropout)
        ctx.save_for_backward(seed)
        ctx.p, ctx.dropout = p, dropout
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        (seed,) = ctx.saved_tensors
        dy2d = dy.reshape(-1, dy.shape[-1]).contiguous()
        dx = dropout_bwd(dy2d, seed, ctx.p) if ctx.dropout else dy2d
        dbias = None if ctx.bias_dtype is None else torch.sum(dx, dim=0, dtype=torch.float32).to(ctx.bias_dtype)
        return dx.view(dy.shape), dbias, dy, None, None, None


def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float, training: bool,
                     generator_seed: int | None = None) -> torch.Tensor:
    for name, tensor in (("x", x), ("bias", bias), ("residual", residual)):
        if tensor is not None:
            _common.check_float(f"bias_dropout_add {name}", tensor)
    dropout = bool(training) and p > 0.0
    seed = seed_tensor(generator_seed, x.device) if dropout else torch.zeros(1, dtype=torch.int64, device=x.device)
    return BiasDropoutAddFunction.apply(x, bias, residual, float(p), dropout, seed)
