//! Scoring and LoRA on the real SmolLM2-135M-Instruct (scripts/fetch-models.sh fetches
//! and converts it once; later runs use the cache).

use std::path::PathBuf;

use mlx_rs::{random, Array};

use dspec_adapters::lora::LoraMode;
use dspec_engine::loading::{builtin_registry, load_model_with_lora};
use dspec_engine::scoring::{Scorer, ScorerAdapter, Variant, Windowing};
use dspec_plugin_api::LoadOptions;

mod common;
use common::{dspec_json, fetch_real_model};

/// The converted SmolLM2 (fetched and converted on first use, cached after).
fn smollm2() -> PathBuf {
    fetch_real_model("smollm2").1
}

#[test]
fn smollm2_finds_paris_far_more_likely_than_berlin() {
    let dir = smollm2();
    let requests = write_requests();
    let json = dspec_json(&[
        "score",
        "--target",
        dir.to_str().unwrap(),
        "--input",
        requests.to_str().unwrap(),
        "--json",
    ]);
    let results = json["results"].as_array().expect("results");
    let next = &results[0]["base"];
    assert_eq!(next["top"][0]["token"], " Paris", "{next}");
    assert!(next["top"][0]["prob"].as_f64().unwrap() > 0.5, "{next}");
    let sum = |i: usize| results[i]["base"]["sum"].as_f64().unwrap();
    let (paris, berlin) = (sum(1), sum(2));
    assert!(
        paris > -1.0 && paris > berlin + 4.0,
        "Paris {paris}, Berlin {berlin}"
    );
    // Natural English is far less surprising than shuffled words.
    let ppl = |i: usize| results[i]["base"]["perplexity"].as_f64().unwrap();
    assert!(ppl(3) * 3.0 < ppl(4), "{} vs {}", ppl(3), ppl(4));
}

fn write_requests() -> PathBuf {
    let path =
        std::env::temp_dir().join(format!("dspec-real-scoring-{}.jsonl", std::process::id()));
    let lines = [
        r#"{"measure":"next-token","prompt":"The capital of France is","k":5}"#,
        r#"{"measure":"logprob","prompt":"The capital of France is","completion":" Paris"}"#,
        r#"{"measure":"logprob","prompt":"The capital of France is","completion":" Berlin"}"#,
        r#"{"measure":"rolling","text":"The cat sat on the mat and looked out of the window at the rain."}"#,
        r#"{"measure":"rolling","text":"window mat the rain cat of sat looked the on out and the at."}"#,
    ];
    std::fs::write(&path, lines.join("\n")).expect("write requests");
    path
}

#[test]
fn smollm2_with_a_random_lora_switches_between_base_and_adapted() {
    let dir = smollm2();
    // q_proj and v_proj of every layer: hidden 576, 9×64 query heads, 3×64 KV heads.
    let adapter = tempfile::tempdir().expect("temp dir");
    let mut tensors = Vec::new();
    for layer in 0..30 {
        for (proj, out) in [("q_proj", 576), ("v_proj", 192)] {
            let stem = format!("base_model.model.model.layers.{layer}.self_attn.{proj}");
            let key = random::key(layer * 2 + (out == 192) as u64).expect("key");
            let a = random::normal::<f32>(&[8, 576], None, None, Some(&key)).expect("a");
            let b = random::normal::<f32>(&[out, 8], None, None, Some(&key)).expect("b");
            tensors.push((
                format!("{stem}.lora_A.weight"),
                a.multiply(Array::from_f32(0.02)).expect("a"),
            ));
            tensors.push((
                format!("{stem}.lora_B.weight"),
                b.multiply(Array::from_f32(0.02)).expect("b"),
            ));
        }
    }
    Array::save_safetensors(
        tensors.iter().map(|(n, a)| (n.as_str(), a)),
        None,
        adapter.path().join("adapter_model.safetensors"),
    )
    .expect("save adapter");
    let config = serde_json::json!({"peft_type": "LORA", "r": 8, "lora_alpha": 16,
        "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "target_modules": ["q_proj", "v_proj"]});
    std::fs::write(
        adapter.path().join("adapter_config.json"),
        config.to_string(),
    )
    .expect("config");

    let (loaded, lora) = load_model_with_lora(
        dir.to_str().unwrap(),
        &builtin_registry().expect("registry"),
        &LoadOptions::default(),
        adapter.path(),
        LoraMode::Switchable,
        false,
    )
    .expect("load with adapter");
    assert!(lora.warnings.is_empty(), "{:?}", lora.warnings);
    let windowing = Windowing::new(None, None, loaded.model.info().max_context).expect("windowing");
    let mut s = Scorer::new(loaded, Some(ScorerAdapter::from(&lora)), windowing);
    let text = "The capital of France is Paris.";
    let base = s.rolling(text, Variant::Base).expect("base");
    let adapted = s.rolling(text, Variant::Adapted).expect("adapted");
    let again = s.rolling(text, Variant::Base).expect("base again");
    assert_eq!(base, again);
    assert!(
        (base.total - adapted.total).abs() > 1e-3,
        "{} vs {}",
        base.total,
        adapted.total
    );
    assert_eq!(
        s.stats().forward_passes,
        2,
        "the repeat came from the cache"
    );
}
