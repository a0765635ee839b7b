//! The `dspec` binary end to end on tiny random models written by the tests:
//! listing adapters, generating (streaming, JSON, stop strings), and every bad input
//! a user can give getting a clear error instead of a panic.

use std::path::Path;
use std::process::{Command, Output};

use dspec_engine::cpu_blas;
use dspec_engine::runtime::Backend;
use dspec_engine::tiny_model::write_tiny_model;

fn dspec(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dspec"))
        .args(args)
        .output()
        .expect("run dspec")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Runs dspec expecting failure; returns stderr after checking it is an error, not a panic.
fn dspec_fails(args: &[&str]) -> String {
    let out = dspec(args);
    let err = stderr(&out);
    assert!(
        !out.status.success(),
        "dspec {args:?} should fail; stdout: {}",
        stdout(&out)
    );
    assert_eq!(
        out.status.code(),
        Some(1),
        "exit code of dspec {args:?}; stderr: {err}"
    );
    assert!(!err.contains("panicked"), "dspec {args:?} panicked: {err}");
    assert!(err.starts_with("error: "), "dspec {args:?}: {err}");
    err
}

/// `dspec bench` on `target` with `drafter`, then `extra`.
fn bench_args<'a>(target: &'a str, drafter: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["bench", "--target", target, "--drafter", drafter];
    args.extend_from_slice(extra);
    args
}

fn tiny_model(overrides: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    write_tiny_model(dir.path(), overrides, 3).expect("write tiny model");
    dir
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("utf-8 temp path")
}

/// The `blas-kernels` line of `dspec --version` run with `coretype` as
/// `OPENBLAS_CORETYPE` (unset for `None`), or `None` where dspec's libmlx has no OpenBLAS.
fn openblas_kernels_line(coretype: Option<&str>) -> Option<String> {
    let mut command = Command::new(env!("CARGO_BIN_EXE_dspec"));
    command.arg("--version");
    match coretype {
        Some(name) => command.env(cpu_blas::CORETYPE, name),
        None => command.env_remove(cpu_blas::CORETYPE),
    };
    let out = command.output().expect("run dspec");
    assert!(out.status.success(), "{}", stderr(&out));
    stdout(&out)
        .lines()
        .find(|l| l.starts_with("blas-kernels "))
        .map(str::to_string)
}

/// Where OpenBLAS takes this CPU for one without AVX (OpenBLAS before 0.3.25 on Intel
/// models it does not know), dspec starts itself again on the kernels the CPU's
/// instruction sets call for; elsewhere OpenBLAS's choice stands. A user's
/// `OPENBLAS_CORETYPE` is kept as given.
#[test]
fn dspec_runs_openblas_kernels_for_this_cpu() {
    let Some(by_instruction_set) = cpu_blas::kernels_by_instruction_set() else {
        return;
    };
    let Some(line) = openblas_kernels_line(None) else {
        return;
    };
    assert!(
        !line.contains(": set OPENBLAS_CORETYPE"),
        "dspec left OpenBLAS on kernels for an older CPU: {line}"
    );
    if line.contains("dspec set") {
        assert!(
            line.starts_with(&format!("blas-kernels {by_instruction_set} (")),
            "{line}"
        );
    }
    // Every CPU with AVX runs OpenBLAS's Sandybridge kernels.
    let chosen = openblas_kernels_line(Some("Sandybridge")).expect("still OpenBLAS");
    assert_eq!(
        chosen,
        "blas-kernels Sandybridge (OPENBLAS_CORETYPE=Sandybridge)"
    );
}

#[test]
fn version_reports_dspec_mlx_and_device() {
    let out = dspec(&["--version"]);
    assert!(out.status.success());
    let text = stdout(&out);
    let lines: Vec<&str> = text.lines().collect();
    // A fifth line names OpenBLAS's kernels where the libmlx runs on OpenBLAS.
    let with_openblas = text.contains("(CPU BLAS: openblas)");
    assert_eq!(lines.len(), if with_openblas { 5 } else { 4 }, "{text}");
    assert_eq!(lines[0], format!("dspec {}", env!("CARGO_PKG_VERSION")));
    assert_eq!(lines[1], "mlx 0.32.2");
    // The device line names one of the backends, and the one this build runs on: this
    // test loads the same libmlx as the binary (same RUNPATH, same LD_LIBRARY_PATH).
    let devices = [Backend::Cpu, Backend::Cuda, Backend::Metal].map(|b| b.device_name());
    let device = lines[2].strip_prefix("device ").unwrap_or_default();
    assert!(devices.contains(&device), "{text}");
    assert_eq!(device, Backend::detect().device_name(), "{text}");
    // `libmlx DIR (CPU BLAS: NAME)`, or where LD_LIBRARY_PATH swapped the library in,
    // `libmlx DIR (redirected from the linked DIR)`.
    let libmlx = lines[3].strip_prefix("libmlx ").unwrap_or_default();
    let (dir, note) = libmlx.split_once(" (").unwrap_or_default();
    assert!(dir.starts_with('/'), "{text}");
    assert!(
        note.ends_with(')')
            && (note.starts_with("CPU BLAS: ") || note.starts_with("redirected from the linked /")),
        "{text}"
    );
}

