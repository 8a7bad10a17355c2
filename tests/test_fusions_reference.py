"""The torch references against plain torch.nn.functional math, backend resolution and its errors, Apex
probing, and vocab-parallel cross entropy on 2 gloo ranks (torch and Triton-interpreter backends) against
F.cross_entropy on the full logits. None of these needs triton in this process."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from megatron_core.errors import UserError
from megatron_core.fusions import (
    FusionBackends,
    apex_status,
    bias_dropout_add,
    bias_gelu,
    cross_entropy,
    fused_adam_class,
    layer_norm,
    resolve_backends,
    scaled_causal_softmax,
)


def test_layer_norm_reference_is_f_layer_norm_math():
    x, weight, bias = torch.randn(33, 1000) * 3 + 2, torch.randn(1000), torch.randn(1000)
    mean = x.mean(-1, keepdim=True)
    var = x.var(-1, unbiased=False, keepdim=True)
    expected = (x - mean) / torch.sqrt(var + 1e-5) * weight + bias
    torch.testing.assert_close(layer_norm(x, weight, bias, 1e-5, backend="torch"), expected, rtol=1e-5, atol=1e-5)


def test_bias_gelu_reference_is_the_tanh_formula():
    x, bias = torch.randn(7, 768) * 3, torch.randn(768)
    z = x + bias
    expected = 0.5 * z * (1 + torch.tanh(0.7978845608028654 * (z + 0.044715 * z**3)))
    torch.testing.assert_close(bias_gelu(x, bias, backend="torch"), expected)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_bias_gelu_on_a_cpu_is_the_tanh_formula_forward_and_backward(dtype):
    """The CPU path computes tanh-GeLU through sigmoid(2z) with its own backward: same values and
    gradients as autograd through the tanh formula (fp64: to rounding; fp32: to fp32 noise)."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(33, 96, generator=gen, dtype=dtype) * 4).requires_grad_()
    bias = torch.randn(96, generator=gen, dtype=dtype).requires_grad_()
    grad = torch.randn(33, 96, generator=gen, dtype=dtype)
    ours = bias_gelu(x, bias, backend="torch")
    assert ours.grad_fn is not None and "BiasGeluSigmoid" in type(ours.grad_fn).__name__
    z = x + bias
    expected = 0.5 * z * (1 + torch.tanh(0.7978845608028654 * (z + 0.044715 * z**3)))
    got, want = torch.autograd.grad(ours, (x, bias), grad), torch.autograd.grad(expected, (x, bias), grad)
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(ours, expected, **tol)
    torch.testing.assert_close(got[0], want[0], **tol)
    torch.testing.assert_close(got[1], want[1], rtol=tol["rtol"], atol=tol["atol"] * 40)  # a sum of 33 rows
    if dtype == torch.float64:
        assert torch.autograd.gradcheck(
            lambda a, b: bias_gelu(a, b, backend="torch"),
            (x[:3, :5].detach().requires_grad_(), bias[:5].detach().requires_grad_()),
        )


def test_bias_gelu_on_a_cpu_keeps_f_gelu_for_16_bit_inputs():
    """bf16 keeps F.gelu (fp32 inside, one rounding): the in-place sigmoid passes would round each step."""
    x, bias = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True), torch.randn(8, dtype=torch.bfloat16)
    out = bias_gelu(x, bias, backend="torch")
    assert "BiasGeluSigmoid" not in type(out.grad_fn).__name__
    torch.testing.assert_close(out, F.gelu(x + bias, approximate="tanh"), rtol=0, atol=0)


def test_causal_softmax_reference_is_megatron_masked_softmax():
    scores = torch.randn(2, 3, 33, 33)
    keep = torch.tril(torch.ones(33, 33, dtype=torch.bool))
    expected = F.softmax((scores * 0.3).masked_fill(~keep, -10000.0), dim=-1)  # Megatron's unfused path
    probs = scaled_causal_softmax(scores, 0.3, backend="torch")
    torch.testing.assert_close(probs, expected)
    assert (probs[..., ~keep] == 0).all()


