"""Data-parallel grad sync on 2 gloo ranks: buckets reduce during the backward of the last micro
batch only (no_sync before), the result is the DP average, reduce-scatter keeps this rank's slice,
and the distributed optimizer's sharded checkpoint state resumes exactly."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distributed_utils import run_distributed
from megatron_core import parallel_state as ps
from megatron_core.config import ParallelConfig
from megatron_core.distributed import DistributedDataParallel


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(6, 6) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.pow(2).mean()


def local_batch(rank: int, micro: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * rank + micro))


def grad_sync_checks(reduce_kind: str) -> dict:
    ps.initialize_model_parallel(1, 1)
    rank = dist.get_rank()
    model = DistributedDataParallel(Toy(), ParallelConfig(world_size=2), bucket_size=50, reduce_kind=reduce_kind)
    buckets = model.grad_sync.buckets
    with model.no_sync():
        model(local_batch(rank, 0)).backward()
    launched_under_no_sync = any(b.launched for b in buckets)
    model(local_batch(rank, 1)).backward()
    launched_in_backward = [b.launched for b in buckets]
    # This rank's own gradient sum, from an unwrapped twin (the wrapper's buffers are reduced in place).
    twin = Toy()
    for micro in (0, 1):
        twin(local_batch(rank, micro)).backward()
    local = {n: p.grad.clone() for n, p in twin.named_parameters()}
    assert all(p.grad is None for p in model.module.parameters()), "main_grad hooks free each micro batch's grad"
    model.finish_grad_sync()
    out = {
        "buckets": len(buckets),
        "launched_under_no_sync": launched_under_no_sync,
        "launched_in_backward": launched_in_backward,
        "local": local,
    }
    if reduce_kind == "all_reduce":
        out["synced"] = {n: p.main_grad.clone() for n, p in model.module.named_parameters()}
    else:
        out["shards"] = [
            (b.grad_shard.clone(), [(b.offsets[i], p.numel()) for i, p in enumerate(b.params)], b.padded_numel)
            for b in buckets
        ]
        out["order"] = [[n for b in buckets for p in b.params for n, q in model.module.named_parameters() if q is p]]
    return out


def both_kinds() -> list[dict]:
    torch.set_num_threads(1)
    results = []
    for kind in ("all_reduce", "reduce_scatter"):
        try:
            results.append(grad_sync_checks(kind))
        finally:
            ps.destroy_model_parallel()
    results.append(distributed_optimizer_resume())
    return results


def distributed_optimizer_resume() -> dict:
    """Train DP2 with the distributed optimizer 3 steps, keep this rank's pieces (nothing gathered);
    train 2 more. A fresh model + optimizer loaded from the pieces must take the same 2 steps bit for bit."""
    import test_parallel_equivalence as proof

    layout = proof.Layout("DP2 distopt resume", dp=2, distributed_optimizer=True)
    run_root = Path(tempfile.mkdtemp())
    try:
        model, module, optimizer, _ = proof.fit(proof.make_recipe(layout, train_iters=3), run_root / "a")
        pieces, plain_state = optimizer.param_state(), optimizer.state_dict()
        model_state = {k: v.clone() for k, v in module.state_dict().items()}
        continued = _steps(module, optimizer, 2, model)
    finally:
        ps.destroy_model_parallel()
    whole = {}  # load_param_state takes whole tensors; this rank's pieces at their place suffice
    for name, piece in pieces.items():
        start, numel = piece.pop("start"), piece["exp_avg"].numel()
        whole[name] = {
            k: torch.zeros(model_state[name].numel()).index_copy_(0, torch.arange(start, start + numel), t)
            for k, t in piece.items()
        }
    try:
        model2, module2, optimizer2 = proof.build(proof.make_recipe(layout))
        module2.load_state_dict(model_state)
        optimizer2.load_state_dict({**plain_state, "param_state": whole})
        resumed = _steps(module2, optimizer2, 2, model2)
    finally:
        ps.destroy_model_parallel()
    return {
        "continued": continued,
        "resumed": resumed,
        "owned": {name: piece["exp_avg"].numel() for name, piece in pieces.items()},
        "numel": {name: t.numel() for name, t in model_state.items()},
    }


def _steps(module, optimizer, count: int, model) -> list[torch.Tensor]:
    """`count` optimizer steps on fixed synthetic batches; the flat parameters after each."""
    out = []
    for step in range(count):
        optimizer.zero_grad()
        tokens = torch.randint(0, 100, (2, 17), generator=torch.Generator().manual_seed(step + 50 * dist.get_rank()))
        loss = model(tokens[:, :-1], torch.arange(16).expand(2, 16), tokens[:, 1:]).mean()
        loss.backward()
        model.finish_grad_sync()
        optimizer.step()
        out.append(torch.cat([p.detach().reshape(-1) for p in module.parameters()]))
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(both_kinds, 2)


def test_buckets_reduce_during_the_last_backward_only(ranks):
    for rank in ranks:
        for result in rank[:2]:
            assert result["buckets"] > 1  # bucket_size 50 elements splits the 3 layers
            assert not result["launched_under_no_sync"]
            assert all(result["launched_in_backward"])  # every bucket launched by its hooks, overlapped


def test_all_reduce_gives_the_dp_average(ranks):
    a, b = ranks[0][0], ranks[1][0]
    for name in a["local"]:
        expected = (a["local"][name] + b["local"][name]) / 2
        for rank in (a, b):
            torch.testing.assert_close(rank["synced"][name], expected, rtol=1e-6, atol=1e-7)


def test_reduce_scatter_keeps_this_ranks_slice_of_the_average(ranks):
    for dp_rank, rank in enumerate(ranks):
        result = rank[1]
        names = iter(result["order"][0])
        for shard, layout, padded in result["shards"]:
            flat = torch.zeros(padded)
            for offset, numel in layout:
                name = next(names)
                mean = (ranks[0][1]["local"][name] + ranks[1][1]["local"][name]) / 2
                flat[offset : offset + numel] = mean.reshape(-1)
            size = padded // 2
            torch.testing.assert_close(shard, flat[dp_rank * size : (dp_rank + 1) * size], rtol=1e-6, atol=1e-7)


def test_distributed_optimizer_sharded_state_resumes_exactly(ranks):
    for rank in ranks:
        result = rank[2]
        for continued, resumed in zip(result["continued"], result["resumed"]):
            assert torch.equal(continued, resumed)
    # Each rank holds only its own pieces: together they cover every parameter exactly once.
    numel = ranks[0][2]["numel"]
    owned = [sum(rank[2]["owned"].get(name, 0) for rank in ranks) for name in numel]
    assert owned == list(numel.values())
