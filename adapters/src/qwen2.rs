//! Qwen2 / Qwen2.5: llama layout with biases on q/k/v (not o), optional sliding
//! window on layers from `max_window_layers` up when `use_sliding_window` is set.

use std::path::Path;

use serde::Deserialize;

use dspec_plugin_api::error::Result;

use crate::attention::AttentionSpec;
use crate::config::{parse_config, CommonConfig};
use crate::transformer::DecoderSpec;

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
    let base = AttentionSpec {
        qkv_bias: true,
        ..c.attention(c.global_rope(&path)?)
    };
    let first_windowed = cfg.max_window_layers.unwrap_or(0);
    let layers = (0..c.num_hidden_layers as usize)
        .map(|i| {
            let sliding = c
                .layer_is_sliding(i)
                .unwrap_or(cfg.use_sliding_window && i >= first_windowed);
            AttentionSpec {
                sliding_window: if sliding { c.sliding_window } else { None },
                ..base.clone()
            }
        })
        .collect();
    Ok(DecoderSpec {
        layers,
        ..c.decoder("qwen2", &path, "silu")?
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
