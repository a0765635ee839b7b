//! The drafter a run trains, chosen from the target: its config.json in the published
//! schema, its layers' shapes and its blocks' layout.

use std::path::Path;

use serde_json::json;

use dspec_adapters::config::{parse_config, CommonConfig};

use super::batch::BlockLayout;
use super::net::NetShape;
use crate::error::EngineError;

/// Which drafter `--kind` trains.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum DrafterKind {
    Dflash,
    Dspark,
}

impl DrafterKind {
    pub fn name(self) -> &'static str {
        match self {
            DrafterKind::Dflash => "dflash",
            DrafterKind::Dspark => "dspark",
        }
    }

    /// The published block sizes: DFlash 16, DSpark 7.
    pub fn default_block_size(self) -> usize {
        match self {
            DrafterKind::Dflash => 16,
            DrafterKind::Dspark => 7,
        }
    }

    /// γ of the position weighting, as the published recipes set it.
    pub fn default_gamma(self) -> f32 {
        match self {
            DrafterKind::Dflash => 7.0,
            DrafterKind::Dspark => 4.0,
        }
    }
}

/// Everything about the drafter that its config.json says.
#[derive(Debug, Clone)]
pub struct DrafterSpec {
    pub kind: DrafterKind,
    pub shape: NetShape,
    pub layout: BlockLayout,
    pub taps: Vec<usize>,
    /// config.json as written beside the weights.
    pub config: serde_json::Value,
}

/// `count` target layers spread evenly, as the published drafters choose them: from
/// the second layer to the fourth from last (z-lab's Qwen3 drafters tap 1, 9, 17, 25,
/// 33 of 36); every layer where the target has no more than `count`.
pub fn default_taps(layers: usize, count: usize) -> Vec<usize> {
    if layers <= count {
        return (0..layers).collect();
    }
    let (first, last) = (1usize, layers.saturating_sub(3).max(2));
    let mut taps: Vec<usize> = (0..count)
        .map(|i| {
            let step = (last - first) as f64 / (count - 1).max(1) as f64;
            (first as f64 + step * i as f64).round() as usize
        })
        .collect();
    taps.dedup();
    taps
}

/// Default depth: one layer for targets under 3B parameters, else five.
pub fn default_layers(target: &CommonConfig) -> usize {
    let (h, i, l, v) = (
        target.hidden_size as f64,
        target.intermediate_size as f64,
        target.num_hidden_layers as f64,
        target.vocab_size as f64,
    );
    let params = l * (4.0 * h * h + 3.0 * h * i) + v * h;
    if params < 3e9 {
        1
    } else {
        5
    }
}

/// The target's config as the drafter copies it.
pub fn target_config(dir: &Path) -> Result<(serde_json::Value, CommonConfig), EngineError> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| EngineError::Invalid(format!("reading {}: {e}", path.display())))?;
    let value: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| EngineError::Invalid(format!("{}: invalid JSON: {e}", path.display())))?;
    let common: CommonConfig = parse_config(&value, dir).map_err(|e| {
        EngineError::Invalid(format!(
            "train-drafter copies the drafter's shapes from the target's config.json, and \
             could not read them: {e}"
        ))
    })?;
    Ok((value, common))
}

