//! Log-probabilities reported under speculation are the target's own, position by
//! position: checked against one uncached forward over the prompt and the output, for
//! tokens committed by verify blocks, by plain steps (`--max-draft auto` with drafts
//! that never pay), and with an EOS that ends generation inside a block.

use std::time::Duration;

use mlx_rs::Array;

use dspec_drafters::ngram::NgramDrafter;
use dspec_engine::decoding::generate::logits_to_host;
use dspec_engine::decoding::logprobs::TokenLogprob;
use dspec_engine::decoding::speculative::VerifyAheadMode;
use dspec_engine::decoding::speculative::{
    generate_speculative, ServingOptions, Speculation, SpeculativeOutput,
};
use dspec_engine::loading::LoadedModel;
use dspec_plugin_api::error::Result as ModelResult;
use dspec_plugin_api::{Draft, Drafter, TargetModel, TokenPicker};

mod common;
use common::{greedy, greedy_config, tiny_target};

const TOP: usize = 3;

fn run(
    loaded: &LoadedModel,
    drafter: &mut dyn Drafter,
    prompt: &[u32],
    n: usize,
    eos: Vec<u32>,
    adaptive: bool,
    rounds: &mut Vec<Vec<TokenLogprob>>,
) -> SpeculativeOutput {
    let mut on_round = |entries: &[TokenLogprob]| rounds.push(entries.to_vec());
    generate_speculative(
        loaded.model.as_ref(),
        &loaded.tokenizer,
        prompt,
        &greedy_config(n, eos),
        Speculation {
            drafter,
            max_draft: 4,
            adaptive,
            trace: None,
            verify_ahead: VerifyAheadMode::Always,
        },
        &mut |_| {},
        ServingOptions {
            logprobs: Some(TOP),
            on_logprobs: Some(&mut on_round),
            ..ServingOptions::default()
        },
    )
    .expect("generation")
}

/// The log-softmax of every position's logits, from one forward over `tokens` with a
/// fresh cache.
fn reference(loaded: &LoadedModel, tokens: &[u32]) -> Vec<Vec<f64>> {
    let mut cache = loaded.model.new_cache();
    let out = loaded
        .model
        .forward(
            &Array::from_slice(tokens, &[1, tokens.len() as i32]),
            &mut cache,
            &[],
        )
        .expect("forward");
    let flat = logits_to_host(&out.logits).expect("logits");
    let vocab = flat.len() / tokens.len();
    flat.chunks(vocab)
        .map(|row| {
            let max = row.iter().fold(f32::MIN, |m, &x| m.max(x)) as f64;
            let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
            row.iter().map(|&x| x as f64 - max - sum.ln()).collect()
        })
        .collect()
}

/// Each entry is its token's log-probability at its position, with the position's
/// likeliest tokens in order; one entry per generated token but an ending EOS.
fn check(loaded: &LoadedModel, prompt: &[u32], out: &SpeculativeOutput, what: &str) {
    let entries = out.logprobs.as_ref().expect("log-probabilities asked for");
    let ended_on_eos = out.stats.stop_reason == dspec_engine::decoding::generate::StopReason::Eos;
    assert_eq!(
        entries.len(),
        out.tokens.len() - usize::from(ended_on_eos),
        "{what}"
    );
    let mut sequence = prompt.to_vec();
    sequence.extend_from_slice(&out.tokens);
    let rows = reference(loaded, &sequence);
    for (i, entry) in entries.iter().enumerate() {
        let row = &rows[prompt.len() - 1 + i];
        assert_eq!(entry.token, out.tokens[i], "{what}: token {i}");
        let near = |a: f32, b: f64| (a as f64 - b).abs() < 1e-3;
        assert!(
            near(entry.logprob, row[entry.token as usize]),
            "{what}: token {i}: {} vs {}",
            entry.logprob,
            row[entry.token as usize]
        );
        assert_eq!(entry.top.len(), TOP);
        let mut order: Vec<usize> = (0..row.len()).collect();
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
        for (rank, &(id, lp)) in entry.top.iter().enumerate() {
            assert!(
                near(lp, row[order[rank]]) && near(lp, row[id as usize]),
                "{what}: token {i}, alternative {rank}"
            );
        }
        // Greedy: the token is the likeliest.
        assert!(near(entry.logprob, row[order[0]]), "{what}: token {i}");
    }
}

#[test]
fn verify_blocks_report_the_targets_log_probabilities() {
    let (_dir, loaded) = tiny_target("{}", 5);
    let prompt = loaded
        .tokenizer
        .encode_prompt("abc abc abc abc abc abc", false)
        .expect("encode");
    let mut rounds = Vec::new();
    let out = run(
        &loaded,
        &mut NgramDrafter::new(3),
        &prompt,
        40,
        vec![],
        false,
        &mut rounds,
    );
    assert!(out.speculative.drafted_tokens > 0);
    check(&loaded, &prompt, &out, "ngram");
    // Round by round, the same entries, in order.
    assert_eq!(rounds.concat(), *out.logprobs.as_ref().expect("entries"));
    assert!(rounds.len() < out.tokens.len(), "several tokens per round");

    // An EOS among a block's tokens ends generation: the tokens after it are not
    // reported, nor is the EOS.
    let truth = greedy(&loaded, &prompt, 40);
    let eos = truth[20];
    let out = run(
        &loaded,
        &mut NgramDrafter::new(3),
        &prompt,
        40,
        vec![eos],
        false,
        &mut Vec::new(),
    );
    check(&loaded, &prompt, &out, "ngram, EOS");
    assert!(out.tokens.len() <= 21);
}

/// Proposes a wrong token every time, at the cost of a draft model's forward, so the
/// draft length controller runs plain steps.
struct AlwaysWrong {
    truth: Vec<u32>,
    seen: usize,
}

impl Drafter for AlwaysWrong {
    fn name(&self) -> &str {
        "always-wrong"
    }
    fn begin(&mut self, _: &dyn TargetModel, _: &[u32], _: Option<&Array>) -> ModelResult<()> {
        Ok(())
    }
    fn propose(
        &mut self,
        _: &dyn TargetModel,
        _: u32,
        max_k: usize,
        _: &mut dyn TokenPicker,
    ) -> ModelResult<Draft> {
        if max_k > 0 {
            std::thread::sleep(Duration::from_millis(3));
        }
        let tokens = self
            .truth
            .iter()
            .skip(self.seen + 1)
            .take(max_k)
            .map(|t| (t + 1) % 259)
            .collect();
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

#[test]
fn plain_steps_report_the_targets_log_probabilities() {
    let (_dir, loaded) = tiny_target("{}", 23);
    let prompt = loaded
        .tokenizer
        .encode_prompt("drafts that never pay", false)
        .expect("encode");
    let truth = greedy(&loaded, &prompt, 80);
    let mut drafter = AlwaysWrong { truth, seen: 0 };
    let out = run(
        &loaded,
        &mut drafter,
        &prompt,
        70,
        vec![],
        true,
        &mut Vec::new(),
    );
    assert!(
        out.speculative.draft_histogram[0] > 0,
        "plain steps ran: {:?}",
        out.speculative.draft_histogram
    );
    check(&loaded, &prompt, &out, "plain steps");
}
