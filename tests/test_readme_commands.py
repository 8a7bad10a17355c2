"""Every command the README prints (issue 36): its ```bash blocks are extracted and each command is run, or,
where it cannot run here (GPUs, nodes, docker, minutes of benchmark), parsed and checked as far as this machine
allows, so a form that fails as printed (a wrong task name, an unknown flag, a recipe key that does not exist,
a layout the recipe refuses) fails the test. The runnable ones run through the console script
`megatron-recipes` from a directory outside the checkout, on the smoke recipe instead of codeparrot-*, with
their outputs in a temporary directory. Also: the console script works from anywhere, and `doctor` without
torch is one line."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_core.config import visible_gpu_count

ROOT = Path(__file__).resolve().parents[1]
CLI = "megatron-recipes"

# megatron-recipes/invoke commands run here as printed, but for codeparrot-* -> smoke, placeholders filled in and
# --workdir set; in this order (each needs the one before), not the README's. Every other CLI command is parsed.
EXECUTED = [
    "recipes",
    "recipes --show codeparrot-small",
    "train --recipe codeparrot-tiny --set lr=1e-3 --set training.train_iters=100",
    "convert --recipe codeparrot-tiny",  # after a plain `train --recipe smoke` (the run it converts)
    "convert --load CKPT_DIR --save HF_DIR --format both --dtype bf16",
    "evaluate --model CKPT_DIR",  # no --workdir: the checkpoint's run finds its own data, from another directory
    "import-hf --model HF_DIR --save CKPT_DIR --tp 2 --pp 2",
    "pipeline --recipe codeparrot-tiny",  # after train and convert: only the evaluation is left
    "doctor",
]
# CLI commands only parsed (task, flags and their types) and their recipe resolved with its --set values and
# layout, why they do not run here.
PARSED_ONLY = {
    "train --recipe codeparrot-tiny --nproc 2 --set pipeline_model_parallel_size=2 --load": "2 gloo ranks: "
    "tests/test_tasks.py::test_readme_nproc_form_trains_and_resumes_under_another_layout runs it",
    "train --recipe codeparrot-tiny --nproc 2 --set tensor_model_parallel_size=2": "the same test runs it",
    "train --recipe codeparrot-small-8gpu": "8 or 16 GPUs",
    "docker.build": "needs a Docker engine: its --dry-run runs below",
    "docker.run": "needs a Docker engine and GPUs: its --dry-run runs below",
    "bench.": "minutes of benchmark (bench.kernels needs CUDA); tests/test_bench_*.py run their code",
}
# Commands that are not the CLI: how each is checked.
OTHER = {
    ". .venv/bin/activate": "the venv's activate script and megatron-recipes sit next to this Python",
    "bash ": "the script exists and `bash -n` parses it (bootstrap, CI, GPU speed: set-up or a GPU)",
    "sbatch ": "SLURM: the batch script parses (bash -n) and its recipe resolves",
    "docker run ": "equals `megatron-recipes docker.run --dry-run` for the same recipe",
    "python -m bench.": "needs the GPU or minutes: argparse takes the printed flags (`--help` appended)",
}


def readme_commands() -> list[str]:
    """The commands of the README's ```bash blocks, continuation lines joined, comments dropped, `a && b` as
    two commands."""
    text = (ROOT / "README.md").read_text()
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            words = shlex.split(line, comments=True)
            while words:
                cut = words.index("&&") if "&&" in words else len(words)
                commands.append(" ".join(words[:cut]))
                words = words[cut + 1 :]
    return commands


def cli_args(command: str) -> list[str] | None:
    """The task part of a `megatron-recipes ...` or `invoke ...` command; None for other commands."""
    words = command.split()
    return words[1:] if Path(words[0]).name in (CLI, "invoke") else None  # .venv/bin/megatron-recipes too


def console_script() -> Path:
    script = Path(sys.executable).parent / CLI
    assert script.is_file(), f"{script} is missing: `pip install -e .` installs the console script"
    return script


def run_cli(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(console_script()), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, (
        f"{CLI} {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-1500:]}\n{proc.stderr[-2000:]}"
    )
    return proc


def parse_only(args: list[str]) -> list[tuple[str, dict]]:
    """Parse ARGS as the console script does, executing nothing: [(task name, its keyword arguments)]."""
    from invoke import Executor, Program

    from megatron_core import cli

    calls = []

    class Recorder(Executor):
        def execute(self, *tasks):
            calls.extend((ctx.name, ctx.as_kwargs) for ctx in tasks)

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            Program(namespace=cli.ns, name=CLI, binary=CLI, executor_class=Recorder).run([CLI, *args])
        except SystemExit as exc:
            pytest.fail(f"`{CLI} {' '.join(args)}` does not parse (exit {exc.code}): {err.getvalue().strip()}")
    assert calls, args
    return calls


def check_recipe_values(name: str, kwargs: dict) -> None:
    """The recipe, its --set values and (for train) the layout of --nproc/--nnodes resolve as the task resolves
    them, without running anything."""
    from megatron_core import cli, config

    if name == "train":
        cli._launch_recipe(kwargs["recipe"], kwargs["set_"], int(kwargs["nproc"]), int(kwargs["nnodes"]))
    elif kwargs.get("recipe"):
        config.load_recipe(kwargs["recipe"], list(kwargs.get("set_") or []))


@pytest.mark.slow
def test_every_readme_command_runs_or_parses(tmp_path):
    commands = readme_commands()
    assert len(commands) >= 20, commands
    elsewhere = tmp_path / "elsewhere"  # outside the checkout: the console script runs from anywhere
    elsewhere.mkdir()
    work = tmp_path / "work"
    cli_commands = [" ".join(args) for c in commands if (args := cli_args(c)) is not None]
    for form in EXECUTED:
        assert form in cli_commands, f"README no longer prints `{CLI} {form}`: update EXECUTED"

    # Parsed only: everything but the executed forms.
    for command in cli_commands:
        if command in EXECUTED:
            continue
        assert any(command.startswith(prefix) for prefix in PARSED_ONLY), (
            f"`{CLI} {command}` is neither run nor listed with a reason in PARSED_ONLY"
        )
        for name, kwargs in parse_only(shlex.split(command)):
            check_recipe_values(name, kwargs)

    # Executed, in dependency order, from another directory.
    from megatron_core import workflow
    from megatron_core.config import load_recipe

    run = workflow.run_dir(load_recipe("smoke"), work)
    places = {"CKPT_DIR": str(run / "checkpoints"), "HF_DIR": str(tmp_path / "hf-bf16")}
    outputs = {}
    run_cli(["train", "--recipe", "smoke", "--workdir", str(work)], elsewhere)  # what `convert --recipe` converts
    for form in EXECUTED:
        args = ["smoke" if a.startswith("codeparrot-tiny") else places.get(a, a) for a in shlex.split(form)]
        # smoke's own lr is 1e-3: another value keeps this a run of its own, as the README's is beside
        # codeparrot-tiny's (lr 5e-3), instead of extending the plain smoke run to 100 iterations
        args = ["lr=2e-3" if a == "lr=1e-3" else a for a in args]
        if form.startswith("import-hf"):
            args[args.index("--save") + 1] = str(tmp_path / "imported")
        if takes_workdir(args[0]) and not form.startswith("evaluate --model"):
            args += ["--workdir", str(work)]
        outputs[form] = run_cli(args, elsewhere).stdout
    assert "smoke " in outputs["recipes"] and "codeparrot-small-8gpu" in outputs["recipes"]
    assert "train: finished at iteration 100" in outputs[EXECUTED[2]]
    assert (tmp_path / "hf-bf16" / "model.safetensors").is_file() and (tmp_path / "imported").is_dir()
    assert (run / "checkpoints-eval" / "evaluation.json").is_file()  # evaluate --model wrote beside the model
    assert "valid_loss" in outputs["pipeline --recipe codeparrot-tiny"]
    assert not (elsewhere / "work").exists()  # nothing landed in the current directory with --workdir given

    # The other commands.
    for command in commands:
        if cli_args(command) is not None:
            continue
        kind = next((prefix for prefix in OTHER if command.startswith(prefix)), None)
        assert kind, f"README command `{command}` is not checked: classify it in OTHER"
        words = shlex.split(command)
        if kind == ". .venv/bin/activate":
            assert (Path(sys.executable).parent / "activate").is_file() and console_script().is_file()
        elif kind in ("bash ", "sbatch "):
            script = next(ROOT / w for w in words[1:] if (ROOT / w).is_file())
            assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, script
            if kind == "sbatch ":
                load_recipe(words[-1])
        elif kind == "docker run ":
            recipe = command.split()[command.split().index("--recipe") + 1]
            printed = run_cli(["docker.run", "--recipe", recipe, "--dry-run"], elsewhere).stdout.split()
            expected = (
                command.replace("$(id -u)", str(os.getuid()))
                .replace("$(id -g)", str(os.getgid()))
                .replace("$PWD", str(elsewhere))
                .replace("~/", f"{Path.home()}/")
                .split()
            )
            assert printed == expected, (printed, expected)
        else:  # python -m bench.X: from the checkout, which holds bench/
            proc = subprocess.run([sys.executable, *words[1:], "--help"], cwd=ROOT, capture_output=True, text=True)
            assert proc.returncode == 0 and "usage:" in proc.stdout, (command, proc.stderr[-1500:])
    run_cli(["docker.build", "--dry-run"], elsewhere)


def takes_workdir(task: str) -> bool:
    import inspect

    from megatron_core import cli

    return "workdir" in inspect.signature(cli.ns[task].body).parameters


def test_the_console_script_runs_from_another_directory(tmp_path):
    """Recipe names, the relative default --workdir (the current directory's ./work) and the checkout's bench/
    resolve wherever `megatron-recipes` runs."""
    listed = run_cli(["recipes"], tmp_path)
    assert listed.stdout.startswith("name ") and "\nsmoke " in listed.stdout
    made = run_cli(["preprocess", "--recipe", "smoke"], tmp_path)
    prefix = Path(made.stdout.strip().splitlines()[-1])
    assert not prefix.is_absolute() and (tmp_path / prefix).with_suffix(".idx").is_file()  # under ./work here
    if visible_gpu_count() == 0:  # on a GPU it would measure (and write results)
        bench = run_cli(["bench.kernels"], tmp_path)  # imports the checkout's bench/: a skip on a CPU
        assert bench.stdout.strip().splitlines()[-1] == '{"skipped": "needs a CUDA GPU"}'


def test_doctor_without_torch_is_one_line(tmp_path):
    code = (
        "import sys; sys.modules['torch'] = None\n"  # `import torch` fails as where it is not installed
        "from megatron_core.cli import program; program.run(['megatron-recipes', 'doctor'])"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-1500:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: torch does not import") and "bootstrap" in lines[0]
