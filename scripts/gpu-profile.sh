#!/usr/bin/env bash
# Where a decode step's and a speculative round's time goes on the GPU machine, run THERE
# from the project root after a run that carried .gpu/ (as for gpu-bench.sh). Random
# weights of the Qwen2.5-Coder 1.5B/0.5B shapes (speed depends on shapes, not values).
# Writes to $OUT: plain.json (generate --json: decode breakdown into building, queueing
# and waiting), spec.json and trace.jsonl (draft and verify ms per round).
# Usage: bash scripts/gpu-profile.sh [MAX_TOKENS]
set -euo pipefail
OUT=${OUT:-/tmp/gpu-profile}
mkdir -p "$OUT"
eval "$(bash .gpu/setup.sh)"
xz -dc .gpu/bench/dspec.xz > /tmp/dspec && chmod +x /tmp/dspec
tokens=${1:-128}
models=/tmp/models
[ -d "$models/qwen15" ] || python3 scripts/random_weights.py .gpu/bench/qwen15 "$models/qwen15" --seed 0
[ -d "$models/qwen05" ] || python3 scripts/random_weights.py .gpu/bench/qwen05 "$models/qwen05" --seed 1
prompt="Write a Python function that returns the n-th Fibonacci number."
plain=(/tmp/dspec generate --target "$models/qwen15" --max-tokens "$tokens" --json --prompt "$prompt")
"${plain[@]}" > "$OUT/plain.json"
"${plain[@]}" --drafter "model:$models/qwen05" --max-draft 4 --trace "$OUT/trace.jsonl" > "$OUT/spec.json"
