#!/usr/bin/env bash
# ON the GPU machine (no network there), from the project root: scripts/gpu_report.py, dspec
# beside mlx-lm, on the real Qwen2.5-Coder pair or on random weights of a named shape.
# Carried as `.gpu`: MLX's CUDA libmlx (../shared/gpu/prepare.sh) and what
# scripts/gpu-prepare.sh packs (this build, the Qwen3 tokenizer, the mlx and mlx-lm wheels).
#
# Usage: bash scripts/gpu-report.sh --random NAME [ARGS for gpu_report.py...]
#        bash scripts/gpu-report.sh --real [ARGS...]
#        bash scripts/gpu-report.sh --real-models
# --random NAME: random weights of a shape of scripts/random_weights.py (qwen15, qwen7b, ...)
#   as the target and of qwen05's as the draft model (speed depends on shapes, not values),
#   and for the kept-drafts lines the same shape with residual-scaled weights (random
#   weights otherwise leave near-ties everywhere, where a replayed answer is lost).
# --real: Qwen2.5-Coder-1.5B-Instruct with the 0.5B as draft model. Their GGUF files
#   (1.6 GB) cannot travel in one device run (64 MiB each), so they come in 60 MB parts over
#   back-to-back runs while the machine stays warm:
#     here:   ../shared/gpu/chunk.sh ~/.cache/dspec/models/qwen05.gguf qwen05.gguf  (and qwen15)
#     there:  one run per part, carrying [".gpu/chunks/NAME.gguf/partNN"]
#   This joins the parts, checks each file's sha256 (fetch-models.sh --sha) and converts it
#   to bf16 in /tmp/models-real/NAME. --real-models stops there, for `dspec bench` runs of
#   your own on those models.
# Results: $OUT/report-NAME.json and report-NAME.log, the table on stdout.
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

tokenizer=.gpu/bench/qwen3-tokenizer
random_model() { # SHAPE DIR [ARGS for random_weights.py]: written once, reused while warm
  local shape=$1 dir=$2; shift 2
  [ -d "$dir" ] && return
  python3 scripts/random_weights.py "$shape" "$dir.partial" --tokenizer "$tokenizer" "$@" | tail -1
  mv "$dir.partial" "$dir"
}

kept=()
case "${1:-}" in
  --random)
    name=$2; shift 2
    random_model "$name" "/tmp/models-random/$name" --seed 0
    random_model qwen05 /tmp/models-random/qwen05 --seed 0
    random_model "$name" "/tmp/models-scaled/$name" --seed 0 --residual-scale 1e-5
    target=/tmp/models-random/$name draft=/tmp/models-random/qwen05
    kept=(--kept-target "/tmp/models-scaled/$name")
    ;;
  --real | --real-models)
    mode=$1; shift
    models=/tmp/models-real
    for name in qwen05 qwen15; do
      parts=.gpu/chunks/$name.gguf
      [ -d "$models/$name" ] && continue
      [ -d "$parts" ] || { echo "gpu-report: no parts of $name yet" >&2; exit 1; }
      cat "$parts"/part* > "/tmp/$name.gguf"
      got=$(sha256sum "/tmp/$name.gguf" | cut -d' ' -f1)
      if [ "$got" != "$(bash scripts/fetch-models.sh --sha "$name")" ]; then
        echo "gpu-report: $name is incomplete or damaged ($(ls "$parts" | wc -l) parts, sha256 $got)" >&2
        exit 1
      fi
      /tmp/dspec convert "/tmp/$name.gguf" "$models/$name" --dtype bf16
      rm "/tmp/$name.gguf"
    done
    [ "$mode" = --real-models ] && { ls -d "$models"/*; exit 0; }
    target=$models/qwen15 draft=$models/qwen05
    ;;
  *)
    echo "usage: bash scripts/gpu-report.sh --random NAME | --real | --real-models [ARGS...]" >&2
    exit 2
    ;;
esac
log=$OUT/report-$(basename "$target")
python3 scripts/gpu_report.py --dspec /tmp/dspec --target "$target" --draft "$draft" \
    --json-out "$log.json" "${kept[@]}" "$@" 2> "$log.log"
