"""What every benchmark's command line does at the end: run, print the JSON last, or one error line."""

from __future__ import annotations

import json
import sys
from typing import Callable

from megatron_core.errors import UserError


def finish(run: Callable[[], dict]) -> int:
    """Exit code 0 with the result's JSON as the last line, or 2 with `error: ...` on stderr."""
    try:
        result = run()
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result), flush=True)
    return 0
