#!/usr/bin/env python3
"""Host time MLX spends per operation on this backend, for the operations a verify of w
positions is made of: products of w rows (w = 1 takes MLX's gemv, w > 1 cuBLASLt on
CUDA), 4-bit products, and attention of w queries (1 query: MLX's vector kernel; more:
cuDNN on CUDA). Each case queues a graph of `n` independent operations of one kind and
times mx.eval of it (host work and device work), after warm-up, median of several runs.

Usage: python3 scripts/gpu_mlx_host_cost.py [--n 112]
"""

import argparse
import statistics
import time

import mlx.core as mx


def timed(build, runs=15):
    for _ in range(3):
        mx.eval(build())
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        outs = build()
        t_built = time.perf_counter()
        mx.eval(outs)
        times.append((time.perf_counter() - t, t_built - t))
    total = statistics.median(t for t, _ in times)
    built = statistics.median(b for _, b in times)
    return total, built


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=112)
    args = ap.parse_args()
    n = args.n
    dt = mx.bfloat16
    hidden, out = 1536, 1536
    w = mx.random.normal((out, hidden)).astype(dt)
    wq = mx.quantize(w, group_size=64, bits=4)
    rows = {r: mx.random.normal((1, r, hidden)).astype(dt) for r in (1, 2, 5, 9, 16)}
    mx.eval(w, wq, *rows.values())
    print(f"{n} operations per graph; ms per graph (of which building), then us per op")
    for r, x in rows.items():
        tot, built = timed(lambda: [x @ w.T + i for i in range(n)])
        tot0, _ = timed(lambda: [x + i for i in range(n)])
        print(f"bf16 product {r:2d} rows: {tot*1e3:7.2f} ms ({built*1e3:.2f})  "
              f"{(tot - tot0) / n * 1e6:6.1f} us/op over an add")
    for r, x in rows.items():
        tot, built = timed(lambda: [mx.quantized_matmul(x, *wq, transpose=True, group_size=64, bits=4) + i for i in range(n)])
        print(f"4-bit product {r:2d} rows: {tot*1e3:7.2f} ms ({built*1e3:.2f})")
    heads, kv, d, keys = 12, 2, 128, 510
    k = mx.random.normal((1, kv, keys, d)).astype(dt)
    v = mx.random.normal((1, kv, keys, d)).astype(dt)
    for q_len in (1, 2, 5, 9, 16):
        q = mx.random.normal((1, heads, q_len, d)).astype(dt)
        bias = mx.zeros((1, heads, q_len, keys), dtype=dt)
        mx.eval(q, k, v, bias)
        n_att = n // 4
        if q_len == 1:
            tot, built = timed(lambda: [mx.fast.scaled_dot_product_attention(q, k, v, scale=0.1) + i
                                        for i in range(n_att)])
        else:
            tot, built = timed(lambda: [mx.fast.scaled_dot_product_attention(q, k, v, scale=0.1, mask=bias) + i
                                        for i in range(n_att)])
        print(f"attention {q_len:2d} queries, {n_att} calls: {tot*1e3:7.2f} ms ({built*1e3:.2f})"
              f"  {tot / n_att * 1e6:6.1f} us/call")


if __name__ == "__main__":
    main()
