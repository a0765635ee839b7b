//! Attention of a batched step's rows over a key/value pool, after the step has written
//! every row's new positions into it ([`KvCache::append_each`]): one attention over the
//! pool's whole buffers, each slot's queries masked to its own positions, however many
//! sequences there are.
//!
//! A row of one new token has one query; a row that verifies drafts has one per
//! position, each seeing the keys up to its own. Those can attend in one call (the
//! queries of every slot side by side, padded to the longest row), or each as a call of
//! its own would compute it. One call is fewest graph nodes, which bound a GPU's step;
//! each query alone computes each position as a one-token step over the pool does,
//! which on the CPU rounds differently from a call of several queries.
//!
//! [`KvCache::append_each`]: dspec_plugin_api::KvCache::append_each

use mlx_rs::fast::{scaled_dot_product_attention, ScaledDotProductAttentionMask};
use mlx_rs::ops::{arange, concatenate, matmul, select};
use mlx_rs::Array;

use dspec_plugin_api::error::Result;
use dspec_plugin_api::PoolView;
use dspec_runtime::cpu_kernels::softmax_last_axis;
use dspec_runtime::slicing::slice_axis;

use crate::attention::lowest_value;
use crate::cpu_attention;

/// Attention over a pool reads positions in multiples of this many, up to the longest
/// a query sees: shapes then repeat from one step to the next for a while.
const POOL_READ_STEP: i32 = 64;

/// A step's written pool, and where its queries are.
pub struct PooledStep<'a> {
    pub view: &'a PoolView,
    /// Per slot, the row of the queries its first new position is at (slots the step
    /// did not write: unused).
    pub first: Vec<i32>,
    pub scale: f32,
    pub sliding_window: Option<i32>,
}

/// How the queries of rows of several positions meet the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Queries {
    /// Every query in one call.
    AtOnce,
    /// Each query as a call of its own computes it (in a few calls for all).
    EachAlone,
}

/// Attention of `q` (`[T, heads, 1, D]`, one position a row) over the pool of `step`:
/// `[P, heads, 1, D]` for the P new positions written, and the rows of `q` they belong
/// to, in their order.
pub fn attend(q: &Array, step: &PooledStep, queries: Queries) -> Result<(Array, Vec<u32>)> {
    match queries {
        Queries::AtOnce => at_once(q, step),
        Queries::EachAlone => each_alone(q, step),
    }
}

/// Every slot's queries side by side, `[slots, heads, widest, D]`, in one call.
fn at_once(q: &Array, step: &PooledStep) -> Result<(Array, Vec<u32>)> {
    let view = step.view;
    let count = view.lengths.len();
    let widest = view.written.iter().copied().max().unwrap_or(1).max(1);
    let w = widest as usize;
    // Slot s's j-th query: row `first + j` of `q`, seeing the keys up to its position.
    // Past a slot's own positions (and for slots not written) the query is row 0, sees
    // key 0 only, and is dropped.
    let mut source = vec![0u32; count * w];
    let mut sees = vec![1i32; count * w];
    let mut taking = Vec::new();
    let mut order = Vec::new();
    for slot in 0..count {
        let written = view.written[slot];
        let before = view.lengths[slot] - written;
        for j in 0..written {
            let at = slot * w + j as usize;
            source[at] = (step.first[slot] + j) as u32;
            sees[at] = before + j + 1;
            taking.push(at as u32);
            order.push(source[at]);
        }
    }
    let (h, d) = (q.shape()[1], q.shape()[3]);
    let queries = q
        .take_axis(Array::from_slice(&source, &[(count * w) as i32]), 0)?
        .reshape(&[count as i32, widest, h, d])?
        .transpose_axes(&[0, 2, 1, 3])?;
    let longest = sees.iter().copied().max().unwrap_or(1);
    let sees = Array::from_slice(&sees, &[count as i32, 1, widest, 1]);
    let out = over_pool(&queries, step, &sees, longest)?
        .transpose_axes(&[0, 2, 1, 3])?
        .reshape(&[(count * w) as i32, h, 1, d])?;
    let len = taking.len() as i32;
    Ok((out.take_axis(Array::from_slice(&taking, &[len]), 0)?, order))
}

