//! What a drafter is trained to minimise, per drafter kind, over a step's sequences.
//!
//! Every prediction is weighted `exp(−(k−1)/γ)` by its place k in the block: a draft
//! counts only if every one before it was kept, so early positions matter most.

use mlx_rs::ops::indexing::{argmax_axis, take_along_axis};
use mlx_rs::ops::{logsumexp_axis, maximum};
use mlx_rs::stop_gradient;
use mlx_rs::{Array, Dtype};

use dspec_plugin_api::TargetModel;

use super::batch::{predicted_rows, BlockLayout, Prepared};
use super::net::{block_hidden, NetShape, Params};
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

/// DFlash: cross-entropy of the target's head over the drafter's block rows, against
/// the label token (or the target's distribution, for text).
pub fn dflash(
    params: &Params,
    shape: &NetShape,
    layout: &BlockLayout,
    target: &dyn TargetModel,
    sequences: &[Prepared],
) -> Result<StepValues> {
    let mut total = Array::from_f32(0.0);
    let mut correct = Array::from_f32(0.0);
    let mut weight = Array::from_f32(0.0);
    for seq in sequences {
        let rows = predicted_rows(&block_hidden(params, shape, &seq.inputs)?, layout)?;
        let logits = target
            .lm_head(&rows.as_dtype(target.info().dtype)?)?
            .as_dtype(Dtype::Float32)?;
        let ce = cross_entropy(&logits, seq)?;
        total = total.add(ce.multiply(&seq.weights)?.sum(None)?)?;
        weight = weight.add(seq.weights.sum(None)?)?;
        correct = correct.add(hits(&logits, seq)?)?;
    }
    Ok(StepValues {
        loss: total.divide(maximum(&weight, Array::from_f32(1e-9))?)?,
        correct: stop_gradient(&correct)?,
        weight,
    })
}

/// Per row: −log q(label), or −Σ p·log q against the target's distribution p.
fn cross_entropy(logits: &Array, seq: &Prepared) -> Result<Array> {
    let lse = logsumexp_axis(logits, -1, false)?;
    match &seq.soft {
        Some(p) => Ok(lse.subtract(p.multiply(logits)?.sum_axis(-1, false)?)?),
        None => {
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
