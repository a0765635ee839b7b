//! The LoRA update as a linear layer runs it: beside the base weight behind the
//! adapter's switch, or merged into the weight once at load.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use mlx_rs::ops::matmul;
use mlx_rs::{Array, Dtype};

use dspec_plugin_api::error::Result;
use dspec_plugin_api::LoraUpdate;

/// `scale · (x Aᵀ) Bᵀ`, added to a linear layer's output while the switch is on.
#[derive(Clone)]
pub(crate) struct LoraDelta {
    /// `Aᵀ`, `[in, r]`.
    a_t: Array,
    /// `scale · Bᵀ`, `[r, out]`: folding the scale in saves a multiply per call.
    b_t_scaled: Array,
    switch: Arc<AtomicBool>,
}

impl LoraDelta {
    /// Keeps `update` in `dtype` (the layer's activation dtype). `None` for an update
    /// that has no switch: those are merged at load, never kept beside the weight.
    pub(crate) fn new(update: &LoraUpdate, dtype: Dtype) -> Result<Option<Self>> {
        let Some(switch) = update.switch.clone() else {
            return Ok(None);
        };
        let b_t_scaled = update
            .b
            .as_dtype(Dtype::Float32)?
            .multiply(Array::from_f32(update.scale))?
            .t()
            .as_dtype(dtype)?;
        let a_t = update.a.t().as_dtype(dtype)?;
        // Materialise now so each forward pass reads ready factors.
        a_t.eval()?;
        b_t_scaled.eval()?;
        Ok(Some(Self {
            a_t,
            b_t_scaled,
            switch,
        }))
    }

    /// `y + scale · (x Aᵀ) Bᵀ` while the adapter is on, `y` unchanged while it is off.
    pub(crate) fn add_to(&self, x: &Array, y: Array) -> Result<Array> {
        if !self.switch.load(Ordering::Relaxed) {
            return Ok(y);
        }
        let low = matmul(matmul(x, &self.a_t)?, &self.b_t_scaled)?;
        Ok(y.add(low)?)
    }
}

/// `W + scale · B A` (`W`: `[out, in]`), computed in f32 and returned in `W`'s dtype.
pub(crate) fn merged_weight(weight: &Array, update: &LoraUpdate) -> Result<Array> {
    let delta = matmul(
        update.b.as_dtype(Dtype::Float32)?,
        update.a.as_dtype(Dtype::Float32)?,
    )?
    .multiply(Array::from_f32(update.scale))?;
    let merged = weight
        .as_dtype(Dtype::Float32)?
        .add(delta)?
        .as_dtype(weight.dtype())?;
    merged.eval()?;
    Ok(merged)
}
