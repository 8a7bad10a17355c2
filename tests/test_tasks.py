"""The invoke tasks themselves, as a user types them: the smoke recipe through `invoke pipeline`
(train -> convert -> evaluate), `import-hf`, the golden check, and the machine/container/bench tasks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def invoke(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "invoke", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.fixture(scope="module")
def smoke_pipeline(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("tasks-work")
    proc = invoke("pipeline", "--recipe", "smoke", "--workdir", str(workdir))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    runs = list((workdir / "smoke" / "runs").iterdir())
    assert len(runs) == 1
    return workdir, runs[0], proc


def test_pipeline_trains_converts_and_evaluates(smoke_pipeline):
    _, run, proc = smoke_pipeline
    assert f"run directory: {run}" in proc.stdout
    config = json.loads((run / "hf" / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["n_layer"] == 2
    results = json.loads((run / "eval" / "evaluation.json").read_text())
    assert set(results["perplexity"]) == {"valid", "test"}
    # evaluate's summary, then a pointer line
    summary = json.loads(proc.stdout[proc.stdout.rindex("{") : proc.stdout.rindex("}") + 1])
    assert summary["valid_ppl"] == pytest.approx(results["perplexity"]["valid"]["ppl"])
    assert (run / "loss_curve.png").stat().st_size > 0


def test_pipeline_reconverts_a_stale_model_and_refuses_humaneval_without_consent(smoke_pipeline, tmp_path):
    workdir, run, _ = smoke_pipeline
    provenance = run / "hf" / "provenance.json"
    stale = json.loads(provenance.read_text())
    stale["iteration"] = 10  # as if converted before the last 10 iterations were trained
    provenance.write_text(json.dumps(stale))
    again = invoke("pipeline", "--recipe", "smoke", "--workdir", str(workdir))
    assert again.returncode == 0, again.stderr[-1500:]
    assert json.loads(provenance.read_text())["iteration"] == 20
    refused = invoke("pipeline", "--recipe", "codeparrot-small-1gpu", "--workdir", str(tmp_path))
    assert refused.returncode == 2 and "add --allow-code-execution" in refused.stderr
    assert not any(tmp_path.iterdir())  # refused before any step ran


def test_golden_task_checks_the_run(smoke_pipeline):
    workdir, _, _ = smoke_pipeline
    proc = invoke("ci.golden", "--recipe", "smoke", "--workdir", str(workdir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("golden smoke: 13/13 values within")


def test_convert_refuses_an_occupied_target_and_import_hf_round_trips(smoke_pipeline, tmp_path):
    workdir, run, _ = smoke_pipeline
    again = invoke("convert", "--recipe", "smoke", "--workdir", str(workdir))
    assert again.returncode == 2 and again.stderr.strip().startswith("error:")
    assert "--overwrite" in again.stderr and len(again.stderr.strip().splitlines()) == 1
    older = invoke(
        "convert",
        "--recipe",
        "smoke",
        "--workdir",
        str(workdir),
        "--iteration",
        "10",
        "--save",
        str(tmp_path / "hf10"),
        "--format",
        "bin",
        "--dtype",
        "fp16",
    )
    assert older.returncode == 0, older.stderr
    assert json.loads((tmp_path / "hf10" / "provenance.json").read_text())["iteration"] == 10
    assert (tmp_path / "hf10" / "pytorch_model.bin").exists()
    imported = invoke("import-hf", "--model", str(run / "hf"), "--save", str(tmp_path / "ckpt"), "--tp", "2")
    assert imported.returncode == 0, imported.stderr
    assert sorted(p.name for p in (tmp_path / "ckpt" / "release").iterdir()) == [
        "manifest.json",
        "mp_rank_00",
        "mp_rank_01",
    ]


def test_a_checkpoint_directory_converts_and_evaluates_on_its_own(smoke_pipeline, tmp_path):
    """The checkpoint directory carries the tokenizer and the recipe: a copy of it, moved elsewhere,
    converts and evaluates from another working directory with only --load / --model."""
    import shutil

    workdir, run, _ = smoke_pipeline
    moved = Path(shutil.copytree(run / "checkpoints", tmp_path / "moved"))
    assert {"vocab.json", "merges.txt", "recipe.yaml"} <= {p.name for p in moved.iterdir()}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def invoke_from_elsewhere(*args):
        return subprocess.run(
            [sys.executable, "-m", "invoke", "-r", str(ROOT), *args],
            cwd=elsewhere,
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )

    converted = invoke_from_elsewhere("convert", "--load", str(moved), "--save", str(tmp_path / "hf"))
    assert converted.returncode == 0, converted.stdout[-1500:] + converted.stderr[-1500:]
    assert f"tokenizer from the checkpoint directory: {moved / 'vocab.json'}" in converted.stdout
    assert (tmp_path / "hf" / "vocab.json").read_bytes() == (moved / "vocab.json").read_bytes()
    evaluated = invoke_from_elsewhere("evaluate", "--model", str(moved), "--workdir", str(workdir))
    assert evaluated.returncode == 0, evaluated.stdout[-1500:] + evaluated.stderr[-1500:]
    assert evaluated.stdout.startswith("recipe: smoke ") and "valid_ppl" in evaluated.stdout


def test_training_continues_from_an_imported_hf_model(smoke_pipeline, tmp_path):
    """import-hf writes a weights-only (`release`) checkpoint; `invoke train --load` starts from those
    weights with a fresh optimizer, the way Megatron-LM starts from a release checkpoint."""
    workdir, run, _ = smoke_pipeline
    ckpt = tmp_path / "imported"
    assert invoke("import-hf", "--model", str(run / "hf"), "--save", str(ckpt)).returncode == 0
    # into the finished run's own directory it is refused: two runs' checkpoints would mix there
    refused = invoke(
        "train", "--recipe", "smoke", "--workdir", str(workdir), "--set", "train_iters=4", "--load", str(ckpt)
    )
    assert refused.returncode == 2 and "already holds checkpoints" in refused.stderr, refused.stderr[-1500:]
    proc = invoke(
        "train",
        "--recipe",
        "smoke",
        "--workdir",
        str(workdir),
        "--set",
        "train_iters=4",
        "--set",
        "save_interval=null",
        "--set",
        "seed=7",
        "--load",
        str(ckpt),
    )
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-1500:]
    assert f"initialized the model from the weights in {ckpt / 'release'}" in proc.stdout + proc.stderr
    trained = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    continued_run = next(p for p in (workdir / "smoke" / "runs").iterdir() if p != run)
    continued = [json.loads(line) for line in (continued_run / "metrics.jsonl").read_text().splitlines()]
    first_trained = next(m["lm_loss"] for m in trained if m["type"] == "train")
    last_trained = [m["lm_loss"] for m in trained if m["type"] == "train"][-1]
    first_continued = next(m["lm_loss"] for m in continued if m["type"] == "train")
    assert first_continued < first_trained - 0.2 and abs(first_continued - last_trained) < 0.2


def test_launch_splits_the_recipe_world_over_nodes_and_names_the_run_it_starts(monkeypatch, tmp_path):
    from megatron_core import cli, config, workflow

    monkeypatch.setattr(workflow, "tokenizer_files", lambda _r, _w: (Path("v.json"), Path("m.txt")))
    monkeypatch.setattr(workflow, "data_prefixes", lambda _r, _w: ["data/prefix"])

    def launched(nproc, nnodes, set_=()):
        r, overrides, per_node = cli._launch_recipe("codeparrot-small-8gpu", list(set_), nproc, nnodes)
        cmd = cli._train_command(r, overrides, per_node, nnodes, 0, "node0", 29500, None, None, False, tmp_path)
        return r, cmd

    r, cmd = launched(0, 1)  # the recipe's 8 processes on one node
    assert "--nproc-per-node=8" in cmd and cmd[cmd.index("--run-dir") + 1] == str(workflow.run_dir(r, tmp_path))
    r, cmd = launched(8, 2)  # --nproc 8 on two nodes: a world of 16, in the run's name and the processes' recipe
    assert r.parallel.world_size == 16 and "--nproc-per-node=8" in cmd and "--nnodes=2" in cmd
    assert cmd[cmd.index("--run-dir") + 1] == str(workflow.run_dir(r, tmp_path))
    assert "parallel.world_size=16" in cmd
    same, same_cmd = launched(0, 2, ["world_size=16"])  # --set world_size=16 says the same
    assert "--nproc-per-node=8" in same_cmd and same.stage_hash("train") == r.stage_hash("train")
    # --nproc sets the world before the layout is validated, so layout flags beside it work ...
    r, cmd = launched(2, 1, ["tensor_model_parallel_size=2"])
    assert (r.parallel.world_size, r.parallel.tensor_model_parallel_size) == (2, 2) and "--nproc-per-node=2" in cmd
    # ... and a layout the model cannot take names the numbers
    with pytest.raises(config.UserError, match="num_attention_heads 12 is not divisible by TP 5"):
        launched(5, 1, ["tensor_model_parallel_size=5"])


def test_docker_tasks_dry_run(tmp_path):
    build = invoke("docker.build", "--dry-run", "--tag", "img:t")
    assert build.returncode == 0 and build.stdout.startswith("docker build -f docker/Dockerfile --build-arg NGC_TAG=")
    run = invoke(
        "docker.run",
        "--dry-run",
        "--recipe",
        "codeparrot-small-8gpu",
        "--image",
        "img:t",
        "--workdir",
        str(tmp_path / "w"),
        "--cache",
        str(tmp_path / "c"),
        "--nnodes",
        "2",
        "--master-addr",
        "node0",
        "--set",
        "lr=1e-4",
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == (
        "docker run --rm --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 "
        f"--user {os.getuid()}:{os.getgid()} --network=host "
        f"-v {tmp_path / 'w'}:/work -v {tmp_path / 'c'}:/cache img:t invoke train --recipe codeparrot-small-8gpu "
        "--set lr=1e-4 --nnodes 2 --node-rank 0 --master-addr node0"
    )
    assert not (tmp_path / "w").exists()  # a dry run creates nothing
    bad = invoke("docker.run", "--dry-run", "--recipe", "no-such-recipe")
    assert bad.returncode == 2 and bad.stderr.startswith("error:")


def test_doctor_task_reports_json():
    doctor = invoke("doctor", "--json")
    assert doctor.returncode == 0 and "torch" in json.loads(doctor.stdout)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU path; a GPU runs the real benchmark")
def test_kernel_bench_task_says_it_needs_a_gpu():
    kernels = invoke("bench.kernels")
    assert kernels.returncode == 0
    assert json.loads(kernels.stdout.strip().splitlines()[-1]) == {"skipped": "needs a CUDA GPU"}


@pytest.mark.slow
def test_readme_nproc_form_trains_and_resumes_under_another_layout(smoke_pipeline):
    """The README's `invoke train --nproc 2 --set tensor_model_parallel_size=2` (on the smoke recipe, whose
    data the pipeline built), then its resume as PP 2 with --load, the README's next form."""
    import shutil

    workdir, _, _ = smoke_pipeline
    readme = (ROOT / "README.md").read_text()
    assert "megatron-recipes train --recipe codeparrot-tiny --nproc 2 --set tensor_model_parallel_size=2\n" in readme
    assert "--nproc 2 --set pipeline_model_parallel_size=2 --load " in readme
    tp2 = invoke(
        "train", "--recipe", "smoke", "--workdir", str(workdir), "--nproc", "2", "--set", "tensor_model_parallel_size=2"
    )
    assert tp2.returncode == 0, tp2.stdout[-1500:] + tp2.stderr[-1500:]
    tp2_run = Path(tp2.stdout.strip().splitlines()[-1].removeprefix("run directory: "))
    pp2 = invoke(
        "train",
        "--recipe",
        "smoke",
        "--workdir",
        str(workdir),
        "--nproc",
        "2",
        "--set",
        "pipeline_model_parallel_size=2",
        "--set",
        "train_iters=24",
        "--load",
        str(tp2_run / "checkpoints"),
    )
    assert pp2.returncode == 0, pp2.stdout[-1500:] + pp2.stderr[-1500:]
    pp2_run = Path(pp2.stdout.strip().splitlines()[-1].removeprefix("run directory: "))
    try:
        assert f"resumed from {tp2_run / 'checkpoints' / 'iter_0000020'} at iteration 20" in pp2.stdout + pp2.stderr
        trained = [json.loads(line) for line in (pp2_run / "metrics.jsonl").read_text().splitlines()]
        assert [m["iteration"] for m in trained if m["type"] == "train"] == [22, 24]
    finally:  # other tests look for the pipeline's run among the recipe's runs
        shutil.rmtree(tp2_run)
        shutil.rmtree(pp2_run)
