//! The prompt cache across requests: a chat's next turn reads only what is new, and
//! decodes exactly what it decodes without the cache, with drafters that keep nothing
//! (n-gram), that keep a cache of their own (a draft model) and that read the target's
//! hidden states (handed over from the cache); on attention and hybrid targets.

use mlx_rs::Array;

use dspec_adapters::fixtures::TINY_QWEN3_5_OVERRIDES;
use dspec_drafters::ngram::NgramDrafter;
use dspec_engine::decoding::prompt_cache::PromptCache;
use dspec_engine::decoding::speculative::VerifyAheadMode;
use dspec_engine::decoding::speculative::{
    generate_speculative, ServingOptions, Speculation, SpeculativeOutput,
};
use dspec_engine::loading::LoadedModel;
use dspec_engine::tiny_model::write_tiny_model;
use dspec_plugin_api::error::Result as ModelResult;
use dspec_plugin_api::{Draft, DraftAhead, Drafter, DrafterOptions, TargetModel, TokenPicker};

mod common;
use common::{greedy, greedy_config, tiny_target};

const BUDGET: usize = 64 << 20;

/// One request: speculative greedy decoding of `n` tokens after `prompt`, through `store`.
fn request(
    loaded: &LoadedModel,
    drafter: &mut dyn Drafter,
    store: Option<&mut PromptCache>,
    prompt: &[u32],
    n: usize,
) -> SpeculativeOutput {
    generate_speculative(
        loaded.model.as_ref(),
        &loaded.tokenizer,
        prompt,
        &greedy_config(n, vec![]),
        Speculation {
            drafter,
            max_draft: 4,
            adaptive: false,
            trace: None,
            verify_ahead: VerifyAheadMode::Always,
        },
        &mut |_| {},
        ServingOptions {
            prompt_cache: store,
            ..ServingOptions::default()
        },
    )
    .expect("speculative generation")
}

fn ids(loaded: &LoadedModel, text: &str) -> Vec<u32> {
    loaded.tokenizer.encode_prompt(text, false).expect("encode")
}

/// Three turns: the first reads everything; the second extends the first turn's prompt
/// and answer, and reads only its new message; the third shares only the first turn's
/// opening. Each turn's tokens are plain greedy decoding's.
fn chat_turns(loaded: &LoadedModel, drafter: &mut dyn Drafter, what: &str) {
    let mut store = PromptCache::new(BUDGET);
    let first = ids(loaded, "user: tell me about the cache. assistant:");
    let out = request(loaded, drafter, Some(&mut store), &first, 24);
    assert_eq!(out.tokens, greedy(loaded, &first, 24), "{what}: turn 1");
    assert_eq!(
        out.stats.cached_prompt_tokens, 0,
        "{what}: nothing cached yet"
    );

    let mut second = first.clone();
    second.extend_from_slice(&out.tokens);
    second.extend(ids(loaded, " user: and then? assistant:"));
    let out = request(loaded, drafter, Some(&mut store), &second, 24);
    assert_eq!(out.tokens, greedy(loaded, &second, 24), "{what}: turn 2");
    // The first turn's cache holds its prompt and every answer token fed back, which is
    // all but the newest (or all, when a plain step fed it already).
    let held = first.len() + 24;
    let cached = out.stats.cached_prompt_tokens;
    assert!(
        (held - 1..=held).contains(&cached),
        "{what}: turn 2 read {cached} of {held} tokens from the cache"
    );

    let mut third = first[..first.len() - 3].to_vec();
    third.extend(ids(loaded, " something else entirely"));
    let out = request(loaded, drafter, Some(&mut store), &third, 16);
    assert_eq!(out.tokens, greedy(loaded, &third, 16), "{what}: turn 3");
    if loaded.model.new_cache().rollback_window().is_none() {
        assert_eq!(
            out.stats.cached_prompt_tokens,
            first.len() - 3,
            "{what}: an attention cache goes back to the shared opening"
        );
    } else {
        assert_eq!(
            out.stats.cached_prompt_tokens, 0,
            "{what}: recurrent state cannot go back to the shared opening"
        );
    }
}

fn draft_model(target: &LoadedModel, dir: &std::path::Path) -> Box<dyn Drafter> {
    common::load_draft_model(
        target,
        dir,
        &DrafterOptions {
            draft_ahead: Some(DraftAhead::On),
            ..DrafterOptions::default()
        },
    )
}

