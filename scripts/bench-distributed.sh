#!/usr/bin/env bash
# Tensor parallelism on one machine: `dspec generate` alone and as N local ranks (MLX's
# ring backend over 127.0.0.1, started the way mlx.launch starts them), on the same
# model, prompt and flags, alternating, REPEATS times each; plain greedy decoding and
# n-gram speculation on an edit prompt. Prints decode tok/s, τ, and the time per token
# the group adds. Then the time of one all-sum of a decode step's activations.
# Usage: scripts/bench-distributed.sh [MODEL_NAME_OR_DIR] [RANKS] [MAX_TOKENS] [REPEATS]
#        (default: qwen05 2 64 2)
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-qwen05}
ranks=${2:-2}
max_tokens=${3:-64}
repeats=${4:-2}

bash scripts/setup.sh >&2   # the build's needs and jq
cargo build --release --locked -p dspec-engine -p dspec-runtime --example all_sum_latency >&2
dspec=target/release/dspec
[ -d "$model" ] || model=$(bash scripts/fetch-models.sh "$model")
hidden=$(jq -r .hidden_size "$model/config.json")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# A ring hostfile of N free ports on 127.0.0.1.
hostfile() {
  python3 - "$ranks" >"$work/hosts.json" <<'PY'
import json, socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(json.dumps([[f"127.0.0.1:{s.getsockname()[1]}"] for s in socks]))
PY
}

# Runs PROGRAM ARGS as the N ranks; rank 0's stdout goes to stdout.
as_ranks() {
  hostfile
  local pids=()
  for ((r = 1; r < ranks; r++)); do
    MLX_RANK=$r MLX_HOSTFILE=$work/hosts.json "$@" >/dev/null 2>"$work/rank$r.err" &
    pids+=($!)
  done
  MLX_RANK=0 MLX_HOSTFILE=$work/hosts.json "$@" 2>"$work/rank0.err"
  for p in "${pids[@]}"; do wait "$p"; done
}

summary() { # JSON of `generate --json` -> "tok/s tau"
  jq -r '"\(.stats.decode_tokens_per_second * 100 | round / 100) \((.speculative.tau // 1) * 100 | round / 100)"'
}

edit_prompt='Rename the variable count to total in this code and return the whole code:

def tally(items):
    count = 0
    for item in items:
        if item.ok:
            count += item.value
    return count'

printf '%-16s %-8s %10s %6s\n' mode ranks "decode/s" tau
for mode in plain ngram; do
  case $mode in
    plain) flags=(--prompt "Write a Python function that checks whether a number is prime.") ;;
    ngram) flags=(--prompt "$edit_prompt" --drafter ngram --max-draft 5) ;;
  esac
  args=(generate --target "$model" --max-tokens "$max_tokens" --json "${flags[@]}")
  for ((i = 0; i < repeats; i++)); do
    read -r speed tau < <(env -u MLX_RANK -u MLX_HOSTFILE "$dspec" "${args[@]}" 2>/dev/null | summary)
    printf '%-16s %-8s %10s %6s\n' "$mode" 1 "$speed" "$tau"
    read -r speed tau < <(as_ranks "$dspec" "${args[@]}" | summary)
    printf '%-16s %-8s %10s %6s\n' "$mode" "$ranks" "$speed" "$tau"
  done
done
for ((i = 0; i < repeats; i++)); do
  as_ranks target/release/examples/all_sum_latency "$hidden"
done
