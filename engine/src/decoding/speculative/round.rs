//! A speculative round, the core of the loop: the drafter proposes, the target verifies
//! `[last, drafts]` in one forward, a prefix of the drafts is accepted with the target's
//! own token after it, the cache forgets the rest, and the kept tokens are committed.
//! How rounds are scheduled besides one at a time is in [`super::pipelined`].

use std::io::Write;
use std::time::Instant;

use mlx_rs::ops::concatenate;
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{Array, Dtype};

use dspec_plugin_api::{Drafter, ModelCache, TargetModel};

use crate::decoding::draft_length::DraftLength;
use crate::decoding::logprobs::token_logprobs;
use crate::decoding::sampling::{EnginePicker, Sampler};
use crate::decoding::session::{Committer, StopReason};
use crate::decoding::speculative::acceptance::{accept_greedy, accept_sampled, Accepted};
use crate::decoding::speculative::stats::{write_trace, HostTime, LogprobSink, RoundTrace, Tally};
use crate::decoding::speculative::VerifyAheadMode;
use crate::error::EngineError;

impl Rounds<'_, '_, '_> {
    /// One round of `k ≥ 1` drafts: propose, verify `[last, drafts]` in one forward,
    /// accept, trim, tell the drafter. Returns the stop reason when generation ends.
    pub(super) fn draft_round(&mut self, k: usize) -> Result<Option<StopReason>, EngineError> {
        let t = Instant::now();
        let mut draft = self.drafter.propose(
            self.model,
            self.last,
            k,
            &mut EnginePicker {
                sampler: self.sampler.as_mut(),
            },
        )?;
        let draft_elapsed = t.elapsed();
        self.tally.draft_time += draft_elapsed;
        draft.truncate(k)?;
        self.length.observe_offered(k, draft.len());

        let t = Instant::now();
        let input = match &draft.on_device {
            // Built on the drafts still in flight: the device drafts while the host builds
            // this forward, and one read below brings back both.
            Some(ids) => {
                let last = Array::from_slice(&[self.last], &[1]);
                concatenate(&[last, ids.as_dtype(Dtype::Uint32)?], 0)?.reshape(&[1, -1])?
            }
            None => {
                let mut input = Vec::with_capacity(1 + draft.tokens.len());
                input.push(self.last);
                input.extend_from_slice(&draft.tokens);
                Array::from_slice(&input, &[1, input.len() as i32])
            }
        };
        let out = self.model.forward(&input, &mut self.cache, &self.taps)?;
        let logits = out.logits.try_index(0)?;
        let Accepted {
            drafts: accepted,
            token: next,
        } = match self.sampler.as_mut() {
            None => accept_greedy(&logits, &mut draft)?,
            Some(s) => {
                draft.read()?;
                accept_sampled(&logits, &draft.tokens, draft.probs.as_ref(), s)?
            }
        };
        let verify_elapsed = t.elapsed();
        self.cache.trim(draft.tokens.len() - accepted)?;
        let stop = self.finish_round(ReadRound {
            first: self.last,
            drafts: &draft.tokens,
            accepted,
            next,
            logits: Some(&logits),
            hidden: out.hidden.as_ref(),
            draft_ms: draft_elapsed.as_secs_f64() * 1e3,
            verify_ms: verify_elapsed.as_secs_f64() * 1e3,
            queued_ahead: false,
            host: None,
        })?;
        // The controller weighs whole rounds: from the verify to the next round, the
        // drafter's and the text's bookkeeping included, as a plain step is timed from
        // token to token.
        let since_verify = t.elapsed().as_secs_f64();
        match draft.tokens.len() {
            0 => self.length.observe_empty(since_verify),
            drafted => {
                let draft = draft_elapsed.as_secs_f64();
                self.length.observe(drafted, accepted, draft, since_verify);
                self.tally
                    .time_round(draft, verify_elapsed.as_secs_f64(), draft + since_verify);
            }
        }
        Ok(stop)
    }

    /// Ends a round whose verify was read: the drafter hears of the positions kept (with
    /// the target's states there), then the round is recorded and its tokens committed
    /// ([`Rounds::record`]). Returns the stop reason when generation ends.
    pub(super) fn finish_round(
        &mut self,
        round: ReadRound<'_>,
    ) -> Result<Option<StopReason>, EngineError> {
        let hidden = match round.hidden {
            Some(h) => Some(h.try_index((.., ..(1 + round.accepted) as i32, ..))?),
            None => None,
        };
        self.keep_hidden(hidden.as_ref());
        let mut fed = Vec::with_capacity(1 + round.accepted);
        fed.push(round.first);
        fed.extend_from_slice(&round.drafts[..round.accepted]);
        self.drafter.commit(&fed, hidden.as_ref())?;
        self.record(&round)
    }

    /// A round's bookkeeping, the same whatever scheduled it (a round of drafts, a round
    /// queued ahead, a plain step): the trace and the tally record it, and the kept drafts
    /// and the target's own token are committed ([`Rounds::commit`]). Returns the stop
    /// reason when generation ends.
    pub(super) fn record(
        &mut self,
        round: &ReadRound<'_>,
    ) -> Result<Option<StopReason>, EngineError> {
        let (host_ms, build_ms) = HostTime::trace_ms(round.host);
        if let Some(out) = self.trace.as_deref_mut() {
            write_trace(
                out,
                &RoundTrace {
                    round: self.tally.forwards,
                    position: self.committer.tokens.len(),
                    drafted: round.drafts.to_vec(),
                    accepted: round.accepted,
                    target_token: round.next,
                    draft_ms: round.draft_ms,
                    verify_ms: round.verify_ms,
                    queued_ahead: round.queued_ahead,
                    host_ms,
                    build_ms,
                },
            )?;
        }
        self.tally.round(round.drafts.len(), round.accepted);
        self.last = round.next;
        let kept: Vec<u32> = round.drafts[..round.accepted]
            .iter()
            .chain([&round.next])
            .copied()
            .collect();
        self.commit(&kept, round.logits)
    }

    /// Commits `tokens` one by one, stopping exactly where plain decoding would, with
    /// their log-probabilities from `logits` (one row per token) when those are reported;
    /// then asks whether generation goes on. Returns the stop reason when it ends.
    pub(super) fn commit(
        &mut self,
        tokens: &[u32],
        logits: Option<&Array>,
    ) -> Result<Option<StopReason>, EngineError> {
        let entries = match (&self.logprobs, logits) {
            (Some(sink), Some(logits)) => Some(token_logprobs(logits, tokens, sink.top)?),
            _ => None,
        };
        let mut stop = None;
        let mut committed = 0;
        for &token in tokens {
            committed += 1;
            stop = self.committer.push(token)?;
            if stop.is_some() {
                break;
            }
        }
        if let (Some(sink), Some(entries)) = (self.logprobs.as_mut(), entries) {
            sink.keep(entries, committed, stop);
        }
        self.committer.end_round(stop)
    }

    /// Drafts to ask for next: `planned` (chosen ahead by a plain run) or the
    /// controller's choice, never past what may still be committed.
    pub(super) fn draft_length(&self, planned: Option<usize>) -> usize {
        let limit = self.committer.room().saturating_sub(1);
        planned.map_or_else(|| self.length.next(limit), |k| k.min(limit))
    }

    /// What the drafter found of its own guesses on plain steps' tokens so far: the
    /// acceptance the controller weighs drafting by, measured without drafting.
    pub(super) fn hear_agreement(&mut self) {
        if let Some(a) = self.drafter.agreement() {
            self.length.observe_agreement(a.agreed, a.checked);
        }
    }

    /// Keeps the states told to the drafter when a prompt cache wants them.
    pub(super) fn keep_hidden(&mut self, hidden: Option<&Array>) {
        if let (Some(kept), Some(h)) = (self.kept_hidden.as_mut(), hidden) {
            kept.push(h.clone());
        }
    }
}

