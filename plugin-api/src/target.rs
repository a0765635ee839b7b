//! `TargetModel`: what the engine needs from a model family — a cached forward pass
//! with hidden-state taps, and the embedding and lm_head on their own for drafters.

use std::path::Path;

use mlx_rs::{Array, Dtype};

use crate::cache::ModelCache;
use crate::error::Result;

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
