//! Keys and values of many sequences in one buffer per attention layer, a slot per
//! sequence, so that a batched decode step writes every sequence's new position and
//! attends for all of them in a few graph nodes, however many sequences there are.
//!
//! With a cache per sequence, a batched step builds a cache write and an attention per
//! sequence and layer: host time per graph node bounds a GPU's step, and on the CPU each
//! small attention call has a fixed cost too. A [`KvCache`](crate::KvCache) that joins a
//! pool keeps its positions in its slot and works as before for every other use (single
//! forwards, prompt chunks, verifies, rollback), so only the batched decode path needs
//! to know about pools.

use std::sync::{Arc, Mutex, MutexGuard};

use mlx_rs::ops::indexing::put_along_axis;
use mlx_rs::ops::{broadcast_to, concatenate, zeros_dtype};
use mlx_rs::Array;

use crate::cache::{grown_capacity, GROWTH_STEP};
use crate::error::{ModelError, Result};
use dspec_runtime::slicing::{slice_region, write_region};

/// One attention layer's pool. Clones share it.
#[derive(Clone, Default)]
pub struct KvPool {
    inner: Arc<Mutex<Buffers>>,
}

#[derive(Default)]
struct Buffers {
    /// `[slots, kv_heads, capacity, head_dim]`, allocated at the first write.
    keys: Option<Array>,
    values: Option<Array>,
    /// Per slot: the positions its sequence holds, or `None` while the slot is free.
    held: Vec<Option<i32>>,
    /// Positions every slot gets room for at the next allocation ([`KvPool::reserve`]).
    reserved: i32,
}

/// A sequence's place in a pool; dropping it frees the slot.
pub(crate) struct PoolSlot {
    pub(crate) pool: KvPool,
    pub(crate) index: usize,
}

impl Drop for PoolSlot {
    fn drop(&mut self) {
        self.pool.lock().held[self.index] = None;
    }
}

/// The longest sequence that should join a pool: every slot is as long as the longest
/// sequence's, so one long sequence would make every slot long. Longer ones keep caches
/// of their own (a batched step attends for them apart).
pub const LONGEST_POOLED: usize = 16 * GROWTH_STEP as usize;