/// Every query as a call of its own computes it, in a few graph nodes for all of them:
/// MLX's attention of one query splits the query heads by key head and multiplies each
/// by the keys in a product of one row, masks with the dtype's lowest value, takes the
/// precise softmax, and multiplies by the values in a product of one row. The same
/// operations here carry an axis of positions per slot, over which the slot's keys and
/// values are broadcast (not copied), so each product is still one row over the same
/// keys: the same sums, bit for bit, as one query a call. Slots that feed as many
/// positions as each other go together, in runs that read only their own buffers.
fn each_alone(q: &Array, step: &PooledStep) -> Result<(Array, Vec<u32>)> {
    let view = step.view;
    let mut outs = Vec::new();
    let mut order = Vec::new();
    let mut widths: Vec<i32> = view.written.iter().copied().filter(|&w| w > 0).collect();
    widths.sort_unstable();
    widths.dedup();
    for width in widths {
        let slots: Vec<usize> = (0..view.written.len())
            .filter(|&slot| view.written[slot] == width)
            .collect();
        for run in slot_runs(&slots) {
            let (lo, hi) = (run[0], run[run.len() - 1] + 1);
            let n = hi - lo;
            // Slot lo + i's j-th query is row `source[i·width + j]` of `q`, seeing the
            // keys before `sees[i·width + j]`; slots in the run that feed other widths
            // compute row 0 seeing key 0, dropped.
            let mut source = vec![0u32; n * width as usize];
            let mut sees = vec![1i32; n * width as usize];
            let mut taking = Vec::new();
            for &slot in run {
                let before = view.lengths[slot] - width;
                for j in 0..width {
                    let at = (slot - lo) * width as usize + j as usize;
                    source[at] = (step.first[slot] + j) as u32;
                    sees[at] = before + j + 1;
                    taking.push(at as u32);
                    order.push(source[at]);
                }
            }
            let out = alone_over(q, step, (lo as i32, hi as i32), width, &source, &sees)?;
            let len = taking.len() as i32;
            outs.push(out.take_axis(Array::from_slice(&taking, &[len]), 0)?);
        }
    }
    let out = match outs.len() {
        1 => outs.pop().expect("one call"),
        _ => concatenate(&outs, 0)?,
    };
    Ok((out, order))
}

/// Rows `source` of `q` (`[T, heads, 1, D]`), `width` a slot for the pool's slots
/// `lo..hi`, each query alone over its slot's keys before its `sees`:
/// `[(hi − lo) · width, heads, 1, D]`.
fn alone_over(
    q: &Array,
    step: &PooledStep,
    (lo, hi): (i32, i32),
    width: i32,
    source: &[u32],
    sees: &[i32],
) -> Result<Array> {
    let view = step.view;
    let (n, heads, d) = (hi - lo, q.shape()[1], q.shape()[3]);
    let kv_heads = view.keys.shape()[1];
    let used = keys_read(view, sees.iter().copied().max().unwrap_or(1));
    let dtype = q.dtype();
    // [n, width, kv_heads, group, 1, D]: one query a matrix, as MLX's one-query call
    // lays it out with the slot's positions in front.
    let queries = q
        .take_axis(Array::from_slice(source, &[n * width]), 0)?
        .multiply(Array::from_f32(step.scale).as_dtype(dtype)?)?
        .reshape(&[n, width, kv_heads, heads / kv_heads, 1, d])?;
    // [n, 1, kv_heads, 1, used, D]: the slot's keys and values, broadcast over its
    // positions and the query heads that share them.
    let own = |buffer: &Array| -> Result<Array> {
        let rows = slice_axis(&slice_axis(buffer, 0, lo, hi)?, 2, 0, used)?;
        Ok(rows.reshape(&[n, 1, kv_heads, 1, used, d])?)
    };
    let (keys, values) = (own(&view.keys)?, own(&view.values)?);
    let scores = matmul(&queries, keys.swap_axes(-1, -2)?)?;
    let at = arange::<_, i32>(0, used, None)?.reshape(&[1, 1, 1, 1, 1, used])?;
    let sees = Array::from_slice(sees, &[n, width, 1, 1, 1, 1]);
    let visible = visible(&at, &sees, step.sliding_window)?;
    let hidden = Array::from_f32(lowest_value(dtype)).as_dtype(dtype)?;
    let scores = softmax_last_axis(&select(&visible, &scores, &hidden)?)?;
    Ok(matmul(&scores, &values)?.reshape(&[n * width, heads, 1, d])?)
}

