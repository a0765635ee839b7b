//! Qwen2 / Qwen2.5: llama layout with biases on q/k/v (not o), optional sliding
//! window on layers from `max_window_layers` up when `use_sliding_window` is set.

use std::path::Path;

use serde::Deserialize;

use dspec_plugin_api::error::Result;

use crate::attention::AttentionSpec;
use crate::config::{parse_config, CommonConfig};
use crate::layers::{Activation, NormWeight, Rope};
use crate::transformer::{DecoderSpec, NormLayout};

#[derive(Debug, Deserialize)]
struct Qwen2Config {
    #[serde(flatten)]
    common: CommonConfig,
    #[serde(default)]
    use_sliding_window: bool,
    max_window_layers: Option<usize>,
}

fn spec(config: &serde_json::Value, dir: &Path) -> Result<DecoderSpec> {
    let cfg: Qwen2Config = parse_config(config, dir)?;
    let c = &cfg.common;
    let path = dir.join("config.json");
    c.validate(&path)?;
    let (theta, scaling) = c.rope();
    let rope = Rope::from_config(c.head_dim(), theta, &scaling, &path)?;
    let first_windowed = cfg.max_window_layers.unwrap_or(0);
    let layers = (0..c.num_hidden_layers as usize)
        .map(|i| {
            let sliding = c
                .layer_is_sliding(i)
                .unwrap_or(cfg.use_sliding_window && i >= first_windowed);
            AttentionSpec {
                hidden: c.hidden_size,
                heads: c.num_attention_heads,
                kv_heads: c.kv_heads(),
                head_dim: c.head_dim(),
                scale: (c.head_dim() as f32).powf(-0.5),
                qkv_bias: true,
                o_bias: false,
                qk_norm: None,
                sliding_window: if sliding { c.sliding_window } else { None },
                softcap: None,
                rope: rope.clone(),
            }
        })
        .collect();
    Ok(DecoderSpec {
        model_type: "qwen2".into(),
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
    name: "qwen2",
    model_types: ["qwen2"],
    aliases: [],
    architectures: ["Qwen2ForCausalLM"],
    spec: spec,
}

#[cfg(test)]
mod tests {
    use crate::fixtures::{check_family, with, TINY_LLAMA};

    #[test]
    fn tiny_qwen2_conforms() {
        check_family(&with(
            TINY_LLAMA,
            r#"{"model_type": "qwen2", "tie_word_embeddings": true, "rope_theta": 1000000.0}"#,
        ));
    }

    #[test]
    fn tiny_qwen2_with_yarn_conforms() {
        check_family(&with(
            TINY_LLAMA,
            r#"{"model_type": "qwen2", "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}}"#,
        ));
    }
}
