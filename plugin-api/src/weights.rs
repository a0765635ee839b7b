//! What a family loads its tensors through: a source asked by HF tensor name and
//! expected shape. Sources themselves (a checkpoint directory, LoRA on top of one) live
//! with the crates that open them; `dspec-adapters` has the safetensors loader.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use mlx_rs::Array;

use crate::error::Result;
use crate::target::LoadOptions;

/// Where an adapter gets its tensors from. Adapters ask by HF name and expected shape;
/// the source checks the shape and casts float tensors to the requested dtype.
pub trait WeightSource {
    /// A float tensor that must exist with exactly `shape`.
    fn tensor(&mut self, name: &str, shape: &[i32]) -> Result<Array>;

    /// Whether `name` exists (optional tensors: biases, untied heads, quantization parts).
    fn contains(&self, name: &str) -> bool;

    /// A tensor taken as stored, without shape check or cast (quantized weight parts).
    fn raw(&mut self, name: &str) -> Result<Array>;

    fn options(&self) -> &LoadOptions;

    /// The LoRA update for linear layer `module` (`model.layers.0.self_attn.q_proj`,
    /// weight `[out_dim, in_dim]`) when this source carries an adapter that targets it.
    /// Plain checkpoints carry none; dspec-adapters' LoRA loading wraps a source to add one.
    fn lora_update(
        &mut self,
        _module: &str,
        _in_dim: i32,
        _out_dim: i32,
    ) -> Result<Option<LoraUpdate>> {
        Ok(None)
    }
}

/// A low-rank update of one linear layer: `y = x Wᵀ + scale · (x Aᵀ) Bᵀ`.
pub struct LoraUpdate {
    /// `[rank, in_dim]`.
    pub a: Array,
    /// `[out_dim, rank]`.
    pub b: Array,
    pub scale: f32,
    /// `Some`: keep the update beside the weight and apply it while the switch is on
    /// (one switch shared by every layer of an adapter); `None`: merge it into the
    /// weight at load (`W + scale · B A`), for speed, with no way back.
    pub switch: Option<Arc<AtomicBool>>,
}
