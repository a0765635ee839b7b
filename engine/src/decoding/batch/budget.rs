//! How many drafts each sequence of a batched step verifies, as the load changes.
//!
//! A step's time grows with the positions it feeds: `fixed + per_position × positions`,
//! fitted over recent steps (the fixed part is mostly reading the weights once; each
//! position adds its share of the products and attention). A step that feeds one
//! position per decoding sequence commits one token per sequence. The j-th draft of a
//! sequence whose drafts are kept at rate α adds α^j tokens for one more position, so it
//! is worth its position when α^j / per_position beats the step's own tokens per second:
//! drafts are handed out best first until the next one would lower the rate. With few
//! sequences the fixed part dominates and sequences draft as deep as their acceptance
//! pays; as the batch fills, positions dominate and drafts fall away until the steps are
//! plain batched steps, never slower than those.

use crate::decoding::draft_length::LineFit;

/// Until steps of different widths have been timed, a position is taken to cost this
/// share of a step's fixed part: a guess that lets drafts be tried at light load, where
/// the fit then learns what positions really cost.
const UNTIMED_POSITION_SHARE: f64 = 1.0 / 32.0;

/// Forgetting per step of the measured throughputs: about the last 30 steps count.
const THROUGHPUT_DECAY: f64 = 0.97;
/// While steps with drafts commit fewer tokens per second than plain ones, one step in
/// this many is still granted drafts, so that the comparison follows the load.
const PROBE_EVERY: usize = 16;

/// What a step fed besides each decoding sequence's newest token, and the tokens it
/// committed.
pub(super) enum StepFed {
    /// Chunks of prompts.
    Prompts,
    Drafts {
        committed: usize,
    },
    Plain {
        committed: usize,
    },
}

/// The step costs measured so far.
#[derive(Debug, Default)]
pub(super) struct StepCosts {
    fit: LineFit,
    /// Decayed tokens committed and seconds taken, by steps that verified drafts and by
    /// steps that did not.
    drafted: (f64, f64),
    plain: (f64, f64),
    steps: usize,
}

impl StepCosts {
    /// A step of `positions` took `seconds`, and fed what `fed` says.
    pub(super) fn observe(&mut self, positions: usize, seconds: f64, fed: StepFed) {
        self.steps += 1;
        let (tokens, drafted) = match fed {
            // Reading prompts is most of such a step: it says nothing about drafts, and
            // a prompt's positions cost what a long forward's do, not a verify's.
            StepFed::Prompts => return,
            StepFed::Drafts { committed } => (committed, true),
            StepFed::Plain { committed } => (committed, false),
        };
        self.fit.observe(positions as f64, seconds);
        for (t, s) in [&mut self.drafted, &mut self.plain] {
            *t *= THROUGHPUT_DECAY;
            *s *= THROUGHPUT_DECAY;
        }
        let side = match drafted {
            true => &mut self.drafted,
            false => &mut self.plain,
        };
        side.0 += tokens as f64;
        side.1 += seconds;
    }

    /// Whether this step may verify drafts: not while steps that did committed fewer
    /// tokens per second than plain steps (the positional model misses what a device
    /// pays for a verify's shapes); every [`PROBE_EVERY`]th step does the other, so that
    /// both rates stay measured.
    pub(super) fn drafting_allowed(&self) -> bool {
        let rate = |(tokens, seconds): (f64, f64)| (seconds > 0.0).then(|| tokens / seconds);
        let preferred = match (rate(self.drafted), rate(self.plain)) {
            (Some(drafted), Some(plain)) => drafted >= plain,
            _ => true,
        };
        preferred != self.steps.is_multiple_of(PROBE_EVERY)
    }

    /// `(fixed, per_position)` seconds; `None` before any step.
    pub(super) fn model(&self) -> Option<(f64, f64)> {
        Some(match self.fit.line()? {
            (fixed, Some(per_position)) => (fixed, per_position),
            (mean, None) => (mean, mean * UNTIMED_POSITION_SHARE),
        })
    }
}

/// One decoding sequence's offer: the drafts it has (`available`) and how often its
/// drafts are kept.
#[derive(Debug, Clone, Copy)]
pub(super) struct Offer {
    pub available: usize,
    pub alpha: f64,
}

