//! The check that speculative sampling is exact: the exact joint distribution of the
//! first three generated tokens, computed on the host from the target's logits
//! (temperature, top-k) with one forward per prefix, against samples of speculative
//! runs (fixed seeds), with Pearson's chi-square. Threshold: the statistic must stay
//! below the chi-square quantile at p = 0.001 for its degrees of freedom
//! (Wilson–Hilferty approximation). A loop that skipped the residual distribution, or
//! accepted drafts unconditionally, fails this by orders of magnitude.

use std::collections::HashMap;

use mlx_rs::Array;

use dspec_engine::decoding::generate::{logits_to_host, GenerationConfig};
use dspec_engine::decoding::sampling::{argmax, probabilities, SamplingParams};
use dspec_engine::decoding::speculative::VerifyAheadMode;
use dspec_engine::decoding::speculative::{generate_speculative, ServingOptions, Speculation};
use dspec_engine::loading::LoadedModel;
use dspec_plugin_api::error::Result as ModelResult;
use dspec_plugin_api::{Draft, Drafter, TargetModel, TokenPicker};

/// Speculative runs sampled per drafter.
pub const SAMPLES: usize = 2000;

/// Sampling with a real choice among three tokens per position, flattened so that the
/// tiny models' top logits are not too far apart.
pub fn params(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 1.5,
        top_k: 3,
        seed: Some(seed),
        ..SamplingParams::default()
    }
}

/// The target's processed next-token distribution after `ids` (no cache reuse: exact).
pub fn next_distribution(
    model: &dyn TargetModel,
    ids: &[u32],
    params: &SamplingParams,
) -> Vec<f32> {
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
pub fn exact_joint(
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

/// The target's most likely `n` tokens after `prompt`, one after the other.
pub fn greedy_path(model: &dyn TargetModel, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut ids = prompt.to_vec();
    let mut path = Vec::new();
    for _ in 0..n {
        let best = argmax(&next_distribution(model, &ids, &params(0)));
        path.push(best);
        ids.push(best);
    }
    path
}

/// Pearson's statistic and the p = 0.001 critical value for its degrees of freedom.
/// Bins expected to hold fewer than 5 samples are pooled into one.
pub fn chi_square(
    expected: &HashMap<[u32; 3], f64>,
    seen: &HashMap<[u32; 3], usize>,
) -> (f64, f64) {
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
/// actually sampled (so drafts are sometimes likely, sometimes impossible). Its q is
/// one-hot, as n-gram's is.
pub struct FixedDrafter {
    pub path: Vec<u32>,
    pub seen: usize,
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
            ..Draft::default()
        })
    }
    fn commit(&mut self, verified: &[u32], _: Option<&Array>) -> ModelResult<()> {
        self.seen += verified.len();
        Ok(())
    }
}

/// How often each first three tokens came out of [`SAMPLES`] speculative runs with up
/// to `max_draft` drafts a round, and the drafts made and kept in all.
pub fn sample_joint(
    target: &LoadedModel,
    drafter: &mut dyn Drafter,
    prompt: &[u32],
    seed: u64,
    max_draft: usize,
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
                max_draft,
                adaptive: false,
                trace: None,
                verify_ahead: VerifyAheadMode::Always,
            },
            &mut |_| {},
            ServingOptions::default(),
        )
        .unwrap();
        drafted += out.speculative.drafted_tokens;
        accepted += out.speculative.accepted_tokens;
        let key = [out.tokens[0], out.tokens[1], out.tokens[2]];
        *seen.entry(key).or_insert(0) += 1;
    }
    (seen, drafted, accepted)
}

/// Samples `drafter` on `target` and checks the first three tokens' distribution
/// against `expected`, and that drafts were both kept and rejected (else the check
/// says nothing about acceptance). `what` names the drafter in failures.
pub fn assert_lossless(
    target: &LoadedModel,
    drafter: &mut dyn Drafter,
    prompt: &[u32],
    expected: &HashMap<[u32; 3], f64>,
    seed: u64,
    what: &str,
) {
    let (seen, drafted, accepted) = sample_joint(target, drafter, prompt, seed, 2);
    assert!(
        drafted > 0 && accepted > 0 && accepted < drafted,
        "{what}: {accepted} of {drafted} drafts kept"
    );
    let (stat, critical) = chi_square(expected, &seen);
    assert!(
        stat < critical,
        "{what}: chi-square {stat:.1} ≥ {critical:.1}"
    );
}
