//! Streaming detokenization: turns generated token ids into text one token at a time,
//! holding back incomplete UTF-8 and keeping word-start spaces right, at O(window) per token.

use crate::text::tokenizer::{TextTokenizer, TokenizerError};

/// Past this many held tokens a trailing U+FFFD is real garbage from the model, not a
/// character still being completed (UTF-8 needs at most four bytes), so it is released
/// rather than letting the window, and the cost per token, grow.
const MAX_HELD_TOKENS: usize = 16;

/// Decodes a growing token sequence incrementally.
///
/// Each step decodes only the tokens from `prefix_offset` on and emits what the newest
/// tokens add beyond the text of `prefix_offset..read_offset`. Decoding from an earlier
/// token rather than the new one alone matters for SentencePiece-style decoders, which
/// drop the leading space of whatever comes first in a decode call.
#[derive(Debug, Clone)]
pub struct StreamDecoder {
    skip_special_tokens: bool,
    tokens: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    /// Decoded text of `tokens[prefix_offset..read_offset]`, filled lazily.
    prefix_text: Option<String>,
    text: String,
}

impl StreamDecoder {
    pub fn new(skip_special_tokens: bool) -> Self {
        Self {
            skip_special_tokens,
            tokens: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
            prefix_text: None,
            text: String::new(),
        }
    }

    /// Adds one token and returns the text it completes (often empty while a multi-byte
    /// character is still being spelled out).
    pub fn push(&mut self, tok: &TextTokenizer, id: u32) -> Result<String, TokenizerError> {
        self.tokens.push(id);
        let prefix_text = self.prefix_text(tok)?;
        let new_text = tok.decode(&self.tokens[self.prefix_offset..], self.skip_special_tokens)?;
        let held = self.tokens.len() - self.read_offset;
        if new_text.len() <= prefix_text.len()
            || (new_text.ends_with('\u{FFFD}') && held < MAX_HELD_TOKENS)
        {
            return Ok(String::new());
        }
        let delta = self.delta(tok, &new_text)?;
        self.advance(delta.clone());
        Ok(delta)
    }

    /// Releases whatever is still held (an unfinished character becomes U+FFFD).
    pub fn finish(&mut self, tok: &TextTokenizer) -> Result<String, TokenizerError> {
        if self.read_offset == self.tokens.len() {
            return Ok(String::new());
        }
        let new_text = tok.decode(&self.tokens[self.prefix_offset..], self.skip_special_tokens)?;
        let delta = self.delta(tok, &new_text)?;
        self.advance(delta.clone());
        Ok(delta)
    }

    /// Everything emitted so far.
    pub fn text_so_far(&self) -> &str {
        &self.text
    }

