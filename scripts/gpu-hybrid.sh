#!/usr/bin/env bash
# On the GPU machine (carry .gpu/bench with dspec.xz, tokenizer.json.xz and qwen15/, plus the
# CUDA libmlx files .gpu/setup.sh installs): random weights of the Qwen3.5-4B shape (hybrid
# Gated DeltaNet + attention), plain greedy decode three times, n-gram under auto, prefill at
# 1k and 4k tokens, and the verify cost per width. Usage: OUT=DIR bash scripts/gpu-hybrid.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu-hybrid}; mkdir -p "$OUT"
eval "$(bash .gpu/setup.sh)"
xz -dc .gpu/bench/dspec.xz > /tmp/dspec && chmod +x /tmp/dspec
xz -dc .gpu/bench/tokenizer.json.xz > .gpu/bench/qwen15/tokenizer.json
M=/tmp/models-random/qwen35-4b
[ -d $M ] || python3 scripts/qwen35_random_weights.py $M --tokenizer-dir .gpu/bench/qwen15 --shape 4b
P="Write a Python function that parses a CSV file of sales records and returns the total per region, with tests."
g() { /tmp/dspec generate --target $M --prompt "$P" --max-tokens 256 --json "$@" 2>>$OUT/stderr.txt | python3 -c 'import json,sys; d=json.load(sys.stdin); s=d["stats"]; sp=d.get("speculative") or {}; print(round(s["decode_tokens_per_second"],1), s["generated_tokens"], sp.get("tau"), "prefill_ms", round(s["prefill_seconds"]*1e3,1))'; }
for i in 1 2 3; do echo "qwen35-4b plain $i: $(g)"; done
echo "qwen35-4b ngram-auto: $(g --drafter ngram --max-draft auto)"
echo "qwen35-4b sampled: $(g --temperature 0.7 --top-p 0.9 --seed 1)"
/tmp/dspec bench --target $M --drafter ngram --max-draft auto --max-tokens 128 --prefill-lengths 1024,4096 --json > $OUT/bench.json 2>>$OUT/stderr.txt
python3 -c 'import json,sys; r=json.load(open(sys.argv[1]))["report"]; print("bench ngram-auto ratio", round(r["speedup"],3), "prefill", json.dumps(r.get("prefill"))[:600])' $OUT/bench.json
python3 scripts/gpu_verify_cost.py --dspec /tmp/dspec --model $M --widths 2,4,8,16 --verify batched --json-out $OUT/verify.json 2>>$OUT/stderr.txt | tail -4
tail -5 $OUT/stderr.txt
