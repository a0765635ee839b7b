//! Choosing tokens, the one place that does: the exact distribution a request draws from
//! (temperature, top-k, top-p, min-p), computed on the host as the reference and on the
//! device by a seeded sampler; the argmax; and the picks plain decoding, the drafter and
//! lossless speculative acceptance make with them.

use mlx_rs::ops::indexing::{argmax_axis, TryIndexOp};
use mlx_rs::ops::{maximum, partition_axis, select, softmax_axis, sort_axis};
use mlx_rs::random::categorical;
use mlx_rs::{Array, Dtype};
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

use dspec_plugin_api::error::Result as ModelResult;
use dspec_plugin_api::{ModelError, Picked, TokenPicker};

use crate::error::EngineError;

/// Serialized when rank 0 of a serving group sends a job to the other ranks.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplingParams {
    /// 0 (or less) means greedy.
    pub temperature: f32,
    /// Keep only the k most likely tokens; 0 = off.
    pub top_k: usize,
    /// Keep the smallest most-likely set with at least this mass; 1.0 = off.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one; 0.0 = off.
    pub min_p: f32,
    /// Fixed seed for reproducible sampling; `None` seeds from the OS.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
        }
    }
}

/// The most tokens top-k may keep (0 = off); any vocabulary fits under it.
pub const MAX_TOP_K: usize = 1_000_000;

/// The least temperature above 0: below it, logits times 1 / temperature can overflow
/// to infinity and the distribution is lost (0 gives greedy decoding, which is the limit).
pub const MIN_TEMPERATURE: f32 = 1e-3;
/// The most temperature: far past the point where sampling is uniform.
pub const MAX_TEMPERATURE: f32 = 100.0;

/// A sampling setting outside its range, named by its field (`top_p`), with the range.
#[derive(Debug, Clone, PartialEq)]
pub struct OutOfRange {
    pub field: &'static str,
    pub range: String,
    pub got: String,
}

impl SamplingParams {
    pub fn is_greedy(&self) -> bool {
        self.temperature.is_nan() || self.temperature <= 0.0
    }

    /// The first setting outside the range it can work in, if any: the command line and
    /// the server both check through this, so they take the same values.
    pub fn out_of_range(&self) -> Option<OutOfRange> {
        let t = self.temperature;
        let fields = [
            (
                "temperature",
                t == 0.0 || (MIN_TEMPERATURE..=MAX_TEMPERATURE).contains(&t),
                format!("0 (greedy) or from {MIN_TEMPERATURE} to {MAX_TEMPERATURE}"),
                format!("{t:?}"),
            ),
            (
                "top_k",
                self.top_k <= MAX_TOP_K,
                format!("from 0 (off) to {MAX_TOP_K}"),
                self.top_k.to_string(),
            ),
            (
                "top_p",
                self.top_p > 0.0 && self.top_p <= 1.0,
                "in (0, 1] (1 = off)".to_string(),
                format!("{:?}", self.top_p),
            ),
            (
                "min_p",
                (0.0..1.0).contains(&self.min_p),
                "in [0, 1) (0 = off)".to_string(),
                format!("{:?}", self.min_p),
            ),
        ];
        fields
            .into_iter()
            .find(|(_, within, _, _)| !within)
            .map(|(field, _, range, got)| OutOfRange { field, range, got })
    }
}

/// Index of the largest logit; ties go to the lowest id, NaN never wins.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best: Option<(usize, f32)> = None;
    for (i, &x) in logits.iter().enumerate() {
        if x.is_nan() {
            continue;
        }
        if best.is_none_or(|(_, b)| x > b) {
            best = Some((i, x));
        }
    }
    best.map_or(0, |(i, _)| i as u32)
}

fn one_hot(len: usize, index: u32) -> Vec<f32> {
    let mut probs = vec![0.0; len];
    if let Some(p) = probs.get_mut(index as usize) {
        *p = 1.0;
    }
    probs
}

