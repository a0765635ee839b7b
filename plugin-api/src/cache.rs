//! Per-layer key/value cache over a preallocated buffer. `trim(n)` only moves the
//! write offset back, so rejecting speculative tokens costs O(1) whatever the context.

use std::any::Any;

use mlx_rs::ops::{concatenate, zeros_dtype};
use mlx_rs::Array;

use crate::error::Result;
use crate::slicing::{slice_axis, write_axis};

/// Positions are allocated in chunks of this many so that decode steps rarely grow the
/// buffer. Deliberately not 256: MLX's CUDA backend sends one-token attention over a
/// buffer whose length is a multiple of 256 to cuDNN, keyed by the buffer's length, and
/// a speculative verify (which writes ahead, so its buffer can be one chunk longer at the
/// same position) would then round differently from plain decoding. With 255 every
/// one-token attention takes MLX's own vector kernel, whatever the buffer length.
const GROWTH_STEP: i32 = 255;

/// Keys and values of one attention layer, shaped `[B, kv_heads, capacity, head_dim]`.
/// Only the first `offset` positions along axis 2 are valid.
#[derive(Default)]
pub struct KvCache {
    keys: Option<Array>,
    values: Option<Array>,
    offset: i32,
}

impl KvCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of valid positions (the position of the next token written).
    pub fn offset(&self) -> usize {
        self.offset as usize
    }

    /// Allocated positions.
    pub fn capacity(&self) -> usize {
        self.keys.as_ref().map_or(0, |k| k.shape()[2] as usize)
    }

    /// Appends `keys`/`values` (`[B, H, L, D]`) at the offset and returns all valid
    /// keys and values, `[B, H, offset + L, D]`.
    pub fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        let new_len = keys.shape()[2];
        let end = self.offset + new_len;
        if end as usize > self.capacity() {
            self.grow(keys, values, end)?;
        }
        let (Some(k_buf), Some(v_buf)) = (self.keys.as_mut(), self.values.as_mut()) else {
            unreachable!("grow always allocates both buffers");
        };
        // Writing into the buffer is an in-place update when MLX holds the only reference.
        *k_buf = write_axis(k_buf, keys, 2, self.offset)?;
        *v_buf = write_axis(v_buf, values, 2, self.offset)?;
        self.offset = end;
        Ok((slice_axis(k_buf, 2, 0, end)?, slice_axis(v_buf, 2, 0, end)?))
    }

    /// Forgets the last `n` positions (clamped to what is there); returns how many were dropped.
    pub fn trim(&mut self, n: usize) -> usize {
        let n = (n as i32).min(self.offset);
        self.offset -= n;
        n as usize
    }

    fn grow(&mut self, keys: &Array, values: &Array, needed: i32) -> Result<()> {
        let capacity = (needed + GROWTH_STEP - 1) / GROWTH_STEP * GROWTH_STEP;
        let grow_one = |old: Option<&Array>, like: &Array| -> Result<Array> {
            let shape = like.shape();
            let fresh = |len: i32| zeros_dtype(&[shape[0], shape[1], len, shape[3]], like.dtype());
            Ok(match old {
                // Keep only the valid prefix: trimmed positions need not be copied.
                Some(old) if self.offset > 0 => {
                    let valid = slice_axis(old, 2, 0, self.offset)?;
                    concatenate(&[valid, fresh(capacity - self.offset)?], 2)?
                }
                _ => fresh(capacity)?,
            })
        };
        let k = grow_one(self.keys.as_ref(), keys)?;
        let v = grow_one(self.values.as_ref(), values)?;
        self.keys = Some(k);
        self.values = Some(v);
        Ok(())
    }

    /// The arrays backing the cache (for evaluation together with a step's outputs).
    pub fn state(&self) -> impl Iterator<Item = &Array> {
        self.keys.iter().chain(self.values.iter())
    }
}

/// A cache kept outside this process's Rust types, such as a dylib plugin's own cache
/// behind an opaque handle. The engine only moves it (trim), asks where it stands
/// (offset) and evaluates its arrays together with a step's outputs (state).
pub trait ExternalCache: Send {
    /// Tokens currently held.
    fn offset(&self) -> usize;

    /// Forgets the last `n` positions (clamped); returns how many were dropped.
    fn trim(&mut self, n: usize) -> usize;

