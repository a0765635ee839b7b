//! A linear layer's share under tensor parallelism: which part of its weight a rank
//! reads, and where the group's all-sum joins row-parallel partial products.

use dspec_plugin_api::error::{ModelError, Result};
use dspec_plugin_api::WeightSource;

use super::dense::DenseProduct;
use super::linear::{Linear, LinearWeight};
use super::quantized::{grouping_for, load_quantized_part, maybe_quantize};
use crate::tensor_parallel::TensorParallel;

/// How a layer's weight is split across a tensor-parallel group.
#[derive(Clone, Copy)]
pub enum Split<'a> {
    /// Column-parallel: each rank computes its share of the outputs (q/k/v, gate/up).
    Outputs(&'a TensorParallel),
    /// Row-parallel: each rank multiplies its share of the inputs and the group sums
    /// the results (o_proj, down_proj): one all-sum per layer.
    Inputs(&'a TensorParallel),
}

impl Linear {
    /// This rank's share of the layer under `split`, read as a part of each tensor.
    pub(super) fn load_share(
        w: &mut dyn WeightSource,
        prefix: &str,
        in_dim: i32,
        out_dim: i32,
        bias: bool,
        split: Split,
    ) -> Result<Self> {
        if w.lora_update(prefix, in_dim, out_dim)?.is_some() {
            return Err(ModelError::Unsupported(format!(
                "a LoRA adapter on `{prefix}` under tensor parallelism is not supported; \
                 run on one process to use the adapter"
            )));
        }
        let (tp, axis) = match split {
            Split::Outputs(tp) => (tp, 0),
            Split::Inputs(tp) => (tp, 1),
        };
        let part = tp.part(axis);
        let whole = [out_dim, in_dim][axis];
        let (start, end) = part.range(&format!("{prefix}.weight"), whole)?;
        let (rows, cols) = match split {
            Split::Outputs(_) => (end - start, in_dim),
            Split::Inputs(_) => (out_dim, end - start),
        };
        let weight = if w.contains(&format!("{prefix}.scales")) {
            LinearWeight::Quantized(load_quantized_part(w, prefix, rows, cols, Some(part))?)
        } else {
            let dense = w.tensor_part(&format!("{prefix}.weight"), &[out_dim, in_dim], part)?;
            // The group size the whole layer would get, so that a rank's share is
            // quantized exactly as that part of the whole layer would be.
            let quantize = grouping_for(in_dim, w.options().quantize);
            if let Some(q) = quantize.filter(|q| cols % q.group_size != 0) {
                return Err(ModelError::Unsupported(format!(
                    "--quantize: `{prefix}` would be quantized in groups of {} inputs, but a \
                     rank's share of its {in_dim} inputs is {cols}, which is no whole number \
                     of groups; run on fewer ranks or without --quantize",
                    q.group_size
                )));
            }
            match maybe_quantize(dense, quantize)? {
                Ok(q) => LinearWeight::Quantized(q),
                Err(dense) => LinearWeight::Dense(DenseProduct::new(dense)),
            }
        };
        let name = format!("{prefix}.bias");
        let (bias, reduce) = match (bias, split) {
            (true, Split::Outputs(_)) => (Some(w.tensor_part(&name, &[out_dim], part)?), None),
            (true, Split::Inputs(tp)) => (Some(w.tensor(&name, &[out_dim])?), Some(tp.clone())),
            (false, Split::Outputs(_)) => (None, None),
            (false, Split::Inputs(tp)) => (None, Some(tp.clone())),
        };
        Ok(Self {
            weight,
            bias,
            lora: None,
            reduce,
        })
    }
}
