//! Golden tests: each built-in family's logits against an independent implementation.
//! Hugging Face transformers built, saved and ran the tiny checkpoints in tests/golden/
//! (adapters/tests/golden/make_golden.py); dspec loads them as a user's model and must agree.
//!
//! The family unit tests check dspec against itself (cached = uncached, quantized ≈
//! float); only a reference computed elsewhere catches a wrong tensor name, norm
//! offset, activation or rotary convention, which would change both sides alike.

use std::path::{Path, PathBuf};

use mlx_rs::{Array, Device, Dtype};
use serde::Deserialize;

use dspec_plugin_api::{AdapterRegistry, LoadOptions, LoadRequest, ModelCache, TargetModel};

/// The agreement asked for at every logit: `|dspec − transformers| ≤ ABS_TOL + REL_TOL ·
/// |transformers|`. Both sides compute in f32 on the CPU, so they differ only by
/// rounding: the order of sums in the matrix products (MLX's and PyTorch's BLAS calls
/// split them differently), the approximations of exp/tanh/pow, and the expected
/// values' rounding to 6 significant digits (up to 5e-6 relative), which dominates.
/// On these checkpoints the worst difference uses about a sixteenth of the bound (the
/// test prints the share with `--nocapture`), while the mistakes planted to check this
/// test (gate/up names swapped, gemma's 1 + w dropped, GELU and SiLU swapped, interleaved
/// rotary pairs, rope_theta ignored, a window one key off) put most logits far beyond it.
const ABS_TOL: f32 = 1e-4;
const REL_TOL: f32 = 1e-4;

/// What is not covered here, and why (llama.cpp's test-llama-archs keeps such a list
/// too). Families with no entry are all tested below.
#[allow(dead_code)]
const SKIPPED: &[(&str, &str)] = &[
    (
        "gemma3 / gemma4 multimodal configs (`text_config`, `language_model.` tensor names)",
        "transformers only builds them with their vision (and audio) towers, which no tiny \
         checkpoint keeps small; the text decoder they wrap is the one tested here, and the \
         nested config and prefixes are unit-tested in gemma3_text.rs and gemma4.rs",
    ),
    (
        "gemma4 per-layer input embeddings, KV sharing, mixture of experts, bidirectional attention",
        "dspec refuses these configs at load (gemma4.rs tests the refusals): nothing to compare",
    ),
    (
        "ministral (the mistral adapter's alias)",
        "the same adapter as mistral, tested under that name",
    ),
    (
        "transformers-4 config layouts (`rope_theta` + `rope_scaling`, gemma3's \
         `rope_local_base_freq`, gemma4's `global_head_dim`)",
        "make_golden.py saves with transformers 5, which writes `rope_parameters` and \
         `per_layer_config`; the older keys are read by the family unit tests' configs and \
         by the Gemma 3 270M answer test (engine/tests/real_models.rs), whose converted \
         config uses them",
    ),
    (
        "attention biases on gemma and qwen3, attention softcapping on gemma3",
        "off in every released checkpoint of those families; the code paths are the ones \
         llama (biases) and gemma2 (softcapping) exercise here",
    ),
    (
        "quantized and bf16/f16 weights",
        "transformers has no reference for MLX's quantization, and half precision is \
         compared with f32 by the conformance tests (plugin-api/src/conformance.rs); here \
         only f32 isolates the architecture from rounding",
    ),
    (
        "text-only `qwen3_5_text` checkpoints (flat `model.` names)",
        "the golden qwen3_5 is the released, multimodal layout; the flat one differs only in \
         its config nesting and tensor prefix, which the conformance tests of the tiny \
         fixture (qwen3_5.rs) load",
    ),
    (
        "the chunked Gated DeltaNet recurrence",
        "twelve positions run position by position (prompts longer than the rollback window \
         and 16 run their head in chunks); gated_delta.rs and hybrid.rs check the chunked \
         form against stepping, which is compared with transformers here",
    ),
    (
        "rope scaling `dynamic` and `longrope`",
        "dspec does not support them and refuses such configs",
    ),
];

/// expected.json, as make_golden.py writes it.
#[derive(Deserialize)]
struct Expected {
    model_type: String,
    tokens: Vec<u32>,
    /// `[position][vocab]`.
    logits: Vec<Vec<f32>>,
    computed_by: serde_json::Value,
}

fn golden_dir(family: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(family)
}

