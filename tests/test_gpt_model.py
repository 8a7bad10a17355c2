"""GPTModel: parameter names/shapes per pipeline stage, parameter count, TP / TP+SP equivalence to
TP 1 (loss and every gradient), pipeline stages chained by hand, recompute, attention paths."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed_utils import run_distributed
from torch.testing import assert_close

from megatron_core import parallel_state as ps
from megatron_core.distributed.grad_sync import allreduce_sequence_parallel_grads
from megatron_core.config import ModelConfig, ParallelConfig, load_recipe
from megatron_core.models import GPTModel
from megatron_core.tensor_parallel import initialize_parameter, model_parallel_manual_seed, normal_init

VOCAB = 256
SEED = 1234


def tiny_config(**overrides) -> ModelConfig:
    base = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        seq_length=8,
        max_position_embeddings=16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return ModelConfig(**{**base, **overrides})


def batch(b=2, s=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, s), generator=g)
    labels = torch.randint(0, VOCAB, (b, s), generator=g)
    return ids, torch.arange(s).expand(b, s), labels


def layer_shapes(i, h, f, tp=1):
    p = f"encoder.layers.{i}."
    return {
        p + "input_layernorm.weight": (h,),
        p + "input_layernorm.bias": (h,),
        p + "self_attention.query_key_value.weight": (3 * h // tp, h),
        p + "self_attention.query_key_value.bias": (3 * h // tp,),
        p + "self_attention.dense.weight": (h, h // tp),
        p + "self_attention.dense.bias": (h,),
        p + "post_attention_layernorm.weight": (h,),
        p + "post_attention_layernorm.bias": (h,),
        p + "mlp.dense_h_to_4h.weight": (f // tp, h),
        p + "mlp.dense_h_to_4h.bias": (f // tp,),
        p + "mlp.dense_4h_to_h.weight": (h, f // tp),
        p + "mlp.dense_4h_to_h.bias": (h,),
    }


@pytest.mark.parametrize("untie", [False, True], ids=["tied", "untied"])
def test_parameter_names_and_shapes_per_pipeline_stage(untie):
    cfg = tiny_config(num_layers=3, untie_embeddings_and_output_weights=untie)
    par = ParallelConfig(pipeline_model_parallel_size=3)
    h, f = cfg.hidden_size, cfg.ffn_size
    stages = {"first": (True, False, 0), "middle": (False, False, 1), "last": (False, True, 2)}
    for stage, (pre, post, offset) in stages.items():
        model = GPTModel(cfg, par, VOCAB, pre_process=pre, post_process=post, layer_offset=offset)
        expected = layer_shapes(0, h, f)  # stage-local numbering
        if pre:
            expected |= {
                "embedding.word_embeddings.weight": (VOCAB, h),
                "embedding.position_embeddings.weight": (cfg.max_position_embeddings, h),
            }
        if post:
            expected |= {"encoder.final_layernorm.weight": (h,), "encoder.final_layernorm.bias": (h,)}
            head = "output_layer.weight" if untie else "word_embeddings_for_head.weight"
            expected |= {head: (VOCAB, h)}
        got = {name: tuple(p.shape) for name, p in model.state_dict().items()}
        assert got == expected, stage
        assert model.layer_range == range(offset, offset + 1)
        shared = model.shared_embedding_parameters()
        assert len(shared) == (0 if untie or stage == "middle" else 1)


def test_parameter_count_of_codeparrot_small_equals_recipe():
    recipe = load_recipe("codeparrot-small")
    vocab = recipe.padded_vocab_size(32768)
    with torch.device("meta"):
        model = GPTModel(recipe.model, dataclasses.replace(recipe.parallel, world_size=1), vocab)
    count = sum(p.numel() for p in model.parameters())
    assert count == recipe.num_parameters(32768) == 111_008_256


def test_initialization_follows_megatron():
    cfg = tiny_config(num_layers=4, hidden_size=64, ffn_hidden_size=256)
    model = GPTModel(cfg, ParallelConfig(), VOCAB, init_seed=SEED)
    params = dict(model.named_parameters())
    assert_close(params["embedding.word_embeddings.weight"].std().item(), 0.02, rtol=0.05, atol=0)
    assert_close(params["encoder.layers.0.mlp.dense_4h_to_h.weight"].std().item(), 0.02 / 8**0.5, rtol=0.05, atol=0)
    assert_close(params["encoder.layers.3.self_attention.dense.weight"].std().item(), 0.02 / 8**0.5, rtol=0.05, atol=0)
    assert torch.all(params["encoder.layers.1.input_layernorm.weight"] == 1)
    assert torch.all(params["encoder.layers.1.mlp.dense_h_to_4h.bias"] == 0)
    again = GPTModel(cfg, ParallelConfig(), VOCAB, init_seed=SEED)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))


def test_logits_and_loss_agree_and_attention_paths_match():
    cfg = tiny_config()
    ids, pos, labels = batch()
    model = GPTModel(cfg, ParallelConfig(), VOCAB, init_seed=SEED)
    loss = model(ids, pos, labels)
    logits = model(ids, pos)
    assert loss.shape == (2, 8) and loss.dtype == torch.float32 and logits.shape == (2, 8, VOCAB)
    assert_close(loss, F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(2, 8))
    unfused = GPTModel(dataclasses.replace(cfg, attention_backend="unfused"), ParallelConfig(), VOCAB, init_seed=SEED)
    assert_close(unfused(ids, pos, labels), loss)
    # Causality: changing the last token changes nothing before it.
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % VOCAB
    assert_close(model(changed, pos)[:, :-1], logits[:, :-1])
    erf = GPTModel(dataclasses.replace(cfg, bias_gelu_fusion=False), ParallelConfig(), VOCAB, init_seed=SEED)
    assert erf.ops.gelu_approximation == "none" and not torch.equal(erf(ids, pos, labels), loss)


def _grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_pipeline_stages_chained_by_hand_equal_the_whole_model():
    cfg = tiny_config(num_layers=4)
    par = ParallelConfig(pipeline_model_parallel_size=2)
    ids, pos, labels = batch()
    whole = GPTModel(cfg, ParallelConfig(), VOCAB, init_seed=SEED)
    whole(ids, pos, labels).mean().backward()
    first = GPTModel(cfg, par, VOCAB, pre_process=True, post_process=False, layer_offset=0, init_seed=SEED)
    last = GPTModel(cfg, par, VOCAB, pre_process=False, post_process=True, layer_offset=2, init_seed=SEED)
    hidden = first(ids, pos)
    assert hidden.shape == (8, 2, cfg.hidden_size)  # [s, b, h]
    received = hidden.detach().requires_grad_(True)
    last.set_input_tensor(received)
    loss = last(None, None, labels)
    assert_close(loss, whole(ids, pos, labels))
    loss.mean().backward()
    hidden.backward(received.grad)
    want = _grads(whole)
    tied = want["embedding.word_embeddings.weight"]
    got_first, got_last = _grads(first), _grads(last)
    # Tied embedding: the whole model's gradient is the sum of both stages' (the embedding-group all-reduce).
    assert_close(first.embedding.word_embeddings.weight, last.word_embeddings_for_head.weight)
    assert_close(
        got_first.pop("embedding.word_embeddings.weight") + got_last.pop("word_embeddings_for_head.weight"), tied
    )
    for stage, grads in ((first, got_first), (last, got_last)):
        for name, grad in grads.items():
            assert_close(grad, want[stage.global_parameter_name(name)], msg=name)


def _randomize_biases_and_norms(model):
    """Megatron's zero biases and unit norms would hide a bias added before the reduce: draw them
    (layout-independently, keyed by the global name) so every parameter matters."""
    for name, param in model.named_parameters():
        if name.endswith(".bias") or "layernorm" in name:
            seed = sum(map(ord, model.global_parameter_name(name)))
            initialize_parameter(param, normal_init(0.5), torch.Generator().manual_seed(seed))


def _tp_run(sequence_parallel):
    ps.initialize_model_parallel(2, 1)
    cfg = tiny_config()
    par = ParallelConfig(world_size=2, tensor_model_parallel_size=2, sequence_parallel=sequence_parallel)
    model = GPTModel(cfg, par, VOCAB, init_seed=SEED)
    _randomize_biases_and_norms(model)
    ids, pos, labels = batch()
    loss = model(ids, pos, labels)
    loss.mean().backward()
    group = ps.get_tensor_model_parallel_group()
    allreduce_sequence_parallel_grads(model.parameters())  # what finishing the grad sync does under SP
    full = {}
    for name, p in model.named_parameters():
        if getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(p.grad) for _ in range(2)]
            dist.all_gather(parts, p.grad, group=group)
            full[name] = torch.cat(parts, dim=p.partition_dim)
        else:
            full[name] = p.grad
    return loss.detach(), full


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2+sp"])
def test_tensor_parallel_model_equals_single_process(sequence_parallel):
    reference = GPTModel(tiny_config(), ParallelConfig(), VOCAB, init_seed=SEED)
    _randomize_biases_and_norms(reference)
    ids, pos, labels = batch()
    ref_loss = reference(ids, pos, labels)
    ref_loss.mean().backward()
    want = _grads(reference)
    for loss, grads in run_distributed(_tp_run, 2, sequence_parallel):
        assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-5)
        assert grads.keys() == want.keys()
        for name, grad in grads.items():
            assert_close(grad, want[name], rtol=1e-5, atol=1e-5, msg=name)


def _train_step(granularity, attention_dropout=0.1, hidden_dropout=0.1):
    cfg = tiny_config(attention_dropout=attention_dropout, hidden_dropout=hidden_dropout, seq_length=16)
    model = GPTModel(cfg, ParallelConfig(recompute_granularity=granularity), VOCAB, init_seed=SEED)
    model.train()
    ids, pos, labels = batch(s=16)
    model_parallel_manual_seed(SEED)
    saved_bytes = 0

    def pack(t):
        nonlocal saved_bytes
        saved_bytes += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, pos, labels)
    loss.mean().backward()
    return loss.detach(), _grads(model), saved_bytes


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_recompute_gives_identical_results_and_saves_memory(granularity):
    loss, grads, saved = _train_step(None)
    r_loss, r_grads, r_saved = _train_step(granularity)
    again, _, _ = _train_step(None)
    assert torch.equal(loss, again)  # deterministic at all, with dropout on
    assert torch.equal(r_loss, loss)
    for name, grad in grads.items():
        assert torch.equal(r_grads[name], grad), name
    assert r_saved < saved, (granularity, r_saved, saved)


def _tp_recompute_with_dropout():
    ps.initialize_model_parallel(2, 1)
    results = {}
    for granularity in (None, "full", "selective"):
        cfg = tiny_config(hidden_dropout=0.1, attention_dropout=0.1)
        par = ParallelConfig(
            world_size=2, tensor_model_parallel_size=2, sequence_parallel=True, recompute_granularity=granularity
        )
        model = GPTModel(cfg, par, VOCAB, init_seed=SEED)
        model_parallel_manual_seed(SEED)
        ids, pos, labels = batch()
        loss = model(ids, pos, labels)
        loss.mean().backward()
        results[granularity] = (loss.detach(), _grads(model))
    return results


@pytest.mark.slow
def test_recompute_under_tp_and_sp_replays_the_tracker_dropout_masks():
    for results in run_distributed(_tp_recompute_with_dropout, 2):
        loss, grads = results[None]
        for granularity in ("full", "selective"):
            r_loss, r_grads = results[granularity]
            assert torch.equal(r_loss, loss), granularity
            assert all(torch.equal(r_grads[name], grad) for name, grad in grads.items()), granularity


def test_one_initialization_path_every_parameter_declares_how_it_is_drawn(monkeypatch):
    """GPTModel draws each weight once: its layers are built without drawing (initialize=False) and
    every parameter declares its init_method, so nothing is drawn and then overwritten."""
    from megatron_core.tensor_parallel import layers

    draws = []
    real = layers.initialize_parameter
    monkeypatch.setattr(layers, "initialize_parameter", lambda p, *a, **k: (draws.append(p), real(p, *a, **k)))
    from megatron_core.models import gpt

    monkeypatch.setattr(gpt, "initialize_parameter", layers.initialize_parameter)
    model = GPTModel(tiny_config(), ParallelConfig(), VOCAB, init_seed=SEED)
    params = list(model.parameters())
    assert len(draws) == len(params) and {id(p) for p in draws} == {id(p) for p in params}
    assert all(callable(getattr(p, "init_method", None)) for p in params)
    layernorm = model.encoder.layers[0].input_layernorm.weight
    assert torch.equal(layernorm, torch.ones_like(layernorm))
    assert not model.encoder.layers[0].self_attention.query_key_value.bias.any()
