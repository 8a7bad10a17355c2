"""evaluate(recipe, model): perplexity on the recipe's valid/test splits and (when asked) HumanEval.

`model` is a Hugging Face model directory (a converted one), a Megatron checkpoint directory, or
a loaded model: an nn.Module whose forward(ids) returns logits (pass `tokenizer` then). Writes
evaluation.json and evaluation.md (ours beside the recipe's `evaluate.reference`) into out_dir.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional, Union

import torch

from megatron_core.errors import UserError
from megatron_core.evaluate.generate import SamplingConfig, generate
from megatron_core.evaluate.humaneval import HumanEvalSettings, evaluate_humaneval
from megatron_core.evaluate.perplexity import evaluate_perplexity


class LoadedModel:
    """What evaluation needs: a logits function, a tokenizer, a hash naming the weights."""

    def __init__(self, model_fn, tokenizer, model_hash: str, context_window: int, description: str):
        self.model_fn, self.tokenizer, self.model_hash = model_fn, tokenizer, model_hash
        self.context_window, self.description = context_window, description


def _file_hash(paths) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def _module_hash(module: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def _tokenizer_from_dir(path: Path):
    from transformers import GPT2TokenizerFast

    if not ((path / "vocab.json").exists() and (path / "merges.txt").exists()):
        raise UserError(f"{path} has no vocab.json/merges.txt; pass tokenizer=<dir with them>")
    return GPT2TokenizerFast.from_pretrained(str(path))


def _tokenizer_for_checkpoint(path: Path):
    """The files the checkpoint's args name (training records them), else ones beside it."""
    from megatron_core.convert.shards import find_shard_files, load_shard_file, resolve_iteration_dir

    if (path / "vocab.json").exists():
        return _tokenizer_from_dir(path)
    args = load_shard_file(next(iter(find_shard_files(resolve_iteration_dir(path)[0]).values()))).get("args")
    vocab, merges = getattr(args, "vocab_file", None), getattr(args, "merge_file", None)
    if not (vocab and merges and Path(vocab).is_file() and Path(merges).is_file()):
        raise UserError(f"the checkpoint {path} names no readable vocab/merge files; pass tokenizer=<HF tokenizer>")
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copyfile(vocab, Path(tmp) / "vocab.json")
        shutil.copyfile(merges, Path(tmp) / "merges.txt")
        return _tokenizer_from_dir(Path(tmp))


def load_for_evaluation(model, tokenizer=None, attn_implementation: str = "sdpa") -> LoadedModel:
    if isinstance(model, torch.nn.Module):
        if tokenizer is None:
            raise UserError("evaluating a loaded model needs its tokenizer (tokenizer=...)")
        window = getattr(getattr(model, "shape", None), "max_position_embeddings", None) or \
            getattr(getattr(model, "config", None), "n_positions", 1024)
        fn = model if not hasattr(model, "config") else (lambda ids: model(ids).logits)
        return LoadedModel(fn, tokenizer, _module_hash(model), window, type(model).__name__)
    path = Path(model)
    if (path / "latest_checkpointed_iteration.txt").exists():
        from megatron_core.convert.load import load_megatron_model

        ours = load_megatron_model(path)
        tok = tokenizer or _tokenizer_for_checkpoint(path)
        return LoadedModel(ours, tok, f"{ours.recipe_hash}-it{ours.iteration}-{_module_hash(ours)}",
                           ours.shape.max_position_embeddings, f"GPTModel from {path}")
    if (path / "config.json").exists():
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                  attn_implementation=attn_implementation).eval()
        weights = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin"))
        tok = tokenizer or _tokenizer_from_dir(path)
        return LoadedModel(lambda ids: hf(ids).logits, tok, _file_hash(weights), hf.config.n_positions,
                           f"{type(hf).__name__} from {path} ({attn_implementation})")
    raise UserError(f"{path} is neither a Hugging Face model dir (config.json) nor a Megatron checkpoint "
                    f"(latest_checkpointed_iteration.txt)")


def recipe_datasets(recipe, workdir) -> dict:
    """The recipe's valid and test splits, one epoch each (built like training builds them)."""
    from megatron_core import workflow
    from megatron_core.data.gpt_dataset import build_gpt_datasets

    cache = Path(workdir) / "eval-index-cache"
    _, valid, test = build_gpt_datasets(workflow.data_prefixes(recipe, workdir), split=recipe.data.split,
                                        seq_length=recipe.model.seq_length, num_samples=(1, None, None),
                                        seed=recipe.training.seed, cache_dir=str(cache))
    return {name: ds for name, ds in (("valid", valid), ("test", test)) if ds is not None}


