"""Gradients accumulate in fp32 main_grad buffers (Megatron's accumulate_allreduce_grads_in_fp32,
forced on for bf16): 16 bf16 micro batches lose nothing that a bf16 .grad would."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from megatron_core.config import ModelConfig, ParallelConfig
from megatron_core.distributed import DistributedDataParallel
from megatron_core.models import GPTModel

VOCAB, MICRO_BATCHES = 96, 16


def _model() -> GPTModel:
    cfg = ModelConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=2,
        seq_length=16,
        max_position_embeddings=16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
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
    ours = _wrapped_main_grads()

    ours_error, bf16_error = _relative_error(ours, reference), _relative_error(bf16_accumulated, reference)
    assert ours_error < 1e-6, ours_error
    assert bf16_error > 100 * ours_error, (bf16_error, ours_error)


def _wrapped_main_grads() -> dict:
    wrapped = DistributedDataParallel(_model(), ParallelConfig(), grad_dtype=torch.float32)
    batches = list(_micro_batches())
    with wrapped.no_sync():
        for batch in batches[:-1]:
            _loss(wrapped, batch).backward()
    _loss(wrapped, batches[-1]).backward()
    wrapped.finish_grad_sync()
    params = dict(wrapped.module.named_parameters())
    assert all(p.grad is None and p.main_grad.dtype == torch.float32 for p in params.values())
    buffers = sum(b.buffer.numel() * b.buffer.element_size() for b in wrapped.grad_sync.buckets)
    assert buffers == 4 * sum(p.numel() for p in params.values())  # one fp32 slot per parameter element
    return {n: p.main_grad for n, p in params.items()}


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


def _adam_state_is_where_it_lives(optimizer) -> None:
    for group in optimizer.param_groups:
        on_device = group.get("fused", False) or group.get("capturable", False)
        for param in group["params"]:
            state = optimizer.state[param]
            assert state, "every parameter has Adam state after a step and a load"
            for key in ("exp_avg", "exp_avg_sq"):
                assert state[key].device == param.device and state[key].dtype == param.dtype, key
            step = state["step"]
            assert step.dtype == torch.float32
            assert step.device == (param.device if on_device else torch.device("cpu"))


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("distributed", [False, True])
def test_loaded_optimizer_state_sits_on_its_parameters_device_and_dtype(monkeypatch, fused, distributed):
    """After a load, Adam's moments and step are where the inner optimizer expects them (for fused
    AdamW: on the parameter's device). On this CPU-only machine every device is the CPU: the test
    pins the rule (and the dtypes); the CUDA placement it implies was read, not run."""
    from megatron_core.optimizer import distrib_optimizer, optimizer as optimizer_module
    from megatron_core.optimizer import AdamSettings, DistributedOptimizer, MegatronOptimizer

    def build_adam(groups, settings, _fused_adam_cls=None):
        kwargs = dict(lr=settings.lr, weight_decay=settings.weight_decay)
        return torch.optim.AdamW(groups, fused=fused, foreach=not fused, **kwargs), "test"

    monkeypatch.setattr(optimizer_module, "build_adam", build_adam)
    monkeypatch.setattr(distrib_optimizer, "build_adam", build_adam)

    def build():
        kind = "reduce_scatter" if distributed else "all_reduce"
        wrapped = DistributedDataParallel(_model(), ParallelConfig(), grad_dtype=torch.float32, reduce_kind=kind)
        cls = DistributedOptimizer if distributed else MegatronOptimizer
        return wrapped, cls(wrapped if distributed else wrapped.module, AdamSettings(1e-3, 0.01), precision="bf16")

    wrapped, opt = build()
    batch = next(_micro_batches())
    _loss(wrapped, batch).backward()
    wrapped.finish_grad_sync()
    assert opt.step()[0]
    saved = opt.state_dict()
    if distributed:  # one DP rank: its pieces are whole (flat) parameters; load_state_dict takes whole tensors
        saved["param_state"] = {
            name: {k: t for k, t in piece.items() if k != "start"} for name, piece in opt.param_state().items()
        }
    wrapped2, opt2 = build()
    opt2.load_state_dict(saved)
    _adam_state_is_where_it_lives(opt2.optimizer)
    _loss(wrapped2, batch).backward()
    wrapped2.finish_grad_sync()
    assert opt2.step()[0]  # the loaded state is usable as placed


def test_fp16_buffers_feed_the_distributed_optimizers_fp32_masters():
    """fp16 without accumulate_allreduce_grads_in_fp32 keeps fp16 main_grad buffers; the distributed
    optimizer's fp32 master pieces still take their gradients (as fp32) and step."""
    from megatron_core.optimizer import AdamSettings, DistributedOptimizer

    wrapped = DistributedDataParallel(
        _model().to(torch.float16), ParallelConfig(), grad_dtype=torch.float16, reduce_kind="reduce_scatter"
    )
    opt = DistributedOptimizer(wrapped, AdamSettings(1e-3, 0.0), precision="fp16")
    before = [p.detach().clone() for p in wrapped.module.parameters()]
    _loss(wrapped, next(_micro_batches())).backward()
    wrapped.finish_grad_sync()
    ok, norm, _ = opt.step()
    assert ok and norm > 0
    assert any(not torch.equal(b, p) for b, p in zip(before, wrapped.module.parameters()))


