//! The target's caches of finished generations, kept across requests so that a prompt
//! sharing a prefix with an earlier sequence (a chat's next turn) reads only the rest.
//!
//! Each entry is the target's [`ModelCache`] as a generation left it, the tokens it
//! holds, and, for drafters that read the target's hidden states, those states at the
//! same positions. A request takes the entry sharing the longest prefix with its prompt
//! out of the store (the generation writes into that cache), and puts it back when it
//! is done, now holding the new sequence. Entries are dropped least recently used first
//! once their memory exceeds the budget.

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::Array;

use dspec_plugin_api::ModelCache;

/// A cached sequence.
struct Entry {
    /// The tokens whose positions the cache holds, in order.
    tokens: Vec<u32>,
    cache: ModelCache,
    /// The target's states at the drafter's taps over the first positions of `tokens`
    /// (`[1, n, taps × hidden]`), when the drafter reads them.
    hidden: Option<Array>,
    bytes: usize,
    /// When the entry was last put back (a counter, for least-recently-used eviction).
    used: u64,
}

impl Entry {
    fn hidden_len(&self) -> usize {
        self.hidden
            .as_ref()
            .map_or(0, |h| h.shape().get(1).copied().unwrap_or(0) as usize)
    }
}

/// What a prompt gets back from the store: a cache holding the prompt's first `reused`
/// tokens, and the hidden states over them when they were asked for.
pub struct Reused {
    pub cache: ModelCache,
    pub reused: usize,
    pub hidden: Option<Array>,
}

/// The store's size now, for stats.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PromptCacheUsage {
    pub entries: usize,
    pub bytes: usize,
    pub budget_bytes: usize,
}

/// Caches of finished generations, bounded by a memory budget.
pub struct PromptCache {
    entries: Vec<Entry>,
    budget: usize,
    clock: u64,
}

impl PromptCache {
    /// A store holding at most `budget` bytes of cache arrays (0: keeps nothing).
    pub fn new(budget: usize) -> Self {
        Self {
            entries: Vec::new(),
            budget,
            clock: 0,
        }
    }

    pub fn usage(&self) -> PromptCacheUsage {
        PromptCacheUsage {
            entries: self.entries.len(),
            bytes: self.entries.iter().map(|e| e.bytes).sum(),
            budget_bytes: self.budget,
        }
    }

    /// How many of `prompt`'s tokens [`PromptCache::take`] would reuse (0: none), without
    /// taking anything: what the ranks of a serving group compare before each request.
    pub fn reusable(&self, prompt: &[u32], with_hidden: bool) -> usize {
        self.best(prompt, with_hidden)
            .map_or(0, |(_, reused)| reused)
    }

    /// The entry that serves `prompt` best and the prefix it serves (see `take`).
    fn best(&self, prompt: &[u32], with_hidden: bool) -> Option<(usize, usize)> {
        let usable = |e: &Entry| -> usize {
            let mut n = common_prefix(&e.tokens, prompt).min(prompt.len().saturating_sub(1));
            if with_hidden {
                n = n.min(e.hidden_len());
            }
            // A cache with recurrent state goes back only within its kept window.
            if e.tokens.len() - n > e.cache.rollback_limit() {
                return 0;
            }
            n
        };
        self.entries
            .iter()
            .enumerate()
            .map(|(i, e)| (i, usable(e)))
            .max_by_key(|&(i, n)| (n, self.entries[i].used))
            .filter(|&(_, n)| n > 0)
    }

    /// Takes out the entry that serves `prompt` best: the one sharing the longest prefix
    /// with it that its cache can be rolled back to, cut to that prefix. At least the
    /// prompt's last token is left to read (its logits start the generation). With
    /// `with_hidden`, only entries holding hidden states that far count. `None` when no
    /// entry shares a token with the prompt.
    pub fn take(&mut self, prompt: &[u32], with_hidden: bool) -> Option<Reused> {
        let (index, reused) = self.best(prompt, with_hidden)?;
        let mut entry = self.entries.swap_remove(index);
        // Checked by `usable`; a failure here leaves the entry dropped, never wrong.
        entry.cache.trim(entry.tokens.len() - reused).ok()?;
        let hidden = match (with_hidden, entry.hidden) {
            (true, Some(h)) => Some(h.try_index((.., ..reused as i32, ..)).ok()?),
            _ => None,
        };
        Some(Reused {
            cache: entry.cache,
            reused,
            hidden,
        })
    }

    /// Stores `cache`, which holds `tokens` (and `hidden` over their first positions),
    /// dropping the least recently used entries until the store fits its budget. A
    /// cache bigger than the whole budget is not kept.
    pub fn put(&mut self, tokens: Vec<u32>, mut cache: ModelCache, hidden: Option<Array>) {
        if tokens.is_empty() || cache.checked_offset().ok() != Some(tokens.len()) {
            return;
        }
        // Recurrent layers keep a state per position of their rollback window; a stored
        // cache is only ever read on from its end, so those go.
        cache.set_rollback_window(0);
        let bytes = cache.state().map(Array::nbytes).sum::<usize>()
            + hidden.as_ref().map_or(0, Array::nbytes);
        if bytes > self.budget {
            return;
        }
        // A sequence that extends a stored one makes that one useless.
        self.entries
            .retain(|e| common_prefix(&e.tokens, &tokens) < e.tokens.len());
        self.clock += 1;
        self.entries.push(Entry {
            tokens,
            cache,
            hidden,
            bytes,
            used: self.clock,
        });
        while self.usage().bytes > self.budget {
            let Some(oldest) = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.used)
                .map(|(i, _)| i)
            else {
                break;
            };
            self.entries.swap_remove(oldest);
        }
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use dspec_plugin_api::{LayerCache, RecurrentCache};
    use mlx_rs::ops::zeros;

