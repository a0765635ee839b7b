//! Speculative decoding must give exactly plain greedy decoding's tokens, whatever the
//! drafter proposes — and stop exactly where plain decoding stops (EOS, max tokens,
//! stop strings) even when that falls inside an accepted block.

use std::time::Duration;

use mlx_rs::Array;

use dspec_drafters::ngram::NgramDrafter;
use dspec_engine::decoding::generate::{generate, GenerationConfig, StopReason};
use dspec_engine::decoding::sampling::SamplingParams;
use dspec_engine::decoding::speculative::VerifyAheadMode;
use dspec_engine::decoding::speculative::{
    generate_speculative, ServingOptions, Speculation, SpeculativeOutput,
};
use dspec_engine::loading::LoadedModel;
use dspec_plugin_api::error::Result as ModelResult;
use dspec_plugin_api::{Agreement, Draft, Drafter, TargetModel, TokenPicker};

mod common;
use common::{greedy, tiny_target as load};

fn config(max_tokens: usize, eos_ids: Vec<u32>, stop_strings: Vec<String>) -> GenerationConfig {
    GenerationConfig {
        max_tokens,
        sampling: SamplingParams::default(),
        stop_strings,
        eos_ids,
    }
}

/// Knows the true greedy continuation and proposes it with one token corrupted at a
/// position that cycles, so every acceptance length occurs (or, `always_wrong`, every
/// token corrupted, so nothing is ever accepted). It also checks the loop tells it
/// about exactly the tokens it committed.
struct NoisyOracle {
    truth: Vec<u32>,
    /// Tokens the target has verified so far (prompt excluded).
    seen: usize,
    round: usize,
    vocab: u32,
    hidden_checks: usize,
    /// Most positions one `commit` brought.
    longest_commit: usize,
    always_wrong: bool,
    /// Time each `propose` of drafts takes, as a draft model's forwards would.
    propose_cost: Duration,
    /// Whether it reports its (always wrong) guesses on plain steps' tokens, as the
    /// n-gram and draft-model drafters do; `None`: it does not measure them.
    agreement: Option<Agreement>,
    /// Whether the commits coming are plain steps'.
    plain: bool,
    /// What it answers to `Drafter::plain_piece`.
    plain_piece: Option<usize>,
}

impl NoisyOracle {
    /// An oracle for the tiny targets' 259-token vocabulary, before any round.
    fn new(truth: &[u32]) -> Self {
        NoisyOracle {
            truth: truth.to_vec(),
            seen: 0,
            round: 0,
            vocab: 259,
            hidden_checks: 0,
            longest_commit: 0,
            always_wrong: false,
            propose_cost: Duration::ZERO,
            agreement: None,
            plain: false,
            plain_piece: None,
        }
    }

    /// The same oracle with every draft shifted by one id.
    fn always_wrong(truth: &[u32]) -> Self {
        NoisyOracle {
            always_wrong: true,
            ..NoisyOracle::new(truth)
        }
    }
}

