"""Evaluation: perplexity of our model and the converted HF model agree; the decoder's top-p and
stop sequences; evaluate() end to end (JSON + markdown beside the reference, HumanEval resume)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from megatron_core.convert import convert_checkpoint
from megatron_core.data.indexed_dataset import IndexedDatasetBuilder
from megatron_core.evaluate import evaluate
from megatron_core.evaluate.generate import HUMANEVAL_STOP, SamplingConfig, generate, top_p_filter, truncate_at_stop
from test_convert_fixtures import (  # noqa: F401
    CORPUS,
    random_full_state,
    read_json,
    save_tp1,
    tiny_recipe,
    tokenizer_files,
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
            builder.add_document([tok.encode(f"# doc {i}\n{text}").ids + [eod]])
        builder.finalize(f"{prefix}.idx")
    recipe = tiny_recipe(data={"data_path": [str(prefix)], "split": "80,10,10"},
                         evaluate={"reference": {"pass@1": 0.038, "pass@10": 0.0657}},
                         training={"eval_iters": 50})
    ckpt = save_tp1(root / "ckpt", recipe, random_full_state(recipe, seed=2), *tokenizer_files)
    convert_checkpoint(ckpt, root / "hf")
    return recipe, ckpt, root / "hf", root


def test_perplexity_ours_and_hf_agree_on_valid_and_test(eval_setup):
    recipe, ckpt, hf_dir, root = eval_setup
    ours = evaluate(recipe, ckpt, workdir=root, out_dir=root / "ev-ours", batch_size=3)
    hf = evaluate(recipe, hf_dir, workdir=root, out_dir=root / "ev-hf", batch_size=5)
    for split in ("valid", "test"):
        a, b = ours["perplexity"][split], hf["perplexity"][split]
        assert a["tokens"] == b["tokens"] > 0
        assert math.isfinite(a["loss"]) and abs(a["loss"] - b["loss"]) / a["loss"] < 1e-4
        assert abs(a["ppl"] - b["ppl"]) / a["ppl"] < 1e-4 and math.isclose(a["ppl"], math.exp(a["loss"]))
    saved = read_json(root / "ev-hf" / "evaluation.json")
    assert saved["perplexity"] == hf["perplexity"] and saved["model_hash"] != ours["model_hash"]
    table = (root / "ev-hf" / "evaluation.md").read_text()
    assert "| pass@1 | - | 3.80% |" in table and "| pass@10 | - | 6.57% |" in table
    assert f"| valid_ppl | {hf['perplexity']['valid']['ppl']:.4f} | - |" in table


def test_humaneval_through_evaluate_resumes_from_cache(eval_setup, monkeypatch):
    recipe, _, hf_dir, root = eval_setup
    kw = dict(workdir=root, out_dir=root / "ev-he", perplexity=False, humaneval=True, allow_code_execution=True,
              num_samples=2, max_new_tokens=6, problems=2, temperature=0.8, k=[1, 2])
    first = evaluate(recipe, hf_dir, **kw)
    assert first["humaneval"]["num_problems"] == 2 and 0.0 <= first["pass@1"] <= first["pass@2"] <= 1.0
    cache = first["humaneval"]["cache"]
    assert len(open(cache).read().splitlines()) == 2
    # sampling is seeded per problem: a fresh run (or a resumed one) draws the same completions
    fresh = evaluate(recipe, hf_dir, **{**kw, "out_dir": root / "ev-he-fresh", "problems": 1})
    records = [json.loads(line) for line in open(cache)]
    assert all(records[0]["completions"]) and records[0]["completions"][0] != records[0]["completions"][1]
    assert [json.loads(line) for line in open(fresh["humaneval"]["cache"])][0]["completions"] == \
        records[0]["completions"]

    import megatron_core.evaluate.runner as runner

    monkeypatch.setattr(runner, "generate", lambda *a, **k: pytest.fail("cached problems were generated again"))
    again = evaluate(recipe, hf_dir, **kw)
    assert again["humaneval"]["passed_per_problem"] == first["humaneval"]["passed_per_problem"]
    with pytest.raises(Exception, match="allow-code-execution"):
        evaluate(recipe, hf_dir, **{**kw, "allow_code_execution": False})


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = lambda p: torch.isfinite(top_p_filter(logits, p))[0].tolist()  # noqa: E731
    assert kept(0.5) == [True, False, False, False]
    assert kept(0.8) == [True, True, False, False]
    assert kept(0.81) == [True, True, True, False]
    assert kept(1.0) == [True] * 4
    shuffled = logits[:, [2, 0, 3, 1]]
    assert torch.isfinite(top_p_filter(shuffled, 0.8))[0].tolist() == [False, True, False, True]


def test_sampling_respects_top_p_temperature_and_seed():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    model_fn = lambda ids: probs.log().expand(ids.shape[0], ids.shape[1], 4)  # noqa: E731  a fixed distribution
    cfg = SamplingConfig(max_new_tokens=50, temperature=1.0, top_p=0.8)
    samples = generate(model_fn, [0], cfg, num_samples=40, generator=torch.Generator().manual_seed(0))
    counts = np.bincount(np.concatenate(samples), minlength=4)
    assert counts[2] == counts[3] == 0 and abs(counts[0] / counts[:2].sum() - 0.5 / 0.8) < 0.05
    again = generate(model_fn, [0], cfg, num_samples=40, generator=torch.Generator().manual_seed(0))
    assert again == samples
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
    out = generate(model_fn, [0], SamplingConfig(max_new_tokens=5, stop_sequences=HUMANEVAL_STOP), num_samples=1,
                   decode=lambda t: "".join(text[i] for i in t))
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