def test_bias_dropout_add_reference_drops_scales_and_adds():
    # x + bias >= 1, so no kept value rounds away against residual and `first != residual` is the mask.
    x, bias, residual = torch.rand(64, 768) + 0.5, torch.rand(768) + 0.5, torch.randn(64, 768)
    torch.manual_seed(11)
    first = bias_dropout_add(x, bias, residual, 0.2, True, backend="torch")
    torch.manual_seed(11)
    assert torch.equal(first, bias_dropout_add(x, bias, residual, 0.2, True, backend="torch"))
    kept = first != residual
    torch.testing.assert_close(first[kept], (residual + (x + bias) / 0.8)[kept])
    assert abs(kept.float().mean().item() - 0.8) < 0.01
    torch.testing.assert_close(bias_dropout_add(x, None, residual, 0.2, False, backend="torch"), residual + x)
    assert torch.equal(bias_dropout_add(x, bias, residual, 1.0, True, backend="torch"), residual)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_reference_is_f_cross_entropy(dtype):
    logits = (torch.randn(4, 9, 1000) * 3).to(dtype).requires_grad_()
    labels = torch.randint(0, 1000, (4, 9))
    loss = cross_entropy(logits, labels, backend="torch")
    assert loss.dtype == torch.float32 and loss.shape == labels.shape
    full = logits.detach().float().requires_grad_()
    expected = F.cross_entropy(full.view(-1, 1000), labels.view(-1), reduction="none").view(4, 9)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(expected)
    (grad,) = torch.autograd.grad(loss, logits, dy)
    (grad_expected,) = torch.autograd.grad(expected, full, dy)
    assert grad.dtype == dtype
    torch.testing.assert_close(
        grad.float(),
        grad_expected,
        rtol=1e-5 if dtype == torch.float32 else 1.6e-2,
        atol=1e-6 if dtype == torch.float32 else 1e-3,
    )


def test_cross_entropy_of_16_bit_logits_leaves_them_alone_even_inplace():
    """bf16 logits: the loss works in its own fp32 copy (the fp32 in-place path must not take them)."""
    logits = (torch.randn(5, 300) * 3).to(torch.bfloat16)
    before, labels = logits.clone(), torch.randint(0, 300, (5,))
    loss = cross_entropy(logits, labels, backend="torch", inplace=True)
    assert torch.equal(logits, before)
    torch.testing.assert_close(loss, F.cross_entropy(before.float(), labels, reduction="none"), rtol=1e-5, atol=1e-5)


def test_cross_entropy_inplace_reuses_the_logits_and_gives_the_same_loss_and_gradient():
    hidden = torch.randn(33, 16, requires_grad=True)
    head = torch.randn(1000, 16, requires_grad=True)
    labels = torch.randint(0, 1000, (33,))
    logits = hidden @ head.t()  # a fresh activation, read by nothing but the loss (as in the model)
    before = logits.detach().clone()
    loss = cross_entropy(logits, labels, backend="torch", inplace=True)
    assert not torch.equal(logits.detach(), before)  # its buffer now holds exp(x - max)
    expected = F.cross_entropy(before, labels, reduction="none")
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    dy = torch.rand(33)
    grads = torch.autograd.grad(loss, (hidden, head), dy, retain_graph=True)
    full_h, full_w = hidden.detach().requires_grad_(), head.detach().requires_grad_()
    reference = F.cross_entropy(full_h @ full_w.t(), labels, reduction="none")
    for got, want in zip(grads, torch.autograd.grad(reference, (full_h, full_w), dy)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="cannot be backpropagated twice"):
        torch.autograd.grad(loss, hidden, dy)


