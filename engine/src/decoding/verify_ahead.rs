//! Whether to queue the next round's verify before this round's is read.
//!
//! A verify is waited on at once: its result decides the next round. So the host builds
//! a round's graph while the device idles, and the device runs it while the host waits.
//! With a drafter whose proposals are lookups (free, and asked again at will), the engine
//! can guess that a round keeps every draft and queue the next round on that round's
//! still lazy last token before reading it:
//!
//! - when the round does keep every draft, the next one was built while the device ran
//!   this one, and where host and device work side by side (a GPU) a round costs about
//!   the slower of the two instead of their sum, as a plain step does;
//! - when it does not, the round queued ahead is thrown away, and whatever it cost that
//!   the real next round could not hide is lost: next to nothing where the host is the
//!   slower, most of a verify where the device is (a large model), all of it where host
//!   and device are the same cores (the CPU backend).
//!
//! None of these is known ahead, so they are measured as rounds go, as seconds from one
//! round's read to the next: `s(w)` for rounds of width `w` waited on with nothing queued
//! ahead, `a(w)` for rounds queued ahead that stood, and the waste, what a round read
//! after a failed guess took beyond `s`. A round queued ahead stands when the round before
//! it keeps every draft and a lookup that knows that round's last token drafts what it
//! did (else its drafts are stale and it goes too). With `p` the chance it stands,
//! queueing ahead pays when `p·(s(w) − a(w)) > (1 − p)·waste`. Until each is measured the choice goes the way
//! that measures it, and now and then it goes the other way so that neither goes stale.

use serde::Serialize;

use crate::decoding::draft_length::LineFit;

/// How much each older outcome weighs against the newest.
const DECAY: f64 = 0.9;
/// Every this many decisions, one goes against the measurements, to renew the costs of
/// the way not taken.
const EXPLORE_EVERY: usize = 32;

/// When rounds are queued ahead (`--verify-ahead`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum VerifyAheadMode {
    /// Each round is read before the next is queued.
    Off,
    /// While the measured costs say it pays (see the module docs).
    Measured,
    /// Whenever a lookup drafter drafts under greedy decoding: what it does does not
    /// depend on timings, so the ranks of a distributed group agree on it.
    Always,
}

/// How one round went, as [`VerifyAhead::observe_round`] weighs it.
#[derive(Debug, Clone, Copy)]
pub struct RoundTiming {
    /// Positions verified (the drafts and the token before them).
    pub width: usize,
    /// Seconds from the read of the round before (or from this round's start, when
    /// nothing was in flight) to this round's read, drafting excluded.
    pub seconds: f64,
    /// It was queued before the round before it was read.
    pub queued_ahead: bool,
    /// A round was queued after it before it was read.
    pub queued_next: bool,
    /// The round queued ahead in its place was thrown away (the guess failed).
    pub after_failed_guess: bool,
}

/// Decides round by round whether a verify is queued ahead (see the module docs).
#[derive(Debug, Clone, Default)]
pub struct VerifyAhead {
    /// Decayed counts of rounds, and of those after which a round queued ahead stood.
    rounds: f64,
    stood: f64,
    /// Seconds per round against its width: rounds waited on, and rounds queued ahead.
    waited: LineFit,
    ahead: LineFit,
    /// Decayed mean of what a round read after a failed guess took beyond `waited`.
    waste: Option<f64>,
    decisions: usize,
    /// Queue ahead whatever the measurements say ([`VerifyAheadMode::Always`]).
    always: bool,
}

impl VerifyAhead {
    pub fn new() -> Self {
        Self::default()
    }

    /// The policy of `mode`; `None` for [`VerifyAheadMode::Off`].
    pub fn for_mode(mode: VerifyAheadMode) -> Option<Self> {
        match mode {
            VerifyAheadMode::Off => None,
            VerifyAheadMode::Measured => Some(Self::new()),
            VerifyAheadMode::Always => Some(Self {
                always: true,
                ..Self::new()
            }),
        }
    }

    /// Whether to queue a round of `width` positions before the current round is read.
    pub fn should_queue(&mut self, width: usize) -> bool {
        if self.always {
            return true;
        }
        self.decisions += 1;
        let w = width as f64;
        let measured = match (
            self.waited.predict(w, false),
            self.ahead.predict(w, false),
            self.waste,
        ) {
            // A round waited on comes first: the rest is weighed against it.
            (None, _, _) => return false,
            (_, None, _) | (_, _, None) => return true,
            (Some(waited), Some(ahead), Some(waste)) => {
                // Laplace-smoothed chance that a round queued ahead stands.
                let p = (self.stood + 1.0) / (self.rounds + 2.0);
                p * (waited - ahead) > (1.0 - p) * waste.max(0.0)
            }
        };
        measured != self.decisions.is_multiple_of(EXPLORE_EVERY)
    }

    /// Whether a round queued ahead stood (or, with none queued, whether the round read
    /// kept every draft, which one queued after it needs).
    pub fn observe_outcome(&mut self, stood: bool) {
        self.rounds = self.rounds * DECAY + 1.0;
        self.stood = self.stood * DECAY + f64::from(u8::from(stood));
    }

