//! Qwen3.5: the hybrid decoder (hybrid.rs) with separate Gated DeltaNet
//! projections (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`). Released
//! checkpoints are multimodal: the text model's config is nested under `text_config`
//! and its tensors named `model.language_model.` (HF) or `language_model.model.` (mlx-lm
//! conversions); the vision tower is not loaded. Text-only `qwen3_5_text` checkpoints
//! are flat.

use std::path::Path;

use serde::Deserialize;

use dspec_plugin_api::error::Result;
use dspec_plugin_api::{AdapterRegistration, LoadRequest, TargetModel, WeightSource};

use crate::config::{parse_config, FamilyBuilder, MoeDefaults};
use crate::gated_delta::ProjectionLayout;
use crate::hybrid::{HybridConfig, HybridDecoder, HybridSpec};
use crate::weights::ProgressWeights;

/// transformers' Qwen3.5 configs: the dense one has no experts; the MoE one always
/// renormalises the chosen experts' probabilities (its config has no switch for it).
pub(crate) const MOE_DEFAULTS: MoeDefaults = MoeDefaults {
    experts: 0,
    norm_topk_prob: true,
};

/// A multimodal config: the text model's fields under `text_config`, so that an error
/// about one names it as `text_config.<field>`.
#[derive(Deserialize)]
struct Nested {
    text_config: HybridConfig,
    tie_word_embeddings: Option<bool>,
}

/// The hybrid decoder of a Qwen3.5 config, nested or flat; Qwen3.5-MoE's too.
pub(crate) fn spec(config: &serde_json::Value, dir: &Path) -> Result<HybridSpec> {
    let path = dir.join("config.json");
    let (cfg, top_tie) = match config.get("text_config") {
        Some(_) => {
            let nested: Nested = parse_config(config, dir)?;
            (nested.text_config, nested.tie_word_embeddings)
        }
        None => (parse_config::<HybridConfig>(config, dir)?, None),
    };
    let nested = config.get("text_config").is_some();
    let model_type = config["model_type"].as_str().unwrap_or("qwen3_5");
    let mut spec = cfg.spec(model_type, &path, ProjectionLayout::Separate, MOE_DEFAULTS)?;
    spec.tie_word_embeddings = cfg.common.tie_word_embeddings.or(top_tie).unwrap_or(false);
    spec.prefixes = match nested {
        true => vec!["model.language_model.", "language_model.model.", "model."],
        false => vec!["model.", "language_model.model.", "model.language_model."],
    }
    .into_iter()
    .map(String::from)
    .collect();
    Ok(spec)
}

pub(crate) fn build(
    config: &serde_json::Value,
    dir: &Path,
    weights: &mut dyn WeightSource,
) -> Result<Box<dyn TargetModel>> {
    Ok(Box::new(HybridDecoder::load(spec(config, dir)?, weights)?))
}

pub(crate) fn load(req: &LoadRequest) -> Result<Box<dyn TargetModel>> {
    let spec = spec(req.config, req.dir)?;
    Ok(Box::new(HybridDecoder::load(
        spec,
        &mut ProgressWeights::open(req)?,
    )?))
}

inventory::submit! {
    AdapterRegistration {
        name: "qwen3_5",
        model_types: &["qwen3_5", "qwen3_5_text"],
        aliases: &[],
        architectures: &["Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"],
        load,
    }
}

inventory::submit! {
    FamilyBuilder { model_type: "qwen3_5", build }
}

inventory::submit! {
    FamilyBuilder { model_type: "qwen3_5_text", build }
}

#[cfg(test)]
mod tests {
    use crate::fixtures::{check_family, with, TINY_LLAMA, TINY_QWEN3_5_OVERRIDES};

    #[test]
    fn tiny_qwen3_5_conforms() {
        check_family(&with(TINY_LLAMA, TINY_QWEN3_5_OVERRIDES));
    }
}
