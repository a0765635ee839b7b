//! Linear layers: `x Wᵀ + b` over a dense or quantized weight, with a LoRA update kept
//! beside it or merged, and projections that read one input fused into one product.

use mlx_rs::ops::concatenate;
use mlx_rs::Array;

use dspec_plugin_api::error::{ModelError, Result};
use dspec_plugin_api::WeightSource;

use super::dense::DenseProduct;
use super::lora_delta::{merged_weight, LoraDelta};
use super::parallel::Split;
use super::quantized::{load_quantized, maybe_quantize, Quantized};
use crate::tensor_parallel::TensorParallel;

/// A linear layer's weight, as its products read it.
#[derive(Clone)]
pub(super) enum LinearWeight {
    Dense(DenseProduct),
    Quantized(Quantized),
}

impl LinearWeight {
    /// The dtype activations meet this weight in.
    pub(super) fn dtype(&self) -> mlx_rs::Dtype {
        match self {
            LinearWeight::Dense(d) => d.dtype(),
            LinearWeight::Quantized(q) => q.scales.dtype(),
        }
    }
}

/// `y = x Wᵀ + b`, plus a LoRA update when the weight source carries an adapter for it.
#[derive(Clone)]
pub struct Linear {
    pub(super) weight: LinearWeight,
    pub(super) bias: Option<Array>,
    pub(super) lora: Option<LoraDelta>,
    /// Row-parallel (a rank's share of the inputs): the partial products of every rank
    /// are summed across the group before the bias, which every rank holds whole.
    pub(super) reduce: Option<TensorParallel>,
}

impl Linear {
    /// Whether products of a few rows go through dspec's CUDA kernel ([`crate::cuda`]);
    /// off until the model turns it on.
    pub fn use_short_kernels(&mut self, on: bool) -> Result<()> {
        match &mut self.weight {
            LinearWeight::Dense(d) => d.use_short_kernels(on),
            _ => Ok(()),
        }
    }

    /// Loads `prefix.weight` (`[out, in]`), quantized or not, and `prefix.bias` when `bias`.
    /// A LoRA update the source offers for `prefix` is kept beside the weight or merged
    /// into it, as the update says.
    pub fn load(
        w: &mut dyn WeightSource,
        prefix: &str,
        in_dim: i32,
        out_dim: i32,
        bias: bool,
    ) -> Result<Self> {
        Self::load_split(w, prefix, in_dim, out_dim, bias, None)
    }

    /// [`Linear::load`] of this rank's share under `split` (`in_dim` and `out_dim` are
    /// the whole layer's); `None` loads the whole layer.
    pub fn load_split(
        w: &mut dyn WeightSource,
        prefix: &str,
        in_dim: i32,
        out_dim: i32,
        bias: bool,
        split: Option<Split>,
    ) -> Result<Self> {
        if let Some(split) = split {
            return Self::load_share(w, prefix, in_dim, out_dim, bias, split);
        }
        let update = w.lora_update(prefix, in_dim, out_dim)?;
        let to_merge = update.as_ref().filter(|u| u.switch.is_none());
        let weight = if w.contains(&format!("{prefix}.scales")) {
            let q = load_quantized(w, prefix, out_dim, in_dim)?;
            match to_merge {
                Some(u) => LinearWeight::Quantized(q.merged(u)?),
                None => LinearWeight::Quantized(q),
            }
        } else {
            let mut dense = w.tensor(&format!("{prefix}.weight"), &[out_dim, in_dim])?;
            if let Some(u) = to_merge {
                // Merged before any quantize-on-load, so the update is quantized once.
                dense = merged_weight(&dense, u)?;
            }
            match maybe_quantize(dense, w.options().quantize)? {
                Ok(q) => LinearWeight::Quantized(q),
                Err(dense) => LinearWeight::Dense(DenseProduct::new(dense)),
            }
        };
        let bias = if bias {
            Some(w.tensor(&format!("{prefix}.bias"), &[out_dim])?)
        } else {
            None
        };
        let lora = match &update {
            Some(u) => LoraDelta::new(u, weight.dtype())?,
            None => None,
        };
        Ok(Self {
            weight,
            bias,
            lora,
            reduce: None,
        })
    }

