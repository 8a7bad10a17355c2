"""The blocked causal attention kernel (CPU, fp32/fp64/bf16) against torch's SDPA, alone and inside the model."""

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from megatron_core.config import ModelConfig, ParallelConfig
from megatron_core.errors import UserError
from megatron_core.fusions import backends, causal_attention, resolve_backends
from megatron_core.fusions.causal_attention import BLOCK_ROWS, block_rows, blocked_causal_attention
from megatron_core.models import GPTModel
from megatron_core.models.gpt import compile_layers

VOCAB = 64


def sdpa_attention(qkv, heads, head_dim):
    """The model's SDPA path on the same fused projection: [s, b, heads*3*d] -> [s, b, heads*d]."""
    s, b = qkv.shape[:2]
    q, k, v = (t.permute(1, 2, 0, 3) for t in qkv.view(s, b, heads, 3, head_dim).unbind(3))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3).reshape(s, b, heads * head_dim)


def outputs_and_grads(attention, qkv, grad, heads, head_dim):
    qkv = qkv.detach().requires_grad_(True)
    out = attention(qkv, heads, head_dim)
    (dqkv,) = torch.autograd.grad(out, qkv, grad)
    return out, dqkv


# s: one block, exactly two, a ragged last block, many blocks, a single token
@pytest.mark.parametrize("s", [1, 40, 2 * BLOCK_ROWS, BLOCK_ROWS + 37, 3 * BLOCK_ROWS + 5])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_equals_sdpa_forward_and_backward(s, dtype, tol):
    heads, head_dim, b = 3, 8, 2
    g = torch.Generator().manual_seed(s)
    qkv = torch.randn(s, b, heads * 3 * head_dim, generator=g, dtype=dtype)
    grad = torch.randn(s, b, heads * head_dim, generator=g, dtype=dtype)
    out, dqkv = outputs_and_grads(blocked_causal_attention, qkv, grad, heads, head_dim)
    want_out, want_dqkv = outputs_and_grads(sdpa_attention, qkv, grad, heads, head_dim)
    assert out.shape == (s, b, heads * head_dim) and dqkv.shape == qkv.shape
    assert_close(out, want_out, rtol=tol, atol=tol)
    assert_close(dqkv, want_dqkv, rtol=tol, atol=tol)


def _relative_error(got, want):
    return ((got.double() - want).abs().max() / want.abs().max()).item()


# bf16 runs its own block size; s: one block, a ragged second, several blocks
@pytest.mark.parametrize("s", [40, block_rows(torch.bfloat16) + 37, 3 * block_rows(torch.bfloat16)])
def test_bf16_is_as_close_to_the_exact_answer_as_sdpa_in_bf16(s):
    """bf16 has no exact reference: both kernels are judged against fp64 SDPA on the same (bf16-rounded)
    inputs, and ours may not be much further from it than SDPA's bf16 kernel is."""
    heads, head_dim, b = 4, 64, 2
    g = torch.Generator().manual_seed(s)
    qkv = torch.randn(s, b, heads * 3 * head_dim, generator=g).to(torch.bfloat16)
    grad = torch.randn(s, b, heads * head_dim, generator=g).to(torch.bfloat16)
    exact_out, exact_dqkv = outputs_and_grads(sdpa_attention, qkv.double(), grad.double(), heads, head_dim)
    out, dqkv = outputs_and_grads(blocked_causal_attention, qkv, grad, heads, head_dim)
    sdpa_out, sdpa_dqkv = outputs_and_grads(sdpa_attention, qkv, grad, heads, head_dim)
    assert out.dtype == dqkv.dtype == torch.bfloat16
    assert _relative_error(out, exact_out) <= max(2 * _relative_error(sdpa_out, exact_out), 1e-2)
    assert _relative_error(dqkv, exact_dqkv) <= max(2 * _relative_error(sdpa_dqkv, exact_dqkv), 1e-2)


def test_gradcheck_across_a_block_boundary():
    qkv = torch.randn(BLOCK_ROWS + 6, 2, 2 * 3 * 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: blocked_causal_attention(t, 2, 4), (qkv,))


def test_compiles_under_torch_compile_and_matches_eager():
    """`training.compile: true` traces the model; this kernel once broke dynamo's trace (a saved tensor
    aliased the returned view), so a CPU run with compile on crashed in its first step."""
    heads, head_dim = 2, 4
    qkv = torch.randn(BLOCK_ROWS + 6, 2, heads * 3 * head_dim)
    grad = torch.randn(BLOCK_ROWS + 6, 2, heads * head_dim)
    compiled = torch.compile(blocked_causal_attention, dynamic=False)
    out, dqkv = outputs_and_grads(compiled, qkv, grad, heads, head_dim)
    want_out, want_dqkv = outputs_and_grads(blocked_causal_attention, qkv, grad, heads, head_dim)
    assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    assert_close(dqkv, want_dqkv, rtol=1e-5, atol=1e-6)


def test_causal_the_last_token_changes_nothing_before_it():
    qkv = torch.randn(BLOCK_ROWS + 10, 1, 2 * 3 * 4)
    changed = qkv.clone()
    changed[-1] += 1.0
    a, b = blocked_causal_attention(qkv, 2, 4), blocked_causal_attention(changed, 2, 4)
    assert torch.equal(a[:-1], b[:-1]) and not torch.equal(a[-1], b[-1])


