#!/usr/bin/env bash
# Prints `export OPENBLAS_CORETYPE=NAME` where the dspec binary given as $1 chose OpenBLAS
# kernels for this CPU over the ones OpenBLAS took it for (engine/src/cpu_blas.rs), and
# nothing otherwise or when the variable is already set. For programs that compute with
# the same OpenBLAS in their own process (the tests, mlx-lm), which must start with it:
#   eval "$(bash scripts/openblas-coretype.sh target/debug/dspec)"
set -euo pipefail
[ -z "${OPENBLAS_CORETYPE:-}" ] || exit 0
coretype=$("$1" --version | sed -n 's/.*dspec set OPENBLAS_CORETYPE=\([A-Za-z0-9_]*\).*/\1/p')
if [ -n "$coretype" ]; then
  echo "OpenBLAS took this CPU for an older one; running with OPENBLAS_CORETYPE=$coretype" >&2
  echo "export OPENBLAS_CORETYPE=$coretype"
fi
