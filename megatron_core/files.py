"""Writing files that must never be seen half-written (torch-free: the data tools import it too)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable


def replace_atomically(path: Path, write: Callable[[Path], Any]) -> None:
    """write(a temporary path beside `path`), fsync it, rename it to `path`: readers, and a machine
    that crashed, see the whole new file or the old one, never a torn one. The one writer of
    checkpoints, the tracker, the tokenizer's files and its cache."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
