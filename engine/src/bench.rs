//! `dspec bench`: plain greedy decoding and speculative decoding on the same prompts in
//! one process, so the speedup is a ratio of runs under the same conditions; prefill
//! speed measured warm; and where the two greedy outputs differ, whether a rounding tie
//! explains it.
//!
//! Decode speed moves between runs of the same prompt in one process (on a GPU bound by
//! the host's work, by more than the gains a drafter is judged on), so each prompt runs
//! several passes, plain and speculative back to back, alternating which goes first. A
//! row reports the median pass of each, and its speedup is the median of the passes'
//! own ratios: the drift moves a pass's two runs together, and their ratio cancels it,
//! where a ratio of the two medians may set a fast plain pass against a slow speculative
//! one.

use std::io::Write;
use std::time::Instant;

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{Array, Dtype};
use serde::Serialize;

use dspec_plugin_api::{Drafter, TargetModel};

use crate::decoding::generate::{
    generate, logits_to_host, prefill, GenerationConfig, GenerationOutput, GenerationStats,
};
use crate::decoding::round_cost::{median, RoundCost};
use crate::decoding::sampling::SamplingParams;
use crate::decoding::speculative::VerifyAheadMode;
use crate::decoding::speculative::{
    generate_speculative, ServingOptions, Speculation, SpeculativeOutput, SpeculativeStats,
};
use crate::error::EngineError;
use crate::text::tokenizer::TextTokenizer;

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
    /// When rounds are queued ahead ([`Speculation::verify_ahead`], `--verify-ahead`).
    pub verify_ahead: VerifyAheadMode,
    /// Plain and speculative runs of each prompt (at least 1); rows report the medians.
    pub passes: usize,
    pub prefill: PrefillPlan,
    /// Also time plain decoding with these sampling settings in every pass, beside plain
    /// greedy (what the sampler costs); `None`, or greedy settings, skip it.
    pub sampled: Option<SamplingParams>,
}

/// What [`run_bench`] tells its caller as it goes, and asks it.
pub struct BenchHooks<'a> {
    /// Receives one JSON line per round of the timed speculative runs.
    pub trace: Option<&'a mut dyn Write>,
    /// Hears of each pass completed (its number, from 1).
    pub pass_done: &'a mut dyn FnMut(usize),
    /// Asked before each run: true ends the bench there, and the report covers the
    /// passes each prompt completed (a run cut short would time nothing real), with
    /// [`BenchReport::interrupted`] set.
    pub stop: &'a dyn Fn() -> bool,
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

