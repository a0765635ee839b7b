//! Lossless acceptance of a round's drafts against the target's verify logits: which
//! drafts are kept and the token the target adds after them, with one host read a round.
//!
//! Greedy: the longest prefix of drafts equal to the target's argmax, then its argmax.
//! Sampling (rejection sampling, on the device): draft d_i is kept with probability
//! min(1, p_i(d_i) / q_i(d_i)); at the first rejection the target's token is drawn from
//! max(0, p_i − q_i) renormalised, and after a full accept the bonus from p_k. p is the
//! target's processed distribution, q the drafter's (one-hot at the draft when the
//! drafter has none, where max(0, p − q) is p without the draft). The output then has
//! exactly the target's distribution.

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::ops::{concatenate, maximum, select, softmax_axis};
use mlx_rs::random::uniform;
use mlx_rs::{Array, Dtype};

use dspec_plugin_api::Draft;

use crate::decoding::sampling::{argmax_ids, host_ids, Sampler};
use crate::error::EngineError;

/// What a round keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Accepted {
    /// Drafts kept, a prefix of the round's drafts.
    pub drafts: usize,
    /// The target's own token after them.
    pub token: u32,
}

/// Greedy acceptance of `draft` against `logits` (`[drafts + 1, V]`). Drafts still on the
/// device are read with the target's argmax, in one wait.
pub fn accept_greedy(logits: &Array, draft: &mut Draft) -> Result<Accepted, EngineError> {
    let target = argmax_ids(logits)?;
    mlx_rs::transforms::eval(std::iter::once(&target).chain(&draft.on_device))?;
    greedy_prefix(&host_ids(&target)?, draft.read()?)
}

/// Greedy acceptance of `drafts` against the target's argmax at every position fed
/// (`target`: one more than the drafts).
pub fn greedy_prefix(target: &[u32], drafts: &[u32]) -> Result<Accepted, EngineError> {
    let kept = drafts
        .iter()
        .zip(target)
        .take_while(|(d, t)| d == t)
        .count();
    let token = *target.get(kept).ok_or_else(|| {
        EngineError::Mlx(format!(
            "verify logits have {} rows for {} drafts",
            target.len(),
            drafts.len()
        ))
    })?;
    Ok(Accepted {
        drafts: kept,
        token,
    })
}