/// How many of each slot's positions a call reads for queries that see at most
/// `longest` keys: rounded up so that shapes repeat from one step to the next.
fn keys_read(view: &PoolView, longest: i32) -> i32 {
    let rounded = (longest + POOL_READ_STEP - 1) / POOL_READ_STEP * POOL_READ_STEP;
    rounded.min(view.keys.shape()[2])
}

/// Which of the `keys` (positions, broadcast against `sees`) a query that sees the keys
/// before `sees` attends to: under a sliding `window`, only the window's last ones (a
/// query at `sees − 1` sees keys less than `window` before it).
fn visible(keys: &Array, sees: &Array, window: Option<i32>) -> Result<Array> {
    let before = keys.lt(sees)?;
    Ok(match window {
        None => before,
        Some(w) => before.logical_and(&keys.gt(sees.subtract(Array::from_int(w + 1))?)?)?,
    })
}

/// `slots` (ascending) in runs that one call reads together: a gap of one slot is read
/// along rather than given a call of its own, a wider one starts a new run.
fn slot_runs(slots: &[usize]) -> Vec<&[usize]> {
    let mut runs = Vec::new();
    let mut start = 0;
    for i in 1..=slots.len() {
        if i == slots.len() || slots[i] - slots[i - 1] > 2 {
            runs.push(&slots[start..i]);
            start = i;
        }
    }
    runs
}

