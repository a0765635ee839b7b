//! What plain and speculative decoding share: the request's configuration, why a
//! generation stopped and what it cost, prefill, and committing tokens as text.

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::Array;
use serde::Serialize;

use dspec_plugin_api::{ModelCache, TargetModel};

use crate::decoding::sampling::SamplingParams;
use crate::error::EngineError;
use crate::text::detokenize::StreamDecoder;
use crate::text::stop::StopMatcher;
use crate::text::tokenizer::TextTokenizer;

/// Prompts longer than this are prefilled in chunks to bound peak memory; the same
/// step as mlx-lm's default `prefill_step_size`, so long prompts round as they do there.
const PREFILL_CHUNK: usize = 2048;

/// Serialized when rank 0 of a serving group sends a job to the other ranks.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct GenerationConfig {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop_strings: Vec<String>,
    /// Token ids that end generation (not emitted as text).
    pub eos_ids: Vec<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    Eos,
    StopString,
    MaxTokens,
    ContextLength,
    /// The caller asked to stop (a server's client went away).
    Cancelled,
}

#[derive(Debug, Clone, Serialize)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    /// Prompt tokens whose cache came from an earlier request (a server's prompt cache):
    /// not read again, so not counted in the prefill rate.
    pub cached_prompt_tokens: usize,
    pub generated_tokens: usize,
    pub prefill_seconds: f64,
    pub prefill_tokens_per_second: f64,
    /// From the first generated token to the last.
    pub decode_seconds: f64,
    /// Tokens after the first, per second of decoding (the first comes from prefill).
    pub decode_tokens_per_second: f64,
    pub stop_reason: StopReason,
    /// Where plain decoding's time went (absent for speculative decoding).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decode_breakdown: Option<DecodeBreakdown>,
}

/// Plain decoding's wall time split three ways. Building graphs and queueing them run
/// on the host while the device works on the step before; `waiting` is the time the host
/// sat idle on the device. Much waiting: device-bound; little: host-bound.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct DecodeBreakdown {
    /// Building each step's lazy graph (the model's forward and the token pick).
    pub building_seconds: f64,
    /// `async_eval`: MLX schedules the graph's kernels (on CUDA: graph nodes, launches).
    pub queueing_seconds: f64,
    /// Waiting for a step's token to arrive on the host.
    pub waiting_seconds: f64,
}

impl GenerationStats {
    /// Derives the rates; the first generated token is prefill's, so decode rate
    /// counts the tokens after it over the time from the first to the last.
    pub fn new(
        prompt_tokens: usize,
        generated_tokens: usize,
        prefill_seconds: f64,
        decode_seconds: f64,
        stop_reason: StopReason,
    ) -> Self {
        Self {
            prompt_tokens,
            cached_prompt_tokens: 0,
            generated_tokens,
            prefill_seconds,
            prefill_tokens_per_second: prompt_tokens as f64 / prefill_seconds.max(1e-9),
            decode_seconds,
            decode_tokens_per_second: generated_tokens.saturating_sub(1) as f64
                / decode_seconds.max(1e-9),
            stop_reason,
            decode_breakdown: None,
        }
    }

    /// Records that the first `cached` prompt tokens were not read: the prefill rate
    /// counts only the tokens that were.
    pub fn with_cached_prompt(mut self, cached: usize) -> Self {
        self.cached_prompt_tokens = cached;
        self.prefill_tokens_per_second =
            self.prompt_tokens.saturating_sub(cached) as f64 / self.prefill_seconds.max(1e-9);
        self
    }
}

/// The model's context limit, after refusing a prompt that already fills it.
pub(crate) fn context_limit(model: &dyn TargetModel, prompt: &[u32]) -> Result<usize, EngineError> {
    let limit = model.info().max_context.unwrap_or(usize::MAX);
    if prompt.len() >= limit {
        return Err(EngineError::PromptTooLong {
            prompt: prompt.len(),
            limit,
        });
    }
    Ok(limit)
}

