#!/usr/bin/env bash
# A/B on the GPU machine: the binary in .gpu/bench/dspec.xz (b) against .gpu/bench/dspec-a.xz (a),
# plain and draft model under --max-draft auto, random weights, per shape given as arguments.
set -uo pipefail
mkdir -p "$OUT"
eval "$(bash .gpu/setup.sh)"
xz -dc .gpu/bench/dspec.xz > /tmp/dspec-b && xz -dc .gpu/bench/dspec-a.xz > /tmp/dspec-a && chmod +x /tmp/dspec-a /tmp/dspec-b
P="Write a Python function that parses a CSV file of sales records and returns the total per region, with tests."
D=/tmp/models-random/qwen05
g() { local bin=$1; shift; $bin generate --target $T --prompt "$P" --max-tokens 384 --json "$@" 2>>$OUT/stderr.txt | python3 -c 'import json,sys; d=json.load(sys.stdin); s=d["stats"]; sp=d.get("speculative") or {}; print(round(s["decode_tokens_per_second"],1), s["generated_tokens"], sp.get("tau"), "prefill_ms", round(s["prefill_seconds"]*1e3,1))'; }
bench() { python3 -c 'import json,sys; r=json.load(open(sys.argv[1]))["report"]; print(sys.argv[2], "plain", round(r["plain_tokens_per_second"],1), "spec", round(r["speculative_tokens_per_second"],1), "ratio", round(r["speedup"],3), "per prompt", [round(x["speedup"],2) for x in r["rows"]], "near_ties", r["near_ties"], "real_mismatches", r["real_mismatches"])' "$@"; }
for S in "$@"; do
  bash scripts/gpu-random-models.sh $S qwen05
  T=/tmp/models-random/$S
  g /tmp/dspec-b > /dev/null
  for i in 1 2 3; do
    echo "$S plain-b $i: $(g /tmp/dspec-b)"
    echo "$S plain-a $i: $(g /tmp/dspec-a)"
    echo "$S dm-auto-a $i: $(g /tmp/dspec-a --drafter model:$D --max-draft auto)"
    echo "$S dm-auto-b $i: $(g /tmp/dspec-b --drafter model:$D --max-draft auto --trace $OUT/dm-b-$S-$i.jsonl)"
  done
  echo "$S ngram-auto-b: $(g /tmp/dspec-b --drafter ngram --max-draft auto)"
  echo "$S sampled-b: $(g /tmp/dspec-b --temperature 0.7 --top-p 0.9 --seed 1)"
  /tmp/dspec-b bench --target $T --drafter model:$D --max-draft auto --max-tokens 256 --json > $OUT/bench-b-$S.json 2>>$OUT/stderr.txt; bench $OUT/bench-b-$S.json "$S bench dm-auto b"
  /tmp/dspec-a bench --target $T --drafter model:$D --max-draft auto --max-tokens 256 --json > $OUT/bench-a-$S.json 2>>$OUT/stderr.txt; bench $OUT/bench-a-$S.json "$S bench dm-auto a"
done
