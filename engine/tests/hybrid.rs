//! Speculative decoding on hybrid targets (Gated DeltaNet layers among attention
//! layers, tiny Qwen3.5 and Qwen3-Next) with every drafter: greedy speculation gives
//! plain greedy decoding's tokens when drafts are rejected at every position of a block,
//! so the target's recurrent state is rolled back into the middle of its verify
//! forwards; DFlash and DSpark read the target's hidden states at Gated DeltaNet and
//! attention layers alike; drafts never exceed what the target's cache can roll back;
//! and sampled speculation keeps the target's distribution.

use std::collections::HashMap;

use mlx_rs::Array;

use dspec_adapters::fixtures::{with, TINY_QWEN3_5_OVERRIDES, TINY_QWEN3_NEXT_OVERRIDES};
use dspec_drafters::ngram::NgramDrafter;
use dspec_drafters::{dflash, dspark};
use dspec_engine::decoding::generate::logits_to_host;
use dspec_engine::decoding::sampling::{argmax, probabilities};
use dspec_engine::decoding::speculative::SpeculativeOutput;
use dspec_engine::loading::drafting::load_drafter;
use dspec_engine::loading::{builtin_registry, LoadedModel};
use dspec_engine::tiny_model::write_tiny_model;
use dspec_plugin_api::error::Result as ModelResult;
use dspec_plugin_api::{
    Draft, DraftAhead, Drafter, DrafterOptions, ExternalCache, ForwardOutput, LoadOptions,
    ModelCache, ModelError, ModelInfo, TargetModel, TokenPicker,
};

mod common;
use common::lossless::{
    assert_lossless, exact_joint, greedy_path, next_distribution, params, FixedDrafter,
};
use common::{
    greedy, greedy_config, load_checkpoint_drafter, load_dir, max_abs_diff, read_config, speculate,
    tiny_target, Argmax,
};

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
            ..Draft::default()
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

/// Qwen3-Next's tiny target: the Qwen3.5 one with its projections grouped per key head.
fn qwen3_next() -> String {
    with(TINY_QWEN3_5_OVERRIDES, TINY_QWEN3_NEXT_OVERRIDES)
}

/// Tap layers of the checkpoint drafters below: the tiny targets' three layers, Gated
/// DeltaNet (0, 2) and attention (1).
const TAPS: &str = "[0, 1, 2]";

/// A DFlash checkpoint for the tiny hybrid targets (block of 8: 7 drafts a pass).
fn dflash_config() -> String {
    with(
        dflash::TINY_DFLASH,
        &format!(
            r#"{{"num_target_layers": 3, "dflash_config": {{"target_layer_ids": {TAPS}, "mask_token_id": 256}}}}"#
        ),
    )
}

/// A qwen3-family DSpark checkpoint for the tiny hybrid targets (block of 4).
fn dspark_config() -> String {
    with(
        dspark::TINY_DSPARK_QWEN3,
        &format!(r#"{{"num_target_layers": 3, "target_layer_ids": {TAPS}}}"#),
    )
}

/// A checkpoint drafter of `kind` with random weights, written to a temp dir.
fn write_checkpoint(kind: &str, seed: u64) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    match kind {
        "dflash" => dflash::write_random_checkpoint(dir.path(), &dflash_config(), seed),
        _ => dspark::write_random_checkpoint(dir.path(), &dspark_config(), seed),
    }
    .unwrap_or_else(|e| panic!("{kind} checkpoint: {e}"));
    dir
}

/// Loads the checkpoint in `dir` through the drafter registry, as the engine does.
fn load_checkpoint(kind: &str, dir: &std::path::Path, target: &LoadedModel) -> Box<dyn Drafter> {
    load_checkpoint_drafter(
        kind,
        dir,
        &read_config(dir),
        target.model.as_ref(),
        &DrafterOptions::default(),
    )
    .unwrap_or_else(|e| panic!("{kind}: {e}"))
}

