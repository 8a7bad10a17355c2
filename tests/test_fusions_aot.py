"""`python -m megatron_core.fusions.aot` compiles the Triton kernels for a real GPU architecture on this
machine (no GPU needed: Triton's bundled ptxas makes the cubin and reports registers and spills).

CI compiles every kernel (softmax and cross entropy, forward and backward) for sm_90, all dtypes and both
shape sets (24 compiles), into a fresh Triton cache in a temporary directory. Run in subprocesses: compiling
needs triton imported without TRITON_INTERPRET, which must not leak into this pytest process.
(tests/test_fusions_triton.py checks that the launches the AOT records are the ones the ops make.)"""

import json
import os
import subprocess
import sys
import types

import pytest

from megatron_core.fusions import aot

EXPECTED_KERNELS = {"softmax_fwd", "softmax_bwd", "cross_entropy_fwd", "cross_entropy_bwd"}


def bundled_ptxas_problem() -> str | None:
    try:
        import importlib.util

        spec = importlib.util.find_spec("triton")
    except ImportError:
        spec = None
    if spec is None:
        return "triton is not installed"
    ptxas = os.path.join(os.path.dirname(spec.origin), "backends", "nvidia", "bin", "ptxas")
    return None if os.path.exists(ptxas) else f"this triton build has no bundled ptxas ({ptxas})"


needs_ptxas = pytest.mark.skipif(bundled_ptxas_problem() is not None, reason=str(bundled_ptxas_problem()))


def run_aot(args, cache_dir, **env_changes):
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(cache_dir), **env_changes)
    return subprocess.run(
        [sys.executable, "-m", "megatron_core.fusions.aot", *args], env=env, capture_output=True, text=True, timeout=600
    )


def progress_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("[")]


@needs_ptxas
def test_every_kernel_compiles_for_sm90_without_spills(tmp_path):
    result = run_aot(["--arch", "sm_90", "--json"], tmp_path / "triton-cache")
    assert result.returncode == 0, result.stderr[-6000:]
    entries = json.loads(result.stdout)
    assert len(entries) == 24 == len(progress_lines(result.stderr)), result.stderr[-3000:]
    for entry in entries:
        assert {"kernel", "arch", "dtype", "ok", "registers", "spills"} <= set(entry), entry
        assert entry["ok"] and entry["spills"] == 0 and entry["arch"] == "sm_90", entry
        assert 0 < entry["registers"] <= 255, entry
    for dtype in ("fp32", "fp16", "bf16"):
        for shapes in ("codeparrot-small", "awkward"):
            compiled = {e["kernel"] for e in entries if e["dtype"] == dtype and e["shapes"] == shapes}
            assert compiled == EXPECTED_KERNELS, (dtype, shapes, compiled ^ EXPECTED_KERNELS)
    # The block sizes are the launchers' own: CodeParrot-small's seq 1024 softmax rows, the awkward seq 37 ones.
    softmax = {e["shapes"]: e["constexprs"] for e in entries if e["kernel"] == "softmax_fwd" and e["dtype"] == "bf16"}
    assert softmax == {"codeparrot-small": {"BLOCK_M": 4, "BLOCK_N": 1024}, "awkward": {"BLOCK_M": 64, "BLOCK_N": 64}}

    # Again from the cache: the figures come back from the ptxas report stored beside each cubin, and when a
    # cached kernel has none (cached by a plain launch) it is compiled once more to get one.
    first = {
        (e["kernel"], e["shapes"]): e["registers"]
        for e in entries
        if e["dtype"] == "bf16" and e["kernel"].startswith("softmax")
    }
    for drop_reports in (False, True):
        if drop_reports:
            reports = list((tmp_path / "triton-cache").rglob("ptxas-v.log"))
            assert len(reports) >= 24 // 2, len(reports)  # identical specialisations share one cache entry
            for report in reports:
                report.unlink()
        again = run_aot(
            ["--arch", "sm_90", "--json", "--fusions", "softmax", "--dtypes", "bf16"], tmp_path / "triton-cache"
        )
        assert again.returncode == 0, again.stderr[-3000:]
        assert {(e["kernel"], e["shapes"]): e["registers"] for e in json.loads(again.stdout)} == first


def test_the_interpreter_is_refused(tmp_path):
    result = run_aot(["--arch", "sm_90", "--fusions", "softmax"], tmp_path, TRITON_INTERPRET="1")
    assert result.returncode == 2 and "TRITON_INTERPRET=1" in result.stderr, result.stderr[-2000:]


def test_unknown_architectures_are_refused():
    with pytest.raises(aot.UserError, match="sm_80, sm_90"):
        aot.parse_arch("sm_75")
    assert aot.parse_arch("sm_90a") == 90 and aot.parse_arch("sm80") == 80


SPILLING_REPORT = """ptxas info    : Compiling entry function '_k' for 'sm_80'
ptxas info    : Function properties for _k
    24 bytes stack frame, 16 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 24 bytes cumulative stack size
"""


def test_ptxas_report_is_read():
    assert aot.ptxas_figures(SPILLING_REPORT) == {"registers": 64, "spills": 16, "spill_loads": 16, "stack_bytes": 24}
    with pytest.raises(RuntimeError, match="could not read"):
        aot.ptxas_figures("ptxas info    : 0 bytes gmem")


def test_a_spill_or_a_compile_error_fails_the_run(monkeypatch, capsys):
    """The verdict alone, with the compiler replaced: one kernel spills, one fails, one is fine."""
    launches = [
        (label, types.SimpleNamespace(name=f"_{label}_kernel", num_warps=4, constexprs={"BLOCK": 64}))
        for label in ("spills", "breaks", "fine")
    ]
    monkeypatch.setattr(aot, "recorded_launches", lambda _fusion, _shapes, _dtype: launches)

    def fake_compile(launch, _capability):
        if launch.name == "_breaks_kernel":
            raise RuntimeError("PTXASError: ptxas failed")
        return None, SPILLING_REPORT.replace(
            "16 bytes spill stores", "0 bytes spill stores"
        ) if launch.name == "_fine_kernel" else SPILLING_REPORT

    monkeypatch.setattr(aot, "compile_launch", fake_compile)
    # test_fusions_triton sets TRITON_INTERPRET=1 in this process when collected alongside; nothing is compiled here
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert (
        aot.main(["--arch", "sm_80", "--json", "--dtypes", "bf16", "--shapes", "awkward", "--fusions", "softmax"]) == 1
    )
    out = capsys.readouterr()
    verdicts = {entry["kernel"]: (entry["ok"], entry["spills"]) for entry in json.loads(out.out)}
    assert verdicts == {"spills": (False, 16), "breaks": (False, None), "fine": (True, 0)}
    assert len(progress_lines(out.err)) == 3 and "FAILED" in out.err
