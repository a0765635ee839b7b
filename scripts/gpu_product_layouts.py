#!/usr/bin/env python3
"""What a forward of w positions costs on this backend against one position, by how its
dense products are laid out, for the layer shapes of a real model (no weights needed).

A stack of `--layers` decoder-like layers with random bf16 weights (fused q/k/v product,
RMS norms, RoPE, attention of w queries over a cache buffer of `--cache` positions, the
output product, fused gate/up product with a gated activation, down product; the cache
is read, not written) runs for each width w and product layout:
  - gemm:   one product of w rows (MLX: gemv for one row; on CUDA cuBLASLt for more);
  - rows:   w one-row products in one batched call (MLX's gemv kernel for every w; the
            weight is read once per row unless the cache holds it);
  - gather: one product of w rows through MLX's gather_mm with a single weight (on CUDA
            a JIT-compiled CUTLASS kernel, not cuBLASLt);
  - chunks: as rows, the weight cut into chunks of about `--chunk-mb` MB with the w
            rows of one chunk next to each other in the batch, so that each chunk is
            read from memory once and from the cache for the other rows;
  - kernel: dspec's product kernel (adapters/src/cuda/product.rs, w <= 8): the weight
            read once for all rows, one kernel node (no cuBLASLt set-up or capture).
Attention (`--attention`, for w > 1): sdpa (MLX's, cuDNN on CUDA, over the whole buffer
with an additive mask), kernel (dspec's, adapters/src/cuda/attention.rs, w <= 8: the
visible keys only, output in the o product's layout), or skip (none: what attention
costs).
Each is timed twice: waited (build, evaluate, wait; a verify whose result decides the
next round) and queued (20 forwards in a chain, each queued before the one before it is
read, as plain decoding keeps steps in flight); "host" is the time spent building and
queueing per forward in the queued runs. Medians of `--runs` runs.

Usage: python3 scripts/gpu_product_layouts.py [--shape 1.5b|7b] [--widths 1,2,4,8,16,32]
           [--layouts gemm,rows,chunks,gather,kernel] [--attention sdpa,kernel,skip]
"""

import argparse
import os
import re
import statistics
import struct
import time

import mlx.core as mx

SHAPES = {
    # hidden, intermediate, heads, kv heads, head dim, layers (Qwen2.5-Coder-1.5B / Qwen2.5-7B)
    "1.5b": (1536, 8960, 12, 2, 128, 28),
    "7b": (3584, 18944, 28, 4, 128, 28),
}


def rust_kernel_source(path):
    """The body of a kernel dspec ships (`const SOURCE` in adapters/src/cuda/*.rs)."""
    here = os.path.dirname(os.path.abspath(__file__))
    text = open(os.path.join(here, "..", "adapters", "src", "cuda", path)).read()
    return re.search(r'const SOURCE: &str = r#"(.*?)"#;', text, re.S).group(1)


_kernels = {}


def kernel(name, inputs, path, row_contiguous):
    if name not in _kernels:
        _kernels[name] = mx.fast.cuda_kernel(
            name=name, input_names=inputs, output_names=["out"],
            source=rust_kernel_source(path), ensure_row_contiguous=row_contiguous)
    return _kernels[name]


# As adapters/src/cuda/product.rs launches its kernel.
KERNEL_MAX_ROWS, KERNEL_COLS = 8, 4


