//! Gemma 2: sandwich norms (before and after attention and MLP), (1 + w) RMSNorm,
//! softcapped attention scores and final logits, sliding window on alternate layers,
//! query scaling by `query_pre_attn_scalar`.

use std::path::Path;

use serde::Deserialize;

use dspec_plugin_api::error::Result;

use crate::attention::AttentionSpec;
use crate::config::{parse_config, CommonConfig};
use crate::transformer::{DecoderSpec, NormLayout};

#[derive(Debug, Deserialize)]
struct Gemma2Config {
    #[serde(flatten)]
    common: CommonConfig,
    #[serde(default)]
    attention_bias: bool,
    query_pre_attn_scalar: Option<f32>,
    attn_logit_softcapping: Option<f32>,
    final_logit_softcapping: Option<f32>,
}

fn spec(config: &serde_json::Value, dir: &Path) -> Result<DecoderSpec> {
    let cfg: Gemma2Config = parse_config(config, dir)?;
    let c = &cfg.common;
    let path = dir.join("config.json");
    c.validate(&path)?;
    let base = AttentionSpec {
        scale: cfg
            .query_pre_attn_scalar
            .unwrap_or(c.head_dim() as f32)
            .powf(-0.5),
        qkv_bias: cfg.attention_bias,
        o_bias: cfg.attention_bias,
        softcap: cfg.attn_logit_softcapping,
        ..c.attention(c.global_rope(&path)?)
    };
    let layers = (0..c.num_hidden_layers as usize)
        .map(|i| {
            // Without layer_types, even layers are the local (windowed) ones.
            let sliding = c.layer_is_sliding(i).unwrap_or(i % 2 == 0);
            AttentionSpec {
                sliding_window: if sliding { c.sliding_window } else { None },
                ..base.clone()
            }
        })
        .collect();
    Ok(DecoderSpec {
        final_logit_softcap: cfg.final_logit_softcapping,
        layers,
        ..c.gemma_decoder("gemma2", &path, NormLayout::Sandwich)?
    })
}

crate::decoder_family! {
    name: "gemma2",
    model_types: ["gemma2"],
    aliases: [],
    architectures: ["Gemma2ForCausalLM"],
    spec: spec,
}

#[cfg(test)]
mod tests {
    use crate::fixtures::{check_family, with, TINY_LLAMA};

    #[test]
    fn tiny_gemma2_conforms() {
        check_family(&with(
            TINY_LLAMA,
            r#"{"model_type": "gemma2", "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 5,
                "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                "hidden_activation": "gelu_pytorch_tanh"}"#,
        ));
    }
}
