//! Qwen3.5-MoE and Qwen3.6-MoE (Qwen3.5-35B-A3B and kin): Qwen3.5's hybrid decoder
//! (qwen3_5.rs) with a mixture of experts and a gated shared expert in every MLP. Its
//! Hugging Face checkpoints ship the experts fused (`experts.gate_up_proj`).

use dspec_plugin_api::AdapterRegistration;

use crate::config::FamilyBuilder;
use crate::qwen3_5::{build, load};

inventory::submit! {
    AdapterRegistration {
        name: "qwen3_5_moe",
        model_types: &["qwen3_5_moe", "qwen3_5_moe_text"],
        aliases: &[],
        architectures: &["Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"],
        load,
    }
}

inventory::submit! {
    FamilyBuilder { model_type: "qwen3_5_moe", build }
}

inventory::submit! {
    FamilyBuilder { model_type: "qwen3_5_moe_text", build }
}

#[cfg(test)]
mod tests {
    use crate::fixtures::{check_family, with, TINY_LLAMA, TINY_QWEN3_5_OVERRIDES};

    /// Every layer sparse: 4 experts, 2 per position, a gated shared expert.
    const MOE: &str = r#"{
        "model_type": "qwen3_5_moe_text",
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "norm_topk_prob": true
    }"#;

    #[test]
    fn tiny_qwen3_5_moe_conforms() {
        check_family(&with(&with(TINY_LLAMA, TINY_QWEN3_5_OVERRIDES), MOE));
    }
}
