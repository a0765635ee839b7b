//! DFlash through the drafter registry, as the engine loads it: greedy speculative
//! output equals plain greedy output on tiny random targets of two families (stops
//! inside a block included), the context cache grown round by round drafts exactly
//! what a drafter started on the whole context drafts, and every drafter/target
//! mismatch is a clear error.

use std::path::Path;

use mlx_rs::Array;

use dspec_adapters::fixtures::with;
use dspec_drafters::dflash::{write_random_checkpoint, DFlashDrafter, TINY_DFLASH};
use dspec_engine::decoding::generate::{generate, GenerationConfig, StopReason};
use dspec_engine::decoding::sampling::SamplingParams;
use dspec_engine::loading::LoadedModel;
use dspec_plugin_api::error::Result as ModelResult;
use dspec_plugin_api::{
    Draft, Drafter, DrafterLoadRequest, DrafterOptions, ModelError, TargetModel, TokenPicker,
};

mod common;
use common::{
    greedy, greedy_config, make_dflash_repeat, max_abs_diff, read_config, speculate,
    tiny_target as load_target, Argmax, DeviceArgmax,
};

/// Loads a DFlash checkpoint through the registry, as the engine does.
fn load_drafter(
    dir: &Path,
    target: &dyn TargetModel,
    options: &DrafterOptions,
) -> ModelResult<Box<dyn Drafter>> {
    common::load_checkpoint_drafter("dflash", dir, &read_config(dir), target, options)
}

const LLAMA: &str = "{}";
const QWEN3: &str = r#"{"model_type": "qwen3", "head_dim": 16, "tie_word_embeddings": true}"#;

fn write_drafter(config_json: &str, seed: u64) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write_random_checkpoint(dir.path(), config_json, seed).unwrap();
    dir
}

/// Passes everything to the real drafter and counts what it was asked and gave.
struct Watched {
    inner: Box<dyn Drafter>,
    proposals: usize,
    proposed: usize,
    /// Non-empty drafts, and those that carried the picker's distributions, one per token.
    non_empty: usize,
    with_probs: usize,
}

impl Watched {
    fn new(inner: Box<dyn Drafter>) -> Self {
        Self {
            inner,
            proposals: 0,
            proposed: 0,
            non_empty: 0,
            with_probs: 0,
        }
    }
}

impl Drafter for Watched {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn taps(&self) -> &[usize] {
        self.inner.taps()
    }
    fn begin(
        &mut self,
        target: &dyn TargetModel,
        prompt: &[u32],
        hidden: Option<&Array>,
    ) -> ModelResult<()> {
        self.inner.begin(target, prompt, hidden)
    }
    fn propose(
        &mut self,
        target: &dyn TargetModel,
        last: u32,
        max_k: usize,
        picker: &mut dyn TokenPicker,
    ) -> ModelResult<Draft> {
        let draft = self.inner.propose(target, last, max_k, picker)?;
        // Greedy drafts may still be on the device: counted, not read, so that the
        // engine's verify is built on them as it is without this wrapper.
        assert!(draft.len() <= max_k, "at most max_k drafts");
        self.proposals += 1;
        self.proposed += draft.len();
        self.non_empty += usize::from(!draft.is_empty());
        if !draft.is_empty()
            && draft
                .probs
                .as_ref()
                .is_some_and(|p| p.shape()[0] as usize == draft.len())
        {
            self.with_probs += 1;
        }
        Ok(draft)
    }
    fn commit(&mut self, verified: &[u32], hidden: Option<&Array>) -> ModelResult<()> {
        self.inner.commit(verified, hidden)
    }
}

const PROMPTS: [&str; 3] = [
    "hello",
    "speculative decoding drafts a block and the target checks it",
    "1 2 3 4 5 6 7 8 9 10 11 12",
];

