//! LoRA adapters on tiny random models, with adapter files written by the tests in
//! PEFT and MLX-LM layout: B = 0 changes nothing; a random adapter, unfused, scores
//! like a model whose weights were merged by the test; fused equals unfused; the
//! switch gives the exact base model back; bad adapters are clear errors.

mod common;

use std::collections::HashMap;
use std::path::Path;

use mlx_rs::{random, Array};
use serde_json::json;

use dspec_adapters::lora::{LoraAdapter, LoraMode};
use dspec_engine::loading::{builtin_registry, load_model_with_lora, LoadedLora, LoadedModel};
use dspec_engine::scoring::{Scorer, ScorerAdapter, Variant, Windowing};
use dspec_engine::tiny_model::write_tiny_model;
use dspec_plugin_api::{LoadOptions, Quantization};

const TEXT: &str = "A fine-tuned model should find its own style more likely.";

/// One adapted module: HF name, A `[r, in]`, B `[out, r]`, and the scale it gets.
struct Factors {
    module: String,
    a: Array,
    b: Array,
    scale: f32,
}

/// `[out, in]` of the tiny llama's linear layers (hidden 32, 4×8 query heads, 2×8 KV
/// heads, MLP 64, vocab 259).
fn dims(module: &str) -> (i32, i32) {
    let suffix = module.rsplit('.').next().unwrap_or(module);
    match suffix {
        "q_proj" | "o_proj" => (32, 32),
        "k_proj" | "v_proj" => (16, 32),
        "gate_proj" | "up_proj" => (64, 32),
        "down_proj" => (32, 64),
        "lm_head" => (259, 32),
        other => panic!("no tiny dims for {other}"),
    }
}

fn normal(shape: &[i32], seed: u64, std: f32) -> Array {
    let key = random::key(seed).expect("key");
    random::normal::<f32>(shape, None, None, Some(&key))
        .and_then(|a| a.multiply(Array::from_f32(std)))
        .expect("random factor")
}

/// Random factors, large enough to move the scores; B all zeros with `zero_b`.
fn factors(modules: &[&str], rank: i32, scale: f32, seed: u64, zero_b: bool) -> Vec<Factors> {
    modules
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let (out, inp) = dims(m);
            let s = seed * 100 + 2 * i as u64;
            let b = if zero_b {
                Array::zeros::<f32>(&[out, rank]).expect("zeros")
            } else {
                normal(&[out, rank], s + 1, 0.3)
            };
            Factors {
                module: m.to_string(),
                a: normal(&[rank, inp], s, 0.3),
                b,
                scale,
            }
        })
        .collect()
}

fn save(path: &Path, tensors: Vec<(String, Array)>) {
    Array::save_safetensors(tensors.iter().map(|(n, a)| (n.as_str(), a)), None, path)
        .unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
}

fn write_json(path: &Path, value: serde_json::Value) {
    std::fs::write(path, serde_json::to_string_pretty(&value).expect("json")).expect("write json");
}

/// A PEFT adapter directory: `config` is adapter_config.json as given.
fn write_peft(dir: &Path, factors: &[Factors], config: serde_json::Value) {
    std::fs::create_dir_all(dir).expect("adapter dir");
    let mut tensors = Vec::new();
    for f in factors {
        let stem = format!("base_model.model.{}", f.module);
        tensors.push((format!("{stem}.lora_A.weight"), f.a.clone()));
        tensors.push((format!("{stem}.lora_B.weight"), f.b.clone()));
    }
    save(&dir.join("adapter_model.safetensors"), tensors);
    write_json(&dir.join("adapter_config.json"), config);
}

fn peft_config(rank: i32, alpha: f64, modules: &[&str]) -> serde_json::Value {
    let targets: Vec<&str> = modules
        .iter()
        .map(|m| m.rsplit('.').next().unwrap_or(m))
        .collect();
    json!({"peft_type": "LORA", "base_model_name_or_path": null, "r": rank,
           "lora_alpha": alpha, "target_modules": targets, "use_rslora": false, "use_dora": false,
           "bias": "none", "fan_in_fan_out": false, "modules_to_save": null,
           "rank_pattern": {}, "alpha_pattern": {}, "task_type": "CAUSAL_LM"})
}

