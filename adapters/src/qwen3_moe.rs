//! Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B, Qwen3-235B-A22B): Qwen3's attention
//! with a mixture of experts in place of the MLP on every `decoder_sparse_step`-th layer
//! not listed in `mlp_only_layers`.

use std::path::Path;

use dspec_plugin_api::error::Result;

use crate::config::{parse_config, MoeConfig, MoeDefaults};
use crate::transformer::DecoderSpec;

fn spec(config: &serde_json::Value, dir: &Path) -> Result<DecoderSpec> {
    let moe: MoeConfig = parse_config(config, dir)?;
    let dense = crate::qwen3::spec(config, dir)?;
    // transformers' Qwen3MoeConfig: no experts, no renormalisation unless asked.
    let defaults = MoeDefaults {
        experts: 0,
        norm_topk_prob: false,
    };
    let experts = moe.experts_per_layer(dense.layers.len(), defaults, &dir.join("config.json"))?;
    Ok(DecoderSpec {
        model_type: "qwen3_moe".into(),
        experts,
        ..dense
    })
}

crate::decoder_family! {
    name: "qwen3_moe",
    model_types: ["qwen3_moe"],
    aliases: [],
    architectures: ["Qwen3MoeForCausalLM"],
    spec: spec,
}

#[cfg(test)]
mod tests {
    use crate::fixtures::{check_family, with, TINY_LLAMA};

    /// Layer 0 sparse, layer 1 dense (`mlp_only_layers`); 4 experts, 2 per position.
    pub const TINY_QWEN3_MOE_OVERRIDES: &str = r#"{
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": true,
        "mlp_only_layers": [1]
    }"#;

    #[test]
    fn tiny_qwen3_moe_conforms() {
        check_family(&with(TINY_LLAMA, TINY_QWEN3_MOE_OVERRIDES));
    }
}
