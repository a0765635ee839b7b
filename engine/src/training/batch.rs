//! A training step's sequences made ready for the drafter: random anchors, the target's
//! tap states and embedded blocks, and per predicted position its label, its soft target
//! and its weight. Everything here comes from the frozen target, outside autograd.

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::ops::softmax_axis;
use mlx_rs::{Array, Dtype};
use rand::seq::index::sample;
use rand::Rng;

use dspec_plugin_api::TargetModel;

use super::data::Example;
use super::net::BlockInputs;
use crate::error::EngineError;

type Result<T> = std::result::Result<T, EngineError>;

/// Sequence lengths the target reads are rounded up to a multiple of this.
const LENGTH_STEP: i32 = 128;

/// Which block positions a drafter predicts from, and which token each one predicts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockLayout {
    pub block_size: i32,
    /// First block position with a prediction: DFlash predicts at the mask positions
    /// (1..B), DSpark at every position (0..B), the anchor's included.
    pub first_predicted: i32,
    /// Block position `j` predicts the token at `anchor + j + ahead`: 0 for DFlash (a
    /// mask position stands for its own token), 1 for DSpark (a position predicts the
    /// next one, as a causal model does).
    pub ahead: i32,
    /// Mask token filling the block after its anchor.
    pub mask_token: u32,
}

impl BlockLayout {
    /// Predictions per block.
    pub fn predicted(&self) -> i32 {
        self.block_size - self.first_predicted
    }
}

/// One sequence's share of a step.
pub struct Prepared {
    pub inputs: BlockInputs,
    /// Per anchor and predicted position (`[N · predicted]`): the token to predict (0
    /// where past the sequence's end), u32.
    pub labels: Array,
    /// The token before each predicted one (DSpark's Markov head reads it), u32.
    pub previous: Array,
    /// `exp(−(k−1)/γ)` for the k-th prediction of a block, 0 past the sequence's end.
    pub weights: Array,
    /// The target's distributions at those positions (`[N · predicted, vocab]` f32),
    /// where asked for or where the labels are distributions.
    pub distributions: Option<Array>,
    /// The labels are `distributions`, not the tokens (text examples).
    pub soft_labels: bool,
}

/// Up to `anchors` positions of `example` to start blocks at: each has context before
/// it (at least one position), and its first prediction is a learnt token.
pub fn pick_anchors(
    example: &Example,
    anchors: usize,
    layout: &BlockLayout,
    rng: &mut impl Rng,
) -> Vec<i32> {
    let t = example.tokens.len() as i32;
    // The first prediction is the token at anchor + first_predicted + ahead.
    let first = layout.first_predicted + layout.ahead;
    let lowest = (example.first_label as i32 - first).max(1);
    let highest = t - 1 - first;
    if highest < lowest {
        return Vec::new();
    }
    let span = (highest - lowest + 1) as usize;
    let mut picked: Vec<i32> = sample(rng, span, anchors.min(span))
        .into_iter()
        .map(|i| lowest + i as i32)
        .collect();
    picked.sort_unstable();
    picked
}

/// Runs the target over `example` and lays out the blocks at `anchors`; the target's
/// distributions come along where `distributions` asks or the labels are them.
pub fn prepare(
    target: &dyn TargetModel,
    taps: &[usize],
    example: &Example,
    anchors: &[i32],
    layout: &BlockLayout,
    gamma: f32,
    distributions: bool,
) -> Result<Prepared> {
    let t = example.tokens.len() as i32;
    // The target reads the sequence padded to a multiple of `LENGTH_STEP` (the last
    // token repeated: causal attention keeps the real positions as they were), so its
    // attention meets few shapes: MLX's CUDA backend builds a cuDNN graph per shape.
    let padded = (t + LENGTH_STEP - 1) / LENGTH_STEP * LENGTH_STEP;
    let mut ids = example.tokens.clone();
    ids.resize(padded as usize, example.tokens[t as usize - 1]);
    let tokens = Array::from_slice(&ids, &[1, padded]);
    let mut cache = target.new_cache();
    let out = target.forward(&tokens, &mut cache, taps)?;
    let hidden = out.hidden.ok_or_else(|| {
        EngineError::Invalid("the target returned no hidden states at the tap layers".into())
    })?;
    let context = hidden.try_index((0, ..t, ..))?.as_dtype(Dtype::Float32)?;

    let b = layout.block_size;
    let mut block_ids = Vec::with_capacity(anchors.len() * b as usize);
    let (mut labels, mut previous, mut weights, mut rows) = (vec![], vec![], vec![], vec![]);
    for &anchor in anchors {
        block_ids.push(example.tokens[anchor as usize]);
        block_ids.extend(std::iter::repeat_n(layout.mask_token, b as usize - 1));
        for (k, j) in (layout.first_predicted..b).enumerate() {
            let at = anchor + j + layout.ahead;
            let inside = at < t;
            let at = at.min(t - 1);
            labels.push(example.tokens[at as usize]);
            previous.push(example.tokens[(at - 1) as usize]);
            weights.push(if inside {
                (-(k as f32) / gamma).exp()
            } else {
                0.0
            });
            // The target's distribution for the token at `at` is its output one before.
            rows.push(at - 1);
        }
    }
    let n = anchors.len() as i32;
    let blocks = target
        .embed(&Array::from_slice(&block_ids, &[1, n * b]))?
        .reshape(&[n, b, -1])?
        .as_dtype(Dtype::Float32)?;
    let count = labels.len() as i32;
    let probabilities = if example.soft || distributions {
        let logits = out.logits.try_index((0, ..t, ..))?;
        let picked = logits.take_axis(Array::from_slice(&rows, &[count]), 0)?;
        Some(softmax_axis(&picked.as_dtype(Dtype::Float32)?, -1, true)?)
    } else {
        None
    };
    let prepared = Prepared {
        inputs: BlockInputs {
            context,
            blocks,
            anchors: anchors.to_vec(),
        },
        labels: Array::from_slice(&labels, &[count]),
        previous: Array::from_slice(&previous, &[count]),
        weights: Array::from_slice(&weights, &[count]),
        distributions: probabilities,
        soft_labels: example.soft,
    };
    let mut evaluated = vec![&prepared.inputs.context, &prepared.inputs.blocks];
    evaluated.extend(prepared.distributions.as_ref());
    mlx_rs::transforms::eval(evaluated)?;
    Ok(prepared)
}

/// The rows `[N, B, H]` of `hidden` at the predicted block positions, `[N · predicted, H]`.
pub fn predicted_rows(hidden: &Array, layout: &BlockLayout) -> Result<Array> {
    let s = hidden.shape();
    let rows = hidden.try_index((.., layout.first_predicted.., ..))?;
    Ok(rows.reshape(&[s[0] * layout.predicted(), s[2]])?)
}