    /// `x`: `[B, L, in]`; in the row layout (`[R, 1, in]`, see [`is_row_layout`](super::is_row_layout)) every
    /// row goes through the one-token kernel.
    pub fn forward(&self, x: &Array) -> Result<Array> {
        let y = match &self.weight {
            LinearWeight::Dense(d) => d.forward(x)?,
            LinearWeight::Quantized(q) => q.matmul_t(x)?,
        };
        let y = match &self.lora {
            Some(delta) => delta.add_to(x, y)?,
            None => y,
        };
        let y = match &self.reduce {
            Some(tp) => tp.all_sum(&y)?,
            None => y,
        };
        match &self.bias {
            Some(b) => Ok(y.add(b)?),
            None => Ok(y),
        }
    }

    pub fn quantized_bits(&self) -> Option<i32> {
        match &self.weight {
            LinearWeight::Quantized(q) => Some(q.bits),
            LinearWeight::Dense(_) => None,
        }
    }

    /// The same layer with its outputs reordered: output `i` of the result is output
    /// `rows[i]` of this one. Rows are independent (quantization groups run along the
    /// input), so quantized weights are reordered exactly. A checkpoint that stores
    /// projections grouped differently from how they are used (Qwen3-Next's per-key-head
    /// `in_proj_qkvz`) is reordered once at load instead of at every step.
    pub fn take_rows(&self, rows: &[i32], prefix: &str) -> Result<Linear> {
        if self.lora.is_some() {
            return Err(ModelError::Unsupported(format!(
                "a LoRA adapter on `{prefix}` is not supported: dspec reorders that \
                 projection's outputs at load"
            )));
        }
        let index = Array::from_slice(rows, &[rows.len() as i32]);
        let take = |a: &Array| a.take_axis(&index, 0);
        let weight = match &self.weight {
            LinearWeight::Dense(d) => LinearWeight::Dense(DenseProduct::new(take(&d.weight())?)),
            LinearWeight::Quantized(q) => LinearWeight::Quantized(Quantized {
                weight: take(&q.weight)?,
                scales: take(&q.scales)?,
                biases: take(&q.biases)?,
                group_size: q.group_size,
                bits: q.bits,
            }),
        };
        let bias = self.bias.as_ref().map(take).transpose()?;
        Ok(Linear {
            weight,
            bias,
            lora: None,
            reduce: self.reduce.clone(),
        })
    }

    /// One layer computing `parts`' outputs side by side, when all are dense with the
    /// same bias layout and no switchable LoRA update; `None` leaves them apart. Fusing projections that read the same
    /// input (q/k/v, gate/up) saves kernel launches per token, which is what decoding
    /// costs on a GPU. Each output element is the same dot product as before.
    pub fn fuse(parts: &[&Linear]) -> Result<Option<Linear>> {
        let mut biases = Vec::with_capacity(parts.len());
        for part in parts {
            // A switchable LoRA update belongs to one projection, and a row-parallel
            // layer's sum to its own outputs: keep those apart.
            if part.lora.is_some() || part.reduce.is_some() {
                return Ok(None);
            }
            biases.extend(part.bias.clone());
        }
        if parts.is_empty() || (!biases.is_empty() && biases.len() != parts.len()) {
            return Ok(None);
        }
        let Some(weight) = LinearWeight::stacked(parts.iter().map(|p| &p.weight))? else {
            return Ok(None);
        };
        let bias = match biases.is_empty() {
            true => None,
            false => Some(concatenate(&biases, 0)?),
        };
        Ok(Some(Linear {
            weight,
            bias,
            lora: None,
            reduce: None,
        }))
    }
}

