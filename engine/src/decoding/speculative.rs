//! Speculative decoding: the drafter proposes k tokens, the target verifies
//! `[last, d1..dk]` in one forward, a prefix of the drafts is kept plus one token of
//! the target's own, and the cache is trimmed of the rest.
//!
//! Greedy: the kept prefix is the one matching the target's argmax, so the output is
//! token for token plain greedy decoding's. Sampling: each draft d is kept with
//! probability min(1, p(d)/q(d)) and the first rejection is replaced by a sample from
//! max(0, p − q) renormalised (p: the target's processed distribution, q: the
//! drafter's, one-hot for drafters without one), so the output has exactly the
//! target's distribution. Acceptance runs on the device ([`crate::decoding::acceptance`]): a
//! round reads back only the kept count and the target's token.

use std::io::Write;
use std::time::{Duration, Instant};

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::ops::{concatenate, softmax_axis};
use mlx_rs::transforms::async_eval;
use mlx_rs::{Array, Dtype};
use serde::Serialize;

use dspec_adapters::attention::{reserve_for_generation, WHOLE_BUFFER_MAX_TOKENS};
use dspec_plugin_api::error::Result as ModelResult;
use dspec_plugin_api::{Drafter, ModelCache, ModelError, Picked, TargetModel, TokenPicker};

use crate::decoding::acceptance::{
    accept_greedy, accept_sampled, argmax_all, argmax_ids, greedy_prefix, host_ids, Accepted,
};
use crate::decoding::draft_length::DraftLength;
use crate::decoding::generate::{
    pick_next, prefill_with_taps, token_value, GenerationConfig, GenerationStats, StopReason,
    TextSink,
};
use crate::decoding::logprobs::{token_logprobs, TokenLogprob};
use crate::decoding::prompt_cache::PromptCache;
use crate::decoding::round_cost::{median, RoundCost, RoundTime};
use crate::decoding::sampling::Sampler;
use crate::decoding::verify_ahead::VerifyAheadMode;
use crate::error::EngineError;
use crate::text::tokenizer::TextTokenizer;

/// How well drafting went.
#[derive(Debug, Clone, Serialize)]
pub struct SpeculativeStats {
    pub drafter: String,
    /// Verify forwards of the target (prefill excluded).
    pub target_forwards: usize,
    pub drafted_tokens: usize,
    pub accepted_tokens: usize,
    /// Tokens committed per verify forward (accepted drafts + the target's own token).
    pub tau: f64,
    /// `acceptance_histogram[a]`: rounds in which exactly `a` drafts were accepted.
    pub acceptance_histogram: Vec<usize>,
    /// `draft_histogram[k]`: rounds that drafted `k` tokens; `[0]` counts the rounds
    /// without drafts, run as plain decoding steps (`--max-draft auto` when drafts do
    /// not pay, and a last token with no room for drafts).
    pub draft_histogram: Vec<usize>,
    /// Share of decode time the engine spent waiting on the drafter (a draft model
    /// drafting ahead on its own thread works while the target verifies: that part is
    /// not counted).
    pub draft_time_share: f64,
    /// What the rounds that drafted cost (medians), in plain steps where this generation
    /// timed plain steps of its own (rounds without drafts, queued as plain decoding
    /// queues them); `None` when no round drafted.
    pub round_cost: Option<RoundCost>,
    /// Every round that drafted, in order, for callers that pool rounds over runs.
    #[serde(skip)]
    pub round_times: Vec<RoundTime>,
}

#[derive(Debug, Clone, Serialize)]
pub struct SpeculativeOutput {
    pub text: String,
    pub tokens: Vec<u32>,
    /// When asked for ([`ServingOptions::logprobs`]): one entry per generated token but
    /// an ending EOS.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<Vec<TokenLogprob>>,
    pub stats: GenerationStats,
    pub speculative: SpeculativeStats,
}

/// The engine's [`TokenPicker`]: argmax on the device under greedy decoding, else a
/// draw from the same processed distribution the target is sampled from, whose rows
/// stay on the device as the drafter's q.
struct EnginePicker<'a> {
    sampler: Option<&'a mut Sampler>,
}

