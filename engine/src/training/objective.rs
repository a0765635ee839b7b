//! What a drafter is trained to minimise, per drafter kind, over a pass of a step's
//! sequences.
//!
//! Every prediction is weighted `exp(−(k−1)/γ)` by its place k in the block: a draft
//! counts only if every one before it was kept, so early positions matter most.

use mlx_rs::ops::indexing::{argmax_axis, take_along_axis};
use mlx_rs::ops::{abs, concatenate, logaddexp, logsumexp_axis, matmul};
use mlx_rs::stop_gradient;
use mlx_rs::{Array, Dtype};

use dspec_plugin_api::TargetModel;

use super::batch::{predicted_rows, BlockLayout, Prepared};
use super::net::{
    block_hidden, param, NetShape, Params, CONFIDENCE_BIAS, CONFIDENCE_WEIGHT, MARKOV_W1, MARKOV_W2,
};
use crate::error::EngineError;

type Result<T> = std::result::Result<T, EngineError>;

/// A pass's share of a step's loss and of what the progress line reports, as lazy
/// scalars; the step divides both by its predictions' total weight.
pub struct StepValues {
    /// Weighted sum of the per-prediction losses: what autograd differentiates.
    pub loss: Array,
    /// Weighted count of predictions whose argmax is the label.
    pub correct: Array,
}

/// The weighted sum of a pass's per-row `loss`, with the weighted count of rows whose
/// argmax (of the `logits` they drafted from) is the label.
fn weighted_sum(batch: &Prepared, loss: &Array, logits: &Array) -> Result<StepValues> {
    Ok(StepValues {
        loss: loss.multiply(&batch.weights)?.sum(None)?,
        correct: stop_gradient(&hits(logits, batch)?)?,
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
    batch: &Prepared,
) -> Result<StepValues> {
    let rows = predicted_rows(&block_hidden(params, shape, &batch.inputs)?, layout)?;
    let logits = target_head(target, &rows)?;
    weighted_sum(batch, &cross_entropy(&logits, batch)?, &logits)
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
    batch: &Prepared,
) -> Result<StepValues> {
    let p = batch.distributions.as_ref().ok_or_else(|| {
        EngineError::Invalid("DSpark's loss needs the target's distributions".into())
    })?;
    let rows = predicted_rows(&block_hidden(params, shape, &batch.inputs)?, layout)?;
    let (logits, markov) = dspark_logits(params, &rows, &batch.previous, target)?;
    let ce = cross_entropy(&logits, batch)?;
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
    weighted_sum(batch, &per_row, &logits)
}

/// Per row: −log q(label), or −Σ p·log q against the target's distribution p.
fn cross_entropy(logits: &Array, batch: &Prepared) -> Result<Array> {
    let lse = logsumexp_axis(logits, -1, false)?;
    match (&batch.distributions, batch.soft_labels) {
        (Some(p), true) => Ok(lse.subtract(p.multiply(logits)?.sum_axis(-1, false)?)?),
        _ => {
            let labels = batch.labels.as_dtype(Dtype::Int32)?.reshape(&[-1, 1])?;
            let picked = take_along_axis(logits, &labels, -1)?.reshape(&[-1])?;
            Ok(lse.subtract(picked)?)
        }
    }
}

/// Weighted count of rows whose argmax is the label.
fn hits(logits: &Array, batch: &Prepared) -> Result<Array> {
    let top = argmax_axis(stop_gradient(logits)?, -1, false)?;
    let same = top.eq(batch.labels.as_dtype(top.dtype())?)?;
    Ok(same
        .as_dtype(Dtype::Float32)?
        .multiply(&batch.weights)?
        .sum(None)?)
}
