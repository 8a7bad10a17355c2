"""Loss scaler rules, MegatronOptimizer (master weights, skip on inf, clipping, weight-decay groups),
FLOPs and MFU."""

import copy
import math

import pytest
import torch

from megatron_core.training import flops
from megatron_core.optimizer.grad_scaler import DynamicGradScaler
from megatron_core.optimizer.optimizer import AdamSettings, MegatronOptimizer, param_groups


# -- loss scaler -----------------------------------------------------------------------------------


def test_dynamic_scaler_hysteresis_backoff_growth_and_floor():
    s = DynamicGradScaler(initial_scale=2.0**32, min_scale=1.0, growth_interval=3, hysteresis=2)
    s.update(found_inf=True)
    assert s.scale == 2.0**32  # first overflow only spends hysteresis
    s.update(found_inf=True)
    assert s.scale == 2.0**31
    s.update(found_inf=True)  # tracker stays exhausted: every further overflow halves
    assert s.scale == 2.0**30
    for _ in range(2):
        s.update(found_inf=False)
    assert s.scale == 2.0**30
    s.update(found_inf=False)  # third clean step in a row: grow, refill hysteresis
    assert s.scale == 2.0**31 and s.hysteresis_tracker == 2
    s.update(found_inf=True)
    assert s.scale == 2.0**31  # hysteresis absorbs one overflow again
    tiny = DynamicGradScaler(initial_scale=2.0, min_scale=1.0, hysteresis=1)
    for _ in range(5):
        tiny.update(found_inf=True)
    assert tiny.scale == 1.0
    restored = DynamicGradScaler()
    restored.load_state_dict(s.state_dict())
    assert restored.state_dict() == s.state_dict()


def test_megatron_defaults_in_recipe_schema():
    from megatron_core.config import TrainingConfig

    t = TrainingConfig()
    assert (t.initial_loss_scale, t.min_loss_scale, t.loss_scale_window, t.hysteresis) == (2.0**32, 1.0, 1000, 2)


# -- optimizer -------------------------------------------------------------------------------------


class TwoLayer(torch.nn.Module):
    """A decayed weight and undecayed bias/norm weights: both of the wrapper's parameter groups."""

    def __init__(self, width: int = 4):
        super().__init__()
        self.dense = torch.nn.Linear(width, width)
        self.layernorm = torch.nn.LayerNorm(width)

    def forward(self, x):
        return self.layernorm(self.dense(x)).pow(2).mean()


def test_no_weight_decay_on_biases_and_norm_weights():
    model = TwoLayer()
    groups = param_groups(model.named_parameters(), weight_decay=0.1)
    decayed = {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    assert decayed == {id(model.dense.weight)}


def _opt(model, precision, scaler=None, clip=1.0):
    return MegatronOptimizer(
        model, AdamSettings(lr=1e-2, weight_decay=0.0), precision=precision, clip_grad=clip, grad_scaler=scaler
    )


def test_fp16_master_weights_skip_on_inf_and_recover():
    torch.manual_seed(0)
    model = TwoLayer().half()
    opt = _opt(model, "fp16", DynamicGradScaler(initial_scale=1024.0, hysteresis=1, growth_interval=1000))
    assert all(m.dtype == torch.float32 for m in opt.master_params)
    x = torch.randn(8, 4).half()
    losses = []
    for step in range(12):
        opt.zero_grad()
        loss = model(x)
        losses.append(float(loss.detach()))
        opt.scale_loss(loss.float()).backward()
        if step == 5:
            model.dense.weight.grad[0, 0] = float("inf")
            before = [p.detach().clone() for p in model.parameters()]
        ok, norm, _ = opt.step()
        if step == 5:
            assert not ok and norm is None
            assert opt.loss_scale == 512.0
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        else:
            assert ok and math.isfinite(norm)
    assert losses[-1] < losses[6] < losses[0]
    for p, m in zip(model.parameters(), opt.master_params):
        assert torch.equal(p, m.half())


def test_grad_clipping_by_global_norm():
    model = TwoLayer()
    opt = _opt(model, "fp32", clip=0.5)
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    expected = math.sqrt(sum(9.0 * p.numel() for p in model.parameters()))
    ok, norm, zeros = opt.step(count_zeros=True)
    assert ok and norm == pytest.approx(expected)
    assert zeros == 0
    clipped = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters()))
    assert clipped == pytest.approx(0.5, rel=1e-4)


