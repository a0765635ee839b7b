//! `TargetModel`: what the engine needs from a model family — a cached forward pass
//! with hidden-state taps, and the embedding and lm_head on their own for drafters.

use std::path::Path;

use mlx_rs::{Array, Dtype};

use crate::cache::ModelCache;
use crate::error::{ModelError, Result};

/// Static facts about a loaded model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelInfo {
    /// config.json `model_type`.
    pub model_type: String,
    pub num_layers: usize,
    pub hidden_size: usize,
    pub vocab_size: usize,
    /// Dtype of activations (the float weights' dtype after any cast on load).
    pub dtype: Dtype,
    /// `Some(bits)` when the linear layers are quantized.
    pub quantized_bits: Option<i32>,
    /// Longest context the config declares (`max_position_embeddings`), if any.
    pub max_context: Option<usize>,
}

/// Result of a forward pass over `L` tokens.
pub struct ForwardOutput {
    /// `[1, L, vocab]`.
    pub logits: Array,
    /// `[1, L, taps.len() * hidden]`: outputs of the requested decoder layers,
    /// concatenated in the order asked for; `None` when no taps were requested.
    pub hidden: Option<Array>,
}

/// A target model family implementation. One instance per loaded model; the caller
/// owns the cache so that several sequences (or a draft and a target) never mix.
pub trait TargetModel: Send {
    fn info(&self) -> &ModelInfo;

    /// A fresh, empty cache for this model.
    fn new_cache(&self) -> ModelCache;

    /// Runs `tokens` (`[1, L]`, integer ids) after whatever `cache` holds, appending
    /// their keys/values to it. `taps` are decoder layer ids (0-based; layer `i`'s
    /// tap is the residual stream after layer `i`), captured before the final norm.
    fn forward(
        &self,
        tokens: &Array,
        cache: &mut ModelCache,
        taps: &[usize],
    ) -> Result<ForwardOutput>;

    /// Token embedding as the first decoder layer sees it (family scaling included),
    /// `[1, L] -> [1, L, hidden]`.
    fn embed(&self, tokens: &Array) -> Result<Array>;

    /// Output head on final-normed hidden states, `[.., hidden] -> [.., vocab]`
    /// (logit softcapping included where the family has it).
    fn lm_head(&self, hidden: &Array) -> Result<Array>;

    /// The final norm applied before `lm_head` in `forward`.
    fn final_norm(&self, hidden: &Array) -> Result<Array>;

    /// Runs several sequences, each over its own cache, and returns what each row
    /// wants ([`RowOutput`]), with the hidden states after the layers in `taps` as
    /// [`TargetModel::forward`] gives them (a block drafter's context). A family that
    /// answers [`TargetModel::batches_rows`] runs them in one forward, reading its
    /// weights once for all rows; the default runs them one after another.
    fn forward_batch(&self, rows: &mut [BatchRow<'_>], taps: &[usize]) -> Result<Vec<RowOutput>> {
        forward_rows_one_by_one(self, rows, taps)
    }

    /// Whether [`TargetModel::forward_batch`] reads the weights once for all its rows
    /// (a server batches requests only for a model that does).
    fn batches_rows(&self) -> bool {
        false
    }

    /// Another handle on the same weights (MLX arrays are handles) with no state of its
    /// own, which may run on another thread beside this one: how a draft model drafts for
    /// several sequences at once, each on a thread of its own. An array made on one
    /// thread can be evaluated on another only if it already was, so a share moves to
    /// another thread only once a forward of this model was evaluated on the thread that
    /// loaded it. `None`, the default, where the model cannot share: a plugin's model, a
    /// rank's part of a tensor-parallel group, weights behind a LoRA adapter's switch.
    fn share(&self) -> Option<Box<dyn TargetModel>> {
        None
    }
}

/// One sequence of a batched forward ([`TargetModel::forward_batch`]).
pub struct BatchRow<'a> {
    /// `[1, L>0]` ids that follow what `cache` holds.
    pub tokens: &'a Array,
    pub cache: &'a mut ModelCache,
    /// How many of the last positions' logits are wanted (0 to L): none for a chunk of
    /// a prompt that is not its last, 1 for a decode step, k + 1 for a verify of k drafts.
    pub logits: usize,
}

/// What one row of a batched forward gives back.
pub struct RowOutput {
    /// The logits of the row's last `logits` positions (`[1, n, vocab]`), `None` where
    /// it wanted none.
    pub logits: Option<Array>,
    /// Where taps were asked for: every position's hidden states after the tapped
    /// layers, `[1, L, taps × hidden]`.
    pub hidden: Option<Array>,
}

