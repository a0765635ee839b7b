"""Time products on MLX's CPU backend with the weight in the checkpoint's layout
([out, in], read transposed) and copied to [in, out], at the row counts decoding uses.

Each pass multiplies x ([M, in]) by every weight of a stack of Qwen2.5-1.5B MLP-shaped
matrices (8960 x 1536, more bytes than any cache) and reports the weights' bytes over
the time: one pass reads every weight once, as a decode step or a verify does.

Usage: python scripts/cpu_weight_layout.py [--passes N] [--dtype float32|bfloat16|float16]
       (any Python with mlx; scripts/bench-vs-mlx-lm.sh builds target/mlx-lm-venv,
       whose MLX uses OpenBLAS as dspec's build does)
"""

import argparse
import statistics
import time

import mlx.core as mx


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--matrices", type=int, default=48)
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    args = ap.parse_args()
    dtype = getattr(mx, args.dtype)
    mx.set_default_device(mx.cpu)
    out_dim, in_dim = 8960, 1536
    rows = [mx.random.normal((out_dim, in_dim)).astype(dtype) for _ in range(args.matrices)]
    cols = [mx.contiguous(w.T) for w in rows]
    mx.eval(rows, cols)
    gbytes = args.matrices * out_dim * in_dim * rows[0].itemsize / 1e9
    print(f"{args.matrices} weights of {out_dim}x{in_dim} {args.dtype} ({gbytes:.1f} GB), "
          f"median of {args.passes} passes, GB/s of weights read")
    print(f"{'rows':>4} {'[out,in] read transposed':>26} {'[in,out] copy':>14} {'ratio':>6}")
    for m in [1, 2, 4, 8, 16, 32]:
        x = mx.random.normal((m, in_dim)).astype(dtype)
        mx.eval(x)
        speeds = {}
        for name, weights in (("rows", [w.T for w in rows]), ("cols", cols)):
            times = []
            for _ in range(args.passes):
                start = time.perf_counter()
                mx.eval([x @ w for w in weights])
                times.append(time.perf_counter() - start)
            speeds[name] = gbytes / statistics.median(times)
        print(f"{m:>4} {speeds['rows']:>26.1f} {speeds['cols']:>14.1f} "
              f"{speeds['cols'] / speeds['rows']:>5.2f}x")


if __name__ == "__main__":
    main()