def test_tp_replicated_and_shared_params_counted_once(monkeypatch):
    """On TP rank 1 only tensor-parallel shards count; the last stage's copy of the tied
    embedding (`shared_embedding` off the first stage) never counts."""
    from megatron_core import parallel_state

    model = TwoLayer()
    model.dense.weight.tensor_model_parallel = True
    opt = _opt(model, "fp32", clip=0.0)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 1)
    _, norm, _ = opt.step()
    assert norm == pytest.approx(math.sqrt(model.dense.weight.numel()))
    model.dense.weight.shared_embedding = True
    monkeypatch.setattr(parallel_state, "is_pipeline_first_stage", lambda: False)
    opt2 = _opt(model, "fp32", clip=0.0)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    _, norm, _ = opt2.step()
    assert norm == pytest.approx(math.sqrt(4 + 4 + 4))  # dense.bias + layernorm weight and bias


def test_state_dict_round_trip_gives_identical_next_step():
    torch.manual_seed(0)
    a = TwoLayer().half()
    b = TwoLayer().half()
    b.load_state_dict(a.state_dict())
    opt_a = _opt(a, "fp16", DynamicGradScaler(initial_scale=256.0))
    x = torch.randn(8, 4).half()
    for _ in range(3):
        opt_a.zero_grad()
        opt_a.scale_loss(a(x).float()).backward()
        opt_a.step()
    opt_b = _opt(b, "fp16", DynamicGradScaler(initial_scale=1.0))
    b.load_state_dict(a.state_dict())
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # as through a file: no shared tensors
    for model, opt in ((a, opt_a), (b, opt_b)):
        opt.zero_grad()
        opt.scale_loss(model(x).float()).backward()
        opt.step()
    assert opt_b.loss_scale == opt_a.loss_scale
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_cpu_optimizer_choice_is_fused_adamw_stepping_like_the_reference():
    """torch's fused AdamW on a CPU too (one kernel over all tensors, no per-tensor loop), and it
    steps as the plain for-loop AdamW does (to fp32 rounding)."""
    torch.manual_seed(0)
    model = TwoLayer()
    reference = copy.deepcopy(model)
    opt = _opt(model, "fp32", clip=0.0)
    assert isinstance(opt.optimizer, torch.optim.AdamW) and opt.optimizer.defaults["fused"]
    assert "fused=True" in opt.description
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0, foreach=False)
    x = torch.randn(8, 4)
    start = [p.detach().clone() for p in model.parameters()]
    for _ in range(3):
        opt.zero_grad()
        model(x).backward()
        assert opt.step()[0]
        plain.zero_grad()
        reference(x).backward()
        plain.step()
    for p, q, p0 in zip(model.parameters(), reference.parameters(), start):
        assert not torch.equal(p, p0)  # the steps moved it
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


# -- FLOPs and MFU ---------------------------------------------------------------------------------


def test_flops_formula_matches_megatron_for_4h():
    B, s, L, h, V = 192, 1024, 12, 768, 32768
    megatron = 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))
    ours = flops.model_flops_per_iteration(
        global_batch_size=B, seq_length=s, num_layers=L, hidden_size=h, ffn_hidden_size=4 * h, padded_vocab_size=V
    )
    assert ours == pytest.approx(megatron, rel=1e-12)
    recompute = flops.model_flops_per_iteration(
        global_batch_size=B,
        seq_length=s,
        num_layers=L,
        hidden_size=h,
        ffn_hidden_size=4 * h,
        padded_vocab_size=V,
        full_recompute=True,
    )
    assert recompute == pytest.approx(ours * 4 / 3)


