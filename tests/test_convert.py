"""Megatron checkpoint -> HF GPT2: parity of logits and greedy tokens, layouts, versions, round trip."""

from __future__ import annotations


import pytest
import torch

from megatron_core.convert import convert_checkpoint, import_hf_model, read_checkpoint
from megatron_core.evaluate.generate import SamplingConfig, generate
from test_convert_fixtures import (  # noqa: F401  (fixtures)
    PADDED_VOCAB,
    fixture_tokenizer_files,
    fixture_tp1_checkpoint,
    load_megatron_model,
    random_full_state,
    read_json,
    save_layout,
    save_tp1,
    tiny_recipe,
)

torch.set_num_threads(1)


def hf_model(path, attn="eager", **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation=attn, **kwargs
    ).eval()


def prompts(n=3, s=20, seed=0):
    return torch.randint(0, 300, (n, s), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def tp1_hf(tp1_checkpoint, tmp_path_factory):
    save, _, _ = tp1_checkpoint
    out = tmp_path_factory.mktemp("hf") / "tp1"
    summary = convert_checkpoint(save, out)
    return out, summary


@torch.no_grad()
def test_tp1_logits_match_ours_eager_and_sdpa(tp1_checkpoint, tp1_hf):
    save, _, _ = tp1_checkpoint
    ours = load_megatron_model(save)
    ids = prompts()
    expected = ours(ids)
    assert expected.shape == (3, 20, PADDED_VOCAB)
    assert expected.std() > 0.1  # perturbed weights: logits far from uniform, so parity means something
    for attn in ("eager", "sdpa"):
        got = hf_model(tp1_hf[0], attn)(ids).logits
        assert (got - expected).abs().max().item() < 1e-4, attn


def test_config_tokenizer_provenance(tp1_checkpoint, tp1_hf, tokenizer_files):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import AutoTokenizer, GPT2TokenizerFast

    out, summary = tp1_hf
    _, recipe, _ = tp1_checkpoint
    cfg = read_json(out / "config.json")
    assert (cfg["vocab_size"], cfg["n_positions"], cfg["n_embd"], cfg["n_layer"], cfg["n_head"], cfg["n_inner"]) == (
        PADDED_VOCAB,
        32,
        64,
        4,
        4,
        256,
    )
    assert cfg["activation_function"] == "gelu_new" and cfg["tie_word_embeddings"] is True
    assert cfg["scale_attn_by_inverse_layer_idx"] is False
    tok = AutoTokenizer.from_pretrained(str(out))
    assert isinstance(tok, GPT2TokenizerFast) and tok.is_fast
    assert (out / "vocab.json").read_bytes() == tokenizer_files[0].read_bytes() and (out / "merges.txt").exists()
    assert read_json(out / "tokenizer_config.json")["tokenizer_class"] == "GPT2TokenizerFast"
    eod = tok.convert_tokens_to_ids("<|endoftext|>")
    assert cfg["bos_token_id"] == cfg["eos_token_id"] == eod
    assert read_json(out / "generation_config.json")["eos_token_id"] == eod
    reference = ByteLevelBPETokenizer(str(tokenizer_files[0]), str(tokenizer_files[1]))
    text = "def fib(n):\n    return n"
    assert tok.encode(text) == reference.encode(text).ids != []
    prov = read_json(out / "provenance.json")
    assert (prov["recipe_name"], prov["recipe_version"], prov["recipe_hash"], prov["iteration"]) == (
        recipe.name,
        recipe.version,
        recipe.hash,
        10,
    )
    assert summary["weights"] == ["model.safetensors"] and not list(out.parent.glob(".tp1.tmp-*"))


@torch.no_grad()
def test_greedy_generation_matches_our_decoder(tp1_checkpoint, tp1_hf):
    ours = load_megatron_model(tp1_checkpoint[0])
    hf = hf_model(tp1_hf[0])
    prompt = prompts(1, 6, seed=3)
    ref = hf.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0, min_new_tokens=10)[
        0, 6:
    ].tolist()
    ours_tokens = generate(ours, prompt[0].tolist(), SamplingConfig(max_new_tokens=10))[0]
    assert ours_tokens == ref and len(ref) == 10


