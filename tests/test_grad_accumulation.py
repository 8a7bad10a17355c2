"""Gradients accumulate in fp32 main_grad buffers (Megatron's accumulate_allreduce_grads_in_fp32,
forced on for bf16): 16 bf16 micro batches lose nothing that a bf16 .grad would."""

from __future__ import annotations

import torch

from megatron_core.config import ModelConfig, ParallelConfig
from megatron_core.distributed import DistributedDataParallel
from megatron_core.models import GPTModel

VOCAB, MICRO_BATCHES = 96, 16


def _model() -> GPTModel:
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=16, max_position_embeddings=16,
                      hidden_dropout=0.0, attention_dropout=0.0)
    return GPTModel(cfg, ParallelConfig(), VOCAB, init_seed=3).to(torch.bfloat16)


def _micro_batches():
    gen = torch.Generator().manual_seed(0)
    for _ in range(MICRO_BATCHES):
        tokens = torch.randint(0, VOCAB, (2, 17), generator=gen)
        yield tokens[:, :-1], torch.arange(16).expand(2, 16), tokens[:, 1:]


def _loss(model, batch) -> torch.Tensor:
    return model(*batch).float().mean() / MICRO_BATCHES  # as the schedule scales each micro batch


def _relative_error(got: dict, want: dict) -> float:
    num = sum(float((got[n].double() - want[n]).pow(2).sum()) for n in want)
    return (num / sum(float(w.pow(2).sum()) for w in want.values())) ** 0.5


def test_bf16_micro_batches_accumulate_in_fp32_main_grad():
    # The reference: each micro batch's bf16 gradient on its own, summed in float64.
    reference_model = _model()
    reference = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in reference_model.named_parameters()}
    for batch in _micro_batches():
        reference_model.zero_grad()
        _loss(reference_model, batch).backward()
        for n, p in reference_model.named_parameters():
            reference[n] += p.grad.double()

    # What a bf16 .grad accumulates over the same micro batches.
    plain = _model()
    for batch in _micro_batches():
        _loss(plain, batch).backward()
    bf16_accumulated = {n: p.grad for n, p in plain.named_parameters()}

    # Ours: the wrapper's fp32 main_grad buffers, the micro batches' .grad freed as they come.
    wrapped = DistributedDataParallel(_model(), ParallelConfig(), grad_dtype=torch.float32)
    batches = list(_micro_batches())
    with wrapped.no_sync():
        for batch in batches[:-1]:
            _loss(wrapped, batch).backward()
    _loss(wrapped, batches[-1]).backward()
    wrapped.finish_grad_sync()
    params = dict(wrapped.module.named_parameters())
    assert all(p.grad is None and p.main_grad.dtype == torch.float32 for p in params.values())
    ours = {n: p.main_grad for n, p in params.items()}
    assert wrapped.grad_sync.grad_buffer_bytes == 4 * sum(p.numel() for p in params.values())

    ours_error, bf16_error = _relative_error(ours, reference), _relative_error(bf16_accumulated, reference)
    assert ours_error < 1e-6, ours_error
    assert bf16_error > 100 * ours_error, (bf16_error, ours_error)


def test_next_backward_starts_from_zero_even_without_zero_grad_buffer():
    """A finished iteration's buffers are zeroed by the next backward, so two iterations never sum."""
    wrapped = DistributedDataParallel(_model(), ParallelConfig(), grad_dtype=torch.float32)
    batch = next(_micro_batches())
    _loss(wrapped, batch).backward()
    wrapped.finish_grad_sync()
    first = {n: p.main_grad.clone() for n, p in wrapped.module.named_parameters()}
    _loss(wrapped, batch).backward()
    wrapped.finish_grad_sync()
    for n, p in wrapped.module.named_parameters():
        assert torch.equal(p.main_grad, first[n]), n
