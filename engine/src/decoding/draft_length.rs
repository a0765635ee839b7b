//! How many tokens to draft each round (`--max-draft auto`), chosen from what rounds
//! cost and how often drafts are kept.
//!
//! A round that drafts k tokens commits on average E(k) = 1 + α + … + α^k tokens, where
//! α is the chance a draft is kept given the one before it was, and costs
//! T(k) = draft(k) + verify(k + 1); a round of no drafts is a plain decoding step, which
//! is pipelined and so costs less than a verify of width 1 (on a GPU bound by the host's
//! per-operation work, several times less: docs/benchmarks.md has the verify costs
//! measured in plain steps). The best k maximises E(k) / T(k). α, the
//! plain step, draft(k) and verify(w) are all measured as the generation goes, because
//! they differ by device and model. The choice never affects *what* is generated
//! (acceptance is lossless for every k), only how fast.
//!
//! While no drafts are made, α would go unmeasured. A drafter that can tell, from the
//! tokens of those plain steps, how often its next-token guess was right
//! ([`dspec_plugin_api::Drafter::agreement`]) keeps α measured for free; otherwise an
//! occasional probe round drafts one token to measure it, at the price of a verify.

/// Exponential forgetting per observation, so the estimates follow a text whose
/// predictability changes (a code block, then prose).
const DECAY: f64 = 0.9;
/// Warm-up rounds, which draft the maximum before the model is trusted, for as long as
/// they keep drafts: a warm-up round that keeps none has shown what more of them would.
const WARMUP_ROUNDS: usize = 3;
/// Drafts of the warm-up when the drafter measures its agreement: then the warm-up is
/// there to time a draft and a verify, which one round of one draft does, while α comes
/// from the agreement. A warm-up round of the maximum, where drafts do not pay, costs as
/// many draft steps and a wide verify, several plain steps' worth (docs/benchmarks.md);
/// each further round of one draft, a draft step and a verify for at most two tokens.
const MEASURED_WARMUP_DRAFTS: usize = 1;
/// The measured α above which a round of one draft is tried when no round with drafts
/// has been timed yet: drafts kept more often than not.
const UNTIMED_ALPHA: f64 = 0.5;
/// Every this many rounds, one round tries a neighbour of the best k, so both cost fits
/// see more than one width and α keeps being measured when k = 0 looks best.
const PROBE_EVERY: usize = 8;
/// While probes keep finding that drafting does not pay, the rounds between them double
/// up to this many: a probe is a synchronous verify amid pipelined plain steps, which on
/// a GPU can cost several steps (docs/benchmarks.md), so probing at a fixed rate would
/// keep a run well below plain decoding's speed.
const PROBE_EVERY_MAX: usize = 256;

/// Least-squares line `y ≈ a + b·x` over decayed observations.
#[derive(Debug, Clone, Default)]
struct LineFit {
    n: f64,
    sx: f64,
    sy: f64,
    sxx: f64,
    sxy: f64,
    /// The largest x observed.
    widest: f64,
}

impl LineFit {
    fn observe(&mut self, x: f64, y: f64) {
        for s in [
            &mut self.n,
            &mut self.sx,
            &mut self.sy,
            &mut self.sxx,
            &mut self.sxy,
        ] {
            *s *= DECAY;
        }
        self.n += 1.0;
        self.sx += x;
        self.sy += y;
        self.sxx += x * x;
        self.sxy += x * y;
        self.widest = self.widest.max(x);
    }

    /// The fitted value at `x`. With (nearly) one x seen so far the slope is unknown:
    /// `through_origin` then scales the mean proportionally (draft cost ∝ tokens drafted),
    /// otherwise the line is flat (a verify costs what the widths seen cost). Without
    /// `through_origin` the line also stops at the widest x seen: a verify wider than
    /// any measured is taken to cost what the widest did, so one round measures it. A
    /// slope fitted on widths 1 and 2 alone and carried to 17 would rule out every wide
    /// round on a device whose verify cost is flat in width but noisy (a GPU bound by
    /// the host), and no wide round would ever come to correct it.
    fn predict(&self, x: f64, through_origin: bool) -> Option<f64> {
        if self.n < 1e-9 {
            return None;
        }
        let x = match through_origin {
            true => x,
            false => x.min(self.widest),
        };
        let (mx, my) = (self.sx / self.n, self.sy / self.n);
        let var = self.sxx / self.n - mx * mx;
        let y = if var > 0.05 {
            let slope = ((self.sxy / self.n - mx * my) / var).max(0.0);
            my + slope * (x - mx)
        } else if through_origin && mx > 0.0 {
            my / mx * x
        } else {
            my
        };
        Some(y.max(0.0))
    }
}