impl TokenPicker for EnginePicker<'_> {
    fn is_greedy(&self) -> bool {
        self.sampler.is_none()
    }

    fn pick(&mut self, logits: &Array) -> ModelResult<Picked> {
        let to_model = |e: EngineError| ModelError::Unsupported(e.to_string());
        let vocab = logits.shape().last().copied().unwrap_or(0);
        let rows = logits.reshape(&[-1, vocab])?;
        match self.sampler.as_deref_mut() {
            None => Ok(Picked {
                tokens: argmax_all(&rows).map_err(to_model)?,
                probs: None,
            }),
            Some(sampler) => {
                let processed = sampler.process(&rows).map_err(to_model)?;
                let tokens = sampler.draw(&processed).map_err(to_model)?;
                tokens.eval()?;
                Ok(Picked {
                    tokens: tokens
                        .try_as_slice::<u32>()
                        .map_err(|e| ModelError::Unsupported(e.to_string()))?
                        .to_vec(),
                    probs: Some(softmax_axis(&processed, -1, true)?),
                })
            }
        }
    }

    fn pick_on_device(&mut self, logits: &Array) -> ModelResult<Option<Array>> {
        if self.sampler.is_some() {
            return Ok(None);
        }
        let vocab = logits.shape().last().copied().unwrap_or(0);
        let rows = logits.reshape(&[-1, vocab])?;
        let to_model = |e: EngineError| ModelError::Unsupported(e.to_string());
        argmax_ids(&rows).map(Some).map_err(to_model)
    }
}

/// One line of `--trace`: what a round drafted and what the target kept.
#[derive(Debug, Clone, Serialize)]
pub struct RoundTrace {
    pub round: usize,
    /// Tokens committed before this round.
    pub position: usize,
    pub drafted: Vec<u32>,
    pub accepted: usize,
    /// The target's own token after the accepted drafts.
    pub target_token: u32,
    pub draft_ms: f64,
    /// Seconds from the round's queueing, or from the read of the round before when it
    /// was queued ahead of that read, to its own read (its drafting excluded).
    pub verify_ms: f64,
    /// Whether the round was queued before the round before it was read (plain steps
    /// after the first of a run are; lookup rounds under [`Speculation::verify_ahead`]).
    pub queued_ahead: bool,
    /// Seconds the host spent building the round's forward and queueing it on the
    /// device, where that is apart from waiting for it (not in rounds whose drafts come
    /// with probabilities or from a model).
    pub host_ms: Option<f64>,
    /// Of `host_ms`, the part spent building the graph; the rest is MLX queueing it,
    /// which blocks while the device is too far behind.
    pub build_ms: Option<f64>,
}

/// What drives a speculative generation besides the target.
pub struct Speculation<'a> {
    pub drafter: &'a mut dyn Drafter,
    /// Most drafts verified per round.
    pub max_draft: usize,
    /// Draft fewer than `max_draft` in a round when the measured acceptance and costs
    /// say fewer pay better (`--max-draft auto`; see [`DraftLength`]).
    pub adaptive: bool,
    /// Receives one JSON line per round when set.
    pub trace: Option<&'a mut dyn Write>,
    /// Under greedy decoding with a drafter that drafts by lookup
    /// ([`Drafter::drafts_by_lookup`]) and a target whose cache rolls back freely (no
    /// recurrent layers): when to queue each round's successor before reading it, on the
    /// guess that it keeps every draft (see [`crate::decoding::verify_ahead`]).
    pub verify_ahead: VerifyAheadMode,
}

/// What a long-lived caller (a server) adds to a generation.
#[derive(Default)]
pub struct ServingOptions<'a> {
    /// Asked once per round, after the round's tokens are committed, unless they ended
    /// the generation: true ends it there, with [`StopReason::Cancelled`] (a server's
    /// client went away). Where it is asked depends only on the tokens, so the ranks of
    /// a group ask at the same rounds and may answer with a collective.
    pub cancelled: Option<&'a CancelCheck<'a>>,
    /// Caches of earlier sequences: the prompt's longest cached prefix is not read
    /// again, and the finished sequence's cache is stored for the next request.
    pub prompt_cache: Option<&'a mut PromptCache>,
    /// Report each generated token's log-probability and its position's `n` likeliest
    /// tokens (see [`crate::decoding::logprobs`]); costs a read from the device per round.
    pub logprobs: Option<usize>,
    /// Receives the log-probabilities of each round's committed tokens, after the
    /// round's text went to `on_text`.
    pub on_logprobs: Option<&'a mut LogprobsCallback<'a>>,
}

