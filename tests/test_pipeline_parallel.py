"""The 1F1B schedule on 4 gloo ranks with a toy stage (one Linear + tanh per stage, driven through
the model protocol's LocalModel, gradients in .grad): the order of forwards and backwards per stage,
gradients equal to the single-process chain for every number of micro batches and forward-only mode.
(Sequence-parallel p2p shapes [s/tp, b, h] are proven by the TP2xPP2 SP layout of test_parallel_equivalence.)"""

from __future__ import annotations

import pytest
import torch

from distributed_utils import LocalModel, run_distributed
from megatron_core import parallel_state as ps
from megatron_core.pipeline_parallel import get_forward_backward_func

HIDDEN, SEQ, MICRO = 8, 4, 2
PP = 4


def stage_weights() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randn(HIDDEN, HIDDEN, generator=generator) / HIDDEN**0.5 for _ in range(PP)]


def micro_batch(index: int) -> torch.Tensor:
    return torch.randn(SEQ, MICRO, HIDDEN, generator=torch.Generator().manual_seed(100 + index))


class ToyStage(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, first: bool, last: bool):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone())
        self.first, self.last, self.input_tensor = first, last, None

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor

    def shared_embedding_parameters(self):
        return []

    def forward(self, x):
        h = x if self.first else self.input_tensor
        out = torch.tanh(h @ self.weight.t())
        return out.pow(2).mean(dim=-1).t() if self.last else out  # [b, s] "per-token loss" on the last stage


def backward_through_chain(weights: list[torch.Tensor], num_microbatches: int):
    """(grads, losses) of the single-process chain tanh(h W^T) over the micro batches."""
    weights = [w.clone().requires_grad_(True) for w in weights]
    losses = []
    for i in range(num_microbatches):
        h = micro_batch(i)
        for w in weights:
            h = torch.tanh(h @ w.t())
        loss = h.pow(2).mean()
        losses.append(float(loss.detach()))
        (loss / num_microbatches).backward()
    return [w.grad for w in weights], losses


def single_process_grads(num_microbatches: int):
    return backward_through_chain(stage_weights(), num_microbatches)


def run_schedules(micro_batch_counts: list[int]) -> list[dict]:
    ps.initialize_model_parallel(1, PP)
    rank = ps.get_pipeline_model_parallel_rank()
    model = ToyStage(stage_weights()[rank], ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage())
    schedule = get_forward_backward_func()
    results = []
    for count in micro_batch_counts:
        for forward_only in (False, True):
            events, model.weight.grad = [], None

            def forward_step(data_iterator, model):
                index = next(data_iterator)
                events.append("F")
                output = model(micro_batch(index))
                if output.requires_grad:
                    output.register_hook(lambda _grad: events.append("B"))

                def loss_func(per_token):
                    loss = per_token.mean()
                    return loss, {"lm loss": loss.detach()}

                return output, loss_func

            stats = schedule(
                forward_step,
                iter(range(count)),
                LocalModel(model),
                count,
                seq_length=SEQ,
                micro_batch_size=MICRO,
                forward_only=forward_only,
                hidden_size=HIDDEN,
                sequence_parallel=False,
            )
            results.append(
                {
                    "count": count,
                    "forward_only": forward_only,
                    "events": "".join(events),
                    "losses": [float(s["lm loss"]) for s in stats],
                    "grad": None if model.weight.grad is None else model.weight.grad.clone(),
                }
            )
    return results


COUNTS = [1, 2, 3, 5]


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(run_schedules, PP, COUNTS)


def expected_events(stage: int, count: int) -> str:
    warmup = min(PP - stage - 1, count)
    return "F" * warmup + "FB" * (count - warmup) + "B" * warmup


def test_one_forward_one_backward_order(ranks):
    for stage, results in enumerate(ranks):
        for result in results:
            if not result["forward_only"]:
                assert result["events"] == expected_events(stage, result["count"]), (stage, result["count"])


def test_gradients_and_losses_match_the_single_process_chain(ranks):
    for i, count in enumerate(COUNTS):
        grads, losses = single_process_grads(count)
        for stage, results in enumerate(ranks):
            result = results[2 * i]
            torch.testing.assert_close(result["grad"], grads[stage], rtol=1e-5, atol=1e-7)
            if stage == PP - 1:
                assert result["losses"] == pytest.approx(losses, rel=1e-6)
            else:
                assert result["losses"] == []


def test_forward_only_returns_losses_without_gradients(ranks):
    for i, count in enumerate(COUNTS):
        _, losses = single_process_grads(count)
        for stage, results in enumerate(ranks):
            result = results[2 * i + 1]
            assert result["forward_only"] and result["grad"] is None
            assert result["events"] == "F" * count
            assert result["losses"] == (pytest.approx(losses, rel=1e-6) if stage == PP - 1 else [])


# ----------------------------------------------------------------------------------------------
# The interleaved schedule (virtual pipeline stages): chunk c of rank r is stage c * pp + r of a
# pp * v stage toy chain.
# ----------------------------------------------------------------------------------------------


class ToyChunks(torch.nn.Module):
    """A rank's model chunks, as GPTModelChunks holds them (the schedule runs the protocol's `.chunks`)."""

    def __init__(self, chunks: list[ToyStage]):
        super().__init__()
        self.chunks = torch.nn.ModuleList(chunks)

    def shared_embedding_parameters(self):
        return []


def chain_weights(stages: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randn(HIDDEN, HIDDEN, generator=generator) / HIDDEN**0.5 for _ in range(stages)]


