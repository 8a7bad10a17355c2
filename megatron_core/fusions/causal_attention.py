"""Causal self-attention for CPUs (fp32/fp64/bf16): query blocks that never compute the keys they cannot see.

torch's CPU kernel behind F.scaled_dot_product_attention spends most of its time outside the matrix
multiplies at GPT shapes (head_dim 32-64, sequences of a few hundred). This computes, for each block of 64
query rows, softmax(q k^T / sqrt(d)) v against only the keys at or before the block's last row, so the
key blocks wholly above the diagonal are skipped, and runs its own backward from the saved probabilities:
dS = P (dP - rowsum(dP P)), in one aten pass (softmax's own backward, which works in fp32 for bf16). One copy lays
q, k, v out for the batched multiplies (q pre-scaled), and the output and the qkv gradient are written straight into
their final layouts.

It keeps the probabilities for the backward: about b * heads * s^2 * (nb + 1) / (2 nb) floats per layer (nb query
blocks; exact when s is a multiple of 64), which a CPU has room for at the sequence lengths it trains; GPUs use
SDPA's flash kernels. No dropout on the probabilities: the model calls SDPA while attention dropout is active.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from megatron_core.errors import UserError

# Query rows per block: best or tied among 32/64/128 in scratch timings at head_dim 32 and 64 (2-core AVX2).
BLOCK_ROWS = 64
# bf16 multiplies (AMX/AVX512-BF16) pay more per call than they save on the skipped blocks: at b 2, 12 heads,
# s 256, d 64, forward and backward took 6.9 ms in blocks of 64 rows, 5.4 in 128, 4.6 in 256 (SDPA: 9.1).
BLOCK_ROWS_16BIT = 256
SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.bfloat16)

_MASKS: dict = {}


def _upper_mask(n: int, dtype: torch.dtype) -> torch.Tensor:
    """[n, n] additive causal mask: -inf above the diagonal (a key after the query), 0 elsewhere."""
    mask = _MASKS.get((n, dtype))
    if mask is None:
        mask = _MASKS[(n, dtype)] = torch.full((n, n), float("-inf"), dtype=dtype).triu_(1)
    return mask


def block_rows(dtype: torch.dtype) -> int:
    return BLOCK_ROWS_16BIT if dtype == torch.bfloat16 else BLOCK_ROWS


def _blocks(s: int, dtype: torch.dtype) -> list[tuple[int, int]]:
    rows = block_rows(dtype)
    return [(start, min(start + rows, s)) for start in range(0, s, rows)]


class _BlockedCausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
        s, b = qkv.shape[:2]
        bh = b * heads
        # [s, b, heads * (q|k|v) * d] -> [3, b*heads, s, d], one copy; q scaled so dK needs no scaling
        # A fresh buffer, never a view of qkv (for s == b*heads == 1 `.contiguous()` would return one and
        # the scaling below would write into the caller's tensor).
        x = torch.empty(3, bh, s, head_dim, dtype=qkv.dtype, device=qkv.device)
        x.copy_(qkv.reshape(s, bh, 3, head_dim).permute(2, 1, 0, 3))
        x[0].mul_(1.0 / math.sqrt(head_dim))
        q, k, v = x.unbind(0)
        out = torch.empty(s, bh, head_dim, dtype=qkv.dtype, device=qkv.device)  # the context's own layout
        probs = []
        for start, end in _blocks(s, qkv.dtype):
            scores = torch.bmm(q[:, start:end], k[:, :end].transpose(1, 2))  # [bh, rows, end]
            scores[:, :, start:end].add_(_upper_mask(end - start, qkv.dtype))
            p = torch.softmax(scores, dim=-1)
            out[start:end] = torch.bmm(p, v[:, :end]).transpose(0, 1)
            probs.append(p)
        context = out.view(s, b, heads * head_dim)
        ctx.save_for_backward(x, *probs)
        ctx.head_dim, ctx.qkv_shape = head_dim, qkv.shape
        return context

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, *probs = ctx.saved_tensors
        q, k, v = x.unbind(0)
        bh, s, d = q.shape
        grad_out = grad.reshape(s, bh, d).transpose(0, 1).contiguous()  # [bh, s, d]
        grad_qkv = torch.empty(s, bh, 3, d, dtype=grad.dtype, device=grad.device)  # qkv's own layout
        grad_q = grad_qkv.permute(2, 1, 0, 3)[0]  # [bh, s, d] view
        grad_k = grad_v = None
        # The last block sees every key: its products start the key/value gradients, the others add in.
        for (start, end), p in reversed(list(zip(_blocks(s, x.dtype), probs))):
            g = grad_out[:, start:end]
            dscores = torch._softmax_backward_data(torch.bmm(g, v[:, :end].transpose(1, 2)), p, -1, p.dtype)
            torch.mul(torch.bmm(dscores, k[:, :end]), 1.0 / math.sqrt(ctx.head_dim), out=grad_q[:, start:end])
            dv, dk = torch.bmm(p.transpose(1, 2), g), torch.bmm(dscores.transpose(1, 2), q[:, start:end])
            if grad_k is None:
                grad_k, grad_v = dk, dv
            else:
                grad_k[:, :end] += dk
                grad_v[:, :end] += dv
        grad_qkv[:, :, 1] = grad_k.transpose(0, 1)
        grad_qkv[:, :, 2] = grad_v.transpose(0, 1)
        return grad_qkv.view(ctx.qkv_shape), None, None


def blocked_causal_attention(qkv: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """softmax(q k^T / sqrt(d), causal) v from the fused projection qkv [s, b, heads * 3 * d] (per head: its q,
    then k, then v rows, Megatron's layout) to the context [s, b, heads * d]."""
    if qkv.dim() != 3 or qkv.shape[-1] != heads * 3 * head_dim:
        raise UserError("blocked_causal_attention takes qkv [s, b, heads * 3 * head_dim] = "
                        f"[s, b, {heads * 3 * head_dim}], "
                        f"got {tuple(qkv.shape)}")
    if qkv.device.type != "cpu" or qkv.dtype not in SUPPORTED_DTYPES:
        raise UserError(f"blocked causal attention runs on a CPU in fp32/fp64/bf16, got {qkv.dtype} on {qkv.device}; "
                        "use attention_backend sdpa (or auto) there")
    return _BlockedCausalAttention.apply(qkv, heads, head_dim)
