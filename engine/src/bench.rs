//! `dspec bench`: plain greedy decoding and speculative decoding on the same prompts in
//! one process, so the speedup is a ratio of two runs under the same conditions, and
//! the two greedy outputs are compared token for token (they must be identical).

use serde::Serialize;

use dspec_plugin_api::Drafter;

use crate::error::EngineError;
use crate::generate::{generate, GenerationConfig, GenerationStats};
use crate::speculative::{generate_speculative, Speculation, SpeculativeStats};
use crate::tokenizer::TextTokenizer;
use dspec_plugin_api::TargetModel;

/// The prompts `dspec bench` runs without `--prompts`: code, chat, and an edit task
/// that repeats its input (where prompt lookup shines).
pub const DEFAULT_PROMPTS: &[&str] = &[
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "Explain in a few sentences why the sky is blue.",
    "Rename the variable `count` to `total` in this code and return the whole code:\n\n\
     def tally(items):\n    count = 0\n    for item in items:\n        if item.ok:\n            count += item.value\n    return count\n\n\
     def report(items):\n    count = tally(items)\n    print(f\"count = {count}\")\n    return count\n",
];

/// Reads `--prompts FILE`: one prompt per line, or JSON lines with a `"prompt"` field
/// (so prompts may span lines); blank lines are skipped.
pub fn read_prompts(path: &std::path::Path) -> Result<Vec<String>, EngineError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| EngineError::Invalid(format!("reading --prompts {}: {e}", path.display())))?;
    let mut prompts = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim_end_matches('\r');
        if line.trim().is_empty() {
            continue;
        }
        if line.trim_start().starts_with('{') {
            let value: serde_json::Value = serde_json::from_str(line).map_err(|e| {
                EngineError::Invalid(format!(
                    "--prompts {} line {}: invalid JSON ({e}); write one prompt per line or {{\"prompt\": \"...\"}}",
                    path.display(),
                    n + 1
                ))
            })?;
            let prompt = value["prompt"].as_str().ok_or_else(|| {
                EngineError::Invalid(format!(
                    "--prompts {} line {}: a JSON line needs a string \"prompt\" field",
                    path.display(),
                    n + 1
                ))
            })?;
            prompts.push(prompt.to_string());
        } else {
            prompts.push(line.to_string());
        }
    }
    if prompts.is_empty() {
        return Err(EngineError::Invalid(format!(
            "--prompts {}: no prompts in the file",
            path.display()
        )));
    }
    Ok(prompts)
}

#[derive(Debug, Clone, Serialize)]
pub struct BenchRow {
    pub prompt_tokens: usize,
    /// The prompt as token ids (after the chat template), so another engine can be
    /// run on exactly the same input.
    pub prompt_ids: Vec<u32>,
    /// Plain greedy decoding's output ids.
    pub tokens: Vec<u32>,
    pub plain: GenerationStats,
    pub speculative: GenerationStats,
    pub drafting: SpeculativeStats,
    /// Speculative decode tok/s over plain decode tok/s.
    pub speedup: f64,
    pub identical: bool,
    /// Index of the first differing generated token, when the outputs differ.
    pub first_difference: Option<usize>,
}

#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub drafter: String,
    pub max_draft: usize,
    /// Draft lengths were chosen per round (`--max-draft auto`), `max_draft` at most.
    pub adaptive: bool,
    pub max_tokens: usize,
    pub rows: Vec<BenchRow>,
    /// Over all prompts: generated tokens (after each first) / decode seconds.
    pub plain_tokens_per_second: f64,
    pub speculative_tokens_per_second: f64,
    pub speedup: f64,
    /// Tokens committed per target forward over all prompts.
    pub tau: f64,
    pub all_identical: bool,
}