#[test]
fn dflash_greedy_speculation_equals_plain_greedy_across_families_prompts_and_lengths() {
    for (family, seed) in [(LLAMA, 11), (QWEN3, 12)] {
        let (_target_dir, loaded) = load_target(family, seed);
        let drafter_dir = write_drafter(TINY_DFLASH, seed + 100);
        // One drafter for every run: `begin` must reset whatever the last run left.
        let mut drafter = Watched::new(
            load_drafter(
                drafter_dir.path(),
                loaded.model.as_ref(),
                &DrafterOptions::default(),
            )
            .unwrap(),
        );
        for text in PROMPTS {
            let prompt = loaded.tokenizer.encode_prompt(text, false).unwrap();
            let truth = greedy(&loaded, &prompt, 40);
            // Lengths that end inside a block, at its edge, and after many rounds.
            for (max_tokens, max_draft) in [(1, 7), (2, 7), (6, 3), (8, 7), (17, 7), (40, 5)] {
                let before = drafter.proposals;
                let out = speculate(
                    &loaded,
                    &mut drafter,
                    &prompt,
                    &greedy_config(max_tokens, vec![]),
                    max_draft,
                    None,
                );
                assert_eq!(
                    out.tokens,
                    truth[..max_tokens].to_vec(),
                    "{family} {text:?} max_tokens {max_tokens} max_draft {max_draft}"
                );
                assert_eq!(out.stats.stop_reason, StopReason::MaxTokens);
                assert_eq!(out.speculative.drafter, "dflash");
                if max_tokens > 1 {
                    assert!(drafter.proposals > before, "the drafter was asked");
                }
                // With two tokens the only round has room for none: the second is the
                // target's own.
                if max_tokens > 2 {
                    assert!(out.speculative.drafted_tokens > 0, "and proposed tokens");
                }
            }
        }
        assert!(drafter.proposed > 0);
    }
}

#[test]
fn eos_inside_a_drafted_block_stops_like_plain_decoding() {
    for (family, seed) in [(LLAMA, 21), (QWEN3, 22)] {
        let (_target_dir, loaded) = load_target(family, seed);
        let drafter_dir = write_drafter(TINY_DFLASH, seed);
        let prompt = loaded
            .tokenizer
            .encode_prompt("where does it end", false)
            .unwrap();
        let truth = greedy(&loaded, &prompt, 40);
        for at in [1, 4, 9, 15] {
            let eos = truth[at];
            let config = greedy_config(40, vec![eos]);
            let plain = generate(
                loaded.model.as_ref(),
                &loaded.tokenizer,
                &prompt,
                &config,
                &mut |_| {},
            )
            .unwrap();
            let mut drafter = Watched::new(
                load_drafter(
                    drafter_dir.path(),
                    loaded.model.as_ref(),
                    &DrafterOptions::default(),
                )
                .unwrap(),
            );
            let out = speculate(&loaded, &mut drafter, &prompt, &config, 7, None);
            assert_eq!(out.tokens, plain.tokens, "{family} eos at {at}");
            assert_eq!(out.text, plain.text);
            assert_eq!(out.stats.stop_reason, StopReason::Eos);
            assert_eq!(out.tokens.last(), Some(&eos));
            if out.tokens.len() > 1 {
                assert!(drafter.proposed > 0);
            }
        }
    }
}

#[test]
fn four_bit_drafter_keeps_greedy_output_exact() {
    let (_target_dir, loaded) = load_target(QWEN3, 31);
    let drafter_dir = write_drafter(TINY_DFLASH, 32);
    let options = DrafterOptions {
        bits: Some(4),
        ..Default::default()
    };
    let config = read_config(drafter_dir.path());
    let info = loaded.model.info();
    let request = DrafterLoadRequest {
        dir: Some(drafter_dir.path()),
        config: &config,
        target: info,
        options: &options,
        load_model: &|_| Err(ModelError::Unsupported("no model".into())),
    };
    assert_eq!(
        DFlashDrafter::load(&request).unwrap().quantized_bits(),
        Some(4)
    );
    let mut drafter =
        Watched::new(load_drafter(drafter_dir.path(), loaded.model.as_ref(), &options).unwrap());
    for text in PROMPTS {
        let prompt = loaded.tokenizer.encode_prompt(text, false).unwrap();
        let truth = greedy(&loaded, &prompt, 30);
        let out = speculate(
            &loaded,
            &mut drafter,
            &prompt,
            &greedy_config(30, vec![]),
            7,
            None,
        );
        assert_eq!(out.tokens, truth, "{text:?}");
    }
    assert!(drafter.proposed > 0);
}

