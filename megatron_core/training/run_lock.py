"""One training job per run directory: a lock file naming its holder.

    lock = acquire(run_dir, job=job_token(), log=print)   # local rank 0 of each node
    ...train...
    release(lock)

`<run_dir>/run.lock` is created atomically (O_EXCL, which local disks and NFS honour) and holds {job, host,
pid, boot, ticks}. `job` is a random token rank 0 draws and every rank of the job receives (`job_token`, a
broadcast), so the nodes of one job, on a shared disk or each with its own copy of the run directory, share
the lock, and no two jobs can ever match. A second job refuses in one line naming the holder's PID and host.
A lock whose holder is gone (same host, and no process with that PID started at that clock tick since that
boot) is stale: it is taken over with a log line, under a flock on `run.lock.mutex` so that two processes
taking it over at once cannot both win. A lock held from another host cannot be checked from here: the
refusal says how to remove it once that job is known to be dead.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import uuid
from pathlib import Path
from typing import Callable, Optional

from megatron_core.errors import UserError

LOCK_FILENAME = "run.lock"


class RunLocked(UserError):
    """Another job trains in this run directory."""


def job_token() -> str:
    """A token for this job, the same on all its ranks (collective when a process group exists)."""
    import torch.distributed as dist

    token = [uuid.uuid4().hex]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(token, src=0)
    return token[0]


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _start_ticks(pid: int) -> Optional[int]:
    """Clock ticks after boot at which process `pid` started (exact, unlike wall-clock times), or None when
    there is no such process; -1 where /proc cannot tell (then only the PID is compared)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return int(handle.read().rsplit(b")", 1)[1].split()[19])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return -1


def _holder_is_gone(holder: dict) -> bool:
    if holder.get("host") != socket.gethostname():
        return False  # cannot tell from here
    if holder.get("boot") != _boot_id():
        return True  # the machine rebooted since
    ticks = _start_ticks(int(holder.get("pid", -1)))
    return ticks is None or (ticks != -1 and ticks != holder.get("ticks"))  # gone, or the PID was reused


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
        raise UserError(
            f"cannot write the run lock {path}: {exc.strerror}; the run directory must be writable "
            "(choose another --workdir or --run-dir)"
        ) from None
    with os.fdopen(fd, "w") as handle:
        handle.write(json.dumps(me))
        handle.flush()
        os.fsync(handle.fileno())
    return True


@contextlib.contextmanager
def _mutex(run_dir: Path):
    """Serialises look-then-take-over between processes of this host."""
    try:
        handle = open(run_dir / (LOCK_FILENAME + ".mutex"), "a")
    except OSError as exc:
        raise UserError(
            f"cannot write in the run directory {run_dir}: {exc.strerror}; it must be writable "
            "(choose another --workdir or --run-dir)"
        ) from None
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def acquire(run_dir: Path, job: Optional[str] = None, log: Callable[[str], None] = print) -> Optional[Path]:
    """Take the run directory's lock for `job` (default: this process alone); the lock's path when this
    process made it (and so removes it), None when a process of the same job holds it. Raises RunLocked
    when another job holds it."""
    run_dir = Path(run_dir)
    path = run_dir / LOCK_FILENAME
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(
            f"cannot create the run directory {run_dir}: {exc.strerror}; choose a writable --workdir (or --run-dir)"
        ) from None
    me = {
        "job": job or f"process:{uuid.uuid4().hex}",
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "boot": _boot_id(),
        "ticks": _start_ticks(os.getpid()),
    }
    with _mutex(run_dir):
        if _create(path, me):
            return path
        holder = _read(path)
        if holder is not None and holder.get("job") == me["job"]:
            return None  # another node of this job made it
        if holder is None or (holder and _holder_is_gone(holder)):
            if holder:
                log(
                    f"run lock: {path} was left by process {holder.get('pid')} on {holder.get('host')}, which is "
                    "gone; taking it over"
                )
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            if _create(path, me):
                return path
            holder = _read(path) or {}
    who = f"process {holder.get('pid')} on host {holder.get('host')}" if holder else "an unreadable lock file"
    raise RunLocked(
        f"{run_dir} is in use by {who} ({path}): wait for that run to finish, or train into "
        "another directory; if that process is dead (e.g. its node was lost), delete the lock file"
    )


def release(path: Optional[Path]) -> None:
    """Remove the lock if it is still this process's own."""
    if path is None:
        return
    holder = _read(path)
    if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
