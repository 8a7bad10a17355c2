"""Run one untrusted Python program isolated from this machine; talk to it through two pipes.

Full isolation (the default, Linux user namespaces, no extra package): the evaluator starts this file as a
launcher (`python -I -S sandbox.py CONFIG`, stdlib only) which
  - drops its supplementary groups, enters new user, mount, PID, network, IPC and UTS namespaces, and has a
    helper left outside map only uid/gid 65534 inside (to 65534 outside when the evaluator is root, else to
    the evaluator's own uid), then becomes 65534;
  - forks the namespace's init, which builds a new root: a read-only bind of /usr, /bin, /lib*, /etc and
    the interpreter's prefix (other Python packages, the home and the checkout under them hidden), a /dev
    with null/zero/full/random/urandom, a fresh /proc, a private 16 MiB /tmp (all a sample can write),
    then pivot_root (the old root unmounted), rlimits (CPU, file size, 8 tasks, memory/8 of address space
    per task so the sum is bounded), no_new_privs, and a parent-death signal tied to the launcher;
  - runs the program as that init's child (exec drops every capability); when it ends, or when the
    evaluator kills the launcher at the timeout, init dies and the kernel kills the whole PID namespace.
The evaluator stays outside all of this: the sample cannot see, signal or trace it, reaches no network
(an empty namespace, abstract sockets included) and no filesystem socket. Its stdout/stderr are counted,
at most 64 KiB kept; messages are length-prefixed and at most 64 KiB; every wait has a deadline.
Not covered: kernel bugs (no seccomp filter), reading world-readable system files, CPU/memory pressure on
the machine within those limits. Weak mode (`weak=True`, only where namespaces are unavailable and the
user said --unsafe-weak-isolation): a plain `python -I -S` subprocess with rlimits in its own session.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import json
import os
import platform
import select
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Optional

PASSED, FAILED, TIMED_OUT = "passed", "failed", "timed out"
MESSAGE_CAP = OUTPUT_CAP = 64 << 10
MAX_TASKS = 8  # processes and threads of one sample (RLIMIT_NPROC counts both)
TMP_MB = 16  # its private /tmp: all it can write anywhere
NOBODY = 65534
SETUP_FAILED = 125
_SETUP_PREFIX = "sandbox-setup: "
_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "HOME": "/tmp"}
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}  # syscall numbers (glibc has no wrapper)


@dataclass
class SandboxResult:
    status: str  # passed | failed | timed out
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.status == PASSED


class SampleExited(Exception):
    """The program ended (or closed its pipe) while we waited for it."""


class SampleTimedOut(Exception):
    """The sample's deadline passed."""


class SetupError(RuntimeError):
    """The isolation could not be set up (a machine problem, not the sample's)."""


