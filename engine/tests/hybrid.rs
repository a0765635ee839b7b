//! Speculative decoding on a hybrid target (Gated DeltaNet layers among attention
//! layers, tiny Qwen3.5): greedy speculation gives plain greedy decoding's tokens when
//! drafts are rejected at every position of a block, so the target's recurrent state is
//! rolled back into the middle of its verify forwards, and when a draft model with
//! recurrent state of its own rolls back its one-token drafts.

use mlx_rs::Array;

use dspec_adapters::fixtures::{with, TINY_QWEN3_5_OVERRIDES};
use dspec_drafters::ngram::NgramDrafter;
use dspec_engine::decoding::drafting::load_drafter;
use dspec_engine::decoding::speculative::SpeculativeOutput;
use dspec_engine::loading::{builtin_registry, LoadedModel};
use dspec_engine::tiny_model::write_tiny_model;
use dspec_plugin_api::error::Result as ModelResult;
use dspec_plugin_api::{
    Draft, DraftAhead, Drafter, DrafterOptions, LoadOptions, TargetModel, TokenPicker,
};

mod common;
use common::{greedy, greedy_config, load_dir, speculate, tiny_target};

/// The vocabulary of the tiny targets (bytes and three specials).
const VOCAB: u32 = 259;

/// Knows the true greedy continuation and drafts it with one token changed, at a
/// position that moves from round to round, so that every acceptance length occurs.
/// It asks for the hidden states of the first and last layers (both recurrent).
struct ShiftingOracle {
    truth: Vec<u32>,
    seen: usize,
    round: usize,
}

impl Drafter for ShiftingOracle {
    fn name(&self) -> &str {
        "shifting-oracle"
    }
    fn taps(&self) -> &[usize] {
        &[0, 2]
    }
    fn begin(&mut self, _: &dyn TargetModel, _: &[u32], hidden: Option<&Array>) -> ModelResult<()> {
        assert!(hidden.is_some(), "taps were declared");
        Ok(())
    }
    fn propose(
        &mut self,
        _: &dyn TargetModel,
        last: u32,
        max_k: usize,
        _: &mut dyn TokenPicker,
    ) -> ModelResult<Draft> {
        assert_eq!(Some(&last), self.truth.get(self.seen));
        let mut tokens: Vec<u32> = self
            .truth
            .iter()
            .skip(self.seen + 1)
            .take(max_k)
            .copied()
            .collect();
        self.round += 1;
        let wrong = self.round % (max_k + 2);
        if let Some(t) = tokens.get_mut(wrong) {
            *t = (*t + 1) % VOCAB;
        }
        Ok(Draft {
            tokens,
            probs: None,
        })
    }
    fn commit(&mut self, verified: &[u32], hidden: Option<&Array>) -> ModelResult<()> {
        assert_eq!(verified, &self.truth[self.seen..self.seen + verified.len()]);
        let hidden = hidden.expect("hidden states of the verified positions");
        assert_eq!(
            hidden.shape(),
            [1, verified.len() as i32, 64],
            "two taps of 32"
        );
        self.seen += verified.len();
        Ok(())
    }
}

fn prompt(loaded: &LoadedModel, text: &str) -> Vec<u32> {
    loaded.tokenizer.encode_prompt(text, false).expect("encode")
}

fn assert_greedy(out: &SpeculativeOutput, truth: &[u32], what: &str) {
    assert_eq!(out.tokens, truth, "{what}");
    let s = &out.speculative;
    assert!(s.drafted_tokens > 0, "{what}: nothing was drafted");
}

