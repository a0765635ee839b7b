//! A model's cache: per decoder layer either attention keys/values ([`KvCache`]) or
//! the state of a recurrent (linear-attention) layer ([`RecurrentCache`]), behind one
//! [`ModelCache`] that keeps the layers at one position and says how far back it can go.
//!
//! Rolling back is part of the contract: speculative decoding runs a draft model over
//! tokens it drafts one by one, and the target over a block of drafts at once, then
//! forgets the rejected ones ([`ModelCache::trim`]). Keys and values are per position,
//! so forgetting is an offset move, O(1) whatever the context. A recurrent state mixes
//! every position into one array and cannot be un-applied; such a layer keeps the
//! states after its recent positions and returns to one of them. How far that reaches
//! is [`ModelCache::rollback_limit`]; a trim beyond it is an error, never a silent
//! partial rollback.

use std::any::Any;
use std::collections::VecDeque;

use mlx_rs::ops::{concatenate, zeros_dtype};
use mlx_rs::Array;

use crate::error::{ModelError, Result};
use crate::kv_pool::{KvPool, PoolSlot, PoolView};
use dspec_runtime::slicing::{slice_axis, write_axis};
use dspec_runtime::Backend;

/// Buffers are allocated in multiples of this many positions. Deliberately not 256:
/// MLX's CUDA backend sends one-token attention over a buffer whose length is a multiple
/// of 256 to cuDNN, with a plan built per buffer length; with 255 one-token attention
/// always takes MLX's own vector kernel (why plans per shape matter:
/// docs/benchmarks.md, "Where the time goes on CUDA").
pub(crate) const GROWTH_STEP: i32 = 255;

/// Longest continuation of a cached sequence that attends over the whole cache buffer;
/// shorter ones run padded to it, so that a backend that builds a plan per query length
/// (cuDNN on CUDA) builds one per capacity, not one per verify width and catch-up
/// length. On CUDA a short forward's cost barely depends on its width, while each new
/// plan costs as much as dozens of decode steps (docs/benchmarks.md has the measurements).
/// Callers that feed a cache in pieces (a draft model catching up, the engine telling a
/// drafter of plain steps) use it as the piece size, so their forwards repeat shapes too.
pub const WHOLE_BUFFER_MAX_TOKENS: i32 = 32;

/// Whether attention over the whole cache buffer pays on this backend, for a short
/// continuation of a cached sequence (a speculative verify, typically), over MLX's
/// causal mode on the written keys.
///
/// Only on CUDA, where MLX runs attention for more than one query through cuDNN and
/// builds a cuDNN graph per distinct (query length, key length, strides): with the key
/// length growing by the kept tokens every round, each verify paid a graph build. Over
/// the whole buffer the key length is the capacity, which changes rarely
/// ([`KvCache::capacity_for`]), so the graphs are built once per width and capacity
/// (docs/benchmarks.md, "Where the time goes on CUDA", says what that saves). Metal's and
/// the CPU's attention build nothing per length, and there the unwritten part of the
/// buffer would only be read for nothing.
pub fn whole_buffer_pays() -> bool {
    Backend::current() == Backend::Cuda
}