/// DFlash drafts from the target's hidden states at Gated DeltaNet and attention layers,
/// through the target's embedding and head, on both hybrid families; draft lengths
/// within its block and past it (it drafts 7 at most), generations ending inside a
/// block, at its edge and after many rounds.
#[test]
fn dflash_on_hybrid_targets_equals_plain_greedy_across_prompts_and_lengths() {
    for (family, overrides, seed) in [
        ("qwen3_5", TINY_QWEN3_5_OVERRIDES.to_string(), 41),
        ("qwen3_next", qwen3_next(), 42),
    ] {
        let (_t, loaded) = tiny_target(&overrides, seed);
        let dir = write_checkpoint("dflash", seed + 100);
        // One drafter for every run: `begin` must reset what the last run left.
        let mut drafter = load_checkpoint("dflash", dir.path(), &loaded);
        for text in ["hello", "1 2 3 4 5 6 7 8 9 10 11 12"] {
            let ids = prompt(&loaded, text);
            let truth = greedy(&loaded, &ids, 40);
            for (n, max_draft) in [(2, 7), (9, 3), (17, 7), (40, 12)] {
                let what = format!("{family} {text:?} max_tokens {n} max_draft {max_draft}");
                let out = speculate(
                    &loaded,
                    drafter.as_mut(),
                    &ids,
                    &greedy_config(n, vec![]),
                    max_draft,
                    None,
                );
                assert_eq!(out.tokens, truth[..n], "{what}");
                assert_eq!(out.speculative.drafter, "dflash");
                if n > 2 {
                    assert!(out.speculative.drafted_tokens > 0, "{what}: no drafts");
                }
            }
        }
    }
}

/// A checkpoint drafter doing all its real work (its context from the target's taps,
/// its block pass, its commits) whose drafts are then steered: the first `keep` become
/// the true continuation and the next one a token that differs from it, with `keep`
/// moving from round to round. Every acceptance length occurs, so the target rolls back
/// into every position of its verify blocks and the drafter's context grows by every
/// length. Greedy only: a steered token is not a draw from the drafter's q.
struct Steered {
    inner: Box<dyn Drafter>,
    truth: Vec<u32>,
    /// Every token committed to the drafter, in order.
    committed: Vec<u32>,
    round: usize,
}

impl Drafter for Steered {
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
        self.committed.clear();
        self.round = 0;
        self.inner.begin(target, prompt, hidden)
    }
    fn propose(
        &mut self,
        target: &dyn TargetModel,
        last: u32,
        max_k: usize,
        picker: &mut dyn TokenPicker,
    ) -> ModelResult<Draft> {
        let seen = self.committed.len();
        assert_eq!(Some(&last), self.truth.get(seen));
        let mut draft = self.inner.propose(target, last, max_k, picker)?;
        draft.read()?;
        self.round += 1;
        let keep = self.round % (draft.tokens.len() + 1);
        let truth = self.truth.iter().skip(seen + 1);
        for (i, (token, &true_token)) in draft.tokens.iter_mut().zip(truth).enumerate() {
            if i < keep {
                *token = true_token;
            } else if i == keep && *token == true_token {
                *token = (true_token + 1) % VOCAB;
            }
        }
        Ok(draft)
    }
    fn commit(&mut self, verified: &[u32], hidden: Option<&Array>) -> ModelResult<()> {
        self.committed.extend_from_slice(verified);
        self.inner.commit(verified, hidden)
    }
}

/// `drafter`'s drafts after `last`, as the logits it picked them from, against those of
/// a drafter of the same checkpoint begun afresh on `history` (one target forward over
/// all of it).
fn assert_drafts_like_a_fresh_start(
    loaded: &LoadedModel,
    drafter: &mut dyn Drafter,
    fresh: &mut dyn Drafter,
    history: &[u32],
    what: &str,
) {
    let target = loaded.model.as_ref();
    let whole = target
        .forward(
            &Array::from_slice(history, &[1, history.len() as i32]),
            &mut target.new_cache(),
            fresh.taps(),
        )
        .expect("a forward over the whole history");
    fresh
        .begin(target, history, whole.hidden.as_ref())
        .expect("begin");
    let (mut grown, mut anew) = (Argmax::default(), Argmax::default());
    let drafted = drafter.propose(target, 65, 3, &mut grown).expect("propose");
    let redrafted = fresh.propose(target, 65, 3, &mut anew).expect("propose");
    assert_eq!(drafted.tokens, redrafted.tokens, "{what}");
    assert_eq!(grown.logits.len(), anew.logits.len(), "{what}");
    for (a, b) in grown.logits.iter().zip(&anew.logits) {
        let diff = max_abs_diff(a, b);
        assert!(diff < 1e-3, "{what}: the logits differ by {diff}");
    }
}

