//! Per-layer key/value cache over a preallocated buffer. `trim(n)` only moves the
//! write offset back, so rejecting speculative tokens costs O(1) whatever the context.

use std::any::Any;

use mlx_rs::ops::{concatenate, zeros_dtype};
use mlx_rs::Array;

use crate::error::Result;
use dspec_runtime::slicing::{slice_axis, write_axis};

/// Buffers are allocated in multiples of this many positions. Deliberately not 256:
/// MLX's CUDA backend sends one-token attention over a buffer whose length is a multiple
/// of 256 to cuDNN, with a plan built per buffer length; with 255 one-token attention
/// always takes MLX's own vector kernel (why plans per shape matter:
/// docs/benchmarks.md, "Where the time goes on CUDA").
const GROWTH_STEP: i32 = 255;

/// Keys and values of one attention layer, shaped `[B, kv_heads, capacity, head_dim]`.
/// Only the first `offset` positions along axis 2 are valid.
#[derive(Default)]
pub struct KvCache {
    keys: Option<Array>,
    values: Option<Array>,
    offset: i32,
    /// Positions the first allocation covers at least ([`KvCache::reserve`]).
    reserved: usize,
}

impl KvCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of valid positions (the position of the next token written).
    pub fn offset(&self) -> usize {
        self.offset as usize
    }

    /// Sizes the next allocation for at least `positions` (rounded up as growth is), so
    /// that a generation whose length is known ahead keeps one buffer length: on CUDA
    /// every buffer length means new attention plans (see [`KvCache::capacity_for`]).
    pub fn reserve(&mut self, positions: usize) {
        self.reserved = self.reserved.max(positions);
    }

    /// Allocated positions.
    pub fn capacity(&self) -> usize {
        self.keys.as_ref().map_or(0, |k| k.shape()[2] as usize)
    }

    /// Appends `keys`/`values` (`[B, H, L, D]`) at the offset and returns all valid
    /// keys and values, `[B, H, offset + L, D]`.
    pub fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        let (k_buf, v_buf) = self.write(keys, values)?;
        Ok((
            slice_axis(&k_buf, 2, 0, self.offset)?,
            slice_axis(&v_buf, 2, 0, self.offset)?,
        ))
    }

    /// Like [`KvCache::update_and_fetch`], but returns the whole allocated buffers,
    /// `[B, H, capacity, D]`: positions from `offset + L` on hold stale or zero values,
    /// which the caller masks. A short continuation attends over this fixed-length view
    /// so that its shapes repeat from one verify to the next (see [`KvCache::capacity_for`]).
    pub fn update_and_fetch_whole(
        &mut self,
        keys: &Array,
        values: &Array,
    ) -> Result<(Array, Array)> {
        self.write(keys, values)
    }

    /// Writes `keys`/`values` at the offset, moves it past them and returns the buffers.
    fn write(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
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
        Ok((k_buf.clone(), v_buf.clone()))
    }

    /// The capacity the cache will have once it holds `end` positions. Capacities double
    /// (`GROWTH_STEP · 2^n`), so a long generation passes through few distinct buffer
    /// lengths: every shape-keyed plan a backend builds for attention over the whole
    /// buffer (cuDNN on CUDA) is built a few times per process, not every few hundred
    /// tokens. The price is up to twice the memory the positions need.
    pub fn capacity_for(&self, end: usize) -> usize {
        let current = self.capacity();
        if end <= current {
            return current;
        }
        let end = end.max(self.reserved);
        let mut capacity = (current.max(GROWTH_STEP as usize)).max(1);
        while capacity < end {
            capacity *= 2;
        }
        capacity
    }

    /// Forgets the last `n` positions (clamped to what is there); returns how many were dropped.
    pub fn trim(&mut self, n: usize) -> usize {
        let n = (n as i32).min(self.offset);
        self.offset -= n;
        n as usize
    }

    fn grow(&mut self, keys: &Array, values: &Array, needed: i32) -> Result<()> {
        let capacity = self.capacity_for(needed as usize) as i32;
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

    /// Sizes every layer's next allocation for at least `positions` ([`KvCache::reserve`]);
    /// an external cache manages its own memory and is left alone.
    pub fn reserve(&mut self, positions: usize) {
        self.layers.iter_mut().for_each(|l| l.reserve(positions));
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

    #[test]
    fn a_reservation_sizes_the_first_allocation() {
        let step = GROWTH_STEP as usize;
        let mut cache = KvCache::new();
        cache.reserve(3 * step);
        assert_eq!(cache.capacity_for(1), 4 * step, "rounded up as growth is");
        let a = kv(10, 9);
        let (k, _) = cache.update_and_fetch(&a, &a).unwrap();
        assert_eq!(cache.capacity(), 4 * step);
        assert_eq!(
            k.shape(),
            &[1, 2, 10, 4],
            "only the written positions are valid"
        );
        let b = kv(3 * step as i32, 10);
        cache.update_and_fetch(&b, &b).unwrap();
        assert_eq!(cache.capacity(), 4 * step, "the reservation held it");
        assert_eq!(
            cache.capacity_for(4 * step + 1),
            8 * step,
            "growth goes on past it"
        );
    }

    #[test]
    fn capacities_double_and_are_predicted_before_writing() {
        let mut cache = KvCache::new();
        let step = GROWTH_STEP as usize;
        assert_eq!(cache.capacity_for(1), step);
        assert_eq!(cache.capacity_for(3 * step), 4 * step);
        let a = kv(10, 7);
        cache.update_and_fetch(&a, &a).unwrap();
        assert_eq!(cache.capacity(), step);
        assert_eq!(cache.capacity_for(step), step, "fits: no growth");
        assert_eq!(cache.capacity_for(step + 1), 2 * step);
        assert_eq!(cache.capacity_for(5 * step), 8 * step);
        let b = kv(step as i32, 8);
        cache.update_and_fetch(&b, &b).unwrap();
        assert_eq!(
            cache.capacity(),
            2 * step,
            "growth is what capacity_for said"
        );
    }

    #[test]
    fn the_whole_buffer_holds_the_valid_prefix_first() {
        let mut cache = KvCache::new();
        let a = kv(6, 9);
        cache.update_and_fetch(&a, &a).unwrap();
        assert_eq!(cache.trim(2), 2);
        let b = kv(3, 10);
        let (k, v) = cache.update_and_fetch_whole(&b, &b).unwrap();
        assert_eq!(k.shape(), &[1, 2, GROWTH_STEP, 4]);
        let kept = a.try_index((.., .., ..4)).unwrap();
        let expected = concatenate(&[kept, b], 2).unwrap();
        assert!(k
            .try_index((.., .., ..7))
            .unwrap()
            .all_close(&expected, 0.0, 0.0, None)
            .unwrap());
        assert!(v
            .try_index((.., .., ..7))
            .unwrap()
            .all_close(&expected, 0.0, 0.0, None)
            .unwrap());
        assert_eq!(cache.offset(), 7);
    }
}
