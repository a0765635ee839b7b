//! `x · wᵀ` for a few rows of `x` and a dense `[out, in]` weight, reading the weight
//! once for all rows.
//!
//! A block owns `COLS` output columns; its threads take the 16-byte chunks of the
//! input dimension in turn, hold the columns' weights as floats and multiply every row
//! by them, so each weight byte is loaded once and each row chunk once per `COLS`
//! columns. Per-thread sums are reduced by a warp butterfly, then across the block's
//! warps. Accumulation is in f32.

use mlx_rs::Array;

use dspec_plugin_api::error::Result;

use super::{apply, available, Kernel, Launch, MAX_ROWS};

/// Output columns per block.
const COLS: i32 = 4;

/// Elements of a 16-bit float per 16-byte load.
const VEC: i32 = 8;

/// Warps the blocks of a product should add up to at least, so that enough loads are
/// in flight to stream the weight at memory speed.
const WARPS_WANTED: i32 = 2048;

const SOURCE: &str = r#"
    constexpr int VEC = 8;
    int rows = 1;
    for (int d = 0; d < x_ndim - 1; d++) {
        rows *= x_shape[d];
    }
    const int K = w_shape[1];
    const int N = w_shape[0];
    const int col0 = blockIdx.x * COLS;
    const int t = threadIdx.x;
    const bool vector_loads = ((reinterpret_cast<unsigned long long>(x)
        | reinterpret_cast<unsigned long long>(w)) % 16) == 0;
    float acc[MAX_ROWS][COLS];
    #pragma unroll
    for (int r = 0; r < MAX_ROWS; r++) {
        #pragma unroll
        for (int c = 0; c < COLS; c++) {
            acc[r][c] = 0.0f;
        }
    }
    for (int k = t * VEC; k < K; k += blockDim.x * VEC) {
        float wf[COLS][VEC];
        #pragma unroll
        for (int c = 0; c < COLS; c++) {
            T raw[VEC];
            if (col0 + c >= N) {
                #pragma unroll
                for (int i = 0; i < VEC; i++) raw[i] = static_cast<T>(0.0f);
            } else if (vector_loads) {
                *reinterpret_cast<uint4*>(raw) =
                    *reinterpret_cast<const uint4*>(w + (long long)(col0 + c) * K + k);
            } else {
                #pragma unroll
                for (int i = 0; i < VEC; i++) raw[i] = w[(long long)(col0 + c) * K + k + i];
            }
            #pragma unroll
            for (int i = 0; i < VEC; i++) wf[c][i] = static_cast<float>(raw[i]);
        }
        #pragma unroll
        for (int r = 0; r < MAX_ROWS; r++) {
            if (r < rows) {
                T raw[VEC];
                if (vector_loads) {
                    *reinterpret_cast<uint4*>(raw) =
                        *reinterpret_cast<const uint4*>(x + (long long)r * K + k);
                } else {
                    #pragma unroll
                    for (int i = 0; i < VEC; i++) raw[i] = x[(long long)r * K + k + i];
                }
                #pragma unroll
                for (int i = 0; i < VEC; i++) {
                    const float xv = static_cast<float>(raw[i]);
                    #pragma unroll
                    for (int c = 0; c < COLS; c++) {
                        acc[r][c] += xv * wf[c][i];
                    }
                }
            }
        }
    }
    __shared__ float part[8][MAX_ROWS * COLS];
    const int lane = t & 31, warp = t >> 5, warps = blockDim.x >> 5;
    #pragma unroll
    for (int r = 0; r < MAX_ROWS; r++) {
        if (r < rows) {
            #pragma unroll
            for (int c = 0; c < COLS; c++) {
                float s = acc[r][c];
                #pragma unroll
                for (int o = 16; o > 0; o /= 2) {
                    s += __shfl_xor_sync(0xffffffffu, s, o);
                }
                if (lane == 0) {
                    part[warp][r * COLS + c] = s;
                }
            }
        }
    }
    __syncthreads();
    for (int i = t; i < rows * COLS; i += blockDim.x) {
        const int r = i / COLS, c = i % COLS;
        if (col0 + c < N) {
            float s = 0.0f;
            for (int g = 0; g < warps; g++) {
                s += part[g][i];
            }
            out[(long long)r * N + col0 + c] = static_cast<T>(s);
        }
    }
"#;

thread_local! {
    static KERNEL: Kernel = Kernel::new("dspec_rows_product", &["x", "w"], SOURCE, true);
}

