#!/usr/bin/env python3
"""Where mlx-lm's greedy output first differs from dspec's greedy output, the top logits
of mlx-lm's own model there, computed the plain way (the prompt in one call, then dspec's
tokens one at a time). Run ON the GPU machine after scripts/gpu-real.sh, with mlx-lm
importable (gpu-bench.sh installs it into /tmp/site):

  PYTHONPATH=/tmp/site python3 scripts/gpu_near_tie.py $OUT/bench.json /tmp/models-real/qwen15

Top logits one bf16 step apart (0.125 at these magnitudes) are a rounding tie: either
token is the model's greedy choice depending on the order of the arithmetic.
"""
import json
import os
import sys

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu import mlx_lm_view  # noqa: E402


def main():
    bench, target = sys.argv[1], sys.argv[2]
    last = json.load(open(bench))["last_pass"]
    model, _ = load(mlx_lm_view(target))
    for i, (row, peer) in enumerate(zip(last["dspec_draft_model"]["rows"], last["mlx_lm"])):
        ours, theirs = row["tokens"], peer["plain_tokens"]
        at = next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if at is None:
            print(f"prompt {i}: identical")
            continue
        cache = make_prompt_cache(model)
        logits = model(mx.array([row["prompt_ids"]]), cache=cache)[:, -1]
        for token in ours[:at]:
            logits = model(mx.array([[token]]), cache=cache)[:, -1]
        values = logits.astype(mx.float32)[0]
        top = mx.argsort(-values)[:3].tolist()
        print(f"prompt {i}: first difference at generated token {at}: dspec {ours[at]}, "
              f"mlx-lm {theirs[at]}; mlx-lm's model there ({logits.dtype}): "
              + ", ".join(f"{t}: {values[t].item():.4f}" for t in top))


if __name__ == "__main__":
    main()
