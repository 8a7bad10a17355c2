"""The package's one logger: Python's `logging`, under the name "megatron_core", with one format.

Lines read as they always have (`[workflow] ...`, `[tokenizer] ...`, the Megatron training line bare);
a process other than rank 0 of a distributed run adds `[rank N] ` in front. Data tools write to stderr
(their stdout may be data), the rest to stdout. Silence or redirect it like any logger:
`logging.getLogger("megatron_core").setLevel(logging.WARNING)`, or replace that logger's handlers.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional

ROOT = "megatron_core"

# logger name -> (tag shown in brackets, or None; to stderr?; add the rank prefix?)
_STYLES: dict[str, tuple[Optional[str], bool, bool]] = {}


def get_logger(
    name: str, *, tag: Optional[str] = None, stderr: bool = False, rank_prefix: bool = True
) -> logging.Logger:
    """The logger for one module (`name` is its __name__). rank_prefix=False: the caller already picks the
    single rank that logs (the training writer), whose lines stay bare as in Megatron."""
    _STYLES[name] = (tag, stderr, rank_prefix)
    configure()
    return logging.getLogger(name)


def _rank() -> int:
    # No torch import here: the data tools and the CLI's recipe listing run without it.
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        tag, _, rank_prefix = _STYLES.get(record.name, (None, False, True))
        text = record.getMessage()
        if tag:
            text = f"[{tag}] {text}"
        if record.levelno >= logging.WARNING:
            text = f"{record.levelname.lower()}: {text}"
        rank = _rank() if rank_prefix else 0
        return f"[rank {rank}] {text}" if rank else text


class _StdStreamHandler(logging.Handler):
    """Writes to the sys.stdout/sys.stderr of the moment (not the one at set-up), so captured or
    redirected streams (pytest, contextlib.redirect_stdout) get the lines."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr if _STYLES.get(record.name, (None, False, True))[1] else sys.stdout
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # logging must never take the run down
            self.handleError(record)


def configure(level: Optional[int] = None) -> logging.Logger:
    """Set up the "megatron_core" logger once (INFO, our handler, no propagation to the root logger so a
    program's own logging set-up does not print every line twice). Entry points call it; the modules'
    get_logger too, so library use prints as before. A logger the user gave handlers first is left alone."""
    logger = logging.getLogger(ROOT)
    if not logger.handlers:
        handler = _StdStreamHandler()
        handler.setFormatter(_Formatter())
        logger.addHandler(handler)
        logger.propagate = False
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
    if level is not None:
        logger.setLevel(level)
    return logger