class Sample:
    """One program in the sandbox: `send`/`recv` length-prefixed messages on its fds argv[1] (requests, read
    by it) and argv[2] (answers, written by it), all before `timeout_s` from the start; `close` kills it."""

    def __init__(
        self, code: str, args: tuple[str, ...] = (), *, timeout_s: float, memory_mb: int, weak: bool = False
    ) -> None:
        self.deadline = time.monotonic() + timeout_s
        self.output, self.output_bytes, self.weak = bytearray(), 0, weak
        request_r, self._request_w = os.pipe()
        self._answer_r, answer_w = os.pipe()
        out_r, out_w = os.pipe()
        os.set_blocking(self._request_w, False)
        python = _python()
        program = [python, "-I", "-S", "-B", "-c", code, str(request_r), str(answer_w), *args]
        self._tmp = tempfile.TemporaryDirectory(prefix="sandbox-") if weak else None
        if weak:
            argv, preexec, cwd = program, _weak_limits(memory_mb, int(timeout_s) + 1), self._tmp.name
        else:
            config = {
                "program": program,
                "expose": _exposed(),
                "memory_mb": memory_mb,
                "cpu_s": int(timeout_s) + 1,
                "fds": [request_r, answer_w],
            }
            config["hide"] = _hidden(config["expose"])
            argv, preexec, cwd = [python, "-I", "-S", "-B", os.path.abspath(__file__), json.dumps(config)], None, "/"
        try:
            self.proc = subprocess.Popen(
                argv,
                cwd=cwd,
                env=_ENV,
                stdin=subprocess.DEVNULL,
                stdout=out_w,
                stderr=out_w,
                pass_fds=(request_r, answer_w),
                start_new_session=True,
                preexec_fn=preexec,
            )
        finally:
            for fd in (request_r, answer_w, out_w):
                os.close(fd)
        self._drainer = threading.Thread(target=self._drain, args=(out_r,), daemon=True)
        self._drainer.start()

    def _drain(self, fd: int) -> None:
        """Counts everything the sample prints, keeps the first OUTPUT_CAP bytes; ends when every holder is gone."""
        with os.fdopen(fd, "rb", buffering=0) as out:
            while chunk := out.read(1 << 16):
                self.output_bytes += len(chunk)
                self.output += chunk[: max(0, OUTPUT_CAP - len(self.output))]

    def _wait(self, fd: int, write: bool) -> None:
        left = self.deadline - time.monotonic()
        ready = select.select([], [fd], [], max(0.0, left)) if write else select.select([fd], [], [], max(0.0, left))
        if not any(ready):
            raise SampleTimedOut

    def send(self, message: bytes) -> None:
        data = len(message).to_bytes(4, "big") + message
        while data:
            self._wait(self._request_w, write=True)
            try:
                data = data[os.write(self._request_w, data) :]
            except BrokenPipeError:
                raise SampleExited from None

    def _read(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            self._wait(self._answer_r, write=False)
            chunk = os.read(self._answer_r, n - len(data))
            if not chunk:
                raise SampleExited
            data += chunk
        return data

    def recv(self) -> bytes:
        size = int.from_bytes(self._read(4), "big")
        if size > MESSAGE_CAP:
            raise SampleExited(f"an answer of {size} bytes (over {MESSAGE_CAP})")
        return self._read(size)

    def close(self) -> None:
        """Kill the launcher's group (init follows by its parent-death signal, the namespace with it), wait a
        bounded time; raises SetupError when the launcher reported a failed set-up."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._drainer.join(timeout=10)  # EOF: no process of the sample holds its stdout any more
        for fd in (self._request_w, self._answer_r):
            os.close(fd)
        if self._tmp:
            self._tmp.cleanup()
        if not self.weak and self.proc.returncode == SETUP_FAILED:
            lines = self.output.decode(errors="replace").splitlines()
            raise SetupError(
                next(
                    (line[len(_SETUP_PREFIX) :] for line in lines if line.startswith(_SETUP_PREFIX)),
                    "the sandbox launcher failed",
                )
            )


def _python() -> str:
    """The base interpreter: a venv's python is a link to it, and the venv itself stays hidden."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _exposed() -> list[str]:
    """The read-only system view, outermost first (a path inside an earlier one is left out)."""
    paths = [
        "/usr",
        "/bin",
        "/sbin",
        "/lib",
        "/lib32",
        "/lib64",
        "/libx32",
        "/etc",
        os.path.realpath(sys.base_prefix),
        os.path.dirname(_python()),
    ]
    chosen: list[str] = []
    for path in sorted(p for p in set(paths) if os.path.lexists(p)):
        if not any(path.startswith(c.rstrip("/") + "/") for c in chosen if not os.path.islink(c)):
            chosen.append(path)
    return chosen


def _hidden(exposed: list[str]) -> list[str]:
    """Directories inside the exposed ones that samples do not see: installed packages (the HumanEval data
    among them), the home, the working and project directories."""
    base = {"base": sys.base_prefix, "platbase": sys.base_prefix}
    candidates = [sysconfig.get_paths(vars=base)[k] for k in ("purelib", "platlib")]
    for pattern in ("/usr/lib/python3*/dist-packages", "/usr/local/lib/python3*/*-packages"):
        candidates += glob.glob(pattern)
    candidates += [
        os.path.expanduser("~"),
        os.getcwd(),
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    ]
    real = sorted({os.path.realpath(p) for p in candidates if os.path.isdir(p)})
    return [p for p in real if any(p.startswith(e + "/") for e in exposed if not os.path.islink(e))]


def _weak_limits(memory_mb: int, cpu_seconds: int):
    def apply() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (TMP_MB << 20, TMP_MB << 20))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


