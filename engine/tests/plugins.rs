//! Adapter plugins end to end: the example phi3 plugin is built as a shared library,
//! loaded across the C ABI, checked by the shared conformance checker, and decoded
//! with plainly and speculatively; a deliberately faulty plugin checks that every way a
//! plugin can go wrong is a clear error (never a crash).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use serde_json::json;

use dspec_adapters::fixtures::RandomWeights;
use dspec_engine::decoding::generate::{generate, GenerationConfig};
use dspec_engine::decoding::sampling::SamplingParams;
use dspec_engine::decoding::speculative::VerifyAheadMode;
use dspec_engine::decoding::speculative::{generate_speculative, ServingOptions, Speculation};
use dspec_engine::loading::drafting::load_drafter;
use dspec_engine::loading::plugins::{registry_with_plugins, PluginOptions, PluginSearch};
use dspec_engine::loading::{load_model, LoadedModel};
use dspec_engine::tiny_model::{write_tiny_model, SPECIAL_TOKENS};
use dspec_plugin_api::conformance::check_target_model;
use dspec_plugin_api::plugin::abi::ABI_VERSION;
use dspec_plugin_api::plugin::load_plugin;
use dspec_plugin_api::{
    AdapterRegistry, AdapterSource, DrafterOptions, LoadOptions, Quantization, WeightSource,
};

struct Plugins {
    example: PathBuf,
    fault: PathBuf,
}

/// Builds both plugin libraries once per test process, with the cargo that runs the
/// tests, into the same target directory and profile.
fn plugins() -> &'static Plugins {
    static BUILT: OnceLock<Plugins> = OnceLock::new();
    BUILT.get_or_init(|| {
        let target_dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .parent()
            .expect("CARGO_TARGET_TMPDIR is <target>/tmp")
            .to_path_buf();
        // This test executable lives in <target>/<profile>/deps.
        let exe = std::env::current_exe().expect("test executable path");
        let profile = exe
            .parent()
            .and_then(Path::parent)
            .and_then(|p| p.file_name())
            .and_then(|n| n.to_str())
            .unwrap_or("debug")
            .to_string();
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| env!("CARGO").to_string());
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml");
        let mut build = Command::new(cargo);
        build
            .args(["build", "--quiet", "-p", "dspec-example-adapter"])
            .args(["-p", "dspec-fault-plugin", "--manifest-path"])
            .arg(&workspace)
            .arg("--target-dir")
            .arg(&target_dir);
        if profile == "release" {
            build.arg("--release");
        }
        let out = build.output().expect("run cargo build for the plugins");
        assert!(
            out.status.success(),
            "building the plugins failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let lib = |name: &str| {
            target_dir.join(&profile).join(format!(
                "{}{name}{}",
                std::env::consts::DLL_PREFIX,
                std::env::consts::DLL_SUFFIX
            ))
        };
        Plugins {
            example: lib("dspec_example_adapter"),
            fault: lib("dspec_fault_plugin"),
        }
    })
}

/// Built-ins plus the given plugin files; the environment's plugin dirs are ignored.
fn registry(files: &[&Path]) -> AdapterRegistry {
    let options = PluginOptions {
        files: files.iter().map(|f| f.to_path_buf()).collect(),
        override_builtin: false,
    };
    registry_with_plugins(&options, &PluginSearch::default())
        .unwrap_or_else(|e| panic!("loading plugins {files:?}: {e}"))
        .registry
}