/// The distribution the sampler draws from for these logits, zeros outside the kept set.
///
/// softmax(logits / temperature) in f64, then top-k, then top-p on the renormalised
/// top-k set, then min-p, renormalised at the end. Greedy gives a one-hot on [`argmax`].
/// Ties in rank (for top-k/top-p) are broken towards the lower id.
pub fn probabilities(logits: &[f32], params: &SamplingParams) -> Vec<f32> {
    if logits.is_empty() {
        return Vec::new();
    }
    if params.is_greedy() {
        return one_hot(logits.len(), argmax(logits));
    }
    let temperature = f64::from(params.temperature);
    let scaled: Vec<f64> = logits
        .iter()
        .map(|&x| {
            if x.is_nan() {
                f64::NEG_INFINITY
            } else {
                f64::from(x) / temperature
            }
        })
        .collect();
    let max = scaled.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let mut probs: Vec<f64> = if max == f64::INFINITY {
        // Infinite logits share all the mass.
        scaled
            .iter()
            .map(|&s| if s == f64::INFINITY { 1.0 } else { 0.0 })
            .collect()
    } else if max == f64::NEG_INFINITY {
        return one_hot(logits.len(), argmax(logits));
    } else {
        scaled.iter().map(|&s| (s - max).exp()).collect()
    };

    let mut order: Vec<usize> = (0..probs.len()).collect();
    // Stable sort keeps lower ids first among equal probabilities.
    order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));

    if params.top_k > 0 && params.top_k < probs.len() {
        for &i in &order[params.top_k..] {
            probs[i] = 0.0;
        }
    }

    let top_p = f64::from(params.top_p);
    if top_p < 1.0 {
        let threshold = top_p * probs.iter().sum::<f64>();
        let mut mass = 0.0;
        let mut reached = false;
        for &i in &order {
            if reached {
                probs[i] = 0.0;
            } else if probs[i] > 0.0 {
                mass += probs[i];
                reached = mass >= threshold;
            }
        }
    }

    let min_p = f64::from(params.min_p);
    if min_p > 0.0 {
        // The ratio to the top probability does not depend on normalisation.
        let cutoff = min_p * probs[order[0]];
        for p in probs.iter_mut() {
            if *p < cutoff {
                *p = 0.0;
            }
        }
    }

    let total: f64 = probs.iter().sum();
    probs.iter().map(|&p| (p / total) as f32).collect()
}

/// The device side of sampling: turns logits into the processed distribution and draws
/// from it as MLX ops, so a step sends one token id to the host instead of the whole
/// vocabulary, and a draw can stay lazy while the next step's graph is built on it.
///
/// Semantics are [`probabilities`']: softmax(logits / temperature), then top-k, then
/// top-p on the renormalised top-k set, then min-p, renormalised. Each filter becomes a
/// cutoff on the scaled logits (a token is kept when its logit is at least the cutoff),
/// which costs a sort (a partition and a sort of k for top-k) instead of a scatter back
/// to vocabulary order. Where the host breaks ties in rank towards the lower id, the
/// device keeps every token whose value equals the cutoff's exactly: the two differ only
/// at exactly equal values. NaN and +inf logits are not sanitised on the device (the
/// host treats NaN as -inf and lets +inf share all the mass): a model emitting them is
/// broken either way.
///
/// Randomness: one MLX PRNG key per draw, each made on the host from a ChaCha8 stream
/// seeded by `seed` (from the OS, once, without one), so a seeded run is reproducible
/// and making a key adds nothing to the graph.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    keys: ChaCha8Rng,
}