#[test]
fn adapters_lists_every_built_in_family() {
    let out = dspec(&["adapters"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    for family in [
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "gemma",
        "gemma2",
        "gemma3_text",
        "gemma4_text",
        "qwen3_5",
        "qwen3_next",
        "qwen3_moe",
        "qwen3_5_moe",
    ] {
        assert!(
            text.lines()
                .any(|l| l.split_whitespace().next() == Some(family) && l.contains("built-in")),
            "`{family}` missing from:\n{text}"
        );
    }
}

#[test]
fn adapters_detect_explains_the_choice() {
    let model = tiny_model(r#"{"model_type": "qwen3", "head_dim": 16}"#);
    let out = dspec(&["adapters", "--detect", path_str(model.path())]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.contains("adapter qwen3") && text.contains("model_type \"qwen3\""),
        "{text}"
    );
}

fn generate_json(model: &Path, extra: &[&str]) -> serde_json::Value {
    let mut args = vec![
        "generate",
        "--target",
        path_str(model),
        "--prompt",
        "Hello there",
        "--json",
    ];
    args.extend_from_slice(extra);
    let out = dspec(&args);
    assert!(out.status.success(), "dspec {args:?}: {}", stderr(&out));
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", stdout(&out)))
}

#[test]
fn generate_streams_the_same_text_as_json_and_no_stream() {
    let model = tiny_model("{}");
    let m = path_str(model.path());
    let json = generate_json(model.path(), &["--max-tokens", "12"]);
    let stats = &json["stats"];
    let generated = stats["generated_tokens"]
        .as_u64()
        .expect("generated_tokens");
    assert!((1..=12).contains(&generated), "{json}");
    match stats["stop_reason"].as_str() {
        Some("max_tokens") => assert_eq!(generated, 12),
        Some("eos") => assert!(generated <= 12),
        other => panic!("unexpected stop reason {other:?}"),
    }
    assert!(
        stats["prompt_tokens"].as_u64().unwrap_or(0) > "Hello there".len() as u64,
        "chat template adds tokens: {json}"
    );
    assert!(
        stats["decode_tokens_per_second"].as_f64().is_some()
            && stats["prefill_tokens_per_second"].as_f64().is_some()
    );
    assert_eq!(json["model"]["adapter"], "llama");
    // Where plain decoding's time went: three parts, none negative, adding up to no
    // more than the decode time they split.
    let breakdown = &stats["decode_breakdown"];
    let parts: Vec<f64> = ["building_seconds", "queueing_seconds", "waiting_seconds"]
        .iter()
        .map(|k| {
            breakdown[k]
                .as_f64()
                .unwrap_or_else(|| panic!("{k}: {json}"))
        })
        .collect();
    let decode = stats["decode_seconds"].as_f64().expect("decode_seconds");
    assert!(parts.iter().all(|&p| p >= 0.0), "{json}");
    assert!(parts.iter().sum::<f64>() <= decode + 1e-6, "{json}");
    if generated > 1 {
        assert!(parts[0] > 0.0, "steps were built: {json}");
    }

    let streamed = dspec(&[
        "generate",
        "--target",
        m,
        "--prompt",
        "Hello there",
        "--max-tokens",
        "12",
    ]);
    assert!(streamed.status.success(), "{}", stderr(&streamed));
    assert!(
        stderr(&streamed).contains("decode"),
        "stats line on stderr: {}",
        stderr(&streamed)
    );
    let whole = dspec(&[
        "generate",
        "--target",
        m,
        "--prompt",
        "Hello there",
        "--max-tokens",
        "12",
        "--no-stream",
    ]);
    let text = json["text"].as_str().expect("text");
    assert_eq!(stdout(&streamed), format!("{text}\n"));
    assert_eq!(stdout(&whole), format!("{text}\n"));
}

#[test]
fn raw_prompt_skips_the_chat_template() {
    let model = tiny_model("{}");
    let chat = generate_json(model.path(), &["--max-tokens", "1"]);
    let raw = generate_json(model.path(), &["--max-tokens", "1", "--no-chat-template"]);
    // One token per byte: the raw prompt is exactly its bytes.
    assert_eq!(raw["stats"]["prompt_tokens"], "Hello there".len());
    assert!(chat["stats"]["prompt_tokens"].as_u64() > raw["stats"]["prompt_tokens"].as_u64());
}

#[test]
fn stop_string_cuts_the_output_where_it_first_appears() {
    let model = tiny_model("{}");
    let full = generate_json(model.path(), &["--max-tokens", "40", "--no-chat-template"]);
    let text = full["text"].as_str().expect("text").to_string();
    let chars: Vec<char> = text.chars().collect();
    if chars.len() < 8 {
        // A random model may hit EOS early; the cut needs some text to cut.
        return;
    }
    let stop: String = chars[4..6].iter().collect();
    let cut = &text[..text.find(&stop).expect("stop occurs")];
    let stopped = generate_json(
        model.path(),
        &["--max-tokens", "40", "--no-chat-template", "--stop", &stop],
    );
    assert_eq!(
        stopped["text"].as_str(),
        Some(cut),
        "stop {stop:?} in {text:?}"
    );
    assert_eq!(stopped["stats"]["stop_reason"], "stop_string");
}

/// `--seed` and `--temperature` both reach the sampler. A random model's next-token
/// distribution is close to flat over its 259 tokens, so at temperature 1 two seeds
/// drawing the same 24 tokens is out of reach, while one seed draws the same tokens every
/// run; at temperature 0 the seed plays no part and the text is the greedy one.
#[test]
fn seed_and_temperature_reach_the_sampler() {
    let model = tiny_model("{}");
    let run = |extra: &[&str]| {
        let args = [&["--max-tokens", "24", "--no-chat-template"][..], extra].concat();
        let json = generate_json(model.path(), &args);
        json["text"].as_str().expect("text").to_string()
    };
    let sampled = |seed: &str| run(&["--temperature", "1.0", "--top-p", "0.95", "--seed", seed]);
    let greedy = run(&[]);
    let seed_11 = sampled("11");
    assert_eq!(sampled("11"), seed_11, "the same seed draws the same text");
    let seed_12 = sampled("12");
    assert_ne!(seed_12, seed_11, "another seed draws another text");
    assert_ne!(seed_11, greedy, "temperature 1 samples");
    for seed in ["11", "12"] {
        let zero = run(&["--temperature", "0", "--top-p", "0.95", "--seed", seed]);
        assert_eq!(zero, greedy, "temperature 0 is greedy, seed {seed}");
    }
}

#[test]
fn every_family_generates_end_to_end() {
    for overrides in [
        r#"{"model_type": "mistral", "sliding_window": 8}"#,
        r#"{"model_type": "qwen2"}"#,
        r#"{"model_type": "gemma", "head_dim": 16}"#,
        r#"{"model_type": "gemma2", "head_dim": 16, "sliding_window": 8, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}"#,
        r#"{"model_type": "gemma3_text", "head_dim": 16, "sliding_window": 8, "sliding_window_pattern": 2}"#,
        dspec_adapters::fixtures::TINY_GEMMA4_OVERRIDES,
    ] {
        let model = tiny_model(overrides);
        let json = generate_json(model.path(), &["--max-tokens", "4", "--quantize", "8"]);
        assert!(
            json["stats"]["generated_tokens"].as_u64().unwrap_or(0) >= 1,
            "{overrides}: {json}"
        );
        assert_eq!(json["model"]["quantized_bits"], 8, "{overrides}");
    }
}

// ---- bad input -------------------------------------------------------------------

#[test]
fn missing_model_dir_and_missing_config_are_named() {
    let err = dspec_fails(&[
        "generate",
        "--target",
        "/nonexistent/model",
        "--prompt",
        "x",
    ]);
    assert!(err.contains("/nonexistent/model"), "{err}");
    let empty = tempfile::tempdir().unwrap();
    let err = dspec_fails(&[
        "generate",
        "--target",
        path_str(empty.path()),
        "--prompt",
        "x",
    ]);
    assert!(
        err.contains("config.json") && err.contains("not found"),
        "{err}"
    );
}

#[test]
fn unknown_model_type_lists_registered_ones_and_how_to_add() {
    let model = tiny_model("{}");
    std::fs::write(
        model.path().join("config.json"),
        r#"{"model_type": "mamba9"}"#,
    )
    .unwrap();
    let err = dspec_fails(&[
        "generate",
        "--target",
        path_str(model.path()),
        "--prompt",
        "x",
    ]);
    assert!(
        err.contains("mamba9") && err.contains("qwen3") && err.contains("gemma2"),
        "{err}"
    );
    assert!(
        err.contains("adapters/src") && err.contains("--plugin"),
        "how to add one: {err}"
    );
}

#[test]
fn missing_tokenizer_is_named() {
    let model = tiny_model("{}");
    std::fs::remove_file(model.path().join("tokenizer.json")).unwrap();
    let err = dspec_fails(&[
        "generate",
        "--target",
        path_str(model.path()),
        "--prompt",
        "x",
    ]);
    assert!(err.contains("tokenizer.json"), "{err}");
}

/// Rewrites model.safetensors without one tensor, or with it replaced.
fn rewrite_weights(dir: &Path, edit: impl Fn(&str, mlx_rs::Array) -> Option<mlx_rs::Array>) {
    let path = dir.join("model.safetensors");
    let arrays = mlx_rs::Array::load_safetensors(&path).unwrap();
    let kept: Vec<(String, mlx_rs::Array)> = arrays
        .into_iter()
        .filter_map(|(n, a)| edit(&n, a).map(|a| (n, a)))
        .collect();
    std::fs::remove_file(&path).unwrap();
    mlx_rs::Array::save_safetensors(kept.iter().map(|(n, a)| (n.as_str(), a)), None, &path)
        .unwrap();
}

#[test]
fn missing_tensor_is_named() {
    let model = tiny_model("{}");
    let victim = "model.layers.1.mlp.up_proj.weight";
    rewrite_weights(model.path(), |n, a| (n != victim).then_some(a));
    let err = dspec_fails(&[
        "generate",
        "--target",
        path_str(model.path()),
        "--prompt",
        "x",
    ]);
    assert!(err.contains(victim) && err.contains("missing"), "{err}");
}

#[test]
fn wrong_shape_is_named_with_both_shapes() {
    let model = tiny_model("{}");
    let victim = "model.layers.0.self_attn.o_proj.weight";
    rewrite_weights(model.path(), |n, a| {
        Some(if n == victim {
            mlx_rs::ops::zeros::<f32>(&[32, 16]).unwrap()
        } else {
            a
        })
    });
    let err = dspec_fails(&[
        "generate",
        "--target",
        path_str(model.path()),
        "--prompt",
        "x",
    ]);
    assert!(
        err.contains(victim) && err.contains("[32, 16]") && err.contains("[32, 32]"),
        "{err}"
    );
}

#[test]
fn truncated_or_garbage_safetensors_is_reported_as_corrupt() {
    let model = tiny_model("{}");
    let path = model.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let err = dspec_fails(&[
        "generate",
        "--target",
        path_str(model.path()),
        "--prompt",
        "x",
    ]);
    assert!(
        err.contains("model.safetensors") && err.contains("truncated"),
        "{err}"
    );
    std::fs::write(&path, b"definitely not safetensors").unwrap();
    let err = dspec_fails(&[
        "generate",
        "--target",
        path_str(model.path()),
        "--prompt",
        "x",
    ]);
    assert!(
        err.contains("model.safetensors") && err.contains("not a valid safetensors"),
        "{err}"
    );
}

#[test]
fn bad_flags_are_rejected_with_the_flag_named() {
    let model = tiny_model("{}");
    let m = path_str(model.path());
    let err = dspec_fails(&["generate", "--target", m, "--prompt", "x", "--top-p", "1.5"]);
    assert!(err.contains("--top-p"), "{err}");
    let err = dspec_fails(&["generate", "--target", m]);
    assert!(err.contains("--prompt"), "{err}");
    let out = dspec(&[
        "generate",
        "--target",
        m,
        "--prompt",
        "x",
        "--quantize",
        "3",
    ]);
    assert_eq!(out.status.code(), Some(2), "clap rejects --quantize 3");
    assert!(stderr(&out).contains("--quantize"));
}

/// Config values no model can have are refused at load, naming config.json and the
/// field, where they would otherwise give NaN logits and empty text with exit 0.
#[test]
fn configs_that_cannot_work_are_refused_at_load() {
    for (overrides, field) in [
        (r#"{"rope_theta": 0}"#, "rope_theta"),
        (r#"{"rope_theta": -10000}"#, "rope_theta"),
        (r#"{"rms_norm_eps": 0}"#, "rms_norm_eps"),
        (r#"{"rms_norm_eps": -1e-6}"#, "rms_norm_eps"),
        (r#"{"num_attention_heads": 0}"#, "num_attention_heads"),
        (r#"{"num_key_value_heads": 3}"#, "num_key_value_heads"),
    ] {
        let model = tiny_model("{}");
        let config_path = model.path().join("config.json");
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
        let changes: serde_json::Value = serde_json::from_str(overrides).unwrap();
        for (key, value) in changes.as_object().unwrap() {
            config[key] = value.clone();
        }
        std::fs::write(&config_path, config.to_string()).unwrap();
        let err = dspec_fails(&[
            "generate",
            "--target",
            path_str(model.path()),
            "--prompt",
            "x",
        ]);
        assert!(
            err.contains("config.json") && err.contains(field),
            "{overrides}: {err}"
        );
    }
}

/// Every count a user gives has a range, and a value outside it is refused before
/// anything loads, with the flag and the range in the message.
#[test]
fn counts_outside_their_range_are_refused_with_the_range() {
    let model = tiny_model("{}");
    let m = path_str(model.path());
    let generate = [
        "generate",
        "--target",
        m,
        "--prompt",
        "x",
        "--drafter",
        "ngram",
    ];
    let bench = ["bench", "--target", m, "--drafter", "ngram"];
    let score = ["score", "--target", m, "--text", "x"];
    let cases: [(&[&str], &str, &str, &str); 10] = [
        (&generate, "--max-draft", "100000", "1 to 64"),
        (&generate, "--max-draft", "auto:65", "1 to 64"),
        (&generate, "--max-tokens", "0", "1 to 1000000"),
        (&generate, "--ngram", "0", "1 to 32"),
        (&generate, "--top-k", "2000000", "0 to 1000000"),
        (&bench, "--passes", "0", "1 to 1000"),
        (&bench, "--prefill-runs", "5000", "0 to 1000"),
        (&bench, "--prefill-lengths", "1024,0", "1 to 1048576"),
        (&score, "--window", "1", "2 to 16777216"),
        (&score, "--top-k", "0", "1 to 1000"),
    ];
    for (command, flag, value, range) in cases {
        let mut args = command.to_vec();
        args.extend([flag, value]);
        let out = dspec(&args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{flag} {value}: {err}");
        assert!(
            err.contains(flag) && err.contains(range),
            "{flag} {value}: {err}"
        );
    }
    // Sampling settings, checked as the server checks its request fields. A temperature
    // just above 0 would overflow the scaled logits to infinity and sample garbage.
    for (flag, value, range) in [
        ("--temperature", "1e-40", "0.001 to 100"),
        ("--temperature", "-1", "0.001 to 100"),
        ("--temperature", "inf", "0.001 to 100"),
        ("--top-p", "1.5", "(0, 1]"),
        ("--min-p", "1", "[0, 1)"),
    ] {
        let joined = format!("{flag}={value}");
        let mut args = generate.to_vec();
        args.push(&joined);
        let err = dspec_fails(&args);
        assert!(
            err.contains(flag) && err.contains(range),
            "{flag} {value}: {err}"
        );
    }
}

#[test]
fn ngram_drafter_gives_the_greedy_text_and_reports_tau() {
    let model = tiny_model("{}");
    let m = path_str(model.path());
    let run = |extra: &[&str]| -> serde_json::Value {
        let mut args = vec![
            "generate",
            "--target",
            m,
            "--prompt",
            "la la la la la la la la la",
            "--no-chat-template",
            "--max-tokens",
            "24",
            "--json",
        ];
        args.extend_from_slice(extra);
        let out = dspec(&args);
        assert!(out.status.success(), "{}", stderr(&out));
        serde_json::from_slice(&out.stdout).expect("json")
    };
    let plain = run(&[]);
    let spec = run(&["--drafter", "ngram", "--max-draft", "4"]);
    assert_eq!(spec["text"], plain["text"]);
    assert_eq!(
        spec["stats"]["generated_tokens"],
        plain["stats"]["generated_tokens"]
    );
    assert!(
        spec["speculative"]["tau"].as_f64().expect("tau") >= 1.0,
        "{spec}"
    );
    assert_eq!(spec["speculative"]["drafter"], "ngram");
    assert!(
        spec["stats"].get("decode_breakdown").is_none(),
        "the breakdown is plain decoding's: {spec}"
    );
    // Adaptive lengths (up to 3 here) change the speed, never the text.
    let auto = run(&["--drafter", "ngram", "--max-draft", "auto:3"]);
    assert_eq!(auto["text"], plain["text"]);
    let histogram = auto["speculative"]["acceptance_histogram"]
        .as_array()
        .expect("histogram");
    assert_eq!(histogram.len(), 4, "{auto}");
    for bad in ["0", "auto:0", "many", "auto3"] {
        let out = dspec(&[
            "generate",
            "--target",
            m,
            "--prompt",
            "x",
            "--drafter",
            "ngram",
            "--max-draft",
            bad,
        ]);
        assert_eq!(out.status.code(), Some(2), "clap rejects --max-draft {bad}");
        assert!(stderr(&out).contains("--max-draft"), "{}", stderr(&out));
    }
    let err = dspec_fails(&[
        "generate",
        "--target",
        m,
        "--prompt",
        "x",
        "--drafter",
        "nope",
    ]);
    assert!(err.contains("--drafter") && err.contains("ngram"), "{err}");
}

#[test]
fn trace_writes_one_json_line_per_round() {
    let model = tiny_model("{}");
    let m = path_str(model.path());
    let trace_dir = tempfile::tempdir().expect("temp dir");
    let trace = trace_dir.path().join("rounds.jsonl");
    let out = dspec(&[
        "generate",
        "--target",
        m,
        "--prompt",
        "do re mi do re mi do re mi do re mi",
        "--no-chat-template",
        "--max-tokens",
        "20",
        "--drafter",
        "ngram",
        "--trace",
        path_str(&trace),
        "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let text = std::fs::read_to_string(&trace).expect("trace written");
    let rounds: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    assert_eq!(
        rounds.len() as u64,
        report["speculative"]["target_forwards"]
            .as_u64()
            .expect("forwards")
    );
    let accepted: u64 = rounds
        .iter()
        .map(|r| r["accepted"].as_u64().expect("accepted"))
        .sum();
    assert_eq!(
        accepted,
        report["speculative"]["accepted_tokens"]
            .as_u64()
            .expect("accepted")
    );
    for r in &rounds {
        assert!(
            r["drafted"].as_array().expect("drafted").len() as u64
                >= r["accepted"].as_u64().unwrap_or(0)
        );
    }
    // --trace only makes sense with a drafter.
    let out = dspec(&[
        "generate", "--target", m, "--prompt", "x", "--trace", "t.jsonl",
    ]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "clap: --trace requires --drafter"
    );
}

#[test]
fn bench_compares_plain_and_speculative_on_the_same_prompts() {
    // Room for the default prompts, one byte a token with this tokenizer.
    let model = tiny_model(r#"{"max_position_embeddings": 1024}"#);
    let m = path_str(model.path());
    // `dspec bench` with the n-gram drafter and `extra`, expected to fail: its stderr.
    let bench_fails = |extra: &[&str]| dspec_fails(&bench_args(m, "ngram", extra));
    let prompts_dir = tempfile::tempdir().expect("temp dir");
    let prompts = prompts_dir.path().join("prompts.txt");
    std::fs::write(
        &prompts,
        "ab ab ab ab ab ab ab ab\n\n{\"prompt\": \"multi\\nline prompt\"}\nthird one\n",
    )
    .expect("write prompts");
    let out = dspec(&[
        "bench",
        "--target",
        m,
        "--drafter",
        "ngram",
        "--prompts",
        path_str(&prompts),
        "--max-tokens",
        "12",
        "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let report = &v["report"];
    assert_eq!(report["rows"].as_array().expect("rows").len(), 3);
    assert_eq!(report["all_identical"], true);
    assert_eq!(report["real_mismatches"], 0);
    assert_eq!(report["near_ties"], 0);
    for row in report["rows"].as_array().expect("rows") {
        assert!(row["first_difference"].is_null(), "{row}");
    }
    assert!(report["tau"].as_f64().expect("tau") >= 1.0);
    assert!(report["speedup"].as_f64().expect("speedup") > 0.0);
    // Three passes of each by default; a row reports the median pass of each side.
    assert_eq!(report["passes"], 3);
    for row in report["rows"].as_array().expect("rows") {
        for (side, passes) in [
            ("plain", "plain_passes"),
            ("speculative", "speculative_passes"),
        ] {
            let mut speeds: Vec<f64> = row[passes]
                .as_array()
                .expect("passes")
                .iter()
                .map(|v| v.as_f64().expect("tok/s"))
                .collect();
            assert_eq!(speeds.len(), 3, "{row}");
            speeds.sort_by(f64::total_cmp);
            let median = row[side]["decode_tokens_per_second"]
                .as_f64()
                .expect("tok/s");
            assert_eq!(median, speeds[1], "{row}");
        }
    }
    // Prefill of each prompt, warm (3 runs by default) with the first call apart.
    let prefill = report["prefill"]["rows"].as_array().expect("prefill rows");
    assert_eq!(prefill.len(), 3);
    for row in prefill {
        assert_eq!(row["warm_seconds"].as_array().expect("warm").len(), 3);
        assert!(row["first_call_seconds"].as_f64().expect("first call") > 0.0);
    }

    // Synthetic long prompts of the lengths asked for, after the prompts' own rows.
    let out = dspec(&[
        "bench",
        "--target",
        m,
        "--drafter",
        "ngram",
        "--max-tokens",
        "4",
        "--prefill-lengths",
        "300,700",
        "--prefill-runs",
        "2",
        "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let rows = v["report"]["prefill"]["rows"]
        .as_array()
        .expect("prefill rows");
    let lengths: Vec<(bool, u64)> = rows
        .iter()
        .map(|r| {
            (
                r["prompt"].is_null(),
                r["prompt_tokens"].as_u64().expect("tokens"),
            )
        })
        .collect();
    assert_eq!(lengths.len(), 5);
    assert_eq!(&lengths[3..], [(true, 300), (true, 700)]);
    assert!(rows
        .iter()
        .all(|r| r["warm_seconds"].as_array().map(Vec::len) == Some(2)));
    let err = bench_fails(&["--prefill-lengths", "4096"]);
    assert!(
        err.contains("--prefill-lengths") && err.contains("4096"),
        "{err}"
    );
    // --prefill-runs 0: no prefill measurement, no key; --passes sets the runs; --trace
    // gets the timed speculative runs' rounds (not the warm-up's).
    let trace = prompts_dir.path().join("rounds.jsonl");
    let out = dspec(&[
        "bench",
        "--target",
        m,
        "--drafter",
        "ngram",
        "--max-tokens",
        "4",
        "--prefill-runs",
        "0",
        "--passes",
        "2",
        "--trace",
        path_str(&trace),
        "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert!(v["report"].get("prefill").is_none(), "{v}");
    assert_eq!(v["report"]["passes"], 2);
    let mut forwards = 0;
    for row in v["report"]["rows"].as_array().expect("rows") {
        assert_eq!(row["speculative_passes"].as_array().map(Vec::len), Some(2));
        forwards += row["drafting"]["target_forwards"]
            .as_u64()
            .expect("forwards");
    }
    let rounds = std::fs::read_to_string(&trace).expect("trace written");
    for line in rounds.lines() {
        let round: serde_json::Value = serde_json::from_str(line).expect("a JSON line");
        assert!(round["verify_ms"].as_f64().is_some(), "{line}");
    }
    // The same rounds in both passes (greedy, a fixed draft length).
    assert!(forwards > 0);
    assert_eq!(rounds.lines().count() as u64, 2 * forwards, "{rounds}");
    let unwritable = prompts_dir.path().join("no such dir").join("rounds.jsonl");
    let err = bench_fails(&[
        "--max-tokens",
        "2",
        "--passes",
        "1",
        "--prefill-runs",
        "0",
        "--trace",
        path_str(&unwritable),
    ]);
    assert!(
        err.contains("--trace") && err.contains("no such dir"),
        "{err}"
    );
    // Out of its range, a count is a usage error (exit 2), as any bad flag is.
    let out = dspec(&bench_args(m, "ngram", &["--passes", "0"]));
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--passes"), "{}", stderr(&out));

    // The table, with the default prompts.
    let out = dspec(&[
        "bench",
        "--target",
        m,
        "--drafter",
        "ngram",
        "--max-tokens",
        "6",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let table = stdout(&out);
    assert!(
        table.contains("speedup") && table.contains("identical") && table.contains("prefill"),
        "{table}"
    );
    assert_eq!(
        table.lines().filter(|l| l.contains("identical")).count(),
        4,
        "{table}"
    );

    let err = bench_fails(&["--prompts", "/nonexistent/p.txt"]);
    assert!(
        err.contains("--prompts") && err.contains("/nonexistent/p.txt"),
        "{err}"
    );
    let bad = prompts_dir.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"text\": 1}\n").expect("write");
    let err = bench_fails(&["--prompts", path_str(&bad)]);
    assert!(
        err.contains("line 1") && err.contains("\"prompt\""),
        "{err}"
    );
}

/// With `--temperature`, bench times plain sampled decoding in every pass beside plain
/// greedy: per pass, the two runs' ratio, whose median is the report's `over_greedy`.
#[test]
fn bench_times_sampled_plain_decoding_beside_greedy() {
    let model = tiny_model("{}");
    let m = path_str(model.path());
    let dir = tempfile::tempdir().expect("temp dir");
    let prompts = dir.path().join("prompts.txt");
    std::fs::write(&prompts, "the quick brown fox\n").expect("write prompts");
    // One short prompt, 16 tokens, no prefill timing, then `extra`.
    let bench = |drafter: &str, extra: &[&str]| {
        let mut args = vec!["--prompts", path_str(&prompts)];
        args.extend_from_slice(&["--max-tokens", "16", "--prefill-runs", "0"]);
        args.extend_from_slice(extra);
        dspec(&bench_args(m, drafter, &args))
    };
    let out = bench(
        "ngram",
        &[
            "--temperature",
            "1.5",
            "--top-p",
            "0.95",
            "--seed",
            "7",
            "--passes",
            "3",
            "--json",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let report = &v["report"];
    let sampled = &report["sampled"];
    assert_eq!(sampled["sampling"]["temperature"], 1.5, "{sampled}");
    let rates = |value: &serde_json::Value| -> Vec<f64> {
        value
            .as_array()
            .expect("passes")
            .iter()
            .map(|v| v.as_f64().expect("tok/s"))
            .collect()
    };
    let greedy = rates(&report["rows"][0]["plain_passes"]);
    let row = &sampled["rows"][0];
    let passes = rates(&row["passes"]);
    assert_eq!(passes.len(), 3, "{sampled}");
    let mut sorted = passes.clone();
    sorted.sort_by(f64::total_cmp);
    assert_eq!(row["stats"]["decode_tokens_per_second"], sorted[1], "{row}");
    // One prompt: a pass's ratio is its sampled rate over its greedy rate.
    let mut ratios: Vec<f64> = passes.iter().zip(&greedy).map(|(s, g)| s / g).collect();
    ratios.sort_by(f64::total_cmp);
    let over_greedy = sampled["over_greedy"].as_f64().expect("ratio");
    assert!(
        (over_greedy - ratios[1]).abs() < 1e-9 * ratios[1],
        "{sampled}"
    );
    // The sampled runs sampled: at temperature 1.5 the output leaves greedy's.
    assert_ne!(row["tokens"], report["rows"][0]["tokens"], "{report}");
    // The speculative runs stayed greedy and are checked against plain decoding.
    assert_eq!(report["all_identical"], true);

    // Beside a draft model on its own thread (drafting ahead), whose runs stay exact.
    let drafter = format!("model:{m}");
    let out = bench(
        &drafter,
        &[
            "--draft-ahead",
            "on",
            "--passes",
            "2",
            "--temperature",
            "0.7",
            "--json",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(v["report"]["all_identical"], true, "{v}");
    assert_eq!(
        v["report"]["sampled"]["rows"][0]["passes"]
            .as_array()
            .map(Vec::len),
        Some(2),
        "{v}"
    );

    let out = bench(
        "ngram",
        &["--temperature", "0.7", "--min-p", "0.1", "--passes", "1"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let table = stdout(&out);
    assert!(
        table.contains("sampled plain decoding (temperature 0.7, min-p 0.1)")
            && table.contains("x plain greedy"),
        "{table}"
    );
    // Greedy: no sampled line.
    let out = bench("ngram", &["--passes", "1", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert!(v["report"].get("sampled").is_none(), "{v}");
    // A filter without a temperature would time nothing: refused, naming both flags.
    let err = dspec_fails(&bench_args(m, "ngram", &["--top-p", "0.9"]));
    assert!(
        err.contains("--top-p") && err.contains("--temperature"),
        "{err}"
    );
    let err = dspec_fails(&bench_args(
        m,
        "ngram",
        &["--temperature", "0.7", "--top-p", "1.5"],
    ));
    assert!(err.contains("--top-p must be in (0, 1]"), "{err}");
}

/// `--draft-ahead on` (a draft model drafting on its own thread while the target
/// verifies; the default on GPUs only) changes the speed, never the text.
#[test]
fn a_draft_model_drafting_ahead_gives_the_plain_text() {
    let model = tiny_model("{}");
    let drafter = format!("model:{}", path_str(model.path()));
    let run = |extra: &[&str]| {
        generate_json(model.path(), &[&["--max-tokens", "24"][..], extra].concat())
    };
    let plain = run(&[]);
    for ahead in ["on", "off", "eager"] {
        let spec = run(&[
            "--drafter",
            &drafter,
            "--max-draft",
            "3",
            "--draft-ahead",
            ahead,
        ]);
        assert_eq!(spec["text"], plain["text"], "--draft-ahead {ahead}");
        assert_eq!(spec["speculative"]["drafter"], "draft-model");
    }
    // A usage error (clap's exit code 2) that names the flag and its values.
    let out = dspec(&[
        "generate",
        "--target",
        path_str(model.path()),
        "--prompt",
        "x",
        "--drafter",
        &drafter,
        "--draft-ahead",
        "sometimes",
    ]);
    let err = stderr(&out);
    assert!(!out.status.success());
    assert!(
        err.contains("--draft-ahead") && err.contains("auto"),
        "{err}"
    );
}

#[test]
fn adapters_lists_drafter_kinds() {
    let out = dspec(&["adapters"]);
    assert!(out.status.success());
    let text = stdout(&out);
    for kind in ["ngram", "draft-model"] {
        assert!(
            text.lines().any(|l| l.starts_with(kind)),
            "{kind} missing from:\n{text}"
        );
    }
}

#[test]
fn dflash_checkpoint_drafts_through_the_cli_and_mismatches_are_errors() {
    let model = tiny_model(r#"{"model_type": "qwen3", "head_dim": 16}"#);
    let drafter = tempfile::tempdir().expect("temp dir");
    dspec_drafters::dflash::write_random_checkpoint(
        drafter.path(),
        dspec_drafters::dflash::TINY_DFLASH,
        5,
    )
    .expect("write dflash checkpoint");
    let run = |extra: &[&str]| {
        generate_json(model.path(), &[&["--max-tokens", "20"][..], extra].concat())
    };
    let plain = run(&[]);
    let spec = run(&["--drafter", path_str(drafter.path()), "--max-draft", "4"]);
    assert_eq!(spec["text"], plain["text"]);
    assert_eq!(spec["speculative"]["drafter"], "dflash");
    assert!(spec["speculative"]["drafted_tokens"].as_u64().unwrap_or(0) > 0);

    // A target with another hidden size: the context width no longer fits.
    let wide = tiny_model(r#"{"model_type": "qwen3", "head_dim": 16, "hidden_size": 64}"#);
    let err = dspec_fails(&[
        "generate",
        "--target",
        path_str(wide.path()),
        "--prompt",
        "x",
        "--drafter",
        path_str(drafter.path()),
    ]);
    assert!(
        err.contains("config.json") && err.contains("hidden"),
        "{err}"
    );
}

/// The median of `values` (of an even count, the mean of the middle two).
fn median_of(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    assert!(n > 0, "no values");
    match n % 2 {
        1 => values[n / 2],
        _ => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// `dspec bench --json` with a model drafter reports what its rounds cost: the medians of
/// the drafting and verify times of every round the timed passes drafted (the same rounds
/// `--trace` writes), against the plain step of its plain passes, with the break-even τ.
/// `dspec generate --json` at a fixed draft length times no plain step: milliseconds only.
#[test]
fn bench_reports_a_drafted_rounds_cost_in_plain_steps_and_its_break_even_tau() {
    let model = tiny_model(r#"{"model_type": "qwen3", "head_dim": 16}"#);
    let m = path_str(model.path());
    let drafter = tempfile::tempdir().expect("temp dir");
    dspec_drafters::dflash::write_random_checkpoint(
        drafter.path(),
        dspec_drafters::dflash::TINY_DFLASH,
        5,
    )
    .expect("write dflash checkpoint");
    let d = path_str(drafter.path());
    let trace = drafter.path().join("rounds.jsonl");
    let prompts = drafter.path().join("prompts.txt");
    std::fs::write(&prompts, "Hello there\nabc abc abc\n").expect("write prompts");
    let out = dspec(&bench_args(
        m,
        d,
        &[
            "--prompts",
            path_str(&prompts),
            "--max-draft",
            "4",
            "--max-tokens",
            "12",
            "--passes",
            "2",
            "--prefill-runs",
            "0",
            "--trace",
            path_str(&trace),
            "--json",
        ],
    ));
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let report = &v["report"];
    let cost = &report["round_cost"];
    let rounds: Vec<serde_json::Value> = std::fs::read_to_string(&trace)
        .expect("trace written")
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .filter(|r: &serde_json::Value| !r["drafted"].as_array().expect("drafted").is_empty())
        .collect();
    assert!(!rounds.is_empty());
    assert_eq!(cost["rounds"].as_u64(), Some(rounds.len() as u64), "{cost}");
    let field = |v: &serde_json::Value, key: &str| v[key].as_f64().expect(key);
    for (key, traced) in [("draft_ms", "draft_ms"), ("verify_ms", "verify_ms")] {
        let want = median_of(rounds.iter().map(|r| field(r, traced)).collect());
        assert!((field(cost, key) - want).abs() < 1e-9, "{key}: {cost}");
    }
    let whole = field(cost, "whole_ms");
    assert!(whole >= field(cost, "verify_ms") && whole > 0.0, "{cost}");
    let step = field(cost, "plain_step_ms");
    let plain_rate = field(report, "plain_tokens_per_second");
    assert!((step - 1e3 / plain_rate).abs() < 1e-6 * step, "{cost}");
    let steps = &cost["in_plain_steps"];
    for (key, ms) in [
        ("draft", "draft_ms"),
        ("verify", "verify_ms"),
        ("whole", "whole_ms"),
    ] {
        assert!(
            (field(steps, key) - field(cost, ms) / step).abs() < 1e-9,
            "{cost}"
        );
    }
    assert_eq!(steps["break_even_tau"], steps["whole"]);

    let spec = generate_json(
        model.path(),
        &["--max-tokens", "12", "--drafter", d, "--max-draft", "4"],
    );
    let cost = &spec["speculative"]["round_cost"];
    assert!(cost["rounds"].as_u64().expect("rounds") > 0, "{spec}");
    assert!(cost["whole_ms"].as_f64().expect("whole_ms") > 0.0, "{spec}");
    assert!(cost.get("in_plain_steps").is_none(), "{cost}");
}

#[test]
fn dspark_checkpoint_drafts_through_the_cli_with_its_options() {
    let model = tiny_model(dspec_adapters::fixtures::TINY_GEMMA4_OVERRIDES);
    let m = path_str(model.path());
    let drafter = tempfile::tempdir().expect("temp dir");
    dspec_drafters::dspark::write_random_checkpoint(
        drafter.path(),
        dspec_drafters::dspark::TINY_DSPARK_GEMMA4,
        5,
    )
    .expect("write dspark checkpoint");
    let d = path_str(drafter.path());
    let run = |extra: &[&str]| {
        generate_json(model.path(), &[&["--max-tokens", "16"][..], extra].concat())
    };
    let plain = run(&[]);
    for extra in [
        &["--drafter", d][..],
        &[
            "--drafter",
            d,
            "--drafter-bits",
            "0",
            "--confidence-threshold",
            "0.5",
        ][..],
    ] {
        let spec = run(extra);
        assert_eq!(spec["text"], plain["text"], "{extra:?}");
        assert_eq!(spec["speculative"]["drafter"], "dspark");
    }
    let out = dspec(&[
        "generate",
        "--target",
        m,
        "--prompt",
        "x",
        "--drafter",
        d,
        "--confidence-threshold",
        "2",
    ]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--confidence-threshold") && err.contains("from 0 and at most 1"),
        "{err}"
    );
    // A qwen3 target of another vocabulary size does not fit a gemma4 drafter.
    let other = tiny_model(r#"{"model_type": "qwen3", "head_dim": 16, "vocab_size": 300}"#);
    let out = dspec(&[
        "generate",
        "--target",
        path_str(other.path()),
        "--prompt",
        "x",
        "--drafter",
        d,
    ]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("vocab") && !err.contains("panicked"), "{err}");
}

/// Ctrl-C during `dspec generate` ends the generation after its current token: the text
/// so far ends its line, the numbers so far are printed with `stop: cancelled`, and the
/// status is 130, plain and speculative alike.
#[test]
fn ctrl_c_ends_a_generation_with_what_it_did() {
    use std::io::Read;
    let model = tiny_model(r#"{"max_position_embeddings": 200000}"#);
    for drafter in [None, Some("ngram")] {
        let mut args = vec![
            "generate",
            "--target",
            path_str(model.path()),
            "--prompt",
            "go on and on",
            "--max-tokens",
            "150000",
        ];
        if let Some(d) = drafter {
            args.extend(["--drafter", d]);
        }
        let mut child = Command::new(env!("CARGO_BIN_EXE_dspec"))
            .args(&args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("start dspec generate");
        let mut stdout = child.stdout.take().expect("piped stdout");
        let mut first = [0u8; 16];
        let n = stdout.read(&mut first).expect("streamed text");
        assert!(n > 0, "no text streamed");
        // SAFETY: sends SIGINT to the child this test spawned.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
        let mut rest = Vec::new();
        stdout.read_to_end(&mut rest).expect("the rest of stdout");
        let out = child.wait_with_output().expect("wait");
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(130), "{drafter:?}: {err}");
        assert!(
            rest.ends_with(b"\n"),
            "{drafter:?}: the text's line is not ended"
        );
        assert!(err.contains("interrupted"), "{drafter:?}: {err}");
        assert!(err.contains("stop: cancelled"), "{drafter:?}: {err}");
        assert!(!err.contains("panicked"), "{drafter:?}: {err}");
    }
}

/// Ctrl-C during `dspec bench` ends it before its next run: the report covers the passes
/// completed, says it was interrupted, and the status is 130.
#[test]
fn ctrl_c_ends_a_bench_with_the_passes_it_completed() {
    use std::io::{BufRead, BufReader, Read};
    let model = tiny_model(r#"{"max_position_embeddings": 1024}"#);
    let prompts_dir = tempfile::tempdir().expect("temp dir");
    let prompts = prompts_dir.path().join("prompts.txt");
    std::fs::write(&prompts, "ab ab ab ab\nthe second one\n").expect("write prompts");
    let mut child = Command::new(env!("CARGO_BIN_EXE_dspec"))
        .args(bench_args(
            path_str(model.path()),
            "ngram",
            &[
                "--prompts",
                path_str(&prompts),
                "--max-tokens",
                "8",
                "--passes",
                "1000",
                "--json",
            ],
        ))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start dspec bench");
    let mut stderr_lines = BufReader::new(child.stderr.take().expect("piped stderr"));
    let mut seen = String::new();
    while !seen.contains("pass 2 of 1000 done") {
        let mut line = String::new();
        let n = stderr_lines.read_line(&mut line).expect("stderr");
        assert!(n > 0, "bench ended before its second pass: {seen}");
        seen += &line;
    }
    // SAFETY: sends SIGINT to the child this test spawned.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
    let mut rest = String::new();
    stderr_lines
        .read_to_string(&mut rest)
        .expect("the rest of stderr");
    let out = child.wait_with_output().expect("wait");
    assert_eq!(out.status.code(), Some(130), "{rest}");
    assert!(
        rest.contains("interrupted") && !rest.contains("panicked"),
        "{rest}"
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json report");
    let report = &v["report"];
    assert_eq!(report["interrupted"], true);
    let passes = report["passes"].as_u64().expect("passes");
    assert!((2..1000).contains(&passes), "{passes} passes");
    let rows = report["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 2);
    for row in rows {
        let runs = row["plain_passes"].as_array().expect("plain passes").len();
        assert_eq!(
            runs,
            row["speculative_passes"].as_array().expect("passes").len()
        );
        assert!(runs >= 2 && runs as u64 <= passes, "{runs} of {passes}");
        assert_eq!(row["identical"], true);
    }
}

/// Whether the process `pid` has a handler for SIGINT (it called `interrupt::catch`).
#[cfg(target_os = "linux")]
fn catches_sigint(pid: u32) -> bool {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("SigCgt:"))
        .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
        .is_some_and(|mask| mask & (1 << (libc::SIGINT - 1)) != 0)
}

/// Ctrl-C during `dspec score --input` stops before the next request: the results so far
/// are printed and marked interrupted, and the status is 130.
#[cfg(target_os = "linux")]
#[test]
fn ctrl_c_ends_scoring_with_the_results_so_far() {
    let model = tiny_model("{}");
    let dir = tempfile::tempdir().expect("temp dir");
    let input = dir.path().join("requests.jsonl");
    let lines: Vec<String> = (0..20_000)
        .map(|i| format!(r#"{{"measure": "rolling", "text": "text number {i} to score"}}"#))
        .collect();
    std::fs::write(&input, lines.join("\n")).expect("write requests");
    let child = Command::new(env!("CARGO_BIN_EXE_dspec"))
        .args([
            "score",
            "--target",
            path_str(model.path()),
            "--input",
            path_str(&input),
            "--json",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start dspec score");
    // The handler goes in just before the first request is scored.
    let started = std::time::Instant::now();
    while !catches_sigint(child.id()) {
        assert!(
            started.elapsed().as_secs() < 600,
            "score never got to its requests"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    // SAFETY: sends SIGINT to the child this test spawned.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
    let out = child.wait_with_output().expect("wait");
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(130), "{err}");
    assert!(
        err.contains("interrupted") && !err.contains("panicked"),
        "{err}"
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(v["interrupted"], true);
    assert_eq!(v["requests"], 20_000);
    let results = v["results"].as_array().expect("results");
    assert!(results.len() < 20_000);
    for (n, result) in results.iter().enumerate() {
        assert_eq!(result["line"], n + 1, "results are in order, none skipped");
    }
}

/// A checkpoint whose weights hold NaN (corrupt bytes of the right size) is caught at
/// its first logits: generate (plain and speculative) and score fail naming the position
/// and the likely causes, instead of empty text with exit 0 or NaN scores.
#[test]
fn non_finite_logits_are_an_error_not_silent_output() {
    let model = tiny_model("{}");
    let weights = model.path().join("model.safetensors");
    let mut bytes = std::fs::read(&weights).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    let offsets = &header["model.norm.weight"]["data_offsets"];
    let (start, end) = (
        8 + header_len + offsets[0].as_u64().unwrap() as usize,
        8 + header_len + offsets[1].as_u64().unwrap() as usize,
    );
    assert_eq!(header["model.norm.weight"]["dtype"], "F32");
    for word in bytes[start..end].chunks_mut(4) {
        word.copy_from_slice(&f32::NAN.to_le_bytes());
    }
    std::fs::write(&weights, bytes).unwrap();
    let m = path_str(model.path());
    for extra in [&[][..], &["--drafter", "ngram"][..]] {
        let mut args = vec!["generate", "--target", m, "--prompt", "hello"];
        args.extend_from_slice(extra);
        let err = dspec_fails(&args);
        assert!(
            err.contains("not finite") && err.contains("position") && err.contains("corrupt"),
            "{extra:?}: {err}"
        );
    }
    let err = dspec_fails(&["score", "--target", m, "--text", "some text to score"]);
    assert!(err.contains("not finite"), "{err}");
}