/// The per-round draft length controller.
#[derive(Debug, Clone)]
pub struct DraftLength {
    max: usize,
    adaptive: bool,
    /// Decayed counts of kept drafts and of first rejections.
    kept: f64,
    rejected: f64,
    /// Seconds of drafting against tokens drafted (rounds with k > 0).
    draft: LineFit,
    /// Seconds of verifying against the verified width (k + 1), rounds with drafts.
    verify: LineFit,
    /// Seconds per plain decoding step (rounds of no drafts). Kept apart from the verify
    /// line: plain steps are pipelined, a verify is waited on, so a plain step is not a
    /// verify of width 1.
    plain: LineFit,
    rounds: usize,
    /// Whether the warm-up is over: [`WARMUP_ROUNDS`] rounds, or one that kept nothing,
    /// or (the drafter measuring its agreement) one that drafted.
    warmed_up: bool,
    /// The round at which the next probe is due, and the current spacing of probes.
    next_probe: usize,
    probe_every: usize,
    /// Whether the drafter measures its agreement during plain steps: then probes are
    /// needed only to refresh the cost fits, and come at the longest spacing.
    agreement_measured: bool,
}

impl DraftLength {
    /// `max` drafts a round; `adaptive` picks fewer when they do not pay.
    pub fn new(max: usize, adaptive: bool) -> Self {
        Self {
            max,
            adaptive,
            kept: 0.0,
            rejected: 0.0,
            draft: LineFit::default(),
            verify: LineFit::default(),
            plain: LineFit::default(),
            rounds: 0,
            warmed_up: false,
            next_probe: PROBE_EVERY,
            probe_every: PROBE_EVERY,
            agreement_measured: false,
        }
    }

    /// The most drafts a round may ask for.
    pub fn max(&self) -> usize {
        self.max
    }

    /// The drafter reports its agreement during plain steps ([`Self::observe_agreement`]):
    /// probes stop being needed to measure α.
    pub fn set_agreement_measured(&mut self) {
        self.agreement_measured = true;
    }

    /// Of `checked` tokens committed by plain steps, the drafter's next-token guess
    /// matched `agreed`: as many observations of a draft kept or rejected, without a
    /// verify spent on them. Weighted as that many rounds' worth of forgetting.
    pub fn observe_agreement(&mut self, agreed: usize, checked: usize) {
        if checked == 0 {
            return;
        }
        let agreed = agreed.min(checked);
        let forget = DECAY.powi(checked.min(i32::MAX as usize) as i32);
        // Each new observation's mean weight under the same forgetting.
        let weight = (1.0 - forget) / (1.0 - DECAY) / checked as f64;
        self.kept = self.kept * forget + agreed as f64 * weight;
        self.rejected = self.rejected * forget + (checked - agreed) as f64 * weight;
    }

    /// The measured chance that a draft is kept (Laplace-smoothed).
    fn acceptance(&self) -> f64 {
        (self.kept + 1.0) / (self.kept + self.rejected + 2.0)
    }

    /// Expected tokens committed by a round of `k` drafts, over its expected seconds;
    /// `None` until both costs have been seen.
    fn rate(&self, k: usize) -> Option<f64> {
        let alpha = self.acceptance();
        let tokens: f64 = (0..=k).map(|i| alpha.powi(i as i32)).sum();
        if k == 0 {
            return Some(1.0 / self.plain.predict(1.0, false)?.max(1e-9));
        }
        let draft = self.draft.predict(k as f64, true)?;
        let verify = self.verify.predict((k + 1) as f64, false)?;
        Some(tokens / (draft + verify).max(1e-9))
    }

    /// The length with the best expected rate among `0..=cap` (`cap` while nothing is
    /// known).
    fn best(&self, cap: usize) -> usize {
        (0..=cap)
            .filter_map(|k| self.rate(k).map(|r| (k, r)))
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .map_or(cap, |(k, _)| k)
    }

