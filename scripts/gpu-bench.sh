#!/usr/bin/env bash
# The GPU benchmark against mlx-lm, run ON the GPU machine from the project root, with
# no network there. Everything it needs travels in ignored folders:
#   .gpu/            MLX's CUDA libmlx (../shared/gpu/prepare.sh)
#   .gpu/bench/      dspec.xz (a stripped, xz-compressed release binary) and qwen05/,
#                    qwen15/ (config.json + tokenizer files of Qwen2.5-Coder 0.5B/1.5B)
#   .gpu/py/         the mlx==0.32.2 (cp312) and mlx-lm==0.32.2 wheels
# Models: $MODELS/qwen15 and $MODELS/qwen05 (default /tmp/models). Where they are
# missing, weights are random, of the real shapes, written on the GPU by
# random_weights.py: decode speed depends on shapes, not values. Random models agree
# with each other no more than chance, so the draft model's tau is ~1 there (n-gram
# lookup still finds the loops random models fall into); real weights (converted GGUF
# carried in parts, see scripts/gpu-real.sh) give the real tau and output comparison.
# Results: $OUT/bench.json, $OUT/bench.log.   Usage: bash scripts/gpu-bench.sh [ARGS...]
# (extra ARGS go to bench_gpu.py, e.g. --passes 1 --max-tokens 64), or
# bash scripts/gpu-bench.sh --sweep [ARGS...] for gpu_sweep.py (MLX CUDA settings).
set -euo pipefail
OUT=${OUT:-/tmp/gpu-bench}
mkdir -p "$OUT"
eval "$(bash .gpu/setup.sh)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .gpu/py/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
xz -dc .gpu/bench/dspec.xz > /tmp/dspec && chmod +x /tmp/dspec
/tmp/dspec --version | tee "$OUT/bench.log"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee -a "$OUT/bench.log"
models=${MODELS:-/tmp/models}
[ -d "$models/qwen15" ] || python3 scripts/random_weights.py .gpu/bench/qwen15 "$models/qwen15" --seed 0
[ -d "$models/qwen05" ] || python3 scripts/random_weights.py .gpu/bench/qwen05 "$models/qwen05" --seed 1
if [ "${1:-}" = "--sweep" ]; then
  shift
  python3 scripts/gpu_sweep.py --dspec /tmp/dspec --target "$models/qwen15" \
      --json-out "$OUT/sweep.json" "$@" 2>&1 | tee -a "$OUT/bench.log"
  exit
fi
python3 scripts/bench_gpu.py --dspec /tmp/dspec --target "$models/qwen15" \
    --draft "$models/qwen05" --json-out "$OUT/bench.json" "$@" 2>&1 | tee -a "$OUT/bench.log"
# Where a round's time goes: one traced generation per draft-length policy.
for policy in 4 auto; do
  /tmp/dspec generate --target "$models/qwen15" --drafter "model:$models/qwen05" \
      --max-draft "$policy" --max-tokens 128 --json --trace "$OUT/trace-$policy.jsonl" \
      --prompt "Write a Python function that returns the n-th Fibonacci number." \
      > "$OUT/generate-$policy.json" 2>> "$OUT/bench.log" || echo "traced run ($policy) failed" | tee -a "$OUT/bench.log"
done
