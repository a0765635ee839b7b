//! What a drafter is trained to minimise, per drafter kind, over a step's sequences.
//!
//! Every prediction is weighted `exp(−(k−1)/γ)` by its place k in the block: a draft
//! counts only if every one before it was kept, so early positions matter most.

use mlx_rs::ops::indexing::{argmax_axis, take_along_axis};
use mlx_rs::ops::{abs, concatenate, logaddexp, logsumexp_axis, matmul, maximum};
use mlx_rs::stop_gradient;
use mlx_rs::{Array, Dtype};

use dspec_plugin_api::TargetModel;

use super::batch::{predicted_rows, BlockLayout, Prepared};
use super::net::{
    block_hidden, param, NetShape, Params, CONFIDENCE_BIAS, CONFIDENCE_WEIGHT, MARKOV_W1, MARKOV_W2,
};
use crate::error::EngineError;

type Result<T> = std::result::Result<T, EngineError>;

/// A step's loss and what the progress line reports, as lazy scalars.
pub struct StepValues {
    /// Weighted mean loss: what autograd differentiates.
    pub loss: Array,
    /// Weighted count of predictions whose argmax is the label.
    pub correct: Array,
    /// Sum of the weights (the loss's denominator).
    pub weight: Array,
}

/// The weighted mean over `sequences` of a per-row loss, with the weighted count of rows
/// whose argmax is the label: `rows_of` gives each sequence's per-row loss and the
/// logits it drafted from.
fn weighted_mean(
    sequences: &[Prepared],
    mut rows_of: impl FnMut(&Prepared) -> Result<(Array, Array)>,
) -> Result<StepValues> {
    let mut total = Array::from_f32(0.0);
    let mut correct = Array::from_f32(0.0);
    let mut weight = Array::from_f32(0.0);
    for seq in sequences {
        let (loss, logits) = rows_of(seq)?;
        total = total.add(loss.multiply(&seq.weights)?.sum(None)?)?;
        weight = weight.add(seq.weights.sum(None)?)?;
        correct = correct.add(hits(&logits, seq)?)?;
    }
    Ok(StepValues {
        loss: total.divide(maximum(&weight, Array::from_f32(1e-9))?)?,
        correct: stop_gradient(&correct)?,
        weight,
    })
}

/// The target's head over the drafter's rows, in f32 (the rows meet the head in the
/// target's dtype; autograd carries the gradient back through the cast).
fn target_head(target: &dyn TargetModel, rows: &Array) -> Result<Array> {
    Ok(target
        .lm_head(&rows.as_dtype(target.info().dtype)?)?
        .as_dtype(Dtype::Float32)?)
}

/// DFlash: cross-entropy of the target's head over the drafter's block rows, against
/// the label token (or the target's distribution, for text).
pub fn dflash(
    params: &Params,
    shape: &NetShape,
    layout: &BlockLayout,
    target: &dyn TargetModel,
    sequences: &[Prepared],
) -> Result<StepValues> {
    weighted_mean(sequences, |seq| {
        let rows = predicted_rows(&block_hidden(params, shape, &seq.inputs)?, layout)?;
        let logits = target_head(target, &rows)?;
        Ok((cross_entropy(&logits, seq)?, logits))
    })
}

/// DeepSpec's weights of the cross-entropy and total-variation terms.
const DSPARK_CE: f32 = 0.1;
const DSPARK_TV: f32 = 0.9;

/// The logits DSpark drafts from at the predicted block rows (`[N · B, H]`, normed):
/// the target's head plus the Markov head's correction from each row's previous token
/// (the true one: training is teacher-forced). Also returns the Markov embeddings of
/// the previous tokens, which the confidence head reads.
pub fn dspark_logits(
    params: &Params,
    rows: &Array,
    previous: &Array,
    target: &dyn TargetModel,
) -> Result<(Array, Array)> {
    let markov = param(params, MARKOV_W1)?.take_axis(previous, 0)?;
    let correction = matmul(&markov, param(params, MARKOV_W2)?.t())?;
    Ok((target_head(target, rows)?.add(correction)?, markov))
}

/// DSpark (paper section 3.3): 0.1 × cross-entropy + 0.9 × total variation between the
/// draft and target distributions, plus the confidence head's binary cross-entropy
/// against each row's acceptance probability 1 − TV/2, all weighted by block position.
pub fn dspark(
    params: &Params,
    shape: &NetShape,
    layout: &BlockLayout,
    target: &dyn TargetModel,
    sequences: &[Prepared],
) -> Result<StepValues> {
    weighted_mean(sequences, |seq| {
        let p = seq.distributions.as_ref().ok_or_else(|| {
            EngineError::Invalid("DSpark's loss needs the target's distributions".into())
        })?;
        let rows = predicted_rows(&block_hidden(params, shape, &seq.inputs)?, layout)?;
        let (logits, markov) = dspark_logits(params, &rows, &seq.previous, target)?;
        let ce = cross_entropy(&logits, seq)?;
        let q = mlx_rs::ops::softmax_axis(&logits, -1, true)?;
        let tv = abs(q.subtract(p)?)?.sum_axis(-1, false)?;
        let accepted =
            stop_gradient(Array::from_f32(1.0).subtract(tv.multiply(Array::from_f32(0.5))?)?)?;
        let features = concatenate(&[rows, markov], -1)?;
        let z = matmul(&features, param(params, CONFIDENCE_WEIGHT)?.t())?
            .add(param(params, CONFIDENCE_BIAS)?)?
            .reshape(&[-1])?;
        // −[a·log σ(z) + (1−a)·log(1−σ(z))], with log σ(z) = −log(1 + e^−z).
        let zero = Array::from_f32(0.0);
        let bce = accepted.multiply(logaddexp(&zero, z.negative()?)?)?.add(
            Array::from_f32(1.0)
                .subtract(&accepted)?
                .multiply(logaddexp(&zero, &z)?)?,
        )?;
        let per_row = ce
            .multiply(Array::from_f32(DSPARK_CE))?
            .add(tv.multiply(Array::from_f32(DSPARK_TV))?)?
            .add(bce)?;
        Ok((per_row, logits))
    })
}

/// Per row: −log q(label), or −Σ p·log q against the target's distribution p.
fn cross_entropy(logits: &Array, seq: &Prepared) -> Result<Array> {
    let lse = logsumexp_axis(logits, -1, false)?;
    match (&seq.distributions, seq.soft_labels) {
        (Some(p), true) => Ok(lse.subtract(p.multiply(logits)?.sum_axis(-1, false)?)?),
        _ => {
            let labels = seq.labels.as_dtype(Dtype::Int32)?.reshape(&[-1, 1])?;
            let picked = take_along_axis(logits, &labels, -1)?.reshape(&[-1])?;
            Ok(lse.subtract(picked)?)
        }
    }
}

/// Weighted count of rows whose argmax is the label.
fn hits(logits: &Array, seq: &Prepared) -> Result<Array> {
    let top = argmax_axis(stop_gradient(logits)?, -1, false)?;
    let same = top.eq(seq.labels.as_dtype(top.dtype())?)?;
    Ok(same
        .as_dtype(Dtype::Float32)?
        .multiply(&seq.weights)?
        .sum(None)?)
}