/// Drives a drafter by hand through rounds of a known continuation, checking after
/// rounds that its incrementally grown context drafts what a fresh drafter (a fork of
/// one never begun) begun on the whole context drafts. Some rounds are committed
/// without a draft after them, as a batch's plain steps are: their states wait to be
/// projected with the next round's.
fn check_incremental_context(loaded: &LoadedModel, drafter_dir: &Path, prompt_text: &str) {
    let target = loaded.model.as_ref();
    let options = DrafterOptions::default();
    let mut drafter = load_drafter(drafter_dir, target, &options).unwrap();
    let unused = load_drafter(drafter_dir, target, &options).unwrap();
    let taps = drafter.taps().to_vec();
    let prompt = loaded.tokenizer.encode_prompt(prompt_text, false).unwrap();
    let truth = greedy(loaded, &prompt, 24);

    let mut cache = target.new_cache();
    let out = target
        .forward(
            &Array::from_slice(&prompt, &[1, prompt.len() as i32]),
            &mut cache,
            &taps,
        )
        .unwrap();
    drafter.begin(target, &prompt, out.hidden.as_ref()).unwrap();
    let mut history = prompt.clone();
    let mut position = 0;
    // Rounds that verify 1, 3, 2, 5, … positions, as acceptance would.
    for (round, verified_len) in [1usize, 3, 2, 5, 1, 4, 2].into_iter().enumerate() {
        let last = truth[position];
        // Rounds 2, 3 and 5 are committed with no draft after them.
        if ![2, 3, 5].contains(&round) {
            check_drafts(
                &mut *drafter,
                unused.as_ref(),
                loaded,
                &history,
                last,
                round,
            );
        }

        // Commit `verified_len` true tokens, with the target's hidden states at them.
        let verified = &truth[position..position + verified_len];
        let step = target
            .forward(
                &Array::from_slice(verified, &[1, verified_len as i32]),
                &mut cache,
                &taps,
            )
            .unwrap();
        drafter.commit(verified, step.hidden.as_ref()).unwrap();
        history.extend_from_slice(verified);
        position += verified_len;
    }
}

/// `drafter`'s drafts after `last` equal those of a fork of `unused` begun on the whole
/// of `history`, read at once or left on the device.
fn check_drafts(
    drafter: &mut dyn Drafter,
    unused: &dyn Drafter,
    loaded: &LoadedModel,
    history: &[u32],
    last: u32,
    round: usize,
) {
    let target = loaded.model.as_ref();
    let taps = drafter.taps().to_vec();
    let mut incremental = Argmax::default();
    let drafted = drafter.propose(target, last, 7, &mut incremental).unwrap();
    assert_eq!(drafted.tokens.len(), 7);

    let mut fresh = unused.fork().expect("a DFlash drafter forks");
    let mut fresh_cache = target.new_cache();
    let whole = target
        .forward(
            &Array::from_slice(history, &[1, history.len() as i32]),
            &mut fresh_cache,
            &taps,
        )
        .unwrap();
    fresh.begin(target, history, whole.hidden.as_ref()).unwrap();
    let mut from_scratch = Argmax::default();
    let redrafted = fresh.propose(target, last, 7, &mut from_scratch).unwrap();
    let diff = max_abs_diff(&incremental.logits[0], &from_scratch.logits[0]);
    assert!(
        diff < 1e-3,
        "round {round}: incremental and from-scratch logits differ by {diff}"
    );
    assert_eq!(drafted.tokens, redrafted.tokens, "round {round}");
    // Left on the device for the verify, as the engine's picker lets it: the same
    // drafts, unread until asked for.
    let mut lazily = drafter.propose(target, last, 7, &mut DeviceArgmax).unwrap();
    assert!(
        lazily.on_device.is_some(),
        "round {round}: drafts read early"
    );
    assert_eq!(
        lazily.read().unwrap(),
        drafted.tokens.as_slice(),
        "round {round}"
    );
}

#[test]
fn context_grown_round_by_round_drafts_like_a_fresh_start() {
    for (family, seed) in [(LLAMA, 41), (QWEN3, 42)] {
        let (_target_dir, loaded) = load_target(family, seed);
        let drafter_dir = write_drafter(TINY_DFLASH, seed);
        check_incremental_context(&loaded, drafter_dir.path(), PROMPTS[1]);
    }
}

