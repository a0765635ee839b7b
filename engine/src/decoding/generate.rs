//! Plain (non-speculative) decoding: prefill, then one target forward per token,
//! streaming text as it is committed and stopping exactly on EOS, stop strings,
//! `max_tokens` or the context limit.

use std::time::Instant;

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::transforms::async_eval;
use mlx_rs::{Array, Dtype};
use serde::Serialize;

use dspec_plugin_api::{ModelCache, TargetModel};

use crate::decoding::sampling::{pick_next, token_value, Sampler};
use crate::decoding::session::{context_limit, CancelCheck};
// Kept at their old paths for the callers that name them here.
use crate::decoding::session::TextSink;
pub use crate::decoding::session::{
    check_prompt_ids, prefill, prefill_with_taps, DecodeBreakdown, GenerationConfig,
    GenerationStats, StopReason,
};
use crate::error::EngineError;
use crate::text::tokenizer::TextTokenizer;

#[derive(Debug, Clone, Serialize)]
pub struct GenerationOutput {
    pub text: String,
    /// Generated ids, the EOS id included when generation ended on one.
    pub tokens: Vec<u32>,
    pub stats: GenerationStats,
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

/// Generates from `prompt` with plain decoding, calling `on_text` with each committed piece.
pub fn generate(
    model: &dyn TargetModel,
    tokenizer: &TextTokenizer,
    prompt: &[u32],
    config: &GenerationConfig,
    on_text: &mut dyn FnMut(&str),
) -> Result<GenerationOutput, EngineError> {
    generate_until(model, tokenizer, prompt, config, on_text, &|| Ok(false))
}

/// [`generate`], asking `cancelled` after each committed token: true ends the generation
/// there, with [`StopReason::Cancelled`] (the user pressed Ctrl-C).
pub fn generate_until(
    model: &dyn TargetModel,
    tokenizer: &TextTokenizer,
    prompt: &[u32],
    config: &GenerationConfig,
    on_text: &mut dyn FnMut(&str),
    cancelled: &CancelCheck,
) -> Result<GenerationOutput, EngineError> {
    let context_limit = context_limit(model, prompt)?;
    let mut sampler = Sampler::unless_greedy(&config.sampling);
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
        if cancelled()? {
            break StopReason::Cancelled;
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
        text: sink.into_text(),
        tokens,
        stats,
    })
}