/// Where plain and speculative greedy outputs first differ, and the plain target's
/// logits of both tokens there.
#[derive(Debug, Clone, Serialize)]
pub struct FirstDifference {
    /// Index of the first differing generated token.
    pub position: usize,
    /// `None` when that output ended before `position` (one output is a prefix of the other).
    pub plain_token: Option<u32>,
    pub speculative_token: Option<u32>,
    /// The two tokens' logits after the prompt and the common prefix, computed as plain
    /// decoding computes them (prefill, then one-token steps).
    pub plain_logit: Option<f32>,
    pub speculative_logit: Option<f32>,
    /// `plain_logit - speculative_logit`.
    pub margin: Option<f32>,
    /// The logits' dtype, which sets how far apart rounding alone can put two logits.
    pub logits_dtype: String,
    /// Largest margin classified as a near-tie; `None` where none is (f32): the larger of
    /// [`NEAR_TIE_ULPS`] units in the last place and twice `path_noise`.
    pub tolerance: Option<f32>,
    /// How far apart the two ways of computing the same logits land here: the largest
    /// difference over the vocabulary between this position's logits from one-token
    /// steps and from a batched forward of the last [`NOISE_PROBE_WIDTH`] positions (a
    /// verify's way). Rounding differences compound through the layers, so a flip may
    /// span more than the last rounding step; two logits each off by up to this much
    /// explain a margin of twice it. `None` where not measured (f32, or too early).
    pub path_noise: Option<f32>,
    /// The margin is within the logits' rounding: a batched verify rounding differently
    /// from a one-token step explains the difference. Otherwise a real mismatch.
    pub near_tie: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct BenchRow {
    pub prompt_tokens: usize,
    /// The prompt as token ids (after the chat template), so another engine can be
    /// run on exactly the same input.
    pub prompt_ids: Vec<u32>,
    /// Plain greedy decoding's output ids.
    pub tokens: Vec<u32>,
    /// The plain pass of median decode time (of an even count, the faster middle one).
    pub plain: GenerationStats,
    /// The speculative pass of median decode time, and its drafting.
    pub speculative: GenerationStats,
    pub drafting: SpeculativeStats,
    /// Decode tok/s of every pass, in the order run.
    pub plain_passes: Vec<f64>,
    pub speculative_passes: Vec<f64>,
    /// The median over passes of the speculative run's decode tok/s over the plain
    /// run's in the same pass.
    pub speedup: f64,
    /// Every speculative pass gave plain decoding's tokens.
    pub identical: bool,
    /// Where a speculative pass's output first differs from plain decoding's, when one
    /// does (a real mismatch before a near-tie).
    pub first_difference: Option<FirstDifference>,
}

#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub drafter: String,
    pub max_draft: usize,
    /// Draft lengths were chosen per round (`--max-draft auto`), `max_draft` at most.
    pub adaptive: bool,
    /// When rounds were queued ahead (`--verify-ahead`).
    pub verify_ahead: VerifyAheadMode,
    pub max_tokens: usize,
    /// Passes per prompt ([`BenchSettings::passes`]), or those the first prompt
    /// completed when [`interrupted`](Self::interrupted).
    pub passes: usize,
    /// The bench was stopped (Ctrl-C) before its last run: the rows cover the prompts
    /// that completed a pass, each over its completed passes.
    pub interrupted: bool,
    pub rows: Vec<BenchRow>,
    /// Over all prompts' median passes: generated tokens (after each first) / decode
    /// seconds.
    pub plain_tokens_per_second: f64,
    pub speculative_tokens_per_second: f64,
    /// The median over passes of all prompts' speculative decode rate over their plain
    /// rate in the same pass (see [`BenchRow::speedup`]).
    pub speedup: f64,
    /// Tokens committed per target forward over all prompts.
    pub tau: f64,
    /// What a round that drafted cost, medians over every such round of every timed
    /// speculative pass, against the plain step of the plain passes (their decode rate
    /// over all prompts): whether the drafter can pay on this machine. `None` when no
    /// round drafted.
    pub round_cost: Option<RoundCost>,
    pub all_identical: bool,
    /// Prompts whose outputs differ only at a near-tie.
    pub near_ties: usize,
    /// Prompts whose outputs differ where rounding cannot explain it: a bug.
    pub real_mismatches: usize,
    /// Absent when prefill was not measured (`--prefill-runs 0`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill: Option<PrefillReport>,
    /// Absent unless sampled decoding was asked for ([`BenchSettings::sampled`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sampled: Option<SampledReport>,
}

