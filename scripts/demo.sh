#!/usr/bin/env bash
# The main job, from a fresh clone: set-up, a release build, then dspec on a model.
# Usage: scripts/demo.sh [MODEL_DIR] [PROMPT]
# Without MODEL_DIR it writes a tiny random llama (with a byte-level tokenizer) and
# generates from it: the whole path (adapter, weights, tokenizer, chat template,
# streaming) on nonsense weights.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo build --release --locked -p dspec-engine -p dspec-examples --bins --examples
dspec=target/release/dspec
"$dspec" --version
"$dspec" adapters
model=${1:-}
if [ -z "$model" ]; then
  model=target/demo-tiny-llama
  target/release/examples/write_tiny_model "$model"
fi
"$dspec" adapters --detect "$model"
"$dspec" generate --target "$model" --prompt "${2:-The capital of France is}" --max-tokens 48