    /// A round was read. Rounds that mix the cases (one queued ahead with nothing queued
    /// after it) say nothing clear and are left out.
    pub fn observe_round(&mut self, round: RoundTiming) {
        let w = round.width as f64;
        if round.after_failed_guess {
            if let Some(waited) = self.waited.predict(w, false) {
                let waste = round.seconds - waited;
                self.waste = Some(match self.waste {
                    Some(old) => old * DECAY + waste * (1.0 - DECAY),
                    None => waste,
                });
            }
            return;
        }
        match (round.queued_ahead, round.queued_next) {
            (false, false) => self.waited.observe(w, round.seconds),
            (true, true) => self.ahead.observe(w, round.seconds),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waited(policy: &mut VerifyAhead, seconds: f64) {
        policy.observe_round(RoundTiming {
            width: 5,
            seconds,
            queued_ahead: false,
            queued_next: false,
            after_failed_guess: false,
        });
    }

    fn ahead(policy: &mut VerifyAhead, seconds: f64) {
        policy.observe_round(RoundTiming {
            width: 5,
            seconds,
            queued_ahead: true,
            queued_next: true,
            after_failed_guess: false,
        });
    }

    fn after_failure(policy: &mut VerifyAhead, seconds: f64) {
        policy.observe_round(RoundTiming {
            width: 5,
            seconds,
            queued_ahead: false,
            queued_next: true,
            after_failed_guess: true,
        });
    }

    /// The decisions of `n` rounds, after each of which a round queued ahead stands or
    /// not as `stood` says.
    fn decide(policy: &mut VerifyAhead, n: usize, stood: impl Fn(usize) -> bool) -> usize {
        (0..n)
            .filter(|&i| {
                policy.observe_outcome(stood(i));
                policy.should_queue(5)
            })
            .count()
    }

    #[test]
    fn measures_a_round_waited_on_then_one_queued_ahead_and_a_failed_guess() {
        let mut policy = VerifyAhead::new();
        assert!(!policy.should_queue(5), "nothing to compare with yet");
        waited(&mut policy, 5e-3);
        assert!(policy.should_queue(5), "rounds queued ahead unmeasured");
        ahead(&mut policy, 3e-3);
        assert!(policy.should_queue(5), "a failed guess unmeasured");
        after_failure(&mut policy, 5e-3);
        assert!(policy.should_queue(5));
    }

    #[test]
    fn where_host_and_device_overlap_and_a_failed_guess_costs_nothing_it_always_queues() {
        // A GPU bound by the host: 5 ms waited on, 3 ms queued ahead, and a round after
        // a failed guess costs what one waited on does.
        let mut policy = VerifyAhead::new();
        waited(&mut policy, 5e-3);
        ahead(&mut policy, 3e-3);
        after_failure(&mut policy, 5e-3);
        let queued = decide(&mut policy, 64, |_| false);
        assert!(
            queued >= 62,
            "every round lost, and still {queued} of 64 queued"
        );
    }

    #[test]
    fn where_nothing_overlaps_it_queues_only_to_keep_measuring() {
        // The CPU: a round costs its work either way, and a failed guess costs a round.
        let mut policy = VerifyAhead::new();
        waited(&mut policy, 100e-3);
        ahead(&mut policy, 100e-3);
        after_failure(&mut policy, 200e-3);
        let queued = decide(&mut policy, 64, |i| i % 2 == 0);
        assert!(queued <= 2, "{queued} of 64 queued");
    }

    #[test]
    fn a_slower_device_queues_ahead_while_most_rounds_queued_ahead_stand() {
        // Host 4 ms, device 12 ms: 16 ms waited on, 12 ms queued ahead, and a failed
        // guess wastes 8 ms of the device's. 4 ms gained against 8 lost: queueing ahead
        // pays while more than 2 in 3 rounds queued ahead stand.
        let measured = || {
            let mut policy = VerifyAhead::new();
            waited(&mut policy, 16e-3);
            ahead(&mut policy, 12e-3);
            after_failure(&mut policy, 24e-3);
            policy
        };
        let all = decide(&mut measured(), 64, |_| true);
        assert!(all >= 60, "all standing: {all} of 64 queued");
        let most = decide(&mut measured(), 64, |i| i % 5 != 0);
        assert!(most >= 56, "4 in 5 standing: {most} of 64 queued");
        let half = decide(&mut measured(), 64, |i| i % 2 == 0);
        assert!(half <= 4, "1 in 2 standing: {half} of 64 queued");
    }

    #[test]
    fn rounds_that_mix_the_cases_are_not_measured() {
        let mut policy = VerifyAhead::new();
        policy.observe_round(RoundTiming {
            width: 5,
            seconds: 1.0,
            queued_ahead: false,
            queued_next: true,
            after_failed_guess: false,
        });
        policy.observe_round(RoundTiming {
            width: 5,
            seconds: 1.0,
            queued_ahead: true,
            queued_next: false,
            after_failed_guess: false,
        });
        assert!(!policy.should_queue(5), "still no round waited on measured");
        after_failure(&mut policy, 1.0);
        assert!(
            policy.waste.is_none(),
            "no waited round to measure it against"
        );
    }
}