/// Rejections at every position of the target's verify blocks, for draft lengths within
/// the default rollback window and beyond it (the engine sizes the window to the draft
/// length).
#[test]
fn a_hybrid_target_speculates_exactly_with_rejections_inside_blocks() {
    let (_dir, loaded) = tiny_target(TINY_QWEN3_5_OVERRIDES, 21);
    let ids = prompt(&loaded, "speculate on this");
    let truth = greedy(&loaded, &ids, 60);
    for max_draft in [4, 11] {
        let mut oracle = ShiftingOracle {
            truth: truth.clone(),
            seen: 0,
            round: 0,
        };
        let out = speculate(
            &loaded,
            &mut oracle,
            &ids,
            &greedy_config(50, vec![]),
            max_draft,
            None,
        );
        assert_greedy(&out, &truth[..50], &format!("max_draft {max_draft}"));
        let histogram = &out.speculative.acceptance_histogram;
        assert!(
            histogram[..max_draft.min(6)].iter().all(|&c| c > 0),
            "max_draft {max_draft}: rejections at every position of a block: {histogram:?}"
        );
    }
}

#[test]
fn ngram_speculation_on_a_hybrid_target_equals_greedy() {
    let (_dir, loaded) = tiny_target(TINY_QWEN3_5_OVERRIDES, 2);
    let ids = prompt(&loaded, "abc abc abc abc abc abc abc");
    let truth = greedy(&loaded, &ids, 48);
    let mut drafter = NgramDrafter::new(3);
    let out = speculate(
        &loaded,
        &mut drafter,
        &ids,
        &greedy_config(48, vec![]),
        6,
        None,
    );
    assert_greedy(&out, &truth, "ngram");
}

/// Draft models on a hybrid target: the same weights (every draft kept), a smaller hybrid
/// model (its own recurrent state rolled back after rejected drafts) and a plain llama,
/// with and without drafting ahead on the draft model's thread.
#[test]
fn draft_models_on_a_hybrid_target_equal_greedy() {
    let root = tempfile::tempdir().expect("temp dir");
    let (target_dir, twin, small, llama) = (
        root.path().join("target"),
        root.path().join("twin"),
        root.path().join("small"),
        root.path().join("llama"),
    );
    write_tiny_model(&target_dir, TINY_QWEN3_5_OVERRIDES, 11).expect("target");
    write_tiny_model(&twin, TINY_QWEN3_5_OVERRIDES, 11).expect("twin");
    let one_layer = with(
        TINY_QWEN3_5_OVERRIDES,
        r#"{"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]}"#,
    );
    write_tiny_model(&small, &one_layer, 5).expect("small");
    write_tiny_model(&llama, r#"{"num_hidden_layers": 1}"#, 5).expect("llama");
    let target = load_dir(&target_dir);
    for ahead in [DraftAhead::Off, DraftAhead::On] {
        let drafter = |dir: &std::path::Path| {
            load_drafter(
                &format!("model:{}", dir.display()),
                &target,
                &builtin_registry().expect("registry"),
                &LoadOptions::default(),
                &DrafterOptions {
                    draft_ahead: Some(ahead),
                    ..DrafterOptions::default()
                },
            )
            .unwrap_or_else(|e| panic!("loading {}: {e}", dir.display()))
        };
        for (prompt_text, n) in [("hello there", 30), ("the quick brown fox", 19)] {
            let ids = prompt(&target, prompt_text);
            let truth = greedy(&target, &ids, n);
            let what = |name: &str| format!("{name}, ahead {ahead:?}, {prompt_text:?}");

            let out = speculate(
                &target,
                drafter(&twin).as_mut(),
                &ids,
                &greedy_config(n, vec![]),
                4,
                None,
            );
            assert_greedy(&out, &truth, &what("twin"));
            assert_eq!(
                out.speculative.accepted_tokens,
                out.speculative.drafted_tokens,
                "{}: the same weights draft the target's tokens",
                what("twin")
            );

            for (name, dir) in [("small hybrid", &small), ("llama", &llama)] {
                for max_draft in [3, 6] {
                    let out = speculate(
                        &target,
                        drafter(dir).as_mut(),
                        &ids,
                        &greedy_config(n, vec![]),
                        max_draft,
                        None,
                    );
                    assert_greedy(&out, &truth, &what(name));
                    assert!(
                        out.speculative.accepted_tokens < out.speculative.drafted_tokens,
                        "{}: some drafts are rejected",
                        what(name)
                    );
                }
            }
        }
    }
}
