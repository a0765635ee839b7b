//! A smaller model of the same tokenizer as drafter: speculative greedy output equals
//! plain greedy output whatever the draft model proposes; `--drafter` resolution and
//! its errors.

use dspec_engine::decoding::generate::{generate, GenerationConfig, StopReason};
use dspec_engine::decoding::speculative::VerifyAheadMode;
use dspec_engine::decoding::speculative::{generate_speculative, ServingOptions, Speculation};
use dspec_engine::loading::drafting::load_drafter;
use dspec_engine::loading::{builtin_registry, LoadedModel};
use dspec_engine::tiny_model::write_tiny_model;
use dspec_plugin_api::{DraftAhead, Drafter, DrafterOptions, LoadOptions};

mod common;
use common::{greedy_config, load_dir as load};

fn options(bits: Option<i32>, ahead: DraftAhead) -> DrafterOptions {
    DrafterOptions {
        bits,
        ngram: 3,
        draft_ahead: Some(ahead),
        ..DrafterOptions::default()
    }
}

/// `ahead`: the draft model keeps drafting on its thread while the target verifies
/// (on by default on GPUs only); the output must not depend on it.
fn drafter_for(
    spec: &str,
    target: &LoadedModel,
    bits: Option<i32>,
    ahead: DraftAhead,
) -> Box<dyn Drafter> {
    load_drafter(
        spec,
        target,
        &builtin_registry().unwrap(),
        &LoadOptions::default(),
        &options(bits, ahead),
    )
    .unwrap_or_else(|e| panic!("loading drafter {spec}: {e}"))
}

fn assert_same_as_greedy(
    target: &LoadedModel,
    drafter: &mut dyn Drafter,
    prompt: &str,
    cfg: &GenerationConfig,
    max_draft: usize,
) -> dspec_engine::decoding::speculative::SpeculativeOutput {
    let ids = target.tokenizer.encode_prompt(prompt, false).unwrap();
    let plain = generate(
        target.model.as_ref(),
        &target.tokenizer,
        &ids,
        cfg,
        &mut |_| {},
    )
    .unwrap();
    let spec = generate_speculative(
        target.model.as_ref(),
        &target.tokenizer,
        &ids,
        cfg,
        Speculation {
            drafter,
            max_draft,
            adaptive: false,
            trace: None,
            verify_ahead: VerifyAheadMode::Always,
        },
        &mut |_| {},
        ServingOptions::default(),
    )
    .unwrap();
    assert_eq!(spec.tokens, plain.tokens, "prompt {prompt:?}");
    assert_eq!(spec.text, plain.text);
    assert_eq!(spec.stats.stop_reason, plain.stats.stop_reason);
    spec
}

#[test]
fn draft_models_give_exactly_the_greedy_output_on_two_families() {
    for ahead in [DraftAhead::Off, DraftAhead::On, DraftAhead::Eager] {
        draft_models_give_the_greedy_output(ahead);
    }
}

