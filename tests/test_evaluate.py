"""Evaluation: perplexity of a checkpoint (converted in memory) and of the converted HF dir equal our
GPTModel's fp32 full-recompute numbers; the KV-cached decoder equals the full recompute; top-p and stop
sequences; evaluate() end to end (JSON + markdown beside the reference, HumanEval resume, bad input)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from megatron_core.convert import convert_checkpoint
from megatron_core.data.indexed_dataset import IndexedDatasetBuilder
from megatron_core.errors import UserError
from megatron_core.evaluate import evaluate, sandbox
from megatron_core.evaluate.generate import (
    HUMANEVAL_STOP,
    SamplingConfig,
    generate,
    generate_cached,
    sample_tokens,
    truncate_at_stop,
)
from test_convert_fixtures import (  # noqa: F401
    CORPUS,
    load_megatron_model,
    random_full_state,
    read_json,
    save_tp1,
    tiny_recipe,
    fixture_tokenizer_files,
)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def eval_setup(tmp_path_factory, tokenizer_files):
    """A recipe whose data_path is a real .bin/.idx of the tokenized corpus, its checkpoint, the HF dir."""
    from tokenizers import ByteLevelBPETokenizer

    root = tmp_path_factory.mktemp("eval")
    tok = ByteLevelBPETokenizer(str(tokenizer_files[0]), str(tokenizer_files[1]))
    eod = tok.token_to_id("<|endoftext|>")
    prefix = root / "corpus_text_document"
    with IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16) as builder:
        for i, text in enumerate(CORPUS):
            ids = tok.encode(f"# doc {i}\n{text}").ids + [eod]
            builder.add_document(ids, [len(ids)])
        builder.finalize(f"{prefix}.idx")
    recipe = tiny_recipe(
        data={"data_path": [str(prefix)], "split": "80,10,10"},
        evaluate={"reference": {"pass@1": 0.038, "pass@10": 0.0657}},
        training={"eval_iters": 50},
    )
    ckpt = save_tp1(root / "ckpt", recipe, random_full_state(recipe, seed=2), *tokenizer_files)
    convert_checkpoint(ckpt, root / "hf")
    return recipe, ckpt, root / "hf", root


def test_perplexity_of_checkpoint_and_hf_dir_equal_our_fp32_full_recompute(eval_setup):
    """The reference is the path evaluation took before it moved to the device: our own GPTModel
    (MegatronCausalLM) in fp32 on the CPU, one sequence at a time."""
    from megatron_core.evaluate.perplexity import evaluate_perplexity
    from megatron_core.evaluate.runner import recipe_datasets

    recipe, ckpt, hf_dir, root = eval_setup
    ours = load_megatron_model(ckpt)
    reference = {
        name: evaluate_perplexity(ours, ds, batch_size=1, max_batches=50 * 3)
        for name, ds in recipe_datasets(recipe, root).items()
    }
    from_ckpt = evaluate(recipe, ckpt, workdir=root, out_dir=root / "ev-ours", batch_size=3)
    hf = evaluate(recipe, hf_dir, workdir=root, out_dir=root / "ev-hf", batch_size=5)
    for split in ("valid", "test"):
        ref = reference[split]
        assert ref["tokens"] > 0 and math.isfinite(ref["loss"])
        for r in (from_ckpt["perplexity"][split], hf["perplexity"][split]):
            assert r["tokens"] == ref["tokens"] and abs(r["loss"] - ref["loss"]) / ref["loss"] < 1e-4
            assert abs(r["ppl"] - ref["ppl"]) / ref["ppl"] < 1e-4 and math.isclose(r["ppl"], math.exp(r["loss"]))
            assert (r["device"], r["dtype"]) == ("cpu", "fp32")  # the placement of a CPU recipe, recorded
    saved = read_json(root / "ev-hf" / "evaluation.json")
    assert saved["perplexity"] == hf["perplexity"] and saved["model_hash"] != from_ckpt["model_hash"]
    assert "converted in memory" in from_ckpt["model"] and not (ckpt / "hf").exists()
    table = (root / "ev-hf" / "evaluation.md").read_text()
    assert "| pass@1 | - | 3.80% |" in table and "| pass@10 | - | 6.57% |" in table
    assert f"| valid_ppl | {hf['perplexity']['valid']['ppl']:.4f} | - |" in table


def _records(cache) -> list[dict]:
    return [json.loads(line) for line in open(cache)]


def test_humaneval_through_evaluate_resumes_from_cache(eval_setup, monkeypatch):
    recipe, _, hf_dir, root = eval_setup
    kw = dict(
        workdir=root,
        out_dir=root / "ev-he",
        perplexity=False,
        humaneval=True,
        allow_code_execution=True,
        num_samples=2,
        max_new_tokens=6,
        problems=3,
        temperature=0.8,
        k=[1, 2],
        generation_batch=2,
    )
    if sandbox.isolation_problem():
        pytest.skip("no user namespaces here: the weak sandbox never resumes from its cache")
    first = evaluate(recipe, hf_dir, **kw)
    assert first["humaneval"]["num_problems"] == 3 and 0.0 <= first["pass@1"] <= first["pass@2"] <= 1.0
    generation = read_json(root / "ev-he" / "evaluation.json")["humaneval"]["generation"]
    assert set(generation) == {"new_tokens", "seconds", "tokens_per_s", "device", "dtype", "batch"}
    assert generation["new_tokens"] > 0 and (generation["device"], generation["dtype"], generation["batch"]) == (
        "cpu",
        "fp32",
        2,
    )
    records = _records(first["humaneval"]["cache"])
    assert len(records) == 3 and all(records[0]["completions"])
    assert records[0]["completions"][0] != records[0]["completions"][1]

    import megatron_core.evaluate.runner as runner

    # interrupted after the first problem, then resumed: the same samples, the same pass@k
    real = runner.generate_cached
    calls = []

    def interrupted(*args, **kwargs):
        if calls:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "generate_cached", interrupted)
    with pytest.raises(KeyboardInterrupt):
        evaluate(recipe, hf_dir, **{**kw, "out_dir": root / "ev-he-resumed"})
    assert not (root / "ev-he-resumed" / "evaluation.json").exists()
    monkeypatch.setattr(runner, "generate_cached", real)
    resumed = evaluate(recipe, hf_dir, **{**kw, "out_dir": root / "ev-he-resumed"})
    assert _records(resumed["humaneval"]["cache"]) == records
    assert {k: resumed[k] for k in ("pass@1", "pass@2")} == {k: first[k] for k in ("pass@1", "pass@2")}
    assert resumed["humaneval"]["generation"]["new_tokens"] < generation["new_tokens"]  # two problems, not three
    # two problems per batch (left-padded together): the same samples again
    packed = evaluate(recipe, hf_dir, **{**kw, "out_dir": root / "ev-he-packed", "generation_batch": 4})
    assert sorted(map(json.dumps, _records(packed["humaneval"]["cache"]))) == sorted(map(json.dumps, records))

    monkeypatch.setattr(
        runner, "generate_cached", lambda *_a, **_k: pytest.fail("cached problems were generated again")
    )
    again = evaluate(recipe, hf_dir, **kw)
    assert again["humaneval"]["passed_per_problem"] == first["humaneval"]["passed_per_problem"]
    with pytest.raises(Exception, match="allow-code-execution"):
        evaluate(recipe, hf_dir, **{**kw, "allow_code_execution": False})


def test_cached_generation_equals_full_recompute(eval_setup):
    """Prompts of different lengths (left-padded in one batch), several samples each, greedy and
    sampled, with EOS and stop sequences ending rows early: token for token what recomputing the whole
    context for every token gives, prompt by prompt."""
    from transformers import AutoModelForCausalLM, GPT2TokenizerFast

    _, _, hf_dir, _ = eval_setup
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    tok = GPT2TokenizerFast.from_pretrained(str(hf_dir))
    prompts = [tok.encode(t) for t in ("def fib(n):\n    if n < 2:", "class", "import os\nprint(")]
    counts = [3, 1, 4]
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    for temperature, stops in ((0.0, ()), (1.0, ()), (1.3, ("\n", " ", "e"))):
        cfg = SamplingConfig(
            max_new_tokens=12,
            temperature=temperature,
            top_p=0.9,
            eos_token_id=eos,
            vocab_limit=len(tok),
            stop_sequences=stops,
        )
        uniforms = torch.rand((sum(counts), 12), dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        cached = generate_cached(model, prompts, counts, cfg, decode=tok.decode, uniforms=uniforms)
        starts = np.cumsum([0] + counts)
        full = [
            s
            for p, c, a in zip(prompts, counts, starts)
            for s in generate(lambda ids: model(ids).logits, p, cfg, c, decode=tok.decode, uniforms=uniforms[a : a + c])
        ]
        assert cached == full
        if stops:  # common stops end rows at different steps: they left the batch and the cache
            assert len({len(row) for row in cached}) > 1


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    grid = torch.linspace(0, 1, 2001, dtype=torch.float64)[:-1]  # uniforms over [0, 1)

    def reachable(logits, top_p, vocab_limit=None):
        cfg = SamplingConfig(temperature=1.0, top_p=top_p, vocab_limit=vocab_limit)
        tokens = sample_tokens(logits.expand(len(grid), -1).clone(), cfg, grid)
        return np.bincount(tokens.numpy(), minlength=logits.shape[-1]) / len(grid)

    assert reachable(logits, 0.5).tolist() == [1, 0, 0, 0]
    assert np.allclose(reachable(logits, 0.8), [0.5 / 0.8, 0.3 / 0.8, 0, 0], atol=1e-3)
    assert np.allclose(reachable(logits, 0.81), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0], atol=1e-3)
    assert np.allclose(reachable(logits, 1.0), [0.5, 0.3, 0.15, 0.05], atol=1e-3)
    assert np.allclose(reachable(logits, 1.0, vocab_limit=3), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0], atol=1e-3)
    shuffled = logits[:, [2, 0, 3, 1]]
    assert np.allclose(reachable(shuffled, 0.8), [0, 0.5 / 0.8, 0, 0.3 / 0.8], atol=1e-3)


def test_sampling_respects_top_p_temperature_and_seed():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    model_fn = lambda ids: probs.log().expand(ids.shape[0], ids.shape[1], 4)  # noqa: E731  a fixed distribution
    cfg = SamplingConfig(max_new_tokens=50, temperature=1.0, top_p=0.8)
    uniforms = torch.rand((40, 50), dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    samples = generate(model_fn, [0], cfg, num_samples=40, uniforms=uniforms)
    counts = np.bincount(np.concatenate(samples), minlength=4)
    assert counts[2] == counts[3] == 0 and abs(counts[0] / counts[:2].sum() - 0.5 / 0.8) < 0.05
    assert generate(model_fn, [0], cfg, num_samples=40, uniforms=uniforms) == samples
    # a row's tokens depend on its own uniforms only: the last 10 rows alone give the same samples
    assert generate(model_fn, [0], cfg, num_samples=10, uniforms=uniforms[30:]) == samples[30:]
    greedy = generate(model_fn, [0], SamplingConfig(max_new_tokens=5), num_samples=2)
    assert greedy == [[0] * 5, [0] * 5]


def test_stop_sequences_and_eos_end_a_sample():
    assert truncate_at_stop("    return 1\nprint(f())\ndef g", HUMANEVAL_STOP) == ("    return 1", True)
    assert truncate_at_stop("    return 1\n", HUMANEVAL_STOP) == ("    return 1\n", False)
    script = [5, 6, 7, 8, 9]  # decodes to "ab\ndef..." after the third token

    def model_fn(ids):
        step = ids.shape[1] - 1
        logits = torch.full((ids.shape[0], ids.shape[1], 10), -10.0)
        logits[:, -1, script[min(step, len(script) - 1)]] = 10.0
        return logits

    text = {5: "a", 6: "b", 7: "\ndef", 8: " g", 9: "h"}
    out = generate(
        model_fn,
        [0],
        SamplingConfig(max_new_tokens=5, stop_sequences=HUMANEVAL_STOP),
        num_samples=1,
        decode=lambda t: "".join(text[i] for i in t),
    )
    assert out == [[5, 6, 7]]
    assert generate(model_fn, [0], SamplingConfig(max_new_tokens=5, eos_token_id=7)) == [[5, 6]]


def test_cli_writes_results(eval_setup, tmp_path, capsys):
    import json

    import yaml

    from megatron_core.evaluate.__main__ import main

    recipe, _, hf_dir, root = eval_setup
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(recipe.to_dict()))
    base = ["--recipe", str(recipe_file), "--model", str(hf_dir), "--workdir", str(root)]
    assert main(base + ["--out", str(tmp_path / "ev"), "--max-batches", "1"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(summary) == {"valid_ppl", "test_ppl"} and summary["valid_ppl"] > 1
    assert (tmp_path / "ev" / "evaluation.json").exists() and (tmp_path / "ev" / "evaluation.md").exists()
    assert main(base + ["--humaneval", "--no-perplexity"]) == 2
    assert capsys.readouterr().err.startswith("error: HumanEval runs model-written code")


def test_bad_input_is_one_line_nonzero_and_leaves_no_evaluation(eval_setup, tmp_path, capsys):
    import yaml

    from megatron_core.evaluate.__main__ import main

    recipe, _, hf_dir, root = eval_setup
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(recipe.to_dict()))
    out = tmp_path / "ev"
    base = ["--recipe", str(recipe_file), "--workdir", str(root), "--out", str(out)]
    (tmp_path / "not-a-model").mkdir()
    he = ["--humaneval", "--allow-code-execution", "--problems", "1", "--max-new-tokens", "4"]
    cases = {
        "neither a Hugging Face model dir": ["--model", str(tmp_path / "not-a-model")],
        "--num-samples 5 is smaller than the largest k of pass@k (100": [
            "--model",
            str(hf_dir),
            *he,
            "--num-samples",
            "5",
        ],
        "--device cuda:7": ["--model", str(hf_dir), "--device", "cuda:7"],
        "--dtype 'fp8' is not known": ["--model", str(hf_dir), "--device", "cpu", "--dtype", "fp8"],
        "--max-new-tokens 40 leaves no room for a prompt": [
            "--model",
            str(hf_dir),
            *he,
            "--num-samples",
            "100",
            "--max-new-tokens",
            "40",
        ],
    }
    for message, argv in cases.items():
        assert main(base + argv) == 2, message
        errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
        assert len(errors) == 1 and errors[0].startswith("error: ") and message in errors[0], errors
        assert not (out / "evaluation.json").exists()


def test_a_tokenizer_that_cannot_encode_the_prompts_is_refused(eval_setup, tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    recipe, _, hf_dir, root = eval_setup
    words = Tokenizer(WordLevel({"def": 0, "return": 1, "[UNK]": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]")
    refused = r"the tokenizer cannot encode the prompt of HumanEval/0: it does not decode back"
    with pytest.raises(UserError, match=refused) as info:
        evaluate(
            recipe,
            hf_dir,
            tokenizer=tok,
            workdir=root,
            out_dir=tmp_path / "ev",
            humaneval=True,
            allow_code_execution=True,
            problems=1,
            num_samples=100,
        )
    assert "\n" not in str(info.value) and not (tmp_path / "ev").exists()


def test_out_of_memory_halves_the_batch_and_samples_the_same(eval_setup, monkeypatch):
    import megatron_core.evaluate.runner as runner
    from megatron_core.evaluate.humaneval import HumanEvalSettings, load_problems

    _, _, hf_dir, _ = eval_setup
    loaded = runner.load_for_evaluation(str(hf_dir))
    settings = HumanEvalSettings(num_samples=4, max_new_tokens=5, temperature=0.8, k=[1])
    prompts = [p["prompt"] for p in load_problems(2)]
    expected = runner.HumanEvalSampler(loaded, settings, batch=2)(prompts, 4)
    real = runner.generate_cached

    def small_memory(model, prompt_ids, counts, *args, **kwargs):
        if sum(counts) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(model, prompt_ids, counts, *args, **kwargs)

    monkeypatch.setattr(runner, "generate_cached", small_memory)
    sampler = runner.HumanEvalSampler(loaded, settings, batch=8)
    assert sampler(prompts, 4) == expected and sampler.batch == 2
