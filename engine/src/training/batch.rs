//! A training step's sequences made ready for the drafter, several at a time: random
//! anchors, the target's tap states and embedded blocks, and per predicted position its
//! label, its soft target and its weight. Everything here comes from the frozen target,
//! outside autograd.

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::ops::softmax_axis;
use mlx_rs::{Array, Dtype};
use rand::seq::index::sample;
use rand::Rng;

use dspec_plugin_api::{BatchRow, TargetModel};

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

/// Several sequences' share of a step, side by side (one pass of the drafter).
pub struct Prepared {
    pub inputs: BlockInputs,
    /// Per sequence, anchor and predicted position (`[S · N · predicted]`): the token to
    /// predict (0 where past the sequence's end), u32.
    pub labels: Array,
    /// The token before each predicted one (DSpark's Markov head reads it), u32.
    pub previous: Array,
    /// `exp(−(k−1)/γ)` for the k-th prediction of a block, 0 past the sequence's end and
    /// in padding blocks.
    pub weights: Array,
    /// The sum of `weights`.
    pub weight: f32,
    /// The target's distributions at those positions (`[S · N · predicted, vocab]` f32),
    /// where asked for or where the labels are distributions.
    pub distributions: Option<Array>,
    /// The labels are `distributions`, not the tokens (text examples).
    pub soft_labels: bool,
}

/// A sequence of a step and the positions its blocks start at.
pub struct Anchored<'a> {
    pub example: &'a Example,
    pub anchors: Vec<i32>,
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

