//! Fuzzing, on stable Rust through proptest, of the parsers that read what users
//! download or send: GGUF files, safetensors files, config.json, chat templates and the
//! server's request bodies. Every input must end in a value or an error: a panic fails
//! the case (proptest then shrinks it to a small one), and an abort or a hang fails the
//! whole test.
//!
//! Inputs are valid seeds changed by a few random edits (bytes set, cut, inserted, or
//! overwritten with sizes that trip length checks), so most of them get past the first
//! check. The suite runs a few hundred per target; `DSPEC_FUZZ_CASES=N` runs N per target
//! (docs/fuzzing.md has the long runs and what they found).

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use serde_json::{json, Value};

use dspec_engine::formats::gguf::GgufFile;
use dspec_engine::loading::{builtin_registry, load_model};
use dspec_engine::serve::request::{chat_request, completion_request, ServedModel};
use dspec_engine::text::chat_template::{ChatMessage, ChatTemplate};
use dspec_engine::tiny_model::write_tiny_model;
use dspec_plugin_api::LoadOptions;

/// Cases per target: `default`, or `DSPEC_FUZZ_CASES` when set.
fn runner(default: u32) -> TestRunner {
    let cases = std::env::var("DSPEC_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default);
    TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    })
}

/// One random change to a byte string.
#[derive(Debug, Clone)]
enum Edit {
    Set(usize, u8),
    Cut(usize),
    Insert(usize, u8),
    /// Eight bytes overwritten with a little-endian number: lengths, counts and offsets
    /// in both formats are u64s, and these values are the ones that break arithmetic.
    Word(usize, u64),
}

fn edits() -> impl Strategy<Value = Vec<Edit>> {
    let word = prop_oneof![
        Just(0u64),
        Just(1),
        Just(u64::MAX),
        Just(u64::MAX / 2 + 1),
        Just(1 << 32),
        Just(1 << 40),
        any::<u64>(),
    ];
    let edit = prop_oneof![
        4 => (any::<usize>(), any::<u8>()).prop_map(|(at, v)| Edit::Set(at, v)),
        1 => any::<usize>().prop_map(Edit::Cut),
        1 => (any::<usize>(), any::<u8>()).prop_map(|(at, v)| Edit::Insert(at, v)),
        3 => (any::<usize>(), word).prop_map(|(at, v)| Edit::Word(at, v)),
    ];
    prop::collection::vec(edit, 1..6)
}

fn mutate(seed: &[u8], edits: &[Edit]) -> Vec<u8> {
    let mut bytes = seed.to_vec();
    for edit in edits {
        let len = bytes.len().max(1);
        match *edit {
            Edit::Set(at, v) if !bytes.is_empty() => bytes[at % len] = v,
            Edit::Cut(at) => bytes.truncate(at % len),
            Edit::Insert(at, v) => bytes.insert(at % (bytes.len() + 1), v),
            Edit::Word(at, v) if bytes.len() >= 8 => {
                let at = at % (bytes.len() - 7);
                bytes[at..at + 8].copy_from_slice(&v.to_le_bytes());
            }
            _ => {}
        }
    }
    bytes
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// A small valid GGUF v3 file: metadata of several types and an F32 and a Q8_0 tensor.
fn gguf_seed() -> Vec<u8> {
    let mut kv = Vec::new();
    put_str(&mut kv, "general.architecture");
    kv.extend(8u32.to_le_bytes());
    put_str(&mut kv, "llama");
    put_str(&mut kv, "llama.block_count");
    kv.extend(4u32.to_le_bytes());
    kv.extend(2u32.to_le_bytes());
    put_str(&mut kv, "llama.rope.freq_base");
    kv.extend(6u32.to_le_bytes());
    kv.extend(10000f32.to_le_bytes());
    put_str(&mut kv, "tokenizer.ggml.tokens");
    kv.extend(9u32.to_le_bytes());
    kv.extend(8u32.to_le_bytes());
    kv.extend(3u64.to_le_bytes());
    for token in ["a", "b", "<s>"] {
        put_str(&mut kv, token);
    }
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend(2u64.to_le_bytes());
    out.extend(4u64.to_le_bytes());
    out.extend(kv);
    // (name, dims, ggml type, offset, data)
    let f32_data: Vec<u8> = (0..8).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let mut q8_data = Vec::new();
    q8_data.extend(half_one());
    q8_data.extend((0..32).map(|i| i as u8));
    for (name, dims, ty, offset) in [
        ("token_embd.weight", vec![4u64, 2], 0u32, 0u64),
        ("blk.0.ffn_up.weight", vec![32u64, 1], 8u32, 32u64),
    ] {
        put_str(&mut out, name);
        out.extend((dims.len() as u32).to_le_bytes());
        dims.iter().for_each(|d| out.extend(d.to_le_bytes()));
        out.extend(ty.to_le_bytes());
        out.extend(offset.to_le_bytes());
    }
    while !out.len().is_multiple_of(32) {
        out.push(0);
    }
    out.extend(&f32_data);
    out.extend(&q8_data);
    out
}

/// 1.0 as an IEEE half, a Q8_0 block's scale.
fn half_one() -> [u8; 2] {
    0x3c00u16.to_le_bytes()
}

/// Every GGUF file opens or is refused; every tensor of one that opens dequantizes or
/// is refused.
#[test]
fn gguf_files_open_or_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fuzz.gguf");
    let seed = gguf_seed();
    std::fs::write(&path, &seed).unwrap();
    let file = GgufFile::open(&path).expect("the seed is a valid GGUF file");
    assert_eq!(file.tensors().len(), 2);
    for info in file.tensors() {
        file.dequantize_f32(info)
            .expect("the seed's tensors dequantize");
    }
    runner(512)
        .run(&edits(), |edits| {
            std::fs::write(&path, mutate(&seed, &edits)).unwrap();
            if let Ok(file) = GgufFile::open(&path) {
                for info in file.tensors() {
                    let _ = file.dequantize_f32(info);
                }
            }
            Ok(())
        })
        .unwrap();
}

