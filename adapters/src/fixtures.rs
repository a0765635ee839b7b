//! Tiny random checkpoints of any built-in family, written to disk as real model
//! directories (config.json + model.safetensors) so tests exercise the same loading
//! path as users; plus the one-line conformance test every family file runs.
//!
//! Behind the `test-fixtures` feature: the crates whose tests build on these enable it
//! from their dev-dependencies, and a release build has none of it.

mod random_weights;

use std::path::Path;

use dspec_plugin_api::error::{ModelError, Result};
use dspec_plugin_api::{AdapterRegistry, LoadOptions, LoadRequest, Quantization, TargetModel};

use crate::config::FamilyBuilder;

pub use random_weights::RandomWeights;

/// A 2-layer llama small enough to run in milliseconds; other families are written
/// as overrides of it (see [`with`]). GQA (4 query heads over 2 KV heads) on purpose.
pub const TINY_LLAMA: &str = r#"{
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 97,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "tie_word_embeddings": false,
    "torch_dtype": "float32"
}"#;

/// A tiny dense Gemma 4 as overrides of [`TINY_LLAMA`]: layer 0 sliding (window 5,
/// head_dim 16, own v_proj), layer 1 full attention (head_dim 32, one KV head
/// with values from the key projection, a quarter of each half-head rotated).
pub const TINY_GEMMA4_OVERRIDES: &str = r#"{
    "model_type": "gemma4_text",
    "architectures": ["Gemma4ForCausalLM"],
    "head_dim": 16,
    "global_head_dim": 32,
    "num_global_key_value_heads": 1,
    "attention_k_eq_v": true,
    "hidden_size_per_layer_input": 0,
    "num_kv_shared_layers": 0,
    "enable_moe_block": false,
    "sliding_window": 5,
    "layer_types": ["sliding_attention", "full_attention"],
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0}
    },
    "final_logit_softcapping": 30.0,
    "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": true
}"#;

/// A tiny dense Qwen3.5 (text-only layout) as overrides of [`TINY_LLAMA`]: three
/// layers, the first and last Gated DeltaNet (2 key heads over 4 value heads of 8, a
/// kernel of 4), the middle one gated full attention with a quarter of its 16-wide heads
/// rotated.
pub const TINY_QWEN3_5_OVERRIDES: &str = r#"{
    "model_type": "qwen3_5_text",
    "architectures": ["Qwen3_5ForCausalLM"],
    "num_hidden_layers": 3,
    "head_dim": 16,
    "layer_types": ["linear_attention", "full_attention", "linear_attention"],
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "hidden_act": "silu",
    "tie_word_embeddings": false
}"#;

/// [`TINY_QWEN3_5_OVERRIDES`] as a dense Qwen3-Next (projections grouped per key head).
pub const TINY_QWEN3_NEXT_OVERRIDES: &str = r#"{
    "model_type": "qwen3_next",
    "architectures": ["Qwen3NextForCausalLM"],
    "num_experts": 0
}"#;

/// Tiny mixture-of-experts overrides: 4 experts of 32, 2 per position, renormalised;
/// with a sigmoid-gated shared expert of 32 where `shared`.
pub fn tiny_experts(shared: bool) -> String {
    let shared = match shared {
        true => r#", "shared_expert_intermediate_size": 32"#,
        false => "",
    };
    format!(
        r#"{{"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "norm_topk_prob": true{shared}}}"#
    )
}

/// `base` with the top-level keys of `overrides` replaced (both JSON objects).
pub fn with(base: &str, overrides: &str) -> String {
    let mut merged: serde_json::Value = serde_json::from_str(base).unwrap_or_default();
    let extra: serde_json::Value = serde_json::from_str(overrides).unwrap_or_default();
    if let (Some(m), Some(e)) = (merged.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            m.insert(k.clone(), v.clone());
        }
    }
    merged.to_string()
}

