#!/usr/bin/env bash
# ON the GPU machine (no network there), from the project root: `dspec serve` under load
# at the Qwen3-4B shape (random bf16 weights, the Qwen3 tokenizer), plain batched decoding
# (--drafter none) and n-gram speculation, against mlx-lm's batching server on the same
# machine, with scripts/bench_serve.py at concurrency 1 to 32. Carried as `.gpu`: MLX's
# CUDA libmlx (../shared/gpu/prepare.sh) and what scripts/gpu-prepare.sh packs (this
# build, the tokenizer, the mlx and mlx-lm wheels).
# Usage: [WORKLOADS="chat edit"] bash scripts/gpu-serve.sh [ARGS for bench_serve.py...]
# (default: both workloads at concurrency 1,4,8,16,32, 128 tokens a request; one workload
# takes about 5 minutes on an H200)
# Results: $OUT (default /tmp/gpu-serve): serve-WORKLOAD.json and .txt, and the servers'
# logs; the tables on stdout.
set -euo pipefail
eval "$(bash .gpu/setup.sh)"
export OUT=${OUT:-/tmp/gpu-serve}
mkdir -p "$OUT"
DSPEC=/tmp/dspec
xz -dc .gpu/bench/dspec.xz > "$DSPEC" && chmod +x "$DSPEC"
"$DSPEC" --version
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2> /dev/null || true
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .gpu/py/*.whl
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
model=/tmp/models-serve/qwen3-4b
[ -f "$model/config.json" ] ||
  python3 scripts/random_weights.py qwen3-4b "$model" --tokenizer .gpu/bench/qwen3-tokenizer
for workload in ${WORKLOADS:-chat edit}; do
  python3 scripts/bench_serve.py --dspec "$DSPEC" --target "$model" --drafter none,ngram \
      --mlx-lm "$model" --mlx-lm-python python3 --workload "$workload" \
      --concurrency 1,4,8,16,32 --max-tokens 128 --json "$OUT/serve-$workload.json" "$@" \
      | tee "$OUT/serve-$workload.txt"
done
