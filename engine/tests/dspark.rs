//! DSpark drafting must leave the output exactly plain greedy decoding's, for both
//! drafter families on their own tiny targets, at 4-bit and full precision, with and
//! without the confidence cut, wherever EOS or max_tokens falls; and every way a
//! checkpoint can misfit its target is a clear error naming the field.
//!
//! Random drafters agree with random targets almost never, so most tests "teach" the
//! checkpoint's Markov head the target's greedy transitions (after token a, strongly
//! propose b): drafts then go through the real DSpark path and are mostly accepted,
//! which is what puts stops inside accepted blocks.

use std::collections::HashMap;
use std::path::Path;

use mlx_rs::Array;

use dspec_adapters::fixtures::TINY_GEMMA4_OVERRIDES;
use dspec_drafters::dspark::{write_random_checkpoint, TINY_DSPARK_GEMMA4, TINY_DSPARK_QWEN3};
use dspec_engine::decoding::generate::{generate, GenerationConfig, StopReason};
use dspec_engine::loading::LoadedModel;
use dspec_plugin_api::error::Result as ModelResult;
use dspec_plugin_api::{Drafter, DrafterOptions, Picked, TargetModel, TokenPicker};

mod common;
use common::{greedy, greedy_config, read_config, speculate, teach_markov_head, tiny_target};

#[derive(Debug, Clone, Copy)]
enum Family {
    Qwen3,
    Gemma4,
}

impl Family {
    fn target_overrides(self) -> &'static str {
        match self {
            Family::Qwen3 => r#"{"model_type": "qwen3", "head_dim": 16}"#,
            Family::Gemma4 => TINY_GEMMA4_OVERRIDES,
        }
    }

    fn drafter_config(self) -> &'static str {
        match self {
            Family::Qwen3 => TINY_DSPARK_QWEN3,
            Family::Gemma4 => TINY_DSPARK_GEMMA4,
        }
    }
}

const FAMILIES: [Family; 2] = [Family::Qwen3, Family::Gemma4];

fn target(family: Family, seed: u64) -> (tempfile::TempDir, LoadedModel) {
    tiny_target(family.target_overrides(), seed)
}

/// Loads a DSpark checkpoint (with `config` in place of its config.json) through the
/// registry, as the engine does.
fn load_drafter(
    dir: &Path,
    config: &serde_json::Value,
    model: &dyn TargetModel,
    options: DrafterOptions,
) -> ModelResult<Box<dyn Drafter>> {
    common::load_checkpoint_drafter("dspark", dir, config, model, &options)
}

/// Teaches the Markov head the most frequent transitions a → b of `truth` (after token
/// `a`, strongly propose `b`), one per `a`, most frequent first.
fn teach_transitions(dir: &Path, truth: &[u32]) {
    let mut counts: HashMap<(u32, u32), usize> = HashMap::new();
    for pair in truth.windows(2) {
        *counts.entry((pair[0], pair[1])).or_default() += 1;
    }
    let mut best: HashMap<u32, (u32, usize)> = HashMap::new();
    let mut ordered: Vec<((u32, u32), usize)> = counts.into_iter().collect();
    ordered.sort_by_key(|&((a, b), n)| (std::cmp::Reverse(n), a, b));
    for ((a, b), n) in ordered {
        best.entry(a).or_insert((b, n));
    }
    let mut by_count: Vec<(u32, (u32, usize))> = best.into_iter().collect();
    by_count.sort_by_key(|&(a, (_, n))| (std::cmp::Reverse(n), a));
    let pairs: Vec<(u32, u32)> = by_count.into_iter().map(|(a, (b, _))| (a, b)).collect();
    teach_markov_head(dir, &pairs);
}

/// A DSpark checkpoint of `family`, taught `truth` when given.
fn drafter_dir(family: Family, seed: u64, truth: Option<&[u32]>) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write_random_checkpoint(dir.path(), family.drafter_config(), seed).unwrap();
    if let Some(truth) = truth {
        teach_transitions(dir.path(), truth);
    }
    dir
}

