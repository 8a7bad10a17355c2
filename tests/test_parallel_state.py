"""Process groups: Megatron's rank order, layout validation, single-process behaviour, a real 4-rank run."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed_utils import run_distributed

from megatron_core import parallel_state as ps
from megatron_core.errors import UserError


def test_rank_layout_world8_tp2_pp2_is_megatron_order():
    layout = ps.rank_layout(8, 2, 2)
    assert layout.tensor == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.data == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.pipeline == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.embedding == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.model == [[0, 1, 4, 5], [2, 3, 6, 7]]


@pytest.mark.parametrize("world,tp,pp", [(8, 1, 1), (8, 8, 1), (8, 1, 8), (8, 2, 4), (8, 4, 2), (16, 2, 2), (12, 2, 3)])
def test_rank_layout_partitions_every_rank(world, tp, pp):
    layout = ps.rank_layout(world, tp, pp)
    dp = world // (tp * pp)
    for groups, size in ((layout.tensor, tp), (layout.data, dp), (layout.pipeline, pp), (layout.model, tp * pp)):
        assert sorted(r for g in groups for r in g) == list(range(world))  # a partition of the world
        assert all(len(g) == size for g in groups)
    for rank in range(world):  # the closed formula: rank = pp_rank * dp * tp + dp_rank * tp + tp_rank
        tp_rank, dp_rank, pp_rank = rank % tp, (rank // tp) % dp, rank // (tp * dp)
        assert next(g for g in layout.tensor if rank in g).index(rank) == tp_rank
        assert next(g for g in layout.data if rank in g).index(rank) == dp_rank
        assert next(g for g in layout.pipeline if rank in g).index(rank) == pp_rank
    assert layout.embedding == [sorted({g[0], g[-1]}) for g in layout.pipeline]


def test_pp3_middle_stage_is_not_in_an_embedding_group():
    layout = ps.rank_layout(6, 2, 3)
    assert layout.pipeline[0] == [0, 2, 4]
    assert layout.embedding[0] == [0, 4]
    assert all(2 not in g and 3 not in g for g in layout.embedding)


def test_a_world_that_does_not_split_into_tp_x_pp_blocks_is_refused():
    """The group arithmetic checks only the world against TP x PP; the model's rules are ModelSpec's
    (tests/test_model_spec.py)."""
    with pytest.raises(ps.ParallelLayoutError) as info:
        ps.rank_layout(6, 4, 1)
    assert str(info.value) == (
        "impossible parallel layout: world size 6 is not divisible by "
        "tensor_model_parallel_size 4 x pipeline_model_parallel_size 1 = 4"
    )
    assert isinstance(info.value, UserError)
    with pytest.raises(ps.ParallelLayoutError, match="pipeline_model_parallel_size must be >= 1 \\(got 0\\)"):
        ps.rank_layout(4, 2, 0)


def test_uninitialized_is_a_single_process():
    assert (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()) == (1, 0)
    assert (ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()) == (1, 0)
    assert (ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()) == (1, 0)
    assert ps.get_tensor_model_parallel_group() is None and ps.get_embedding_group() is None
    assert ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage()
    ps.initialize_model_parallel(1, 1)  # allowed without torch.distributed
    with pytest.raises(ps.ParallelLayoutError, match="needs torch.distributed"):
        ps.initialize_model_parallel(2, 1)


def _groups_on_four_ranks():
    ps.initialize_model_parallel(2, 2)
    rank = dist.get_rank()

    def members(group):  # who is in my group, found by a real collective on it
        out = [torch.zeros(1) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, torch.tensor([float(rank)]), group=group)
        return [int(t.item()) for t in out]

    return {
        "tp": (
            ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_world_size(),
            members(ps.get_tensor_model_parallel_group()),
        ),
        "dp": (ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), members(ps.get_data_parallel_group())),
        "pp": (
            ps.get_pipeline_model_parallel_rank(),
            ps.get_pipeline_model_parallel_world_size(),
            members(ps.get_pipeline_model_parallel_group()),
        ),
        "model": members(ps.get_model_parallel_group()),
        "embedding": members(ps.get_embedding_group()),
        "first_last": (ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()),
        "next_prev": (ps.get_pipeline_model_parallel_next_rank(), ps.get_pipeline_model_parallel_prev_rank()),
    }


@pytest.mark.slow
def test_real_groups_on_four_gloo_ranks():
    results = run_distributed(_groups_on_four_ranks, 4)
    expected = {
        0: ((0, [0, 1]), (0, [0]), (0, [0, 2])),
        1: ((1, [0, 1]), (0, [1]), (0, [1, 3])),
        2: ((0, [2, 3]), (0, [2]), (1, [0, 2])),
        3: ((1, [2, 3]), (0, [3]), (1, [1, 3])),
    }
    for rank, got in enumerate(results):
        (tp_rank, tp_members), (dp_rank, dp_members), (pp_rank, pp_members) = expected[rank]
        assert got["tp"] == (tp_rank, 2, tp_members)
        assert got["dp"] == (dp_rank, 1, dp_members)
        assert got["pp"] == (pp_rank, 2, pp_members)
        assert got["model"] == [0, 1, 2, 3]
        assert got["embedding"] == pp_members
        assert got["first_last"] == (pp_rank == 0, pp_rank == 1)
        other = pp_members[1 - pp_rank]
        assert got["next_prev"] == (other, other)


def test_stage_layers_contiguous_and_megatrons_interleaved_layout():
    from megatron_core.parallel_state import stage_layers

    assert [stage_layers(8, 2, r) for r in range(2)] == [range(0, 4), range(4, 8)]
    # L 8, PP 2, 2 layers per virtual stage: rank 0 holds 0-1 and 4-5, rank 1 holds 2-3 and 6-7.
    layout = {
        (r, c): list(stage_layers(8, 2, r, num_layers_per_virtual_pipeline_stage=2, virtual_rank=c))
        for r in range(2)
        for c in range(2)
    }
    assert layout == {(0, 0): [0, 1], (1, 0): [2, 3], (0, 1): [4, 5], (1, 1): [6, 7]}
    # every layer exactly once over PP 4 x 3 chunks of 1 layer
    held = sorted(
        l
        for r in range(4)
        for c in range(3)
        for l in stage_layers(12, 4, r, num_layers_per_virtual_pipeline_stage=1, virtual_rank=c)
    )
    assert held == list(range(12))


def test_collective_tensors_are_made_on_the_training_device_whatever_the_backend(monkeypatch):
    """Several ranks sharing one GPU talk gloo, yet must hand collectives what NCCL would get: CUDA tensors.
    The trainer's stop flag and loss average, and the resume agreement, follow the training device."""
    from megatron_core.training import checkpointing, trainer

    seen = []

    class Recorded(Exception):
        pass

    def all_reduce(tensor, *_args, **_kwargs):
        seen.append(tensor.device.type)
        raise Recorded

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *_args, **_kwargs: 2)
    monkeypatch.setattr(dist, "get_backend", lambda *_args, **_kwargs: "gloo")
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(ps, "get_data_parallel_group", lambda: object())
    monkeypatch.setattr(ps, "get_data_parallel_world_size", lambda: 2)
    monkeypatch.setattr(ps, "_COLLECTIVE_DEVICE", None)
    assert ps.get_collective_device() == "cpu"  # gloo, before a run names its device
    ps.set_collective_device(torch.device("meta"))  # stands for CUDA: any device but the CPU
    for call in (
        lambda: trainer._any_rank(True),
        lambda: trainer._average_over_dp(1.0),
        lambda: checkpointing._on_every_rank(True, 3, Path("x")),
    ):
        with pytest.raises(Recorded):
            call()
    assert seen == ["meta"] * 3
