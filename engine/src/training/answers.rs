//! The answers the target generated for the training prompts, cached in a JSONL file that
//! outlives the run.
//!
//! Each answer costs the target a whole decode, so it is appended to the file as soon as it
//! exists: a run stopped halfway, or run again on the same data, generates only what is
//! missing. An answer is keyed by everything that determines it: the target
//! ([`target_fingerprint`]), the prompt's token ids ([`hash_tokens`]), the temperature and
//! the seed. Lines another target wrote are left in the file but never served, and a damaged
//! line (a run killed mid-write) is skipped with a warning, its answer generated again.

use std::collections::HashMap;
use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::EngineError;
use crate::loading::LoadedModel;

/// Everything that determines an answer besides the target and its length limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct AnswerKey {
    pub(crate) prompt: u128,
    pub(crate) prompt_tokens: usize,
    /// `f32::to_bits`, so that the key can be hashed.
    pub(crate) temperature: u32,
    /// The prompt's own seed (0 for greedy answers, which use none).
    pub(crate) seed: u64,
}

/// The seed a sampled answer is drawn with: derived from the base seed and the prompt, not
/// the line's position, so that adding or moving lines keeps every other answer;
/// `occurrence` tells the repeats of one prompt apart.
pub(crate) fn answer_seed(base_seed: u64, prompt: u128, occurrence: u64) -> u64 {
    let mut hash = Fnv1a::new();
    hash.field(&base_seed.to_le_bytes());
    hash.field(&prompt.to_le_bytes());
    hash.field(&occurrence.to_le_bytes());
    let h = hash.finish();
    (h as u64) ^ ((h >> 64) as u64)
}

/// The stable hash of a prompt's token ids that keys its answers.
pub(crate) fn hash_tokens(tokens: &[u32]) -> u128 {
    let mut hash = Fnv1a::new();
    for id in tokens {
        hash.bytes(&id.to_le_bytes());
    }
    hash.finish()
}

/// 128-bit FNV-1a: the answers file outlives builds, and std's hashers may change
/// between Rust releases.
struct Fnv1a(u128);

impl Fnv1a {
    const OFFSET: u128 = 0x6c62272e07bb014262b821756295c58d;
    const PRIME: u128 = 0x0000000001000000000000000000013b;

    fn new() -> Self {
        Self(Self::OFFSET)
    }

    fn bytes(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u128::from(b);
            self.0 = self.0.wrapping_mul(Self::PRIME);
        }
    }

    /// Length first, so that consecutive fields cannot run into each other.
    fn field(&mut self, bytes: &[u8]) {
        self.bytes(&(bytes.len() as u64).to_le_bytes());
        self.bytes(bytes);
    }

    fn finish(&self) -> u128 {
        self.0
    }
}

const WEIGHT_EXTENSIONS: [&str; 6] = ["safetensors", "gguf", "bin", "npz", "pt", "pth"];
/// Pieces read from each weight file, spread over it: fine-tunes of one architecture often
/// share their config.json and file sizes, but no stretch of their weights.
const SAMPLES_PER_FILE: u64 = 16;
const SAMPLE_BYTES: u64 = 4096;