fn read_expected(dir: &Path) -> Expected {
    let path = dir.join("expected.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (run adapters/tests/golden/make_golden.py)",
            path.display()
        )
    });
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Loads a model directory as the engine does: the adapter detected from config.json by
/// the registry, weights kept in f32.
fn load(dir: &Path) -> Box<dyn TargetModel> {
    dspec_adapters::link();
    let registry = AdapterRegistry::builtin().expect("built-in registry");
    let found = registry
        .detect(dir)
        .unwrap_or_else(|e| panic!("detecting {}: {e}", dir.display()));
    let options = LoadOptions {
        dtype: Some(Dtype::Float32),
        ..LoadOptions::default()
    };
    let req = LoadRequest {
        dir,
        config: &found.config,
        options: &options,
        progress: &|_, _| {},
    };
    (found.adapter.load)(&req).unwrap_or_else(|e| panic!("loading {}: {e}", dir.display()))
}

/// The logits of `tokens` after what `cache` holds, one row per position.
fn forward_rows(model: &dyn TargetModel, tokens: &[u32], cache: &mut ModelCache) -> Vec<Vec<f32>> {
    let ids = Array::from_slice(tokens, &[1, tokens.len() as i32]);
    let logits = model
        .forward(&ids, cache, &[])
        .expect("forward")
        .logits
        .as_dtype(Dtype::Float32)
        .expect("f32 logits");
    let vocab = *logits.shape().last().expect("logits have a vocab axis") as usize;
    assert_eq!(logits.shape(), [1, tokens.len() as i32, vocab as i32]);
    logits
        .as_slice::<f32>()
        .chunks(vocab)
        .map(<[f32]>::to_vec)
        .collect()
}

/// One logit's disagreement.
struct Miss {
    pos: usize,
    id: usize,
    got: f32,
    want: f32,
    /// `|got − want|` over the tolerance at `want` (∞ for NaN).
    share: f32,
}

/// The worst `|got − want|` over all logits, and the worst share of the tolerance used.
/// Beyond the tolerance it panics with how many logits are, the first position where
/// one is (a rotary mistake spares position 0), and the worst one.
fn compare(family: &str, path: &str, got: &[Vec<f32>], want: &[Vec<f32>]) -> (f32, f32) {
    assert_eq!(got.len(), want.len(), "{family} ({path}): positions");
    let mut worst_diff = 0.0f32;
    let mut worst: Option<Miss> = None;
    let (mut beyond, mut first_pos) = (0usize, None);
    for (pos, (g_row, w_row)) in got.iter().zip(want).enumerate() {
        assert_eq!(g_row.len(), w_row.len(), "{family} ({path}): vocab size");
        for (id, (&g, &w)) in g_row.iter().zip(w_row).enumerate() {
            let diff = (g - w).abs();
            let share = match diff / (ABS_TOL + REL_TOL * w.abs()) {
                s if s.is_nan() => f32::INFINITY,
                s => s,
            };
            if share > 1.0 {
                beyond += 1;
                first_pos.get_or_insert(pos);
            }
            worst_diff = worst_diff.max(diff);
            if worst.as_ref().is_none_or(|m| share > m.share) {
                worst = Some(Miss {
                    pos,
                    id,
                    got: g,
                    want: w,
                    share,
                });
            }
        }
    }
    let share = worst.as_ref().map_or(0.0, |m| m.share);
    if let (Some(first), Some(m)) = (first_pos, &worst) {
        let total: usize = want.iter().map(Vec::len).sum();
        panic!(
            "{family} ({path}): {beyond} of {total} logits beyond |diff| <= {ABS_TOL:e} + \
             {REL_TOL:e}·|expected|, from position {first} on; worst at position {}, token id \
             {}: dspec {} vs transformers {} (|diff| {:.3e})",
            m.pos,
            m.id,
            m.got,
            m.want,
            (m.got - m.want).abs()
        );
    }
    (worst_diff, share)
}

/// Runs the family's checkpoint two ways and compares every position with transformers:
/// the whole sequence in one forward, and a prefill of the first half followed by the
/// rest one token at a time through the KV cache (as decoding runs it).
fn check_family(family: &str) {
    check_dir(family, &golden_dir(family), "");
}

/// [`check_family`] on the checkpoint in `dir`, with the expected logits of the golden
/// family `family`; `variant` names the checkpoint in messages.
fn check_dir(family: &str, dir: &Path, variant: &str) {
    // The tolerance is for f32 on the CPU; a GPU build of MLX would otherwise pick its GPU.
    Device::set_default(&Device::cpu());
    let expected = read_expected(&golden_dir(family));
    let model = load(dir);
    let family = &format!("{family}{variant}");
    assert_eq!(
        model.info().model_type,
        expected.model_type,
        "{family}: the registry picked another adapter"
    );
    let tokens = &expected.tokens;

    let whole = forward_rows(model.as_ref(), tokens, &mut model.new_cache());
    let (worst_whole, share_whole) = compare(family, "one forward", &whole, &expected.logits);

    let half = tokens.len() / 2;
    let mut cache = model.new_cache();
    let mut cached = forward_rows(model.as_ref(), &tokens[..half], &mut cache);
    for &token in &tokens[half..] {
        cached.extend(forward_rows(model.as_ref(), &[token], &mut cache));
    }
    let (worst_cached, share_cached) = compare(
        family,
        "prefill, then one token at a time",
        &cached,
        &expected.logits,
    );
    eprintln!(
        "{family}: worst |diff| {worst_whole:.2e} (one forward), {worst_cached:.2e} (cached); \
         at most {:.1}% of the tolerance; against {}",
        100.0 * share_whole.max(share_cached),
        expected.computed_by
    );
}