fn draft_models_give_the_greedy_output(ahead: DraftAhead) {
    for (overrides, draft_overrides) in [
        ("{}", r#"{"num_hidden_layers": 1}"#),
        (
            r#"{"model_type": "qwen3", "head_dim": 16}"#,
            r#"{"model_type": "qwen2", "num_hidden_layers": 1}"#,
        ),
    ] {
        let root = tempfile::tempdir().unwrap();
        let (t, same, other) = (
            root.path().join("target"),
            root.path().join("same"),
            root.path().join("other"),
        );
        write_tiny_model(&t, overrides, 11).unwrap();
        // The same weights as the target: every draft is accepted.
        write_tiny_model(&same, overrides, 11).unwrap();
        // A different, smaller model: drafts are mostly rejected.
        write_tiny_model(&other, draft_overrides, 5).unwrap();
        let target = load(&t);

        let mut twin = drafter_for(&format!("model:{}", same.display()), &target, None, ahead);
        for (prompt, n) in [("hello there", 30), ("a", 7), ("the quick brown fox", 19)] {
            let out =
                assert_same_as_greedy(&target, twin.as_mut(), prompt, &greedy_config(n, vec![]), 4);
            assert_eq!(
                out.speculative.accepted_tokens, out.speculative.drafted_tokens,
                "{overrides}: an identical draft model is always right"
            );
            assert!(out.speculative.tau > 1.0);
        }
        // A plain model directory given without `model:` also becomes a draft model.
        let mut small = drafter_for(other.to_str().unwrap(), &target, None, ahead);
        assert_eq!(small.name(), "draft-model");
        for (prompt, n) in [("hello there", 30), ("zz", 13)] {
            let out = assert_same_as_greedy(
                &target,
                small.as_mut(),
                prompt,
                &greedy_config(n, vec![]),
                3,
            );
            assert!(out.speculative.drafted_tokens > 0);
        }
        // 8-bit drafter weights change the drafts, never the output.
        let mut q8 = drafter_for(other.to_str().unwrap(), &target, Some(8), ahead);
        assert_same_as_greedy(
            &target,
            q8.as_mut(),
            "quantized",
            &greedy_config(17, vec![]),
            5,
        );
    }
}

/// Under `--max-draft auto` a draft model whose drafts mostly fail leaves runs of plain
/// steps, which reach its thread in pieces it reads while the target decodes (when its
/// work overlaps the target's): the output is still plain greedy's, token for token,
/// whatever the rounds chose (the choice follows measured times, so how many rounds
/// ran plain varies; the pieces' reading itself is checked in `draft_thread`'s tests).
#[test]
fn auto_rounds_with_a_failing_draft_model_keep_the_greedy_output() {
    let root = tempfile::tempdir().unwrap();
    let (t, other) = (root.path().join("target"), root.path().join("other"));
    write_tiny_model(&t, "{}", 11).unwrap();
    write_tiny_model(&other, r#"{"num_hidden_layers": 1}"#, 5).unwrap();
    let target = load(&t);
    let cfg = greedy_config(160, vec![]);
    let ids = target.tokenizer.encode_prompt("plain runs", false).unwrap();
    let plain = generate(
        target.model.as_ref(),
        &target.tokenizer,
        &ids,
        &cfg,
        &mut |_| {},
    )
    .unwrap();
    for ahead in [DraftAhead::Off, DraftAhead::On] {
        let mut drafter = drafter_for(other.to_str().unwrap(), &target, None, ahead);
        let spec = generate_speculative(
            target.model.as_ref(),
            &target.tokenizer,
            &ids,
            &cfg,
            Speculation {
                drafter: drafter.as_mut(),
                max_draft: 4,
                adaptive: true,
                trace: None,
                verify_ahead: VerifyAheadMode::Always,
            },
            &mut |_| {},
            ServingOptions::default(),
        )
        .unwrap();
        assert_eq!(spec.tokens, plain.tokens, "{ahead:?}");
        let s = &spec.speculative;
        assert_eq!(
            s.draft_histogram.iter().sum::<usize>(),
            s.target_forwards,
            "{ahead:?}: every round counted once"
        );
    }
}

#[test]
fn eos_and_max_tokens_inside_a_draft_model_block_stop_like_plain_decoding() {
    let root = tempfile::tempdir().unwrap();
    let (t, same) = (root.path().join("t"), root.path().join("same"));
    write_tiny_model(&t, "{}", 3).unwrap();
    write_tiny_model(&same, "{}", 3).unwrap();
    let target = load(&t);
    let ids = target.tokenizer.encode_prompt("stop here", false).unwrap();
    let truth = generate(
        target.model.as_ref(),
        &target.tokenizer,
        &ids,
        &greedy_config(30, vec![]),
        &mut |_| {},
    )
    .unwrap()
    .tokens;
    // Every draft is accepted, so a stop at position 6 lands inside the second block.
    let eos = truth[6];
    for ahead in [DraftAhead::Off, DraftAhead::On, DraftAhead::Eager] {
        let mut twin = drafter_for(&format!("model:{}", same.display()), &target, None, ahead);
        let out = assert_same_as_greedy(
            &target,
            twin.as_mut(),
            "stop here",
            &greedy_config(30, vec![eos]),
            4,
        );
        assert_eq!(out.stats.stop_reason, StopReason::Eos);
        for n in [1, 2, 6, 9] {
            let out = assert_same_as_greedy(
                &target,
                twin.as_mut(),
                "stop here",
                &greedy_config(n, vec![]),
                4,
            );
            assert_eq!(out.tokens.len(), n);
        }
    }
}

fn load_error(spec: &str, target: &LoadedModel) -> String {
    match load_drafter(
        spec,
        target,
        &builtin_registry().unwrap(),
        &LoadOptions::default(),
        &options(None, DraftAhead::Off),
    ) {
        Ok(d) => panic!("--drafter {spec} loaded as {}", d.name()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn drafter_arguments_that_cannot_work_get_clear_errors() {
    let root = tempfile::tempdir().unwrap();
    let t = root.path().join("t");
    write_tiny_model(&t, "{}", 1).unwrap();
    let target = load(&t);

    // A draft model whose tokenizer maps tokens to other ids.
    let other_tok = root.path().join("other-tok");
    write_tiny_model(&other_tok, "{}", 2).unwrap();
    let path = other_tok.join("tokenizer.json");
    let text = std::fs::read_to_string(&path).unwrap();
    // Swap the ids of "a" and "b".
    let swapped = text
        .replace("\"a\": 97", "\"a\": TMP")
        .replace("\"b\": 98", "\"b\": 97")
        .replace("\"a\": TMP", "\"a\": 98");
    assert_ne!(text, swapped, "the fixture's vocab layout changed");
    std::fs::write(&path, swapped).unwrap();
    let err = load_error(&format!("model:{}", other_tok.display()), &target);
    assert!(
        err.contains("tokenizer differs") && err.contains("other-tok"),
        "{err}"
    );

    // Not a kind, not a directory.
    let err = load_error("no-such-drafter", &target);
    assert!(
        err.contains("no-such-drafter") && err.contains("ngram") && err.contains("draft-model"),
        "{err}"
    );

    // A directory whose config is neither a drafter nor a loadable model.
    let odd = root.path().join("odd");
    std::fs::create_dir_all(&odd).unwrap();
    std::fs::write(odd.join("config.json"), r#"{"model_type": "mystery"}"#).unwrap();
    let err = load_error(odd.to_str().unwrap(), &target);
    assert!(
        err.contains("mystery") && err.contains("not a drafter checkpoint"),
        "{err}"
    );

    // Missing config.json.
    let empty = root.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let err = load_error(&format!("model:{}", empty.display()), &target);
    assert!(err.contains("config.json"), "{err}");

    // --drafter-bits outside 0/4/8.
    let err = match load_drafter(
        "ngram",
        &target,
        &builtin_registry().unwrap(),
        &LoadOptions::default(),
        &options(Some(3), DraftAhead::Off),
    ) {
        Ok(_) => panic!("3 bits accepted"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("--drafter-bits"), "{err}");
}