/// Plain sampled decoding, run in the same passes as plain greedy decoding.
#[derive(Debug, Clone, Serialize)]
pub struct SampledReport {
    pub sampling: SamplingParams,
    /// Per prompt, in the bench's order.
    pub rows: Vec<SampledRow>,
    /// Over all prompts' median passes: generated tokens (after each first) / decode
    /// seconds.
    pub tokens_per_second: f64,
    /// The median over passes of all prompts' sampled decode rate over their plain
    /// greedy rate in the same pass (as [`BenchRow::speedup`] is taken).
    pub over_greedy: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct SampledRow {
    /// The sampled pass of median decode time.
    pub stats: GenerationStats,
    /// Its output ids.
    pub tokens: Vec<u32>,
    /// Decode tok/s of every pass, in the order run.
    pub passes: Vec<f64>,
}

/// Runs every prompt plainly and speculatively (greedy), `passes` times each, after one
/// short warm-up of each so neither side pays first-call costs inside its timing. The
/// passes go over all prompts in turn, and alternate which of the two runs first, so a
/// drift in the machine's speed falls on both alike. Sampled plain decoding, when asked
/// for, runs between the two, so that it always sits next to plain greedy's run of the
/// same pass; with a seed, pass `n` samples with seed + `n`. Prefill is measured first, so each
/// prompt's first prefill is its first in the process. The trace in `hooks` gets the
/// rounds (as `generate --trace` writes them), so that round costs can be set against the
/// plain steps of the same process; `hooks` also hear of each pass and can stop the bench.
pub fn run_bench(
    model: &dyn TargetModel,
    tokenizer: &TextTokenizer,
    drafter: &mut dyn Drafter,
    prompts: &[Vec<u32>],
    settings: &BenchSettings,
    hooks: BenchHooks<'_>,
) -> Result<BenchReport, EngineError> {
    let BenchHooks {
        mut trace,
        pass_done,
        stop,
    } = hooks;
    let BenchSettings {
        max_tokens,
        max_draft,
        adaptive,
        verify_ahead,
        passes,
        ..
    } = *settings;
    if passes == 0 {
        return Err(EngineError::Invalid("--passes must be at least 1".into()));
    }
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
    let sampling = settings.sampled.clone().filter(|s| !s.is_greedy());
    let sampled_config = |pass: u64| {
        sampling.as_ref().map(|s| GenerationConfig {
            sampling: SamplingParams {
                seed: s.seed.map(|seed| seed.wrapping_add(pass)),
                ..s.clone()
            },
            ..config.clone()
        })
    };
    let speculative = |drafter: &mut dyn Drafter,
                       prompt: &[u32],
                       config: &GenerationConfig,
                       trace: Option<&mut dyn Write>| {
        let speculation = Speculation {
            drafter: &mut *drafter,
            max_draft,
            adaptive,
            trace: trace.map(|t| t as &mut dyn Write),
            verify_ahead,
        };
        generate_speculative(
            model,
            tokenizer,
            prompt,
            config,
            speculation,
            &mut |_| {},
            ServingOptions::default(),
        )
    };
    if let Some(first) = prompts.first() {
        let warm = GenerationConfig {
            max_tokens: max_tokens.min(8),
            ..config.clone()
        };
        generate(model, tokenizer, first, &warm, &mut |_| {})?;
        speculative(&mut *drafter, first, &warm, None)?;
        if let Some(sampled) = sampled_config(0) {
            let warm = GenerationConfig {
                max_tokens: warm.max_tokens,
                ..sampled
            };
            generate(model, tokenizer, first, &warm, &mut |_| {})?;
        }
    }
    let runs = || -> Vec<Vec<GenerationOutput>> { prompts.iter().map(|_| Vec::new()).collect() };
    let (mut plain_runs, mut sampled_runs) = (runs(), runs());
    let mut spec_runs: Vec<Vec<SpeculativeOutput>> = prompts.iter().map(|_| Vec::new()).collect();
    let mut interrupted = false;
    'passes: for pass in 0..passes {
        let sampled = sampled_config(pass as u64);
        // Sampled sits in the middle, next to plain greedy either way round.
        let order = match pass % 2 {
            0 => [Run::Plain, Run::Sampled, Run::Speculative],
            _ => [Run::Speculative, Run::Sampled, Run::Plain],
        };
        for (i, prompt) in prompts.iter().enumerate() {
            for run in order {
                if stop() {
                    interrupted = true;
                    break 'passes;
                }
                match (run, &sampled) {
                    (Run::Plain, _) => plain_runs[i].push(generate(
                        model,
                        tokenizer,
                        prompt,
                        &config,
                        &mut |_| {},
                    )?),
                    (Run::Sampled, Some(sampled)) => sampled_runs[i].push(generate(
                        model,
                        tokenizer,
                        prompt,
                        sampled,
                        &mut |_| {},
                    )?),
                    (Run::Sampled, None) => {}
                    (Run::Speculative, _) => spec_runs[i].push(speculative(
                        &mut *drafter,
                        prompt,
                        &config,
                        trace.as_mut().map(|t| &mut **t as &mut dyn Write),
                    )?),
                }
            }
        }
        pass_done(pass + 1);
    }
    // A pass counts for a prompt once all its runs are done; passes go over the prompts
    // in order, so the prompts with a complete pass come first.
    let completed: Vec<usize> = (0..prompts.len())
        .map(|i| {
            let sampled = match sampling.is_some() {
                true => sampled_runs[i].len(),
                false => usize::MAX,
            };
            plain_runs[i].len().min(spec_runs[i].len()).min(sampled)
        })
        .collect();
    let reported = completed.iter().take_while(|&&n| n > 0).count();
    if reported == 0 {
        return Err(EngineError::Invalid(
            "interrupted before any prompt finished a pass: nothing to report".into(),
        ));
    }
    let prompts = &prompts[..reported];
    for (i, &n) in completed.iter().enumerate() {
        plain_runs[i].truncate(n);
        sampled_runs[i].truncate(n);
        spec_runs[i].truncate(n);
    }
    plain_runs.truncate(reported);
    sampled_runs.truncate(reported);
    spec_runs.truncate(reported);
    let sampled = sampling
        .as_ref()
        .map(|params| sampled_report(params, &plain_runs, sampled_runs));
    let mut rows = Vec::new();
    // Per prompt, per pass: the plain and the speculative run's decoding.
    let mut paired_passes: Vec<Vec<(DecodeRun, DecodeRun)>> = Vec::new();
    let mut round_times = Vec::new();
    for ((prompt, plains), specs) in prompts.iter().zip(plain_runs).zip(spec_runs) {
        let plain_passes: Vec<f64> = plains
            .iter()
            .map(|p| p.stats.decode_tokens_per_second)
            .collect();
        let speculative_passes: Vec<f64> = specs
            .iter()
            .map(|s| s.stats.decode_tokens_per_second)
            .collect();
        let pairs = paired_runs(
            plains.iter().map(|p| &p.stats),
            specs.iter().map(|s| &s.stats),
        );
        let speedup = paired_ratio(&[pairs.as_slice()]);
        paired_passes.push(pairs);
        let plain = median_pass(plains, |p| p.stats.decode_seconds);
        // Passes that gave the same tokens share one check (a difference is classified
        // by running the target again).
        let mut outputs: Vec<&[u32]> = Vec::new();
        for spec in &specs {
            if !outputs.contains(&spec.tokens.as_slice()) {
                outputs.push(&spec.tokens);
            }
        }
        let mut first_difference: Option<FirstDifference> = None;
        for tokens in outputs {
            let found = self::first_difference(model, prompt, &plain.tokens, tokens)?;
            let worse = match (&first_difference, &found) {
                (None, Some(_)) => true,
                (Some(kept), Some(new)) => kept.near_tie && !new.near_tie,
                _ => false,
            };
            if worse {
                first_difference = found;
            }
        }
        round_times.extend(specs.iter().flat_map(|s| s.speculative.round_times.clone()));
        let spec = median_pass(specs, |s| s.stats.decode_seconds);
        rows.push(BenchRow {
            prompt_tokens: prompt.len(),
            prompt_ids: prompt.clone(),
            tokens: plain.tokens.clone(),
            speedup,
            identical: first_difference.is_none(),
            first_difference,
            plain: plain.stats,
            speculative: spec.stats,
            drafting: spec.speculative,
            plain_passes,
            speculative_passes,
        });
    }
    let plain_tps = decode_rate(rows.iter().map(|r| DecodeRun::of(&r.plain)));
    let spec_tps = decode_rate(rows.iter().map(|r| DecodeRun::of(&r.speculative)));
    let forwards: usize = rows.iter().map(|r| r.drafting.target_forwards).sum();
    let committed: usize = rows
        .iter()
        .map(|r| r.drafting.accepted_tokens + r.drafting.target_forwards)
        .sum();
    let differences = || rows.iter().filter_map(|r| r.first_difference.as_ref());
    Ok(BenchReport {
        drafter: drafter.name().to_string(),
        max_draft,
        adaptive,
        verify_ahead,
        max_tokens,
        passes: completed[0],
        interrupted,
        plain_tokens_per_second: plain_tps,
        speculative_tokens_per_second: spec_tps,
        speedup: paired_ratio(&paired_passes.iter().map(Vec::as_slice).collect::<Vec<_>>()),
        tau: committed as f64 / forwards.max(1) as f64,
        round_cost: RoundCost::of(&round_times)
            .map(|cost| cost.against(Some(1e3 / plain_tps.max(1e-9)))),
        all_identical: rows.iter().all(|r| r.identical),
        near_ties: differences().filter(|d| d.near_tie).count(),
        real_mismatches: differences().filter(|d| !d.near_tie).count(),
        prefill,
        sampled,
        rows,
    })
}

