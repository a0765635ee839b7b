//! Speculative decoding, greedy: the drafter proposes k tokens, the target verifies
//! `[last, d1..dk]` in one forward, the longest prefix matching the target's own argmax
//! is kept plus the target's next token, and the cache is trimmed of the rest. The
//! output is token for token what plain greedy decoding gives.

use std::time::{Duration, Instant};

use mlx_rs::ops::indexing::{argmax_axis, TryIndexOp};
use mlx_rs::{Array, Dtype};
use serde::Serialize;

use dspec_plugin_api::{Drafter, TargetModel};

use crate::error::EngineError;
use crate::generate::{prefill_with_taps, GenerationConfig, GenerationStats, StopReason, TextSink};
use crate::tokenizer::TextTokenizer;

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
    /// Share of decode time spent inside the drafter.
    pub draft_time_share: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct SpeculativeOutput {
    pub text: String,
    pub tokens: Vec<u32>,
    pub stats: GenerationStats,
    pub speculative: SpeculativeStats,
}

/// Argmax of every position of `[1, L, V]` logits, on the host (one sync per round).
fn argmax_all(logits: &Array) -> Result<Vec<u32>, EngineError> {
    let ids = argmax_axis(logits, -1, false)?.as_dtype(Dtype::Uint32)?;
    ids.eval()?;
    Ok(ids
        .try_as_slice::<u32>()
        .map_err(|e| EngineError::Mlx(e.to_string()))?
        .to_vec())
}

/// Commits tokens one at a time, stopping exactly where plain decoding would.
struct Committer<'a> {
    sink: TextSink<'a>,
    tokens: Vec<u32>,
    config: &'a GenerationConfig,
    context_left: usize,
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
}

/// Greedy speculative generation with `drafter`, at most `max_draft` drafts a round.
pub fn generate_speculative(
    model: &dyn TargetModel,
    tokenizer: &TextTokenizer,
    prompt: &[u32],
    config: &GenerationConfig,
    drafter: &mut dyn Drafter,
    max_draft: usize,
    on_text: &mut dyn FnMut(&str),
) -> Result<SpeculativeOutput, EngineError> {
    if !config.sampling.is_greedy() {
        return Err(EngineError::Invalid(
            "speculative decoding with sampling is not available yet: use --temperature 0, or drop --drafter".into(),
        ));
    }
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
    };
    let mut cache = model.new_cache();

    let start = Instant::now();
    let (logits, prompt_hidden) = prefill_with_taps(model, &mut cache, prompt, &taps)?;
    let mut last = argmax_all(&logits)?[0];
    let prefill_seconds = start.elapsed().as_secs_f64();
    let decode_start = Instant::now();
    drafter.begin(prompt, prompt_hidden.as_ref())?;

    let mut draft_time = Duration::ZERO;
    let mut histogram = vec![0usize; max_draft + 1];
    let (mut forwards, mut drafted, mut accepted_total) = (0usize, 0usize, 0usize);
    let mut stop = committer.push(last)?;
    while stop.is_none() {
        // Never draft past what may still be committed.
        let room = (config.max_tokens - committer.tokens.len())
            .min(committer.context_left - committer.tokens.len());
        let k = max_draft.min(room.saturating_sub(1));
        let t = Instant::now();
        let mut draft = drafter.propose(last, k)?.tokens;
        draft_time += t.elapsed();
        draft.truncate(k);

        let mut input = Vec::with_capacity(1 + draft.len());
        input.push(last);
        input.extend_from_slice(&draft);
        let out = model.forward(
            &Array::from_slice(&input, &[1, input.len() as i32]),
            &mut cache,
            &taps,
        )?;
        let target = argmax_all(&out.logits)?;
        let accepted = draft
            .iter()
            .zip(&target)
            .take_while(|(d, t)| d == t)
            .count();
        cache.trim(draft.len() - accepted);
        let hidden = match &out.hidden {
            Some(h) => Some(h.try_index((.., ..(1 + accepted) as i32, ..))?),
            None => None,
        };
        drafter.commit(&input[..1 + accepted], hidden.as_ref())?;
        forwards += 1;
        drafted += draft.len();
        accepted_total += accepted;
        histogram[accepted] += 1;

        last = target[accepted];
        for &token in draft[..accepted].iter().chain(std::iter::once(&last)) {
            stop = committer.push(token)?;
            if stop.is_some() {
                break;
            }
        }
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
    );
    let speculative = SpeculativeStats {
        drafter: drafter.name().to_string(),
        target_forwards: forwards,
        drafted_tokens: drafted,
        accepted_tokens: accepted_total,
        tau: (accepted_total + forwards) as f64 / forwards.max(1) as f64,
        acceptance_histogram: histogram,
        draft_time_share: draft_time.as_secs_f64() / decode_seconds.max(1e-9),
    };
    Ok(SpeculativeOutput {
        text: committer.sink.text,
        tokens: committer.tokens,
        stats,
        speculative,
    })
}
