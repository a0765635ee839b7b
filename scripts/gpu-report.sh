#!/usr/bin/env bash
# scripts/gpu_report.py ON the GPU machine (no network there), from carried files:
#   .gpu/            MLX's CUDA libmlx (../shared/gpu/prepare.sh), and .gpu/bench/ with
#                    dspec.xz (a stripped, xz-compressed release build), tokenizer.json.xz
#                    and config dirs qwen05/, qwen15/, qwen7b/ (config.json, tokenizer_config.json)
#   .gpu/py/         the mlx==0.32.2 (cp312) and mlx-lm==0.32.2 wheels
# Usage: bash scripts/gpu-report.sh TARGET_DIR DRAFT_DIR [ARGS for gpu_report.py...]
#        bash scripts/gpu-report.sh --random NAME [ARGS...]   random weights of .gpu/bench/NAME's
#            shapes as the target, of qwen05's as the draft (speed depends on shapes, not values),
#            and for the kept-drafts verify lines the same shapes with residual-scaled weights
# Results: $OUT/report-*.json and the table on stdout; a hung dspec process leaves its
# threads' stacks in $OUT/stall-N.json, a crashed one its backtrace in $OUT/crash-N.txt.
set -euo pipefail
OUT=${OUT:-/tmp/gpu-report}
mkdir -p "$OUT"
eval "$(bash .gpu/setup.sh)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .gpu/py/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
[ -x /tmp/dspec ] || { xz -dc .gpu/bench/dspec.xz > /tmp/dspec && chmod +x /tmp/dspec; }
/tmp/dspec --version
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
# Crash backtraces of the dspec processes (scripts/crash_backtrace.c): built here where
# there is a compiler, else the one carried in .gpu/.
shim=()
if command -v gcc > /dev/null && gcc -O2 -shared -fPIC -o /tmp/crash_backtrace.so scripts/crash_backtrace.c; then
  shim=(--crash-shim /tmp/crash_backtrace.so)
elif [ -f .gpu/crash_backtrace.so ]; then
  shim=(--crash-shim "$PWD/.gpu/crash_backtrace.so")
fi
kept=()
if [ "$1" = "--random" ]; then
  name=$2; shift 2
  bash scripts/gpu-random-models.sh "$name" qwen05
  target=/tmp/models-random/$name draft=/tmp/models-random/qwen05
  # Plain random weights leave near-ties everywhere, where a replayed answer is lost; the
  # kept-drafts verify lines take the same shapes with wide margins.
  RESIDUAL_SCALE=1e-5 bash scripts/gpu-random-models.sh "$name"
  kept=(--kept-target "/tmp/models-scaled/$name")
else
  target=$1 draft=$2; shift 2
fi
python3 scripts/gpu_report.py --dspec /tmp/dspec --target "$target" --draft "$draft" \
    --json-out "$OUT/report-$(basename "$target").json" "${kept[@]}" "${shim[@]}" "$@" 2> "$OUT/report-$(basename "$target").log"
