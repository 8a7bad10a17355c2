"""LayerNorm over the last dimension: one program per block of rows forward; backward with per-program partial
sums of dweight/dbias (rows split into contiguous groups, one fp32 partial row per group, reduced after)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_core.fusions.triton_kernels import _common


@triton.jit
def _layer_norm_fwd_kernel(X, W, B, Y, Mean, Rstd, n_rows, n_cols, eps,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    live = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    offsets = rows[:, None] * n_cols + cols[None, :]
    x = tl.load(X + offsets, mask=live, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / n_cols
    centered = tl.where(live, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=1) / n_cols + eps)
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    y = centered * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(Y + offsets, y.to(Y.dtype.element_ty), mask=live)
    tl.store(Mean + rows, mean, mask=rows < n_rows)
    tl.store(Rstd + rows, rstd, mask=rows < n_rows)


@triton.jit
def _layer_norm_bwd_kernel(DY, X, W, Mean, Rstd, DX, DW_partial, DB_partial, n_rows, n_cols,
                           blocks_per_program, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program g handles row blocks [g * blocks_per_program, (g + 1) * blocks_per_program) and writes
    its fp32 partial dweight/dbias to row g of the partial buffers."""
    group = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    first = group.to(tl.int64) * blocks_per_program * BLOCK_M
    for i in range(0, blocks_per_program):
        rows = first + i * BLOCK_M + tl.arange(0, BLOCK_M)
        live = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
        offsets = rows[:, None] * n_cols + cols[None, :]
        x = tl.load(X + offsets, mask=live, other=0.0).to(tl.float32)
        dy = tl.load(DY + offsets, mask=live, other=0.0).to(tl.float32)
        mean = tl.load(Mean + rows, mask=rows < n_rows, other=0.0)
        rstd = tl.load(Rstd + rows, mask=rows < n_rows, other=0.0)
        xhat = tl.where(live, (x - mean[:, None]) * rstd[:, None], 0.0)
        wdy = w[None, :] * dy
        mean_wdy_xhat = tl.sum(wdy * xhat, axis=1) / n_cols
        mean_wdy = tl.sum(wdy, axis=1) / n_cols
        dx = (wdy - (xhat * mean_wdy_xhat[:, None] + mean_wdy[:, None])) * rstd[:, None]
        tl.store(DX + offsets, dx.to(DX.dtype.element_ty), mask=live)
        dw += tl.sum(dy * xhat, axis=0)
        db += tl.sum(dy, axis=0)
    tl.store(DW_partial + group * n_cols + cols, dw, mask=cols < n_cols)
    tl.store(DB_partial + group * n_cols + cols, db, mask=cols < n_cols)


def _layer_norm_fwd(x, weight, bias, eps: float, launch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, n_cols = x.shape
    block = _common.row_block(n_cols, "layer_norm hidden size")
    y = _common.new_output((rows, n_cols), x.dtype, x.device)
    mean = _common.new_output((rows,), torch.float32, x.device)
    rstd = _common.new_output((rows,), torch.float32, x.device)
    block_m = _common.rows_per_block(block)
    if rows:
        launch(_common.Launch(_layer_norm_fwd_kernel, (triton.cdiv(rows, block_m),),
                              (x, weight, bias, y, mean, rstd, rows, n_cols, eps),
                              dict(BLOCK_M=block_m, BLOCK_N=block), _common.warps_for(block_m * block)))
    return y, mean, rstd


@_common.kernel_op("megatron_fusions::layer_norm_fwd")
def layer_norm_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: contiguous [rows, n]. Returns y [rows, n] (x's dtype), mean and rstd [rows] (fp32)."""
    return _layer_norm_fwd(x, weight, bias, eps, _common.run)


@layer_norm_fwd.register_fake
def _(x, weight, bias, eps):
    rows = x.shape[0]
    return torch.empty_like(x), x.new_empty((rows,), dtype=torch.float32), x.new_empty((rows,), dtype=torch.float32)


def _layer_norm_bwd(dy, x, weight, mean, rstd, launch, sm_count: int):
    """`sm_count`: the device's multiprocessors; the rows are split into about 8 groups per SM.
    Small programs (about 1024 elements a step, 4 warps) so that many fit on an SM at once: each one walks
    its rows in a serial loop, and with the forward's 4096-element, 16-warp programs (74 registers a thread on
    sm_90, one program per SM) an H200 took 0.25 ms a call at [12288, 768], waiting on each step's loads."""
    rows, n_cols = x.shape
    block = _common.row_block(n_cols, "layer_norm hidden size")
    block_m = _common.rows_per_block(block, elements=1024)
    row_blocks = triton.cdiv(rows, block_m)
    groups = max(1, min(row_blocks, 8 * sm_count))
    blocks_per_program = max(1, triton.cdiv(row_blocks, groups))
    groups = max(1, triton.cdiv(row_blocks, blocks_per_program))
    dx = _common.new_output((rows, n_cols), x.dtype, x.device)
    dw_partial = _common.new_output((groups, n_cols), torch.float32, x.device)
    db_partial = _common.new_output((groups, n_cols), torch.float32, x.device)
    if rows:
        launch(_common.Launch(_layer_norm_bwd_kernel, (groups,),
                              (dy, x, weight, mean, rstd, dx, dw_partial, db_partial, rows, n_cols,
                               blocks_per_program),
                              dict(BLOCK_M=block_m, BLOCK_N=block), _common.warps_for(block_m * block)))
    else:
        dw_partial.zero_()
        db_partial.zero_()
    return dx, dw_partial.sum(0).to(weight.dtype), db_partial.sum(0).to(weight.dtype)


@_common.kernel_op("megatron_fusions::layer_norm_bwd")
def layer_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor,
                   rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns dx (x's dtype), dweight and dbias (weight's dtype)."""
    return _layer_norm_bwd(dy, x, weight, mean, rstd, _common.run, _common.sm_count(x.device))


@layer_norm_bwd.register_fake
def _(dy, x, weight, mean, rstd):
    return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(weight)


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        shape = x.shape
        x2d = x.reshape(-1, shape[-1]).contiguous()
        y, mean, rstd = layer_norm_fwd(x2d, weight.contiguous(), bias.contiguous(), eps)
        ctx.save_for_backward(x2d, weight, mean, rstd)
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = layer_norm_bwd(dy.reshape(x2d.shape).contiguous(), x2d, weight.contiguous(), mean, rstd)
        return dx.view(dy.shape), dw, db, None


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    for name, tensor in (("x", x), ("weight", weight), ("bias", bias)):
        _common.check_float(f"layer_norm {name}", tensor)
    return LayerNormFunction.apply(x, weight, bias, eps)