def test_fp32_iterations_without_zero_grad_buffer_lose_nothing():
    """An fp32 param's .grad is its main_grad view while the optimizer steps; the step lets go of it,
    so the next backward accumulates afresh instead of adding into the buffer it then zeroes."""
    from megatron_core.optimizer import AdamSettings, MegatronOptimizer

    model = _model().float()
    wrapped = DistributedDataParallel(model, ParallelConfig(), grad_dtype=torch.float32)
    opt = MegatronOptimizer(model, AdamSettings(0.0, 0.0), precision="fp32")  # lr 0: the same weights twice
    batch = next(_micro_batches())
    firsts = []
    for _ in range(2):
        _loss(wrapped, batch).backward()
        wrapped.finish_grad_sync()
        firsts.append({n: p.main_grad.clone() for n, p in model.named_parameters()})
        assert opt.step()[0]
    for name, grad in firsts[0].items():
        assert torch.equal(firsts[1][name], grad) and grad.abs().sum() > 0, name


class _TwoHeads(torch.nn.Module):
    """Two branches, so an iteration can leave one of them without a gradient."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)

    def forward(self, x, use_b: bool = True):
        return self.a(x).sum() + (self.b(x).sum() if use_b else 0.0)


@pytest.mark.parametrize("clear", ["zero_grad_buffer", "next_backward"])
def test_a_parameter_without_a_gradient_this_iteration_reads_zero_not_the_last_one(clear):
    """main_grad is not filled when an iteration starts (the first gradient is copied in); what no
    backward wrote must still read zero after finish_grad_sync, not the previous iteration's gradient."""
    wrapped = DistributedDataParallel(_TwoHeads(), ParallelConfig(), grad_dtype=torch.float32)
    x = torch.randn(3, 8)
    wrapped(x).backward()
    wrapped.finish_grad_sync()
    assert wrapped.module.b.weight.main_grad.abs().sum() > 0
    if clear == "zero_grad_buffer":
        wrapped.zero_grad_buffer()
    with wrapped.no_sync():
        wrapped(x, use_b=False).backward()
    wrapped(2 * x, use_b=False).backward()
    wrapped.finish_grad_sync()
    assert torch.equal(wrapped.module.b.weight.main_grad, torch.zeros(4, 8))
    assert torch.equal(wrapped.module.b.bias.main_grad, torch.zeros(4))
    assert_close(wrapped.module.a.weight.main_grad, x.sum(0).expand(4, 8) * 3)  # x's micro batch, then 2x's


def test_an_iteration_without_any_backward_reads_zero_gradients():
    wrapped = DistributedDataParallel(_TwoHeads(), ParallelConfig(), grad_dtype=torch.float32)
    wrapped(torch.randn(3, 8)).backward()
    wrapped.finish_grad_sync()
    wrapped.zero_grad_buffer()
    wrapped.finish_grad_sync()
    assert all(torch.equal(p.main_grad, torch.zeros_like(p)) for p in wrapped.module.parameters())