/// Whether [`product`] serves `x`, `rows` rows (all of it but its last dimension), times
/// `weight` here. The kernel reads `x` as the weight's dtype, so the two must agree.
pub fn serves(x: &Array, rows: i32, weight: &Array) -> bool {
    let shape = weight.shape();
    (2..=MAX_ROWS).contains(&rows)
        && available(weight.dtype())
        && x.dtype() == weight.dtype()
        && shape.len() == 2
        && shape[1] % VEC == 0
}

/// Warps per block for `columns` outputs of `inputs` inputs: enough blocks' warps to
/// keep memory busy ([`WARPS_WANTED`]), at most one per 256 inputs (a warp's share of
/// a column should be a whole pass of its lanes) and at most 8.
fn warps_per_block(columns: i32, inputs: i32) -> i32 {
    let groups = (columns + COLS - 1) / COLS;
    let by_inputs = (inputs / (VEC * 32)).clamp(1, 8);
    let mut warps = 1;
    while warps * 2 <= by_inputs && groups * warps < WARPS_WANTED {
        warps *= 2;
    }
    warps
}

/// `x` (`[.., in]`, [`serves`]'s rows) times `weight` (`[out, in]`): `[.., out]`.
pub fn product(x: &Array, weight: &Array) -> Result<Array> {
    let (out_features, in_features) = (weight.shape()[0], weight.shape()[1]);
    let mut out_shape = x.shape().to_vec();
    if let Some(last) = out_shape.last_mut() {
        *last = out_features;
    }
    let warps = warps_per_block(out_features, in_features);
    let groups = (out_features + COLS - 1) / COLS;
    KERNEL.with(|kernel| {
        apply(
            kernel,
            &[x, weight],
            Launch {
                out_shape: &out_shape,
                dtype: weight.dtype(),
                grid: (groups * warps * 32, 1, 1),
                block: warps * 32,
                ints: &[(c"MAX_ROWS", MAX_ROWS), (c"COLS", COLS)],
            },
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::ops::matmul;
    use mlx_rs::{random, Dtype};

    /// Blocks get more warps where columns are few and inputs many, never past 8 or
    /// past a whole pass of lanes per warp.
    #[test]
    fn warps_follow_the_shape() {
        assert_eq!(warps_per_block(37_888, 3_584), 1);
        assert_eq!(warps_per_block(1_536, 8_960), 8);
        assert_eq!(warps_per_block(2_048, 1_536), 4);
        assert_eq!(warps_per_block(64, 64), 1);
    }

    /// On a CUDA machine (the test binary run with MLX's CUDA libmlx; elsewhere it
    /// checks that the kernel is not used): every row count it takes gives MLX's
    /// product within bf16 rounding, for shapes whose columns do not fill the last
    /// block and inputs that do not fill the last pass.
    #[test]
    fn rows_times_a_weight_are_mlx_s_product() {
        let key = random::key(3).unwrap();
        let w = random::normal::<f32>(&[70, 200], None, None, Some(&key))
            .unwrap()
            .as_dtype(Dtype::Bfloat16)
            .unwrap();
        let x4 = random::normal::<f32>(&[1, 4, 200], None, None, None)
            .unwrap()
            .as_dtype(Dtype::Bfloat16)
            .unwrap();
        if !available(Dtype::Bfloat16) {
            assert!(!serves(&x4, 4, &w));
            return;
        }
        assert!(!serves(&x4, 1, &w) && !serves(&x4, MAX_ROWS + 1, &w));
        let f32_rows = x4.as_dtype(Dtype::Float32).unwrap();
        assert!(
            !serves(&f32_rows, 4, &w),
            "rows of another dtype than the weight"
        );
        for (out_f, in_f) in [(70, 200), (2_048, 1_536), (1_536, 8_960)] {
            let w = random::normal::<f32>(&[out_f, in_f], None, None, Some(&key))
                .unwrap()
                .as_dtype(Dtype::Bfloat16)
                .unwrap();
            for rows in 2..=MAX_ROWS {
                let x = random::normal::<f32>(&[1, rows, in_f], None, None, None)
                    .unwrap()
                    .as_dtype(Dtype::Bfloat16)
                    .unwrap();
                assert!(serves(&x, rows, &w));
                let got = product(&x, &w).unwrap();
                assert_eq!(got.shape(), &[1, rows, out_f]);
                let want = matmul(
                    x.as_dtype(Dtype::Float32).unwrap(),
                    w.as_dtype(Dtype::Float32).unwrap().t(),
                )
                .unwrap();
                let close = got
                    .as_dtype(Dtype::Float32)
                    .unwrap()
                    .all_close(&want, 1e-2, 1e-1, None)
                    .unwrap();
                assert!(
                    close,
                    "{rows} rows of [{out_f}, {in_f}] differ from MLX's product"
                );
            }
        }
    }
}
