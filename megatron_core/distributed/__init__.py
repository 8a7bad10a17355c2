"""Process start-up and data parallelism.

init_distributed(backend=None) -> DistributedInfo
    Reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT),
    picks NCCL when CUDA is available and gloo otherwise (or the given backend), sets the CUDA
    device from the local rank, initializes the default process group and logs the choice.
    Without WORLD_SIZE (a plain `python -m`) it returns a single-process DistributedInfo and
    initializes nothing.

destroy_distributed()
    At exit, also after an error: the model-parallel groups and the default process group, when
    init_distributed created it (a group the caller made is the caller's). Without it NCCL warns
    at exit and some versions hang.

DistributedDataParallel(module, parallel, *, bucket_size=None, reduce_kind="all_reduce", grad_dtype=None)
    Wraps a GPTModel or GPTModelChunks (at any DP size, as Megatron does: the wrapper owns the
    main_grad buffers gradients accumulate in); see grad_sync.py for the bucketed, overlapped
    reduction. It implements the model protocol (trainable.py: `module`, `chunks`,
    zero_grad_buffer(), no_sync(), finish_grad_sync(), set_input_tensor(t)), which the schedules
    call after the last backward; state_dict()/load_state_dict() are the module's own (checkpoint
    keys do not change). Nothing else is forwarded: the inner model is `.module`.

The distributed optimizer that shards over these buckets lives in megatron_core.optimizer.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_core import parallel_state as ps
from megatron_core.distributed.grad_sync import GradSync, ReduceKind
from megatron_core.distributed.trainable import TrainableModel, shared_embedding_parameters
from megatron_core.errors import UserError
from megatron_core.log import get_logger

_LOG = get_logger(__name__)  # lines read "distributed: ..." as they always have


@dataclass(frozen=True)
class DistributedInfo:
    rank: int
    world_size: int
    local_rank: int
    backend: Optional[str]  # None: single process, no process group
    device: torch.device


_CREATED_PROCESS_GROUP = False  # init_distributed made the default group: destroy_distributed undoes it


def init_distributed(backend: Optional[str] = None, timeout_minutes: float = 30.0) -> DistributedInfo:
    """Join the torchrun job described by the environment (see module docstring)."""
    global _CREATED_PROCESS_GROUP
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    if backend is None:
        backend = "nccl" if cuda else "gloo"
    if backend not in ("nccl", "gloo"):
        raise UserError(f"distributed backend {backend!r} is not supported; use 'nccl' (GPUs) or 'gloo' (CPU)")
    if backend == "nccl" and not cuda:
        raise UserError("backend 'nccl' needs CUDA GPUs but none is visible; use backend 'gloo' on a CPU")
    device = torch.device("cpu")
    if cuda and backend == "nccl":
        if local_rank >= torch.cuda.device_count():
            raise UserError(
                f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPUs are visible; "
                "launch at most one process per GPU (--nproc-per-node)"
            )
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    if dist.is_initialized():
        return DistributedInfo(dist.get_rank(), dist.get_world_size(), local_rank, dist.get_backend(), device)
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        _LOG.info(f"distributed: single process (no process group), device {device}")
        return DistributedInfo(0, 1, 0, None, device)
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise UserError(
                f"environment variable {name} is not set; start the job with torchrun "
                "(invoke train) rather than plain python"
            )
    dist.init_process_group(
        backend=backend,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(minutes=timeout_minutes),
        device_id=device if device.type == "cuda" else None,
    )
    _CREATED_PROCESS_GROUP = True
    if rank == 0:
        _LOG.info(
            f"distributed: backend {backend}, world size {world_size}, "
            f"master {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        )
    return DistributedInfo(rank, world_size, local_rank, backend, device)


def destroy_distributed() -> None:
    """Undo init_distributed (see module docstring); a no-op when it created no process group."""
    global _CREATED_PROCESS_GROUP
    if not _CREATED_PROCESS_GROUP:
        return
    _CREATED_PROCESS_GROUP = False
    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


class DistributedDataParallel(torch.nn.Module):
    """A model replica whose gradients are averaged over its data-parallel group in buckets."""

    def __init__(
        self,
        module: torch.nn.Module,
        parallel,
        *,
        bucket_size: Optional[int] = None,
        reduce_kind: ReduceKind = "all_reduce",
        grad_dtype: Optional[torch.dtype] = None,
    ):
        super().__init__()
        self.module = module
        self.grad_sync = GradSync(
            list(module.parameters()),
            bucket_size=bucket_size or parallel.ddp_bucket_size,
            reduce_kind=reduce_kind,
            sequence_parallel=parallel.sequence_parallel,
            shared_embedding_params=shared_embedding_parameters(module),
            grad_dtype=grad_dtype,
        )
        if ps.get_data_parallel_world_size() > 1:
            self._broadcast_params()

    def _broadcast_params(self) -> None:
        """Start every DP replica from DP rank 0's weights (they should agree already; make it certain)."""
        group = ps.get_data_parallel_group()
        src_rank = dist.get_global_rank(group, 0)
        with torch.no_grad():
            for tensor in list(self.module.parameters()) + list(self.module.buffers()):
                dist.broadcast(tensor.data, src=src_rank, group=group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def zero_grad_buffer(self) -> None:
        self.grad_sync.zero_grad_buffer()

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.grad_sync.no_sync()

    def finish_grad_sync(self) -> None:
        self.grad_sync.finish()

    @property
    def chunks(self) -> Sequence[torch.nn.Module]:
        return self.module.chunks

    def set_input_tensor(self, tensor) -> None:
        self.module.set_input_tensor(tensor)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, **kwargs):
        return self.module.load_state_dict(state_dict, strict=strict, **kwargs)


__all__ = [
    "DistributedDataParallel",
    "DistributedInfo",
    "TrainableModel",
    "destroy_distributed",
    "init_distributed",
]
