//! Token sampling: the exact distribution a request draws from (temperature, top-k, top-p,
//! min-p) and a seeded sampler, shared by plain decoding and lossless speculative acceptance.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 (or less) means greedy.
    pub temperature: f32,
    /// Keep only the k most likely tokens; 0 = off.
    pub top_k: usize,
    /// Keep the smallest most-likely set with at least this mass; 1.0 = off.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one; 0.0 = off.
    pub min_p: f32,
    /// Fixed seed for reproducible sampling; `None` seeds from the OS.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
        }
    }
}

impl SamplingParams {
    pub fn is_greedy(&self) -> bool {
        self.temperature.is_nan() || self.temperature <= 0.0
    }
}

/// Index of the largest logit; ties go to the lowest id, NaN never wins.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best: Option<(usize, f32)> = None;
    for (i, &x) in logits.iter().enumerate() {
        if x.is_nan() {
            continue;
        }
        if best.is_none_or(|(_, b)| x > b) {
            best = Some((i, x));
        }
    }
    best.map_or(0, |(i, _)| i as u32)
}

fn one_hot(len: usize, index: u32) -> Vec<f32> {
    let mut probs = vec![0.0; len];
    if let Some(p) = probs.get_mut(index as usize) {
        *p = 1.0;
    }
    probs
}

/// The distribution the sampler draws from for these logits, zeros outside the kept set.
///
/// softmax(logits / temperature) in f64, then top-k, then top-p on the renormalised
/// top-k set, then min-p, renormalised at the end. Greedy gives a one-hot on [`argmax`].
/// Ties in rank (for top-k/top-p) are broken towards the lower id.
pub fn probabilities(logits: &[f32], params: &SamplingParams) -> Vec<f32> {
    if logits.is_empty() {
        return Vec::new();
    }
    if params.is_greedy() {
        return one_hot(logits.len(), argmax(logits));
    }
    let temperature = f64::from(params.temperature);
    let scaled: Vec<f64> = logits
        .iter()
        .map(|&x| {
            if x.is_nan() {
                f64::NEG_INFINITY
            } else {
                f64::from(x) / temperature
            }
        })
        .collect();
    let max = scaled.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let mut probs: Vec<f64> = if max == f64::INFINITY {
        // Infinite logits share all the mass.
        scaled
            .iter()
            .map(|&s| if s == f64::INFINITY { 1.0 } else { 0.0 })
            .collect()
    } else if max == f64::NEG_INFINITY {
        return one_hot(logits.len(), argmax(logits));
    } else {
        scaled.iter().map(|&s| (s - max).exp()).collect()
    };

    let mut order: Vec<usize> = (0..probs.len()).collect();
    // Stable sort keeps lower ids first among equal probabilities.
    order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));

    if params.top_k > 0 && params.top_k < probs.len() {
        for &i in &order[params.top_k..] {
            probs[i] = 0.0;
        }
    }

    let top_p = f64::from(params.top_p);
    if top_p < 1.0 {
        let threshold = top_p * probs.iter().sum::<f64>();
        let mut mass = 0.0;
        let mut reached = false;
        for &i in &order {
            if reached {
                probs[i] = 0.0;
            } else if probs[i] > 0.0 {
                mass += probs[i];
                reached = mass >= threshold;
            }
        }
    }

    let min_p = f64::from(params.min_p);
    if min_p > 0.0 {
        // The ratio to the top probability does not depend on normalisation.
        let cutoff = min_p * probs[order[0]];
        for p in probs.iter_mut() {
            if *p < cutoff {
                *p = 0.0;
            }
        }
    }

    let total: f64 = probs.iter().sum();
    probs.iter().map(|&p| (p / total) as f32).collect()
}

