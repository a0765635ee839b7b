//! Whether to queue the next round's verify before this round's is read.
//!
//! A verify is waited on at once: its result decides the next round. So the host builds
//! a round's graph while the device idles, and the device runs it while the host waits.
//! With a drafter whose proposals are lookups (free, and asked again at will), the engine
//! can guess that a round keeps every draft and queue the next round on that round's
//! still lazy last token before reading it:
//!
//! - when the round keeps every draft, the next one was built while the device ran this
//!   one, and where host and device work side by side (a GPU) the round costs about the
//!   slower of the two instead of their sum, as a plain step does;
//! - when it does not, the round queued ahead is thrown away unread, and what the device
//!   spent on it beyond what the next round's host work hides is lost.
//!
//! A round without drafts keeps "every draft" by definition, so a round queued behind it
//! always stands (unless a lookup that knows its last token drafts otherwise, which
//! throws the queued round away before anything is spent on reading it). Rounds without
//! drafts are what a lookup drafter gives wherever the output does not repeat its input,
//! at a fixed `--max-draft`, and read one by one each costs a verify waited on instead of
//! a pipelined step. Behind rounds with drafts, queueing ahead saved host time in the
//! rounds that stood but lost more in those thrown away on an H100 at 1.5B
//! (docs/benchmarks.md, "Rounds queued ahead"), so `auto` queues only behind rounds
//! without drafts, and `always` behind every round. Under `--max-draft auto` the
//! draft-length controller already turns stretches without drafts into pipelined plain
//! steps, and reads a lookup that found nothing as evidence against drafting; queued
//! ahead, such rounds passed for plain steps and kept it drafting (0.89–0.92× plain on
//! the H100 against 1.02×), so there `auto` queues nothing.

use serde::Serialize;

/// When rounds are queued ahead (`--verify-ahead`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum VerifyAheadMode {
    /// Each round is read before the next is queued.
    Off,
    /// Behind rounds without drafts, where the round queued ahead always stands (the
    /// CLI's `auto` on a GPU; on the CPU it is `Off`).
    Auto,
    /// Behind every round, on the guess that it keeps every draft.
    Always,
}

impl VerifyAheadMode {
    /// The mode in force when the draft length is chosen per round (`adaptive`) or not.
    pub fn with_draft_length(self, adaptive: bool) -> Self {
        match (self, adaptive) {
            (VerifyAheadMode::Auto, true) => VerifyAheadMode::Off,
            (mode, _) => mode,
        }
    }

    /// Whether a round is queued behind one of `drafts` drafts before that one is read.
    pub fn queues_after(self, drafts: usize) -> bool {
        match self {
            VerifyAheadMode::Off => false,
            VerifyAheadMode::Auto => drafts == 0,
            VerifyAheadMode::Always => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_queues_only_behind_rounds_that_cannot_reject() {
        assert!(VerifyAheadMode::Auto.queues_after(0));
        assert!(!VerifyAheadMode::Auto.queues_after(1));
        assert!(VerifyAheadMode::Always.queues_after(5));
        assert!(!VerifyAheadMode::Off.queues_after(0));
    }

    #[test]
    fn auto_leaves_an_adaptive_draft_length_its_own_plain_steps() {
        let auto = VerifyAheadMode::Auto;
        assert_eq!(auto.with_draft_length(true), VerifyAheadMode::Off);
        assert_eq!(auto.with_draft_length(false), auto);
        let always = VerifyAheadMode::Always;
        assert_eq!(always.with_draft_length(true), always);
    }
}
