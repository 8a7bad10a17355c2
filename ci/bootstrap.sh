#!/usr/bin/env bash
# Set up a fresh machine for the CPU path: a virtualenv in .venv with the pinned CPU torch wheel
# (installed first, so the project's plain `torch` requirement does not pull a multi-GB CUDA build)
# and the project. `--test` adds the test extra (pytest, ruff, Triton, Megatron-LM's own package for the
# golden comparisons, ...): the tests need it, the demo does not, and leaving it out halves the set-up.
# Idempotent: a second run only checks.
# Inside the NGC image do NOT use this: torch is already there (see docker/Dockerfile).
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  "") target="." ;;
  --test) target=".[test]" ;;
  *) echo "error: unknown argument '$1'; usage: bash ci/bootstrap.sh [--test]" >&2; exit 2 ;;
esac
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
# TORCH_INDEX_URL: where the CPU build lives on machines whose pip would otherwise pick the CUDA build
# (the GitHub workflow sets PyTorch's CPU index); unset, pip's own configuration decides.
if ! python -c "import torch" 2>/dev/null; then
  echo "bootstrap: installing torch 2.13.0 (CPU) into .venv"
  pip install --quiet "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
echo "bootstrap: installing megatron-recipes ($target) into .venv"
pip install --quiet -e "$target"
python -c "import torch, megatron_core; print(f'ready: torch {torch.__version__}, megatron_core {megatron_core.__version__}')"
