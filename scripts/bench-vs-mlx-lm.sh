#!/usr/bin/env bash
# Greedy decode speed of dspec against mlx-lm 0.32.2 (PyPI, the same MLX 0.32.2
# build, with the same OpenBLAS substitution dspec's build makes) on the same
# converted model and prompt, in one run. Prints a table and the ratio.
# Usage: scripts/bench-vs-mlx-lm.sh [MODEL_NAME_OR_DIR] [MAX_TOKENS]   (default: smollm2 128)
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-smollm2}
max_tokens=${2:-128}
prompt="Once upon a time, in a small village by the sea, there lived"
venv=target/mlx-lm-venv

bash scripts/setup.sh >&2   # OpenBLAS, pip and jq
cargo build --release --locked -p dspec-engine >&2
export DSPEC=target/release/dspec
# Same OpenBLAS kernels for mlx-lm as dspec chooses for this CPU.
eval "$(bash scripts/openblas-coretype.sh "$DSPEC")"
[ -d "$model" ] || model=$(bash scripts/fetch-models.sh "$model")
# Conversions made before dspec wrote Hugging Face shard names (shard-NNNNN): mlx-lm
# finds weights only as model*.safetensors, so it reads them through a directory of links.
if compgen -G "$model/shard-*.safetensors" >/dev/null; then
  links=$(mktemp -d)
  for f in "$model"/*; do
    case $(basename "$f") in
      shard-*) ln -s "$f" "$links/model-$(basename "$f" | cut -d- -f2)" ;;
      model.safetensors.index.json) sed 's/"shard-/"model-/g' "$f" > "$links/$(basename "$f")" ;;
      *) ln -s "$f" "$links/" ;;
    esac
  done
  model=$links
fi

if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check mlx==0.32.2 mlx-cpu==0.32.2 mlx-lm==0.32.2 >&2
fi
# Same BLAS for both: point the wheel's bundled BLAS/LAPACK at OpenBLAS when present.
libs=$("$venv/bin/python" -c 'import mlx.core as c, os; print(os.path.join(os.path.dirname(os.path.dirname(c.__file__)), "mlx_cpu.libs"))')
blas=reference
for dir in /usr/lib/*/openblas-pthread; do
  if [ -f "$dir/libblas.so.3" ]; then
    for f in "$libs"/libblas-*; do ln -sf "$dir/libblas.so.3" "$f"; done
    for f in "$libs"/liblapack-*; do ln -sf "$dir/liblapack.so.3" "$f"; done
    blas=openblas
  fi
done

run_mlx_lm() { # dtype -> decode tok/s
  "$venv/bin/python" - "$model" "$prompt" "$max_tokens" "$1" <<'PY'
import sys, mlx.core as mx
from mlx_lm import load, stream_generate
from mlx_lm.sample_utils import make_sampler
model_dir, prompt, n, dtype = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
model, tok = load(model_dir)
if dtype == "float32":
    model.set_dtype(mx.float32)
ids = tok.encode(prompt)
last = None
for _ in range(2):  # the first run warms up
    for r in stream_generate(model, tok, ids, max_tokens=n, sampler=make_sampler(temp=0.0)):
        last = r
print(f"{last.generation_tps:.2f} {last.generation_tokens}")
PY
}

run_dspec() { # dtype -> decode tok/s
  local best=0 tokens=0
  for _ in 1 2; do
    out=$("$DSPEC" generate --target "$model" --prompt "$prompt" --no-chat-template --max-tokens "$max_tokens" --dtype "$1" --json)
    read -r tps n < <(jq -r '.stats | "\(.decode_tokens_per_second) \(.generated_tokens)"' <<<"$out")
    best=$tps tokens=$n
  done
  echo "$best $tokens"
}

echo "model: $model   prompt tokens: ~$(echo "$prompt" | wc -w) words   max tokens: $max_tokens   BLAS: $blas   cores: $(nproc)"
printf "%-8s %14s %14s %8s\n" dtype "mlx-lm tok/s" "dspec tok/s" ratio
for pair in "float32 f32" "bfloat16 bf16"; do
  read -r mdt ddt <<<"$pair"
  read -r m mn < <(run_mlx_lm "$mdt")
  read -r d dn < <(run_dspec "$ddt")
  printf "%-8s %14.2f %14.2f %7.2fx   (tokens: mlx-lm %s, dspec %s)\n" "$ddt" "$m" "$d" "$(awk -v d="$d" -v m="$m" 'BEGIN { print d / m }')" "$mn" "$dn"
done