/// Whether to stop; an error (a collective that failed) fails the generation.
pub type CancelCheck<'a> = dyn Fn() -> Result<bool, EngineError> + 'a;

/// Receives one round's log-probabilities.
pub type LogprobsCallback<'a> = dyn FnMut(&[TokenLogprob]) + 'a;

/// Collects log-probabilities round by round, as far as tokens are committed.
struct LogprobSink<'l> {
    top: usize,
    all: Vec<TokenLogprob>,
    on_round: Option<&'l mut LogprobsCallback<'l>>,
}

impl LogprobSink<'_> {
    /// Keeps the entries of the tokens committed (an EOS that ended generation is no
    /// text and gets none).
    fn keep(&mut self, mut entries: Vec<TokenLogprob>, committed: usize, stop: Option<StopReason>) {
        entries.truncate(committed);
        if stop == Some(StopReason::Eos) {
            entries.pop();
        }
        if let Some(on_round) = self.on_round.as_deref_mut() {
            if !entries.is_empty() {
                on_round(&entries);
            }
        }
        self.all.extend(entries);
    }
}

/// Commits tokens one at a time, stopping exactly where plain decoding would.
struct Committer<'a> {
    sink: TextSink<'a>,
    tokens: Vec<u32>,
    config: &'a GenerationConfig,
    context_left: usize,
    /// Asked once per round (see [`ServingOptions::cancelled`]).
    cancelled: &'a CancelCheck<'a>,
}

impl Committer<'_> {
    /// Returns the stop reason when `token` ends generation.
    fn push(&mut self, token: u32) -> Result<Option<StopReason>, EngineError> {
        self.tokens.push(token);
        if self.config.eos_ids.contains(&token) {
            return Ok(Some(StopReason::Eos));
        }
        if self.sink.push(token)? {
            return Ok(Some(StopReason::StopString));
        }
        if self.tokens.len() >= self.config.max_tokens {
            return Ok(Some(StopReason::MaxTokens));
        }
        if self.tokens.len() >= self.context_left {
            return Ok(Some(StopReason::ContextLength));
        }
        Ok(None)
    }

    /// Ends a round whose tokens stopped the generation or not (`stop`): one that goes
    /// on asks whether it is cancelled.
    fn end_round(&self, stop: Option<StopReason>) -> Result<Option<StopReason>, EngineError> {
        if stop.is_some() {
            return Ok(stop);
        }
        Ok((self.cancelled)()?.then_some(StopReason::Cancelled))
    }
}

/// Counts of what the rounds did, for [`SpeculativeStats`].
struct Tally {
    forwards: usize,
    drafted: usize,
    accepted: usize,
    /// Rounds by drafts accepted.
    accepted_histogram: Vec<usize>,
    /// Rounds by tokens drafted (`[0]`: rounds run as plain decoding steps).
    drafted_histogram: Vec<usize>,
    draft_time: Duration,
    round_times: Vec<RoundTime>,
    /// Seconds of each plain step run with the step before it still in flight, as plain
    /// decoding runs every step: what a round's cost is set against.
    plain_step_seconds: Vec<f64>,
}

impl Tally {
    fn new(max_draft: usize) -> Self {
        Self {
            forwards: 0,
            drafted: 0,
            accepted: 0,
            accepted_histogram: vec![0; max_draft + 1],
            drafted_histogram: vec![0; max_draft + 1],
            draft_time: Duration::ZERO,
            round_times: Vec::new(),
            plain_step_seconds: Vec::new(),
        }
    }