/// Keys and values of one attention layer, shaped `[B, kv_heads, capacity, head_dim]`.
/// Only the first `offset` positions along axis 2 are valid. A cache that joined a
/// [`KvPool`] keeps them in its slot there instead ([`KvCache::join_pool`]).
#[derive(Default)]
pub struct KvCache {
    keys: Option<Array>,
    values: Option<Array>,
    offset: i32,
    /// Positions the first allocation covers at least ([`KvCache::reserve`]).
    reserved: usize,
    pooled: Option<PoolSlot>,
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
        match &self.pooled {
            Some(slot) => slot.pool.capacity(),
            None => self.keys.as_ref().map_or(0, |k| k.shape()[2] as usize),
        }
    }

    /// Appends `keys`/`values` (`[B, H, L, D]`) at the offset and returns all valid
    /// keys and values, `[B, H, offset + L, D]`.
    pub fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        self.append(keys, values)?;
        self.fetch()
    }

    /// Appends `keys`/`values` (`[B, H, L, D]`) at the offset. With [`KvCache::fetch`]
    /// after it: in a pool, every sequence's writes go first, so that each write
    /// updates the buffer in place (a read between writes would make the next one copy
    /// the whole pool).
    pub fn append(&mut self, keys: &Array, values: &Array) -> Result<()> {
        match &self.pooled {
            Some(slot) => {
                check_pooled_batch(keys)?;
                slot.pool.write(slot.index, self.offset, keys, values)?;
                self.offset += keys.shape()[2];
            }
            None => {
                self.write(keys, values)?;
            }
        }
        Ok(())
    }

    /// Every valid key and value, `[B, H, offset, D]` (views).
    pub fn fetch(&self) -> Result<(Array, Array)> {
        match &self.pooled {
            Some(slot) => slot.pool.fetch(slot.index, Some(self.offset)),
            None => match (&self.keys, &self.values) {
                (Some(k), Some(v)) => Ok((
                    slice_axis(k, 2, 0, self.offset)?,
                    slice_axis(v, 2, 0, self.offset)?,
                )),
                _ => Err(ModelError::Unsupported(
                    "keys and values were read from a cache nothing was written to".into(),
                )),
            },
        }
    }

    /// Moves this cache's positions into a slot of `pool` (the pool's buffers must
    /// have this cache's head shape and dtype). Its positions then live there until
    /// [`KvCache::leave_pool`], and it works as before.
    pub fn join_pool(&mut self, pool: &KvPool) -> Result<()> {
        if self.pooled.is_some() {
            self.leave_pool()?;
        }
        let slot = pool.take_slot();
        if self.offset > 0 {
            let (k, v) = self.fetch()?;
            pool.write(slot.index, 0, &k, &v)?;
        }
        self.keys = None;
        self.values = None;
        self.pooled = Some(slot);
        Ok(())
    }

    /// Takes this cache's positions out of its pool into buffers of its own (a copy
    /// of what it holds, made now) and frees the slot; nothing to do outside a pool.
    pub fn leave_pool(&mut self) -> Result<()> {
        self.copy_out_of_pool()?;
        Ok(mlx_rs::transforms::eval(self.state())?)
    }

    /// [`KvCache::leave_pool`] with the copy left to the next evaluation. Until then the
    /// copy refers to the pool's buffers, and the pool's next write, finding them
    /// shared, copies every slot instead of writing in place: evaluate before it.
    fn copy_out_of_pool(&mut self) -> Result<()> {
        let Some(slot) = self.pooled.take() else {
            return Ok(());
        };
        if self.offset > 0 {
            let (k, v) = slot.pool.fetch(slot.index, Some(self.offset))?;
            let offset = self.offset;
            self.offset = 0;
            self.write(&k, &v)?;
            debug_assert_eq!(self.offset, offset);
        }
        Ok(())
    }

    /// The pool this cache's positions are in, if any.
    pub fn pool(&self) -> Option<&KvPool> {
        self.pooled.as_ref().map(|s| &s.pool)
    }

    /// Writes `lens[r]` new positions for each of `caches[r]` (all in one pool;
    /// `keys`/`values` `[T, H, 1, D]`, one position a row, cache r's from row
    /// `starts[r]` on) in a few graph nodes, and returns the pool's whole buffers with
    /// what each slot holds, for attention over every slot at once, and each cache's
    /// slot. `None` when the caches are not all in one pool (nothing is written then).
    pub fn append_each(
        caches: &mut [&mut KvCache],
        keys: &Array,
        values: &Array,
        starts: &[i32],
        lens: &[i32],
    ) -> Result<Option<(PoolView, Vec<usize>)>> {
        let Some(pool) = caches.first().and_then(|c| c.pool()).cloned() else {
            return Ok(None);
        };
        let mut slots = Vec::with_capacity(caches.len());
        for cache in caches.iter() {
            match &cache.pooled {
                Some(slot) if slot.pool.same(&pool) => slots.push(slot.index),
                _ => return Ok(None),
            }
        }
        let view = pool.append_each(&slots, starts, lens, keys, values)?;
        for (cache, &len) in caches.iter_mut().zip(lens) {
            cache.offset += len;
        }
        Ok(Some((view, slots)))
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
        let Some(slot) = &self.pooled else {
            return self.write(keys, values);
        };
        let (pool, index) = (slot.pool.clone(), slot.index);
        self.append(keys, values)?;
        pool.fetch(index, None)
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
        match end <= current {
            true => current,
            false => grown_capacity(current, end.max(self.reserved)),
        }
    }

    /// Forgets the last `n` positions; asking for more than the cache holds is an error
    /// (and forgets nothing).
    pub fn trim(&mut self, n: usize) -> Result<()> {
        if n > self.offset() {
            return Err(ModelError::CannotRollBack {
                asked: n,
                held: self.offset(),
                limit: self.offset(),
            });
        }
        self.offset -= n as i32;
        if let Some(slot) = &self.pooled {
            slot.pool.set_held(slot.index, self.offset);
        }
        Ok(())
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

    /// The arrays backing the cache (for evaluation together with a step's outputs);
    /// none in a pool, whose owner evaluates its buffers ([`KvPool::arrays`]).
    pub fn state(&self) -> impl Iterator<Item = &Array> {
        self.keys.iter().chain(self.values.iter())
    }
}