#[test]
fn greedy_speculation_equals_plain_greedy_for_both_families_and_precisions() {
    for (i, family) in FAMILIES.into_iter().enumerate() {
        let (_t, loaded) = target(family, 11 + i as u64);
        for (prompt_text, n) in [("speculate on this", 30), ("a b", 17)] {
            let prompt = loaded.tokenizer.encode_prompt(prompt_text, false).unwrap();
            let truth = greedy(&loaded, &prompt, n);
            for taught in [true, false] {
                let dir = drafter_dir(family, 5, taught.then_some(truth.as_slice()));
                let dconfig = read_config(dir.path());
                for bits in [None, Some(0)] {
                    for max_draft in [2, 4, 7] {
                        let what = format!(
                            "{family:?} {prompt_text:?} taught {taught} bits {bits:?} max_draft {max_draft}"
                        );
                        let mut drafter = load_drafter(
                            dir.path(),
                            &dconfig,
                            loaded.model.as_ref(),
                            DrafterOptions {
                                bits,
                                ..Default::default()
                            },
                        )
                        .unwrap();
                        let out = speculate(
                            &loaded,
                            drafter.as_mut(),
                            &prompt,
                            &config_for(n),
                            max_draft,
                            None,
                        );
                        assert_eq!(out.tokens, truth, "{what}");
                        let s = &out.speculative;
                        assert_eq!(s.drafter, "dspark");
                        assert!(s.drafted_tokens > 0, "{what}");
                        if taught {
                            assert!(s.tau > 1.5, "{what}: tau {}", s.tau);
                        }
                    }
                }
            }
        }
    }
}

fn config_for(n: usize) -> GenerationConfig {
    greedy_config(n, vec![])
}

/// Whether the last round drafted past where generation stopped (the stop fell inside
/// an accepted block), from the `--trace` lines.
fn stopped_inside_accepted_block(trace: &[u8], committed: usize) -> bool {
    let text = String::from_utf8_lossy(trace);
    let Some(last) = text.lines().last() else {
        return false;
    };
    let round: serde_json::Value = serde_json::from_str(last).unwrap();
    let position = round["position"].as_u64().unwrap() as usize;
    let accepted = round["accepted"].as_u64().unwrap() as usize;
    position + accepted + 1 > committed && accepted > 0
}

#[test]
fn eos_and_max_tokens_inside_accepted_blocks_stop_like_plain_decoding() {
    for (i, family) in FAMILIES.into_iter().enumerate() {
        let (_t, loaded) = target(family, 31 + i as u64);
        let prompt = loaded
            .tokenizer
            .encode_prompt("where does it end", false)
            .unwrap();
        let truth = greedy(&loaded, &prompt, 40);
        let dir = drafter_dir(family, 9, Some(&truth));
        let dconfig = read_config(dir.path());
        let load = || {
            load_drafter(
                dir.path(),
                &dconfig,
                loaded.model.as_ref(),
                DrafterOptions::default(),
            )
            .unwrap()
        };
        let mut inside = 0;
        for max_tokens in [1, 2, 3, 5, 6, 7, 9, 13] {
            let mut drafter = load();
            let mut trace = Vec::new();
            let out = speculate(
                &loaded,
                drafter.as_mut(),
                &prompt,
                &greedy_config(max_tokens, vec![]),
                4,
                Some(&mut trace),
            );
            assert_eq!(
                out.tokens,
                truth[..max_tokens].to_vec(),
                "{family:?} max_tokens {max_tokens}"
            );
            assert_eq!(out.stats.stop_reason, StopReason::MaxTokens);
            inside += usize::from(stopped_inside_accepted_block(&trace, max_tokens));
        }
        for at in [3, 6, 10, 17] {
            let eos = truth[at];
            let first = truth.iter().position(|&t| t == eos).unwrap();
            let plain = generate(
                loaded.model.as_ref(),
                &loaded.tokenizer,
                &prompt,
                &greedy_config(40, vec![eos]),
                &mut |_| {},
            )
            .unwrap();
            let mut drafter = load();
            let mut trace = Vec::new();
            let out = speculate(
                &loaded,
                drafter.as_mut(),
                &prompt,
                &greedy_config(40, vec![eos]),
                4,
                Some(&mut trace),
            );
            assert_eq!(out.tokens, truth[..=first].to_vec(), "{family:?} eos {eos}");
            assert_eq!(out.tokens, plain.tokens);
            assert_eq!(out.text, plain.text);
            assert_eq!(out.stats.stop_reason, StopReason::Eos);
            inside += usize::from(stopped_inside_accepted_block(&trace, first + 1));
        }
        assert!(
            inside > 0,
            "{family:?}: some stop should fall inside an accepted block"
        );
    }
}