    /// All tokens pushed so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    fn prefix_text(&mut self, tok: &TextTokenizer) -> Result<String, TokenizerError> {
        if let Some(text) = &self.prefix_text {
            return Ok(text.clone());
        }
        let text = tok.decode(
            &self.tokens[self.prefix_offset..self.read_offset],
            self.skip_special_tokens,
        )?;
        self.prefix_text = Some(text.clone());
        Ok(text)
    }

    /// The text the window adds after its prefix. Decoders whose output for a window is not
    /// an extension of the output for its prefix (text clean-ups across tokens) fall back to
    /// decoding everything once and diffing against what was already emitted.
    fn delta(&mut self, tok: &TextTokenizer, new_text: &str) -> Result<String, TokenizerError> {
        let prefix_text = self.prefix_text(tok)?;
        if let Some(delta) = new_text.strip_prefix(prefix_text.as_str()) {
            return Ok(delta.to_string());
        }
        let full = tok.decode(&self.tokens, self.skip_special_tokens)?;
        if let Some(delta) = full.strip_prefix(self.text.as_str()) {
            return Ok(delta.to_string());
        }
        // Emitted text cannot be taken back; continue after the longest common prefix.
        let common = full
            .char_indices()
            .zip(self.text.chars())
            .take_while(|((_, a), b)| a == b)
            .last()
            .map_or(0, |((i, c), _)| i + c.len_utf8());
        Ok(full[common..].to_string())
    }

    fn advance(&mut self, delta: String) {
        self.text.push_str(&delta);
        self.prefix_offset = self.read_offset;
        self.read_offset = self.tokens.len();
        self.prefix_text = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::tokenizer::tests::{write_byte_level_tokenizer, write_json, EOS};
    use rand::{Rng, SeedableRng};
    use serde_json::json;
    use std::path::Path;

    fn byte_level() -> (tempfile::TempDir, TextTokenizer) {
        let dir = tempfile::tempdir().unwrap();
        write_byte_level_tokenizer(dir.path(), false);
        let tok = TextTokenizer::from_dir(dir.path()).unwrap();
        (dir, tok)
    }

    /// Streams `ids` and returns every push's output plus finish's output last.
    fn stream(tok: &TextTokenizer, ids: &[u32], skip: bool) -> Vec<String> {
        let mut decoder = StreamDecoder::new(skip);
        let mut pieces: Vec<String> = ids
            .iter()
            .map(|id| decoder.push(tok, *id).unwrap())
            .collect();
        pieces.push(decoder.finish(tok).unwrap());
        assert_eq!(decoder.text_so_far(), pieces.concat());
        pieces
    }

    #[test]
    fn byte_level_multibyte_characters_are_held_until_complete() {
        let (_dir, tok) = byte_level();
        let text = "hello world, café 😀 ok";
        let ids = tok.encode(text, false).unwrap();
        // The fixture's merges cut "é" and the emoji across tokens; make sure they do.
        let partial = ids
            .iter()
            .filter(|id| tok.decode(&[**id], false).unwrap().contains('\u{FFFD}'))
            .count();
        assert!(
            partial >= 3,
            "fixture should split characters, got {partial}"
        );

        let pieces = stream(&tok, &ids, false);
        assert_eq!(pieces.concat(), text);
        assert_eq!(pieces.concat(), tok.decode(&ids, false).unwrap());
        for piece in &pieces {
            assert!(!piece.contains('\u{FFFD}'), "{pieces:?}");
        }
        assert!(pieces.iter().any(|p| p.contains('😀')));
    }

    #[test]
    fn token_that_finishes_one_char_and_starts_another() {
        let (_dir, tok) = byte_level();
        // "café" → c, a, "f"+first byte of é, second byte of é.
        let ids = tok.encode("café", false).unwrap();
        assert_eq!(ids.len(), 4, "{ids:?}");
        assert_eq!(stream(&tok, &ids, false), ["c", "a", "", "fé", ""]);
    }

    #[test]
    fn special_tokens_follow_skip_flag() {
        let (_dir, tok) = byte_level();
        let mut ids = tok.encode("hello world", false).unwrap();
        ids.push(tok.token_to_id(EOS).unwrap());
        assert_eq!(stream(&tok, &ids, true).concat(), "hello world");
        assert_eq!(stream(&tok, &ids, false).concat(), "hello world</s>");
    }

    #[test]
    fn random_ids_match_full_decode() {
        let (_dir, tok) = byte_level();
        let vocab = tok.vocab_size() as u32;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for _ in 0..20 {
            let ids: Vec<u32> = (0..300).map(|_| rng.random_range(0..vocab)).collect();
            for skip in [false, true] {
                let full = tok.decode(&ids, skip).unwrap();
                let pieces = stream(&tok, &ids, skip);
                assert_eq!(pieces.concat(), full);
                if !full.contains('\u{FFFD}') {
                    assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')));
                }
            }
        }
    }

    /// A Llama-2-style SentencePiece tokenizer: "▁" marks word starts, bytes fall back to
    /// `<0xXX>` tokens, and the decoder strips the one leading space of each decode call.
    fn write_sentencepiece_tokenizer(dir: &Path) {
        let mut vocab = serde_json::Map::new();
        for token in ["<unk>", "<s>", "</s>"] {
            vocab.insert(token.into(), json!(vocab.len()));
        }
        for byte in 0..=255u8 {
            vocab.insert(format!("<0x{byte:02X}>"), json!(vocab.len()));
        }
        for token in ["▁", "▁hello", "▁world", "▁caf", "!"] {
            vocab.insert(token.into(), json!(vocab.len()));
        }
        let tokenizer = json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": null, "post_processor": null,
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0}
            ]},
            "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>",
                      "continuing_subword_prefix": null, "end_of_word_suffix": null,
                      "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                      "vocab": vocab, "merges": []}
        });
        write_json(&dir.join("tokenizer.json"), &tokenizer);
    }

    #[test]
    fn sentencepiece_word_starts_keep_their_space() {
        let dir = tempfile::tempdir().unwrap();
        write_sentencepiece_tokenizer(dir.path());
        let tok = TextTokenizer::from_dir(dir.path()).unwrap();
        let ids: Vec<u32> = ["▁hello", "▁world", "▁caf", "<0xC3>", "<0xA9>", "!"]
            .iter()
            .map(|t| tok.token_to_id(t).unwrap())
            .collect();
        assert_eq!(tok.decode(&ids, false).unwrap(), "hello world café!");
        // Decoding each token alone would give "world" without its space.
        assert_eq!(tok.decode(&ids[1..2], false).unwrap(), "world");
        assert_eq!(
            stream(&tok, &ids, false),
            ["hello", " world", " caf", "", "é", "!", ""]
        );
    }

    #[test]
    fn finish_releases_an_unfinished_character() {
        let dir = tempfile::tempdir().unwrap();
        write_sentencepiece_tokenizer(dir.path());
        let tok = TextTokenizer::from_dir(dir.path()).unwrap();
        let hello = tok.token_to_id("▁hello").unwrap();
        let lead = tok.token_to_id("<0xC3>").unwrap();
        let mut decoder = StreamDecoder::new(false);
        assert_eq!(decoder.push(&tok, hello).unwrap(), "hello");
        assert_eq!(decoder.push(&tok, lead).unwrap(), "");
        assert_eq!(decoder.finish(&tok).unwrap(), "\u{FFFD}");
        assert_eq!(decoder.finish(&tok).unwrap(), "");
        assert_eq!(decoder.text_so_far(), "hello\u{FFFD}");
    }

    #[test]
    fn window_stays_small() {
        let (_dir, tok) = byte_level();
        let ids = tok.encode(&"hello world ".repeat(200), false).unwrap();
        let mut decoder = StreamDecoder::new(false);
        for id in &ids {
            decoder.push(&tok, *id).unwrap();
            assert!(decoder.tokens.len() - decoder.prefix_offset <= 3);
        }
        assert_eq!(decoder.text_so_far(), "hello world ".repeat(200));
    }
}
