#!/usr/bin/env bash
# On the GPU machine (files carried as for scripts/gpu-report.sh): `dspec bench` of a draft
# model and of n-gram lookup under --max-draft auto against dspec's own plain decoding, on
# random weights of the 7B and 1.5B shapes (no draft is ever kept, so auto must keep to
# plain speed), PASSES passes per prompt (default 5): one line per bench with its speedup
# (the median of the passes' own ratios), then each prompt's and every pass's tok/s.
# Reports in $OUT.
# Usage: OUT=DIR [PASSES=5] bash scripts/gpu-auto-passes.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu-auto-passes}; mkdir -p "$OUT"
PASSES=${PASSES:-5}
eval "$(bash .gpu/setup.sh)"
xz -dc .gpu/bench/dspec.xz > /tmp/dspec && chmod +x /tmp/dspec
R=/tmp/models-random
bash scripts/gpu-random-models.sh qwen7b qwen15 qwen05
bench() {
  local name=$1; shift
  echo "== $name"
  /tmp/dspec bench --max-tokens 256 --prefill-runs 0 --passes "$PASSES" --max-draft auto "$@" --json \
    > "$OUT/$name.json" 2>>"$OUT/stderr.txt" || { echo "failed (see $OUT/stderr.txt)"; return; }
  python3 - "$OUT/$name.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["report"]
print(f"all: plain {r['plain_tokens_per_second']:.1f} spec {r['speculative_tokens_per_second']:.1f} "
      f"ratio {r['speedup']:.3f} tau {r['tau']:.2f} near_ties {r['near_ties']} real_mismatches {r['real_mismatches']}")
for row in r["rows"]:
    print(f"  {row['speedup']:.3f}  plain {[round(x) for x in row['plain_passes']]}  "
          f"spec {[round(x) for x in row['speculative_passes']]}  drafts {row['drafting']['draft_histogram']}")
PY
}
bench dm-qwen7b --target $R/qwen7b --drafter model:$R/qwen05
bench ngram-qwen7b --target $R/qwen7b --drafter ngram
bench dm-qwen15 --target $R/qwen15 --drafter model:$R/qwen05
bench ngram-qwen15 --target $R/qwen15 --drafter ngram
