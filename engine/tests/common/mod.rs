//! Helpers shared by the engine's integration tests: tiny targets, plain greedy
//! references, and loading a drafter checkpoint the way the engine does. Each test
//! binary includes this with `mod common;` and uses what it needs.
#![allow(dead_code)]

pub mod lossless;

use std::path::{Path, PathBuf};
use std::process::Command;

use dspec_engine::decoding::generate::{generate, GenerationConfig};
use dspec_engine::decoding::sampling::SamplingParams;
use dspec_engine::decoding::speculative::VerifyAheadMode;
use dspec_engine::decoding::speculative::{
    generate_speculative, ServingOptions, Speculation, SpeculativeOutput,
};
use dspec_engine::loading::{builtin_registry, load_model, LoadedModel};
use dspec_engine::tiny_model::write_tiny_model;
use dspec_plugin_api::error::Result as ModelResult;
use dspec_plugin_api::{
    detect_drafter_kind, Drafter, DrafterLoadRequest, DrafterOptions, LoadOptions, ModelError,
    Picked, TargetModel, TokenPicker,
};
use mlx_rs::ops::indexing::argmax_axis;
use mlx_rs::{Array, Dtype};

/// Loads a model directory through the built-in registry, as `--target` does.
pub fn load_dir(dir: &Path) -> LoadedModel {
    load_model(
        dir.to_str().expect("utf-8 temp path"),
        &builtin_registry().expect("built-in registry"),
        &LoadOptions::default(),
        false,
    )
    .unwrap_or_else(|e| panic!("loading {}: {e}", dir.display()))
}

/// A tiny target (see `write_tiny_model`) written to a temp dir and loaded.
pub fn tiny_target(overrides: &str, seed: u64) -> (tempfile::TempDir, LoadedModel) {
    let dir = tempfile::tempdir().expect("temp dir");
    write_tiny_model(dir.path(), overrides, seed).expect("write tiny model");
    let loaded = load_dir(dir.path());
    (dir, loaded)
}

pub fn greedy_config(max_tokens: usize, eos_ids: Vec<u32>) -> GenerationConfig {
    GenerationConfig {
        max_tokens,
        sampling: SamplingParams::default(),
        stop_strings: Vec::new(),
        eos_ids,
    }
}

/// Plain greedy decoding's first `n` tokens: the reference speculation must equal.
pub fn greedy(loaded: &LoadedModel, prompt: &[u32], n: usize) -> Vec<u32> {
    generate(
        loaded.model.as_ref(),
        &loaded.tokenizer,
        prompt,
        &greedy_config(n, vec![]),
        &mut |_| {},
    )
    .expect("plain greedy generation")
    .tokens
}

pub fn read_config(dir: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(dir.join("config.json")).expect("read config.json");
    serde_json::from_str(&text).expect("config.json is JSON")
}

/// A draft model (`--drafter model:DIR`) for `target`, loaded as the engine does.
pub fn load_draft_model(
    target: &LoadedModel,
    dir: &Path,
    options: &DrafterOptions,
) -> Box<dyn Drafter> {
    dspec_engine::loading::drafting::load_drafter(
        &format!("model:{}", dir.display()),
        target,
        &builtin_registry().expect("registry"),
        &LoadOptions::default(),
        options,
    )
    .unwrap_or_else(|e| panic!("loading {}: {e}", dir.display()))
}

/// Loads a drafter checkpoint as the engine does: its kind detected from `config`
/// (asserted to be `kind`), then that kind's constructor against the target, with the
/// target's dtype. Loading a model from inside is an error: checkpoints never need one.
pub fn load_checkpoint_drafter(
    kind: &str,
    dir: &Path,
    config: &serde_json::Value,
    target: &dyn TargetModel,
    options: &DrafterOptions,
) -> ModelResult<Box<dyn Drafter>> {
    let found = detect_drafter_kind(config)?.expect("config.json is detected as a drafter kind");
    assert_eq!(found.kind, kind);
    (found.load)(&DrafterLoadRequest {
        dir: Some(dir),
        config,
        target: target.info(),
        options: &DrafterOptions {
            dtype: options.dtype.or(Some(target.info().dtype)),
            ..options.clone()
        },
        load_model: &|path| {
            Err(ModelError::Unsupported(format!(
                "a {kind} checkpoint must not load a model ({})",
                path.display()
            )))
        },
    })
}

