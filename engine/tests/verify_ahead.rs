//! Rounds queued ahead (`--verify-ahead`): a round fed the still lazy last token of the
//! round before it, on the guess that that round keeps every draft. Whether the guess
//! holds, fails, or leaves the queued drafts stale, the output must be plain greedy
//! decoding's, token for token, and stop where plain decoding stops.

use mlx_rs::Array;

use dspec_drafters::ngram::NgramDrafter;
use dspec_drafters::replay::ReplayDrafter;
use dspec_engine::decoding::generate::{generate, GenerationConfig, StopReason};
use dspec_engine::decoding::sampling::SamplingParams;
use dspec_engine::decoding::speculative::SpeculativeOutput;
use dspec_engine::decoding::speculative::VerifyAheadMode;
use dspec_engine::loading::LoadedModel;
use dspec_plugin_api::error::Result as ModelResult;
use dspec_plugin_api::{Draft, Drafter, TargetModel, TokenPicker};

mod common;
use common::{greedy, greedy_config, speculate_queueing, tiny_target as load};

/// Drafts as a lookup does: its answer depends only on what was committed and where the
/// proposal starts, and asking again changes nothing. It knows the true greedy
/// continuation and spoils it in ways that depend on the proposal's start as well as on
/// each token's position, so a proposal made before a round's last token was known and
/// one made after it sometimes disagree (stale drafts), and it sometimes runs out early
/// or has nothing (rounds of no drafts). It checks that it is told exactly the tokens
/// committed, with the target's states at them.
struct LookupOracle {
    truth: Vec<u32>,
    /// Tokens committed so far (prompt excluded).
    seen: usize,
    commits: usize,
}

impl LookupOracle {
    fn new(truth: &[u32]) -> Self {
        LookupOracle {
            truth: truth.to_vec(),
            seen: 0,
            commits: 0,
        }
    }
}

impl Drafter for LookupOracle {
    fn name(&self) -> &str {
        "lookup-oracle"
    }
    fn taps(&self) -> &[usize] {
        &[0, 1]
    }
    fn begin(&mut self, _: &dyn TargetModel, _: &[u32], hidden: Option<&Array>) -> ModelResult<()> {
        assert!(hidden.is_some(), "taps were declared");
        Ok(())
    }
    fn propose(
        &mut self,
        _target: &dyn TargetModel,
        last: u32,
        max_k: usize,
        _picker: &mut dyn TokenPicker,
    ) -> ModelResult<Draft> {
        let start = self.seen;
        assert_eq!(
            Some(&last),
            self.truth.get(start),
            "last is the next true token"
        );
        let mut tokens = Vec::new();
        if start % 6 != 2 {
            for j in start + 1..(start + 1 + max_k).min(self.truth.len()) {
                if j > start + 1 && (j + 2 * start).is_multiple_of(13) {
                    break;
                }
                let t = self.truth[j];
                tokens.push(if (j + start).is_multiple_of(7) {
                    (t + 1) % 259
                } else {
                    t
                });
            }
        }
        Ok(Draft {
            tokens,
            ..Draft::default()
        })
    }
    fn commit(&mut self, verified: &[u32], hidden: Option<&Array>) -> ModelResult<()> {
        assert_eq!(verified, &self.truth[self.seen..self.seen + verified.len()]);
        let h = hidden.expect("hidden states of the verified positions");
        assert_eq!(h.shape()[1] as usize, verified.len());
        self.seen += verified.len();
        self.commits += 1;
        Ok(())
    }
    fn drafts_by_lookup(&self) -> bool {
        true
    }
}

/// Generates with `drafter`, traced; returns the output and the trace's rounds.
fn run(
    loaded: &LoadedModel,
    prompt: &[u32],
    drafter: &mut dyn Drafter,
    max_draft: usize,
    config: &GenerationConfig,
    mode: VerifyAheadMode,
) -> (SpeculativeOutput, Vec<serde_json::Value>) {
    let mut trace = Vec::new();
    let out = speculate_queueing(
        loaded,
        drafter,
        prompt,
        config,
        max_draft,
        Some(&mut trace),
        mode,
    );
    let rounds = String::from_utf8(trace)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (out, rounds)
}

