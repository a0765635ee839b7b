#!/usr/bin/env bash
# Where dspec's host time goes on the GPU machine, run THERE from the project root (after
# a run that carried .gpu/ as for gpu-bench.sh). Random weights of the Qwen2.5-Coder
# 1.5B/0.5B shapes (speed depends on shapes, not values). Writes to $OUT:
#   plain.json, spec.json, trace.jsonl   generate --json (decode breakdown) and a traced
#                                        speculative run (draft / verify ms per round)
#   nsys-*.txt                           NVTX ranges (MLX names one per primitive's
#                                        eval_gpu) and CUDA API calls, when nsys exists
#   perf.txt                             the host's hottest symbols, when perf exists
# Usage: bash scripts/gpu-profile.sh [MAX_TOKENS]
set -uo pipefail
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
spec=("${plain[@]}" --drafter "model:$models/qwen05" --max-draft 4)
"${plain[@]}" > "$OUT/plain.json"
"${spec[@]}" --trace "$OUT/trace.jsonl" > "$OUT/spec.json"
for tool in nsys perf; do echo "$tool: $(command -v $tool || echo none)"; done | tee "$OUT/tools.txt"
if command -v nsys > /dev/null; then
  for run in plain spec; do
    declare -n cmd=$run
    nsys profile --force-overwrite true -o "/tmp/prof-$run" --trace cuda,nvtx "${cmd[@]}" > /dev/null 2>&1
    nsys stats --force-export true --report nvtx_sum,cuda_api_sum "/tmp/prof-$run.nsys-rep" \
        > "$OUT/nsys-$run.txt" 2>&1
  done
fi
if command -v perf > /dev/null; then
  perf record -F 2000 -g -o /tmp/perf.data "${spec[@]}" > /dev/null 2>&1
  perf report -i /tmp/perf.data --stdio --no-children --sort dso,symbol 2>/dev/null | head -150 > "$OUT/perf.txt"
fi
