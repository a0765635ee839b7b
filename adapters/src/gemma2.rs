//! Gemma 2: sandwich norms (before and after attention and MLP), (1 + w) RMSNorm,
//! softcapped attention scores and final logits, sliding window on alternate layers,
//! query scaling by `query_pre_attn_scalar`.

use std::path::Path;

use serde::Deserialize;

use dspec_plugin_api::error::Result;

use crate::attention::AttentionSpec;
use crate::config::{parse_config, CommonConfig};
use crate::layers::{Activation, NormWeight, Rope};
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
    let (theta, scaling) = c.rope();
    let rope = Rope::from_config(c.head_dim(), theta, &scaling, &path)?;
    let scale = cfg
        .query_pre_attn_scalar
        .unwrap_or(c.head_dim() as f32)
        .powf(-0.5);
    let layers = (0..c.num_hidden_layers as usize)
        .map(|i| {
            // Without layer_types, even layers are the local (windowed) ones.
            let sliding = c.layer_is_sliding(i).unwrap_or(i % 2 == 0);
            AttentionSpec {
                hidden: c.hidden_size,
                heads: c.num_attention_heads,
                kv_heads: c.kv_heads(),
                head_dim: c.head_dim(),
                scale,
                qkv_bias: cfg.attention_bias,
                o_bias: cfg.attention_bias,
                qk_norm: None,
                sliding_window: if sliding { c.sliding_window } else { None },
                softcap: cfg.attn_logit_softcapping,
                rope: rope.clone(),
            }
        })
        .collect();
    Ok(DecoderSpec {
        model_type: "gemma2".into(),
        prefix: "model.".into(),
        vocab_size: c.vocab_size,
        hidden_size: c.hidden_size,
        intermediate_size: c.intermediate_size,
        rms_norm_eps: c.rms_norm_eps,
        norm_weight: NormWeight::OffsetByOne,
        norm_layout: NormLayout::Sandwich,
        activation: Activation::from_name(&c.activation_name("gelu_pytorch_tanh"), &path)?,
        mlp_bias: false,
        embed_scale: Some((c.hidden_size as f32).sqrt()),
        tie_word_embeddings: c.tie_word_embeddings.unwrap_or(true),
        final_logit_softcap: cfg.final_logit_softcapping,
        max_position_embeddings: c.max_position_embeddings,
        layers,
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