/// The sampled line from each prompt's plain greedy and sampled runs (the same passes
/// in the same order).
fn sampled_report(
    params: &SamplingParams,
    plain_runs: &[Vec<GenerationOutput>],
    sampled_runs: Vec<Vec<GenerationOutput>>,
) -> SampledReport {
    let paired: Vec<Vec<(DecodeRun, DecodeRun)>> = plain_runs
        .iter()
        .zip(&sampled_runs)
        .map(|(plains, sampled)| {
            paired_runs(
                plains.iter().map(|p| &p.stats),
                sampled.iter().map(|s| &s.stats),
            )
        })
        .collect();
    let rows: Vec<SampledRow> = sampled_runs
        .into_iter()
        .map(|runs| {
            let passes = runs
                .iter()
                .map(|r| r.stats.decode_tokens_per_second)
                .collect();
            let median = median_pass(runs, |r| r.stats.decode_seconds);
            SampledRow {
                stats: median.stats,
                tokens: median.tokens,
                passes,
            }
        })
        .collect();
    SampledReport {
        sampling: params.clone(),
        tokens_per_second: decode_rate(rows.iter().map(|r| DecodeRun::of(&r.stats))),
        over_greedy: paired_ratio(&paired.iter().map(Vec::as_slice).collect::<Vec<_>>()),
        rows,
    }
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

/// The runs of one prompt in a pass, in the order [`run_bench`] runs them.
#[derive(Clone, Copy)]
enum Run {
    Plain,
    Sampled,
    Speculative,
}

/// Two runs of each pass side by side, pass by pass.
fn paired_runs<'a>(
    first: impl Iterator<Item = &'a GenerationStats>,
    second: impl Iterator<Item = &'a GenerationStats>,
) -> Vec<(DecodeRun, DecodeRun)> {
    first
        .zip(second)
        .map(|(a, b)| (DecodeRun::of(a), DecodeRun::of(b)))
        .collect()
}