/// Runs the target over `sequences` in one batched forward and lays out their blocks
/// side by side, each padded to the most anchors among them; the target's distributions
/// come along where `distributions` asks or the labels are them. The sequences' labels
/// must be of one kind (all tokens or all distributions).
pub fn prepare(
    target: &dyn TargetModel,
    taps: &[usize],
    sequences: &[Anchored<'_>],
    layout: &BlockLayout,
    gamma: f32,
    distributions: bool,
) -> Result<Prepared> {
    let soft = sequences.first().is_some_and(|s| s.example.soft);
    if sequences.is_empty() || sequences.iter().any(|s| s.example.soft != soft) {
        return Err(EngineError::Invalid(
            "a training pass needs sequences, all with labels of one kind".into(),
        ));
    }
    let wants_distributions = soft || distributions;
    // Each sequence is read padded to a multiple of `LENGTH_STEP` (its last token
    // repeated: causal attention keeps the real positions as they were), so the target's
    // attention meets few shapes: MLX's CUDA backend builds a cuDNN graph per shape.
    let padded: Vec<Vec<u32>> = sequences
        .iter()
        .map(|s| {
            let tokens = &s.example.tokens;
            let len = tokens.len().div_ceil(LENGTH_STEP as usize) * LENGTH_STEP as usize;
            let mut ids = tokens.clone();
            ids.resize(len, tokens[tokens.len() - 1]);
            ids
        })
        .collect();
    let ids: Vec<Array> = padded
        .iter()
        .map(|p| Array::from_slice(p, &[1, p.len() as i32]))
        .collect();
    let mut caches: Vec<_> = sequences.iter().map(|_| target.new_cache()).collect();
    let mut rows: Vec<BatchRow<'_>> = ids
        .iter()
        .zip(caches.iter_mut())
        .map(|(tokens, cache)| BatchRow {
            tokens,
            cache,
            logits: if wants_distributions {
                tokens.shape()[1] as usize
            } else {
                0
            },
        })
        .collect();
    let outputs = target.forward_batch(&mut rows, taps)?;
    // Nothing reads the caches again: dropped before the pass is evaluated, their keys
    // and values are freed as the forward runs instead of held until it ends.
    drop(rows);
    drop(caches);

    let longest = padded.iter().map(Vec::len).max().unwrap_or(0) as i32;
    let mut contexts = Vec::with_capacity(sequences.len());
    for (out, p) in outputs.iter().zip(&padded) {
        let hidden = out.hidden.as_ref().ok_or_else(|| {
            EngineError::Invalid("the target returned no hidden states at the tap layers".into())
        })?;
        let short = longest - p.len() as i32;
        let widths: &[(i32, i32)] = &[(0, 0), (0, short), (0, 0)];
        contexts.push(mlx_rs::ops::pad(
            hidden.as_dtype(Dtype::Float32)?,
            widths,
            None,
            None,
        )?);
    }
    let context = mlx_rs::ops::concatenate(&contexts, 0)?;

    let b = layout.block_size;
    let n = sequences.iter().map(|s| s.anchors.len()).max().unwrap_or(0);
    let (mut block_ids, mut all_anchors) = (Vec::new(), Vec::new());
    let (mut labels, mut previous, mut weights, mut rows) = (vec![], vec![], vec![], vec![]);
    let mut start = 0;
    for (seq, p) in sequences.iter().zip(&padded) {
        let tokens = &seq.example.tokens;
        let t = tokens.len() as i32;
        // Padding blocks start at 1 (every sequence has a position before it) and weigh nothing.
        let anchors: Vec<(i32, bool)> = seq
            .anchors
            .iter()
            .map(|&a| (a, true))
            .chain(std::iter::repeat((1, false)))
            .take(n)
            .collect();
        for &(anchor, real) in &anchors {
            block_ids.push(tokens[anchor as usize]);
            block_ids.extend(std::iter::repeat_n(layout.mask_token, b as usize - 1));
            for (k, j) in (layout.first_predicted..b).enumerate() {
                let at = anchor + j + layout.ahead;
                let inside = real && at < t;
                let at = at.min(t - 1);
                labels.push(tokens[at as usize]);
                previous.push(tokens[(at - 1) as usize]);
                weights.push(if inside {
                    (-(k as f32) / gamma).exp()
                } else {
                    0.0
                });
                // The target's distribution for the token at `at` is its output one before.
                rows.push(start + at - 1);
            }
        }
        all_anchors.push(anchors.iter().map(|&(a, _)| a).collect());
        start += p.len() as i32;
    }
    let (s, n) = (sequences.len() as i32, n as i32);
    let blocks = target
        .embed(&Array::from_slice(&block_ids, &[1, s * n * b]))?
        .reshape(&[s, n, b, -1])?
        .as_dtype(Dtype::Float32)?;
    let count = labels.len() as i32;
    let probabilities = match wants_distributions {
        false => None,
        true => {
            let logits: Vec<&Array> = outputs.iter().filter_map(|o| o.logits.as_ref()).collect();
            let logits = mlx_rs::ops::concatenate(&logits, 1)?;
            let logits = logits.reshape(&[-1, logits.shape()[2]])?;
            // Softmax before picking: blocks overlap, so rows are picked more than once.
            let all = softmax_axis(&logits.as_dtype(Dtype::Float32)?, -1, true)?;
            Some(all.take_axis(Array::from_slice(&rows, &[count]), 0)?)
        }
    };
    let prepared = Prepared {
        inputs: BlockInputs {
            context,
            blocks,
            anchors: all_anchors,
        },
        labels: Array::from_slice(&labels, &[count]),
        previous: Array::from_slice(&previous, &[count]),
        weight: weights.iter().sum(),
        weights: Array::from_slice(&weights, &[count]),
        distributions: probabilities,
        soft_labels: soft,
    };
    let mut evaluated = vec![&prepared.inputs.context, &prepared.inputs.blocks];
    evaluated.extend(prepared.distributions.as_ref());
    mlx_rs::transforms::eval(evaluated)?;
    Ok(prepared)
}

/// The rows `[S, N, B, H]` of `hidden` at the predicted block positions,
/// `[S · N · predicted, H]`.
pub fn predicted_rows(hidden: &Array, layout: &BlockLayout) -> Result<Array> {
    let s = hidden.shape();
    let rows = hidden.try_index((.., .., layout.first_predicted.., ..))?;
    Ok(rows.reshape(&[s[0] * s[1] * layout.predicted(), s[3]])?)
}
