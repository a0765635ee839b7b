#!/usr/bin/env bash
# On the GPU machine (files carried as for scripts/gpu-report.sh): plain, draft model and n-gram
# under --max-draft auto, and sampled decoding, on random weights of the 1.5B and 7B shapes
# (where no draft is ever kept, so auto must run at plain speed), three alternating
# processes each, plus one `dspec bench` per shape. Prints one line per run; traces in $OUT.
# Usage: OUT=DIR bash scripts/gpu-auto-fallback.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu-auto}; mkdir -p "$OUT"
eval "$(bash .gpu/setup.sh)"
xz -dc .gpu/bench/dspec.xz > /tmp/dspec && chmod +x /tmp/dspec
bash scripts/gpu-random-models.sh qwen15 qwen05 qwen7b
D=/tmp/models-random/qwen05
P="Write a Python function that parses a CSV file of sales records and returns the total per region, with tests."
g() { /tmp/dspec generate --target $T --prompt "$P" --max-tokens 384 --json "$@" 2>>$OUT/stderr.txt | python3 -c 'import json,sys; d=json.load(sys.stdin); s=d["stats"]; sp=d.get("speculative") or {}; print(round(s["decode_tokens_per_second"],1), s["generated_tokens"], sp.get("tau"))'; }
T=/tmp/models-random/qwen15
g > /dev/null
for T in /tmp/models-random/qwen15 /tmp/models-random/qwen7b; do
  for i in 1 2 3; do
    echo "$(basename $T) plain $i: $(g)"
    echo "$(basename $T) dm-auto $i: $(g --drafter model:$D --max-draft auto --trace $OUT/dm-$(basename $T)-$i.jsonl)"
    echo "$(basename $T) ngram-auto $i: $(g --drafter ngram --max-draft auto)"
    echo "$(basename $T) sampled $i: $(g --temperature 0.7 --top-p 0.9 --seed $i)"
  done
  /tmp/dspec bench --target $T --drafter model:$D --max-draft auto --max-tokens 256 --json > $OUT/bench-dm-$(basename $T).json 2>/dev/null
  python3 -c 'import json,sys; r=json.load(open(sys.argv[1]))["report"]; print(sys.argv[2], "bench dm-auto: plain", round(r["plain_tokens_per_second"],1), "spec", round(r["speculative_tokens_per_second"],1), "ratio", round(r["speedup"],3), "per prompt", [round(x["speedup"],2) for x in r["rows"]], "near_ties", r["near_ties"], "real_mismatches", r["real_mismatches"])' $OUT/bench-dm-$(basename $T).json $(basename $T)
done