fn queued_ahead(round: &serde_json::Value) -> bool {
    round["queued_ahead"].as_bool().unwrap()
}

fn drafted(round: &serde_json::Value) -> usize {
    round["drafted"].as_array().unwrap().len()
}

#[test]
fn rounds_queued_ahead_give_plain_greedy_output_whatever_becomes_of_the_guess() {
    for overrides in [
        "{}",
        r#"{"model_type": "qwen3", "head_dim": 16}"#,
        r#"{"model_type": "gemma2", "head_dim": 16, "sliding_window": 6, "attn_logit_softcapping": 50.0}"#,
    ] {
        let (_dir, loaded) = load(overrides, 31);
        let prompt = loaded
            .tokenizer
            .encode_prompt("queue it ahead", false)
            .unwrap();
        let truth = greedy(&loaded, &prompt, 70);
        for max_draft in [1, 2, 5] {
            let what = format!("{overrides}, --max-draft {max_draft}");
            let mut drafter = LookupOracle::new(&truth);
            let (out, rounds) = run(
                &loaded,
                &prompt,
                &mut drafter,
                max_draft,
                &greedy_config(60, vec![]),
                VerifyAheadMode::Always,
            );
            assert_eq!(out.tokens, truth[..60].to_vec(), "{what}");
            assert_eq!(drafter.commits, rounds.len(), "{what}: one commit a round");
            let ahead = rounds.iter().filter(|r| queued_ahead(r)).count();
            let ahead_with_drafts = rounds
                .iter()
                .filter(|r| queued_ahead(r) && drafted(r) > 0)
                .count();
            // Rounds not queued ahead after the first: a round queued on a guess was
            // thrown away before them.
            let fresh = rounds.iter().skip(1).filter(|r| !queued_ahead(r)).count();
            assert!(ahead_with_drafts > 0, "{what}: {ahead} queued ahead");
            assert!(fresh > 0, "{what}: no guess failed");
            // Lookup rounds tell the host's time apart, its graph building a part of it.
            for r in &rounds {
                let (host, build) = (r["host_ms"].as_f64(), r["build_ms"].as_f64());
                let (Some(host), Some(build)) = (host, build) else {
                    panic!("{what}: a lookup round without its host times: {r}");
                };
                assert!(
                    build > 0.0 && build <= host,
                    "{what}: build {build} of host {host}"
                );
            }
        }
    }
}

#[test]
fn without_verify_ahead_every_round_is_read_before_the_next_is_queued() {
    let (_dir, loaded) = load("{}", 32);
    let prompt = loaded
        .tokenizer
        .encode_prompt("one at a time", false)
        .unwrap();
    let truth = greedy(&loaded, &prompt, 50);
    let mut drafter = LookupOracle::new(&truth);
    let (out, rounds) = run(
        &loaded,
        &prompt,
        &mut drafter,
        4,
        &greedy_config(40, vec![]),
        VerifyAheadMode::Off,
    );
    assert_eq!(out.tokens, truth[..40].to_vec());
    assert!(rounds.iter().all(|r| !queued_ahead(r)));
    assert!(out.speculative.accepted_tokens > 0);
}

#[test]
fn eos_and_max_tokens_with_a_round_queued_ahead_stop_like_plain_decoding() {
    let (_dir, loaded) = load("{}", 33);
    let prompt = loaded
        .tokenizer
        .encode_prompt("where it stops", false)
        .unwrap();
    let truth = greedy(&loaded, &prompt, 50);
    for max_tokens in [1, 2, 6, 11, 23] {
        let mut drafter = LookupOracle::new(&truth);
        let (out, _) = run(
            &loaded,
            &prompt,
            &mut drafter,
            5,
            &greedy_config(max_tokens, vec![]),
            VerifyAheadMode::Always,
        );
        assert_eq!(
            out.tokens,
            truth[..max_tokens].to_vec(),
            "max_tokens {max_tokens}"
        );
        assert_eq!(out.stats.stop_reason, StopReason::MaxTokens);
    }
    for at in [8, 19, 30] {
        let eos = truth[at];
        let config = greedy_config(50, vec![eos]);
        let plain = generate(
            loaded.model.as_ref(),
            &loaded.tokenizer,
            &prompt,
            &config,
            &mut |_| {},
        )
        .unwrap();
        let mut drafter = LookupOracle::new(&truth);
        let (out, _) = run(
            &loaded,
            &prompt,
            &mut drafter,
            5,
            &config,
            VerifyAheadMode::Always,
        );
        assert_eq!(out.tokens, plain.tokens, "EOS {eos}");
        assert_eq!(out.text, plain.text);
        assert_eq!(out.stats.stop_reason, StopReason::Eos);
    }
}