    /// The arrays backing the cache, as of the latest forward pass.
    fn state(&self) -> &[Array];

    /// For the model that made the cache to get its own type back.
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// The cache of a whole model: one `KvCache` per decoder layer, moved in lockstep,
/// or an [`ExternalCache`] when the model keeps its cache itself (plugins).
#[derive(Default)]
pub struct ModelCache {
    pub layers: Vec<KvCache>,
    external: Option<Box<dyn ExternalCache>>,
}

impl ModelCache {
    pub fn new(num_layers: usize) -> Self {
        Self {
            layers: (0..num_layers).map(|_| KvCache::new()).collect(),
            external: None,
        }
    }

    /// A cache the model manages itself; `layers` stays empty, so a model expecting
    /// per-layer caches rejects it instead of silently running without one.
    pub fn external(cache: Box<dyn ExternalCache>) -> Self {
        Self {
            layers: Vec::new(),
            external: Some(cache),
        }
    }

    /// The external cache, when this is one.
    pub fn external_mut(&mut self) -> Option<&mut dyn ExternalCache> {
        match &mut self.external {
            Some(cache) => Some(cache.as_mut()),
            None => None,
        }
    }

    /// Tokens currently held (all layers agree).
    pub fn offset(&self) -> usize {
        match &self.external {
            Some(cache) => cache.offset(),
            None => self.layers.first().map_or(0, KvCache::offset),
        }
    }

    /// Drops the last `n` positions from every layer.
    pub fn trim(&mut self, n: usize) -> usize {
        match &mut self.external {
            Some(cache) => cache.trim(n),
            None => self.layers.iter_mut().map(|l| l.trim(n)).min().unwrap_or(0),
        }
    }

    pub fn state(&self) -> impl Iterator<Item = &Array> {
        self.layers
            .iter()
            .flat_map(KvCache::state)
            .chain(self.external.iter().flat_map(|cache| cache.state().iter()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::ops::indexing::TryIndexOp;
    use mlx_rs::random;

    fn kv(len: i32, seed: u64) -> Array {
        let key = random::key(seed).unwrap();
        random::normal::<f32>(&[1, 2, len, 4], None, None, Some(&key)).unwrap()
    }

    #[test]
    fn update_returns_everything_written_so_far() {
        let mut cache = KvCache::new();
        let a = kv(3, 1);
        let b = kv(2, 2);
        cache.update_and_fetch(&a, &a).unwrap();
        let (k, v) = cache.update_and_fetch(&b, &b).unwrap();
        let expected = concatenate(&[a, b], 2).unwrap();
        assert_eq!(k.shape(), &[1, 2, 5, 4]);
        assert!(k.all_close(&expected, 0.0, 0.0, None).unwrap());
        assert!(v.all_close(&expected, 0.0, 0.0, None).unwrap());
        assert_eq!(cache.offset(), 5);
    }

    #[test]
    fn trim_then_write_overwrites_the_trimmed_positions() {
        let mut cache = KvCache::new();
        let a = kv(4, 3);
        cache.update_and_fetch(&a, &a).unwrap();
        assert_eq!(cache.trim(2), 2);
        let b = kv(1, 4);
        let (k, _) = cache.update_and_fetch(&b, &b).unwrap();
        let kept = a.try_index((.., .., ..2)).unwrap();
        let expected = concatenate(&[kept, b], 2).unwrap();
        assert_eq!(k.shape(), &[1, 2, 3, 4]);
        assert!(k.all_close(&expected, 0.0, 0.0, None).unwrap());
        assert_eq!(cache.trim(99), 3, "trim clamps to what is held");
    }

    #[test]
    fn growth_preserves_contents_across_chunk_boundaries() {
        let mut cache = KvCache::new();
        let a = kv(GROWTH_STEP - 1, 5);
        cache.update_and_fetch(&a, &a).unwrap();
        assert_eq!(cache.capacity(), GROWTH_STEP as usize);
        let b = kv(3, 6);
        let (k, _) = cache.update_and_fetch(&b, &b).unwrap();
        assert_eq!(cache.capacity(), 2 * GROWTH_STEP as usize);
        let expected = concatenate(&[a, b], 2).unwrap();
        assert!(k.all_close(&expected, 0.0, 0.0, None).unwrap());
    }
}