/// Refuses a prompt with an id the model has no embedding row for: looking it up would
/// read past the embedding (on CUDA, an illegal memory access, after which the process's
/// GPU work never completes). Tokenizers that know more tokens than their model's
/// vocabulary exist; the ids come from the tokenizer, so this is checked on the host.
pub fn check_prompt_ids(model: &dyn TargetModel, prompt: &[u32]) -> Result<(), EngineError> {
    let rows = model.info().vocab_size;
    match prompt.iter().find(|&&id| id as usize >= rows) {
        Some(&id) => Err(EngineError::TokenPastVocabulary { id, rows }),
        None => Ok(()),
    }
}

/// Feeds `prompt` through the model (in chunks), returning the last position's logits.
pub fn prefill(
    model: &dyn TargetModel,
    cache: &mut ModelCache,
    prompt: &[u32],
) -> Result<Array, EngineError> {
    Ok(prefill_with_taps(model, cache, prompt, &[])?.0)
}

/// Like [`prefill`], also returning the hidden states at `taps` over the whole prompt
/// (`[1, L, taps × hidden]`) when taps are asked for.
pub fn prefill_with_taps(
    model: &dyn TargetModel,
    cache: &mut ModelCache,
    prompt: &[u32],
    taps: &[usize],
) -> Result<(Array, Option<Array>), EngineError> {
    let Some((&final_token, head)) = prompt.split_last() else {
        return Err(EngineError::EmptyPrompt);
    };
    check_prompt_ids(model, prompt)?;
    // All but the last token fill the cache (and the taps) only: their logits are never
    // evaluated, so the vocabulary projection of the prompt is never computed.
    let mut hidden = Vec::new();
    let chunks = head.len().div_ceil(PREFILL_CHUNK);
    for (i, chunk) in head.chunks(PREFILL_CHUNK).enumerate() {
        let tokens = Array::from_slice(chunk, &[1, chunk.len() as i32]);
        let out = model.forward(&tokens, cache, taps)?;
        let state = out.hidden.iter().chain(cache.state());
        if i + 1 < chunks {
            // Evaluate per chunk so the graph (and activations) of a long prompt stay small.
            mlx_rs::transforms::eval(state)?;
        } else {
            // The last chunk computes while the host builds the final step's graph (the
            // arrays are not held here, so the cache's buffers can still be updated in
            // place).
            mlx_rs::transforms::async_eval(state)?;
        }
        hidden.extend(out.hidden);
    }
    // The last prompt token goes through the one-token step, as every later token does
    // (and as mlx-lm does): its keys and values come from the same kernels as a decoded
    // token's, so on a GPU the first tokens round exactly as mlx-lm's do.
    let out = model.forward(&Array::from_slice(&[final_token], &[1, 1]), cache, taps)?;
    let logits = out.logits.try_index((.., -1, ..))?;
    // The sum is NaN or infinite when any logit is: a broken checkpoint shows here, before
    // it could generate garbage with a clean exit, at one reduction per generation.
    let total = logits.as_dtype(mlx_rs::Dtype::Float32)?.sum(None)?;
    mlx_rs::transforms::eval(
        [&logits, &total]
            .into_iter()
            .chain(out.hidden.iter())
            .chain(cache.state()),
    )?;
    let total: f32 = total
        .try_item_cast()
        .map_err(|e| EngineError::Mlx(e.to_string()))?;
    if !total.is_finite() {
        // The cache's length, not the prompt's: a prompt-cache hit prefills only the rest.
        return Err(EngineError::NonFiniteLogits {
            position: cache.offset() - 1,
            what: "the prompt's last token",
        });
    }
    hidden.extend(out.hidden);
    let hidden = if hidden.is_empty() {
        None
    } else {
        Some(mlx_rs::ops::concatenate(&hidden, 1)?)
    };
    Ok((logits, hidden))
}

/// Committed tokens as text: detokenized as they come, with text that may be the start
/// of a stop string held back until it is known not to be.
pub(crate) struct TextStream {
    decoder: StreamDecoder,
    stops: StopMatcher,
    /// Everything given out so far.
    pub(crate) text: String,
}

