//! Plain (non-speculative) decoding: prefill, then one target forward per token,
//! streaming text as it is committed and stopping exactly on EOS, stop strings,
//! `max_tokens` or the context limit.

use std::time::Instant;

use mlx_rs::ops::indexing::{argmax_axis, TryIndexOp};
use mlx_rs::transforms::async_eval;
use mlx_rs::{Array, Dtype};
use serde::Serialize;

use dspec_plugin_api::{ModelCache, TargetModel};

use crate::decoding::sampling::{Sampler, SamplingParams};
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

#[derive(Debug, Clone, Serialize)]
pub struct GenerationOutput {
    pub text: String,
    /// Generated ids, the EOS id included when generation ended on one.
    pub tokens: Vec<u32>,
    pub stats: GenerationStats,
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
    mlx_rs::transforms::eval(
        std::iter::once(&logits)
            .chain(out.hidden.iter())
            .chain(cache.state()),
    )?;
    hidden.extend(out.hidden);
    let hidden = if hidden.is_empty() {
        None
    } else {
        Some(mlx_rs::ops::concatenate(&hidden, 1)?)
    };
    Ok((logits, hidden))
}

/// Logits → host `f32` values, row after row (references and tests: decoding itself
/// samples on the device).
pub fn logits_to_host(logits: &Array) -> Result<Vec<f32>, EngineError> {
    let row = logits.as_dtype(Dtype::Float32)?;
    row.eval()?;
    Ok(row
        .try_as_slice::<f32>()
        .map_err(|e| EngineError::Mlx(e.to_string()))?
        .to_vec())
}

/// The next token from `[1, vocab]` logits as a lazy `[1, 1]` uint32 array: the argmax
/// without a sampler, else a draw. On the device either way, so the next step's graph
/// can be built on the token before it is known.
pub(crate) fn pick_next(
    sampler: Option<&mut Sampler>,
    logits: &Array,
) -> Result<Array, EngineError> {
    Ok(match sampler {
        None => argmax_axis(logits, -1, true)?.as_dtype(Dtype::Uint32)?,
        Some(sampler) => sampler.sample(logits)?.reshape(&[1, 1])?,
    })
}

/// Builds and queues the forward that follows `token` (`[1, 1]`, possibly still lazy);
/// returns the picked next token, being computed.
fn queue_step(
    model: &dyn TargetModel,
    cache: &mut ModelCache,
    token: &Array,
    sampler: Option<&mut Sampler>,
    times: &mut DecodeBreakdown,
) -> Result<Array, EngineError> {
    let start = Instant::now();
    let logits = model
        .forward(token, cache, &[])?
        .logits
        .try_index((.., -1, ..))?;
    let picked = pick_next(sampler, &logits)?;
    let built = Instant::now();
    async_eval([&picked])?;
    times.building_seconds += (built - start).as_secs_f64();
    times.queueing_seconds += built.elapsed().as_secs_f64();
    Ok(picked)
}

pub(crate) fn token_value(token: &Array) -> Result<u32, EngineError> {
    token
        .try_item_cast::<u32>()
        .map_err(|e| EngineError::Mlx(e.to_string()))
}

/// Emits committed text through the detokenizer and stop-string matcher.
pub(crate) struct TextSink<'a> {
    tokenizer: &'a TextTokenizer,
    decoder: StreamDecoder,
    stops: StopMatcher,
    pub(crate) text: String,
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
            decoder: StreamDecoder::new(true),
            stops: StopMatcher::new(stop_strings.to_vec()),
            text: String::new(),
            on_text,
        }
    }

    /// Returns true when a stop string completed.
    pub(crate) fn push(&mut self, id: u32) -> Result<bool, EngineError> {
        let piece = self.decoder.push(self.tokenizer, id)?;
        let step = self.stops.push(&piece);
        self.emit(&step.emit);
        Ok(step.stopped)
    }

    pub(crate) fn finish(&mut self, stopped_on_string: bool) -> Result<(), EngineError> {
        if stopped_on_string {
            return Ok(());
        }
        let rest = self.decoder.finish(self.tokenizer)?;
        let step = self.stops.push(&rest);
        self.emit(&step.emit);
        if !step.stopped {
            let held = self.stops.finish();
            self.emit(&held);
        }
        Ok(())
    }

    fn emit(&mut self, s: &str) {
        if !s.is_empty() {
            self.text.push_str(s);
            (self.on_text)(s);
        }
    }
}