/// Speculative generation that must succeed, rounds queued ahead wherever they may be;
/// `trace` receives `--trace` lines.
pub fn speculate(
    loaded: &LoadedModel,
    drafter: &mut dyn Drafter,
    prompt: &[u32],
    config: &GenerationConfig,
    max_draft: usize,
    trace: Option<&mut Vec<u8>>,
) -> SpeculativeOutput {
    speculate_queueing(
        loaded,
        drafter,
        prompt,
        config,
        max_draft,
        trace,
        VerifyAheadMode::Always,
    )
}

/// [`speculate`] with rounds queued ahead as `verify_ahead` says.
pub fn speculate_queueing(
    loaded: &LoadedModel,
    drafter: &mut dyn Drafter,
    prompt: &[u32],
    config: &GenerationConfig,
    max_draft: usize,
    trace: Option<&mut Vec<u8>>,
    verify_ahead: VerifyAheadMode,
) -> SpeculativeOutput {
    generate_speculative(
        loaded.model.as_ref(),
        &loaded.tokenizer,
        prompt,
        config,
        Speculation {
            drafter,
            max_draft,
            adaptive: false,
            trace: trace.map(|t| t as &mut dyn std::io::Write),
            verify_ahead,
        },
        &mut |_| {},
        ServingOptions::default(),
    )
    .expect("speculative generation")
}

/// A real model fetched, checked and converted by scripts/fetch-models.sh with this
/// build's `dspec convert` (cached after the first run): (gguf file, converted dir).
pub fn fetch_real_model(name: &str) -> (PathBuf, PathBuf) {
    // Tests of one binary run in parallel: one fetch at a time, so a first download
    // and conversion is never raced by a second.
    static FETCHING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = FETCHING.lock().unwrap_or_else(|e| e.into_inner());
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let run = |extra: &[&str]| -> PathBuf {
        let out = succeeded(
            Command::new("bash")
                .arg(root.join("scripts/fetch-models.sh"))
                .args(extra)
                .arg(name)
                .env("DSPEC", env!("CARGO_BIN_EXE_dspec"))
                .current_dir(&root),
            &format!("fetch-models.sh {name}"),
        );
        PathBuf::from(
            String::from_utf8_lossy(&out.stdout)
                .trim()
                .lines()
                .last()
                .unwrap_or_default(),
        )
    };
    (run(&["--gguf-only"]), run(&[]))
}

/// Runs this build's `dspec` with `args`, which must include `--json`; fails the test
/// with dspec's stderr when it does not succeed, else returns the parsed output.
pub fn dspec_json(args: &[&str]) -> serde_json::Value {
    let out = succeeded(
        Command::new(env!("CARGO_BIN_EXE_dspec")).args(args),
        &format!("dspec {args:?}"),
    );
    serde_json::from_slice(&out.stdout).expect("json")
}