/// The buffer length that holds `end` positions, grown from `current` the way every
/// key/value buffer grows: unchanged when it already does, else `GROWTH_STEP · 2^n`.
pub(crate) fn grown_capacity(current: usize, end: usize) -> usize {
    if end <= current {
        return current;
    }
    let mut capacity = current.max(GROWTH_STEP as usize);
    while capacity < end {
        capacity *= 2;
    }
    capacity
}

/// A pool holds one sequence per slot.
fn check_pooled_batch(keys: &Array) -> Result<()> {
    match keys.shape()[0] {
        1 => Ok(()),
        b => Err(ModelError::Unsupported(format!(
            "a cache in a key/value pool holds one sequence, not a batch of {b}"
        ))),
    }
}

/// The state of one recurrent layer (Gated DeltaNet and the like): the arrays it
/// carries from one position to the next (say a convolution window and the
/// recurrence's state), after the position the cache is at, and after each of a
/// bounded window of positions before it.
///
/// Why states are kept, not recomputed: the alternative, a snapshot before a forward
/// plus the recurrence's inputs, rebuilds a rolled-back state by running the kept
/// steps again. Speculative rounds reject some drafts in most rounds, so that would
/// add a replay to nearly every round: more graph nodes per round where a GPU decode
/// is bound by host time, and work proportional to the tokens kept. A forward run
/// position by position computes each state anyway; keeping them makes a rollback
/// picking one, O(1) and exact, at the price of memory for the window
/// (docs/hybrid-cache.md has the arithmetic and the measurements).
pub struct RecurrentCache {
    /// Positions consumed.
    offset: usize,
    /// The state after `offset` positions; empty before the first forward (the layer's
    /// initial state, whatever the layer takes that to be).
    current: Vec<Array>,
    /// The states after the positions just before `offset`, oldest first: entry `i` is
    /// the state after position `offset - kept.len() + i`.
    kept: VecDeque<Vec<Array>>,
    /// Most states kept besides the current one.
    window: usize,
    /// How many of the newest `kept` entries the latest forward made (still to be
    /// evaluated along with its outputs; older ones already were).
    fresh: usize,
}

impl RecurrentCache {
    /// An empty cache that keeps up to `window` past states.
    pub fn new(window: usize) -> Self {
        Self {
            offset: 0,
            current: Vec::new(),
            kept: VecDeque::new(),
            window,
            fresh: 0,
        }
    }

    /// Positions consumed.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The state after [`RecurrentCache::offset`] positions (empty: the initial state).
    pub fn current(&self) -> &[Array] {
        &self.current
    }

    /// Most positions this cache keeps states for besides the current one.
    pub fn window(&self) -> usize {
        self.window
    }