#[test]
fn sliding_window_layer_masks_old_context_and_keeps_output_exact() {
    let (_target_dir, loaded) = load_target(QWEN3, 51);
    let sliding = with(
        TINY_DFLASH,
        r#"{"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4, "use_sliding_window": true}"#,
    );
    // Same seed, same tensors: the two drafters differ only by the window.
    let windowed_dir = write_drafter(&sliding, 52);
    let full_dir = write_drafter(TINY_DFLASH, 52);
    check_incremental_context(&loaded, windowed_dir.path(), PROMPTS[1]);

    let target = loaded.model.as_ref();
    let prompt = loaded.tokenizer.encode_prompt(PROMPTS[1], false).unwrap();
    let mut logits = Vec::new();
    for dir in [&windowed_dir, &full_dir] {
        let mut drafter = load_drafter(dir.path(), target, &DrafterOptions::default()).unwrap();
        let mut cache = target.new_cache();
        let out = target
            .forward(
                &Array::from_slice(&prompt, &[1, prompt.len() as i32]),
                &mut cache,
                drafter.taps(),
            )
            .unwrap();
        drafter.begin(target, &prompt, out.hidden.as_ref()).unwrap();
        let mut picker = Argmax::default();
        drafter.propose(target, 65, 7, &mut picker).unwrap();
        logits.push(picker.logits.remove(0));
    }
    assert!(
        max_abs_diff(&logits[0], &logits[1]) > 1e-3,
        "a 4-position window over a long prompt must change the drafts' logits"
    );

    let mut drafter = Watched::new(
        load_drafter(windowed_dir.path(), target, &DrafterOptions::default()).unwrap(),
    );
    for text in PROMPTS {
        let prompt = loaded.tokenizer.encode_prompt(text, false).unwrap();
        let truth = greedy(&loaded, &prompt, 30);
        let out = speculate(
            &loaded,
            &mut drafter,
            &prompt,
            &greedy_config(30, vec![]),
            7,
            None,
        );
        assert_eq!(out.tokens, truth, "{text:?}");
    }
    assert!(drafter.proposed > 0);
}

#[test]
fn sampled_drafts_carry_the_pickers_distributions() {
    let (_target_dir, loaded) = load_target(LLAMA, 61);
    let drafter_dir = write_drafter(TINY_DFLASH, 62);
    let mut drafter = Watched::new(
        load_drafter(
            drafter_dir.path(),
            loaded.model.as_ref(),
            &DrafterOptions::default(),
        )
        .unwrap(),
    );
    let prompt = loaded.tokenizer.encode_prompt(PROMPTS[0], false).unwrap();
    let config = GenerationConfig {
        max_tokens: 20,
        sampling: SamplingParams {
            temperature: 0.8,
            seed: Some(7),
            ..Default::default()
        },
        stop_strings: vec![],
        eos_ids: vec![],
    };
    let out = speculate(&loaded, &mut drafter, &prompt, &config, 5, None);
    assert_eq!(out.tokens.len(), 20);
    assert!(drafter.non_empty > 0);
    assert_eq!(
        drafter.with_probs, drafter.non_empty,
        "every sampled draft has q for rejection sampling"
    );
}

fn mismatch(drafter_config: &str, edit: Option<&str>) -> String {
    let (_target_dir, loaded) = load_target(LLAMA, 71);
    let dir = write_drafter(drafter_config, 72);
    if let Some(edit) = edit {
        // Hand-edit config.json after the weights were written for the original.
        let edited = with(&read_config(dir.path()).to_string(), edit);
        std::fs::write(dir.path().join("config.json"), edited).unwrap();
    }
    match load_drafter(
        dir.path(),
        loaded.model.as_ref(),
        &DrafterOptions::default(),
    ) {
        Ok(_) => panic!("{drafter_config} {edit:?} should not fit the target"),
        Err(e) => {
            assert!(
                matches!(e, ModelError::DrafterMismatch { .. }),
                "a mismatch error, got {e:?}"
            );
            let message = e.to_string();
            assert!(message.contains("config.json"), "{message}");
            message
        }
    }
}

