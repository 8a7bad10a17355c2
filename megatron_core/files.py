"""Writing files and directories that must never be seen half-written (torch-free: the data tools
import it too). Every rename the package makes to publish something goes through `rename_durably`."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable, Optional, Union

PathLike = Union[str, os.PathLike]


def fsync_directory(path: PathLike) -> None:
    """Make a rename inside `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def rename_durably(source: Path, target: Path) -> None:
    """Rename, then fsync the directory (or both) so the rename survives a crash of the machine."""
    os.replace(source, target)
    fsync_directory(target.parent)
    if source.parent != target.parent:
        fsync_directory(source.parent)


def publish_file(tmp: PathLike, path: PathLike) -> None:
    """Move the complete file `tmp` onto `path` (beside it), fsyncing its contents first: readers,
    and a machine that crashed, see the whole new file or the old one, never a torn one."""
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    rename_durably(Path(tmp), Path(path))


def replace_atomically(path: PathLike, write: Callable[[Path], Any]) -> None:
    """write(a temporary path beside `path`), then `publish_file` it to `path`. The one writer of
    checkpoints, the tracker, the tokenizer's files and its cache."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        publish_file(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def publish_directory(tmp: PathLike, final: PathLike, *, set_aside: Optional[PathLike] = None) -> None:
    """Rename the complete directory `tmp` to `final`. An existing `final` is first renamed to
    `set_aside` (replacing an older one there; the caller removes it once the new one is in use),
    or deleted where `set_aside` is None. Each rename is fsynced before the next."""
    tmp, final = Path(tmp), Path(final)
    if final.exists():
        if set_aside is None:
            shutil.rmtree(final)
        else:
            shutil.rmtree(set_aside, ignore_errors=True)
            rename_durably(final, Path(set_aside))
    rename_durably(tmp, final)


def remove_directory(path: PathLike) -> None:
    """Delete a directory tree, renaming it to `{path}.pruned` first so that a deletion cut short
    never leaves a half-deleted tree under its old name."""
    path = Path(path)
    doomed = path.with_name(path.name + ".pruned")
    shutil.rmtree(doomed, ignore_errors=True)
    rename_durably(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)
