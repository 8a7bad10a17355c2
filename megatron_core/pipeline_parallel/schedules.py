"""Forward/backward schedules over the micro batches of one iteration.

THE CONTRACT (the training loop codes to this; both schedules below honour it):

    forward_backward(forward_step_func, data_iterator, model, num_microbatches, *,
                     seq_length, micro_batch_size, forward_only=False, loss_scale=1.0)
        -> list[dict]   # one loss dict per micro batch, in order, on the LAST pipeline stage; [] elsewhere

    forward_step_func(data_iterator, model) -> (output_tensor, loss_func)
        Called exactly `num_microbatches` times per call on every pipeline stage, in micro-batch
        order, so every stage consumes its data iterator identically (stages that need no data
        may pass None and ignore it). Under the interleaved schedule: that many times per model
        chunk, with the chunk as `model` and a view of the iterator that yields each micro batch
        to every chunk while the iterator itself is still read once per micro batch. It runs
        `model(...)`: on a non-first stage the schedule has already called
        `model.set_input_tensor(activations_from_previous_stage)`.
        output_tensor: the per-token loss [b, s] on the last stage, hidden states elsewhere.
    loss_func(output_tensor) -> (loss, stats)
        loss: the scalar loss of THIS micro batch (mean over its tokens), with its graph.
        stats: {"lm loss": <detached scalar tensor>, ...}, returned as they are in the list.
        The schedule (not loss_func) divides `loss` by num_microbatches and multiplies by
        loss_scale before the backward, so gradients are the mean over the micro batches of
        this rank times the loss scale. Averaging across data-parallel ranks is grad sync's job.

    forward_only=True: no graph, no backward (evaluation); the loss dicts are still returned.
    After the last backward (forward_only=False) the schedule calls `model.finish_grad_sync()`:
    it waits for the data-parallel gradient reduction, all-reduces sequence-parallel parameters'
    grads across TP and the tied word-embedding grads across the embedding group (first + last
    stage). The trainer calls nothing else between forward_backward and optimizer.step().

    `model` implements the model protocol (megatron_core.distributed.TrainableModel): the
    data-parallel wrapper `DistributedDataParallel` around a GPTModel (or GPTModelChunks; the tests
    also drive a `LocalModel` at DP = 1). Gradient reduction is launched only during the backward
    of the last micro batch (`model.no_sync()` for the others).

    Activations travel between stages as [s, b, h] ([s/tp, b, h] with sequence parallelism)
    in the dtype of the model's parameters; `hidden_size` and `sequence_parallel` are read from
    the wrapped model (`model.module.config`, `model.module.parallel`) unless given.

Schedules: `forward_backward_no_pipelining` (PP = 1: gradient accumulation over micro batches),
`forward_backward_pipelining_without_interleaving` (Megatron's 1F1B: stage r runs
min(pp - r - 1, M) warm-up forwards, then one-forward-one-backward, then the cool-down
backwards; any M >= 1) and `forward_backward_pipelining_with_interleaving` (Megatron's
interleaved 1F1B over virtual pipeline stages, the model chunks of each rank; M % pp == 0).
Under the interleaved schedule the data-parallel reduction of a chunk's buckets may start in
that chunk's last backward; `model.no_sync()` covers the others.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch

from megatron_core import parallel_state as ps
from megatron_core.distributed import TrainableModel
from megatron_core.errors import UserError
from megatron_core.pipeline_parallel.p2p import StageLink

LossFunc = Callable[[torch.Tensor], tuple[torch.Tensor, dict]]
ForwardStepFunc = Callable[[Optional[Iterator], Any], tuple[torch.Tensor, LossFunc]]


def _first_param(model: TrainableModel) -> torch.Tensor:
    for param in model.module.parameters():
        if param.is_floating_point():
            return param
    raise ValueError("the model has no floating-point parameters; cannot infer the activation dtype")


def activation_shape(
    model: TrainableModel,
    seq_length: int,
    micro_batch_size: int,
    hidden_size: Optional[int] = None,
    sequence_parallel: Optional[bool] = None,
) -> tuple[int, int, int]:
    """Shape of the tensor sent between stages: [s, b, h], or [s/tp, b, h] with sequence parallelism."""
    if hidden_size is None:
        hidden_size = model.module.config.hidden_size
    if sequence_parallel is None:
        sequence_parallel = bool(model.module.parallel.sequence_parallel)
    tp = ps.get_tensor_model_parallel_world_size()
    seq = seq_length // tp if sequence_parallel else seq_length
    return (seq, micro_batch_size, hidden_size)


class _MicroBatchRunner:
    """Forward and backward of one micro batch on this stage (or on one model chunk of it, under the
    interleaved schedule: then first/last stage are the chunk's place in the whole pipeline,
    `model` is the chunk, `sync_model` the model protocol's implementation around every chunk and
    `losses` is shared)."""

    def __init__(
        self,
        forward_step_func: ForwardStepFunc,
        data_iterator,
        model,
        num_microbatches: int,
        forward_only: bool,
        loss_scale: float,
        *,
        first_stage: Optional[bool] = None,
        last_stage: Optional[bool] = None,
        sync_model: Optional[TrainableModel] = None,
        losses: Optional[list] = None,
    ):
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1 (got {num_microbatches})")
        self.forward_step_func, self.data_iterator, self.model = forward_step_func, data_iterator, model
        self.num_microbatches, self.forward_only, self.loss_scale = num_microbatches, forward_only, loss_scale
        self.last_stage = ps.is_pipeline_last_stage() if last_stage is None else last_stage
        self.first_stage = ps.is_pipeline_first_stage() if first_stage is None else first_stage
        self.sync_model = model if sync_model is None else sync_model
        self.losses: list[dict] = [] if losses is None else losses
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

    def backward(
        self, input_tensor: Optional[torch.Tensor], output: torch.Tensor, output_grad: Optional[torch.Tensor]
    ) -> Optional[torch.Tensor]:
        """Backward of one micro batch; returns the gradient for the previous stage."""
        self.backwards_done += 1
        is_last_backward = self.backwards_done == self.num_microbatches
        gate = contextlib.nullcontext() if is_last_backward else self.sync_model.no_sync()
        with gate:
            if self.last_stage:
                torch.autograd.backward(output * self.loss_scale)
            else:
                torch.autograd.backward(output, grad_tensors=output_grad)
        return input_tensor.grad if input_tensor is not None else None

    def finish(self) -> list[dict]:
        if not self.forward_only:
            self.sync_model.finish_grad_sync()
        return self.losses if self.last_stage else []


def forward_backward_no_pipelining(
    forward_step_func: ForwardStepFunc,
    data_iterator,
    model: TrainableModel,
    num_microbatches: int,
    *,
    forward_only: bool = False,
    loss_scale: float = 1.0,
    **_unused_shape_hints,
) -> list[dict]:
    """PP = 1: forward and backward each micro batch in turn, accumulating gradients (no stage sends a
    tensor, so the shape hints the other schedules take, seq_length and micro_batch_size, are not needed)."""
    runner = _MicroBatchRunner(forward_step_func, data_iterator, model, num_microbatches, forward_only, loss_scale)
    for _ in range(num_microbatches):
        output = runner.forward(None)
        if not forward_only:
            runner.backward(None, output, None)
    return runner.finish()


def forward_backward_pipelining_without_interleaving(
    forward_step_func: ForwardStepFunc,
    data_iterator,
    model: TrainableModel,
    num_microbatches: int,
    *,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool = False,
    loss_scale: float = 1.0,
    hidden_size: Optional[int] = None,
    sequence_parallel: Optional[bool] = None,
) -> list[dict]:
    """Megatron's non-interleaved 1F1B schedule for PP > 1."""
    runner = _MicroBatchRunner(forward_step_func, data_iterator, model, num_microbatches, forward_only, loss_scale)
    param = _first_param(model)
    link = StageLink(
        activation_shape(model, seq_length, micro_batch_size, hidden_size, sequence_parallel), param.dtype, param.device
    )
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


