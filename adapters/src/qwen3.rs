//! Qwen3: llama layout with RMSNorm on each head's queries and keys, explicit
//! head_dim, no biases by default.

use std::path::Path;

use serde::Deserialize;

use dspec_plugin_api::error::Result;

use crate::attention::AttentionSpec;
use crate::config::{parse_config, CommonConfig};
use crate::layers::NormWeight;
use crate::transformer::DecoderSpec;

#[derive(Debug, Deserialize)]
struct Qwen3Config {
    #[serde(flatten)]
    common: CommonConfig,
    #[serde(default)]
    attention_bias: bool,
}

/// The dense Qwen3 decoder `config` describes; Qwen3-MoE builds on it.
pub(crate) fn spec(config: &serde_json::Value, dir: &Path) -> Result<DecoderSpec> {
    let cfg: Qwen3Config = parse_config(config, dir)?;
    let c = &cfg.common;
    let path = dir.join("config.json");
    c.validate(&path)?;
    let base = AttentionSpec {
        qkv_bias: cfg.attention_bias,
        o_bias: cfg.attention_bias,
        qk_norm: Some((c.rms_norm_eps, NormWeight::Plain)),
        ..c.attention(c.global_rope(&path)?)
    };
    let layers = (0..c.num_hidden_layers as usize)
        .map(|i| AttentionSpec {
            sliding_window: if c.layer_is_sliding(i).unwrap_or(false) {
                c.sliding_window
            } else {
                None
            },
            ..base.clone()
        })
        .collect();
    Ok(DecoderSpec {
        layers,
        ..c.decoder("qwen3", &path, "silu")?
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
