#!/usr/bin/env bash
# On the GPU machine, from the project root: dspec's CUDA kernels for short continuations
# (adapters/src/cuda) against MLX's own kernels, in one command. Carry .gpu (libmlx,
# .gpu/bench with dspec.xz, tokenizer.json.xz and the config directories TARGET/ and
# qwen05/).
#
# Target: random weights of the shape in .gpu/bench/TARGET (default qwen15) with the
# layers' output projections scaled down (random_weights.py --residual-scale), so that
# greedy answers have wide margins and must not depend on the kernels.
#   1. Every draft kept: `dspec bench --drafter replay:` the plain answer, at w = 4, 8, 16,
#      with DSPEC_CUDA_KERNELS=1 and 0. bench runs plain and speculative decoding in one
#      process (medians of the passes' own ratios); a whole round's cost in plain steps is
#      tau / speedup. From bench's --trace, per pass, the median round queued ahead (its
#      verify_ms: from the read of the round before to its own, drafting excluded) over
#      the plain step of the plain run next to it; the median over passes.
#   2. A draft model (qwen05's shape, on its own thread) under --max-draft auto, in bench,
#      with and without the kernels.
#   3. One-shot generations, passes alternating (kernels 1, then 0): plain, n-gram and the
#      draft model must print one tokens hash.
# Usage: OUT=DIR [PASSES=2] bash scripts/gpu-kernels-ab.sh [TARGET]
set -uo pipefail
OUT=${OUT:-/tmp/gpu-kernels-ab}; mkdir -p "$OUT"
eval "$(bash .gpu/setup.sh)"
xz -dc .gpu/bench/dspec.xz > /tmp/dspec && chmod +x /tmp/dspec
target=${1:-qwen15}
RESIDUAL_SCALE=1e-5 bash scripts/gpu-random-models.sh "$target" qwen05
models=/tmp/models-scaled
T=$models/$target
P="Write a Python function that returns the n-th Fibonacci number iteratively."
printf '{"prompt": "%s"}\n' "$P" > "$OUT/prompt.jsonl"
/tmp/dspec generate --target "$T" --prompt "$P" --max-tokens 300 --json > "$OUT/answer.json" 2>> "$OUT/stderr.txt"

bench_row() { # FILE TRACE LABEL: bench's report in one line, with what a round costs in
  # plain steps (scripts/gpu_verify_cost.py, kept_round_steps)
  python3 -c 'import json, sys
sys.path.insert(0, "scripts")
from gpu_verify_cost import kept_round_steps
r = json.load(open(sys.argv[1]))["report"]
whole, traced, passes = kept_round_steps(r, sys.argv[2])
print(sys.argv[3], "plain", round(r["plain_tokens_per_second"], 1), "spec",
      round(r["speculative_tokens_per_second"], 1), "speedup", round(r["speedup"], 3),
      "tau", round(r["tau"], 2), "steps/round", round(whole, 3),
      "" if traced is None else "traced round %.3f steps (passes %s)" % (
          traced, " ".join("%.2f" % v for v in passes)),
      "identical", r["all_identical"], "near_ties", r["near_ties"], "real", r["real_mismatches"])' "$@"
}
bench() { # NAME KERNELS ARGS...
  local name=$1 k=$2; shift 2
  DSPEC_CUDA_KERNELS=$k timeout 120 /tmp/dspec bench --target "$T" --prompts "$OUT/prompt.jsonl" \
      --max-tokens 256 --prefill-runs 1 --json --trace "$OUT/trace-$name-k$k.jsonl" "$@" \
      > "$OUT/bench-$name-k$k.json" 2>> "$OUT/stderr.txt" \
    && bench_row "$OUT/bench-$name-k$k.json" "$OUT/trace-$name-k$k.jsonl" "$target $name kernels=$k:" \
    || { echo "$name k=$k failed"; tail -3 "$OUT/stderr.txt"; }
}
for k in 1 0; do
  for w in 4 8 16; do
    bench "kept-w$w" $k --drafter "replay:$OUT/answer.json" --max-draft $((w - 1)) \
        --verify-ahead always --passes 7
  done
done
for k in 1 0; do
  bench draft-model $k --drafter "model:$models/qwen05" --max-draft auto --passes 5
done

summary() {
  python3 -c 'import json, sys, hashlib
d = json.load(open(sys.argv[1])); s = d["stats"]; sp = d.get("speculative") or {}
tau = sp.get("tau")
print(sys.argv[2], round(s["decode_tokens_per_second"], 1), "tok/s", s["generated_tokens"], "tokens",
      "tau", tau if tau is None else round(tau, 2),
      "tokens_sha", hashlib.sha1(str(d["tokens"]).encode()).hexdigest()[:12])' "$@"
}
run() { # NAME KERNELS ARGS...
  local name=$1 k=$2; shift 2
  DSPEC_CUDA_KERNELS=$k /tmp/dspec generate --target "$T" --prompt "$P" --max-tokens 256 --json "$@" \
      > "$OUT/$name-k$k.json" 2>> "$OUT/stderr.txt" || { echo "$name k=$k failed"; tail -3 "$OUT/stderr.txt"; return; }
  summary "$OUT/$name-k$k.json" "$target $name kernels=$k:"
}
for pass in $(seq "${PASSES:-2}"); do
  for k in 1 0; do
    run "plain-$pass" $k
    run "ngram-$pass" $k --drafter ngram --max-draft 8
    run "model-$pass" $k --drafter "model:$models/qwen05" --max-draft auto
  done
done
