#!/usr/bin/env bash
# On the GPU machine, from the project root: writes /tmp/models-random/NAME for each NAME
# not there yet, random weights of the shape in .gpu/bench/NAME/config.json with the carried
# tokenizer (scripts/random_weights.py, seed 0). The GPU scripts call it first.
# With RESIDUAL_SCALE=S, the layers' output projections are scaled by S
# (random_weights.py --residual-scale: greedy answers with wide margins, for runs whose
# outputs must not depend on rounding) and the models go to /tmp/models-scaled/NAME.
# Usage: [RESIDUAL_SCALE=S] bash scripts/gpu-random-models.sh NAME...
set -euo pipefail
root=/tmp/models-random
scale=()
if [ -n "${RESIDUAL_SCALE:-}" ]; then
  root=/tmp/models-scaled
  scale=(--residual-scale "$RESIDUAL_SCALE")
fi
for n in "$@"; do
  [ -d "$root/$n" ] && continue
  xz -dc .gpu/bench/tokenizer.json.xz > ".gpu/bench/$n/tokenizer.json"
  python3 scripts/random_weights.py ".gpu/bench/$n" "$root/$n" --seed 0 "${scale[@]}" | tail -1
done
