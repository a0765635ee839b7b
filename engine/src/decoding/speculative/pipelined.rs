//! Rounds scheduled so the device is not left waiting on the host: runs of plain steps,
//! and rounds of a lookup drafter queued ahead of the read of the round before.
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
//! rounds that stood but lost more in those thrown away on a GPU (docs/benchmarks.md,
//! "Rounds queued ahead", has the measurements), so `auto` queues only behind rounds
//! without drafts, and `always` behind every round. Under `--max-draft auto` the
//! draft-length controller already turns stretches without drafts into pipelined plain
//! steps, and reads a lookup that found nothing as evidence against drafting; queued
//! ahead, such rounds passed for plain steps and kept it drafting, slower than plain
//! decoding, so there `auto` queues nothing.

use std::time::Instant;

use mlx_rs::ops::concatenate;
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::transforms::async_eval;
use mlx_rs::Array;
use serde::Serialize;

use dspec_plugin_api::cache::WHOLE_BUFFER_MAX_TOKENS;

use crate::decoding::sampling::{argmax_ids, host_ids, pick_next, token_value, EnginePicker};
use crate::decoding::session::StopReason;
use crate::decoding::speculative::acceptance::{greedy_prefix, Accepted};
use crate::decoding::speculative::round::{ReadRound, Rounds};
use crate::decoding::speculative::stats::HostTime;
use crate::error::EngineError;

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

/// A plain decoding step in flight: its token (`[1, 1]`, lazy) and the target's hidden
/// states at the position it fed, when the drafter taps them.
struct PlainStep {
    token: Array,
    hidden: Option<Array>,
    /// The step's logits (`[1, vocab]`), kept when log-probabilities are reported.
    logits: Option<Array>,
    /// Where the host's time went building and queueing it.
    host: HostTime,
    /// Whether the step before it was still in flight when it was queued.
    queued_ahead: bool,
}

/// A greedy verify queued and not read yet (rounds of a lookup drafter).
struct QueuedVerify {
    /// The token it feeds first; `None` while that is the still lazy last token of the
    /// round before it.
    first: Option<u32>,
    drafts: Vec<u32>,
    /// The target's argmax at every position fed (`[1 + drafts]`, uint32, lazy).
    argmax: Array,
    /// `[1 + drafts, vocab]`, kept when log-probabilities are reported.
    logits: Option<Array>,
    hidden: Option<Array>,
    /// Seconds spent proposing its drafts.
    draft_seconds: f64,
    /// Whether it was queued before the round before it was read.
    queued_ahead: bool,
    host: HostTime,
}

impl QueuedVerify {
    fn width(&self) -> usize {
        1 + self.drafts.len()
    }
}

/// A lookup drafter's proposal past the tokens committed: the drafts of the round it is
/// for, then its guess of that round's last token (the target's own), then drafts for
/// the round after.
struct Proposal {
    tokens: Vec<u32>,
    seconds: f64,
}

