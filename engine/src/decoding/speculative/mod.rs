//! Speculative decoding: the drafter proposes k tokens, the target verifies
//! `[last, d1..dk]` in one forward, a prefix of the drafts is kept plus one token of
//! the target's own, and the cache is trimmed of the rest. A round is in [`round`]
//! (read it first); runs of plain steps and rounds queued ahead in [`pipelined`]; what a
//! generation reports in [`stats`]. This file starts a generation and picks each
//! round's schedule.
//!
//! Greedy: the kept prefix is the one matching the target's argmax, so the output is
//! token for token plain greedy decoding's. Sampling: each draft d is kept with
//! probability min(1, p(d)/q(d)) and the first rejection is replaced by a sample from
//! max(0, p − q) renormalised (p: the target's processed distribution, q: the
//! drafter's, one-hot for drafters without one), so the output has exactly the
//! target's distribution. Acceptance runs on the device ([`acceptance`]): a round reads
//! back only the kept count and the target's token.

pub mod acceptance;
pub mod pipelined;
mod round;
pub mod stats;

use std::io::Write;
use std::time::Instant;

use mlx_rs::ops::concatenate;
use mlx_rs::Array;
use serde::Serialize;

use dspec_plugin_api::{Drafter, ModelCache, TargetModel};

use crate::decoding::draft_length::DraftLength;
use crate::decoding::logprobs::TokenLogprob;
use crate::decoding::prompt_cache::PromptCache;
use crate::decoding::sampling::{pick_next, token_value, Sampler};
use crate::decoding::session::{
    context_limit, prefill_with_taps, Committer, GenerationConfig, GenerationStats, StopReason,
    TextSink,
};
use crate::error::EngineError;
use crate::text::tokenizer::TextTokenizer;

pub use crate::decoding::session::CancelCheck;
pub use pipelined::VerifyAheadMode;
use round::Rounds;
use stats::{LogprobSink, Tally};
pub use stats::{RoundTrace, SpeculativeStats};

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
    /// guess that it keeps every draft (see [`pipelined`]).
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

/// Receives one round's log-probabilities.
pub type LogprobsCallback<'a> = dyn FnMut(&[TokenLogprob]) + 'a;

/// Speculative generation: greedy or sampled as `config.sampling` says, lossless
/// either way, with what a long-lived caller adds in `options` (cancellation, a prompt
/// cache across requests, log-probabilities; `ServingOptions::default()` for none).
/// Rounds for which the draft-length controller chooses no drafts run as plain decoding
/// (see [`pipelined`]), so `--max-draft auto` with drafts that do not pay decodes at
/// plain decoding's speed.
pub fn generate_speculative(
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
    let mut sampler = Sampler::unless_greedy(&config.sampling);
    let context_limit = context_limit(model, prompt)?;
    let taps = drafter.taps().to_vec();
    let committer = Committer {
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
    cache.reserve_for_generation((prompt.len() + config.max_tokens).min(context_limit));
    // A round forgets the drafts the target rejects: a cache with recurrent state keeps
    // the states to return to for that many positions, and a cache that keeps a fixed
    // window (a plugin's) bounds the drafts a round may make.
    // A drafter that never drafts (`none`) leaves every round a plain step.
    let max_draft = if drafter.drafts() { max_draft } else { 0 };
    cache.set_rollback_window(max_draft);
    let max_draft = match cache.rollback_window() {
        Some(0) if max_draft > 0 => {
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

    let logprobs = options.logprobs.map(|top| LogprobSink {
        top,
        all: Vec::new(),
        on_round: options.on_logprobs,
    });
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
    // The first token is prefill's: committed as a round's are, but no round of its own.
    let mut stop = rounds.commit(&[last], Some(&logits))?;
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
    Ok(SpeculativeOutput {
        text: committer.sink.into_text(),
        tokens: committer.tokens,
        logprobs: logprobs.map(|sink| sink.all),
        stats,
        speculative: tally.into_stats(drafter.name(), decode_seconds),
    })
}

/// Puts a finished generation's cache in the prompt cache, with the tokens it holds: the
/// prompt and the generated tokens fed so far (the newest one is not, unless a plain
/// step already queued it). A generation that stopped inside an accepted block (an EOS
/// or the token limit among the drafts) fed drafts past its last token: they go.
pub(crate) fn store_sequence(
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
