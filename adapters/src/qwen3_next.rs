//! Qwen3-Next (Qwen3-Next-80B-A3B): the hybrid decoder (hybrid.rs) with Gated DeltaNet
//! projections fused per key head (`in_proj_qkvz`, `in_proj_ba`), and as released a
//! mixture of experts with a gated shared expert in every MLP (`num_experts` 0 gives
//! dense MLPs).

use std::path::Path;

use dspec_plugin_api::error::Result;
use dspec_plugin_api::{AdapterRegistration, LoadRequest, TargetModel, WeightSource};

use crate::config::{parse_config, FamilyBuilder, MoeDefaults};
use crate::gated_delta::ProjectionLayout;
use crate::hybrid::{HybridConfig, HybridDecoder, HybridSpec};
use crate::weights::ProgressWeights;

/// HF's `Qwen3NextConfig` defaults: 512 experts, their probabilities renormalised.
const MOE_DEFAULTS: MoeDefaults = MoeDefaults {
    experts: 512,
    norm_topk_prob: true,
};

fn spec(config: &serde_json::Value, dir: &Path) -> Result<HybridSpec> {
    let cfg: HybridConfig = parse_config(config, dir)?;
    cfg.spec(
        "qwen3_next",
        &dir.join("config.json"),
        ProjectionLayout::GroupedByKeyHead,
        MOE_DEFAULTS,
    )
}

fn build(
    config: &serde_json::Value,
    dir: &Path,
    weights: &mut dyn WeightSource,
) -> Result<Box<dyn TargetModel>> {
    Ok(Box::new(HybridDecoder::load(spec(config, dir)?, weights)?))
}

fn load(req: &LoadRequest) -> Result<Box<dyn TargetModel>> {
    let spec = spec(req.config, req.dir)?;
    Ok(Box::new(HybridDecoder::load(
        spec,
        &mut ProgressWeights::open(req)?,
    )?))
}

inventory::submit! {
    AdapterRegistration {
        name: "qwen3_next",
        model_types: &["qwen3_next"],
        aliases: &[],
        architectures: &["Qwen3NextForCausalLM"],
        load,
    }
}

inventory::submit! {
    FamilyBuilder { model_type: "qwen3_next", build }
}

#[cfg(test)]
mod tests {
    use crate::fixtures::{
        check_family, with, TINY_LLAMA, TINY_QWEN3_5_OVERRIDES, TINY_QWEN3_NEXT_OVERRIDES,
    };

    #[test]
    fn tiny_qwen3_next_conforms() {
        check_family(&with(
            &with(TINY_LLAMA, TINY_QWEN3_5_OVERRIDES),
            TINY_QWEN3_NEXT_OVERRIDES,
        ));
    }

    /// As released: experts on every layer, with a gated shared expert.
    #[test]
    fn tiny_qwen3_next_moe_conforms() {
        let moe = r#"{"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32, "norm_topk_prob": true}"#;
        check_family(&with(
            &with(
                &with(TINY_LLAMA, TINY_QWEN3_5_OVERRIDES),
                TINY_QWEN3_NEXT_OVERRIDES,
            ),
            moe,
        ));
    }
}