_PROBE = (
    "import os, sys\nm = f'{os.getuid()} {os.getpid()}'.encode()\n"
    "os.write(int(sys.argv[2]), len(m).to_bytes(4, 'big') + m)\n"
)


@functools.lru_cache(maxsize=1)
def isolation_problem() -> Optional[str]:
    """None when full isolation works on this machine, else a line naming what is missing (probed once)."""
    if sys.platform != "linux" or platform.machine() not in _PIVOT_ROOT:
        return f"Linux namespaces with pivot_root on x86_64/aarch64 (this is {sys.platform} {platform.machine()})"
    sample = Sample(_PROBE, timeout_s=30, memory_mb=256)
    try:
        answer = sample.recv().decode()
    except (SampleExited, SampleTimedOut):
        answer = None
    finally:
        try:
            sample.close()
        except SetupError as exc:
            return str(exc)
    return None if answer == f"{NOBODY} 2" else f"a working sandbox (the probe answered {answer!r})"


def describe(weak: bool) -> str:
    if weak:
        return "sandbox: WEAK (--unsafe-weak-isolation): a subprocess per sample with rlimits, no namespaces"
    return (
        f"sandbox: per sample user/mount/PID/net/IPC namespaces, uid {NOBODY}, read-only system view, "
        f"{TMP_MB} MiB private /tmp, {MAX_TASKS} tasks, no network"
    )


# ---- the launcher: what runs between `python sandbox.py CONFIG` and the program (stdlib only) ----

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_KEPT = MS_NOEXEC | 1024 | 2048 | 4096  # noexec/noatime/nodiratime/relatime: locked, so kept on remount
MNT_DETACH, PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 2, 1, 38


class _Libc:
    def __init__(self) -> None:
        self.lib = ctypes.CDLL(None, use_errno=True)

    def __call__(self, what: str, name: str, *args) -> None:
        if getattr(self.lib, name)(*args) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    def mount(self, source: Optional[str], target: str, fstype: Optional[str], flags: int, data: str = "") -> None:
        enc = lambda s: s.encode() if s is not None else None
        self(f"mount {target}", "mount", enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data))


def _launch(config: dict) -> None:
    libc = _Libc()
    if os.geteuid() == 0:
        os.setgroups([])  # root's groups would still count for file access outside
    uid, gid = os.geteuid(), os.getegid()
    go_r, go_w = os.pipe()
    helper = os.fork()
    if helper == 0:  # stays outside, writes the maps of the new user namespace
        os.close(go_w)
        if not os.read(go_r, 1):
            os._exit(0)
        outer_uid, outer_gid = (NOBODY, NOBODY) if uid == 0 else (uid, gid)
        try:
            for name, text in (
                ("setgroups", "deny"),
                ("uid_map", f"{NOBODY} {outer_uid} 1"),
                ("gid_map", f"{NOBODY} {outer_gid} 1"),
            ):
                with open(f"/proc/{os.getppid()}/{name}", "w") as f:
                    f.write(text)
        except OSError as exc:
            print(f"{_SETUP_PREFIX}writing the user namespace's {name} failed: {exc}", file=sys.stderr)
            os._exit(1)
        os._exit(0)
    os.close(go_r)
    libc(
        "unshare(user, mount, PID, net, IPC, UTS namespaces) (are user namespaces allowed here?)",
        "unshare",
        CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS,
    )
    os.write(go_w, b"x")
    if os.waitpid(helper, 0)[1] != 0:
        raise OSError("writing the uid/gid maps of the sample's user namespace failed")
    alive_r, alive_w = os.pipe()  # init sees EOF if this launcher dies before init's parent-death signal is set
    init = os.fork()
    if init == 0:
        os.close(alive_w)
        _init(config, libc, alive_r)
    for fd in (alive_r, *config["fds"]):
        os.close(fd)
    status = os.waitpid(init, 0)[1]
    os._exit(SETUP_FAILED if os.WIFEXITED(status) and os.WEXITSTATUS(status) == SETUP_FAILED else 0)