/// The drafter for `target`: `layers` decoder layers of the target's width, heads and
/// MLP, tapping `taps`, drafting blocks of `block_size`.
pub fn drafter_spec(
    kind: DrafterKind,
    target: &CommonConfig,
    dtype: &str,
    layers: usize,
    block_size: usize,
    taps: Vec<usize>,
) -> Result<DrafterSpec, EngineError> {
    let target_layers = target.num_hidden_layers as usize;
    if let Some(&bad) = taps.iter().find(|&&t| t >= target_layers) {
        return Err(EngineError::Invalid(format!(
            "--taps: layer {bad} is past the target's {target_layers} layers (0..={})",
            target_layers.saturating_sub(1)
        )));
    }
    let (theta, _) = target.rope();
    let shape = NetShape {
        hidden: target.hidden_size,
        intermediate: target.intermediate_size,
        layers,
        heads: target.num_attention_heads,
        kv_heads: target.kv_heads(),
        head_dim: target.head_dim(),
        tap_width: taps.len() as i32 * target.hidden_size,
        eps: target.rms_norm_eps,
        rope_theta: theta,
        windows: vec![None; layers],
        markov_rank: match kind {
            DrafterKind::Dflash => 0,
            DrafterKind::Dspark => MARKOV_RANK.min(target.vocab_size),
        },
        vocab: target.vocab_size,
    };
    // A token id the target's embedding has; which one does not matter (the drafter
    // learns what the mask positions mean), the vocabulary's last is rarely a real token.
    let mask_token = (target.vocab_size - 1) as u32;
    let (layout, config) = match kind {
        DrafterKind::Dflash => (
            BlockLayout {
                block_size: block_size as i32,
                first_predicted: 1,
                ahead: 0,
                mask_token,
            },
            dflash_config(target, &shape, &taps, dtype, block_size, mask_token),
        ),
        DrafterKind::Dspark => (
            BlockLayout {
                block_size: block_size as i32,
                first_predicted: 0,
                ahead: 1,
                mask_token,
            },
            dspark_config(target, &shape, &taps, block_size, mask_token),
        ),
    };
    Ok(DrafterSpec {
        kind,
        shape,
        layout,
        taps,
        config,
    })
}

/// Rank of DSpark's Markov head: the published drafters' 256.
pub const MARKOV_RANK: i32 = 256;

/// z-lab's DFlash config.json.
fn dflash_config(
    target: &CommonConfig,
    shape: &NetShape,
    taps: &[usize],
    dtype: &str,
    block_size: usize,
    mask_token: u32,
) -> serde_json::Value {
    let layers = shape.layers;
    json!({
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "vocab_size": target.vocab_size,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": shape.eps,
        "rope_theta": shape.rope_theta,
        "rope_scaling": null,
        "max_position_embeddings": target.max_position_embeddings,
        "attention_bias": false,
        "layer_types": vec!["full_attention"; layers],
        "sliding_window": null,
        "use_sliding_window": false,
        "tie_word_embeddings": false,
        "torch_dtype": dtype,
        "block_size": block_size,
        "num_target_layers": target.num_hidden_layers,
        "dflash_config": {"target_layer_ids": taps, "mask_token_id": mask_token},
    })
}

/// The config.json of DeepSpec's qwen3-family DSpark drafters (seed 003's schema):
/// its own embedding and head (the target's, copied), a Markov head of rank
/// [`MARKOV_RANK`] and a confidence head that reads it.
fn dspark_config(
    target: &CommonConfig,
    shape: &NetShape,
    taps: &[usize],
    block_size: usize,
    mask_token: u32,
) -> serde_json::Value {
    json!({
        "architectures": ["DSparkDraftModel"],
        "model_type": "qwen3",
        "vocab_size": target.vocab_size,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "rms_norm_eps": shape.eps,
        "rope_theta": shape.rope_theta,
        "attention_bias": false,
        "max_position_embeddings": target.max_position_embeddings,
        "block_size": block_size,
        "mask_token_id": mask_token,
        "target_layer_ids": taps,
        "num_target_layers": target.num_hidden_layers,
        "target_hidden_size": target.hidden_size,
        "markov_rank": shape.markov_rank,
        "markov_head_type": "vanilla",
        "enable_confidence_head": true,
        "confidence_head_with_markov": true,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_taps_spread_like_the_published_drafters() {
        assert_eq!(default_taps(36, 5), vec![1, 9, 17, 25, 33]);
        assert_eq!(default_taps(2, 5), vec![0, 1]);
        assert_eq!(default_taps(28, 5), vec![1, 7, 13, 19, 25]);
        assert_eq!(default_taps(6, 2), vec![1, 3]);
    }
}
