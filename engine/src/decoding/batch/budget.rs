//! How many drafts each sequence of a batched step verifies, as the load changes.
//!
//! A plain step (each decoding sequence feeds its newest token) takes
//! `fixed + per_row × rows`, fitted over recent plain steps: the fixed part is mostly
//! reading the weights once, each row adds its share of the products and attention. A
//! step that verifies drafts takes longer than the plain step of its rows by
//! `per_draft × drafts + per_verifying_row × rows that verify`, fitted over recent steps
//! with drafts: a verifying row attends apart from the others, which on a GPU costs host
//! time whatever its length. The j-th draft of a sequence whose drafts are kept at rate α
//! adds α^j tokens, so drafts are handed out best value first while they raise the
//! step's tokens per second. With few sequences the fixed part dominates and sequences
//! draft as deep as their acceptance pays; as the batch fills, rows dominate and drafts
//! fall away until the steps are plain batched steps.
//!
//! A check that the model cannot fool: steps with drafts are compared with what plain
//! steps of the same rows take, by the plain line (not with the plain steps that
//! happened to run, which ran at other loads); while drafts commit their tokens slower
//! than plain steps would, steps stay plain but for an occasional probe.

use crate::decoding::draft_length::LineFit;

/// Until steps of different loads have been timed, a row is taken to cost this share of
/// a plain step: a guess that lets drafts be tried at light load, where the fits then
/// learn what rows and drafts really cost.
const UNTIMED_ROW_SHARE: f64 = 1.0 / 32.0;

/// Forgetting per step with drafts of the draft costs and of the check: about the last
/// 10 such steps count, so that one step slowed by something else (a GPU compiling
/// kernels for a shape it had not met) is soon outweighed.
const DECAY: f64 = 0.9;
/// Probes fall on every step of this many: one verifies drafts where no step has for
/// more than the probe interval (so while drafts are off, one step in twice this many
/// at the first interval), else it is plain where every step for more than this many
/// drafted; so both the plain line and the draft costs keep being measured whatever
/// the load.
const PROBE_EVERY: usize = 16;
/// Where a drafter runs a model, a probe whose drafts lost (committed slower than plain
/// steps of its rows would have) doubles the steps to the next one that verifies
/// drafts, up to this many; one that won brings them back to [`PROBE_EVERY`]. Such a
/// probe costs the drafter's forward, a few plain steps' time, so drafts that never pay
/// are tried seldom, and drafts that start to pay are back within this many steps. A
/// lookup drafter's probe costs only the positions it verifies, and its drafts often
/// start to pay at once (an answer that begins to copy its prompt): its probes keep
/// their first interval.
const PROBE_EVERY_MOST: usize = 64;

/// What a step does with the drafts offered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Drafting {
    /// Grants drafts as the costs say they pay.
    ByCost,
    /// Verifies none.
    Off,
    /// Grants drafts as the costs say, and where they say none pay, the drafts of the
    /// sequence that keeps them most often: a measurement.
    Probe,
}

/// What a step fed and committed.
pub(super) enum StepFed {
    /// Chunks of prompts besides any decoding rows, or a step in which the key/value
    /// pools grew: its time says nothing about rows or drafts (a prompt's positions cost
    /// what a long forward's do, and growing copies every sequence's keys and values).
    Untypical,
    Decode(DecodeStep),
}

/// A step of decoding rows only.
#[derive(Debug, Clone, Copy)]
pub(super) struct DecodeStep {
    /// Sequences that fed their newest token.
    pub rows: usize,
    /// Drafts verified, over all rows.
    pub drafts: usize,
    /// Rows that verified at least one draft.
    pub verifying: usize,
    /// Tokens committed.
    pub committed: usize,
    /// Some of the drafts came from a drafter that runs a model.
    pub from_models: bool,
}

/// What steps cost, in seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct CostModel {
    pub fixed: f64,
    pub per_row: f64,
    pub per_draft: f64,
    pub per_verifying_row: f64,
}

