//! Tool calls read back out of generated text, in the format the model's chat template
//! teaches it: Hermes/Qwen `<tool_call>` blocks, Llama 3.1+ JSON, Mistral `[TOOL_CALLS]`.
//!
//! The format is told by markers in the template's source ([`ToolCallFormat::detect`]);
//! a template that takes `tools` in none of these formats gets no parsing, its output
//! stays plain content. Anything that does not parse as a call (malformed JSON, a call
//! without a name) stays in the content as written: a model's text is never lost.
//!
//! Each format also accepts the calls as the whole output with the marker missing. The
//! markers of Llama (`<|python_tag|>`) and Mistral (`[TOOL_CALLS]`) are special tokens,
//! which the detokenizer leaves out of the text; and small Qwen models (Qwen2.5-Coder
//! 0.5B) answer with the bare `{"name": ..., "arguments": ...}` object, no tags.

use serde_json::Value;

/// How a family's chat template asks the model to write tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolCallFormat {
    /// `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per
    /// call (Hermes 2/3, Qwen2.5, Qwen3 and the templates that copied them).
    Hermes,
    /// `{"name": ..., "parameters": {...}}` as the whole answer, optionally after
    /// `<|python_tag|>`, several separated by `;` (Llama 3.1, 3.2, 3.3).
    Llama3Json,
    /// `[TOOL_CALLS]` and a JSON list of `{"name", "arguments"}` (Mistral v0.3, Nemo).
    Mistral,
}

/// One call parsed out of the output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments as JSON text, as OpenAI's API carries them.
    pub arguments: String,
}

/// Generated text split into what the model said and what it called.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ParsedOutput {
    /// The text outside the calls; the whole text, unchanged, when there are none.
    pub content: String,
    pub calls: Vec<ToolCall>,
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const LLAMA_PYTHON_TAG: &str = "<|python_tag|>";
const MISTRAL_MARKER: &str = "[TOOL_CALLS]";

impl ToolCallFormat {
    /// The format a chat template's source teaches, `None` when it names no known one.
    pub fn detect(template_source: &str) -> Option<Self> {
        if template_source.contains(HERMES_OPEN) {
            Some(Self::Hermes)
        } else if template_source.contains(MISTRAL_MARKER) {
            Some(Self::Mistral)
        } else if template_source.contains(LLAMA_PYTHON_TAG)
            || (template_source.contains("<|start_header_id|>")
                && template_source.contains("ipython"))
        {
            // Llama 3.2's template has no python tag, but 3.1's and 3.2's both give tool
            // results an `ipython` turn.
            Some(Self::Llama3Json)
        } else {
            None
        }
    }

    /// The text that starts a call wherever it appears.
    fn marker(self) -> &'static str {
        match self {
            Self::Hermes => HERMES_OPEN,
            Self::Llama3Json => LLAMA_PYTHON_TAG,
            Self::Mistral => MISTRAL_MARKER,
        }
    }

    /// The first character of calls written as the whole output without a marker.
    fn bare_opener(self) -> char {
        match self {
            Self::Hermes | Self::Llama3Json => '{',
            Self::Mistral => '[',
        }
    }

    /// Splits a finished generation into content and calls.
    pub fn parse(self, text: &str) -> ParsedOutput {
        let mut parts = Parts::default();
        let marker = self.marker();
        match (self, text.find(marker)) {
            (Self::Hermes, Some(_)) => hermes_blocks(text, &mut parts),
            // Everything after the marker is the calls; the text before it is content.
            (_, Some(at)) => match calls_in(&text[at + marker.len()..]) {
                Some(calls) => {
                    parts.text(&text[..at]);
                    calls.into_iter().for_each(|c| parts.call(c));
                }
                None => parts.text(text),
            },
            (_, None) => {
                let bare = text.trim_start().starts_with(self.bare_opener());
                match calls_in(text).filter(|_| bare) {
                    Some(calls) => calls.into_iter().for_each(|c| parts.call(c)),
                    None => parts.text(text),
                }
            }
        }
        parts.finish(text)
    }
}

