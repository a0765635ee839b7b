#!/usr/bin/env python3
"""How long MLX's first call of a custom CUDA kernel takes in a fresh process (NVRTC
compiles it; MLX keeps custom kernels out of its disk cache): an empty kernel, then
dspec's product and attention kernels (sources read from adapters/src/cuda/*.rs).

Usage: python3 scripts/gpu_kernel_compile_time.py
"""

import struct
import time

import mlx.core as mx

from gpu_product_layouts import rust_kernel_source


def timed(label, fn):
    t = time.perf_counter()
    mx.eval(fn())
    first = time.perf_counter() - t
    t = time.perf_counter()
    mx.eval(fn())
    print(f"{label}: first call {first * 1e3:.0f} ms, second {(time.perf_counter() - t) * 1e3:.2f} ms",
          flush=True)


def main():
    x = mx.ones((1, 4, 64), dtype=mx.bfloat16)
    w = mx.ones((32, 64), dtype=mx.bfloat16)
    q = mx.ones((1, 2, 4, 128), dtype=mx.bfloat16)
    kv = mx.ones((1, 1, 16, 128), dtype=mx.bfloat16)
    mx.eval(x, w, q, kv)
    empty = mx.fast.cuda_kernel(name="empty", input_names=["x"], output_names=["out"],
                                source="out[0] = x[0];")
    timed("empty kernel", lambda: empty(inputs=[x], template=[("T", mx.bfloat16)], grid=(32, 1, 1),
                                        threadgroup=(32, 1, 1), output_shapes=[(1,)],
                                        output_dtypes=[mx.bfloat16])[0])
    product = mx.fast.cuda_kernel(name="product", input_names=["x", "w"], output_names=["out"],
                                  source=rust_kernel_source("product.rs"))
    timed("product kernel", lambda: product(
        inputs=[x, w], template=[("T", mx.bfloat16), ("MAX_ROWS", 8), ("COLS", 4)],
        grid=(8 * 32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(1, 4, 32)],
        output_dtypes=[mx.bfloat16])[0])
    attention = mx.fast.cuda_kernel(name="attention", input_names=["q", "k", "v"],
                                    output_names=["out"], ensure_row_contiguous=False,
                                    source=rust_kernel_source("attention.rs"))
    bits = struct.unpack("<i", struct.pack("<f", 128 ** -0.5))[0]
    timed("attention kernel", lambda: attention(
        inputs=[q, kv, kv], template=[("T", mx.bfloat16), ("D", 128), ("WARPS", 4), ("WINDOW", 0),
                                      ("SCALE_BITS", bits)],
        grid=(2 * 4 * 128, 1, 1), threadgroup=(128, 1, 1), output_shapes=[(1, 4, 256)],
        output_dtypes=[mx.bfloat16])[0])


if __name__ == "__main__":
    main()