    /// How many of the latest positions [`RecurrentCache::trim`] can forget now.
    pub fn rollback_limit(&self) -> usize {
        self.kept.len()
    }

    /// Keeps up to `window` past states from now on (dropping the oldest beyond it).
    pub fn set_window(&mut self, window: usize) {
        self.window = window;
        while self.kept.len() > window {
            self.kept.pop_front();
        }
        self.fresh = self.fresh.min(self.kept.len());
    }

    /// Records a forward of `len` positions. `states` are the states after its last
    /// `states.len()` positions (between 1 and `len` of them), oldest first; the last is
    /// the new current state. A forward that hands over a state per position stays
    /// contiguous with what was kept before it; one that hands over fewer starts the
    /// window afresh at its first state.
    pub fn advance(&mut self, len: usize, mut states: Vec<Vec<Array>>) -> Result<()> {
        if states.is_empty() || states.len() > len {
            return Err(ModelError::Unsupported(format!(
                "a recurrent layer handed over {} states for a forward of {len} positions \
                 (between 1 and {len} expected): a bug in the model family",
                states.len()
            )));
        }
        let Some(last) = states.pop() else {
            unreachable!("checked non-empty above");
        };
        if states.len() + 1 == len {
            self.kept.push_back(std::mem::take(&mut self.current));
        } else {
            self.kept.clear();
        }
        self.fresh = states.len();
        self.kept.extend(states);
        self.current = last;
        while self.kept.len() > self.window {
            self.kept.pop_front();
        }
        self.fresh = self.fresh.min(self.kept.len());
        self.offset += len;
        Ok(())
    }

    /// Returns to the state `n` positions back; beyond [`RecurrentCache::rollback_limit`]
    /// it is an error and nothing changes.
    pub fn trim(&mut self, n: usize) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        if n > self.kept.len() {
            return Err(ModelError::CannotRollBack {
                asked: n,
                held: self.offset,
                limit: self.kept.len(),
            });
        }
        let at = self.kept.len() - n;
        self.kept.truncate(at + 1);
        if let Some(state) = self.kept.pop_back() {
            self.current = state;
        }
        self.offset -= n;
        self.fresh = self.fresh.min(self.kept.len());
        Ok(())
    }

    /// The current state and the states the latest forward added to the window.
    pub fn state(&self) -> impl Iterator<Item = &Array> {
        let fresh = self.kept.len() - self.fresh..;
        self.current.iter().chain(self.kept.range(fresh).flatten())
    }
}

/// One decoder layer's cache.
pub enum LayerCache {
    /// Keys and values of an attention layer.
    Attention(KvCache),
    /// The state of a recurrent (linear-attention) layer.
    Recurrent(RecurrentCache),
}

impl LayerCache {
    pub fn offset(&self) -> usize {
        match self {
            LayerCache::Attention(kv) => kv.offset(),
            LayerCache::Recurrent(r) => r.offset(),
        }
    }

    /// How many of the latest positions this layer can forget now.
    pub fn rollback_limit(&self) -> usize {
        match self {
            LayerCache::Attention(kv) => kv.offset(),
            LayerCache::Recurrent(r) => r.rollback_limit(),
        }
    }

    /// The attention cache, or an error when this layer's cache is recurrent (a cache
    /// made by another model).
    pub fn kv_mut(&mut self) -> Result<&mut KvCache> {
        match self {
            LayerCache::Attention(kv) => Ok(kv),
            LayerCache::Recurrent(_) => Err(ModelError::Unsupported(
                "an attention layer got a recurrent layer's cache: the cache was made for a different model".into(),
            )),
        }
    }

    /// The recurrent cache, or an error when this layer's cache holds keys and values.
    pub fn recurrent_mut(&mut self) -> Result<&mut RecurrentCache> {
        match self {
            LayerCache::Recurrent(r) => Ok(r),
            LayerCache::Attention(_) => Err(ModelError::Unsupported(
                "a recurrent layer got an attention layer's cache: the cache was made for a different model".into(),
            )),
        }
    }

