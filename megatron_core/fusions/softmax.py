"""Megatron's scaled upper-triangular masked softmax for the explicit (unfused) attention path."""

from __future__ import annotations

import torch

from megatron_core.errors import UserError
from megatron_core.fusions.backends import choose_backend


def causal_mask(sq: int, sk: int, device) -> torch.Tensor:
    """True where key j lies in the future of query i (j > i): those probabilities are 0."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(diagonal=1)


def scaled_causal_softmax_reference(scores: torch.Tensor, scale: float) -> torch.Tensor:
    """fp32 softmax of scale * scores with the causal mask, returned in the scores' dtype."""
    masked = (scores.float() * scale).masked_fill(causal_mask(*scores.shape[-2:], scores.device), float("-inf"))
    return torch.softmax(masked, dim=-1).to(scores.dtype)


def scaled_causal_softmax(scores: torch.Tensor, scale: float, backend: str = "auto") -> torch.Tensor:
    """softmax(scale * scores) over the keys of attention scores [b, np, sq, sk] (sq == sk), with key j > query
    i masked to probability 0. Non-contiguous scores are accepted (the Triton path copies them contiguous)."""
    if scores.dim() != 4 or scores.shape[-1] != scores.shape[-2]:
        raise UserError(
            f"scaled_causal_softmax takes scores [b, np, sq, sk] with sq == sk (self-attention), "
            f"got {tuple(scores.shape)}"
        )
    chosen = choose_backend("softmax", backend, scores.device)
    if chosen == "triton":
        # Lazy: the kernel module imports triton (optional; its import fixes TRITON_INTERPRET for the process).
        from megatron_core.fusions.triton_kernels.softmax import scaled_causal_softmax as triton_softmax

        return triton_softmax(scores, scale)
    return scaled_causal_softmax_reference(scores, scale)
