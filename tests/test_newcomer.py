"""A newcomer's path (issue 36): every form the README prints works, a wrong flag is refused before any work
in one line, a stopped or finished run says so honestly, results land beside the model they describe, and the
output says where things are. One smoke pipeline (module-scoped) serves the tests that need a run."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_core import workflow
from megatron_core.config import load_recipe
from megatron_core.errors import UserError

ROOT = Path(__file__).resolve().parents[1]


def invoke(*args: str, cwd: Path = ROOT, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "invoke", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def run_task(*argv: str) -> tuple[int, str]:
    """`invoke ARGV` in this process (no interpreter start-up per call): (exit code, stdout and stderr)."""
    import tasks
    from invoke import Program

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            Program(namespace=tasks.ns, name="invoke", binary="invoke").run(["invoke", *argv])
            code = 0
        except SystemExit as exc:
            code = exc.code or 0
    return code, out.getvalue()


def one_line_error(code: int, out: str) -> str:
    """A refusal: exit 2 and one `error:` line, printed last, no traceback."""
    assert code == 2 and "Traceback" not in out, out[-1500:]
    assert out.strip().splitlines()[-1].startswith("error: "), out[-1500:]
    return out.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("newcomer-work")
    proc = invoke("pipeline", "--recipe", "smoke", "--workdir", str(workdir))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return workdir, workflow.run_dir(load_recipe("smoke"), workdir), proc


# ----------------------------------------------------------------------------------------------
# 1. The README's training example; a short run's warm-up
# ----------------------------------------------------------------------------------------------


def test_the_readme_training_example_is_accepted_and_a_too_short_run_names_the_key(tmp_path):
    from megatron_core.pretrain_gpt import check_training_values

    readme = (ROOT / "README.md").read_text()
    form = "megatron-recipes train --recipe codeparrot-tiny --set lr="
    example = next(line for line in readme.splitlines() if line.startswith(form))
    words = shlex.split(example, comments=True)
    overrides = [words[i + 1] for i, w in enumerate(words) if w == "--set"]
    check_training_values(load_recipe(words[words.index("--recipe") + 1], overrides))  # as `invoke train` checks it

    with pytest.raises(
        UserError,
        match=r"training\.lr_warmup_iters 50 must be below training\.train_iters 50 .*"
        r"--set training\.lr_warmup_iters=5 ",
    ):
        load_recipe("codeparrot-tiny", ["training.train_iters=50"])
    check_training_values(load_recipe("codeparrot-tiny", ["training.train_iters=50", "training.lr_warmup_iters=5"]))
    refused = run_task(
        "train", "--recipe", "codeparrot-tiny", "--set", "training.train_iters=50", "--workdir", str(tmp_path / "w")
    )
    assert "training.lr_warmup_iters" in one_line_error(*refused)
    assert not (tmp_path / "w").exists()  # refused before any data step


# ----------------------------------------------------------------------------------------------
# 9. Help
# ----------------------------------------------------------------------------------------------


def test_every_task_answers_help_and_dash_h_is_help():
    import tasks

    names = sorted(tasks.ns.task_names)
    assert {"import-hf", "evaluate", "pipeline", "train"} <= set(names)
    for name in names:
        code, text = run_task(name, "--help")
        assert code == 0 and "Usage:" in text and f" {name} " in text, (name, text[-500:])
        assert not re.search(r"^\s+--,", text, re.M), (name, text)  # an option with no flag name
        code, short = run_task(name, "-h")  # -h is help, never a task flag
        flags = re.compile(r"^  (-\S+)", re.M)  # (invoke hands each help text out once per process: compare flags)
        assert code == 0 and short.startswith("Usage:") and flags.findall(short) == flags.findall(text), name


# ----------------------------------------------------------------------------------------------
# 10. A device the machine does not have
# ----------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_cuda_without_a_gpu_is_refused_before_launch(tmp_path):
    refused = one_line_error(
        *run_task(
            "train", "--recipe", "smoke", "--set", "device=cuda", "--nproc", "2", "--workdir", str(tmp_path / "w")
        )
    )
    assert "no visible CUDA GPU" in refused and "--set device=cpu" in refused and not (tmp_path / "w").exists()


# ----------------------------------------------------------------------------------------------
# 3. A --load with no checkpoint
# ----------------------------------------------------------------------------------------------


def test_a_load_without_a_checkpoint_is_refused_unless_from_scratch(smoke_run, tmp_path):
    from megatron_core import cli

    workdir, run, _ = smoke_run
    before = (run / "metrics.jsonl").read_bytes()
    missing = run_task("train", "--recipe", "smoke", "--workdir", str(workdir), "--load", str(tmp_path / "nope"))
    assert "no such directory" in one_line_error(*missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="holds no checkpoint"):
        cli._check_load(tmp_path / "empty")
    with pytest.raises(UserError, match=f"did you mean --load {re.escape(str(run / 'checkpoints'))}"):
        cli._check_load(run)  # the run directory instead of its checkpoints/
    cli._check_load(run / "checkpoints")
    assert (run / "metrics.jsonl").read_bytes() == before  # nothing trained


# ----------------------------------------------------------------------------------------------
# 11. A finished run re-run; 12. what the output says
# ----------------------------------------------------------------------------------------------


def test_the_pipeline_says_where_things_are(smoke_run):
    _, run, proc = smoke_run
    out = proc.stdout
    assert out.index("train: starting 1 process(es) for 20 iterations") < out.index("iteration        2/")
    for line in (
        f"train: loss curve: {run / 'loss_curve.png'}",
        f"train: TensorBoard: {run / 'tensorboard'}",
        f"pipeline: model {run / 'hf'}, evaluation {run / 'eval' / 'evaluation.md'}",
    ):
        assert line in out
    assert re.search(r"train: finished at iteration 20: valid loss \d\.\d{4}, test loss \d\.\d{4}", out)
    assert out.count("[workflow] corpus: ") == 2  # building, done: never "up to date" besides
    tflops = re.findall(r"TFLOP/s/GPU\): ([^ ]+) \|", out)
    assert tflops and all(float(x) > 0 for x in tflops)  # a CPU's GFLOP/s, not 0.0
    umask = os.umask(0)
    os.umask(umask)
    assert (run / "hf").stat().st_mode & 0o777 == 0o777 & ~umask  # a shared disk's others can read the model
    assert all(p.stat().st_mode & 0o777 == 0o666 & ~umask for p in (run / "hf").iterdir())


def test_up_to_date_steps_are_said_once(smoke_run, capsys):
    workdir, _, _ = smoke_run
    workflow.ensure_training_inputs(load_recipe("smoke"), workdir)
    out = capsys.readouterr().out
    assert [out.count(f"[workflow] {step}: up to date") for step in ("corpus", "tokenizer", "preprocess")] == [1, 1, 1]


def test_a_finished_run_rerun_is_a_no_op_and_keeps_earlier_humaneval(smoke_run):
    workdir, run, _ = smoke_run
    final = run / "checkpoints" / "iter_0000020"
    watched = [run / "metrics.jsonl", run / "summary.json", run / "eval" / "evaluation.json", *sorted(final.rglob("*"))]
    before = {p: (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None) for p in watched}
    code, again = run_task("pipeline", "--recipe", "smoke", "--workdir", str(workdir))
    assert code == 0, again[-3000:]
    assert "train: nothing to do: this run finished all 20 iterations" in again
    assert "[workflow] evaluate: up to date" in again
    assert {p: (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None) for p in watched} == before

    # HumanEval results of this very model (as an earlier --humaneval run left them) survive a perplexity-only evaluate
    evaluation = run / "eval" / "evaluation.json"
    earlier = json.loads(evaluation.read_text())
    humaneval = {"pass@1": 0.25, "generation": {"device": "cpu"}}
    evaluation.write_text(json.dumps({**earlier, "humaneval": humaneval, "pass@1": 0.25}))
    code, out = run_task("evaluate", "--recipe", "smoke", "--workdir", str(workdir))
    assert code == 0, out[-3000:]
    kept = json.loads(evaluation.read_text())
    assert kept["humaneval"] == humaneval and kept["pass@1"] == 0.25
    assert kept["perplexity"]["valid"]["loss"] == pytest.approx(earlier["perplexity"]["valid"]["loss"])
    evaluation.write_text(json.dumps(earlier))


# ----------------------------------------------------------------------------------------------
# 4. Results beside the model; the model's own recipe
# ----------------------------------------------------------------------------------------------


def test_evaluating_another_model_writes_beside_it_under_its_own_recipe(smoke_run, tmp_path):
    workdir, run, _ = smoke_run
    own = (run / "eval" / "evaluation.json").read_bytes()
    copy = Path(shutil.copytree(run / "hf", tmp_path / "other-hf"))
    code, out = run_task("evaluate", "--model", str(copy), "--workdir", str(workdir))
    assert code == 0, out[-3000:]
    assert out.startswith("recipe: smoke ")  # the model's carried recipe, not the default codeparrot-tiny
    results = json.loads((tmp_path / "other-hf-eval" / "evaluation.json").read_text())
    assert (results["model_path"], results["checkpoint_iteration"]) == (str(copy.resolve()), 20)
    assert results["recipe_hash"] == load_recipe("smoke").hash
    assert (run / "eval" / "evaluation.json").read_bytes() == own  # the run's own results untouched
    code, converted = run_task("convert", "--load", str(run / "checkpoints"), "--save", str(tmp_path / "hf2"))
    assert code == 0, converted[-3000:]
    assert converted.startswith("recipe: smoke ")
    assert not (workdir / "codeparrot-tiny").exists()  # nothing of the default recipe's was made


# ----------------------------------------------------------------------------------------------
# 8. The converted model's context window
# ----------------------------------------------------------------------------------------------


def test_the_converted_model_knows_its_context_window(smoke_run, capsys):
    from transformers import AutoTokenizer, GenerationConfig

    from megatron_core.evaluate.humaneval import HumanEvalSettings
    from megatron_core.evaluate.runner import HumanEvalSampler, load_for_evaluation

    _, run, _ = smoke_run
    positions = load_recipe("smoke").model.max_position_embeddings
    assert AutoTokenizer.from_pretrained(run / "hf").model_max_length == positions
    assert GenerationConfig.from_pretrained(run / "hf").max_length == positions
    loaded = load_for_evaluation(run / "hf")
    sampler = HumanEvalSampler(loaded, HumanEvalSettings(num_samples=1, max_new_tokens=8, k=[1]), batch=1)
    completions, new_tokens = sampler(["def f(x):\n" + "    x = x + 1\n" * 40], 1)
    assert len(completions[0]) == 1 and 0 < new_tokens <= 8  # generated, within the window
    assert f"keep their last {positions - 8} (the model has {positions} positions" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------
# 2. A stopped training stops the pipeline
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_pipeline_whose_training_is_stopped_converts_and_evaluates_nothing(smoke_run):
    workdir, _, _ = smoke_run
    # a run of its own (seed): a raised train_iters alone would extend smoke_run's finished run in place
    long = [
        "training.train_iters=100000",
        "training.save_interval=null",
        "training.log_interval=1",
        "training.eval_interval=100000",
        "training.seed=2",
    ]
    run = workflow.run_dir(load_recipe("smoke", long), workdir)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "invoke",
            "pipeline",
            "--recipe",
            "smoke",
            "--workdir",
            str(workdir),
            *[a for item in long for a in ("--set", item)],
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        deadline = time.time() + 120
        while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().count("\n") >= 2):
            assert proc.poll() is None and time.time() < deadline, "training did not start"
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGTERM)  # a scheduler's preemption, to the invoke process
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert re.search(r"stopped by SIGTERM at iteration \d+ of 100000 .*run the same command again to resume", out)
    assert not (run / "hf").exists() and not (run / "eval").exists()
    assert "convert:" not in out and "evaluate:" not in out
