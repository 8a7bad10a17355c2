"""bench.drift: two runs from the same weights (reference fusions torch, candidate another backend), compared
tensor by tensor after the training steps and forward-only on the next step's batches, weights x fusions."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.drift import compare_tensors

ROOT = Path(__file__).resolve().parents[1]


def test_compare_tensors_ranks_by_difference_relative_to_the_reference():
    reference = {"a": torch.tensor([1.0, -4.0]), "b": torch.tensor([0.5, 0.5]), "empty": torch.zeros(0)}
    candidate = {"a": torch.tensor([1.0, -4.2]), "b": torch.tensor([0.5, 0.6]), "empty": torch.zeros(0)}
    rows = compare_tensors(reference, candidate)
    assert [row["tensor"] for row in rows] == ["b", "a", "empty"]
    assert rows[0]["max_abs_diff"] == pytest.approx(0.1) and rows[0]["relative"] == pytest.approx(0.2)
    assert rows[1]["relative"] == pytest.approx(0.05)
    with pytest.raises(RuntimeError, match="different tensors"):
        compare_tensors(reference, {"a": candidate["a"]})


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("drift-work")


def test_the_reference_against_itself_agrees_to_the_bit(workdir):
    """torch against torch: the same seed, weights and batches give bitwise the same run on a CPU, so any
    difference the tool reports between two backends comes from the backends."""
    import bench.drift as drift

    result = drift.run("smoke", [], str(workdir), fusions="torch", steps=2, echo=lambda _: None)
    assert result["losses"]["reference"] == result["losses"]["candidate"]
    assert result["forward_gap"] == result["update_gap"] == 0.0 and result["verdict"] == "the two runs agree"
    assert {row["max_abs_diff"] for row in result["tensors"]} == {0.0}
    assert set(result["largest_relative_difference_by_kind"]) == {"param", "exp_avg", "exp_avg_sq"}  # fp32: no masters
    assert len(result["next_step_forward_losses"]) == 4


@pytest.mark.slow
def test_triton_candidate_in_the_interpreter_matches_torch_in_fp32(workdir, tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.drift",
            "--recipe",
            "smoke",
            "--workdir",
            str(workdir),
            "--fusions",
            "triton",
            "--results-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    printed = json.loads(result.stdout.strip().splitlines()[-1])
    assert json.loads(Path(printed["results_file"]).read_text())["verdict"] == printed["verdict"]
    assert printed["candidate_fusions"] == "triton" and printed["steps"] == 2
    # fp32 kernels against fp32 references: far below the 1e-3 drift this tool was written to explain
    assert printed["forward_gap"] < 1e-5 and printed["update_gap"] < 1e-5, printed["verdict"]
    assert max(abs(a - b) / b for a, b in zip(*printed["losses"].values())) < 1e-5