/// DFlash and DSpark on both hybrid families, with rejections at every position of
/// their blocks: the output is plain greedy decoding's, and afterwards each drafter's
/// context (the hidden states the engine handed over from verify forwards rolled back
/// inside their blocks) drafts what a drafter begun afresh on the same tokens drafts.
#[test]
fn checkpoint_drafters_on_hybrid_targets_are_exact_with_rejections_inside_blocks() {
    for (family, overrides, seed) in [
        ("qwen3_5", TINY_QWEN3_5_OVERRIDES.to_string(), 51),
        ("qwen3_next", qwen3_next(), 52),
    ] {
        let (_t, loaded) = tiny_target(&overrides, seed);
        let ids = prompt(&loaded, "speculate on this");
        let truth = greedy(&loaded, &ids, 60);
        for (kind, max_draft) in [("dflash", 7), ("dspark", 4)] {
            let what = format!("{kind} on {family}");
            let dir = write_checkpoint(kind, seed);
            let mut steered = Steered {
                inner: load_checkpoint(kind, dir.path(), &loaded),
                truth: truth.clone(),
                committed: Vec::new(),
                round: 0,
            };
            let out = speculate(
                &loaded,
                &mut steered,
                &ids,
                &greedy_config(45, vec![]),
                max_draft,
                None,
            );
            assert_greedy(&out, &truth[..45], &what);
            let histogram = &out.speculative.acceptance_histogram;
            assert!(
                histogram.iter().all(|&rounds| rounds > 0),
                "{what}: rejections at every position of a block: {histogram:?}"
            );
            let history = [ids.as_slice(), &steered.committed].concat();
            let mut fresh = load_checkpoint(kind, dir.path(), &loaded);
            assert_drafts_like_a_fresh_start(
                &loaded,
                steered.inner.as_mut(),
                fresh.as_mut(),
                &history,
                &what,
            );
        }
    }
}

/// A target whose cache keeps at most `cap` past states whatever it is asked, as a
/// model with a fixed rollback window has: the tiny hybrid target behind an external
/// cache that bounds the window it passes on.
struct FixedWindow {
    inner: Box<dyn TargetModel>,
    cap: usize,
}

struct FixedWindowCache {
    inner: ModelCache,
    cap: usize,
    state: Vec<Array>,
}

