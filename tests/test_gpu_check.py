"""bench/gpu_check.py, the one device call that proves the GPU path, run here on the CPU (DEVICE=cpu), where
its CUDA-only parts say skipped: so the script cannot rot between device loans."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import collective_shim

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_every_part_runs_on_the_cpu_and_writes_the_summary(tmp_path):
    results = tmp_path / "results"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.gpu_check",
            "--device",
            "cpu",
            "--workdir",
            str(tmp_path / "work"),
            "--results-dir",
            str(results),
            "--time-scale",
            "3",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    summary_file = results / Path(json.loads(proc.stdout.splitlines()[-1])["results_file"]).name
    summary = json.loads(summary_file.read_text())
    assert summary["ok"] is True and summary["cuda"] is None and summary["torch"] == torch.__version__
    parts = {p["name"]: p for p in summary["parts"]}
    assert list(parts) == ["train-resume", "precision", "recompute", "layout-8-ranks", "evaluation", "kernels-rng"]
    assert all(p["ok"] for p in parts.values()), {n: p["detail"] for n, p in parts.items() if not p["ok"]}
    assert [name for name, p in parts.items() if p["skipped"]] == ["kernels-rng"]  # CUDA only
    # each part's own JSON beside the summary
    stamp = Path(summary_file).stem
    assert {p.name for p in results.glob(f"{stamp}-*.json")} == {f"{stamp}-{name}.json" for name in parts}

    resume = parts["train-resume"]["detail"]
    assert resume["noise_floor_rel"] == 0.0 and resume["resume_max_rel_diff"] <= 1e-5  # two fresh CPU runs agree
    assert sorted(map(int, resume["losses"]["resumed"])) == list(range(11, 21))
    precision = parts["precision"]["detail"]
    assert "skipped" in precision["fp16"] and len(precision["bf16"]["losses"]) == 20
    layout = parts["layout-8-ranks"]["detail"]
    assert layout["ranks_reporting"] == 8 and layout["max_rel_loss_diff"] <= 1e-4
    generation = parts["evaluation"]["detail"]["generation"]
    assert generation["greedy_check"]["ours"] == generation["greedy_check"]["transformers"]


def test_the_shim_refuses_a_tensor_on_the_wrong_device():
    with pytest.raises(AssertionError, match="all_reduce: a \\(3,\\) torch.float32 tensor on cpu, expected cuda"):
        collective_shim._check("all_reduce", [torch.zeros(3)], "cuda")
    collective_shim._check("all_reduce", [torch.zeros(3)], "cpu")  # the right device passes
