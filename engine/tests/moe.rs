//! Speculative decoding on mixture-of-experts targets (tiny Qwen3-MoE, Qwen3-Next with
//! experts and Qwen3.5-MoE) with every drafter: greedy speculation gives plain greedy
//! decoding's tokens with drafts rejected at every position of a block (a verify routes
//! its positions to the experts together, sorted by expert once it is wide enough), and
//! sampled speculation keeps the target's distribution.

use mlx_rs::Array;

use dspec_adapters::fixtures::{
    tiny_experts, with, TINY_QWEN3_5_OVERRIDES, TINY_QWEN3_NEXT_OVERRIDES,
};
use dspec_drafters::ngram::NgramDrafter;
use dspec_drafters::{dflash, dspark};
use dspec_engine::loading::LoadedModel;
use dspec_engine::tiny_model::write_tiny_model;
use dspec_plugin_api::error::Result as ModelResult;
use dspec_plugin_api::{Draft, Drafter, DrafterOptions, TargetModel, TokenPicker};

mod common;
use common::lossless::{assert_lossless, exact_joint, greedy_path, params, FixedDrafter};
use common::{
    greedy, greedy_config, load_checkpoint_drafter, load_dir, load_draft_model, read_config,
    speculate, tiny_target,
};

/// The vocabulary of the tiny targets (bytes and three specials).
const VOCAB: u32 = 259;

/// The three MoE families' tiny targets and their layer counts: Qwen3-MoE with a dense
/// second layer (`mlp_only_layers`), the hybrids with experts on every layer.
fn targets() -> Vec<(&'static str, String, usize)> {
    let qwen3_moe = with(
        r#"{"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "head_dim": 16, "mlp_only_layers": [1]}"#,
        &tiny_experts(false),
    );
    let qwen3_next = with(
        &with(TINY_QWEN3_5_OVERRIDES, TINY_QWEN3_NEXT_OVERRIDES),
        &tiny_experts(true),
    );
    let qwen3_5_moe = with(
        &with(
            TINY_QWEN3_5_OVERRIDES,
            r#"{"model_type": "qwen3_5_moe_text", "architectures": ["Qwen3_5MoeForCausalLM"]}"#,
        ),
        &tiny_experts(true),
    );
    vec![
        ("qwen3_moe", qwen3_moe, 2),
        ("qwen3_next", qwen3_next, 3),
        ("qwen3_5_moe", qwen3_5_moe, 3),
    ]
}

/// Drafts the true greedy continuation (as [`FixedDrafter`] does) with one token
/// changed, at a position that moves from round to round, so that every acceptance
/// length occurs.
struct ShiftingOracle {
    truth: FixedDrafter,
    round: usize,
}

impl Drafter for ShiftingOracle {
    fn name(&self) -> &str {
        "shifting-oracle"
    }
    fn begin(&mut self, t: &dyn TargetModel, p: &[u32], h: Option<&Array>) -> ModelResult<()> {
        self.truth.begin(t, p, h)
    }
    fn propose(
        &mut self,
        target: &dyn TargetModel,
        last: u32,
        max_k: usize,
        picker: &mut dyn TokenPicker,
    ) -> ModelResult<Draft> {
        let mut draft = self.truth.propose(target, last, max_k, picker)?;
        self.round += 1;
        if let Some(t) = draft.tokens.get_mut(self.round % (max_k + 2)) {
            *t = (*t + 1) % VOCAB;
        }
        Ok(draft)
    }
    fn commit(&mut self, verified: &[u32], hidden: Option<&Array>) -> ModelResult<()> {
        self.truth.commit(verified, hidden)
    }
}

/// DFlash (block 8) and DSpark (block 4) checkpoints with random weights, reading every
/// layer of a target of `layers` layers.
fn checkpoint(kind: &str, layers: usize, seed: u64) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    let taps: Vec<usize> = (0..layers).collect();
    let written = match kind {
        "dflash" => dflash::write_random_checkpoint(
            dir.path(),
            &with(
                dflash::TINY_DFLASH,
                &format!(
                    r#"{{"num_target_layers": {layers}, "dflash_config": {{"target_layer_ids": {taps:?}, "mask_token_id": 256}}}}"#
                ),
            ),
            seed,
        ),
        _ => dspark::write_random_checkpoint(
            dir.path(),
            &with(
                dspark::TINY_DSPARK_QWEN3,
                &format!(r#"{{"num_target_layers": {layers}, "target_layer_ids": {taps:?}}}"#),
            ),
            seed,
        ),
    };
    written.unwrap_or_else(|e| panic!("{kind} checkpoint: {e}"));
    dir
}

