//! The model's tokenizer as a Hugging Face model directory describes it: tokenizer.json plus
//! the special tokens, BOS policy, chat template and EOS ids spread over the config files.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use serde_json::Value as Json;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum TokenizerError {
    #[error(
        "{}: not found; the model directory needs a tokenizer.json (download it with the model \
         files, or convert a slow tokenizer with transformers: \
         AutoTokenizer.from_pretrained(dir).save_pretrained(dir))",
        .path.display()
    )]
    MissingTokenizerJson { path: PathBuf },
    #[error("{}: cannot read: {cause}", .path.display())]
    Read { path: PathBuf, cause: io::Error },
    #[error(
        "{}: the tokenizers library cannot load it ({message}); re-save it with a recent \
         transformers/tokenizers",
        .path.display()
    )]
    Load { path: PathBuf, message: String },
    #[error("{}: not valid JSON: {cause}", .path.display())]
    Json {
        path: PathBuf,
        cause: serde_json::Error,
    },
    #[error("{}: field `{field}`: {message}", .path.display())]
    Field {
        path: PathBuf,
        field: String,
        message: String,
    },
    #[error("encoding text with the tokenizer of {}: {message}", .dir.display())]
    Encode { dir: PathBuf, message: String },
    #[error("decoding token ids with the tokenizer of {}: {message}", .dir.display())]
    Decode { dir: PathBuf, message: String },
}

/// A tokenizer together with the special-token facts that the config files add to it.
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    dir: PathBuf,
    bos_token: Option<String>,
    bos_token_id: Option<u32>,
    eos_token: Option<String>,
    eos_token_ids: Vec<u32>,
    chat_template: Option<String>,
    /// `add_bos_token` from tokenizer_config.json; `None` leaves it to the post-processor.
    add_bos_token: Option<bool>,
    /// Whether tokenizer.json's post-processor itself puts BOS in front of a sequence.
    post_processor_adds_bos: bool,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("dir", &self.dir)
            .field("vocab_size", &self.vocab_size())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("eos_token_ids", &self.eos_token_ids)
            .finish_non_exhaustive()
    }
}

impl TextTokenizer {
    /// Loads `tokenizer.json` (required) and the optional `tokenizer_config.json`,
    /// `chat_template.jinja` and `generation_config.json` from a model directory.
    pub fn from_dir(dir: &Path) -> Result<Self, TokenizerError> {
        let tokenizer_path = dir.join("tokenizer.json");
        if !tokenizer_path.is_file() {
            return Err(TokenizerError::MissingTokenizerJson {
                path: tokenizer_path,
            });
        }
        let inner = tokenizers::Tokenizer::from_file(&tokenizer_path).map_err(|e| {
            TokenizerError::Load {
                path: tokenizer_path.clone(),
                message: e.to_string(),
            }
        })?;

        let config_path = dir.join("tokenizer_config.json");
        let config = read_optional_json(&config_path)?;
        let generation_path = dir.join("generation_config.json");
        let generation = read_optional_json(&generation_path)?;

        let mut bos_token = None;
        let mut eos_token = None;
        let mut add_bos_token = None;
        let mut config_template = None;
        let mut declared_added = Vec::new();
        if let Some(config) = &config {
            bos_token = special_token_field(config, "bos_token", &config_path)?;
            eos_token = special_token_field(config, "eos_token", &config_path)?;
            add_bos_token = bool_field(config, "add_bos_token", &config_path)?;
            config_template = chat_template_field(config, &config_path)?;
            declared_added = added_tokens_decoder_field(config, &config_path)?;
        }

        // Recent transformers saves the template as its own file and prefers it.
        let jinja_path = dir.join("chat_template.jinja");
        let chat_template = if is_present(&jinja_path) {
            Some(
                fs::read_to_string(&jinja_path).map_err(|source| TokenizerError::Read {
                    path: jinja_path.clone(),
                    cause: source,
                })?,
            )
        } else {
            config_template
        };

        let mut generation_eos = Vec::new();
        let mut generation_bos = None;
        if let Some(generation) = &generation {
            generation_eos = token_ids_field(generation, "eos_token_id", &generation_path)?;
            generation_bos = token_ids_field(generation, "bos_token_id", &generation_path)?
                .first()
                .copied();
        }

        // tokenizer_config may name a token that only its own added_tokens_decoder lists.
        let lookup = |token: &str| {
            inner.token_to_id(token).or_else(|| {
                declared_added
                    .iter()
                    .find(|(_, content)| content == token)
                    .map(|(id, _)| *id)
            })
        };
        let bos_token_id = bos_token.as_deref().and_then(lookup).or(generation_bos);
        let mut eos_token_ids = Vec::new();
        let config_eos = eos_token.as_deref().and_then(lookup);
        for id in generation_eos.into_iter().chain(config_eos) {
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }

        // An empty sequence shows what the post-processor adds around any text.
        let post_processor_adds_bos = match (bos_token_id, inner.encode("", true)) {
            (Some(bos), Ok(encoding)) => encoding.get_ids().first() == Some(&bos),
            _ => false,
        };

        Ok(Self {
            inner,
            dir: dir.to_path_buf(),
            bos_token,
            bos_token_id,
            eos_token,
            eos_token_ids,
            chat_template,
            add_bos_token,
            post_processor_adds_bos,
        })
    }