/// What one run decoded: tokens after the first, and the seconds they took.
#[derive(Debug, Clone, Copy)]
struct DecodeRun {
    tokens: usize,
    seconds: f64,
}

impl DecodeRun {
    fn of(stats: &GenerationStats) -> Self {
        Self {
            tokens: stats.generated_tokens.saturating_sub(1),
            seconds: stats.decode_seconds,
        }
    }
}

/// The median over passes of the second run's decode rate over the first's, each rate
/// summed over `prompts` (each prompt's `(plain, other)` run of every pass, passes in the
/// same order for every prompt): a speedup, or sampled decoding's rate against greedy's.
fn paired_ratio(prompts: &[&[(DecodeRun, DecodeRun)]]) -> f64 {
    let passes = prompts.iter().map(|p| p.len()).min().unwrap_or(0);
    let ratios: Vec<f64> = (0..passes)
        .map(|i| {
            let plain = decode_rate(prompts.iter().map(|p| p[i].0));
            let other = decode_rate(prompts.iter().map(|p| p[i].1));
            other / plain.max(1e-9)
        })
        .collect();
    median(&ratios).unwrap_or(0.0)
}

/// Tokens over seconds, summed over `runs`.
fn decode_rate(runs: impl Iterator<Item = DecodeRun>) -> f64 {
    let (tokens, seconds) = runs.fold((0, 0.0), |(t, s), r| (t + r.tokens, s + r.seconds));
    tokens as f64 / f64::max(seconds, 1e-9)
}

/// The run of median `seconds` among `runs` (not empty); of an even count, the faster
/// of the two middle ones.
fn median_pass<T>(mut runs: Vec<T>, seconds: impl Fn(&T) -> f64) -> T {
    runs.sort_by(|a, b| seconds(a).total_cmp(&seconds(b)));
    runs.swap_remove((runs.len() - 1) / 2)
}

