//! Prompt lookup: propose what followed the latest earlier occurrence of the last `n`
//! tokens, and follow an output that copies its input with edits (see
//! [`crate::copy_alignment`]). No weights; strong on edits, code and anything that
//! repeats its input.

use std::cell::RefCell;

use mlx_rs::Array;

use dspec_plugin_api::error::Result;
use dspec_plugin_api::{
    inventory, Agreement, Draft, Drafter, DrafterLoadRequest, DrafterRegistration, TargetModel,
    TokenPicker,
};

use crate::copy_alignment::{continue_copy, copy, Alignment, Edit, EditMemory};
use crate::match_index::MatchIndex;

/// Tokens in a row that continue a lookup's match after which the output is taken to be
/// copying from there.
const ADOPT_AFTER: usize = 2;

/// Where drafts come from, followed over every token fed.
#[derive(Debug, Clone, Copy, Default)]
struct Tracking {
    /// What part of the history the output is copying.
    alignment: Alignment,
    /// While no copy is followed: where the latest match's continuation goes on, and how
    /// many tokens in a row have followed it (drafted and kept, or fed by plain steps
    /// alike): at [`ADOPT_AFTER`] the copy is followed from there.
    candidate: Option<(usize, usize)>,
}

/// The prompt-lookup drafter over prompt + committed output.
pub struct NgramDrafter {
    history: Vec<u32>,
    /// The history's n-grams, so the latest match is found without a scan.
    matches: RefCell<MatchIndex>,
    tracking: Tracking,
    edits: EditMemory,
    /// Whether the commits arriving are plain steps' (after a propose of no drafts),
    /// whose tokens are checked against what a lookup would have proposed.
    plain: bool,
    agreement: Agreement,
    /// The longest n-gram matched (`new`'s `n`).
    longest: usize,
}

impl NgramDrafter {
    /// `n`: longest n-gram to match (shorter ones down to 1 are tried after it).
    pub fn new(n: usize) -> Self {
        Self {
            history: Vec::new(),
            matches: RefCell::new(MatchIndex::new(n.max(1))),
            tracking: Tracking::default(),
            edits: EditMemory::default(),
            plain: false,
            agreement: Agreement::default(),
            longest: n,
        }
    }

    /// Up to `max_k` drafts after `history` (the newest token included), drafts coming
    /// from `tracking` as it stands there: the aligned copy when it has something, else
    /// the latest match's continuation, with the remembered edits applied.
    fn lookup(&self, history: &[u32], tracking: &Tracking, max_k: usize) -> Vec<u32> {
        let alignment = &tracking.alignment;
        if let Some(tokens) = continue_copy(history, alignment, &self.edits, max_k) {
            return tokens;
        }
        // The candidate is the latest match while the output is off its copy (or has
        // none); a copy in step with nothing left to continue looks one up afresh.
        let from = match tracking.candidate {
            Some((at, _)) => Some(at),
            None if alignment.is_in_step() => self.latest_continuation(history),
            None => None,
        };
        from.map_or_else(Vec::new, |from| {
            copy(history, from, &[], &self.edits, max_k)
        })
    }

    /// Where the continuation of the latest earlier match of `history`'s last `n` tokens
    /// (or of a shorter suffix) starts. `history` is the drafter's, possibly with the
    /// token about to be fed.
    fn latest_continuation(&self, history: &[u32]) -> Option<usize> {
        self.matches.borrow_mut().latest_continuation(history, 1)
    }

    /// `tracking` followed over the newest token of `history`, and the edit that token
    /// completed, if any (see [`Alignment::advance`]).
    fn track(&self, history: &[u32], tracking: Tracking) -> (Tracking, Option<Edit>) {
        let Some((&token, before)) = history.split_last() else {
            return (tracking, None);
        };
        let followed = match tracking.candidate {
            Some((at, run)) if before.get(at) == Some(&token) => Some((at, run + 1)),
            _ => None,
        };
        let mut alignment = tracking.alignment;
        let edit = alignment.advance(before, token, &self.edits);
        // Off its copy (or with none), the output takes up the latest match once it has
        // followed it long enough: a copy it left and did not rejoin nearby may go on
        // from anywhere, earlier in the source included.
        if let (false, Some((at, ADOPT_AFTER..))) = (alignment.is_in_step(), followed) {
            alignment = Alignment::copying_from(at + 1);
        }
        let candidate = match (alignment.is_in_step(), followed) {
            (true, _) => None,
            (false, Some((at, run))) => Some((at + 1, run)),
            (false, None) => self.latest_continuation(history).map(|at| (at, 0)),
        };
        (
            Tracking {
                alignment,
                candidate,
            },
            edit,
        )
    }

