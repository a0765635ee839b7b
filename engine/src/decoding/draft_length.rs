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
/// Drafts assumed kept as predicted before any round is verified: one unlucky round
/// should not discount the drafter's agreement much, rounds that keep far less should.
const BORNE_OUT_PRIOR: f64 = 4.0;
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
pub(crate) struct LineFit {
    n: f64,
    sx: f64,
    sy: f64,
    sxx: f64,
    sxy: f64,
    /// The largest x observed.
    widest: f64,
}

impl LineFit {
    pub(crate) fn observe(&mut self, x: f64, y: f64) {
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

    /// The fitted intercept and slope (never below 0), once x has varied enough to
    /// tell; the mean of y with no slope before.
    pub(crate) fn line(&self) -> Option<(f64, Option<f64>)> {
        if self.n < 1e-9 {
            return None;
        }
        let (mx, my) = (self.sx / self.n, self.sy / self.n);
        let var = self.sxx / self.n - mx * mx;
        if var <= 0.05 {
            return Some((my, None));
        }
        let slope = ((self.sxy / self.n - mx * my) / var).max(0.0);
        Some((my - slope * mx, Some(slope)))
    }

    /// The mean of the x observed (decayed as the fit is); `None` before any.
    pub(crate) fn mean_x(&self) -> Option<f64> {
        (self.n >= 1e-9).then(|| self.sx / self.n)
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
        let mx = self.sx / self.n;
        let y = match self.line()? {
            (intercept, Some(slope)) => intercept + slope * x,
            (my, None) if through_origin && mx > 0.0 => my / mx * x,
            (my, None) => my,
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
    /// Over rounds that drafted while the drafter measures its agreement: the drafts
    /// kept, and the drafts the acceptance of the time predicted would be (decayed sums).
    /// Their ratio discounts the agreement where verifies keep less than plain steps
    /// agree with (see `acceptance`).
    verified_kept: f64,
    predicted_kept: f64,
    /// What the drafter gives when asked (a lookup gives fewer when its match runs out):
    /// per draft position j (at index j − 1), decayed counts of rounds that asked for a
    /// j-th draft after getting j − 1, and of those that got it. Drafts that are kept but
    /// never come in the number asked must not be priced as if they would: a round
    /// asking for 8 that always gets 1 commits 2 tokens, not 9.
    asked_at: Vec<f64>,
    given_at: Vec<f64>,
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
            verified_kept: 0.0,
            predicted_kept: 0.0,
            asked_at: vec![0.0; max],
            given_at: vec![0.0; max],
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

    /// The measured chance that a draft is kept (Laplace-smoothed). Where the drafter's
    /// agreement with plain steps counts too, it is discounted by how much less the
    /// verified rounds kept than it predicted: a verify can reject what plain steps agree
    /// with (a 16-bit verify rounding a near-tie the other way), and then the agreement
    /// alone would keep asking for verifies that keep nothing.
    fn acceptance(&self) -> f64 {
        let pooled = (self.kept + 1.0) / (self.kept + self.rejected + 2.0);
        if !self.agreement_measured {
            return pooled;
        }
        let borne_out =
            (self.verified_kept + BORNE_OUT_PRIOR) / (self.predicted_kept + BORNE_OUT_PRIOR);
        pooled * borne_out.min(1.0)
    }

    /// A round asked for `asked` drafts and the drafter gave `given`.
    pub fn observe_offered(&mut self, asked: usize, given: usize) {
        for count in self.asked_at.iter_mut().chain(self.given_at.iter_mut()) {
            *count *= DECAY;
        }
        let reached = asked.min(given + 1).min(self.max);
        for j in 0..reached {
            self.asked_at[j] += 1.0;
            if j < given {
                self.given_at[j] += 1.0;
            }
        }
    }

    /// The chance that the drafter gives a j-th draft when asked for it, having given
    /// the j − 1 before (optimistic until asked: a position never asked for is tried).
    fn gives(&self, j: usize) -> f64 {
        match (self.asked_at.get(j - 1), self.given_at.get(j - 1)) {
            (Some(asked), Some(given)) => (given + 0.5) / (asked + 0.5),
            _ => 1.0,
        }
    }

    /// Expected tokens committed by a round asking for `k` drafts, over its expected
    /// seconds; `None` until both costs have been seen.
    fn rate(&self, k: usize) -> Option<f64> {
        if k == 0 {
            return Some(1.0 / self.plain.predict(1.0, false)?.max(1e-9));
        }
        let alpha = self.acceptance();
        // Draft j counts where it is given (`reach`) and it and those before it are kept.
        let (mut tokens, mut given, mut reach) = (1.0, 0.0, 1.0);
        for j in 1..=k {
            reach *= self.gives(j);
            tokens += reach * alpha.powi(j as i32);
            given += reach;
        }
        let drafting = self.draft.predict(given, true)?;
        let verify = self.verify.predict(1.0 + given, false)?;
        Some(tokens / (drafting + verify).max(1e-9))
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
            if self.agreement_measured {
                let alpha = self.acceptance();
                let predicted: f64 = (1..=drafted).map(|i| alpha.powi(i as i32)).sum();
                self.verified_kept = self.verified_kept * DECAY + kept as f64;
                self.predicted_kept = self.predicted_kept * DECAY + predicted;
            }
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
mod tests;