/// An MLX-LM adapter directory (`lora_a` = Aᵀ, `lora_b` = Bᵀ).
fn write_mlx_lm(dir: &Path, factors: &[Factors], rank: i32, scale: f32) {
    std::fs::create_dir_all(dir).expect("adapter dir");
    let mut tensors = Vec::new();
    for f in factors {
        tensors.push((format!("{}.lora_a", f.module), f.a.t()));
        tensors.push((format!("{}.lora_b", f.module), f.b.t()));
    }
    save(&dir.join("adapters.safetensors"), tensors);
    write_json(
        &dir.join("adapter_config.json"),
        json!({"fine_tune_type": "lora", "num_layers": 2, "model": "tiny-llama",
               "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0}}),
    );
}

/// A copy of the model in `base` with `W += scale · B A` merged into each module by
/// hand, in f64 on the host.
fn write_merged_model(base: &Path, out: &Path, factors: &[Factors]) {
    std::fs::create_dir_all(out).expect("merged dir");
    for entry in std::fs::read_dir(base).expect("list base") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "json") {
            std::fs::copy(&path, out.join(path.file_name().expect("name"))).expect("copy");
        }
    }
    let mut weights: HashMap<String, Array> =
        Array::load_safetensors(base.join("model.safetensors")).expect("load base weights");
    for f in factors {
        let name = format!("{}.weight", f.module);
        let w = weights.get(&name).expect("module weight");
        let (out_dim, in_dim) = dims(&f.module);
        let rank = f.a.shape()[0] as usize;
        let host = |a: &Array| {
            a.eval().expect("eval");
            a.as_slice::<f32>()
                .iter()
                .map(|&x| x as f64)
                .collect::<Vec<f64>>()
        };
        let (wv, av, bv) = (host(w), host(&f.a), host(&f.b));
        let merged: Vec<f32> = (0..out_dim as usize * in_dim as usize)
            .map(|idx| {
                let (o, i) = (idx / in_dim as usize, idx % in_dim as usize);
                let delta: f64 = (0..rank)
                    .map(|k| bv[o * rank + k] * av[k * in_dim as usize + i])
                    .sum();
                (wv[idx] + f.scale as f64 * delta) as f32
            })
            .collect();
        weights.insert(name, Array::from_slice(&merged, &[out_dim, in_dim]));
    }
    save(
        &out.join("model.safetensors"),
        weights.into_iter().collect(),
    );
}

fn load_lora(
    model: &Path,
    lora: &Path,
    mode: LoraMode,
    options: &LoadOptions,
) -> (LoadedModel, LoadedLora) {
    load_model_with_lora(
        model.to_str().expect("utf-8 path"),
        &builtin_registry().expect("registry"),
        options,
        lora,
        mode,
        false,
    )
    .unwrap_or_else(|e| panic!("loading {} with {}: {e}", model.display(), lora.display()))
}

fn scorer(loaded: LoadedModel, lora: Option<&LoadedLora>) -> Scorer {
    let windowing = Windowing::new(None, None, loaded.model.info().max_context).expect("windowing");
    Scorer::new(loaded, lora.map(ScorerAdapter::from), windowing)
}

fn rolling(s: &mut Scorer, variant: Variant) -> Vec<f64> {
    s.rolling(TEXT, variant)
        .expect("rolling")
        .tokens
        .iter()
        .map(|t| t.logprob)
        .collect()
}

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// A tiny model dir plus its plain scores.
fn base_model(seed: u64) -> (tempfile::TempDir, Vec<f64>) {
    let dir = tempfile::tempdir().expect("temp dir");
    write_tiny_model(dir.path(), "{}", seed).expect("tiny model");
    let mut plain = scorer(common::load_dir(dir.path()), None);
    let base = rolling(&mut plain, Variant::Base);
    (dir, base)
}

/// Base scores of a LoRA-carrying load against a plain load of the same checkpoint. A
/// plain load fuses dense q/k/v and gate/up into one product each, a layer with a
/// switchable update keeps its projections apart, so the two differ by float
/// reassociation only.
fn assert_close_to_plain_load(got: &[f64], plain: &[f64]) {
    assert_eq!(got.len(), plain.len());
    assert!(
        max_diff(got, plain) < 1e-5,
        "base with the adapter off vs a plain load: {}",
        max_diff(got, plain)
    );
}