/// Units in the last place a margin may span and still count as a rounding tie. A
/// verify and a one-token step compute each logit with a different summation order, so
/// each of the two logits may land a rounding step away from where the other path puts
/// it: one ulp on each side.
pub const NEAR_TIE_ULPS: f32 = 2.0;

/// The largest gap between two logits of magnitude up to `magnitude`, stored as `dtype`,
/// that rounding alone can explain: [`NEAR_TIE_ULPS`] units in the last place of
/// `magnitude` in that format. `None` for f32 and wider: dspec's f32 verify and step
/// compute every logit alike on the CPU backend (the tests check speculative greedy output
/// against plain greedy's, token for token, for every drafter), so there speculative
/// greedy must equal plain greedy token for token and no gap is excused.
pub fn rounding_tolerance(dtype: Dtype, magnitude: f32) -> Option<f32> {
    // Explicit mantissa bits, and the smallest normal exponent (below it the spacing is
    // that of the smallest normals).
    let (mantissa_bits, min_exponent) = match dtype {
        Dtype::Bfloat16 => (7, -126),
        Dtype::Float16 => (10, -14),
        _ => return None,
    };
    let magnitude = magnitude.abs();
    if !magnitude.is_finite() {
        return None;
    }
    // The binary exponent from the f32 bits: exact, where log2 can round across a power of two.
    let exponent = (((magnitude.to_bits() >> 23) & 0xff) as i32 - 127).max(min_exponent);
    Some(NEAR_TIE_ULPS * 2f32.powi(exponent - mantissa_bits))
}

/// Positions of the batched forward that measures [`FirstDifference::path_noise`].
pub const NOISE_PROBE_WIDTH: usize = 4;

/// Whether logits `a` and `b` of `dtype` are within rounding of each other.
pub fn is_near_tie(dtype: Dtype, a: f32, b: f32) -> bool {
    rounding_tolerance(dtype, a.abs().max(b.abs())).is_some_and(|tol| (a - b).abs() <= tol)
}

/// Compares plain and speculative greedy outputs of `prompt`; where they differ, runs the
/// target the way plain decoding does (prefill, then the common prefix one token at a
/// time) to get both tokens' logits at the first difference and classify it.
pub fn first_difference(
    model: &dyn TargetModel,
    prompt: &[u32],
    plain: &[u32],
    speculative: &[u32],
) -> Result<Option<FirstDifference>, EngineError> {
    let Some(position) = plain
        .iter()
        .zip(speculative)
        .position(|(a, b)| a != b)
        .or_else(|| (plain.len() != speculative.len()).then(|| plain.len().min(speculative.len())))
    else {
        return Ok(None);
    };
    let mut cache = model.new_cache();
    let mut logits = prefill(model, &mut cache, prompt)?;
    for &token in &plain[..position] {
        let step = model.forward(&Array::from_slice(&[token], &[1, 1]), &mut cache, &[])?;
        logits = step.logits.try_index((.., -1, ..))?;
        // One step at a time, as plain decoding evaluates them (a graph of the whole
        // prefix would also grow without bound).
        logits.eval()?;
    }
    let dtype = logits.dtype();
    let host = logits_to_host(&logits)?;
    let (plain_token, speculative_token) = (
        plain.get(position).copied(),
        speculative.get(position).copied(),
    );
    let logit = |t: Option<u32>| t.and_then(|t| host.get(t as usize).copied());
    let (plain_logit, speculative_logit) = (logit(plain_token), logit(speculative_token));
    let path_noise = match rounding_tolerance(dtype, 1.0) {
        Some(_) if position >= 2 => Some(path_noise(model, prompt, &plain[..position], &host)?),
        _ => None,
    };
    let (margin, tolerance, near_tie) = match (plain_logit, speculative_logit) {
        (Some(a), Some(b)) => {
            let tolerance = rounding_tolerance(dtype, a.abs().max(b.abs()))
                .map(|t| t.max(2.0 * path_noise.unwrap_or(0.0)));
            let near_tie = tolerance.is_some_and(|t| (a - b).abs() <= t);
            (Some(a - b), tolerance, near_tie)
        }
        _ => (None, None, false),
    };
    Ok(Some(FirstDifference {
        position,
        plain_token,
        speculative_token,
        plain_logit,
        speculative_logit,
        margin,
        logits_dtype: format!("{dtype:?}"),
        tolerance,
        path_noise,
        near_tie,
    }))
}

