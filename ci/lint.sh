#!/usr/bin/env bash
# Lint: Python syntax errors and undefined names (ruff's E9/F63/F7/F82: the findings that are bugs, not
# style), hadolint on the Dockerfile (no warning allowed), bash syntax of every script, and the workflow's YAML.
set -euo pipefail
cd "$(dirname "$0")/.."
RUFF_VERSION=0.17.5

if ! command -v ruff >/dev/null; then
  echo "error: ruff not found; install it with: pip install ruff==${RUFF_VERSION}" >&2
  exit 2
fi
echo "== $(ruff --version)"
ruff check --isolated --select E9,F63,F7,F82 .

echo "== hadolint docker/Dockerfile"
hadolint --failure-threshold warning docker/Dockerfile

echo "== bash -n"
for script in ci/*.sh docker/entrypoint.sh .ci/run; do
  bash -n "$script"
done

echo "== workflow YAML"
python -c "import sys, yaml; [yaml.safe_load(open(p)) for p in sys.argv[1:]]" .github/workflows/*.yml
echo "lint: ok"
