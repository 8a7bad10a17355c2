"""CI check that a converted model is what users get: `transformers` loads it, its shape matches the recipe,
and it computes a finite loss and generates tokens.

    python -m ci.hf_load --recipe smoke --workdir W      # the recipe run's <run dir>/hf
    python -m ci.hf_load path/to/hf_dir
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from megatron_core.errors import UserError

PROMPT = "def add(a, b):\n    return"


def hf_dir_of(recipe: str, workdir: str, overrides=()) -> Path:
    from megatron_core import config, workflow

    return workflow.run_dir(config.load_recipe(recipe, list(overrides)), workdir) / "hf"


def check_hf_model(hf_dir: str | Path, expect: dict | None = None) -> dict:
    """Load with AutoModelForCausalLM (+ AutoTokenizer when the directory has one); compare the config with
    `expect` ({config key: value}); run one forward with labels and a short greedy generation."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise UserError(f"{hf_dir} has no config.json; convert the run first (invoke convert --recipe ...)")
    cfg = AutoConfig.from_pretrained(hf_dir)
    wrong = {
        key: (getattr(cfg, key, None), value)
        for key, value in (expect or {}).items()
        if getattr(cfg, key, None) != value
    }
    if wrong:
        raise UserError(
            f"{hf_dir}/config.json does not match the recipe: "
            + ", ".join(f"{k}={got} (recipe: {want})" for k, (got, want) in wrong.items())
        )
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    has_tokenizer = (hf_dir / "tokenizer.json").is_file() or (hf_dir / "vocab.json").is_file()
    tokenizer = AutoTokenizer.from_pretrained(hf_dir) if has_tokenizer else None
    ids = (
        tokenizer(PROMPT, return_tensors="pt").input_ids if tokenizer else torch.arange(8).unsqueeze(0) % cfg.vocab_size
    )
    with torch.no_grad():
        loss = float(model(ids, labels=ids).loss)
        generated = model.generate(
            ids, max_new_tokens=8, do_sample=False, pad_token_id=getattr(cfg, "eos_token_id", None) or 0
        )
    if not math.isfinite(loss):
        raise UserError(f"the model in {hf_dir} computes a non-finite loss ({loss}); the conversion is broken")
    new = generated[0, ids.shape[1] :].tolist()
    return {
        "hf_dir": str(hf_dir),
        "model_type": cfg.model_type,
        "loss": loss,
        "generated_ids": new,
        "generated_text": tokenizer.decode(new) if tokenizer else None,
    }


def recipe_expectations(recipe: str, overrides=()) -> dict:
    from megatron_core import config

    m = config.load_recipe(recipe, list(overrides)).model
    return {
        "model_type": "gpt2",
        "n_layer": m.num_layers,
        "n_embd": m.hidden_size,
        "n_head": m.num_attention_heads,
        "n_positions": m.max_position_embeddings,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ci.hf_load", description=__doc__.splitlines()[0])
    parser.add_argument("hf_dir", nargs="?", help="a Hugging Face model directory")
    parser.add_argument("--recipe", help="check the recipe run's converted model, against the recipe's shape")
    parser.add_argument("--workdir", default="./work")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    try:
        if not args.hf_dir and not args.recipe:
            raise UserError("give a Hugging Face directory or --recipe R [--workdir W]")
        hf_dir = args.hf_dir or hf_dir_of(args.recipe, args.workdir, args.overrides)
        expect = recipe_expectations(args.recipe, args.overrides) if args.recipe else None
        result = check_hf_model(hf_dir, expect)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"hf load ok: {result['hf_dir']} ({result['model_type']}), loss {result['loss']:.4f}, "
        f"greedy continuation {result['generated_text']!r}"
        if result["generated_text"] is not None
        else f"hf load ok: {result['hf_dir']}, loss {result['loss']:.4f}, generated ids {result['generated_ids']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