fn prompt(loaded: &LoadedModel, text: &str) -> Vec<u32> {
    loaded.tokenizer.encode_prompt(text, false).expect("encode")
}

/// Every drafter on every MoE family: the oracle (rejections at each position of a block,
/// verifies of 6 positions routed together), n-gram lookup, a dense draft model, and
/// DFlash and DSpark reading the target's hidden states; each gives plain greedy's tokens.
#[test]
fn every_drafter_on_moe_targets_equals_plain_greedy() {
    let root = tempfile::tempdir().expect("temp dir");
    let small = root.path().join("small-llama");
    write_tiny_model(&small, r#"{"num_hidden_layers": 1}"#, 5).expect("draft model");
    for (family, overrides, layers) in targets() {
        let (_t, target) = tiny_target(&overrides, 31);
        assert!(target.model.info().model_type.starts_with(family));
        let ids = prompt(&target, "abc abc abc abc abc abc abc");
        let n = 40;
        let truth = greedy(&target, &ids, n);
        let config = greedy_config(n, vec![]);
        let mut drafters: Vec<(&str, Box<dyn Drafter>, usize)> = vec![
            (
                "oracle",
                Box::new(ShiftingOracle {
                    truth: FixedDrafter {
                        path: truth.clone(),
                        seen: 0,
                    },
                    round: 0,
                }),
                5,
            ),
            ("ngram", Box::new(NgramDrafter::new(3)), 6),
            (
                "draft model",
                load_draft_model(&target, &small, &DrafterOptions::default()),
                4,
            ),
        ];
        for kind in ["dflash", "dspark"] {
            let dir = checkpoint(kind, layers, 7);
            let drafter = load_checkpoint_drafter(
                kind,
                dir.path(),
                &read_config(dir.path()),
                target.model.as_ref(),
                &DrafterOptions::default(),
            )
            .unwrap_or_else(|e| panic!("{family} {kind}: {e}"));
            drafters.push((kind, drafter, 6));
            // The checkpoint is read at load; its directory may go.
            drop(dir);
        }
        for (name, mut drafter, max_draft) in drafters {
            // The oracle knows the true path from the start of `truth`.
            let out = speculate(&target, drafter.as_mut(), &ids, &config, max_draft, None);
            assert_eq!(out.tokens, truth, "{family}, {name}");
            assert!(
                out.speculative.drafted_tokens > 0,
                "{family}, {name}: no drafts"
            );
            if name == "oracle" {
                assert!(
                    out.speculative.accepted_tokens < out.speculative.drafted_tokens,
                    "{family}: the oracle's drafts are rejected too"
                );
            }
        }
    }
}

/// Sampled speculation on MoE targets keeps the target's distribution of the first three
/// tokens, with one-hot drafts and with a draft model (the target's own weights at 8 bits,
/// experts quantized on load: at 4 bits a tiny model's near-flat routing moves to other
/// experts and too few drafts are kept to test acceptance). See `common/lossless.rs`.
#[test]
fn sampled_speculation_on_moe_targets_keeps_the_distribution() {
    for (family, overrides, _) in targets().into_iter().step_by(2) {
        let root = tempfile::tempdir().expect("temp dir");
        let (t, twin) = (root.path().join("t"), root.path().join("twin"));
        write_tiny_model(&t, &overrides, 71).expect("target");
        write_tiny_model(&twin, &overrides, 71).expect("twin");
        let target = load_dir(&t);
        let ids = prompt(&target, "ab");
        let expected = exact_joint(target.model.as_ref(), &ids, &params(0));
        assert!(
            expected.len() >= 9,
            "{family}: top-3 sampling has a real choice"
        );
        let mut fixed = FixedDrafter {
            path: greedy_path(target.model.as_ref(), &ids, 4),
            seen: 0,
        };
        assert_lossless(
            &target,
            &mut fixed,
            &ids,
            &expected,
            1,
            &format!("{family}, one-hot"),
        );
        let eight_bits = DrafterOptions {
            bits: Some(8),
            ..DrafterOptions::default()
        };
        let mut twin = load_draft_model(&target, &twin, &eight_bits);
        assert_lossless(
            &target,
            twin.as_mut(),
            &ids,
            &expected,
            2,
            &format!("{family}, draft model"),
        );
    }
}
