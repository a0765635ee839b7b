//! Sampling is exact: the first three generated tokens are distributed exactly as the
//! target's own sampling distribution says, for plain decoding (drawn on the device,
//! pipelined) and for speculative decoding whatever the drafter (rejection sampling on
//! the device).
//!
//! The exact joint distribution P(t1, t2, t3) is computed on the host by the reference
//! `probabilities` from the target's logits (temperature, top-k) with one forward per
//! prefix; samples (fixed seeds) are tested against it with Pearson's chi-square. Threshold: the
//! statistic must stay below the chi-square quantile at p = 0.001 for its degrees of
//! freedom (Wilson–Hilferty approximation). A loop that skipped the residual
//! distribution, or accepted drafts unconditionally, fails this by orders of magnitude.

use std::collections::HashMap;

use mlx_rs::Array;

use dspec_engine::decoding::drafting::load_drafter;
use dspec_engine::decoding::generate::{generate, logits_to_host, GenerationConfig};
use dspec_engine::decoding::sampling::{probabilities, SamplingParams};
use dspec_engine::decoding::speculative::{generate_speculative, Speculation};
use dspec_engine::loading::{builtin_registry, LoadedModel};
use dspec_engine::tiny_model::write_tiny_model;
use dspec_plugin_api::error::Result as ModelResult;
use dspec_plugin_api::{Draft, Drafter, DrafterOptions, LoadOptions, TargetModel, TokenPicker};

mod common;
use common::load_dir as load;

const SAMPLES: usize = 2000;

fn params(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 1.5,
        top_k: 3,
        seed: Some(seed),
        ..SamplingParams::default()
    }
}

/// The target's processed next-token distribution after `ids` (no cache reuse: exact).
fn next_distribution(model: &dyn TargetModel, ids: &[u32], params: &SamplingParams) -> Vec<f32> {
    let mut cache = model.new_cache();
    let out = model
        .forward(
            &Array::from_slice(ids, &[1, ids.len() as i32]),
            &mut cache,
            &[],
        )
        .unwrap();
    let vocab = model.info().vocab_size;
    let all = logits_to_host(&out.logits).unwrap();
    probabilities(&all[all.len() - vocab..], params)
}

/// Exact P(t1, t2, t3) after `prompt`, over sequences of nonzero probability.
fn exact_joint(
    model: &dyn TargetModel,
    prompt: &[u32],
    params: &SamplingParams,
) -> HashMap<[u32; 3], f64> {
    let support = |p: &[f32]| -> Vec<(u32, f64)> {
        p.iter()
            .enumerate()
            .filter(|(_, &x)| x > 0.0)
            .map(|(i, &x)| (i as u32, f64::from(x)))
            .collect()
    };
    let mut joint = HashMap::new();
    let p1 = next_distribution(model, prompt, params);
    for (a, pa) in support(&p1) {
        let mut ids = prompt.to_vec();
        ids.push(a);
        for (b, pb) in support(&next_distribution(model, &ids, params)) {
            ids.push(b);
            for (c, pc) in support(&next_distribution(model, &ids, params)) {
                joint.insert([a, b, c], pa * pb * pc);
            }
            ids.pop();
        }
    }
    joint
}

/// Pearson's statistic and the p = 0.001 critical value for its degrees of freedom.
/// Bins expected to hold fewer than 5 samples are pooled into one.
fn chi_square(expected: &HashMap<[u32; 3], f64>, seen: &HashMap<[u32; 3], usize>) -> (f64, f64) {
    let n = seen.values().sum::<usize>() as f64;
    let (mut stat, mut bins) = (0.0, 0usize);
    let (mut pooled_e, mut pooled_o) = (0.0, 0.0);
    for (key, &p) in expected {
        let e = p * n;
        let o = *seen.get(key).unwrap_or(&0) as f64;
        if e < 5.0 {
            pooled_e += e;
            pooled_o += o;
        } else {
            stat += (o - e).powi(2) / e;
            bins += 1;
        }
    }
    let impossible: usize = seen
        .iter()
        .filter(|(k, _)| !expected.contains_key(*k))
        .map(|(_, &c)| c)
        .sum();
    assert_eq!(
        impossible, 0,
        "speculative sampling produced sequences the target gives zero probability"
    );
    if pooled_e > 0.0 {
        stat += (pooled_o - pooled_e).powi(2) / pooled_e;
        bins += 1;
    }
    let df = (bins - 1) as f64;
    // Wilson–Hilferty: chi2_q ≈ df (1 − 2/(9df) + z √(2/(9df)))³ with z(0.999) = 3.0902.
    let k = 2.0 / (9.0 * df);
    let critical = df * (1.0 - k + 3.0902 * k.sqrt()).powi(3);
    (stat, critical)
}

/// Proposes a fixed one-hot continuation: the target's greedy path, whatever was
/// actually sampled (so drafts are sometimes likely, sometimes impossible).
struct FixedDrafter {
    path: Vec<u32>,
    seen: usize,
}

impl Drafter for FixedDrafter {
    fn name(&self) -> &str {
        "fixed"
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
        let tokens = self
            .path
            .iter()
            .skip(self.seen + 1)
            .take(max_k)
            .copied()
            .collect();
        Ok(Draft {
            tokens,
            probs: None,
        })
    }
    fn commit(&mut self, verified: &[u32], _: Option<&Array>) -> ModelResult<()> {
        self.seen += verified.len();
        Ok(())
    }
}