def test_leaves_the_callers_qkv_alone_even_when_a_copy_could_be_a_view():
    # s == b * heads == 1: permute(...).contiguous() is a view of qkv there; q's scaling must not reach it.
    qkv = torch.randn(1, 1, 3 * 4, dtype=torch.float64)
    before = qkv.clone()
    blocked_causal_attention(qkv, 1, 4)
    assert torch.equal(qkv, before)
    assert torch.autograd.gradcheck(lambda t: blocked_causal_attention(t, 1, 4), (qkv.requires_grad_(),))


def test_refuses_what_it_cannot_run():
    with pytest.raises(UserError, match="fp32/fp64/bf16"):
        blocked_causal_attention(torch.randn(4, 1, 24, dtype=torch.float16), 2, 4)
    with pytest.raises(UserError, match=r"heads \* 3 \* head_dim"):
        blocked_causal_attention(torch.randn(4, 1, 20), 2, 4)


def _model(backend: str, attention_dropout: float = 0.0, recompute: str = None) -> GPTModel:
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=96,
                      max_position_embeddings=96, hidden_dropout=0.0, attention_dropout=attention_dropout,
                      attention_backend=backend)
    return GPTModel(cfg, ParallelConfig(recompute_granularity=recompute), VOCAB, init_seed=1234)


def _batch():
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, VOCAB, (2, 96), generator=g), torch.arange(96).expand(2, 96),
            torch.randint(0, VOCAB, (2, 96), generator=g))


def test_auto_runs_the_blocked_kernel_on_a_cpu_and_trains_like_sdpa(monkeypatch):
    calls = []
    real = causal_attention._BlockedCausalAttention.apply
    monkeypatch.setattr(causal_attention._BlockedCausalAttention, "apply",
                        lambda *a: calls.append(1) or real(*a))
    ids, pos, labels = _batch()
    auto, sdpa = _model("auto"), _model("sdpa")
    auto(ids, pos, labels).mean().backward()
    assert len(calls) == 2  # one per layer
    sdpa(ids, pos, labels).mean().backward()
    assert len(calls) == 2
    assert_close(auto(ids, pos, labels), sdpa(ids, pos, labels))
    for (name, p), q in zip(auto.named_parameters(), sdpa.parameters()):
        assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_auto_keeps_sdpa_while_attention_dropout_is_drawn():
    model = _model("auto", attention_dropout=0.1)
    attention = model.encoder.layers[0].self_attention
    qkv = torch.randn(8, 1, 3 * 32)
    assert attention.kernel(qkv) == "sdpa"  # training: the kernel has no dropout
    model.eval()
    assert attention.kernel(qkv) == "blocked"  # evaluation draws none
    assert attention.kernel(qkv.to(torch.bfloat16)) == "blocked"
    assert attention.kernel(qkv.to(torch.float16)) == "sdpa"  # SDPA's


def test_selective_recompute_of_the_blocked_kernel_gives_the_same_gradients():
    ids, pos, labels = _batch()
    plain, recomputed = _model("blocked"), _model("blocked", recompute="selective")
    assert recomputed.encoder.layers[0].self_attention.recompute_core
    for model in (plain, recomputed):
        model(ids, pos, labels).mean().backward()
    for (name, p), q in zip(plain.named_parameters(), recomputed.parameters()):
        assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def test_blocked_refuses_to_train_with_attention_dropout_it_does_not_have():
    model = _model("blocked", attention_dropout=0.1)
    ids, pos, labels = _batch()
    with pytest.raises(UserError, match="attention_dropout"):
        model(ids, pos, labels)
    model.eval()
    model(ids, pos, labels)  # evaluation draws no dropout


def test_the_registry_resolves_attention_once_per_run():
    """`auto` settles from the run's facts in resolve_backends; the model reads the choice, and refuses
    backends resolved for another attention_backend."""
    fp32 = resolve_backends("torch", device="cpu", dtype=torch.float32)
    assert (fp32.attention, fp32.attention_with_dropout) == ("blocked", "sdpa")
    for facts in (dict(device="cpu", dtype=torch.float16), dict(device="cuda", dtype=torch.float32),
                  dict(device="cpu", dtype=torch.float32, compile=True)):
        chosen = resolve_backends("torch", **facts)
        assert (chosen.attention, chosen.attention_with_dropout) == ("sdpa", "sdpa"), facts
    unfused = resolve_backends("torch", device="cpu", dtype=torch.float32, attention="unfused")
    assert (unfused.attention, unfused.attention_with_dropout) == ("unfused", "unfused")
    assert "attention=unfused, layer_norm=torch" in unfused.describe()
    with pytest.raises(UserError, match="attention_backend: 'flash' is not one of auto, sdpa, unfused, blocked"):
        resolve_backends("torch", attention="flash")
    assert set(backends._AUTO_BLOCKED_DTYPES) == set(causal_attention.SUPPORTED_DTYPES)

    cfg = _model("auto", attention_dropout=0.1).config
    compiled = resolve_backends("torch", device="cpu", dtype=torch.float32, compile=True)
    model = GPTModel(cfg, ParallelConfig(), VOCAB, fusions=compiled, init_seed=1234).eval()
    assert model.encoder.layers[0].self_attention.kernel(torch.randn(8, 1, 3 * 32)) == "sdpa"  # not blocked
    with pytest.raises(ValueError, match="resolved for attention_backend 'unfused' but the model asks for 'auto'"):
        GPTModel(cfg, ParallelConfig(), VOCAB, fusions=unfused, init_seed=1234)
    with pytest.raises(ValueError, match="pass compile=True to resolve_backends"):  # blocked cannot be traced
        compile_layers(GPTModel(cfg, ParallelConfig(), VOCAB, fusions=fp32, init_seed=1234))
