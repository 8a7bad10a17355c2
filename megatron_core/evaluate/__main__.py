"""python -m megatron_core.evaluate --recipe R --model DIR [...]: perplexity and (when asked) HumanEval.

DIR is a converted Hugging Face model dir or a Megatron checkpoint dir.
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_core.errors import UserError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_core.evaluate", description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", required=True, help="recipe name or YAML path")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="recipe override key=value")
    parser.add_argument("--model", required=True, help="HF model dir or Megatron checkpoint dir")
    parser.add_argument("--workdir", default=".", help="where the recipe's data steps live")
    parser.add_argument("--out", default=None, help="output dir (default WORKDIR/evaluation)")
    parser.add_argument("--humaneval", action="store_true", default=None)
    parser.add_argument("--no-perplexity", dest="perplexity", action="store_false", default=None)
    parser.add_argument("--allow-code-execution", action="store_true")
    parser.add_argument(
        "--unsafe-weak-isolation",
        action="store_true",
        help="where namespaces are unavailable, run HumanEval samples with rlimits only",
    )
    parser.add_argument("--num-samples", type=int)
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--problems", type=int, help="first N HumanEval problems")
    parser.add_argument("--batch-size", type=int, default=8, help="perplexity sequences per batch")
    parser.add_argument(
        "--device", default="auto", help="auto | cpu | cuda | cuda:N | cuda:all (default: the GPU when there is one)"
    )
    parser.add_argument(
        "--dtype", default="auto", help="auto | fp32 | fp16 | bf16 (default: the recipe's on a GPU, fp32 on a CPU)"
    )
    parser.add_argument(
        "--generation-batch", type=int, help="HumanEval rows per batch (default: from GPU memory; 16 on a CPU)"
    )
    parser.add_argument("--workers", type=int, help="sandboxed samples run at once (default: CPU count)")
    parser.add_argument("--max-batches", type=int, default=None, help="default: the recipe's eval_iters")
    ns = parser.parse_args(argv)
    try:
        from megatron_core.config import load_recipe
        from megatron_core.evaluate.runner import evaluate

        recipe = load_recipe(ns.recipe, ns.overrides)
        results = evaluate(
            recipe,
            ns.model,
            workdir=ns.workdir,
            out_dir=ns.out,
            perplexity=ns.perplexity,
            humaneval=ns.humaneval,
            allow_code_execution=ns.allow_code_execution,
            batch_size=ns.batch_size,
            max_batches=ns.max_batches,
            num_samples=ns.num_samples,
            temperature=ns.temperature,
            top_p=ns.top_p,
            max_new_tokens=ns.max_new_tokens,
            problems=ns.problems,
            device=ns.device,
            dtype=ns.dtype,
            generation_batch=ns.generation_batch,
            workers=ns.workers,
            unsafe_weak_isolation=ns.unsafe_weak_isolation,
        )
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    summary = {k: v for k, v in results.items() if k.startswith("pass@")}
    summary.update({f"{s}_ppl": r["ppl"] for s, r in results.get("perplexity", {}).items()})
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
