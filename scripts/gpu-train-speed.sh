#!/usr/bin/env bash
# ON THE GPU MACHINE, from the project root, after `eval "$(bash .gpu/setup.sh)"`: how fast
# `dspec train-drafter` steps, on random weights of a real model's shape (speed depends on
# shapes, not values), over the target's own answers to code prompts, as a real run trains.
# Times DFlash at 64 and 256 anchors a sequence and DSpark at 64, ten steps each on the same
# batches (same seed), and prints the median step after the first three: seconds in the
# target's forwards, in the drafter's forward, backward and update, and the whole step.
#
# Carried beforehand (HERE: bash scripts/gpu-prepare.sh; python3 scripts/code-prompts.py
# .gpu/train):
#   .gpu/bench/dspec.xz            this checkout's release build
#   .gpu/bench/qwen3-tokenizer/    the tokenizer random models take
#   .gpu/train/train.jsonl         code prompts ({"prompt": ...})
#
# Usage: bash scripts/gpu-train-speed.sh [--shape qwen15 (a scripts/random_weights.py shape)]
#        [--prompts 160]
#        [--baseline FILE.xz]   also time another build (e.g. an older commit's) on the
#                               same steps, for DFlash at 64 anchors
# Writes to $OUT (or ./gpu-train-speed-out): each run's log.jsonl and the answers' log.
set -euo pipefail
shape=qwen15
prompts=160
baseline=
while [ $# -gt 0 ]; do
  case "$1" in
    --shape) shape=$2; shift 2 ;;
    --prompts) prompts=$2; shift 2 ;;
    --baseline) baseline=$2; shift 2 ;;
    *) echo "gpu-train-speed.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
out=${OUT:-gpu-train-speed-out}
work=.gpu/work/train-speed
mkdir -p "$out" "$work"
dspec=$work/dspec
[ -x "$dspec" ] || { xz -dc .gpu/bench/dspec.xz > "$dspec"; chmod +x "$dspec"; }
if [ -n "$baseline" ]; then
  xz -dc "$baseline" > "$work/baseline"
  chmod +x "$work/baseline"
fi
nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null || echo "no NVIDIA GPU: timing the CPU"
target=$work/$(basename "$shape")
[ -f "$target/config.json" ] ||
  python3 scripts/random_weights.py "$shape" "$target" --tokenizer .gpu/bench/qwen3-tokenizer > /dev/null
head -n "$prompts" .gpu/train/train.jsonl > "$work/prompts.jsonl"
flags=(--target "$target" --data "$work/prompts.jsonl" --lr 1e-3 --answer-tokens 384
  --eval-every 100000 --seed 0)

# The target writes its answers once (one step), and every run reads them from its cache.
start=$(date +%s)
"$dspec" train-drafter "${flags[@]}" --kind dflash --steps 1 --out "$work/answers" \
  > "$out/answers.log" 2>&1
echo "answers written in $(( $(date +%s) - start )) s"

run() {
  local name=$1 binary=$2
  shift 2
  mkdir -p "$work/$name"
  cp "$work/answers/answers.jsonl" "$work/$name/"
  "$binary" train-drafter "${flags[@]}" --steps 10 --out "$work/$name" "$@" > "$work/$name.log" 2>&1 ||
    { echo "$name failed:"; tail -n 5 "$work/$name.log"; return 0; }
  cp "$work/$name/training/log.jsonl" "$out/$name.jsonl"
  python3 - "$name" "$out/$name.jsonl" <<'PY'
import json, statistics, sys
name, path = sys.argv[1], sys.argv[2]
steps = [json.loads(line) for line in open(path) if '"loss"' in line][3:]
target = statistics.median(s["target_seconds"] for s in steps)
drafter = statistics.median(s["drafter_seconds"] for s in steps)
step = statistics.median(s["target_seconds"] + s["drafter_seconds"] for s in steps)
losses = [round(s["loss"], 3) for s in steps]
print(f"{name}: step {step:.3f} s (target {target:.3f}, drafter {drafter:.3f}); losses {losses}")
PY
}
[ -n "$baseline" ] && run baseline-dflash-64 "$work/baseline" --kind dflash
run dflash-64 "$dspec" --kind dflash
run dflash-256 "$dspec" --kind dflash --anchors 256
run dspark-64 "$dspec" --kind dspark