    /// Encodes like transformers: with `add_special_tokens`, `add_bos_token` from
    /// tokenizer_config.json decides about BOS even where tokenizer.json's post-processor
    /// disagrees (transformers rebuilds the post-processor from that flag).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        let encoding =
            self.inner
                .encode(text, add_special_tokens)
                .map_err(|e| TokenizerError::Encode {
                    dir: self.dir.clone(),
                    message: e.to_string(),
                })?;
        let mut ids = encoding.get_ids().to_vec();
        if add_special_tokens {
            if let Some(bos) = self.bos_token_id {
                match (self.add_bos_token, self.post_processor_adds_bos) {
                    (Some(true), false) => ids.insert(0, bos),
                    (Some(false), true) if ids.first() == Some(&bos) => {
                        ids.remove(0);
                    }
                    _ => {}
                }
            }
        }
        Ok(ids)
    }

    /// Encodes a prompt for generation without ever doubling BOS.
    ///
    /// Text that already starts with the BOS string (templates often write `{{ bos_token }}`)
    /// gets no second one. Rendered chat templates otherwise get BOS only (when this
    /// tokenizer adds one), never other post-processor tokens such as a trailing EOS, because
    /// the template already placed every special token it wants; raw text is encoded with the
    /// tokenizer's full special-token handling.
    pub fn encode_prompt(
        &self,
        rendered: &str,
        from_chat_template: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let starts_with_bos = self
            .bos_token
            .as_deref()
            .is_some_and(|bos| !bos.is_empty() && rendered.starts_with(bos));
        if !from_chat_template {
            return self.encode(rendered, !starts_with_bos);
        }
        let mut ids = self.encode(rendered, false)?;
        if !starts_with_bos && self.adds_bos() {
            if let Some(bos) = self.bos_token_id {
                ids.insert(0, bos);
            }
        }
        Ok(ids)
    }

    /// Whether encoding with special tokens puts BOS in front.
    pub fn adds_bos(&self) -> bool {
        self.bos_token_id.is_some() && self.add_bos_token.unwrap_or(self.post_processor_adds_bos)
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| TokenizerError::Decode {
                dir: self.dir.clone(),
                message: e.to_string(),
            })
    }

    /// Generation stops on any of these: generation_config.json's `eos_token_id`(s) first,
    /// then tokenizer_config.json's `eos_token`, without duplicates.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// The id of `bos_token`, or generation_config.json's `bos_token_id` when the tokenizer
    /// config names none.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token_id
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Number of token ids including added tokens (the model's embedding may be larger).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// The model directory this tokenizer was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// Whether an optional file is there at all: one that is there but cannot be read (a
/// directory, a link to a missing file, no permission) is an error, not absent.
fn is_present(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok()
}

fn read_optional_json(path: &Path) -> Result<Option<Json>, TokenizerError> {
    if !is_present(path) {
        return Ok(None);
    }
    let text = fs::read_to_string(path).map_err(|source| TokenizerError::Read {
        path: path.to_path_buf(),
        cause: source,
    })?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|source| TokenizerError::Json {
            path: path.to_path_buf(),
            cause: source,
        })
}

fn field_error(path: &Path, field: &str, message: impl Into<String>) -> TokenizerError {
    TokenizerError::Field {
        path: path.to_path_buf(),
        field: field.to_string(),
        message: message.into(),
    }
}

