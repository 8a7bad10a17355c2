"""bench.kernels on a machine without a CUDA GPU: it says so, measures nothing and exits 0."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only path; a GPU machine runs the real benchmark")
def test_kernels_benchmark_skips_cleanly_without_a_gpu():
    from bench.kernels import run

    assert run() == {"skipped": "needs a CUDA GPU"}
    result = subprocess.run([sys.executable, "-m", "bench.kernels"], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert "needs a CUDA GPU" in lines[0]
    assert json.loads(lines[-1]) == {"skipped": "needs a CUDA GPU"}
