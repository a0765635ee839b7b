#!/usr/bin/env bash
# The test suite: set-up, formatting and lint checks, then every workspace test (unit,
# conformance, CLI end to end).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --lint --test-clients
cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test --workspace --locked