/// [`TargetModel::forward_batch`] as a loop of single forwards: what families that do
/// not batch (plugins) run, and what batched families must agree with.
pub fn forward_rows_one_by_one<M: TargetModel + ?Sized>(
    model: &M,
    rows: &mut [BatchRow<'_>],
    taps: &[usize],
) -> Result<Vec<RowOutput>> {
    rows.iter_mut()
        .map(|row| {
            check_batch_row(row)?;
            let out = model.forward(row.tokens, row.cache, taps)?;
            Ok(RowOutput {
                logits: last_positions(&out.logits, row.logits)?,
                hidden: out.hidden,
            })
        })
        .collect()
}

/// Refuses a row that wants the logits of more positions than it has.
pub fn check_batch_row(row: &BatchRow<'_>) -> Result<()> {
    let len = row.tokens.shape().get(1).copied().unwrap_or(0) as usize;
    if row.logits > len {
        return Err(ModelError::Unsupported(format!(
            "a batch row of {len} tokens asked for the logits of its last {} positions",
            row.logits
        )));
    }
    Ok(())
}

/// The last `n` positions of `[1, L, ..]`, or `None` for none.
pub fn last_positions(x: &Array, n: usize) -> Result<Option<Array>> {
    let len = x.shape()[1];
    Ok(match n as i32 {
        0 => None,
        n if n == len => Some(x.clone()),
        n => Some(mlx_rs::ops::indexing::TryIndexOp::try_index(
            x,
            (.., (len - n)..len, ..),
        )?),
    })
}

/// Checks `forward`'s arguments for a model of `num_layers` decoder layers: tokens of
/// shape `[1, L>0]` and an integer dtype, tap ids in range, a cache made for this model
/// whose layers all hold the same positions. Every family's `forward` starts with it,
/// so bad calls fail alike everywhere.
pub fn check_forward_args(
    tokens: &Array,
    cache: &ModelCache,
    taps: &[usize],
    num_layers: usize,
) -> Result<()> {
    if tokens.ndim() != 2 || tokens.shape()[0] != 1 || tokens.shape()[1] == 0 {
        return Err(ModelError::Unsupported(format!(
            "forward expects tokens of shape [1, L>0], got {:?}",
            tokens.shape()
        )));
    }
    if !matches!(
        tokens.dtype(),
        Dtype::Int32 | Dtype::Uint32 | Dtype::Int64 | Dtype::Uint64
    ) {
        return Err(ModelError::Unsupported(format!(
            "token ids must be integers, got {:?}",
            tokens.dtype()
        )));
    }
    if let Some(&bad) = taps.iter().find(|&&t| t >= num_layers) {
        return Err(ModelError::Unsupported(format!(
            "tap layer {bad} out of range: the model has {num_layers} layers"
        )));
    }
    if cache.num_layers() != num_layers {
        return Err(ModelError::Unsupported(
            "cache was made for a different model".into(),
        ));
    }
    cache.checked_offset()?;
    Ok(())
}

/// Gathers the residual stream at the requested tap layers during a forward pass and
/// hands them back concatenated in the order asked for (`ForwardOutput::hidden`).
pub struct TapCollector<'a> {
    taps: &'a [usize],
    captured: Vec<Option<Array>>,
}

impl<'a> TapCollector<'a> {
    pub fn new(taps: &'a [usize], num_layers: usize) -> Self {
        Self {
            taps,
            captured: vec![None; if taps.is_empty() { 0 } else { num_layers }],
        }
    }

    /// Offers layer `layer`'s output; kept only when that layer is tapped.
    pub fn offer(&mut self, layer: usize, hidden: &Array) {
        if self.taps.contains(&layer) {
            if let Some(slot) = self.captured.get_mut(layer) {
                *slot = Some(hidden.clone());
            }
        }
    }

    /// `[1, L, taps × hidden]`, or `None` when no taps were asked for.
    pub fn finish(self) -> Result<Option<Array>> {
        if self.taps.is_empty() {
            return Ok(None);
        }
        Ok(Some(mlx_rs::ops::concatenate(&self.parts(), -1)?))
    }

    /// The tapped layers' outputs in the order of the taps, each `[1, L, hidden]`.
    pub fn parts(&self) -> Vec<&Array> {
        self.taps
            .iter()
            .filter_map(|&t| self.captured.get(t).and_then(Option::as_ref))
            .collect()
    }
}

/// Weight quantization, as MLX's affine `quantize` does it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quantization {
    pub bits: i32,
    pub group_size: i32,
}

/// How the user asked the weights to be loaded.
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// Cast float weights to this dtype; `None` keeps the checkpoint's.
    pub dtype: Option<Dtype>,
    /// Quantize unquantized linear/embedding weights on load.
    pub quantize: Option<Quantization>,
    /// Run short continuations of a cached sequence (speculative verify) position by
    /// position through the same kernels as one-token decoding, so that their logits are
    /// bitwise those of plain decoding even where batched kernels round differently
    /// (CUDA, bf16). Opt-in (`--verify exact`): it reads the weights once per position.
    pub rowwise_verify: bool,
    /// Verify drafts through kernels of the backend's own where they pay, compiled while
    /// the weights load (on CUDA, dspec's kernels for short continuations: a one-off of
    /// a few seconds per process, which a long-lived process such as `dspec serve` or
    /// `dspec bench` repays and a one-shot generation of a few hundred tokens does not).
    pub verify_kernels: bool,
    /// Every verify will be waited on before the next round is built (a drafter that
    /// runs a model drafts from the verify's answer, so no verify is queued ahead): the
    /// host's time building a verify is then the round's own, and the kernels of
    /// `verify_kernels` pay whatever the model's size.
    pub verifies_waited_on: bool,
}

/// Everything an adapter constructor gets.
pub struct LoadRequest<'a> {
    pub dir: &'a Path,
    /// The parsed config.json.
    pub config: &'a serde_json::Value,
    pub options: &'a LoadOptions,
    /// Called with (tensors loaded, tensors total) while weights load.
    pub progress: &'a dyn Fn(usize, usize),
}