impl KvPool {
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, Buffers> {
        // The buffers stay consistent between statements: a panic elsewhere leaves them usable.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn same(&self, other: &KvPool) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// A free slot, holding nothing; the pool gets one more slot when none is free.
    pub(crate) fn take_slot(&self) -> PoolSlot {
        let mut b = self.lock();
        let index = match b.held.iter().position(Option::is_none) {
            Some(i) => i,
            None => {
                b.held.push(None);
                b.held.len() - 1
            }
        };
        b.held[index] = Some(0);
        PoolSlot {
            pool: self.clone(),
            index,
        }
    }

    /// Makes the next write give every slot room for `positions`, so that the buffers
    /// grow when a sequence joins (its prompt being read) rather than amid decoding,
    /// where growing copies every slot and holds every sequence up for that step.
    pub fn reserve(&self, positions: usize) {
        let mut b = self.lock();
        b.reserved = b.reserved.max(positions.min(i32::MAX as usize) as i32);
    }

    /// Slots, free ones included.
    pub fn slots(&self) -> usize {
        self.lock().held.len()
    }

    /// Positions each slot has room for.
    pub fn capacity(&self) -> usize {
        self.lock()
            .keys
            .as_ref()
            .map_or(0, |k| k.shape()[2] as usize)
    }

    /// The buffers, for evaluation with a step's outputs (the caches in the pool do not
    /// list them: the pool's owner evaluates them once).
    pub fn arrays(&self) -> Vec<Array> {
        let b = self.lock();
        b.keys.iter().chain(b.values.iter()).cloned().collect()
    }

    /// Writes `keys`/`values` (`[1, kv_heads, L, head_dim]`) into `slot` at position `at`.
    pub(crate) fn write(&self, slot: usize, at: i32, keys: &Array, values: &Array) -> Result<()> {
        let mut b = self.lock();
        let end = at + keys.shape()[2];
        b.make_room(keys, end)?;
        let starts = [slot as i32, 0, at, 0];
        let (k, v) = b.buffers()?;
        let (k, v) = (
            write_region(k, keys, &starts)?,
            write_region(v, values, &starts)?,
        );
        b.keys = Some(k);
        b.values = Some(v);
        b.held[slot] = Some(end);
        Ok(())
    }

    /// `slot`'s first `len` positions, `[1, kv_heads, len, head_dim]` views; `len`
    /// `None`: the whole capacity (positions past what the slot holds are stale).
    pub(crate) fn fetch(&self, slot: usize, len: Option<i32>) -> Result<(Array, Array)> {
        let b = self.lock();
        let (k, v) = b.buffers()?;
        let s = k.shape();
        let end = len.unwrap_or(s[2]);
        let starts = [slot as i32, 0, 0, 0];
        let stops = [slot as i32 + 1, s[1], end, s[3]];
        Ok((
            slice_region(k, &starts, &stops)?,
            slice_region(v, &starts, &stops)?,
        ))
    }

    /// Records that `slot` now holds `positions` (after a trim).
    pub(crate) fn set_held(&self, slot: usize, positions: i32) {
        self.lock().held[slot] = Some(positions);
    }

    /// Writes `lens[r]` positions for each of `slots` (`keys`/`values`: `[T, kv_heads,
    /// 1, head_dim]`, one position a row; slot `slots[r]`'s at rows `starts[r]..`) in a
    /// few graph nodes per buffer, and returns the whole buffers with what each slot
    /// holds after the write.
    pub(crate) fn append_each(
        &self,
        slots: &[usize],
        starts: &[i32],
        lens: &[i32],
        keys: &Array,
        values: &Array,
    ) -> Result<PoolView> {
        let mut b = self.lock();
        let widest = lens.iter().copied().max().unwrap_or(1).max(1);
        let needed = b.held.iter().flatten().copied().max().unwrap_or(0) + widest;
        b.make_room(keys, needed)?;
        let count = b.held.len();
        // Every slot gets `widest` positions written from its first unheld one: a slot's
        // own rows, its last row repeated past them, and for slots not in this write
        // copies of row 0; all past what the slot holds, so overwritten when it next
        // writes and never read before.
        let mut written = vec![0i32; count];
        let mut source = vec![0u32; count * widest as usize];
        for ((&slot, &start), &len) in slots.iter().zip(starts).zip(lens) {
            written[slot] = len;
            for j in 0..widest {
                source[slot * widest as usize + j as usize] = (start + j.min(len - 1)) as u32;
            }
        }
        let at: Vec<i32> = b
            .held
            .iter()
            .flat_map(|h| {
                let from = h.unwrap_or(0);
                (from..from + widest).collect::<Vec<_>>()
            })
            .collect();
        let (k, v) = b.buffers()?;
        let s = k.shape().to_vec();
        let shape = [count as i32, s[1], widest, s[3]];
        let index = broadcast_to(
            Array::from_slice(&at, &[count as i32, 1, widest, 1]),
            &shape,
        )?;
        let source = Array::from_slice(&source, &[count as i32 * widest]);
        let write = |buffer: &Array, rows: &Array| -> Result<Array> {
            // `[count·widest, kv_heads, 1, D]` → `[count, kv_heads, widest, D]`.
            let rows = rows
                .take_axis(&source, 0)?
                .reshape(&[count as i32, widest, s[1], s[3]])?
                .transpose_axes(&[0, 2, 1, 3])?;
            Ok(put_along_axis(buffer, &index, &rows, 2)?)
        };
        let (k, v) = (write(k, keys)?, write(v, values)?);
        b.keys = Some(k.clone());
        b.values = Some(v.clone());
        for (&slot, &len) in slots.iter().zip(lens) {
            if let Some(h) = b.held[slot].as_mut() {
                *h += len;
            }
        }
        let lengths = b.held.iter().map(|h| h.unwrap_or(0)).collect();
        Ok(PoolView {
            keys: k,
            values: v,
            lengths,
            written,
        })
    }
}

/// The whole of a pool after a batched write.
pub struct PoolView {
    /// `[slots, kv_heads, capacity, head_dim]`.
    pub keys: Array,
    pub values: Array,
    /// Per slot, the positions that are valid (free slots: 0).
    pub lengths: Vec<i32>,
    /// Per slot, the positions this write added (slots not in it: 0).
    pub written: Vec<i32>,
}

impl Buffers {
    fn buffers(&self) -> Result<(&Array, &Array)> {
        match (&self.keys, &self.values) {
            (Some(k), Some(v)) => Ok((k, v)),
            _ => Err(ModelError::Unsupported(
                "a key/value pool was read before anything was written to it".into(),
            )),
        }
    }

