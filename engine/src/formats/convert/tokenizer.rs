//! The tokenizer a GGUF file carries → HF tokenizer.json, tokenizer_config.json and
//! generation_config.json: byte-level BPE (`gpt2`) with the pre-tokenizer named by
//! `tokenizer.ggml.pre`, and SentencePiece BPE (`llama`, gemma) with byte fallback.

use std::collections::HashMap;

use serde_json::{json, Value};

use super::ConvertError;
use crate::formats::gguf::GgufFile;

/// GGUF token types (llama.cpp's `llama_token_type`).
const TYPE_CONTROL: i64 = 3;
const TYPE_USER_DEFINED: i64 = 4;
const TYPE_BYTE: i64 = 6;

/// Qwen2's: case-insensitive contractions, single digits, newlines kept apart.
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama 3's: like Qwen2 but digits in groups of up to three.
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn split(pattern: &str) -> Value {
    json!({"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false})
}

fn byte_level(use_regex: bool) -> Value {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": use_regex})
}

/// The pre-tokenizer HF uses for a `tokenizer.ggml.pre` name.
fn gpt2_pre_tokenizer(pre: &str) -> Result<Value, ConvertError> {
    Ok(match pre {
        "default" | "gpt-2" | "gpt2" | "starcoder" | "olmo" => byte_level(true),
        // SmolLM: every digit its own token, then GPT-2's split.
        "smollm" => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
        "qwen2" | "deepseek-r1-qwen" => json!({"type": "Sequence", "pretokenizers": [split(QWEN2_PATTERN), byte_level(false)]}),
        "llama3" | "llama-bpe" | "smaug-bpe" => {
            json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_PATTERN), byte_level(false)]})
        }
        other => {
            return Err(ConvertError::Invalid(format!(
                "tokenizer.ggml.pre = `{other}` is not supported (supported: default, gpt2, smollm, qwen2, llama-bpe)"
            )))
        }
    })
}

struct Vocab {
    tokens: Vec<String>,
    types: Vec<i64>,
    scores: Vec<f32>,
}

fn read_vocab(g: &GgufFile) -> Result<Vocab, ConvertError> {
    let tokens = g.get_str_array("tokenizer.ggml.tokens").ok_or_else(|| {
        ConvertError::Invalid("no tokenizer.ggml.tokens: this GGUF has no tokenizer".into())
    })?;
    let types = g
        .get_i64_array("tokenizer.ggml.token_type")
        .unwrap_or_else(|| vec![1; tokens.len()]);
    let scores = g
        .get_f32_array("tokenizer.ggml.scores")
        .unwrap_or_else(|| vec![0.0; tokens.len()]);
    if types.len() != tokens.len() || scores.len() != tokens.len() {
        return Err(ConvertError::Invalid(
            "tokenizer arrays (tokens, token_type, scores) differ in length".into(),
        ));
    }
    Ok(Vocab {
        tokens,
        types,
        scores,
    })
}

fn added_tokens(v: &Vocab) -> Vec<Value> {
    v.types
        .iter()
        .enumerate()
        .filter(|(_, &t)| t == TYPE_CONTROL || t == TYPE_USER_DEFINED)
        .map(|(id, &t)| {
            json!({"id": id, "content": v.tokens[id], "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": t == TYPE_CONTROL})
        })
        .collect()
}

fn special_id(g: &GgufFile, key: &str) -> Option<u64> {
    g.get_u64(&format!("tokenizer.ggml.{key}_token_id"))
}

