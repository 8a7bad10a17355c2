"""Process groups for tensor (TP), pipeline (PP) and data (DP) parallelism, and rank queries.

Rank order is Megatron's: TP ranks are adjacent, then DP, then PP. For world 8, TP 2, PP 2:

    TP groups  [0,1] [2,3] [4,5] [6,7]
    DP groups  [0,2] [1,3] [4,6] [5,7]
    PP groups  [0,4] [1,5] [2,6] [3,7]

i.e. rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank. The embedding group of a pipeline is
its first and last stage (the tied word embeddings live on both), and the model-parallel group
(TP x PP) is the set of ranks that hold one full copy of the model (grad-norm reductions).

Without `initialize_model_parallel` (or without torch.distributed at all) every query answers
as a single process: world 1, rank 0, group None, first and last pipeline stage.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import torch.distributed as dist

from megatron_core.errors import UserError


class ParallelLayoutError(UserError):
    """The requested TP x PP x DP layout cannot be built for this world or model."""


# ----------------------------------------------------------------------------------------------
# Pure rank arithmetic (no process groups): what the group builder uses, testable anywhere
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankLayout:
    """Every group of a layout as lists of global ranks."""

    tensor: list[list[int]]
    data: list[list[int]]
    pipeline: list[list[int]]
    model: list[list[int]]  # TP x PP: one full model replica
    embedding: list[list[int]]  # first and last stage of each pipeline (one rank when PP == 1)


def _check_world(world_size: int, tp: int, pp: int) -> None:
    """Refuse sizes the groups cannot be cut from: the world must split into TP x PP blocks. The model's
    shape and layout rules are config.ModelSpec's (recipe validation and GPTModel ask it)."""
    problems = [
        f"{name} must be >= 1 (got {value})"
        for name, value in (
            ("world size", world_size),
            ("tensor_model_parallel_size", tp),
            ("pipeline_model_parallel_size", pp),
        )
        if value < 1
    ]
    if not problems and world_size % (tp * pp):
        problems.append(
            f"world size {world_size} is not divisible by tensor_model_parallel_size {tp} x "
            f"pipeline_model_parallel_size {pp} = {tp * pp}"
        )
    if problems:
        raise ParallelLayoutError("impossible parallel layout: " + "; ".join(problems))


def stage_layers(
    num_layers: int,
    pp: int,
    pp_rank: int,
    *,
    num_layers_per_virtual_pipeline_stage: Optional[int] = None,
    virtual_rank: int = 0,
) -> range:
    """Global layer numbers held by pipeline rank `pp_rank` (its model chunk `virtual_rank` when interleaved).

    Without virtual stages, rank r holds the contiguous [r L/p, (r+1) L/p). With v = L / (p n)
    virtual stages of n layers, chunk c of rank r holds [(c p + r) n, (c p + r + 1) n): the model
    goes round the ranks v times (Megatron's layout), e.g. L 8, p 2, n 2:
    rank 0 holds layers 0-1 and 4-5, rank 1 holds 2-3 and 6-7.
    """
    if num_layers_per_virtual_pipeline_stage is None:
        per_stage = num_layers // pp
        return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)
    n = num_layers_per_virtual_pipeline_stage
    start = (virtual_rank * pp + pp_rank) * n
    return range(start, start + n)


def rank_layout(world_size: int, tp: int, pp: int) -> RankLayout:
    _check_world(world_size, tp, pp)
    dp = world_size // (tp * pp)

    def rank(t: int, d: int, p: int) -> int:
        return p * dp * tp + d * tp + t

    tensor = [[rank(t, d, p) for t in range(tp)] for p in range(pp) for d in range(dp)]
    data = [[rank(t, d, p) for d in range(dp)] for p in range(pp) for t in range(tp)]
    pipeline = [[rank(t, d, p) for p in range(pp)] for d in range(dp) for t in range(tp)]
    model = [[rank(t, d, p) for p in range(pp) for t in range(tp)] for d in range(dp)]
    embedding = [sorted({group[0], group[-1]}) for group in pipeline]
    return RankLayout(tensor=tensor, data=data, pipeline=pipeline, model=model, embedding=embedding)