/// [`ToolCallFormat::parse`] with the format told by `template_source`; a template in
/// no known format gives the text back as content.
pub fn parse_tool_calls(template_source: &str, text: &str) -> ParsedOutput {
    match ToolCallFormat::detect(template_source) {
        Some(format) => format.parse(text),
        None => ParsedOutput {
            content: text.to_string(),
            calls: Vec::new(),
        },
    }
}

/// `<tool_call>` blocks anywhere in `text`. The last may lack its closing tag (the model
/// ended the turn right after the JSON), which counts when the JSON is complete.
fn hermes_blocks(text: &str, parts: &mut Parts) {
    let mut rest = text;
    while let Some(open) = rest.find(HERMES_OPEN) {
        let inside = &rest[open + HERMES_OPEN.len()..];
        let (json, block_end) = match inside.find(HERMES_CLOSE) {
            Some(close) => (
                &inside[..close],
                open + HERMES_OPEN.len() + close + HERMES_CLOSE.len(),
            ),
            None => (inside, rest.len()),
        };
        match calls_in(json) {
            Some(calls) => {
                parts.text(&rest[..open]);
                calls.into_iter().for_each(|c| parts.call(c));
            }
            // Not a call: the block stays in the content as the model wrote it.
            None => parts.text(&rest[..block_end]),
        }
        rest = &rest[block_end..];
    }
    parts.text(rest);
}

/// The calls that make up all of `json` (surrounding whitespace aside): call objects
/// or lists of them, one after another, optionally separated by `;` as Llama writes
/// several. `None` unless every value is a call and there is at least one.
fn calls_in(json: &str) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    let mut rest = json.trim_start();
    while !rest.is_empty() {
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        let value = values.next()?.ok()?;
        let used = values.byte_offset();
        match value {
            Value::Array(items) => {
                for item in &items {
                    calls.push(call_of(item)?);
                }
            }
            other => calls.push(call_of(&other)?),
        }
        rest = rest[used..].trim_start();
        if let Some(after) = rest.strip_prefix(';') {
            rest = after.trim_start();
        }
    }
    (!calls.is_empty()).then_some(calls)
}

/// `{"name": ..., "arguments": ...}` (or Llama's `"parameters"`) as a call. Arguments
/// that are a string must hold JSON (some models encode them twice); missing ones are `{}`.
fn call_of(value: &Value) -> Option<ToolCall> {
    let object = value.as_object()?;
    let name = object.get("name")?.as_str()?;
    if name.is_empty() {
        return None;
    }
    let arguments = match object.get("arguments").or_else(|| object.get("parameters")) {
        None | Some(Value::Null) => "{}".to_string(),
        Some(Value::String(text)) => {
            serde_json::from_str::<Value>(text).ok()?;
            text.clone()
        }
        Some(other) => serde_json::to_string(other).ok()?,
    };
    Some(ToolCall {
        name: name.to_string(),
        arguments,
    })
}

/// Collects the output in order: runs of text, split by calls.
#[derive(Default)]
struct Parts {
    /// The text runs: run `i` comes before call `i`, and a last one may follow the
    /// last call.
    runs: Vec<String>,
    calls: Vec<ToolCall>,
}

impl Parts {
    fn text(&mut self, text: &str) {
        // A run is open when it has no call after it yet.
        let open = self.runs.len() > self.calls.len();
        match self.runs.last_mut() {
            Some(run) if open => run.push_str(text),
            _ => self.runs.push(text.to_string()),
        }
    }

    fn call(&mut self, call: ToolCall) {
        if self.runs.len() == self.calls.len() {
            self.runs.push(String::new());
        }
        self.calls.push(call);
    }

    /// The content is the text runs without the whitespace that set the calls apart
    /// (newlines around `<tool_call>` blocks), the runs that are left joined by a line.
    /// Without calls it is `text` exactly.
    fn finish(self, text: &str) -> ParsedOutput {
        if self.calls.is_empty() {
            return ParsedOutput {
                content: text.to_string(),
                calls: Vec::new(),
            };
        }
        let calls = self.calls.len();
        let content: Vec<&str> = self
            .runs
            .iter()
            .enumerate()
            .map(|(i, run)| {
                // The first run keeps its leading whitespace: a stream has sent it already.
                let run = if i > 0 {
                    run.trim_start()
                } else {
                    run.as_str()
                };
                // Run `i` comes before call `i`.
                if i < calls {
                    run.trim_end()
                } else {
                    run
                }
            })
            .filter(|run| !run.is_empty())
            .collect();
        ParsedOutput {
            content: content.join("\n"),
            calls: self.calls,
        }
    }
}

