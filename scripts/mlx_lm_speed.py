#!/usr/bin/env python3
"""mlx-lm's decode and prefill speed on a model directory, for side-by-side tables with
`dspec generate` and `dspec bench` (docs/benchmarks.md).

Greedy decoding of --max-tokens after --prompt (--runs times, each with mlx-lm's own
tok/s), then prefill of synthetic prompts of --prefill-lengths tokens (a warm-up and a
timed run each). One JSON line per measurement on stdout.

Usage: mlx_lm_speed.py MODEL_DIR [--prompt TEXT] [--max-tokens 256] [--runs 3]
                       [--prefill-lengths 1024,4096]
"""

import argparse
import json

from mlx_lm import load, stream_generate
from mlx_lm.sample_utils import make_sampler


def last_response(model, tokenizer, prompt, max_tokens):
    last = None
    for response in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens,
                                    sampler=make_sampler(temp=0.0)):
        last = response
    return last


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--prompt", default="Write a Python function that parses a CSV file of "
                   "sales records and returns the total per region, with tests.")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--prefill-lengths", default="1024,4096")
    a = p.parse_args()
    model, tokenizer = load(a.model)
    ids = tokenizer.encode(a.prompt)
    for run in range(a.runs):
        r = last_response(model, tokenizer, ids, a.max_tokens)
        print(json.dumps({"what": "decode", "run": run, "tokens": r.generation_tokens,
                          "decode_tps": round(r.generation_tps, 1),
                          "prompt_tps": round(r.prompt_tps, 1),
                          "peak_gb": round(r.peak_memory, 2)}), flush=True)
    filler = tokenizer.encode(" the quick brown fox jumps over the lazy dog")
    for length in [int(x) for x in a.prefill_lengths.split(",") if x]:
        prompt = (filler * (length // len(filler) + 1))[:length]
        for run in ("warm-up", "timed"):
            r = last_response(model, tokenizer, prompt, 1)
        print(json.dumps({"what": "prefill", "length": length,
                          "prompt_tps": round(r.prompt_tps, 1)}), flush=True)


if __name__ == "__main__":
    main()
