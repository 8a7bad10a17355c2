"""One list of CI steps (issue 35): .ci/run, the GitHub workflow's CPU job and the README's test command all
run ci/check.sh; the smoke recipe under TP 2 x PP 2 (4 gloo ranks) goes end to end with its golden losses
here, in the test suite, so no CI step is left outside it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_every_entry_point_runs_the_one_script():
    assert "ci/check.sh" in (ROOT / ".ci" / "run").read_text()
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "ci.yml").read_text())
    runs = [step["run"].strip() for step in workflow["jobs"]["cpu"]["steps"] if "run" in step]
    assert runs == ["bash ci/check.sh"]
    readme = (ROOT / "README.md").read_text()
    first_block = readme.split("```bash\n", 1)[1].split("```", 1)[0]  # the two set-up commands at the top
    assert [line.split("#")[0].strip() for line in first_block.splitlines()][1] == "bash .ci/run"


def test_bootstrap_refuses_an_unknown_argument_before_touching_anything(tmp_path):
    proc = subprocess.run(
        ["bash", str(ROOT / "ci" / "bootstrap.sh"), "--tests"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "PYTHON": str(tmp_path / "no-python")},
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: unknown argument '--tests'; usage: bash ci/bootstrap.sh [--test]"


@pytest.mark.slow
def test_smoke_tp2pp2_end_to_end_matches_its_golden(tmp_path):
    venv_bin = Path(sys.executable).parent  # smoke.sh calls invoke and python from the venv
    env = {**os.environ, "WORKDIR": str(tmp_path), "PATH": f"{venv_bin}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(
        ["bash", str(ROOT / "ci" / "smoke.sh"), "smoke-tp2pp2"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "golden smoke-tp2pp2: " in proc.stdout and "values within" in proc.stdout
    assert "hf load ok" in proc.stdout + proc.stderr
    assert (tmp_path / "smoke-tp2pp2").is_dir()
