"""`invoke doctor`: the environment report runs on this CPU machine and says what a missing piece disables."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys

import pytest
import torch

from megatron_core import doctor

CPU_LINE = "CUDA: not available -> fused Triton kernels, Apex and NCCL disabled; training runs on CPU with gloo"


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
    r["cuda"].update(
        available=True,
        cudnn=91000,
        devices=[{"name": "NVIDIA H100 80GB HBM3", "capability": "9.0", "memory_gib": 79.1}],
    )
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
    assert any(
        line.startswith("Apex: apex, amp_C, fused_layer_norm_cuda, apex.optimizers.FusedAdam missing ->")
        for line in lines
    )
    assert any(line.startswith("NCCL: not available ->") for line in lines)
    assert any(line.startswith("Triton: not installed ->") for line in lines)
    assert CPU_LINE not in lines


def test_require_fails_with_the_missing_names(here):
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
    result = subprocess.run([sys.executable, "-m", "megatron_core.doctor"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0].startswith("python ")


# -- transformers: the range evaluation needs, the same in pyproject.toml and the doctor ------------


def _pyproject_requirement(name: str) -> str:
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    found = [d.replace(" ", "") for d in pyproject["project"]["dependencies"] if re.match(rf"{name}\b", d)]
    assert len(found) == 1, found
    return found[0][len(name) :]


def test_transformers_floor_is_one_constant():
    assert _pyproject_requirement("transformers") == doctor.TRANSFORMERS_REQUIREMENT == ">=5.24,<6"


@pytest.mark.parametrize(
    "version, ok",
    [
        ("5.23.0", False),
        ("5.24.0", True),
        ("5.25.0.dev0", True),
        ("5.30.1+local", True),
        ("4.57.6", False),
        ("6.0.0", False),
    ],
)
def test_transformers_range_bounds(version, ok):
    assert (doctor.TRANSFORMERS_FLOOR <= doctor.release(version) < doctor.TRANSFORMERS_BELOW) is ok


def test_too_old_transformers_is_named_with_the_fix(monkeypatch, capsys):
    real = doctor._distribution_version
    monkeypatch.setattr(
        doctor, "_distribution_version", lambda names: "4.57.1" if names == ("transformers",) else real(names)
    )
    assert doctor.main(["--require", "transformers"]) == 2
    captured = capsys.readouterr()
    assert "transformers      4.57.1 (needs >=5.24,<6: NOT SUPPORTED)" in captured.out
    assert "transformers: 4.57.1 is outside >=5.24,<6 -> evaluation and HumanEval generation fail" in captured.out
    assert "pip install 'transformers>=5.24,<6'" in captured.out
    assert "error: required but missing here: transformers;" in captured.err


def test_installed_transformers_has_what_evaluation_calls(tmp_path):
    """The names evaluate/generate.py and evaluate/runner.py use, on the installed transformers (5.23 lacks
    the first three): the KV cache passed as `cache=` and returned as `.cache`, `logits_to_keep`,
    Cache.batch_select_indices, and from_pretrained(dtype=...) loading in that dtype."""
    import dataclasses
    import inspect

    from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel
    from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

    assert doctor._transformers_section()["ok"], "the installed transformers is outside the required range"
    forward = inspect.signature(GPT2LMHeadModel.forward).parameters
    assert {"cache", "logits_to_keep", "attention_mask", "position_ids", "use_cache"} <= set(forward)
    assert "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithCrossAttentions)}
    assert callable(getattr(DynamicCache, "batch_select_indices", None))
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8)).save_pretrained(tmp_path)
    loaded = GPT2LMHeadModel.from_pretrained(str(tmp_path), dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
