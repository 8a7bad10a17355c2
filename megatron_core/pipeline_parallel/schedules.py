"""Forward/backward schedules over the micro batches of one iteration.

THE CONTRACT (the training loop codes to this; both schedules below honour it):

    forward_backward(forward_step_func, data_iterator, model, num_microbatches, *,
                     seq_length, micro_batch_size, forward_only=False, loss_scale=1.0)
        -> list[dict]   # one loss dict per micro batch, in order, on the LAST pipeline stage; [] elsewhere

    forward_step_func(data_iterator, model) -> (output_tensor, loss_func)
        Called exactly `num_microbatches` times per call on every pipeline stage, in micro-batch
        order, so every stage consumes its data iterator identically (stages that need no data
        may pass None and ignore it). It runs `model(...)`: on a non-first stage the schedule has
        already called `model.set_input_tensor(activations_from_previous_stage)`.
        output_tensor: the per-token loss [b, s] on the last stage, hidden states elsewhere.
    loss_func(output_tensor) -> (loss, stats)
        loss: the scalar loss of THIS micro batch (mean over its tokens), with its graph.
        stats: {"lm loss": <detached scalar tensor>, ...}, returned as they are in the list.
        The schedule (not loss_func) divides `loss` by num_microbatches and multiplies by
        loss_scale before the backward, so gradients are the mean over the micro batches of
        this rank times the loss scale. Averaging across data-parallel ranks is grad sync's job.

    forward_only=True: no graph, no backward (evaluation); the loss dicts are still returned.
    After the last backward (forward_only=False) the schedule calls
    `megatron_core.distributed.finalize_model_grads(model)`: it waits for the data-parallel
    gradient reduction, all-reduces sequence-parallel parameters' grads across TP and the tied
    word-embedding grads across the embedding group (first + last stage). The trainer calls
    nothing else between forward_backward and optimizer.step().

    `model` is a GPTModel or the data-parallel wrapper `megatron_core.distributed.
    DistributedDataParallel` around one. With the wrapper, gradient reduction is launched only
    during the backward of the last micro batch (`model.no_sync()` for the others).

    Activations travel between stages as [s, b, h] ([s/tp, b, h] with sequence parallelism)
    in the dtype of the model's parameters; `hidden_size` and `sequence_parallel` are read from
    the model (`model.config`, `model.parallel`) unless given.

Schedules: `forward_backward_no_pipelining` (PP = 1: gradient accumulation over micro batches)
and `forward_backward_pipelining_without_interleaving` (Megatron's 1F1B: stage r runs
min(pp - r - 1, M) warm-up forwards, then one-forward-one-backward, then the cool-down
backwards; any M >= 1).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch

from megatron_core import parallel_state as ps
from megatron_core.pipeline_parallel.p2p import StageLink

LossFunc = Callable[[torch.Tensor], tuple[torch.Tensor, dict]]
ForwardStepFunc = Callable[[Optional[Iterator], Any], tuple[torch.Tensor, LossFunc]]


def _unwrap(model):
    """The GPTModel inside a data-parallel wrapper (or the model itself)."""
    return getattr(model, "module", model)


def _first_param(model) -> torch.Tensor:
    for param in _unwrap(model).parameters():
        if param.is_floating_point():
            return param
    raise ValueError("the model has no floating-point parameters; cannot infer the activation dtype")


def activation_shape(model, seq_length: int, micro_batch_size: int, hidden_size: Optional[int] = None,
                     sequence_parallel: Optional[bool] = None) -> tuple[int, int, int]:
    """Shape of the tensor sent between stages: [s, b, h], or [s/tp, b, h] with sequence parallelism."""
    inner = _unwrap(model)
    if hidden_size is None:
        hidden_size = inner.config.hidden_size
    if sequence_parallel is None:
        sequence_parallel = bool(getattr(getattr(inner, "parallel", None), "sequence_parallel", False))
    tp = ps.get_tensor_model_parallel_world_size()
    seq = seq_length // tp if sequence_parallel else seq_length
    return (seq, micro_batch_size, hidden_size)


class _MicroBatchRunner:
    """Forward and backward of one micro batch on this stage; shared by both schedules."""

    def __init__(self, forward_step_func: ForwardStepFunc, data_iterator, model, num_microbatches: int,
                 forward_only: bool, loss_scale: float):
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1 (got {num_microbatches})")
        self.forward_step_func, self.data_iterator, self.model = forward_step_func, data_iterator, model
        self.num_microbatches, self.forward_only, self.loss_scale = num_microbatches, forward_only, loss_scale
        self.last_stage = ps.is_pipeline_last_stage()
        self.first_stage = ps.is_pipeline_first_stage()
        self.losses: list[dict] = []
        self.backwards_done = 0

    def forward(self, input_tensor: Optional[torch.Tensor]) -> torch.Tensor:
        if not self.first_stage:
            if input_tensor is not None and not self.forward_only:
                input_tensor.requires_grad_(True)
            self.model.set_input_tensor(input_tensor)
        with torch.no_grad() if self.forward_only else contextlib.nullcontext():
            output, loss_func = self.forward_step_func(self.data_iterator, self.model)
            if self.last_stage:
                loss, stats = loss_func(output)
                self.losses.append(stats)
                output = loss / self.num_microbatches
        return output

    def backward(self, input_tensor: Optional[torch.Tensor], output: torch.Tensor,
                 output_grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Backward of one micro batch; returns the gradient for the previous stage."""
        self.backwards_done += 1
        is_last_backward = self.backwards_done == self.num_microbatches
        no_sync = getattr(self.model, "no_sync", None)
        gate = no_sync() if (no_sync is not None and not is_last_backward) else contextlib.nullcontext()
        with gate:
            if self.last_stage:
                torch.autograd.backward(output * self.loss_scale)
            else:
                torch.autograd.backward(output, grad_tensors=output_grad)
        return input_tensor.grad if input_tensor is not None else None

    def finish(self) -> list[dict]:
        if not self.forward_only:
            from megatron_core.distributed import finalize_model_grads

            finalize_model_grads(self.model)
        return self.losses if self.last_stage else []