const MODULES: [&str; 6] = [
    "model.layers.0.self_attn.q_proj",
    "model.layers.0.self_attn.v_proj",
    "model.layers.1.self_attn.q_proj",
    "model.layers.1.self_attn.o_proj",
    "model.layers.1.mlp.down_proj",
    "lm_head",
];

#[test]
fn a_lora_whose_b_is_zero_changes_nothing() {
    let (model, base) = base_model(21);
    let adapter = tempfile::tempdir().expect("temp dir");
    write_peft(
        adapter.path(),
        &factors(&MODULES, 4, 2.0, 1, true),
        peft_config(4, 8.0, &MODULES),
    );
    let (loaded, lora) = load_lora(
        model.path(),
        adapter.path(),
        LoraMode::Switchable,
        &LoadOptions::default(),
    );
    let mut s = scorer(loaded, Some(&lora));
    let same_load_base = rolling(&mut s, Variant::Base);
    assert_eq!(rolling(&mut s, Variant::Adapted), same_load_base);
    assert_close_to_plain_load(&same_load_base, &base);
    let next = |s: &mut Scorer, v| s.next_token("A fine", 5, v).expect("next-token");
    assert_eq!(next(&mut s, Variant::Adapted), next(&mut s, Variant::Base));
}

#[test]
fn an_unfused_peft_lora_scores_like_the_merged_weights_model_and_switches_back_to_base() {
    let (model, base) = base_model(22);
    let (rank, alpha) = (4, 8.0);
    let f = factors(&MODULES, rank, (alpha / rank as f64) as f32, 2, false);
    let adapter = tempfile::tempdir().expect("temp dir");
    write_peft(adapter.path(), &f, peft_config(rank, alpha, &MODULES));
    let merged = tempfile::tempdir().expect("temp dir");
    write_merged_model(model.path(), merged.path(), &f);
    let want = rolling(
        &mut scorer(common::load_dir(merged.path()), None),
        Variant::Base,
    );

    let (loaded, lora) = load_lora(
        model.path(),
        adapter.path(),
        LoraMode::Switchable,
        &LoadOptions::default(),
    );
    assert!(
        lora.summary.contains("6 modules") && lora.summary.contains("rank 4"),
        "{}",
        lora.summary
    );
    assert!(lora.warnings.is_empty(), "{:?}", lora.warnings);
    let mut s = scorer(loaded, Some(&lora));
    let adapted = rolling(&mut s, Variant::Adapted);
    assert!(
        max_diff(&adapted, &want) < 1e-4,
        "unfused vs merged: {}",
        max_diff(&adapted, &want)
    );
    assert!(
        max_diff(&adapted, &base) > 1e-2,
        "the adapter should change the scores"
    );
    // Off again: the base model, from the same weights.
    assert_close_to_plain_load(&rolling(&mut s, Variant::Base), &base);
    assert_eq!(rolling(&mut s, Variant::Adapted), adapted);
    assert_eq!(
        s.stats().computed,
        2,
        "one base and one adapted computation, the rest cached"
    );
}

#[test]
fn rslora_and_rank_and_alpha_patterns_scale_each_module_as_peft_does() {
    let (model, _) = base_model(23);
    let modules = [
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.self_attn.v_proj",
    ];
    // q_proj: rank 2 from rank_pattern, alpha 8; v_proj: rank 4, alpha 32 from alpha_pattern.
    // rsLoRA divides by √r.
    let mut f = factors(&modules[..1], 2, 8.0 / 2f32.sqrt(), 3, false);
    f.extend(factors(&modules[1..], 4, 32.0 / 2.0, 4, false));
    let mut config = peft_config(4, 8.0, &modules);
    config["use_rslora"] = json!(true);
    config["rank_pattern"] = json!({"layers.0.self_attn.q_proj": 2});
    config["alpha_pattern"] = json!({"v_proj": 32});
    let adapter = tempfile::tempdir().expect("temp dir");
    write_peft(adapter.path(), &f, config);
    let merged = tempfile::tempdir().expect("temp dir");
    write_merged_model(model.path(), merged.path(), &f);
    let want = rolling(
        &mut scorer(common::load_dir(merged.path()), None),
        Variant::Base,
    );
    let (loaded, lora) = load_lora(
        model.path(),
        adapter.path(),
        LoraMode::Switchable,
        &LoadOptions::default(),
    );
    let got = rolling(&mut scorer(loaded, Some(&lora)), Variant::Adapted);
    assert!(max_diff(&got, &want) < 1e-4, "{}", max_diff(&got, &want));
}

