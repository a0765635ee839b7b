#!/usr/bin/env bash
# On the GPU machine (carry .gpu/bench with dspec.xz, tokenizer.json.xz and qwen15/, .gpu/py with
# the mlx==0.32.2 (cp312) and mlx-lm==0.32.2 wheels, plus the CUDA libmlx files .gpu/setup.sh
# installs): random weights of the Qwen3.5-4B shape; dspec and mlx-lm 0.32.2 on the same CUDA
# libmlx, alternating processes: greedy decode of 256 tokens and prefill at 1k and 4k tokens.
# Usage: OUT=DIR bash scripts/gpu-hybrid-vs-mlx-lm.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu-hybrid-vs-mlx-lm}; mkdir -p "$OUT"
eval "$(bash .gpu/setup.sh)"
python3 -m pip install -q --no-deps --no-index .gpu/py/*.whl 2>>$OUT/stderr.txt
xz -dc .gpu/bench/dspec.xz > /tmp/dspec && chmod +x /tmp/dspec
xz -dc .gpu/bench/tokenizer.json.xz > .gpu/bench/qwen15/tokenizer.json
M=/tmp/models-random/qwen35-4b
[ -d $M ] || python3 scripts/qwen35_random_weights.py $M --tokenizer-dir .gpu/bench/qwen15 --shape 4b
# mlx-lm knows the family as qwen3_5 (text-only configs included): the same files, that name.
L=/tmp/models-random/qwen35-4b-mlx-lm; mkdir -p $L
for f in $M/*; do [ "$(basename $f)" = config.json ] || ln -sf $f $L/; done
python3 -c 'import json,sys; c=json.load(open(sys.argv[1])); c["model_type"]="qwen3_5"; json.dump(c, open(sys.argv[2],"w"))' $M/config.json $L/config.json
P="Write a Python function that parses a CSV file of sales records and returns the total per region, with tests."
g() { /tmp/dspec generate --target $M --prompt "$P" --max-tokens 256 --json "$@" 2>>$OUT/stderr.txt | python3 -c 'import json,sys; d=json.load(sys.stdin); s=d["stats"]; print(round(s["decode_tokens_per_second"],1), s["generated_tokens"], "prefill_ms", round(s["prefill_seconds"]*1e3,1))'; }
for i in 1 2 3; do
  echo "dspec plain $i: $(g)"
  python3 scripts/mlx_lm_speed.py $L --runs 1 --prefill-lengths "" 2>>$OUT/stderr.txt | sed "s/^/mlx-lm $i: /"
done
/tmp/dspec bench --target $M --drafter ngram --max-draft auto --max-tokens 64 --prefill-lengths 1024,4096 --json > $OUT/bench.json 2>>$OUT/stderr.txt
python3 -c 'import json,sys; r=json.load(open(sys.argv[1]))["report"]; print("dspec prefill", json.dumps(r.get("prefill"))[:700])' $OUT/bench.json
python3 scripts/mlx_lm_speed.py $L --runs 0 --prefill-lengths 1024,4096 2>>$OUT/stderr.txt | sed "s/^/mlx-lm /"
tail -5 $OUT/stderr.txt