def test_peak_table_and_mfu():
    assert flops.device_peak_tflops("NVIDIA A100-SXM4-80GB", "bf16") == 312.0
    assert flops.device_peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert flops.device_peak_tflops("NVIDIA H100 PCIe", "fp16") == 756.0
    assert flops.device_peak_tflops("NVIDIA H200", "bf16") == 989.0
    assert flops.device_peak_tflops("cpu (x86_64)", "fp32") is None
    assert flops.mfu(100.0, None) is None
    assert flops.mfu(156.0, 312.0) == pytest.approx(0.5)
    assert flops.tflops_per_device(8e12, 0.5, 2) == pytest.approx(8.0)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_step_count_keeps_counting_after_a_resume(precision):
    """A resume writes the step where both torch (per tensor) and Apex (per group) read it; the
    saved count must be the one that moved on, or Adam's bias correction restarts at every resume."""

    def steps(opt, model, count):
        for _ in range(count):
            model(torch.ones(2, 4, dtype=next(model.parameters()).dtype)).float().backward()
            assert opt.step()[0]
            opt.zero_grad()

    torch.manual_seed(0)
    model = TwoLayer() if precision == "fp32" else TwoLayer().bfloat16()
    opt = _opt(model, precision)
    steps(opt, model, 3)
    saved, weights = opt.state_dict(), copy.deepcopy(model.state_dict())
    model2 = TwoLayer() if precision == "fp32" else TwoLayer().bfloat16()
    model2.load_state_dict(weights)
    opt2 = _opt(model2, precision)
    opt2.load_state_dict(saved)
    steps(opt2, model2, 5)
    assert saved["step"] == 3 and opt2.state_dict()["step"] == 8


def test_flat_spans_merge_back_to_back_views_and_keep_every_element_as_often():
    """The norm and the clip run over the gradient buckets' spans, not one kernel per parameter: views
    that tile a buffer (in any order) merge; a gap, another buffer or a strided tensor keeps them apart,
    and a tensor given twice still counts twice."""
    from megatron_core.optimizer.clip_grads import clip_by_norm_, flat_spans, global_grad_norm

    buffer, other = torch.randn(100), torch.randn(4, 3)
    views = [buffer[50:70].view(4, 5), buffer[0:20].view(2, 10), buffer[20:50], buffer[80:90], other.t(), buffer[:20]]
    spans = flat_spans(views)
    assert sorted((s.storage_offset(), s.numel()) for s in spans if s.is_contiguous()) == [(0, 20), (0, 70), (80, 10)]
    assert sum(s.numel() for s in spans) == sum(v.numel() for v in views)
    assert all(s.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr() for s in spans if s.dim() == 1)
    want = torch.cat([v.reshape(-1) for v in views]).norm()
    assert global_grad_norm(views, [], torch.device("cpu")) == pytest.approx(float(want), rel=1e-6)
    before = buffer.clone()
    clip_by_norm_(views[:4], float(want), max_norm=float(want) / 2)  # each element scaled once
    assert torch.allclose(buffer[:70], before[:70] / 2) and torch.allclose(buffer[80:90], before[80:90] / 2)
    assert torch.equal(buffer[70:80], before[70:80]) and torch.equal(buffer[90:], before[90:])


def test_flat_spans_keep_the_callers_order_of_buffers_not_their_addresses():
    """The spans' order is the order the norm's partial sums are added in: it must follow the caller's
    list, never the allocator's addresses, or a resumed run's grad norm (and then its weights) changes in
    the last bits (the TP2 x PP2 and PP2 x VPP2 resume tests caught it)."""
    from megatron_core.optimizer.clip_grads import flat_spans

    a, b = torch.randn(10), torch.randn(10)
    low, high = sorted((a, b), key=lambda t: t.untyped_storage().data_ptr())
    for first, second in ((high, low), (low, high)):
        spans = flat_spans([first[5:], second[:5], first[:5], second[5:]])
        assert [s.untyped_storage().data_ptr() for s in spans] == [
            first.untyped_storage().data_ptr(),
            second.untyped_storage().data_ptr(),
        ]
        assert [s.numel() for s in spans] == [10, 10]


