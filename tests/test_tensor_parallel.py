"""Tensor-parallel mappings, layers, vocab-parallel cross entropy and the RNG tracker on 2 gloo ranks."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed_utils import run_distributed
from torch import nn
from torch.testing import assert_close

from megatron_core import parallel_state as ps
from megatron_core import tensor_parallel as tp
from megatron_core.tensor_parallel.random import MODEL_PARALLEL_RNG

WORLD = 2


def _leaf(t):
    return t.clone().requires_grad_(True)


def _check_mappings():
    ps.initialize_model_parallel(WORLD, 1)
    r = ps.get_tensor_model_parallel_rank()
    torch.manual_seed(0)
    x = torch.randn(4, 3, 6)  # same on both ranks
    g = torch.randn(4, 3, 6)
    scale = r + 1.0  # makes each rank's contribution distinguishable (sum over ranks = 3)

    # f: identity forward, all-reduce backward
    a = _leaf(x)
    out = tp.copy_to_tensor_model_parallel_region(a)
    assert_close(out, x)
    out.backward(g * scale)
    assert_close(a.grad, g * 3)

    # g: all-reduce forward, identity backward
    a = _leaf(x * scale)
    out = tp.reduce_from_tensor_model_parallel_region(a)
    assert_close(out, x * 3)
    out.backward(g)
    assert_close(a.grad, g)
    assert_close(a.detach(), x * scale)  # the input is not summed into

    # split / gather along the last dim
    a = _leaf(x)
    out = tp.scatter_to_tensor_model_parallel_region(a)
    assert_close(out, x.chunk(WORLD, -1)[r])
    out.backward(g.chunk(WORLD, -1)[r])
    assert_close(a.grad, g)
    a = _leaf(x.chunk(WORLD, -1)[r])
    out = tp.gather_from_tensor_model_parallel_region(a)
    assert_close(out, x)
    out.backward(g)
    assert_close(a.grad, g.chunk(WORLD, -1)[r])

    # sequence parallel: split / gather / reduce-scatter along dim 0
    a = _leaf(x)
    out = tp.scatter_to_sequence_parallel_region(a)
    assert_close(out, x.chunk(WORLD, 0)[r])
    out.backward(g.chunk(WORLD, 0)[r])
    assert_close(a.grad, g)
    for tensor_parallel_output_grad in (True, False):
        a = _leaf(x.chunk(WORLD, 0)[r])
        out = tp.gather_from_sequence_parallel_region(a, tensor_parallel_output_grad)
        assert_close(out, x)
        out.backward(g * scale)
        expected = (g * 3 if tensor_parallel_output_grad else g * scale).chunk(WORLD, 0)[r]
        assert_close(a.grad, expected)
    a = _leaf(x * scale)
    out = tp.reduce_scatter_to_sequence_parallel_region(a)
    assert_close(out, (x * 3).chunk(WORLD, 0)[r])
    out.backward(g.chunk(WORLD, 0)[r])
    assert_close(a.grad, g)
    return True


@pytest.mark.slow
def test_mappings_forward_and_backward():
    assert run_distributed(_check_mappings, WORLD) == [True, True]


def _gather_grad(param):
    """The full gradient of a TP-sharded parameter, from every rank's slice."""
    parts = [torch.empty_like(param.grad) for _ in range(WORLD)]
    dist.all_gather(parts, param.grad.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=param.partition_dim)


