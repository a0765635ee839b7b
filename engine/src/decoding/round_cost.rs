//! What a speculative round costs, in the unit that decides whether drafting pays: plain
//! decoding steps of the same process. A round that commits τ tokens (kept drafts plus
//! the target's own) and costs C plain steps decodes τ / C times as fast as plain
//! decoding, so C is the break-even τ.

use serde::Serialize;

/// One round's times in seconds, as the engine measured them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RoundTime {
    /// Waiting on the drafter for this round's drafts.
    pub draft: f64,
    /// The verify: building the target's forward, running it and reading the result.
    pub verify: f64,
    /// The whole round, from asking for drafts to the next round: drafting, verify,
    /// acceptance and the commit (the drafter's bookkeeping included).
    pub whole: f64,
}

/// Medians over the rounds that drafted, in milliseconds and, where plain steps were
/// timed in the same process, in plain steps.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RoundCost {
    /// Rounds the medians are over.
    pub rounds: usize,
    pub draft_ms: f64,
    pub verify_ms: f64,
    pub whole_ms: f64,
    /// The plain step the costs are measured against; absent when none was timed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub plain_step_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub in_plain_steps: Option<CostInSteps>,
}

/// A round's cost in plain decoding steps.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct CostInSteps {
    pub draft: f64,
    pub verify: f64,
    pub whole: f64,
    /// Tokens a round must commit to run as fast as plain decoding: the whole round's
    /// cost in steps. A measured τ above it is a speedup, below it a slowdown.
    pub break_even_tau: f64,
}

impl RoundCost {
    /// The medians of `rounds`; `None` when there are none.
    pub fn of(rounds: &[RoundTime]) -> Option<Self> {
        let ms = |part: fn(&RoundTime) -> f64| {
            median(&rounds.iter().map(part).collect::<Vec<_>>()).map(|s| s * 1e3)
        };
        Some(Self {
            rounds: rounds.len(),
            draft_ms: ms(|r| r.draft)?,
            verify_ms: ms(|r| r.verify)?,
            whole_ms: ms(|r| r.whole)?,
            plain_step_ms: None,
            in_plain_steps: None,
        })
    }

    /// The same costs against a plain step of `plain_step_ms` (ignored unless positive).
    pub fn against(mut self, plain_step_ms: Option<f64>) -> Self {
        let step = plain_step_ms.filter(|s| *s > 0.0 && s.is_finite());
        self.plain_step_ms = step;
        self.in_plain_steps = step.map(|step| CostInSteps {
            draft: self.draft_ms / step,
            verify: self.verify_ms / step,
            whole: self.whole_ms / step,
            break_even_tau: self.whole_ms / step,
        });
        self
    }

    /// One line for people: the costs, and whether the measured `tau` pays for them.
    pub fn describe(&self, tau: f64) -> String {
        let ms = format!(
            "drafting {:.2} ms, verify {:.2} ms, whole {:.2} ms",
            self.draft_ms, self.verify_ms, self.whole_ms
        );
        match (&self.in_plain_steps, self.plain_step_ms) {
            (Some(steps), Some(step)) => {
                let verdict = if tau > steps.break_even_tau {
                    "drafting pays"
                } else {
                    "drafting does not pay"
                };
                format!(
                    "round cost (medians of {} rounds that drafted): drafting {:.2}, verify \
                     {:.2}, whole {:.2} plain steps of {step:.2} ms ({ms}); break-even tau \
                     {:.2}, measured {tau:.2}: {verdict}",
                    self.rounds, steps.draft, steps.verify, steps.whole, steps.break_even_tau,
                )
            }
            _ => format!(
                "round cost (medians of {} rounds that drafted): {ms}; no plain step was \
                 timed in this run to set it against (`dspec bench` times one)",
                self.rounds
            ),
        }
    }
}

/// The median of `values` (of an even count, the mean of the middle two); `None` when
/// empty.
pub fn median(values: &[f64]) -> Option<f64> {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(sorted[n / 2]),
        _ => Some((sorted[n / 2 - 1] + sorted[n / 2]) / 2.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round(draft: f64, verify: f64, whole: f64) -> RoundTime {
        RoundTime {
            draft,
            verify,
            whole,
        }
    }

    #[test]
    fn medians_are_taken_part_by_part() {
        let cost = RoundCost::of(&[
            round(0.001, 0.010, 0.012),
            round(0.003, 0.006, 0.020),
            round(0.002, 0.008, 0.011),
        ])
        .unwrap();
        assert_eq!(cost.rounds, 3);
        assert!((cost.draft_ms - 2.0).abs() < 1e-9);
        assert!((cost.verify_ms - 8.0).abs() < 1e-9);
        assert!((cost.whole_ms - 12.0).abs() < 1e-9);
        assert_eq!(cost.in_plain_steps, None);
        assert_eq!(RoundCost::of(&[]), None);
    }

    #[test]
    fn the_break_even_tau_is_the_whole_round_in_plain_steps() {
        let cost = RoundCost::of(&[round(0.002, 0.006, 0.010)])
            .unwrap()
            .against(Some(4.0));
        let steps = cost.in_plain_steps.unwrap();
        assert!((steps.draft - 0.5).abs() < 1e-9);
        assert!((steps.verify - 1.5).abs() < 1e-9);
        assert!((steps.whole - 2.5).abs() < 1e-9);
        assert_eq!(steps.break_even_tau, steps.whole);
        assert!(cost.describe(3.0).ends_with("drafting pays"));
        assert!(cost.describe(2.0).ends_with("drafting does not pay"));
        // No plain step timed, or a nonsense one: no steps claimed.
        for step in [None, Some(0.0), Some(f64::NAN)] {
            let cost = RoundCost::of(&[round(0.002, 0.006, 0.010)])
                .unwrap()
                .against(step);
            assert_eq!((cost.plain_step_ms, cost.in_plain_steps), (None, None));
        }
    }

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(&[]), None);
    }
}