impl CostModel {
    fn plain_seconds(&self, rows: usize) -> f64 {
        self.fixed + self.per_row * rows as f64
    }
}

/// Decayed least squares of `y ≈ c·v + b·d` (no intercept): a drafted step's time over
/// its plain step's, by rows that verify (v) and drafts (d).
#[derive(Debug, Default)]
struct ExcessFit {
    vv: f64,
    vd: f64,
    dd: f64,
    vy: f64,
    dy: f64,
}

impl ExcessFit {
    fn observe(&mut self, v: f64, d: f64, y: f64) {
        for s in [
            &mut self.vv,
            &mut self.vd,
            &mut self.dd,
            &mut self.vy,
            &mut self.dy,
        ] {
            *s *= DECAY;
        }
        self.vv += v * v;
        self.vd += v * d;
        self.dd += d * d;
        self.vy += v * y;
        self.dy += d * y;
    }

    /// `(per_verifying_row, per_draft)`, neither below zero; `None` before any
    /// observation. While every row has verified the same number of drafts the two
    /// cannot be told apart, and the whole excess is put on the drafts.
    fn costs(&self) -> Option<(f64, f64)> {
        if self.dd <= 0.0 {
            return None;
        }
        let on_drafts = (0.0, (self.dy / self.dd).max(0.0));
        let det = self.vv * self.dd - self.vd * self.vd;
        if det <= 1e-6 * self.vv * self.dd {
            return Some(on_drafts);
        }
        let row = (self.vy * self.dd - self.dy * self.vd) / det;
        let draft = (self.dy * self.vv - self.vy * self.vd) / det;
        Some(match (row >= 0.0, draft >= 0.0) {
            (true, true) => (row, draft),
            (false, _) => on_drafts,
            (true, false) => ((self.vy / self.vv).max(0.0), 0.0),
        })
    }
}

/// The step costs measured so far.
#[derive(Debug, Default)]
pub(super) struct StepCosts {
    /// Plain steps' seconds by rows.
    plain: LineFit,
    excess: ExcessFit,
    /// Decayed over steps with drafts: their seconds, and the seconds plain steps of
    /// their rows would have taken to commit as many tokens.
    drafted_seconds: f64,
    plain_equivalent: f64,
    steps: usize,
    /// The last decoding step with drafts and the last one without.
    last_drafted: usize,
    last_plain: usize,
    /// Steps from one step with drafts to the next probe that verifies drafts (0 before
    /// any: [`PROBE_EVERY`]).
    draft_probe_every: usize,
    /// Row counts whose plain step has run: the first at a count is not fitted, since a
    /// GPU compiles kernels for a batch size new to it in that step (tens to hundreds of
    /// plain steps' time), which would make every draft look cheap next to it.
    plain_rows_seen: Vec<usize>,
}

impl StepCosts {
    /// A step took `seconds` and fed what `fed` says.
    pub(super) fn observe(&mut self, seconds: f64, fed: StepFed) {
        self.steps += 1;
        let StepFed::Decode(step) = fed else {
            return;
        };
        if step.drafts == 0 {
            self.last_plain = self.steps;
            match self.plain_rows_seen.contains(&step.rows) {
                true => self.plain.observe(step.rows as f64, seconds),
                false => self.plain_rows_seen.push(step.rows),
            }
            return;
        }
        self.last_drafted = self.steps;
        let Some(model) = self.model() else {
            return;
        };
        let plain = model.plain_seconds(step.rows);
        self.excess
            .observe(step.verifying as f64, step.drafts as f64, seconds - plain);
        let equivalent = step.committed as f64 * plain / step.rows as f64;
        self.drafted_seconds = self.drafted_seconds * DECAY + seconds;
        self.plain_equivalent = self.plain_equivalent * DECAY + equivalent;
        self.draft_probe_every = match equivalent >= seconds || !step.from_models {
            true => PROBE_EVERY,
            false => (self.draft_probe_interval() * 2).min(PROBE_EVERY_MOST),
        };
    }

