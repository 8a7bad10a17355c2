"""`training.compile`: each transformer layer through torch.compile (inductor's C++ backend on this CPU)
trains like eager with dropout on, without a graph break, alone and under TP 2 with sequence parallelism.

Dropout inside TP regions (attention probabilities, SP chunks) is drawn through the tracker's custom op
(the graph never swaps generator states); dropout outside them comes from the default generator, which
inductor reads through aten with `fallback_random` (so the masks are eager's, bit for bit).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from distributed_utils import run_distributed
from torch.testing import assert_close

from megatron_core import parallel_state as ps
from megatron_core.config import ModelConfig, ParallelConfig
from megatron_core.errors import UserError
from megatron_core.models.gpt import GPTModel, compile_layers
from megatron_core.tensor_parallel.random import model_parallel_manual_seed

SEQ, BATCH, VOCAB, STEPS = 16, 2, 128, 3
CONFIG = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=SEQ,
    max_position_embeddings=SEQ,
    hidden_dropout=0.1,
    attention_dropout=0.1,
)


@pytest.fixture
def eager_masks():
    """Inductor draws the default generator's dropout through aten, as eager does (its own RNG otherwise).
    Through the config's own patch(): monkeypatch's undo deletes a config entry, breaking later compiles."""
    import torch._inductor.config as inductor_config

    # compile_threads 1: no worker pool to start for one small graph
    with inductor_config.patch(fallback_random=True, compile_threads=1):
        torch._dynamo.reset()
        yield
        torch._dynamo.reset()


def _train(parallel: ParallelConfig, compiled: bool) -> tuple[list, list[str]]:
    """(per step: loss and every gradient, state_dict keys) of STEPS SGD steps from the same seeds."""
    model_parallel_manual_seed(5)
    model = GPTModel(CONFIG, parallel, VOCAB, init_seed=3)
    if compiled:
        compile_layers(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = torch.Generator().manual_seed(0)
    steps = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=batches)
        loss = model(ids, torch.arange(SEQ).expand(BATCH, SEQ), ids.roll(-1, 1)).mean()
        optimizer.zero_grad()
        loss.backward()
        steps.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        optimizer.step()
    return steps, list(model.state_dict())


def _assert_same_training(eager: list, compiled: list) -> None:
    for step, ((eager_loss, eager_grads), (loss, grads)) in enumerate(zip(eager, compiled)):
        assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6, msg=f"loss of step {step}")
        for i, (grad, eager_grad) in enumerate(zip(grads, eager_grads)):
            assert_close(grad, eager_grad, rtol=1e-4, atol=1e-6, msg=f"gradient {i} of step {step}")


@pytest.mark.usefixtures("eager_masks")
def test_compiled_layers_train_like_eager_with_dropout():
    eager, eager_keys = _train(ParallelConfig(), compiled=False)
    compiled, keys = _train(ParallelConfig(), compiled=True)
    assert keys == eager_keys  # checkpoints of compiled and eager runs are interchangeable
    _assert_same_training(eager, compiled)
    # Dropout was drawn (a p=0 run would pass the comparison above for any mask handling).
    assert not torch.equal(eager[0][0], _train_without_dropout_loss())


def _train_without_dropout_loss() -> torch.Tensor:
    model_parallel_manual_seed(5)
    config = dataclasses.replace(CONFIG, hidden_dropout=0.0, attention_dropout=0.0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    model = GPTModel(config, ParallelConfig(), VOCAB, init_seed=3)
    return model(ids, torch.arange(SEQ).expand(BATCH, SEQ), ids.roll(-1, 1)).mean().detach()


def _graph_breaks(parallel: ParallelConfig) -> list[str]:
    model_parallel_manual_seed(5)
    layer = GPTModel(CONFIG, parallel, VOCAB, init_seed=3).encoder.layers[0]
    local_seq = SEQ // ps.get_tensor_model_parallel_world_size() if parallel.sequence_parallel else SEQ
    explained = torch._dynamo.explain(layer)(torch.randn(local_seq, BATCH, CONFIG.hidden_size))
    return [reason.reason.splitlines()[0] for reason in explained.break_reasons]


def test_a_layer_with_dropout_compiles_without_graph_breaks():
    torch._dynamo.reset()
    assert _graph_breaks(ParallelConfig()) == []


def test_compile_refuses_selective_recompute():
    model_parallel_manual_seed(5)
    with pytest.raises(UserError, match="use --set recompute_granularity=full"):
        compile_layers(GPTModel(CONFIG, ParallelConfig(recompute_granularity="selective"), VOCAB, init_seed=3))


def _tp2_compiled_and_eager():
    import torch._inductor.config as inductor_config

    inductor_config.fallback_random = True
    inductor_config.compile_threads = 1
    ps.initialize_model_parallel(2, 1)
    parallel = ParallelConfig(world_size=2, tensor_model_parallel_size=2, sequence_parallel=True)
    breaks = _graph_breaks(parallel)
    torch._dynamo.reset()
    return breaks, _train(parallel, compiled=False), _train(parallel, compiled=True)


@pytest.mark.slow
def test_tp2_sequence_parallel_compiled_layers_train_like_eager():
    """Under TP 2 + SP on gloo the collectives (autograd Functions around c10d calls) trace into the
    layer's graph, and the tracker's masks differ per rank exactly as in eager."""
    for breaks, (eager, eager_keys), (compiled, keys) in run_distributed(_tp2_compiled_and_eager, 2):
        assert breaks == []
        assert keys == eager_keys
        _assert_same_training(eager, compiled)
