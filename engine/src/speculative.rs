//! Speculative decoding: the drafter proposes k tokens, the target verifies
//! `[last, d1..dk]` in one forward, a prefix of the drafts is kept plus one token of
//! the target's own, and the cache is trimmed of the rest.
//!
//! Greedy: the kept prefix is the one matching the target's argmax, so the output is
//! token for token plain greedy decoding's. Sampling: each draft d is kept with
//! probability min(1, p(d)/q(d)) and the first rejection is replaced by a sample from
//! max(0, p − q) renormalised (p: the target's processed distribution, q: the
//! drafter's, one-hot for drafters without one), so the output has exactly the
//! target's distribution. Acceptance runs on the device ([`crate::acceptance`]): a
//! round reads back only the kept count and the target's token.

use std::io::Write;
use std::time::{Duration, Instant};

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::ops::softmax_axis;
use mlx_rs::Array;
use serde::Serialize;

use dspec_plugin_api::error::Result as ModelResult;
use dspec_plugin_api::{Drafter, ModelError, Picked, TargetModel, TokenPicker};

use crate::acceptance::{accept_greedy, accept_sampled, argmax_all, Accepted};
use crate::draft_length::DraftLength;
use crate::error::EngineError;
use crate::generate::{prefill_with_taps, GenerationConfig, GenerationStats, StopReason, TextSink};
use crate::sampling::Sampler;
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
    /// Share of decode time the engine spent waiting on the drafter (a draft model
    /// drafting ahead on its own thread works while the target verifies: that part is
    /// not counted).
    pub draft_time_share: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct SpeculativeOutput {
    pub text: String,
    pub tokens: Vec<u32>,
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
    pub verify_ms: f64,
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

/// Speculative generation: greedy or sampled as `config.sampling` says, lossless
/// either way.
pub fn generate_speculative(
    model: &dyn TargetModel,
    tokenizer: &TextTokenizer,
    prompt: &[u32],
    config: &GenerationConfig,
    speculation: Speculation<'_>,
    on_text: &mut dyn FnMut(&str),
) -> Result<SpeculativeOutput, EngineError> {
    let Speculation {
        drafter,
        max_draft,
        adaptive,
        mut trace,
    } = speculation;
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
    };
    let mut cache = model.new_cache();

    let start = Instant::now();
    let (logits, prompt_hidden) = prefill_with_taps(model, &mut cache, prompt, &taps)?;
    let mut last = match sampler.as_mut() {
        None => argmax_all(&logits)?[0],
        Some(s) => s
            .sample(&logits)?
            .try_item_cast::<u32>()
            .map_err(|e| EngineError::Mlx(e.to_string()))?,
    };
    // The drafter reads the prompt too (a draft model prefills its own cache): that is
    // prompt processing, timed with the target's, as mlx-lm times its draft model's.
    drafter.begin(model, prompt, prompt_hidden.as_ref())?;
    let prefill_seconds = start.elapsed().as_secs_f64();
    let decode_start = Instant::now();

    let mut draft_time = Duration::ZERO;
    let mut histogram = vec![0usize; max_draft + 1];
    let mut length = DraftLength::new(max_draft, adaptive);
    let (mut forwards, mut drafted, mut accepted_total) = (0usize, 0usize, 0usize);
    let mut stop = committer.push(last)?;
    while stop.is_none() {
        // Never draft past what may still be committed.
        let room = (config.max_tokens - committer.tokens.len())
            .min(committer.context_left - committer.tokens.len());
        let k = length.next(room.saturating_sub(1));
        let t = Instant::now();
        let mut draft = drafter.propose(
            model,
            last,
            k,
            &mut EnginePicker {
                sampler: sampler.as_mut(),
            },
        )?;
        let draft_elapsed = t.elapsed();
        draft_time += draft_elapsed;
        draft.truncate(k)?;

        let t = Instant::now();
        let mut input = Vec::with_capacity(1 + draft.tokens.len());
        input.push(last);
        input.extend_from_slice(&draft.tokens);
        let out = model.forward(
            &Array::from_slice(&input, &[1, input.len() as i32]),
            &mut cache,
            &taps,
        )?;
        let logits = out.logits.try_index(0)?;
        let Accepted {
            drafts: accepted,
            token: next,
        } = match sampler.as_mut() {
            None => accept_greedy(&logits, &draft.tokens)?,
            Some(s) => accept_sampled(&logits, &draft.tokens, draft.probs.as_ref(), s)?,
        };
        let verify_elapsed = t.elapsed();
        length.observe(
            draft.tokens.len(),
            accepted,
            draft_elapsed.as_secs_f64(),
            verify_elapsed.as_secs_f64(),
        );
        cache.trim(draft.tokens.len() - accepted);
        let hidden = match &out.hidden {
            Some(h) => Some(h.try_index((.., ..(1 + accepted) as i32, ..))?),
            None => None,
        };
        drafter.commit(&input[..1 + accepted], hidden.as_ref())?;
        if let Some(out) = trace.as_deref_mut() {
            let line = RoundTrace {
                round: forwards,
                position: committer.tokens.len(),
                drafted: draft.tokens.clone(),
                accepted,
                target_token: next,
                draft_ms: draft_elapsed.as_secs_f64() * 1e3,
                verify_ms: verify_elapsed.as_secs_f64() * 1e3,
            };
            serde_json::to_writer(&mut *out, &line)
                .map_err(|e| EngineError::Invalid(format!("writing --trace: {e}")))?;
            writeln!(out).map_err(|e| EngineError::Invalid(format!("writing --trace: {e}")))?;
        }
        forwards += 1;
        drafted += draft.tokens.len();
        accepted_total += accepted;
        histogram[accepted] += 1;

        last = next;
        for &token in draft.tokens[..accepted]
            .iter()
            .chain(std::iter::once(&last))
        {
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