    /// Drafts to ask for this round, at most `limit` (what may still be committed).
    /// Plain decoding steps (rounds of no drafts) ask one round ahead, before the round
    /// in flight is observed: the choice then lags one observation behind.
    pub fn next(&self, limit: usize) -> usize {
        let cap = self.max.min(limit);
        if !self.adaptive {
            return cap;
        }
        if !self.warmed_up {
            return match self.agreement_measured {
                true => cap.min(MEASURED_WARMUP_DRAFTS),
                false => cap,
            };
        }
        // What drafting is weighed against: plain decoding's own step, measured once.
        if self.plain.n < 1e-9 {
            return 0;
        }
        let best = self.best(cap);
        // Drafting is weighed by the costs of rounds with drafts: until one is timed
        // (the warm-up's lookups found nothing, or its round was thrown away unread)
        // only plain steps can win. Where the measured α says drafts are likely kept,
        // one round of one draft times them; elsewhere plain steps go on.
        if best == 0 && cap > 0 && self.rate(1).is_none() && self.acceptance() > UNTIMED_ALPHA {
            return 1;
        }
        if self.rounds < self.next_probe {
            return best;
        }
        // With α measured by the drafter, a probe only refreshes the cost fits, which a
        // probe at the longest spacing does well enough.
        if best == 0 && self.agreement_measured && self.probe_every < PROBE_EVERY_MAX {
            return best;
        }
        // A probe: one step up when there is room (k = 0 becomes 1, so α stays
        // measured), else one step down.
        if best < cap {
            best + 1
        } else {
            best.saturating_sub(1)
        }
    }

    /// What one round did: `drafted` tokens proposed (the drafter may give fewer than
    /// asked), `kept` of them accepted, and the seconds drafting and verifying took.
    pub fn observe(
        &mut self,
        drafted: usize,
        kept: usize,
        draft_seconds: f64,
        verify_seconds: f64,
    ) {
        self.rounds += 1;
        let timed = drafted > 0 && self.agreement_measured;
        if self.rounds >= WARMUP_ROUNDS || (drafted > 0 && kept == 0) || timed {
            self.warmed_up = true;
        }
        if drafted > 0 {
            self.kept = self.kept * DECAY + kept as f64;
            self.rejected = self.rejected * DECAY + f64::from(u8::from(kept < drafted));
            self.draft.observe(drafted as f64, draft_seconds);
            self.verify.observe((drafted + 1) as f64, verify_seconds);
        } else {
            self.plain.observe(1.0, verify_seconds);
        }
        self.schedule_probe();
    }

    /// A round that asked for drafts and got none (a lookup that found no match): it
    /// paid a verify of width 1, waited on at once, for one token, as a round whose first
    /// draft is rejected does; it is counted so, not as a plain step, whose pipelined cost
    /// it does not have (counted as one, it would make plain steps look dear and keep
    /// rounds asking for drafts that do not come).
    pub fn observe_empty(&mut self, verify_seconds: f64) {
        self.rounds += 1;
        if self.rounds >= WARMUP_ROUNDS {
            self.warmed_up = true;
        }
        self.kept *= DECAY;
        self.rejected = self.rejected * DECAY + 1.0;
        self.verify.observe(1.0, verify_seconds);
        self.schedule_probe();
    }

    fn schedule_probe(&mut self) {
        if self.rounds > self.next_probe {
            // The probe is in: space the next one out while drafting still does not pay
            // (at once to the longest spacing when α is measured without probes, which
            // then only refresh the cost fits).
            self.probe_every = match (self.best(self.max), self.agreement_measured) {
                (0, true) => PROBE_EVERY_MAX,
                (0, false) => (self.probe_every * 2).min(PROBE_EVERY_MAX),
                _ => PROBE_EVERY,
            };
            self.next_probe = self.rounds + self.probe_every;
        }
    }
}

// Simulated rounds for the tests, beside this file to keep it short enough to read.
#[cfg(test)]
mod simulation;

#[cfg(test)]
mod tests {
    use super::simulation::{
        most_common, simulate, simulate_ahead, simulate_with_agreement, uniform_stream,
    };
    use super::*;

    #[test]
    fn good_drafts_and_a_flat_verify_draft_the_maximum() {
        let ks = simulate(6, 60, 1.0, 0.0005, |_| 0.01);
        assert_eq!(most_common(&ks[20..]), 6, "{ks:?}");
    }