#[test]
fn confidence_threshold_cuts_blocks_without_changing_the_output() {
    for (i, family) in FAMILIES.into_iter().enumerate() {
        let (_t, loaded) = target(family, 41 + i as u64);
        let prompt = loaded.tokenizer.encode_prompt("confidence", false).unwrap();
        let truth = greedy(&loaded, &prompt, 24);
        let dir = drafter_dir(family, 3, Some(&truth));
        let dconfig = read_config(dir.path());
        let run = |threshold: Option<f32>| {
            let mut drafter = load_drafter(
                dir.path(),
                &dconfig,
                loaded.model.as_ref(),
                DrafterOptions {
                    confidence_threshold: threshold,
                    ..Default::default()
                },
            )
            .unwrap();
            speculate(&loaded, drafter.as_mut(), &prompt, &config_for(24), 4, None)
        };
        let off = run(None);
        let zero = run(Some(0.0));
        let strict = run(Some(0.999));
        for (what, out) in [("off", &off), ("0.0", &zero), ("0.999", &strict)] {
            assert_eq!(out.tokens, truth, "{family:?} threshold {what}");
        }
        // A sigmoid is never below 0: threshold 0 cuts nothing.
        assert_eq!(
            zero.speculative.drafted_tokens,
            off.speculative.drafted_tokens
        );
        // Random confidence heads score far below 0.999: blocks are cut to one token.
        assert!(
            strict.speculative.drafted_tokens < off.speculative.drafted_tokens,
            "{family:?}: {} drafted with the cut vs {} without",
            strict.speculative.drafted_tokens,
            off.speculative.drafted_tokens
        );
        // At most one draft per round (the last round may have room for none).
        assert!(strict.speculative.drafted_tokens <= strict.speculative.target_forwards);
    }
}

/// Samples nothing: returns the argmax and the softmax of each row, recording the rows,
/// so a test sees exactly the distribution each token was picked from.
#[derive(Default)]
struct SoftmaxPicker {
    rows: Vec<Vec<f32>>,
}

impl TokenPicker for SoftmaxPicker {
    fn is_greedy(&self) -> bool {
        false
    }

    fn pick(&mut self, logits: &Array) -> ModelResult<Picked> {
        let host = logits.as_dtype(mlx_rs::Dtype::Float32)?;
        host.eval()?;
        let values = host.as_slice::<f32>();
        let vocab = *logits.shape().last().unwrap() as usize;
        let (mut tokens, mut probs) = (vec![], vec![]);
        for row in values.chunks(vocab) {
            self.rows.push(row.to_vec());
            let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let exp: Vec<f32> = row.iter().map(|x| (x - max).exp()).collect();
            let sum: f32 = exp.iter().sum();
            let argmax = row
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .map(|(i, _)| i as u32)
                .unwrap();
            tokens.push(argmax);
            probs.extend(exp.iter().map(|e| e / sum));
        }
        let rows = tokens.len() as i32;
        Ok(Picked {
            tokens,
            probs: Some(Array::from_slice(&probs, &[rows, vocab as i32])),
        })
    }
}

/// A full-precision drafter of `family` whose Markov head was taught the target's greedy
/// continuation `truth` of `prompt` (so that the head decides the drafts), begun on the
/// target's hidden states of `prompt`.
fn taught_and_begun(
    loaded: &LoadedModel,
    family: Family,
    prompt: &[u32],
    truth: &[u32],
    threshold: Option<f32>,
) -> (tempfile::TempDir, Box<dyn Drafter>) {
    let model = loaded.model.as_ref();
    let dir = drafter_dir(family, 4, Some(truth));
    let dconfig = read_config(dir.path());
    let mut drafter = load_drafter(
        dir.path(),
        &dconfig,
        model,
        DrafterOptions {
            bits: Some(0),
            confidence_threshold: threshold,
            ..Default::default()
        },
    )
    .unwrap();
    let taps = drafter.taps().to_vec();
    let out = model
        .forward(
            &Array::from_slice(prompt, &[1, prompt.len() as i32]),
            &mut model.new_cache(),
            &taps,
        )
        .unwrap();
    drafter.begin(model, prompt, out.hidden.as_ref()).unwrap();
    (dir, drafter)
}