#[test]
fn a_chats_next_turn_reads_only_what_is_new_on_an_attention_target() {
    let root = tempfile::tempdir().expect("temp dir");
    let small = root.path().join("small");
    write_tiny_model(&small, r#"{"num_hidden_layers": 1}"#, 5).expect("draft model");
    let (_dir, target) = tiny_target("{}", 7);
    chat_turns(&target, &mut NgramDrafter::new(3), "ngram");
    chat_turns(
        &target,
        draft_model(&target, &small).as_mut(),
        "draft model",
    );
}

/// A turn that ends on an EOS among accepted drafts has fed the drafts after it: its
/// cache is cut back to the sequence and kept for the next turn.
#[test]
fn a_turn_ending_inside_an_accepted_block_is_cached_without_the_drafts_after_it() {
    let root = tempfile::tempdir().expect("temp dir");
    let twin = root.path().join("twin");
    write_tiny_model(&twin, "{}", 7).expect("twin");
    let (_dir, target) = tiny_target("{}", 7);
    let first = ids(&target, "user: a turn that ends early. assistant:");
    let truth = greedy(&target, &first, 24);
    // Rounds of the twin commit 4 drafts and the target's token: positions 1–5, 6–10…
    // An EOS at a new token inside a round ends it with drafts fed past it.
    let end = (2..24)
        .find(|&i| i % 5 != 0 && !truth[..i].contains(&truth[i]))
        .expect("a token seen first inside a round");
    let mut store = PromptCache::new(BUDGET);
    let out = generate_speculative(
        target.model.as_ref(),
        &target.tokenizer,
        &first,
        &greedy_config(24, vec![truth[end]]),
        Speculation {
            drafter: draft_model(&target, &twin).as_mut(),
            max_draft: 4,
            adaptive: false,
            trace: None,
            verify_ahead: VerifyAheadMode::Always,
        },
        &mut |_| {},
        ServingOptions {
            prompt_cache: Some(&mut store),
            ..ServingOptions::default()
        },
    )
    .expect("generation");
    assert_eq!(out.tokens, truth[..=end], "stopped on the EOS");
    assert_eq!(store.usage().entries, 1, "kept");

    let mut second = first.clone();
    second.extend_from_slice(&out.tokens);
    second.extend(ids(&target, " user: more"));
    let out = request(
        &target,
        &mut NgramDrafter::new(3),
        Some(&mut store),
        &second,
        8,
    );
    assert_eq!(out.tokens, greedy(&target, &second, 8));
    assert!(out.stats.cached_prompt_tokens >= first.len() + end);
}

#[test]
fn a_chats_next_turn_reads_only_what_is_new_on_a_hybrid_target() {
    let root = tempfile::tempdir().expect("temp dir");
    let small = root.path().join("small");
    write_tiny_model(&small, r#"{"num_hidden_layers": 1}"#, 5).expect("draft model");
    let (_dir, target) = tiny_target(TINY_QWEN3_5_OVERRIDES, 3);
    chat_turns(&target, &mut NgramDrafter::new(3), "ngram, hybrid");
    chat_turns(
        &target,
        draft_model(&target, &small).as_mut(),
        "draft model, hybrid",
    );
}

/// Drafts nothing, and keeps the hidden states `begin` hands it.
#[derive(Default)]
struct HiddenRecorder {
    begun: Vec<Array>,
}

impl Drafter for HiddenRecorder {
    fn name(&self) -> &str {
        "hidden-recorder"
    }
    fn taps(&self) -> &[usize] {
        &[0, 1]
    }
    fn begin(
        &mut self,
        _: &dyn TargetModel,
        prompt: &[u32],
        hidden: Option<&Array>,
    ) -> ModelResult<()> {
        let hidden = hidden.expect("taps were declared").clone();
        assert_eq!(
            hidden.shape()[1] as usize,
            prompt.len(),
            "a state per prompt position"
        );
        self.begun.push(hidden);
        Ok(())
    }
    fn propose(
        &mut self,
        _: &dyn TargetModel,
        _: u32,
        _: usize,
        _: &mut dyn TokenPicker,
    ) -> ModelResult<Draft> {
        Ok(Draft::default())
    }
    fn commit(&mut self, _: &[u32], _: Option<&Array>) -> ModelResult<()> {
        Ok(())
    }
}

/// A drafter that reads the target's hidden states (DFlash, DSpark) gets, on a cached
/// turn, the states of the whole prompt: the cached ones and the ones just read, equal to
/// those of a prefill from scratch.
#[test]
fn a_tapping_drafter_gets_the_whole_prompts_states_on_a_cached_turn() {
    let (_dir, target) = tiny_target("{}", 9);
    let mut store = PromptCache::new(BUDGET);
    let first = ids(&target, "the first turn of a conversation");
    let mut recorder = HiddenRecorder::default();
    let out = request(&target, &mut recorder, Some(&mut store), &first, 12);
    let mut second = first.clone();
    second.extend_from_slice(&out.tokens);
    second.extend(ids(&target, " and its second turn"));
    let out = request(&target, &mut recorder, Some(&mut store), &second, 4);
    assert!(out.stats.cached_prompt_tokens >= first.len() + 11);

    let mut fresh = HiddenRecorder::default();
    request(&target, &mut fresh, None, &second, 4);
    let (cached, read) = (&recorder.begun[1], &fresh.begun[0]);
    assert_eq!(cached.shape(), read.shape());
    assert!(
        cached.all_close(read, 1e-4, 1e-4, None).expect("compare"),
        "the states handed over from the cache are a fresh prefill's"
    );
}

/// With no budget nothing is kept, and every turn reads its whole prompt.
#[test]
fn a_zero_budget_keeps_nothing() {
    let (_dir, target) = tiny_target("{}", 7);
    let mut store = PromptCache::new(0);
    let first = ids(&target, "user: hello assistant:");
    let out = request(
        &target,
        &mut NgramDrafter::new(3),
        Some(&mut store),
        &first,
        8,
    );
    let mut second = first.clone();
    second.extend_from_slice(&out.tokens);
    let out = request(
        &target,
        &mut NgramDrafter::new(3),
        Some(&mut store),
        &second,
        8,
    );
    assert_eq!(out.stats.cached_prompt_tokens, 0);
    assert_eq!(store.usage().entries, 0);
}