impl Rounds<'_, '_, '_> {
    /// Asks a lookup drafter for `max_k` tokens to follow `last`.
    fn propose_lookup(&mut self, last: u32, max_k: usize) -> Result<Proposal, EngineError> {
        let t = Instant::now();
        let draft =
            self.drafter
                .propose(self.model, last, max_k, &mut EnginePicker { sampler: None })?;
        let seconds = t.elapsed();
        self.tally.draft_time += seconds;
        let mut tokens = draft.tokens;
        tokens.truncate(max_k);
        Ok(Proposal {
            tokens,
            seconds: seconds.as_secs_f64(),
        })
    }

    /// Builds and queues the greedy verify of `[first, drafts]`, `first` a `[1, 1]`
    /// token, known or lazy.
    fn queue_verify(
        &mut self,
        first: (&Array, Option<u32>),
        drafts: &[u32],
        draft_seconds: f64,
        queued_ahead: bool,
    ) -> Result<QueuedVerify, EngineError> {
        let ((out, logits, argmax), host) = HostTime::measure(
            || -> Result<_, EngineError> {
                let input = match drafts.len() {
                    0 => first.0.clone(),
                    n => concatenate(&[first.0, &Array::from_slice(drafts, &[1, n as i32])], 1)?,
                };
                let out = self.model.forward(&input, &mut self.cache, &self.taps)?;
                let logits = out.logits.try_index(0)?;
                let argmax = argmax_ids(&logits)?;
                Ok((out, logits, argmax))
            },
            |(out, _, argmax)| {
                Ok(async_eval(
                    std::iter::once(argmax).chain(out.hidden.iter()),
                )?)
            },
        )?;
        Ok(QueuedVerify {
            first: first.1,
            drafts: drafts.to_vec(),
            argmax,
            logits: self.logprobs.is_some().then_some(logits),
            hidden: out.hidden,
            draft_seconds,
            queued_ahead,
            host,
        })
    }

    /// Greedy rounds of a lookup drafter, each queued before the one before it is read
    /// where [`VerifyAheadMode::queues_after`] says so. The drafter is asked for the
    /// tokens past the round being verified, its guess of that round's last token
    /// included, and the next round feeds that round's still lazy last token followed
    /// by the drafts after the guess. It stands if the round keeps every draft (wrong
    /// drafts after a wrong guess are only rejected, so the output stays plain greedy's);
    /// otherwise it is trimmed from the cache, unread. Starts with a round of `k` drafts
    /// and returns when a round was read with none queued after it, or generation ended.
    pub(super) fn lookup_rounds(&mut self, k: usize) -> Result<Option<StopReason>, EngineError> {
        let mut since = Instant::now();
        let max_draft = self.length.max();
        let mut proposal = self.propose_lookup(self.last, k + 1 + max_draft)?;
        let drafts: Vec<u32> = proposal.tokens.iter().take(k).copied().collect();
        self.length.observe_offered(k, drafts.len());
        let first = Array::from_slice(&[self.last], &[1, 1]);
        let mut current =
            self.queue_verify((&first, Some(self.last)), &drafts, proposal.seconds, false)?;
        // What the proposal holds past the current round: the guess of its last token,
        // then drafts for the round after it.
        let mut beyond: Vec<u32> = proposal
            .tokens
            .split_off(drafts.len().min(proposal.tokens.len()));
        if drafts.len() < k {
            // The lookup ran out inside this round: nothing to guess past it.
            beyond.clear();
        }
        loop {
            // The round after the current one, on the guess that the current one keeps
            // every draft; as many drafts as the controller would ask for then.
            let room_after = self.committer.room().saturating_sub(current.width());
            let mut ahead = None;
            let queue = self
                .ahead
                .is_some_and(|mode| mode.queues_after(current.drafts.len()));
            let next_k = match (queue, room_after) {
                (false, _) | (_, 0) => 0,
                (true, room) => self.length.next(room - 1),
            };
            if next_k > 0 {
                let drafts: Vec<u32> = beyond.iter().skip(1).take(next_k).copied().collect();
                let last = current
                    .argmax
                    .try_index(current.drafts.len() as i32..current.width() as i32)?
                    .reshape(&[1, 1])?;
                ahead = Some(self.queue_verify((&last, None), &drafts, 0.0, true)?);
            }

            // Read the current round.
            let target = host_ids(&current.argmax)?;
            let Accepted {
                drafts: accepted,
                token: next,
            } = greedy_prefix(&target, &current.drafts)?;
            let round_seconds = (since.elapsed().as_secs_f64() - current.draft_seconds).max(0.0);
            since = Instant::now();
            let whole = accepted == current.drafts.len();
            let first = current.first.ok_or_else(|| {
                EngineError::Mlx("a verify was read before the round it follows".into())
            })?;
            match (&ahead, whole) {
                (Some(queued), false) => {
                    // Queued on a guess that did not hold: gone unread.
                    self.cache
                        .trim(current.drafts.len() - accepted + queued.width())?;
                    ahead = None;
                }
                _ => self.cache.trim(current.drafts.len() - accepted)?,
            }
            match (current.drafts.len(), current.queued_ahead) {
                (0, true) => self.length.observe(0, 0, 0.0, round_seconds),
                (0, false) => self.length.observe_empty(round_seconds),
                (drafted, _) => {
                    self.length
                        .observe(drafted, accepted, current.draft_seconds, round_seconds);
                    self.tally.time_round(
                        current.draft_seconds,
                        round_seconds,
                        current.draft_seconds + round_seconds,
                    );
                }
            }
            let stop = self.finish_round(ReadRound {
                first,
                drafts: &current.drafts,
                accepted,
                next,
                logits: current.logits.as_ref(),
                hidden: current.hidden.as_ref(),
                draft_ms: current.draft_seconds * 1e3,
                verify_ms: round_seconds * 1e3,
                queued_ahead: current.queued_ahead,
                host: Some(current.host),
            })?;
            if let Some(stop) = stop {
                if let Some(queued) = ahead {
                    // Queued past the end: let it finish, so nothing is in flight when
                    // generation returns, and forget it.
                    queued.argmax.eval()?;
                    self.cache.trim(queued.width())?;
                }
                return Ok(Some(stop));
            }
            let Some(mut queued) = ahead else {
                return Ok(None);
            };
            // The round queued ahead is valid. Its drafts were looked up before this
            // round's last token was known: where a lookup knowing it drafts otherwise
            // (the guess failed, or the output left the text it copied), the queued
            // drafts are stale and mostly lost, so it goes unread and a round with the
            // new drafts takes its place. Otherwise the new lookup holds the drafts for
            // the round after it.
            proposal = self.propose_lookup(next, queued.drafts.len() + 1 + max_draft)?;
            let Some(rest) = proposal.tokens.strip_prefix(queued.drafts.as_slice()) else {
                self.cache.trim(queued.width())?;
                return Ok(None);
            };
            beyond = rest.to_vec();
            queued.first = Some(next);
            queued.draft_seconds += proposal.seconds;
            current = queued;
        }
    }

    /// Builds and queues the plain step that feeds `token` (possibly still lazy).
    /// `queued_ahead`: the step before it is still in flight.
    fn queue_plain(&mut self, token: &Array, queued_ahead: bool) -> Result<PlainStep, EngineError> {
        let ((out, logits, token), host) = HostTime::measure(
            || -> Result<_, EngineError> {
                let out = self.model.forward(token, &mut self.cache, &self.taps)?;
                let logits = out.logits.try_index((.., -1, ..))?;
                let token = pick_next(self.sampler.as_mut(), &logits)?;
                Ok((out, logits, token))
            },
            |(out, _, token)| Ok(async_eval(std::iter::once(token).chain(out.hidden.iter()))?),
        )?;
        Ok(PlainStep {
            host,
            queued_ahead,
            token,
            hidden: out.hidden,
            logits: self.logprobs.is_some().then_some(logits),
        })
    }

    /// Rounds without drafts, run as plain decoding for as long as the controller
    /// chooses none: two steps in flight (the next step's graph is built on the still
    /// lazy token, as [`crate::decoding::generate::generate`] does), one token read per
    /// step, and the drafter asked for no drafts once. It hears of the positions the run
    /// fed in `commit`s of [`COMMIT_EVERY`], which it may read while the run goes on, or
    /// of [`Drafter::plain_piece`](dspec_plugin_api::Drafter::plain_piece) when it asks
    /// for fewer (a lookup per token, then), the last one at the run's end. Each step is
    /// a round to the controller, timed from token to token, so rounds without drafts are
    /// measured at plain decoding's pipelined speed and its probes keep coming. Returns
    /// the stop reason when generation ends, else the draft length chosen for the next
    /// round.
    pub(super) fn plain_run(&mut self) -> Result<(Option<StopReason>, Option<usize>), EngineError> {
        let t = Instant::now();
        self.drafter.propose(
            self.model,
            self.last,
            0,
            &mut EnginePicker {
                sampler: self.sampler.as_mut(),
            },
        )?;
        self.tally.draft_time += t.elapsed();
        let piece = self
            .drafter
            .plain_piece()
            .map_or(COMMIT_EVERY, |p| p.clamp(1, COMMIT_EVERY));
        let mut fed = vec![self.last];
        let mut hidden = Vec::new();
        let mut current = self.queue_plain(&Array::from_slice(&[self.last], &[1, 1]), false)?;
        let mut since = Instant::now();
        let outcome = loop {
            // Chosen before this step is read or observed (the price of keeping two
            // steps in flight): the round after it, when there is room for one.
            let room_after = self.committer.room() - 1;
            let next_k = (room_after > 0).then(|| self.length.next(room_after - 1));
            let queued = match next_k {
                Some(0) => Some(self.queue_plain(&current.token, true)?),
                _ => None,
            };
            let token = token_value(&current.token)?;
            let seconds = since.elapsed().as_secs_f64();
            since = Instant::now();
            self.length.observe(0, 0, 0.0, seconds);
            if current.queued_ahead {
                self.tally.plain_step_seconds.push(seconds);
            }
            hidden.extend(current.hidden.take());
            let stop = self.record(&ReadRound {
                first: self.last,
                drafts: &[],
                accepted: 0,
                next: token,
                logits: current.logits.as_ref(),
                // Told to the drafter a piece at a time below, not round by round.
                hidden: None,
                draft_ms: 0.0,
                verify_ms: seconds * 1e3,
                queued_ahead: current.queued_ahead,
                host: Some(current.host),
            })?;
            match (stop, queued) {
                (Some(stop), queued) => {
                    // A step queued past the end: let it finish, so nothing is in
                    // flight when generation returns.
                    if let Some(step) = queued {
                        step.token.eval()?;
                    }
                    break (Some(stop), None);
                }
                (None, Some(step)) => {
                    // `fed` and `hidden` cover the same positions here: the token just
                    // read is fed by the step now in flight.
                    if fed.len() >= piece {
                        let hidden = concat_steps(std::mem::take(&mut hidden))?;
                        self.keep_hidden(hidden.as_ref());
                        self.drafter
                            .commit(&std::mem::take(&mut fed), hidden.as_ref())?;
                        self.hear_agreement();
                    }
                    fed.push(token);
                    current = step;
                }
                (None, None) => break (None, next_k),
            }
        };
        let hidden = concat_steps(hidden)?;
        self.keep_hidden(hidden.as_ref());
        self.drafter.commit(&fed, hidden.as_ref())?;
        self.hear_agreement();
        Ok(outcome)
    }
}

/// Positions of a run of plain steps told to the drafter at once: often enough for a
/// drafter to keep up in the background (a draft model reads them on its thread), few
/// enough commits that telling costs nothing per step.
const COMMIT_EVERY: usize = WHOLE_BUFFER_MAX_TOKENS as usize;

/// The hidden states of consecutive plain steps as one `[1, n, ..]` array.
fn concat_steps(mut hidden: Vec<Array>) -> Result<Option<Array>, EngineError> {
    Ok(match hidden.len() {
        0 => None,
        1 => hidden.pop(),
        _ => Some(concatenate(&hidden, 1)?),
    })
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
