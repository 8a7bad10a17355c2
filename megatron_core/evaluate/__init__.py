"""Evaluation on the recipe's device: perplexity, HumanEval pass@k (sandboxed), our KV-cached decoder."""

from megatron_core.evaluate.generate import SamplingConfig, generate, generate_cached
from megatron_core.evaluate.humaneval import HumanEvalSettings, evaluate_humaneval, pass_at_k
from megatron_core.evaluate.perplexity import evaluate_perplexity
from megatron_core.evaluate.runner import evaluate, load_for_evaluation, markdown_table

__all__ = [
    "evaluate",
    "evaluate_perplexity",
    "evaluate_humaneval",
    "HumanEvalSettings",
    "pass_at_k",
    "generate",
    "generate_cached",
    "SamplingConfig",
    "load_for_evaluation",
    "markdown_table",
]