impl TextStream {
    pub(crate) fn new(stop_strings: &[String]) -> Self {
        TextStream {
            decoder: StreamDecoder::new(true),
            stops: StopMatcher::new(stop_strings.to_vec()),
            text: String::new(),
        }
    }

    /// The text `id` gives out (often empty: held back, or part of a character), and
    /// whether a stop string completed.
    pub(crate) fn push(
        &mut self,
        tokenizer: &TextTokenizer,
        id: u32,
    ) -> Result<(String, bool), EngineError> {
        let piece = self.decoder.push(tokenizer, id)?;
        let step = self.stops.push(&piece);
        self.text.push_str(&step.emit);
        Ok((step.emit, step.stopped))
    }

    /// The text still held back at the end (none after a stop string).
    pub(crate) fn finish(
        &mut self,
        tokenizer: &TextTokenizer,
        stopped_on_string: bool,
    ) -> Result<String, EngineError> {
        if stopped_on_string {
            return Ok(String::new());
        }
        let rest = self.decoder.finish(tokenizer)?;
        let step = self.stops.push(&rest);
        let mut out = step.emit;
        if !step.stopped {
            out.push_str(&self.stops.finish());
        }
        self.text.push_str(&out);
        Ok(out)
    }
}

/// Emits committed text through a [`TextStream`] to a callback.
pub(crate) struct TextSink<'a> {
    tokenizer: &'a TextTokenizer,
    stream: TextStream,
    on_text: &'a mut dyn FnMut(&str),
}

impl<'a> TextSink<'a> {
    pub(crate) fn new(
        tokenizer: &'a TextTokenizer,
        stop_strings: &[String],
        on_text: &'a mut dyn FnMut(&str),
    ) -> Self {
        TextSink {
            tokenizer,
            stream: TextStream::new(stop_strings),
            on_text,
        }
    }

    /// Returns true when a stop string completed.
    pub(crate) fn push(&mut self, id: u32) -> Result<bool, EngineError> {
        let (piece, stopped) = self.stream.push(self.tokenizer, id)?;
        self.emit(&piece);
        Ok(stopped)
    }

    pub(crate) fn finish(&mut self, stopped_on_string: bool) -> Result<(), EngineError> {
        let rest = self.stream.finish(self.tokenizer, stopped_on_string)?;
        self.emit(&rest);
        Ok(())
    }

    /// Everything given out.
    pub(crate) fn into_text(self) -> String {
        self.stream.text
    }

    fn emit(&mut self, s: &str) {
        if !s.is_empty() {
            (self.on_text)(s);
        }
    }
}

/// Whether to stop; an error (a collective that failed) fails the generation.
pub type CancelCheck<'a> = dyn Fn() -> Result<bool, EngineError> + 'a;

/// Commits tokens one at a time, stopping exactly where plain decoding would.
pub(crate) struct Committer<'a> {
    pub(crate) sink: TextSink<'a>,
    pub(crate) tokens: Vec<u32>,
    pub(crate) config: &'a GenerationConfig,
    pub(crate) context_left: usize,
    /// Asked once per round (see
    /// [`ServingOptions::cancelled`](crate::decoding::speculative::ServingOptions::cancelled)).
    pub(crate) cancelled: &'a CancelCheck<'a>,
}

impl Committer<'_> {
    /// Returns the stop reason when `token` ends generation.
    pub(crate) fn push(&mut self, token: u32) -> Result<Option<StopReason>, EngineError> {
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
    pub(crate) fn end_round(
        &self,
        stop: Option<StopReason>,
    ) -> Result<Option<StopReason>, EngineError> {
        if stop.is_some() {
            return Ok(stop);
        }
        Ok((self.cancelled)()?.then_some(StopReason::Cancelled))
    }

    /// Tokens that may still be committed (at least 1 while generation goes on).
    pub(crate) fn room(&self) -> usize {
        let done = self.tokens.len();
        (self.config.max_tokens - done).min(self.context_left - done)
    }
}
