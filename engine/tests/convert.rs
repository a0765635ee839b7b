//! `dspec convert` against models whose HF weights we know: a tiny random model is
//! written as an HF dir, re-encoded by this test as a GGUF file the way llama.cpp's
//! converter lays it out (names, reversed dims, llama's q/k row permutation, gemma's
//! `1 + w` norms), converted back, and must compute the same logits.

use std::path::Path;
use std::process::Command;

use mlx_rs::{Array, Dtype};

use dspec_engine::loading::{builtin_registry, load_model};
use dspec_engine::tiny_model::{byte_level_char, write_tiny_model, SPECIAL_TOKENS};
use dspec_plugin_api::LoadOptions;

/// A minimal GGUF v3 writer (little-endian), enough for F32 tensors and metadata.
#[derive(Default)]
struct Gguf {
    kv: Vec<u8>,
    kv_count: u64,
    tensors: Vec<(String, Vec<u64>, Vec<f32>)>,
}

fn put_str(buf: &mut Vec<u8>, s: &str) {
    buf.extend((s.len() as u64).to_le_bytes());
    buf.extend(s.as_bytes());
}

impl Gguf {
    fn key(&mut self, k: &str, ty: u32) -> &mut Vec<u8> {
        self.kv_count += 1;
        put_str(&mut self.kv, k);
        self.kv.extend(ty.to_le_bytes());
        &mut self.kv
    }
    fn string(&mut self, k: &str, v: &str) {
        put_str(self.key(k, 8), v);
    }
    fn u32(&mut self, k: &str, v: u32) {
        self.key(k, 4).extend(v.to_le_bytes());
    }
    fn f32(&mut self, k: &str, v: f32) {
        self.key(k, 6).extend(v.to_le_bytes());
    }
    fn strings(&mut self, k: &str, items: &[String]) {
        let buf = self.key(k, 9);
        buf.extend(8u32.to_le_bytes());
        buf.extend((items.len() as u64).to_le_bytes());
        for s in items {
            put_str(buf, s);
        }
    }
    fn i32s(&mut self, k: &str, items: &[i32]) {
        let buf = self.key(k, 9);
        buf.extend(5u32.to_le_bytes());
        buf.extend((items.len() as u64).to_le_bytes());
        for v in items {
            buf.extend(v.to_le_bytes());
        }
    }
    fn write(&self, path: &Path) {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend(self.kv_count.to_le_bytes());
        out.extend(&self.kv);
        let mut offset = 0u64;
        for (name, dims, data) in &self.tensors {
            put_str(&mut out, name);
            out.extend((dims.len() as u32).to_le_bytes());
            dims.iter().for_each(|d| out.extend(d.to_le_bytes()));
            out.extend(0u32.to_le_bytes()); // F32
            out.extend(offset.to_le_bytes());
            offset += (data.len() * 4).next_multiple_of(32) as u64;
        }
        while !out.len().is_multiple_of(32) {
            out.push(0);
        }
        for (_, _, data) in &self.tensors {
            let start = out.len();
            data.iter().for_each(|v| out.extend(v.to_le_bytes()));
            while !(out.len() - start).is_multiple_of(32) {
                out.push(0);
            }
        }
        std::fs::write(path, out).unwrap();
    }
}

/// llama.cpp's name for an HF tensor (the inverse of the converter's map).
fn gguf_name(hf: &str, sandwich: bool) -> String {
    let globals = [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
        ("lm_head.weight", "output.weight"),
    ];
    if let Some((_, g)) = globals.iter().find(|(h, _)| *h == hf) {
        return g.to_string();
    }
    let rest = hf.strip_prefix("model.layers.").unwrap();
    let (layer, rest) = rest.split_once('.').unwrap();
    let (module, suffix) = rest.rsplit_once('.').unwrap();
    let g = match module {
        "input_layernorm" => "attn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        "mlp.gate" => "ffn_gate_inp",
        "post_attention_layernorm" if sandwich => "post_attention_norm",
        "post_attention_layernorm" => "ffn_norm",
        "pre_feedforward_layernorm" => "ffn_norm",
        "post_feedforward_layernorm" => "post_ffw_norm",
        other => panic!("unmapped {other}"),
    };
    format!("blk.{layer}.{g}.{suffix}")
}

