//! One sequence of a batch: its prompt and cache, how its tokens are chosen, what it
//! has committed so far, and its numbers.

use std::time::Instant;

use mlx_rs::ops::concatenate;
use mlx_rs::Array;

use dspec_plugin_api::{Draft, Drafter, KvPool, ModelCache, TargetModel, LONGEST_POOLED};
use dspec_runtime::slicing::slice_axis;

use crate::decoding::logprobs::{token_logprobs, TokenLogprob};
use crate::decoding::prompt_cache::Reused;
use crate::decoding::sampling::{EnginePicker, Sampler};
use crate::decoding::session::{
    context_limit, GenerationConfig, GenerationStats, StopReason, TextStream,
};
use crate::decoding::speculative::stats::Tally;
use crate::decoding::speculative::SpeculativeStats;
use crate::error::EngineError;
use crate::text::tokenizer::TextTokenizer;

/// A sequence's handle in its batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SequenceId(pub u64);

/// What a caller asks a batch to generate.
pub struct NewSequence {
    pub prompt: Vec<u32>,
    pub config: GenerationConfig,
    /// This sequence's own drafter (one per sequence: a drafter holds its sequence's
    /// state), begun here; `None` decodes plainly.
    pub drafter: Option<Box<dyn Drafter>>,
    /// Report each generated token's log-probability and its position's `n` likeliest.
    pub logprobs: Option<usize>,
    /// A cache already holding the prompt's first tokens (a prompt cache's), how many,
    /// and the target's states there where the prompt cache kept them.
    pub reused: Option<Reused>,
}

/// A finished sequence: its output, its numbers, and its cache (which holds the prompt
/// and the tokens fed so far, for a prompt cache to keep).
pub struct Finished {
    pub prompt: Vec<u32>,
    pub tokens: Vec<u32>,
    pub text: String,
    pub stats: GenerationStats,
    pub speculative: SpeculativeStats,
    /// When asked for: one entry per generated token but an ending EOS.
    pub logprobs: Option<Vec<TokenLogprob>>,
    pub cache: ModelCache,
    /// With a block drafter: the target's states at its taps for every position the
    /// cache holds, in pieces (what a prompt cache keeps beside the cache).
    pub states: Option<Vec<Array>>,
}

/// What one step did for a decoding sequence: it fed `[last, drafts…]`, the target kept
/// `accepted` drafts and added `token`.
pub(super) struct Round<'a> {
    pub drafts: &'a [u32],
    pub accepted: usize,
    pub token: u32,
    /// The round's rows, for log-probabilities.
    pub logits: Option<&'a Array>,
    /// The target's states at the drafter's taps, every position fed.
    pub states: Option<&'a Array>,
}

/// How often drafts are kept: decayed counts, so a sequence whose text turns from a copy
/// to new prose stops being granted drafts within a few rounds.
const DECAY: f64 = 0.8;

pub(super) struct Sequence {
    pub(super) id: SequenceId,
    pub(super) prompt: Vec<u32>,
    pub(super) cache: ModelCache,
    /// Prompt tokens in the cache. All but the last are read in chunks; the last goes in
    /// as the first decode row, as plain decoding feeds it.
    pub(super) read: usize,
    cached_prompt: usize,
    config: GenerationConfig,
    pub(super) sampler: Option<Sampler>,
    pub(super) drafter: Option<Box<dyn Drafter>>,
    logprobs: Option<usize>,
    all_logprobs: Vec<TokenLogprob>,
    stream: TextStream,
    tokens: Vec<u32>,
    context_left: usize,
    /// The newest token, which the next decode row feeds: the prompt's last, then the
    /// token each round ends with.
    pub(super) last: u32,
    started: Instant,
    first_token: Option<Instant>,
    kept: f64,
    rejected: f64,
    tally: Tally,
    /// With a block drafter, which reads the target's states: those of every position
    /// the cache holds, in pieces. The drafter begins once the prompt's last position
    /// is read (the first round), with all of them, as a generation alone begins it.
    states: Option<Vec<Array>>,
}

