//! Streaming detokenization: turns generated token ids into text one token at a time,
//! holding back incomplete UTF-8 and keeping word-start spaces right, at O(window) per token.

use tokenizers::{step_decode_stream, DecodeStreamError};

use crate::text::tokenizer::{TextTokenizer, TokenizerError};

/// Past this many held tokens a trailing U+FFFD is real garbage from the model, not a
/// character still being completed (UTF-8 needs at most four bytes), so it is released
/// rather than letting the window, and the cost per token, grow.
const MAX_HELD_TOKENS: usize = 16;

/// Decodes a growing token sequence incrementally.
///
/// Each token goes through tokenizers' `DecodeStream` step: the ids of the last piece
/// emitted plus those held since are decoded together, and what they add beyond that
/// piece's own text is the next piece. Decoding from the earlier piece rather than the
/// new token alone matters for SentencePiece-style decoders, which drop the leading
/// space of whatever comes first in a decode call.
///
/// The step is called as the free function `step_decode_stream`, the `DecodeStream`
/// struct's step with its state kept here, because three cases need that state and the
/// struct keeps it private: releasing held tokens at the end of generation (`finish`),
/// releasing a trailing U+FFFD held for `MAX_HELD_TOKENS` tokens (the step would hold
/// it for ever), and decoders whose text for the window does not extend the text of its
/// piece (clean-ups across tokens), where the step fails and the text is taken from a
/// decode of every token instead.
#[derive(Debug, Clone)]
pub struct StreamDecoder {
    skip_special_tokens: bool,
    /// The step's state: the ids of the last emitted piece, then those held since...
    window: Vec<u32>,
    /// ...the text of that piece decoded alone...
    piece_text: String,
    /// ...and where in `window` the held ids start.
    held_from: usize,
    /// Tokens pushed since the last piece. (Not `window.len() - held_from`: the step
    /// counts tokens that decode to nothing, a skipped BOS, as part of the piece.)
    held: usize,
    tokens: Vec<u32>,
    text: String,
}

impl StreamDecoder {
    pub fn new(skip_special_tokens: bool) -> Self {
        Self {
            skip_special_tokens,
            window: Vec::new(),
            piece_text: String::new(),
            held_from: 0,
            held: 0,
            tokens: Vec::new(),
            text: String::new(),
        }
    }

    /// Adds one token and returns the text it completes (often empty while a multi-byte
    /// character is still being spelled out).
    pub fn push(&mut self, tok: &TextTokenizer, id: u32) -> Result<String, TokenizerError> {
        self.tokens.push(id);
        self.held += 1;
        let step = step_decode_stream(
            tok.inner(),
            vec![id],
            self.skip_special_tokens,
            &mut self.window,
            &mut self.piece_text,
            &mut self.held_from,
        );
        let piece = match step {
            Ok(Some(piece)) => {
                self.held = 0;
                piece
            }
            Ok(None) if self.held < MAX_HELD_TOKENS => return Ok(String::new()),
            Ok(None) => {
                // Held this long, a trailing U+FFFD is let out; tokens that add no text
                // at all (skipped special tokens) stay held.
                let window_text = tok.decode(&self.window, self.skip_special_tokens)?;
                if window_text.len() <= self.piece_text.len() {
                    return Ok(String::new());
                }
                self.release(tok, &window_text)?
            }
            Err(e) if e.downcast_ref::<DecodeStreamError>().is_some() => {
                let window_text = tok.decode(&self.window, self.skip_special_tokens)?;
                self.release(tok, &window_text)?
            }
            Err(e) => {
                return Err(TokenizerError::Decode {
                    dir: tok.dir().to_path_buf(),
                    message: e.to_string(),
                })
            }
        };
        self.text.push_str(&piece);
        Ok(piece)
    }

    /// Releases whatever is still held (an unfinished character becomes U+FFFD).
    pub fn finish(&mut self, tok: &TextTokenizer) -> Result<String, TokenizerError> {
        if self.held == 0 {
            return Ok(String::new());
        }
        let window_text = tok.decode(&self.window, self.skip_special_tokens)?;
        let piece = self.release(tok, &window_text)?;
        self.text.push_str(&piece);
        Ok(piece)
    }