def test_resolve_backends_on_cpu_and_overrides():
    auto = resolve_backends("auto", device="cpu")
    assert auto == FusionBackends(device="cpu", attention="sdpa")
    assert auto.describe() == (
        "backends on cpu: attention=sdpa, layer_norm=torch, bias_gelu=torch, "
        "bias_dropout_add=torch, softmax=torch, cross_entropy=torch"
    )
    assert resolve_backends("torch", {"softmax": "auto"}, device=torch.device("cpu")).softmax == "torch"
    assert resolve_backends(device="cpu", attention="unfused").attention == "unfused"
    with pytest.raises(UserError, match="attention_backend: 'blocked' is not one of auto, sdpa, unfused"):
        resolve_backends(device="cpu", attention="blocked")


@pytest.mark.parametrize(
    "fusions,overrides,message",
    [
        ("fast", None, "not one of auto"),
        ("auto", {"attention": "torch"}, "unknown fusions"),
        ("auto", {"softmax": "apex"}, "Apex has no kernel for softmax"),
        ("apex", None, "Apex kernels need a CUDA device"),
        ("auto", {"layer_norm": "cudnn"}, "unknown backend"),
        ("compile", None, "not one of auto, triton, apex, torch"),
    ],
)
def test_resolve_backends_errors_name_the_problem(fusions, overrides, message):
    with pytest.raises(UserError, match=message):
        resolve_backends(fusions, overrides, device="cpu")


def test_triton_on_cpu_without_the_interpreter_is_a_user_error(monkeypatch):
    from megatron_core.fusions import backends

    monkeypatch.setattr(backends, "_TRITON_USABLE_ON", set())  # forget an earlier success in this process
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(UserError, match="TRITON_INTERPRET=1"):
        resolve_backends("triton", device="cpu")
    with pytest.raises(UserError, match="TRITON_INTERPRET=1"):
        scaled_causal_softmax(torch.randn(1, 1, 4, 4), 1.0, backend="triton")


def test_triton_on_cuda_under_the_interpreter_is_a_user_error(monkeypatch):
    """With TRITON_INTERPRET=1 a "triton" backend on CUDA would interpret the kernels on host copies: refused,
    so that nothing claims to have run compiled kernels on the GPU when it did not."""
    from megatron_core.fusions import backends

    monkeypatch.setattr(backends, "_TRITON_USABLE_ON", set())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(UserError, match="interpreter on host copies"):
        resolve_backends("triton", device="cuda")
    assert resolve_backends("auto", device="cuda").cross_entropy == "torch"
    assert "TRITON_INTERPRET=1" in resolve_backends("auto", device="cuda").note