/// A tiny phi3 model directory: the tiny model's tokenizer files, a phi3 config and
/// random weights under phi3's tensor names (fused qkv and gate_up projections).
fn write_tiny_phi3(dir: &Path, seed: u64) {
    write_tiny_model(dir, "{}", seed).expect("tiny model files");
    let vocab = (256 + SPECIAL_TOKENS.len()) as i32;
    let (hidden, inner, heads, kv_heads, layers) = (32, 64, 4, 2, 2);
    let head_dim = hidden / heads;
    let config = json!({
        "model_type": "phi3", "architectures": ["Phi3ForCausalLM"],
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inner,
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5, "max_position_embeddings": 512,
        "tie_word_embeddings": false, "hidden_act": "silu", "torch_dtype": "float32"
    });
    std::fs::write(dir.join("config.json"), config.to_string()).expect("write config");
    let mut w = RandomWeights::new(seed).expect("random weights");
    w.tensor("model.embed_tokens.weight", &[vocab, hidden])
        .unwrap();
    for i in 0..layers {
        let p = format!("model.layers.{i}");
        let qkv = (heads + 2 * kv_heads) * head_dim;
        w.tensor(&format!("{p}.input_layernorm.weight"), &[hidden])
            .unwrap();
        w.tensor(&format!("{p}.self_attn.qkv_proj.weight"), &[qkv, hidden])
            .unwrap();
        w.tensor(&format!("{p}.self_attn.o_proj.weight"), &[hidden, hidden])
            .unwrap();
        w.tensor(&format!("{p}.post_attention_layernorm.weight"), &[hidden])
            .unwrap();
        w.tensor(
            &format!("{p}.mlp.gate_up_proj.weight"),
            &[2 * inner, hidden],
        )
        .unwrap();
        w.tensor(&format!("{p}.mlp.down_proj.weight"), &[hidden, inner])
            .unwrap();
    }
    w.tensor("model.norm.weight", &[hidden]).unwrap();
    w.tensor("lm_head.weight", &[vocab, hidden]).unwrap();
    w.save(dir, None).expect("save weights");
}

fn tiny_phi3(seed: u64) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    write_tiny_phi3(dir.path(), seed);
    dir
}

/// A model dir (with tokenizer files) for the fault plugin; `fault` picks what breaks.
fn faulty_model(fault: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    write_tiny_model(dir.path(), "{}", 1).expect("tiny model files");
    let config = json!({"model_type": "faulty", "fault": fault, "vocab_size": 259});
    std::fs::write(dir.path().join("config.json"), config.to_string()).expect("write config");
    dir
}

fn load(dir: &Path, registry: &AdapterRegistry, options: &LoadOptions) -> LoadedModel {
    load_model(dir.to_str().expect("utf-8 path"), registry, options, false)
        .unwrap_or_else(|e| panic!("loading {}: {e}", dir.display()))
}

#[test]
fn plugin_descriptor_is_read_and_registered_as_a_plugin_family() {
    let p = plugins();
    let plugin = load_plugin(&p.example).expect("load the example plugin");
    assert_eq!(plugin.name(), "example-phi3");
    assert_eq!(plugin.version(), env!("CARGO_PKG_VERSION"));
    assert_eq!(plugin.model_types(), ["phi3".to_string()]);
    assert_eq!(plugin.architectures(), ["Phi3ForCausalLM".to_string()]);
    assert_eq!(plugin.abi_version(), ABI_VERSION);

    let registry = registry(&[&p.example]);
    let dir = tiny_phi3(1);
    let found = registry
        .detect(dir.path())
        .map_err(|e| e.to_string())
        .unwrap();
    assert_eq!(
        found.adapter.source,
        AdapterSource::Plugin {
            path: p.example.clone(),
            abi_version: ABI_VERSION
        }
    );
    assert!(found.reason.contains("phi3"), "{}", found.reason);
}

#[test]
fn plugin_model_passes_the_conformance_checker_across_the_abi() {
    let p = plugins();
    let registry = registry(&[&p.example]);
    let dir = tiny_phi3(2);
    let plain = load(dir.path(), &registry, &LoadOptions::default());
    assert_eq!(plain.model.info().model_type, "phi3");
    assert_eq!(plain.model.info().num_layers, 2);
    check_target_model(plain.model.as_ref()).unwrap_or_else(|e| panic!("f32: {e}"));

    let quantized = LoadOptions {
        dtype: None,
        quantize: Some(Quantization {
            bits: 8,
            group_size: 32,
        }),
        ..LoadOptions::default()
    };
    let q = load(dir.path(), &registry, &quantized);
    assert_eq!(q.model.info().quantized_bits, Some(8));
    check_target_model(q.model.as_ref()).unwrap_or_else(|e| panic!("8-bit on load: {e}"));
}