def chain_grads(stages: int, num_microbatches: int):
    return backward_through_chain(chain_weights(stages), num_microbatches)


def run_interleaved(pp: int, v: int, micro_batch_counts: list[int]) -> dict:
    from megatron_core.errors import UserError
    from megatron_core.pipeline_parallel import forward_backward_pipelining_with_interleaving

    ps.initialize_model_parallel(1, pp, virtual_pipeline_model_parallel_size=v)
    rank = ps.get_pipeline_model_parallel_rank()
    weights = chain_weights(pp * v)
    chunks = []
    for c in range(v):
        stage = ToyStage(weights[c * pp + rank], first=(c == 0 and rank == 0), last=(c == v - 1 and rank == pp - 1))
        stage.chunk = c
        chunks.append(stage)
    model = LocalModel(ToyChunks(chunks))
    assert get_forward_backward_func() is forward_backward_pipelining_with_interleaving
    results = []
    for count in micro_batch_counts:
        for forward_only in (False, True):
            events, reads = [], []
            for chunk in chunks:
                chunk.weight.grad = None

            def data():
                for index in range(count):
                    reads.append(index)
                    yield index

            def forward_step(data_iterator, chunk):
                index = next(data_iterator)
                events.append(("F", chunk.chunk, index))
                output = chunk(micro_batch(index))
                if output.requires_grad:
                    output.register_hook(lambda _grad, c=chunk.chunk, i=index: events.append(("B", c, i)))

                def loss_func(per_token):
                    loss = per_token.mean()
                    return loss, {"lm loss": loss.detach()}

                return output, loss_func

            stats = forward_backward_pipelining_with_interleaving(
                forward_step,
                data(),
                model,
                count,
                seq_length=SEQ,
                micro_batch_size=MICRO,
                forward_only=forward_only,
                hidden_size=HIDDEN,
                sequence_parallel=False,
            )
            results.append(
                {
                    "count": count,
                    "forward_only": forward_only,
                    "events": events,
                    "reads": reads,
                    "losses": [float(s["lm loss"]) for s in stats],
                    "grads": [None if c.weight.grad is None else c.weight.grad.clone() for c in chunks],
                }
            )
    try:
        forward_backward_pipelining_with_interleaving(
            lambda _it, _m: None, iter(()), model, pp + 1, seq_length=SEQ, micro_batch_size=MICRO, hidden_size=HIDDEN
        )
        refused = None
    except UserError as exc:
        refused = str(exc)
    return {"rank": rank, "results": results, "refused": refused}


def interleaved_order(pp: int, v: int, rank: int, count: int) -> list[tuple]:
    """Megatron's interleaved order on one rank: virtual micro batch k is chunk (k mod pp v) // pp,
    micro batch (k // pp v) pp + k mod pp; warm-up forwards, then one forward one backward, then
    the remaining backwards (backwards visit the chunks in reverse)."""
    total = count * v

    def step(k, forward):
        chunk = (k % (pp * v)) // pp
        return ("F" if forward else "B", chunk if forward else v - 1 - chunk, (k // (pp * v)) * pp + k % pp)

    warmup = min(2 * (pp - rank - 1) + (v - 1) * pp, total)
    order = [step(k, True) for k in range(warmup)]
    for i in range(total - warmup):
        order += [step(warmup + i, True), step(i, False)]
    return order + [step(k, False) for k in range(total - warmup, total)]


INTERLEAVED_CASES = {2: (3, [2, 4, 6]), 4: (2, [4, 8])}  # pp: (virtual stages, micro batch counts)


@pytest.fixture(scope="module", params=sorted(INTERLEAVED_CASES), ids=lambda pp: f"PP{pp}")
def interleaved(request):
    pp = request.param
    v, counts = INTERLEAVED_CASES[pp]
    return pp, v, counts, run_distributed(run_interleaved, pp, pp, v, counts)


def test_interleaved_order_is_megatrons(interleaved):
    pp, v, counts, ranks = interleaved
    for rank in ranks:
        for result in rank["results"]:
            if result["forward_only"]:
                continue
            assert result["events"] == interleaved_order(pp, v, rank["rank"], result["count"]), (
                rank["rank"],
                result["count"],
            )
            assert result["reads"] == list(range(result["count"]))  # the data iterator is read once per micro batch


def test_interleaved_gradients_and_losses_match_the_single_process_chain(interleaved):
    pp, v, counts, ranks = interleaved
    for i, count in enumerate(counts):
        grads, losses = chain_grads(pp * v, count)
        for rank in ranks:
            r = rank["rank"]
            result = rank["results"][2 * i]
            for c in range(v):
                torch.testing.assert_close(result["grads"][c], grads[c * pp + r], rtol=1e-5, atol=1e-7)
            assert result["losses"] == (pytest.approx(losses, rel=1e-6) if r == pp - 1 else [])
            forward_only = rank["results"][2 * i + 1]
            assert all(g is None for g in forward_only["grads"])
            assert [e[0] for e in forward_only["events"]] == ["F"] * (count * v)
            assert forward_only["losses"] == (pytest.approx(losses, rel=1e-6) if r == pp - 1 else [])


def test_interleaved_refuses_micro_batches_not_a_multiple_of_pp(interleaved):
    pp, _, _, ranks = interleaved
    for rank in ranks:
        assert rank["refused"] is not None and f"({pp + 1})" in rank["refused"] and f"size {pp}" in rank["refused"]