def _init(config: dict, libc: _Libc, alive_r: int) -> None:
    """PID 1 of the sample's namespace: build its root, set its limits, run the program, end with it."""
    try:
        _build_root(config, libc)
        libc("prctl(PR_SET_PDEATHSIG)", "prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # after setresuid
        if select.select([alive_r], [], [], 0)[0]:
            os._exit(0)
        _limit(config)
        libc("prctl(PR_SET_NO_NEW_PRIVS)", "prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    except OSError as exc:
        print(f"{_SETUP_PREFIX}{exc}", file=sys.stderr, flush=True)
        os._exit(SETUP_FAILED)
    program = config["program"]
    sample = os.fork()
    if sample == 0:
        os.close(alive_r)
        try:
            os.execv(program[0], program)
        finally:
            os._exit(127)
    for fd in config["fds"]:
        os.close(fd)
    while os.wait()[0] != sample:  # reap orphans until the program itself ends
        pass
    os._exit(0)


def _build_root(config: dict, libc: _Libc) -> None:
    # Opened while still the evaluator's uid outside (which can reach them), bound from these handles once
    # uid 65534 (the only uid the new tmpfs can own files as); capabilities in the namespace stay until exec.
    handles = {p: os.open(p, os.O_PATH) for p in config["expose"] if not os.path.islink(p)}
    os.setresgid(NOBODY, NOBODY, NOBODY)
    os.setresuid(NOBODY, NOBODY, NOBODY)
    libc.mount(None, "/", None, MS_REC | MS_PRIVATE)
    root = "/tmp"  # any existing directory: the new root is a tmpfs mounted on it in this namespace only
    libc.mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path in config["expose"]:
        target = root + path
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if os.path.islink(path):  # /bin -> usr/bin and the like
            os.symlink(os.readlink(path), target)
            continue
        os.makedirs(target, exist_ok=True)
        libc.mount(f"/proc/self/fd/{handles[path]}", target, None, MS_BIND)
        os.close(handles[path])
        kept = os.statvfs(target).f_flag & MS_KEPT
        libc.mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | kept)
    for path in config["hide"]:
        libc.mount("tmpfs", root + path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=0755")
    os.mkdir(root + "/dev")
    libc.mount("tmpfs", root + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755")
    for name in ("null", "zero", "full", "random", "urandom"):
        open(f"{root}/dev/{name}", "w").close()
        libc.mount(f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND)
    os.symlink("/proc/self/fd", root + "/dev/fd")
    os.mkdir(root + "/proc")
    try:
        libc.mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:
        pass  # a container that masks parts of /proc forbids a fresh one: the sample then has no /proc
    else:  # no nested user namespaces (less kernel to attack; they would give nothing the sample lacks)
        with open(root + "/proc/sys/user/max_user_namespaces", "w") as f:
            f.write("0")
    os.mkdir(root + "/tmp")
    libc.mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={TMP_MB}m,nr_inodes=1024,mode=1777")
    libc.mount(None, root, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(root)
    libc("pivot_root", "syscall", _PIVOT_ROOT[platform.machine()], b".", b".")
    libc("unmounting the old root", "umount2", b".", MNT_DETACH)
    os.chdir("/tmp")


def _limit(config: dict) -> None:
    import resource

    per_task = (config["memory_mb"] << 20) // MAX_TASKS  # so all tasks together stay within memory_mb
    for limit, value in (
        (resource.RLIMIT_AS, per_task),
        (resource.RLIMIT_CPU, config["cpu_s"]),
        (resource.RLIMIT_FSIZE, TMP_MB << 20),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_NPROC, MAX_TASKS),
        (resource.RLIMIT_NOFILE, 64),
    ):
        resource.setrlimit(limit, (value, value))


if __name__ == "__main__":
    try:
        _launch(json.loads(sys.argv[1]))
    except OSError as exc:
        print(f"{_SETUP_PREFIX}{exc}", file=sys.stderr, flush=True)
        os._exit(SETUP_FAILED)