/// A safetensors file from a header (as JSON) and its data bytes.
fn safetensors_bytes(header: &Value, data: &[u8]) -> Vec<u8> {
    let header = header.to_string().into_bytes();
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend(header);
    out.extend(data);
    out
}

fn safetensors_seed() -> (Value, Vec<u8>) {
    let header = json!({
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        "b": {"dtype": "BF16", "shape": [4], "data_offsets": [24, 32]},
    });
    (header, (0..32u8).collect())
}

/// A header entry's fields replaced by arbitrary values of the kinds that break them.
fn header_entry() -> impl Strategy<Value = Value> {
    let number = prop_oneof![
        Just(json!(0)),
        Just(json!(-1)),
        Just(json!(u64::MAX)),
        Just(json!(i64::MAX)),
        Just(json!(1u64 << 40)),
        Just(json!(1.5)),
        Just(json!("2")),
        (0u64..64).prop_map(|n| json!(n)),
    ];
    let dtype = prop_oneof![
        Just(json!("F32")),
        Just(json!("BF16")),
        Just(json!("F16")),
        Just(json!("I64")),
        Just(json!("U8")),
        Just(json!("F8_E4M3")),
        Just(json!("Q4")),
        Just(json!(7)),
        Just(Value::Null),
    ];
    (
        dtype,
        prop::collection::vec(number.clone(), 0..5),
        prop::collection::vec(number, 0..4),
    )
        .prop_map(|(dtype, shape, offsets)| {
            json!({"dtype": dtype, "shape": shape, "data_offsets": offsets})
        })
}

/// Every safetensors file opens or is refused: bytes changed anywhere, or header
/// entries with arbitrary dtypes, shapes and offsets.
#[test]
fn safetensors_files_open_or_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fuzz.safetensors");
    let (header, data) = safetensors_seed();
    let seed = safetensors_bytes(&header, &data);
    let options = LoadOptions::default();
    std::fs::write(&path, &seed).unwrap();
    dspec_adapters::weights::Weights::open_file(&path, &options)
        .expect("the seed is a valid safetensors file");
    runner(512)
        .run(&edits(), |edits| {
            std::fs::write(&path, mutate(&seed, &edits)).unwrap();
            let _ = dspec_adapters::weights::Weights::open_file(&path, &options);
            Ok(())
        })
        .unwrap();
    runner(512)
        .run(
            &(prop::sample::select(vec!["a", "b", "c"]), header_entry()),
            |(name, entry)| {
                let mut header = header.clone();
                header[name] = entry;
                std::fs::write(&path, safetensors_bytes(&header, &data)).unwrap();
                let _ = dspec_adapters::weights::Weights::open_file(&path, &options);
                Ok(())
            },
        )
        .unwrap();
}

/// Values that config fields cannot take, and some they can.
fn config_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        Just(json!(0)),
        Just(json!(-1)),
        Just(json!(0.0)),
        Just(json!(-1e308)),
        Just(json!(1e308)),
        Just(json!(u64::MAX)),
        Just(json!(3)),
        Just(json!(7)),
        Just(json!(1e-30)),
        Just(json!("llama")),
        Just(json!("")),
        Just(json!([])),
        Just(json!({})),
        Just(json!({"type": "yarn", "factor": 0})),
        Just(json!({"rope_type": "llama3", "factor": -2})),
        Just(json!(true)),
    ]
}

const CONFIG_KEYS: [&str; 14] = [
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "tie_word_embeddings",
    "torch_dtype",
];

