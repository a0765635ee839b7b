#!/usr/bin/env bash
# ON the GPU machine (no network there), from the project root: what a DFlash, a DSpark and a
# draft-model round cost in plain decoding steps at the Qwen3-4B and Qwen3-8B shapes, with
# random weights (scripts/gpu_drafters.py says what runs); at the Qwen3-30B-A3B shape
# (--shapes 30b-a3b, mixture of experts, written in mlx-lm's 4-bit layout), plain greedy
# against mlx-lm, n-gram auto, prefill, verify cost by width and a DFlash round (estimated
# at about 5 minutes, not yet timed there). Carried as `.gpu`: MLX's CUDA
# libmlx (../shared/gpu/prepare.sh) and what scripts/gpu-prepare.sh packs (this build, the
# Qwen3 tokenizer, the mlx and mlx-lm wheels for mlx-lm's plain greedy line, which is
# skipped with a note without them, optionally the adapters' kernel tests).
# Usage: bash scripts/gpu-drafters.sh [--shapes 4b|8b|4b,8b|30b-a3b] [ARGS for gpu_drafters.py...]
# One shape takes 4-7 minutes on an H100; run one shape per device call.
# DSPEC_LOCAL=1 skips the GPU set-up and keeps $DSPEC as it is (a CPU check run:
# DSPEC=target/debug/dspec, --shapes moe-tiny for the mixture-of-experts path);
# MLX_LM_PYTHON=PY runs mlx-lm's line with that Python (e.g. target/mlx-lm-venv/bin/python)
# instead of installing the carried wheels.
# Results: $OUT (default /tmp/gpu-drafters): drafters-SHAPE.json (every report whole) and
# drafters-SHAPE.txt (the table), drafters.log (every process's stderr), and
# cuda-kernel-tests.txt; the table on stdout.
set -euo pipefail
[ -n "${DSPEC_LOCAL:-}" ] || eval "$(bash .gpu/setup.sh)"
export OUT=${OUT:-/tmp/gpu-drafters}
DSPEC=${DSPEC:-/tmp/dspec}
mkdir -p "$OUT"
# The carried build wins over one a warm machine kept from an earlier call (round_cost is new).
if [ -z "${DSPEC_LOCAL:-}" ] && [ -f .gpu/bench/dspec.xz ]; then
  xz -dc .gpu/bench/dspec.xz > "$DSPEC" && chmod +x "$DSPEC"
fi
"$DSPEC" --version
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader 2> /dev/null || true
export PYTHONUNBUFFERED=1
# mlx-lm's line is extra: without its wheels, or where they do not install (another Python,
# as on a CPU check run), it is skipped with a note rather than failing the report.
mlx=()
if [ -n "${MLX_LM_PYTHON:-}" ]; then
  mlx=(--mlx-lm-python "$MLX_LM_PYTHON")
elif ! compgen -G ".gpu/py/*.whl" > /dev/null; then
  mlx=(--skip-mlx-lm --skip-mlx-lm-note "no mlx/mlx-lm wheels carried in .gpu/py/")
elif python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .gpu/py/*.whl; then
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
else
  mlx=(--skip-mlx-lm --skip-mlx-lm-note "the wheels in .gpu/py/ did not install")
fi
# The adapters' unit tests carried as .gpu/bench/adapters-tests.xz (`cargo test -p
# dspec-adapters --no-run`'s binary): their CUDA kernel checks run here first, on MLX's
# CUDA libmlx, and only here do they check the kernels rather than their absence.
if [ -f .gpu/bench/adapters-tests.xz ]; then
  xz -dc .gpu/bench/adapters-tests.xz > /tmp/adapters-tests && chmod +x /tmp/adapters-tests
  /tmp/adapters-tests cuda:: 2>&1 | tee "$OUT/cuda-kernel-tests.txt" | tail -5
fi
rc=0
python3 scripts/gpu_drafters.py --dspec "$DSPEC" --out "$OUT" "${mlx[@]}" "$@" \
    2> "$OUT/drafters.log" || rc=$?
if [ "$rc" != 0 ]; then
  tail -c 8000 "$OUT/drafters.log" >&2
  echo "gpu_drafters.py failed (exit $rc); its whole log is $OUT/drafters.log" >&2
  exit "$rc"
fi
