"""Vocab-parallel cross entropy bound to the tensor-parallel group.

Each TP rank holds logits for its vocabulary slice [.., V/tp]; the max, the target logit and the
sum of exponentials are each reduced once across TP, and the gradient is softmax minus one-hot,
all without gathering the full logits.

The fused implementation (megatron_core.fusions.cross_entropy) is used when that module
provides it; until then the PyTorch reference below runs (interface seam: same arguments).
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist

from megatron_core import parallel_state


class _VocabParallelCrossEntropyReference(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, group, vocab_start_index):
        logits = logits.float()
        parallel = group is not None and dist.get_world_size(group) > 1
        logits_max = logits.max(dim=-1).values
        if parallel:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)
        vocab_local = logits.size(-1)
        outside = (labels < vocab_start_index) | (labels >= vocab_start_index + vocab_local)
        local_labels = (labels - vocab_start_index).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if parallel:
            # One reduce for both: the target logit lives on exactly one rank.
            both = torch.stack([target_logit, sum_exp])
            dist.all_reduce(both, group=group)
            target_logit, sum_exp = both[0], both[1]
        loss = sum_exp.log() - target_logit
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_labels, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_labels, outside = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local_labels.unsqueeze(-1), -(~outside).to(grad.dtype).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, labels: torch.Tensor, *,
                                 backend: str = "torch") -> torch.Tensor:
    """Per-token loss (float32, labels' shape) from this rank's vocabulary slice of the logits."""
    group = parallel_state.get_tensor_model_parallel_group()
    vocab_start_index = parallel_state.get_tensor_model_parallel_rank() * vocab_parallel_logits.size(-1)
    try:
        from megatron_core.fusions import cross_entropy as fused_cross_entropy
    except ImportError:
        fused_cross_entropy = None
    if isinstance(fused_cross_entropy, types.ModuleType):  # the submodule, not the function
        fused_cross_entropy = getattr(fused_cross_entropy, "cross_entropy", None)
    if fused_cross_entropy is not None:
        return fused_cross_entropy(vocab_parallel_logits, labels, group=group,
                                   vocab_start_index=vocab_start_index, backend=backend)
    return _VocabParallelCrossEntropyReference.apply(vocab_parallel_logits, labels, group, vocab_start_index)