impl Drafter for NoisyOracle {
    fn name(&self) -> &str {
        "noisy-oracle"
    }
    fn taps(&self) -> &[usize] {
        &[0, 1]
    }
    fn begin(
        &mut self,
        _target: &dyn TargetModel,
        _prompt: &[u32],
        hidden: Option<&Array>,
    ) -> ModelResult<()> {
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
        assert_eq!(
            Some(&last),
            self.truth.get(self.seen),
            "last is the next true token"
        );
        if max_k > 0 {
            std::thread::sleep(self.propose_cost);
        }
        self.plain = max_k == 0;
        let start = self.seen + 1;
        let mut tokens: Vec<u32> = self.truth.iter().skip(start).take(max_k).copied().collect();
        self.round += 1;
        let corrupt = self.round % (max_k + 2);
        for (i, t) in tokens.iter_mut().enumerate() {
            if self.always_wrong || i == corrupt {
                *t = (*t + 1) % self.vocab;
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
        self.hidden_checks += 1;
        self.longest_commit = self.longest_commit.max(verified.len());
        self.seen += verified.len();
        if let (Some(a), true) = (self.agreement.as_mut(), self.plain) {
            a.checked += verified.len();
            if !self.always_wrong {
                a.agreed += verified.len();
            }
        }
        Ok(())
    }
    fn agreement(&mut self) -> Option<Agreement> {
        self.agreement.as_mut().map(std::mem::take)
    }
    fn plain_piece(&self) -> Option<usize> {
        self.plain_piece
    }
}

fn spec(drafter: &mut dyn Drafter, max_draft: usize) -> Speculation<'_> {
    Speculation {
        drafter,
        max_draft,
        adaptive: false,
        trace: None,
        verify_ahead: VerifyAheadMode::Always,
    }
}

#[test]
fn noisy_oracle_speculation_equals_greedy_with_every_acceptance_length() {
    for overrides in [
        "{}",
        r#"{"model_type": "qwen3", "head_dim": 16}"#,
        r#"{"model_type": "gemma2", "head_dim": 16, "sliding_window": 6, "attn_logit_softcapping": 50.0}"#,
    ] {
        let (_dir, loaded) = load(overrides, 21);
        let prompt = loaded
            .tokenizer
            .encode_prompt("speculate on this", false)
            .unwrap();
        let truth = greedy(&loaded, &prompt, 60);
        let mut drafter = NoisyOracle::new(&truth);
        let out = generate_speculative(
            loaded.model.as_ref(),
            &loaded.tokenizer,
            &prompt,
            &config(40, vec![], vec![]),
            spec(&mut drafter, 4),
            &mut |_| {},
            ServingOptions::default(),
        )
        .unwrap();
        assert_eq!(out.tokens, truth[..40].to_vec(), "{overrides}");
        let s = &out.speculative;
        assert!(s.tau > 1.5, "{overrides}: tau {}", s.tau);
        assert_eq!(
            s.acceptance_histogram.iter().sum::<usize>(),
            s.target_forwards
        );
        assert!(
            s.acceptance_histogram.iter().all(|&c| c > 0),
            "every acceptance length 0..=4 occurs: {:?}",
            s.acceptance_histogram
        );
        assert_eq!(drafter.hidden_checks, s.target_forwards);
    }
}

#[test]
fn eos_and_max_tokens_inside_an_accepted_block_stop_like_plain_decoding() {
    let (_dir, loaded) = load("{}", 4);
    let prompt = loaded
        .tokenizer
        .encode_prompt("where does it end", false)
        .unwrap();
    let truth = greedy(&loaded, &prompt, 40);
    // The oracle corrupts one draft in most rounds; stops must still land exactly.
    let oracle = || NoisyOracle::new(&truth);

    for max_tokens in [1, 2, 7, 13] {
        let mut d = oracle();
        let out = generate_speculative(
            loaded.model.as_ref(),
            &loaded.tokenizer,
            &prompt,
            &config(max_tokens, vec![], vec![]),
            spec(&mut d, 5),
            &mut |_| {},
            ServingOptions::default(),
        )
        .unwrap();
        assert_eq!(
            out.tokens,
            truth[..max_tokens].to_vec(),
            "max_tokens {max_tokens}"
        );
        assert_eq!(out.stats.stop_reason, StopReason::MaxTokens);
    }
    let eos = truth[9];
    let first = truth.iter().position(|&t| t == eos).unwrap();
    let mut d = oracle();
    let plain = generate(
        loaded.model.as_ref(),
        &loaded.tokenizer,
        &prompt,
        &config(40, vec![eos], vec![]),
        &mut |_| {},
    )
    .unwrap();
    let out = generate_speculative(
        loaded.model.as_ref(),
        &loaded.tokenizer,
        &prompt,
        &config(40, vec![eos], vec![]),
        spec(&mut d, 5),
        &mut |_| {},
        ServingOptions::default(),
    )
    .unwrap();
    assert_eq!(out.tokens, truth[..=first].to_vec());
    assert_eq!(out.tokens, plain.tokens);
    assert_eq!(out.text, plain.text);
    assert_eq!(out.stats.stop_reason, StopReason::Eos);
}

#[test]
fn stop_strings_inside_a_block_cut_the_text_like_plain_decoding() {
    let (_dir, loaded) = load("{}", 6);
    let prompt = loaded
        .tokenizer
        .encode_prompt("stop strings", false)
        .unwrap();
    let truth = greedy(&loaded, &prompt, 40);
    let text = loaded.tokenizer.decode(&truth, true).unwrap();
    let chars: Vec<char> = text.chars().collect();
    if chars.len() < 12 {
        return;
    }
    let stop: String = chars[8..10].iter().collect();
    let cfg = config(40, vec![], vec![stop.clone()]);
    let plain = generate(
        loaded.model.as_ref(),
        &loaded.tokenizer,
        &prompt,
        &cfg,
        &mut |_| {},
    )
    .unwrap();
    let mut d = NoisyOracle::new(&truth);
    let mut streamed = String::new();
    let out = generate_speculative(
        loaded.model.as_ref(),
        &loaded.tokenizer,
        &prompt,
        &cfg,
        spec(&mut d, 5),
        &mut |s| streamed.push_str(s),
        ServingOptions::default(),
    )
    .unwrap();
    assert_eq!(out.text, plain.text, "stop {stop:?}");
    assert_eq!(streamed, plain.text);
    assert_eq!(out.tokens, plain.tokens);
    assert_eq!(out.stats.stop_reason, StopReason::StopString);
}

#[test]
fn ngram_speculation_equals_greedy_on_repetitive_prompts() {
    for (overrides, seed) in [
        ("{}", 1),
        (r#"{"model_type": "mistral", "sliding_window": 5}"#, 2),
        (
            r#"{"model_type": "gemma3_text", "head_dim": 16, "sliding_window": 6, "sliding_window_pattern": 2}"#,
            3,
        ),
    ] {
        let (_dir, loaded) = load(overrides, seed);
        let prompt = loaded
            .tokenizer
            .encode_prompt("abc abc abc abc abc abc abc", false)
            .unwrap();
        let truth = greedy(&loaded, &prompt, 48);
        let mut drafter = NgramDrafter::new(3);
        let out = generate_speculative(
            loaded.model.as_ref(),
            &loaded.tokenizer,
            &prompt,
            &config(48, vec![], vec![]),
            spec(&mut drafter, 6),
            &mut |_| {},
            ServingOptions::default(),
        )
        .unwrap();
        assert_eq!(out.tokens, truth, "{overrides}");
        assert!(
            out.speculative.drafted_tokens > 0,
            "{overrides}: the repetitive prompt gives n-gram matches"
        );
    }
}

/// `--max-draft auto`: the draft length changes from round to round with what the
/// rounds measured, and the output is still plain greedy's, token for token, whether
/// the drafts are mostly right (noisy oracle) or always wrong (every token shifted).
#[test]
fn adaptive_draft_length_keeps_greedy_output() {
    let (_dir, loaded) = load("{}", 23);
    let prompt = loaded
        .tokenizer
        .encode_prompt("adapt the draft length", false)
        .unwrap();
    let truth = greedy(&loaded, &prompt, 70);
    for mut drafter in [NoisyOracle::new(&truth), NoisyOracle::always_wrong(&truth)] {
        let always_wrong = drafter.always_wrong;
        let out = generate_speculative(
            loaded.model.as_ref(),
            &loaded.tokenizer,
            &prompt,
            &config(60, vec![], vec![]),
            Speculation {
                drafter: &mut drafter,
                max_draft: 6,
                adaptive: true,
                trace: None,
                verify_ahead: VerifyAheadMode::Always,
            },
            &mut |_| {},
            ServingOptions::default(),
        )
        .unwrap();
        assert_eq!(
            out.tokens,
            truth[..60].to_vec(),
            "always wrong: {always_wrong}"
        );
        let s = &out.speculative;
        assert_eq!(s.acceptance_histogram.len(), 7);
        assert_eq!(
            s.acceptance_histogram.iter().sum::<usize>(),
            s.target_forwards
        );
        if always_wrong {
            assert_eq!(s.accepted_tokens, 0);
        }
    }
}

/// `max_tokens` greedy tokens with `--max-draft auto:6`.
fn auto_run<'a>(
    loaded: &LoadedModel,
    prompt: &[u32],
    drafter: &'a mut dyn Drafter,
    max_tokens: usize,
    trace: Option<&'a mut dyn std::io::Write>,
) -> SpeculativeOutput {
    generate_speculative(
        loaded.model.as_ref(),
        &loaded.tokenizer,
        prompt,
        &config(max_tokens, vec![], vec![]),
        Speculation {
            drafter,
            max_draft: 6,
            adaptive: true,
            trace,
            verify_ahead: VerifyAheadMode::Always,
        },
        &mut |_| {},
        ServingOptions::default(),
    )
    .unwrap()
}

/// The target, prompt and plain greedy tokens of the tests whose drafts are never kept.
fn never_paying() -> (tempfile::TempDir, LoadedModel, Vec<u32>, Vec<u32>) {
    let (dir, loaded) = load("{}", 23);
    let prompt = loaded
        .tokenizer
        .encode_prompt("drafts that never pay", false)
        .unwrap();
    let truth = greedy(&loaded, &prompt, 130);
    (dir, loaded, prompt, truth)
}

/// A drafter that reports how its guesses fare on plain steps' tokens spares the
/// generation its probes: with drafts that are never kept, one warm-up round drafts and
/// every other round is a plain step, and the output is plain greedy's.
#[test]
fn measured_agreement_spares_the_probes() {
    let (_dir, loaded, prompt, truth) = never_paying();
    // Drafting dear enough that, once the warm-up kept nothing, even one draft does not
    // look worth a round before the first agreement arrives, even where a loaded machine
    // makes plain steps look dear for a while.
    let mut drafter = NoisyOracle {
        propose_cost: Duration::from_millis(200),
        agreement: Some(Agreement::default()),
        ..NoisyOracle::always_wrong(&truth)
    };
    let out = auto_run(&loaded, &prompt, &mut drafter, 120, None);
    assert_eq!(out.tokens, truth[..120].to_vec());
    let h = &out.speculative.draft_histogram;
    // One warm-up round of one draft (α comes from the agreement, the round times a
    // draft and a verify), where a drafter without agreement warms up with the maximum.
    assert!(h[1] >= 1 && h[6] == 0, "one short warm-up round: {h:?}");
    // Without agreement the same run probes at rounds 8, 24 and 56 (the test above);
    // one short round is still the controller's to choose, should plain steps time
    // badly on a loaded machine.
    assert!(h[1..6].iter().sum::<usize>() <= 2, "no probes: {h:?}");
    assert!(h[0] >= out.speculative.target_forwards - 2, "{h:?}");
}

/// `--max-draft auto` with drafts that are never kept and cost a draft model's time:
/// after the warm-up, rounds run as plain decoding steps (no drafts), with a probe of
/// one draft now and then so the acceptance stays measured; the drafter hears of the
/// plain steps in batches, and the output is plain greedy's token for token.
#[test]
fn auto_draft_length_decodes_plainly_while_drafts_fail() {
    let (_dir, loaded, prompt, truth) = never_paying();
    // Drafting dear enough that one draft never looks worth a round, even where a
    // loaded machine (a CI runner with other tests beside this one) times plain steps
    // tens of milliseconds dear: the controller's choices are then the schedule's alone.
    let mut drafter = NoisyOracle {
        propose_cost: Duration::from_millis(60),
        ..NoisyOracle::always_wrong(&truth)
    };
    let mut trace = Vec::new();
    let out = auto_run(&loaded, &prompt, &mut drafter, 120, Some(&mut trace));
    assert_eq!(out.tokens, truth[..120].to_vec());
    let s = &out.speculative;
    assert_eq!(s.accepted_tokens, 0);
    // Every round commits one token: the first comes from prefill.
    assert_eq!(s.target_forwards, 119);
    assert_eq!(s.draft_histogram.len(), 7);
    assert_eq!(s.draft_histogram.iter().sum::<usize>(), s.target_forwards);
    let plain = s.draft_histogram[0];
    assert!(
        plain * 3 >= s.target_forwards * 2,
        "most rounds run without drafts: {:?}",
        s.draft_histogram
    );
    // Probes keep measuring acceptance: at least three rounds with drafts besides the
    // warm-up. A probe is one draft more than the best length, so it is one draft while
    // plain steps win; a loaded machine can time plain steps dear for a while, make one
    // draft the best, and turn a probe into two or three.
    let drafted_rounds: usize = s.draft_histogram[1..].iter().sum();
    assert!(
        drafted_rounds > 3,
        "probes keep measuring acceptance: {:?}",
        s.draft_histogram
    );
    // The warm-up drafts the maximum, and ends with its first round that keeps nothing;
    // a later round may too, where a loaded machine made a plain step look dear (the
    // choice follows measured times).
    assert!(
        s.draft_histogram[6] >= 1,
        "the warm-up drafts the maximum: {:?}",
        s.draft_histogram
    );
    // Plain steps reach the drafter in batches, each commit checked by the oracle, and
    // a long run in pieces the drafter can read while it goes on.
    assert!(
        drafter.hidden_checks * 3 < s.target_forwards,
        "{} commits for {} rounds",
        drafter.hidden_checks,
        s.target_forwards
    );
    assert!(
        (2..=32).contains(&drafter.longest_commit),
        "longest commit: {}",
        drafter.longest_commit
    );
    // The trace has a line per round; rounds without drafts show none.
    let lines: Vec<serde_json::Value> = String::from_utf8(trace)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), s.target_forwards);
    let undrafted = lines
        .iter()
        .filter(|l| l["drafted"].as_array().is_some_and(|d| d.is_empty()))
        .count();
    assert_eq!(undrafted, plain);
}

/// A drafter that asks for plain steps' positions one at a time (as the n-gram drafter
/// does, whose check of a token is one lookup) is told of each in a commit of its own, so
/// its agreement reaches the draft-length controller as the steps come rather than a
/// piece of a few dozen positions later. The output stays plain greedy's.
#[test]
fn a_drafter_may_take_plain_steps_one_by_one() {
    let (_dir, loaded, prompt, truth) = never_paying();
    let mut drafter = NoisyOracle {
        agreement: Some(Agreement::default()),
        plain_piece: Some(1),
        ..NoisyOracle::always_wrong(&truth)
    };
    let out = auto_run(&loaded, &prompt, &mut drafter, 120, None);
    assert_eq!(out.tokens, truth[..120].to_vec());
    let s = &out.speculative;
    assert_eq!(s.accepted_tokens, 0);
    // Every round feeds one position (nothing drafted is kept), and every position
    // reaches the drafter in a commit of one.
    assert_eq!(drafter.longest_commit, 1);
    assert_eq!(drafter.hidden_checks, s.target_forwards);
}