/// top-p's cutoff keeps a token while the mass ranked above it is below `top_p`; the
/// most likely token has nothing above it and must stay even for `top_p = 0`.
const LEAST_TOP_P: f32 = f32::MIN_POSITIVE;

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let keys = match params.seed {
            Some(seed) => ChaCha8Rng::seed_from_u64(seed),
            None => ChaCha8Rng::from_os_rng(),
        };
        Self { params, keys }
    }

    /// A sampler for `params`, or `None` under greedy decoding (which picks the argmax).
    pub fn unless_greedy(params: &SamplingParams) -> Option<Self> {
        (!params.is_greedy()).then(|| Self::new(params.clone()))
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// A fresh MLX PRNG key (`[2]` uint32, a constant: no device work).
    pub fn next_key(&mut self) -> Result<Array, EngineError> {
        Ok(mlx_rs::random::key(self.keys.next_u64())?)
    }

    /// `[rows, vocab]` logits → the scaled logits (f32) with `-inf` outside the kept set:
    /// the log of the processed distribution up to a per-row constant. Stages that are
    /// off add nothing to the graph. Greedy parameters give the logits unscaled.
    pub fn process(&self, logits: &Array) -> Result<Array, EngineError> {
        let p = &self.params;
        let x = logits.as_dtype(Dtype::Float32)?;
        if p.is_greedy() {
            return Ok(x);
        }
        let x = if p.temperature == 1.0 {
            x
        } else {
            x.multiply(Array::from_f32(1.0 / p.temperature))?
        };
        let vocab = x.shape().last().copied().unwrap_or(0);
        let top_k = i32::try_from(p.top_k).ok().filter(|&k| k > 0 && k < vocab);
        let top_p = p.top_p < 1.0;
        let mut cutoff = match (top_k, top_p) {
            (None, false) => None,
            // top-k alone: the cutoff is the k-th largest logit, where a partition puts it.
            (Some(k), false) => {
                Some(partition_axis(&x, vocab - k, -1)?.try_index((.., vocab - k..vocab - k + 1))?)
            }
            (top_k, true) => {
                // The candidates in ascending order: the top k (a partition puts them
                // last, so only k values are sorted), or the whole row.
                let sorted = match top_k {
                    Some(k) => sort_axis(
                        partition_axis(&x, vocab - k, -1)?.try_index((.., vocab - k..))?,
                        -1,
                    )?,
                    None => sort_axis(&x, -1)?,
                };
                // The mass ranked above each candidate (a reverse exclusive cumulative
                // sum over the renormalised candidates); the smallest value kept is the
                // cutoff.
                let above = softmax_axis(&sorted, -1, true)?.cumsum(-1, true, false)?;
                let keep = above.lt(Array::from_f32(p.top_p.max(LEAST_TOP_P)))?;
                Some(select(&keep, &sorted, Array::from_f32(f32::INFINITY))?.min_axis(-1, true)?)
            }
        };
        if p.min_p > 0.0 {
            // p / p_max < min_p ⇔ logit < max logit + ln(min_p); capped at the top so
            // the most likely token always stays.
            let floor = x
                .max_axis(-1, true)?
                .add(Array::from_f32(p.min_p.min(1.0).ln()))?;
            cutoff = Some(match cutoff {
                Some(c) => maximum(c, floor)?,
                None => floor,
            });
        }
        Ok(match cutoff {
            Some(c) => select(x.ge(&c)?, &x, Array::from_f32(f32::NEG_INFINITY))?,
            None => x,
        })
    }

    /// `[rows, vocab]` logits → the processed distribution of each row (f32, sums to 1),
    /// on the device. Greedy parameters give a one-hot on the argmax.
    pub fn probabilities(&self, logits: &Array) -> Result<Array, EngineError> {
        if self.params.is_greedy() {
            let vocab = logits.shape().last().copied().unwrap_or(0);
            let best = argmax_axis(logits, -1, true)?;
            return Ok(Array::from_iter(0..vocab, &[1, vocab])
                .eq(&best)?
                .as_dtype(Dtype::Float32)?);
        }
        Ok(softmax_axis(self.process(logits)?, -1, true)?)
    }

    /// One token per row of `[rows, vocab]` logits, `[rows]` uint32, still lazy. Greedy
    /// parameters take the argmax without using a key.
    pub fn sample(&mut self, logits: &Array) -> Result<Array, EngineError> {
        if self.params.is_greedy() {
            return argmax_ids(logits);
        }
        let processed = self.process(logits)?;
        self.draw(&processed)
    }

    /// One token per row drawn from `[rows, vocab]` unnormalised log-weights (`-inf`:
    /// never drawn), `[rows]` uint32, with the next key.
    pub fn draw(&mut self, log_weights: &Array) -> Result<Array, EngineError> {
        let key = self.next_key()?;
        Ok(categorical(log_weights, -1, None, &key)?.as_dtype(Dtype::Uint32)?)
    }
}