/// Drafts granted to each offer, for a step that feeds `positions` positions without
/// drafts and commits `tokens` tokens, under the cost model `(fixed, per_position)`.
pub(super) fn allocate(
    offers: &[Offer],
    positions: usize,
    tokens: f64,
    (fixed, per_position): (f64, f64),
) -> Vec<usize> {
    let mut granted = vec![0usize; offers.len()];
    let mut tokens = tokens;
    let mut seconds = fixed + per_position * positions as f64;
    loop {
        // The draft that adds the most tokens next: the j-th of offer i adds α^j.
        let best = offers
            .iter()
            .zip(&granted)
            .enumerate()
            .filter(|(_, (offer, &k))| k < offer.available)
            .map(|(i, (offer, &k))| (i, offer.alpha.powi(k as i32 + 1)))
            .max_by(|a, b| a.1.total_cmp(&b.1));
        let Some((i, gain)) = best else {
            return granted;
        };
        // Worth its position when the rate rises: gain / per_position > tokens / seconds.
        if gain * seconds <= tokens * per_position {
            return granted;
        }
        granted[i] += 1;
        tokens += gain;
        seconds += per_position;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offers(n: usize, alpha: f64) -> Vec<Offer> {
        vec![
            Offer {
                available: 8,
                alpha
            };
            n
        ]
    }

    /// A device where a step is mostly its weights (a GPU at small batches): drafts kept
    /// often are granted deep at one sequence, fewer each as sequences join, none once
    /// positions dominate the step; drafts seldom kept are never granted.
    #[test]
    fn drafts_follow_the_load() {
        let costs = (0.010, 0.0002);
        let one = allocate(&offers(1, 0.9), 1, 1.0, costs);
        assert_eq!(one, vec![8], "a lone sequence drafts all it has");
        let four: usize = allocate(&offers(4, 0.9), 4, 4.0, costs).iter().sum();
        let sixty_four: usize = allocate(&offers(64, 0.9), 64, 64.0, costs).iter().sum();
        assert!(four > 0 && four <= 32, "{four}");
        assert!(
            sixty_four * 4 < four * 64,
            "a full batch drafts less per sequence: {sixty_four} over 64 vs {four} over 4"
        );
        let dear = allocate(&offers(256, 0.9), 256, 256.0, (0.010, 0.001));
        assert!(
            dear.iter().all(|&k| k == 0),
            "positions dominate: plain steps"
        );
        let seldom = allocate(&offers(2, 0.01), 2, 2.0, costs);
        assert_eq!(seldom, vec![0, 0], "drafts seldom kept never pay");
    }

    /// Drafts go first to the sequences that keep them, and never past what a sequence has.
    #[test]
    fn the_best_drafts_come_first() {
        let offers = [
            Offer {
                available: 3,
                alpha: 0.95,
            },
            Offer {
                available: 8,
                alpha: 0.3,
            },
        ];
        let granted = allocate(&offers, 2, 2.0, (0.010, 0.001));
        assert_eq!(granted[0], 3, "{granted:?}");
        assert!(granted[1] < 3, "{granted:?}");
    }

    /// The cost model: a guess for positions until widths vary, then the fitted line of
    /// decoding steps; steps that read prompts leave it alone.
    #[test]
    fn step_costs_learn_what_a_position_costs() {
        let mut costs = StepCosts::default();
        assert!(costs.model().is_none());
        costs.observe(4, 0.010, StepFed::Plain { committed: 4 });
        let (fixed, per_position) = costs.model().expect("a model");
        assert!((fixed - 0.010).abs() < 1e-12);
        assert!((per_position - 0.010 / 32.0).abs() < 1e-12);
        for w in [1, 5, 9, 13, 17] {
            costs.observe(w, 0.004 + 0.001 * w as f64, StepFed::Plain { committed: w });
        }
        let (fixed, per_position) = costs.model().expect("a model");
        assert!((per_position - 0.001).abs() < 3e-4, "{per_position}");
        assert!(fixed > 0.0 && fixed < 0.008, "{fixed}");
        for _ in 0..20 {
            costs.observe(260, 1.5, StepFed::Prompts);
        }
        assert_eq!(costs.model(), Some((fixed, per_position)));
    }

    /// Steps with drafts that commit fewer tokens per second than plain steps stop drafts
    /// but for a probe every [`PROBE_EVERY`] steps; once they commit more, drafts come
    /// back.
    #[test]
    fn drafts_that_slow_the_batch_stop_but_for_probes() {
        let mut costs = StepCosts::default();
        let mut allowed = 0;
        for i in 0..64 {
            match costs.drafting_allowed() {
                // Drafted steps: 8 tokens in 20 ms; plain ones: 8 in 10 ms.
                true => costs.observe(16, 0.020, StepFed::Drafts { committed: 8 }),
                false => costs.observe(8, 0.010, StepFed::Plain { committed: 8 }),
            }
            if i >= 32 && costs.drafting_allowed() {
                allowed += 1;
            }
        }
        assert!((1..=4).contains(&allowed), "{allowed} of 32 steps drafted");
        for _ in 0..200 {
            match costs.drafting_allowed() {
                // Now drafted steps commit 24 tokens in 20 ms.
                true => costs.observe(16, 0.020, StepFed::Drafts { committed: 24 }),
                false => costs.observe(8, 0.010, StepFed::Plain { committed: 8 }),
            }
        }
        assert!(costs.drafting_allowed(), "drafts pay again");
    }
}