    /// Allocates or grows the buffers so that every slot has a row and room for `end`
    /// positions, like `like` (`[_, kv_heads, _, head_dim]`, its dtype).
    fn make_room(&mut self, like: &Array, end: i32) -> Result<()> {
        let slots = self.held.len() as i32;
        let shape = like.shape();
        let (rows, capacity) = match &self.keys {
            Some(k) => (k.shape()[0], k.shape()[2]),
            None => (0, 0),
        };
        let end = end.max(self.reserved);
        let new_capacity = grown_capacity(capacity as usize, end as usize) as i32;
        if rows == slots && new_capacity == capacity {
            return Ok(());
        }
        let fresh = |r: i32, c: i32| zeros_dtype(&[r, shape[1], c, shape[3]], like.dtype());
        let grow = |old: Option<&Array>| -> Result<Array> {
            let Some(old) = old else {
                return Ok(fresh(slots, new_capacity)?);
            };
            let mut grown = old.clone();
            if new_capacity > capacity {
                grown = concatenate(&[grown, fresh(rows, new_capacity - capacity)?], 2)?;
            }
            if slots > rows {
                grown = concatenate(&[grown, fresh(slots - rows, new_capacity)?], 0)?;
            }
            Ok(grown)
        };
        let (k, v) = (grow(self.keys.as_ref())?, grow(self.values.as_ref())?);
        self.keys = Some(k);
        self.values = Some(v);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use mlx_rs::ops::concatenate;

    use super::*;
    use crate::cache::tests::kv;
    use crate::KvCache;

    fn same(a: &Array, b: &Array) -> bool {
        a.shape() == b.shape() && a.all_close(b, 0.0, 0.0, None).unwrap()
    }

    /// Caches in a pool hold what caches of their own hold, through writes of several
    /// lengths, trims, growth past the first allocation and writes of one and of several
    /// positions for all of them at once; leaving the pool keeps the positions.
    #[test]
    fn pooled_caches_hold_what_caches_of_their_own_hold() {
        let pool = KvPool::new();
        let mut pooled: Vec<KvCache> = (0..3).map(|_| KvCache::new()).collect();
        let mut own: Vec<KvCache> = (0..3).map(|_| KvCache::new()).collect();
        // One cache joins with positions already written: they move into its slot.
        let early = kv(5, 99);
        pooled[2].update_and_fetch(&early, &early).unwrap();
        own[2].update_and_fetch(&early, &early).unwrap();
        for cache in &mut pooled {
            cache.join_pool(&pool).unwrap();
        }
        assert_eq!(pool.slots(), 3);
        let mut seed = 0;
        for (round, len) in [7, 1, 300, 2].into_iter().enumerate() {
            for (p, o) in pooled.iter_mut().zip(&mut own) {
                seed += 1;
                let x = kv(len, seed);
                let (pk, pv) = p.update_and_fetch(&x, &x.negative().unwrap()).unwrap();
                let (ok, ov) = o.update_and_fetch(&x, &x.negative().unwrap()).unwrap();
                assert!(same(&pk, &ok) && same(&pv, &ov), "round {round}");
            }
            pooled[round % 3].trim(1).unwrap();
            own[round % 3].trim(1).unwrap();
        }
        // One new position each, in one write: each lands after its own cache's positions.
        let rows: Vec<Array> = (0..3).map(|i| kv(1, 1000 + i)).collect();
        let keys = concatenate(&rows, 0).unwrap();
        let mut refs: Vec<&mut KvCache> = pooled.iter_mut().collect();
        let (view, slots) = KvCache::append_each(&mut refs, &keys, &keys, &[0, 1, 2], &[1; 3])
            .unwrap()
            .expect("one pool");
        for ((o, row), &slot) in own.iter_mut().zip(&rows).zip(&slots) {
            o.update_and_fetch(row, row).unwrap();
            assert_eq!(view.lengths[slot] as usize, o.offset());
        }
        // Then 3, 1 and 2 positions, in one write.
        let lens = [3, 1, 2];
        let rows: Vec<Array> = (0..6).map(|i| kv(1, 2000 + i)).collect();
        let keys = concatenate(&rows, 0).unwrap();
        let mut refs: Vec<&mut KvCache> = pooled.iter_mut().collect();
        let (view, slots) = KvCache::append_each(&mut refs, &keys, &keys, &[0, 3, 4], &lens)
            .unwrap()
            .expect("one pool");
        let mut at = 0;
        for ((o, len), &slot) in own.iter_mut().zip(lens).zip(&slots) {
            // `[len, H, 1, D]` rows as one sequence `[1, H, len, D]`.
            let mine = concatenate(&rows[at..at + len as usize], 2).unwrap();
            at += len as usize;
            o.update_and_fetch(&mine, &mine).unwrap();
            assert_eq!(view.lengths[slot] as usize, o.offset());
            assert_eq!(view.written[slot], len);
        }
        for (p, o) in pooled.iter_mut().zip(&own) {
            assert_eq!(p.offset(), o.offset());
            assert!(same(&p.fetch().unwrap().0, &o.fetch().unwrap().0));
            p.leave_pool().unwrap();
            assert!(p.pool().is_none());
            assert!(same(&p.fetch().unwrap().1, &o.fetch().unwrap().1));
        }
    }

    /// A dropped cache's slot goes to the next cache that joins; caches of another pool,
    /// or of none, are not written as a batch.
    #[test]
    fn slots_are_reused_and_batches_need_one_pool() {
        let pool = KvPool::new();
        let mut a = KvCache::new();
        let mut b = KvCache::new();
        a.join_pool(&pool).unwrap();
        b.join_pool(&pool).unwrap();
        drop(a);
        let mut c = KvCache::new();
        c.join_pool(&pool).unwrap();
        assert_eq!(pool.slots(), 2, "the freed slot was taken again");

        let mut alone = KvCache::new();
        let x = kv(1, 1);
        let mut refs = vec![&mut b, &mut alone];
        assert!(KvCache::append_each(
            &mut refs,
            &concatenate(&[&x, &x], 0).unwrap(),
            &x,
            &[0, 1],
            &[1, 1]
        )
        .unwrap()
        .is_none());
        assert_eq!(b.offset(), 0, "nothing was written");
    }
}