    fn round(&mut self, drafted: usize, accepted: usize) {
        self.forwards += 1;
        self.drafted += drafted;
        self.accepted += accepted;
        self.accepted_histogram[accepted] += 1;
        self.drafted_histogram[drafted] += 1;
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

/// The state of a speculative generation between rounds.
struct Rounds<'a, 't, 'l> {
    model: &'a dyn TargetModel,
    cache: ModelCache,
    taps: Vec<usize>,
    drafter: &'a mut dyn Drafter,
    sampler: Option<Sampler>,
    length: DraftLength,
    committer: Committer<'a>,
    trace: Option<&'t mut dyn Write>,
    tally: Tally,
    /// The newest committed token, not yet fed to the target.
    last: u32,
    /// The target's states at the taps over every position fed, when a prompt cache
    /// stores them for the next request's drafter.
    kept_hidden: Option<Vec<Array>>,
    logprobs: Option<LogprobSink<'l>>,
    /// Set when rounds may be queued ahead (see [`Speculation::verify_ahead`]).
    ahead: Option<VerifyAheadMode>,
}

/// A round whose verify was read, as [`Rounds::finish_round`] ends it.
struct ReadRound<'r> {
    /// The token it fed before its drafts.
    first: u32,
    drafts: &'r [u32],
    accepted: usize,
    /// The target's own token after the accepted drafts.
    next: u32,
    /// The verify's logits, `[1 + drafts, vocab]` (for log-probabilities).
    logits: Option<&'r Array>,
    /// The target's states at every position fed, when the drafter taps them.
    hidden: Option<&'r Array>,
    draft_ms: f64,
    verify_ms: f64,
    queued_ahead: bool,
    host: Option<HostTime>,
}

/// Seconds the host spent on a forward it queued: building its graph, then handing it
/// to MLX (`async_eval`).
#[derive(Clone, Copy)]
struct HostTime {
    build: f64,
    queue: f64,
}

impl HostTime {
    /// `(host_ms, build_ms)` as a trace reports them.
    fn trace_ms(host: Option<HostTime>) -> (Option<f64>, Option<f64>) {
        (
            host.map(|h| (h.build + h.queue) * 1e3),
            host.map(|h| h.build * 1e3),
        )
    }

    /// Times `build` (returning what to queue), then `queue` on its result.
    fn measure<T, E>(
        build: impl FnOnce() -> Result<T, E>,
        queue: impl FnOnce(&T) -> Result<(), E>,
    ) -> Result<(T, HostTime), E> {
        let t = Instant::now();
        let built = build()?;
        let b = t.elapsed().as_secs_f64();
        queue(&built)?;
        let time = HostTime {
            build: b,
            queue: t.elapsed().as_secs_f64() - b,
        };
        Ok((built, time))
    }
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
    /// Tokens that may still be committed (at least 1 while generation goes on).
    fn room(&self) -> usize {
        let done = self.committer.tokens.len();
        (self.committer.config.max_tokens - done).min(self.committer.context_left - done)
    }

    /// Drafts to ask for next: `planned` (chosen ahead by a plain run) or the
    /// controller's choice, never past what may still be committed.
    fn draft_length(&self, planned: Option<usize>) -> usize {
        let limit = self.room().saturating_sub(1);
        planned.map_or_else(|| self.length.next(limit), |k| k.min(limit))
    }

    fn write_trace(&mut self, line: RoundTrace) -> Result<(), EngineError> {
        if let Some(out) = self.trace.as_deref_mut() {
            serde_json::to_writer(&mut *out, &line)
                .map_err(|e| EngineError::Invalid(format!("writing --trace: {e}")))?;
            writeln!(out).map_err(|e| EngineError::Invalid(format!("writing --trace: {e}")))?;
        }
        Ok(())
    }