    #[test]
    fn drafts_that_are_never_kept_stop_being_drafted() {
        // Each draft costs half a verify and is never kept: plain steps (k = 0) win,
        // with the occasional probe of one draft.
        let ks = simulate(6, 80, 0.0, 0.005, |w| 0.01 + 0.0001 * w as f64);
        let tail = &ks[30..];
        assert_eq!(most_common(tail), 0, "{ks:?}");
        assert!(tail.iter().all(|&k| k <= 1), "{ks:?}");
        assert!(
            tail.contains(&1),
            "probes keep measuring acceptance: {ks:?}"
        );
    }

    /// Plain steps choose the next round before their own is observed: never-kept
    /// drafts still stop being drafted, and the probes still come, further and further
    /// apart while they keep finding that drafts do not pay.
    #[test]
    fn choosing_one_round_ahead_keeps_the_plain_steps_and_the_probes() {
        let ks = simulate_ahead(6, 400, 0.0, 0.005, |w| 0.01 + 0.0001 * w as f64, true);
        let tail = &ks[30..];
        assert_eq!(most_common(tail), 0, "{ks:?}");
        assert!(tail.iter().all(|&k| k <= 1), "{ks:?}");
        let probes: Vec<usize> = (30..ks.len()).filter(|&i| ks[i] == 1).collect();
        assert!(probes.len() >= 3, "{ks:?}");
        let gaps: Vec<usize> = probes.windows(2).map(|p| p[1] - p[0]).collect();
        assert!(
            gaps.windows(2).all(|g| g[1] >= g[0]),
            "probes spread out: {gaps:?}"
        );
        assert!(gaps.last() > gaps.first(), "probes spread out: {gaps:?}");
        assert!(
            probes.len() <= 8,
            "{} probes in {} rounds",
            probes.len(),
            tail.len()
        );
    }

    /// Where a verify costs several plain steps (a GPU bound by the host's per-operation
    /// work), drafting is weighed against the plain step: a draft model as slow per token
    /// as the target stops drafting even though its drafts are kept, while free drafts
    /// that are kept often still pay.
    #[test]
    fn drafting_is_weighed_against_the_plain_step() {
        let verify = |w: usize| if w == 1 { 1.0 } else { 3.0 + 0.1 * w as f64 };
        let dear_drafts = simulate_ahead(8, 200, 0.95, 1.0, verify, true);
        assert_eq!(most_common(&dear_drafts[50..]), 0, "{dear_drafts:?}");
        let free_drafts = simulate_ahead(8, 200, 0.95, 0.0, verify, true);
        assert_eq!(most_common(&free_drafts[50..]), 8, "{free_drafts:?}");
    }

    #[test]
    fn a_verify_that_grows_with_width_shortens_the_drafts() {
        // Free drafts kept 70% of the time. A flat verify (a GPU's) makes every extra
        // draft free: the maximum. A verify costing 5× more per position than its fixed
        // part (a CPU's) makes a long block cost more than its expected gain.
        let flat = simulate(8, 120, 0.7, 0.0, |_| 0.01);
        let steep = simulate(8, 120, 0.7, 0.0, |w| 0.002 + 0.01 * w as f64);
        assert_eq!(most_common(&flat[40..]), 8, "{flat:?}");
        assert!(most_common(&steep[40..]) <= 2, "{steep:?}");
    }

    /// A mixture-of-experts target: a verify of w positions reads every expert any of
    /// them was routed to, so its cost grows with width, steeply and then less so
    /// (Qwen3-30B-A3B's shape: 8 of 128 experts a position, experts most of a step's
    /// weight). Drafts kept half the time do not pay for that: plain steps. Drafts kept
    /// 90% of the time pay for a few positions, not for the maximum. Either way the
    /// rounds chosen run at least 0.95× the better of plain decoding and the best
    /// fixed length.
    #[test]
    fn a_mixture_of_experts_verify_is_paid_for_only_where_drafts_earn_it() {
        let experts_read = |w: usize| 128.0 * (1.0 - (1.0 - 8.0 / 128.0f64).powi(w as i32));
        // In plain steps: the dense part, then the experts read.
        let verify = |w: usize| 0.3 + 0.7 * experts_read(w) / 8.0;
        let expected_tokens =
            |k: usize, alpha: f64| (0..=k).map(|i| alpha.powi(i as i32)).sum::<f64>();
        let cost = |k: usize| verify(k + 1);
        for (alpha, most_drafted) in [(0.5, 0), (0.9, 4)] {
            let ks = simulate(8, 400, alpha, 0.0, verify);
            let tail = &ks[100..];
            let rate = tail.iter().map(|&k| expected_tokens(k, alpha)).sum::<f64>()
                / tail.iter().map(|&k| cost(k)).sum::<f64>();
            let best = (0..=8)
                .map(|k| expected_tokens(k, alpha) / cost(k))
                .fold(0.0, f64::max);
            assert!(
                rate >= 0.95 * best,
                "α {alpha}: {rate:.3} against {best:.3}: {ks:?}"
            );
            assert!(
                most_common(tail) <= most_drafted,
                "α {alpha}: drafts {}: {ks:?}",
                most_common(tail)
            );
        }
    }