/// Draws tokens with a seeded ChaCha8 generator.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = match params.seed {
            Some(seed) => ChaCha8Rng::seed_from_u64(seed),
            None => ChaCha8Rng::from_os_rng(),
        };
        Self { params, rng }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Greedy parameters take the argmax without touching the random stream.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.is_greedy() {
            return argmax(logits);
        }
        let probs = probabilities(logits, &self.params);
        self.sample_from(&probs)
    }

    /// Draws from a given distribution (it need not sum to exactly 1). Tokens with zero,
    /// negative or non-finite weight are never drawn; with no positive weight at all this
    /// falls back to the argmax.
    pub fn sample_from(&mut self, probs: &[f32]) -> u32 {
        let weight = |p: f32| {
            if p.is_finite() && p > 0.0 {
                f64::from(p)
            } else {
                0.0
            }
        };
        let total: f64 = probs.iter().map(|&p| weight(p)).sum();
        if total <= 0.0 {
            return argmax(probs);
        }
        let target = self.uniform() * total;
        let mut cumulative = 0.0;
        let mut last_positive = 0;
        for (i, &p) in probs.iter().enumerate() {
            let w = weight(p);
            if w == 0.0 {
                continue;
            }
            cumulative += w;
            last_positive = i;
            if target < cumulative {
                return i as u32;
            }
        }
        // Rounding can leave `target` a hair above the last cumulative sum.
        last_positive as u32
    }

    /// A uniform draw from [0, 1), from the same stream as the samples.
    pub fn uniform(&mut self) -> f64 {
        self.rng.random::<f64>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            seed: Some(1234),
        }
    }

    /// Logits whose softmax at temperature 1 is exactly [0.1, 0.2, 0.3, 0.4].
    fn ladder() -> Vec<f32> {
        [1.0f32, 2.0, 3.0, 4.0].iter().map(|p| p.ln()).collect()
    }

    fn assert_close(actual: &[f32], expected: &[f64]) {
        assert_eq!(actual.len(), expected.len());
        for (a, e) in actual.iter().zip(expected) {
            assert!(
                (f64::from(*a) - e).abs() < 1e-6,
                "{actual:?} vs {expected:?}"
            );
        }
    }

    #[test]
    fn default_is_greedy() {
        let p = SamplingParams::default();
        assert!(p.is_greedy());
        assert_eq!((p.top_k, p.top_p, p.min_p, p.seed), (0, 1.0, 0.0, None));
        assert!(!params(0.7, 0, 1.0, 0.0).is_greedy());
        assert!(params(f32::NAN, 0, 1.0, 0.0).is_greedy());
    }

    #[test]
    fn argmax_ties_and_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, -1.0, f32::NAN]), 1);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
        assert_close(
            &probabilities(&[1.0, 3.0, 3.0, 2.0], &SamplingParams::default()),
            &[0.0, 1.0, 0.0, 0.0],
        );
    }

    #[test]
    fn softmax_and_temperature() {
        assert_close(
            &probabilities(&ladder(), &params(1.0, 0, 1.0, 0.0)),
            &[0.1, 0.2, 0.3, 0.4],
        );
        // Temperature 0.5 squares the probabilities: [1, 4, 9, 16] / 30.
        assert_close(
            &probabilities(&ladder(), &params(0.5, 0, 1.0, 0.0)),
            &[1.0 / 30.0, 4.0 / 30.0, 9.0 / 30.0, 16.0 / 30.0],
        );
        // Temperature 2 takes square roots.
        let roots: Vec<f64> = [1.0f64, 2.0, 3.0, 4.0].iter().map(|x| x.sqrt()).collect();
        let sum: f64 = roots.iter().sum();
        let expected: Vec<f64> = roots.iter().map(|r| r / sum).collect();
        assert_close(
            &probabilities(&ladder(), &params(2.0, 0, 1.0, 0.0)),
            &expected,
        );
        // Huge logits must not overflow, -inf and NaN get nothing.
        assert_close(
            &probabilities(
                &[1000.0, 1000.0, f32::NEG_INFINITY, f32::NAN],
                &params(1.0, 0, 1.0, 0.0),
            ),
            &[0.5, 0.5, 0.0, 0.0],
        );
        assert_close(
            &probabilities(&[0.0, f32::INFINITY, 5.0], &params(1.0, 0, 1.0, 0.0)),
            &[0.0, 1.0, 0.0],
        );
    }

    #[test]
    fn top_k_support() {
        assert_close(
            &probabilities(&ladder(), &params(1.0, 2, 1.0, 0.0)),
            &[0.0, 0.0, 3.0 / 7.0, 4.0 / 7.0],
        );
        assert_close(
            &probabilities(&ladder(), &params(1.0, 1, 1.0, 0.0)),
            &[0.0, 0.0, 0.0, 1.0],
        );
        // k at or above the vocabulary is off.
        assert_close(
            &probabilities(&ladder(), &params(1.0, 4, 1.0, 0.0)),
            &[0.1, 0.2, 0.3, 0.4],
        );
        // Equal logits at the cut: the lower id stays.
        assert_close(
            &probabilities(&[0.0, 1.0, 1.0, 1.0], &params(1.0, 2, 1.0, 0.0)),
            &[0.0, 0.5, 0.5, 0.0],
        );
    }

    #[test]
    fn top_p_support() {
        // Sorted masses 0.4, 0.3, 0.2, 0.1; cumulative 0.4, 0.7, 0.9, 1.0.
        let cases: [(f32, &[f64]); 5] = [
            (0.35, &[0.0, 0.0, 0.0, 1.0]),
            (0.65, &[0.0, 0.0, 3.0 / 7.0, 4.0 / 7.0]),
            (0.75, &[0.0, 2.0 / 9.0, 3.0 / 9.0, 4.0 / 9.0]),
            (0.95, &[0.1, 0.2, 0.3, 0.4]),
            (0.0, &[0.0, 0.0, 0.0, 1.0]),
        ];
        for (top_p, expected) in cases {
            assert_close(
                &probabilities(&ladder(), &params(1.0, 0, top_p, 0.0)),
                expected,
            );
        }
    }

    #[test]
    fn min_p_support() {
        // Threshold 0.6 * 0.4 = 0.24 keeps 0.3 and 0.4.
        assert_close(
            &probabilities(&ladder(), &params(1.0, 0, 1.0, 0.6)),
            &[0.0, 0.0, 3.0 / 7.0, 4.0 / 7.0],
        );
        // Threshold 0.45 * 0.4 = 0.18 keeps 0.2 too.
        assert_close(
            &probabilities(&ladder(), &params(1.0, 0, 1.0, 0.45)),
            &[0.0, 2.0 / 9.0, 3.0 / 9.0, 4.0 / 9.0],
        );
    }

    #[test]
    fn filters_apply_in_order_top_k_then_top_p_then_min_p() {
        // top-k 2 leaves [3/7, 4/7]; top-p 0.5 on that keeps only 4/7. Applying top-p to the
        // unfiltered distribution first would have kept two tokens.
        assert_close(
            &probabilities(&ladder(), &params(1.0, 2, 0.5, 0.0)),
            &[0.0, 0.0, 0.0, 1.0],
        );
        // top-k 3 → [2, 3, 4]/9; top-p 0.8 keeps all three (4/9 + 3/9 < 0.8);
        // min-p 0.6 drops 2/9 < 0.6 * 4/9.
        assert_close(
            &probabilities(&ladder(), &params(1.0, 3, 0.8, 0.6)),
            &[0.0, 0.0, 3.0 / 7.0, 4.0 / 7.0],
        );
    }

    /// Empirical frequencies over `n` draws against `probs`: each count is binomial, so its
    /// frequency has standard deviation sqrt(p(1-p)/n); 4 standard deviations leaves a
    /// false-failure chance of about 6e-5 per token for an arbitrary seed. Zero-probability
    /// tokens must never be drawn.
    fn assert_frequencies(counts: &[usize], probs: &[f32], n: usize) {
        for (i, (&count, &p)) in counts.iter().zip(probs).enumerate() {
            let p = f64::from(p);
            let freq = count as f64 / n as f64;
            if p == 0.0 {
                assert_eq!(count, 0, "token {i} has probability 0 but was drawn");
                continue;
            }
            let tolerance = 4.0 * (p * (1.0 - p) / n as f64).sqrt();
            assert!(
                (freq - p).abs() <= tolerance,
                "token {i}: frequency {freq} vs probability {p} (tolerance {tolerance})"
            );
        }
    }

    #[test]
    fn draws_follow_the_distribution() {
        let logits = [0.5f32, -1.0, 2.0, 1.2, 0.0];
        let n = 200_000;
        for p in [
            params(1.0, 0, 1.0, 0.0),
            params(0.7, 0, 1.0, 0.0),
            params(1.3, 3, 1.0, 0.0),
            params(1.0, 0, 0.8, 0.0),
            params(1.0, 0, 1.0, 0.2),
        ] {
            let probs = probabilities(&logits, &p);
            let mut sampler = Sampler::new(p.clone());
            let mut counts = [0usize; 5];
            for _ in 0..n {
                counts[sampler.sample(&logits) as usize] += 1;
            }
            assert_frequencies(&counts, &probs, n);
        }
    }

    #[test]
    fn sample_from_unnormalised_and_sparse() {
        let mut sampler = Sampler::new(params(1.0, 0, 1.0, 0.0));
        let n = 200_000;
        let weights = [1.0f32, 0.0, 3.0, f32::NAN, -2.0];
        let mut counts = [0usize; 5];
        for _ in 0..n {
            counts[sampler.sample_from(&weights) as usize] += 1;
        }
        assert_frequencies(&counts, &[0.25, 0.0, 0.75, 0.0, 0.0], n);
        // A trailing zero is never returned, even for draws near 1.
        for _ in 0..10_000 {
            assert_ne!(sampler.sample_from(&[0.5, 0.5, 0.0]), 2);
        }
        assert_eq!(sampler.sample_from(&[0.0, 0.0]), 0);
    }

    #[test]
    fn greedy_sampler_takes_argmax() {
        let mut sampler = Sampler::new(SamplingParams::default());
        for _ in 0..100 {
            assert_eq!(sampler.sample(&[0.1, 5.0, 4.9]), 1);
        }
    }

    #[test]
    fn uniform_is_in_unit_interval_with_mean_one_half() {
        let mut sampler = Sampler::new(params(1.0, 0, 1.0, 0.0));
        let n = 100_000;
        let mut sum = 0.0;
        for _ in 0..n {
            let u = sampler.uniform();
            assert!((0.0..1.0).contains(&u));
            sum += u;
        }
        // Mean of n uniforms has standard deviation sqrt(1/12/n) ≈ 0.0009.
        assert!((sum / n as f64 - 0.5).abs() < 0.004);
    }

    #[test]
    fn seeds_reproduce_and_differ() {
        let logits = [0.0f32; 5];
        let draw = |seed: Option<u64>| {
            let mut sampler = Sampler::new(SamplingParams {
                temperature: 1.0,
                seed,
                ..SamplingParams::default()
            });
            (0..100)
                .map(|_| sampler.sample(&logits))
                .collect::<Vec<u32>>()
        };
        assert_eq!(draw(Some(42)), draw(Some(42)));
        // 100 uniform draws over 5 tokens coincide with probability 5^-100.
        assert_ne!(draw(Some(42)), draw(Some(43)));
        assert_ne!(draw(None), draw(None));
    }
}
