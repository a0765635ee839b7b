//! `dspec bench`'s first-difference report on a real (tiny) model: the logits it reads
//! are plain decoding's, and a hand-made divergence is classified by its margin.

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{Array, Dtype};

use dspec_engine::bench::{first_difference, measure_prefill, rounding_tolerance, PrefillPlan};
use dspec_engine::decoding::generate::{generate, logits_to_host, prefill, GenerationConfig};
use dspec_engine::decoding::sampling::SamplingParams;
use dspec_engine::loading::{builtin_registry, load_model, LoadedModel};
use dspec_engine::tiny_model::write_tiny_model;
use dspec_plugin_api::{LoadOptions, TargetModel};

fn tiny(dtype: Dtype) -> (tempfile::TempDir, LoadedModel) {
    let dir = tempfile::tempdir().expect("temp dir");
    write_tiny_model(dir.path(), "{}", 11).expect("write tiny model");
    let options = LoadOptions {
        dtype: Some(dtype),
        ..LoadOptions::default()
    };
    let loaded = load_model(
        dir.path().to_str().expect("utf-8 temp path"),
        &builtin_registry().expect("built-in registry"),
        &options,
        false,
    )
    .expect("load tiny model");
    (dir, loaded)
}

fn greedy(loaded: &LoadedModel, prompt: &[u32], n: usize) -> Vec<u32> {
    let config = GenerationConfig {
        max_tokens: n,
        sampling: SamplingParams::default(),
        stop_strings: Vec::new(),
        eos_ids: Vec::new(),
    };
    generate(
        loaded.model.as_ref(),
        &loaded.tokenizer,
        prompt,
        &config,
        &mut |_| {},
    )
    .expect("plain greedy")
    .tokens
}

/// Host logits after `prompt` and `prefix`, stepping one token at a time.
fn logits_after(model: &dyn TargetModel, prompt: &[u32], prefix: &[u32]) -> Vec<f32> {
    let mut cache = model.new_cache();
    let mut logits = prefill(model, &mut cache, prompt).expect("prefill");
    for &t in prefix {
        logits = model
            .forward(&Array::from_slice(&[t], &[1, 1]), &mut cache, &[])
            .expect("step")
            .logits
            .try_index((.., -1, ..))
            .expect("last row");
    }
    logits_to_host(&logits).expect("host logits")
}

const PROMPT: &[u32] = &[72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100];

#[test]
fn identical_outputs_have_no_difference() {
    let (_dir, loaded) = tiny(Dtype::Float32);
    let tokens = greedy(&loaded, PROMPT, 10);
    let found = first_difference(loaded.model.as_ref(), PROMPT, &tokens, &tokens).expect("report");
    assert!(found.is_none(), "{found:?}");
}

/// In f32 a difference is never excused: speculative greedy must be plain greedy.
#[test]
fn an_f32_difference_is_a_real_mismatch_with_plain_decodings_logits() {
    let (_dir, loaded) = tiny(Dtype::Float32);
    let model = loaded.model.as_ref();
    let plain = greedy(&loaded, PROMPT, 10);
    let at = 4;
    let other = (plain[at] + 1) % 256;
    let mut speculative = plain.clone();
    speculative[at] = other;
    speculative.truncate(at + 3);

    let d = first_difference(model, PROMPT, &plain, &speculative)
        .expect("report")
        .expect("a difference");
    assert_eq!(d.position, at);
    assert_eq!(d.plain_token, Some(plain[at]));
    assert_eq!(d.speculative_token, Some(other));
    assert_eq!(d.logits_dtype, "Float32");
    let logits = logits_after(model, PROMPT, &plain[..at]);
    assert_eq!(d.plain_logit, Some(logits[plain[at] as usize]));
    assert_eq!(d.speculative_logit, Some(logits[other as usize]));
    // Plain greedy picked its token there, so it leads by a non-negative margin.
    let margin = d.margin.expect("margin");
    assert!(margin >= 0.0, "{d:?}");
    assert_eq!(d.tolerance, None);
    assert_eq!(d.path_noise, None, "f32 excuses no difference");
    assert!(!d.near_tie, "{d:?}");

    // One output a prefix of the other: no token to compare, a real mismatch.
    let d = first_difference(model, PROMPT, &plain, &plain[..at])
        .expect("report")
        .expect("a difference");
    assert_eq!((d.position, d.speculative_token), (at, None));
    assert!(d.margin.is_none() && !d.near_tie, "{d:?}");
}

