#!/usr/bin/env bash
# The one list of CI steps: .ci/run (the README's test command), the GitHub workflow's CPU job and a
# developer all run this script. Set-up (the test extra included), the lints, the layering contract,
# then the whole test suite; the smoke recipes' golden losses are tests in it.
# Quick loop while developing (under 3 minutes): python -m pytest -q -n 2 -m "not slow" tests
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/bootstrap.sh --test
. .venv/bin/activate
bash ci/lint.sh  # ruff (rules in pyproject.toml), hadolint, bash -n, the workflow's YAML
lint-imports  # the layering contract in pyproject.toml
# Two workers, each taking whole test files (module fixtures are built once): much of a test's time is one
# process importing torch while the other core idles.
python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile tests
