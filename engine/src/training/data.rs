//! The training data of `dspec train-drafter`: a JSONL file of prompts, conversations and
//! texts turned into token sequences, the target's own answers generated once and cached.
//!
//! A drafter learns to predict what its target writes, so prompts and conversations are
//! answered by the target itself, through the plain decoding `dspec generate` runs; only
//! those answers are learnt. Texts are learnt whole, against the target's distributions
//! (the trainer computes them). Answers are slow to generate, so each is appended to an
//! answers file as soon as it exists, keyed by everything that determines it
//! ([`super::answers`]).

use std::collections::HashMap;
use std::fs;
use std::path::Path;

use serde_json::Value;

use super::answers::{answer_seed, hash_tokens, target_fingerprint, AnswerCache, AnswerKey};
use crate::decoding::batch::{BatchDecoder, NewSequence, SequenceId};
use crate::decoding::generate::{check_prompt_ids, GenerationConfig};
use crate::decoding::sampling::SamplingParams;
use crate::error::EngineError;
use crate::loading::LoadedModel;
use crate::text::chat_template::ChatMessage;
use crate::text::prompt::PromptEncoder;

/// One training sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Example {
    /// The whole sequence: prompt (templated) and answer, or the text.
    pub tokens: Vec<u32>,
    /// First position whose token is a label (learnt): the answer's first token for
    /// prompt/messages lines, 1 for text lines. Every later position is learnt too.
    pub first_label: usize,
    /// Labels are the target's own distributions (text lines), not the tokens.
    pub soft: bool,
    /// The 1-based line of the data file it came from.
    pub line: usize,
}

/// How lines become examples.
#[derive(Debug, Clone, PartialEq)]
pub struct DataOptions {
    /// Prompts and conversations go through the target's chat template.
    pub chat_template: bool,
    /// The target's sampling temperature for answers; 0 = greedy.
    pub temperature: f32,
    /// Base seed of sampled answers; each prompt's own seed derives from it.
    pub seed: u64,
    /// Most tokens the target writes for one answer (its EOS ends an answer sooner).
    pub answer_tokens: usize,
    /// Longest example, prompt and answer together; longer ones are cut.
    pub max_tokens: usize,
}

/// What became of the file's lines.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DataSummary {
    pub examples: usize,
    /// Answers the target wrote in this call.
    pub generated: usize,
    /// Answers taken from the answers file (or from an identical prompt's answer).
    pub reused: usize,
    /// Examples cut to `max_tokens`.
    pub truncated: usize,
    /// Lines left out for fewer than two learnt positions.
    pub skipped: usize,
    /// Assistant turns that ended a conversation, dropped for the target to rewrite.
    pub dropped_assistant_turns: usize,
    /// Problems that did not stop loading (corrupt lines of the answers file), for the
    /// caller to print.
    pub warnings: Vec<String>,
}

/// One line of the data file, checked but not yet tokenized.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DataLine {
    /// A user prompt; the target writes the answer.
    Prompt(String),
    /// A conversation as written; its trailing assistant turns are dropped when it is
    /// encoded, for the target to write the answer.
    Messages(Vec<ChatMessage>),
    /// Text learnt as it is.
    Text(String),
}

const LINE_KEYS: [&str; 3] = ["prompt", "messages", "text"];
const LINE_NEEDS: &str = r#"each line needs one of "prompt", "messages" or "text""#;
const ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];

/// Fewer learnt positions than this teach a drafter nothing about following on.
const MIN_LEARNT: usize = 2;

/// Every line of a JSONL data file, with its 1-based line number; blank lines are skipped.
/// The first malformed line is an error naming the file and the line.
pub fn read_lines(path: &Path) -> Result<Vec<(usize, DataLine)>, EngineError> {
    let text = fs::read_to_string(path).map_err(|e| {
        EngineError::Invalid(format!("reading the training data {}: {e}", path.display()))
    })?;
    let mut lines = Vec::new();
    for (index, raw) in text.lines().enumerate() {
        let number = index + 1;
        // Editors on some systems start a UTF-8 file with a byte order mark.
        let raw = if number == 1 {
            raw.trim_start_matches('\u{feff}')
        } else {
            raw
        };
        if raw.trim().is_empty() {
            continue;
        }
        let line = parse_line(raw).map_err(|problem| line_error(path, number, &problem))?;
        lines.push((number, line));
    }
    Ok(lines)
}

fn line_error(path: &Path, line: usize, problem: &str) -> EngineError {
    EngineError::Invalid(format!("{}:{line}: {problem}", path.display()))
}

/// A JSON value as a user wrote it, shortened to stay readable in one error line.
fn shown(value: &Value) -> String {
    const LONGEST: usize = 60;
    let text = value.to_string();
    match text.char_indices().nth(LONGEST) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text,
    }
}