    /// Feeds one token to the history, following where drafts come from and learning
    /// the copy's edits.
    fn push(&mut self, token: u32) {
        self.history.push(token);
        let (tracking, edit) = self.track(&self.history, self.tracking);
        self.tracking = tracking;
        if let Some(edit) = edit {
            self.edits.learn(edit);
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
        self.matches.borrow_mut().clear();
        self.tracking = Tracking {
            alignment: Alignment::default(),
            candidate: self.latest_continuation(&self.history).map(|at| (at, 0)),
        };
        self.edits = EditMemory::default();
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
        // Where drafts come from once `last` is fed; `commit` follows it for good.
        self.history.push(last);
        let (tracking, _) = self.track(&self.history, self.tracking);
        let tokens = self.lookup(&self.history, &tracking, max_k);
        self.history.pop();
        Ok(Draft {
            tokens,
            ..Draft::default()
        })
    }

    fn commit(&mut self, verified: &[u32], _hidden: Option<&Array>) -> Result<()> {
        for &token in verified {
            // A lookup per plain step: what a round of one draft would have proposed.
            if self.plain {
                let guess = self.lookup(&self.history, &self.tracking, 1);
                self.agreement.add(Agreement {
                    agreed: usize::from(guess.first() == Some(&token)),
                    checked: 1,
                });
            }
            self.push(token);
        }
        Ok(())
    }

    fn agreement(&mut self) -> Option<Agreement> {
        Some(std::mem::take(&mut self.agreement))
    }

    /// Each plain step's token as it comes: checking it is one lookup, and a copy the
    /// output starts is worth drafting from its first tokens on.
    fn plain_piece(&self) -> Option<usize> {
        Some(1)
    }

    /// A proposal reads the history and the copy being followed without changing them.
    fn drafts_by_lookup(&self) -> bool {
        true
    }

    fn fork(&self) -> Option<Box<dyn Drafter>> {
        Some(Box::new(NgramDrafter::new(self.longest)))
    }

    fn forks(&self) -> bool {
        true
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
        summary: "prompt lookup: continues the latest earlier match of the last n tokens (--ngram N), following an output that copies its input through its edits",
        detect: |_| false,
        by_name: true,
        load,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::match_index::scan_latest_continuation;

    /// The latest-match lookup alone: up to `max_k` tokens of the continuation.
    fn propose(history: &[u32], n: usize, min_n: usize, max_k: usize) -> Vec<u32> {
        match scan_latest_continuation(history, n, min_n) {
            Some(from) if max_k > 0 => history[from..(from + max_k).min(history.len())].to_vec(),
            _ => Vec::new(),
        }
    }

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

    /// Rounds a drafter takes to produce `output` (its first token from the prefill)
    /// after `prompt` under greedy acceptance: each round keeps the drafts that match.
    fn rounds_to_write(d: &mut NgramDrafter, prompt: &[u32], output: &[u32], k: usize) -> usize {
        let (_dir, target) = tiny_target();
        let t = target.as_ref();
        d.begin(t, prompt, None).unwrap();
        let (mut at, mut rounds) = (1, 0);
        while at < output.len() {
            let room = k.min(output.len() - at - 1);
            let drafts = d
                .propose(t, output[at - 1], room, &mut NoPicker)
                .unwrap()
                .tokens;
            assert!(drafts.len() <= room, "drafted past max_k");
            let kept = drafts
                .iter()
                .zip(&output[at..])
                .take_while(|(a, b)| a == b)
                .count();
            let mut verified = vec![output[at - 1]];
            verified.extend_from_slice(&drafts[..kept]);
            d.commit(&verified, None).unwrap();
            rounds += 1;
            at += kept + 1;
        }
        rounds
    }

    /// The same count for the latest-match lookup alone.
    fn rounds_of_plain_lookup(prompt: &[u32], output: &[u32], k: usize) -> usize {
        let mut history = prompt.to_vec();
        history.push(output[0]);
        let (mut at, mut rounds) = (1, 0);
        while at < output.len() {
            let drafts = propose(&history, 3, 1, k.min(output.len() - at - 1));
            let kept = drafts
                .iter()
                .zip(&output[at..])
                .take_while(|(a, b)| a == b)
                .count();
            history.extend_from_slice(&output[at..at + kept + 1]);
            rounds += 1;
            at += kept + 1;
        }
        rounds
    }

    /// A rename across a body of code: a name (7) used every sixth token becomes two
    /// tokens (70 71). Once the first occurrence is learned, the copy drafts the rest
    /// with the new name: whole rounds of k drafts but for where the output ends.
    #[test]
    fn a_rename_is_drafted_from_its_second_occurrence_on() {
        let body: Vec<u32> = (0..96)
            .map(|i| if i % 6 == 3 { 7 } else { 100 + i })
            .collect();
        let prompt: Vec<u32> = [1, 5, 6]
            .into_iter()
            .chain(body.clone())
            .chain([3])
            .collect();
        let output: Vec<u32> = body
            .iter()
            .flat_map(|&t| if t == 7 { vec![70, 71] } else { vec![t] })
            .chain([2])
            .collect();
        let k = 8;
        let mut d = NgramDrafter::new(3);
        let aligned = rounds_to_write(&mut d, &prompt, &output, k);
        let plain = rounds_of_plain_lookup(&prompt, &output, k);
        // Learning the rename costs the first few rounds; every later round keeps k.
        let after_learning = (output.len() - 8).div_ceil(k + 1);
        assert!(
            aligned <= 6 + after_learning,
            "{aligned} rounds, against {after_learning} for the output past the first rename"
        );
        assert!(
            2 * aligned <= plain,
            "aligned copy {aligned} rounds, latest-match lookup {plain}"
        );
    }

    /// Drafting and plain commits in any order, over a small vocabulary (matches
    /// everywhere, edits learned and contradicted): drafts stay within max_k and the
    /// drafter never fails.
    #[test]
    fn any_sequence_of_rounds_is_handled() {
        let (_dir, target) = tiny_target();
        let t = target.as_ref();
        let mut state = 0x9e37_79b9_u64;
        let mut next = |m: u64| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1);
            (state >> 33) % m
        };
        let mut d = NgramDrafter::new(3);
        let prompt: Vec<u32> = (0..40).map(|_| next(6) as u32).collect();
        d.begin(t, &prompt, None).unwrap();
        let mut last = 0;
        for _ in 0..2000 {
            let max_k = next(10) as usize;
            let drafts = d.propose(t, last, max_k, &mut NoPicker).unwrap().tokens;
            assert!(drafts.len() <= max_k);
            let mut verified = vec![last];
            if max_k == 0 {
                verified.extend((0..next(5)).map(|_| next(6) as u32));
            } else {
                let kept = next(drafts.len() as u64 + 1) as usize;
                verified.extend_from_slice(&drafts[..kept]);
            }
            d.commit(&verified, None).unwrap();
            last = next(6) as u32;
        }
        assert!(d.agreement().is_some_and(|a| a.checked > 0));
    }

