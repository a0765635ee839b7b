#!/usr/bin/env bash
# On the GPU machine, from the project root: the n-gram drafter at its default --max-draft
# on random weights (where its lookups find nothing) with rounds queued ahead
# (`--verify-ahead auto`) against rounds read one by one (`off`), per shape given
# (.gpu/bench/NAME/config.json; default qwen7b qwen15). Writes one bench JSON per line to
# $OUT and prints the ratios (medians of five passes' speculative/plain ratios).
set -euo pipefail
OUT=${OUT:-/tmp/gpu-verify-ahead}
mkdir -p "$OUT"
eval "$(bash .gpu/setup.sh)"
xz -dc .gpu/bench/dspec.xz > /tmp/dspec && chmod +x /tmp/dspec
shapes=("$@")
[ ${#shapes[@]} -gt 0 ] || shapes=(qwen7b qwen15)
for shape in "${shapes[@]}"; do
  bash scripts/gpu-random-models.sh "$shape"
  for ahead in auto off; do
    /tmp/dspec bench --target "/tmp/models-random/$shape" --drafter ngram --verify-ahead "$ahead" \
        --max-tokens 256 --passes 5 --prefill-runs 0 --json > "$OUT/ngram-$shape-$ahead.json"
    python3 -c 'import json, sys
r = json.load(open(sys.argv[1]))["report"]
print(sys.argv[2], "plain", round(r["plain_tokens_per_second"], 1), "spec",
      round(r["speculative_tokens_per_second"], 1), "speedup", round(r["speedup"], 3),
      "real mismatches", r["real_mismatches"])' "$OUT/ngram-$shape-$ahead.json" "$shape $ahead"
  done
done