#[test]
fn an_mlx_lm_adapter_scores_like_the_merged_weights_model() {
    let (model, base) = base_model(24);
    let f = factors(&MODULES[..5], 8, 0.5, 5, false);
    let adapter = tempfile::tempdir().expect("temp dir");
    write_mlx_lm(adapter.path(), &f, 8, 0.5);
    let merged = tempfile::tempdir().expect("temp dir");
    write_merged_model(model.path(), merged.path(), &f);
    let want = rolling(
        &mut scorer(common::load_dir(merged.path()), None),
        Variant::Base,
    );
    let (loaded, lora) = load_lora(
        model.path(),
        adapter.path(),
        LoraMode::Switchable,
        &LoadOptions::default(),
    );
    assert!(lora.summary.starts_with("MLX-LM"), "{}", lora.summary);
    let mut s = scorer(loaded, Some(&lora));
    let got = rolling(&mut s, Variant::Adapted);
    assert!(max_diff(&got, &want) < 1e-4, "{}", max_diff(&got, &want));
    assert_close_to_plain_load(&rolling(&mut s, Variant::Base), &base);
}

#[test]
fn fused_scores_equal_unfused_and_leave_no_base_model() {
    let (model, _) = base_model(25);
    let f = factors(&MODULES, 4, 2.0, 6, false);
    let adapter = tempfile::tempdir().expect("temp dir");
    write_peft(adapter.path(), &f, peft_config(4, 8.0, &MODULES));
    let options = LoadOptions::default();
    let (loaded, lora) = load_lora(model.path(), adapter.path(), LoraMode::Switchable, &options);
    // Every handle on the weights would read the one switch: none is handed out.
    assert!(loaded.model.share().is_none());
    let unfused = rolling(&mut scorer(loaded, Some(&lora)), Variant::Adapted);
    let (loaded, lora) = load_lora(model.path(), adapter.path(), LoraMode::Fused, &options);
    assert!(lora.switch.is_none());
    // Merged into the weights, the adapter is plain weights, shared like any.
    assert!(loaded.model.share().is_some());
    let mut fused = scorer(loaded, Some(&lora));
    let got = rolling(&mut fused, Variant::Adapted);
    assert!(
        max_diff(&got, &unfused) < 1e-4,
        "{}",
        max_diff(&got, &unfused)
    );
    let e = fused.rolling(TEXT, Variant::Base).unwrap_err().to_string();
    assert!(e.contains("fused") && e.contains("drop --fuse"), "{e}");
}

#[test]
fn fusing_into_quantized_weights_requantizes_close_to_the_unfused_adapter() {
    let q8 = Quantization {
        bits: 8,
        group_size: 32,
    };
    // A checkpoint stored quantized (dequantize → merge → quantize) and one quantized
    // on load (merge, then quantize).
    let stored = tempfile::tempdir().expect("temp dir");
    write_tiny_model(stored.path(), "{}", 26).expect("tiny model");
    let config = std::fs::read_to_string(stored.path().join("config.json")).expect("config");
    dspec_adapters::fixtures::write_random_model(stored.path(), &config, 26, Some(q8))
        .expect("quantized");
    let float = tempfile::tempdir().expect("temp dir");
    write_tiny_model(float.path(), "{}", 26).expect("tiny model");
    let on_load = LoadOptions {
        dtype: None,
        quantize: Some(q8),
        ..LoadOptions::default()
    };

    let f = factors(&MODULES[..5], 4, 2.0, 7, false);
    let adapter = tempfile::tempdir().expect("temp dir");
    write_peft(adapter.path(), &f, peft_config(4, 8.0, &MODULES[..5]));
    for (dir, options) in [
        (stored.path(), LoadOptions::default()),
        (float.path(), on_load),
    ] {
        let (loaded, lora) = load_lora(dir, adapter.path(), LoraMode::Switchable, &options);
        assert_eq!(loaded.model.info().quantized_bits, Some(8));
        let mut s = scorer(loaded, Some(&lora));
        let (base, unfused) = (
            rolling(&mut s, Variant::Base),
            rolling(&mut s, Variant::Adapted),
        );
        let (loaded, lora) = load_lora(dir, adapter.path(), LoraMode::Fused, &options);
        let fused = rolling(&mut scorer(loaded, Some(&lora)), Variant::Adapted);
        // 8-bit rounding of the merged weight is the only difference.
        let (err, effect) = (max_diff(&fused, &unfused), max_diff(&base, &unfused));
        assert!(
            err < effect / 10.0,
            "{}: fused vs unfused {err}, adapter effect {effect}",
            dir.display()
        );
    }
}

