#!/usr/bin/env bash
# Lint: `ruff check .` with the rules in pyproject.toml's [tool.ruff] (syntax errors, undefined names, unused
# imports/variables/arguments, redefinitions, lines over 120) and `ruff format --check .`, hadolint on the
# Dockerfile (no warning allowed), bash syntax of every script, and the workflow's YAML.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v ruff >/dev/null; then
  echo "error: ruff not found; install the test extra (it pins ruff): bash ci/bootstrap.sh --test" >&2
  exit 2
fi
echo "== $(ruff --version)"
ruff check .
ruff format --check .  # the formatter's style (pyproject.toml [tool.ruff]); `ruff format .` applies it

echo "== hadolint docker/Dockerfile"
hadolint --failure-threshold warning docker/Dockerfile

echo "== bash -n"
for script in ci/*.sh docker/entrypoint.sh .ci/run; do
  bash -n "$script"
done

echo "== workflow YAML"
python -c "import sys, yaml; [yaml.safe_load(open(p)) for p in sys.argv[1:]]" .github/workflows/*.yml
echo "lint: ok"
