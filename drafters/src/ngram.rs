//! Prompt lookup: propose what followed the latest earlier occurrence of the last `n`
//! tokens. No weights; strong on edits, code and anything that repeats its input.

/// Finds the continuation of the most recent earlier match of the history's last `n`
/// tokens (trying `n`, then shorter suffixes down to `min_n`), up to `max_k` tokens.
pub fn propose(history: &[u32], n: usize, min_n: usize, max_k: usize) -> Vec<u32> {
    if max_k == 0 {
        return Vec::new();
    }
    for size in (min_n.max(1)..=n).rev() {
        if history.len() <= size {
            continue;
        }
        let suffix = &history[history.len() - size..];
        // Latest match first: recent context predicts the continuation best.
        let found = (0..history.len() - size)
            .rev()
            .find(|&start| &history[start..start + size] == suffix);
        if let Some(start) = found {
            let from = start + size;
            let to = (from + max_k).min(history.len());
            return history[from..to].to_vec();
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::propose;

    #[test]
    fn continues_the_latest_match_of_the_suffix() {
        // "1 2 3 4 ... 1 2 3 9 ... 1 2 3" -> the latest "1 2 3" was followed by 9, 7.
        let h = [1, 2, 3, 4, 5, 1, 2, 3, 9, 7, 1, 2, 3];
        assert_eq!(propose(&h, 3, 1, 2), vec![9, 7]);
        assert_eq!(propose(&h, 3, 1, 10), vec![9, 7, 1, 2, 3]);
    }

    #[test]
    fn falls_back_to_shorter_ngrams_and_gives_nothing_without_a_match() {
        let h = [5, 6, 7, 8, 6];
        assert_eq!(
            propose(&h, 3, 1, 2),
            vec![7, 8],
            "only the 1-gram [6] matches"
        );
        assert_eq!(
            propose(&h, 3, 2, 2),
            Vec::<u32>::new(),
            "no 2-gram match allowed to fall back to"
        );
        assert!(propose(&[1, 2, 3], 2, 1, 4).is_empty());
        assert!(propose(&[], 2, 1, 4).is_empty());
        assert!(propose(&[1, 1], 2, 1, 0).is_empty());
    }
}