#[test]
fn plugin_cache_is_refused_by_another_model() {
    let p = plugins();
    let registry = registry(&[&p.example]);
    let (a, b) = (tiny_phi3(3), tiny_phi3(4));
    let a = load(a.path(), &registry, &LoadOptions::default());
    let b = load(b.path(), &registry, &LoadOptions::default());
    let mut cache = a.model.new_cache();
    let tokens = mlx_rs::Array::from_slice(&[1u32, 2, 3], &[1, 3]);
    let err = b
        .model
        .forward(&tokens, &mut cache, &[])
        .err()
        .expect("a cache of another model must be refused")
        .to_string();
    assert!(err.contains("not made by this model"), "{err}");
    // The cache state crosses the ABI: keys and values of both layers after a forward.
    a.model.forward(&tokens, &mut cache, &[]).unwrap();
    assert_eq!(cache.offset(), 3);
    assert_eq!(cache.state().count(), 4);
    cache.trim(2).expect("trim");
    assert_eq!(cache.offset(), 1);
}

fn greedy_config(max_tokens: usize) -> GenerationConfig {
    GenerationConfig {
        max_tokens,
        sampling: SamplingParams::default(),
        stop_strings: Vec::new(),
        // No EOS: every run generates exactly max_tokens, so outputs compare in full.
        eos_ids: Vec::new(),
    }
}

