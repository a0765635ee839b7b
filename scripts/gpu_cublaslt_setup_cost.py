#!/usr/bin/env python3
"""Host time of what MLX 0.32's CUDA backend does before every product of more than one
row: create a cuBLASLt matmul descriptor, three matrix layouts and a preference, then
ask cuBLASLt's heuristic for an algorithm (`CublasGemm` is built per call, so the
heuristic runs on every product). Timed here through ctypes against the cuBLASLt that
MLX's CUDA wheel loads, for the bf16 products of a verify (rows x outputs x inputs of
Qwen2.5-Coder-1.5B's and Qwen2.5-7B's layers), median of many calls.

Usage: python3 scripts/gpu_cublaslt_setup_cost.py [--lib PATH] [--calls 500]
"""

import argparse
import ctypes
import glob
import site
import statistics
import time

CUBLAS_COMPUTE_32F = 68
CUDA_R_32F = 0
CUDA_R_16BF = 14
DESC_TRANSA, DESC_TRANSB = 3, 4
OP_N, OP_T = 0, 1
PREF_MAX_WORKSPACE_BYTES = 1

SHAPES = {
    "1.5b": [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)],
    "7b": [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)],
}


def find_lib():
    """The newest cuBLASLt under site-packages/nvidia (MLX's CUDA 13 wheel loads .so.13)."""
    found = [p for sp in site.getsitepackages()
             for p in glob.glob(f"{sp}/nvidia/*/lib/libcublasLt.so.*")]
    if not found:
        raise SystemExit("no libcublasLt under site-packages/nvidia: pass --lib")
    return max(found, key=lambda p: int(p.rsplit(".so.", 1)[1].split(".")[0]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib")
    ap.add_argument("--calls", type=int, default=500)
    args = ap.parse_args()
    path = args.lib or find_lib()
    lt = ctypes.CDLL(path)
    print("cuBLASLt:", path)
    vp = ctypes.c_void_p

    def check(status, what):
        if status != 0:
            raise SystemExit(f"{what} failed: status {status}")

    handle = vp()
    check(lt.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    workspace = ctypes.c_size_t(32 * 1024 * 1024)
    result = (ctypes.c_byte * 1024)()
    returned = ctypes.c_int()

    def setup(m, n, k, heuristic):
        desc, a, b, d, pref = vp(), vp(), vp(), vp(), vp()
        check(lt.cublasLtMatmulDescCreate(ctypes.byref(desc), CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc")
        op_t, op_n = ctypes.c_int(OP_T), ctypes.c_int(OP_N)
        check(lt.cublasLtMatmulDescSetAttribute(desc, DESC_TRANSA, ctypes.byref(op_t), 4), "transa")
        check(lt.cublasLtMatmulDescSetAttribute(desc, DESC_TRANSB, ctypes.byref(op_n), 4), "transb")
        # Column-major view of row-major data: the weight [n, k] is A (k x n, transposed),
        # the rows [m, k] are B (k x m), the output [m, n] is D (n x m).
        u64, i64 = ctypes.c_uint64, ctypes.c_int64
        check(lt.cublasLtMatrixLayoutCreate(ctypes.byref(a), CUDA_R_16BF, u64(k), u64(n), i64(k)), "a")
        check(lt.cublasLtMatrixLayoutCreate(ctypes.byref(b), CUDA_R_16BF, u64(k), u64(m), i64(k)), "b")
        check(lt.cublasLtMatrixLayoutCreate(ctypes.byref(d), CUDA_R_16BF, u64(n), u64(m), i64(n)), "d")
        check(lt.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "pref")
        check(lt.cublasLtMatmulPreferenceSetAttribute(
            pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(workspace), 8), "pref attr")
        if heuristic:
            check(lt.cublasLtMatmulAlgoGetHeuristic(
                handle, desc, a, b, d, d, pref, 1, result, ctypes.byref(returned)), "heuristic")
        lt.cublasLtMatmulPreferenceDestroy(pref)
        for layout in (a, b, d):
            lt.cublasLtMatrixLayoutDestroy(layout)
        lt.cublasLtMatmulDescDestroy(desc)

    def timed(m, n, k, heuristic):
        for _ in range(20):
            setup(m, n, k, heuristic)
        times = []
        for _ in range(args.calls):
            t = time.perf_counter()
            setup(m, n, k, heuristic)
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e6

    print("shape  rows  outputs x inputs | descriptors us | with heuristic us")
    for name, products in SHAPES.items():
        for m in (2, 8, 32):
            for n, k in products:
                plain = timed(m, n, k, False)
                full = timed(m, n, k, True)
                print(f"{name:5s} {m:4d}  {n:6d} x {k:6d}    | {plain:14.1f} | {full:17.1f}",
                      flush=True)


if __name__ == "__main__":
    main()