def kernel_product(x, w):
    """dspec's product kernel: x [rows <= 8, K] times w [N, K]."""
    rows, n, k = x.shape[0], w.shape[0], w.shape[1]
    groups = (n + KERNEL_COLS - 1) // KERNEL_COLS
    by_inputs, warps = min(max(k // 256, 1), 8), 1
    while warps * 2 <= by_inputs and groups * warps < 2048:
        warps *= 2
    return kernel("dspec_rows_product", ["x", "w"], "product.rs", True)(
        inputs=[x, w], template=[("T", x.dtype), ("MAX_ROWS", KERNEL_MAX_ROWS),
                                 ("COLS", KERNEL_COLS)],
        grid=(groups * warps * 32, 1, 1), threadgroup=(warps * 32, 1, 1),
        output_shapes=[(rows, n)], output_dtypes=[x.dtype])[0]


def kernel_attention(q, k, v):
    """dspec's attention kernel: the W queries of q [1, H, W, D] are the last W positions
    of k, v [1, KVH, total, D] (any strides); out [1, W, H * D]."""
    _, heads, w, hd = q.shape
    bits = struct.unpack("<i", struct.pack("<f", hd ** -0.5))[0]
    return kernel("dspec_short_attention", ["q", "k", "v"], "attention.rs", False)(
        inputs=[q, k, v], template=[("T", q.dtype), ("D", hd), ("WARPS", 4), ("WINDOW", 0),
                                    ("SCALE_BITS", bits)],
        grid=(heads * w * 128, 1, 1), threadgroup=(128, 1, 1),
        output_shapes=[(1, w, heads * hd)], output_dtypes=[q.dtype])[0]


def chunk_count(n, k, chunk_mb):
    """A divisor of n giving chunks of about chunk_mb MB of bf16 [n/c, k] rows."""
    want = max(1, round(n * k * 2 / (chunk_mb * 1e6)))
    return min((c for c in range(1, n + 1) if n % c == 0 and (n // c) % 8 == 0),
               key=lambda c: abs(c - want))


class Product:
    def __init__(self, n, k, chunk_mb):
        self.w = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
        self.n, self.k = n, k
        self.index = mx.array([0], dtype=mx.uint32)
        self.c = chunk_count(n, k, chunk_mb)
        # [C, K, N/C]: each chunk transposed, as a view.
        self.chunks_t = self.w.reshape(self.c, n // self.c, k).transpose(0, 2, 1)[:, None]

    def __call__(self, x, layout):
        rows = x.shape[0]
        if layout == "gemm" or rows == 1 and layout not in ("chunks", "gather"):
            return x @ self.w.T
        if layout == "kernel":
            return kernel_product(x, self.w)
        if layout == "gather":
            return mx.gather_mm(x[None], self.w.T[None], lhs_indices=self.index,
                                rhs_indices=self.index)[0]
        # [rows, 1, K] as a transposed view: MLX's CUDA matmul then keeps the rows apart
        # (a row-contiguous one would be folded back into one product of `rows` rows).
        apart = x.reshape(rows, self.k, 1).swapaxes(1, 2)
        if layout == "rows":
            return (apart @ self.w.T).reshape(rows, self.n)
        out = apart[None] @ self.chunks_t  # [C, rows, 1, N/C], rows of a chunk adjacent
        return out.transpose(1, 2, 0, 3).reshape(rows, self.n)


class Layer:
    def __init__(self, shape, chunk_mb, cache):
        hidden, inter, heads, kv, hd, _ = shape
        self.heads, self.kv, self.hd, self.inter = heads, kv, hd, inter
        self.qkv = Product((heads + 2 * kv) * hd, hidden, chunk_mb)
        self.o = Product(hidden, heads * hd, chunk_mb)
        self.gate_up = Product(2 * inter, hidden, chunk_mb)
        self.down = Product(hidden, inter, chunk_mb)
        self.norms = [mx.ones((hidden,), dtype=mx.bfloat16) for _ in range(2)]
        self.k_cache = mx.random.normal((1, kv, cache, hd)).astype(mx.bfloat16)
        self.v_cache = mx.random.normal((1, kv, cache, hd)).astype(mx.bfloat16)

    def arrays(self):
        return [self.qkv.w, self.o.w, self.gate_up.w, self.down.w, self.k_cache, self.v_cache]

    def __call__(self, h, layout, mask, offset, attention="sdpa"):
        w = h.shape[0]
        x = mx.fast.rms_norm(h, self.norms[0], 1e-6)
        qkv = self.qkv(x, layout)
        q = qkv[:, : self.heads * self.hd].reshape(1, w, self.heads, self.hd).transpose(0, 2, 1, 3)
        k = qkv[:, self.heads * self.hd:(self.heads + self.kv) * self.hd]
        k = k.reshape(1, w, self.kv, self.hd).transpose(0, 2, 1, 3)
        q = mx.fast.rope(q, self.hd, traditional=False, base=1e6, scale=1.0, offset=offset)
        k = mx.fast.rope(k, self.hd, traditional=False, base=1e6, scale=1.0, offset=offset)
        if w == 1:
            keys, values = self.k_cache[:, :, :offset], self.v_cache[:, :, :offset]
            a = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.hd ** -0.5)
        elif attention == "skip":
            a = q
        elif attention == "kernel":
            end = offset + w
            a = kernel_attention(q, self.k_cache[:, :, :end], self.v_cache[:, :, :end])
        else:
            a = mx.fast.scaled_dot_product_attention(
                q, self.k_cache, self.v_cache, scale=self.hd ** -0.5, mask=mask)
        if w == 1 or attention != "kernel":
            a = a.transpose(0, 2, 1, 3)
        a = a.reshape(w, self.heads * self.hd)
        h = h + self.o(a, layout)
        x = mx.fast.rms_norm(h, self.norms[1], 1e-6)
        gu = self.gate_up(x, layout)
        h = h + self.down(gated(gu[:, : self.inter], gu[:, self.inter:]), layout)
        return h


def check_kernels(layer, hidden, offset):
    """dspec's kernels against MLX's own operations (relative max difference)."""
    for w in (2, 5, KERNEL_MAX_ROWS):
        x = mx.random.normal((w, hidden)).astype(mx.bfloat16)
        for p in (layer.qkv, layer.down if w == 2 else layer.o):
            xin = x if p.k == hidden else mx.random.normal((w, p.k)).astype(mx.bfloat16)
            want = (xin @ p.w.T).astype(mx.float32)
            got = kernel_product(xin, p.w).astype(mx.float32)
            err = (mx.abs(got - want).max() / mx.abs(want).max()).item()
            print(f"check product w={w} [{p.n}x{p.k}]: relative max difference {err:.2e}")
        q = mx.random.normal((1, layer.heads, w, layer.hd)).astype(mx.bfloat16)
        keys, values = layer.k_cache[:, :, :offset + w], layer.v_cache[:, :, :offset + w]
        want = mx.fast.scaled_dot_product_attention(
            q, keys, values, scale=layer.hd ** -0.5, mask="causal")
        want = want.transpose(0, 2, 1, 3).reshape(1, w, -1).astype(mx.float32)
        got = kernel_attention(q, keys, values).astype(mx.float32)
        err = (mx.abs(got - want).max() / mx.abs(want).max()).item()
        print(f"check attention w={w}: relative max difference {err:.2e}")


@mx.compile
def gated(g, u):
    return mx.sigmoid(g) * g * u


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=SHAPES, default="1.5b")
    ap.add_argument("--widths", default="1,2,4,8,16,32")
    ap.add_argument("--layouts", default="gemm,rows,chunks")
    ap.add_argument("--attention", default="sdpa")
    ap.add_argument("--layers", type=int, default=0, help="default: the shape's")
    ap.add_argument("--cache", type=int, default=1024)
    ap.add_argument("--chunk-mb", type=float, default=2.0)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    layers = [Layer(shape, args.chunk_mb, args.cache) for _ in range(args.layers or shape[5])]
    mx.eval([a for layer in layers for a in layer.arrays()])
    hidden = shape[0]
    offset = args.cache // 2

    def forward(h, layout, mask, attention="sdpa"):
        for layer in layers:
            h = layer(h, layout, mask, offset, attention)
        return h

    if "kernel" in args.layouts or "kernel" in args.attention:
        check_kernels(layers[0], hidden, offset)

    print(f"shape {args.shape}: {len(layers)} layers, cache {args.cache}, chunks "
          f"{[(p.n, p.c) for p in (layers[0].qkv, layers[0].o, layers[0].gate_up, layers[0].down)]}")
    print("layout  attention  w  | waited ms | queued ms  host ms | queued / one-row queued")
    base = None
    for w in [int(x) for x in args.widths.split(",")]:
        mask = mx.zeros((w, args.cache), dtype=mx.bfloat16)
        x0 = mx.random.normal((w, hidden)).astype(mx.bfloat16)
        mx.eval(mask, x0)
        for layout, attention in [(la, at) for la in args.layouts.split(",")
                                  for at in args.attention.split(",")]:
            if w == 1 and attention != args.attention.split(",")[0]:
                continue
            if w == 1 and layout not in ("gemm", "gather"):
                continue
            if layout in ("rows", "chunks") and w > 16:
                continue
            if "kernel" in (layout, attention) and w > KERNEL_MAX_ROWS:
                continue
            for _ in range(2):
                mx.eval(forward(x0, layout, mask, attention))
            waited, queued, host = [], [], []
            for _ in range(args.runs):
                t = time.perf_counter()
                mx.eval(forward(x0, layout, mask, attention))
                waited.append(time.perf_counter() - t)
                n, h, spent = 20, x0, 0.0
                t = time.perf_counter()
                for _ in range(n):
                    s = time.perf_counter()
                    h = forward(h, layout, mask, attention) * 1e-3 + x0  # keep values bounded
                    mx.async_eval(h)
                    spent += time.perf_counter() - s
                mx.eval(h)
                queued.append((time.perf_counter() - t) / n)
                host.append(spent / n)
            wt, qt, ht = (statistics.median(v) * 1e3 for v in (waited, queued, host))
            if w == 1:
                base = qt
            ratio = f"{qt / base:.2f}" if base else "-"
            print(f"{layout:7s} {attention:9s} {w:2d} | {wt:9.2f} | {qt:9.2f} {ht:8.2f} | {ratio}", flush=True)


if __name__ == "__main__":
    main()
