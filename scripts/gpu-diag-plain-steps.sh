#!/usr/bin/env bash
# On the GPU machine: traced plain-step times under n-gram and the draft model (drafting
# ahead on and off) against plain decoding, 1.5B shape, random weights, three processes each.
# Usage: OUT=DIR bash scripts/gpu-diag-plain-steps.sh
set -uo pipefail
mkdir -p "$OUT"
eval "$(bash .gpu/setup.sh)"
xz -dc .gpu/bench/dspec.xz > /tmp/dspec && chmod +x /tmp/dspec
bash scripts/gpu-random-models.sh qwen15 qwen05
T=/tmp/models-random/qwen15; D=/tmp/models-random/qwen05
P="Write a Python function that parses a CSV file of sales records and returns the total per region, with tests."
g() { /tmp/dspec generate --target $T --prompt "$P" --max-tokens 384 --json "$@" 2>>$OUT/stderr.txt | python3 -c 'import json,sys; d=json.load(sys.stdin); s=d["stats"]; print(round(s["decode_tokens_per_second"],1))'; }
med() { python3 -c 'import json,sys,statistics; L=[json.loads(l) for l in open(sys.argv[1])]; p=[l["verify_ms"] for l in L if not l["drafted"]]; print("plain-step median", round(statistics.median(p),2), "p90", round(sorted(p)[int(len(p)*0.9)],2))' $1; }
g > /dev/null
for i in 1 2 3; do
  echo "plain $i: $(g)"
  echo "ngram $i: $(g --drafter ngram --max-draft auto --trace $OUT/ng$i.jsonl) $(med $OUT/ng$i.jsonl)"
  echo "dm-on $i: $(g --drafter model:$D --max-draft auto --trace $OUT/on$i.jsonl) $(med $OUT/on$i.jsonl)"
  echo "dm-off $i: $(g --drafter model:$D --max-draft auto --draft-ahead off --trace $OUT/off$i.jsonl) $(med $OUT/off$i.jsonl)"
done