    /// An output that leaves its copy and does not rejoin it nearby (here it starts the
    /// copied text over) takes up the latest match once two tokens have followed it,
    /// and learns the edits it makes there.
    #[test]
    fn a_copy_left_for_another_part_of_the_text_is_taken_up_there() {
        let (_dir, target) = tiny_target();
        let t = target.as_ref();
        let source: Vec<u32> = (1..=20).collect();
        // Prose after the code, so that where the output starts over is out of a
        // resync's reach.
        let mut prompt = vec![500];
        prompt.extend(&source);
        prompt.extend(600..630);
        let mut d = NgramDrafter::new(3);
        d.begin(t, &prompt, None).unwrap();
        // Copies 1..=10, writes three tokens of its own, starts over at 3, and renames 6.
        let output: Vec<u32> = (1..=10).chain([90, 91, 92, 3, 4, 5, 66, 7]).collect();
        d.propose(t, output[0], 0, &mut NoPicker).unwrap();
        d.commit(&output[..13], None).unwrap();
        let left = d.tracking.alignment;
        assert!(
            left.is_copying() && !left.is_in_step(),
            "left at 11: {left:?}"
        );
        // 3 starts a match, 4 and 5 follow it.
        d.commit(&output[13..16], None).unwrap();
        let taken_up = d.tracking.alignment;
        assert!(taken_up.is_in_step(), "following 3 4 5 again: {taken_up:?}");
        d.commit(&output[16..], None).unwrap();
        assert_eq!(
            d.edits.at(&[6], 0),
            Some(&Edit {
                from: vec![6],
                to: vec![66]
            })
        );
        // The copy taken up goes on after 8.
        assert_eq!(
            d.propose(t, 8, 2, &mut NoPicker).unwrap().tokens,
            vec![9, 10]
        );
    }

    /// Plain steps (no drafts) are followed as drafted rounds are: the copy is taken up
    /// and its edits learned from the tokens alone, so the agreement that decides
    /// whether to draft (`--max-draft auto`) is the copy's, and the first round drafted
    /// afterwards continues it, the edit applied.
    #[test]
    fn plain_steps_take_up_the_copy_and_its_edits() {
        let (_dir, target) = tiny_target();
        let t = target.as_ref();
        let body: Vec<u32> = (0..48)
            .map(|i| if i % 6 == 3 { 7 } else { 100 + i })
            .collect();
        let prompt: Vec<u32> = [1, 5, 6].into_iter().chain(body.clone()).collect();
        let output: Vec<u32> = body
            .iter()
            .flat_map(|&t| if t == 7 { vec![70, 71] } else { vec![t] })
            .collect();
        let mut d = NgramDrafter::new(3);
        d.begin(t, &prompt, None).unwrap();
        assert!(d
            .propose(t, output[0], 0, &mut NoPicker)
            .unwrap()
            .tokens
            .is_empty());
        // Two thirds of the output through plain steps, told in two commits.
        let told = 2 * output.len() / 3;
        d.commit(&output[..20], None).unwrap();
        d.commit(&output[20..told], None).unwrap();
        let Agreement { agreed, checked } = d.agreement().unwrap();
        assert_eq!(checked, told);
        // Missed only before the copy is taken up and around the first rename, before
        // its edit is learned: four tokens. The latest-match lookup misses at every
        // renamed name.
        assert!(agreed + 4 >= told, "{agreed} of {told}");
        let drafts = d
            .propose(t, output[told], 12, &mut NoPicker)
            .unwrap()
            .tokens;
        assert_eq!(drafts, output[told + 1..told + 13].to_vec());
    }
}