def _check_layers(sequence_parallel):
    ps.initialize_model_parallel(WORLD, 1)
    r = ps.get_tensor_model_parallel_rank()
    torch.manual_seed(1)
    s, b, h_in, h_out, vocab = 6, 2, 8, 10, 16
    x = torch.randn(s, b, h_in)
    ref = nn.Linear(h_in, h_out)
    nn.init.normal_(ref.bias)
    g = torch.randn(s, b, h_out)

    def local_input(full):
        return _leaf(full.chunk(WORLD, 0)[r] if sequence_parallel else full)

    # Column-parallel: weight rows split; compare the full output and full gradients.
    col = tp.ColumnParallelLinear(h_in, h_out, gather_output=not sequence_parallel, sequence_parallel=sequence_parallel)
    with torch.no_grad():
        col.weight.copy_(ref.weight.chunk(WORLD, 0)[r])
        col.bias.copy_(ref.bias.chunk(WORLD, 0)[r])
    assert col.weight.shape == (h_out // WORLD, h_in) and col.weight.partition_dim == 0
    a, full_in = local_input(x), _leaf(x)
    expected = ref(full_in)
    expected.backward(g)
    out = col(a)
    if sequence_parallel:  # output stays split by features
        assert_close(out, expected.detach().chunk(WORLD, -1)[r])
        out.backward(g.chunk(WORLD, -1)[r])
        assert_close(a.grad, full_in.grad.chunk(WORLD, 0)[r])
    else:
        assert_close(out, expected.detach())
        out.backward(g)
        assert_close(a.grad, full_in.grad)
    assert_close(_gather_grad(col.weight), ref.weight.grad)
    assert_close(_gather_grad(col.bias), ref.bias.grad)

    # Row-parallel: weight columns split, bias added once after the reduce.
    ref.zero_grad()
    row_ref = nn.Linear(h_out, h_in)
    nn.init.normal_(row_ref.bias)
    y = torch.randn(s, b, h_out)
    gy = torch.randn(s, b, h_in)
    row = tp.RowParallelLinear(h_out, h_in, input_is_parallel=True, sequence_parallel=sequence_parallel)
    with torch.no_grad():
        row.weight.copy_(row_ref.weight.chunk(WORLD, 1)[r])
        row.bias.copy_(row_ref.bias)
    assert row.weight.partition_dim == 1 and getattr(row.bias, "sequence_parallel") is sequence_parallel
    full_y = _leaf(y)
    expected = row_ref(full_y)
    expected.backward(gy)
    a = _leaf(y.chunk(WORLD, -1)[r])
    out = row(a)
    if sequence_parallel:
        assert_close(out, expected.detach().chunk(WORLD, 0)[r])
        out.backward(gy.chunk(WORLD, 0)[r])
        bias_grad = row.bias.grad.clone()
        dist.all_reduce(bias_grad, group=ps.get_tensor_model_parallel_group())  # what the trainer does for SP params
    else:
        assert_close(out, expected.detach())
        out.backward(gy)
        bias_grad = row.bias.grad
    assert_close(a.grad, full_y.grad.chunk(WORLD, -1)[r])
    assert_close(_gather_grad(row.weight), row_ref.weight.grad)
    assert_close(bias_grad, row_ref.bias.grad)
    if not sequence_parallel:  # the scatter path for a replicated input
        row_full = tp.RowParallelLinear(h_out, h_in, input_is_parallel=False)
        with torch.no_grad():
            row_full.weight.copy_(row.weight)
            row_full.bias.copy_(row.bias)
        assert_close(row_full(y), expected.detach())

    # Vocab-parallel embedding: ids [s, b] covering both halves of the vocabulary.
    emb_ref = nn.Embedding(vocab, h_in)
    ids = torch.randint(0, vocab, (s, b))
    ids[0, 0], ids[1, 0] = 0, vocab - 1
    emb = tp.VocabParallelEmbedding(vocab, h_in, reduce_scatter_output=sequence_parallel)
    with torch.no_grad():
        emb.weight.copy_(emb_ref.weight.chunk(WORLD, 0)[r])
    assert (emb.vocab_start_index, emb.vocab_end_index) == (r * vocab // 2, (r + 1) * vocab // 2)
    expected = emb_ref(ids)
    ge = torch.randn_like(expected)
    expected.backward(ge)
    out = emb(ids)
    if sequence_parallel:
        assert_close(out, expected.detach().chunk(WORLD, 0)[r])
        out.backward(ge.chunk(WORLD, 0)[r])
    else:
        assert_close(out, expected.detach())
        out.backward(ge)
    assert_close(_gather_grad(emb.weight), emb_ref.weight.grad)

    # Vocab-parallel cross entropy against F.cross_entropy on the full logits.
    logits = torch.randn(s, b, vocab) * 3
    labels = torch.randint(0, vocab, (s, b))
    full_logits = _leaf(logits)
    expected = F.cross_entropy(full_logits.reshape(-1, vocab), labels.reshape(-1), reduction="none").view(s, b)
    gl = torch.rand(s, b)
    expected.backward(gl)
    local_logits = _leaf(logits.chunk(WORLD, -1)[r])
    loss = tp.vocab_parallel_cross_entropy(local_logits, labels)
    assert loss.dtype == torch.float32
    assert_close(loss, expected.detach())
    loss.backward(gl)
    assert_close(local_logits.grad, full_logits.grad.chunk(WORLD, -1)[r])
    return True


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_parallel_layers_match_full_torch_layers(sequence_parallel):
    assert run_distributed(_check_layers, WORLD, sequence_parallel) == [True, True]


def test_layers_on_a_single_process_are_nn_linear():
    torch.manual_seed(2)
    col = tp.ColumnParallelLinear(5, 7)
    row = tp.RowParallelLinear(7, 3, input_is_parallel=False)
    x = torch.randn(4, 5)
    assert_close(row(col(x)), F.linear(F.linear(x, col.weight, col.bias), row.weight, row.bias))


def test_initialization_keeps_this_ranks_slice_of_the_master_weight(monkeypatch):
    master = tp.ColumnParallelLinear(6, 8, init_method=tp.normal_init(1.0))
    master.reset_parameters(torch.Generator().manual_seed(5))
    for rank in range(2):  # pretend to be TP rank `rank` of 2: the slice must be the master's rows
        monkeypatch.setattr(ps, "get_tensor_model_parallel_world_size", lambda: 2)
        monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda rank=rank: rank)
        shard = tp.ColumnParallelLinear(6, 8, init_method=tp.normal_init(1.0))
        shard.reset_parameters(torch.Generator().manual_seed(5))
        monkeypatch.undo()
        assert_close(shard.weight, master.weight.chunk(2, 0)[rank])


def _check_rng_tracker():
    ps.initialize_model_parallel(WORLD, 1)
    tp.model_parallel_manual_seed(1234)
    group = ps.get_tensor_model_parallel_group()

    def across_ranks(t):
        parts = [torch.empty_like(t) for _ in range(WORLD)]
        dist.all_gather(parts, t, group=group)
        return parts

    outside = F.dropout(torch.ones(64), p=0.5)
    with tp.get_rng_tracker().fork():
        inside = F.dropout(torch.ones(64), p=0.5)
    after = F.dropout(torch.ones(64), p=0.5)
    o, i, a = across_ranks(outside), across_ranks(inside), across_ranks(after)
    assert torch.equal(o[0], o[1]), "dropout outside TP regions must agree across TP ranks"
    assert torch.equal(a[0], a[1]), "fork must not disturb the default generator"
    assert not torch.equal(i[0], i[1]), "dropout inside TP regions must differ across TP ranks"
    return True


@pytest.mark.slow
def test_rng_tracker_inside_differs_outside_agrees_across_tp():
    assert run_distributed(_check_rng_tracker, WORLD) == [True, True]


def test_rng_tracker_fork_is_reproducible_and_isolated():
    tp.model_parallel_manual_seed(7)
    first_outside = torch.rand(8)
    with tp.get_rng_tracker().fork():
        first_inside = torch.rand(8)
    tp.model_parallel_manual_seed(7)
    with tp.get_rng_tracker().fork():  # forking first does not change what the default draws
        assert torch.equal(torch.rand(8), first_inside)
    assert torch.equal(torch.rand(8), first_outside)
    with tp.get_rng_tracker().fork():  # the tracker state advanced: a new draw
        assert not torch.equal(torch.rand(8), first_inside)
    assert tp.get_rng_tracker().device_type in ("cpu", "cuda")
    with pytest.raises(RuntimeError, match="not set"):
        with tp.get_rng_tracker().fork("no-such-state"):
            pass
    assert MODEL_PARALLEL_RNG in tp.get_rng_tracker().get_states()


@pytest.mark.parametrize("tp_rank, pp_rank", [(0, 0), (1, 0), (3, 2)])
def test_seed_offsets_are_megatrons(monkeypatch, tp_rank, pp_rank):
    """Megatron's numbers: the default generators get seed + 100 x pipeline rank, the tracker's
    model-parallel generator that + 2718 + tensor rank."""
    from megatron_core import pretrain_gpt as train_lib
    from megatron_core.tensor_parallel.random import get_rng_tracker

    monkeypatch.setattr(ps, "get_pipeline_model_parallel_rank", lambda: pp_rank)
    monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: tp_rank)
    train_lib.seed_everything(1234)
    assert torch.initial_seed() == 1234 + 100 * pp_rank
    expected = torch.Generator().manual_seed(1234 + 100 * pp_rank + 2718 + tp_rank).get_state()
    assert torch.equal(get_rng_tracker().get_states()[MODEL_PARALLEL_RNG], expected)
    torch.manual_seed(0)
