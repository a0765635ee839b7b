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
# OpenBLAS before 0.3.25 runs Intel CPUs it does not know on its kernels for CPUs without
# AVX (engine/src/cpu_blas.rs). dspec starts itself again with OPENBLAS_CORETYPE set; the
# tests that compute in their own process need it set before they start, as dspec says.
cargo test --workspace --locked --no-run
coretype=$(target/debug/dspec --version | sed -n 's/.*dspec set OPENBLAS_CORETYPE=\([A-Za-z0-9_]*\).*/\1/p')
if [ -n "$coretype" ] && [ -z "${OPENBLAS_CORETYPE:-}" ]; then
    echo "test: OpenBLAS took this CPU for an older one; the tests run with OPENBLAS_CORETYPE=$coretype"
    export OPENBLAS_CORETYPE="$coretype"
fi
cargo test --workspace --locked