/// bf16: two tokens whose logits lie within rounding of each other make a near-tie, the
/// most and least likely tokens a real mismatch.
#[test]
fn a_bf16_difference_is_classified_by_its_margin() {
    let (_dir, loaded) = tiny(Dtype::Bfloat16);
    let model = loaded.model.as_ref();
    let plain = greedy(&loaded, PROMPT, 8);
    let at = 3;
    let logits = logits_after(model, PROMPT, &plain[..at]);
    let vocab = logits.len();
    let diverging = |a: usize, b: usize| {
        let mut p = plain[..at].to_vec();
        let mut s = p.clone();
        p.push(a as u32);
        s.push(b as u32);
        first_difference(model, PROMPT, &p, &s)
            .expect("report")
            .expect("a difference")
    };

    // The closest pair of distinct tokens: with ~260 logits in 8 significant bits, some
    // lie within two units in the last place of each other.
    let mut best: Option<(usize, usize, f32)> = None;
    for a in 0..vocab {
        for b in 0..vocab {
            let gap = logits[a] - logits[b];
            if a != b && gap >= 0.0 && best.is_none_or(|(_, _, g)| gap < g) {
                best = Some((a, b, gap));
            }
        }
    }
    let (a, b, gap) = best.expect("a pair");
    let tolerance = rounding_tolerance(Dtype::Bfloat16, logits[a].abs().max(logits[b].abs()))
        .expect("bf16 has a tolerance");
    assert!(
        gap <= tolerance,
        "no pair within rounding: closest {gap} > {tolerance}"
    );
    let d = diverging(a, b);
    assert_eq!(d.logits_dtype, "Bfloat16");
    assert_eq!(d.margin, Some(gap));
    // The tolerance is the ulps' or twice the measured difference between the one-token
    // and the batched way of computing these logits, whichever is larger.
    let noise = d
        .path_noise
        .expect("bf16 measures the two paths' difference");
    assert!(noise.is_finite() && noise >= 0.0, "{d:?}");
    assert_eq!(d.tolerance, Some(tolerance.max(2.0 * noise)));
    assert!(d.near_tie, "{d:?}");

    let by_logit = |i: &usize, j: &usize| logits[*i].total_cmp(&logits[*j]);
    let top = (0..vocab).max_by(by_logit).expect("vocab");
    let bottom = (0..vocab).min_by(by_logit).expect("vocab");
    let d = diverging(top, bottom);
    assert!(d.margin.expect("margin") > d.tolerance.expect("tolerance"));
    assert!(!d.near_tie, "{d:?}");
}

#[test]
fn prefill_is_reported_cold_and_warm_for_prompts_and_synthetic_lengths() {
    let (_dir, loaded) = tiny(Dtype::Float32);
    let plan = PrefillPlan {
        warm_runs: 3,
        synthetic_lengths: vec![40, 100],
    };
    let prompts = vec![PROMPT.to_vec(), vec![1, 2, 3]];
    let report = measure_prefill(loaded.model.as_ref(), &prompts, &plan).expect("prefill");
    assert_eq!(report.warm_runs, 3);
    let shape: Vec<(Option<usize>, usize)> = report
        .rows
        .iter()
        .map(|r| (r.prompt, r.prompt_tokens))
        .collect();
    assert_eq!(
        shape,
        [
            (Some(1), PROMPT.len()),
            (Some(2), 3),
            (None, 40),
            (None, 100)
        ]
    );
    for r in &report.rows {
        assert_eq!(r.warm_seconds.len(), 3);
        assert!(
            r.first_call_seconds > 0.0 && r.median_seconds > 0.0,
            "{r:?}"
        );
        assert!(r.warm_seconds.contains(&r.median_seconds), "{r:?}");
        let rate = r.prompt_tokens as f64 / r.median_seconds;
        assert!((r.tokens_per_second - rate).abs() <= 1e-6 * rate, "{r:?}");
    }
    // A length past the model's context fails before anything runs, naming the flag.
    let too_long = PrefillPlan {
        warm_runs: 1,
        synthetic_lengths: vec![1_000_000],
    };
    let err = measure_prefill(loaded.model.as_ref(), &prompts, &too_long)
        .expect_err("longer than the context")
        .to_string();
    assert!(err.contains("--prefill-lengths"), "{err}");
}
