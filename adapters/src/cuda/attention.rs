//! Attention of one or more consecutive query positions over the KV cache.
//!
//! One thread block per (head, position), `WARPS` warps. Warp w takes the visible keys
//! `first + w, first + w + WARPS, …` in order, each lane a slice of head_dim; a key's
//! score is summed across lanes by a fixed butterfly; the warp keeps an online softmax
//! (running max, sum and weighted values); warps are merged in warp order. The visible
//! keys of a position (`first..=position`, `first` moved up by a sliding window) depend
//! on the position alone, so nothing depends on how many positions share the call. The
//! result is written straight in the `[R, 1, heads·D]` layout the output projection
//! reads. MLX's own attention computes several causal queries differently from one
//! (scripts/gpu_rowwise_check.py shows it on an H100).

use mlx_rs::Array;

use dspec_plugin_api::error::Result;

use super::{apply, available, enabled, Kernel, Launch};

/// Warps per (head, position) block.
const WARPS: i32 = 8;

const SOURCE: &str = r#"
    constexpr int PER_LANE = D / 32;
    const int head = blockIdx.y;
    const int row = blockIdx.z;
    const int heads = q_shape[1];
    const int rows = q_shape[2];
    const int total = k_shape[2];
    const int position = total - rows + row;
    const int kv_head = head / (heads / k_shape[1]);
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int first = (WINDOW > 0 && position - WINDOW + 1 > 0) ? position - WINDOW + 1 : 0;
    const float neg_inf = __int_as_float(0xff800000);
    // Scores in base 2: exp(s) = exp2(s * log2(e)).
    const float scale = __int_as_float(SCALE_BITS) * 1.4426950408889634f;

    float qv[PER_LANE];
    const T* qp = q + head * q_strides[1] + row * q_strides[2];
    for (int i = 0; i < PER_LANE; i++) {
        qv[i] = static_cast<float>(qp[(lane * PER_LANE + i) * q_strides[3]]) * scale;
    }
    float m = neg_inf;
    float l = 0.0f;
    float o[PER_LANE];
    for (int i = 0; i < PER_LANE; i++) {
        o[i] = 0.0f;
    }
    const T* kb = k + kv_head * k_strides[1];
    const T* vb = v + kv_head * v_strides[1];
    for (int j = first + warp; j <= position; j += WARPS) {
        const T* kj = kb + j * k_strides[2];
        float s = 0.0f;
        for (int i = 0; i < PER_LANE; i++) {
            s += qv[i] * static_cast<float>(kj[(lane * PER_LANE + i) * k_strides[3]]);
        }
        for (int offset = 16; offset > 0; offset /= 2) {
            s += __shfl_xor_sync(0xffffffffu, s, offset);
        }
        const float m_new = fmaxf(m, s);
        const float keep = exp2f(m - m_new);
        const float p = exp2f(s - m_new);
        l = l * keep + p;
        const T* vj = vb + j * v_strides[2];
        for (int i = 0; i < PER_LANE; i++) {
            o[i] = o[i] * keep + p * static_cast<float>(vj[(lane * PER_LANE + i) * v_strides[3]]);
        }
        m = m_new;
    }

    __shared__ float warp_max[WARPS];
    __shared__ float warp_sum[WARPS];
    __shared__ float warp_out[WARPS][D];
    if (lane == 0) {
        warp_max[warp] = m;
        warp_sum[warp] = l;
    }
    for (int i = 0; i < PER_LANE; i++) {
        warp_out[warp][lane * PER_LANE + i] = o[i];
    }
    __syncthreads();
    if (warp == 0) {
        float top = neg_inf;
        for (int w = 0; w < WARPS; w++) {
            top = fmaxf(top, warp_max[w]);
        }
        float sum = 0.0f;
        float acc[PER_LANE];
        for (int i = 0; i < PER_LANE; i++) {
            acc[i] = 0.0f;
        }
        for (int w = 0; w < WARPS; w++) {
            const float f = warp_max[w] == neg_inf ? 0.0f : exp2f(warp_max[w] - top);
            sum += warp_sum[w] * f;
            for (int i = 0; i < PER_LANE; i++) {
                acc[i] += warp_out[w][lane * PER_LANE + i] * f;
            }
        }
        T* op = out + (row * heads + head) * D + lane * PER_LANE;
        for (int i = 0; i < PER_LANE; i++) {
            op[i] = static_cast<T>(acc[i] / sum);
        }
    }
"#;

thread_local! {
    static KERNEL: Kernel = Kernel::new("dspec_cached_attention", &["q", "k", "v"], SOURCE, false);
}