fn parse_line(raw: &str) -> Result<DataLine, String> {
    let value: Value = serde_json::from_str(raw)
        .map_err(|e| format!("not JSON ({e}); {LINE_NEEDS}, in a JSON object"))?;
    let Value::Object(object) = &value else {
        return Err(format!(
            "got {}, not a JSON object; {LINE_NEEDS}",
            shown(&value)
        ));
    };
    if let Some(key) = object.keys().find(|k| !LINE_KEYS.contains(&k.as_str())) {
        return Err(format!(
            "unknown key {key:?}; {LINE_NEEDS} and nothing else"
        ));
    }
    let present: Vec<&str> = LINE_KEYS
        .into_iter()
        .filter(|k| object.contains_key(*k))
        .collect();
    let key = match present.as_slice() {
        [key] => *key,
        [] => return Err(format!("an empty object; {LINE_NEEDS}")),
        several => {
            let named: Vec<String> = several.iter().map(|k| format!("{k:?}")).collect();
            return Err(format!(
                "has {}; {LINE_NEEDS}, not several",
                named.join(" and ")
            ));
        }
    };
    let value = object.get(key).unwrap_or(&Value::Null);
    let what = format!("{key:?}");
    match key {
        "messages" => parse_messages(value).map(DataLine::Messages),
        "prompt" => non_empty_string(&what, value).map(DataLine::Prompt),
        _ => non_empty_string(&what, value).map(DataLine::Text),
    }
}

fn non_empty_string(what: &str, value: &Value) -> Result<String, String> {
    match value {
        Value::String(s) if s.is_empty() => {
            Err(format!("{what} is empty; {LINE_NEEDS}, with text"))
        }
        Value::String(s) => Ok(s.clone()),
        other => Err(format!(
            "{what} must be a string, got {}; {LINE_NEEDS}",
            shown(other)
        )),
    }
}

