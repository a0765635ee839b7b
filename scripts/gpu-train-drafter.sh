#!/usr/bin/env bash
# ON THE GPU MACHINE, from the project root, after `eval "$(bash .gpu/setup.sh)"`: trains a
# drafter for the real Qwen2.5-Coder-1.5B-Instruct and measures it against dspec's own plain
# greedy decoding on held-out code prompts, all in one invocation.
#
# Carried beforehand (HERE: bash scripts/gpu-prepare.sh, then
# ../shared/gpu/chunk.sh ~/.cache/dspec/models/qwen15.gguf qwen15.gguf, one part per run):
#   .gpu/bench/dspec.xz            this checkout's release build
#   .gpu/chunks/qwen15.gguf/part*  the GGUF of scripts/fetch-models.sh qwen15, in parts
#   .gpu/train/code.jsonl.xz       training text: {"text": ...} lines of Python source
#                                  (the standard library's; no HumanEval or MBPP)
#   .gpu/train/eval.jsonl, eval.txt  held-out code prompts (JSONL for --eval, lines for bench)
#
# Usage: bash scripts/gpu-train-drafter.sh [--kind dflash|dspark] [--steps N] [any other
#        train-drafter flags]
# Writes to $OUT (or ./gpu-train-out): train.log, log.jsonl, bench.json, config.json.
set -euo pipefail
kind=dflash
if [ "${1:-}" = "--kind" ]; then kind=$2; shift 2; fi
out=${OUT:-gpu-train-out}
mkdir -p "$out" .gpu/work
dspec=.gpu/work/dspec
[ -x "$dspec" ] || { xz -dc .gpu/bench/dspec.xz > "$dspec"; chmod +x "$dspec"; }
gguf=.gpu/work/qwen15.gguf
if [ ! -f "$gguf" ]; then
  cat .gpu/chunks/qwen15.gguf/part* > "$gguf.part"
  want=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
  have=$(sha256sum "$gguf.part" | cut -d' ' -f1)
  [ "$have" = "$want" ] || { echo "qwen15.gguf: sha256 $have, expected $want (a part is missing?)" >&2; exit 1; }
  mv "$gguf.part" "$gguf"
fi
target=.gpu/work/qwen15
[ -f "$target/config.json" ] || "$dspec" convert "$gguf" "$target" --dtype bf16
data=.gpu/work/code.jsonl
[ -f "$data" ] || xz -dc .gpu/train/code.jsonl.xz > "$data"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/device.txt"

drafter=.gpu/work/drafter-$kind
start=$(date +%s)
"$dspec" train-drafter --target "$target" --kind "$kind" --data "$data" --out "$drafter" \
  --eval .gpu/train/eval.jsonl --eval-tokens 128 "$@" 2>&1 | tee "$out/train.log"
echo "training took $(( $(date +%s) - start )) s" | tee -a "$out/train.log"
cp "$drafter/training/log.jsonl" "$drafter/config.json" "$out/"
"$dspec" bench --target "$target" --drafter "$drafter" --prompts .gpu/train/eval.txt \
  --max-tokens 128 --json > "$out/bench.json" 2> "$out/bench.err" || { cat "$out/bench.err"; exit 1; }
python3 - "$out/bench.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))["report"]
print("bench: tau", r.get("tau"), "speedup", r.get("speedup"), "identical", r.get("all_identical"),
      "near ties", r.get("near_ties"), "real mismatches", r.get("real_mismatches"))
print("round cost", json.dumps(r.get("round_cost")))
EOF