#[test]
fn sampled_rounds_are_never_queued_ahead() {
    let (_dir, loaded) = load("{}", 34);
    let prompt = loaded
        .tokenizer
        .encode_prompt("abc abc abc abc abc abc abc", false)
        .unwrap();
    let config = GenerationConfig {
        sampling: SamplingParams {
            temperature: 0.7,
            seed: Some(7),
            ..SamplingParams::default()
        },
        ..greedy_config(40, vec![])
    };
    let mut drafter = NgramDrafter::new(3);
    let (out, rounds) = run(
        &loaded,
        &prompt,
        &mut drafter,
        4,
        &config,
        VerifyAheadMode::Always,
    );
    assert_eq!(out.tokens.len(), 40);
    assert!(
        out.speculative.drafted_tokens > 0,
        "the prompt gives n-gram matches"
    );
    assert!(rounds.iter().all(|r| !queued_ahead(r) || drafted(r) == 0));
}

#[test]
fn a_replayed_answer_is_kept_whole_and_a_wrong_one_changes_nothing() {
    let (_dir, loaded) = load("{}", 35);
    let prompt = loaded
        .tokenizer
        .encode_prompt("say it again", false)
        .unwrap();
    let truth = greedy(&loaded, &prompt, 48);
    for mode in [VerifyAheadMode::Always, VerifyAheadMode::Off] {
        let mut drafter = ReplayDrafter::new(truth.clone());
        let (out, rounds) = run(
            &loaded,
            &prompt,
            &mut drafter,
            5,
            &greedy_config(48, vec![]),
            mode,
        );
        assert_eq!(out.tokens, truth, "{mode:?}");
        assert_eq!(
            out.speculative.accepted_tokens, out.speculative.drafted_tokens,
            "{mode:?}"
        );
        assert!(
            out.speculative.tau > 5.0,
            "{mode:?}: tau {}",
            out.speculative.tau
        );
        if mode == VerifyAheadMode::Always {
            assert!(rounds.iter().skip(1).all(queued_ahead), "every guess holds");
        }
        // Another answer: every round rejects, the output is still plain greedy's.
        let wrong: Vec<u32> = truth.iter().map(|t| (t + 1) % 259).collect();
        let mut drafter = ReplayDrafter::new(wrong);
        let (out, _) = run(
            &loaded,
            &prompt,
            &mut drafter,
            5,
            &greedy_config(48, vec![]),
            mode,
        );
        assert_eq!(out.tokens, truth, "{mode:?}");
        assert_eq!(out.speculative.accepted_tokens, 0);
    }
}

#[test]
fn auto_queues_only_behind_rounds_without_drafts() {
    let (_dir, loaded) = load("{}", 36);
    let prompt = loaded
        .tokenizer
        .encode_prompt("only where safe", false)
        .unwrap();
    let truth = greedy(&loaded, &prompt, 90);
    let mut drafter = LookupOracle::new(&truth);
    let (out, rounds) = run(
        &loaded,
        &prompt,
        &mut drafter,
        3,
        &greedy_config(80, vec![]),
        VerifyAheadMode::Auto,
    );
    assert_eq!(out.tokens, truth[..80].to_vec());
    for pair in rounds.windows(2) {
        if queued_ahead(&pair[1]) {
            assert_eq!(drafted(&pair[0]), 0, "queued behind a round with drafts");
        }
    }
    assert!(
        rounds.iter().any(queued_ahead),
        "the lookups that find nothing are followed by rounds queued ahead"
    );
}
