"""Per-token cross entropy over (a vocab shard of) the logits, in fp32 registers, reading the logits in
their own dtype: the forward makes one pass per row (online max and sum-exp, plus the target logit); the
backward writes softmax - onehot, scaled by the incoming gradient, in one more pass. Only [rows] fp32
statistics are ever materialised, never an fp32 copy of the logits.

Vocab parallel: each rank's forward yields its local max m_r, its sum-exp s_r relative to m_r, and its
target logit (0 when the label lies in another shard). Then max is all-reduced (MAX), s_r rescaled to the
global max, and [sum-exp, target] all-reduced (SUM) together: each statistic crosses the group once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_core.fusions._collectives import all_reduce_max, all_reduce_sum
from megatron_core.fusions.triton_kernels import _common

VOCAB_BLOCK = 4096


@triton.jit
def _cross_entropy_fwd_kernel(Logits, Labels, RowMax, RowSumExp, Target, n_cols, vocab_start, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_start = Logits + row * n_cols
    running_max = float("-inf")
    running_sum = 0.0
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_start + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        running_max = new_max
    label = tl.load(Labels + row) - vocab_start
    in_shard = (label >= 0) & (label < n_cols)
    target = tl.load(row_start + tl.where(in_shard, label, 0)).to(tl.float32)
    tl.store(RowMax + row, running_max)
    tl.store(RowSumExp + row, running_sum)
    tl.store(Target + row, tl.where(in_shard, target, 0.0))


@triton.jit
def _cross_entropy_bwd_kernel(Logits, Labels, LogSumExp, DLoss, DLogits, n_cols, vocab_start, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    log_sum_exp = tl.load(LogSumExp + row)
    dloss = tl.load(DLoss + row)
    label = tl.load(Labels + row) - vocab_start
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        live = cols < n_cols
        x = tl.load(Logits + row * n_cols + cols, mask=live, other=0.0).to(tl.float32)
        grad = tl.exp(x - log_sum_exp) - tl.where(cols == label, 1.0, 0.0)
        tl.store(DLogits + row * n_cols + cols, (grad * dloss).to(DLogits.dtype.element_ty), mask=live)


def _vocab_block(n_cols: int) -> int:
    return min(VOCAB_BLOCK, triton.next_power_of_2(max(n_cols, 1)))


def _cross_entropy_fwd(logits, labels, vocab_start: int, launch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, n_cols = logits.shape
    row_max = _common.new_output((rows,), torch.float32, logits.device)
    row_sum_exp = _common.new_output((rows,), torch.float32, logits.device)
    target = _common.new_output((rows,), torch.float32, logits.device)
    if rows:
        block = _vocab_block(n_cols)
        launch(
            _common.Launch(
                _cross_entropy_fwd_kernel,
                (rows,),
                (logits, labels, row_max, row_sum_exp, target, n_cols, vocab_start),
                dict(BLOCK_V=block),
                _common.warps_for(block),
            )
        )
    return row_max, row_sum_exp, target


def _cross_entropy_bwd(logits, labels, log_sum_exp, dloss, vocab_start: int, launch) -> torch.Tensor:
    rows, n_cols = logits.shape
    dlogits = _common.new_output((rows, n_cols), logits.dtype, logits.device)
    if rows:
        block = _vocab_block(n_cols)
        launch(
            _common.Launch(
                _cross_entropy_bwd_kernel,
                (rows,),
                (logits, labels, log_sum_exp, dloss, dlogits, n_cols, vocab_start),
                dict(BLOCK_V=block),
                _common.warps_for(block),
            )
        )
    return dlogits


@_common.kernel_op("megatron_fusions::cross_entropy_fwd")
def cross_entropy_fwd(
    logits: torch.Tensor, labels: torch.Tensor, vocab_start: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits: contiguous [rows, V_local]; labels: int64 [rows]. Returns the local row max, the local
    sum of exp(logit - local max) and the target logit (0 outside this shard), all fp32 [rows]."""
    return _cross_entropy_fwd(logits, labels, vocab_start, _common.run)


@cross_entropy_fwd.register_fake
def _(logits, labels, vocab_start):  # noqa: ARG001 - a fake takes the op's arguments
    rows = logits.shape[0]
    return tuple(logits.new_empty((rows,), dtype=torch.float32) for _ in range(3))


@_common.kernel_op("megatron_fusions::cross_entropy_bwd")
def cross_entropy_bwd(
    logits: torch.Tensor, labels: torch.Tensor, log_sum_exp: torch.Tensor, dloss: torch.Tensor, vocab_start: int
) -> torch.Tensor:
    """d loss / d logits = (softmax - onehot) * dloss, in the logits' dtype."""
    return _cross_entropy_bwd(logits, labels, log_sum_exp, dloss, vocab_start, _common.run)


@cross_entropy_bwd.register_fake
def _(logits, labels, log_sum_exp, dloss, vocab_start):  # noqa: ARG001 - a fake takes the op's arguments
    return torch.empty_like(logits)


class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, group, vocab_start):
        logits2d = logits.reshape(-1, logits.shape[-1]).contiguous()
        labels1d = labels.reshape(-1).to(torch.int64).contiguous()
        local_max, sum_exp, target = cross_entropy_fwd(logits2d, labels1d, vocab_start)
        global_max = all_reduce_max(local_max.clone(), group)
        sum_exp = sum_exp * torch.exp(local_max - global_max)
        sum_exp, target = all_reduce_sum(torch.stack([sum_exp, target]), group).unbind(0)
        log_sum_exp = torch.log(sum_exp) + global_max
        ctx.save_for_backward(logits2d, labels1d, log_sum_exp)
        ctx.vocab_start = vocab_start
        return (log_sum_exp - target).view(labels.shape)

    @staticmethod
    def backward(ctx, dloss):
        logits2d, labels1d, log_sum_exp = ctx.saved_tensors
        dloss1d = dloss.reshape(-1).to(torch.float32).contiguous()
        dlogits = cross_entropy_bwd(logits2d, labels1d, log_sum_exp, dloss1d, ctx.vocab_start)
        return dlogits.view(*dloss.shape, logits2d.shape[-1]), None, None, None


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, group, vocab_start_index: int) -> torch.Tensor:
    _common.check_float("cross_entropy logits", logits)
    return CrossEntropyFunction.apply(logits, labels, group, int(vocab_start_index))
