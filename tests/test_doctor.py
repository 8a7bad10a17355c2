"""`invoke doctor`: the environment report runs on this CPU machine and says what a missing piece disables."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch

from megatron_core import doctor

CPU_LINE = ("CUDA: not available -> fused Triton kernels, Apex and NCCL disabled; "
            "training runs on CPU with gloo")


@pytest.fixture(scope="module")
def here() -> dict:
    return doctor.report()


def test_report_describes_this_machine(here):
    assert here["torch"]["version"] == torch.__version__
    assert here["cuda"]["available"] == torch.cuda.is_available()
    assert here["nccl"]["gloo"] is True
    assert set(here["apex"]["modules"]) == {"apex", "amp_C", "fused_layer_norm_cuda", "apex.optimizers.FusedAdam"}
    json.dumps(here)  # the --json form must be serializable


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU message is for machines without CUDA")
def test_cpu_machine_says_what_is_disabled(here):
    assert here["consequences"][0] == CPU_LINE
    text = doctor.format_report(here)
    assert "\nCUDA              not available\n" in text
    assert CPU_LINE in text
    assert f"torch             {torch.__version__}" in text


def _gpu_report(base: dict, apex_ok: bool, nccl: bool = True, triton: str | None = "3.4.0") -> dict:
    r = copy.deepcopy(base)
    r["cuda"].update(available=True, cudnn=91000,
                     devices=[{"name": "NVIDIA H100 80GB HBM3", "capability": "9.0", "memory_gib": 79.1}])
    r["nccl"].update(built=True, available=nccl, version="2.27.7" if nccl else None)
    r["apex"]["modules"] = {name: apex_ok for name in r["apex"]["modules"]}
    r["apex"]["usable"] = apex_ok
    r["triton"].update(version=triton, runs_on="cuda" if triton else None)
    r["consequences"] = doctor.consequences(r)
    return r


def test_complete_gpu_node_reports_nothing_missing(here):
    r = _gpu_report(here, apex_ok=True)
    assert not any(line.startswith(("CUDA", "Apex", "NCCL", "Triton")) for line in r["consequences"])
    text = doctor.format_report(r)
    assert "1 device(s): NVIDIA H100 80GB HBM3 (sm 9.0, 79.1 GiB)" in text
    assert "NCCL              2.27.7" in text


def test_gpu_node_without_apex_nccl_triton_names_each(here):
    lines = _gpu_report(here, apex_ok=False, nccl=False, triton=None)["consequences"]
    assert any(line.startswith("Apex: apex, amp_C, fused_layer_norm_cuda, apex.optimizers.FusedAdam missing ->")
               for line in lines)
    assert any(line.startswith("NCCL: not available ->") for line in lines)
    assert any(line.startswith("Triton: not installed ->") for line in lines)
    assert CPU_LINE not in lines


def test_require_fails_with_the_missing_names(here, capsys):
    r = _gpu_report(here, apex_ok=False)
    with pytest.raises(doctor.UserError, match="required but missing here: apex;"):
        doctor.check_requirements(r, ["cuda", "apex", "nccl"])
    doctor.check_requirements(r, ["cuda", "nccl", "triton"])  # all present: no error
    with pytest.raises(doctor.UserError, match="unknown pieces"):
        doctor.check_requirements(r, ["cudaa"])


def test_cli_json_and_exit_codes(capsys):
    assert doctor.main(["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["torch"]["version"] == torch.__version__
    if not torch.cuda.is_available():
        assert doctor.main(["--require", "cuda"]) == 2
        assert "error: required but missing here: cuda" in capsys.readouterr().err


def test_module_runs_as_a_program():
    result = subprocess.run([sys.executable, "-m", "megatron_core.doctor"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0].startswith("python ")
