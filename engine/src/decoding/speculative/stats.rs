//! What a speculative generation reports: its stats, the counts they come from, the
//! `--trace` line of each round, and the log-probabilities of the tokens it committed.

use std::io::Write;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::decoding::logprobs::TokenLogprob;
use crate::decoding::round_cost::{median, RoundCost, RoundTime};
use crate::decoding::session::StopReason;
use crate::decoding::speculative::LogprobsCallback;
use crate::error::EngineError;

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
    /// after the first of a run are; lookup rounds under
    /// [`Speculation::verify_ahead`](super::Speculation::verify_ahead)).
    pub queued_ahead: bool,
    /// Seconds the host spent building the round's forward and queueing it on the
    /// device, where that is apart from waiting for it (not in rounds whose drafts come
    /// with probabilities or from a model).
    pub host_ms: Option<f64>,
    /// Of `host_ms`, the part spent building the graph; the rest is MLX queueing it,
    /// which blocks while the device is too far behind.
    pub build_ms: Option<f64>,
}

/// Writes one `--trace` line.
pub(super) fn write_trace(out: &mut dyn Write, line: &RoundTrace) -> Result<(), EngineError> {
    let failed = |e: &dyn std::fmt::Display| EngineError::Invalid(format!("writing --trace: {e}"));
    serde_json::to_writer(&mut *out, line).map_err(|e| failed(&e))?;
    writeln!(out).map_err(|e| failed(&e))
}

/// Counts of what the rounds did, for [`SpeculativeStats`].
pub(crate) struct Tally {
    pub(super) forwards: usize,
    pub(super) drafted: usize,
    pub(super) accepted: usize,
    /// Rounds by drafts accepted.
    pub(super) accepted_histogram: Vec<usize>,
    /// Rounds by tokens drafted (`[0]`: rounds run as plain decoding steps).
    pub(super) drafted_histogram: Vec<usize>,
    pub(super) draft_time: Duration,
    pub(super) round_times: Vec<RoundTime>,
    /// Seconds of each plain step run with the step before it still in flight, as plain
    /// decoding runs every step: what a round's cost is set against.
    pub(super) plain_step_seconds: Vec<f64>,
}

impl Tally {
    pub(crate) fn new(max_draft: usize) -> Self {
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

    pub(crate) fn round(&mut self, drafted: usize, accepted: usize) {
        self.forwards += 1;
        self.drafted += drafted;
        self.accepted += accepted;
        self.accepted_histogram[accepted] += 1;
        self.drafted_histogram[drafted] += 1;
    }

    /// Times a round that drafted, for [`SpeculativeStats::round_cost`].
    pub(super) fn time_round(&mut self, draft: f64, verify: f64, whole: f64) {
        self.round_times.push(RoundTime {
            draft,
            verify,
            whole,
        });
    }

    /// The stats of a generation whose rounds this counted, over `decode_seconds`.
    pub(crate) fn into_stats(self, drafter: &str, decode_seconds: f64) -> SpeculativeStats {
        SpeculativeStats {
            drafter: drafter.to_string(),
            target_forwards: self.forwards,
            drafted_tokens: self.drafted,
            accepted_tokens: self.accepted,
            tau: (self.accepted + self.forwards) as f64 / self.forwards.max(1) as f64,
            acceptance_histogram: self.accepted_histogram,
            draft_histogram: self.drafted_histogram,
            draft_time_share: self.draft_time.as_secs_f64() / decode_seconds.max(1e-9),
            round_cost: RoundCost::of(&self.round_times)
                .map(|cost| cost.against(median(&self.plain_step_seconds).map(|s| s * 1e3))),
            round_times: self.round_times,
        }
    }
}

/// Collects log-probabilities round by round, as far as tokens are committed.
pub(super) struct LogprobSink<'l> {
    pub(super) top: usize,
    pub(super) all: Vec<TokenLogprob>,
    pub(super) on_round: Option<&'l mut LogprobsCallback<'l>>,
}

impl LogprobSink<'_> {
    /// Keeps the entries of the tokens committed (an EOS that ended generation is no
    /// text and gets none).
    pub(super) fn keep(
        &mut self,
        mut entries: Vec<TokenLogprob>,
        committed: usize,
        stop: Option<StopReason>,
    ) {
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

/// Seconds the host spent on a forward it queued: building its graph, then handing it
/// to MLX (`async_eval`).
#[derive(Clone, Copy)]
pub(super) struct HostTime {
    build: f64,
    queue: f64,
}

impl HostTime {
    /// `(host_ms, build_ms)` as a trace reports them.
    pub(super) fn trace_ms(host: Option<HostTime>) -> (Option<f64>, Option<f64>) {
        (
            host.map(|h| (h.build + h.queue) * 1e3),
            host.map(|h| h.build * 1e3),
        )
    }

    /// Times `build` (returning what to queue), then `queue` on its result.
    pub(super) fn measure<T, E>(
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
