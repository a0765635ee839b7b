//! Qwen3: llama layout with RMSNorm on each head's queries and keys, explicit
//! head_dim, no biases by default.

use std::path::Path;

use serde::Deserialize;

use dspec_plugin_api::error::Result;

use crate::attention::AttentionSpec;
use crate::config::{parse_config, CommonConfig};
use crate::layers::{Activation, NormWeight, Rope};
use crate::transformer::{DecoderSpec, NormLayout};

#[derive(Debug, Deserialize)]
struct Qwen3Config {
    #[serde(flatten)]
    common: CommonConfig,
    #[serde(default)]
    attention_bias: bool,
}

fn spec(config: &serde_json::Value, dir: &Path) -> Result<DecoderSpec> {
    let cfg: Qwen3Config = parse_config(config, dir)?;
    let c = &cfg.common;
    let path = dir.join("config.json");
    c.validate(&path)?;
    let (theta, scaling) = c.rope();
    let rope = Rope::from_config(c.head_dim(), theta, &scaling, &path)?;
    let layers = (0..c.num_hidden_layers as usize)
        .map(|i| AttentionSpec {
            hidden: c.hidden_size,
            heads: c.num_attention_heads,
            kv_heads: c.kv_heads(),
            head_dim: c.head_dim(),
            scale: (c.head_dim() as f32).powf(-0.5),
            qkv_bias: cfg.attention_bias,
            o_bias: cfg.attention_bias,
            qk_norm: Some((c.rms_norm_eps, NormWeight::Plain)),
            sliding_window: if c.layer_is_sliding(i).unwrap_or(false) {
                c.sliding_window
            } else {
                None
            },
            softcap: None,
            rope: rope.clone(),
        })
        .collect();
    Ok(DecoderSpec {
        model_type: "qwen3".into(),
        prefix: "model.".into(),
        vocab_size: c.vocab_size,
        hidden_size: c.hidden_size,
        intermediate_size: c.intermediate_size,
        rms_norm_eps: c.rms_norm_eps,
        norm_weight: NormWeight::Plain,
        norm_layout: NormLayout::PreNorm,
        activation: Activation::from_name(&c.activation_name("silu"), &path)?,
        mlp_bias: false,
        embed_scale: None,
        tie_word_embeddings: c.tie_word_embeddings.unwrap_or(false),
        final_logit_softcap: None,
        max_position_embeddings: c.max_position_embeddings,
        layers,
    })
}

crate::decoder_family! {
    name: "qwen3",
    model_types: ["qwen3"],
    aliases: [],
    architectures: ["Qwen3ForCausalLM"],
    spec: spec,
}

#[cfg(test)]
mod tests {
    use crate::fixtures::{check_family, with, TINY_LLAMA};

    #[test]
    fn tiny_qwen3_conforms() {
        // head_dim deliberately differs from hidden/heads, as in real Qwen3 checkpoints.
        check_family(&with(
            TINY_LLAMA,
            r#"{"model_type": "qwen3", "head_dim": 16, "tie_word_embeddings": true}"#,
        ));
    }
}