/// Tool calls out of a streamed generation: text passes through as it comes until a
/// call may be starting, from then on it is held and parsed when generation ends.
///
/// What is held: the end of the text while it could still become the format's marker
/// (as stop strings are held back), with the whitespace before it; everything from a
/// whole marker on; and everything when the output begins with the opener of calls
/// written bare (`{`, or `[` for Mistral), because only the finished text tells a call
/// from an answer that is JSON. What [`ToolCallStream::push`] released and what
/// [`ToolCallStream::finish`] returns add up to the parsed content.
#[derive(Debug, Clone)]
pub struct ToolCallStream {
    format: ToolCallFormat,
    text: String,
    /// Bytes of `text` released.
    sent: usize,
    /// A call may have started: nothing more is released until the end.
    holding: bool,
}

impl ToolCallStream {
    pub fn new(format: ToolCallFormat) -> Self {
        Self {
            format,
            text: String::new(),
            sent: 0,
            holding: false,
        }
    }

    /// Adds a piece of generated text; returns the text that is safe to send now.
    pub fn push(&mut self, piece: &str) -> String {
        self.text.push_str(piece);
        if self.holding {
            return String::new();
        }
        let pending = &self.text[self.sent..];
        if self.sent == 0 {
            let start = pending.trim_start();
            if start.is_empty() {
                return String::new();
            }
            if start.starts_with(self.format.bare_opener()) {
                self.holding = true;
                return String::new();
            }
        }
        let marker = self.format.marker();
        let hold_from = match pending.find(marker) {
            Some(at) => {
                self.holding = true;
                at
            }
            None => partial_marker_start(pending, marker),
        };
        let release = pending[..hold_from].trim_end();
        let released = release.to_string();
        self.sent += release.len();
        released
    }

    /// Ends the stream on the finished generation's text (what was pushed): returns the
    /// content not released yet, and the parse.
    pub fn finish(self, text: &str) -> (String, ParsedOutput) {
        let parsed = self.format.parse(text);
        let sent = text.get(..self.sent).unwrap_or_default();
        // The released text is always where the content begins (see the type's doc);
        // were it not, sending nothing more beats sending text twice.
        let rest = parsed
            .content
            .strip_prefix(sent)
            .unwrap_or_default()
            .to_string();
        (rest, parsed)
    }
}