class _SharedMicroBatches:
    """The schedule's one data iterator, read once per micro batch and handed to every model chunk.

    Each chunk's view yields micro batch 0, 1, ... in turn; the first chunk to ask for batch j
    reads it from the iterator (so the iterator advances exactly as under the other schedules)
    and it is dropped once every chunk has taken it.
    """

    def __init__(self, iterator: Optional[Iterator], num_chunks: int):
        self.iterator, self.num_chunks = iterator, num_chunks
        self.batches: dict[int, list] = {}  # micro batch index -> [batch, chunks yet to take it]
        self.read = 0

    def view(self) -> Optional[Iterator]:
        return None if self.iterator is None else self._view()

    def _view(self) -> Iterator:
        index = 0
        while True:
            yield self._take(index)
            index += 1

    def _take(self, index: int):
        while self.read <= index:
            self.batches[self.read] = [next(self.iterator), self.num_chunks]
            self.read += 1
        entry = self.batches[index]
        entry[1] -= 1
        if entry[1] == 0:
            del self.batches[index]
        return entry[0]


def forward_backward_pipelining_with_interleaving(
    forward_step_func: ForwardStepFunc,
    data_iterator,
    model: TrainableModel,
    num_microbatches: int,
    *,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool = False,
    loss_scale: float = 1.0,
    hidden_size: Optional[int] = None,
    sequence_parallel: Optional[bool] = None,
) -> list[dict]:
    """Megatron's interleaved 1F1B over the v model chunks of each PP rank (virtual pipeline stages).

    `model.chunks` are the chunks (the model protocol's; megatron_core.models.gpt.GPTModelChunks
    inside the wrapper); chunk c of rank r is pipeline position c p + r of p v, so
    activations go round the ranks v times and rank p - 1 hands chunk c's output to chunk c + 1 of
    rank 0. Virtual micro batch k (M v of them) runs chunk (k mod p v) // p forward on micro batch
    (k // p v) p + k mod p, and chunk v - 1 - that backward: p micro batches per chunk in turn.
    Rank r runs 2 (p - r - 1) + (v - 1) p warm-up forwards (all of them when that reaches M v),
    then one forward and one backward per step, then the cool-down backwards. Needs M % p == 0.
    forward_step_func is called M times per chunk, with that chunk as `model`; the data iterator
    is read once per micro batch (see _SharedMicroBatches). The contract is otherwise the module's.
    """
    chunks = list(model.chunks)
    p, r, v = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank(), len(chunks)
    expected = ps.get_virtual_pipeline_model_parallel_world_size()
    if expected is not None and expected != v:
        raise ValueError(
            f"the model has {v} chunks but the process groups were built for {expected} virtual "
            "pipeline stages per rank"
        )
    if num_microbatches % p:
        raise UserError(
            f"the interleaved pipeline schedule needs the number of micro batches per iteration "
            f"({num_microbatches}) to be a multiple of pipeline_model_parallel_size {p}; change "
            "global_batch_size, micro_batch_size or the data-parallel size"
        )
    param = _first_param(model)
    link = StageLink(
        activation_shape(model, seq_length, micro_batch_size, hidden_size, sequence_parallel), param.dtype, param.device
    )
    losses: list[dict] = []
    data = _SharedMicroBatches(data_iterator, v)
    runners = [
        _MicroBatchRunner(
            forward_step_func,
            data.view(),
            chunk,
            num_microbatches,
            forward_only,
            loss_scale,
            first_stage=(r == 0 and c == 0),
            last_stage=(r == p - 1 and c == v - 1),
            sync_model=model,
            losses=losses,
        )
        for c, chunk in enumerate(chunks)
    ]
    first_chunk = runners[0].first_stage  # rank 0's chunk 0 takes the tokens
    last_chunk = runners[-1].last_stage  # rank p - 1's chunk v - 1 computes the loss

    total = num_microbatches * v
    warmup = total if forward_only else 2 * (p - r - 1) + (v - 1) * p
    all_warmup = warmup >= total
    warmup = min(warmup, total)
    remaining = total - warmup

    def chunk_of(k: int, forward: bool) -> int:
        c = (k % (p * v)) // p
        return c if forward else v - 1 - c

    def receive_after(k: int, forward: bool) -> tuple[bool, int]:
        """After virtual step k: does a tensor arrive, and for which chunk? The rank that starts
        the direction (rank 0 forward, rank p - 1 backward) receives what the rank at the other
        end produced p - 1 steps earlier, for the chunk after (before) it; the others receive
        their neighbour's output for their next step's chunk."""
        leading = r == 0 if forward else r == p - 1
        if not leading:
            return True, chunk_of(k + 1, forward)
        if k < p - 1:
            return False, 0  # the other end has produced nothing yet
        produced = chunk_of(k - (p - 1), forward)
        if produced == (v - 1 if forward else 0):
            return False, 0  # the end of the model: nothing goes round
        return True, produced + 1 if forward else produced - 1

    inputs: list[list] = [[] for _ in range(v)]  # per chunk, FIFO: inputs of forwards awaiting backward
    outputs: list[list] = [[] for _ in range(v)]
    output_grads: list[list] = [[] for _ in range(v)]

    def forward(k: int) -> Optional[torch.Tensor]:
        """Forward of virtual micro batch k; returns what goes to the next stage (None at the end)."""
        c = chunk_of(k, True)
        if c == 0 and first_chunk:
            inputs[c].append(None)
        input_tensor = inputs[c][len(outputs[c])]
        output = runners[c].forward(input_tensor)
        if forward_only:
            inputs[c].pop(0)
        else:
            outputs[c].append(output)
        return None if (c == v - 1 and last_chunk) else output

    def backward(k: int) -> Optional[torch.Tensor]:
        """Backward of virtual micro batch k; returns what goes to the previous stage (None at the start)."""
        c = chunk_of(k, False)
        output_grad = None if (c == v - 1 and last_chunk) else output_grads[c].pop(0)
        input_grad = runners[c].backward(inputs[c].pop(0), outputs[c].pop(0), output_grad)
        return None if (c == 0 and first_chunk) else input_grad

    if r != 0:
        inputs[0].append(link.exchange(recv_prev=True)[0])
    for k in range(warmup):
        send = forward(k)
        recv_prev, for_chunk = receive_after(k, True)
        recv_prev = recv_prev and k != total - 1
        if k == warmup - 1 and not forward_only and not all_warmup:
            # The last warm-up step also takes the first gradient for the first backward (chunk v - 1).
            recv_next = r != p - 1
            from_prev, from_next = link.exchange(send_next=send, recv_prev=recv_prev, recv_next=recv_next)
            if recv_next:
                output_grads[v - 1].append(from_next)
        else:
            from_prev, _ = link.exchange(send_next=send, recv_prev=recv_prev)
        if recv_prev:
            inputs[for_chunk].append(from_prev)

    for i in range(remaining):
        forward_k, backward_k = warmup + i, i
        send_next = forward(forward_k)
        send_prev = backward(backward_k)
        recv_prev, forward_chunk = receive_after(forward_k, True)
        recv_next, backward_chunk = receive_after(backward_k, False)
        recv_prev = recv_prev and i != remaining - 1
        from_prev, from_next = link.exchange(
            send_next=send_next, send_prev=send_prev, recv_prev=recv_prev, recv_next=recv_next
        )
        if recv_prev:
            inputs[forward_chunk].append(from_prev)
        if recv_next:
            output_grads[backward_chunk].append(from_next)

    if not forward_only:
        if all_warmup and r != p - 1:
            output_grads[v - 1].append(link.exchange(recv_next=True)[1])
        for k in range(remaining, total):
            send_prev = backward(k)
            recv_next, backward_chunk = receive_after(k, False)
            recv_next = recv_next and k != total - 1
            _, from_next = link.exchange(send_prev=send_prev, recv_next=recv_next)
            if recv_next:
                output_grads[backward_chunk].append(from_next)
    runners[0].finish()  # finish_grad_sync on the whole model, once
    return losses if last_chunk else []


def get_forward_backward_func() -> Callable:
    """The schedule for this process's layout: interleaved 1F1B with virtual pipeline stages,
    1F1B when PP > 1, plain accumulation otherwise."""
    if ps.get_pipeline_model_parallel_world_size() > 1:
        if ps.get_virtual_pipeline_model_parallel_world_size() is not None:
            return forward_backward_pipelining_with_interleaving
        return forward_backward_pipelining_without_interleaving
    return forward_backward_no_pipelining