@torch.no_grad()
def test_tp2pp2_split_layout_and_untied_fp16(tp1_checkpoint, tokenizer_files, tmp_path):
    """TP 2 x PP 2 shards (split from the TP 1 state) convert to the same model; an untied,
    erf-GeLU, fp16 checkpoint converts with its own activation and output layer."""
    _, recipe, state = tp1_checkpoint
    ids = prompts(seed=1)
    ckpt = save_layout(tmp_path / "tp2pp2", tiny_recipe(2, 2), state, *tokenizer_files, tp=2, pp=2)
    merged = read_checkpoint(ckpt)
    assert (merged.tensor_parallel, merged.pipeline_parallel) == (2, 2)
    assert all(torch.equal(merged.state[k], v) for k, v in state.items()) and set(merged.state) == set(state)
    convert_checkpoint(ckpt, tmp_path / "hf22")
    expected = load_megatron_model(ckpt)(ids)
    assert (hf_model(tmp_path / "hf22", "sdpa")(ids).logits - expected).abs().max() < 1e-4

    untied = tiny_recipe(untie=True, gelu_tanh=False)
    state_u = random_full_state(untied, seed=5)
    save_tp1(tmp_path / "untied", untied, state_u, *tokenizer_files, dtype=torch.float16)
    summary = convert_checkpoint(tmp_path / "untied", tmp_path / "hf_u", dtype="fp32", format="both")
    assert summary["source_dtype"] == "float16" and summary["weights"] == ["model.safetensors", "pytorch_model.bin"]
    cfg = read_json(tmp_path / "hf_u" / "config.json")
    assert cfg["activation_function"] == "gelu" and cfg["tie_word_embeddings"] is False
    ours = load_megatron_model(tmp_path / "untied")(ids)
    hf = hf_model(tmp_path / "hf_u")
    assert not torch.equal(hf.lm_head.weight, hf.transformer.wte.weight)
    assert (hf(ids).logits - ours).abs().max() < 1e-4


def _legacy_qkv(t: torch.Tensor, version: float, heads_local: int) -> torch.Tensor:
    """Our per-head [q, k, v] rows in the row order of an older checkpoint_version."""
    if version >= 2.0:
        return t
    hn = t.shape[0] // (3 * heads_local)
    v = t.view(heads_local, 3, hn, *t.shape[1:])
    v = v.transpose(0, 1) if version == 0 else v.transpose(1, 2)  # v0 [3, np, hn]; v1 [np, hn, 3]
    return v.contiguous().view(t.shape)