/// Whether [`attend`] serves `q` (`[1, heads, R, D]`) of a layer with or without
/// score softcapping on this machine.
pub fn serves(q: &Array, softcap: bool) -> bool {
    if !enabled() || softcap {
        return false;
    }
    let head_dim = q.shape()[3];
    available(q.dtype()) && head_dim % 32 == 0 && head_dim <= 256
}

/// Attention of the R positions of `q` (`[1, heads, R, D]`, the last R positions of the
/// cache) over `keys`/`values` (`[1, kv_heads, total, D]`, any strides), each position
/// seeing the keys up to its own and no further back than `window`: `[R, 1, heads·D]`.
pub fn attend(
    q: &Array,
    keys: &Array,
    values: &Array,
    scale: f32,
    window: Option<i32>,
) -> Result<Array> {
    let (heads, rows, head_dim) = (q.shape()[1], q.shape()[2], q.shape()[3]);
    KERNEL.with(|kernel| {
        apply(
            kernel,
            &[q, keys, values],
            Launch {
                out_shape: &[rows, 1, heads * head_dim],
                dtype: q.dtype(),
                grid: (WARPS * 32, heads, rows),
                block: WARPS * 32,
                ints: &[
                    (c"D", head_dim),
                    (c"WARPS", WARPS),
                    (c"WINDOW", window.unwrap_or(0)),
                    (c"SCALE_BITS", scale.to_bits() as i32),
                ],
            },
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::Dtype;
    use crate::attention::attention_mask;
    use mlx_rs::fast::scaled_dot_product_attention;
    use mlx_rs::ops::indexing::TryIndexOp;
    use mlx_rs::random;

    /// On a CUDA machine (the test binary run with MLX's CUDA libmlx; elsewhere it
    /// checks only that the kernel is not used): every position of a 5-position call
    /// equals the same position computed alone, bitwise, and MLX's attention within
    /// bf16 rounding, with and without a sliding window, for head_dim 64 and 128 and
    /// grouped KV heads.
    #[test]
    fn positions_attend_alone_and_like_mlx() {
        let probe = Array::zeros::<f32>(&[1, 12, 1, 128]).unwrap().as_dtype(Dtype::Bfloat16).unwrap();
        if !available(Dtype::Bfloat16) {
            assert!(!serves(&probe, false));
            return;
        }
        assert!(!serves(&probe, true), "softcapping needs MLX's path");
        for (head_dim, window, total) in [(128, None, 300), (64, None, 1500), (128, Some(100), 300)] {
            let (heads, kv_heads, rows) = (12, 2, 5);
            let key = random::key(head_dim as u64 + total as u64).unwrap();
            let keys_of = |i: u64, h: i32| {
                random::normal::<f32>(&[1, h, total, head_dim], None, None, Some(&random::key(i).unwrap()))
                    .unwrap()
                    .as_dtype(Dtype::Bfloat16)
                    .unwrap()
            };
            let (k, v) = (keys_of(1, kv_heads), keys_of(2, kv_heads));
            let q = random::normal::<f32>(&[1, heads, rows, head_dim], None, None, Some(&key))
                .unwrap()
                .as_dtype(Dtype::Bfloat16)
                .unwrap();
            let scale = (head_dim as f32).powf(-0.5);
            let all = attend(&q, &k, &v, scale, window).unwrap();
            assert_eq!(all.shape(), &[rows, 1, heads * head_dim]);
            for r in 0..rows {
                let visible = total - rows + r + 1;
                let (k_r, v_r) = (
                    k.try_index((.., .., 0..visible, ..)).unwrap(),
                    v.try_index((.., .., 0..visible, ..)).unwrap(),
                );
                let q_r = q.try_index((.., .., r..r + 1, ..)).unwrap();
                let alone = attend(&q_r, &k_r, &v_r, scale, window).unwrap();
                let row = all.try_index(r..r + 1).unwrap();
                assert!(row.eq_values(&alone).unwrap(), "d {head_dim} window {window:?}: row {r} differs alone");
                let mask = attention_mask(visible - 1, 1, window).unwrap();
                let mlx = scaled_dot_product_attention(&q_r, &k_r, &v_r, scale, mask.for_sdpa(), None)
                    .unwrap()
                    .reshape(&[1, 1, heads * head_dim])
                    .unwrap();
                let close = row
                    .as_dtype(Dtype::Float32)
                    .unwrap()
                    .all_close(&mlx.as_dtype(Dtype::Float32).unwrap(), 2e-2, 2e-2, None)
                    .unwrap();
                assert!(close, "d {head_dim} window {window:?}: row {r} is not MLX's attention");
            }
        }
    }
}
