#!/usr/bin/env bash
# Unit tests (CPU): the whole pytest suite; multi-process tests run their ranks on gloo.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pytest -q -p no:cacheprovider tests "$@"