/// Generates from `prompt` with plain decoding, calling `on_text` with each committed piece.
pub fn generate(
    model: &dyn TargetModel,
    tokenizer: &TextTokenizer,
    prompt: &[u32],
    config: &GenerationConfig,
    on_text: &mut dyn FnMut(&str),
) -> Result<GenerationOutput, EngineError> {
    let context_limit = model.info().max_context.unwrap_or(usize::MAX);
    if prompt.len() >= context_limit {
        return Err(EngineError::PromptTooLong {
            prompt: prompt.len(),
            limit: context_limit,
        });
    }
    let mut sampler = (!config.sampling.is_greedy()).then(|| Sampler::new(config.sampling.clone()));
    let mut sink = TextSink::new(tokenizer, &config.stop_strings, on_text);
    let mut cache = model.new_cache();
    // Plain decoding never rolls back: no past states to keep for recurrent layers.
    cache.set_rollback_window(0);
    let mut tokens = Vec::new();

    let start = Instant::now();
    let mut next = pick_next(sampler.as_mut(), &prefill(model, &mut cache, prompt)?)?;
    let first_id = token_value(&next)?;
    let prefill_seconds = start.elapsed().as_secs_f64();
    let decode_start = Instant::now();

    // Decoding keeps two steps in flight: the graph of step n+2 is built and queued
    // from step n+1's still-lazy token (greedy or sampled, it is picked on the device)
    // before the host waits for step n+1, so the device never idles while the host
    // builds graphs or detokenizes. (A step queued past an EOS or a stop string is
    // computed and dropped.)
    let mut current_id = first_id;
    let mut queued: Option<Array> = None;
    let mut times = DecodeBreakdown::default();
    let stop_reason = loop {
        tokens.push(current_id);
        if config.eos_ids.contains(&current_id) {
            break StopReason::Eos;
        }
        let done_by_count = tokens.len() >= config.max_tokens;
        let done_by_context = prompt.len() + tokens.len() >= context_limit;
        if done_by_count || done_by_context {
            if sink.push(current_id)? {
                break StopReason::StopString;
            }
            break if done_by_count {
                StopReason::MaxTokens
            } else {
                StopReason::ContextLength
            };
        }
        let step = match queued.take() {
            Some(token) => token,
            None => queue_step(model, &mut cache, &next, sampler.as_mut(), &mut times)?,
        };
        // Room for one more after `step`: queue it before waiting on `step`.
        let room =
            tokens.len() + 1 < config.max_tokens && prompt.len() + tokens.len() + 1 < context_limit;
        if room {
            queued = Some(queue_step(
                model,
                &mut cache,
                &step,
                sampler.as_mut(),
                &mut times,
            )?);
        }
        if sink.push(current_id)? {
            break StopReason::StopString;
        }
        let wait = Instant::now();
        current_id = token_value(&step)?;
        times.waiting_seconds += wait.elapsed().as_secs_f64();
        next = step;
    };
    // A step queued past the end is still running: wait for it, so nothing is in flight
    // when the caller goes on. (A library caller's process that exits normally while
    // MLX's stream thread is inside an OpenBLAS call deadlocks in OpenBLAS's exit handler.)
    if let Some(step) = queued {
        step.eval()?;
    }
    sink.finish(stop_reason == StopReason::StopString)?;
    let mut stats = GenerationStats::new(
        prompt.len(),
        tokens.len(),
        prefill_seconds,
        decode_start.elapsed().as_secs_f64(),
        stop_reason,
    );
    stats.decode_breakdown = Some(times);
    Ok(GenerationOutput {
        text: sink.text,
        tokens,
        stats,
    })
}