# ----------------------------------------------------------------------------------------------
# Process groups of this process
# ----------------------------------------------------------------------------------------------


@dataclass
class _Group:
    group: Optional[dist.ProcessGroup]
    ranks: list[int]  # global ranks, in group order

    @property
    def rank(self) -> int:
        return self.ranks.index(dist.get_rank())

    @property
    def world_size(self) -> int:
        return len(self.ranks)


_GROUPS: dict[str, _Group] = {}
_VIRTUAL_PIPELINE_WORLD_SIZE: Optional[int] = None  # model chunks per PP rank (interleaved 1F1B), or None


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
) -> None:
    """Build every TP, DP, PP, embedding and model-parallel group (call on all ranks, same sizes).
    `virtual_pipeline_model_parallel_size` (Megatron's name): model chunks per PP rank for the
    interleaved schedule; None runs one contiguous stage per rank."""
    global _VIRTUAL_PIPELINE_WORLD_SIZE
    if _GROUPS:
        raise RuntimeError("model parallel groups are already initialized; call destroy_model_parallel() first")
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    if virtual_pipeline_model_parallel_size is not None and (pp < 2 or virtual_pipeline_model_parallel_size < 1):
        raise ParallelLayoutError(
            f"virtual_pipeline_model_parallel_size {virtual_pipeline_model_parallel_size} "
            f"needs pipeline_model_parallel_size >= 2 (got {pp}) and a value >= 1"
        )
    if not dist.is_initialized():
        if tp * pp != 1:
            raise ParallelLayoutError(
                f"tensor_model_parallel_size {tp} x pipeline_model_parallel_size {pp} needs torch.distributed; "
                "launch with torchrun (or run_distributed in tests)"
            )
        return  # single process: every query already answers world 1
    layout = rank_layout(dist.get_world_size(), tp, pp)
    me = dist.get_rank()
    for kind in ("tensor", "data", "pipeline", "model", "embedding"):
        for ranks in getattr(layout, kind):
            group = dist.new_group(ranks)  # collective: every rank creates every group, in order
            if me in ranks:
                _GROUPS[kind] = _Group(group, ranks)
    # On a middle pipeline stage (PP > 2) this rank belongs to no embedding group.
    _GROUPS.setdefault("embedding", _Group(None, []))
    _VIRTUAL_PIPELINE_WORLD_SIZE = virtual_pipeline_model_parallel_size


_COLLECTIVE_DEVICE: Optional[str] = None  # the training device, set once a run has chosen it


def set_collective_device(device) -> None:
    """Name the training device: the tensors this process hands to collectives are made there."""
    global _COLLECTIVE_DEVICE
    _COLLECTIVE_DEVICE = str(device)


def get_collective_device() -> str:
    """Where a tensor made for a collective goes: the training device (NCCL takes CUDA tensors only, gloo
    takes both, so several ranks sharing one GPU over gloo still hand over what NCCL would get). Before a run
    names it: the current CUDA device under an NCCL group, else the CPU."""
    if _COLLECTIVE_DEVICE is not None:
        return _COLLECTIVE_DEVICE
    nccl = dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"
    return "cuda" if nccl else "cpu"


def all_ranks_ok(ok: bool) -> bool:
    """True on every rank when `ok` holds on every rank (collective): a check that one rank fails (its disk,
    its lock) stops the whole job together instead of leaving the others waiting in a collective."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return ok
    import torch

    flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=get_collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item()) == 0


def is_local_rank_zero() -> bool:
    """Local rank 0 of this node (torchrun's LOCAL_RANK; without it, global rank 0, or no process
    group at all): the process that looks after this node's files, so nodes need no shared disk."""
    distributed = dist.is_available() and dist.is_initialized()
    return int(os.environ.get("LOCAL_RANK", dist.get_rank() if distributed else 0)) == 0