/// Argmax of every row of `[.., V]` logits as uint32 ids, lazy (on the device).
pub fn argmax_ids(logits: &Array) -> Result<Array, EngineError> {
    Ok(argmax_axis(logits, -1, false)?.as_dtype(Dtype::Uint32)?)
}

/// Argmax of every row of `[.., V]` logits, on the host (one sync for all rows).
pub fn argmax_all(logits: &Array) -> Result<Vec<u32>, EngineError> {
    host_ids(&argmax_ids(logits)?)
}

/// Reads a small uint32 array to the host (one sync).
pub(crate) fn host_ids(ids: &Array) -> Result<Vec<u32>, EngineError> {
    ids.eval()?;
    Ok(ids
        .try_as_slice::<u32>()
        .map_err(|e| EngineError::Mlx(e.to_string()))?
        .to_vec())
}

/// Reads one token to the host.
pub(crate) fn token_value(token: &Array) -> Result<u32, EngineError> {
    token
        .try_item_cast::<u32>()
        .map_err(|e| EngineError::Mlx(e.to_string()))
}

/// The next token from `[1, vocab]` logits as a lazy `[1, 1]` uint32 array: the argmax
/// without a sampler, else a draw. On the device either way, so the next step's graph
/// can be built on the token before it is known.
pub(crate) fn pick_next(
    sampler: Option<&mut Sampler>,
    logits: &Array,
) -> Result<Array, EngineError> {
    let token = match sampler {
        None => argmax_ids(logits)?,
        Some(sampler) => sampler.sample(logits)?,
    };
    Ok(token.reshape(&[1, 1])?)
}

/// The engine's [`TokenPicker`], what a drafter picks its drafts with: argmax on the
/// device under greedy decoding, else a draw from the same processed distribution the
/// target is sampled from, whose rows stay on the device as the drafter's q.
pub(crate) struct EnginePicker<'a> {
    pub(crate) sampler: Option<&'a mut Sampler>,
}

impl TokenPicker for EnginePicker<'_> {
    fn is_greedy(&self) -> bool {
        self.sampler.is_none()
    }

    fn pick(&mut self, logits: &Array) -> ModelResult<Picked> {
        let rows = as_rows(logits)?;
        match self.sampler.as_deref_mut() {
            None => Ok(Picked {
                tokens: argmax_all(&rows).map_err(to_model)?,
                probs: None,
            }),
            Some(sampler) => {
                let processed = sampler.process(&rows).map_err(to_model)?;
                let tokens = host_ids(&sampler.draw(&processed).map_err(to_model)?);
                Ok(Picked {
                    tokens: tokens.map_err(to_model)?,
                    probs: Some(softmax_axis(&processed, -1, true)?),
                })
            }
        }
    }

    fn pick_on_device(&mut self, logits: &Array) -> ModelResult<Option<Array>> {
        if self.sampler.is_some() {
            return Ok(None);
        }
        argmax_ids(&as_rows(logits)?).map(Some).map_err(to_model)
    }
}

/// Logits of any leading shape as `[rows, vocab]`.
fn as_rows(logits: &Array) -> ModelResult<Array> {
    let vocab = logits.shape().last().copied().unwrap_or(0);
    Ok(logits.reshape(&[-1, vocab])?)
}

/// A drafter's picker answers in the plugin contract's error type.
fn to_model(e: EngineError) -> ModelError {
    ModelError::Unsupported(e.to_string())
}

// The tests sit beside this file: with them it would be too long to read at once.
#[cfg(test)]
mod tests;
