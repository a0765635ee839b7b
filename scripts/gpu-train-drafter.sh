#!/usr/bin/env bash
# ON THE GPU MACHINE, from the project root, after `eval "$(bash .gpu/setup.sh)"`: trains a
# drafter for the real Qwen2.5-Coder-1.5B-Instruct on its own answers to code prompts, then
# measures it against dspec's own plain greedy decoding on held-out code prompts.
#
# Carried beforehand (HERE: bash scripts/gpu-prepare.sh; python3 scripts/code-prompts.py
# .gpu/train; split -b 54M -d -a 2 ~/.cache/dspec/models/qwen15.gguf .gpu/chunks/qwen15.gguf/part,
# then one run per part carrying [".gpu/chunks/qwen15.gguf/partNN"], back to back):
#   .gpu/bench/dspec.xz            this checkout's release build
#   .gpu/chunks/qwen15.gguf/part*  the GGUF of scripts/fetch-models.sh qwen15, in parts
#   .gpu/train/train.jsonl         training prompts ({"prompt": ...}; no HumanEval or MBPP)
#   .gpu/train/eval.jsonl, eval.txt  held-out code prompts (JSONL for --eval, lines for bench)
#   .gpu/train/answers.jsonl.xz    optional: the target's answers, as a stopped run returns them
#
# Usage: bash scripts/gpu-train-drafter.sh [--kind dflash|dspark] [--for SECONDS] [--resume]
#        [any other train-drafter flags]
# A device run lasts 10 minutes at most: `--for S` stops training after S seconds (it saves,
# as Ctrl-C does), and a second run with `--resume` and the same flags continues on the same
# machine while it is still warm. The answers the target writes are cached in the drafter's
# directory, so a stop while they are written loses none. Once training ends, the drafter is
# measured with `dspec bench` and packed into $OUT with its weights rounded to 8 bits
# (scripts/drafter_int8.py; a run returns at most 64 MiB), for the CPU bench here:
#   python3 scripts/drafter_int8.py unpack FILES_AT ./drafter   (needs numpy, safetensors)
# Writes to $OUT (or ./gpu-train-out): train.log, log.jsonl, bench.json, and the drafter's
# config.json and weights in parts: eight files at most, as many as a run returns.
set -euo pipefail
kind=dflash
seconds=0
resume=()
while [ $# -gt 0 ]; do
  case "$1" in
    --kind) kind=$2; shift 2 ;;
    --for) seconds=$2; shift 2 ;;
    --resume) resume=(--resume); shift ;;
    *) break ;;
  esac
done
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
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

drafter=.gpu/work/drafter-$kind
# Answers an earlier session brought back (below) spare the target writing them again.
if [ -f .gpu/train/answers.jsonl.xz ] && [ ! -f "$drafter/answers.jsonl" ]; then
  mkdir -p "$drafter"
  xz -dc .gpu/train/answers.jsonl.xz > "$drafter/answers.jsonl"
fi
start=$(date +%s)
status=0
limit=()
[ "$seconds" -gt 0 ] && limit=(timeout -s INT "$seconds")
"${limit[@]}" "$dspec" train-drafter --target "$target" --kind "$kind" \
  --data .gpu/train/train.jsonl --out "$drafter" --eval .gpu/train/eval.jsonl \
  --eval-tokens 128 "${resume[@]}" "$@" > "$out/train.log" 2>&1 || status=$?
tr '\r' '\n' < "$out/train.log" | grep -v '^$' | tail -n 40
echo "this run trained for $(( $(date +%s) - start )) s"
[ -f "$drafter/training/log.jsonl" ] && cp "$drafter/training/log.jsonl" "$out/"
if [ "$status" -ne 0 ]; then
  if [ "$status" -eq 124 ]; then
    # A stopped run returns the answers too (a few MB), which a later session carries
    # as .gpu/train/answers.jsonl.xz instead of having them written again.
    [ -f "$drafter/answers.jsonl" ] && xz -T0 -c "$drafter/answers.jsonl" > "$out/answers.jsonl.xz"
    echo "stopped after $seconds s: run again with --resume and the same flags"
    exit 0
  fi
  exit "$status"
fi
"$dspec" bench --target "$target" --drafter "$drafter" --prompts .gpu/train/eval.txt \
  --max-tokens 128 --json > "$out/bench.json" 2> .gpu/work/bench.err || { cat .gpu/work/bench.err; exit 1; }
python3 - "$out/bench.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))["report"]
print("bench: tau", r.get("tau"), "speedup", r.get("speedup"), "identical", r.get("all_identical"),
      "near ties", r.get("near_ties"), "real mismatches", r.get("real_mismatches"))
print("round cost", json.dumps(r.get("round_cost")))
EOF
python3 scripts/drafter_int8.py pack "$drafter" "$out"
ls -la "$out"