# -- the NaN guard, collective devices, host copies at save (issue 30 bugs 5 and 6, issue 32) ---------------


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_nan_gradient_or_loss_skips_the_update_in_every_precision(precision):
    """fp32 and bf16 have no loss scaler, yet a NaN gradient element (or a NaN loss on some rank) must not
    reach the weights: the step is skipped with the non-finite norm, and the next clean step goes on."""
    torch.manual_seed(0)
    model = TwoLayer().to(torch.float32 if precision == "fp32" else torch.bfloat16)
    opt = _opt(model, precision)
    x = torch.randn(8, 4).to(next(model.parameters()).dtype)

    def backward():
        opt.zero_grad()
        model(x).float().backward()

    backward()
    model.dense.weight.grad[1, 2] = float("nan")
    weights = [p.detach().clone() for p in model.parameters()]
    masters = [m.detach().clone() for m in opt.master_params]
    ok, norm, _ = opt.step()
    assert not ok and math.isnan(norm)
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(masters, opt.master_params))
    assert not opt.optimizer.state  # Adam's moments never saw the NaN

    backward()  # finite gradients, but this rank's loss was NaN: skipped as well
    ok, norm, _ = opt.step(nonfinite_loss=True)
    assert not ok and math.isnan(norm)
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))

    backward()
    ok, norm, _ = opt.step()
    assert ok and math.isfinite(norm)
    assert not torch.equal(weights[0], model.dense.weight)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_fp16_tells_an_overflow_from_a_nan_loss():
    """fp16: an overflowing gradient is the loss scaler's (grad norm None); a NaN loss is the NaN guard's
    (grad norm NaN). Both skip the update and back the scale off."""
    model = TwoLayer().half()
    opt = _opt(model, "fp16", DynamicGradScaler(initial_scale=1024.0, hysteresis=1))
    x = torch.randn(8, 4).half()
    for nonfinite_loss, want_norm in ((False, None), (True, "nan")):
        opt.zero_grad()
        opt.scale_loss(model(x).float()).backward()
        if not nonfinite_loss:
            model.dense.weight.grad[0, 0] = float("inf")
        scale = opt.loss_scale
        ok, norm, _ = opt.step(nonfinite_loss=nonfinite_loss)
        assert not ok and opt.loss_scale == scale / 2
        assert (norm is None) if want_norm is None else math.isnan(norm)


class _CollectiveReached(Exception):
    pass


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_rank_without_gradients_reduces_on_the_training_device(monkeypatch, precision):
    """The norm's and the overflow check's collectives run on the device the optimizer was given even where
    this rank holds no gradient (NCCL refuses a CPU tensor). 'meta' stands in for cuda:N on this host."""
    import torch.distributed as dist

    from megatron_core import parallel_state

    seen = []

    def all_reduce(tensor, *_args, **_kwargs):
        seen.append(tensor.device)
        raise _CollectiveReached

    monkeypatch.setattr(parallel_state, "get_model_parallel_group", lambda: "model-parallel group")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *_args, **_kwargs: 2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    model = TwoLayer().half() if precision == "fp16" else TwoLayer()
    opt = MegatronOptimizer(
        model, AdamSettings(lr=1e-2, weight_decay=0.0), precision=precision, device=torch.device("meta")
    )
    opt.zero_grad()  # no backward: this rank has no gradients
    with pytest.raises(_CollectiveReached):
        opt.step()
    assert seen == [torch.device("meta")]


def _fake_cuda_module():
    """A module whose parameters claim to live on cuda:0 (FakeTensorMode: shapes and devices, no data)."""
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(torch.empty(4, 4, device="cuda", dtype=torch.float16))
    module.bias = torch.nn.Parameter(torch.empty(4, device="cuda", dtype=torch.float16))
    return module


def test_checkpoint_state_copies_masters_and_moments_to_the_host():
    """state_dict() hands the checkpoint host copies of the fp32 masters and Adam moments: nothing is cloned
    on the training device (12 bytes/param of GPU memory at every save). Checked with parameters that claim
    cuda:0 under FakeTensorMode, and on real CPU tensors: the copies do not share memory with the live state."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        opt = MegatronOptimizer(_fake_cuda_module(), AdamSettings(lr=1e-2, weight_decay=0.0), precision="fp16")
        weight_master = opt.master_params[0]
        opt.optimizer.state[weight_master] = {k: torch.zeros_like(weight_master) for k in ("exp_avg", "exp_avg_sq")}
        saved = opt.state_dict()["param_state"]
    assert {m.device.type for m in opt.master_params} == {"cuda"}
    devices = {name: {k: t.device.type for k, t in entry.items()} for name, entry in saved.items()}
    on_cpu = {"fp32_param": "cpu", "exp_avg": "cpu", "exp_avg_sq": "cpu"}
    assert devices == {name: on_cpu for name in ("weight", "bias")}

    model = TwoLayer().bfloat16()
    opt = _opt(model, "bf16")
    opt.zero_grad()
    model(torch.randn(8, 4).bfloat16()).float().backward()
    assert opt.step()[0]
    saved = opt.state_dict()["param_state"]["dense.weight"]
    live = opt.optimizer.state[opt.master_params[0]]
    expected = {k: t.clone() for k, t in saved.items()}
    with torch.no_grad():
        opt.master_params[0].add_(1.0)
        live["exp_avg"].add_(1.0)
    assert all(torch.equal(saved[k], expected[k]) for k in saved)