/// Start of the longest end of `text` that `marker` begins with (`text.len()` if none).
fn partial_marker_start(text: &str, marker: &str) -> usize {
    let window = text.len().saturating_sub(marker.len().saturating_sub(1));
    text.char_indices()
        .map(|(i, _)| i)
        .filter(|i| *i >= window)
        .find(|i| marker.starts_with(&text[*i..]))
        .unwrap_or(text.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str, arguments: &str) -> ToolCall {
        ToolCall {
            name: name.into(),
            arguments: arguments.into(),
        }
    }

    fn parsed(content: &str, calls: &[(&str, &str)]) -> ParsedOutput {
        ParsedOutput {
            content: content.into(),
            calls: calls.iter().map(|(n, a)| call(n, a)).collect(),
        }
    }

    #[test]
    fn formats_are_told_by_the_template_source() {
        let hermes = "{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>\n{\"name\": ...}\n</tool_call>";
        assert_eq!(ToolCallFormat::detect(hermes), Some(ToolCallFormat::Hermes));
        let mistral = "{%- if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{% endif %}{{ '[TOOL_CALLS]' }}";
        assert_eq!(
            ToolCallFormat::detect(mistral),
            Some(ToolCallFormat::Mistral)
        );
        let llama31 = "<|start_header_id|>assistant<|end_header_id|>\n\n<|python_tag|>";
        assert_eq!(
            ToolCallFormat::detect(llama31),
            Some(ToolCallFormat::Llama3Json)
        );
        let llama32 = "{{- \"<|start_header_id|>ipython<|end_header_id|>\\n\\n\" }}";
        assert_eq!(
            ToolCallFormat::detect(llama32),
            Some(ToolCallFormat::Llama3Json)
        );
        // Takes tools, but in a format dspec does not know: no calls, content as it is.
        let unknown = "{% for tool in tools %}{{ tool.function.name }}{% endfor %}<function=...>";
        assert_eq!(ToolCallFormat::detect(unknown), None);
        let text = "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>";
        assert_eq!(parse_tool_calls(unknown, text), parsed(text, &[]));
        assert_eq!(parse_tool_calls(hermes, text), parsed("", &[("f", "{}")]));
    }

    #[test]
    fn hermes_blocks_with_text_around_them() {
        let text = "Let me check both.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"C\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": \"CET\"}}\n</tool_call>\nDone.";
        assert_eq!(
            ToolCallFormat::Hermes.parse(text),
            parsed(
                "Let me check both.\nDone.",
                &[
                    ("get_weather", r#"{"city":"Paris","unit":"C"}"#),
                    ("get_time", r#"{"tz":"CET"}"#)
                ]
            )
        );
    }

    #[test]
    fn hermes_last_block_may_be_unclosed_and_bare_json_counts_when_whole() {
        let unclosed = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": [1, 2.5]}}";
        assert_eq!(
            ToolCallFormat::Hermes.parse(unclosed),
            parsed("", &[("f", r#"{"x":[1,2.5]}"#)])
        );
        // Qwen2.5-Coder 0.5B writes the object without tags.
        let bare = "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n";
        assert_eq!(
            ToolCallFormat::Hermes.parse(bare),
            parsed("", &[("get_weather", r#"{"city":"Paris"}"#)])
        );
        // JSON that is no call, or a call inside other text without tags, is content.
        for text in [
            "{\"answer\": 42}",
            "Call {\"name\": \"f\", \"arguments\": {}}",
        ] {
            assert_eq!(ToolCallFormat::Hermes.parse(text), parsed(text, &[]));
        }
    }

    #[test]
    fn malformed_calls_stay_content() {
        let cases = [
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": }\n</tool_call>",
            "<tool_call>\n{\"arguments\": {}}\n</tool_call>",
            "<tool_call>\n{\"name\": \"\"}\n</tool_call>",
            "<tool_call>\n{\"name\": \"f\", \"arguments\": \"not json\"}\n</tool_call>",
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"cut\": \"off",
            "<tool_call></tool_call>",
            "<tool_call>",
        ];
        for text in cases {
            assert_eq!(
                ToolCallFormat::Hermes.parse(text),
                parsed(text, &[]),
                "{text}"
            );
        }
        // A bad block beside a good one: the good one is a call, the bad one content.
        let mixed = "a <tool_call>{oops}</tool_call> b\n<tool_call>{\"name\": \"g\"}</tool_call>";
        assert_eq!(
            ToolCallFormat::Hermes.parse(mixed),
            parsed("a <tool_call>{oops}</tool_call> b", &[("g", "{}")])
        );
        for text in ["[TOOL_CALLS] [{\"name\": \"f\",", "[TOOL_CALLS]", "[1, 2]"] {
            assert_eq!(
                ToolCallFormat::Mistral.parse(text),
                parsed(text, &[]),
                "{text}"
            );
        }
        for text in ["<|python_tag|>{\"name\": ", "{\"name\": \"f\"} and more"] {
            assert_eq!(
                ToolCallFormat::Llama3Json.parse(text),
                parsed(text, &[]),
                "{text}"
            );
        }
    }

    #[test]
    fn llama_json_whole_output_with_or_without_the_python_tag() {
        let one = " {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}";
        assert_eq!(
            ToolCallFormat::Llama3Json.parse(one),
            parsed("", &[("get_weather", r#"{"city":"Paris"}"#)])
        );
        let tagged = "<|python_tag|>{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {\"n\": 1}}";
        assert_eq!(
            ToolCallFormat::Llama3Json.parse(tagged),
            parsed("", &[("a", "{}"), ("b", r#"{"n":1}"#)])
        );
        let after_text =
            "Looking it up.<|python_tag|>{\"name\": \"a\", \"arguments\": \"{\\\"q\\\": 1}\"}";
        assert_eq!(
            ToolCallFormat::Llama3Json.parse(after_text),
            parsed("Looking it up.", &[("a", r#"{"q": 1}"#)])
        );
        let answer = "Paris is sunny today.";
        assert_eq!(
            ToolCallFormat::Llama3Json.parse(answer),
            parsed(answer, &[])
        );
    }

    #[test]
    fn mistral_list_after_the_marker_or_bare() {
        let text = "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}, {\"name\": \"get_time\", \"arguments\": {}}]";
        let both = parsed(
            "",
            &[("get_weather", r#"{"city":"Paris"}"#), ("get_time", "{}")],
        );
        assert_eq!(ToolCallFormat::Mistral.parse(text), both);
        // The marker is a special token the detokenizer drops.
        let bare = &text["[TOOL_CALLS] ".len()..];
        assert_eq!(ToolCallFormat::Mistral.parse(bare), both);
        let with_text = "Sure.[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"a\": \"[x]\"}}]";
        assert_eq!(
            ToolCallFormat::Mistral.parse(with_text),
            parsed("Sure.", &[("f", r#"{"a":"[x]"}"#)])
        );
    }

    /// Streams `text` cut into pieces of `size` bytes (at char boundaries): returns
    /// what was released at each push, what finish returned, and the parse.
    fn stream(
        format: ToolCallFormat,
        text: &str,
        size: usize,
    ) -> (Vec<String>, String, ParsedOutput) {
        let mut s = ToolCallStream::new(format);
        let mut released = Vec::new();
        let mut piece = String::new();
        for c in text.chars() {
            piece.push(c);
            if piece.len() >= size {
                released.push(s.push(&piece));
                piece.clear();
            }
        }
        released.push(s.push(&piece));
        let (rest, parsed) = s.finish(text);
        (released, rest, parsed)
    }

    #[test]
    fn streamed_content_equals_the_parsed_content_however_it_is_cut() {
        let texts = [
            "Hello there, how are you?",
            "  leading space kept",
            "Let me check.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>\nAfter.",
            "<tool_call>\n{\"name\": \"f\"}\n</tool_call>",
            "Not a call: <tool_call>{bad}</tool_call> and a < sign <tool_",
            "{\"name\": \"f\", \"arguments\": {}}",
            "{\"json\": \"but no call\"}",
            "é😀 <tool_call>{\"name\": \"f\"}</tool_call>",
            "a <tool_ca",
            "\n\n  \n",
        ];
        for format in [
            ToolCallFormat::Hermes,
            ToolCallFormat::Llama3Json,
            ToolCallFormat::Mistral,
        ] {
            for text in texts {
                for size in [1, 2, 3, 5, 100] {
                    let (released, rest, parsed) = stream(format, text, size);
                    assert_eq!(
                        released.concat() + &rest,
                        parsed.content,
                        "{format:?} {text:?} in pieces of {size}"
                    );
                    assert_eq!(parsed, format.parse(text));
                }
            }
        }
    }

    #[test]
    fn streams_hold_back_only_what_may_start_a_call() {
        let (released, rest, parsed) = stream(
            ToolCallFormat::Hermes,
            "Checking <tool -> no.\n<tool_call>\n{\"name\": \"f\"}\n</tool_call>",
            1,
        );
        // "<tool" is held until " " shows it is no marker; the call's block never goes out.
        assert_eq!(released.concat(), "Checking <tool -> no.");
        assert_eq!(rest, "");
        assert_eq!(parsed.calls, [call("f", "{}")]);
        let at_tool = released
            .iter()
            .position(|r| r.contains("<tool"))
            .expect("released");
        assert_eq!(released[at_tool], " <tool");
        // A bare-JSON opener holds the whole answer until the end.
        let (released, rest, _) = stream(ToolCallFormat::Mistral, "[1, 2, 3]", 1);
        assert_eq!(released.concat(), "");
        assert_eq!(rest, "[1, 2, 3]");
        // Ordinary text goes out as it comes, but for trailing whitespace.
        let mut s = ToolCallStream::new(ToolCallFormat::Hermes);
        assert_eq!(s.push("Hi "), "Hi");
        assert_eq!(s.push("there"), " there");
    }
}