    fn trim(&mut self, n: usize) -> Result<()> {
        match self {
            LayerCache::Attention(kv) => kv.trim(n),
            LayerCache::Recurrent(r) => r.trim(n),
        }
    }

    fn reserve(&mut self, positions: usize) {
        if let LayerCache::Attention(kv) = self {
            kv.reserve(positions);
        }
    }

    /// The arrays to evaluate with a step's outputs.
    pub fn state(&self) -> impl Iterator<Item = &Array> {
        let (kv, recurrent) = match self {
            LayerCache::Attention(kv) => (Some(kv), None),
            LayerCache::Recurrent(r) => (None, Some(r)),
        };
        kv.into_iter()
            .flat_map(KvCache::state)
            .chain(recurrent.into_iter().flat_map(RecurrentCache::state))
    }
}

/// A cache kept outside this process's Rust types, such as a dylib plugin's own cache
/// behind an opaque handle. The engine only moves it (trim), asks where it stands
/// (offset, rollback limit) and evaluates its arrays together with a step's outputs
/// (state).
///
/// For plugin authors: a cache whose positions are independent (keys and values) can
/// forget any number of the positions it holds, which is what the defaults of
/// [`ExternalCache::rollback_limit`] and [`ExternalCache::rollback_window`] say. A
/// cache with recurrent state says how far back it can go with both, and refuses a
/// trim beyond that with [`ModelError::CannotRollBack`] ([`ModelCache::trim`] refuses
/// it before asking). A dylib plugin's cache says it across the C ABI
/// (`plugin::abi::RollbackFunctions`).
pub trait ExternalCache: Send {
    /// Tokens currently held.
    fn offset(&self) -> usize;

    /// How many of the latest positions [`ExternalCache::trim`] can forget now.
    /// Default: everything held.
    fn rollback_limit(&self) -> usize {
        self.offset()
    }

    /// How many positions back a trim can always go after any forward (once that many
    /// are held); `None`: no bound but what is held (the default).
    fn rollback_window(&self) -> Option<usize> {
        None
    }

    /// The caller will roll back no more than `positions` after a forward: a cache that
    /// keeps past states for rolling back may keep that many (and no more). Default:
    /// nothing to do.
    fn set_rollback_window(&mut self, _positions: usize) {}

    /// Forgets exactly the last `n` positions, or fails and forgets nothing.
    fn trim(&mut self, n: usize) -> Result<()>;

    /// The arrays backing the cache, as of the latest forward pass.
    fn state(&self) -> &[Array];

    /// For the model that made the cache to get its own type back.
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// The cache of a whole model: one [`LayerCache`] per decoder layer, kept at one
/// position, or an [`ExternalCache`] when the model keeps its cache itself (plugins).
#[derive(Default)]
pub struct ModelCache {
    layers: Vec<LayerCache>,
    external: Option<Box<dyn ExternalCache>>,
}

impl ModelCache {
    /// An attention cache for each of `num_layers` layers.
    pub fn new(num_layers: usize) -> Self {
        Self::with_layers(
            (0..num_layers)
                .map(|_| LayerCache::Attention(KvCache::new()))
                .collect(),
        )
    }

    /// A cache of the given per-layer kinds (hybrid models: attention and recurrent).
    pub fn with_layers(layers: Vec<LayerCache>) -> Self {
        Self {
            layers,
            external: None,
        }
    }

    /// A cache the model manages itself; it has no layers, so a model expecting
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

    /// Number of per-layer caches (0 for an external cache).
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    pub fn layers(&self) -> &[LayerCache] {
        &self.layers
    }

    /// The per-layer caches, for the model's forward to write. A forward must leave
    /// every layer at the same position ([`ModelCache::checked_offset`] checks it).
    pub fn layers_mut(&mut self) -> &mut [LayerCache] {
        &mut self.layers
    }

    /// Tokens currently held: what every layer holds. Should layers disagree (a forward
    /// failed part-way), the fewest any layer holds; [`ModelCache::checked_offset`]
    /// says so as an error.
    pub fn offset(&self) -> usize {
        match &self.external {
            Some(cache) => cache.offset(),
            None => self
                .layers
                .iter()
                .map(LayerCache::offset)
                .min()
                .unwrap_or(0),
        }
    }

