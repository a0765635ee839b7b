#!/usr/bin/env bash
# On the GPU machine, from the project root: what a round costs when every draft is kept,
# queued ahead (`--verify-ahead always`) and read one by one (`off`), per shape given
# (.gpu/bench/NAME/config.json; default qwen15 qwen7b), with dspec's CUDA kernels for
# short continuations and without them (DSPEC_CUDA_KERNELS=1 / 0, in that order; KERNELS
# picks, e.g. KERNELS=0). Weights are random with the layers' output projections scaled
# down (random_weights.py --residual-scale), so that bf16 rounding does not leave the
# replayed answer at the first near-tie; the drafter replays the plain run's own answer
# (verify_ahead_cost.py --drafter replay). Also prints plain decoding's per-step host
# split (building, queueing, waiting). Writes JSON to $OUT.
# Usage: bash scripts/gpu-verify-kept.sh [NAME...]   (WIDTHS=2,4,8,16 by default)
set -euo pipefail
OUT=${OUT:-/tmp/gpu-verify-kept}
mkdir -p "$OUT"
eval "$(bash .gpu/setup.sh)"
xz -dc .gpu/bench/dspec.xz > /tmp/dspec && chmod +x /tmp/dspec
prompt="Write a Python function that returns the n-th Fibonacci number iteratively."
printf '{"prompt": "%s"}\n' "$prompt" > /tmp/verify-kept-prompt.jsonl
shapes=("$@")
[ ${#shapes[@]} -gt 0 ] || shapes=(qwen15 qwen7b)
for n in "${shapes[@]}"; do
  RESIDUAL_SCALE=1e-5 bash scripts/gpu-random-models.sh "$n"
  m=/tmp/models-scaled/$n
  /tmp/dspec generate --target "$m" --prompt "$prompt" --max-tokens 256 --json > "$OUT/plain-$n.json"
  python3 -c 'import json, sys
s = json.load(open(sys.argv[1]))["stats"]
n = s["generated_tokens"]
split = {k: round(v / n * 1e3, 3) for k, v in (s.get("decode_breakdown") or {}).items()}
print(sys.argv[2], "plain", round(s["decode_tokens_per_second"], 1), "tok/s; ms per step:", split)' \
      "$OUT/plain-$n.json" "$n"
  for k in ${KERNELS:-1 0}; do
    echo "$n, DSPEC_CUDA_KERNELS=$k"
    DSPEC_CUDA_KERNELS=$k python3 scripts/verify_ahead_cost.py --dspec /tmp/dspec --model "$m" \
        --prompt-file /tmp/verify-kept-prompt.jsonl --drafter replay --widths "${WIDTHS:-2,4,8,16}" \
        --max-tokens 256 --json-out "$OUT/kept-$n-kernels$k.json" 2>&1 | grep -v '^+ '
  done
done
