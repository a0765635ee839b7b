//! What a family loads its tensors through: a source asked by HF tensor name and
//! expected shape. Sources themselves (a checkpoint directory, LoRA on top of one) live
//! with the crates that open them; `dspec-adapters` has the safetensors loader.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use mlx_rs::Array;

use crate::error::{ModelError, Result};
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

    /// Part `part.index` of `part.count` equal parts of float tensor `name` (whole shape
    /// `shape`) along `part.axis`, checked and cast as [`WeightSource::tensor`] does: a
    /// rank's shard under tensor parallelism. Sources that can read a part alone (a
    /// checkpoint file) override this, so a rank never reads the other ranks' parts.
    fn tensor_part(&mut self, name: &str, shape: &[i32], part: Part) -> Result<Array> {
        let whole = self.tensor(name, shape)?;
        part.of(name, &whole)
    }

    /// Part of a tensor taken as stored ([`WeightSource::raw`]): quantized weight parts.
    fn raw_part(&mut self, name: &str, part: Part) -> Result<Array> {
        let whole = self.raw(name)?;
        part.of(name, &whole)
    }

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

/// One of `count` equal, consecutive parts of a tensor along `axis`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    pub axis: usize,
    pub index: i32,
    pub count: i32,
}

impl Part {
    /// `[start, end)` of this part along an axis of `len`, when `count` divides it.
    pub fn range(&self, name: &str, len: i32) -> Result<(i32, i32)> {
        if self.count <= 0 || self.index < 0 || self.index >= self.count {
            return Err(ModelError::Unsupported(format!(
                "part {} of {} of tensor `{name}` does not exist",
                self.index, self.count
            )));
        }
        if len % self.count != 0 {
            return Err(ModelError::Unsupported(format!(
                "tensor `{name}` has {len} entries along axis {}, which do not split into {} equal parts",
                self.axis, self.count
            )));
        }
        let size = len / self.count;
        Ok((self.index * size, (self.index + 1) * size))
    }

    /// This part of `whole` (a view of it).
    pub fn of(&self, name: &str, whole: &Array) -> Result<Array> {
        let Some(&len) = whole.shape().get(self.axis) else {
            return Err(ModelError::Unsupported(format!(
                "tensor `{name}` of shape {:?} has no axis {}",
                whole.shape(),
                self.axis
            )));
        };
        let (start, end) = self.range(name, len)?;
        Ok(dspec_runtime::slicing::slice_axis(
            whole, self.axis, start, end,
        )?)
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
