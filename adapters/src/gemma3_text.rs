//! Gemma 3 (text): gemma2's sandwich norms plus (1 + w) RMSNorm on queries and keys;
//! local (sliding) layers with their own rope base, a global layer every
//! `sliding_window_pattern` layers with rope scaling. Also reads the text part of
//! multimodal `gemma3` configs (`text_config`, `language_model.` tensor names).

use std::path::Path;

use serde::Deserialize;

use dspec_plugin_api::error::Result;

use crate::attention::AttentionSpec;
use crate::config::{parse_config, CommonConfig};
use crate::layers::{NormWeight, Rope};
use crate::transformer::{DecoderSpec, NormLayout};

fn default_pattern() -> usize {
    6
}

fn default_local_base() -> f32 {
    10_000.0
}

#[derive(Debug, Deserialize)]
struct Gemma3TextConfig {
    #[serde(flatten)]
    common: CommonConfig,
    #[serde(default)]
    attention_bias: bool,
    query_pre_attn_scalar: Option<f32>,
    attn_logit_softcapping: Option<f32>,
    final_logit_softcapping: Option<f32>,
    #[serde(default = "default_pattern")]
    sliding_window_pattern: usize,
    #[serde(default = "default_local_base")]
    rope_local_base_freq: f32,
}

fn spec(config: &serde_json::Value, dir: &Path) -> Result<DecoderSpec> {
    let (text, prefix) = match config.get("text_config") {
        Some(text) => (text, "language_model.model."),
        None => (config, "model."),
    };
    let cfg: Gemma3TextConfig = parse_config(text, dir)?;
    let c = &cfg.common;
    let path = dir.join("config.json");
    c.validate(&path)?;
    // transformers ≥ 5 writes one rope object per layer type in `rope_parameters`, in
    // place of rope_theta + rope_scaling (global) and rope_local_base_freq (local).
    let per_type = |layer_type: &str, default_theta: f32| -> Result<Option<Rope>> {
        match c.rope_parameters.get(layer_type) {
            Some(p) if p.is_object() => {
                let theta = p["rope_theta"].as_f64().map_or(default_theta, |t| t as f32);
                Ok(Some(Rope::from_config(c.head_dim(), theta, p, &path)?))
            }
            _ => Ok(None),
        }
    };
    let global_rope = match per_type("full_attention", 1_000_000.0)? {
        Some(rope) => rope,
        None => c.global_rope(&path)?,
    };
    let local_rope = match per_type("sliding_attention", cfg.rope_local_base_freq)? {
        Some(rope) => rope,
        None => Rope::from_config(
            c.head_dim(),
            cfg.rope_local_base_freq,
            &serde_json::Value::Null,
            &path,
        )?,
    };
    let base = AttentionSpec {
        scale: cfg
            .query_pre_attn_scalar
            .unwrap_or(c.head_dim() as f32)
            .powf(-0.5),
        qkv_bias: cfg.attention_bias,
        o_bias: cfg.attention_bias,
        qk_norm: Some((c.rms_norm_eps, NormWeight::OffsetByOne)),
        softcap: cfg.attn_logit_softcapping,
        ..c.attention(global_rope.clone())
    };
    let pattern = cfg.sliding_window_pattern.max(1);
    let layers = (0..c.num_hidden_layers as usize)
        .map(|i| {
            let sliding = c.layer_is_sliding(i).unwrap_or((i + 1) % pattern != 0);
            AttentionSpec {
                sliding_window: if sliding { c.sliding_window } else { None },
                rope: if sliding {
                    local_rope.clone()
                } else {
                    global_rope.clone()
                },
                ..base.clone()
            }
        })
        .collect();
    Ok(DecoderSpec {
        prefix: prefix.into(),
        final_logit_softcap: cfg.final_logit_softcapping,
        layers,
        ..c.gemma_decoder("gemma3_text", &path, NormLayout::Sandwich)?
    })
}

crate::decoder_family! {
    name: "gemma3_text",
    model_types: ["gemma3_text"],
    aliases: ["gemma3"],
    architectures: ["Gemma3ForCausalLM"],
    spec: spec,
}

#[cfg(test)]
mod tests {
    use crate::fixtures::{check_family, with, TINY_LLAMA};

    #[test]
    fn tiny_gemma3_text_conforms() {
        // Two layers with pattern 2: layer 0 local (window 5, own rope base), layer 1 global.
        check_family(&with(
            TINY_LLAMA,
            r#"{"model_type": "gemma3_text", "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 5,
                "sliding_window_pattern": 2, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                "rope_scaling": {"rope_type": "linear", "factor": 8.0}}"#,
        ));
    }
}