    /// Drafts that are never kept, from a drafter that measures its agreement: one
    /// warm-up round that keeps nothing, then plain steps without a single probe for as
    /// long as probes are spaced at most (α is known without them).
    #[test]
    fn measured_agreement_replaces_the_probes() {
        let verify = |w: usize| 0.01 + 0.0001 * w as f64;
        let ks = simulate_with_agreement(PROBE_EVERY_MAX, |_| 0.0, 0.005, verify, 0.004);
        assert_eq!(ks[0], 1, "a warm-up round drafts one token: {ks:?}");
        assert!(ks[1..].iter().all(|&k| k == 0), "{ks:?}");
        // Without agreement the same drafter is probed again and again.
        let probed = simulate(8, PROBE_EVERY_MAX, 0.0, 0.005, verify);
        assert!(
            probed[1..].iter().filter(|&&k| k > 0).count() >= 3,
            "{probed:?}"
        );
        // Probes still come at the longest spacing, to refresh the cost fits.
        let long = simulate_with_agreement(3 * PROBE_EVERY_MAX, |_| 0.0, 0.005, verify, 0.004);
        let probes = long[1..].iter().filter(|&&k| k > 0).count();
        assert!((1..=3).contains(&probes), "{probes} probes: {long:?}");
    }

    /// Good drafts from a drafter that measures its agreement: a short warm-up (one round
    /// of one draft, which times a draft and a verify), then the maximum.
    #[test]
    fn measured_agreement_warms_up_short_then_drafts_what_pays() {
        let ks = simulate_with_agreement(60, |_| 0.95, 0.0001, |_| 0.005, 0.004);
        assert_eq!(ks[0], 1, "{ks:?}");
        assert_ne!(ks[1], 1, "one warm-up round: {ks:?}");
        assert_eq!(most_common(&ks[10..]), 8, "{ks:?}");
    }

    /// Warm-up rounds whose lookups found nothing time no round with drafts, so the
    /// costs that weigh drafting are unknown: once the agreement says drafts would be
    /// kept, one round of one draft times them, instead of waiting for a probe.
    #[test]
    fn untimed_drafting_is_tried_once_the_agreement_is_high() {
        let mut control = DraftLength::new(16, true);
        control.set_agreement_measured();
        for _ in 0..4 {
            control.observe(0, 0, 0.0, 0.003);
        }
        control.observe_agreement(0, 20);
        assert_eq!(control.next(16), 0, "agreement low: plain steps");
        control.observe_agreement(40, 40);
        assert_eq!(
            control.next(16),
            1,
            "agreement high: one draft to time drafting"
        );
        control.observe(1, 1, 1e-5, 0.005);
        assert!(control.next(16) > 1, "timed: weighed by the costs");
    }

    /// A text that turns predictable while decoding plainly: the agreement the drafter
    /// measures brings drafting back within a few commits, long before a probe is due.
    #[test]
    fn rising_agreement_brings_drafting_back_without_a_probe() {
        let verify = |_| 0.005;
        let ks = simulate_with_agreement(
            200,
            |i| if i < 60 { 0.0 } else { 0.95 },
            0.0001,
            verify,
            0.004,
        );
        // (Right after the warm-up, with free drafts and a verify barely dearer than a
        // plain step, one short round can still look worth it.)
        assert!(ks[5..60].iter().all(|&k| k == 0), "{ks:?}");
        let back = ks[60..].iter().position(|&k| k > 0).map(|i| i + 60);
        assert!(
            back.is_some_and(|i| i < 80),
            "drafting resumed at {back:?}: {ks:?}"
        );
        assert_eq!(most_common(&ks[100..]), 8, "{ks:?}");
    }

