"""A run meets a second process and signals: the run lock, and Ctrl-C / SIGTERM through `invoke train`.

Each fault is injected into real processes and judged by what is on disk: the checkpoint at the iteration
the trainer stopped, metrics.jsonl without a second copy of any iteration, no trainer left running."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from distributed_utils import free_port

from megatron_core import workflow
from megatron_core.checkpoint_format import read_tracker
from megatron_core.config import load_recipe
from megatron_core.training import run_lock

ROOT = Path(__file__).resolve().parents[1]
LONG = [
    "--set",
    "training.train_iters=100000",
    "--set",
    "training.save_interval=null",
    "--set",
    "training.log_interval=1",
    "--set",
    "training.eval_interval=100000",
]


# ----------------------------------------------------------------------------------------------
# The lock itself
# ----------------------------------------------------------------------------------------------


def _write_lock(run_dir: Path, **holder) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / run_lock.LOCK_FILENAME
    path.write_text(
        json.dumps({"job": "another job", "host": socket.gethostname(), "boot": run_lock._boot_id(), **holder})
    )
    return path


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_live_holder_is_refused_by_name(tmp_path):
    holder = _sleeper()
    try:
        path = _write_lock(tmp_path, pid=holder.pid, ticks=run_lock._start_ticks(holder.pid))
        with pytest.raises(run_lock.RunLocked, match=f"in use by process {holder.pid} on host {socket.gethostname()}"):
            run_lock.acquire(tmp_path, "this job")
        assert json.loads(path.read_text())["pid"] == holder.pid  # untouched
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_from_another_host_is_refused(tmp_path):
    _write_lock(tmp_path, pid=1, ticks=0, host="node-that-is-not-here")
    with pytest.raises(run_lock.RunLocked, match="node-that-is-not-here.*delete the lock file"):
        run_lock.acquire(tmp_path, "this job")


def test_a_stale_lock_is_taken_over_with_a_log_line_and_released(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path = _write_lock(tmp_path, pid=dead.pid, ticks=12345)
    said = []
    lock = run_lock.acquire(tmp_path, "this job", log=said.append)
    assert lock == path and json.loads(path.read_text())["pid"] == os.getpid()
    assert len(said) == 1 and f"left by process {dead.pid}" in said[0] and "taking it over" in said[0]
    run_lock.release(lock)
    assert not path.exists()


def test_a_reused_pid_or_a_reboot_is_stale(tmp_path):
    # the lock names this very process, but a start tick it never had, then another boot
    me = run_lock._start_ticks(os.getpid())
    for stale in ({"ticks": me + 1}, {"ticks": me, "boot": "another boot"}):
        path = _write_lock(tmp_path, pid=os.getpid(), **stale)
        assert run_lock.acquire(tmp_path, "this job", log=lambda _: None) == path
        path.unlink()


def test_the_nodes_of_one_job_share_the_lock_and_other_jobs_do_not(tmp_path):
    holder = _sleeper()
    try:
        path = _write_lock(tmp_path, pid=holder.pid, ticks=run_lock._start_ticks(holder.pid), job="job-a", host="node1")
        assert run_lock.acquire(tmp_path, "job-a") is None  # node 1 holds it for this job: shared, not re-made
        with pytest.raises(run_lock.RunLocked):
            run_lock.acquire(tmp_path, "job-b")  # same launcher settings or not: another token, another job
        assert json.loads(path.read_text())["host"] == "node1"
    finally:
        holder.kill()
        holder.wait()


def test_two_processes_taking_over_one_stale_lock_cannot_both_win(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _write_lock(tmp_path, pid=dead.pid, ticks=1)
    code = (
        "import sys, time; from megatron_core.training import run_lock\n"
        "try:\n    run_lock.acquire(sys.argv[1], sys.argv[2], log=lambda _: None); print('won', flush=True)\n"
        "except run_lock.RunLocked:\n    print('refused', flush=True)\n"
        "time.sleep(3)\n"
    )
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path), f"job-{i}"], stdout=subprocess.PIPE, text=True, cwd=ROOT
        )
        for i in range(4)
    ]
    verdicts = sorted(r.communicate(timeout=60)[0].strip() for r in racers)
    assert verdicts == ["refused", "refused", "refused", "won"]


# ----------------------------------------------------------------------------------------------
# Real trainers through invoke
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smoke_data(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("faults-work")
    proc = subprocess.run(
        [sys.executable, "-m", "invoke", "preprocess", "--recipe", "smoke", "--workdir", str(workdir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    subprocess.run(
        [sys.executable, "-m", "invoke", "tokenizer", "--recipe", "smoke", "--workdir", str(workdir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return workdir


def _start_train(workdir: Path, *extra: str) -> subprocess.Popen:
    # its own session, as a shell job is: os.killpg(pid, SIGINT) is the terminal's Ctrl-C
    return subprocess.Popen(
        [sys.executable, "-m", "invoke", "train", "--recipe", "smoke", "--workdir", str(workdir), *LONG, *extra],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _run_dir(workdir: Path) -> Path:
    overrides = [LONG[i + 1] for i in range(0, len(LONG), 2)]
    return workflow.run_dir(load_recipe("smoke", overrides), workdir)


def _wait_for_iteration(run_dir: Path, proc: subprocess.Popen, at_least: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    metrics = run_dir / "metrics.jsonl"
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"training ended early (exit {proc.returncode}): {proc.stdout.read()[-3000:]}")
        if metrics.exists() and sum(1 for line in metrics.read_text().splitlines() if line.strip()) >= at_least:
            return
        time.sleep(0.2)
    pytest.fail("training did not reach the iteration in time")


def _trainers_of(run_dir: Path) -> list[int]:
    """PIDs of processes still training into run_dir."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "megatron_core.pretrain_gpt" in cmdline and str(run_dir) in cmdline:
                found.append(int(entry.name))
    return found


