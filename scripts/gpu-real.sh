#!/usr/bin/env bash
# The GPU benchmark on the REAL Qwen2.5-Coder pair, run ON the GPU machine from the project
# root. The two GGUF files (1.6 GB) cannot travel in one device run (64 MiB each), so they
# come in 60 MB parts over back-to-back runs, the way ../shared/gpu/chunk.sh cuts them:
#   here:   ../shared/gpu/chunk.sh ~/.cache/dspec/models/qwen05.gguf qwen05.gguf   (and qwen15)
#   there:  one run per part, carrying [".gpu/chunks/NAME/partNN"] (the parts accumulate while
#           the machine stays warm), after one run that carried .gpu (with the wheels in .gpu/py).
# This joins the parts, checks each file's sha256 (fetch-models.sh --sha), converts both
# with `dspec convert` (bf16) and runs scripts/gpu-report.sh on them.
# Usage: bash scripts/gpu-real.sh [--check | --edit | --ahead] [ARGS for bench_gpu.py...]
#   --check: convert and run a short dspec-only equality check on whatever has arrived.
#   --edit:  the lines that need only some of the pair, against dspec's own plain decoding
#            (`dspec bench`, PASSES passes, default 5): n-gram on the long edit prompt
#            (max-draft 16 and auto:16) and under auto on the built-in prompts once the
#            1.5B target has arrived, and the draft model under auto on the built-in
#            prompts once the 0.5B has too.
#   --ahead: rounds queued ahead against rounds read one by one (`--verify-ahead auto|off`):
#            n-gram benches on the edit and built-in prompts, and round costs per width
#            from traces (`always` against `off`).
set -euo pipefail
OUT=${OUT:-/tmp/gpu-bench}
mkdir -p "$OUT"
export MODELS=/tmp/models-real
eval "$(bash .gpu/setup.sh)"
xz -dc .gpu/bench/dspec.xz > /tmp/dspec && chmod +x /tmp/dspec

for name in qwen05 qwen15; do
  parts=.gpu/chunks/$name.gguf
  [ -d "$MODELS/$name" ] && continue
  [ -d "$parts" ] || { echo "gpu-real: no parts of $name yet" >&2; continue; }
  cat "$parts"/part* > "/tmp/$name.gguf"
  got=$(sha256sum "/tmp/$name.gguf" | cut -d' ' -f1)
  if [ "$got" != "$(bash scripts/fetch-models.sh --sha "$name")" ]; then
    echo "gpu-real: $name is incomplete or damaged ($(ls "$parts" | wc -l) parts, sha256 $got)" >&2
    continue
  fi
  /tmp/dspec convert "/tmp/$name.gguf" "$MODELS/$name" --dtype bf16
  rm "/tmp/$name.gguf"
done

if [ "${1:-}" = "--check" ]; then
  # Speculative output must equal plain greedy output on the GPU, bit for bit: n-gram and
  # the model drafting for itself (every draft right: long verifies).
  for m in "$MODELS"/*; do
    for drafter in ngram "model:$m"; do
      /tmp/dspec bench --target "$m" --drafter "$drafter" --max-tokens 64 \
          | tee -a "$OUT/check.log"
    done
  done
  exit
fi
if [ "${1:-}" = "--ahead" ]; then
  # Rounds queued ahead (`--verify-ahead auto`) against rounds read one by one (`off`), a
  # process per line: n-gram on the long edit prompt (--max-draft 16 and auto:16) and on
  # the built-in prompts at the default --max-draft; then round costs per width from
  # traces with `always` against `off` (scripts/verify_ahead_cost.py).
  passes=${PASSES:-5}
  python3 -c 'import json, sys; sys.path.insert(0, "scripts"); from gpu_report import EDIT_PROMPT
print(json.dumps({"prompt": EDIT_PROMPT}))' > /tmp/edit.jsonl
  for ahead in auto off; do
    for max in 16 auto:16; do
      /tmp/dspec bench --target "$MODELS/qwen15" --drafter ngram --max-draft "$max" \
          --verify-ahead "$ahead" --max-tokens 320 --passes "$passes" --prompts /tmp/edit.jsonl \
          --prefill-runs 0 --json > "$OUT/ngram-edit-${max/:/-}-$ahead.json"
    done
    /tmp/dspec bench --target "$MODELS/qwen15" --drafter ngram --verify-ahead "$ahead" \
        --max-tokens 256 --passes "$passes" --prefill-runs 0 --json > "$OUT/ngram-5-$ahead.json"
  done
  python3 scripts/verify_ahead_cost.py --dspec /tmp/dspec --model "$MODELS/qwen15" \
      --prompt-file /tmp/edit.jsonl --json-out "$OUT/verify-ahead-cost.json"
  exit
fi
if [ "${1:-}" = "--edit" ]; then
  passes=${PASSES:-5}
  python3 -c 'import json, sys; sys.path.insert(0, "scripts"); from gpu_report import EDIT_PROMPT
print(json.dumps({"prompt": EDIT_PROMPT}))' > /tmp/edit.jsonl
  if [ -d "$MODELS/qwen15" ]; then
    for max in 16 auto:16; do
      /tmp/dspec bench --target "$MODELS/qwen15" --drafter ngram --max-draft "$max" \
          --max-tokens 320 --passes "$passes" --prompts /tmp/edit.jsonl --prefill-runs 0 \
          --json > "$OUT/ngram-edit-${max/:/-}.json"
    done
    /tmp/dspec bench --target "$MODELS/qwen15" --drafter ngram --max-draft auto \
        --max-tokens 256 --passes "$passes" --prefill-runs 0 --json > "$OUT/ngram-auto.json"
  fi
  if [ -d "$MODELS/qwen15" ] && [ -d "$MODELS/qwen05" ]; then
    /tmp/dspec bench --target "$MODELS/qwen15" --drafter "model:$MODELS/qwen05" \
        --max-draft auto --max-tokens 256 --passes "$passes" --json > "$OUT/draft-model-auto.json"
  fi
  exit
fi
exec bash scripts/gpu-report.sh "$MODELS/qwen15" "$MODELS/qwen05" "$@"