fn parse_messages(value: &Value) -> Result<Vec<ChatMessage>, String> {
    const SHAPE: &str = r#"a JSON array of {"role": ..., "content": "..."} objects"#;
    let Value::Array(items) = value else {
        return Err(format!(
            r#""messages" must be {SHAPE}, got {}"#,
            shown(value)
        ));
    };
    if items.is_empty() {
        return Err(format!(r#""messages" is empty; it must be {SHAPE}"#));
    }
    let mut messages = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let at = format!(r#""messages"[{i}]"#);
        let Value::Object(message) = item else {
            return Err(format!(
                r#"{at} must be an object with "role" and "content", got {}"#,
                shown(item)
            ));
        };
        // Tool calls and names would be dropped without a word: refused instead.
        if let Some(key) = message.keys().find(|k| *k != "role" && *k != "content") {
            return Err(format!(
                r#"{at} has {key:?}, which training does not read; a message holds "role" and "content" only"#
            ));
        }
        let role = match message.get("role") {
            Some(Value::String(role)) if ROLES.contains(&role.as_str()) => role.clone(),
            Some(other) => {
                return Err(format!(
                    r#"{at} has role {}; "role" is one of "system", "user", "assistant" or "tool""#,
                    shown(other)
                ))
            }
            None => return Err(format!(r#"{at} has no "role""#)),
        };
        let content = match message.get("content") {
            Some(Value::String(content)) if content.is_empty() => {
                return Err(format!(r#"{at} has an empty "content""#))
            }
            Some(Value::String(content)) => content.clone(),
            Some(other) => {
                return Err(format!(
                    r#"{at} "content" must be a string, got {}"#,
                    shown(other)
                ))
            }
            None => return Err(format!(r#"{at} has no "content""#)),
        };
        messages.push(ChatMessage::new(role, content));
    }
    if messages.iter().all(|m| m.role == "assistant") {
        return Err(
            r#""messages" has only assistant turns: the target writes the answer itself, so a conversation needs a turn before it"#
                .into(),
        );
    }
    Ok(messages)
}

/// Turns the data file into examples: parses every line first (so a bad line fails before
/// any generation), then generates the answers the answers file at `cache_path` lacks.
/// `progress` hears (answers done, answers to generate), from (0, n) on.
pub fn load_examples(
    path: &Path,
    loaded: &LoadedModel,
    options: &DataOptions,
    cache_path: &Path,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(Vec<Example>, DataSummary), EngineError> {
    check_options(options)?;
    let lines = read_lines(path)?;
    if lines.is_empty() {
        return Err(EngineError::Invalid(format!(
            "{} has no lines; {LINE_NEEDS}",
            path.display()
        )));
    }
    let mut summary = DataSummary::default();
    let longest = options
        .max_tokens
        .min(loaded.model.info().max_context.unwrap_or(usize::MAX));

    // Every line to token ids before the first answer is generated.
    let mut planner = Planner {
        loaded,
        encoder: PromptEncoder::new(&loaded.tokenizer, options.chat_template, None)?,
        options,
        longest,
        occurrences: HashMap::new(),
        dropped_assistant_turns: 0,
    };
    let mut planned = Vec::with_capacity(lines.len());
    for (line, data) in &lines {
        let plan = planner
            .plan(data)
            .map_err(|problem| line_error(path, *line, &problem))?;
        planned.push((*line, plan));
    }
    summary.dropped_assistant_turns = planner.dropped_assistant_turns;

    let answers_wanted = planned
        .iter()
        .filter(|(_, plan)| matches!(plan, Plan::Answer { .. }))
        .count();
    let cache = if answers_wanted > 0 {
        let mut cache = AnswerCache::open(cache_path, target_fingerprint(loaded)?)?;
        summary.warnings.append(&mut cache.warnings);
        summary.generated =
            generate_missing(path, &planned, loaded, options, &mut cache, progress)?;
        summary.reused = answers_wanted - summary.generated;
        Some(cache)
    } else {
        None
    };

    let eos_ids = loaded.tokenizer.eos_token_ids();
    let mut examples = Vec::with_capacity(planned.len());
    for (line, plan) in planned {
        let example = match plan {
            Plan::Skip => None,
            Plan::Text(mut tokens) => {
                if tokens.len() > longest {
                    tokens.truncate(longest);
                    summary.truncated += 1;
                }
                Some(Example {
                    tokens,
                    first_label: 1,
                    soft: true,
                    line,
                })
            }
            Plan::Answer { prompt, key, limit } => {
                let answer = cache
                    .as_ref()
                    .and_then(|cache| cache.answer(&key, limit))
                    .ok_or_else(|| {
                        line_error(path, line, "its answer went missing from the answers cache")
                    })?;
                let ended = answer.last().is_some_and(|id| eos_ids.contains(id));
                if limit < options.answer_tokens && answer.len() == limit && !ended {
                    summary.truncated += 1;
                }
                let first_label = prompt.len();
                let mut tokens = prompt;
                tokens.extend_from_slice(answer);
                Some(Example {
                    tokens,
                    first_label,
                    soft: false,
                    line,
                })
            }
        };
        match example {
            Some(e) if e.tokens.len().saturating_sub(e.first_label) >= MIN_LEARNT => {
                examples.push(e)
            }
            _ => summary.skipped += 1,
        }
    }
    summary.examples = examples.len();
    if examples.is_empty() {
        return Err(EngineError::Invalid(format!(
            "no line of {} gave an example with {MIN_LEARNT} or more learnt tokens within {} tokens",
            path.display(),
            longest
        )));
    }
    Ok((examples, summary))
}

/// Turns lines into [`Plan`]s, for one target and one set of options.
struct Planner<'a> {
    loaded: &'a LoadedModel,
    encoder: PromptEncoder<'a>,
    options: &'a DataOptions,
    /// The longest example: `max_tokens`, or the target's context where that is shorter.
    longest: usize,
    /// How often each prompt (by [`hash_tokens`]) came before: its repeats are samples of
    /// their own.
    occurrences: HashMap<u128, u64>,
    dropped_assistant_turns: usize,
}

impl Planner<'_> {
    /// What a line becomes once tokenized; an error is the problem with the line.
    fn plan(&mut self, data: &DataLine) -> Result<Plan, String> {
        let text = |e: EngineError| e.to_string();
        let (tokens, answered) = match data {
            DataLine::Text(raw) => (
                self.loaded
                    .tokenizer
                    .encode_prompt(raw, false)
                    .map_err(|e| text(e.into()))?,
                false,
            ),
            DataLine::Prompt(prompt) => {
                (self.encoder.encode_user(prompt, None).map_err(text)?, true)
            }
            DataLine::Messages(messages) => {
                if !self.encoder.has_template() {
                    return Err(messages_refused(self.options));
                }
                let kept = messages
                    .iter()
                    .rposition(|m| m.role != "assistant")
                    .map_or(0, |i| i + 1);
                self.dropped_assistant_turns += messages.len() - kept;
                (
                    self.encoder
                        .encode_conversation(&messages[..kept])
                        .map_err(text)?,
                    true,
                )
            }
        };
        if tokens.is_empty() {
            return Err("tokenizes to nothing".into());
        }
        check_prompt_ids(self.loaded.model.as_ref(), &tokens).map_err(text)?;
        if !answered {
            return Ok(Plan::Text(tokens));
        }
        if tokens.len() + MIN_LEARNT > self.longest {
            // No room left for an answer worth learning: not worth generating.
            return Ok(Plan::Skip);
        }
        let prompt = hash_tokens(&tokens);
        let temperature = self.options.temperature;
        // -0.0 is greedy too, and must find 0.0's answers.
        let key = if temperature == 0.0 {
            AnswerKey {
                prompt,
                prompt_tokens: tokens.len(),
                temperature: 0,
                seed: 0,
            }
        } else {
            let occurrence = self.occurrences.entry(prompt).or_insert(0);
            let seed = answer_seed(self.options.seed, prompt, *occurrence);
            *occurrence += 1;
            AnswerKey {
                prompt,
                prompt_tokens: tokens.len(),
                temperature: temperature.to_bits(),
                seed,
            }
        };
        Ok(Plan::Answer {
            limit: self.options.answer_tokens.min(self.longest - tokens.len()),
            prompt: tokens,
            key,
        })
    }
}

/// How many answers the target writes at once, in one batch: a batch step reads the
/// weights once for all its sequences, so a GPU writes dozens nearly as fast as one (as
/// many as `dspec serve` batches by default, whose keys and values a Mac's memory holds
/// too); a CPU's step grows with each sequence, and a few already fill its cores.
fn answers_at_once(loaded: &LoadedModel) -> usize {
    match dspec_runtime::Backend::current() {
        dspec_runtime::Backend::Cpu => 8,
        _ => 32,
    }
    .min(if loaded.model.batches_rows() {
        usize::MAX
    } else {
        1
    })
}

/// Generates the answers `cache` lacks, each once (as long as its longest request),
/// several at once in one batch, each saved as soon as it ends; returns how many it
/// generated. Batched decoding writes what plain decoding writes alone (token for token
/// in f32; at a bf16 near-tie either token may come out).
fn generate_missing(
    path: &Path,
    planned: &[(usize, Plan)],
    loaded: &LoadedModel,
    options: &DataOptions,
    cache: &mut AnswerCache,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<usize, EngineError> {
    let mut missing: Vec<(usize, &[u32], AnswerKey, usize)> = Vec::new();
    let mut missing_index: HashMap<AnswerKey, usize> = HashMap::new();
    for (line, plan) in planned {
        let Plan::Answer { prompt, key, limit } = plan else {
            continue;
        };
        if cache.answer(key, *limit).is_some() {
            continue;
        }
        match missing_index.get(key) {
            Some(&i) => missing[i].3 = missing[i].3.max(*limit),
            None => {
                missing_index.insert(*key, missing.len());
                missing.push((*line, prompt, *key, *limit));
            }
        }
    }
    let greedy = options.temperature == 0.0;
    progress(0, missing.len());
    let mut batch = BatchDecoder::new(loaded.model.as_ref(), &loaded.tokenizer, 0);
    let mut waiting = missing.iter();
    let mut writing: HashMap<SequenceId, (AnswerKey, usize)> = HashMap::new();
    let at_once = answers_at_once(loaded);
    let mut done = 0;
    loop {
        while writing.len() < at_once {
            let Some((line, prompt, key, limit)) = waiting.next() else {
                break;
            };
            let config = GenerationConfig {
                max_tokens: *limit,
                sampling: SamplingParams {
                    temperature: options.temperature,
                    seed: (!greedy).then_some(key.seed),
                    ..SamplingParams::default()
                },
                stop_strings: Vec::new(),
                eos_ids: loaded.tokenizer.eos_token_ids().to_vec(),
            };
            let id = batch
                .add(NewSequence {
                    prompt: prompt.to_vec(),
                    config,
                    drafter: None,
                    logprobs: None,
                    reused: None,
                })
                .map_err(|e| line_error(path, *line, &format!("generating the answer: {e}")))?;
            writing.insert(id, (*key, *limit));
        }
        if writing.is_empty() {
            break;
        }
        let stepped = batch.step().map_err(|e| {
            EngineError::Invalid(format!("{}: generating the answers: {e}", path.display()))
        })?;
        for (id, answer) in stepped
            .into_iter()
            .filter_map(|p| p.finished.map(|f| (p.id, f)))
        {
            if let Some((key, limit)) = writing.remove(&id) {
                cache.append(key, limit, answer.tokens)?;
                done += 1;
                progress(done, missing.len());
            }
        }
    }
    Ok(missing.len())
}

fn check_options(options: &DataOptions) -> Result<(), EngineError> {
    let t = options.temperature;
    if !t.is_finite() || t < 0.0 {
        return Err(EngineError::Invalid(format!(
            "the answers' temperature must be 0 (greedy) or more, got {t}"
        )));
    }
    if options.answer_tokens < MIN_LEARNT {
        return Err(EngineError::Invalid(format!(
            "answers need at least {MIN_LEARNT} tokens to learn from, got {}",
            options.answer_tokens
        )));
    }
    // The shortest example: one token of context and its learnt ones.
    if options.max_tokens < MIN_LEARNT + 1 {
        return Err(EngineError::Invalid(format!(
            "examples need at least {} tokens, got a maximum of {}",
            MIN_LEARNT + 1,
            options.max_tokens
        )));
    }
    Ok(())
}

fn messages_refused(options: &DataOptions) -> String {
    let why = if options.chat_template {
        r#"the target has no chat template; use "prompt" or "text" lines"#
    } else {
        r#"chat templates are off; use "prompt" or "text" lines, or drop --no-chat-template"#
    };
    format!(r#""messages" needs the target's chat template, but {why}"#)
}

/// What a line becomes once tokenized.
enum Plan {
    Text(Vec<u32>),
    Answer {
        prompt: Vec<u32>,
        key: AnswerKey,
        /// Most answer tokens: `answer_tokens`, or less where `max_tokens` leaves less room.
        limit: usize,
    },
    /// Too long a prompt for any answer to fit.
    Skip,
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::decoding::generate::generate;
    use crate::loading::{builtin_registry, load_model};
    use crate::text::chat_template::ChatTemplate;
    use crate::tiny_model::write_tiny_model;
    use dspec_plugin_api::LoadOptions;

    fn tiny_target(seed: u64) -> (tempfile::TempDir, LoadedModel) {
        let dir = tempfile::tempdir().expect("temp dir");
        write_tiny_model(dir.path(), r#"{}"#, seed).expect("write tiny model");
        let loaded = load_model(
            dir.path().to_str().expect("utf-8 temp path"),
            &builtin_registry().expect("built-in registry"),
            &LoadOptions::default(),
            false,
        )
        .expect("load tiny model");
        (dir, loaded)
    }

    fn greedy(answer_tokens: usize) -> DataOptions {
        DataOptions {
            chat_template: true,
            temperature: 0.0,
            seed: 7,
            answer_tokens,
            max_tokens: 256,
        }
    }

    fn sampled(temperature: f32, seed: u64) -> DataOptions {
        DataOptions {
            temperature,
            seed,
            ..greedy(12)
        }
    }

    fn write_data(dir: &Path, lines: &[impl AsRef<str>]) -> PathBuf {
        let path = dir.join("data.jsonl");
        let lines: Vec<&str> = lines.iter().map(AsRef::as_ref).collect();
        fs::write(&path, lines.join("\n")).expect("write data");
        path
    }

    /// load_examples with its progress reports.
    fn load(
        data: &Path,
        loaded: &LoadedModel,
        options: &DataOptions,
        cache: &Path,
    ) -> (Vec<Example>, DataSummary, Vec<(usize, usize)>) {
        let mut reports = Vec::new();
        let (examples, summary) =
            load_examples(data, loaded, options, cache, &mut |done, total| {
                reports.push((done, total))
            })
            .expect("load examples");
        (examples, summary, reports)
    }

    /// The ChatML rendering of a conversation, ready for the assistant, as token ids.
    fn templated(loaded: &LoadedModel, messages: &[ChatMessage]) -> Vec<u32> {
        let tokenizer = &loaded.tokenizer;
        let source = tokenizer
            .chat_template()
            .expect("tiny model has a template");
        let template = ChatTemplate::new(source, tokenizer.bos_token(), tokenizer.eos_token())
            .expect("template compiles");
        let rendered = template
            .render(messages, true, &serde_json::Map::new())
            .expect("template renders");
        tokenizer.encode_prompt(&rendered, true).expect("encode")
    }

    fn user(text: &str) -> Vec<ChatMessage> {
        vec![ChatMessage::new("user", text)]
    }

    /// Plain decoding's answer, as `dspec generate` writes it.
    fn generated(
        loaded: &LoadedModel,
        prompt: &[u32],
        max: usize,
        sampling: SamplingParams,
    ) -> Vec<u32> {
        let config = GenerationConfig {
            max_tokens: max,
            sampling,
            stop_strings: Vec::new(),
            eos_ids: loaded.tokenizer.eos_token_ids().to_vec(),
        };
        generate(
            loaded.model.as_ref(),
            &loaded.tokenizer,
            prompt,
            &config,
            &mut |_| {},
        )
        .expect("generate")
        .tokens
    }

    const PROMPTS: [&str; 2] = ["Hello there", "Write a haiku about the sea."];

    fn prompt_lines() -> Vec<String> {
        PROMPTS
            .iter()
            .map(|p| serde_json::json!({ "prompt": p }).to_string())
            .collect()
    }

    #[test]
    fn prompts_are_answered_by_the_target_and_answers_are_cached() {
        let (_model, loaded) = tiny_target(3);
        let dir = tempfile::tempdir().expect("temp dir");
        let lines = prompt_lines();
        let data = write_data(dir.path(), &lines);
        let cache = dir.path().join("out").join("answers.jsonl");
        let options = greedy(12);

        let (examples, summary, reports) = load(&data, &loaded, &options, &cache);
        assert_eq!(examples.len(), 2);
        for (example, (text, line)) in examples.iter().zip(PROMPTS.iter().zip([1, 2])) {
            let prompt = templated(&loaded, &user(text));
            let answer = generated(&loaded, &prompt, 12, SamplingParams::default());
            assert!(
                answer.len() >= 2,
                "the tiny target answers {text:?} at length"
            );
            assert_eq!(example.tokens, [prompt.clone(), answer].concat());
            assert_eq!(example.first_label, prompt.len());
            assert!(!example.soft);
            assert_eq!(example.line, line);
        }
        assert_eq!(
            (summary.generated, summary.reused, summary.examples),
            (2, 0, 2)
        );
        assert_eq!(reports, [(0, 2), (1, 2), (2, 2)]);
        assert!(summary.warnings.is_empty());

        let (again, summary, reports) = load(&data, &loaded, &options, &cache);
        assert_eq!(again, examples);
        assert_eq!((summary.generated, summary.reused), (0, 2));
        assert_eq!(reports, [(0, 0)]);

        // Chat templates off: the prompt is the raw text, as `generate --no-chat-template`.
        let raw = DataOptions {
            chat_template: false,
            ..greedy(12)
        };
        let (examples, summary, _) = load(&data, &loaded, &raw, &cache);
        assert_eq!(summary.generated, 2);
        let prompt = loaded
            .tokenizer
            .encode_prompt(PROMPTS[0], false)
            .expect("encode");
        assert_eq!(examples[0].first_label, prompt.len());
        assert_eq!(examples[0].tokens[..prompt.len()], prompt[..]);
    }

    /// More prompts than one batch holds, of different lengths: every answer, greedy or
    /// sampled, is what plain decoding writes for its prompt alone, and progress counts
    /// each answer once.
    #[test]
    fn answers_written_in_batches_are_plain_decodings_answers() {
        let (_model, loaded) = tiny_target(3);
        let dir = tempfile::tempdir().expect("temp dir");
        let texts: Vec<String> = (0..answers_at_once(&loaded) + 3)
            .map(|i| "abcdefghij"[..1 + i % 10].repeat(1 + i / 4))
            .collect();
        let lines: Vec<String> = texts
            .iter()
            .map(|p| serde_json::json!({ "prompt": p }).to_string())
            .collect();
        let data = write_data(dir.path(), &lines);
        for (options, temperature) in [(greedy(20), 0.0), (sampled(0.8, 7), 0.8)] {
            let cache = dir.path().join(format!("answers-{temperature}.jsonl"));
            let (examples, summary, reports) = load(&data, &loaded, &options, &cache);
            assert_eq!(summary.generated, texts.len());
            let counts: Vec<usize> = reports.iter().map(|r| r.0).collect();
            assert_eq!(counts, (0..=texts.len()).collect::<Vec<_>>());
            // A line whose answer is its EOS alone is left out: pair examples by line.
            assert_eq!(examples.len() + summary.skipped, texts.len());
            for example in &examples {
                let text = &texts[example.line - 1];
                let prompt = templated(&loaded, &user(text));
                let sampling = SamplingParams {
                    temperature,
                    seed: (temperature > 0.0).then(|| answer_seed(7, hash_tokens(&prompt), 0)),
                    ..SamplingParams::default()
                };
                let answer = generated(&loaded, &prompt, options.answer_tokens, sampling);
                assert_eq!(
                    example.tokens[prompt.len()..],
                    answer[..],
                    "{text:?} at {temperature}"
                );
            }
        }
    }

    #[test]
    fn sampled_answers_are_reproducible_and_keyed_by_temperature_and_seed() {
        let (_model, loaded) = tiny_target(3);
        let dir = tempfile::tempdir().expect("temp dir");
        let lines = prompt_lines();
        let data = write_data(dir.path(), &lines);
        let cache = dir.path().join("answers.jsonl");

        let (first, summary, _) = load(&data, &loaded, &sampled(0.8, 1), &cache);
        assert_eq!((summary.generated, summary.reused), (2, 0));
        for (example, text) in first.iter().zip(PROMPTS) {
            let prompt = templated(&loaded, &user(text));
            let sampling = SamplingParams {
                temperature: 0.8,
                seed: Some(answer_seed(1, hash_tokens(&prompt), 0)),
                ..SamplingParams::default()
            };
            let answer = generated(&loaded, &prompt, 12, sampling);
            assert_eq!(example.tokens[prompt.len()..], answer[..]);
        }

        let (again, summary, _) = load(&data, &loaded, &sampled(0.8, 1), &cache);
        assert_eq!((summary.generated, summary.reused), (0, 2));
        assert_eq!(again, first);

        for changed in [sampled(0.8, 2), sampled(0.9, 1), greedy(12)] {
            let (_, summary, _) = load(&data, &loaded, &changed, &cache);
            assert_eq!(
                (summary.generated, summary.reused),
                (2, 0),
                "{changed:?} reused another setting's answers"
            );
        }

        // A repeated prompt is a second sample when sampling, the same answer when greedy.
        let twice = write_data(dir.path(), &[&lines[0], &lines[0]]);
        let (_, summary, _) = load(&twice, &loaded, &sampled(0.8, 5), &cache);
        assert_eq!((summary.generated, summary.reused), (2, 0));
        let (examples, summary, _) = load(&twice, &loaded, &greedy(12), &cache);
        assert_eq!((summary.generated, summary.reused), (0, 2));
        assert_eq!(examples[0].tokens, examples[1].tokens);
    }

    #[test]
    fn shorter_answers_and_cut_examples_reuse_longer_answers() {
        let (_model, loaded) = tiny_target(3);
        let dir = tempfile::tempdir().expect("temp dir");
        let line = serde_json::json!({ "prompt": PROMPTS[1] }).to_string();
        let data = write_data(dir.path(), &[&line]);
        let cache = dir.path().join("answers.jsonl");
        let prompt = templated(&loaded, &user(PROMPTS[1]));
        let answer = generated(&loaded, &prompt, 16, SamplingParams::default());
        assert!(answer.len() > 6, "the tiny target answers at length");

        let (long, summary, _) = load(&data, &loaded, &greedy(16), &cache);
        assert_eq!(summary.generated, 1);
        assert_eq!(long[0].tokens[prompt.len()..], answer[..]);

        let (short, summary, _) = load(&data, &loaded, &greedy(6), &cache);
        assert_eq!(
            (summary.generated, summary.reused, summary.truncated),
            (0, 1, 0)
        );
        assert_eq!(short[0].tokens[prompt.len()..], answer[..6]);

        // max_tokens leaves room for 5 of the answer's tokens: cut, and counted as cut.
        let cut = DataOptions {
            max_tokens: prompt.len() + 5,
            ..greedy(16)
        };
        let (examples, summary, _) = load(&data, &loaded, &cut, &cache);
        assert_eq!((summary.generated, summary.truncated), (0, 1));
        assert_eq!(examples[0].tokens.len(), prompt.len() + 5);
        assert_eq!(examples[0].tokens[prompt.len()..], answer[..5]);

        // No room for two answer tokens: skipped, nothing generated.
        let no_room = DataOptions {
            max_tokens: prompt.len() + 1,
            ..greedy(16)
        };
        let other = serde_json::json!({ "text": "enough text to learn from" }).to_string();
        let data = write_data(dir.path(), &[&line, &other]);
        let (examples, summary, _) = load(&data, &loaded, &no_room, &cache);
        assert_eq!(
            (summary.skipped, summary.generated, summary.examples),
            (1, 0, 1)
        );
        assert!(examples[0].soft);
    }

    #[test]
    fn conversations_drop_their_trailing_assistant_turns() {
        let (_model, loaded) = tiny_target(3);
        let dir = tempfile::tempdir().expect("temp dir");
        let lines = [
            r#"{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}"#,
            r#"{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yes?"}, {"role": "user", "content": "Count"}, {"role": "assistant", "content": "1"}, {"role": "assistant", "content": "2"}]}"#,
        ];
        let data = write_data(dir.path(), &lines);
        let cache = dir.path().join("answers.jsonl");
        let (examples, summary, _) = load(&data, &loaded, &greedy(8), &cache);
        assert_eq!(summary.dropped_assistant_turns, 3);
        let kept = [
            vec![
                ChatMessage::new("system", "Be brief."),
                ChatMessage::new("user", "Hi"),
            ],
            vec![
                ChatMessage::new("user", "Hi"),
                ChatMessage::new("assistant", "Yes?"),
                ChatMessage::new("user", "Count"),
            ],
        ];
        assert_eq!(examples.len(), 2);
        for (example, messages) in examples.iter().zip(&kept) {
            let prompt = templated(&loaded, messages);
            assert_eq!(example.first_label, prompt.len());
            assert_eq!(example.tokens[..prompt.len()], prompt[..]);
            let answer = generated(&loaded, &prompt, 8, SamplingParams::default());
            assert_eq!(example.tokens[prompt.len()..], answer[..]);
        }

        // Without a chat template a conversation cannot be rendered: refused, with the way out.
        let raw = DataOptions {
            chat_template: false,
            ..greedy(8)
        };
        let error = load_examples(&data, &loaded, &raw, &cache, &mut |_, _| {})
            .expect_err("messages need a template")
            .to_string();
        for part in [
            "data.jsonl:1:",
            r#""prompt""#,
            r#""text""#,
            "--no-chat-template",
        ] {
            assert!(error.contains(part), "{error:?} lacks {part:?}");
        }
    }

    #[test]
    fn texts_are_learnt_whole_against_the_target() {
        let (_model, loaded) = tiny_target(3);
        let dir = tempfile::tempdir().expect("temp dir");
        let text = "fn main() { println!(\"hi\"); }";
        let long = "x".repeat(40);
        let lines = [
            serde_json::json!({ "text": text }).to_string(),
            serde_json::json!({ "text": "ab" }).to_string(),
            serde_json::json!({ "text": long }).to_string(),
        ];
        let data = write_data(dir.path(), &lines);
        let cache = dir.path().join("answers.jsonl");
        let options = DataOptions {
            max_tokens: 32,
            ..greedy(8)
        };
        let (examples, summary, reports) = load(&data, &loaded, &options, &cache);
        let raw = loaded.tokenizer.encode(text, true).expect("encode");
        // The tiny tokenizer has one token per byte.
        let bytes: Vec<u32> = text.bytes().map(u32::from).collect();
        assert_eq!(raw, bytes);
        assert_eq!(examples[0].tokens, raw);
        assert_eq!((examples[0].first_label, examples[0].soft), (1, true));
        // "ab": one learnt position, too few; the long text cut to max_tokens.
        assert_eq!(examples.len(), 2);
        assert_eq!(examples[1].tokens.len(), 32);
        assert_eq!(examples[1].line, 3);
        assert_eq!(
            (summary.skipped, summary.truncated, summary.generated),
            (1, 1, 0)
        );
        // Nothing to generate: no progress, and no answers file.
        assert!(reports.is_empty());
        assert!(!cache.exists());
    }

    #[test]
    fn bad_lines_are_refused_with_their_file_and_line() {
        let cases = [
            ("not json", "not JSON"),
            (r#""a string""#, "not a JSON object"),
            ("[1, 2]", "not a JSON object"),
            (
                "{}",
                r#"an empty object; each line needs one of "prompt", "messages" or "text""#,
            ),
            (r#"{"promt": "hi"}"#, r#"unknown key "promt""#),
            (
                r#"{"prompt": "a", "text": "b"}"#,
                r#"has "prompt" and "text""#,
            ),
            (
                r#"{"prompt": 42}"#,
                r#""prompt" must be a string, got 42; each line needs one of"#,
            ),
            (r#"{"text": null}"#, r#""text" must be a string, got null"#),
            (r#"{"text": ""}"#, r#""text" is empty"#),
            (
                r#"{"messages": "hi"}"#,
                r#""messages" must be a JSON array"#,
            ),
            (r#"{"messages": []}"#, r#""messages" is empty"#),
            (r#"{"messages": [3]}"#, r#""messages"[0] must be an object"#),
            (
                r#"{"messages": [{"role": "bot", "content": "x"}]}"#,
                r#""messages"[0] has role "bot""#,
            ),
            (
                r#"{"messages": [{"role": 1, "content": "x"}]}"#,
                r#""messages"[0] has role 1"#,
            ),
            (
                r#"{"messages": [{"content": "x"}]}"#,
                r#""messages"[0] has no "role""#,
            ),
            (
                r#"{"messages": [{"role": "user", "content": 5}]}"#,
                r#""messages"[0] "content" must be a string, got 5"#,
            ),
            (
                r#"{"messages": [{"role": "user", "content": ""}]}"#,
                r#""messages"[0] has an empty "content""#,
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}, {"role": "user"}]}"#,
                r#""messages"[1] has no "content""#,
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x", "name": "n"}]}"#,
                r#""messages"[0] has "name""#,
            ),
            (
                r#"{"messages": [{"role": "assistant", "content": "x"}]}"#,
                "only assistant turns",
            ),
        ];
        let dir = tempfile::tempdir().expect("temp dir");
        for (bad, expected) in cases {
            // A good line and a blank one first: the bad line is line 3.
            let data = write_data(dir.path(), &[r#"{"prompt": "fine"}"#, "  ", bad]);
            let error = read_lines(&data).expect_err(bad).to_string();
            let at = format!("{}:3: ", data.display());
            assert!(
                error.starts_with(&at),
                "{bad}: {error:?} does not start with {at:?}"
            );
            assert!(
                error.contains(expected),
                "{bad}: {error:?} lacks {expected:?}"
            );
        }
        let long = format!(r#"{{"prompt": [{}]}}"#, vec!["1"; 100].join(","));
        let data = write_data(dir.path(), &[&long]);
        let error = read_lines(&data).expect_err("an array prompt").to_string();
        assert!(
            error.contains("…") && error.len() < 250,
            "{error:?} is not shortened"
        );

        // Through load_examples, a bad last line fails before anything is generated.
        let (_model, loaded) = tiny_target(3);
        let data = write_data(dir.path(), &[r#"{"prompt": "fine"}"#, r#"{"prompt": 42}"#]);
        let cache = dir.path().join("answers.jsonl");
        let error = load_examples(&data, &loaded, &greedy(8), &cache, &mut |_, _| {})
            .expect_err("a bad line")
            .to_string();
        assert!(error.contains("data.jsonl:2:"), "{error:?}");
        assert!(!cache.exists());
    }

    #[test]
    fn corrupt_cache_lines_are_skipped_and_other_targets_answers_not_reused() {
        let (_model, loaded) = tiny_target(3);
        let dir = tempfile::tempdir().expect("temp dir");
        let lines = prompt_lines();
        let data = write_data(dir.path(), &lines);
        let cache = dir.path().join("answers.jsonl");
        let (examples, _, _) = load(&data, &loaded, &greedy(8), &cache);

        // Damage: a garbage line, a line of the wrong shape, and a line cut off mid-write.
        let mut text = fs::read_to_string(&cache).expect("read cache");
        text.insert_str(0, "garbage\n{\"target\": 3}\n");
        text.push_str(r#"{"target": "00ff", "prompt"#);
        fs::write(&cache, text).expect("damage cache");
        let (again, summary, _) = load(&data, &loaded, &greedy(8), &cache);
        assert_eq!(again, examples);
        assert_eq!((summary.generated, summary.reused), (0, 2));
        assert_eq!(summary.warnings.len(), 1);
        let warning = &summary.warnings[0];
        assert!(
            warning.contains("ignored 3") && warning.contains("line 1"),
            "{warning:?}"
        );

        // An answer appended after the cut-off line is read back whole.
        let (_, summary, _) = load(&data, &loaded, &sampled(0.7, 3), &cache);
        assert_eq!(summary.generated, 2);
        let (_, summary, _) = load(&data, &loaded, &sampled(0.7, 3), &cache);
        assert_eq!((summary.generated, summary.reused), (0, 2));

        // Same architecture and file sizes, other weights: its answers are its own.
        let (_other_model, other) = tiny_target(4);
        let (_, summary, _) = load(&data, &other, &greedy(8), &cache);
        assert_eq!((summary.generated, summary.reused), (2, 0));
    }
}