#[test]
fn speculative_decoding_on_a_plugin_target_equals_plain_greedy() {
    let p = plugins();
    let registry = registry(&[&p.example]);
    let target_dir = tiny_phi3(5);
    let draft_dir = tiny_phi3(6);
    let target = load(target_dir.path(), &registry, &LoadOptions::default());
    let cfg = greedy_config(40);
    let prompt = "abcabcabcabc the cat the cat the cat";
    let ids = target.tokenizer.encode_prompt(prompt, false).unwrap();
    let plain = generate(
        target.model.as_ref(),
        &target.tokenizer,
        &ids,
        &cfg,
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(plain.tokens.len(), 40);

    let draft_spec = format!("model:{}", draft_dir.path().display());
    for spec in ["ngram", draft_spec.as_str()] {
        let options = DrafterOptions {
            ngram: 2,
            ..DrafterOptions::default()
        };
        let mut drafter = load_drafter(spec, &target, &registry, &LoadOptions::default(), &options)
            .unwrap_or_else(|e| panic!("drafter {spec}: {e}"));
        let out = generate_speculative(
            target.model.as_ref(),
            &target.tokenizer,
            &ids,
            &cfg,
            Speculation {
                drafter: drafter.as_mut(),
                max_draft: 4,
                adaptive: false,
                trace: None,
                verify_ahead: VerifyAheadMode::Always,
            },
            &mut |_| {},
            ServingOptions::default(),
        )
        .unwrap_or_else(|e| panic!("speculative with {spec}: {e}"));
        assert_eq!(out.tokens, plain.tokens, "drafter {spec}");
        assert!(out.speculative.target_forwards <= 40, "drafter {spec}");
    }

    // A draft model of the target itself is always right: every round accepts in full,
    // which exercises trimming the plugin's cache by zero and by whole drafts.
    let self_spec = format!("model:{}", target_dir.path().display());
    let mut drafter = load_drafter(
        &self_spec,
        &target,
        &registry,
        &LoadOptions::default(),
        &DrafterOptions::default(),
    )
    .unwrap();
    let out = generate_speculative(
        target.model.as_ref(),
        &target.tokenizer,
        &ids,
        &cfg,
        Speculation {
            drafter: drafter.as_mut(),
            max_draft: 4,
            adaptive: false,
            trace: None,
            verify_ahead: VerifyAheadMode::Always,
        },
        &mut |_| {},
        ServingOptions::default(),
    )
    .unwrap();
    assert_eq!(out.tokens, plain.tokens);
    assert!(out.speculative.tau > 3.0, "tau {}", out.speculative.tau);
}

#[test]
fn a_failing_or_panicking_plugin_call_is_an_error_not_a_crash() {
    let p = plugins();
    let registry = registry(&[&p.fault]);
    let tokens = mlx_rs::Array::from_slice(&[1u32, 2], &[1, 2]);

    let ok = faulty_model("none");
    let model = load(ok.path(), &registry, &LoadOptions::default()).model;
    let mut cache = model.new_cache();
    model
        .forward(&tokens, &mut cache, &[0])
        .expect("the healthy fault model runs");

    let failing = faulty_model("fail_forward");
    let model = load(failing.path(), &registry, &LoadOptions::default()).model;
    let err = model
        .forward(&tokens, &mut model.new_cache(), &[])
        .err()
        .expect("forward fails")
        .to_string();
    assert!(
        err.contains("forward failed on purpose") && err.contains("dspec_fault_plugin"),
        "{err}"
    );
    // An error is not a panic: the model stays usable.
    let again = model
        .forward(&tokens, &mut model.new_cache(), &[])
        .err()
        .unwrap()
        .to_string();
    assert!(again.contains("on purpose"), "{again}");

    // An MLX exception inside the plugin comes back as its message.
    let mlx = faulty_model("mlx_forward");
    let model = load(mlx.path(), &registry, &LoadOptions::default()).model;
    let err = model
        .forward(&tokens, &mut model.new_cache(), &[])
        .err()
        .expect("MLX error")
        .to_string();
    assert!(err.contains("MLX error") && err.contains("matmul"), "{err}");

    let panicking = faulty_model("panic_forward");
    let model = load(panicking.path(), &registry, &LoadOptions::default()).model;
    let err = model
        .forward(&tokens, &mut model.new_cache(), &[])
        .err()
        .expect("forward panics")
        .to_string();
    assert!(
        err.contains("panicked") && err.contains("exploded on purpose"),
        "{err}"
    );
    let after = model.embed(&tokens).expect_err("refused").to_string();
    assert!(after.contains("panicked earlier"), "{after}");

    for fault in ["fail_load", "panic_load"] {
        let dir = faulty_model(fault);
        let err = load_model(
            dir.path().to_str().unwrap(),
            &registry,
            &LoadOptions::default(),
            false,
        )
        .err()
        .expect("load fails")
        .to_string();
        assert!(
            err.contains("load") && err.contains("on purpose"),
            "{fault}: {err}"
        );
    }
}

#[test]
fn files_that_are_not_plugins_are_refused_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("libnotaplugin.so");
    std::fs::write(&text, "this is not a shared library").unwrap();
    let err = load_plugin(&text).err().expect("text file").to_string();
    assert!(
        err.contains("libnotaplugin.so") && err.contains("cannot be loaded as a shared library"),
        "{err}"
    );
    let missing = dir.path().join("nothing-here.so");
    let err = load_plugin(&missing)
        .err()
        .expect("missing file")
        .to_string();
    assert!(err.contains("no such file"), "{err}");
}

/// A real shared library without the entry point: libmlx itself, found among the
/// libraries this process has mapped (Linux: /proc/self/maps).
#[cfg(target_os = "linux")]
#[test]
fn a_shared_library_without_the_entry_point_is_refused() {
    let _ = mlx_rs::Array::from_int(1); // make sure libmlx is mapped
    let maps = std::fs::read_to_string("/proc/self/maps").expect("read /proc/self/maps");
    let libmlx = maps
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| {
            Path::new(p)
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("libmlx"))
        })
        .expect("libmlx is mapped");
    let err = load_plugin(Path::new(libmlx))
        .err()
        .expect("libmlx is no plugin")
        .to_string();
    assert!(
        err.contains("not a dspec plugin") && err.contains("dspec_plugin_descriptor"),
        "{err}"
    );
}

