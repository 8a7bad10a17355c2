"""The 1F1B schedule on 4 gloo ranks with a toy stage (one Linear + tanh per stage):
the order of forwards and backwards per stage, gradients equal to the single-process chain for
every number of micro batches and forward-only mode. (Sequence-parallel p2p shapes [s/tp, b, h]
are proven by the TP2xPP2 SP layout of test_parallel_equivalence.)"""

from __future__ import annotations

import pytest
import torch

from distributed_utils import run_distributed
from megatron_core import parallel_state as ps
from megatron_core.pipeline_parallel import get_forward_backward_func

HIDDEN, SEQ, MICRO = 8, 4, 2
PP = 4


def stage_weights() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randn(HIDDEN, HIDDEN, generator=generator) / HIDDEN ** 0.5 for _ in range(PP)]


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


def single_process_grads(num_microbatches: int):
    weights = [w.clone().requires_grad_(True) for w in stage_weights()]
    losses = []
    for i in range(num_microbatches):
        h = micro_batch(i)
        for w in weights:
            h = torch.tanh(h @ w.t())
        loss = h.pow(2).mean()
        losses.append(loss.item() if not loss.requires_grad else float(loss.detach()))
        (loss / num_microbatches).backward()
    return [w.grad for w in weights], losses


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
                    output.register_hook(lambda grad: events.append("B"))

                def loss_func(per_token):
                    loss = per_token.mean()
                    return loss, {"lm loss": loss.detach()}

                return output, loss_func

            stats = schedule(forward_step, iter(range(count)), model, count, seq_length=SEQ, micro_batch_size=MICRO,
                             forward_only=forward_only, hidden_size=HIDDEN)
            results.append({"count": count, "forward_only": forward_only, "events": "".join(events),
                            "losses": [float(s["lm loss"]) for s in stats],
                            "grad": None if model.weight.grad is None else model.weight.grad.clone()})
    return results


COUNTS = [1, 2, 3, 5]


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(run_schedules, PP, COUNTS, timeout=120)


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
