//! "How likely is this text?": log-probabilities of a completion after a prompt, rolling
//! log-probabilities of a text (in windows beyond the context), and the next-token
//! distribution — for the base model and, with a LoRA adapter, the adapted one — with
//! every result cached for the run.
//!
//! All scoring is on raw text (no chat template). Token ids are the tokenizer's ids of
//! the text without special tokens, after BOS when the tokenizer adds one; log-softmax
//! is taken in f32 whatever the model's dtype. `batch` reads and runs many requests.

pub mod batch;

use std::collections::HashMap;

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{Array, Dtype};
use serde::{Deserialize, Serialize};

use dspec_adapters::lora::LoraSwitch;
use dspec_plugin_api::{ModelCache, TargetModel};

use crate::decoding::generate::check_prompt_ids;
use crate::error::EngineError;
use crate::loading::{LoadedLora, LoadedModel};
use crate::text::tokenizer::TextTokenizer;

/// Tokens per forward pass inside a window: bounds the `[tokens, vocab]` logits held
/// at once; the KV cache carries the context across chunks, so this changes no result.
const FORWARD_CHUNK: usize = 512;
/// Window for models whose config declares no context length.
const FALLBACK_WINDOW: usize = 2048;

/// What to measure; with the model and adapter it is the cache key of a result.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "measure", rename_all = "kebab-case")]
pub enum Measure {
    /// `log p(completion | prompt)`, per completion token and summed.
    Logprob { prompt: String, completion: String },
    /// `log p(token | earlier tokens)` for every token of `text`.
    Rolling { text: String },
    /// The `k` most likely next tokens after `prompt`.
    NextToken { prompt: String, k: usize },
}

impl Measure {
    pub fn name(&self) -> &'static str {
        match self {
            Measure::Logprob { .. } => "logprob",
            Measure::Rolling { .. } => "rolling",
            Measure::NextToken { .. } => "next-token",
        }
    }
}

