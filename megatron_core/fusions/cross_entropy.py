"""Per-token cross entropy, vocab-parallel aware (Megatron's _VocabParallelCrossEntropy semantics).

With a tensor-parallel `group`, `logits` are this rank's vocab shard [vocab_start_index, + V_local); the
row max, the target logit and the sum of exponentials are each all-reduced once across the group, and the
gradient is the local shard of softmax - onehot (no communication in backward). Labels must be valid
global vocab ids; mask tokens out with a loss mask afterwards (there is no ignore_index). The loss is fp32.
"""

from __future__ import annotations

import torch

from megatron_core.errors import UserError
from megatron_core.fusions._collectives import all_reduce_max, all_reduce_sum
from megatron_core.fusions.backends import choose_backend


class VocabParallelCrossEntropy(torch.autograd.Function):
    """The torch backend, in fp32 and in as few passes over the logits as plain PyTorch allows.

    Forward: exp(x - max) is computed once into one fp32 buffer (the row max all-reduced across TP),
    summed, and the sum is all-reduced together with the target logit. The buffer is saved; backward
    turns it into (softmax - onehot) x grad in place, so the exponentials are computed once per step
    and no other tensor the size of the logits is made. With `inplace` (fp32 logits that nothing else
    reads, as in the model's loss) that buffer is the logits tensor itself, as in Megatron.
    """

    @staticmethod
    def forward(ctx, logits, labels, group, vocab_start_index, inplace=False):
        ctx.logits_dtype = logits.dtype
        local_labels = labels.to(torch.int64) - vocab_start_index
        in_shard = (local_labels >= 0) & (local_labels < logits.shape[-1])
        safe_labels = torch.where(in_shard, local_labels, torch.zeros_like(local_labels))
        global_max = all_reduce_max(logits.amax(dim=-1).float(), group)
        target = logits.gather(-1, safe_labels.unsqueeze(-1)).squeeze(-1).float() - global_max
        if logits.dtype != torch.float32:
            # 16-bit: one fp32 copy, then in place; a mixed-dtype sub on a CPU casts into a temporary of
            # that size first and writes a second one (two fresh 8 MB buffers per micro batch at 512 x 4096)
            exp_logits = logits.float().sub_(global_max.unsqueeze(-1)).exp_()
        elif inplace:
            exp_logits = logits.sub_(global_max.unsqueeze(-1)).exp_()  # no fresh buffer to fault in
        else:
            exp_logits = torch.sub(logits, global_max.unsqueeze(-1)).exp_()
        sum_exp, target = all_reduce_sum(torch.stack([exp_logits.sum(dim=-1), target * in_shard]), group).unbind(0)
        ctx.save_for_backward(exp_logits, sum_exp, safe_labels, in_shard)
        ctx.backward_done = False
        return torch.log(sum_exp) - target

    @staticmethod
    def backward(ctx, dloss):
        if ctx.backward_done:
            raise RuntimeError(
                "cross_entropy (torch backend) reuses its saved buffer for the gradient; "
                "it cannot be backpropagated twice (retain_graph)"
            )
        ctx.backward_done = True
        exp_logits, sum_exp, safe_labels, in_shard = ctx.saved_tensors
        dloss = dloss.float()
        grad = exp_logits.mul_((dloss / sum_exp).unsqueeze(-1))  # softmax x grad, in the saved buffer
        grad.scatter_add_(-1, safe_labels.unsqueeze(-1), (-dloss * in_shard).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


def cross_entropy_reference(
    logits: torch.Tensor, labels: torch.Tensor, group=None, vocab_start_index: int = 0, inplace: bool = False
) -> torch.Tensor:
    return VocabParallelCrossEntropy.apply(logits, labels, group, vocab_start_index, inplace)


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    group=None,
    vocab_start_index: int = 0,
    backend: str = "auto",
    inplace: bool = False,
) -> torch.Tensor:
    """Per-token loss [...] (fp32) of `logits` [..., V_local] against int `labels` [...].
    `inplace=True` lets the torch backend overwrite fp32 `logits` (only when nothing else reads them)."""
    if labels.shape != logits.shape[:-1]:
        raise UserError(
            f"cross_entropy labels {tuple(labels.shape)} must match logits {tuple(logits.shape)} "
            "without its last (vocab) dimension"
        )
    if labels.dtype not in (torch.int64, torch.int32):
        raise UserError(f"cross_entropy labels have dtype {labels.dtype}; pass integer token ids (int64)")
    if int(vocab_start_index) < 0:
        raise UserError(f"vocab_start_index {vocab_start_index} is negative; it is this rank's first vocab id")
    chosen = choose_backend("cross_entropy", backend, logits.device)
    if chosen == "triton":
        # Lazy: the kernel module imports triton (optional; its import fixes TRITON_INTERPRET for the process).
        from megatron_core.fusions.triton_kernels.cross_entropy import cross_entropy as triton_cross_entropy

        return triton_cross_entropy(logits, labels, group, vocab_start_index)
    return cross_entropy_reference(logits, labels, group, int(vocab_start_index), inplace)
