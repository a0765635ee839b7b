//! `x · wᵀ` for a few rows of `x` and a dense `[out, in]` weight, reading the weight
//! once for all rows, on tensor cores.
//!
//! Each warp issues `mma.sync` m16n8k16 products (16-bit inputs, f32 sums): the weight
//! is the 16×16 `A` operand as it lies in memory (`[out, in]` is row-major `A`), and
//! up to 8 rows of `x` are the `B` operand (`x`'s rows are `B`'s columns, `in`
//! contiguous, the `.col` layout); rows 9–16 take a second product with the same `A`.
//! Which 16 inputs of a 64-input slice go to which of a product's 16 slots is free (the
//! sum does not care), so each lane loads 32 contiguous bytes of its weight rows and
//! of its `x` row and hands them out slot by slot: every load is a full 16-byte one.
//!
//! A block owns 16 output columns; its warps split the input dimension and their sums
//! meet in shared memory. With the products on tensor cores, a verify's rows cost no
//! more arithmetic time than one row's: the weight's bytes are what the kernel waits on,
//! as a one-row step does.

use mlx_rs::Array;

use dspec_plugin_api::error::Result;

use super::{apply, available, with_constants, Kernel, Launch, MAX_ROWS};

/// Inputs per warp per step: four m16n8k16 products.
const SLICE: i32 = 64;

/// Elements of a 16-bit float per 16-byte load.
const VEC: i32 = 8;

/// Output columns per block: one product's `M`.
const COLS: i32 = 16;

/// Most warps per block (the shared buffer of partial sums is sized for it).
const MAX_WARPS: i32 = 16;

/// Warps the blocks of a product should add up to at least, so that enough loads are
/// in flight to stream the weight at memory speed.
const WARPS_WANTED: i32 = 2048;

/// The tensor-core product for each 16-bit float type MLX hands the kernel as `T`.
const HEADER: &str = r#"
template <typename T> struct DspecMma;
#define DSPEC_MMA(TYPE, PTX)                                                                   \
    template <> struct DspecMma<TYPE> {                                                        \
        static __device__ __forceinline__ void run(float* d, const unsigned* a, unsigned b0, unsigned b1) { \
            asm("mma.sync.aligned.m16n8k16.row.col.f32." PTX "." PTX ".f32 "                   \
                "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"                        \
                : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                               \
                : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));               \
        }                                                                                      \
    };
DSPEC_MMA(__nv_bfloat16, "bf16")
DSPEC_MMA(__half, "f16")
#undef DSPEC_MMA
"#;