/// Runs `command`, failing the test with its stderr (under `what`) unless it succeeds.
fn succeeded(command: &mut Command, what: &str) -> std::process::Output {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("run {what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Argmax on the host, like the engine's greedy picker, remembering the logits.
#[derive(Default)]
pub struct Argmax {
    pub logits: Vec<Array>,
}

impl TokenPicker for Argmax {
    fn is_greedy(&self) -> bool {
        true
    }
    fn pick(&mut self, logits: &Array) -> ModelResult<Picked> {
        self.logits.push(logits.as_dtype(Dtype::Float32)?);
        let ids = argmax_axis(logits, -1, false)?.as_dtype(Dtype::Uint32)?;
        ids.eval()?;
        Ok(Picked {
            tokens: ids.as_slice::<u32>().to_vec(),
            probs: None,
        })
    }
}

/// Argmax left on the device, as the engine's greedy picker leaves it for drafters that
/// hand their drafts on unread (`TokenPicker::pick_on_device`); `pick` reads it.
#[derive(Default)]
pub struct DeviceArgmax;

impl DeviceArgmax {
    fn ids(logits: &Array) -> ModelResult<Array> {
        let vocab = logits.shape().last().copied().unwrap_or(0);
        Ok(argmax_axis(&logits.reshape(&[-1, vocab])?, -1, false)?.as_dtype(Dtype::Uint32)?)
    }
}

impl TokenPicker for DeviceArgmax {
    fn is_greedy(&self) -> bool {
        true
    }
    fn pick(&mut self, logits: &Array) -> ModelResult<Picked> {
        let ids = Self::ids(logits)?;
        ids.eval()?;
        Ok(Picked {
            tokens: ids.as_slice::<u32>().to_vec(),
            probs: None,
        })
    }
    fn pick_on_device(&mut self, logits: &Array) -> ModelResult<Option<Array>> {
        Self::ids(logits).map(Some)
    }
}

pub fn max_abs_diff(a: &Array, b: &Array) -> f32 {
    assert_eq!(a.shape(), b.shape());
    mlx_rs::ops::max(mlx_rs::ops::abs(a.subtract(b).unwrap()).unwrap(), None)
        .unwrap()
        .try_item_cast::<f32>()
        .unwrap()
}

/// Rewrites model.safetensors in `dir`: each tensor `edit` returns a replacement for
/// (given its name and value) is replaced, the others kept.
pub fn edit_checkpoint(dir: &Path, edit: impl Fn(&str, &Array) -> Option<Array>) {
    let file = dir.join("model.safetensors");
    let tensors = Array::load_safetensors(&file).expect("read model.safetensors");
    let edited: Vec<(String, Array)> = tensors
        .into_iter()
        .map(|(name, t)| {
            let t = edit(&name, &t).unwrap_or(t);
            (name, t)
        })
        .collect();
    // MLX reads lazily: materialise everything before the file is overwritten.
    mlx_rs::transforms::eval(edited.iter().map(|(_, a)| a)).expect("evaluate tensors");
    Array::save_safetensors(edited.iter().map(|(n, a)| (n.as_str(), a)), None, &file)
        .expect("write model.safetensors");
}

/// Makes the DFlash checkpoint in `dir` draft one distribution over and over: its layers
/// add nothing (zero `o_proj` and `down_proj`) and its final norm is neutral, so every
/// draft is the target's head applied to the mask token's embedding, normed — with
/// tied embeddings, usually the mask token itself.
pub fn make_dflash_repeat(dir: &Path) {
    edit_checkpoint(dir, |name, t| {
        if name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight") {
            Some(mlx_rs::ops::zeros_like(t).expect("zeros"))
        } else if name == "norm.weight" {
            Some(mlx_rs::ops::ones_like(t).expect("ones"))
        } else {
            None
        }
    });
}

/// Rewrites the Markov head of a tiny DSpark checkpoint (`TINY_DSPARK_QWEN3`'s rank 32
/// over the 259-token vocabulary) so that after token `a` it proposes `b`, by a margin
/// no base logit reaches, for each pair `(a, b)` (the first 32).
pub fn teach_markov_head(dir: &Path, pairs: &[(u32, u32)]) {
    const VOCAB: usize = 259;
    const RANK: usize = 32;
    let mut w1 = vec![0f32; VOCAB * RANK];
    let mut w2 = vec![0f32; VOCAB * RANK];
    for (j, &(a, b)) in pairs.iter().take(RANK).enumerate() {
        w1[a as usize * RANK + j] = 1.0;
        w2[b as usize * RANK + j] = 100.0;
    }
    let shape = [VOCAB as i32, RANK as i32];
    edit_checkpoint(dir, |name, _| match name {
        "markov_head.markov_w1.weight" => Some(Array::from_slice(&w1, &shape)),
        "markov_head.markov_w2.weight" => Some(Array::from_slice(&w2, &shape)),
        _ => None,
    });
}