def forward_backward_no_pipelining(forward_step_func: ForwardStepFunc, data_iterator, model, num_microbatches: int,
                                   *, seq_length: int, micro_batch_size: int, forward_only: bool = False,
                                   loss_scale: float = 1.0, **_unused_shape_hints) -> list[dict]:
    """PP = 1: forward and backward each micro batch in turn, accumulating gradients."""
    runner = _MicroBatchRunner(forward_step_func, data_iterator, model, num_microbatches, forward_only, loss_scale)
    for _ in range(num_microbatches):
        output = runner.forward(None)
        if not forward_only:
            runner.backward(None, output, None)
    return runner.finish()


def forward_backward_pipelining_without_interleaving(
        forward_step_func: ForwardStepFunc, data_iterator, model, num_microbatches: int, *, seq_length: int,
        micro_batch_size: int, forward_only: bool = False, loss_scale: float = 1.0,
        hidden_size: Optional[int] = None, sequence_parallel: Optional[bool] = None) -> list[dict]:
    """Megatron's non-interleaved 1F1B schedule for PP > 1."""
    runner = _MicroBatchRunner(forward_step_func, data_iterator, model, num_microbatches, forward_only, loss_scale)
    param = _first_param(model)
    link = StageLink(activation_shape(model, seq_length, micro_batch_size, hidden_size, sequence_parallel),
                     param.dtype, param.device)
    stage, stages = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    num_warmup = min(stages - stage - 1, num_microbatches)
    num_steady = num_microbatches - num_warmup
    # FIFO of (input, output) awaiting their backward; at most num_warmup + 1 long.
    in_flight: list[tuple[Optional[torch.Tensor], torch.Tensor]] = []

    for _ in range(num_warmup):
        input_tensor = link.recv_forward()
        output = runner.forward(input_tensor)
        link.send_forward(output)
        if not forward_only:
            in_flight.append((input_tensor, output))

    input_tensor = link.recv_forward() if num_steady > 0 else None
    for i in range(num_steady):
        last_steady = i == num_steady - 1
        output = runner.forward(input_tensor)
        if forward_only:
            link.send_forward(output)
            input_tensor = None if last_steady else link.recv_forward()
            continue
        output_grad = link.send_forward_recv_backward(output)
        in_flight.append((input_tensor, output))
        oldest_input, oldest_output = in_flight.pop(0)
        input_grad = runner.backward(oldest_input, oldest_output, output_grad)
        if last_steady:
            input_tensor = None
            link.send_backward(input_grad)
        else:
            input_tensor = link.send_backward_recv_forward(input_grad)

    if not forward_only:
        for _ in range(num_warmup):  # cool-down: the backwards of the warm-up forwards
            oldest_input, oldest_output = in_flight.pop(0)
            output_grad = link.recv_backward()
            input_grad = runner.backward(oldest_input, oldest_output, output_grad)
            link.send_backward(input_grad)
    return runner.finish()


def get_forward_backward_func() -> Callable:
    """The schedule for this process's layout: 1F1B when PP > 1, plain accumulation otherwise."""
    if ps.get_pipeline_model_parallel_world_size() > 1:
        return forward_backward_pipelining_without_interleaving
    return forward_backward_no_pipelining