    /// A one-layer attention cache holding `len` positions of `[1, 1, len, 4]` f32.
    fn cache_of(len: usize) -> ModelCache {
        let mut cache = ModelCache::new(1);
        if let LayerCache::Attention(kv) = &mut cache.layers_mut()[0] {
            let x = zeros::<f32>(&[1, 1, len as i32, 4]).unwrap();
            kv.update_and_fetch(&x, &x).unwrap();
        }
        cache
    }

    fn bytes_of(len: usize) -> usize {
        cache_of(len).state().map(Array::nbytes).sum()
    }

    #[test]
    fn the_longest_shared_prefix_wins_and_the_cache_is_cut_to_it() {
        let mut store = PromptCache::new(1 << 20);
        store.put(vec![1, 2, 3, 4], cache_of(4), None);
        store.put(vec![1, 9, 9], cache_of(3), None);
        assert_eq!(store.reusable(&[1, 2, 3, 7, 8], false), 3);
        let got = store.take(&[1, 2, 3, 7, 8], false).unwrap();
        assert_eq!(got.reused, 3);
        assert_eq!(got.cache.offset(), 3);
        // Taken out: the other entry is all that is left.
        assert_eq!(store.usage().entries, 1);
        assert_eq!(store.reusable(&[5, 6], false), 0);
        assert!(store.take(&[5, 6], false).is_none());
    }

    #[test]
    fn the_prompts_last_token_is_always_left_to_read() {
        let mut store = PromptCache::new(1 << 20);
        store.put(vec![1, 2, 3], cache_of(3), None);
        let got = store.take(&[1, 2, 3], false).unwrap();
        assert_eq!((got.reused, got.cache.offset()), (2, 2));
        store.put(vec![1, 2, 3], cache_of(3), None);
        let got = store.take(&[1, 2], false).unwrap();
        assert_eq!(got.reused, 1);
    }

    #[test]
    fn hidden_states_bound_what_a_tapping_drafter_reuses() {
        let mut store = PromptCache::new(1 << 20);
        let hidden = zeros::<f32>(&[1, 2, 8]).unwrap();
        store.put(vec![1, 2, 3, 4], cache_of(4), Some(hidden));
        let got = store.take(&[1, 2, 3, 4, 5], true).unwrap();
        assert_eq!(got.reused, 2);
        assert_eq!(got.hidden.unwrap().shape(), &[1, 2, 8]);
        store.put(vec![1, 2, 3, 4], cache_of(4), None);
        assert!(store.take(&[1, 2, 3, 4, 5], true).is_none());
        assert_eq!(store.take(&[1, 2, 3, 4, 5], false).unwrap().reused, 4);
    }

    #[test]
    fn the_budget_drops_least_recently_used_entries() {
        let one = bytes_of(4);
        let mut store = PromptCache::new(2 * one);
        store.put(vec![1, 1, 1, 1], cache_of(4), None);
        store.put(vec![2, 2, 2, 2], cache_of(4), None);
        // Used again (taken, then put back as it was): now the most recent.
        let again = store.take(&[1, 1, 1, 1, 5], false).unwrap();
        store.put(vec![1, 1, 1, 1], again.cache, None);
        // A third entry is over budget: the least recently used goes.
        store.put(vec![3, 3, 3, 3], cache_of(4), None);
        assert_eq!(store.usage().entries, 2);
        assert!(store.usage().bytes <= 2 * one);
        assert!(store.take(&[2, 2, 2, 2, 0], false).is_none());
        assert!(store.take(&[1, 1, 1, 1, 0], false).is_some());
        // Nothing is kept that is bigger than the whole budget.
        let mut small = PromptCache::new(one - 1);
        small.put(vec![1, 2, 3, 4], cache_of(4), None);
        assert_eq!(small.usage().entries, 0);
    }

    #[test]
    fn a_sequence_that_extends_a_stored_one_replaces_it() {
        let mut store = PromptCache::new(1 << 20);
        store.put(vec![1, 2], cache_of(2), None);
        store.put(vec![1, 2, 3, 4], cache_of(4), None);
        assert_eq!(store.usage().entries, 1);
    }

    #[test]
    fn a_cache_that_does_not_hold_the_tokens_is_not_kept() {
        let mut store = PromptCache::new(1 << 20);
        store.put(vec![1, 2, 3], cache_of(2), None);
        assert_eq!(store.usage().entries, 0);
    }

    #[test]
    fn a_recurrent_cache_is_reused_only_from_its_end() {
        let recurrent = || {
            let mut layer = RecurrentCache::new(4);
            let states = (0..3)
                .map(|i| vec![Array::from_f32(i as f32)])
                .collect::<Vec<_>>();
            layer.advance(3, states).unwrap();
            let mut cache = ModelCache::with_layers(vec![LayerCache::Recurrent(layer)]);
            // A generation's window: stored caches drop it.
            cache.set_rollback_window(4);
            cache
        };
        let mut store = PromptCache::new(1 << 20);
        store.put(vec![1, 2, 3], recurrent(), None);
        assert!(store.take(&[1, 2, 9, 9], false).is_none());
        let got = store.take(&[1, 2, 3, 9], false).unwrap();
        assert_eq!((got.reused, got.cache.offset()), (3, 3));
    }
}