    /// Tokens currently held, or an error when the layers disagree about it.
    pub fn checked_offset(&self) -> Result<usize> {
        if let Some(cache) = &self.external {
            return Ok(cache.offset());
        }
        let mut offsets = self.layers.iter().map(LayerCache::offset).enumerate();
        let Some((_, first)) = offsets.next() else {
            return Ok(0);
        };
        match offsets.find(|&(_, o)| o != first) {
            None => Ok(first),
            Some((i, other)) => Err(ModelError::Unsupported(format!(
                "the cache's layers disagree on the positions they hold (layer 0: {first}, \
                 layer {i}: {other}): a forward failed part-way through; start a new cache"
            ))),
        }
    }

    /// How many of the latest positions [`ModelCache::trim`] can forget now: everything
    /// held for attention layers, the kept window for recurrent ones.
    pub fn rollback_limit(&self) -> usize {
        match &self.external {
            Some(cache) => cache.rollback_limit(),
            None => self
                .layers
                .iter()
                .map(LayerCache::rollback_limit)
                .min()
                .unwrap_or(0),
        }
    }

    /// How many positions back a trim can always go after any forward, once that many
    /// are held: the smallest window of the recurrent layers; `None` when nothing
    /// bounds it but what is held (attention only).
    pub fn rollback_window(&self) -> Option<usize> {
        match &self.external {
            Some(cache) => cache.rollback_window(),
            None => self
                .layers
                .iter()
                .filter_map(|l| match l {
                    LayerCache::Recurrent(r) => Some(r.window()),
                    LayerCache::Attention(_) => None,
                })
                .min(),
        }
    }

    /// Sets how far back a trim must be able to go after any forward: recurrent layers
    /// keep states for that many past positions (memory: a state each), no more. The
    /// engine sets it to the most drafts a round may reject, and to 0 when it never
    /// rolls back (plain decoding); the model's own default applies until then.
    pub fn set_rollback_window(&mut self, positions: usize) {
        if let Some(cache) = &mut self.external {
            cache.set_rollback_window(positions);
        }
        for layer in &mut self.layers {
            if let LayerCache::Recurrent(r) = layer {
                r.set_window(positions);
            }
        }
    }

    /// Sizes every attention layer's next allocation for at least `positions`
    /// ([`KvCache::reserve`]); recurrent state and external caches are left alone.
    pub fn reserve(&mut self, positions: usize) {
        self.layers.iter_mut().for_each(|l| l.reserve(positions));
    }

    /// Sizes the cache once for a generation that may reach `positions` positions, where
    /// buffer lengths cost ([`whole_buffer_pays`]): each one means new attention plans for
    /// the continuations over the whole buffer. The slack covers the last continuation's
    /// padding and a draft model drafting ahead of what was asked. Elsewhere it does
    /// nothing: buffers grow as they are written.
    pub fn reserve_for_generation(&mut self, positions: usize) {
        if whole_buffer_pays() {
            self.reserve(positions + 2 * WHOLE_BUFFER_MAX_TOKENS as usize);
        }
    }

    /// Forgets the last `n` positions in every layer. Beyond
    /// [`ModelCache::rollback_limit`] (or with layers that disagree) it is an error
    /// and nothing changes; an external cache is not asked to go past the limit it
    /// states either.
    pub fn trim(&mut self, n: usize) -> Result<()> {
        if let Some(cache) = &mut self.external {
            let limit = cache.rollback_limit();
            if n > limit {
                return Err(ModelError::CannotRollBack {
                    asked: n,
                    held: cache.offset(),
                    limit,
                });
            }
            return cache.trim(n);
        }
        let held = self.checked_offset()?;
        let limit = self.rollback_limit();
        if n > limit {
            return Err(ModelError::CannotRollBack {
                asked: n,
                held,
                limit,
            });
        }
        self.layers.iter_mut().try_for_each(|l| l.trim(n))
    }

