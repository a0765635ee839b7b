//! Attention of a few consecutive positions over the KV cache: causal (a verify), or
//! a drafter's block, whose positions all see the whole block and the cache.
//!
//! One block per (query head, position), `WARPS` warps. A key is taken by `D / 8`
//! lanes (8 dimensions each, one 16-byte load where the layout allows), so a warp works
//! on `256 / D` keys at once; each such lane group keeps an online softmax (running max,
//! sum and weighted values) over its keys, and the groups are merged through shared
//! memory. A causal position sees the keys up to its own, a block's every key; under a
//! window, no cached key further back than the window. The output is written in the
//! `[1, R, heads·D]` layout the output projection reads, so no transpose follows.

use mlx_rs::{Array, Dtype};

use dspec_plugin_api::error::Result;

use super::{apply, available, with_constants, Kernel, Launch};

/// Warps per (head, position) block.
const WARPS: i32 = 4;

const SOURCE: &str = r#"
    constexpr int LANES = D / 8;
    constexpr int GROUPS = WARPS * (32 / LANES);
    const int heads = q_shape[1];
    const int rows = q_shape[2];
    const int total = k_shape[2];
    const int head = blockIdx.x / rows;
    const int row = blockIdx.x % rows;
    const int position = total - rows + row;
    const int kv_head = head / (heads / k_shape[1]);
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const int sub = lane % LANES;
    const int group = warp * (32 / LANES) + lane / LANES;
    // The last key seen, and the first: a block always sees itself, so a window cuts
    // only the cache before it.
    const int last = CAUSAL ? position : total - 1;
    const int reach = position - WINDOW + 1 > 0 ? position - WINDOW + 1 : 0;
    const int first = WINDOW > 0 ? (CAUSAL ? reach : min(reach, total - rows)) : 0;
    const float scale = __int_as_float(SCALE_BITS);
    const T* qp = q + head * q_strides[1] + row * q_strides[2];
    const T* kb = k + kv_head * k_strides[1];
    const T* vb = v + kv_head * v_strides[1];
    const bool vector_loads = q_strides[3] == 1 && k_strides[3] == 1 && v_strides[3] == 1
        && (q_strides[2] % 8 | k_strides[2] % 8 | v_strides[2] % 8) == 0
        && (q_strides[1] % 8 | k_strides[1] % 8 | v_strides[1] % 8) == 0
        && ((reinterpret_cast<unsigned long long>(q) | reinterpret_cast<unsigned long long>(k)
             | reinterpret_cast<unsigned long long>(v)) % 16) == 0;
    auto load8 = [&](const T* base, long long stride, float* dst) {
        T raw[8];
        if (vector_loads) {
            *reinterpret_cast<uint4*>(raw) = *reinterpret_cast<const uint4*>(base + sub * 8);
        } else {
            #pragma unroll
            for (int i = 0; i < 8; i++) raw[i] = base[(sub * 8 + i) * stride];
        }
        #pragma unroll
        for (int i = 0; i < 8; i++) dst[i] = static_cast<float>(raw[i]);
    };
    float qf[8];
    load8(qp, q_strides[3], qf);
    #pragma unroll
    for (int i = 0; i < 8; i++) qf[i] *= scale;
    float m = -3.0e38f, l = 0.0f, acc[8];
    #pragma unroll
    for (int i = 0; i < 8; i++) acc[i] = 0.0f;
    // A warp's lane groups step together (the shuffles need every lane); a group past
    // the last visible key computes on that key and discards it.
    for (int j0 = first + warp * (32 / LANES); j0 <= last; j0 += GROUPS) {
        const int j = j0 + lane / LANES;
        const bool seen = j <= last;
        const int jj = seen ? j : last;
        float kf[8], vf[8];
        load8(kb + jj * k_strides[2], k_strides[3], kf);
        float s = 0.0f;
        #pragma unroll
        for (int i = 0; i < 8; i++) s += qf[i] * kf[i];
        #pragma unroll
        for (int o = LANES / 2; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (seen) {
            load8(vb + jj * v_strides[2], v_strides[3], vf);
            const float m_new = fmaxf(m, s);
            const float keep = __expf(m - m_new), p = __expf(s - m_new);
            l = l * keep + p;
            #pragma unroll
            for (int i = 0; i < 8; i++) acc[i] = acc[i] * keep + p * vf[i];
            m = m_new;
        }
    }
    __shared__ float group_max[GROUPS], group_sum[GROUPS], group_acc[GROUPS][D];
    if (sub == 0) {
        group_max[group] = m;
        group_sum[group] = l;
    }
    #pragma unroll
    for (int i = 0; i < 8; i++) group_acc[group][sub * 8 + i] = acc[i];
    __syncthreads();
    float top = group_max[0];
    for (int g = 1; g < GROUPS; g++) top = fmaxf(top, group_max[g]);
    for (int d = t; d < D; d += WARPS * 32) {
        float num = 0.0f, den = 0.0f;
        for (int g = 0; g < GROUPS; g++) {
            const float f = __expf(group_max[g] - top);
            num += group_acc[g][d] * f;
            den += group_sum[g] * f;
        }
        out[((long long)row * heads + head) * D + d] = static_cast<T>(num / den);
    }
"#;

thread_local! {
    static KERNEL: Kernel = Kernel::new(
        "dspec_short_attention",
        &["q", "k", "v"],
        "",
        &with_constants(&[("WARPS", WARPS)], SOURCE),
        false,
    );
}

/// Whether [`attend`] serves a layer of this shape here (no score softcapping, a head
/// size of 64, 128 or 256).
pub fn serves(head_dim: i32, dtype: Dtype, softcap: bool) -> bool {
    available(dtype) && !softcap && matches!(head_dim, 64 | 128 | 256)
}

/// Attention of the R positions of `q` (`[1, heads, R, D]`, the last R positions of the
/// cache) over `keys`/`values` (`[1, kv_heads, total, D]`, any strides): `[1, R, heads·D]`.
/// `causal`: each position sees the keys up to its own; otherwise (a drafter's block)
/// every key. Under a `window`, no key of the cache before the R positions further back
/// than the window.
pub fn attend(
    q: &Array,
    keys: &Array,
    values: &Array,
    scale: f32,
    window: Option<i32>,
    causal: bool,
) -> Result<Array> {
    let (heads, rows, head_dim) = (q.shape()[1], q.shape()[2], q.shape()[3]);
    KERNEL.with(|kernel| {
        apply(
            kernel,
            &[q, keys, values],
            Launch {
                out_shape: &[1, rows, heads * head_dim],
                dtype: q.dtype(),
                grid: (heads * rows * WARPS * 32, 1, 1),
                block: WARPS * 32,
                ints: &[
                    (c"D", head_dim),
                    (c"WINDOW", window.unwrap_or(0)),
                    (c"SCALE_BITS", scale.to_bits() as i32),
                    (c"CAUSAL", i32::from(causal)),
                ],
            },
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::fast::scaled_dot_product_attention;
    use mlx_rs::ops::indexing::TryIndexOp;
    use mlx_rs::random;

    fn normal(shape: &[i32], seed: u64) -> Array {
        random::normal::<f32>(shape, None, None, Some(&random::key(seed).unwrap()))
            .unwrap()
            .as_dtype(Dtype::Bfloat16)
            .unwrap()
    }

    /// On a CUDA machine (the test binary run with MLX's CUDA libmlx; elsewhere it
    /// checks that the kernel is not used): each position of a call is MLX's attention
    /// of that position alone over the keys it sees within bf16 rounding, causal and as a
    /// drafter's block, with and without a sliding window (one shorter than the block
    /// too), for head sizes 64, 128 and 256, grouped KV heads, keys read from a longer
    /// buffer (a slice, as the cache hands them over), and the most positions a call takes.
    #[test]
    fn positions_attend_like_mlx() {
        if !available(Dtype::Bfloat16) {
            assert!(!serves(128, Dtype::Bfloat16, false));
            return;
        }
        assert!(
            !serves(128, Dtype::Bfloat16, true),
            "softcapping needs MLX's path"
        );
        assert!(!serves(96, Dtype::Bfloat16, false));
        let cases = [
            (128, None, 300, 5),
            (64, None, 1500, 5),
            (128, Some(100), 300, 5),
            (128, Some(3), 300, 5),
            (256, None, 40, 5),
            (128, None, 300, crate::cuda::MAX_ROWS),
        ];
        for ((head_dim, window, total, rows), causal) in cases
            .into_iter()
            .flat_map(|case| [(case, true), (case, false)])
        {
            let (heads, kv_heads) = (12, 2);
            let buffer = |seed| normal(&[1, kv_heads, total + 64, head_dim], seed);
            let (k, v) = (buffer(1), buffer(2));
            let (k, v) = (
                k.try_index((.., .., 0..total, ..)).unwrap(),
                v.try_index((.., .., 0..total, ..)).unwrap(),
            );
            let q = normal(&[1, heads, rows, head_dim], 3 + head_dim as u64);
            let scale = (head_dim as f32).powf(-0.5);
            let all = attend(&q, &k, &v, scale, window, causal).unwrap();
            assert_eq!(all.shape(), &[1, rows, heads * head_dim]);
            for r in 0..rows {
                let position = total - rows + r;
                // Keys `first..=last`: a block sees all of itself, a window cuts only the
                // cache before it.
                let reach = window.map_or(0, |w| (position - w + 1).max(0));
                let (first, last) = match causal {
                    true => (reach, position),
                    false => (reach.min(total - rows), total - 1),
                };
                let (k_r, v_r) = (
                    k.try_index((.., .., first..last + 1, ..)).unwrap(),
                    v.try_index((.., .., first..last + 1, ..)).unwrap(),
                );
                let q_r = q.try_index((.., .., r..r + 1, ..)).unwrap();
                let want = scaled_dot_product_attention(&q_r, &k_r, &v_r, scale, None, None)
                    .unwrap()
                    .reshape(&[1, heads * head_dim])
                    .unwrap();
                let row = all.try_index((.., r, ..)).unwrap();
                let close = row
                    .as_dtype(Dtype::Float32)
                    .unwrap()
                    .all_close(want.as_dtype(Dtype::Float32).unwrap(), 2e-2, 2e-2, None)
                    .unwrap();
                assert!(
                    close,
                    "d {head_dim} window {window:?} causal {causal}: row {r} is not MLX's attention"
                );
            }
        }
    }
}
