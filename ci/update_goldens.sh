#!/usr/bin/env bash
# Regenerate ci/golden/<recipe>.json for every smoke recipe from fresh runs (after an intended change);
# commit the new files together with the change that moved the losses.
set -euo pipefail
cd "$(dirname "$0")/.."
for recipe in ${RECIPES:-smoke smoke-tp2pp2}; do
  GOLDEN=update bash ci/smoke.sh "$recipe"
done
git --no-pager diff --stat -- ci/golden || true
