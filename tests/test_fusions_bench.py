"""bench.kernels on a machine without a CUDA GPU: it says so, measures nothing and exits 0."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only path; a GPU machine runs the real benchmark")
def test_kernels_benchmark_skips_cleanly_without_a_gpu():
    from bench.kernels import run

    assert run() == {"skipped": "needs a CUDA GPU"}
    result = subprocess.run(
        [sys.executable, "-m", "bench.kernels"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert "needs a CUDA GPU" in lines[0]
    assert json.loads(lines[-1]) == {"skipped": "needs a CUDA GPU"}


@pytest.mark.slow
def test_kernels_benchmark_runs_its_whole_flow_through_the_interpreter(tmp_path):
    """--device cpu runs what a GPU run does (check each fusion against torch, time both backends forward and
    forward+backward, write the JSON) through Triton's interpreter at tiny shapes; device times are CUDA-only."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.kernels",
            "--device",
            "cpu",
            "--dtype",
            "fp32",
            "--tokens",
            "32",
            "--vocab",
            "64",
            "--heads",
            "2",
            "--seq",
            "8",
            "--iters",
            "1",
            "--copy-megabytes",
            "1",
            "--results-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    printed = json.loads(result.stdout.strip().splitlines()[-1])
    written = json.loads(Path(printed["results_file"]).read_text())
    assert Path(printed["results_file"]).parent == tmp_path
    assert set(written["fusions"]) == {"softmax", "cross_entropy"}
    for name, entry in written["fusions"].items():
        assert entry["check_rel_error"] < 1e-5, name
        for phase in ("fwd", "fwd_bwd"):
            figures = entry[phase]
            assert figures["triton_ms"] > 0 and figures["torch_ms"] > 0, (name, phase)
            assert figures["triton_device_ms"] is None and figures["launch_bound"] is None


def test_kernels_benchmark_refuses_triton_on_a_cpu_without_the_interpreter():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "bench.kernels", "--device", "cpu", "--tokens", "8", "--seq", "8"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: ") and "TRITON_INTERPRET=1" in result.stderr
