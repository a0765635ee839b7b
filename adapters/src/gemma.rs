//! Gemma (1): pre-norm blocks with (1 + w) RMSNorm, tanh-GELU MLP, embeddings scaled
//! by √hidden, tied output head.

use std::path::Path;

use serde::Deserialize;

use dspec_plugin_api::error::Result;

use crate::attention::AttentionSpec;
use crate::config::{parse_config, CommonConfig};
use crate::transformer::{DecoderSpec, NormLayout};

#[derive(Debug, Deserialize)]
struct GemmaConfig {
    #[serde(flatten)]
    common: CommonConfig,
    #[serde(default)]
    attention_bias: bool,
}

fn spec(config: &serde_json::Value, dir: &Path) -> Result<DecoderSpec> {
    let cfg: GemmaConfig = parse_config(config, dir)?;
    let c = &cfg.common;
    let path = dir.join("config.json");
    c.validate(&path)?;
    let attention = AttentionSpec {
        qkv_bias: cfg.attention_bias,
        o_bias: cfg.attention_bias,
        ..c.attention(c.global_rope(&path)?)
    };
    Ok(DecoderSpec {
        layers: vec![attention; c.num_hidden_layers as usize],
        ..c.gemma_decoder("gemma", &path, NormLayout::PreNorm)?
    })
}

crate::decoder_family! {
    name: "gemma",
    model_types: ["gemma"],
    aliases: [],
    architectures: ["GemmaForCausalLM"],
    spec: spec,
}

#[cfg(test)]
mod tests {
    use crate::fixtures::{check_family, with, TINY_LLAMA};

    #[test]
    fn tiny_gemma_conforms() {
        check_family(&with(
            TINY_LLAMA,
            r#"{"model_type": "gemma", "head_dim": 16, "hidden_act": "gelu"}"#,
        ));
    }
}
