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
  - kernel: one product of w rows through a custom CUDA kernel (MLX's cuda_kernel,
            compiled by NVRTC once per row bound): the weight read once for all rows,
            launched as one kernel node (no cuBLASLt set-up, no stream capture).
Attention (`--attention`, for w > 1): sdpa (MLX's, cuDNN on CUDA, over the whole buffer
with an additive mask), kernel (a custom kernel reading only the visible keys, writing
its output in the o product's layout), or skip (none at all: what attention costs).
Each is timed twice: waited (build, evaluate, wait; a verify whose result decides the
next round) and queued (20 forwards in a chain, each queued before the one before it is
read, as plain decoding keeps steps in flight); "host" is the time spent building and
queueing per forward in the queued runs. Medians of `--runs` runs.

Usage: python3 scripts/gpu_product_layouts.py [--shape 1.5b|7b] [--widths 1,2,4,8,16,32]
           [--layouts gemm,rows,chunks,gather,kernel] [--attention sdpa,kernel,skip]
"""

import argparse
import statistics
import time

import mlx.core as mx

SHAPES = {
    # hidden, intermediate, heads, kv heads, head dim, layers (Qwen2.5-Coder-1.5B / Qwen2.5-7B)
    "1.5b": (1536, 8960, 12, 2, 128, 28),
    "7b": (3584, 18944, 28, 4, 128, 28),
}


PRODUCT_SOURCE = """
    constexpr int VEC = 16 / sizeof(T);
    const int rows = x_shape[0];
    const int K = x_shape[1];
    const int N = w_shape[0];
    const int col0 = blockIdx.x * COLS;
    const int t = threadIdx.x;
    float acc[ROWS][COLS];
    #pragma unroll
    for (int r = 0; r < ROWS; r++) {
        #pragma unroll
        for (int c = 0; c < COLS; c++) acc[r][c] = 0.0f;
    }
    for (int k = t * VEC; k < K; k += WARPS * 32 * VEC) {
        uint4 wv[COLS];
        #pragma unroll
        for (int c = 0; c < COLS; c++) {
            wv[c] = col0 + c < N
                ? *reinterpret_cast<const uint4*>(w + (long long)(col0 + c) * K + k)
                : make_uint4(0, 0, 0, 0);
        }
        #pragma unroll
        for (int r = 0; r < ROWS; r++) {
            if (r < rows) {
                uint4 xv = *reinterpret_cast<const uint4*>(x + (long long)r * K + k);
                const T* xe = reinterpret_cast<const T*>(&xv);
                #pragma unroll
                for (int c = 0; c < COLS; c++) {
                    const T* we = reinterpret_cast<const T*>(&wv[c]);
                    #pragma unroll
                    for (int i = 0; i < VEC; i++) {
                        acc[r][c] += static_cast<float>(xe[i]) * static_cast<float>(we[i]);
                    }
                }
            }
        }
    }
    __shared__ float part[WARPS][ROWS * COLS];
    const int lane = t & 31, warp = t >> 5;
    #pragma unroll
    for (int r = 0; r < ROWS; r++) {
        if (r < rows) {
            #pragma unroll
            for (int c = 0; c < COLS; c++) {
                float s = acc[r][c];
                #pragma unroll
                for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
                if (lane == 0) part[warp][r * COLS + c] = s;
            }
        }
    }
    __syncthreads();
    for (int i = t; i < rows * COLS; i += WARPS * 32) {
        const int r = i / COLS, c = i % COLS;
        if (col0 + c < N) {
            float s = 0.0f;
            #pragma unroll
            for (int g = 0; g < WARPS; g++) s += part[g][i];
            out[(long long)r * N + col0 + c] = static_cast<T>(s);
        }
    }
"""

# Attention of W queries (q: [1, H, W, D], rotated) over the first lens[i] keys of a
# cache buffer (k, v: [1, KVH, L, D]); out: [1, W, H, D]. One block per (head, query),
# each half-warp takes one key at a time with 8 dims per lane, online softmax, and the
# eight partial states are merged through shared memory.
ATTENTION_SOURCE = """
    const int H = q_shape[1], W = q_shape[2], D = 128;
    const int KVH = k_shape[1], L = k_shape[2];
    const int h = blockIdx.x / W, i = blockIdx.x % W;
    const int kvh = h / (H / KVH);
    const int n = lens[i];
    const int t = threadIdx.x, warp = t >> 5, lane = t & 31;
    const int half = lane >> 4, sub = lane & 15, g = warp * 2 + half;
    float qf[8];
    {
        uint4 qv = *reinterpret_cast<const uint4*>(q + ((long long)h * W + i) * D + sub * 8);
        const T* qe = reinterpret_cast<const T*>(&qv);
        #pragma unroll
        for (int d = 0; d < 8; d++) qf[d] = static_cast<float>(qe[d]) * rsqrtf((float)D);
    }
    const T* kb = k + (long long)kvh * L * D + sub * 8;
    const T* vb = v + (long long)kvh * L * D + sub * 8;
    float m = -3.0e38f, l = 0.0f, acc[8];
    #pragma unroll
    for (int d = 0; d < 8; d++) acc[d] = 0.0f;
    // Whole warps step together (the shuffles need every lane); a half-warp past the
    // last key computes on key 0 and discards it.
    for (int j0 = warp * 2; j0 < n; j0 += 8) {
        const int j = j0 + half < n ? j0 + half : 0;
        uint4 kv = *reinterpret_cast<const uint4*>(kb + (long long)j * D);
        uint4 vv = *reinterpret_cast<const uint4*>(vb + (long long)j * D);
        const T* ke = reinterpret_cast<const T*>(&kv);
        const T* ve = reinterpret_cast<const T*>(&vv);
        float s = 0.0f;
        #pragma unroll
        for (int d = 0; d < 8; d++) s += qf[d] * static_cast<float>(ke[d]);
        #pragma unroll
        for (int o = 8; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (j0 + half < n) {
            const float m_new = fmaxf(m, s);
            const float corr = __expf(m - m_new), p = __expf(s - m_new);
            l = l * corr + p;
            #pragma unroll
            for (int d = 0; d < 8; d++) acc[d] = acc[d] * corr + p * static_cast<float>(ve[d]);
            m = m_new;
        }
    }
    __shared__ float sm_m[8], sm_l[8], sm_acc[8][128];
    if (sub == 0) { sm_m[g] = m; sm_l[g] = l; }
    #pragma unroll
    for (int d = 0; d < 8; d++) sm_acc[g][sub * 8 + d] = acc[d];
    __syncthreads();
    float big = sm_m[0];
    #pragma unroll
    for (int e = 1; e < 8; e++) big = fmaxf(big, sm_m[e]);
    float num = 0.0f, den = 0.0f;
    #pragma unroll
    for (int e = 0; e < 8; e++) {
        const float f = __expf(sm_m[e] - big);
        num += sm_acc[e][t] * f;
        den += sm_l[e] * f;
    }
    out[((long long)i * H + h) * D + t] = static_cast<T>(num / den);
"""

_kernels = {}


def kernel(name, inputs, source):
    if name not in _kernels:
        _kernels[name] = mx.fast.cuda_kernel(name=name, input_names=inputs,
                                             output_names=["out"], source=source)
    return _kernels[name]


def kernel_product(x, w):
    rows, n = x.shape[0], w.shape[0]
    bound = next(b for b in (2, 4, 8, 16, 32) if rows <= b)
    cols = 4 if bound <= 16 else 2
    groups = (n + cols - 1) // cols
    warps = 1
    while warps < 8 and groups * warps < 2048:
        warps *= 2
    return kernel("dspec_rows_product", ["x", "w"], PRODUCT_SOURCE)(
        inputs=[x, w], template=[("T", x.dtype), ("ROWS", bound), ("COLS", cols),
                                 ("WARPS", warps)],
        grid=(groups * warps * 32, 1, 1), threadgroup=(warps * 32, 1, 1),
        output_shapes=[(rows, n)], output_dtypes=[x.dtype])[0]


def kernel_attention(q, k, v, lens):
    """Scaled by 1/sqrt(head dim), as every model here."""
    _, heads, w, hd = q.shape
    assert hd == 128
    return kernel("dspec_short_attention", ["q", "k", "v", "lens"], ATTENTION_SOURCE)(
        inputs=[q, k, v, lens], template=[("T", q.dtype)],
        grid=(heads * w * 128, 1, 1), threadgroup=(128, 1, 1),
        output_shapes=[(1, w, heads, hd)], output_dtypes=[q.dtype])[0]


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

    def __call__(self, h, layout, mask, offset, attention="sdpa", lens=None):
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
            a = kernel_attention(q, self.k_cache, self.v_cache, lens)
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


def check_kernels(layer, hidden, offset, cache):
    """The custom kernels against MLX's own operations (relative max difference)."""
    for w in (2, 5, 16, 32):
        x = mx.random.normal((w, hidden)).astype(mx.bfloat16)
        for p in (layer.qkv, layer.down if w == 2 else layer.o):
            xin = x if p.k == hidden else mx.random.normal((w, p.k)).astype(mx.bfloat16)
            want = (xin @ p.w.T).astype(mx.float32)
            got = kernel_product(xin, p.w).astype(mx.float32)
            err = (mx.abs(got - want).max() / mx.abs(want).max()).item()
            print(f"check product w={w} [{p.n}x{p.k}]: relative max difference {err:.2e}")
        q = mx.random.normal((1, layer.heads, w, layer.hd)).astype(mx.bfloat16)
        lens = mx.arange(offset + 1, offset + w + 1, dtype=mx.int32)
        k_pos = mx.arange(cache)[None]
        bias = mx.where(k_pos < lens[:, None], 0.0, -1e9).astype(mx.bfloat16)
        want = mx.fast.scaled_dot_product_attention(
            q, layer.k_cache, layer.v_cache, scale=layer.hd ** -0.5, mask=bias)
        want = want.transpose(0, 2, 1, 3).astype(mx.float32)
        got = kernel_attention(q, layer.k_cache, layer.v_cache, lens).astype(mx.float32)
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

    def forward(h, layout, mask, attention="sdpa", lens=None):
        for layer in layers:
            h = layer(h, layout, mask, offset, attention, lens)
        return h

    if "kernel" in args.layouts or "kernel" in args.attention:
        check_kernels(layers[0], hidden, offset, args.cache)

    print(f"shape {args.shape}: {len(layers)} layers, cache {args.cache}, chunks "
          f"{[(p.n, p.c) for p in (layers[0].qkv, layers[0].o, layers[0].gate_up, layers[0].down)]}")
    print("layout  attention  w  | waited ms | queued ms  host ms | queued / one-row queued")
    base = None
    for w in [int(x) for x in args.widths.split(",")]:
        mask = mx.zeros((w, args.cache), dtype=mx.bfloat16)
        lens = mx.arange(offset + 1, offset + w + 1, dtype=mx.int32)
        x0 = mx.random.normal((w, hidden)).astype(mx.bfloat16)
        mx.eval(mask, x0, lens)
        for layout, attention in [(la, at) for la in args.layouts.split(",")
                                  for at in args.attention.split(",")]:
            if w == 1 and attention != args.attention.split(",")[0]:
                continue
            if w == 1 and layout not in ("gemm", "gather"):
                continue
            if layout in ("rows", "chunks") and w > 16:
                continue
            for _ in range(2):
                mx.eval(forward(x0, layout, mask, attention, lens))
            waited, queued, host = [], [], []
            for _ in range(args.runs):
                t = time.perf_counter()
                mx.eval(forward(x0, layout, mask, attention, lens))
                waited.append(time.perf_counter() - t)
                n, h, spent = 20, x0, 0.0
                t = time.perf_counter()
                for _ in range(n):
                    s = time.perf_counter()
                    h = forward(h, layout, mask, attention, lens) * 1e-3 + x0  # keep values bounded
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