/// Runs every prompt plainly and speculatively (greedy), after one short warm-up of
/// each so neither side pays first-call costs inside its timing.
pub fn run_bench(
    model: &dyn TargetModel,
    tokenizer: &TextTokenizer,
    drafter: &mut dyn Drafter,
    prompts: &[Vec<u32>],
    max_tokens: usize,
    max_draft: usize,
    adaptive: bool,
) -> Result<BenchReport, EngineError> {
    let config = GenerationConfig {
        max_tokens,
        sampling: Default::default(),
        stop_strings: Vec::new(),
        eos_ids: tokenizer.eos_token_ids().to_vec(),
    };
    if let Some(first) = prompts.first() {
        let warm = GenerationConfig {
            max_tokens: max_tokens.min(8),
            ..config.clone()
        };
        generate(model, tokenizer, first, &warm, &mut |_| {})?;
        let speculation = Speculation {
            drafter: &mut *drafter,
            max_draft,
            adaptive,
            trace: None,
        };
        generate_speculative(model, tokenizer, first, &warm, speculation, &mut |_| {})?;
    }
    let mut rows = Vec::new();
    for prompt in prompts {
        let plain = generate(model, tokenizer, prompt, &config, &mut |_| {})?;
        let speculation = Speculation {
            drafter: &mut *drafter,
            max_draft,
            adaptive,
            trace: None,
        };
        let spec =
            generate_speculative(model, tokenizer, prompt, &config, speculation, &mut |_| {})?;
        let first_difference = plain
            .tokens
            .iter()
            .zip(&spec.tokens)
            .position(|(a, b)| a != b)
            .or_else(|| {
                (plain.tokens.len() != spec.tokens.len())
                    .then(|| plain.tokens.len().min(spec.tokens.len()))
            });
        rows.push(BenchRow {
            prompt_tokens: prompt.len(),
            prompt_ids: prompt.clone(),
            tokens: plain.tokens.clone(),
            speedup: spec.stats.decode_tokens_per_second
                / plain.stats.decode_tokens_per_second.max(1e-9),
            identical: first_difference.is_none(),
            first_difference,
            plain: plain.stats,
            speculative: spec.stats,
            drafting: spec.speculative,
        });
    }
    let rate = |pick: &dyn Fn(&BenchRow) -> &GenerationStats| {
        let tokens: usize = rows
            .iter()
            .map(|r| pick(r).generated_tokens.saturating_sub(1))
            .sum();
        let seconds: f64 = rows.iter().map(|r| pick(r).decode_seconds).sum();
        tokens as f64 / seconds.max(1e-9)
    };
    let plain_tps = rate(&|r| &r.plain);
    let spec_tps = rate(&|r| &r.speculative);
    let forwards: usize = rows.iter().map(|r| r.drafting.target_forwards).sum();
    let committed: usize = rows
        .iter()
        .map(|r| r.drafting.accepted_tokens + r.drafting.target_forwards)
        .sum();
    Ok(BenchReport {
        drafter: drafter.name().to_string(),
        max_draft,
        adaptive,
        max_tokens,
        plain_tokens_per_second: plain_tps,
        speculative_tokens_per_second: spec_tps,
        speedup: spec_tps / plain_tps.max(1e-9),
        tau: committed as f64 / forwards.max(1) as f64,
        all_identical: rows.iter().all(|r| r.identical),
        rows,
    })
}

impl BenchReport {
    /// The human-readable table.
    pub fn table(&self) -> String {
        let mut out = format!(
            "{:>3}  {:>7}  {:>9}  {:>9}  {:>9}  {:>7}  {:>5}  {}\n",
            "#", "prompt", "generated", "plain t/s", "spec t/s", "speedup", "tau", "greedy outputs"
        );
        for (i, r) in self.rows.iter().enumerate() {
            let same = match r.first_difference {
                None => "identical".to_string(),
                Some(at) => format!("DIFFER at token {at}"),
            };
            out += &format!(
                "{:>3}  {:>7}  {:>9}  {:>9.1}  {:>9.1}  {:>6.2}x  {:>5.2}  {}\n",
                i + 1,
                r.prompt_tokens,
                r.plain.generated_tokens,
                r.plain.decode_tokens_per_second,
                r.speculative.decode_tokens_per_second,
                r.speedup,
                r.drafting.tau,
                same
            );
        }
        out += &format!(
            "all  {:>7}  {:>9}  {:>9.1}  {:>9.1}  {:>6.2}x  {:>5.2}  {}\n",
            "",
            "",
            self.plain_tokens_per_second,
            self.speculative_tokens_per_second,
            self.speedup,
            self.tau,
            if self.all_identical {
                "identical"
            } else {
                "OUTPUTS DIFFER"
            }
        );
        out
    }
}
