//! Log-probabilities of generated tokens, and of the likeliest alternatives, under the
//! target's own distribution: a server's `logprobs` / `top_logprobs`.
//!
//! They are the model's: the log-softmax of its logits before temperature, top-k or
//! top-p (as vLLM reports them by default), so they do not depend on how the token was
//! picked. Under speculation a verify's rows give them for every token it commits.

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::ops::{argpartition_axis, negative};
use mlx_rs::{Array, Dtype};
use serde::Serialize;

use crate::error::EngineError;

/// Most alternatives a request may ask for (OpenAI's limit for `top_logprobs`).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// One generated token's log-probability, and the `top` likeliest tokens at its position
/// (most likely first).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// The log-probabilities of `tokens[i]` under row `i` of `logits` (`[n, vocab]`), and
/// each row's `top` likeliest tokens. One read from the device for all rows.
pub fn token_logprobs(
    logits: &Array,
    tokens: &[u32],
    top: usize,
) -> Result<Vec<TokenLogprob>, EngineError> {
    let rows = tokens.len() as i32;
    let vocab = logits.shape().last().copied().unwrap_or(0);
    if rows == 0 {
        return Ok(Vec::new());
    }
    let logits = logits
        .reshape(&[-1, vocab])?
        .try_index((..rows, ..))?
        .as_dtype(Dtype::Float32)?;
    let logprobs = logits.subtract(logits.logsumexp_axis(-1, true)?)?;
    let at = Array::from_slice(tokens, &[rows, 1]);
    let chosen = logprobs.take_along_axis(&at, -1)?;
    let top = top.min(vocab as usize);
    let alternatives = match top {
        0 => None,
        k => {
            // The k largest, unordered: a partition, not a sort of the vocabulary.
            let ids = argpartition_axis(negative(&logprobs)?, k as i32 - 1, -1)?
                .try_index((.., ..k as i32))?
                .as_dtype(Dtype::Uint32)?
                .contiguous()?;
            let values = logprobs.take_along_axis(&ids, -1)?;
            Some((ids, values))
        }
    };
    let mut outputs = vec![&chosen];
    if let Some((ids, values)) = &alternatives {
        outputs.extend([ids, values]);
    }
    mlx_rs::transforms::eval(outputs)?;
    let read = |a: &Array| -> Result<Vec<f32>, EngineError> {
        Ok(a.try_as_slice::<f32>()
            .map_err(|e| EngineError::Invalid(format!("reading log-probabilities: {e}")))?
            .to_vec())
    };
    let chosen = read(&chosen)?;
    let alternatives = match &alternatives {
        Some((ids, values)) => Some((
            ids.try_as_slice::<u32>()
                .map_err(|e| EngineError::Invalid(format!("reading token ids: {e}")))?
                .to_vec(),
            read(values)?,
        )),
        None => None,
    };
    Ok(tokens
        .iter()
        .enumerate()
        .map(|(i, &token)| {
            let mut top: Vec<(u32, f32)> = match &alternatives {
                Some((ids, values)) => ids[i * top..(i + 1) * top]
                    .iter()
                    .copied()
                    .zip(values[i * top..(i + 1) * top].iter().copied())
                    .collect(),
                None => Vec::new(),
            };
            top.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            TokenLogprob {
                token,
                logprob: chosen[i],
                top,
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Log-softmax computed on the host, in f64.
    fn reference(row: &[f32]) -> Vec<f64> {
        let max = row.iter().fold(f32::MIN, |m, &x| m.max(x)) as f64;
        let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
        row.iter().map(|&x| x as f64 - max - sum.ln()).collect()
    }

    #[test]
    fn chosen_and_top_tokens_match_a_host_log_softmax() {
        let rows: Vec<Vec<f32>> = vec![
            (0..50)
                .map(|i| ((i * 37) % 50) as f32 * 0.1 - 2.0)
                .collect(),
            (0..50)
                .map(|i| ((i * 11) % 50) as f32 * -0.3 + 1.0)
                .collect(),
        ];
        let flat: Vec<f32> = rows.concat();
        let logits = Array::from_slice(&flat, &[1, 2, 50])
            .as_dtype(Dtype::Bfloat16)
            .unwrap();
        // The same values as the device sees them (bf16).
        let seen = logits.as_dtype(Dtype::Float32).unwrap();
        let seen: Vec<f32> = seen.as_slice::<f32>().to_vec();
        let got = token_logprobs(&logits, &[7, 42], 5).unwrap();
        for (i, entry) in got.iter().enumerate() {
            let want = reference(&seen[i * 50..(i + 1) * 50]);
            assert!((entry.logprob as f64 - want[entry.token as usize]).abs() < 1e-4);
            let mut order: Vec<usize> = (0..50).collect();
            order.sort_by(|&a, &b| want[b].total_cmp(&want[a]).then(a.cmp(&b)));
            let ids: Vec<u32> = entry.top.iter().map(|t| t.0).collect();
            let expected: Vec<u32> = order[..5].iter().map(|&t| t as u32).collect();
            // Ties may pick either id; their values must agree.
            for ((id, lp), want_id) in entry.top.iter().zip(&expected) {
                assert!(
                    (*lp as f64 - want[*want_id as usize]).abs() < 1e-4,
                    "{ids:?}"
                );
                assert!((*lp as f64 - want[*id as usize]).abs() < 1e-4);
            }
        }
    }

    #[test]
    fn no_alternatives_when_none_are_asked_for() {
        let logits = Array::from_slice(&[0.0f32, 1.0, 2.0], &[1, 3]);
        let got = token_logprobs(&logits, &[2], 0).unwrap();
        assert!(got[0].top.is_empty());
        let want = reference(&[0.0, 1.0, 2.0])[2];
        assert!((got[0].logprob as f64 - want).abs() < 1e-6);
        assert!(token_logprobs(&logits, &[], 3).unwrap().is_empty());
    }
}
