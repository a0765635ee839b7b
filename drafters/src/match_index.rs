//! Where the history's newest tokens last occurred before, found in a few hash lookups
//! instead of a scan of the whole history: the n-gram drafter asks once per token fed
//! while no copy is followed, and a scan would cost a long prompt's length every time.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};

/// Every n-gram of the history (lengths 1 to `n`) with where its latest occurrence ends.
#[derive(Debug, Default)]
pub struct MatchIndex {
    n: usize,
    /// Per length `size` (at `size - 1`): the gram's hash and the end (exclusive) of its
    /// latest occurrence among those ending at or before `indexed_to`. Grams whose
    /// hashes collide share an entry; a lookup checks the tokens, and scans on a mismatch.
    latest: Vec<HashMap<u64, usize>>,
    /// Grams ending (exclusive) up to here are in `latest`.
    indexed_to: usize,
}

impl MatchIndex {
    /// An empty index of grams up to `n` tokens long.
    pub fn new(n: usize) -> Self {
        Self {
            n,
            latest: (0..n).map(|_| HashMap::new()).collect(),
            indexed_to: 0,
        }
    }

    /// Forgets every gram: the next history may not extend the last one.
    pub fn clear(&mut self) {
        self.latest.iter_mut().for_each(HashMap::clear);
        self.indexed_to = 0;
    }

    /// Where the continuation of the most recent earlier occurrence of the history's last
    /// `n` tokens starts, trying shorter suffixes down to `min_n` after it. `history` must
    /// extend the histories asked about before (since the last [`Self::clear`]); one
    /// token shorter than the longest (a token taken back) is answered by a scan.
    pub fn latest_continuation(&mut self, history: &[u32], min_n: usize) -> Option<usize> {
        let len = history.len();
        // An earlier occurrence ends before the newest token.
        let newest_end = len.checked_sub(1)?;
        if self.indexed_to > newest_end {
            return scan_latest_continuation(history, self.n, min_n);
        }
        while self.indexed_to < newest_end {
            self.indexed_to += 1;
            let end = self.indexed_to;
            for (size, latest) in (1..=self.n.min(end)).zip(&mut self.latest) {
                latest.insert(gram_hash(&history[end - size..end]), end);
            }
        }
        for size in (min_n.max(1)..=self.n).rev().filter(|&size| size < len) {
            let suffix = &history[len - size..];
            if let Some(&end) = self.latest[size - 1].get(&gram_hash(suffix)) {
                if &history[end - size..end] != suffix {
                    return scan_latest_continuation(history, self.n, min_n);
                }
                return Some(end);
            }
        }
        None
    }
}

fn gram_hash(gram: &[u32]) -> u64 {
    let mut hasher = DefaultHasher::new();
    gram.hash(&mut hasher);
    hasher.finish()
}

/// [`MatchIndex::latest_continuation`] by scanning the history, latest start first.
pub fn scan_latest_continuation(history: &[u32], n: usize, min_n: usize) -> Option<usize> {
    for size in (min_n.max(1)..=n).rev() {
        if history.len() <= size {
            continue;
        }
        let suffix = &history[history.len() - size..];
        let found = (0..history.len() - size)
            .rev()
            .find(|&start| &history[start..start + size] == suffix);
        if let Some(start) = found {
            return Some(start + size);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fixed pseudo-random stream (xorshift).
    fn stream(mut state: u64) -> impl FnMut() -> u64 {
        move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        }
    }

    /// Token by token, over histories with much repetition (a small vocabulary, and
    /// stretches copied from earlier), the index answers what a scan answers, for every
    /// gram length asked; a token taken back and fed again is answered alike.
    #[test]
    fn the_index_answers_as_a_scan_of_the_history_does() {
        let mut next = stream(0x9e37_79b9_7f4a_7c15);
        for n in [1, 3, 5] {
            let mut index = MatchIndex::new(n);
            let mut history: Vec<u32> = Vec::new();
            for _ in 0..3000 {
                let token = match next() % 4 {
                    0 if history.len() > 8 => history[(next() % history.len() as u64) as usize],
                    _ => (next() % 12) as u32,
                };
                history.push(token);
                for min_n in 1..=n {
                    assert_eq!(
                        index.latest_continuation(&history, min_n),
                        scan_latest_continuation(&history, n, min_n),
                        "n {n}, min_n {min_n}, history {}",
                        history.len()
                    );
                }
                if next().is_multiple_of(5) {
                    // As the n-gram drafter's propose does: `last` pushed and popped.
                    let taken = history.pop().unwrap_or_default();
                    assert_eq!(
                        index.latest_continuation(&history, 1),
                        scan_latest_continuation(&history, n, 1)
                    );
                    history.push(taken);
                }
            }
        }
    }

    #[test]
    fn a_cleared_index_serves_a_new_history() {
        let mut index = MatchIndex::new(2);
        assert_eq!(index.latest_continuation(&[1, 2, 3, 1, 2], 1), Some(2));
        index.clear();
        assert_eq!(index.latest_continuation(&[7, 8, 7], 1), Some(1));
        assert_eq!(index.latest_continuation(&[], 1), None);
        assert_eq!(index.latest_continuation(&[7, 8, 7, 9], 1), None);
    }
}