// ---- The dspec binary ----

/// Runs dspec with no plugin directories of the user's, plus `env`.
fn dspec(args: &[&str], env: &[(&str, &str)]) -> Output {
    let home = tempfile::tempdir().expect("temp dir");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_dspec"));
    cmd.args(args)
        .env("XDG_DATA_HOME", home.path())
        .env_remove("DSPEC_PLUGIN_PATH");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run dspec")
}

fn ok(args: &[&str], env: &[(&str, &str)]) -> String {
    let out = dspec(args, env);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "dspec {args:?} failed: {err}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn fails(args: &[&str], env: &[(&str, &str)]) -> String {
    let out = dspec(args, env);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    // Exit code 1 is dspec reporting an error; a panic in dspec would be 101, a crash
    // a signal. (A panicking plugin's own panic message may precede the error line.)
    assert_eq!(out.status.code(), Some(1), "dspec {args:?}: {err}");
    assert!(
        err.lines().any(|l| l.starts_with("error: ")),
        "dspec {args:?}: {err}"
    );
    err
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

#[test]
fn cli_lists_detects_and_generates_with_a_plugin_family() {
    let p = plugins();
    let lib = s(&p.example);
    let listing = ok(&["adapters", "--plugin", lib], &[]);
    let row = listing
        .lines()
        .find(|l| l.starts_with("phi3 "))
        .unwrap_or_else(|| panic!("no phi3 row:\n{listing}"));
    assert!(
        row.contains("example-phi3") && row.contains(lib) && row.contains("ABI v1"),
        "{row}"
    );
    assert!(
        listing.lines().any(|l| l.starts_with("llama ")),
        "{listing}"
    );

    let model = tiny_phi3(7);
    let detect = ok(
        &["adapters", "--plugin", lib, "--detect", s(model.path())],
        &[],
    );
    assert!(
        detect.contains("example-phi3") && detect.contains("plugin"),
        "{detect}"
    );

    let run = |extra: &[&str]| -> serde_json::Value {
        let mut args = vec!["generate", "--plugin", lib, "--target", s(model.path())];
        args.extend([
            "--prompt",
            "hello hello hello",
            "--max-tokens",
            "12",
            "--json",
        ]);
        args.extend(extra);
        serde_json::from_str(&ok(&args, &[])).expect("JSON report")
    };
    let plain = run(&[]);
    assert_eq!(plain["model"]["model_type"], "phi3");
    assert!(plain["model"]["adapter"]
        .as_str()
        .unwrap()
        .contains("example-phi3"));
    let spec = run(&["--drafter", "ngram"]);
    assert_eq!(spec["text"], plain["text"]);
    assert!(
        spec["speculative"]["target_forwards"].as_u64().is_some(),
        "{spec}"
    );

    // Without the plugin the family is unknown, and the error says how to add one.
    let err = fails(&["adapters", "--detect", s(model.path())], &[]);
    assert!(err.contains("`phi3`") && err.contains("--plugin"), "{err}");
}

#[test]
fn cli_finds_plugins_in_the_plugin_path_and_the_user_dir() {
    let p = plugins();
    let dir = tempfile::tempdir().unwrap();
    let plugin_dir = dir.path().join("plugins");
    std::fs::create_dir_all(&plugin_dir).unwrap();
    std::os::unix::fs::symlink(&p.example, plugin_dir.join("libphi3.so")).unwrap();
    let listing = ok(&["adapters"], &[("DSPEC_PLUGIN_PATH", s(&plugin_dir))]);
    assert!(listing.lines().any(|l| l.starts_with("phi3 ")), "{listing}");

    let data = dir.path().join("data");
    let user_dir = data.join("dspec/plugins");
    std::fs::create_dir_all(&user_dir).unwrap();
    std::os::unix::fs::symlink(&p.example, user_dir.join("libphi3.so")).unwrap();
    let listing = ok(&["adapters"], &[("XDG_DATA_HOME", s(&data))]);
    assert!(listing.lines().any(|l| l.starts_with("phi3 ")), "{listing}");

    // The same plugin from --plugin and a plugin dir: the first one found wins.
    let both = dspec(
        &["adapters", "--plugin", s(&p.example)],
        &[("DSPEC_PLUGIN_PATH", s(&plugin_dir))],
    );
    assert!(both.status.success());
    let listing = String::from_utf8_lossy(&both.stdout);
    assert_eq!(
        listing.lines().filter(|l| l.starts_with("phi3 ")).count(),
        1
    );
}

#[test]
fn cli_errors_for_bad_plugins_are_clear() {
    let p = plugins();
    let fault = s(&p.fault);

    let err = fails(
        &["adapters", "--plugin", fault],
        &[("DSPEC_FAULT_PLUGIN_ABI", "99")],
    );
    assert!(
        err.contains(fault)
            && err.contains("ABI v99")
            && err.contains(&format!("ABI v{ABI_VERSION}")),
        "{err}"
    );

    let clash = [("DSPEC_FAULT_PLUGIN_MODEL_TYPES", "llama")];
    let err = fails(&["adapters", "--plugin", fault], &clash);
    assert!(
        err.contains("`llama`")
            && err.contains("built-in adapter llama")
            && err.contains("--plugin-override"),
        "{err}"
    );
    let listing = ok(
        &["adapters", "--plugin", fault, "--plugin-override"],
        &clash,
    );
    let row = listing
        .lines()
        .find(|l| l.starts_with("llama "))
        .expect("llama row");
    assert!(row.contains("fault-plugin") && row.contains(fault), "{row}");

    // Two plugins claiming one model_type: always an error, naming both.
    let err = fails(
        &[
            "adapters",
            "--plugin",
            s(&p.example),
            "--plugin",
            fault,
            "--plugin-override",
        ],
        &[("DSPEC_FAULT_PLUGIN_MODEL_TYPES", "phi3")],
    );
    assert!(err.contains("example-phi3") && err.contains(fault), "{err}");

    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("libfake.so");
    std::fs::write(&text, "not a library").unwrap();
    let err = fails(&["adapters", "--plugin", s(&text)], &[]);
    assert!(
        err.contains("cannot be loaded as a shared library"),
        "{err}"
    );
    let err = fails(&["adapters", "--plugin", "/no/such/plugin.so"], &[]);
    assert!(err.contains("no such file"), "{err}");

    // A plugin that panics mid-generation: an error from dspec, not a crash.
    let model = faulty_model("panic_forward");
    let err = fails(
        &[
            "generate",
            "--plugin",
            fault,
            "--target",
            s(model.path()),
            "--prompt",
            "hi",
        ],
        &[],
    );
    assert!(
        err.contains("panicked") && err.contains("exploded on purpose"),
        "{err}"
    );
}

/// A plugin whose cache keeps recurrent state (two positions back unless the host asks
/// for more), generating with drafts that are rejected six at a time. Built with the
/// rollback entries, it learns from the engine how far rounds roll back and keeps that
/// many states; laid out as plugins built before those entries are, it still loads and
/// keeps what v1 meant without them: the engine cannot ask, and the plugin refuses the
/// first rollback past its own window, naming how far it can go.
#[test]
fn cli_sizes_a_recurrent_plugin_cache_and_older_descriptor_layouts_still_load() {
    let p = plugins();
    let fault = s(&p.fault);
    let dir = tempfile::tempdir().expect("temp dir");
    write_tiny_model(dir.path(), "{}", 1).expect("tiny model files");
    let config = json!({"model_type": "faulty", "fault": "recurrent", "vocab_size": 259});
    std::fs::write(dir.path().join("config.json"), config.to_string()).expect("write config");
    // The model always predicts `a`, so n-gram's continuations of the prompt's earlier
    // `abc`s are rejected until the output's own `aaa` takes over.
    let args = [
        "generate",
        "--plugin",
        fault,
        "--target",
        s(dir.path()),
        "--prompt",
        "abcabcabcabc",
        "--max-tokens",
        "16",
        "--drafter",
        "ngram",
        "--max-draft",
        "6",
        "--json",
    ];
    let old_layout = [("DSPEC_FAULT_PLUGIN_LAYOUT", "first-v1")];

    let out: serde_json::Value = serde_json::from_str(&ok(&args, &[])).expect("JSON report");
    assert_eq!(out["text"], "a".repeat(16), "{out}");
    let spec = &out["speculative"];
    let rejected_past_two = spec["draft_histogram"]
        .as_array()
        .expect("draft histogram")
        .iter()
        .skip(3)
        .any(|rounds| rounds.as_u64() > Some(0));
    assert!(
        rejected_past_two && spec["acceptance_histogram"][0].as_u64() > Some(0),
        "rounds of more than two drafts, some rejected in full: {spec}"
    );

    let listing = ok(&["adapters", "--plugin", fault], &old_layout);
    let row = listing
        .lines()
        .find(|l| l.starts_with("faulty "))
        .unwrap_or_else(|| panic!("no faulty row:\n{listing}"));
    assert!(row.contains("ABI v1"), "{row}");
    let err = fails(&args, &old_layout);
    assert!(
        err.contains("cache_trim") && err.contains("at most 2"),
        "{err}"
    );
    let plain = [&args[..9], &["--json"]].concat();
    let out: serde_json::Value =
        serde_json::from_str(&ok(&plain, &old_layout)).expect("JSON report");
    assert_eq!(
        out["text"],
        "a".repeat(16),
        "plain decoding needs no rollback"
    );
}

/// DFlash and DSpark draft from the target's tap outputs and (DFlash) through its
/// embedding and lm_head: all of it crosses the C ABI here, and the output must still
/// be plain greedy decoding's.
#[test]
fn dflash_and_dspark_draft_for_a_plugin_target() {
    let p = plugins();
    let registry = registry(&[&p.example]);
    let target_dir = tiny_phi3(7);
    let target = load(target_dir.path(), &registry, &LoadOptions::default());
    let cfg = greedy_config(24);
    let ids = target
        .tokenizer
        .encode_prompt("drafting across the boundary", false)
        .unwrap();
    let plain = generate(
        target.model.as_ref(),
        &target.tokenizer,
        &ids,
        &cfg,
        &mut |_| {},
    )
    .unwrap();
    let root = tempfile::tempdir().expect("temp dir");
    let dflash = root.path().join("dflash");
    let dspark = root.path().join("dspark");
    dspec_drafters::dflash::write_random_checkpoint(
        &dflash,
        dspec_drafters::dflash::TINY_DFLASH,
        3,
    )
    .expect("dflash checkpoint");
    dspec_drafters::dspark::write_random_checkpoint(
        &dspark,
        dspec_drafters::dspark::TINY_DSPARK_QWEN3,
        3,
    )
    .expect("dspark checkpoint");
    for (dir, kind) in [(&dflash, "dflash"), (&dspark, "dspark")] {
        let mut drafter = load_drafter(
            dir.to_str().expect("utf-8 path"),
            &target,
            &registry,
            &LoadOptions::default(),
            &DrafterOptions::default(),
        )
        .unwrap_or_else(|e| panic!("{kind}: {e}"));
        assert_eq!(drafter.name(), kind);
        let out = generate_speculative(
            target.model.as_ref(),
            &target.tokenizer,
            &ids,
            &cfg,
            Speculation {
                drafter: drafter.as_mut(),
                max_draft: 3,
                adaptive: false,
                trace: None,
                verify_ahead: VerifyAheadMode::Always,
            },
            &mut |_| {},
            ServingOptions::default(),
        )
        .unwrap_or_else(|e| panic!("{kind}: {e}"));
        assert_eq!(out.tokens, plain.tokens, "{kind}");
        assert!(out.speculative.drafted_tokens > 0, "{kind} drafted nothing");
    }
}