const SOURCE: &str = r#"
    int rows = 1;
    for (int d = 0; d < x_ndim - 1; d++) {
        rows *= x_shape[d];
    }
    const int K = w_shape[1];
    const int N = w_shape[0];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    // The fragment layout of m16n8k16: lane group g holds A's rows g and g + 8 and
    // B's column g; t picks its slots within them.
    const int g = lane >> 2, t = lane & 3;
    const int col0 = blockIdx.x * COLS;
    const bool second = rows > 8;
    const bool vector_loads = ((reinterpret_cast<unsigned long long>(x)
        | reinterpret_cast<unsigned long long>(w)) % 16) == 0;
    // 16 elements from `from + k` (a lane's share of a slice) as 8 words, zeros past
    // `K` or for a row that is not there.
    auto load16 = [&](const T* from, bool there, int k, unsigned* words) {
        #pragma unroll
        for (int h = 0; h < 2; h++) {
            const int kk = k + h * VEC;
            if (there && kk < K) {
                if (vector_loads) {
                    *reinterpret_cast<uint4*>(words + h * 4) =
                        *reinterpret_cast<const uint4*>(from + kk);
                } else {
                    T* e = reinterpret_cast<T*>(words + h * 4);
                    #pragma unroll
                    for (int i = 0; i < VEC; i++) e[i] = from[kk + i];
                }
            } else {
                #pragma unroll
                for (int i = 0; i < 4; i++) words[h * 4 + i] = 0u;
            }
        }
    };
    const T* w_lo = w + (long long)(col0 + g) * K;
    const T* w_hi = w + (long long)(col0 + g + 8) * K;
    const T* x_lo = x + (long long)g * K;
    const T* x_hi = x + (long long)(g + 8) * K;
    float acc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    for (int k0 = warp * SLICE; k0 < K; k0 += warps * SLICE) {
        const int k = k0 + t * 16;
        unsigned a_lo[8], a_hi[8], b_lo[8], b_hi[8];
        load16(w_lo, col0 + g < N, k, a_lo);
        load16(w_hi, col0 + g + 8 < N, k, a_hi);
        load16(x_lo, g < rows, k, b_lo);
        if (second) {
            load16(x_hi, g + 8 < rows, k, b_hi);
        }
        // Product j takes this lane's inputs 4j..4j+3: the first two as slots 2t, 2t+1,
        // the other two as slots 2t+8, 2t+9, for A and B alike.
        #pragma unroll
        for (int j = 0; j < 4; j++) {
            const unsigned a[4] = {a_lo[2 * j], a_hi[2 * j], a_lo[2 * j + 1], a_hi[2 * j + 1]};
            DspecMma<T>::run(acc[0], a, b_lo[2 * j], b_lo[2 * j + 1]);
            if (second) {
                DspecMma<T>::run(acc[1], a, b_hi[2 * j], b_hi[2 * j + 1]);
            }
        }
    }
    // acc[h][i]: output column g (i < 2) or g + 8 (i >= 2), row 8h + 2t + (i & 1).
    __shared__ float part[MAX_WARPS][16 * COLS];
    #pragma unroll
    for (int h = 0; h < 2; h++) {
        if (h == 0 || second) {
            #pragma unroll
            for (int i = 0; i < 4; i++) {
                const int r = 8 * h + 2 * t + (i & 1);
                const int c = g + (i >= 2 ? 8 : 0);
                part[warp][r * COLS + c] = acc[h][i];
            }
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < rows * COLS; i += blockDim.x) {
        const int r = i / COLS, c = i % COLS;
        if (col0 + c < N) {
            float s = 0.0f;
            for (int v = 0; v < warps; v++) {
                s += part[v][i];
            }
            out[(long long)r * N + col0 + c] = static_cast<T>(s);
        }
    }
"#;

thread_local! {
    static KERNEL: Kernel = Kernel::new(
        "dspec_rows_product",
        &["x", "w"],
        HEADER,
        &with_constants(
            &[("SLICE", SLICE), ("VEC", VEC), ("COLS", COLS), ("MAX_WARPS", MAX_WARPS)],
            SOURCE,
        ),
        true,
    );
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
/// keep memory busy ([`WARPS_WANTED`]), at least two slices of the inputs per warp, and
/// at most [`MAX_WARPS`].
fn warps_per_block(columns: i32, inputs: i32) -> i32 {
    let blocks = (columns + COLS - 1) / COLS;
    let by_inputs = (inputs / (2 * SLICE)).clamp(1, MAX_WARPS);
    let mut warps = 1;
    while warps * 2 <= by_inputs && blocks * warps < WARPS_WANTED {
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
    let blocks = (out_features + COLS - 1) / COLS;
    KERNEL.with(|kernel| {
        apply(
            kernel,
            &[x, weight],
            Launch {
                out_shape: &out_shape,
                dtype: weight.dtype(),
                grid: (blocks * warps * 32, 1, 1),
                block: warps * 32,
                ints: &[],
            },
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::ops::matmul;
    use mlx_rs::{random, Dtype};

    /// Blocks get more warps where columns are few and inputs many, never past
    /// [`MAX_WARPS`] or below two slices of the inputs per warp.
    #[test]
    fn warps_follow_the_shape() {
        assert_eq!(warps_per_block(151_936, 1_536), 1);
        assert_eq!(warps_per_block(17_920, 1_536), 2);
        assert_eq!(warps_per_block(1_536, 8_960), 16);
        assert_eq!(warps_per_block(1_536, 1_536), 8);
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
