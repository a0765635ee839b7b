#!/usr/bin/env bash
# Installs what building dspec needs on a Debian/Ubuntu machine, once: a C++ compiler
# (mlx-c), libclang (bindgen), pip (fetches the pinned MLX wheel at build time) and
# OpenBLAS (a much faster CPU BLAS than the wheel's bundled reference BLAS; the build
# uses it when present). Safe to re-run: installs only what is missing.
set -euo pipefail

need=()
have_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
command -v g++ >/dev/null 2>&1 || need+=(g++)
have_pkg libclang-dev || ls /usr/lib/llvm-*/lib/libclang.so >/dev/null 2>&1 || need+=(libclang-dev)
ls /usr/lib/*/openblas-pthread/libblas.so.3 >/dev/null 2>&1 || need+=(libopenblas0-pthread)
python3 -m pip --version >/dev/null 2>&1 || need+=(python3-pip)

if [ ${#need[@]} -gt 0 ]; then
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "setup: please install: ${need[*]} (no apt-get here)" >&2
    exit 1
  fi
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "setup: installing ${need[*]}" >&2
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q "${need[@]}"
fi

command -v cargo >/dev/null 2>&1 || { echo "setup: Rust (cargo) is required: https://rustup.rs" >&2; exit 1; }