    /// Moves every attention layer's positions into a slot of that layer's pool
    /// (`pools[i]` for layer i; [`KvCache::join_pool`]). A batch of sequences whose
    /// caches are pooled decodes a step with one write and one attention per layer.
    pub fn join_pools(&mut self, pools: &[KvPool]) -> Result<()> {
        if pools.len() != self.layers.len() {
            return Err(ModelError::Unsupported(format!(
                "{} key/value pools for a cache of {} layers",
                pools.len(),
                self.layers.len()
            )));
        }
        for (layer, pool) in self.layers.iter_mut().zip(pools) {
            if let LayerCache::Attention(kv) = layer {
                kv.join_pool(pool)?;
            }
        }
        Ok(())
    }

    /// Takes every attention layer's positions out of its pool ([`KvCache::leave_pool`]),
    /// the copies made in one evaluation.
    pub fn leave_pools(&mut self) -> Result<()> {
        for layer in &mut self.layers {
            if let LayerCache::Attention(kv) = layer {
                kv.copy_out_of_pool()?;
            }
        }
        Ok(mlx_rs::transforms::eval(self.state())?)
    }

    pub fn state(&self) -> impl Iterator<Item = &Array> {
        self.layers
            .iter()
            .flat_map(LayerCache::state)
            .chain(self.external.iter().flat_map(|cache| cache.state().iter()))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use mlx_rs::ops::indexing::TryIndexOp;
    use mlx_rs::random;

    /// `[1, 2, len, 4]` f32 from `seed`: keys or values of `len` positions.
    pub(crate) fn kv(len: i32, seed: u64) -> Array {
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
        cache.trim(2).unwrap();
        let b = kv(1, 4);
        let (k, _) = cache.update_and_fetch(&b, &b).unwrap();
        let kept = a.try_index((.., .., ..2)).unwrap();
        let expected = concatenate(&[kept, b], 2).unwrap();
        assert_eq!(k.shape(), &[1, 2, 3, 4]);
        assert!(k.all_close(&expected, 0.0, 0.0, None).unwrap());
        let err = cache.trim(4).expect_err("more than is held");
        assert!(err.to_string().contains("holds 3"), "{err}");
        assert_eq!(cache.offset(), 3, "a refused trim forgets nothing");
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
        cache.trim(2).unwrap();
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

    /// A stand-in state: one scalar array holding the position it is the state after.
    fn at(position: usize) -> Vec<Array> {
        vec![Array::from_int(position as i32)]
    }

    fn position_of(cache: &RecurrentCache) -> Option<i32> {
        cache.current().first().map(|a| a.item_cast::<i32>())
    }

    /// Forwards of one position each and a forward with a state per position keep a
    /// contiguous window; a trim returns to the state after the position it lands on.
    #[test]
    fn a_recurrent_cache_returns_to_kept_states() {
        let mut cache = RecurrentCache::new(4);
        assert_eq!((cache.offset(), cache.rollback_limit()), (0, 0));
        cache.advance(1, vec![at(1)]).unwrap();
        assert_eq!(cache.rollback_limit(), 1, "back to the initial state");
        cache.advance(3, vec![at(2), at(3), at(4)]).unwrap();
        assert_eq!((cache.offset(), cache.rollback_limit()), (4, 4));
        cache.advance(1, vec![at(5)]).unwrap();
        assert_eq!(cache.rollback_limit(), 4, "the window bounds it");
        cache.trim(3).unwrap();
        assert_eq!((cache.offset(), position_of(&cache)), (2, Some(2)));
        assert_eq!(cache.rollback_limit(), 1);
        cache.trim(1).unwrap();
        assert_eq!(position_of(&cache), Some(1));
        assert!(
            cache.trim(1).is_err(),
            "the initial state fell out of the window"
        );

        let mut cache = RecurrentCache::new(4);
        cache.advance(2, vec![at(1), at(2)]).unwrap();
        cache.trim(2).unwrap();
        assert_eq!(
            (cache.offset(), position_of(&cache)),
            (0, None),
            "the initial state"
        );
    }

    /// A forward that hands over fewer states than positions (a long prefill keeping its
    /// tail) can be rolled back through those only, and a trim past that fails and
    /// changes nothing.
    #[test]
    fn a_trim_past_the_kept_states_is_an_error() {
        let mut cache = RecurrentCache::new(8);
        cache.advance(2, vec![at(1), at(2)]).unwrap();
        cache
            .advance(10, vec![at(9), at(10), at(11), at(12)])
            .unwrap();
        assert_eq!((cache.offset(), cache.rollback_limit()), (12, 3));
        let err = cache.trim(4).expect_err("past the kept states");
        assert!(
            matches!(
                err,
                ModelError::CannotRollBack {
                    asked: 4,
                    held: 12,
                    limit: 3
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("at most 3"), "{err}");
        assert_eq!((cache.offset(), position_of(&cache)), (12, Some(12)));
        cache.trim(3).unwrap();
        assert_eq!(position_of(&cache), Some(9));
        assert!(cache.advance(2, vec![]).is_err(), "no state at all");
        assert!(
            cache.advance(1, vec![at(1), at(2)]).is_err(),
            "more states than positions"
        );
    }

    /// Only the current state and the states the latest forward made are evaluated with
    /// a step: older ones already were.
    #[test]
    fn a_recurrent_cache_hands_over_only_new_states_for_evaluation() {
        let mut cache = RecurrentCache::new(8);
        cache.advance(3, vec![at(1), at(2), at(3)]).unwrap();
        assert_eq!(cache.state().count(), 3);
        cache.advance(1, vec![at(4)]).unwrap();
        assert_eq!(cache.state().count(), 1);
        cache.trim(2).unwrap();
        assert_eq!(cache.state().count(), 1);
    }

    /// A hybrid model's cache: the offset is the layers' common one (checked), the
    /// rollback limit the smallest any layer allows, and a trim past it is an error that
    /// leaves every layer where it was.
    #[test]
    fn a_hybrid_model_cache_moves_its_layers_together() {
        let mut cache = ModelCache::with_layers(vec![
            LayerCache::Recurrent(RecurrentCache::new(2)),
            LayerCache::Attention(KvCache::new()),
        ]);
        assert_eq!(cache.rollback_window(), Some(2));
        assert_eq!(ModelCache::new(2).rollback_window(), None);
        cache.set_rollback_window(3);
        assert_eq!(cache.rollback_window(), Some(3));
        cache.set_rollback_window(2);
        let write = |cache: &mut ModelCache, from: usize, len: usize| {
            let layers = cache.layers_mut();
            let states = (from + 1..=from + len).map(at).collect();
            layers[0]
                .recurrent_mut()
                .unwrap()
                .advance(len, states)
                .unwrap();
            let a = kv(len as i32, from as u64);
            layers[1]
                .kv_mut()
                .unwrap()
                .update_and_fetch(&a, &a)
                .unwrap();
        };
        write(&mut cache, 0, 3);
        write(&mut cache, 3, 1);
        assert_eq!(cache.checked_offset().unwrap(), 4);
        assert_eq!(cache.rollback_limit(), 2);
        let err = cache.trim(3).expect_err("past the recurrent window");
        assert!(err.to_string().contains("at most 2"), "{err}");
        assert_eq!(cache.checked_offset().unwrap(), 4, "nothing moved");
        cache.trim(2).unwrap();
        assert_eq!(cache.checked_offset().unwrap(), 2);
        assert_eq!(cache.state().count(), 3, "state, keys, values");

        // A forward that stopped part-way leaves layers apart: named, not hidden.
        let a = kv(1, 9);
        cache.layers_mut()[1]
            .kv_mut()
            .unwrap()
            .update_and_fetch(&a, &a)
            .unwrap();
        assert_eq!(cache.offset(), 2, "the fewest any layer holds");
        let err = cache.checked_offset().expect_err("layers disagree");
        assert!(err.to_string().contains("layer 1: 3"), "{err}");
        assert!(cache.trim(1).is_err());
        assert!(
            cache.layers_mut()[0].kv_mut().is_err(),
            "a recurrent layer's cache is not an attention cache"
        );
    }
}