/// `bos_token`/`eos_token` are saved either as a plain string or as an AddedToken object.
fn special_token_field(
    config: &Json,
    field: &str,
    path: &Path,
) -> Result<Option<String>, TokenizerError> {
    match config.get(field) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(Json::Object(object)) => match object.get("content") {
            Some(Json::String(s)) => Ok(Some(s.clone())),
            _ => Err(field_error(
                path,
                field,
                "an object here needs a string \"content\"",
            )),
        },
        Some(_) => Err(field_error(
            path,
            field,
            "expected a string or an object with \"content\"",
        )),
    }
}

fn bool_field(config: &Json, field: &str, path: &Path) -> Result<Option<bool>, TokenizerError> {
    match config.get(field) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(field_error(path, field, "expected true or false")),
    }
}

/// `chat_template` is a string, or a list of named templates of which "default" is used.
fn chat_template_field(config: &Json, path: &Path) -> Result<Option<String>, TokenizerError> {
    let field = "chat_template";
    match config.get(field) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(Json::Array(entries)) => {
            let mut named = Vec::new();
            for entry in entries {
                match (
                    entry.get("name").and_then(Json::as_str),
                    entry.get("template").and_then(Json::as_str),
                ) {
                    (Some(name), Some(template)) => named.push((name, template)),
                    _ => {
                        return Err(field_error(
                            path,
                            field,
                            "each list entry needs string \"name\" and \"template\"",
                        ))
                    }
                }
            }
            if let Some((_, template)) = named.iter().find(|(name, _)| *name == "default") {
                return Ok(Some(template.to_string()));
            }
            match named.as_slice() {
                [] => Ok(None),
                [(_, only)] => Ok(Some(only.to_string())),
                _ => {
                    let names: Vec<&str> = named.iter().map(|(name, _)| *name).collect();
                    Err(field_error(
                        path,
                        field,
                        format!(
                            "several templates ({}) and none named \"default\"; write the one \
                             to use into chat_template.jinja next to it",
                            names.join(", ")
                        ),
                    ))
                }
            }
        }
        Some(_) => Err(field_error(
            path,
            field,
            "expected a string or a list of {\"name\", \"template\"} objects",
        )),
    }
}

fn added_tokens_decoder_field(
    config: &Json,
    path: &Path,
) -> Result<Vec<(u32, String)>, TokenizerError> {
    let field = "added_tokens_decoder";
    let Some(entries) = config.get(field) else {
        return Ok(Vec::new());
    };
    let Some(entries) = entries.as_object() else {
        return Err(field_error(
            path,
            field,
            "expected an object keyed by token id",
        ));
    };
    let mut tokens = Vec::with_capacity(entries.len());
    for (key, entry) in entries {
        let id: u32 = key
            .parse()
            .map_err(|_| field_error(path, field, format!("key {key:?} is not a token id")))?;
        let content = match entry {
            Json::String(s) => s.clone(),
            other => match other.get("content").and_then(Json::as_str) {
                Some(s) => s.to_string(),
                None => {
                    return Err(field_error(
                        path,
                        field,
                        format!("entry {key} has no string \"content\""),
                    ))
                }
            },
        };
        tokens.push((id, content));
    }
    Ok(tokens)
}

