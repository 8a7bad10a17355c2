"""Vocab-parallel cross entropy bound to the tensor-parallel group.

Each TP rank holds logits for its vocabulary slice [.., V/tp]; megatron_core.fusions.cross_entropy
reduces the max, the target logit and the sum of exponentials once each across the group and
returns softmax minus one-hot as the gradient, without gathering the full logits.
"""

from __future__ import annotations

import torch

from megatron_core import parallel_state
from megatron_core.fusions import cross_entropy


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor, labels: torch.Tensor, *, backend: str = "torch", inplace: bool = False
) -> torch.Tensor:
    """Per-token loss (float32, labels' shape) from this TP rank's vocabulary slice of the logits
    (overwritten when `inplace`: the model's loss, whose logits nothing else reads)."""
    vocab_start_index = parallel_state.get_tensor_model_parallel_rank() * vocab_parallel_logits.size(-1)
    return cross_entropy(
        vocab_parallel_logits,
        labels,
        group=parallel_state.get_tensor_model_parallel_group(),
        vocab_start_index=vocab_start_index,
        backend=backend,
        inplace=inplace,
    )