/// A model whose config.json has fields set to arbitrary values loads or is refused,
/// and one that loads computes a forward or refuses to.
#[test]
fn configs_load_or_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(dir.path(), "{}", 0).unwrap();
    let config_path = dir.path().join("config.json");
    let seed: Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    let registry = builtin_registry().unwrap();
    let options = LoadOptions::default();
    let model = dir.path().to_str().unwrap().to_string();
    load_model(&model, &registry, &options, false).expect("the seed loads");
    let changes = prop::collection::vec(
        (prop::sample::select(CONFIG_KEYS.to_vec()), config_value()),
        1..4,
    );
    runner(64)
        .run(&changes, |changes| {
            let mut config = seed.clone();
            for (key, value) in changes {
                config[key] = value;
            }
            std::fs::write(&config_path, config.to_string()).unwrap();
            if let Ok(loaded) = load_model(&model, &registry, &options, false) {
                let tokens = mlx_rs::Array::from_slice(&[1u32, 2, 3], &[1, 3]);
                let mut cache = loaded.model.new_cache();
                if let Ok(out) = loaded.model.forward(&tokens, &mut cache, &[]) {
                    let _ = out.logits.eval();
                }
            }
            Ok(())
        })
        .unwrap();
}

/// Template fragments that a hostile or broken template might hold.
const TEMPLATE_PARTS: [&str; 24] = [
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    "{% for i in range(1000000000) %}{{ i }}{% endfor %}",
    "{{ 'x' * 1000000000 }}",
    "{{ messages * 100000000 }}",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "{% set ns = namespace(s='a') %}{% for i in range(20) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "{{ raise_exception('no') }}",
    "{{ undefined_thing.attr.more }}",
    "{{ messages[1000].content }}",
    "{{ messages|tojson }}",
    "{{ tools|tojson(indent=4) }}",
    "{% if add_generation_prompt %}<|assistant|>{% endif %}",
    "{{ bos_token }}{{ eos_token }}",
    "{% generation %}{{ 'kept' }}{% endgeneration %}",
    "{{ strftime_now('%Y') }}",
    "{{ messages[0].content.split('') }}",
    "{{ (messages|length) // 0 }}",
    "{% for m in messages|reverse %}{{ loop.index0 / 0 }}{% endfor %}",
    "{{ '%s' % messages }}",
    "{% include 'other' %}",
    "{% for %}",
    "{{",
    "\u{0}\u{ffff}{# unclosed",
];

/// Every template compiles or is refused, and every render ends, with text or an error.
#[test]
fn chat_templates_render_or_fail_in_bounded_time() {
    let messages = vec![
        ChatMessage::new("system", "be brief"),
        ChatMessage::new("user", "hi"),
    ];
    let mut extra = serde_json::Map::new();
    extra.insert(
        "tools".into(),
        json!([{"type": "function", "function": {"name": "f"}}]),
    );
    let templates = prop::collection::vec(prop::sample::select(TEMPLATE_PARTS.to_vec()), 1..4)
        .prop_map(|parts| parts.concat());
    let random = "\\PC{0,80}";
    runner(64)
        .run(
            &prop_oneof![templates, random.prop_map(String::from)],
            |source| {
                if let Ok(template) = ChatTemplate::new(&source, Some("<s>"), Some("</s>")) {
                    if let Ok(text) = template.render(&messages, true, &extra) {
                        prop_assert!(text.len() < 1 << 30, "a render of {} bytes", text.len());
                    }
                }
                Ok(())
            },
        )
        .unwrap();
}

/// JSON values of every kind, nested a few levels.
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| json!(f)),
        "\\PC{0,12}".prop_map(Value::from),
        prop::sample::select(vec![
            "user",
            "assistant",
            "system",
            "tool",
            "function",
            "text",
            "auto"
        ])
        .prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            prop::collection::btree_map("\\PC{0,8}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

const REQUEST_KEYS: [&str; 18] = [
    "messages",
    "prompt",
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "n",
    "stream",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "best_of",
];

/// Every request body, valid JSON or not, becomes a job or a 4xx error naming what to
/// change; none panics.
#[test]
fn request_bodies_become_jobs_or_errors() {
    let served = ServedModel {
        id: "tiny",
        max_context: Some(256),
    };
    let seed = json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                      "prompt": "hi", "max_tokens": 8});
    let check = |body: &[u8]| -> Result<(), TestCaseError> {
        for parsed in [
            chat_request(body, &served),
            completion_request(body, &served),
        ] {
            if let Err(e) = parsed {
                prop_assert!(e.status.is_client_error(), "{}: {}", e.status, e.message);
                prop_assert!(!e.message.is_empty());
            }
        }
        Ok(())
    };
    let fields = prop::collection::vec(
        (prop::sample::select(REQUEST_KEYS.to_vec()), any_json()),
        1..4,
    );
    runner(512)
        .run(&fields, |fields| {
            let mut body = seed.clone();
            for (key, value) in fields {
                body[key] = value;
            }
            check(body.to_string().as_bytes())
        })
        .unwrap();
    let seed_bytes = seed.to_string().into_bytes();
    runner(512)
        .run(&edits(), |edits| check(&mutate(&seed_bytes, &edits)))
        .unwrap();
}
