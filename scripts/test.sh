#!/usr/bin/env bash
# The test suite: set-up, formatting and lint checks, then every workspace test (unit,
# conformance, CLI end to end).
set -euo pipefail
cd "$(dirname "$0")/.."
# One full run gains nothing from incremental caches, which take gigabytes beside the
# build itself; a caller who wants them sets CARGO_INCREMENTAL=1.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
bash scripts/setup.sh --lint --test-clients
cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings
# Tests that compute in their own process need the OpenBLAS kernels dspec chooses for this
# CPU before they start (engine/src/cpu_blas.rs).
cargo test --workspace --locked --no-run
eval "$(bash scripts/openblas-coretype.sh target/debug/dspec)"
cargo test --workspace --locked