impl Sequence {
    /// A sequence whose attention layers keep their positions in `pools` (one per
    /// layer), unless it may grow longer than a pool should, so that the batch's decode
    /// steps write and attend for the pooled sequences at once.
    pub(super) fn new(
        id: SequenceId,
        model: &dyn TargetModel,
        new: NewSequence,
        max_draft: usize,
        pools: &[KvPool],
    ) -> Result<Self, EngineError> {
        let NewSequence {
            prompt,
            config,
            mut drafter,
            logprobs,
            reused,
        } = new;
        let Some(&last) = prompt.last() else {
            return Err(EngineError::EmptyPrompt);
        };
        crate::decoding::session::check_prompt_ids(model, &prompt)?;
        let limit = context_limit(model, &prompt)?;
        if config.max_tokens == 0 {
            return Err(EngineError::Invalid("max_tokens must be at least 1".into()));
        }
        let reads_states = drafter
            .as_ref()
            .is_some_and(|d| d.drafts() && !d.taps().is_empty());
        // A drafter that reads the target's states needs them for the reused positions
        // too: a stored cache without them is not used.
        let reused = reused.filter(|r| !reads_states || r.hidden.is_some());
        let (mut cache, mut read, mut reused_states) = match reused {
            Some(r) => (r.cache, r.reused, r.hidden),
            None => (model.new_cache(), 0, None),
        };
        // The prompt's last token is always fed as a decode row.
        if read >= prompt.len() {
            cache.trim(read + 1 - prompt.len())?;
            read = prompt.len() - 1;
            reused_states = reused_states
                .map(|h| slice_axis(&h, 1, 0, read as i32))
                .transpose()?;
        }
        let longest = (prompt.len() + config.max_tokens).min(limit);
        cache.reserve_for_generation(longest);
        if longest <= LONGEST_POOLED {
            pools.iter().for_each(|pool| pool.reserve(longest));
            cache.join_pools(pools)?;
        }
        // Rounds forget rejected drafts: recurrent layers keep that many past states.
        let drafts = drafter.as_ref().is_some_and(|d| d.drafts());
        cache.set_rollback_window(if drafts { max_draft } else { 0 });
        match drafter.as_mut() {
            Some(_) if reads_states => {}
            Some(d) => d.begin(model, &prompt, None)?,
            None => {}
        }
        Ok(Self {
            id,
            cached_prompt: read,
            read,
            cache,
            stream: TextStream::new(&config.stop_strings),
            sampler: Sampler::unless_greedy(&config.sampling),
            context_left: limit - prompt.len(),
            config,
            drafter,
            logprobs,
            all_logprobs: Vec::new(),
            tokens: Vec::new(),
            last,
            prompt,
            started: Instant::now(),
            first_token: None,
            kept: 0.0,
            rejected: 0.0,
            tally: Tally::new(max_draft),
            states: reads_states.then(|| reused_states.into_iter().collect()),
        })
    }

    /// Whether the drafter reads the target's states at its taps.
    pub(super) fn reads_states(&self) -> bool {
        self.states.is_some()
    }

    /// Keeps the states of positions a step fed and the cache keeps (a prompt chunk's).
    pub(super) fn keep_states(&mut self, states: Option<Array>) {
        if let (Some(pieces), Some(h)) = (self.states.as_mut(), states) {
            pieces.push(h);
        }
    }

    /// Up to `k` drafts from the drafter, after the newest token, read to the host
    /// (with the distributions they were sampled from, where they were).
    pub(super) fn propose(
        &mut self,
        model: &dyn TargetModel,
        k: usize,
    ) -> Result<Draft, EngineError> {
        let Some(drafter) = self.drafter.as_mut() else {
            return Ok(Draft::default());
        };
        let mut picker = EnginePicker {
            sampler: self.sampler.as_mut(),
        };
        let mut draft = drafter.propose(model, self.last, k, &mut picker)?;
        draft.truncate(k)?;
        draft.read()?;
        Ok(draft)
    }

    /// Tokens committed so far.
    pub(super) fn generated(&self) -> usize {
        self.tokens.len()
    }

    /// Whether a token has been committed (the first comes from the prompt's last).
    pub(super) fn has_committed(&self) -> bool {
        !self.tokens.is_empty()
    }

    /// Prompt tokens still to be read as chunks (all but the last).
    pub(super) fn prompt_left(&self) -> usize {
        (self.prompt.len() - 1).saturating_sub(self.read)
    }

    /// Tokens that may still be committed (at least 1 while the sequence goes on).
    pub(super) fn room(&self) -> usize {
        let done = self.tokens.len();
        (self.config.max_tokens - done).min(self.context_left - done)
    }

    /// The most drafts a round may verify now.
    pub(super) fn draft_cap(&self, max_draft: usize) -> usize {
        let window = self.cache.rollback_window().unwrap_or(usize::MAX);
        max_draft.min(window).min(self.room().saturating_sub(1))
    }

    /// The chance a draft is kept (Laplace-smoothed, decayed).
    pub(super) fn alpha(&self) -> f64 {
        (self.kept + 1.0) / (self.kept + self.rejected + 2.0)
    }

    /// A draft the drafter offered but the step did not verify (it would not have paid
    /// at the load of the time) is still checked against the token the step chose: how
    /// often drafts would be kept stays measured while none are granted, so that they
    /// are granted again once they would pay.
    pub(super) fn observe_guess(&mut self, guess: u32, token: u32) {
        self.kept *= DECAY;
        self.rejected *= DECAY;
        match guess == token {
            true => self.kept += 1.0,
            false => self.rejected += 1.0,
        }
    }

