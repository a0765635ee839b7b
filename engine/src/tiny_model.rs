//! A tiny but complete model directory for demos and end-to-end tests
//! (random llama weights, a byte-level BPE tokenizer, a ChatML chat template).
//! Compiled only with the `test-fixtures` feature, which release builds leave off.

use std::path::Path;

use serde_json::json;

use dspec_adapters::fixtures::{with, write_random_model, TINY_LLAMA};

use crate::error::EngineError;

/// Special tokens of the demo tokenizer, after the 256 byte tokens.
pub const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// GPT-2's byte-level alphabet: printable bytes stand for themselves, the others are
/// shifted to unused code points so every byte has a visible, unique character.
pub fn byte_level_char(byte: u8) -> char {
    let printable = |b: u8| {
        (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
    };
    if printable(byte) {
        return byte as char;
    }
    let shifted = (0..byte).filter(|&b| !printable(b)).count() as u32;
    char::from_u32(256 + shifted).unwrap_or('?')
}

/// A byte-level BPE tokenizer.json with one token per byte (no merges) and ChatML specials.
pub fn byte_level_tokenizer_json() -> serde_json::Value {
    let vocab: serde_json::Map<String, serde_json::Value> = (0..=255u8)
        .map(|b| (byte_level_char(b).to_string(), json!(b as u32)))
        .collect();
    let added: Vec<serde_json::Value> = SPECIAL_TOKENS
        .iter()
        .enumerate()
        .map(|(i, t)| {
            json!({"id": 256 + i, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": true})
        })
        .collect();
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "vocab": vocab, "merges": []}
    })
}

/// ChatML, as Qwen-style models use it.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// Writes a complete tiny model directory for `model_type` overrides of the tiny
/// llama config (e.g. `{}` or `{"model_type": "qwen3", "head_dim": 16}`).
pub fn write_tiny_model(dir: &Path, overrides: &str, seed: u64) -> Result<(), EngineError> {
    let io = |path: &Path, e: std::io::Error| {
        EngineError::Invalid(format!("writing {}: {e}", path.display()))
    };
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let vocab = 256 + SPECIAL_TOKENS.len();
    let config = with(
        &with(TINY_LLAMA, &json!({"vocab_size": vocab}).to_string()),
        overrides,
    );
    write_random_model(dir, &config, seed, None)?;
    let write = |name: &str, value: serde_json::Value| -> Result<(), EngineError> {
        let path = dir.join(name);
        std::fs::write(
            &path,
            serde_json::to_string_pretty(&value).unwrap_or_default(),
        )
        .map_err(|e| io(&path, e))
    };
    write("tokenizer.json", byte_level_tokenizer_json())?;
    write(
        "tokenizer_config.json",
        json!({"eos_token": "<|im_end|>", "bos_token": null, "pad_token": "<|endoftext|>",
               "chat_template": CHATML_TEMPLATE, "add_bos_token": false}),
    )?;
    write(
        "generation_config.json",
        json!({"eos_token_id": [258, 256]}),
    )?;
    Ok(())
}