/// The largest difference between `stepped` (the logits after `prefix`, from one-token
/// steps) and the same logits from a batched forward over the last positions of `prefix`.
fn path_noise(
    model: &dyn TargetModel,
    prompt: &[u32],
    prefix: &[u32],
    stepped: &[f32],
) -> Result<f32, EngineError> {
    let start = prefix.len().saturating_sub(NOISE_PROBE_WIDTH);
    let mut context = prompt.to_vec();
    context.extend_from_slice(&prefix[..start]);
    let mut cache = model.new_cache();
    prefill(model, &mut cache, &context)?;
    let tail = &prefix[start..];
    let out = model.forward(
        &Array::from_slice(tail, &[1, tail.len() as i32]),
        &mut cache,
        &[],
    )?;
    let batched = logits_to_host(&out.logits.try_index((.., -1, ..))?)?;
    Ok(stepped
        .iter()
        .zip(&batched)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max))
}

impl FirstDifference {
    /// The table's last column.
    fn describe(&self) -> String {
        let what = if self.near_tie { "near-tie" } else { "DIFFER" };
        let tokens = |t: Option<u32>| t.map_or("end".to_string(), |t| t.to_string());
        let margin = match (self.margin, self.tolerance) {
            (Some(m), Some(tol)) => {
                format!(", margin {m:.4} (tie ≤ {tol:.4}, {})", self.logits_dtype)
            }
            (Some(m), None) => format!(", margin {m:.4} ({})", self.logits_dtype),
            _ => String::new(),
        };
        format!(
            "{what} at token {}: plain {} vs speculative {}{margin}",
            self.position,
            tokens(self.plain_token),
            tokens(self.speculative_token)
        )
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
            let same = match &r.first_difference {
                None => "identical".to_string(),
                Some(d) => d.describe(),
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
        let overall = match (self.real_mismatches, self.near_ties) {
            (0, 0) => "identical".to_string(),
            (0, n) => format!("{n} differ at near-ties only"),
            (m, _) => format!("OUTPUTS DIFFER ({m} real mismatches)"),
        };
        out += &format!(
            "all  {:>7}  {:>9}  {:>9.1}  {:>9.1}  {:>6.2}x  {:>5.2}  {}\n",
            "",
            "",
            self.plain_tokens_per_second,
            self.speculative_tokens_per_second,
            self.speedup,
            self.tau,
            overall
        );
        if self.passes > 1 {
            out += &format!(
                "(t/s: the median of {} passes; speedup: the median of the passes' own ratios, \
                 plain and speculative run back to back)\n",
                self.passes
            );
        }
        if let Some(cost) = &self.round_cost {
            out += &format!("\n{}\n", cost.describe(self.tau));
        }
        if let Some(sampled) = &self.sampled {
            out += &format!(
                "\nsampled plain decoding ({}): {:.1} t/s, {:.2}x plain greedy (the median of \
                 the passes' own ratios, the two run back to back)\n",
                describe_sampling(&sampled.sampling),
                sampled.tokens_per_second,
                sampled.over_greedy
            );
        }
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

/// The sampling settings that differ from plain sampling, as the flags name them.
fn describe_sampling(p: &SamplingParams) -> String {
    let mut parts = vec![format!("temperature {}", p.temperature)];
    if p.top_k > 0 {
        parts.push(format!("top-k {}", p.top_k));
    }
    if p.top_p < 1.0 {
        parts.push(format!("top-p {}", p.top_p));
    }
    if p.min_p > 0.0 {
        parts.push(format!("min-p {}", p.min_p));
    }
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(tokens: usize, tokens_per_second: f64) -> DecodeRun {
        DecodeRun {
            tokens,
            seconds: tokens as f64 / tokens_per_second,
        }
    }

    /// Passes whose speed drifts (both runs of a pass alike) still show the speedup each
    /// pass had; the ratio of the two medians would set the fastest plain pass against a
    /// slower speculative one.
    #[test]
    fn the_speedup_is_the_median_of_the_passes_own_ratios() {
        let drift = [1.0, 1.6, 0.7, 1.3, 0.8];
        let pairs: Vec<(DecodeRun, DecodeRun)> = drift
            .iter()
            .enumerate()
            .map(|(i, d)| {
                // Every pass 1.2x, except one at 1.5x.
                let ratio = if i == 3 { 1.5 } else { 1.2 };
                (run(100, 300.0 * d), run(100, 300.0 * d * ratio))
            })
            .collect();
        assert!((paired_ratio(&[&pairs]) - 1.2).abs() < 1e-9);
        // Over several prompts a pass's rate is its prompts' tokens over their seconds.
        let short: Vec<(DecodeRun, DecodeRun)> = drift
            .iter()
            .map(|d| (run(10, 100.0 * d), run(10, 100.0 * d * 3.0)))
            .collect();
        // Pass 0: plain 110 tokens in 1/3 + 1/10 s, speculative in 1/3.6 + 1/30 s.
        let expected = (1.0 / 3.0 + 0.1) / (1.0 / 3.6 + 1.0 / 30.0);
        let got = paired_ratio(&[&pairs, &short]);
        assert!((got - expected).abs() < 1e-9, "{got} vs {expected}");
        assert_eq!(paired_ratio(&[]), 0.0);
    }

    #[test]
    fn bf16_and_f16_ties_are_two_ulps_of_the_larger_magnitude() {
        // bf16 keeps 8 significant bits: in [16, 32) a step is 2^(4-7) = 0.125.
        assert_eq!(rounding_tolerance(Dtype::Bfloat16, 20.0), Some(0.25));
        assert!(is_near_tie(Dtype::Bfloat16, 20.25, 20.0));
        assert!(
            is_near_tie(Dtype::Bfloat16, 20.0, 20.25),
            "order does not matter"
        );
        assert!(!is_near_tie(Dtype::Bfloat16, 20.375, 20.0));
        // At a power of two the step is that of the larger magnitude's binade.
        assert_eq!(rounding_tolerance(Dtype::Bfloat16, 32.0), Some(0.5));
        assert_eq!(rounding_tolerance(Dtype::Bfloat16, 31.875), Some(0.25));
        // Negative logits: the magnitude counts.
        assert!(is_near_tie(Dtype::Bfloat16, -3.0, -3.03125));
        // f16 keeps 11 significant bits: in [16, 32) a step is 2^(4-10).
        assert_eq!(rounding_tolerance(Dtype::Float16, 20.0), Some(2.0 / 64.0));
        assert!(is_near_tie(Dtype::Float16, 20.03125, 20.0));
        assert!(!is_near_tie(Dtype::Bfloat16, 1.0, 0.0));
        // Tiny magnitudes: the spacing bottoms out at the smallest normals', never 0.
        assert!(rounding_tolerance(Dtype::Float16, 0.0).is_some_and(|t| t > 0.0));
        assert!(is_near_tie(Dtype::Bfloat16, 0.0, 0.0));
    }

    #[test]
    fn f32_differences_are_never_ties() {
        assert_eq!(rounding_tolerance(Dtype::Float32, 20.0), None);
        assert!(!is_near_tie(Dtype::Float32, 20.0, 20.0));
        assert!(!is_near_tie(
            Dtype::Float32,
            20.0 + 16.0 * f32::EPSILON,
            20.0
        ));
        assert!(!is_near_tie(Dtype::Bfloat16, f32::NAN, 1.0));
        assert!(!is_near_tie(Dtype::Bfloat16, f32::INFINITY, 1.0));
    }

    #[test]
    fn synthetic_prompts_repeat_the_prompts_ids_to_the_length() {
        let prompts = vec![vec![1, 2, 3], vec![], vec![4]];
        assert_eq!(synthetic_prompt(&prompts, 6), Some(vec![1, 2, 3, 4, 1, 2]));
        assert_eq!(synthetic_prompt(&prompts, 2), Some(vec![1, 2]));
        assert_eq!(synthetic_prompt(&[vec![]], 4), None);
    }
}
