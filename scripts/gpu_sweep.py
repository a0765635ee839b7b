#!/usr/bin/env python3
"""Plain greedy decode speed of dspec and mlx-lm under MLX CUDA backend settings.

MLX's CUDA backend batches kernels into CUDA graphs of MLX_MAX_OPS_PER_BUFFER nodes
(default 20) and caches MLX_CUDA_GRAPH_CACHE_SIZE instantiated graphs (default 100).
At decode sizes (per-token overhead, not bandwidth, bounds speed) these settings decide
how much host time each token costs. This runs, for each setting and in a fresh process
each time (MLX reads them once): `dspec bench` (plain greedy on its prompts, with the
breakdown of where decode time went) and mlx-lm greedy on the same prompt ids.

Usage: python3 scripts/gpu_sweep.py --dspec BIN --target DIR [--max-tokens 256]
           [--setting "MLX_MAX_OPS_PER_BUFFER=80" ...] [--json-out FILE]
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_gpu import mlx_lm_generate, mlx_lm_view, run_dspec_bench  # noqa: E402

DEFAULT_SETTINGS = [
    "",
    "MLX_MAX_OPS_PER_BUFFER=40",
    "MLX_MAX_OPS_PER_BUFFER=80",
    "MLX_MAX_OPS_PER_BUFFER=160",
    "MLX_MAX_OPS_PER_BUFFER=250",
    "MLX_MAX_OPS_PER_BUFFER=80 MLX_CUDA_GRAPH_CACHE_SIZE=2000",
    "MLX_USE_CUDA_GRAPHS=0",
]


def env_of(setting):
    env = dict(os.environ)
    for pair in setting.split():
        key, _, value = pair.partition("=")
        env[key] = value
    return env


def mlx_lm_child(target, prompts, max_tokens):
    """Runs in the child: greedy tok/s per prompt, after a warm-up."""
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = load(mlx_lm_view(target))
    greedy = make_sampler(temp=0.0)
    mlx_lm_generate(stream_generate, model, tokenizer, prompts[0], 16, greedy)
    rows = []
    for ids in prompts:
        tokens, tps, _ = mlx_lm_generate(stream_generate, model, tokenizer, ids, max_tokens,
                                         greedy)
        rows.append({"tokens": len(tokens), "tps": tps})
    print(json.dumps(rows))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dspec", default="target/release/dspec")
    ap.add_argument("--target", required=True)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--setting", action="append",
                    help="space-separated VAR=VALUE pairs (repeatable; '' = defaults)")
    ap.add_argument("--skip-mlx-lm", action="store_true")
    ap.add_argument("--json-out")
    ap.add_argument("--child-mlx-lm", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_mlx_lm:
        mlx_lm_child(args.target, json.loads(args.child_mlx_lm), args.max_tokens)
        return

    results = []
    for setting in args.setting or DEFAULT_SETTINGS:
        env = env_of(setting)
        report = run_dspec_bench(args.dspec, args.target, "ngram", 4, args.max_tokens, [],
                                 env)
        rows = report["rows"]
        breakdown = {k: sum((r["plain"].get("decode_breakdown") or {}).get(k, 0.0)
                            for r in rows)
                     for k in ("building_seconds", "queueing_seconds", "waiting_seconds")}
        decode_s = sum(r["plain"]["decode_seconds"] for r in rows)
        steps = sum(max(r["plain"]["generated_tokens"] - 1, 0) for r in rows)
        line = {"setting": setting or "(defaults)",
                "dspec_greedy_tps": report["plain_tokens_per_second"],
                "dspec_ngram_tps": report["speculative_tokens_per_second"],
                "dspec_ms_per_token": {k.replace("_seconds", ""): 1e3 * v / max(steps, 1)
                                       for k, v in breakdown.items()},
                "dspec_decode_ms_per_token": 1e3 * decode_s / max(steps, 1)}
        if not args.skip_mlx_lm:
            prompts = json.dumps([r["prompt_ids"] for r in rows])
            out = subprocess.run([sys.executable, __file__, "--target", args.target,
                                  "--max-tokens", str(args.max_tokens),
                                  "--child-mlx-lm", prompts],
                                 env=env, capture_output=True, text=True)
            try:
                peer = json.loads(out.stdout.strip().splitlines()[-1])
                n = sum(max(p["tokens"] - 1, 0) for p in peer)
                line["mlx_lm_greedy_tps"] = n / sum(max(p["tokens"] - 1, 0) / p["tps"]
                                                    for p in peer if p["tps"] > 0)
            except (IndexError, json.JSONDecodeError, ZeroDivisionError):
                line["mlx_lm_error"] = out.stderr[-2000:]
        results.append(line)
        print(json.dumps(line), flush=True)
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
