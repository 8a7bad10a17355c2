#!/usr/bin/env bash
# One smoke recipe end to end on this machine, in a fresh work directory:
#   corpus -> tokenizer -> preprocess -> train -> golden loss check -> convert to HF -> load it with transformers.
# Usage: ci/smoke.sh RECIPE
#   GOLDEN=check (default) | update (rewrite ci/golden/RECIPE.json from this run) | skip
#   WORKDIR=dir (default: a new temporary directory, removed on success)
set -euo pipefail
cd "$(dirname "$0")/.."
recipe=${1:?usage: ci/smoke.sh RECIPE}
GOLDEN=${GOLDEN:-check}
if [ -z "${WORKDIR:-}" ]; then
  WORKDIR=$(mktemp -d "${TMPDIR:-/tmp}/smoke-${recipe}.XXXXXX")
  trap 'status=$?; [ $status -eq 0 ] && rm -rf "$WORKDIR" || echo "smoke: outputs kept in $WORKDIR" >&2' EXIT
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # several ranks share few cores; reproducible float sums

echo "== [$recipe] train (workdir $WORKDIR)"
invoke train --recipe "$recipe" --workdir "$WORKDIR"

case "$GOLDEN" in
  check|update)
    echo "== [$recipe] golden $GOLDEN"
    python -m ci.golden "$GOLDEN" --recipe "$recipe" --workdir "$WORKDIR" ;;
  skip) echo "== [$recipe] golden check skipped (GOLDEN=skip)" ;;
  *) echo "error: GOLDEN=$GOLDEN is not check, update or skip" >&2; exit 2 ;;
esac

echo "== [$recipe] convert to Hugging Face"
invoke convert --recipe "$recipe" --workdir "$WORKDIR"

echo "== [$recipe] load with transformers"
python -m ci.hf_load --recipe "$recipe" --workdir "$WORKDIR"
echo "smoke $recipe: ok"
