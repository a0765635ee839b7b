//! Llama (1–3.x, and the many checkpoints with its layout: SmolLM, TinyLlama, …):
//! pre-norm blocks, SiLU MLP, RoPE with default/linear/llama3/yarn scaling.

use std::path::Path;

use serde::Deserialize;

use dspec_plugin_api::error::Result;

use crate::attention::AttentionSpec;
use crate::config::{parse_config, CommonConfig};
use crate::transformer::DecoderSpec;

#[derive(Debug, Deserialize)]
struct LlamaConfig {
    #[serde(flatten)]
    common: CommonConfig,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    mlp_bias: bool,
}

/// Maps a llama config.json onto the shared decoder. Mistral reuses this with its window.
pub(crate) fn llama_spec(
    config: &serde_json::Value,
    dir: &Path,
    model_type: &str,
    window: Option<i32>,
) -> Result<DecoderSpec> {
    let cfg: LlamaConfig = parse_config(config, dir)?;
    let c = &cfg.common;
    let path = dir.join("config.json");
    c.validate(&path)?;
    let base = c.attention(c.global_rope(&path)?);
    let layers = (0..c.num_hidden_layers as usize)
        .map(|i| AttentionSpec {
            qkv_bias: cfg.attention_bias,
            o_bias: cfg.attention_bias,
            sliding_window: if c.layer_is_sliding(i).unwrap_or(true) {
                window
            } else {
                None
            },
            ..base.clone()
        })
        .collect();
    Ok(DecoderSpec {
        mlp_bias: cfg.mlp_bias,
        layers,
        ..c.decoder(model_type, &path, "silu")?
    })
}

fn spec(config: &serde_json::Value, dir: &Path) -> Result<DecoderSpec> {
    llama_spec(config, dir, "llama", None)
}

crate::decoder_family! {
    name: "llama",
    model_types: ["llama"],
    aliases: [],
    architectures: ["LlamaForCausalLM"],
    spec: spec,
}

#[cfg(test)]
mod tests {
    #[test]
    fn tiny_llama_conforms() {
        crate::fixtures::check_family(crate::fixtures::TINY_LLAMA);
    }

    #[test]
    fn tiny_llama_with_llama3_rope_and_bias_conforms() {
        crate::fixtures::check_family(&crate::fixtures::with(
            crate::fixtures::TINY_LLAMA,
            r#"{"attention_bias": true, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8}}"#,
        ));
    }
}
