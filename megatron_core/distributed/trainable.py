"""The model protocol: what the schedules, the optimizers and the training loop call on the model they
train, declared once instead of probed with getattr.

    TrainableModel (typing.Protocol)
        module              the model itself: a GPTModel (one pipeline stage) or GPTModelChunks (this
                            rank's virtual pipeline chunks); its parameter names and state_dict keys are
                            what checkpoints and the optimizers use
        chunks              the stage modules the interleaved schedule runs and checkpoints hold as
                            model0, model1, ...: the module's own `chunks` ([the GPTModel] without virtual
                            pipeline stages)
        zero_grad_buffer()  start an iteration's gradients
        no_sync()           a context whose backwards only accumulate (the micro batches before the last)
        finish_grad_sync()  complete the iteration's reductions: after it every gradient is final
        model(...), set_input_tensor(t), train(), eval(), parameters(): as the module's

Two implementations: `DistributedDataParallel` (gradients in main_grad buffers, averaged over DP in
buckets: what training builds at every DP size) and `LocalModel` (DP = 1 with the gradients in `.grad`:
only the model-parallel sums, for tests and tools that drive the schedules without the wrapper).
Under pipeline parallelism the module declares `shared_embedding_parameters()` (the tied word
embedding on the first and last stage).
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol, Sequence

import torch

from megatron_core import parallel_state as ps
from megatron_core.distributed.grad_sync import allreduce_embedding_grads, allreduce_sequence_parallel_grads


class TrainableModel(Protocol):
    """A model as the schedules, the optimizers and the loop drive it (see the module docstring)."""

    @property
    def module(self) -> torch.nn.Module: ...

    @property
    def chunks(self) -> Sequence[torch.nn.Module]: ...

    def zero_grad_buffer(self) -> None: ...

    def no_sync(self) -> contextlib.AbstractContextManager: ...

    def finish_grad_sync(self) -> None: ...

    def set_input_tensor(self, tensor: Any) -> None: ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def train(self, mode: bool = True) -> Any: ...

    def eval(self) -> Any: ...

    def parameters(self, recurse: bool = True) -> Any: ...


def shared_embedding_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The tied word-embedding weights whose gradients the first and last stage sum (none without PP)."""
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return []  # one stage holds the tied weight once; autograd already sums both uses
    return list(module.shared_embedding_parameters())


class LocalModel(torch.nn.Module):
    """A model trained at DP = 1 without the data-parallel wrapper: gradients stay in `.grad` (the
    optimizer's zero_grad clears them), and finishing the sync is the model-parallel sums alone:
    sequence-parallel parameters over TP, the tied word embedding over the embedding group."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    @property
    def chunks(self) -> Sequence[torch.nn.Module]:
        return self.module.chunks

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def set_input_tensor(self, tensor) -> None:
        self.module.set_input_tensor(tensor)

    def zero_grad_buffer(self) -> None:
        """Nothing to do: the gradients are the parameters' own `.grad`."""

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def finish_grad_sync(self) -> None:
        if ps.get_data_parallel_world_size() > 1:
            raise TypeError(
                "data-parallel size > 1 but the model is not wrapped in "
                "megatron_core.distributed.DistributedDataParallel; its gradients would not be averaged"
            )
        allreduce_sequence_parallel_grads(self.module.parameters())  # only those marked sequence_parallel
        allreduce_embedding_grads(shared_embedding_parameters(self.module))

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, **kwargs):
        return self.module.load_state_dict(state_dict, strict=strict, **kwargs)