/// What identifies the target's answers: its config.json, its weight files' names, sizes
/// and samples of their bytes (reading them whole would take as long as loading them),
/// the dtype and quantization it was loaded with, and the ids that end an answer.
pub(crate) fn target_fingerprint(loaded: &LoadedModel) -> Result<u128, EngineError> {
    let dir = &loaded.dir;
    let unreadable = |what: &Path, e: std::io::Error| {
        EngineError::Invalid(format!(
            "reading {} to tell the target's answers apart: {e}",
            what.display()
        ))
    };
    let mut hash = Fnv1a::new();
    let config_path = dir.join("config.json");
    let config = match fs::read(&config_path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(unreadable(&config_path, e)),
    };
    hash.field(&config);
    let mut weights = Vec::new();
    for entry in fs::read_dir(dir).map_err(|e| unreadable(dir, e))? {
        let entry = entry.map_err(|e| unreadable(dir, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let is_weights = Path::new(&name)
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| WEIGHT_EXTENSIONS.contains(&e));
        if is_weights {
            weights.push((name, entry.path()));
        }
    }
    weights.sort();
    for (name, path) in &weights {
        hash.field(name.as_bytes());
        hash_samples(path, &mut hash).map_err(|e| unreadable(path, e))?;
    }
    let info = loaded.model.info();
    hash.field(format!("{:?} {:?}", info.dtype, info.quantized_bits).as_bytes());
    for id in loaded.tokenizer.eos_token_ids() {
        hash.field(&id.to_le_bytes());
    }
    Ok(hash.finish())
}

/// A file's size and [`SAMPLES_PER_FILE`] pieces of it, from its start to its end.
fn hash_samples(path: &Path, hash: &mut Fnv1a) -> std::io::Result<()> {
    // Opening follows the links of a hub cache's snapshot to the files themselves.
    let mut file = fs::File::open(path)?;
    let size = file.metadata()?.len();
    hash.field(&size.to_le_bytes());
    let mut piece = Vec::with_capacity(SAMPLE_BYTES as usize);
    for i in 0..SAMPLES_PER_FILE {
        let offset = size.saturating_sub(SAMPLE_BYTES) * i / (SAMPLES_PER_FILE - 1);
        file.seek(SeekFrom::Start(offset))?;
        piece.clear();
        (&mut file).take(SAMPLE_BYTES).read_to_end(&mut piece)?;
        hash.field(&piece);
    }
    Ok(())
}

/// One line of the answers file.
#[derive(Debug, Serialize, Deserialize)]
struct CacheLine {
    /// [`target_fingerprint`], hex.
    target: String,
    /// [`hash_tokens`] of the prompt, hex.
    prompt: String,
    prompt_tokens: usize,
    temperature: f32,
    seed: u64,
    /// The answer's length limit when it was generated.
    limit: usize,
    /// Generated ids, EOS included when the answer ended on it.
    answer: Vec<u32>,
}

struct CachedAnswer {
    limit: usize,
    tokens: Vec<u32>,
}

impl CachedAnswer {
    /// The longest limit this answer serves, cut to it: decoding is causal and draws its
    /// seeded samples in order, so a generation with a lower limit gives a prefix of it;
    /// one that ended before its own limit (EOS, context) is the whole answer at any limit.
    fn reach(&self) -> usize {
        if self.tokens.len() < self.limit {
            usize::MAX
        } else {
            self.limit
        }
    }
}

/// The answers file: what earlier runs generated for this target, and where new answers go.
pub(crate) struct AnswerCache {
    path: PathBuf,
    target: u128,
    entries: HashMap<AnswerKey, CachedAnswer>,
    /// Opened on the first append.
    file: Option<fs::File>,
    /// The file ends inside a line (a run stopped while writing it).
    needs_newline: bool,
    pub(crate) warnings: Vec<String>,
}

impl AnswerCache {
    pub(crate) fn open(path: &Path, target: u128) -> Result<Self, EngineError> {
        let mut cache = Self {
            path: path.to_path_buf(),
            target,
            entries: HashMap::new(),
            file: None,
            needs_newline: false,
            warnings: Vec::new(),
        };
        let bytes = match fs::read(path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(cache),
            Err(e) => {
                return Err(EngineError::Invalid(format!(
                    "reading the answers cache {}: {e}",
                    path.display()
                )))
            }
        };
        cache.needs_newline = bytes.last().is_some_and(|&b| b != b'\n');
        let mut corrupt = 0;
        let mut first_corrupt = None;
        for (index, raw) in bytes.split(|&b| b == b'\n').enumerate() {
            if raw.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            match Self::parse(raw, target) {
                Ok(Some((key, answer))) => cache.insert(key, answer),
                Ok(None) => {}
                Err(why) => {
                    corrupt += 1;
                    first_corrupt.get_or_insert((index + 1, why));
                }
            }
        }
        if let Some((line, why)) = first_corrupt {
            cache.warnings.push(format!(
                "ignored {corrupt} unreadable line(s) of the answers cache {} (the first, line {line}: {why}); their answers are generated again",
                path.display()
            ));
        }
        Ok(cache)
    }

    /// An answer of this target, `None` for another target's, an error for a damaged line.
    fn parse(raw: &[u8], target: u128) -> Result<Option<(AnswerKey, CachedAnswer)>, String> {
        let line: CacheLine = serde_json::from_slice(raw).map_err(|e| e.to_string())?;
        let hex = |s: &str| u128::from_str_radix(s, 16).map_err(|e| format!("{s:?}: {e}"));
        let written_for = hex(&line.target)?;
        let prompt = hex(&line.prompt)?;
        if line.answer.len() > line.limit {
            return Err(format!(
                "{} answer tokens past its limit of {}",
                line.answer.len(),
                line.limit
            ));
        }
        Ok(Some((
            AnswerKey {
                prompt,
                prompt_tokens: line.prompt_tokens,
                temperature: line.temperature.to_bits(),
                seed: line.seed,
            },
            CachedAnswer {
                limit: line.limit,
                tokens: line.answer,
            },
        ))
        .filter(|_| written_for == target))
    }

    fn insert(&mut self, key: AnswerKey, answer: CachedAnswer) {
        // Of two answers to one prompt, keeps the one that serves more limits.
        if self
            .entries
            .get(&key)
            .is_none_or(|old| answer.reach() > old.reach())
        {
            self.entries.insert(key, answer);
        }
    }

    /// The cached answer for `key`, cut to `limit`, when the cache has one that covers it.
    pub(crate) fn answer(&self, key: &AnswerKey, limit: usize) -> Option<&[u32]> {
        let entry = self.entries.get(key).filter(|e| e.reach() >= limit)?;
        Some(&entry.tokens[..entry.tokens.len().min(limit)])
    }

    /// Records a generated answer, on disk at once: a run stopped later loses nothing.
    pub(crate) fn append(
        &mut self,
        key: AnswerKey,
        limit: usize,
        tokens: Vec<u32>,
    ) -> Result<(), EngineError> {
        let failed = |e: std::io::Error| {
            EngineError::Invalid(format!(
                "writing the answers cache {}: {e}",
                self.path.display()
            ))
        };
        let line = CacheLine {
            target: format!("{:032x}", self.target),
            prompt: format!("{:032x}", key.prompt),
            prompt_tokens: key.prompt_tokens,
            temperature: f32::from_bits(key.temperature),
            seed: key.seed,
            limit,
            answer: tokens,
        };
        let mut text = serde_json::to_string(&line)
            .map_err(|e| EngineError::Invalid(format!("encoding an answer: {e}")))?;
        if self.needs_newline {
            // Ends the damaged line rather than gluing this one to it.
            text.insert(0, '\n');
        }
        text.push('\n');
        if self.file.is_none() {
            if let Some(parent) = self.path.parent().filter(|p| !p.as_os_str().is_empty()) {
                fs::create_dir_all(parent).map_err(failed)?;
            }
            let file = fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&self.path)
                .map_err(failed)?;
            self.file = Some(file);
        }
        if let Some(file) = self.file.as_mut() {
            file.write_all(text.as_bytes()).map_err(failed)?;
            file.flush().map_err(failed)?;
        }
        self.needs_newline = false;
        self.insert(
            key,
            CachedAnswer {
                limit,
                tokens: line.answer,
            },
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_matches_the_published_values() {
        assert_eq!(Fnv1a::new().finish(), 0x6c62272e07bb014262b821756295c58d);
        let mut hash = Fnv1a::new();
        hash.bytes(b"a");
        assert_eq!(hash.finish(), 0xd228cb696f1a8caf78912b704e4a8964);
    }
}
