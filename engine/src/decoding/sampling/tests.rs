//! The device sampler against the host reference, and the reference against itself.

use super::*;
use mlx_rs::ops::broadcast_to;
use rand::Rng;

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

/// The device's processed distribution of one row of logits, on the host.
fn on_device(logits: &[f32], params: &SamplingParams) -> Vec<f32> {
    let row = Array::from_slice(logits, &[1, logits.len() as i32]);
    let probs = Sampler::new(params.clone()).probabilities(&row).unwrap();
    probs.eval().unwrap();
    probs.as_slice::<f32>().to_vec()
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

/// Both the host reference and the device give `expected`.
fn assert_both(logits: &[f32], params: &SamplingParams, expected: &[f64]) {
    assert_close(&probabilities(logits, params), expected);
    assert_close(&on_device(logits, params), expected);
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
    assert_both(
        &[1.0, 3.0, 3.0, 2.0],
        &SamplingParams::default(),
        &[0.0, 1.0, 0.0, 0.0],
    );
}

#[test]
fn softmax_and_temperature() {
    assert_both(&ladder(), &params(1.0, 0, 1.0, 0.0), &[0.1, 0.2, 0.3, 0.4]);
    // Temperature 0.5 squares the probabilities: [1, 4, 9, 16] / 30.
    assert_both(
        &ladder(),
        &params(0.5, 0, 1.0, 0.0),
        &[1.0 / 30.0, 4.0 / 30.0, 9.0 / 30.0, 16.0 / 30.0],
    );
    // Temperature 2 takes square roots.
    let roots: Vec<f64> = [1.0f64, 2.0, 3.0, 4.0].iter().map(|x| x.sqrt()).collect();
    let sum: f64 = roots.iter().sum();
    let expected: Vec<f64> = roots.iter().map(|r| r / sum).collect();
    assert_both(&ladder(), &params(2.0, 0, 1.0, 0.0), &expected);
    // Huge logits must not overflow, -inf gets nothing.
    assert_both(
        &[1000.0, 1000.0, f32::NEG_INFINITY],
        &params(1.0, 0, 1.0, 0.0),
        &[0.5, 0.5, 0.0],
    );
    // The host reference also sanitises NaN and +inf (the device does not: see
    // `Sampler`).
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
    assert_both(
        &ladder(),
        &params(1.0, 2, 1.0, 0.0),
        &[0.0, 0.0, 3.0 / 7.0, 4.0 / 7.0],
    );
    assert_both(&ladder(), &params(1.0, 1, 1.0, 0.0), &[0.0, 0.0, 0.0, 1.0]);
    // k at or above the vocabulary is off.
    assert_both(&ladder(), &params(1.0, 4, 1.0, 0.0), &[0.1, 0.2, 0.3, 0.4]);
    assert_both(&ladder(), &params(1.0, 9, 1.0, 0.0), &[0.1, 0.2, 0.3, 0.4]);
    // Equal logits at the cut: the host keeps the lower id, the device every token
    // equal to the cutoff (the documented difference, at exactly equal values only).
    let tied = [0.0, 1.0, 1.0, 1.0];
    assert_close(
        &probabilities(&tied, &params(1.0, 2, 1.0, 0.0)),
        &[0.0, 0.5, 0.5, 0.0],
    );
    let third = 1.0 / 3.0;
    assert_close(
        &on_device(&tied, &params(1.0, 2, 1.0, 0.0)),
        &[0.0, third, third, third],
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
        assert_both(&ladder(), &params(1.0, 0, top_p, 0.0), expected);
    }
}

#[test]
fn min_p_support() {
    // Threshold 0.6 * 0.4 = 0.24 keeps 0.3 and 0.4.
    assert_both(
        &ladder(),
        &params(1.0, 0, 1.0, 0.6),
        &[0.0, 0.0, 3.0 / 7.0, 4.0 / 7.0],
    );
    // Threshold 0.45 * 0.4 = 0.18 keeps 0.2 too.
    assert_both(
        &ladder(),
        &params(1.0, 0, 1.0, 0.45),
        &[0.0, 2.0 / 9.0, 3.0 / 9.0, 4.0 / 9.0],
    );
    // min-p 1 keeps the most likely token only.
    assert_both(&ladder(), &params(1.0, 0, 1.0, 1.0), &[0.0, 0.0, 0.0, 1.0]);
}

#[test]
fn filters_apply_in_order_top_k_then_top_p_then_min_p() {
    // top-k 2 leaves [3/7, 4/7]; top-p 0.5 on that keeps only 4/7. Applying top-p to the
    // unfiltered distribution first would have kept two tokens.
    assert_both(&ladder(), &params(1.0, 2, 0.5, 0.0), &[0.0, 0.0, 0.0, 1.0]);
    // top-k 3 → [2, 3, 4]/9; top-p 0.8 keeps all three (4/9 + 3/9 < 0.8);
    // min-p 0.6 drops 2/9 < 0.6 * 4/9.
    assert_both(
        &ladder(),
        &params(1.0, 3, 0.8, 0.6),
        &[0.0, 0.0, 3.0 / 7.0, 4.0 / 7.0],
    );
}

/// The device's distributions equal the host reference's on random logits, for every
/// combination of the filters, rows processed together as the speculative verify
/// processes them.
#[test]
fn device_distributions_equal_the_host_reference_on_random_logits() {
    let (rows, vocab) = (12usize, 64usize);
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let logits: Vec<f32> = (0..rows * vocab)
        .map(|_| rng.random_range(-6.0f32..6.0))
        .collect();
    let device_logits = Array::from_slice(&logits, &[rows as i32, vocab as i32]);
    let mut checked = 0;
    for temperature in [0.6f32, 1.0, 1.7] {
        for top_k in [0usize, 1, 7, 63, 64, 100] {
            for top_p in [1.0f32, 0.95, 0.6, 0.1, 0.0] {
                for min_p in [0.0f32, 0.02, 0.3] {
                    let p = params(temperature, top_k, top_p, min_p);
                    let device = Sampler::new(p.clone())
                        .probabilities(&device_logits)
                        .unwrap();
                    device.eval().unwrap();
                    let device = device.as_slice::<f32>();
                    for (r, row) in logits.chunks(vocab).enumerate() {
                        let host = probabilities(row, &p);
                        let got = &device[r * vocab..(r + 1) * vocab];
                        for (i, (&h, &d)) in host.iter().zip(got).enumerate() {
                            assert!(
                                (h - d).abs() < 1e-5 && (h == 0.0) == (d == 0.0),
                                "{p:?} row {r} token {i}: host {h} device {d}"
                            );
                        }
                        checked += 1;
                    }
                }
            }
        }
    }
    assert_eq!(checked, 3 * 6 * 5 * 3 * rows);
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

/// Device draws follow the host reference distribution: `n` rows of the same logits
/// drawn in one call (each row its own draw).
#[test]
fn draws_follow_the_distribution() {
    let logits = [0.5f32, -1.0, 2.0, 1.2, 0.0];
    let n = 200_000;
    let rows = broadcast_to(Array::from_slice(&logits, &[1, 5]), &[n as i32, 5]).unwrap();
    for p in [
        params(1.0, 0, 1.0, 0.0),
        params(0.7, 0, 1.0, 0.0),
        params(1.3, 3, 1.0, 0.0),
        params(1.0, 0, 0.8, 0.0),
        params(1.0, 0, 1.0, 0.2),
        params(0.9, 4, 0.9, 0.1),
    ] {
        let probs = probabilities(&logits, &p);
        let drawn = Sampler::new(p.clone()).sample(&rows).unwrap();
        drawn.eval().unwrap();
        let mut counts = [0usize; 5];
        for &t in drawn.as_slice::<u32>() {
            counts[t as usize] += 1;
        }
        assert_frequencies(&counts, &probs, n);
    }
}

/// Unnormalised log-weights: `-inf` is never drawn, the rest in proportion.
#[test]
fn draw_from_unnormalised_log_weights() {
    let n = 200_000;
    let weights = [1.0f32, 0.0, 3.0, 0.0];
    let logs: Vec<f32> = weights.iter().map(|w| w.ln()).collect();
    let rows = broadcast_to(Array::from_slice(&logs, &[1, 4]), &[n as i32, 4]).unwrap();
    let drawn = Sampler::new(params(1.0, 0, 1.0, 0.0)).draw(&rows).unwrap();
    drawn.eval().unwrap();
    let mut counts = [0usize; 4];
    for &t in drawn.as_slice::<u32>() {
        counts[t as usize] += 1;
    }
    assert_frequencies(&counts, &[0.25, 0.0, 0.75, 0.0], n);
}

#[test]
fn greedy_sampler_takes_argmax() {
    let mut sampler = Sampler::new(SamplingParams::default());
    let logits = Array::from_slice(&[0.1f32, 5.0, 4.9, 0.1, 4.0, 5.5], &[2, 3]);
    for _ in 0..10 {
        let ids = sampler.sample(&logits).unwrap();
        ids.eval().unwrap();
        assert_eq!(ids.as_slice::<u32>(), &[1, 2]);
    }
}

#[test]
fn seeds_reproduce_and_differ() {
    let logits = Array::from_slice(&[0.0f32; 5], &[1, 5]);
    let draw = |seed: Option<u64>| {
        let mut sampler = Sampler::new(SamplingParams {
            temperature: 1.0,
            seed,
            ..SamplingParams::default()
        });
        (0..100)
            .map(|_| sampler.sample(&logits).unwrap().item_cast::<u32>())
            .collect::<Vec<u32>>()
    };
    assert_eq!(draw(Some(42)), draw(Some(42)));
    // 100 uniform draws over 5 tokens coincide with probability 5^-100.
    assert_ne!(draw(Some(42)), draw(Some(43)));
    assert_ne!(draw(None), draw(None));
}