#[test]
fn sampled_drafts_carry_the_markov_corrected_distribution() {
    for (i, family) in FAMILIES.into_iter().enumerate() {
        let (_t, loaded) = target(family, 51 + i as u64);
        let model = loaded.model.as_ref();
        let prompt = loaded.tokenizer.encode_prompt("markov", false).unwrap();
        let truth = greedy(&loaded, &prompt, 20);
        let (_dir, mut drafter) = taught_and_begun(&loaded, family, &prompt, &truth, None);
        let mut picker = SoftmaxPicker::default();
        let draft = drafter.propose(model, truth[0], 4, &mut picker).unwrap();
        let probs = draft.probs.as_ref().expect("sampled drafts carry q");
        assert_eq!(probs.shape()[0] as usize, draft.tokens.len());
        assert_eq!(draft.tokens.len(), 4);
        let vocab = probs.shape()[1] as usize;
        probs.eval().unwrap();
        for (q, &t) in probs.as_slice::<f32>().chunks(vocab).zip(&draft.tokens) {
            assert!((q.iter().sum::<f32>() - 1.0).abs() < 1e-4);
            // The taught Markov bias (+100) dominates: q puts its mass on the token it
            // picked, which only happens if the bias is inside the distribution.
            assert!(
                q[t as usize] > 0.99,
                "{family:?}: q(picked) {}",
                q[t as usize]
            );
        }
        // The first draft is a taught successor of truth[0].
        assert!(
            truth
                .windows(2)
                .any(|w| w[0] == truth[0] && w[1] == draft.tokens[0]),
            "{family:?}: {} never follows {} in {truth:?}",
            draft.tokens[0],
            truth[0]
        );
    }
}

/// Greedy drafts chained on the device (each pick feeding the next position's Markov
/// correction unread, as the engine's picker lets DSpark draft) are the drafts a picker
/// reading every pick on the host gets, with and without a confidence cut; without one
/// they reach the engine unread.
#[test]
fn drafts_chained_on_the_device_are_the_host_pickers_drafts() {
    for (i, family) in FAMILIES.into_iter().enumerate() {
        let (_t, loaded) = target(family, 61 + i as u64);
        let model = loaded.model.as_ref();
        let prompt = loaded.tokenizer.encode_prompt("chains", false).unwrap();
        let truth = greedy(&loaded, &prompt, 20);
        for threshold in [None, Some(0.5)] {
            let (_dir, mut drafter) = taught_and_begun(&loaded, family, &prompt, &truth, threshold);
            let on_host = drafter
                .propose(model, truth[0], 5, &mut common::Argmax::default())
                .unwrap();
            let mut on_device = drafter
                .propose(model, truth[0], 5, &mut common::DeviceArgmax)
                .unwrap();
            assert_eq!(
                on_device.on_device.is_some(),
                threshold.is_none(),
                "{family:?} {threshold:?}: drafts stay on the device unless a cut reads them"
            );
            assert!(!on_host.tokens.is_empty());
            assert_eq!(
                on_device.read().unwrap(),
                on_host.tokens.as_slice(),
                "{family:?} {threshold:?}"
            );
            assert!(on_device.probs.is_none());
        }
    }
}