/// Which model answers: the base weights, or the base with the LoRA adapter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Variant {
    Base,
    Adapted,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TokenLogprob {
    pub id: u32,
    /// The token decoded on its own.
    pub token: String,
    pub logprob: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LogprobScore {
    /// Sum of the completion tokens' log-probabilities.
    pub sum: f64,
    pub tokens: Vec<TokenLogprob>,
    /// Tokens (BOS included) before the first completion token.
    pub prompt_tokens: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RollingScore {
    pub total: f64,
    /// Tokens scored (`tokens.len()`).
    pub count: usize,
    /// `exp(-total / count)`; `None` when nothing was scored.
    pub perplexity: Option<f64>,
    pub tokens: Vec<TokenLogprob>,
    /// Whether the first token was scored after BOS; without BOS it has no context and
    /// is not scored.
    pub conditioned_on_bos: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TokenProb {
    pub id: u32,
    pub token: String,
    pub logprob: f64,
    pub prob: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NextTokenScore {
    /// Most likely first.
    pub top: Vec<TokenProb>,
    /// Probability of every token outside `top` (= 1 − Σ top, summed from the tail for
    /// precision); `None` when `k` covers the vocabulary.
    pub tail_mass: Option<f64>,
    /// Width of the model's output (may exceed the tokenizer's vocabulary).
    pub vocab_size: usize,
    /// Prompt tokens the model saw (the last `window` when the prompt is longer).
    pub context_tokens: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Score {
    Logprob(LogprobScore),
    Rolling(RollingScore),
    NextToken(NextTokenScore),
}

/// Work done so far: forward passes run, results computed, results served from cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ScorerStats {
    pub forward_passes: usize,
    pub computed: usize,
    pub cache_hits: usize,
}

/// How texts longer than the context are scored: windows of `window` tokens starting
/// every `stride` tokens; each token is scored once, in the first window that reaches
/// it, so every token after the first window sees at least `window − stride` earlier
/// tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Windowing {
    pub window: usize,
    pub stride: usize,
}

impl Windowing {
    /// `window` defaults to the model's declared context (else 2048), `stride` to half
    /// the window.
    pub fn new(
        window: Option<usize>,
        stride: Option<usize>,
        max_context: Option<usize>,
    ) -> Result<Self, EngineError> {
        let window = window.or(max_context).unwrap_or(FALLBACK_WINDOW);
        if window < 2 {
            return Err(EngineError::Invalid(format!(
                "--window must be at least 2 tokens, got {window}"
            )));
        }
        if let Some(limit) = max_context.filter(|&limit| window > limit) {
            return Err(EngineError::Invalid(format!(
                "--window {window} exceeds the model's context of {limit} tokens"
            )));
        }
        let stride = stride.unwrap_or(window / 2);
        if stride == 0 || stride >= window {
            return Err(EngineError::Invalid(format!(
                "--stride must be between 1 and window − 1 ({}), got {stride}: windows must overlap so every token has context",
                window - 1
            )));
        }
        Ok(Self { window, stride })
    }
}

/// The adapter side of a scorer: its identity in cache keys and its switch (`None`
/// when fused into the weights, which leaves no base model to score).
pub struct ScorerAdapter {
    pub id: String,
    pub switch: Option<LoraSwitch>,
}

impl From<&LoadedLora> for ScorerAdapter {
    fn from(lora: &LoadedLora) -> Self {
        let fused = if lora.switch.is_none() {
            " (fused)"
        } else {
            ""
        };
        Self {
            id: format!("{}{fused}", lora.dir.display()),
            switch: lora.switch.clone(),
        }
    }
}

#[derive(Hash, PartialEq, Eq)]
struct CacheKey {
    model: String,
    adapter: Option<String>,
    measure: Measure,
}

/// A loaded target that answers [`Measure`]s, with a per-run result cache.
pub struct Scorer {
    model: Box<dyn TargetModel>,
    tokenizer: TextTokenizer,
    model_id: String,
    adapter: Option<ScorerAdapter>,
    windowing: Windowing,
    cache: HashMap<CacheKey, Score>,
    stats: ScorerStats,
}

impl Scorer {
    pub fn new(loaded: LoadedModel, adapter: Option<ScorerAdapter>, windowing: Windowing) -> Self {
        Self {
            model_id: loaded.dir.display().to_string(),
            model: loaded.model,
            tokenizer: loaded.tokenizer,
            adapter,
            windowing,
            cache: HashMap::new(),
            stats: ScorerStats::default(),
        }
    }

    pub fn model(&self) -> &dyn TargetModel {
        self.model.as_ref()
    }

    pub fn tokenizer(&self) -> &TextTokenizer {
        &self.tokenizer
    }

    pub fn windowing(&self) -> Windowing {
        self.windowing
    }

    pub fn stats(&self) -> ScorerStats {
        self.stats
    }

    /// Whether base scores are available (not when the adapter was fused).
    pub fn has_base(&self) -> bool {
        self.adapter.as_ref().is_none_or(|a| a.switch.is_some())
    }

    pub fn has_adapter(&self) -> bool {
        self.adapter.is_some()
    }

    /// The model that answers when none is named: the adapted one when there is an adapter.
    pub fn default_variant(&self) -> Variant {
        if self.has_adapter() {
            Variant::Adapted
        } else {
            Variant::Base
        }
    }

    /// Scores `measure` with `variant`, from the cache when this run already did.
    pub fn score(&mut self, measure: &Measure, variant: Variant) -> Result<Score, EngineError> {
        let adapter = self.select(variant)?;
        let key = CacheKey {
            model: self.model_id.clone(),
            adapter,
            measure: measure.clone(),
        };
        if let Some(hit) = self.cache.get(&key) {
            self.stats.cache_hits += 1;
            return Ok(hit.clone());
        }
        let score = match measure {
            Measure::Logprob { prompt, completion } => {
                Score::Logprob(self.compute_logprob(prompt, completion)?)
            }
            Measure::Rolling { text } => Score::Rolling(self.compute_rolling(text)?),
            Measure::NextToken { prompt, k } => {
                Score::NextToken(self.compute_next_token(prompt, *k)?)
            }
        };
        self.stats.computed += 1;
        self.cache.insert(key, score.clone());
        Ok(score)
    }

    pub fn logprob(
        &mut self,
        prompt: &str,
        completion: &str,
        variant: Variant,
    ) -> Result<LogprobScore, EngineError> {
        let measure = Measure::Logprob {
            prompt: prompt.into(),
            completion: completion.into(),
        };
        match self.score(&measure, variant)? {
            Score::Logprob(s) => Ok(s),
            _ => Err(mismatched(&measure)),
        }
    }

    pub fn rolling(&mut self, text: &str, variant: Variant) -> Result<RollingScore, EngineError> {
        let measure = Measure::Rolling { text: text.into() };
        match self.score(&measure, variant)? {
            Score::Rolling(s) => Ok(s),
            _ => Err(mismatched(&measure)),
        }
    }

    pub fn next_token(
        &mut self,
        prompt: &str,
        k: usize,
        variant: Variant,
    ) -> Result<NextTokenScore, EngineError> {
        let measure = Measure::NextToken {
            prompt: prompt.into(),
            k,
        };
        match self.score(&measure, variant)? {
            Score::NextToken(s) => Ok(s),
            _ => Err(mismatched(&measure)),
        }
    }

    /// Sets the adapter switch for `variant`; returns the adapter part of the cache key.
    fn select(&self, variant: Variant) -> Result<Option<String>, EngineError> {
        match (variant, &self.adapter) {
            (Variant::Base, None) => Ok(None),
            (Variant::Base, Some(adapter)) => match &adapter.switch {
                Some(switch) => {
                    switch.set_enabled(false);
                    Ok(None)
                }
                None => Err(EngineError::Invalid(
                    "base scores are not available: the adapter was fused into the weights \
                     (--fuse); drop --fuse to score base and adapted from one load"
                        .into(),
                )),
            },
            (Variant::Adapted, None) => Err(EngineError::Invalid(
                "no LoRA adapter is loaded; give --lora DIR to score the adapted model".into(),
            )),
            (Variant::Adapted, Some(adapter)) => {
                if let Some(switch) = &adapter.switch {
                    switch.set_enabled(true);
                }
                Ok(Some(adapter.id.clone()))
            }
        }
    }

    /// Token ids of `text` as scored: BOS (when the tokenizer adds one), then the text's
    /// own tokens without any other special token.
    fn encode(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        let mut ids = Vec::new();
        if let Some(bos) = self.bos() {
            ids.push(bos);
        }
        ids.extend(self.tokenizer.encode(text, false)?);
        check_prompt_ids(self.model.as_ref(), &ids)?;
        Ok(ids)
    }

    fn bos(&self) -> Option<u32> {
        self.tokenizer
            .bos_token_id()
            .filter(|_| self.tokenizer.adds_bos())
    }

    /// The prompt and completion are tokenized together, as the model would read the
    /// text; completion tokens start where that tokenization stops agreeing with the
    /// prompt's own, so a token straddling the boundary counts as completion.
    fn compute_logprob(
        &mut self,
        prompt: &str,
        completion: &str,
    ) -> Result<LogprobScore, EngineError> {
        let prompt_ids = self.encode(prompt)?;
        let ids = self.encode(&format!("{prompt}{completion}"))?;
        let boundary = prompt_ids
            .iter()
            .zip(&ids)
            .take_while(|(a, b)| a == b)
            .count();
        if boundary == ids.len() {
            return Err(EngineError::Invalid(format!(
                "the completion {completion:?} adds no tokens after the prompt {prompt:?}"
            )));
        }
        if boundary == 0 {
            return Err(EngineError::Invalid(format!(
                "nothing conditions the completion {completion:?}: the prompt {prompt:?} leaves \
                 no token of its own and the tokenizer adds no BOS; give a longer prompt"
            )));
        }
        let logprobs = self.target_logprobs(&ids, boundary)?;
        let tokens = self.token_logprobs(&ids[boundary..], &logprobs)?;
        Ok(LogprobScore {
            sum: tokens.iter().map(|t| t.logprob).sum(),
            tokens,
            prompt_tokens: boundary,
        })
    }

    fn compute_rolling(&mut self, text: &str) -> Result<RollingScore, EngineError> {
        let ids = self.encode(text)?;
        let tokens = if ids.len() < 2 {
            Vec::new()
        } else {
            let logprobs = self.target_logprobs(&ids, 1)?;
            self.token_logprobs(&ids[1..], &logprobs)?
        };
        let total: f64 = tokens.iter().map(|t| t.logprob).sum();
        let count = tokens.len();
        Ok(RollingScore {
            total,
            count,
            perplexity: (count > 0).then(|| (-total / count as f64).exp()),
            tokens,
            conditioned_on_bos: self.bos().is_some(),
        })
    }

    fn compute_next_token(
        &mut self,
        prompt: &str,
        k: usize,
    ) -> Result<NextTokenScore, EngineError> {
        if k == 0 {
            return Err(EngineError::Invalid(
                "--top-k (or `k`) must be at least 1".into(),
            ));
        }
        let ids = self.encode(prompt)?;
        if ids.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let context = &ids[ids.len().saturating_sub(self.windowing.window)..];
        let row = self.next_logprobs(context)?;
        let vocab = row.len();
        let shown = k.min(vocab);
        let mut order: Vec<usize> = (0..vocab).collect();
        let by_logprob_desc = |a: &usize, b: &usize| row[*b].total_cmp(&row[*a]);
        if shown < vocab {
            order.select_nth_unstable_by(shown - 1, by_logprob_desc);
        }
        let (top_ids, rest) = order.split_at_mut(shown);
        top_ids.sort_by(by_logprob_desc);
        let mut top = Vec::with_capacity(shown);
        for &i in top_ids.iter() {
            let logprob = row[i] as f64;
            top.push(TokenProb {
                id: i as u32,
                token: self.token_text(i as u32)?,
                logprob,
                prob: logprob.exp(),
            });
        }
        let tail_mass =
            (k < vocab).then(|| rest.iter().map(|&i| (row[i] as f64).exp()).sum::<f64>());
        Ok(NextTokenScore {
            top,
            tail_mass,
            vocab_size: vocab,
            context_tokens: context.len(),
        })
    }

    fn token_text(&self, id: u32) -> Result<String, EngineError> {
        Ok(self.tokenizer.decode(&[id], false)?)
    }

    fn token_logprobs(
        &self,
        ids: &[u32],
        logprobs: &[f32],
    ) -> Result<Vec<TokenLogprob>, EngineError> {
        ids.iter()
            .zip(logprobs)
            .map(|(&id, &lp)| {
                Ok(TokenLogprob {
                    id,
                    token: self.token_text(id)?,
                    logprob: lp as f64,
                })
            })
            .collect()
    }

    /// `log p(ids[t] | ids[..t])` for `t` in `first..ids.len()`, window by window (see
    /// [`Windowing`]); windows holding no wanted target are skipped. `first ≥ 1`.
    fn target_logprobs(&mut self, ids: &[u32], first: usize) -> Result<Vec<f32>, EngineError> {
        let Windowing { window, stride } = self.windowing;
        let n = ids.len();
        let mut out = Vec::with_capacity(n.saturating_sub(first));
        // Targets before `scored_to` were handled by an earlier window.
        let (mut begin, mut scored_to) = (0, 1);
        loop {
            let end = (begin + window).min(n);
            let keep_from = scored_to.max(first);
            if keep_from < end {
                let logprobs = self.window_logprobs(&ids[begin..end])?;
                // logprobs[j] scores ids[begin + 1 + j].
                out.extend_from_slice(&logprobs[keep_from - begin - 1..]);
            }
            scored_to = end;
            if end == n {
                return Ok(out);
            }
            begin += stride;
        }
    }

    /// `log p(tokens[j + 1] | tokens[..=j])` for every `j`, from a fresh cache.
    fn window_logprobs(&mut self, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
        let mut cache = self.model.new_cache();
        // Scoring never rolls back: recurrent layers need keep no past states.
        cache.set_rollback_window(0);
        let inputs = &tokens[..tokens.len() - 1];
        let mut out = Vec::with_capacity(inputs.len());
        for (i, chunk) in inputs.chunks(FORWARD_CHUNK).enumerate() {
            let start = i * FORWARD_CHUNK;
            let targets = &tokens[start + 1..start + 1 + chunk.len()];
            let logits = self.forward(chunk, &mut cache)?;
            let logprobs = gather_logprobs(&logits, targets)?;
            mlx_rs::transforms::eval(std::iter::once(&logprobs).chain(cache.state()))?;
            out.extend_from_slice(to_host(&logprobs)?.as_slice());
        }
        Ok(out)
    }

    /// Log-probabilities over the vocabulary of the token after `context`.
    fn next_logprobs(&mut self, context: &[u32]) -> Result<Vec<f32>, EngineError> {
        let mut cache = self.model.new_cache();
        cache.set_rollback_window(0);
        let mut last = None;
        for chunk in context.chunks(FORWARD_CHUNK) {
            let logits = self.forward(chunk, &mut cache)?;
            let row = logits.try_index((.., -1, ..))?.as_dtype(Dtype::Float32)?;
            mlx_rs::transforms::eval(std::iter::once(&row).chain(cache.state()))?;
            last = Some(row);
        }
        let row = last.ok_or(EngineError::EmptyPrompt)?;
        let logprobs = row.subtract(row.logsumexp_axis(-1, true)?)?;
        to_host(&logprobs)
    }

    fn forward(&mut self, ids: &[u32], cache: &mut ModelCache) -> Result<Array, EngineError> {
        self.stats.forward_passes += 1;
        let tokens = Array::from_slice(ids, &[1, ids.len() as i32]);
        Ok(self.model.forward(&tokens, cache, &[])?.logits)
    }
}

/// `log_softmax(logits)[targets]` in f32: `[1, L, V]` logits, `L` targets → `[L]`.
fn gather_logprobs(logits: &Array, targets: &[u32]) -> Result<Array, EngineError> {
    let logits = logits.as_dtype(Dtype::Float32)?;
    let len = targets.len() as i32;
    let index = Array::from_slice(targets, &[1, len, 1]);
    let picked = logits.take_along_axis(&index, -1)?;
    let normalizer = logits.logsumexp_axis(-1, true)?;
    Ok(picked.subtract(normalizer)?.reshape(&[len])?)
}

/// The log-probabilities on the host; a NaN among them is a broken model, never a score.
fn to_host(values: &Array) -> Result<Vec<f32>, EngineError> {
    let values = values.as_dtype(Dtype::Float32)?.reshape(&[-1])?;
    values.eval()?;
    let values = values
        .try_as_slice::<f32>()
        .map_err(|e| EngineError::Mlx(e.to_string()))?
        .to_vec();
    match values
        .iter()
        .position(|v| v.is_nan() || *v == f32::INFINITY)
    {
        Some(position) => Err(EngineError::NonFiniteLogits {
            position,
            what: "counted from the first scored token",
        }),
        None => Ok(values),
    }
}

fn mismatched(measure: &Measure) -> EngineError {
    EngineError::Invalid(format!(
        "internal: a cached {} result has another measure's shape",
        measure.name()
    ))
}
