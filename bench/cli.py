"""What every benchmark's command line does at the end: run, print the JSON last, or one error line."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from megatron_core.errors import UserError
from megatron_core.files import replace_atomically

# Where a run's JSON goes unless --results-dir says otherwise: beside the user's other outputs (./work, relative
# to the current directory), never into the checkout's tracked bench/results/, which keeps only the runs the
# README cites (copied there on purpose).
RESULTS = Path("work") / "bench-results"


def results_path(name: str, results_dir: Optional[Path] = None, suffix: str = ".json") -> Path:
    """work/bench-results/<name>-<UTC time><suffix> (or under results_dir), its folder made."""
    results_dir = Path(results_dir or RESULTS)
    results_dir.mkdir(parents=True, exist_ok=True)
    return results_dir / f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}{suffix}"


def write_result(result: dict, path: Path) -> Path:
    """The result as indented JSON at path, never half-written under that name."""
    replace_atomically(path, lambda tmp: tmp.write_text(json.dumps(result, indent=2) + "\n"))
    return path


def finish(run: Callable[[], dict]) -> int:
    """Exit code 0 with the result's JSON as the last line, or 2 with `error: ...` on stderr."""
    try:
        result = run()
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result), flush=True)
    return 0
