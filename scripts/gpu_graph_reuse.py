#!/usr/bin/env python3
"""Whether a multi-row product or attention costs a CUDA graph more than its own launch.

MLX (0.32.2, CUDA) records up to 100 operations per CUDA graph and reuses a graph's
executable from one evaluation to the next where it can update it in place; a graph
holding a node it cannot update is instantiated anew on every evaluation.

Every case evaluates 10 segments of 100 operations on 1536-wide bf16 rows (so about one
segment per MLX graph), waited; the cases take turns, medians of `--runs`:
  base:        each segment 98 one-row products in a chain (MLX's gemv), one more
               one-row product of another row, added into the chain;
  <op>-spread: the same with that one product replaced by <op>: gemm-R (a product of R
               rows: cuBLASLt, captured per call), sdpa-R (attention of R queries over a
               1,024-position buffer with an additive mask: cuDNN), kernel-R (a product
               of R <= 8 rows through dspec's kernel: one kernel node);
  <op>-chain:  1,000 such operations in a chain.
"extra per segment" = (spread - base) / 10: the op's own cost over a gemv's plus any
cost it brings on its graph. "extra per op" = (chain - base) / 1000: its own cost with
the graph's cost spread over 100 ops. An op whose first figure is far above its second
makes its whole graph dearer (re-instantiated rather than updated).

Usage: python3 scripts/gpu_graph_reuse.py [--rows 2,8,32] [--runs 20]
"""

import argparse
import statistics
import time

import mlx.core as mx

from gpu_product_layouts import KERNEL_MAX_ROWS, kernel_product

WIDTH, HEADS, HEAD_DIM, BUFFER = 1536, 12, 128, 1024


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="2,8,32")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--ops", default="gemm,sdpa,kernel")
    args = ap.parse_args()
    w = (mx.random.normal((WIDTH, WIDTH)) * WIDTH ** -0.5).astype(mx.bfloat16)
    x1 = mx.random.normal((1, WIDTH)).astype(mx.bfloat16)
    y1 = mx.random.normal((1, WIDTH)).astype(mx.bfloat16)
    kc = mx.random.normal((1, 2, BUFFER, HEAD_DIM)).astype(mx.bfloat16)
    vc = mx.random.normal((1, 2, BUFFER, HEAD_DIM)).astype(mx.bfloat16)
    mx.eval(w, x1, y1, kc, vc)
    inputs = {}
    for r in [int(v) for v in args.rows.split(",")]:
        inputs[r] = (mx.random.normal((r, WIDTH)).astype(mx.bfloat16),
                     mx.random.normal((1, HEADS, r, HEAD_DIM)).astype(mx.bfloat16),
                     mx.zeros((1, 1, r, BUFFER), dtype=mx.bfloat16))
        mx.eval(*inputs[r])

    def op(kind, r):
        if kind == "gemv":
            return lambda: y1 @ w.T
        xr, q, mask = inputs[r]
        if kind == "gemm":
            return lambda: xr @ w.T
        if kind == "kernel":
            return lambda: kernel_product(xr, w)
        return lambda: mx.fast.scaled_dot_product_attention(
            q, kc, vc, scale=HEAD_DIM ** -0.5, mask=mask).reshape(-1, WIDTH)

    def spread(one):
        x = x1
        for _ in range(10):
            for _ in range(98):
                x = x @ w.T
            x = x + one()[:1]
        return x

    def chain(kind, r):
        xr = inputs[r][0]
        for _ in range(1000):
            xr = xr @ w.T if kind == "gemm" else kernel_product(xr, w)
        return xr

    cases = {"base": lambda: spread(op("gemv", 1))}
    for r in inputs:
        for kind in args.ops.split(","):
            if kind == "kernel" and r > KERNEL_MAX_ROWS:
                continue
            cases[f"{kind}-{r}-spread"] = (lambda k, r: lambda: spread(op(k, r)))(kind, r)
            if kind != "sdpa":
                cases[f"{kind}-{r}-chain"] = (lambda k, r: lambda: chain(k, r))(kind, r)
    for make in cases.values():
        for _ in range(3):
            mx.eval(make())
    times = {name: [] for name in cases}
    for _ in range(args.runs):
        for name, make in cases.items():
            out = make()
            t = time.perf_counter()
            mx.eval(out)
            times[name].append(time.perf_counter() - t)
    med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
    print(f"base: {med['base']:.3f} ms for 1,000 ops (medians of {args.runs})")
    for name in cases:
        if name.endswith("-spread"):
            key = name[: -len("-spread")]
            line = f"{key:10s} extra per segment {(med[name] - med['base']) * 100:7.1f} µs"
            if f"{key}-chain" in med:
                line += f" | extra per op in a chain {(med[key + '-chain'] - med['base']):6.1f} µs"
            print(line, flush=True)


if __name__ == "__main__":
    main()
