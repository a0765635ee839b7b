//! Gemma (1): pre-norm blocks with (1 + w) RMSNorm, tanh-GELU MLP, embeddings scaled
//! by √hidden, tied output head.

use std::path::Path;

use serde::Deserialize;

use dspec_plugin_api::error::Result;

use crate::attention::AttentionSpec;
use crate::config::{parse_config, CommonConfig};
use crate::layers::{Activation, NormWeight, Rope};
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
    let (theta, scaling) = c.rope();
    let rope = Rope::from_config(c.head_dim(), theta, &scaling, &path)?;
    let layers = (0..c.num_hidden_layers)
        .map(|_| AttentionSpec {
            hidden: c.hidden_size,
            heads: c.num_attention_heads,
            kv_heads: c.kv_heads(),
            head_dim: c.head_dim(),
            scale: (c.head_dim() as f32).powf(-0.5),
            qkv_bias: cfg.attention_bias,
            o_bias: cfg.attention_bias,
            qk_norm: None,
            sliding_window: None,
            softcap: None,
            rope: rope.clone(),
        })
        .collect();
    Ok(DecoderSpec {
        model_type: "gemma".into(),
        prefix: "model.".into(),
        vocab_size: c.vocab_size,
        hidden_size: c.hidden_size,
        intermediate_size: c.intermediate_size,
        rms_norm_eps: c.rms_norm_eps,
        norm_weight: NormWeight::OffsetByOne,
        norm_layout: NormLayout::PreNorm,
        // HF Gemma runs the tanh approximation even where configs say "gelu".
        activation: Activation::from_name(&c.activation_name("gelu_pytorch_tanh"), &path)?,
        mlp_bias: false,
        embed_scale: Some((c.hidden_size as f32).sqrt()),
        tie_word_embeddings: c.tie_word_embeddings.unwrap_or(true),
        final_logit_softcap: None,
        max_position_embeddings: c.max_position_embeddings,
        layers,
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