/// llama.cpp's q/k permutation: within each head, interleave the two rotary halves.
fn permute(rows: &[f32], n_rows: usize, cols: usize, heads: usize) -> Vec<f32> {
    let d = n_rows / heads;
    let mut out = Vec::with_capacity(rows.len());
    for h in 0..heads {
        for i in 0..d / 2 {
            for half in 0..2 {
                let r = h * d + half * (d / 2) + i;
                out.extend_from_slice(&rows[r * cols..(r + 1) * cols]);
            }
        }
    }
    out
}

fn encode_as_gguf(hf_dir: &Path, gguf: &Path, arch: &str) {
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(hf_dir.join("config.json")).unwrap())
            .unwrap();
    let num = |k: &str| config[k].as_u64().unwrap() as u32;
    let mut g = Gguf::default();
    g.string("general.architecture", arch);
    g.string("general.name", "tiny test model");
    g.u32(&format!("{arch}.block_count"), num("num_hidden_layers"));
    g.u32(&format!("{arch}.embedding_length"), num("hidden_size"));
    g.u32(
        &format!("{arch}.feed_forward_length"),
        num("intermediate_size"),
    );
    g.u32(
        &format!("{arch}.attention.head_count"),
        num("num_attention_heads"),
    );
    g.u32(
        &format!("{arch}.attention.head_count_kv"),
        num("num_key_value_heads"),
    );
    let head_dim = config["head_dim"]
        .as_u64()
        .unwrap_or((num("hidden_size") / num("num_attention_heads")) as u64)
        as u32;
    g.u32(&format!("{arch}.attention.key_length"), head_dim);
    g.u32(&format!("{arch}.context_length"), 256);
    g.f32(
        &format!("{arch}.rope.freq_base"),
        config["rope_theta"].as_f64().unwrap() as f32,
    );
    g.f32(
        &format!("{arch}.attention.layer_norm_rms_epsilon"),
        config["rms_norm_eps"].as_f64().unwrap() as f32,
    );
    if let Some(w) = config["sliding_window"].as_u64() {
        g.u32(&format!("{arch}.attention.sliding_window"), w as u32);
    }
    if arch == "qwen3moe" {
        g.u32(&format!("{arch}.expert_count"), num("num_experts"));
        g.u32(
            &format!("{arch}.expert_used_count"),
            num("num_experts_per_tok"),
        );
        g.u32(
            &format!("{arch}.expert_feed_forward_length"),
            num("moe_intermediate_size"),
        );
    }
    let mut tokens: Vec<String> = (0..=255u8)
        .map(|b| byte_level_char(b).to_string())
        .collect();
    tokens.extend(SPECIAL_TOKENS.iter().map(|s| s.to_string()));
    let types: Vec<i32> = (0..tokens.len())
        .map(|i| if i < 256 { 1 } else { 3 })
        .collect();
    g.string("tokenizer.ggml.model", "gpt2");
    g.string("tokenizer.ggml.pre", "default");
    g.strings("tokenizer.ggml.tokens", &tokens);
    g.i32s("tokenizer.ggml.token_type", &types);
    g.strings("tokenizer.ggml.merges", &[]);
    g.u32("tokenizer.ggml.eos_token_id", 258);

    let gemma = arch.starts_with("gemma");
    let sandwich = gemma;
    let heads = num("num_attention_heads") as usize;
    let kv_heads = num("num_key_value_heads") as usize;
    let weights = Array::load_safetensors(hf_dir.join("model.safetensors")).unwrap();
    let mut names: Vec<&String> = weights.keys().collect();
    names.sort();
    // llama.cpp stores a layer's experts stacked, one tensor per projection.
    let mut experts: std::collections::BTreeMap<(String, String), Vec<(usize, Array)>> =
        Default::default();
    for name in &names {
        let Some(rest) = name.strip_prefix("model.layers.") else {
            continue;
        };
        let Some((layer, rest)) = rest.split_once(".mlp.experts.") else {
            continue;
        };
        let (e, proj) = rest.split_once('.').unwrap();
        let proj = proj.trim_end_matches(".weight").to_string();
        experts
            .entry((layer.to_string(), proj))
            .or_default()
            .push((e.parse().unwrap(), weights[*name].clone()));
    }
    for ((layer, proj), mut list) in experts {
        list.sort_by_key(|(e, _)| *e);
        let parts: Vec<Array> = list.into_iter().map(|(_, a)| a).collect();
        let stacked = mlx_rs::ops::stack(&parts, 0).unwrap();
        let dims: Vec<u64> = stacked.shape().iter().rev().map(|&d| d as u64).collect();
        let data = stacked
            .as_dtype(Dtype::Float32)
            .unwrap()
            .as_slice::<f32>()
            .to_vec();
        let g_proj = match proj.as_str() {
            "gate_proj" => "ffn_gate_exps",
            "up_proj" => "ffn_up_exps",
            _ => "ffn_down_exps",
        };
        g.tensors
            .push((format!("blk.{layer}.{g_proj}.weight"), dims, data));
    }
    for name in names {
        if name.contains(".mlp.experts.") {
            continue;
        }
        let a = weights[name].as_dtype(Dtype::Float32).unwrap();
        let shape: Vec<usize> = a.shape().iter().map(|&d| d as usize).collect();
        let mut data = a.as_slice::<f32>().to_vec();
        let cols = shape.get(1).copied().unwrap_or(1);
        if arch == "llama" && name.contains("q_proj") {
            data = permute(&data, shape[0], cols, heads);
        } else if arch == "llama" && name.contains("k_proj") {
            data = permute(&data, shape[0], cols, kv_heads);
        }
        if gemma && name.ends_with("norm.weight") {
            data.iter_mut().for_each(|x| *x += 1.0);
        }
        let dims: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
        g.tensors.push((gguf_name(name, sandwich), dims, data));
    }
    g.write(gguf);
}

