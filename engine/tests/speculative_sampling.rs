//! Sampling is exact: the first three generated tokens are distributed exactly as the
//! target's own sampling distribution says, for plain decoding (drawn on the device,
//! pipelined) and for speculative decoding whatever the drafter (rejection sampling on
//! the device). The check itself (exact joint distribution, chi-square) is in
//! `common/lossless.rs`.

use std::collections::HashMap;

use dspec_engine::decoding::generate::{generate, GenerationConfig};
use dspec_engine::decoding::sampling::SamplingParams;
use dspec_engine::loading::builtin_registry;
use dspec_engine::loading::drafting::load_drafter;
use dspec_engine::tiny_model::write_tiny_model;
use dspec_plugin_api::{DrafterOptions, LoadOptions};

mod common;
use common::load_dir as load;
use common::lossless::{
    assert_lossless, chi_square, exact_joint, greedy_path, params, FixedDrafter, SAMPLES,
};

#[test]
fn speculative_sampling_matches_the_targets_distribution() {
    let root = tempfile::tempdir().unwrap();
    let (t, d) = (root.path().join("t"), root.path().join("d"));
    write_tiny_model(&t, "{}", 8).unwrap();
    // The target's own weights, loaded 4-bit: q close to p but not equal, so drafts
    // are both accepted and rejected (an unrelated random model's top-3 never meets
    // the target's).
    write_tiny_model(&d, "{}", 8).unwrap();
    let target = load(&t);
    let prompt = target.tokenizer.encode_prompt("ab", false).unwrap();
    let expected = exact_joint(target.model.as_ref(), &prompt, &params(0));
    assert!(expected.len() >= 9, "top-3 sampling has a real choice");

    // One-hot drafts (no probabilities).
    let mut fixed = FixedDrafter {
        path: greedy_path(target.model.as_ref(), &prompt, 4),
        seen: 0,
    };
    assert_lossless(
        &target,
        &mut fixed,
        &prompt,
        &expected,
        1,
        "one-hot drafter",
    );

    // A draft model sampling from its own distribution q (probabilities attached).
    let mut model_drafter = load_drafter(
        &format!("model:{}", d.display()),
        &target,
        &builtin_registry().unwrap(),
        &LoadOptions::default(),
        &DrafterOptions {
            bits: Some(4),
            ..DrafterOptions::default()
        },
    )
    .unwrap();
    assert_lossless(
        &target,
        model_drafter.as_mut(),
        &prompt,
        &expected,
        2,
        "draft model",
    );
}

/// Plain decoding's device sampling draws from the reference distribution: the same
/// chi-square test over runs of three tokens, each run with its own seed. A lower
/// temperature than the speculative test's and top-p on the top-k set: the tiny
/// model's top logits are close, and sharper distributions make a wrong temperature
/// or filter show.
#[test]
fn plain_sampling_matches_the_targets_distribution() {
    let plain_params = |seed: u64| SamplingParams {
        temperature: 0.6,
        top_k: 3,
        top_p: 0.75,
        seed: Some(seed),
        ..SamplingParams::default()
    };
    let root = tempfile::tempdir().unwrap();
    write_tiny_model(root.path(), "{}", 8).unwrap();
    let target = load(root.path());
    let prompt = target.tokenizer.encode_prompt("ab", false).unwrap();
    let expected = exact_joint(target.model.as_ref(), &prompt, &plain_params(0));
    assert!(expected.len() >= 4, "the filters leave a real choice");
    let mut seen = HashMap::new();
    for i in 0..SAMPLES {
        let cfg = GenerationConfig {
            max_tokens: 3,
            sampling: plain_params(3 * 1_000_003 + i as u64),
            stop_strings: Vec::new(),
            eos_ids: Vec::new(),
        };
        let out = generate(
            target.model.as_ref(),
            &target.tokenizer,
            &prompt,
            &cfg,
            &mut |_| {},
        )
        .unwrap();
        let key = [out.tokens[0], out.tokens[1], out.tokens[2]];
        *seen.entry(key).or_insert(0) += 1;
    }
    let (stat, critical) = chi_square(&expected, &seen);
    assert!(
        stat < critical,
        "plain sampling: chi-square {stat:.1} ≥ {critical:.1}"
    );
}
