//! Rotary position embeddings with HF's `rope_scaling` variants (linear, llama3, yarn,
//! proportional), turned into the periods MLX's fused rope kernel takes.

use mlx_rs::{fast, Array};

use dspec_plugin_api::error::{ModelError, Result};

/// Rotary position embedding of one attention layer (HF's non-interleaved layout).
#[derive(Clone)]
pub struct Rope {
    dims: i32,
    base: Option<f32>,
    scale: f32,
    /// Per-pair periods when a scaling scheme reshapes the spectrum (llama3, yarn).
    freqs: Option<Array>,
    /// Yarn's attention temperature, applied to the rotated part of q and k.
    mscale: f32,
}

impl Rope {
    /// Builds the rotary embedding from `rope_theta` and an HF `rope_scaling` object
    /// (`null`, or `{"rope_type"|"type": "default"|"linear"|"llama3"|"yarn"|"proportional", ...}`).
    pub fn from_config(
        dims: i32,
        base: f32,
        scaling: &serde_json::Value,
        config_path: &std::path::Path,
    ) -> Result<Self> {
        let plain = Rope {
            dims,
            base: Some(base),
            scale: 1.0,
            freqs: None,
            mscale: 1.0,
        };
        if scaling.is_null() {
            return Ok(plain);
        }
        let kind = scaling["rope_type"]
            .as_str()
            .or(scaling["type"].as_str())
            .unwrap_or("default");
        let num = |key: &str| scaling[key].as_f64();
        let need = |key: &str| {
            num(key).ok_or_else(|| {
                ModelError::config(config_path, format!("rope_scaling ({kind}) needs `{key}`"))
            })
        };
        let half = (dims / 2) as usize;
        // Period of pair i in the unscaled embedding: base^(2i/dims) (MLX's `freqs` are periods).
        let periods: Vec<f64> = (0..half)
            .map(|i| (base as f64).powf(2.0 * i as f64 / dims as f64))
            .collect();
        match kind {
            "default" => Ok(plain),
            "proportional" => {
                // Gemma 4 full-attention layers: the first `partial_rotary_factor` share
                // of each half-head rotates, with frequencies spaced over the *whole* head
                // (exponent 2i/dims, not 2i/rotated); the other pairs keep period ∞, i.e.
                // stay unrotated. HF: `_compute_proportional_rope_parameters`.
                let partial = num("partial_rotary_factor").unwrap_or(1.0);
                let factor = num("factor").unwrap_or(1.0);
                let angles = ((partial * dims as f64) / 2.0).floor().max(0.0) as usize;
                let adjusted: Vec<f32> = periods
                    .iter()
                    .enumerate()
                    .map(|(i, &p)| if i < angles { (p * factor) as f32 } else { f32::INFINITY })
                    .collect();
                Ok(Rope { base: None, freqs: Some(Array::from_slice(&adjusted, &[half as i32])), ..plain })
            }
            "linear" => Ok(Rope { scale: 1.0 / need("factor")? as f32, ..plain }),
            "llama3" => {
                let factor = need("factor")?;
                let low = num("low_freq_factor").unwrap_or(1.0);
                let high = num("high_freq_factor").unwrap_or(4.0);
                let original = need("original_max_position_embeddings")?;
                let low_wavelen = original / low;
                let high_wavelen = original / high;
                let adjusted: Vec<f32> = periods
                    .iter()
                    .map(|&p| {
                        let wavelen = 2.0 * std::f64::consts::PI * p;
                        if wavelen < high_wavelen {
                            p
                        } else if wavelen > low_wavelen {
                            p * factor
                        } else {
                            // Interpolate the inverse frequency between scaled and unscaled.
                            let smooth = (original / wavelen - low) / (high - low);
                            1.0 / ((1.0 - smooth) / (factor * p) + smooth / p)
                        }
                    })
                    .map(|p| p as f32)
                    .collect();
                Ok(Rope { base: None, freqs: Some(Array::from_slice(&adjusted, &[half as i32])), ..plain })
            }
            "yarn" => {
                let factor = need("factor")?;
                let original = num("original_max_position_embeddings").unwrap_or(4096.0);
                let beta_fast = num("beta_fast").unwrap_or(32.0);
                let beta_slow = num("beta_slow").unwrap_or(1.0);
                let get_mscale = |scale: f64, m: f64| if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 };
                let mscale = match num("attention_factor") {
                    Some(f) => f,
                    None => match (num("mscale"), num("mscale_all_dim")) {
                        (Some(m), Some(all)) => get_mscale(factor, m) / get_mscale(factor, all),
                        (Some(m), None) => get_mscale(factor, m),
                        _ => get_mscale(factor, 1.0),
                    },
                };
                // Pair index at which a given number of rotations fits the original context.
                let correction = |rotations: f64| {
                    dims as f64 * (original / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * (base as f64).ln())
                };
                let low = correction(beta_fast).floor().max(0.0);
                let high = correction(beta_slow).ceil().min(dims as f64 - 1.0);
                let span = if high == low { 0.001 } else { high - low };
                let adjusted: Vec<f32> = periods
                    .iter()
                    .enumerate()
                    .map(|(i, &p)| {
                        // 1 → keep the original frequency (extrapolate), 0 → interpolate.
                        let extrapolate = 1.0 - ((i as f64 - low) / span).clamp(0.0, 1.0);
                        let inv = (1.0 / p) * extrapolate + (1.0 / (p * factor)) * (1.0 - extrapolate);
                        (1.0 / inv) as f32
                    })
                    .collect();
                Ok(Rope {
                    base: None,
                    freqs: Some(Array::from_slice(&adjusted, &[half as i32])),
                    mscale: mscale as f32,
                    ..plain
                })
            }
            other => Err(ModelError::config(
                config_path,
                format!("rope_scaling type `{other}` is not supported (supported: default, linear, llama3, yarn, proportional)"),
            )),
        }
    }

    /// Rotates `x` (`[B, H, L, D]`) for positions `offset..offset+L`.
    pub fn forward(&self, x: &Array, offset: i32) -> Result<Array> {
        let x = self.temperature(x)?;
        Ok(fast::rope(
            &x,
            self.dims,
            false,
            self.base,
            self.scale,
            offset,
            self.freqs.as_ref(),
        )?)
    }

    /// Rotates `x` (`[B, H, 1, D]`) with batch row b at position `positions[b]`: several
    /// sequences' positions rotated in one call, each at its own place.
    pub fn forward_at(&self, x: &Array, positions: &Array) -> Result<Array> {
        let x = self.temperature(x)?;
        Ok(fast::rope_dynamic(
            &x,
            self.dims,
            false,
            self.base,
            self.scale,
            positions,
            self.freqs.as_ref(),
        )?)
    }

    /// `x` times yarn's attention temperature, where it has one.
    fn temperature(&self, x: &Array) -> Result<Array> {
        Ok(match self.mscale != 1.0 {
            true => x.multiply(Array::from_f32(self.mscale).as_dtype(x.dtype())?)?,
            false => x.clone(),
        })
    }
}
