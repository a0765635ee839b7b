#!/usr/bin/env bash
# On the GPU machine, from the project root: writes /tmp/models-random/NAME for each NAME
# not there yet, random weights of the shape in .gpu/bench/NAME/config.json with the carried
# tokenizer (scripts/random_weights.py, seed 0). The GPU scripts call it first.
# Usage: bash scripts/gpu-random-models.sh NAME...
set -euo pipefail
for n in "$@"; do
  [ -d "/tmp/models-random/$n" ] && continue
  xz -dc .gpu/bench/tokenizer.json.xz > ".gpu/bench/$n/tokenizer.json"
  python3 scripts/random_weights.py ".gpu/bench/$n" "/tmp/models-random/$n" --seed 0 | tail -1
done