    /// Ends a round that fed `[last, drafts…]`: the target kept `accepted` drafts and
    /// added `token` (`logits`: the round's rows, for log-probabilities). The drafter
    /// hears of the positions kept; tokens are committed one by one, stopping exactly
    /// where plain decoding would. Returns the text given out and why the sequence ends,
    /// if it does.
    pub(super) fn end_round(
        &mut self,
        model: &dyn TargetModel,
        tokenizer: &TextTokenizer,
        round: Round<'_>,
    ) -> Result<(String, Vec<TokenLogprob>, Option<StopReason>), EngineError> {
        let Round {
            drafts,
            accepted,
            token,
            logits,
            states,
        } = round;
        // The first round fed the prompt's last token: a drafter that reads no states
        // began with the prompt, one that does begins now.
        let first_round = !self.has_committed();
        self.first_token.get_or_insert_with(Instant::now);
        self.tally.round(drafts.len(), accepted);
        if !drafts.is_empty() {
            self.kept = self.kept * DECAY + accepted as f64;
            self.rejected = self.rejected * DECAY + f64::from(u8::from(accepted < drafts.len()));
        }
        // The states of the positions kept: the fed token's and the kept drafts'.
        let kept_states = match (&self.states, states) {
            (Some(_), Some(h)) => Some(slice_axis(h, 1, 0, 1 + accepted as i32)?),
            (Some(_), None) => {
                return Err(EngineError::Mlx(
                    "a batched step gave no states at the drafter's taps".into(),
                ))
            }
            _ => None,
        };
        self.keep_states(kept_states.clone());
        match (self.drafter.as_mut(), &self.states) {
            (Some(d), Some(pieces)) if first_round => {
                let prompt_states = concatenate(pieces, 1)?;
                d.begin(model, &self.prompt, Some(&prompt_states))?;
            }
            (Some(d), _) if !first_round => {
                let mut verified = Vec::with_capacity(accepted + 1);
                verified.push(self.last);
                verified.extend_from_slice(&drafts[..accepted]);
                d.commit(&verified, kept_states.as_ref())?;
            }
            _ => {}
        }
        let committed: Vec<u32> = drafts[..accepted].iter().copied().chain([token]).collect();
        let entries = match (self.logprobs, logits) {
            (Some(top), Some(logits)) => Some(token_logprobs(logits, &committed, top)?),
            _ => None,
        };
        let mut text = String::new();
        let mut stop = None;
        let mut count = 0;
        for &t in &committed {
            count += 1;
            stop = self.push(tokenizer, t, &mut text)?;
            if stop.is_some() {
                break;
            }
        }
        let mut entries = entries.unwrap_or_default();
        entries.truncate(count);
        if stop == Some(StopReason::Eos) {
            entries.pop();
        }
        self.all_logprobs.extend(entries.iter().cloned());
        self.last = token;
        Ok((text, entries, stop))
    }

    /// Commits one token (plain decoding's order of checks); its text goes to `text`.
    fn push(
        &mut self,
        tokenizer: &TextTokenizer,
        token: u32,
        text: &mut String,
    ) -> Result<Option<StopReason>, EngineError> {
        self.tokens.push(token);
        if self.config.eos_ids.contains(&token) {
            return Ok(Some(StopReason::Eos));
        }
        let (piece, stopped) = self.stream.push(tokenizer, token)?;
        text.push_str(&piece);
        if stopped {
            return Ok(Some(StopReason::StopString));
        }
        let done = self.tokens.len();
        if done >= self.config.max_tokens {
            return Ok(Some(StopReason::MaxTokens));
        }
        if done >= self.context_left {
            return Ok(Some(StopReason::ContextLength));
        }
        Ok(None)
    }

    /// The sequence's end: the text still held back, and what it made.
    pub(super) fn finish(
        mut self,
        tokenizer: &TextTokenizer,
        stop: StopReason,
    ) -> Result<(String, Finished), EngineError> {
        let rest = self
            .stream
            .finish(tokenizer, stop == StopReason::StopString)?;
        let now = Instant::now();
        let first = self.first_token.unwrap_or(now);
        let stats = GenerationStats::new(
            self.prompt.len(),
            self.tokens.len(),
            (first - self.started).as_secs_f64(),
            (now - first).as_secs_f64(),
            stop,
        )
        .with_cached_prompt(self.cached_prompt);
        let drafter = self.drafter.as_ref().map_or("none", |d| d.name());
        let speculative = self.tally.into_stats(drafter, stats.decode_seconds);
        // The cache outlives the batch (a prompt cache keeps it): out of the pools.
        self.cache.leave_pools()?;
        let finished = Finished {
            prompt: self.prompt,
            tokens: self.tokens,
            text: self.stream.text,
            stats,
            speculative,
            logprobs: self.logprobs.map(|_| self.all_logprobs),
            cache: self.cache,
            states: self.states,
        };
        Ok((rest, finished))
    }
}