/// Rejection sampling of `drafts` against `logits` (`[drafts + 1, V]`), on the device.
/// `q`: the drafter's distributions, `[drafts, V]`, or `None` for one-hot drafts. The
/// acceptance uniforms and the final draw use the sampler's key stream.
pub fn accept_sampled(
    logits: &Array,
    drafts: &[u32],
    q: Option<&Array>,
    sampler: &mut Sampler,
) -> Result<Accepted, EngineError> {
    let processed = sampler.process(logits)?;
    let k = drafts.len() as i32;
    if k == 0 {
        let token = host_ids(&sampler.draw(&processed)?)?;
        return Ok(Accepted {
            drafts: 0,
            token: token[0],
        });
    }
    let vocab = processed.shape().last().copied().unwrap_or(0);
    if let Some(q) = q {
        if q.shape() != [k, vocab] {
            return Err(EngineError::Invalid(format!(
                "the drafter's probabilities have shape {:?}, expected [{k}, {vocab}] (one row per draft over the target's vocabulary)",
                q.shape()
            )));
        }
    }
    let p = softmax_axis(&processed, -1, true)?;
    let at = Array::from_slice(drafts, &[k, 1]);
    let p_drafted = p.try_index((..k, ..))?;
    let pd = p_drafted.take_along_axis(&at, -1)?;
    let (qd, residual) = match q {
        Some(q) => (
            q.take_along_axis(&at, -1)?,
            maximum(p_drafted.subtract(q)?, Array::from_f32(0.0))?,
        ),
        None => (
            Array::from_f32(1.0),
            p_drafted.put_along_axis(&at, Array::from_f32(0.0), -1)?,
        ),
    };
    let key = sampler.next_key()?;
    let u = uniform::<_, f32>(0.0f32, 1.0f32, &[k, 1][..], &key)?;
    // u < p/q without the division: q(d) = 0 (a drafter that drew a token it gave no
    // mass) then keeps d whenever p(d) > 0, as min(1, p/0) says.
    let kept = u.multiply(&qd)?.lt(&pd)?;
    // Drafts kept: the leading run of accepts.
    let accepted = kept
        .as_dtype(Dtype::Int32)?
        .cumprod(0, None, None)?
        .sum(None)?
        .reshape(&[1])?;
    // The row the target's token comes from: the first rejected draft's residual, or p
    // after the last draft (the bonus).
    let rows = concatenate(&[residual, p.try_index((k.., ..))?], 0)?;
    let row = rows.take_axis(&accepted, 0)?;
    // Rounding can leave a residual without mass (p = q): draw from p then, as the
    // exact arithmetic would never need to.
    let has_mass = row.sum_axis(-1, true)?.gt(Array::from_f32(0.0))?;
    let row = select(&has_mass, &row, p.take_axis(&accepted, 0)?)?;
    let token = sampler.draw(&row.log()?)?;
    let both = host_ids(&concatenate(
        &[accepted.as_dtype(Dtype::Uint32)?, token],
        0,
    )?)?;
    Ok(Accepted {
        drafts: both[0] as usize,
        token: both[1],
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decoding::sampling::{probabilities, SamplingParams};

    fn sampler(seed: u64) -> Sampler {
        Sampler::new(SamplingParams {
            temperature: 1.0,
            seed: Some(seed),
            ..SamplingParams::default()
        })
    }

    fn host_draft(tokens: &[u32]) -> Draft {
        Draft {
            tokens: tokens.to_vec(),
            ..Draft::default()
        }
    }

    /// Logits whose softmax is `probs` (rows of a tiny vocabulary).
    fn logits_of(rows: &[&[f32]]) -> Array {
        let vocab = rows[0].len();
        let flat: Vec<f32> = rows.iter().flat_map(|r| r.iter().map(|p| p.ln())).collect();
        Array::from_slice(&flat, &[rows.len() as i32, vocab as i32])
    }

    #[test]
    fn greedy_keeps_the_matching_prefix_and_adds_the_argmax() {
        let logits = logits_of(&[&[0.1, 0.7, 0.2], &[0.6, 0.3, 0.1], &[0.2, 0.2, 0.6]]);
        let got = accept_greedy(&logits, &mut host_draft(&[1, 2])).unwrap();
        assert_eq!(
            got,
            Accepted {
                drafts: 1,
                token: 0
            }
        );
        let got = accept_greedy(&logits, &mut host_draft(&[1, 0])).unwrap();
        assert_eq!(
            got,
            Accepted {
                drafts: 2,
                token: 2
            }
        );
    }

    /// A draft the target gives all the mass is always kept; one it gives none never is,
    /// and the replacement never is the rejected draft (one-hot residual).
    #[test]
    fn certain_and_impossible_drafts() {
        let logits = logits_of(&[&[0.0, 1.0, 0.0], &[0.5, 0.0, 0.5]]);
        let mut s = sampler(3);
        for _ in 0..50 {
            let got = accept_sampled(&logits, &[1], None, &mut s).unwrap();
            assert_eq!(got.drafts, 1);
            assert_ne!(got.token, 1, "p gives token 1 no mass after the draft");
        }
        let logits = logits_of(&[&[0.5, 0.0, 0.5], &[1.0, 0.0, 0.0]]);
        for _ in 0..50 {
            let got = accept_sampled(&logits, &[1], None, &mut s).unwrap();
            assert_eq!(got.drafts, 0);
            assert_ne!(got.token, 1);
        }
    }

    /// One round, one draft, against the closed form: with p and q over three tokens,
    /// the committed token is distributed as p whatever q is, and d is kept with
    /// probability sum over d of q(d) min(1, p(d)/q(d)).
    #[test]
    fn one_draft_rounds_commit_tokens_distributed_as_p() {
        let p = [0.5f32, 0.3, 0.2];
        let q = [0.2f32, 0.2, 0.6];
        let n = 20_000;
        let logits = logits_of(&[&p, &[1.0 / 3.0; 3]]);
        let q_rows = Array::from_slice(&q, &[1, 3]);
        let mut s = sampler(11);
        let mut counts = [0usize; 3];
        let mut kept = 0;
        // The draft is drawn from q on the host, so the test does not trust the device
        // sampler it checks.
        let mut stream = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        use rand::{Rng, SeedableRng};
        for _ in 0..n {
            let u: f32 = stream.random();
            let d = if u < q[0] {
                0
            } else if u < q[0] + q[1] {
                1
            } else {
                2
            };
            let got = accept_sampled(&logits, &[d], Some(&q_rows), &mut s).unwrap();
            let first = if got.drafts == 1 { d } else { got.token };
            counts[first as usize] += 1;
            kept += got.drafts;
        }
        let expected_kept: f32 = p.iter().zip(&q).map(|(p, q)| p.min(*q)).sum();
        let sd = (0.25 / n as f64).sqrt();
        assert!(
            (kept as f64 / n as f64 - f64::from(expected_kept)).abs() < 4.0 * sd,
            "kept {kept} of {n}, expected {expected_kept}"
        );
        for (i, (&c, &pi)) in counts.iter().zip(&p).enumerate() {
            let pi = f64::from(pi);
            let tolerance = 4.0 * (pi * (1.0 - pi) / n as f64).sqrt();
            assert!(
                (c as f64 / n as f64 - pi).abs() < tolerance,
                "token {i}: {c} of {n} vs {pi}"
            );
        }
    }

    /// The bonus after a full accept comes from the last row's processed distribution.
    #[test]
    fn full_accept_draws_the_bonus_from_the_last_row() {
        let params = SamplingParams {
            temperature: 1.0,
            top_k: 2,
            seed: Some(9),
            ..SamplingParams::default()
        };
        let last = [0.1f32, 0.2, 0.3, 0.4];
        let logits = logits_of(&[&[0.0, 1.0, 0.0, 0.0], &last]);
        let reference = probabilities(
            &[0.1f32.ln(), 0.2f32.ln(), 0.3f32.ln(), 0.4f32.ln()],
            &params,
        );
        let mut s = Sampler::new(params);
        let mut counts = [0usize; 4];
        let n = 4000;
        for _ in 0..n {
            let got = accept_sampled(&logits, &[1], None, &mut s).unwrap();
            assert_eq!(got.drafts, 1);
            counts[got.token as usize] += 1;
        }
        assert_eq!(
            counts[0] + counts[1],
            0,
            "top-k 2 keeps tokens 2 and 3 only"
        );
        let share = counts[3] as f64 / n as f64;
        assert!((share - f64::from(reference[3])).abs() < 0.04, "{counts:?}");
    }

    #[test]
    fn probabilities_of_the_wrong_shape_are_an_error() {
        let logits = logits_of(&[&[0.5, 0.5], &[0.5, 0.5]]);
        let q = Array::from_slice(&[0.5f32, 0.5, 0.0], &[1, 3]);
        let err = accept_sampled(&logits, &[0], Some(&q), &mut sampler(1)).unwrap_err();
        assert!(err.to_string().contains("shape"), "{err}");
    }
}