/// Everything written for the tokenizer: (tokenizer.json, tokenizer_config.json, generation_config.json).
pub fn tokenizer_files(g: &GgufFile) -> Result<(Value, Value, Value), ConvertError> {
    let v = read_vocab(g)?;
    let kind = g.get_str("tokenizer.ggml.model").unwrap_or("gpt2");
    let bos = special_id(g, "bos");
    let eos = special_id(g, "eos");
    let token = |id: Option<u64>| id.and_then(|i| v.tokens.get(i as usize).cloned());
    let add_bos = g
        .get_bool("tokenizer.ggml.add_bos_token")
        .unwrap_or(kind == "llama");

    let (model, normalizer, pre_tokenizer, decoder) = match kind {
        "gpt2" => {
            let vocab: serde_json::Map<String, Value> = v.tokens.iter().enumerate().map(|(i, t)| (t.clone(), json!(i))).collect();
            let merges = g.get_str_array("tokenizer.ggml.merges").unwrap_or_default();
            let pre = gpt2_pre_tokenizer(g.get_str("tokenizer.ggml.pre").unwrap_or("default"))?;
            let model = json!({"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": vocab, "merges": merges});
            let decoder = json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true});
            (model, Value::Null, pre, decoder)
        }
        "llama" => {
            let vocab: serde_json::Map<String, Value> = v.tokens.iter().enumerate().map(|(i, t)| (t.clone(), json!(i))).collect();
            let model = json!({"type": "BPE", "dropout": null, "unk_token": token(special_id(g, "unknown")),
                "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": true,
                "byte_fallback": true, "ignore_merges": false, "vocab": vocab, "merges": sentencepiece_merges(&v)});
            // SentencePiece marks spaces with ▁; gemma adds no dummy prefix.
            let prefix = g.get_bool("tokenizer.ggml.add_space_prefix").unwrap_or(false);
            let mut normalizers = vec![];
            if prefix {
                normalizers.push(json!({"type": "Prepend", "prepend": "▁"}));
            }
            normalizers.push(json!({"type": "Replace", "pattern": {"String": " "}, "content": "▁"}));
            let mut decoders = vec![json!({"type": "Replace", "pattern": {"String": "▁"}, "content": " "}),
                                    json!({"type": "ByteFallback"}), json!({"type": "Fuse"})];
            if prefix {
                decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
            }
            (model, json!({"type": "Sequence", "normalizers": normalizers}), Value::Null, json!({"type": "Sequence", "decoders": decoders}))
        }
        other => {
            return Err(ConvertError::Invalid(format!(
                "tokenizer.ggml.model = `{other}` is not supported (supported: gpt2 byte-level BPE, llama SentencePiece BPE)"
            )))
        }
    };

    let post_processor = match (add_bos, token(bos)) {
        (true, Some(b)) => json!({"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {b.clone(): {"id": b, "ids": [bos], "tokens": [b]}}}),
        _ => Value::Null,
    };
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added_tokens(&v),
        "normalizer": normalizer, "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor, "decoder": decoder, "model": model,
    });

    let mut config = json!({
        "add_bos_token": add_bos,
        "add_eos_token": false,
        "bos_token": token(bos),
        "eos_token": token(eos),
        "pad_token": token(special_id(g, "padding")),
        "unk_token": token(special_id(g, "unknown")),
        "model_max_length": g.get_u64(&format!("{}.context_length", g.get_str("general.architecture").unwrap_or(""))),
        "tokenizer_class": "PreTrainedTokenizerFast",
    });
    if let Some(template) = g.get_str("tokenizer.chat_template") {
        config["chat_template"] = json!(template);
    }
    // End-of-turn tokens end generation just like EOS (chat models use them).
    let mut eos_ids: Vec<u64> = [eos, special_id(g, "eot"), special_id(g, "eom")]
        .into_iter()
        .flatten()
        .collect();
    let mut seen = std::collections::HashSet::new();
    eos_ids.retain(|id| seen.insert(*id));
    let generation = json!({"bos_token_id": bos, "eos_token_id": eos_ids});
    Ok((tokenizer, config, generation))
}

/// Merges of a SentencePiece BPE vocabulary: every way to split a piece into two
/// pieces of the vocabulary, ranked by the merged piece's score (higher merges first),
/// ties broken by ids — the order SentencePiece's BPE applies them.
fn sentencepiece_merges(v: &Vocab) -> Vec<String> {
    let ids: HashMap<&str, usize> = v
        .tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_str(), i))
        .collect();
    let mut merges: Vec<(f32, usize, usize, usize)> = Vec::new();
    for (id, piece) in v.tokens.iter().enumerate() {
        if v.types[id] == TYPE_CONTROL
            || v.types[id] == TYPE_BYTE
            || v.types[id] == TYPE_USER_DEFINED
        {
            continue;
        }
        for (split, _) in piece.char_indices().skip(1) {
            let (l, r) = piece.split_at(split);
            if let (Some(&li), Some(&ri)) = (ids.get(l), ids.get(r)) {
                merges.push((v.scores[id], id, li, ri));
            }
        }
    }
    merges.sort_by(|a, b| {
        b.0.total_cmp(&a.0)
            .then(a.1.cmp(&b.1))
            .then(a.2.cmp(&b.2))
            .then(a.3.cmp(&b.3))
    });
    merges
        .into_iter()
        .map(|(_, _, l, r)| format!("{} {}", v.tokens[l], v.tokens[r]))
        .collect()
}
