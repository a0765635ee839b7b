//! `dspec bench`'s measurements on a real (tiny) model.

use mlx_rs::Dtype;

use dspec_engine::bench::{measure_prefill, PrefillPlan};
use dspec_engine::loading::{builtin_registry, load_model, LoadedModel};
use dspec_engine::tiny_model::write_tiny_model;
use dspec_plugin_api::LoadOptions;

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

const PROMPT: &[u32] = &[72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100];

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
