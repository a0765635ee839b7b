//! Attention on the CPU backend in f32, as MLX's CPU computes `scaled_dot_product_attention`
//! (it has no fused kernel there: scaled queries, a product with the keys per KV head
//! group, the mask, a softmax, a product with the values), with dspec's softmax kernel in
//! place of MLX's ([`dspec_runtime::cpu_kernels`]): on the CPU that softmax, one
//! exponential per query and key, cost more than both products.
//!
//! The products are MLX's, over the same shapes as before, so a verify's queries still
//! round as one-token decoding's do (docs/verify-numerics.md); the softmax's rows depend
//! on their values alone.

use mlx_rs::fast::ScaledDotProductAttentionMask;
use mlx_rs::ops::{arange, matmul, select};
use mlx_rs::{Array, Dtype};

use dspec_plugin_api::error::{ModelError, Result};
use dspec_runtime::cpu_kernels::{apply_to, softmax_last_axis};

/// Whether [`attend`] computes attention over these arrays (else MLX's own).
pub fn serves(q: &Array, keys: &Array, values: &Array) -> bool {
    apply_to(&[q, keys, values])
}

/// Attention of `q` (`[B, heads, L, D]`) over `keys`/`values` (`[B, kv_heads, S, D]`)
/// with MLX's masks: causal aligned to the last key, or an array (booleans, true where
/// visible, or an additive bias) broadcast over `[.., L, S]`.
pub fn attend(
    q: &Array,
    keys: &Array,
    values: &Array,
    scale: f32,
    mask: Option<ScaledDotProductAttentionMask<'_>>,
) -> Result<Array> {
    let &[b, heads, len, dim] = q.shape() else {
        return Err(ModelError::Unsupported(format!(
            "attention queries of shape {:?}: [B, heads, L, D] expected",
            q.shape()
        )));
    };
    let (kv_heads, total) = (keys.shape()[1], keys.shape()[2]);
    let group = heads / kv_heads;
    let q = q
        .multiply(Array::from_f32(scale))?
        .reshape(&[b, kv_heads, group, len, dim])?;
    let k = keys.reshape(&[b, kv_heads, 1, total, dim])?;
    let v = values.reshape(&[b, kv_heads, 1, total, dim])?;
    let mut scores = matmul(&q, k.swap_axes(-1, -2)?)?;
    let lowest = || Array::from_f32(f32::MIN);
    match mask {
        None => {}
        Some(ScaledDotProductAttentionMask::Causal) => {
            let q_pos = arange::<_, i32>(total - len, total, None)?.reshape(&[len, 1])?;
            let k_pos = arange::<_, i32>(0, total, None)?.reshape(&[1, total])?;
            scores = select(&q_pos.ge(&k_pos)?, &scores, lowest())?;
        }
        Some(ScaledDotProductAttentionMask::Array(m)) => {
            let m = as_group_mask(m, len, total)?;
            scores = match m.dtype() {
                Dtype::Bool => select(&m, &scores, lowest())?,
                _ => scores.add(&m.as_dtype(Dtype::Float32)?)?,
            };
        }
    }
    let probs = softmax_last_axis(&scores)?;
    Ok(matmul(&probs, &v)?.reshape(&[b, heads, len, dim])?)
}

/// A mask of `[.., L, S]` (a leading batch axis and a heads axis of 1 at most) as
/// `[B or 1, 1, 1, L, S]`, broadcasting over the KV heads and their query groups.
fn as_group_mask(mask: &Array, len: i32, total: i32) -> Result<Array> {
    let shape = mask.shape();
    let batch = match shape.len() {
        4 => shape[0],
        _ => 1,
    };
    Ok(mask.reshape(&[batch, 1, 1, len, total])?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::fast::scaled_dot_product_attention;
    use mlx_rs::random;

    fn normal(shape: &[i32], seed: u64) -> Array {
        let key = random::key(seed).unwrap();
        random::normal::<f32>(shape, None, None, Some(&key)).unwrap()
    }

    fn max_abs_diff(a: &Array, b: &Array) -> f32 {
        a.subtract(b)
            .unwrap()
            .abs()
            .unwrap()
            .max(None)
            .unwrap()
            .item_exact::<f32>()
    }

    /// MLX's attention and this one agree to f32 rounding under every mask MLX takes:
    /// none, causal (queries after cached keys), booleans, and an additive bias, with
    /// query heads grouped over fewer key heads and a batch of two.
    #[test]
    fn agrees_with_mlx_attention_under_every_mask() {
        let (b, heads, kv_heads, len, total, dim) = (2, 6, 2, 5, 13, 16);
        let q = normal(&[b, heads, len, dim], 1);
        let k = normal(&[b, kv_heads, total, dim], 2);
        let v = normal(&[b, kv_heads, total, dim], 3);
        let scale = 0.25;
        assert!(serves(&q, &k, &v), "f32 on the CPU");
        let visible = normal(&[len, total], 4).gt(Array::from_f32(-0.5)).unwrap();
        let bias = normal(&[1, 1, len, total], 5);
        let mask = |i: usize| match i {
            0 => None,
            1 => Some(ScaledDotProductAttentionMask::Causal),
            2 => Some(ScaledDotProductAttentionMask::Array(&visible)),
            _ => Some(ScaledDotProductAttentionMask::Array(&bias)),
        };
        for i in 0..4 {
            let ours = attend(&q, &k, &v, scale, mask(i)).unwrap();
            let theirs = scaled_dot_product_attention(&q, &k, &v, scale, mask(i), None).unwrap();
            assert_eq!(ours.shape(), theirs.shape());
            let diff = max_abs_diff(&ours, &theirs);
            assert!(diff < 2e-6, "mask {i}: {diff}");
        }
    }

    /// A query over its keys and the same query over a longer buffer whose extra keys
    /// are masked give the same bits: what lets a step read keys up to a rounded length
    /// and still compute each query as over its own keys.
    #[test]
    fn masked_keys_past_a_query_change_nothing() {
        let (heads, kv_heads, total, seen, dim) = (4, 2, 40, 27, 8);
        let k = normal(&[1, kv_heads, total, dim], 6);
        let v = normal(&[1, kv_heads, total, dim], 7);
        let q = normal(&[1, heads, 1, dim], 8);
        let visible = mlx_rs::ops::arange::<_, i32>(0, total, None)
            .unwrap()
            .lt(Array::from_int(seen))
            .unwrap()
            .reshape(&[1, total])
            .unwrap();
        let padded = attend(
            &q,
            &k,
            &v,
            0.3,
            Some(ScaledDotProductAttentionMask::Array(&visible)),
        )
        .unwrap();
        let keys = dspec_runtime::slicing::slice_axis(&k, 2, 0, seen).unwrap();
        let values = dspec_runtime::slicing::slice_axis(&v, 2, 0, seen).unwrap();
        let own = attend(&q, &keys, &values, 0.3, None).unwrap();
        assert_eq!(max_abs_diff(&own, &padded), 0.0);
    }
}
