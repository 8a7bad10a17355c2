"""Megatron's scaled upper-triangular masked softmax: probs = softmax(scale * scores) over the last dim,
where key j > query i is masked (probability exactly 0). Rows of [b, np, sq, sk] are processed in blocks;
query index i = row % sq. Masked elements are never read."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_core.fusions.triton_kernels import _common


@triton.jit
def _causal_softmax_fwd_kernel(S, Y, n_rows, sq, sk, scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    query = rows % sq
    in_tensor = (rows[:, None] < n_rows) & (cols[None, :] < sk)
    visible = in_tensor & (cols[None, :] <= query[:, None])
    offsets = rows[:, None] * sk + cols[None, :]
    s = tl.load(S + offsets, mask=visible, other=0.0).to(tl.float32)
    s = tl.where(visible, s * scale, float("-inf"))
    # Padding rows past n_rows see nothing: give them a finite max and a unit denominator (never stored).
    row_max = tl.where(rows < n_rows, tl.max(s, axis=1), 0.0)
    e = tl.where(visible, tl.exp(s - row_max[:, None]), 0.0)
    denominator = tl.sum(e, axis=1)
    denominator = tl.where(rows < n_rows, denominator, 1.0)
    tl.store(Y + offsets, (e / denominator[:, None]).to(Y.dtype.element_ty), mask=in_tensor)


@triton.jit
def _causal_softmax_bwd_kernel(DY, Y, DS, n_rows, sq, sk, scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    query = rows % sq
    in_tensor = (rows[:, None] < n_rows) & (cols[None, :] < sk)
    visible = in_tensor & (cols[None, :] <= query[:, None])
    offsets = rows[:, None] * sk + cols[None, :]
    y = tl.load(Y + offsets, mask=visible, other=0.0).to(tl.float32)
    dy = tl.load(DY + offsets, mask=visible, other=0.0).to(tl.float32)
    dot = tl.sum(y * dy, axis=1)
    ds = scale * y * (dy - dot[:, None])
    tl.store(DS + offsets, ds.to(DS.dtype.element_ty), mask=in_tensor)


def _launch_rows(kernel, tensors, sq, sk, scale, launch):
    """Launch `kernel` over the rows of `tensors` (the pointer arguments, all shaped [..., sq, sk])."""
    rows = tensors[0].numel() // sk if sk else 0
    block = _common.row_block(sk, "softmax key length")
    block_m = _common.rows_per_block(block)
    if rows:
        launch(
            _common.Launch(
                kernel,
                (triton.cdiv(rows, block_m),),
                (*tensors, rows, sq, sk, scale),
                dict(BLOCK_M=block_m, BLOCK_N=block),
                _common.warps_for(block_m * block),
            )
        )


def _causal_softmax_fwd(scores, scale: float, launch) -> torch.Tensor:
    probs = _common.new_output(scores.shape, scores.dtype, scores.device)
    _launch_rows(_causal_softmax_fwd_kernel, (scores, probs), scores.shape[-2], scores.shape[-1], scale, launch)
    return probs


def _causal_softmax_bwd(dprobs, probs, scale: float, launch) -> torch.Tensor:
    dscores = _common.new_output(probs.shape, probs.dtype, probs.device)
    _launch_rows(_causal_softmax_bwd_kernel, (dprobs, probs, dscores), probs.shape[-2], probs.shape[-1], scale, launch)
    return dscores


@_common.kernel_op("megatron_fusions::causal_softmax_fwd")
def causal_softmax_fwd(scores: torch.Tensor, scale: float) -> torch.Tensor:
    """scores: contiguous [..., sq, sk] with sq == sk."""
    return _causal_softmax_fwd(scores, scale, _common.run)


@causal_softmax_fwd.register_fake
def _(scores, scale):  # noqa: ARG001 - a fake takes the op's arguments
    return torch.empty_like(scores)


@_common.kernel_op("megatron_fusions::causal_softmax_bwd")
def causal_softmax_bwd(dprobs: torch.Tensor, probs: torch.Tensor, scale: float) -> torch.Tensor:
    return _causal_softmax_bwd(dprobs, probs, scale, _common.run)


@causal_softmax_bwd.register_fake
def _(dprobs, probs, scale):  # noqa: ARG001 - a fake takes the op's arguments
    return torch.empty_like(probs)


class ScaledCausalSoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores, scale):
        probs = causal_softmax_fwd(scores.contiguous(), scale)
        ctx.save_for_backward(probs)
        ctx.scale = scale
        return probs

    @staticmethod
    def backward(ctx, dprobs):
        (probs,) = ctx.saved_tensors
        return causal_softmax_bwd(dprobs.contiguous(), probs, ctx.scale), None


def scaled_causal_softmax(scores: torch.Tensor, scale: float) -> torch.Tensor:
    _common.check_float("scaled_causal_softmax scores", scores)
    return ScaledCausalSoftmaxFunction.apply(scores, float(scale))