/// The state of a speculative generation between rounds.
pub(super) struct Rounds<'a, 't, 'l> {
    pub(super) model: &'a dyn TargetModel,
    pub(super) cache: ModelCache,
    pub(super) taps: Vec<usize>,
    pub(super) drafter: &'a mut dyn Drafter,
    pub(super) sampler: Option<Sampler>,
    pub(super) length: DraftLength,
    pub(super) committer: Committer<'a>,
    pub(super) trace: Option<&'t mut dyn Write>,
    pub(super) tally: Tally,
    /// The newest committed token, not yet fed to the target.
    pub(super) last: u32,
    /// The target's states at the taps over every position fed, when a prompt cache
    /// stores them for the next request's drafter.
    pub(super) kept_hidden: Option<Vec<Array>>,
    pub(super) logprobs: Option<LogprobSink<'l>>,
    /// Set when rounds may be queued ahead (see [`super::Speculation::verify_ahead`]).
    pub(super) ahead: Option<VerifyAheadMode>,
}

/// A round whose verify was read, as [`Rounds::record`] books it.
pub(super) struct ReadRound<'r> {
    /// The token it fed before its drafts.
    pub(super) first: u32,
    pub(super) drafts: &'r [u32],
    pub(super) accepted: usize,
    /// The target's own token after the accepted drafts.
    pub(super) next: u32,
    /// The verify's logits, `[1 + drafts, vocab]` (for log-probabilities).
    pub(super) logits: Option<&'r Array>,
    /// The target's states at every position fed, when the drafter taps them.
    pub(super) hidden: Option<&'r Array>,
    pub(super) draft_ms: f64,
    pub(super) verify_ms: f64,
    pub(super) queued_ahead: bool,
    pub(super) host: Option<HostTime>,
}
