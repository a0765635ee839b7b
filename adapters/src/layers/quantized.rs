//! MLX's affine quantization: packed weights with per-group scales and biases, read from
//! a quantized checkpoint or made at load (`--quantize`), and merged with a LoRA update.

use mlx_rs::ops::{dequantize, quantize, quantized_matmul};
use mlx_rs::Array;

use dspec_plugin_api::error::{ModelError, Result};
use dspec_plugin_api::{LoraUpdate, Part, Quantization, WeightSource};

use super::lora_delta::merged_weight;

/// Quantized weight parts, as MLX's affine quantization stores them.
#[derive(Clone)]
pub(super) struct Quantized {
    pub(super) weight: Array,
    pub(super) scales: Array,
    pub(super) biases: Array,
    pub(super) group_size: i32,
    pub(super) bits: i32,
}

impl Quantized {
    /// `x Wᵀ` with the packed weight (linear layers and tied heads alike).
    pub(super) fn matmul_t(&self, x: &Array) -> Result<Array> {
        Ok(quantized_matmul(
            x,
            &self.weight,
            &self.scales,
            &self.biases,
            true,
            self.group_size,
            self.bits,
        )?)
    }

    /// Dequantizes, merges a LoRA update and quantizes again with the same bits and
    /// group size (as mlx-lm's fuse does; the result carries one more rounding).
    pub(super) fn merged(&self, update: &LoraUpdate) -> Result<Quantized> {
        let dense = dequantize(
            &self.weight,
            &self.scales,
            &self.biases,
            self.group_size,
            self.bits,
        )?;
        let (weight, scales, biases) =
            quantize(merged_weight(&dense, update)?, self.group_size, self.bits)?;
        Ok(Quantized {
            weight,
            scales,
            biases,
            group_size: self.group_size,
            bits: self.bits,
        })
    }
}

/// Finds `prefix.{weight,scales,biases}` of a quantized layer and infers bits and group
/// size from their shapes (a packed u32 row holds `32 / bits` values; one scale per group).
pub(super) fn load_quantized(
    w: &mut dyn WeightSource,
    prefix: &str,
    rows: i32,
    cols: i32,
) -> Result<Quantized> {
    load_quantized_part(w, prefix, rows, cols, None)
}

/// [`load_quantized`] of a rank's `part` (`rows` and `cols` are the part's): packed
/// rows, scales and biases are cut alike, along the outputs or, by whole quantization
/// groups, along the inputs.
pub(super) fn load_quantized_part(
    w: &mut dyn WeightSource,
    prefix: &str,
    rows: i32,
    cols: i32,
    part: Option<Part>,
) -> Result<Quantized> {
    let mut fetch = |what: &str| -> Result<Array> {
        let name = format!("{prefix}.{what}");
        match part {
            Some(part) => w.raw_part(&name, part),
            None => w.raw(&name),
        }
    };
    let parts = [fetch("weight")?, fetch("scales")?, fetch("biases")?];
    quantized_parts(w, prefix, parts, &[rows], cols)
}

/// A quantized weight from its packed `weight`, `scales` and `biases`, whose leading
/// dimensions must be `lead` (`[rows]` for a linear layer, `[experts, rows]` for stacked
/// experts) over `cols` inputs; bits and group size are read from the shapes (a packed
/// u32 holds `32 / bits` values; one scale per group). `prefix` names it in errors.
pub(super) fn quantized_parts(
    w: &dyn WeightSource,
    prefix: &str,
    [weight, scales, biases]: [Array; 3],
    lead: &[i32],
    cols: i32,
) -> Result<Quantized> {
    let (ws, ss) = (weight.shape().to_vec(), scales.shape().to_vec());
    let n = lead.len();
    let shaped = ws.len() == n + 1
        && ws[..n] == *lead
        && ss.len() == n + 1
        && ss[..n] == *lead
        && ss[n] > 0
        && biases.shape() == ss;
    let group_size = if shaped { cols / ss[n] } else { 0 };
    let bits = if shaped { ws[n] * 32 / cols } else { 0 };
    if !shaped
        || group_size * ss[n] != cols
        || bits * cols != ws[n] * 32
        || ![2, 3, 4, 5, 6, 8].contains(&bits)
    {
        let mut expected = lead.to_vec();
        expected.push(cols * 4 / 32);
        return Err(ModelError::ShapeMismatch {
            name: format!("{prefix}.weight/scales/biases"),
            file: "(quantized checkpoint)".into(),
            expected,
            actual: ws,
        });
    }
    let cast = |a: Array| -> Result<Array> {
        match w.options().dtype {
            Some(d) if d != a.dtype() => Ok(a.as_dtype(d)?),
            _ => Ok(a),
        }
    };
    Ok(Quantized {
        weight,
        scales: cast(scales)?,
        biases: cast(biases)?,
        group_size,
        bits,
    })
}

/// How `quantize_to` quantizes a layer of `cols` inputs: in the requested groups where
/// they divide the inputs, else in groups of 32; `None` where neither does (the layer
/// stays dense).
pub(super) fn grouping_for(cols: i32, quantize_to: Option<Quantization>) -> Option<Quantization> {
    quantize_to.and_then(|q| {
        [q.group_size, 32]
            .into_iter()
            .find(|g| cols % g == 0)
            .map(|group_size| Quantization { group_size, ..q })
    })
}

/// Quantizes a dense `[..., rows, cols]` weight (a linear layer's, or stacked experts')
/// when the user asked for it, grouped as [`grouping_for`] says; layers no group size
/// fits stay dense.
pub(super) fn maybe_quantize(
    weight: Array,
    quantize_to: Option<Quantization>,
) -> Result<std::result::Result<Quantized, Array>> {
    let cols = *weight.shape().last().unwrap_or(&0);
    match grouping_for(cols, quantize_to) {
        Some(Quantization { bits, group_size }) => {
            let (w, scales, biases) = quantize(&weight, group_size, bits)?;
            // Quantized while loading, as the weights are read: left lazy, the whole model
            // would be quantized inside its first forward (a drafter's first round), with
            // the full-precision weights held until then.
            mlx_rs::transforms::eval([&w, &scales, &biases])?;
            Ok(Ok(Quantized {
                weight: w,
                scales,
                biases,
                group_size,
                bits,
            }))
        }
        None => Ok(Err(weight)),
    }
}
