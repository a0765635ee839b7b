//! `dspec bench`: plain greedy decoding and speculative decoding on the same prompts in
//! one process, so the speedup is a ratio of two runs under the same conditions, and
//! the two greedy outputs are compared token for token (they must be identical); and
//! prefill speed, measured warm.

use std::time::Instant;

use serde::Serialize;

use dspec_plugin_api::{Drafter, TargetModel};

use crate::error::EngineError;
use crate::generate::{generate, prefill, GenerationConfig, GenerationStats};
use crate::speculative::{generate_speculative, Speculation, SpeculativeStats};
use crate::tokenizer::TextTokenizer;

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

/// How `dspec bench` measures prefill.
#[derive(Debug, Clone, Default)]
pub struct PrefillPlan {
    /// Prefills timed per prompt after its first call; 0 skips prefill measurement.
    pub warm_runs: usize,
    /// Synthetic prompt lengths measured besides the bench prompts.
    pub synthetic_lengths: Vec<usize>,
}

/// What `dspec bench` runs, besides the model, drafter and prompts.
#[derive(Debug, Clone)]
pub struct BenchSettings {
    pub max_tokens: usize,
    pub max_draft: usize,
    /// Draft lengths chosen per round (`--max-draft auto`), `max_draft` at most.
    pub adaptive: bool,
    pub prefill: PrefillPlan,
}

/// Prefill of one prompt: its first call apart from the warm calls after it.
#[derive(Debug, Clone, Serialize)]
pub struct PrefillRow {
    /// The bench prompt's number (1-based), or `None` for a synthetic prompt.
    pub prompt: Option<usize>,
    pub prompt_tokens: usize,
    /// The first prefill of this prompt in the process: on a GPU it also pays one-off
    /// costs (kernel JIT, plans built per shape) that later calls do not.
    pub first_call_seconds: f64,
    pub first_call_tokens_per_second: f64,
    /// Every warm prefill's seconds, in the order run.
    pub warm_seconds: Vec<f64>,
    pub median_seconds: f64,
    /// Prompt tokens over the median warm prefill's seconds.
    pub tokens_per_second: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct PrefillReport {
    pub warm_runs: usize,
    pub rows: Vec<PrefillRow>,
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
    /// Absent when prefill was not measured (`--prefill-runs 0`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill: Option<PrefillReport>,
}

/// Runs every prompt plainly and speculatively (greedy), after one short warm-up of
/// each so neither side pays first-call costs inside its timing. Prefill is measured
/// first, so each prompt's first prefill is its first in the process.
pub fn run_bench(
    model: &dyn TargetModel,
    tokenizer: &TextTokenizer,
    drafter: &mut dyn Drafter,
    prompts: &[Vec<u32>],
    settings: &BenchSettings,
) -> Result<BenchReport, EngineError> {
    let BenchSettings {
        max_tokens,
        max_draft,
        adaptive,
        ..
    } = *settings;
    let prefill = match settings.prefill.warm_runs {
        0 => None,
        _ => Some(measure_prefill(model, prompts, &settings.prefill)?),
    };
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
        prefill,
        rows,
    })
}

/// A prompt of exactly `len` real token ids: the bench prompts' ids one after another,
/// repeated, so long-prompt prefill runs on text-like input rather than one id repeated.
/// `None` when the prompts hold no ids.
pub fn synthetic_prompt(prompts: &[Vec<u32>], len: usize) -> Option<Vec<u32>> {
    let pool = prompts.concat();
    (!pool.is_empty()).then(|| pool.iter().copied().cycle().take(len).collect())
}

/// Prefill of every prompt and every synthetic length: once cold (the first call of that
/// prompt in the process), then `warm_runs` times, of which the median is reported.
pub fn measure_prefill(
    model: &dyn TargetModel,
    prompts: &[Vec<u32>],
    plan: &PrefillPlan,
) -> Result<PrefillReport, EngineError> {
    let limit = model.info().max_context.unwrap_or(usize::MAX);
    let mut inputs: Vec<(Option<usize>, Vec<u32>)> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| (Some(i + 1), p.clone()))
        .collect();
    // Every length is checked before anything runs: a long bench should not fail late.
    for &len in &plan.synthetic_lengths {
        if len == 0 || len > limit {
            return Err(EngineError::Invalid(format!(
                "--prefill-lengths: {len} tokens is not a prompt length this model takes (1 to {limit})"
            )));
        }
        let prompt = synthetic_prompt(prompts, len).ok_or_else(|| {
            EngineError::Invalid("--prefill-lengths needs prompts with tokens to repeat".into())
        })?;
        inputs.push((None, prompt));
    }
    let time_one = |prompt: &[u32]| -> Result<f64, EngineError> {
        let mut cache = model.new_cache();
        let start = Instant::now();
        // `prefill` evaluates the last logits and the whole cache before returning.
        prefill(model, &mut cache, prompt)?;
        Ok(start.elapsed().as_secs_f64())
    };
    let mut rows = Vec::with_capacity(inputs.len());
    for (number, prompt) in inputs {
        let first = time_one(&prompt)?;
        let warm = (0..plan.warm_runs)
            .map(|_| time_one(&prompt))
            .collect::<Result<Vec<_>, _>>()?;
        let median = median(&warm).unwrap_or(first);
        let rate = |seconds: f64| prompt.len() as f64 / seconds.max(1e-9);
        rows.push(PrefillRow {
            prompt: number,
            prompt_tokens: prompt.len(),
            first_call_seconds: first,
            first_call_tokens_per_second: rate(first),
            warm_seconds: warm,
            median_seconds: median,
            tokens_per_second: rate(median),
        });
    }
    Ok(PrefillReport {
        warm_runs: plan.warm_runs,
        rows,
    })
}

fn median(values: &[f64]) -> Option<f64> {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(sorted[n / 2]),
        _ => Some((sorted[n / 2 - 1] + sorted[n / 2]) / 2.0),
    }
}

impl BenchReport {
    /// The human-readable tables: decoding, then prefill when it was measured.
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
        if let Some(prefill) = &self.prefill {
            out += &format!(
                "\nprefill (median of {} warm runs after each prompt's first call)\n",
                prefill.warm_runs
            );
            out += &format!(
                "{:>9}  {:>7}  {:>12}  {:>11}  {:>9}\n",
                "prompt", "tokens", "first call s", "warm median", "warm t/s"
            );
            for r in &prefill.rows {
                let name = r.prompt.map_or("synthetic".to_string(), |n| n.to_string());
                out += &format!(
                    "{:>9}  {:>7}  {:>12.3}  {:>10.3}s  {:>9.1}\n",
                    name,
                    r.prompt_tokens,
                    r.first_call_seconds,
                    r.median_seconds,
                    r.tokens_per_second
                );
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_prompts_repeat_the_prompts_ids_to_the_length() {
        let prompts = vec![vec![1, 2, 3], vec![], vec![4]];
        assert_eq!(synthetic_prompt(&prompts, 6), Some(vec![1, 2, 3, 4, 1, 2]));
        assert_eq!(synthetic_prompt(&prompts, 2), Some(vec![1, 2]));
        assert_eq!(synthetic_prompt(&[vec![]], 4), None);
    }

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
    }
}