def _train_iterations(run_dir: Path) -> list[int]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["iteration"] for r in records if r["type"] == "train"]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", [[], ["--torchrun"]], ids=["python", "torchrun"])
def test_ctrl_c_through_invoke_saves_where_it_stopped_and_exits_130(smoke_data, launcher):
    """torchrun starts its workers in sessions of their own: the signal must reach them, not only torchrun
    (whose own handler would kill them 30 s later)."""
    run_dir = _run_dir(smoke_data)
    for stale in (run_dir / "checkpoints", run_dir / "metrics.jsonl", run_dir / "summary.json"):
        subprocess.run(["rm", "-rf", str(stale)], check=True)
    proc = _start_train(smoke_data, *launcher, *(["--master-port", str(free_port())] if launcher else []))
    _wait_for_iteration(run_dir, proc, 3)
    os.killpg(proc.pid, signal.SIGINT)  # the terminal sends Ctrl-C to the job's whole process group
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, out[-3000:]
    assert "received SIGINT: saved checkpoint at iteration" in out
    stopped = _train_iterations(run_dir)[-1]
    assert read_tracker(run_dir / "checkpoints") == stopped
    assert (run_dir / "checkpoints" / f"iter_{stopped:07d}").is_dir()
    assert not _trainers_of(run_dir)
    assert not (run_dir / run_lock.LOCK_FILENAME).exists()  # released on the way out


@pytest.mark.slow
def test_a_second_run_is_refused_and_sigterm_to_invoke_stops_the_first(smoke_data):
    run_dir = _run_dir(smoke_data)
    for stale in (run_dir / "checkpoints", run_dir / "metrics.jsonl", run_dir / "summary.json"):  # earlier tests
        subprocess.run(["rm", "-rf", str(stale)], check=True)
    first = _start_train(smoke_data, "--from-scratch")
    _wait_for_iteration(run_dir, first, 2)
    second = _start_train(smoke_data)
    out2, _ = second.communicate(timeout=120)
    assert second.returncode != 0 and "is in use by process" in out2, out2[-3000:]
    os.kill(first.pid, signal.SIGTERM)  # the invoke process only, as a scheduler or `kill` would
    out1, _ = first.communicate(timeout=120)
    assert first.returncode == 128 + signal.SIGTERM, out1[-3000:]
    assert "received SIGTERM: saved checkpoint at iteration" in out1
    iterations = _train_iterations(run_dir)
    assert iterations == list(range(1, len(iterations) + 1))  # one run's lines, none twice
    assert read_tracker(run_dir / "checkpoints") == iterations[-1]
    assert not _trainers_of(run_dir)  # no orphan trains on