#[test]
fn drafters_that_do_not_fit_the_target_are_refused_with_the_reason() {
    let m = mismatch(&with(TINY_DFLASH, r#"{"vocab_size": 300}"#), None);
    assert!(
        m.contains("vocab_size is 300") && m.contains("target's is 259"),
        "{m}"
    );

    let m = mismatch(&with(TINY_DFLASH, r#"{"hidden_size": 48}"#), None);
    assert!(
        m.contains("fc takes") && m.contains("96") && m.contains("64"),
        "{m}"
    );

    let m = mismatch(
        TINY_DFLASH,
        Some(r#"{"dflash_config": {"target_layer_ids": [1], "mask_token_id": 256}}"#),
    );
    assert!(
        m.contains("fc.weight takes 64 inputs") && m.contains("target_layer_ids"),
        "{m}"
    );

    let m = mismatch(
        &with(
            TINY_DFLASH,
            r#"{"dflash_config": {"target_layer_ids": [0, 5], "mask_token_id": 256}}"#,
        ),
        None,
    );
    assert!(
        m.contains("target_layer_ids [0, 5]") && m.contains("layer 5") && m.contains("2 layers"),
        "{m}"
    );

    let m = mismatch(
        &with(
            TINY_DFLASH,
            r#"{"dflash_config": {"target_layer_ids": [0, 1], "mask_token_id": 300}}"#,
        ),
        None,
    );
    assert!(
        m.contains("mask_token_id 300") && m.contains("259 tokens"),
        "{m}"
    );
}

/// A real-schema DFlash checkpoint that drafts one token over and over: its layers add
/// nothing (zero `o_proj` and `down_proj`) and its final norm is neutral, so every draft
/// is the target's head applied to the mask token's embedding — with tied embeddings,
/// usually the mask token itself. Against a target that repeats a token, drafts get
/// accepted for many positions in a row, which random drafters never achieve.
fn repeater(mask: u32, seed: u64) -> tempfile::TempDir {
    let config = with(
        TINY_DFLASH,
        &format!(r#"{{"dflash_config": {{"target_layer_ids": [0, 1], "mask_token_id": {mask}}}}}"#),
    );
    let dir = write_drafter(&config, seed);
    make_dflash_repeat(dir.path());
    dir
}

/// A repeater whose drafts are one of the tokens `truth` repeats, and that token.
fn repeater_for(loaded: &LoadedModel, prompt: &[u32], truth: &[u32]) -> (tempfile::TempDir, u32) {
    let target = loaded.model.as_ref();
    let mut runs: Vec<u32> = truth
        .windows(2)
        .filter(|w| w[0] == w[1])
        .map(|w| w[0])
        .collect();
    runs.dedup();
    for token in runs {
        let dir = repeater(token, 81);
        let mut drafter = load_drafter(dir.path(), target, &DrafterOptions::default()).unwrap();
        let mut cache = target.new_cache();
        let out = target
            .forward(
                &Array::from_slice(prompt, &[1, prompt.len() as i32]),
                &mut cache,
                drafter.taps(),
            )
            .unwrap();
        drafter.begin(target, prompt, out.hidden.as_ref()).unwrap();
        let draft = drafter
            .propose(target, truth[0], 7, &mut Argmax::default())
            .unwrap();
        if draft.tokens.iter().all(|&t| t == token) {
            return (dir, token);
        }
    }
    panic!("no repeated token of {truth:?} is drafted by its repeater");
}

#[test]
fn accepted_blocks_commit_several_positions_and_stop_inside_the_block() {
    // This tied qwen3 target falls into long runs of one token (see `repeater`).
    let (_target_dir, loaded) = load_target(QWEN3, 22);
    let prompt = loaded
        .tokenizer
        .encode_prompt("where does it end", false)
        .unwrap();
    let truth = greedy(&loaded, &prompt, 40);
    let (dir, token) = repeater_for(&loaded, &prompt, &truth);
    let first = truth.iter().position(|&t| t == token).unwrap();
    let run_end = first + truth[first..].iter().take_while(|&&t| t == token).count();
    let fresh = || {
        Watched::new(
            load_drafter(
                dir.path(),
                loaded.model.as_ref(),
                &DrafterOptions::default(),
            )
            .unwrap(),
        )
    };

    // The whole continuation: many drafts accepted, commits of several positions.
    let out = speculate(
        &loaded,
        &mut fresh(),
        &prompt,
        &greedy_config(40, vec![]),
        7,
        None,
    );
    assert_eq!(out.tokens, truth);
    assert!(
        out.speculative.accepted_tokens >= 3,
        "the repeater's drafts are accepted along the run of {token}: {:?}",
        out.speculative.acceptance_histogram
    );

    // max_tokens inside the run: accepted drafts beyond it never show.
    for max_tokens in [first + 2, (first + run_end) / 2 + 1, run_end] {
        let out = speculate(
            &loaded,
            &mut fresh(),
            &prompt,
            &greedy_config(max_tokens, vec![]),
            7,
            None,
        );
        assert_eq!(
            out.tokens,
            truth[..max_tokens].to_vec(),
            "max_tokens {max_tokens}"
        );
        assert_eq!(out.stats.stop_reason, StopReason::MaxTokens);
    }

    // EOS = the repeated token: its first occurrence is an accepted draft, with more
    // accepted drafts after it in the same block that must be dropped.
    let config = greedy_config(40, vec![token]);
    let plain = generate(
        loaded.model.as_ref(),
        &loaded.tokenizer,
        &prompt,
        &config,
        &mut |_| {},
    )
    .unwrap();
    let out = speculate(&loaded, &mut fresh(), &prompt, &config, 7, None);
    assert_eq!(out.tokens, plain.tokens);
    assert_eq!(out.tokens, truth[..=first].to_vec());
    assert_eq!(out.text, plain.text);
    assert_eq!(out.stats.stop_reason, StopReason::Eos);
    assert!(
        out.speculative.accepted_tokens >= 1,
        "the EOS arrived as an accepted draft: {:?}",
        out.speculative.acceptance_histogram
    );
}
