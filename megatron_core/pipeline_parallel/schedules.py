"""Forward/backward schedules. The training loop calls, for every iteration,

    losses = forward_backward_func(forward_step_func, data_iterator, model, num_microbatches,
                                   seq_length=..., micro_batch_size=..., forward_only=False,
                                   loss_scale=1.0)

`forward_step_func(data_iterator, model) -> (output_tensor, loss_func)`, and
`loss_func(output_tensor) -> (loss, {"lm loss": detached loss})`. Each micro batch's loss is
divided by num_microbatches (gradient accumulation to the global batch) and multiplied by
loss_scale before backward. Returns the per-microbatch loss dicts (on the last pipeline stage;
an empty list elsewhere).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch


def forward_backward_no_pipelining(forward_step_func: Callable, data_iterator, model: torch.nn.Module,
                                   num_microbatches: int, *, seq_length: int, micro_batch_size: int,
                                   forward_only: bool = False, loss_scale: float = 1.0) -> list[dict]:
    del seq_length, micro_batch_size  # shapes only matter for pipeline communication
    losses = []
    # A DDP wrapper may offer `no_sync()` to delay the gradient all-reduce to the last micro batch.
    no_sync = getattr(model, "no_sync", None)
    for index in range(num_microbatches):
        last = index == num_microbatches - 1
        context = no_sync() if (no_sync is not None and not last and not forward_only) else contextlib.nullcontext()
        with context, torch.set_grad_enabled(not forward_only):
            output_tensor, loss_func = forward_step_func(data_iterator, model)
            loss, loss_dict = loss_func(output_tensor)
            if not forward_only:
                (loss * (loss_scale / num_microbatches)).backward()
        losses.append(loss_dict)
    return losses


def get_forward_backward_func() -> Callable:
    """The schedule for this process's layout (PP = 1 here; the 1F1B schedule plugs in for PP > 1)."""
    from megatron_core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        raise NotImplementedError("pipeline-parallel schedule (1F1B) is not available yet; use PP = 1")
    return forward_backward_no_pipelining