@pytest.fixture
def usable_triton_on_cuda(monkeypatch):
    """Triton usable on a (pretended) CUDA device, as on a GPU host, triton installed here or not."""
    from megatron_core.fusions import backends

    monkeypatch.setattr(backends, "_TRITON_USABLE_ON", set())
    monkeypatch.setattr(backends, "_triton_import_problem", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.mark.usefixtures("usable_triton_on_cuda")
def test_auto_on_cuda_runs_our_triton_softmax_and_cross_entropy():
    auto = resolve_backends("auto", device="cuda")
    assert (auto.softmax, auto.cross_entropy) == ("triton", "triton")
    assert (auto.layer_norm, auto.bias_gelu, auto.bias_dropout_add) == ("torch", "torch", "torch")
    assert auto.note == ""
    assert resolve_backends("auto", device="cpu").cross_entropy == "torch"


@pytest.mark.parametrize("apex_runs", [True, False])
@pytest.mark.usefixtures("usable_triton_on_cuda")
def test_fusions_triton_gives_the_fusions_without_a_kernel_the_best_other_backend(monkeypatch, apex_runs):
    """`fusions: triton` has kernels for softmax and cross entropy only: LayerNorm takes Apex's where Apex runs,
    the rest what "auto" picks, and the start-up description says so."""
    from megatron_core.fusions import backends

    monkeypatch.setattr(backends, "apex_problem", lambda _: None if apex_runs else "Apex is not usable")
    chosen = resolve_backends("triton", device="cuda")
    assert chosen == FusionBackends(
        layer_norm="apex" if apex_runs else "torch",
        softmax="triton",
        cross_entropy="triton",
        device="cuda",
        note=chosen.note,
        attention="sdpa",
    )
    assert chosen.describe().endswith(
        "(triton has no kernel for layer_norm, bias_gelu, bias_dropout_add: they run the best other backend)"
    )


@pytest.mark.parametrize(
    "fusion,choices",
    [("layer_norm", "auto, apex, torch"), ("bias_gelu", "auto, torch"), ("bias_dropout_add", "auto, torch")],
)
@pytest.mark.usefixtures("usable_triton_on_cuda")
def test_a_triton_override_for_a_deleted_kernel_is_refused(fusion, choices):
    with pytest.raises(UserError, match=f"no Triton kernel for {fusion} .*; use one of {choices}$"):
        resolve_backends("auto", {fusion: "triton"}, device="cuda")
    assert resolve_backends("torch", {"softmax": "triton"}, device="cuda").softmax == "triton"


def test_bad_inputs_are_user_errors():
    with pytest.raises(UserError, match="weight"):
        layer_norm(torch.randn(2, 8), torch.ones(7), torch.zeros(8))
    with pytest.raises(UserError, match="sq == sk"):
        scaled_causal_softmax(torch.randn(1, 1, 4, 6), 1.0)
    with pytest.raises(UserError, match="outside"):
        bias_dropout_add(torch.randn(2, 8), None, torch.randn(2, 8), 1.5, True)
    with pytest.raises(UserError, match="labels"):
        cross_entropy(torch.randn(3, 10), torch.zeros(4, dtype=torch.long))


def test_apex_status_never_raises_and_names_what_failed():
    status = apex_status()
    for name in ("apex", "amp_C", "fused_layer_norm_cuda", "apex.optimizers.FusedAdam"):
        assert isinstance(status[name], bool)
        assert status[name] or name in status["errors"]
    assert (fused_adam_class() is not None) == (status["apex.optimizers.FusedAdam"] and status["amp_C"])
    status["apex"] = "mutated"
    assert apex_status()["apex"] != "mutated"


WORLD = 2


def _vocab_parallel_worker(rank: int, init_file: str, backends: list) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        generator = torch.Generator().manual_seed(0)
        rows, vocab = 13, 2 * 750
        full = torch.randn(rows, vocab, generator=generator) * 4
        labels = torch.randint(0, vocab, (rows,), generator=generator)
        labels[:2] = torch.tensor([749, 750])  # the last id of shard 0, the first of shard 1
        dy = torch.rand(rows, generator=generator)
        full_leaf = full.clone().requires_grad_()
        expected = F.cross_entropy(full_leaf, labels, reduction="none")
        (expected_grad,) = torch.autograd.grad(expected, full_leaf, dy)
        shard = slice(rank * 750, (rank + 1) * 750)
        for backend in backends:
            local = full[:, shard].clone().requires_grad_()
            loss = cross_entropy(local, labels, group=dist.group.WORLD, vocab_start_index=rank * 750, backend=backend)
            (grad,) = torch.autograd.grad(loss, local, dy)
            torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5, msg=f"{backend} loss, rank {rank}")
            torch.testing.assert_close(
                grad, expected_grad[:, shard], rtol=1e-5, atol=1e-6, msg=f"{backend} grad, rank {rank}"
            )
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_vocab_parallel_cross_entropy_on_two_gloo_ranks(monkeypatch):
    # Spawned ranks are fresh processes: with TRITON_INTERPRET=1 in their environment they import triton
    # interpreted, whatever this process imported before.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with tempfile.TemporaryDirectory() as scratch:
        mp.spawn(
            _vocab_parallel_worker,
            args=(os.path.join(scratch, "rendezvous"), ["torch", "triton"]),
            nprocs=WORLD,
            join=True,
        )