    fn draft_probe_interval(&self) -> usize {
        self.draft_probe_every.max(PROBE_EVERY)
    }

    /// What the next step does with drafts: grants them while steps with drafts have
    /// committed their tokens faster than plain steps of their rows would have, else
    /// none; every [`PROBE_EVERY`]th step probes the side not measured lately (drafts
    /// less often while their probes lose: [`PROBE_EVERY_MOST`]).
    pub(super) fn drafting(&self) -> Drafting {
        let next = self.steps + 1;
        if next.is_multiple_of(PROBE_EVERY) {
            if next - self.last_drafted > self.draft_probe_interval() {
                return Drafting::Probe;
            }
            if next - self.last_plain > PROBE_EVERY {
                return Drafting::Off;
            }
        }
        match self.drafted_seconds <= 0.0 || self.plain_equivalent >= self.drafted_seconds {
            true => Drafting::ByCost,
            false => Drafting::Off,
        }
    }

    /// The costs measured; `None` before any plain step.
    pub(super) fn model(&self) -> Option<CostModel> {
        let (fixed, per_row) = match self.plain.line()? {
            (fixed, Some(per_row)) => (fixed, per_row),
            // Through the mean of the steps timed, at the loads they ran.
            (mean, None) => {
                let per_row = mean * UNTIMED_ROW_SHARE;
                let rows = self.plain.mean_x().unwrap_or(0.0);
                (mean - per_row * rows, per_row)
            }
        };
        let (per_verifying_row, per_draft) = self.excess.costs().unwrap_or((0.0, per_row));
        Some(CostModel {
            fixed,
            per_row,
            per_draft,
            per_verifying_row,
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

/// Drafts granted to each offer on a probe: as [`allocate`] grants them, or where it
/// grants none, every draft of the offer kept most often.
pub(super) fn allocate_probe(offers: &[Offer], rows: usize, model: &CostModel) -> Vec<usize> {
    let mut granted = allocate(offers, rows, model);
    if granted.iter().all(|&k| k == 0) {
        let best = offers
            .iter()
            .enumerate()
            .filter(|(_, o)| o.available > 0)
            .max_by(|a, b| a.1.alpha.total_cmp(&b.1.alpha));
        if let Some((i, offer)) = best {
            granted[i] = offer.available;
        }
    }
    granted
}

/// Drafts granted to each offer, for a step of `rows` decoding rows under `model`.
pub(super) fn allocate(offers: &[Offer], rows: usize, model: &CostModel) -> Vec<usize> {
    let mut granted = vec![0usize; offers.len()];
    let mut tokens = rows as f64;
    let mut seconds = model.plain_seconds(rows);
    loop {
        // The best value next: for a row that verifies already, its next draft; for one
        // that does not yet, its best first drafts together, as the first one alone
        // also pays for the row's verifying.
        let best = offers
            .iter()
            .zip(&granted)
            .enumerate()
            .filter(|(_, (offer, &k))| k < offer.available)
            .map(|(i, (offer, &k))| match k {
                0 => {
                    let mut gain = 0.0;
                    let mut best = (0.0, 1.0, 0);
                    for m in 1..=offer.available {
                        gain += offer.alpha.powi(m as i32);
                        let cost = model.per_verifying_row + model.per_draft * m as f64;
                        if gain * best.1 > best.0 * cost {
                            best = (gain, cost, m);
                        }
                    }
                    (i, best)
                }
                k => (i, (offer.alpha.powi(k as i32 + 1), model.per_draft, 1)),
            })
            .max_by(|a, b| (a.1 .0 * b.1 .1).total_cmp(&(b.1 .0 * a.1 .1)));
        let Some((i, (gain, cost, m))) = best else {
            return granted;
        };
        // Worth it when the rate rises: gain / cost > tokens / seconds.
        if m == 0 || gain * seconds <= tokens * cost {
            return granted;
        }
        granted[i] += m;
        tokens += gain;
        seconds += cost;
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

    fn model(fixed: f64, per_row: f64, per_draft: f64, per_verifying_row: f64) -> CostModel {
        CostModel {
            fixed,
            per_row,
            per_draft,
            per_verifying_row,
        }
    }

    /// A decoding step whose drafts (if any) a drafter running a model drafted.
    fn decode(rows: usize, drafts: usize, verifying: usize, committed: usize) -> StepFed {
        StepFed::Decode(DecodeStep {
            rows,
            drafts,
            verifying,
            committed,
            from_models: true,
        })
    }

    /// The same step with drafts from a lookup drafter.
    fn looked_up(rows: usize, drafts: usize, verifying: usize, committed: usize) -> StepFed {
        StepFed::Decode(DecodeStep {
            rows,
            drafts,
            verifying,
            committed,
            from_models: false,
        })
    }

    /// A device where a step is mostly its weights (a GPU at small batches): drafts kept
    /// often are granted deep at one sequence, fewer each as sequences join, none once
    /// rows dominate the step; drafts seldom kept are never granted.
    #[test]
    fn drafts_follow_the_load() {
        let costs = model(0.010, 0.0002, 0.0002, 0.0);
        let one = allocate(&offers(1, 0.9), 1, &costs);
        assert_eq!(one, vec![8], "a lone sequence drafts all it has");
        let four: usize = allocate(&offers(4, 0.9), 4, &costs).iter().sum();
        let sixty_four: usize = allocate(&offers(64, 0.9), 64, &costs).iter().sum();
        assert!(four > 0 && four <= 32, "{four}");
        assert!(
            sixty_four * 4 < four * 64,
            "a full batch drafts less per sequence: {sixty_four} over 64 vs {four} over 4"
        );
        let dear = allocate(&offers(256, 0.9), 256, &model(0.010, 0.001, 0.001, 0.0));
        assert!(dear.iter().all(|&k| k == 0), "rows dominate: plain steps");
        let seldom = allocate(&offers(2, 0.01), 2, &costs);
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
        let granted = allocate(&offers, 2, &model(0.010, 0.001, 0.001, 0.0));
        assert_eq!(granted[0], 3, "{granted:?}");
        assert!(granted[1] < 3, "{granted:?}");
    }

    /// What a row costs to verify at all, apart from its drafts: rows open only where
    /// several drafts are likely kept, and at load fewer rows verify than with drafts
    /// alone priced; a first draft that would not pay alone is granted with the ones
    /// after it.
    #[test]
    fn verifying_a_row_costs_apart_from_its_drafts() {
        let cheap_rows = model(0.010, 0.0005, 0.0005, 0.0);
        let dear_rows = model(0.010, 0.0005, 0.0005, 0.004);
        let rows = |m: &CostModel| -> usize {
            allocate(&offers(8, 0.8), 8, m)
                .iter()
                .filter(|&&k| k > 0)
                .count()
        };
        assert_eq!(rows(&cheap_rows), 8);
        assert!(rows(&dear_rows) < 8, "{}", rows(&dear_rows));
        // One draft alone: 0.9 tokens for 12.5 ms, below the step's 1 token in 10.5 ms;
        // eight: 5.1 tokens for 16 ms.
        let lone = allocate(&offers(1, 0.9), 1, &model(0.010, 0.0005, 0.0005, 0.012));
        assert!(lone[0] >= 4, "{lone:?}");
    }

    /// The plain line from plain steps alone, the draft costs from steps with drafts over
    /// their rows' plain step, and the two parts of those told apart once rows verify
    /// different numbers of drafts; steps that read prompts, and the first plain step at
    /// each batch size, change nothing.
    #[test]
    fn step_costs_learn_rows_drafts_and_verifying_rows() {
        let mut costs = StepCosts::default();
        assert!(costs.model().is_none());
        // The first plain step at a batch size (a GPU compiling its kernels) is not fitted.
        costs.observe(0.500, decode(4, 0, 0, 4));
        assert!(costs.model().is_none());
        costs.observe(0.010, decode(4, 0, 0, 4));
        let m = costs.model().expect("a model");
        assert!((m.plain_seconds(4) - 0.010).abs() < 1e-12);
        assert!(
            (m.per_draft - m.per_row).abs() < 1e-12,
            "untimed drafts cost a row"
        );
        let truth = model(0.004, 0.001, 0.0003, 0.002);
        let mut costs = StepCosts::default();
        for rows in [1, 5, 9, 13, 17].iter().cycle().take(300) {
            costs.observe(truth.plain_seconds(*rows), decode(*rows, 0, 0, *rows));
        }
        for (i, rows) in [1, 5, 9, 13, 17, 3, 7, 11]
            .iter()
            .cycle()
            .take(40)
            .enumerate()
        {
            costs.observe(truth.plain_seconds(*rows), decode(*rows, 0, 0, *rows));
            let (verifying, per_row) = (1 + i % 3, 1 + i % 4);
            let drafts = verifying * per_row;
            let seconds = truth.plain_seconds(*rows)
                + truth.per_verifying_row * verifying as f64
                + truth.per_draft * drafts as f64;
            costs.observe(
                seconds,
                decode(*rows, drafts, verifying, *rows + drafts / 2),
            );
        }
        let m = costs.model().expect("a model");
        for (got, want) in [
            (m.fixed, truth.fixed),
            (m.per_row, truth.per_row),
            (m.per_draft, truth.per_draft),
            (m.per_verifying_row, truth.per_verifying_row),
        ] {
            assert!((got - want).abs() < 1e-6, "{m:?} against {truth:?}");
        }
        for _ in 0..20 {
            costs.observe(1.5, StepFed::Untypical);
        }
        assert_eq!(costs.model(), Some(m));
    }

    /// Steps with drafts that commit slower than plain steps of their rows would stop
    /// drafts but for probes, ever fewer while they lose (one in about
    /// [`PROBE_EVERY_MOST`] steps), even where the plain steps that ran were at another
    /// load; once drafts pay, they come back.
    #[test]
    fn drafts_that_slow_the_batch_stop_but_for_probes() {
        let truth = model(0.008, 0.001, 0.002, 0.0);
        let mut costs = StepCosts::default();
        for rows in [2, 16] {
            costs.observe(truth.plain_seconds(rows), decode(rows, 0, 0, rows));
        }
        let mut drafted = Vec::new();
        let mut load = [2, 16].into_iter().cycle();
        for kept in [2, 6] {
            for _ in 0..200 {
                // Drafts at 2 rows (a light load), plain steps at 2 or 16: the plain
                // steps at 16 commit more per second whatever the drafts do, which must
                // not decide.
                let draft = costs.drafting() != Drafting::Off;
                match draft {
                    true => {
                        let seconds = truth.plain_seconds(2) + 8.0 * truth.per_draft;
                        costs.observe(seconds, decode(2, 8, 2, 2 + kept));
                    }
                    false => {
                        let rows = load.next().expect("endless");
                        costs.observe(truth.plain_seconds(rows), decode(rows, 0, 0, rows));
                    }
                }
                drafted.push(draft);
            }
            match kept {
                // 4 tokens in 26 ms against plain 2 rows' 2 in 10 ms: probes only, one
                // in 64 to 80 steps once they keep losing.
                2 => {
                    let late = drafted[drafted.len() - 128..]
                        .iter()
                        .filter(|&&d| d)
                        .count();
                    assert!((1..=2).contains(&late), "{late} of 128 steps drafted");
                }
                // 8 tokens in 26 ms: all but the plain probes, within a probe interval.
                _ => {
                    let late = drafted[drafted.len() - 64..].iter().filter(|&&d| d).count();
                    assert!(late >= 56, "{late} of 64 steps drafted");
                }
            }
        }
    }

    /// Lookup drafts that lose are still probed as often as at first (a probe costs only
    /// its positions), where a model drafter's probes back off.
    #[test]
    fn losing_lookup_drafts_keep_being_probed() {
        let truth = model(0.008, 0.001, 0.002, 0.0);
        type Fed = fn(usize, usize, usize, usize) -> StepFed;
        for (fed, probes) in [(looked_up as Fed, 4..=5), (decode as Fed, 1..=2)] {
            let mut costs = StepCosts::default();
            for _ in 0..2 {
                costs.observe(truth.plain_seconds(2), decode(2, 0, 0, 2));
            }
            let mut drafted = Vec::new();
            for _ in 0..256 {
                let draft = costs.drafting() != Drafting::Off;
                // Drafts commit 2 tokens in 26 ms against plain 2 rows' 2 in 10 ms.
                match draft {
                    true => {
                        let seconds = truth.plain_seconds(2) + 8.0 * truth.per_draft;
                        costs.observe(seconds, fed(2, 8, 2, 2));
                    }
                    false => costs.observe(truth.plain_seconds(2), decode(2, 0, 0, 2)),
                }
                drafted.push(draft);
            }
            let late = drafted[128..].iter().filter(|&&d| d).count();
            assert!(probes.contains(&late), "{late} of 128 steps drafted");
        }
    }

    /// One step with drafts far slower than any other (a GPU compiling kernels for a
    /// shape new to it) makes drafts look dear, so that no step is granted any; the
    /// probes still verify drafts, and once they have outweighed it drafts come back.
    #[test]
    fn one_slow_step_does_not_stop_drafts_for_good() {
        let truth = model(0.008, 0.0002, 0.0002, 0.001);
        let mut costs = StepCosts::default();
        for _ in 0..4 {
            costs.observe(truth.plain_seconds(1), decode(1, 0, 0, 1));
        }
        costs.observe(0.100, decode(1, 4, 1, 1));
        let offer = [Offer {
            available: 4,
            alpha: 0.8,
        }];
        let mut drafted = Vec::new();
        for _ in 0..400 {
            let model = costs.model().expect("a model");
            let k = match costs.drafting() {
                Drafting::Off => 0,
                Drafting::ByCost => allocate(&offer, 1, &model)[0],
                Drafting::Probe => allocate_probe(&offer, 1, &model)[0],
            };
            let seconds = truth.plain_seconds(1)
                + match k {
                    0 => 0.0,
                    k => truth.per_verifying_row + truth.per_draft * k as f64,
                };
            // The tokens k drafts kept 4 times in 5 commit on average, rounded.
            let kept: f64 = (1..=k).map(|j| 0.8f64.powi(j as i32)).sum();
            let committed = (1.0 + kept).round() as usize;
            costs.observe(seconds, decode(1, k, usize::from(k > 0), committed));
            drafted.push(k > 0);
        }
        let early = drafted[..64].iter().filter(|&&d| d).count();
        let late = drafted[drafted.len() - 64..].iter().filter(|&&d| d).count();
        assert!(early <= 8, "{early} of the first 64 steps drafted");
        assert!(late >= 56, "{late} of the last 64 steps drafted");
    }

    /// A probe verifies the drafts of the sequence that keeps them most often where the
    /// costs grant none, and grants what the costs grant otherwise.
    #[test]
    fn probes_verify_the_best_offer() {
        let offers = [
            Offer {
                available: 3,
                alpha: 0.2,
            },
            Offer {
                available: 5,
                alpha: 0.4,
            },
            Offer {
                available: 0,
                alpha: 0.9,
            },
        ];
        let dear = model(0.010, 0.001, 0.010, 0.0);
        assert_eq!(allocate(&offers, 3, &dear), vec![0, 0, 0]);
        assert_eq!(allocate_probe(&offers, 3, &dear), vec![0, 5, 0]);
        let cheap = model(0.010, 0.001, 0.0001, 0.0);
        assert_eq!(
            allocate_probe(&offers, 3, &cheap),
            allocate(&offers, 3, &cheap)
        );
    }
}