impl ExternalCache for FixedWindowCache {
    fn offset(&self) -> usize {
        self.inner.offset()
    }
    fn rollback_limit(&self) -> usize {
        self.inner.rollback_limit()
    }
    fn rollback_window(&self) -> Option<usize> {
        self.inner.rollback_window()
    }
    fn set_rollback_window(&mut self, positions: usize) {
        self.inner.set_rollback_window(positions.min(self.cap));
    }
    fn trim(&mut self, n: usize) -> ModelResult<()> {
        self.inner.trim(n)
    }
    fn state(&self) -> &[Array] {
        &self.state
    }
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

impl TargetModel for FixedWindow {
    fn info(&self) -> &ModelInfo {
        self.inner.info()
    }
    fn new_cache(&self) -> ModelCache {
        let mut inner = self.inner.new_cache();
        inner.set_rollback_window(self.cap);
        ModelCache::external(Box::new(FixedWindowCache {
            inner,
            cap: self.cap,
            state: Vec::new(),
        }))
    }
    fn forward(
        &self,
        tokens: &Array,
        cache: &mut ModelCache,
        taps: &[usize],
    ) -> ModelResult<ForwardOutput> {
        let cache = cache
            .external_mut()
            .and_then(|c| c.as_any_mut().downcast_mut::<FixedWindowCache>())
            .ok_or_else(|| ModelError::Unsupported("not a FixedWindow cache".into()))?;
        let out = self.inner.forward(tokens, &mut cache.inner, taps)?;
        cache.state = cache.inner.state().cloned().collect();
        Ok(out)
    }
    fn embed(&self, tokens: &Array) -> ModelResult<Array> {
        self.inner.embed(tokens)
    }
    fn lm_head(&self, hidden: &Array) -> ModelResult<Array> {
        self.inner.lm_head(hidden)
    }
    fn final_norm(&self, hidden: &Array) -> ModelResult<Array> {
        self.inner.final_norm(hidden)
    }
}

/// Drafts the true continuation with its first token wrong, and more of them than it
/// is asked for: every round rejects all it was allowed to draft.
struct Overdrafter {
    truth: Vec<u32>,
    seen: usize,
}

impl Drafter for Overdrafter {
    fn name(&self) -> &str {
        "overdrafter"
    }
    fn begin(&mut self, _: &dyn TargetModel, _: &[u32], _: Option<&Array>) -> ModelResult<()> {
        self.seen = 0;
        Ok(())
    }
    fn propose(
        &mut self,
        _: &dyn TargetModel,
        _last: u32,
        max_k: usize,
        _: &mut dyn TokenPicker,
    ) -> ModelResult<Draft> {
        let mut tokens: Vec<u32> = self
            .truth
            .iter()
            .skip(self.seen + 1)
            .take(max_k + 4)
            .copied()
            .collect();
        if let Some(first) = tokens.first_mut() {
            *first = (*first + 1) % VOCAB;
        }
        Ok(Draft {
            tokens,
            ..Draft::default()
        })
    }
    fn commit(&mut self, verified: &[u32], _: Option<&Array>) -> ModelResult<()> {
        self.seen += verified.len();
        Ok(())
    }
}

/// A target that can roll back 3 positions, whatever it is asked to keep, with drafters
/// that draft more (DFlash's block of 8 drafts 7; one drafter ignores how many it is
/// asked for) and `--max-draft 7`: the engine drafts 3 a round at most, so a round that
/// rejects every draft rolls back 3 and generation never fails. Past those 3 a rollback
/// is an error.
#[test]
fn drafts_are_capped_to_a_fixed_rollback_window_so_no_rollback_fails() {
    let (_t, loaded) = tiny_target(TINY_QWEN3_5_OVERRIDES, 61);
    let ids = prompt(&loaded, "a window of three");
    let truth = greedy(&loaded, &ids, 40);
    let dflash_dir = write_checkpoint("dflash", 62);
    let LoadedModel {
        model,
        tokenizer,
        dir,
        adapter,
        reason,
    } = loaded;
    let capped = LoadedModel {
        model: Box::new(FixedWindow {
            inner: model,
            cap: 3,
        }),
        tokenizer,
        dir,
        adapter,
        reason,
    };

    let mut cache = capped.model.new_cache();
    cache.set_rollback_window(7);
    assert_eq!(cache.rollback_window(), Some(3));
    capped
        .model
        .forward(
            &Array::from_slice(&ids, &[1, ids.len() as i32]),
            &mut cache,
            &[],
        )
        .expect("forward");
    let err = cache.trim(4).expect_err("past the window");
    assert!(
        matches!(
            err,
            ModelError::CannotRollBack {
                asked: 4,
                limit: 3,
                ..
            }
        ),
        "{err}"
    );

    let mut dflash = load_checkpoint("dflash", dflash_dir.path(), &capped);
    let mut overdrafter = Overdrafter {
        truth: truth.clone(),
        seen: 0,
    };
    for drafter in [dflash.as_mut(), &mut overdrafter as &mut dyn Drafter] {
        let name = drafter.name().to_string();
        let out = speculate(&capped, drafter, &ids, &greedy_config(40, vec![]), 7, None);
        assert_greedy(&out, &truth, &name);
        let s = &out.speculative;
        assert_eq!(
            s.draft_histogram.len(),
            4,
            "{name}: drafts a round capped at the window of 3: {:?}",
            s.draft_histogram
        );
        assert!(
            s.draft_histogram[3] > 0 && s.acceptance_histogram[0] > 0,
            "{name}: rounds of 3 drafts, some rejecting all: {s:?}"
        );
    }
}

/// The tiny Qwen3.5 target of the sampled tests, its twin's directory, the prompt and
/// the exact distribution of the first three tokens after it.
struct SampledCase {
    _root: tempfile::TempDir,
    twin: std::path::PathBuf,
    target: LoadedModel,
    ids: Vec<u32>,
    expected: HashMap<[u32; 3], f64>,
}

fn sampled_case() -> SampledCase {
    let root = tempfile::tempdir().expect("temp dir");
    let (t, twin) = (root.path().join("t"), root.path().join("d"));
    write_tiny_model(&t, TINY_QWEN3_5_OVERRIDES, 71).expect("target");
    write_tiny_model(&twin, TINY_QWEN3_5_OVERRIDES, 71).expect("twin");
    let target = load_dir(&t);
    let ids = prompt(&target, "ab");
    let expected = exact_joint(target.model.as_ref(), &ids, &params(0));
    assert!(expected.len() >= 9, "top-3 sampling has a real choice");
    SampledCase {
        _root: root,
        twin,
        target,
        ids,
        expected,
    }
}

/// Sampled speculation on a hybrid target keeps the target's distribution with one-hot
/// drafts (n-gram's q) and a draft model (the target's own weights at 4 bits: q near p,
/// sampling from it); drafts are kept and rejected, so the recurrent state is rolled
/// back after sampled rounds. See `common/lossless.rs` for the check.
#[test]
fn sampled_speculation_on_a_hybrid_target_keeps_its_distribution_with_drafts_and_draft_models() {
    let SampledCase {
        _root: _keep,
        twin,
        target,
        ids,
        expected,
    } = sampled_case();
    let mut fixed = FixedDrafter {
        path: greedy_path(target.model.as_ref(), &ids, 4),
        seen: 0,
    };
    assert_lossless(&target, &mut fixed, &ids, &expected, 1, "one-hot drafts");

    let mut twin = load_drafter(
        &format!("model:{}", twin.display()),
        &target,
        &builtin_registry().expect("registry"),
        &LoadOptions::default(),
        &DrafterOptions {
            bits: Some(4),
            ..DrafterOptions::default()
        },
    )
    .expect("draft model");
    assert_lossless(&target, twin.as_mut(), &ids, &expected, 2, "draft model");
}

/// The same with DFlash and DSpark, each sampling its drafts from its own q.
#[test]
fn sampled_speculation_on_a_hybrid_target_keeps_its_distribution_with_dflash_and_dspark() {
    let SampledCase {
        target,
        ids,
        expected,
        ..
    } = sampled_case();
    // Random checkpoints' top 3 never meet the target's: DFlash drafts one distribution
    // whose top 3 does (the best mask token for a repeating drafter), DSpark's Markov
    // head is taught the target's likeliest second token after each first one.
    let target_model = target.model.as_ref();
    let dflash_dir = write_checkpoint("dflash", 72);
    let mask = best_repeating_mask(target_model, &ids);
    std::fs::write(
        dflash_dir.path().join("config.json"),
        with(
            &read_config(dflash_dir.path()).to_string(),
            &format!(
                r#"{{"dflash_config": {{"target_layer_ids": {TAPS}, "mask_token_id": {mask}}}}}"#
            ),
        ),
    )
    .expect("write config.json");
    common::make_dflash_repeat(dflash_dir.path());
    let dspark_dir = write_checkpoint("dspark", 72);
    let first = next_distribution(target_model, &ids, &params(0));
    let pairs: Vec<(u32, u32)> = (0..first.len() as u32)
        .filter(|&t| first[t as usize] > 0.0)
        .map(|t| {
            let after = [ids.as_slice(), &[t]].concat();
            (
                t,
                argmax(&next_distribution(target_model, &after, &params(0))),
            )
        })
        .collect();
    common::teach_markov_head(dspark_dir.path(), &pairs);
    for (kind, dir, seed) in [("dflash", &dflash_dir, 3), ("dspark", &dspark_dir, 4)] {
        let mut drafter = load_checkpoint(kind, dir.path(), &target);
        assert_lossless(&target, drafter.as_mut(), &ids, &expected, seed, kind);
    }
}

/// The mask token for which a repeating DFlash drafter (see `make_dflash_repeat`: every
/// draft comes from `lm_head(rms_norm(embed(mask)))`) most likely has its first draft
/// kept after `prompt` and a first token drawn from `params(0)`:
/// Σ_t1 p(t1) Σ_x min(p(x | t1), q(x)).
fn best_repeating_mask(target: &dyn TargetModel, prompt: &[u32]) -> u32 {
    let vocab = target.info().vocab_size;
    let all: Vec<u32> = (0..vocab as u32).collect();
    let embedded = target
        .embed(&Array::from_slice(&all, &[1, vocab as i32]))
        .expect("embed");
    let normed = mlx_rs::fast::rms_norm(&embedded, None, 1e-6).expect("norm");
    let rows = logits_to_host(&target.lm_head(&normed).expect("lm_head")).expect("logits");
    let first = next_distribution(target, prompt, &params(0));
    let seconds: Vec<(f32, Vec<f32>)> = (0..vocab as u32)
        .filter(|&t| first[t as usize] > 0.0)
        .map(|t| {
            let after = [prompt, &[t]].concat();
            (
                first[t as usize],
                next_distribution(target, &after, &params(0)),
            )
        })
        .collect();
    let kept = |mask: usize| -> f32 {
        let q = probabilities(&rows[mask * vocab..(mask + 1) * vocab], &params(0));
        seconds
            .iter()
            .map(|(p1, p2)| p1 * p2.iter().zip(&q).map(|(p, q)| p.min(*q)).sum::<f32>())
            .sum()
    };
    let best = (0..vocab)
        .max_by(|&a, &b| kept(a).total_cmp(&kept(b)))
        .unwrap_or(0);
    assert!(kept(best) > 0.0, "no mask token's drafts can be kept");
    best as u32
}