/// Loads `model` with the adapter in `adapter`, expecting an error; returns its text.
fn load_error(model: &Path, adapter: &Path) -> String {
    match load_model_with_lora(
        model.to_str().expect("utf-8 path"),
        &builtin_registry().expect("registry"),
        &LoadOptions::default(),
        adapter,
        LoraMode::Switchable,
        false,
    ) {
        Ok(_) => panic!("{} should be refused", adapter.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_adapters_are_errors_naming_the_file_or_module_and_the_fix() {
    let (model, _) = base_model(27);
    let root = tempfile::tempdir().expect("temp dir");
    let good = factors(&MODULES[..2], 4, 2.0, 8, false);
    let case = |name: &str| root.path().join(name);

    let e = load_error(model.path(), &case("absent"));
    assert!(
        e.contains("absent") && e.contains("adapter_config.json"),
        "{e}"
    );

    std::fs::create_dir_all(case("no-config")).expect("dir");
    let e = load_error(model.path(), &case("no-config"));
    assert!(
        e.contains("adapter_config.json") && e.contains("not found"),
        "{e}"
    );

    std::fs::create_dir_all(case("no-weights")).expect("dir");
    write_json(
        &case("no-weights").join("adapter_config.json"),
        peft_config(4, 8.0, &MODULES),
    );
    let e = load_error(model.path(), &case("no-weights"));
    assert!(
        e.contains("adapter_model.safetensors") && e.contains("adapters.safetensors"),
        "{e}"
    );

    // Trained for a wider model: A is [4, 48] where q_proj takes 32 inputs.
    let wide = vec![Factors {
        module: MODULES[0].into(),
        a: normal(&[4, 48], 1, 0.1),
        b: normal(&[32, 4], 2, 0.1),
        scale: 2.0,
    }];
    write_peft(&case("shapes"), &wide, peft_config(4, 8.0, &MODULES));
    let e = load_error(model.path(), &case("shapes"));
    assert!(
        e.contains("self_attn.q_proj.lora_A.weight")
            && e.contains("[4, 48]")
            && e.contains("[4, 32]"),
        "{e}"
    );

    // A module the 2-layer model does not have.
    let mut extra = factors(&MODULES[..1], 4, 2.0, 9, false);
    extra[0].module = "model.layers.7.self_attn.q_proj".into();
    write_peft(
        &case("unknown-module"),
        &extra,
        peft_config(4, 8.0, &MODULES),
    );
    let e = load_error(model.path(), &case("unknown-module"));
    assert!(
        e.contains("model.layers.7.self_attn.q_proj")
            && e.contains("model.layers.0.self_attn.q_proj"),
        "{e}"
    );

    // Config says rank 8, tensors have rank 4.
    write_peft(&case("rank"), &good, peft_config(8, 16.0, &MODULES));
    let e = load_error(model.path(), &case("rank"));
    assert!(e.contains("rank 4") && e.contains("rank 8"), "{e}");

    // A and B of one module disagree on the rank.
    let skew = vec![Factors {
        module: MODULES[0].into(),
        a: normal(&[4, 32], 3, 0.1),
        b: normal(&[32, 2], 4, 0.1),
        scale: 2.0,
    }];
    write_peft(&case("skew"), &skew, peft_config(4, 8.0, &MODULES));
    let e = load_error(model.path(), &case("skew"));
    assert!(
        e.contains("lora_A.weight") && e.contains("lora_B.weight") && e.contains("rank"),
        "{e}"
    );

    let mut dora = peft_config(4, 8.0, &MODULES);
    dora["use_dora"] = json!(true);
    write_peft(&case("dora"), &good, dora);
    let e = load_error(model.path(), &case("dora"));
    assert!(
        e.contains("DoRA") && e.contains("adapter_config.json"),
        "{e}"
    );

    // A garbage weights file is a corrupt-file error, not a crash.
    write_peft(&case("corrupt"), &good, peft_config(4, 8.0, &MODULES));
    std::fs::write(
        case("corrupt").join("adapter_model.safetensors"),
        b"\x10\0\0\0\0\0\0\0{not json",
    )
    .expect("write");
    let e = load_error(model.path(), &case("corrupt"));
    assert!(
        e.contains("adapter_model.safetensors")
            && e.contains("not a valid safetensors")
            && e.contains("re-save the adapter"),
        "{e}"
    );
}

#[test]
fn a_base_model_with_another_name_is_a_warning_not_an_error() {
    let (model, _) = base_model(28);
    let adapter = tempfile::tempdir().expect("temp dir");
    let mut config = peft_config(4, 8.0, &MODULES[..2]);
    config["base_model_name_or_path"] = json!("SomeOrg/Completely-Different-7B");
    write_peft(
        adapter.path(),
        &factors(&MODULES[..2], 4, 2.0, 10, false),
        config,
    );
    let (_, lora) = load_lora(
        model.path(),
        adapter.path(),
        LoraMode::Switchable,
        &LoadOptions::default(),
    );
    assert_eq!(lora.warnings.len(), 1);
    assert!(
        lora.warnings[0].contains("Completely-Different-7B"),
        "{:?}",
        lora.warnings
    );

    let parsed = LoraAdapter::open(adapter.path()).expect("adapter");
    let same = serde_json::json!({"_name_or_path": "someorg/completely_different_7b"});
    assert_eq!(parsed.base_model_warning(model.path(), &same), None);
}

fn dspec(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_dspec"))
        .args(args)
        .output()
        .expect("run dspec")
}

#[test]
fn cli_compare_prints_base_adapted_and_deltas_from_one_load() {
    let (model, base) = base_model(29);
    let adapter = tempfile::tempdir().expect("temp dir");
    write_peft(
        adapter.path(),
        &factors(&MODULES, 4, 2.0, 11, false),
        peft_config(4, 8.0, &MODULES),
    );
    let (m, a) = (
        model.path().to_str().unwrap(),
        adapter.path().to_str().unwrap(),
    );
    let out = dspec(&[
        "score",
        "--target",
        m,
        "--lora",
        a,
        "--compare",
        "--text",
        TEXT,
        "--json",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let r = &json["results"][0];
    assert_eq!(r["measure"], "rolling");
    let values = |side: &str| -> Vec<f64> {
        r[side]["tokens"]
            .as_array()
            .expect("tokens")
            .iter()
            .map(|t| t["logprob"].as_f64().unwrap())
            .collect()
    };
    assert_close_to_plain_load(&values("base"), &base);
    let delta = r["delta"]["logprob"].as_f64().expect("delta");
    let sum = |side: &str| r[side]["total"].as_f64().unwrap();
    assert!((delta - (sum("adapted") - sum("base"))).abs() < 1e-9 && delta.abs() > 1e-3);
    assert_eq!(json["adapter"]["fused"], false);

    // Text output: both columns and the delta.
    let out = dspec(&[
        "score",
        "--target",
        m,
        "--lora",
        a,
        "--compare",
        "--prompt",
        "A fine",
        "--completion=-tuned",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success()
            && text.contains("base")
            && text.contains("adapted")
            && text.contains("delta"),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // --fuse cannot compare; a broken adapter is an error, not a panic.
    let out = dspec(&[
        "score",
        "--target",
        m,
        "--lora",
        a,
        "--compare",
        "--fuse",
        "--text",
        "x",
    ]);
    assert!(!out.status.success());
    let out = dspec(&["score", "--target", m, "--lora", m, "--text", "x"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.starts_with("error: loading --lora") && err.contains("adapter_config.json"),
        "{err}"
    );
}
