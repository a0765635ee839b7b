#!/usr/bin/env bash
# Installs what building dspec needs on a Debian/Ubuntu machine, once: a C++ compiler
# (mlx-c), libclang (bindgen), pip (fetches the pinned MLX wheel at build time) and
# OpenBLAS (a much faster CPU BLAS than the wheel's bundled reference BLAS; the build
# uses it when present). With --lint, also rustfmt and clippy (through rustup), which
# scripts/test.sh runs before the tests. With --test-clients, also the official `openai`
# Python client (pinned, into target/openai-client), which the server's tests speak
# through. Safe to re-run: installs only what is missing.
set -euo pipefail

lint=false
clients=false
for arg in "$@"; do
  case "$arg" in
    --lint) lint=true ;;
    --test-clients) clients=true ;;
    *) echo "setup: unknown option $arg (known: --lint, --test-clients)" >&2; exit 2 ;;
  esac
done

need=()
have_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
command -v g++ >/dev/null 2>&1 || need+=(g++)
have_pkg libclang-dev || ls /usr/lib/llvm-*/lib/libclang.so >/dev/null 2>&1 || need+=(libclang-dev)
ls /usr/lib/*/openblas-pthread/libblas.so.3 >/dev/null 2>&1 || need+=(libopenblas0-pthread)
python3 -m pip --version >/dev/null 2>&1 || need+=(python3-pip)
# The benchmark scripts read dspec's --json output with jq.
command -v jq >/dev/null 2>&1 || need+=(jq)

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

if $lint; then
  tools=()
  cargo fmt --version >/dev/null 2>&1 || tools+=(rustfmt)
  cargo clippy --version >/dev/null 2>&1 || tools+=(clippy)
  if [ ${#tools[@]} -gt 0 ]; then
    if ! command -v rustup >/dev/null 2>&1; then
      echo "setup: the lint checks need cargo's ${tools[*]}, and there is no rustup to add them:" \
        "install them from wherever this cargo came from (they ship with each Rust release)" >&2
      exit 1
    fi
    echo "setup: adding ${tools[*]} (rustup component add)" >&2
    rustup component add "${tools[@]}" || {
      echo "setup: rustup could not add ${tools[*]} (see above); run \`rustup component add ${tools[*]}\` once with network access" >&2
      exit 1
    }
  fi
fi

if $clients; then
  # Pinned so that the tests speak to the client they were written against.
  openai_version=3.51.0
  dest="$(cd "$(dirname "$0")/.." && pwd)/target/openai-client"
  if [ ! -f "$dest/.installed-$openai_version" ]; then
    echo "setup: installing the openai Python client $openai_version into $dest" >&2
    rm -rf "$dest"
    PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --disable-pip-version-check --no-warn-conflicts --target "$dest" "openai==$openai_version" || {
      echo "setup: pip could not install openai==$openai_version (see above); the server's client test needs it: re-run with network access" >&2
      exit 1
    }
    touch "$dest/.installed-$openai_version"
  fi
fi
