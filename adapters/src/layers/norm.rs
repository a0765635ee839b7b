//! RMS normalisation, with the scale stored plainly or offset by one as gemma stores it.

use mlx_rs::{fast, Array};

use dspec_plugin_api::error::Result;
use dspec_plugin_api::WeightSource;

/// How a family stores its RMSNorm scale.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormWeight {
    /// `x̂ · w` (llama, qwen, mistral).
    Plain,
    /// `x̂ · (1 + w)` (gemma family); folded into the weight once at load.
    OffsetByOne,
}

#[derive(Clone)]
pub struct RmsNorm {
    weight: Array,
    eps: f32,
}

impl RmsNorm {
    pub fn load(
        w: &mut dyn WeightSource,
        name: &str,
        dim: i32,
        eps: f32,
        style: NormWeight,
    ) -> Result<Self> {
        let weight = w.tensor(name, &[dim])?;
        let weight = match style {
            NormWeight::Plain => weight,
            NormWeight::OffsetByOne => {
                weight.add(Array::from_f32(1.0).as_dtype(weight.dtype())?)?
            }
        };
        Ok(Self { weight, eps })
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        Ok(fast::rms_norm(x, Some(&self.weight), self.eps)?)
    }
}

/// RMS normalisation with no learned scale (gemma4's `v_norm`).
pub fn rms_norm_unscaled(x: &Array, eps: f32) -> Result<Array> {
    Ok(fast::rms_norm(x, None, eps)?)
}