fn logits_of(dir: &Path) -> Vec<f32> {
    let loaded = load_model(
        dir.to_str().unwrap(),
        &builtin_registry().unwrap(),
        &LoadOptions::default(),
        false,
    )
    .unwrap();
    let ids = loaded
        .tokenizer
        .encode("round trip through GGUF", false)
        .unwrap();
    let tokens = Array::from_slice(&ids, &[1, ids.len() as i32]);
    let mut cache = loaded.model.new_cache();
    let logits = loaded
        .model
        .forward(&tokens, &mut cache, &[])
        .unwrap()
        .logits
        .as_dtype(Dtype::Float32)
        .unwrap();
    logits.as_slice::<f32>().to_vec()
}

#[test]
fn gguf_round_trip_reproduces_the_model() {
    for (arch, overrides) in [
        ("llama", "{}"),
        (
            "qwen3moe",
            r#"{"model_type": "qwen3_moe", "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": true}"#,
        ),
        (
            "gemma3",
            r#"{"model_type": "gemma3_text", "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 4}"#,
        ),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let hf = tmp.path().join("hf");
        write_tiny_model(&hf, overrides, 9).unwrap();
        let gguf = tmp.path().join("tiny.gguf");
        encode_as_gguf(&hf, &gguf, arch);
        let out = tmp.path().join("converted");
        let run = Command::new(env!("CARGO_BIN_EXE_dspec"))
            .args([
                "convert",
                gguf.to_str().unwrap(),
                out.to_str().unwrap(),
                "--dtype",
                "f32",
            ])
            .output()
            .unwrap();
        assert!(
            run.status.success(),
            "{arch}: {}",
            String::from_utf8_lossy(&run.stderr)
        );
        let (want, got) = (logits_of(&hf), logits_of(&out));
        let max_diff = want
            .iter()
            .zip(&got)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(
            max_diff < 1e-4,
            "{arch}: converted model differs by {max_diff}"
        );

        // Split into several shards: Hugging Face's names, an index naming exactly them,
        // and the same model.
        let sharded = tmp.path().join("sharded");
        let run = Command::new(env!("CARGO_BIN_EXE_dspec"))
            .args(["convert", gguf.to_str().unwrap(), sharded.to_str().unwrap()])
            .args(["--dtype", "f32", "--max-shard-size", "8KB"])
            .output()
            .unwrap();
        assert!(
            run.status.success(),
            "{arch} sharded: {}",
            String::from_utf8_lossy(&run.stderr)
        );
        let mut shards: Vec<String> = std::fs::read_dir(&sharded)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".safetensors"))
            .collect();
        shards.sort();
        let n = shards.len();
        assert!(
            n > 1,
            "{arch}: 8KB shards should make several, got {shards:?}"
        );
        let expected: Vec<String> = (1..=n)
            .map(|i| format!("model-{i:05}-of-{n:05}.safetensors"))
            .collect();
        assert_eq!(shards, expected, "{arch}");
        let index: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(sharded.join("model.safetensors.index.json")).unwrap(),
        )
        .unwrap();
        let mut named: Vec<String> = index["weight_map"]
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_str().unwrap().to_string())
            .collect();
        named.sort();
        named.dedup();
        assert_eq!(
            named, expected,
            "{arch}: the index names exactly the shards"
        );
        assert_eq!(logits_of(&sharded), got, "{arch}: sharded output differs");

        // Quantized output loads and stays close to the float model.
        let q8 = tmp.path().join("q8");
        let run = Command::new(env!("CARGO_BIN_EXE_dspec"))
            .args([
                "convert",
                gguf.to_str().unwrap(),
                q8.to_str().unwrap(),
                "--quantize",
                "8",
                "--dtype",
                "f32",
            ])
            .output()
            .unwrap();
        assert!(
            run.status.success(),
            "{arch} q8: {}",
            String::from_utf8_lossy(&run.stderr)
        );
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(q8.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(config["quantization"]["bits"], 8);
        let q = logits_of(&q8);
        let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let q_diff = want
            .iter()
            .zip(&q)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(
            q_diff < 0.05 * scale.max(1.0),
            "{arch}: 8-bit model far off ({q_diff} vs scale {scale})"
        );
    }
}