def _make_legacy(ckpt_dir, version: float, newer_norm_names: bool):
    from megatron_core.checkpoint_format import load_checkpoint_file

    for path in ckpt_dir.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        obj = load_checkpoint_file(path)
        lm = obj["model"]["language_model"]
        encoder = {}
        for key, value in lm.pop("encoder").items():
            if "query_key_value" in key:
                value = _legacy_qkv(value, version, 4 // obj["args"].tensor_model_parallel_size)
            if newer_norm_names:
                key = key.replace("layernorm", "norm")
            else:
                key = key.replace("self_attention", "attention")
            encoder[key] = value
        lm["encoder" if newer_norm_names else "transformer"] = encoder
        obj["checkpoint_version"] = version
        torch.save(obj, path)
    for manifest in ckpt_dir.glob("iter_*/manifest.json"):  # Megatron-LM's own checkpoints have none
        manifest.unlink()


@pytest.mark.parametrize("version,newer_names", [(0, False), (1.0, False), (2.0, True)])
def test_legacy_versions_and_names_merge_to_the_same_state(
    tp1_checkpoint, tokenizer_files, tmp_path, version, newer_names
):
    _, _, state = tp1_checkpoint
    ckpt = save_layout(tmp_path / "legacy", tiny_recipe(2, 1), state, *tokenizer_files, tp=2, pp=1)
    _make_legacy(ckpt, version, newer_names)
    merged = read_checkpoint(ckpt)
    assert merged.checkpoint_version == version
    assert set(merged.state) == set(state) and all(torch.equal(merged.state[k], state[k]) for k in state)


def test_round_trip_ours_hf_ours_is_bit_exact(tp1_checkpoint, tokenizer_files, tmp_path):
    from megatron_core.checkpoint_format import load_checkpoint_file

    _, _, state = tp1_checkpoint
    original = save_layout(tmp_path / "orig", tiny_recipe(2, 2), state, *tokenizer_files, tp=2, pp=2)
    convert_checkpoint(original, tmp_path / "hf")
    import_hf_model(tmp_path / "hf", tmp_path / "back", tp=2, pp=2, iteration=10)
    files = sorted(p.relative_to(original) for p in original.glob("iter_*/mp_rank_*/model_optim_rng.pt"))
    assert len(files) == 4
    assert sorted(p.relative_to(tmp_path / "back") for p in (tmp_path / "back").glob("iter_*/*/*.pt")) == files

    def flat(d, prefix=""):
        return {
            k2: v2
            for k, v in d.items()
            for k2, v2 in (flat(v, f"{prefix}{k}.").items() if isinstance(v, dict) else [(prefix + k, v)])
        }

    for rel in files:
        a = flat(load_checkpoint_file(original / rel)["model"])
        b = flat(load_checkpoint_file(tmp_path / "back" / rel)["model"])
        assert list(a) == list(b) and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    # and the imported checkpoint is usable again: it converts to the same HF weights
    convert_checkpoint(tmp_path / "back", tmp_path / "hf2")
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == (tmp_path / "hf2" / "model.safetensors").read_bytes()


@torch.no_grad()
def test_device_map_auto_and_disk_offload(tp1_hf, tmp_path):
    out = tp1_hf[0]
    ids = prompts(seed=2)
    expected = hf_model(out)(ids).logits
    auto = hf_model(out, device_map="auto")
    assert (auto(ids).logits - expected).abs().max() < 1e-5
    split = hf_model(out, device_map="auto", max_memory={"cpu": "600KB"}, offload_folder=str(tmp_path / "off"))
    placements = set(split.hf_device_map.values())
    assert "disk" in placements and len(placements) > 1, split.hf_device_map
    assert (split(ids).logits - expected).abs().max() < 1e-5


def _save_tp2pp2_rank(save, seed):
    from megatron_core import parallel_state as ps
    from megatron_core.models.gpt import GPTModel
    from megatron_core.training.checkpointing import megatron_args, save_checkpoint

    recipe = tiny_recipe(2, 2, init_std=0.3)
    ps.initialize_model_parallel(2, 2)
    model = GPTModel(recipe.model, recipe.parallel, PADDED_VOCAB, init_seed=seed)
    args = megatron_args(recipe, PADDED_VOCAB, iteration=4, consumed_train_samples=0, params_dtype="float32")
    save_checkpoint(save, 4, model_state=model.state_dict(), args=args, recipe=recipe, consumed_train_samples=0)
    ps.destroy_model_parallel()


@pytest.mark.slow
@torch.no_grad()
def test_tp2pp2_checkpoint_written_by_four_ranks(tmp_path, tokenizer_files):
    """Shards written by a real TP 2 x PP 2 GPTModel (layout-independent init) merge into the
    weights of the single-process model built with the same seed."""
    from distributed_utils import run_distributed

    from megatron_core.config import ParallelConfig
    from megatron_core.models.gpt import GPTModel

    run_distributed(_save_tp2pp2_rank, 4, str(tmp_path / "ck"), 7)
    single = GPTModel(
        tiny_recipe(init_std=0.3).model,
        ParallelConfig(),
        PADDED_VOCAB,
        pre_process=True,
        post_process=True,
        layer_offset=0,
        init_seed=7,
    ).state_dict()
    merged = read_checkpoint(tmp_path / "ck")
    assert set(merged.state) == set(single) and all(torch.equal(merged.state[k], single[k]) for k in single)
    convert_checkpoint(
        tmp_path / "ck", tmp_path / "hf", *[], vocab_file=tokenizer_files[0], merge_file=tokenizer_files[1]
    )
    ids = prompts()
    expected = load_megatron_model(tmp_path / "ck")(ids)
    assert (hf_model(tmp_path / "hf")(ids).logits - expected).abs().max() < 1e-4


def test_virtual_pipeline_layout_imports_reads_and_converts(tp1_checkpoint, tokenizer_files, tmp_path):
    """import-hf writes the interleaved schedule's layout (model0, model1 per rank; chunk c of PP
    rank r holds global layer c x PP + r here), and read/convert merge it back bit for bit."""
    from megatron_core.checkpoint_format import load_checkpoint_file

    _, _, state = tp1_checkpoint
    plain = save_layout(tmp_path / "plain", tiny_recipe(2, 2), state, *tokenizer_files, tp=2, pp=2)
    convert_checkpoint(plain, tmp_path / "hf")
    import_hf_model(
        tmp_path / "hf", tmp_path / "vpp", tp=2, pp=2, iteration=10, num_layers_per_virtual_pipeline_stage=1
    )
    qkv = "self_attention.query_key_value.weight"
    for pp_rank in range(2):
        rank_dir = tmp_path / "vpp" / "iter_0000010" / f"mp_rank_01_{pp_rank:03d}"
        shard = load_checkpoint_file(rank_dir / "model_optim_rng.pt")
        assert "model" not in shard and shard["args"].virtual_pipeline_model_parallel_size == 2
        for chunk in range(2):
            encoder = shard[f"model{chunk}"]["language_model"]["encoder"]
            assert torch.equal(
                encoder[f"layers.0.{qkv}"], state[f"encoder.layers.{chunk * 2 + pp_rank}.{qkv}"].chunk(2)[1]
            )
            assert ("final_layernorm.weight" in encoder) == (pp_rank == 1 and chunk == 1)
    merged = read_checkpoint(tmp_path / "vpp")
    assert all(torch.equal(merged.state[k], v) for k, v in state.items()) and set(merged.state) == set(state)
    convert_checkpoint(tmp_path / "vpp", tmp_path / "hf2")
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == (tmp_path / "hf2" / "model.safetensors").read_bytes()