/// generation_config.json writes token ids as one integer, a list of them, or null.
fn token_ids_field(config: &Json, field: &str, path: &Path) -> Result<Vec<u32>, TokenizerError> {
    let as_id = |value: &Json| {
        value
            .as_u64()
            .and_then(|id| u32::try_from(id).ok())
            .ok_or_else(|| field_error(path, field, format!("{value} is not a token id")))
    };
    match config.get(field) {
        None | Some(Json::Null) => Ok(Vec::new()),
        Some(Json::Array(values)) => values.iter().map(as_id).collect(),
        Some(value) => Ok(vec![as_id(value)?]),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::json;

    /// GPT-2's reversible byte → printable-char table, so every byte is a vocab entry.
    pub(crate) fn byte_to_char(byte: u8) -> char {
        let printable =
            |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
        if printable(byte) {
            return char::from(byte);
        }
        let shifted = (0..byte).filter(|b| !printable(*b)).count() as u32;
        char::from_u32(256 + shifted).unwrap_or('?')
    }

    fn byte_str(bytes: &[u8]) -> String {
        bytes.iter().map(|b| byte_to_char(*b)).collect()
    }

    pub(crate) const BOS: &str = "<s>";
    pub(crate) const EOS: &str = "</s>";
    pub(crate) const IM_END: &str = "<|im_end|>";

    /// Writes a byte-level BPE tokenizer.json: ids 0..256 are the bytes, then a few merges
    /// (including ones that cut a multi-byte character in two), then the special tokens.
    /// With `bos_post_processor` the post-processor puts `<s>` in front of every sequence.
    pub(crate) fn write_byte_level_tokenizer(dir: &Path, bos_post_processor: bool) {
        let mut vocab = serde_json::Map::new();
        for byte in 0..=255u8 {
            vocab.insert(byte_to_char(byte).to_string(), json!(byte as u32));
        }
        let merges: Vec<(Vec<u8>, Vec<u8>)> = vec![
            (b"h".to_vec(), b"e".to_vec()),
            (b"l".to_vec(), b"l".to_vec()),
            (b"he".to_vec(), b"ll".to_vec()),
            (b"hell".to_vec(), b"o".to_vec()),
            (b" ".to_vec(), b"w".to_vec()),
            // "f" + the first byte of "é": a token that ends inside a character.
            (b"f".to_vec(), vec![0xC3]),
            (vec![0xC3], vec![0xA9]),
            // The first two of the emoji's four bytes.
            (vec![0xF0], vec![0x9F]),
        ];
        let mut merge_list = Vec::new();
        for (left, right) in &merges {
            let merged: Vec<u8> = left.iter().chain(right).copied().collect();
            let id = vocab.len();
            vocab.insert(byte_str(&merged), json!(id));
            merge_list.push(json!([byte_str(left), byte_str(right)]));
        }
        let first_special = vocab.len();
        let added: Vec<_> = [BOS, EOS, IM_END]
            .iter()
            .enumerate()
            .map(|(i, content)| {
                json!({"id": first_special + i, "content": content, "single_word": false,
                       "lstrip": false, "rstrip": false, "normalized": false, "special": true})
            })
            .collect();
        let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false,
                                "trim_offsets": true, "use_regex": true});
        let post_processor = if bos_post_processor {
            json!({"type": "TemplateProcessing",
                   "single": [{"SpecialToken": {"id": BOS, "type_id": 0}},
                              {"Sequence": {"id": "A", "type_id": 0}}],
                   "pair": [{"SpecialToken": {"id": BOS, "type_id": 0}},
                            {"Sequence": {"id": "A", "type_id": 0}},
                            {"Sequence": {"id": "B", "type_id": 1}}],
                   "special_tokens": {BOS: {"id": BOS, "ids": [first_special], "tokens": [BOS]}}})
        } else {
            byte_level.clone()
        };
        let tokenizer = json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": added, "normalizer": null,
            "pre_tokenizer": byte_level, "post_processor": post_processor,
            "decoder": byte_level,
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                      "continuing_subword_prefix": null, "end_of_word_suffix": null,
                      "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                      "vocab": vocab, "merges": merge_list}
        });
        write_json(&dir.join("tokenizer.json"), &tokenizer);
    }

    pub(crate) fn write_json(path: &Path, value: &Json) {
        fs::write(path, serde_json::to_string_pretty(value).unwrap()).unwrap();
    }

    fn load(dir: &Path) -> TextTokenizer {
        TextTokenizer::from_dir(dir).unwrap()
    }

    #[test]
    fn minimal_dir_round_trips_text() {
        let dir = tempfile::tempdir().unwrap();
        write_byte_level_tokenizer(dir.path(), false);
        let tok = load(dir.path());
        let text = "hello world, café 😀!";
        let ids = tok.encode(text, true).unwrap();
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
        // "hello" is one merged token and the emoji needs three (two bytes merged, two single).
        assert_eq!(ids[0], tok.token_to_id("hello").unwrap());
        assert!(ids.len() > text.split_whitespace().count());
        assert_eq!(tok.bos_token(), None);
        assert_eq!(tok.eos_token(), None);
        assert!(tok.eos_token_ids().is_empty());
        assert_eq!(tok.chat_template(), None);
        assert!(!tok.adds_bos());
        // 256 bytes + 8 merges + 3 added tokens.
        assert_eq!(tok.vocab_size(), 256 + 8 + 3);
        assert_eq!(tok.id_to_token(256 + 8), Some(BOS.to_string()));
        assert_eq!(tok.token_to_id(IM_END), Some(256 + 8 + 2));
        assert_eq!(tok.id_to_token(10_000), None);
    }

    #[test]
    fn missing_tokenizer_json_names_path_and_fix() {
        let dir = tempfile::tempdir().unwrap();
        let err = TextTokenizer::from_dir(dir.path()).unwrap_err();
        assert!(matches!(err, TokenizerError::MissingTokenizerJson { .. }));
        let message = err.to_string();
        assert!(message.contains(&dir.path().join("tokenizer.json").display().to_string()));
        assert!(message.contains("needs a tokenizer.json"), "{message}");
    }

    #[test]
    fn corrupt_files_are_errors_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("tokenizer.json"), "{\"model\": 3}").unwrap();
        let err = TextTokenizer::from_dir(dir.path()).unwrap_err();
        assert!(matches!(err, TokenizerError::Load { .. }), "{err}");
        assert!(err.to_string().contains("tokenizer.json"));

        write_byte_level_tokenizer(dir.path(), false);
        fs::write(dir.path().join("tokenizer_config.json"), "{not json").unwrap();
        let err = TextTokenizer::from_dir(dir.path()).unwrap_err();
        assert!(matches!(err, TokenizerError::Json { .. }), "{err}");
        assert!(err.to_string().contains("tokenizer_config.json"));

        fs::remove_file(dir.path().join("tokenizer_config.json")).unwrap();
        write_json(
            &dir.path().join("generation_config.json"),
            &json!({"eos_token_id": ["two"]}),
        );
        let err = TextTokenizer::from_dir(dir.path()).unwrap_err();
        let message = err.to_string();
        assert!(message.contains("generation_config.json"), "{message}");
        assert!(message.contains("eos_token_id"), "{message}");
        fs::remove_file(dir.path().join("generation_config.json")).unwrap();

        // An optional file that is there but cannot be read is named, not skipped.
        for name in [
            "tokenizer_config.json",
            "generation_config.json",
            "chat_template.jinja",
        ] {
            let path = dir.path().join(name);
            fs::create_dir(&path).unwrap();
            let err = TextTokenizer::from_dir(dir.path()).unwrap_err();
            assert!(matches!(err, TokenizerError::Read { .. }), "{name}: {err}");
            assert!(err.to_string().contains(name), "{err}");
            fs::remove_dir(&path).unwrap();
        }
        #[cfg(unix)]
        {
            let path = dir.path().join("tokenizer_config.json");
            std::os::unix::fs::symlink(dir.path().join("missing-blob"), &path).unwrap();
            let err = TextTokenizer::from_dir(dir.path()).unwrap_err();
            assert!(err.to_string().contains("tokenizer_config.json"), "{err}");
        }
    }

    #[test]
    fn special_tokens_and_eos_ids_from_both_configs() {
        let dir = tempfile::tempdir().unwrap();
        write_byte_level_tokenizer(dir.path(), false);
        write_json(
            &dir.path().join("tokenizer_config.json"),
            &json!({
                "bos_token": {"content": BOS, "lstrip": false, "special": true},
                "eos_token": EOS,
                "chat_template": [
                    {"name": "tool_use", "template": "TOOLS"},
                    {"name": "default", "template": "DEFAULT"}
                ]
            }),
        );
        let im_end = 256 + 8 + 2;
        let eos = 256 + 8 + 1;
        write_json(
            &dir.path().join("generation_config.json"),
            &json!({"bos_token_id": 256 + 8, "eos_token_id": [im_end, eos]}),
        );
        let tok = load(dir.path());
        assert_eq!(tok.bos_token(), Some(BOS));
        assert_eq!(tok.eos_token(), Some(EOS));
        assert_eq!(tok.bos_token_id(), Some(256 + 8));
        // generation_config's order, and the tokenizer's eos only once.
        assert_eq!(tok.eos_token_ids(), &[im_end, eos]);
        assert_eq!(tok.chat_template(), Some("DEFAULT"));

        write_json(
            &dir.path().join("generation_config.json"),
            &json!({"eos_token_id": im_end}),
        );
        assert_eq!(load(dir.path()).eos_token_ids(), &[im_end, eos]);
    }

    #[test]
    fn chat_template_sources() {
        let dir = tempfile::tempdir().unwrap();
        write_byte_level_tokenizer(dir.path(), false);
        let config = dir.path().join("tokenizer_config.json");
        write_json(&config, &json!({"chat_template": "FROM CONFIG"}));
        assert_eq!(load(dir.path()).chat_template(), Some("FROM CONFIG"));

        fs::write(dir.path().join("chat_template.jinja"), "FROM FILE\n").unwrap();
        assert_eq!(load(dir.path()).chat_template(), Some("FROM FILE\n"));
        fs::remove_file(dir.path().join("chat_template.jinja")).unwrap();

        write_json(
            &config,
            &json!({"chat_template": [{"name": "rag", "template": "ONLY"}]}),
        );
        assert_eq!(load(dir.path()).chat_template(), Some("ONLY"));

        write_json(
            &config,
            &json!({"chat_template": [{"name": "rag", "template": "A"},
                                      {"name": "tool_use", "template": "B"}]}),
        );
        let message = TextTokenizer::from_dir(dir.path()).unwrap_err().to_string();
        assert!(message.contains("rag, tool_use"), "{message}");
        assert!(message.contains("chat_template.jinja"), "{message}");
    }

    #[test]
    fn eos_known_only_to_added_tokens_decoder() {
        let dir = tempfile::tempdir().unwrap();
        write_byte_level_tokenizer(dir.path(), false);
        write_json(
            &dir.path().join("tokenizer_config.json"),
            &json!({"eos_token": "<|eot|>",
                    "added_tokens_decoder": {"300": {"content": "<|eot|>", "special": true}}}),
        );
        assert_eq!(load(dir.path()).eos_token_ids(), &[300]);
    }

    #[test]
    fn bos_is_never_doubled() {
        let dir = tempfile::tempdir().unwrap();
        write_byte_level_tokenizer(dir.path(), true);
        write_json(
            &dir.path().join("tokenizer_config.json"),
            &json!({"bos_token": BOS, "eos_token": EOS}),
        );
        let tok = load(dir.path());
        let bos = tok.token_to_id(BOS).unwrap();
        let hello = tok.token_to_id("hello").unwrap();
        assert!(tok.adds_bos());
        assert_eq!(tok.encode("hello", true).unwrap(), vec![bos, hello]);
        assert_eq!(tok.encode("hello", false).unwrap(), vec![hello]);
        // Template wrote BOS itself / raw text that starts with it: one BOS.
        assert_eq!(
            tok.encode_prompt("<s>hello", true).unwrap(),
            vec![bos, hello]
        );
        assert_eq!(
            tok.encode_prompt("<s>hello", false).unwrap(),
            vec![bos, hello]
        );
        // Template without BOS on a tokenizer that adds one: BOS is supplied.
        assert_eq!(tok.encode_prompt("hello", true).unwrap(), vec![bos, hello]);
        assert_eq!(tok.encode_prompt("hello", false).unwrap(), vec![bos, hello]);
    }

    #[test]
    fn add_bos_token_flag_overrides_post_processor() {
        let dir = tempfile::tempdir().unwrap();
        write_byte_level_tokenizer(dir.path(), false);
        let config = dir.path().join("tokenizer_config.json");
        write_json(&config, &json!({"bos_token": BOS, "add_bos_token": true}));
        let tok = load(dir.path());
        let bos = tok.token_to_id(BOS).unwrap();
        let hello = tok.token_to_id("hello").unwrap();
        assert_eq!(tok.encode("hello", true).unwrap(), vec![bos, hello]);
        assert_eq!(tok.encode_prompt("hello", true).unwrap(), vec![bos, hello]);

        write_byte_level_tokenizer(dir.path(), true);
        write_json(&config, &json!({"bos_token": BOS, "add_bos_token": false}));
        let tok = load(dir.path());
        assert!(!tok.adds_bos());
        assert_eq!(tok.encode("hello", true).unwrap(), vec![hello]);
        assert_eq!(tok.encode_prompt("hello", true).unwrap(), vec![hello]);
        // Text that spells BOS still encodes it as the special token.
        assert_eq!(
            tok.encode_prompt("<s>hello", true).unwrap(),
            vec![bos, hello]
        );
    }

    #[test]
    fn no_bos_token_means_no_bos() {
        let dir = tempfile::tempdir().unwrap();
        write_byte_level_tokenizer(dir.path(), false);
        write_json(
            &dir.path().join("tokenizer_config.json"),
            &json!({"bos_token": null, "eos_token": IM_END}),
        );
        let tok = load(dir.path());
        let hello = tok.token_to_id("hello").unwrap();
        assert_eq!(tok.encode_prompt("hello", true).unwrap(), vec![hello]);
        assert_eq!(tok.encode_prompt("hello", false).unwrap(), vec![hello]);
        assert_eq!(tok.eos_token_ids(), &[tok.token_to_id(IM_END).unwrap()]);
    }
}