/// `queries` (`[slots, heads, L, D]`) over the pool, query (s, j) seeing the keys before
/// `sees[s, 0, j, 0]` (and, under a sliding window, only the window's last ones);
/// `longest`: the most any query sees.
fn over_pool(queries: &Array, step: &PooledStep, sees: &Array, longest: i32) -> Result<Array> {
    let view = step.view;
    let used = keys_read(view, longest);
    let keys = arange::<_, i32>(0, used, None)?.reshape(&[1, 1, 1, used])?;
    let visible = visible(&keys, sees, step.sliding_window)?;
    let (keys, values) = (
        slice_axis(&view.keys, 2, 0, used)?,
        slice_axis(&view.values, 2, 0, used)?,
    );
    let mask = Some(ScaledDotProductAttentionMask::Array(&visible));
    if cpu_attention::serves(queries, &keys, &values) {
        return cpu_attention::attend(queries, &keys, &values, step.scale, mask);
    }
    Ok(scaled_dot_product_attention(
        queries, keys, values, step.scale, mask, None,
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use dspec_plugin_api::{KvCache, KvPool};
    use dspec_runtime::Backend;
    use mlx_rs::random;

    /// Query heads, key/value heads and head size of the pools below.
    const H: i32 = 6;
    const KV: i32 = 2;
    const D: i32 = 64;

    fn normal(shape: &[i32], seed: u64) -> Array {
        let key = random::key(seed).unwrap();
        random::normal::<f32>(shape, None, None, Some(&key)).unwrap()
    }

    /// Three sequences in a pool (2 KV heads of 64 under 6 query heads), 37, 70 and 5
    /// positions held, then 4, 1 and 3 new ones written at once: both ways of querying
    /// give each new position what one query over its own sequence's keys up to it
    /// gives, with and without a sliding window.
    #[test]
    fn every_position_sees_its_own_keys_up_to_itself() {
        let held = [37, 70, 5];
        let lens = [4, 1, 3];
        let starts = [0, 4, 5];
        for window in [None, Some(3)] {
            let pool = KvPool::new();
            let mut caches: Vec<KvCache> = (0..3).map(|_| KvCache::new()).collect();
            let mut own: Vec<KvCache> = (0..3).map(|_| KvCache::new()).collect();
            for (i, (c, o)) in caches.iter_mut().zip(&mut own).enumerate() {
                c.join_pool(&pool).unwrap();
                let (k, v) = (
                    normal(&[1, KV, held[i], D], i as u64),
                    normal(&[1, KV, held[i], D], 10 + i as u64),
                );
                c.update_and_fetch(&k, &v).unwrap();
                o.update_and_fetch(&k, &v).unwrap();
            }
            let (k, v) = (normal(&[8, KV, 1, D], 20), normal(&[8, KV, 1, D], 21));
            let q = normal(&[8, H, 1, D], 22);
            let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
            let (view, slots) = KvCache::append_each(&mut refs, &k, &v, &starts, &lens)
                .unwrap()
                .expect("one pool");
            let mut first = vec![0; view.lengths.len()];
            for (&slot, &start) in slots.iter().zip(&starts) {
                first[slot] = start;
            }
            let step = PooledStep {
                view: &view,
                first,
                scale: 0.125,
                sliding_window: window,
            };
            // One query at a time over the sequence's own keys up to its position.
            let mut expected = Vec::new();
            for (i, o) in own.iter_mut().enumerate() {
                for j in 0..lens[i] {
                    let row = starts[i] + j;
                    let at = |a: &Array| a.take_axis(Array::from_int(row), 0).unwrap();
                    let (keys, values) = o
                        .update_and_fetch(
                            &at(&k).reshape(&[1, KV, 1, D]).unwrap(),
                            &at(&v).reshape(&[1, KV, 1, D]).unwrap(),
                        )
                        .unwrap();
                    let end = held[i] + j + 1;
                    let from = window.map_or(0, |w| (end - w).max(0));
                    let out = scaled_dot_product_attention(
                        at(&q).reshape(&[1, H, 1, D]).unwrap(),
                        slice_axis(&keys, 2, from, end).unwrap(),
                        slice_axis(&values, 2, from, end).unwrap(),
                        0.125,
                        None,
                        None,
                    )
                    .unwrap();
                    expected.push((row as u32, out));
                }
            }
            // In f32, MLX's CUDA backend computes the products of attention over several
            // queries in TF32 by default (`MLX_ENABLE_TF32`), about three decimal digits.
            let tolerance = match Backend::current() {
                Backend::Cpu => 1e-5,
                _ => 5e-3,
            };
            for queries in [Queries::AtOnce, Queries::EachAlone] {
                let (out, order) = attend(&q, &step, queries).unwrap();
                assert_eq!(order.len(), 8, "{queries:?}");
                for (row, want) in &expected {
                    let at = order.iter().position(|r| r == row).expect("every row");
                    let got = out.take_axis(Array::from_int(at as i32), 0).unwrap();
                    let got = got.reshape(&[1, H, 1, D]).unwrap();
                    assert!(
                        got.all_close(want, tolerance, tolerance, None).unwrap(),
                        "{queries:?}, window {window:?}, row {row}"
                    );
                }
            }
            // Each query alone gives, bit for bit, what a one-token step over the pool
            // gives the same position (one query of one slot), on every backend.
            let (out, order) = attend(&q, &step, Queries::EachAlone).unwrap();
            for (i, &slot) in slots.iter().enumerate() {
                for j in 0..lens[i] {
                    let before = view.lengths[slot] - view.written[slot];
                    let mut lengths = view.lengths.clone();
                    let mut written = vec![0; lengths.len()];
                    let mut first = vec![0; lengths.len()];
                    (lengths[slot], written[slot], first[slot]) =
                        (before + j + 1, 1, starts[i] + j);
                    let alone = PoolView {
                        keys: view.keys.clone(),
                        values: view.values.clone(),
                        lengths,
                        written,
                    };
                    let one = PooledStep {
                        view: &alone,
                        first,
                        scale: 0.125,
                        sliding_window: window,
                    };
                    let (want, _) = attend(&q, &one, Queries::AtOnce).unwrap();
                    let row = (starts[i] + j) as u32;
                    let at = order.iter().position(|&r| r == row).expect("every row");
                    let got = out.take_axis(Array::from_int(at as i32), 0).unwrap();
                    let got = got.reshape(&[1, H, 1, D]).unwrap();
                    assert!(
                        got.eq_values(&want).unwrap(),
                        "window {window:?}, row {row}: not a one-token step's bits"
                    );
                }
            }
        }
    }
}
