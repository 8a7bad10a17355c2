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

The product's implementation is `DistributedDataParallel` (gradients in main_grad buffers, averaged over DP
in buckets: what training builds at every DP size); the tests drive the schedules with a second one
(tests/distributed_utils.py `LocalModel`, gradients in `.grad`).
Under pipeline parallelism the module declares `shared_embedding_parameters()` (the tied word
embedding on the first and last stage).
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol, Sequence

import torch

from megatron_core import parallel_state as ps


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