fn sample_joint(
    target: &LoadedModel,
    drafter: &mut dyn Drafter,
    prompt: &[u32],
    seed: u64,
) -> (HashMap<[u32; 3], usize>, usize, usize) {
    let mut seen = HashMap::new();
    let (mut drafted, mut accepted) = (0, 0);
    for i in 0..SAMPLES {
        let cfg = GenerationConfig {
            max_tokens: 3,
            sampling: params(seed * 1_000_003 + i as u64),
            stop_strings: Vec::new(),
            eos_ids: Vec::new(),
        };
        let out = generate_speculative(
            target.model.as_ref(),
            &target.tokenizer,
            prompt,
            &cfg,
            Speculation {
                drafter: &mut *drafter,
                max_draft: 2,
                adaptive: false,
                trace: None,
            },
            &mut |_| {},
        )
        .unwrap();
        drafted += out.speculative.drafted_tokens;
        accepted += out.speculative.accepted_tokens;
        let key = [out.tokens[0], out.tokens[1], out.tokens[2]];
        *seen.entry(key).or_insert(0) += 1;
    }
    (seen, drafted, accepted)
}

#[test]
fn speculative_sampling_matches_the_targets_distribution() {
    let root = tempfile::tempdir().unwrap();
    let (t, d) = (root.path().join("t"), root.path().join("d"));
    write_tiny_model(&t, "{}", 8).unwrap();
    // The target's own weights, loaded 4-bit: q close to p but not equal, so drafts
    // are both accepted and rejected (an unrelated random model's top-3 never meets
    // the target's).
    write_tiny_model(&d, "{}", 8).unwrap();
    let target = load(&t);
    let prompt = target.tokenizer.encode_prompt("ab", false).unwrap();
    let expected = exact_joint(target.model.as_ref(), &prompt, &params(0));
    assert!(expected.len() >= 9, "top-3 sampling has a real choice");

    // One-hot drafts (no probabilities).
    let greedy_path: Vec<u32> = {
        let mut ids = prompt.clone();
        let mut path = Vec::new();
        for _ in 0..4 {
            let p = next_distribution(target.model.as_ref(), &ids, &params(0));
            let best = dspec_engine::decoding::sampling::argmax(&p);
            path.push(best);
            ids.push(best);
        }
        path
    };
    let mut fixed = FixedDrafter {
        path: greedy_path,
        seen: 0,
    };
    let (seen, drafted, accepted) = sample_joint(&target, &mut fixed, &prompt, 1);
    assert!(
        drafted > 0 && accepted > 0 && accepted < drafted,
        "{accepted}/{drafted}"
    );
    let (stat, critical) = chi_square(&expected, &seen);
    assert!(
        stat < critical,
        "one-hot drafter: chi-square {stat:.1} ≥ {critical:.1}"
    );

    // A draft model sampling from its own distribution q (probabilities attached).
    let mut model_drafter = load_drafter(
        &format!("model:{}", d.display()),
        &target,
        &builtin_registry().unwrap(),
        &LoadOptions::default(),
        &DrafterOptions {
            bits: Some(4),
            ..DrafterOptions::default()
        },
    )
    .unwrap();
    let (seen, drafted, accepted) = sample_joint(&target, model_drafter.as_mut(), &prompt, 2);
    assert!(
        drafted > 0 && accepted > 0 && accepted < drafted,
        "{accepted}/{drafted}"
    );
    let (stat, critical) = chi_square(&expected, &seen);
    assert!(
        stat < critical,
        "draft model: chi-square {stat:.1} ≥ {critical:.1}"
    );
}

/// Plain decoding's device sampling draws from the reference distribution: the same
/// chi-square test over runs of three tokens, each run with its own seed. A lower
/// temperature than the speculative test's and top-p on the top-k set: the tiny
/// model's top logits are close, and sharper distributions make a wrong temperature
/// or filter show.
#[test]
fn plain_sampling_matches_the_targets_distribution() {
    let plain_params = |seed: u64| SamplingParams {
        temperature: 0.6,
        top_k: 3,
        top_p: 0.75,
        seed: Some(seed),
        ..SamplingParams::default()
    };
    let root = tempfile::tempdir().unwrap();
    write_tiny_model(root.path(), "{}", 8).unwrap();
    let target = load(root.path());
    let prompt = target.tokenizer.encode_prompt("ab", false).unwrap();
    let expected = exact_joint(target.model.as_ref(), &prompt, &plain_params(0));
    assert!(expected.len() >= 4, "the filters leave a real choice");
    let mut seen = HashMap::new();
    for i in 0..SAMPLES {
        let cfg = GenerationConfig {
            max_tokens: 3,
            sampling: plain_params(3 * 1_000_003 + i as u64),
            stop_strings: Vec::new(),
            eos_ids: Vec::new(),
        };
        let out = generate(
            target.model.as_ref(),
            &target.tokenizer,
            &prompt,
            &cfg,
            &mut |_| {},
        )
        .unwrap();
        let key = [out.tokens[0], out.tokens[1], out.tokens[2]];
        *seen.entry(key).or_insert(0) += 1;
    }
    let (stat, critical) = chi_square(&expected, &seen);
    assert!(
        stat < critical,
        "plain sampling: chi-square {stat:.1} ≥ {critical:.1}"
    );
}