def humaneval_generate_fn(loaded: LoadedModel, settings: HumanEvalSettings):
    tok = loaded.tokenizer
    eos = tok.convert_tokens_to_ids("<|endoftext|>") if "<|endoftext|>" in tok.get_vocab() else None
    cfg = SamplingConfig(max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                         top_p=settings.top_p, stop_sequences=settings.stop_sequences, eos_token_id=eos,
                         vocab_limit=len(tok), context_window=loaded.context_window)
    def fn(prompt: str, n: int) -> list[str]:
        # One generator per problem, seeded by (seed, prompt): a resumed run samples what an
        # uninterrupted one would have.
        digest = hashlib.sha256(f"{settings.seed}:{prompt}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
        ids = tok.encode(prompt)[-(loaded.context_window - 1):]
        samples = generate(loaded.model_fn, ids, cfg, num_samples=n, decode=tok.decode, generator=generator)
        return [tok.decode(s) for s in samples]

    return fn


def markdown_table(results: dict, reference: dict) -> str:
    rows = ["| metric | ours | reference |", "|---|---|---|"]
    metrics = [k for k in results if k.startswith("pass@")] + [f"{s}_{m}" for s in ("valid", "test") for m in ("loss", "ppl")]
    for key in dict.fromkeys(metrics + list(reference)):
        ours = results.get(key)
        if ours is None:
            split, _, m = key.partition("_")
            ours = results.get("perplexity", {}).get(split, {}).get(m)
        fmt = (lambda v: "-" if v is None else (f"{100 * v:.2f}%" if key.startswith("pass@") else f"{v:.4f}"))
        rows.append(f"| {key} | {fmt(ours)} | {fmt(reference.get(key))} |")
    return "\n".join(rows) + "\n"


def evaluate(recipe, model: Union[str, Path, torch.nn.Module], *, workdir=".", out_dir=None, tokenizer=None,
             datasets: Optional[dict] = None, perplexity: Optional[bool] = None, humaneval: Optional[bool] = None,
             allow_code_execution: bool = False, batch_size: int = 8, max_batches: Optional[int] = None,
             attn_implementation: str = "sdpa", **humaneval_overrides) -> dict:
    """Run what the recipe's `evaluate` section asks for (flags override it); returns the results."""
    e = recipe.evaluate
    do_ppl = e.perplexity if perplexity is None else perplexity
    do_he = e.humaneval if humaneval is None else humaneval
    if do_he and not allow_code_execution:
        raise UserError("HumanEval runs model-written code; pass --allow-code-execution to allow it")
    loaded = load_for_evaluation(model, tokenizer, attn_implementation)
    out_dir = Path(out_dir or Path(workdir) / "evaluation")
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"evaluate: {loaded.description}, model hash {loaded.model_hash}", flush=True)
    results: dict = {"recipe": recipe.name, "recipe_hash": recipe.hash, "model": loaded.description,
                     "model_hash": loaded.model_hash}
    if do_ppl:
        datasets = datasets if datasets is not None else recipe_datasets(recipe, workdir)
        limit = max_batches if max_batches is not None else recipe.training.eval_iters
        results["perplexity"] = {name: evaluate_perplexity(loaded.model_fn, ds, batch_size, limit, desc=name)
                                 for name, ds in datasets.items()}
        for name, r in results["perplexity"].items():
            print(f"evaluate: {name} loss {r['loss']:.6f} ppl {r['ppl']:.4f} over {r['tokens']} tokens", flush=True)
    if do_he:
        settings = HumanEvalSettings.from_recipe(e, **humaneval_overrides)
        he = evaluate_humaneval(humaneval_generate_fn(loaded, settings), settings, model_hash=loaded.model_hash,
                                cache_dir=out_dir / "cache", allow_code_execution=True)
        results["humaneval"] = he
        results.update({k: v for k, v in he.items() if k.startswith("pass@")})
    results["reference"] = dict(e.reference)
    _write_atomic(out_dir / "evaluation.json", json.dumps(results, indent=2, default=str) + "\n")
    _write_atomic(out_dir / "evaluation.md", f"# {recipe.name}: evaluation\n\n{markdown_table(results, e.reference)}")
    print(f"evaluate: wrote {out_dir / 'evaluation.json'} and evaluation.md", flush=True)
    return results


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
