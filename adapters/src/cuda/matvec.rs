//! Products of up to [`MAX_ROWS`] activation rows with a dense `[out, in]` weight,
//! reading the weight once for all rows.
//!
//! One warp per output column: lane L takes the 16-byte chunks L, L + 32, … of the
//! weight row and of each activation row, accumulates every row in chunk order, and a
//! fixed butterfly sums the lanes. A call takes up to [`ROWS`] rows, so the accumulators
//! stay in registers: a first build with room for 32 rows in every call left an H100
//! decoding GPU-bound (0.51 s of 0.97 s waiting on the GPU for 128 tokens). A row's arithmetic is the same code in the same
//! order whatever the number of rows (MLX's kernels pick a matrix-vector kernel for
//! one row and a matrix-matrix one for several, which round differently), and a
//! 5-row verify reads the weights once instead of five times.

use mlx_rs::ops::concatenate;
use mlx_rs::{Array, Dtype};

use dspec_plugin_api::error::Result;
use dspec_plugin_api::slicing::slice_axis;

use super::{apply, available, enabled, Kernel};
use super::Launch;

/// Rows one kernel call takes; more go in groups of this many (each row's arithmetic is
/// the same in any group). One build for every row count: a build per count paid
/// NVRTC's compile (about a second on an H100) in the middle of a measured run whenever
/// a new verify width came up.
const ROWS: i32 = 8;

/// Most rows [`product`] takes: the row layout's longest verify (`MAX_ROWWISE_TOKENS`).
pub const MAX_ROWS: i32 = 32;

/// Output columns (warps) per block.
const WARPS: i32 = 8;