    /// Everything emitted so far.
    pub fn text_so_far(&self) -> &str {
        &self.text
    }

    /// All tokens pushed so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The held tokens' text, given the window's, where the step would keep holding it or
    /// fails; the window then moves on as after a piece the step emits.
    fn release(
        &mut self,
        tok: &TextTokenizer,
        window_text: &str,
    ) -> Result<String, TokenizerError> {
        let piece = match window_text.strip_prefix(self.piece_text.as_str()) {
            Some(piece) => piece.to_string(),
            None => self.rest_of_full_decode(tok)?,
        };
        self.window.drain(..self.held_from);
        self.piece_text = tok.decode(&self.window, self.skip_special_tokens)?;
        self.held_from = self.window.len();
        self.held = 0;
        Ok(piece)
    }

    /// What a decode of every token adds to the text emitted so far. Emitted text cannot
    /// be taken back, so where the two disagree this continues after their longest
    /// common prefix.
    fn rest_of_full_decode(&self, tok: &TextTokenizer) -> Result<String, TokenizerError> {
        let full = tok.decode(&self.tokens, self.skip_special_tokens)?;
        if let Some(rest) = full.strip_prefix(self.text.as_str()) {
            return Ok(rest.to_string());
        }
        let common = full
            .char_indices()
            .zip(self.text.chars())
            .take_while(|((_, a), b)| a == b)
            .last()
            .map_or(0, |((i, c), _)| i + c.len_utf8());
        Ok(full[common..].to_string())
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
    fn garbage_is_let_out_after_max_held_tokens() {
        let (_dir, tok) = byte_level();
        // One token per byte, its id the byte: 0xC3 starts a two-byte character, and a
        // run of them never completes one.
        let lead = 0xC3;
        let mut decoder = StreamDecoder::new(false);
        let pieces: Vec<String> = (0..MAX_HELD_TOKENS + 2)
            .map(|_| decoder.push(&tok, lead).unwrap())
            .collect();
        assert!(
            pieces[..MAX_HELD_TOKENS - 1].iter().all(String::is_empty),
            "{pieces:?}"
        );
        assert_eq!(
            pieces[MAX_HELD_TOKENS - 1],
            "\u{FFFD}".repeat(MAX_HELD_TOKENS)
        );
        assert_eq!(pieces[MAX_HELD_TOKENS..], ["", ""]);
        let a = tok.token_to_id("a").unwrap();
        assert_eq!(decoder.push(&tok, a).unwrap(), "\u{FFFD}\u{FFFD}a");
        assert_eq!(
            decoder.text_so_far(),
            tok.decode(decoder.tokens(), false).unwrap()
        );
    }

    #[test]
    fn a_decoder_that_rewrites_across_tokens_falls_back_to_the_full_decode() {
        // After Fuse, Replace sees the whole text: "a" then "b" decode to "XY", which does
        // not extend "a", so DecodeStream's step fails there.
        let dir = tempfile::tempdir().unwrap();
        let tokenizer = json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": null, "post_processor": null,
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Fuse"},
                {"type": "Replace", "pattern": {"String": "ab"}, "content": "XY"}
            ]},
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                      "continuing_subword_prefix": null, "end_of_word_suffix": null,
                      "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                      "vocab": {"a": 0, "b": 1, "c": 2}, "merges": []}
        });
        write_json(&dir.path().join("tokenizer.json"), &tokenizer);
        let tok = TextTokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(tok.decode(&[0, 1, 2], false).unwrap(), "XYc");
        // "a" was already out when "b" rewrote it; emitted text is never taken back, so
        // the stream goes on with what the full decode adds after their common prefix.
        assert_eq!(stream(&tok, &[0, 1, 2], false), ["a", "XY", "c", ""]);
    }

    #[test]
    fn window_stays_small() {
        let (_dir, tok) = byte_level();
        let ids = tok.encode(&"hello world ".repeat(200), false).unwrap();
        let mut decoder = StreamDecoder::new(false);
        for id in &ids {
            decoder.push(&tok, *id).unwrap();
            assert!(decoder.window.len() <= 3, "{:?}", decoder.window);
        }
        assert_eq!(decoder.text_so_far(), "hello world ".repeat(200));
    }
}