#[test]
fn context_grown_round_by_round_equals_the_context_given_at_once() {
    for (i, family) in FAMILIES.into_iter().enumerate() {
        let (_t, loaded) = target(family, 61 + i as u64);
        let model = loaded.model.as_ref();
        let prompt = loaded
            .tokenizer
            .encode_prompt("incremental context", false)
            .unwrap();
        let truth = greedy(&loaded, &prompt, 12);
        let dir = drafter_dir(family, 8, None);
        let dconfig = read_config(dir.path());
        let load = || {
            load_drafter(
                dir.path(),
                &dconfig,
                model,
                DrafterOptions {
                    bits: Some(0),
                    ..Default::default()
                },
            )
            .unwrap()
        };
        let mut all = prompt.clone();
        all.extend_from_slice(&truth[..7]);
        let taps = load().taps().to_vec();
        let hidden = model
            .forward(
                &Array::from_slice(&all, &[1, all.len() as i32]),
                &mut model.new_cache(),
                &taps,
            )
            .unwrap()
            .hidden
            .unwrap();
        let slice = |from: usize, to: usize| {
            use mlx_rs::ops::indexing::TryIndexOp;
            hidden.try_index((.., from as i32..to as i32, ..)).unwrap()
        };
        let p = prompt.len();
        // Rounds of 1, 3 and 3 verified positions after the prompt.
        let mut stepwise = load();
        stepwise.begin(model, &prompt, Some(&slice(0, p))).unwrap();
        stepwise
            .commit(&truth[..1], Some(&slice(p, p + 1)))
            .unwrap();
        stepwise
            .commit(&truth[1..4], Some(&slice(p + 1, p + 4)))
            .unwrap();
        stepwise
            .commit(&truth[4..7], Some(&slice(p + 4, p + 7)))
            .unwrap();
        let mut at_once = load();
        at_once.begin(model, &all, Some(&hidden)).unwrap();
        let (mut a, mut b) = (SoftmaxPicker::default(), SoftmaxPicker::default());
        // Proposing twice also checks the block's own keys leave the context untouched.
        for _ in 0..2 {
            stepwise.propose(model, truth[7], 4, &mut a).unwrap();
            at_once.propose(model, truth[7], 4, &mut b).unwrap();
        }
        assert_eq!(a.rows.len(), 8);
        for (row, (x, y)) in a.rows.iter().zip(&b.rows).enumerate() {
            let diff = x
                .iter()
                .zip(y)
                .map(|(p, q)| (p - q).abs())
                .fold(0f32, f32::max);
            assert!(diff < 1e-3, "{family:?} row {row}: max |diff| {diff}");
        }
        assert_eq!(
            a.rows[..4],
            a.rows[4..],
            "proposing again gives the same rows"
        );
    }
}

#[test]
fn misfit_checkpoints_are_clear_errors_naming_the_field() {
    let (_t, loaded) = target(Family::Qwen3, 71);
    let model = loaded.model.as_ref();
    let dir = drafter_dir(Family::Qwen3, 1, None);
    let base = read_config(dir.path());
    let cases: [(&str, serde_json::Value, &[&str]); 6] = [
        (
            "vocab",
            serde_json::json!({"vocab_size": 300}),
            &["vocab_size is 300", "259", "tokenizer"],
        ),
        (
            "fc width",
            serde_json::json!({"target_hidden_size": 48}),
            &[
                "fc input width is 96",
                "2 taps × 48",
                "gives 64",
                "hidden_size 32",
            ],
        ),
        (
            "tap layer",
            serde_json::json!({"target_layer_ids": [0, 5]}),
            &["target_layer_ids [0, 5]", "layer 5", "2 layers"],
        ),
        (
            "mask token",
            serde_json::json!({"mask_token_id": 400}),
            &["mask_token_id 400", "259 tokens", "fix `mask_token_id`"],
        ),
        (
            "missing field",
            serde_json::json!({"block_size": null}),
            &["`block_size`"],
        ),
        (
            "target layers",
            serde_json::json!({"num_target_layers": 36}),
            &["num_target_layers is 36", "2 layers"],
        ),
    ];
    for (what, patch, needles) in cases {
        let mut config = base.clone();
        for (k, v) in patch.as_object().unwrap() {
            config[k.as_str()] = v.clone();
        }
        let err = load_drafter(dir.path(), &config, model, DrafterOptions::default())
            .err()
            .unwrap_or_else(|| panic!("{what}: should not load"))
            .to_string();
        assert!(err.contains("config.json"), "{what}: names the file: {err}");
        for needle in needles {
            assert!(err.contains(needle), "{what}: `{needle}` missing in: {err}");
        }
    }
    let err = load_drafter(
        dir.path(),
        &base,
        model,
        DrafterOptions {
            bits: Some(3),
            ..Default::default()
        },
    )
    .err()
    .unwrap()
    .to_string();
    assert!(err.contains("--drafter-bits 3"), "{err}");

    // A gemma4 drafter against the qwen3 target loads (same vocab and widths): the
    // family is the drafter's own, not the target's.
    let gemma = drafter_dir(Family::Gemma4, 1, None);
    load_drafter(
        gemma.path(),
        &read_config(gemma.path()),
        model,
        DrafterOptions::default(),
    )
    .unwrap();
}
