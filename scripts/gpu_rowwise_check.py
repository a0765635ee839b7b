#!/usr/bin/env python3
"""Checks, on the machine's default MLX device (a CUDA GPU), the kernel fact dspec's
row-layout verify rests on (bitwise equality with one-token decoding): R rows handed over
as the view [R, in, 1] swapped to [R, 1, in], times the weight broadcast to [R, in, out],
are computed exactly as R one-row products. Exits non-zero when they are not.

For information it also shows what dspec avoids: rows a row's width apart (which MLX
folds into one matrix product) and two or three causal queries in one attention call
(on an H100 with MLX 0.32.2 both differ from one-row calls, which is why the row layout
attends position by position).
Shapes are Qwen2.5-Coder-1.5B's (12 query heads, 2 KV heads, head_dim 128; hidden 1536,
MLP 8960), bf16.

Usage (where `import mlx` works, e.g. the GPU machine): python3 scripts/gpu_rowwise_check.py
"""

import sys

import mlx.core as mx

HEADS, KV_HEADS, HEAD_DIM = 12, 2, 128


def case(offset, rows, seed):
    """Max |difference| (0.0 when bitwise equal) between one causal call over `rows`
    queries after `offset` cached keys and one call per query."""
    mx.random.seed(seed)
    total = offset + rows
    # Queries laid out as dspec's packed heads leave them: a transposed view.
    q = mx.random.normal((1, rows, HEADS, HEAD_DIM)).astype(mx.bfloat16).transpose(0, 2, 1, 3)
    k = mx.random.normal((1, KV_HEADS, total, HEAD_DIM)).astype(mx.bfloat16)
    v = mx.random.normal((1, KV_HEADS, total, HEAD_DIM)).astype(mx.bfloat16)
    scale = HEAD_DIM ** -0.5
    grouped = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
    singles = [
        mx.fast.scaled_dot_product_attention(
            q[:, :, r:r + 1], k[:, :, :offset + r + 1], v[:, :, :offset + r + 1], scale=scale)
        for r in range(rows)
    ]
    single = mx.concatenate(singles, axis=2)
    return mx.max(mx.abs(grouped.astype(mx.float32) - single.astype(mx.float32))).item()


def products(rows, k, n, seed):
    """Max |difference| from one-row products for the layout dspec uses on CUDA and for
    the dense rows MLX folds (information only)."""
    mx.random.seed(seed)
    x = mx.random.normal((rows, 1, k)).astype(mx.bfloat16)
    w_t = mx.random.normal((n, k)).astype(mx.bfloat16).T
    single = mx.concatenate([x[r:r + 1] @ w_t for r in range(rows)], axis=0)
    w = mx.broadcast_to(w_t, (rows, k, n))
    apart = x.reshape(rows, k, 1).swapaxes(1, 2) @ w
    folded = x @ w

    def diff(y):
        return mx.max(mx.abs(y.astype(mx.float32) - single.astype(mx.float32))).item()

    return diff(apart), diff(folded)


def main():
    print(f"device: {mx.default_device()}")
    failures = 0
    for rows, k, n in [(2, 1536, 2048), (5, 1536, 2048), (5, 1536, 17920), (5, 8960, 1536),
                       (7, 896, 151936)]:
        apart, folded = products(rows, k, n, seed=rows + k + n)
        verdict = "equal" if apart == 0.0 else f"DIFFERS (max {apart:.3g})"
        print(f"product rows {rows} {k}x{n}: {verdict}; folded rows would differ by {folded:.3g}")
        failures += apart != 0.0
    for offset in [4, 300, 1500]:
        for rows in [2, 3]:
            diff = case(offset, rows, seed=offset * 10 + rows)
            print(f"attention, {rows} causal queries in one call after {offset} keys: "
                  f"{'equal' if diff == 0.0 else f'differs by {diff:.3g}'} (information)")
    print("ok" if failures == 0 else f"{failures} product layout(s) differ")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
