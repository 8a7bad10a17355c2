"""One training job per run directory: a lock file naming its holder.

    with hold_run_lock(run_dir, log=print):
        ...train...

`<run_dir>/run.lock` is created atomically (O_EXCL, which local disks and NFS honour) by local rank 0 of
each node and holds {job, host, pid, started}. The ranks of one job agree on `job` (torchrun's rendezvous:
master address, port and run id), so the nodes of a job on a shared disk, and a node that has its own copy
of the run directory, all take or share it. A second job refuses in one line naming the holder's PID and
host. A lock whose holder is gone (same host, no such process, or a process that started later than the
lock: the PID was reused) is stale: it is taken over with a log line. A lock held from another host cannot
be checked from here: the refusal says how to remove it once that job is known to be dead.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Callable, Optional

from megatron_core.errors import UserError

LOCK_FILENAME = "run.lock"


class RunLocked(UserError):
    """Another job trains in this run directory."""


def job_id() -> str:
    """The same on every rank of one torchrun job; this process alone otherwise."""
    if "MASTER_ADDR" in os.environ:
        return (f"torchrun:{os.environ['MASTER_ADDR']}:{os.environ.get('MASTER_PORT', '')}:"
                f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}:{os.environ.get('WORLD_SIZE', '')}")
    return f"process:{socket.gethostname()}:{os.getpid()}"


def _process_start(pid: int) -> Optional[float]:
    """When process `pid` started (seconds since the epoch), or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            ticks = int(handle.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/stat", "rb") as handle:
            boot = next(int(line.split()[1]) for line in handle if line.startswith(b"btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, IndexError, StopIteration):  # no /proc: ask the kernel whether it exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return 0.0


def _holder_is_gone(holder: dict) -> bool:
    if holder.get("host") != socket.gethostname():
        return False  # cannot tell from here
    started = _process_start(int(holder.get("pid", -1)))
    return started is None or started > float(holder.get("started", 0)) + 1.0


def _read(path: Path) -> Optional[dict]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # torn or foreign: treated as held by an unknown job


def _create(path: Path, me: dict) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    except OSError as exc:
        raise UserError(f"cannot write the run lock {path}: {exc.strerror}; the run directory must be writable "
                        "(choose another --workdir or --run-dir)") from None
    with os.fdopen(fd, "w") as handle:
        handle.write(json.dumps(me))
        handle.flush()
        os.fsync(handle.fileno())
    return True


def acquire(run_dir: Path, log: Callable[[str], None] = print) -> Optional[Path]:
    """Take the run directory's lock for this job; the lock's path when this process made it (and so
    removes it), None when this job already held it. Raises RunLocked when another job holds it."""
    run_dir = Path(run_dir)
    path = run_dir / LOCK_FILENAME
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create the run directory {run_dir}: {exc.strerror}; choose a writable "
                        "--workdir (or --run-dir)") from None
    me = {"job": job_id(), "host": socket.gethostname(), "pid": os.getpid(),
          "started": _process_start(os.getpid()) or time.time()}
    for _ in range(3):  # a lock removed or taken over between our look and our create: look again
        if _create(path, me):
            return path
        holder = _read(path)
        if holder is None:
            continue
        gone = bool(holder) and _holder_is_gone(holder)
        if holder.get("job") == me["job"] and not gone:
            return None  # another node of this job made it
        if gone:
            log(f"run lock: {path} was left by process {holder.get('pid')} on {holder.get('host')}, which is gone; "
                "taking it over")
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            continue
        who = (f"process {holder.get('pid')} on host {holder.get('host')}" if holder else "an unreadable lock file")
        raise RunLocked(f"{run_dir} is in use by {who} ({path}): wait for that run to finish, or train into "
                        "another directory; if that process is dead (e.g. its node was lost), delete the lock file")
    raise RunLocked(f"could not take {path}: other processes keep creating it")


def release(path: Optional[Path]) -> None:
    """Remove the lock if it is still this process's own."""
    if path is None:
        return
    holder = _read(path)
    if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@contextlib.contextmanager
def hold_run_lock(run_dir: Path, log: Callable[[str], None] = print, take: bool = True):
    """The lock held for the block (`take`: this process is one that takes it, local rank 0 of its node)."""
    path = acquire(run_dir, log) if take else None
    try:
        yield
    finally:
        release(path)