    /// One round of `k ≥ 1` drafts: propose, verify `[last, drafts]` in one forward,
    /// accept, trim, tell the drafter. Returns the stop reason when generation ends.
    fn draft_round(&mut self, k: usize) -> Result<Option<StopReason>, EngineError> {
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
                self.length
                    .observe(drafted, accepted, draft_elapsed.as_secs_f64(), since_verify);
                self.tally.round_times.push(RoundTime {
                    draft: draft_elapsed.as_secs_f64(),
                    verify: verify_elapsed.as_secs_f64(),
                    whole: draft_elapsed.as_secs_f64() + since_verify,
                });
            }
        }
        Ok(stop)
    }

    /// Ends a round whose verify was read: the drafter hears of the positions kept (with
    /// the target's states there), the trace and the tally record the round, and the
    /// kept drafts and the target's own token are committed one by one, stopping
    /// exactly where plain decoding would. Returns the stop reason when generation ends.
    fn finish_round(&mut self, round: ReadRound<'_>) -> Result<Option<StopReason>, EngineError> {
        let ReadRound {
            first,
            drafts,
            accepted,
            next,
            logits,
            hidden,
            draft_ms,
            verify_ms,
            queued_ahead,
            host,
        } = round;
        let (host_ms, build_ms) = HostTime::trace_ms(host);
        let hidden = match hidden {
            Some(h) => Some(h.try_index((.., ..(1 + accepted) as i32, ..))?),
            None => None,
        };
        self.keep_hidden(hidden.as_ref());
        let mut fed = Vec::with_capacity(1 + accepted);
        fed.push(first);
        fed.extend_from_slice(&drafts[..accepted]);
        self.drafter.commit(&fed, hidden.as_ref())?;
        self.write_trace(RoundTrace {
            round: self.tally.forwards,
            position: self.committer.tokens.len(),
            drafted: drafts.to_vec(),
            accepted,
            target_token: next,
            draft_ms,
            verify_ms,
            queued_ahead,
            host_ms,
            build_ms,
        })?;
        self.tally.round(drafts.len(), accepted);

        self.last = next;
        let kept: Vec<u32> = drafts[..accepted].iter().chain([&next]).copied().collect();
        let entries = match (&self.logprobs, logits) {
            (Some(sink), Some(logits)) => Some(token_logprobs(logits, &kept, sink.top)?),
            _ => None,
        };
        let mut stop = None;
        let mut committed = 0;
        for &token in &kept {
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
    fn lookup_rounds(&mut self, k: usize) -> Result<Option<StopReason>, EngineError> {
        let mut since = Instant::now();
        let max_draft = self.length.max();
        let mut proposal = self.propose_lookup(self.last, k + 1 + max_draft)?;
        let drafts: Vec<u32> = proposal.tokens.iter().take(k).copied().collect();
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
            let room_after = self.room().saturating_sub(current.width());
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
                    self.tally.round_times.push(RoundTime {
                        draft: current.draft_seconds,
                        verify: round_seconds,
                        whole: current.draft_seconds + round_seconds,
                    });
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
    /// lazy token, as [`crate::decoding::generate::generate`] does), one token read per step, and
    /// the drafter asked for no drafts once. It hears of the positions the run fed in
    /// `commit`s of [`COMMIT_EVERY`], which it may read while the run goes on, or of
    /// [`Drafter::plain_piece`] when it asks for fewer (a lookup per token, then), the last
    /// one at the run's end. Each step is a round to
    /// the controller, timed from token to token, so rounds without drafts are measured
    /// at plain decoding's pipelined speed and its probes keep coming. Returns the stop
    /// reason when generation ends, else the draft length chosen for the next round.
    fn plain_run(&mut self) -> Result<(Option<StopReason>, Option<usize>), EngineError> {
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
            let room_after = self.room() - 1;
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
            let (host_ms, build_ms) = HostTime::trace_ms(Some(current.host));
            self.write_trace(RoundTrace {
                round: self.tally.forwards,
                position: self.committer.tokens.len(),
                drafted: Vec::new(),
                accepted: 0,
                target_token: token,
                draft_ms: 0.0,
                verify_ms: seconds * 1e3,
                queued_ahead: current.queued_ahead,
                host_ms,
                build_ms,
            })?;
            self.tally.round(0, 0);
            hidden.extend(current.hidden.take());
            self.last = token;
            let entries = match (&self.logprobs, &current.logits) {
                (Some(sink), Some(logits)) => Some(token_logprobs(logits, &[token], sink.top)?),
                _ => None,
            };
            let stop = self.committer.push(token)?;
            if let (Some(sink), Some(entries)) = (self.logprobs.as_mut(), entries) {
                sink.keep(entries, 1, stop);
            }
            let stop = self.committer.end_round(stop)?;
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

    /// What the drafter found of its own guesses on plain steps' tokens so far: the
    /// acceptance the controller weighs drafting by, measured without drafting.
    fn hear_agreement(&mut self) {
        if let Some(a) = self.drafter.agreement() {
            self.length.observe_agreement(a.agreed, a.checked);
        }
    }

    /// Keeps the states told to the drafter when a prompt cache wants them.
    fn keep_hidden(&mut self, hidden: Option<&Array>) {
        if let (Some(kept), Some(h)) = (self.kept_hidden.as_mut(), hidden) {
            kept.push(h.clone());
        }
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

/// Speculative generation: greedy or sampled as `config.sampling` says, lossless
/// either way. Rounds for which the draft-length controller chooses no drafts run as
/// plain decoding (see [`Rounds::plain_run`]), so `--max-draft auto` with drafts that
/// do not pay decodes at plain decoding's speed.
pub fn generate_speculative(
    model: &dyn TargetModel,
    tokenizer: &TextTokenizer,
    prompt: &[u32],
    config: &GenerationConfig,
    speculation: Speculation<'_>,
    on_text: &mut dyn FnMut(&str),
) -> Result<SpeculativeOutput, EngineError> {
    generate_speculative_serving(
        model,
        tokenizer,
        prompt,
        config,
        speculation,
        on_text,
        ServingOptions::default(),
    )
}

/// [`generate_speculative`] with what a server adds: cancellation and a prompt cache
/// across requests (see [`ServingOptions`]).
pub fn generate_speculative_serving(
    model: &dyn TargetModel,
    tokenizer: &TextTokenizer,
    prompt: &[u32],
    config: &GenerationConfig,
    speculation: Speculation<'_>,
    on_text: &mut dyn FnMut(&str),
    options: ServingOptions<'_>,
) -> Result<SpeculativeOutput, EngineError> {
    let Speculation {
        drafter,
        max_draft,
        adaptive,
        trace,
        verify_ahead,
    } = speculation;
    let never = || Ok(false);
    let cancelled: &CancelCheck = options.cancelled.unwrap_or(&never);
    let mut prompt_cache = options.prompt_cache;
    if max_draft == 0 {
        return Err(EngineError::Invalid(
            "--max-draft must be at least 1".into(),
        ));
    }
    let mut sampler = (!config.sampling.is_greedy()).then(|| Sampler::new(config.sampling.clone()));
    let context_limit = model.info().max_context.unwrap_or(usize::MAX);
    if prompt.len() >= context_limit {
        return Err(EngineError::PromptTooLong {
            prompt: prompt.len(),
            limit: context_limit,
        });
    }
    let taps = drafter.taps().to_vec();
    let mut committer = Committer {
        sink: TextSink::new(tokenizer, &config.stop_strings, on_text),
        tokens: Vec::new(),
        config,
        context_left: context_limit - prompt.len(),
        cancelled,
    };
    // A prefix read by an earlier request comes with its cache (and, for a drafter that
    // reads the target's states, those states): only the rest of the prompt is read.
    let reused = match prompt_cache.as_deref_mut() {
        Some(store) => store.take(prompt, !taps.is_empty()),
        None => None,
    };
    let (mut cache, cached_prompt, cached_hidden) = match reused {
        Some(r) => (r.cache, r.reused, r.hidden),
        None => (model.new_cache(), 0, None),
    };
    reserve_for_generation(
        &mut cache,
        (prompt.len() + config.max_tokens).min(context_limit),
    );
    // A round forgets the drafts the target rejects: a cache with recurrent state keeps
    // the states to return to for that many positions, and a cache that keeps a fixed
    // window (a plugin's) bounds the drafts a round may make.
    cache.set_rollback_window(max_draft);
    let max_draft = match cache.rollback_window() {
        Some(0) => {
            return Err(EngineError::Invalid(
                "the target's cache cannot roll back a single position, which speculative \
                 decoding needs; decode without a drafter"
                    .into(),
            ))
        }
        Some(window) => max_draft.min(window),
        None => max_draft,
    };

    let start = Instant::now();
    // The drafter reads the prompt too (a draft model prefills its own cache): that is
    // prompt processing, timed with the target's, as mlx-lm times its draft model's. A
    // drafter that needs none of the target's hidden states starts first, so a draft
    // model on its own thread reads the prompt while the target does.
    if taps.is_empty() {
        drafter.begin(model, prompt, None)?;
    }
    let (logits, read_hidden) =
        prefill_with_taps(model, &mut cache, &prompt[cached_prompt..], &taps)?;
    let prompt_hidden = match (cached_hidden, read_hidden) {
        (Some(cached), Some(read)) => Some(concatenate(&[cached, read], 1)?),
        (cached, read) => read.or(cached),
    };
    let last = token_value(&pick_next(sampler.as_mut(), &logits)?)?;
    if !taps.is_empty() {
        drafter.begin(model, prompt, prompt_hidden.as_ref())?;
    }
    let prefill_seconds = start.elapsed().as_secs_f64();
    let decode_start = Instant::now();

    let mut logprobs = options.logprobs.map(|top| LogprobSink {
        top,
        all: Vec::new(),
        on_round: options.on_logprobs,
    });
    let first_entries = match &logprobs {
        Some(sink) => Some(token_logprobs(&logits, &[last], sink.top)?),
        None => None,
    };
    let mut stop = committer.push(last)?;
    if let (Some(sink), Some(entries)) = (logprobs.as_mut(), first_entries) {
        sink.keep(entries, 1, stop);
    }
    stop = committer.end_round(stop)?;
    let kept_hidden = match (&prompt_cache, &prompt_hidden) {
        (Some(_), Some(h)) => Some(vec![h.clone()]),
        _ => None,
    };
    let mut length = DraftLength::new(max_draft, adaptive);
    if drafter.agreement().is_some() {
        length.set_agreement_measured();
    }
    // Rounds queued ahead are trimmed unread when their guess fails: two rounds' worth
    // of positions to roll back, which only attention caches can always do.
    let ahead = match sampler.is_none()
        && drafter.drafts_by_lookup()
        && cache.rollback_window().is_none()
    {
        true => Some(verify_ahead.with_draft_length(adaptive))
            .filter(|mode| *mode != VerifyAheadMode::Off),
        false => None,
    };
    let mut rounds = Rounds {
        model,
        cache,
        taps,
        drafter,
        sampler,
        length,
        committer,
        trace,
        tally: Tally::new(max_draft),
        last,
        kept_hidden,
        logprobs,
        ahead,
    };
    let mut planned = None;
    while stop.is_none() {
        match rounds.draft_length(planned.take()) {
            0 => (stop, planned) = rounds.plain_run()?,
            k if rounds.ahead.is_some() => stop = rounds.lookup_rounds(k)?,
            k => stop = rounds.draft_round(k)?,
        }
    }
    let Rounds {
        drafter,
        mut committer,
        tally,
        cache,
        kept_hidden,
        logprobs,
        ..
    } = rounds;
    if let Some(store) = prompt_cache {
        store_sequence(store, prompt, &committer.tokens, cache, kept_hidden)?;
    }
    let stop_reason = stop.unwrap_or(StopReason::MaxTokens);
    committer
        .sink
        .finish(stop_reason == StopReason::StopString)?;
    let decode_seconds = decode_start.elapsed().as_secs_f64();
    let stats = GenerationStats::new(
        prompt.len(),
        committer.tokens.len(),
        prefill_seconds,
        decode_seconds,
        stop_reason,
    )
    .with_cached_prompt(cached_prompt);
    let speculative = SpeculativeStats {
        drafter: drafter.name().to_string(),
        target_forwards: tally.forwards,
        drafted_tokens: tally.drafted,
        accepted_tokens: tally.accepted,
        tau: (tally.accepted + tally.forwards) as f64 / tally.forwards.max(1) as f64,
        acceptance_histogram: tally.accepted_histogram,
        draft_histogram: tally.drafted_histogram,
        draft_time_share: tally.draft_time.as_secs_f64() / decode_seconds.max(1e-9),
        round_cost: RoundCost::of(&tally.round_times)
            .map(|cost| cost.against(median(&tally.plain_step_seconds).map(|s| s * 1e3))),
        round_times: tally.round_times,
    };
    Ok(SpeculativeOutput {
        text: committer.sink.text,
        tokens: committer.tokens,
        logprobs: logprobs.map(|sink| sink.all),
        stats,
        speculative,
    })
}

/// Puts a finished generation's cache in the prompt cache, with the tokens it holds: the
/// prompt and the generated tokens fed so far (the newest one is not, unless a plain
/// step already queued it). A generation that stopped inside an accepted block (an EOS
/// or the token limit among the drafts) fed drafts past its last token: they go.
fn store_sequence(
    store: &mut PromptCache,
    prompt: &[u32],
    generated: &[u32],
    mut cache: ModelCache,
    kept_hidden: Option<Vec<Array>>,
) -> Result<(), EngineError> {
    let held = cache.checked_offset()?;
    let sequence = prompt.len() + generated.len();
    if held > sequence && cache.trim(held - sequence).is_err() {
        return Ok(());
    }
    let tokens: Vec<u32> = prompt.iter().chain(generated).take(held).copied().collect();
    let hidden = match kept_hidden {
        Some(pieces) if !pieces.is_empty() => {
            let hidden = concatenate(&pieces, 1)?;
            // Evaluated now, so the store holds one array, not the graph of its pieces.
            hidden.eval()?;
            Some(hidden)
        }
        _ => None,
    };
    store.put(tokens, cache, hidden);
    Ok(())
}