#[test]
fn unsupported_architecture_and_non_gguf_files_are_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tmp.path().join("mamba.gguf");
    let mut g = Gguf::default();
    g.string("general.architecture", "mamba");
    g.tensors
        .push(("token_embd.weight".into(), vec![4, 8], vec![0.0; 32]));
    g.write(&gguf);
    let out = Command::new(env!("CARGO_BIN_EXE_dspec"))
        .args([
            "convert",
            gguf.to_str().unwrap(),
            tmp.path().join("o").to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("mamba") && err.contains("qwen2") && err.contains("gemma3"),
        "{err}"
    );

    let not_gguf = tmp.path().join("x.gguf");
    std::fs::write(&not_gguf, b"hello world, not a gguf").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_dspec"))
        .args([
            "convert",
            not_gguf.to_str().unwrap(),
            tmp.path().join("o2").to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("x.gguf") && !err.contains("panicked"), "{err}");
    assert_eq!(
        err.matches("x.gguf").count(),
        1,
        "the file is named once: {err}"
    );
    let missing = tmp.path().join("missing.gguf");
    let out = Command::new(env!("CARGO_BIN_EXE_dspec"))
        .args([
            "convert",
            missing.to_str().unwrap(),
            tmp.path().join("o2").to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.matches("missing.gguf").count(), 1, "{err}");
    assert_eq!(err.matches("os error").count(), 1, "{err}");

    for bad in ["2XB", "0", "-5MB", "MB"] {
        let out = Command::new(env!("CARGO_BIN_EXE_dspec"))
            .args([
                "convert",
                gguf.to_str().unwrap(),
                tmp.path().join("o3").to_str().unwrap(),
            ])
            .arg(format!("--max-shard-size={bad}"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad}: {err}");
        assert!(
            err.contains("--max-shard-size") && err.contains("not a size"),
            "{bad}: {err}"
        );
    }
}