const SOURCE: &str = r#"
    constexpr int VEC = 16 / sizeof(T);
    const int rows = x_shape[0];
    const int n_out = w_shape[0];
    const int n_in = w_shape[1];
    const int lane = threadIdx.x % 32;
    const int col = blockIdx.x * WARPS + threadIdx.x / 32;
    if (col >= n_out) {
        return;
    }
    const T* wr = w + (long long)col * n_in;
    // Whole 16-byte loads where both operands allow them; element by element otherwise,
    // into the same chunk (the sums are the same either way).
    const bool vector_loads = ((reinterpret_cast<unsigned long long>(x)
        | reinterpret_cast<unsigned long long>(w)) % 16) == 0;
    float acc[ROWS];
    #pragma unroll
    for (int r = 0; r < ROWS; r++) {
        acc[r] = 0.0f;
    }
    #pragma unroll 4
    for (int k = lane * VEC; k < n_in; k += 32 * VEC) {
        T wv[VEC];
        if (vector_loads) {
            *reinterpret_cast<uint4*>(wv) = *reinterpret_cast<const uint4*>(wr + k);
        } else {
            #pragma unroll
            for (int i = 0; i < VEC; i++) {
                wv[i] = wr[k + i];
            }
        }
        #pragma unroll
        for (int r = 0; r < ROWS; r++) {
            if (r < rows) {
                const T* xr = x + (long long)r * n_in + k;
                T xv[VEC];
                if (vector_loads) {
                    *reinterpret_cast<uint4*>(xv) = *reinterpret_cast<const uint4*>(xr);
                } else {
                    #pragma unroll
                    for (int i = 0; i < VEC; i++) {
                        xv[i] = xr[i];
                    }
                }
                #pragma unroll
                for (int i = 0; i < VEC; i++) {
                    acc[r] += static_cast<float>(wv[i]) * static_cast<float>(xv[i]);
                }
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < ROWS; r++) {
        if (r < rows) {
            float s = acc[r];
            #pragma unroll
            for (int offset = 16; offset > 0; offset /= 2) {
                s += __shfl_xor_sync(0xffffffffu, s, offset);
            }
            if (lane == 0) {
                out[(long long)r * n_out + col] = static_cast<T>(s);
            }
        }
    }
"#;

thread_local! {
    static KERNEL: Kernel = Kernel::new("dspec_rows_matvec", &["x", "w"], SOURCE, true);
}

/// Whether [`product`] serves `x` (`[R, 1, in]`) times `weight` (`[out, in]`) here.
pub fn serves(x: &Array, weight: &Array) -> bool {
    if !enabled() {
        return false;
    }
    let (xs, ws) = (x.shape(), weight.shape());
    let dtype = weight.dtype();
    // Elements per 16-byte load: `in` must be a whole number of them.
    let vec = if dtype == Dtype::Float32 { 4 } else { 8 };
    available(dtype)
        && x.dtype() == dtype
        && xs.len() == 3
        && xs[1] == 1
        && (1..=MAX_ROWS).contains(&xs[0])
        && ws.len() == 2
        && ws[1] == xs[2]
        && xs[2] % vec == 0
}

/// `x · weightᵀ` (`[R, 1, in]` times `[out, in]`): `[R, 1, out]`.
pub fn product(x: &Array, weight: &Array) -> Result<Array> {
    let rows = x.shape()[0];
    if rows <= ROWS {
        return product_of_group(x, weight);
    }
    let mut groups = Vec::new();
    let mut start = 0;
    while start < rows {
        let end = (start + ROWS).min(rows);
        groups.push(product_of_group(&slice_axis(x, 0, start, end)?, weight)?);
        start = end;
    }
    Ok(concatenate(&groups, 0)?)
}

fn product_of_group(x: &Array, weight: &Array) -> Result<Array> {
    let (rows, n_out) = (x.shape()[0], weight.shape()[0]);
    let columns = (n_out + WARPS - 1) / WARPS * WARPS;
    KERNEL.with(|kernel| {
        apply(
            kernel,
            &[x, weight],
            Launch {
                out_shape: &[rows, 1, n_out],
                dtype: weight.dtype(),
                grid: (columns * 32, 1, 1),
                block: WARPS * 32,
                ints: &[(c"WARPS", WARPS), (c"ROWS", ROWS)],
            },
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::ops::matmul;
    use mlx_rs::ops::indexing::TryIndexOp;
    use mlx_rs::random;

    /// On a CUDA machine: each row of a many-row product equals the row alone, bitwise,
    /// and MLX's product within rounding, for bf16 and f32, aligned and unaligned
    /// inputs (a view one element in). Elsewhere: the kernel is not offered.
    #[test]
    fn rows_multiply_alone_and_like_mlx() {
        if !available(Dtype::Bfloat16) {
            let x = Array::zeros::<f32>(&[2, 1, 64]).unwrap();
            assert!(!serves(&x, &Array::zeros::<f32>(&[8, 64]).unwrap()));
            return;
        }
        for (dtype, n_in, n_out, rows, shifted) in [
            (Dtype::Bfloat16, 1536, 2048, 5, false),
            (Dtype::Bfloat16, 8960, 1536, 11, false),
            (Dtype::Float32, 896, 1000, 3, false),
            (Dtype::Bfloat16, 1536, 300, 4, true),
        ] {
            let normal = |shape: &[i32], seed: u64| {
                random::normal::<f32>(shape, None, None, Some(&random::key(seed).unwrap()))
                    .unwrap()
                    .as_dtype(dtype)
                    .unwrap()
            };
            let w = normal(&[n_out, n_in], 1);
            let x = if shifted {
                // A view starting one element into its buffer: not 16-byte aligned.
                let flat = normal(&[rows * n_in + 1], 2);
                flat.try_index(1..).unwrap().reshape(&[rows, 1, n_in]).unwrap()
            } else {
                normal(&[rows, 1, n_in], 2)
            };
            assert!(serves(&x, &w));
            let all = product(&x, &w).unwrap();
            assert_eq!(all.shape(), &[rows, 1, n_out]);
            for r in 0..rows {
                let x_r = x.try_index(r..r + 1).unwrap();
                let alone = product(&x_r, &w).unwrap();
                let row = all.try_index(r..r + 1).unwrap();
                assert!(row.eq_values(&alone).unwrap(), "{dtype:?} {n_in}x{n_out}: row {r}");
                let mlx = matmul(&x_r, &w.t()).unwrap().as_dtype(Dtype::Float32).unwrap();
                let tolerance = if dtype == Dtype::Float32 { 1e-2 } else { 5e-2 };
                assert!(
                    row.as_dtype(Dtype::Float32).unwrap().all_close(&mlx, tolerance, tolerance, None).unwrap(),
                    "{dtype:?} {n_in}x{n_out}: row {r} is not MLX's product"
                );
            }
        }
    }
}