    /// A lookup that finds no match proposes nothing: such a round costs a verify of
    /// width 1 waited on at once, and must not pass for a plain step (which would then
    /// look as dear, and keep rounds asking for drafts that do not come): the plain
    /// step's cost stays what plain steps cost, and the round counts as a rejection.
    #[test]
    fn a_round_that_gets_no_drafts_is_not_a_plain_step() {
        let mut control = DraftLength::new(16, true);
        for _ in 0..4 {
            control.observe(0, 0, 0.0, 0.003);
        }
        let alpha = control.acceptance();
        for _ in 0..20 {
            control.observe_empty(0.008);
        }
        let plain = control.plain.predict(1.0, false).expect("plain steps seen");
        assert!((plain - 0.003).abs() < 1e-9, "plain step {plain}");
        let verify = control.verify.predict(1.0, false).expect("verifies seen");
        assert!((verify - 0.008).abs() < 1e-9, "verify {verify}");
        assert!(
            control.acceptance() < alpha / 4.0,
            "{alpha} -> {}",
            control.acceptance()
        );
        assert_eq!(control.next(usize::MAX), 0);
    }

    /// The start of an edit on a GPU: two rounds whose lookup found nothing (verifies of
    /// width 1), a warm-up round of one draft that was rejected (a verify of width 2, a
    /// little dearer by noise), then plain steps whose tokens the drafter would have
    /// guessed nine times in ten. A verify costs the same at every width. Drafting must
    /// come back, and wide: a slope fitted on widths 1 and 2 must not price a verify of
    /// 17 out of reach before one is measured.
    #[test]
    fn a_verify_wider_than_any_seen_is_tried_before_it_is_ruled_out() {
        let verify = |w: usize| if w == 2 { 0.0085 } else { 0.007 };
        let mut control = DraftLength::new(16, true);
        control.set_agreement_measured();
        control.observe_empty(verify(1));
        control.observe_empty(verify(1));
        assert_eq!(control.next(usize::MAX), MEASURED_WARMUP_DRAFTS);
        control.observe(1, 0, 0.0, verify(2));
        let mut uniform = uniform_stream(0x5151_7e2f_00d1_a5edu64);
        let mut chosen = Vec::new();
        for _ in 0..64 {
            let k = control.next(usize::MAX);
            chosen.push(k);
            if k == 0 {
                control.observe(0, 0, 0.0, 0.003);
                control.observe_agreement(usize::from(uniform() < 0.9), 1);
            } else {
                let kept = (0..k).take_while(|_| uniform() < 0.9).count();
                control.observe(k, kept, 0.0, verify(k + 1));
            }
        }
        let first = chosen.iter().position(|&k| k > 0);
        assert!(first.is_some_and(|i| i < 16), "{chosen:?}");
        assert!(most_common(&chosen[32..]) >= 8, "{chosen:?}");
    }

    #[test]
    fn fixed_length_is_the_maximum_within_the_limit() {
        let mut control = DraftLength::new(5, false);
        control.observe(5, 0, 1.0, 1.0);
        assert_eq!(control.next(usize::MAX), 5);
        assert_eq!(control.next(3), 3);
        assert_eq!(control.next(0), 0);
    }

    #[test]
    fn the_line_fit_recovers_a_line_and_falls_back_sensibly() {
        let mut fit = LineFit::default();
        for w in 1..=6 {
            fit.observe(w as f64, 2.0 + 3.0 * w as f64);
        }
        assert!((fit.predict(5.0, false).unwrap() - 17.0).abs() < 1e-6);
        assert!((fit.predict(10.0, true).unwrap() - 32.0).abs() < 1e-6);
        // A verify past the widest seen is priced at the widest.
        assert!((fit.predict(10.0, false).unwrap() - 20.0).abs() < 1e-6);
        let mut one_width = LineFit::default();
        one_width.observe(4.0, 8.0);
        assert!((one_width.predict(2.0, true).unwrap() - 4.0).abs() < 1e-9);
        assert!((one_width.predict(2.0, false).unwrap() - 8.0).abs() < 1e-9);
        assert!(LineFit::default().predict(1.0, false).is_none());
    }
}