impl LinearWeight {
    /// The weights' `[out, in]` blocks stacked along `out`, when all are dense, or all
    /// quantized alike (same bits and group size: quantization groups run along `in`,
    /// so stacking the packed rows, scales and biases quantizes nothing again);
    /// `None` for a mix.
    pub(super) fn stacked<'a>(
        weights: impl Iterator<Item = &'a LinearWeight>,
    ) -> Result<Option<LinearWeight>> {
        let weights: Vec<&LinearWeight> = weights.collect();
        // One array of each weight, or `None` where one has none.
        let parts = |pick: &dyn Fn(&LinearWeight) -> Option<Array>| -> Option<Vec<Array>> {
            weights.iter().map(|w| pick(w)).collect()
        };
        let stack = |pick: &dyn Fn(&LinearWeight) -> Option<Array>| -> Result<Option<Array>> {
            Ok(parts(pick).map(|p| concatenate(&p, 0)).transpose()?)
        };
        match weights.first() {
            // `[out, in]` blocks stacked, like every dense weight, so products see the
            // same layout (and MLX's CUDA backend the same kernels).
            // The parts' layout: a fused product is held as its parts would be.
            Some(LinearWeight::Dense(first)) => {
                let layout = first.layout;
                let blocks = parts(&|w| match w {
                    LinearWeight::Dense(d) => Some(d.weight()),
                    LinearWeight::Quantized(_) => None,
                });
                Ok(blocks
                    .map(|blocks| DenseProduct::stacked(blocks, layout))
                    .transpose()?
                    .map(LinearWeight::Dense))
            }
            Some(LinearWeight::Quantized(first)) => {
                let (bits, group_size) = (first.bits, first.group_size);
                let part = |w: &LinearWeight, which: fn(&Quantized) -> &Array| match w {
                    LinearWeight::Quantized(q) if q.bits == bits && q.group_size == group_size => {
                        Some(which(q).clone())
                    }
                    _ => None,
                };
                let (Some(weight), Some(scales), Some(biases)) = (
                    stack(&|w| part(w, |q| &q.weight))?,
                    stack(&|w| part(w, |q| &q.scales))?,
                    stack(&|w| part(w, |q| &q.biases))?,
                ) else {
                    return Ok(None);
                };
                Ok(Some(LinearWeight::Quantized(Quantized {
                    weight,
                    scales,
                    biases,
                    group_size,
                    bits,
                })))
            }
            None => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dspec_plugin_api::Quantization;
    use mlx_rs::random;

    /// Quantized projections fuse like dense ones: the fused product's outputs are the
    /// separate products' side by side; a mix of dense and quantized, or of bit widths,
    /// stays apart.
    #[test]
    fn quantized_projections_fuse_exactly() {
        let normal = |shape: &[i32], seed: u64| {
            random::normal::<f32>(shape, None, None, Some(&random::key(seed).unwrap())).unwrap()
        };
        let linear = |seed: u64, out: i32, bits: Option<i32>| {
            let dense = normal(&[out, 64], seed);
            let weight = match bits {
                Some(bits) => {
                    let q = Quantization {
                        bits,
                        group_size: 32,
                    };
                    match maybe_quantize(dense, Some(q)).unwrap() {
                        Ok(q) => LinearWeight::Quantized(q),
                        Err(_) => unreachable!("64 columns take group size 32"),
                    }
                }
                None => LinearWeight::Dense(DenseProduct::new(dense)),
            };
            Linear {
                weight,
                bias: Some(normal(&[out], seed + 100)),
                lora: None,
                reduce: None,
            }
        };
        let (a, b) = (linear(1, 48, Some(4)), linear(2, 16, Some(4)));
        let fused = Linear::fuse(&[&a, &b])
            .unwrap()
            .expect("alike quantized weights fuse");
        assert_eq!(fused.quantized_bits(), Some(4));
        let x = normal(&[1, 3, 64], 9);
        let both = concatenate(&[a.forward(&x).unwrap(), b.forward(&x).unwrap()], -1).unwrap();
        let y = fused.forward(&x).unwrap();
        assert_eq!(y.shape(), &[1, 3, 64]);
        assert!(y.all_close(&both, 1e-5, 1e-5, None).unwrap());
        let (dense, eight) = (linear(3, 16, None), linear(4, 16, Some(8)));
        assert!(
            Linear::fuse(&[&a, &dense]).unwrap().is_none(),
            "dense with quantized"
        );
        assert!(
            Linear::fuse(&[&a, &eight]).unwrap().is_none(),
            "4-bit with 8-bit"
        );
    }
}