def destroy_model_parallel() -> None:
    """Forget the groups (the default process group itself is left to its owner)."""
    global _VIRTUAL_PIPELINE_WORLD_SIZE
    _VIRTUAL_PIPELINE_WORLD_SIZE = None
    for entry in _GROUPS.values():
        if entry.group is not None and dist.is_initialized():
            dist.destroy_process_group(entry.group)
    _GROUPS.clear()


@contextmanager
def single_process_view() -> Iterator[None]:
    """Inside, every query answers as a single process; the groups stay built and answer again after. What
    building a model on the meta device to read its structure needs, whatever this process's layout."""
    global _VIRTUAL_PIPELINE_WORLD_SIZE
    saved, saved_virtual = dict(_GROUPS), _VIRTUAL_PIPELINE_WORLD_SIZE
    _GROUPS.clear()
    _VIRTUAL_PIPELINE_WORLD_SIZE = None
    try:
        yield
    finally:
        _GROUPS.update(saved)
        _VIRTUAL_PIPELINE_WORLD_SIZE = saved_virtual


def _group(kind: str) -> Optional[_Group]:
    return _GROUPS.get(kind)


def _group_handle(kind: str) -> Optional[dist.ProcessGroup]:
    entry = _group(kind)
    return entry.group if entry else None


def _group_rank(kind: str) -> int:
    entry = _group(kind)
    return entry.rank if entry and entry.ranks else 0


def _group_world_size(kind: str) -> int:
    entry = _group(kind)
    return entry.world_size if entry else 1


def get_tensor_model_parallel_group() -> Optional[dist.ProcessGroup]:
    return _group_handle("tensor")


def get_tensor_model_parallel_rank() -> int:
    return _group_rank("tensor")


def get_tensor_model_parallel_world_size() -> int:
    return _group_world_size("tensor")


def get_pipeline_model_parallel_group() -> Optional[dist.ProcessGroup]:
    return _group_handle("pipeline")


def get_pipeline_model_parallel_rank() -> int:
    return _group_rank("pipeline")


def get_pipeline_model_parallel_world_size() -> int:
    return _group_world_size("pipeline")


def get_pipeline_model_parallel_ranks() -> list[int]:
    """Global ranks of this rank's pipeline, stage 0 first."""
    entry = _group("pipeline")
    return list(entry.ranks) if entry else [0]


def get_pipeline_model_parallel_next_rank() -> int:
    """Global rank of the next stage (wraps around, as Megatron)."""
    ranks = get_pipeline_model_parallel_ranks()
    return ranks[(get_pipeline_model_parallel_rank() + 1) % len(ranks)]


def get_pipeline_model_parallel_prev_rank() -> int:
    ranks = get_pipeline_model_parallel_ranks()
    return ranks[(get_pipeline_model_parallel_rank() - 1) % len(ranks)]


def is_pipeline_first_stage() -> bool:
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage() -> bool:
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def get_virtual_pipeline_model_parallel_world_size() -> Optional[int]:
    """Model chunks per pipeline rank under the interleaved schedule; None without it."""
    return _VIRTUAL_PIPELINE_WORLD_SIZE


def get_data_parallel_group() -> Optional[dist.ProcessGroup]:
    return _group_handle("data")


def get_data_parallel_rank() -> int:
    return _group_rank("data")


def get_data_parallel_world_size() -> int:
    return _group_world_size("data")


def get_model_parallel_group() -> Optional[dist.ProcessGroup]:
    """TP x PP ranks holding one model replica: reduce grad norms and inf checks over this."""
    return _group_handle("model")


def get_embedding_group() -> Optional[dist.ProcessGroup]:
    """First and last pipeline stage of this rank's pipeline (None on middle stages or uninitialized)."""
    return _group_handle("embedding")