/// Writes `config.json` and random weights for the family named by its `model_type`.
/// With `quantize`, linear and embedding weights are stored MLX-quantized and the
/// config gets the `quantization` entry MLX-community checkpoints carry.
pub fn write_random_model(
    dir: &Path,
    config_json: &str,
    seed: u64,
    quantize: Option<Quantization>,
) -> Result<()> {
    let path = dir.join("config.json");
    let mut config: serde_json::Value = serde_json::from_str(config_json)
        .map_err(|e| ModelError::config(&path, format!("invalid JSON: {e}")))?;
    let model_type = config["model_type"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let family = inventory::iter::<FamilyBuilder>
        .into_iter()
        .find(|f| f.model_type == model_type)
        .ok_or_else(|| ModelError::config(&path, format!("no built-in family `{model_type}`")))?;
    let mut weights = RandomWeights::new(seed)?;
    (family.build)(&config, dir, &mut weights)?;
    weights.save(dir, quantize)?;
    if let (Some(q), Some(obj)) = (quantize, config.as_object_mut()) {
        obj.insert(
            "quantization".into(),
            serde_json::json!({"group_size": q.group_size, "bits": q.bits}),
        );
    }
    std::fs::write(
        &path,
        serde_json::to_string_pretty(&config).unwrap_or_default(),
    )
    .map_err(|source| ModelError::Io { path, source })
}

/// Loads a model directory through the registry, as the engine does.
pub fn load_dir(dir: &Path, options: &LoadOptions) -> Result<Box<dyn TargetModel>> {
    crate::link();
    let registry = AdapterRegistry::builtin()?;
    let found = registry.detect(dir)?;
    let req = LoadRequest {
        dir,
        config: &found.config,
        options,
        progress: &|_, _| {},
    };
    (found.adapter.load)(&req)
}

/// The conformance test of a family: float checkpoint, quantized checkpoint, and
/// quantize-on-load all share their weights and pass the shared checker. Panics with
/// the failing comparison.
/// For this crate's own tests, which alone have `tempfile`.
#[cfg(test)]
pub fn check_family(config_json: &str) {
    let q4 = Quantization {
        bits: 4,
        group_size: 32,
    };
    let rowwise = LoadOptions {
        rowwise_verify: true,
        ..LoadOptions::default()
    };
    let cases: [(&str, Option<Quantization>, LoadOptions); 4] = [
        ("f32 checkpoint", None, LoadOptions::default()),
        ("f32 checkpoint, rowwise verify", None, rowwise),
        ("4-bit MLX checkpoint", Some(q4), LoadOptions::default()),
        (
            "f32 checkpoint quantized on load (8-bit)",
            None,
            LoadOptions {
                dtype: None,
                quantize: Some(Quantization {
                    bits: 8,
                    group_size: 32,
                }),
                ..LoadOptions::default()
            },
        ),
    ];
    for (what, stored, options) in cases {
        let dir = tempfile::tempdir().expect("temp dir");
        write_random_model(dir.path(), config_json, 7, stored)
            .unwrap_or_else(|e| panic!("{what}: writing fixture: {e}"));
        let model =
            load_dir(dir.path(), &options).unwrap_or_else(|e| panic!("{what}: loading: {e}"));
        if stored.is_some() || options.quantize.is_some() {
            assert!(
                model.info().quantized_bits.is_some(),
                "{what}: model should report quantized layers"
            );
        }
        assert!(
            model.share().is_some(),
            "{what}: the model shares no handle on its weights"
        );
        dspec_plugin_api::conformance::check_target_model(model.as_ref())
            .unwrap_or_else(|e| panic!("{what}: {e}"));
    }
}

/// Rows up to which the BLAS kernels this process runs give each row of an f32 product
/// the bits of its one-row product: every row count a verify takes, except on the kernel
/// sets for which a probe found a lower limit (`dspec_runtime::blas::rows_summed_alike`).
pub fn rows_summed_alike_here() -> i32 {
    dspec_runtime::blas::loaded_kernels()
        .and_then(|kernels| dspec_runtime::blas::rows_summed_alike(&kernels))
        .unwrap_or(i32::MAX)
}

/// How many of `a` and `b`'s values differ in any bit: the measure of exactness where
/// two ways of computing the same logits must agree bit for bit.
pub fn differing_bits(a: &[f32], b: &[f32]) -> usize {
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count()
}
