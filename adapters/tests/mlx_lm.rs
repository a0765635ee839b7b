//! Mixture-of-experts checkpoints as mlx-lm writes them (stacked `switch_mlp` experts,
//! f32 and 4-bit with 8-bit routers), against the greedy tokens mlx-lm itself generated
//! from them: tests/mlx_lm/make_mlx_lm.py built each tiny model with mlx-lm's own model
//! class, saved it with mlx-lm's saver, read it back and decoded greedily. dspec loads
//! the directory as a user's model and must decode the same tokens.
//!
//! golden.rs checks the families' architecture against transformers in f32; this checks
//! the MLX layout, the quantized experts and routers, and a whole decode with a cache.

use std::path::{Path, PathBuf};

use mlx_rs::{Array, Dtype};
use serde::Deserialize;

use dspec_plugin_api::{AdapterRegistry, LoadOptions, LoadRequest, TargetModel};

/// The agreement asked for at the last prompt position's logits: MLX on both sides, so
/// the products are the same kernels; expected values are rounded to 6 digits.
const TOLERANCE: f32 = 2e-4;

#[derive(Deserialize)]
struct Expected {
    model_type: String,
    prompt: Vec<u32>,
    greedy: Vec<u32>,
    logits_last_prompt_position: Vec<f32>,
}

fn case_dir(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/mlx_lm")
        .join(case)
}

fn load(dir: &Path) -> Box<dyn TargetModel> {
    dspec_adapters::link();
    let registry = AdapterRegistry::builtin().expect("built-in registry");
    let found = registry
        .detect(dir)
        .unwrap_or_else(|e| panic!("detecting {}: {e}", dir.display()));
    let options = LoadOptions::default();
    let req = LoadRequest {
        dir,
        config: &found.config,
        options: &options,
        progress: &|_, _| {},
    };
    (found.adapter.load)(&req).unwrap_or_else(|e| panic!("loading {}: {e}", dir.display()))
}

/// The last position's logits of `tokens` fed after what `cache` holds.
fn last_logits(
    model: &dyn TargetModel,
    tokens: &[u32],
    cache: &mut dspec_plugin_api::ModelCache,
) -> Vec<f32> {
    let ids = Array::from_slice(tokens, &[1, tokens.len() as i32]);
    let logits = model
        .forward(&ids, cache, &[])
        .expect("forward")
        .logits
        .as_dtype(Dtype::Float32)
        .expect("f32 logits");
    let vocab = *logits.shape().last().expect("vocab axis") as usize;
    logits.as_slice::<f32>()[(tokens.len() - 1) * vocab..].to_vec()
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best as u32
}

fn check(case: &str) {
    let dir = case_dir(case);
    let expected: Expected = serde_json::from_str(
        &std::fs::read_to_string(dir.join("expected.json"))
            .unwrap_or_else(|e| panic!("{case}: {e} (run tests/mlx_lm/make_mlx_lm.py)")),
    )
    .unwrap_or_else(|e| panic!("{case}: {e}"));
    let model = load(&dir);
    assert_eq!(model.info().model_type, expected.model_type, "{case}");
    let mut cache = model.new_cache();
    let first = last_logits(model.as_ref(), &expected.prompt, &mut cache);
    let worst = first
        .iter()
        .zip(&expected.logits_last_prompt_position)
        .map(|(g, w)| (g - w).abs() / (1.0 + w.abs()))
        .fold(0.0f32, f32::max);
    assert!(
        worst < TOLERANCE,
        "{case}: last prompt logits differ by {worst}"
    );
    let mut tokens = vec![argmax(&first)];
    while tokens.len() < expected.greedy.len() {
        let next = last_logits(model.as_ref(), &tokens[tokens.len() - 1..], &mut cache);
        tokens.push(argmax(&next));
    }
    assert_eq!(tokens, expected.greedy, "{case}: greedy tokens");
}

#[test]
fn qwen3_moe_decodes_what_mlx_lm_decodes() {
    check("qwen3_moe_f32");
    check("qwen3_moe_q4");
}

#[test]
fn qwen3_next_moe_decodes_what_mlx_lm_decodes() {
    check("qwen3_next_f32");
    check("qwen3_next_q4");
}

#[test]
fn qwen3_5_moe_decodes_what_mlx_lm_decodes() {
    check("qwen3_5_moe_f32");
    check("qwen3_5_moe_q4");
}
