//! Prompt lookup: propose what followed the latest earlier occurrence of the last `n`
//! tokens. No weights; strong on edits, code and anything that repeats its input.

use mlx_rs::Array;

use dspec_plugin_api::error::Result;
use dspec_plugin_api::{
    inventory, Agreement, Draft, Drafter, DrafterLoadRequest, DrafterRegistration, TargetModel,
    TokenPicker,
};

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

/// The prompt-lookup drafter over prompt + committed output.
pub struct NgramDrafter {
    n: usize,
    history: Vec<u32>,
    /// Whether the commits arriving are plain steps' (after a propose of no drafts),
    /// whose tokens are checked against what a lookup would have proposed.
    plain: bool,
    agreement: Agreement,
}

impl NgramDrafter {
    /// `n`: longest n-gram to match (shorter ones down to 1 are tried after it).
    pub fn new(n: usize) -> Self {
        Self {
            n: n.max(1),
            history: Vec::new(),
            plain: false,
            agreement: Agreement::default(),
        }
    }
}

impl Drafter for NgramDrafter {
    fn name(&self) -> &str {
        "ngram"
    }

    fn begin(
        &mut self,
        _target: &dyn TargetModel,
        prompt: &[u32],
        _hidden: Option<&Array>,
    ) -> Result<()> {
        self.history = prompt.to_vec();
        self.plain = false;
        self.agreement = Agreement::default();
        Ok(())
    }

    fn propose(
        &mut self,
        _target: &dyn TargetModel,
        last: u32,
        max_k: usize,
        _picker: &mut dyn TokenPicker,
    ) -> Result<Draft> {
        self.plain = max_k == 0;
        if self.plain {
            return Ok(Draft::default());
        }
        self.history.push(last);
        let tokens = propose(&self.history, self.n, 1, max_k);
        self.history.pop();
        Ok(Draft {
            tokens,
            probs: None,
        })
    }

    fn commit(&mut self, verified: &[u32], _hidden: Option<&Array>) -> Result<()> {
        for &token in verified {
            // A lookup per plain step: what a round of one draft would have proposed.
            if self.plain {
                let guess = propose(&self.history, self.n, 1, 1);
                self.agreement.add(Agreement {
                    agreed: usize::from(guess.first() == Some(&token)),
                    checked: 1,
                });
            }
            self.history.push(token);
        }
        Ok(())
    }

    fn agreement(&mut self) -> Option<Agreement> {
        Some(std::mem::take(&mut self.agreement))
    }
}

fn load(request: &DrafterLoadRequest) -> Result<Box<dyn Drafter>> {
    if request.options.ngram == 0 {
        return Err(request.mismatch("--ngram must be at least 1"));
    }
    Ok(Box::new(NgramDrafter::new(request.options.ngram)))
}

inventory::submit! {
    DrafterRegistration {
        kind: "ngram",
        summary: "prompt lookup: continues the latest earlier match of the last n tokens (--ngram N)",
        detect: |_| false,
        by_name: true,
        load,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    /// A picker the n-gram drafter must never call: it has no logits.
    struct NoPicker;
    impl TokenPicker for NoPicker {
        fn is_greedy(&self) -> bool {
            true
        }
        fn pick(&mut self, _logits: &Array) -> Result<dspec_plugin_api::Picked> {
            panic!("ngram drafter has no logits to pick from")
        }
    }

    /// A target to pass along (the n-gram drafter never reads it).
    fn tiny_target() -> (tempfile::TempDir, Box<dyn TargetModel>) {
        let dir = tempfile::tempdir().unwrap();
        let fixtures = dspec_adapters::fixtures::TINY_LLAMA;
        dspec_adapters::fixtures::write_random_model(dir.path(), fixtures, 1, None).unwrap();
        let target = dspec_adapters::fixtures::load_dir(dir.path(), &Default::default()).unwrap();
        (dir, target)
    }

    #[test]
    fn drafter_sees_the_last_token_and_committed_history() {
        let (_dir, target) = tiny_target();
        let t = target.as_ref();
        let mut d = NgramDrafter::new(2);
        d.begin(t, &[10, 11, 12, 13, 10], None).unwrap();
        // history + last = [10 11 12 13 10 11] -> "10 11" was followed by 12, 13.
        assert_eq!(
            d.propose(t, 11, 2, &mut NoPicker).unwrap().tokens,
            vec![12, 13]
        );
        d.commit(&[11, 12], None).unwrap(); // last 11 and one accepted draft, 12
        assert_eq!(
            d.propose(t, 14, 3, &mut NoPicker).unwrap().tokens,
            Vec::<u32>::new(),
            "14 never seen"
        );
    }

    /// Plain steps' tokens are checked against the lookup that would have drafted them;
    /// a round that drafted is counted by the engine itself, not again here.
    #[test]
    fn plain_steps_report_how_often_a_lookup_would_have_guessed_them() {
        let (_dir, target) = tiny_target();
        let t = target.as_ref();
        let mut d = NgramDrafter::new(2);
        d.begin(t, &[1, 2, 3, 4], None).unwrap();
        assert!(d.propose(t, 1, 0, &mut NoPicker).unwrap().tokens.is_empty());
        // After 1 2 3 4: no match, so no guess for 1. After ..4 1: "1" was followed by 2
        // (kept). After ..1 2: "1 2" by 3 (kept). After ..2 3: "2 3" by 4, not 5. After
        // ..3 5: nothing.
        d.commit(&[1, 2, 3, 5, 1], None).unwrap();
        assert_eq!(
            d.agreement(),
            Some(Agreement {
                agreed: 2,
                checked: 5
            })
        );
        assert_eq!(d.agreement(), Some(Agreement::default()), "counted once");
        let drafts = d.propose(t, 2, 2, &mut NoPicker).unwrap().tokens;
        assert_eq!(drafts, vec![3, 5], "the latest match");
        d.commit(&[2, 3], None).unwrap();
        assert_eq!(
            d.agreement(),
            Some(Agreement::default()),
            "a drafting round"
        );
    }
}
