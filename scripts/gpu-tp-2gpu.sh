#!/usr/bin/env bash
# On a machine with two GPUs (nvidia-h200-x2; carry .gpu/bench with dspec.xz, tokenizer.json.xz,
# qwen7b/ and qwen05/, plus the CUDA libmlx files .gpu/setup.sh installs): random weights of the
# Qwen2.5-7B shape (0.5B for the draft model), one GPU against two ranks (one per GPU)
# through MLX's NCCL backend, in the same run: plain greedy, n-gram and draft-model tokens
# must be equal, and decode tok/s of each.
# NVLink multicast stays off in every process (NCCL_NVLS_ENABLE=0 and the device notes' others).
# Usage: OUT=DIR bash scripts/gpu-tp-2gpu.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu-tp-2gpu}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
eval "$(bash .gpu/setup.sh)"
xz -dc .gpu/bench/dspec.xz > /tmp/dspec && chmod +x /tmp/dspec
# Output projections scaled down (random_weights.py --residual-scale): random weights
# otherwise leave near-ties at most positions, where the two ranks' all-reduced sums,
# rounded in another order than one GPU's product, may pick the other token.
RESIDUAL_SCALE=1e-5 bash scripts/gpu-random-models.sh qwen7b qwen05
T=/tmp/models-scaled/qwen7b
P="Write a Python function that parses a CSV file of sales records and returns the total per region, with tests."
summary() { python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); s=d["stats"]; print(sys.argv[2], round(s["decode_tokens_per_second"],1), "tok/s", s["generated_tokens"], "tokens", "tokens_sha", __import__("hashlib").sha1(str(d["tokens"]).encode()).hexdigest()[:12])' "$@"; }
one() { CUDA_VISIBLE_DEVICES=0 /tmp/dspec generate --target $T --prompt "$P" --max-tokens 256 --seed 1 --json "$@" 2>>$OUT/stderr.txt; }
two() { # both ranks, one GPU each; rank 0 prints
  local port=$((20000 + RANDOM % 20000))
  ( CUDA_VISIBLE_DEVICES=1 MLX_RANK=1 MLX_WORLD_SIZE=2 NCCL_HOST_IP=127.0.0.1 NCCL_PORT=$port \
      /tmp/dspec generate --target $T --prompt "$P" --max-tokens 256 --seed 1 --distributed on \
      --distributed-backend nccl --json "$@" > /dev/null 2>>$OUT/stderr-rank1.txt ) &
  CUDA_VISIBLE_DEVICES=0 MLX_RANK=0 MLX_WORLD_SIZE=2 NCCL_HOST_IP=127.0.0.1 NCCL_PORT=$port \
    /tmp/dspec generate --target $T --prompt "$P" --max-tokens 256 --seed 1 --distributed on \
    --distributed-backend nccl --json "$@" 2>>$OUT/stderr.txt
  wait
}
for i in 1 2 3; do
  one > $OUT/one-plain-$i.json; summary $OUT/one-plain-$i.json "1 GPU plain $i:"
  two > $OUT/two-plain-$i.json; summary $OUT/two-plain-$i.json "2 GPUs plain $i:"
done
one --drafter ngram --max-draft 4 > $OUT/one-ngram.json; summary $OUT/one-ngram.json "1 GPU ngram:"
two --drafter ngram --max-draft 4 > $OUT/two-ngram.json; summary $OUT/two-ngram.json "2 GPUs ngram:"
one --drafter model:/tmp/models-scaled/qwen05 --max-draft 4 > $OUT/one-dm.json; summary $OUT/one-dm.json "1 GPU draft model:"
two --drafter model:/tmp/models-scaled/qwen05 --max-draft 4 > $OUT/two-dm.json; summary $OUT/two-dm.json "2 GPUs draft model:"
tail -n 5 $OUT/stderr.txt $OUT/stderr-rank1.txt