#[test]
fn llama() {
    check_family("llama");
}

#[test]
fn mistral() {
    check_family("mistral");
}

#[test]
fn qwen2() {
    check_family("qwen2");
}

#[test]
fn qwen3() {
    check_family("qwen3");
}

#[test]
fn gemma() {
    check_family("gemma");
}

#[test]
fn gemma2() {
    check_family("gemma2");
}

#[test]
fn gemma3_text() {
    check_family("gemma3_text");
}

#[test]
fn gemma4() {
    check_family("gemma4");
}

#[test]
fn qwen3_next() {
    check_family("qwen3_next");
}

#[test]
fn qwen3_5() {
    check_family("qwen3_5");
}

/// Experts on layers 0 and 2 (layer 1 in `mlp_only_layers`), renormalised top 2 of 4.
#[test]
fn qwen3_moe() {
    check_family("qwen3_moe");
}

/// Every second layer sparse (`decoder_sparse_step` 2), probabilities not renormalised,
/// the expert count only as `num_local_experts`.
#[test]
fn qwen3_moe_step2() {
    check_family("qwen3_moe_step2");
}

/// Qwen3-Next as released: experts and a gated shared expert on every layer.
#[test]
fn qwen3_next_moe() {
    check_family("qwen3_next_moe");
}

/// Qwen3.5-MoE as released (multimodal config, no `norm_topk_prob`: always renormalised),
/// with the experts one tensor each, and fused as Qwen ships them.
#[test]
fn qwen3_5_moe() {
    check_family("qwen3_5_moe");
    check_dir(
        "qwen3_5_moe",
        &golden_dir("qwen3_5_moe_fused"),
        " (fused experts)",
    );
}

/// The hybrid golden checkpoint as mlx-lm's conversion would store it: conv1d weights
/// `[C, K, 1]`, the `x̂ · (1 + w)` norms (not the gated one) stored as `1 + w`, and for a
/// multimodal Qwen3.5 the language model under `language_model.model.` with its head at
/// `language_model.lm_head` and no vision tower. The logits must not change: dspec tells
/// the layouts apart and shifts the norms once, in HF's layout only.
fn as_mlx_conversion(family: &str) -> tempfile::TempDir {
    let from = golden_dir(family);
    let out = tempfile::tempdir().expect("temp dir");
    std::fs::copy(from.join("config.json"), out.path().join("config.json")).expect("config");
    let tensors = Array::load_safetensors(from.join("model.safetensors")).expect("weights");
    let shifted = [
        ".input_layernorm.weight",
        ".post_attention_layernorm.weight",
        ".q_norm.weight",
        ".k_norm.weight",
    ];
    let mut converted: Vec<(String, Array)> = Vec::new();
    for (name, array) in tensors {
        if name.starts_with("model.visual.") {
            continue;
        }
        let array = if name.ends_with("conv1d.weight") {
            array.swap_axes(1, 2).expect("move the kernel axis")
        } else if shifted.iter().any(|s| name.ends_with(s))
            || name.ends_with("model.norm.weight")
            || name == "model.language_model.norm.weight"
        {
            array.add(Array::from_f32(1.0)).expect("shift")
        } else {
            array
        };
        let name = match name.strip_prefix("model.language_model.") {
            Some(rest) => format!("language_model.model.{rest}"),
            None if family == "qwen3_5" && name == "lm_head.weight" => {
                "language_model.lm_head.weight".into()
            }
            None => name,
        };
        converted.push((name, array));
    }
    Array::save_safetensors(
        converted.iter().map(|(n, a)| (n.as_str(), a)),
        None,
        out.path().join("model.safetensors"),
    )
    .expect("save");
    out
}

#[test]
fn qwen3_next_mlx_conversion() {
    let dir = as_mlx_conversion("qwen3_next");
    check_dir("qwen3_next", dir.path(), " (MLX layout)");
}

#[test]
fn qwen3_5_mlx_conversion() {
    let dir = as_mlx_conversion("qwen3_5");
    check_dir("qwen3_5", dir.path(), " (MLX layout)");
}
