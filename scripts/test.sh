#!/usr/bin/env bash
# The test suite: set-up, then every workspace test (unit, conformance, CLI end to end).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo test --workspace --locked
