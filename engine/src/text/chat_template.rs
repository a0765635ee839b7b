//! Hugging Face chat templates (Jinja) rendered with minijinja the way transformers renders
//! them: same whitespace rules, the helpers templates call, and Python's JSON output.

use std::collections::BTreeMap;
use std::io;

use jiff::fmt::strtime;
use jiff::tz::TimeZone;
use jiff::{Timestamp, Zoned};
use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Serde};
use minijinja::{Environment, Error, ErrorKind, Value};
use serde::{Deserialize, Serialize};
use serde_json::ser::Formatter;
use thiserror::Error;

use crate::text::tool_calls::ToolCallFormat;

#[derive(Debug, Error)]
pub enum ChatTemplateError {
    #[error("the chat template does not compile: {message}")]
    Compile { message: String },
    #[error("the chat template rejected the conversation: {message}")]
    Raised { message: String },
    #[error("rendering the chat template failed: {message}")]
    Render { message: String },
}

/// One turn of a conversation, in the shape Hugging Face templates read. The tool
/// fields are left out of the template's view when absent, because templates test
/// `message.tool_calls is defined` or `'tool_calls' in message`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant turn's calls.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<MessageToolCall>>,
    /// A `tool` turn: the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A `tool` turn: the function that answered (some templates print it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }
    }
}

/// A call in an assistant turn: `{"type": "function", "function": {"name", "arguments"}}`
/// with the arguments as a JSON value, not OpenAI's string, because templates write them
/// with `tool_call.arguments | tojson`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MessageToolCall {
    /// Mistral's template checks it; the others ignore it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type")]
    pub kind: String,
    pub function: MessageFunctionCall,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MessageFunctionCall {
    pub name: String,
    pub arguments: serde_json::Value,
}

const TEMPLATE_NAME: &str = "chat_template";

/// A chat template compiled once, rendered per request.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// How the template teaches the model to call tools, when it names a known format.
    tool_call_format: Option<ToolCallFormat>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

/// Template instructions one render may run: hundreds of times what a real template
/// needs for a long conversation with tools, and a second or two of work at most.
const TEMPLATE_FUEL: u64 = 5_000_000;

/// The longest rendered conversation: far past any context (a million tokens of text
/// take a few MB), short enough that a template writing without end fails before it
/// exhausts memory.
const MAX_RENDERED_BYTES: usize = 64 << 20;

/// The render's output, refusing to grow past [`MAX_RENDERED_BYTES`].
#[derive(Default)]
struct BoundedOutput {
    text: Vec<u8>,
    overflowed: bool,
}

impl std::io::Write for BoundedOutput {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if self.text.len() + data.len() > MAX_RENDERED_BYTES {
            self.overflowed = true;
            return Err(std::io::Error::other(
                "the rendered conversation is too long",
            ));
        }
        self.text.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl ChatTemplate {
    pub fn new(
        source: &str,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
    ) -> Result<Self, ChatTemplateError> {
        let compile_error = |e: Error| ChatTemplateError::Compile {
            message: e.to_string(),
        };
        let mut env = Environment::new();
        // transformers compiles with trim_blocks and lstrip_blocks and Jinja's default of
        // dropping one trailing newline of the source.
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .map_err(compile_error)?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        // A template comes with a downloaded model: one that loops without end (nested
        // ranges, say) must fail, not hold the process.
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        // Unset special tokens stay undefined, as in transformers' special_tokens_map.
        if let Some(bos) = bos_token {
            env.add_global("bos_token", bos);
        }
        if let Some(eos) = eos_token {
            env.add_global("eos_token", eos);
        }
        env.add_template_owned(TEMPLATE_NAME, neutralize_generation_tags(source))
            .map_err(compile_error)?;
        Ok(Self {
            env,
            tool_call_format: ToolCallFormat::detect(source),
        })
    }

    /// Whether the template reads the `tools` variable at all; one that does not would
    /// drop a request's tools without a word.
    pub fn supports_tools(&self) -> bool {
        self.env
            .get_template(TEMPLATE_NAME)
            .is_ok_and(|t| t.undeclared_variables(false).contains("tools"))
    }

    /// The format in which the template asks for tool calls (see [`ToolCallFormat`]).
    pub fn tool_call_format(&self) -> Option<ToolCallFormat> {
        self.tool_call_format
    }

    /// Renders a conversation. `extra` are further template variables (`tools`,
    /// `enable_thinking`, `date_string`, ...); they may override `bos_token`/`eos_token`
    /// but not `messages` or `add_generation_prompt`.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, ChatTemplateError> {
        let mut context: BTreeMap<String, Value> = extra
            .iter()
            .map(|(key, value)| (key.clone(), Value::from(Serde(value))))
            .collect();
        context.insert("messages".into(), Value::from(Serde(messages)));
        context.insert(
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        );
        let template =
            self.env
                .get_template(TEMPLATE_NAME)
                .map_err(|e| ChatTemplateError::Render {
                    message: e.to_string(),
                })?;
        let mut out = BoundedOutput::default();
        let rendered = template.render_captured_to(Value::from(context), &mut out);
        if let Err(e) = rendered {
            return Err(match raised_message(&e) {
                Some(message) => ChatTemplateError::Raised { message },
                None if out.overflowed => ChatTemplateError::Render {
                    message: format!(
                        "it wrote more than {} MiB, far more than any prompt (a loop without end?); fix the template or pass --no-chat-template",
                        MAX_RENDERED_BYTES >> 20
                    ),
                },
                None if e.kind() == ErrorKind::OutOfFuel => ChatTemplateError::Render {
                    message: format!(
                        "it ran more than {TEMPLATE_FUEL} steps without finishing (a loop without end?); fix the template or pass --no-chat-template"
                    ),
                },
                None => ChatTemplateError::Render {
                    message: e.to_string(),
                },
            });
        }
        String::from_utf8(out.text).map_err(|e| ChatTemplateError::Render {
            message: format!("it wrote text that is not UTF-8 ({e})"),
        })
    }
}

/// The error `raise_exception` attaches so that render errors can tell it apart.
#[derive(Debug)]
struct TemplateRaised(String);

impl std::fmt::Display for TemplateRaised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TemplateRaised {}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message.clone())
        .with_source(TemplateRaised(message)))
}

fn raised_message(error: &Error) -> Option<String> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(current) = source {
        if let Some(raised) = current.downcast_ref::<TemplateRaised>() {
            return Some(raised.0.clone());
        }
        source = current.source();
    }
    None
}

/// transformers' AssistantTracker adds `{% generation %}…{% endgeneration %}`, which only
/// marks assistant text for training masks; rendering it is a no-op. minijinja has no such
/// tag, so it becomes an always-true `if` that keeps the tags' whitespace control.
fn neutralize_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let mut inner_start = 2;
        if tag[inner_start..].starts_with(['-', '+']) {
            inner_start += 1;
        }
        let body = &tag[inner_start..];
        let trimmed = body.trim_start();
        let word_at = inner_start + (body.len() - trimmed.len());
        let replacement = [("endgeneration", "endif"), ("generation", "if true")]
            .into_iter()
            .find(|(word, _)| {
                trimmed.starts_with(word)
                    && trimmed[word.len()..]
                        .trim_start()
                        .trim_start_matches(['-', '+'])
                        .starts_with("%}")
            });
        match replacement {
            Some((word, with)) => {
                out.push_str(&tag[..word_at]);
                out.push_str(with);
                rest = &tag[word_at + word.len()..];
            }
            None => {
                out.push_str("{%");
                rest = &tag[2..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// transformers' `strftime_now(format)`: the current time through C's `strftime`, which
/// templates use for "today's date" lines; here in UTC.
fn strftime_now(format: &str) -> String {
    format_time(format, &Timestamp::now().to_zoned(TimeZone::UTC))
}

/// `format` as C's `strftime` would write `time`, through jiff's strtime (which follows
/// C's directives). jiff rejects a whole format over one directive it does not know;
/// glibc copies such a directive through as written, so only then is the format
/// written a directive at a time, the unknown ones verbatim.
fn format_time(format: &str, time: &Zoned) -> String {
    if let Ok(text) = strtime::format(format, time) {
        return text;
    }
    let mut out = String::with_capacity(format.len());
    let mut rest = format;
    while let Some(start) = rest.find('%') {
        out.push_str(&rest[..start]);
        let directive = directive_at(&rest[start..]);
        match strtime::format(directive, time) {
            Ok(text) => out.push_str(&text),
            Err(_) => out.push_str(directive),
        }
        rest = &rest[start + directive.len()..];
    }
    out.push_str(rest);
    out
}

/// The directive `s` starts with: `%`, flags and width (`%-d`, `%_5H`, `%:z`), and the
/// conversion character (absent at the end of the format).
fn directive_at(s: &str) -> &str {
    let body = &s[1..];
    let modifiers = body
        .find(|c: char| !(c.is_ascii_digit() || matches!(c, '-' | '_' | '^' | '#' | ':' | '.')))
        .unwrap_or(body.len());
    let conversion = body[modifiers..].chars().next().map_or(0, char::len_utf8);
    &s[..1 + modifiers + conversion]
}

/// transformers replaces Jinja's `tojson` with `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`; tool schemas reach the model in exactly that form,
/// so this follows Python's output (spacing, no HTML escaping, float repr) and argument order.
fn tojson(
    value: &Value,
    ensure_ascii: Option<Value>,
    indent: Option<Value>,
    kwargs: Kwargs,
) -> Result<Value, Error> {
    let ensure_ascii = match ensure_ascii {
        Some(v) => v.is_true(),
        None => kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
    };
    let indent = match indent {
        Some(v) => Some(v),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_string()),
            None => {
                let n = i64::try_from(v).map_err(|_| {
                    Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: indent must be int or str",
                    )
                })?;
                Some(" ".repeat(usize::try_from(n).unwrap_or(0)))
            }
        },
    };
    let separators = match kwargs.get::<Option<Value>>("separators")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => {
            let parts: Vec<String> = v
                .try_iter()?
                .map(|part| part.as_str().map(str::to_string))
                .collect::<Option<_>>()
                .unwrap_or_default();
            match <[String; 2]>::try_from(parts) {
                Ok([item, key]) => Some((item, key)),
                Err(_) => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be two strings",
                    ))
                }
            }
        }
    };
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    kwargs.assert_all_used()?;

    let (item_separator, key_separator) = separators.unwrap_or_else(|| {
        let item = if indent.is_some() { "," } else { ", " };
        (item.to_string(), ": ".to_string())
    });
    let not_serializable = |e: serde_json::Error| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: not JSON serializable: {e}"),
        )
    };
    // Through serde_json's own value (keys in the template's order, as Python's dicts
    // keep them) so that sort_keys can order every level. Two cases differ from Python:
    // serde_json writes NaN and infinities as null where Python writes NaN/Infinity
    // (neither is JSON), and a None key is an error where Python writes "null".
    let mut json = serde_json::to_value(value).map_err(not_serializable)?;
    if sort_keys {
        json.sort_all_objects();
    }
    let formatter = PythonJson {
        ensure_ascii,
        indent,
        item_separator,
        key_separator,
        depth: 0,
        has_items: false,
    };
    let mut out = Vec::new();
    json.serialize(&mut serde_json::Serializer::with_formatter(
        &mut out, formatter,
    ))
    .map_err(not_serializable)?;
    // serde_json writes valid UTF-8; the formatter's escapes are ASCII.
    let text = String::from_utf8(out)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    Ok(Value::from(text))
}

/// `json.dumps`' layout as a serde_json formatter: its separators, newlines and
/// indentation only with an indent (empty containers stay `[]` and `{}`), `repr` floats,
/// and with `ensure_ascii` every character outside printable ASCII as `\uXXXX` (UTF-16).
/// serde_json does the rest: the escapes both write alike (`\"`, `\\`, `\n`, `\u001f`).
struct PythonJson {
    ensure_ascii: bool,
    indent: Option<String>,
    item_separator: String,
    key_separator: String,
    /// Containers open around the next item.
    depth: usize,
    /// Whether the innermost open container has an item yet.
    has_items: bool,
}

impl PythonJson {
    fn open<W: ?Sized + io::Write>(&mut self, writer: &mut W, bracket: &[u8]) -> io::Result<()> {
        self.depth += 1;
        self.has_items = false;
        writer.write_all(bracket)
    }

    fn close<W: ?Sized + io::Write>(&mut self, writer: &mut W, bracket: &[u8]) -> io::Result<()> {
        self.depth -= 1;
        if self.has_items {
            self.new_line(writer)?;
        }
        writer.write_all(bracket)
    }

    fn item<W: ?Sized + io::Write>(&mut self, writer: &mut W, first: bool) -> io::Result<()> {
        if !first {
            writer.write_all(self.item_separator.as_bytes())?;
        }
        self.new_line(writer)
    }

    fn new_line<W: ?Sized + io::Write>(&self, writer: &mut W) -> io::Result<()> {
        if let Some(indent) = &self.indent {
            writer.write_all(b"\n")?;
            for _ in 0..self.depth {
                writer.write_all(indent.as_bytes())?;
            }
        }
        Ok(())
    }
}

impl Formatter for PythonJson {
    fn write_f64<W: ?Sized + io::Write>(&mut self, writer: &mut W, value: f64) -> io::Result<()> {
        writer.write_all(python_float_repr(value).as_bytes())
    }

    fn write_string_fragment<W: ?Sized + io::Write>(
        &mut self,
        writer: &mut W,
        fragment: &str,
    ) -> io::Result<()> {
        if !self.ensure_ascii {
            return writer.write_all(fragment.as_bytes());
        }
        for c in fragment.chars() {
            if (' '..='~').contains(&c) {
                writer.write_all(&[c as u8])?;
            } else {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    write!(writer, "\\u{unit:04x}")?;
                }
            }
        }
        Ok(())
    }

    fn begin_array<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.open(writer, b"[")
    }

    fn end_array<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.close(writer, b"]")
    }

    fn begin_array_value<W: ?Sized + io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> io::Result<()> {
        self.item(writer, first)
    }

    fn end_array_value<W: ?Sized + io::Write>(&mut self, _writer: &mut W) -> io::Result<()> {
        self.has_items = true;
        Ok(())
    }

    fn begin_object<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.open(writer, b"{")
    }

    fn end_object<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.close(writer, b"}")
    }

    fn begin_object_key<W: ?Sized + io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> io::Result<()> {
        self.item(writer, first)
    }

    fn begin_object_value<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        writer.write_all(self.key_separator.as_bytes())
    }

    fn end_object_value<W: ?Sized + io::Write>(&mut self, _writer: &mut W) -> io::Result<()> {
        self.has_items = true;
        Ok(())
    }
}

/// Python's `repr(float)`: shortest round-trip digits, scientific notation outside
/// 1e-4 <= |x| < 1e16, always a decimal point or exponent, `NaN`/`Infinity` as json.dumps.
fn python_float_repr(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let sign = if x.is_sign_negative() { "-" } else { "" };
    // Rust's `{:e}` already gives the shortest digits that round-trip, like Python's repr.
    let scientific = format!("{:e}", x.abs());
    let (mantissa, exponent) = scientific.split_once('e').unwrap_or((&scientific, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if x == 0.0 {
        return format!("{sign}0.0");
    }
    if !(-4..16).contains(&exponent) {
        let (first, rest) = digits.split_at(1);
        let fraction = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let exp_sign = if exponent < 0 { '-' } else { '+' };
        return format!("{sign}{first}{fraction}e{exp_sign}{:02}", exponent.abs());
    }
    if exponent < 0 {
        let zeros = "0".repeat((-exponent - 1) as usize);
        return format!("{sign}0.{zeros}{digits}");
    }
    let point = exponent as usize + 1;
    if digits.len() <= point {
        format!("{sign}{digits}{}.0", "0".repeat(point - digits.len()))
    } else {
        format!("{sign}{}.{}", &digits[..point], &digits[point..])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn messages(pairs: &[(&str, &str)]) -> Vec<ChatMessage> {
        pairs
            .iter()
            .map(|(role, content)| ChatMessage::new(*role, *content))
            .collect()
    }

    fn extra(value: serde_json::Value) -> serde_json::Map<String, serde_json::Value> {
        match value {
            serde_json::Value::Object(map) => map,
            _ => panic!("extra must be an object"),
        }
    }

    fn no_extra() -> serde_json::Map<String, serde_json::Value> {
        serde_json::Map::new()
    }

    /// A template that would loop for hours runs out of its steps and says so, and a
    /// long conversation through a real template stays far inside them.
    #[test]
    fn a_template_that_never_ends_is_stopped() {
        let endless = ChatTemplate::new(
            "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
            None,
            None,
        )
        .unwrap();
        let err = endless
            .render(&messages(&[("user", "hi")]), true, &no_extra())
            .unwrap_err();
        assert!(err.to_string().contains("loop without end"), "{err}");
        // Within its steps, one that writes 100 kB a step would write 100 GB: refused
        // once it passes the bound, before it takes the memory.
        let flood = ChatTemplate::new(
            "{% set big = 'x' * 100000 %}{% for i in range(1000) %}{% for j in range(1000) %}{{ big }}{% endfor %}{% endfor %}",
            None,
            None,
        )
        .unwrap();
        let err = flood
            .render(&messages(&[("user", "hi")]), true, &no_extra())
            .unwrap_err();
        assert!(err.to_string().contains("more than 64 MiB"), "{err}");
        let long: Vec<(&str, &str)> = (0..2000)
            .map(|i| match i % 2 {
                0 => ("user", "a question of a few words"),
                _ => ("assistant", "an answer of a few words"),
            })
            .collect();
        let qwen = ChatTemplate::new(QWEN25, None, Some("<|im_end|>")).unwrap();
        let text = qwen.render(&messages(&long), true, &no_extra()).unwrap();
        assert!(text.matches("<|im_start|>").count() > 2000);
    }

    /// Qwen2.5-Instruct's template as published on the hub.
    const QWEN25: &str = r##"{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"##;

    #[test]
    fn qwen25_default_system_prompt() {
        let template = ChatTemplate::new(QWEN25, None, Some("<|im_end|>")).unwrap();
        let rendered = template
            .render(&messages(&[("user", "Hello")]), true, &no_extra())
            .unwrap();
        assert_eq!(
            rendered,
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful \
             assistant.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn qwen25_own_system_prompt_and_history() {
        let template = ChatTemplate::new(QWEN25, None, Some("<|im_end|>")).unwrap();
        let conversation = messages(&[
            ("system", "You are a pirate."),
            ("user", "Hi"),
            ("assistant", "Arr."),
            ("user", "Bye"),
        ]);
        let rendered = template.render(&conversation, false, &no_extra()).unwrap();
        assert_eq!(
            rendered,
            "<|im_start|>system\nYou are a pirate.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\nArr.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
        );
    }

    #[test]
    fn qwen25_tools_render_as_python_json() {
        let template = ChatTemplate::new(QWEN25, None, None).unwrap();
        // Key order differs from sorted order on purpose: Python keeps insertion order.
        let tools = extra(json!({"tools": [{
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather for a city, in 'C' or <F>",
                "parameters": {"type": "object",
                               "properties": {"city": {"type": "string"}},
                               "required": ["city"]}
            }
        }]}));
        let rendered = template
            .render(&messages(&[("user", "Weather in Paris?")]), true, &tools)
            .unwrap();
        let expected = concat!(
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
            "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n",
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n",
            r#"{"type": "function", "function": {"name": "get_weather", "#,
            r#""description": "Weather for a city, in 'C' or <F>", "#,
            r#""parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "#,
            r#""required": ["city"]}}}"#,
            "\n</tools>\n\nFor each function call, return a json object with function name and ",
            "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n",
            r#"{"name": <function-name>, "arguments": <args-json-object>}"#,
            "\n</tool_call><|im_end|>\n",
            "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(rendered, expected);
    }

    /// Llama 3 Instruct's template (single line on the hub).
    const LLAMA3: &str = "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

    #[test]
    fn llama3_bos_and_trim_binds_to_content_only() {
        let template =
            ChatTemplate::new(LLAMA3, Some("<|begin_of_text|>"), Some("<|eot_id|>")).unwrap();
        let conversation = messages(&[("system", "You are helpful."), ("user", "  Hi there \n")]);
        let rendered = template.render(&conversation, true, &no_extra()).unwrap();
        assert_eq!(
            rendered,
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are helpful.\
             <|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\n"
        );
    }

    /// The system-prompt part of Llama 3.1/3.2's template: date logic and `{{-` layout.
    const LLAMA32_SYSTEM: &str = r#"{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"#;

    #[test]
    fn llama32_date_from_extra_and_from_strftime_now() {
        let template = ChatTemplate::new(LLAMA32_SYSTEM, Some("<|begin_of_text|>"), None).unwrap();
        let conversation = messages(&[("system", " Be kind. "), ("user", "Hi")]);
        let rendered = template
            .render(
                &conversation,
                true,
                &extra(json!({"date_string": "01 Jan 2025"})),
            )
            .unwrap();
        assert_eq!(
            rendered,
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n\
             Cutting Knowledge Date: December 2023\nToday Date: 01 Jan 2025\n\n\
             Be kind.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\n"
        );

        let rendered = template.render(&conversation, false, &no_extra()).unwrap();
        let date_line = rendered
            .lines()
            .find_map(|line| line.strip_prefix("Today Date: "))
            .unwrap();
        // Today in UTC as "%d %b %Y" (yesterday if the render straddled midnight).
        assert_eq!(date_line.len(), "01 Jan 2025".len(), "{date_line:?}");
        let shown = jiff::civil::Date::strptime("%d %b %Y", date_line)
            .unwrap_or_else(|e| panic!("{date_line:?}: {e}"));
        let today = Timestamp::now().to_zoned(TimeZone::UTC).date();
        assert!(
            shown == today || today.yesterday().ok() == Some(shown),
            "{shown} is not {today}"
        );
    }

    /// Gemma 3's template: system prompt folded into the first user turn, `model` role.
    const GEMMA3: &str = r#"{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"#;

    #[test]
    fn gemma3_folds_system_into_first_turn() {
        let template = ChatTemplate::new(GEMMA3, Some("<bos>"), Some("<eos>")).unwrap();
        let conversation = messages(&[
            ("system", "You are terse."),
            ("user", "Hello"),
            ("assistant", "Hi."),
            ("user", "Bye\n"),
        ]);
        let rendered = template.render(&conversation, true, &no_extra()).unwrap();
        assert_eq!(
            rendered,
            "<bos><start_of_turn>user\nYou are terse.\n\nHello<end_of_turn>\n\
             <start_of_turn>model\nHi.<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n\
             <start_of_turn>model\n"
        );
    }

    #[test]
    fn raise_exception_becomes_an_error_with_its_message() {
        let template = ChatTemplate::new(GEMMA3, Some("<bos>"), None).unwrap();
        let conversation = messages(&[("user", "a"), ("user", "b")]);
        let err = template
            .render(&conversation, true, &no_extra())
            .unwrap_err();
        match &err {
            ChatTemplateError::Raised { message } => assert_eq!(
                message,
                "Conversation roles must alternate user/assistant/user/assistant/..."
            ),
            other => panic!("expected Raised, got {other:?}"),
        }
        assert!(err.to_string().contains("roles must alternate"));
    }

    /// The parts of Qwen3's template that exercise Python string methods, namespaces,
    /// reversed slices and the `enable_thinking` switch.
    const QWEN3: &str = r#"{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"#;

    #[test]
    fn qwen3_enable_thinking_false_reaches_the_template() {
        let template = ChatTemplate::new(QWEN3, None, Some("<|im_end|>")).unwrap();
        let conversation = messages(&[
            ("system", "Be brief."),
            ("user", "2+2?"),
            ("assistant", "<think>\nadd them\n</think>\n\n4"),
            ("user", "3+3?"),
        ]);
        let history = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n\
                       <|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\n3+3?<|im_end|>\n\
                       <|im_start|>assistant\n";
        let thinking_off = template
            .render(
                &conversation,
                true,
                &extra(json!({"enable_thinking": false})),
            )
            .unwrap();
        assert_eq!(thinking_off, format!("{history}<think>\n\n</think>\n\n"));
        let thinking_on = template
            .render(
                &conversation,
                true,
                &extra(json!({"enable_thinking": true})),
            )
            .unwrap();
        assert_eq!(thinking_on, history);
        let unset = template.render(&conversation, true, &no_extra()).unwrap();
        assert_eq!(unset, history);
    }

    #[test]
    fn qwen3_keeps_reasoning_after_the_last_query() {
        let template = ChatTemplate::new(QWEN3, None, None).unwrap();
        let conversation = messages(&[
            ("user", "Hi"),
            ("assistant", "<think>\nhmm\n</think>\n\nHello!"),
        ]);
        let rendered = template.render(&conversation, false, &no_extra()).unwrap();
        assert_eq!(
            rendered,
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\n\
             Hello!<|im_end|>\n"
        );
    }

    #[test]
    fn whitespace_rules_match_transformers() {
        // trim_blocks eats the newline after a block tag, lstrip_blocks the indentation
        // before it; the final newline of the source is dropped.
        let source = "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}\n";
        let template = ChatTemplate::new(source, None, None).unwrap();
        let rendered = template
            .render(
                &messages(&[("user", "a"), ("assistant", "b"), ("user", "c")]),
                false,
                &no_extra(),
            )
            .unwrap();
        assert_eq!(rendered, "[a]\n[c]\n");
    }

    #[test]
    fn special_tokens_python_printing_and_generation_tags() {
        let source = "{{ bos_token }}|{{ eos_token }}|{{ flag }}|{{ nothing }}|{% generation %}{{ messages[0].content }}{% endgeneration %}|{%- generation -%} x {%- endgeneration %}";
        let template = ChatTemplate::new(source, Some("<s>"), None).unwrap();
        let rendered = template
            .render(
                &messages(&[("user", "u")]),
                false,
                &extra(json!({"flag": true, "nothing": null})),
            )
            .unwrap();
        assert_eq!(rendered, "<s>||True|None|u|x");
        let overridden = template
            .render(
                &messages(&[("user", "u")]),
                false,
                &extra(json!({"bos_token": "<B>", "flag": false})),
            )
            .unwrap();
        assert!(overridden.starts_with("<B>||False|"), "{overridden}");
    }

    #[test]
    fn tojson_follows_python_json_dumps() {
        let template = ChatTemplate::new(
            "{{ v | tojson }}\n{{ v | tojson(indent=2) }}\n{{ v | tojson(separators=(',', ':'), sort_keys=true) }}\n{{ s | tojson }}|{{ s | tojson(ensure_ascii=true) }}",
            None,
            None,
        )
        .unwrap();
        let vars = extra(json!({
            "v": {"b": [1, 2.5, 1e20, 0.0001, 3.0], "a": {}, "c": [], "d": null, "e": true},
            "s": "é\"\n😀"
        }));
        let rendered = template.render(&[], false, &vars).unwrap();
        let expected = [
            r#"{"b": [1, 2.5, 1e+20, 0.0001, 3.0], "a": {}, "c": [], "d": null, "e": true}"#,
            "{\n  \"b\": [\n    1,\n    2.5,\n    1e+20,\n    0.0001,\n    3.0\n  ],\n  \"a\": {},\n  \"c\": [],\n  \"d\": null,\n  \"e\": true\n}",
            r#"{"a":{},"b":[1,2.5,1e+20,0.0001,3.0],"c":[],"d":null,"e":true}"#,
            r#""é\"\n😀"|"\u00e9\"\n\ud83d\ude00""#,
        ]
        .join("\n");
        assert_eq!(rendered, expected);
    }

    #[test]
    fn tojson_nests_sorts_every_level_and_escapes_as_python() {
        let template = ChatTemplate::new(
            "{{ v | tojson(indent='\t', sort_keys=true) }}\n{{ v | tojson }}\n{{ s | tojson }}|{{ s | tojson(ensure_ascii=true) }}\n{{ {1: 'one', true: [[], {}]} | tojson }}",
            None,
            None,
        )
        .unwrap();
        let vars = extra(json!({
            "v": {"z": [{"y": 1, "x": [2, {}]}], "a": {"d": [], "c": -0.5}},
            "s": "tab\tbell\u{7}del\u{7f}nbsp\u{a0}"
        }));
        let rendered = template.render(&[], false, &vars).unwrap();
        let expected = [
            "{\n\t\"a\": {\n\t\t\"c\": -0.5,\n\t\t\"d\": []\n\t},\n\t\"z\": [\n\t\t{\n\t\t\t\"x\": [\n\t\t\t\t2,\n\t\t\t\t{}\n\t\t\t],\n\t\t\t\"y\": 1\n\t\t}\n\t]\n}",
            r#"{"z": [{"y": 1, "x": [2, {}]}], "a": {"d": [], "c": -0.5}}"#,
            // Python escapes DEL only under ensure_ascii (it is ASCII but not printable).
            "\"tab\\tbell\\u0007del\u{7f}nbsp\u{a0}\"|\"tab\\tbell\\u0007del\\u007fnbsp\\u00a0\"",
            // Python writes int and bool keys as JSON strings.
            r#"{"1": "one", "true": [[], {}]}"#,
        ]
        .join("\n");
        assert_eq!(rendered, expected);
    }

    #[test]
    fn tojson_rejects_what_is_not_json_serializable() {
        let template = ChatTemplate::new("{{ {none: 1} | tojson }}", None, None).unwrap();
        let err = template.render(&[], false, &no_extra()).unwrap_err();
        assert!(matches!(err, ChatTemplateError::Render { .. }), "{err}");
        assert!(err.to_string().contains("tojson"), "{err}");
    }

    #[test]
    fn python_float_reprs() {
        let cases = [
            (1.0, "1.0"),
            (-0.0, "-0.0"),
            (0.1, "0.1"),
            (123.456, "123.456"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (9999999999999998.0, "9999999999999998.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (-2.5e-7, "-2.5e-07"),
            (1e300, "1e+300"),
            (f64::NAN, "NaN"),
            (f64::NEG_INFINITY, "-Infinity"),
        ];
        for (x, expected) in cases {
            assert_eq!(python_float_repr(x), expected, "{x}");
        }
    }

    fn utc(seconds: i64) -> Zoned {
        Timestamp::from_second(seconds)
            .expect("in range")
            .to_zoned(TimeZone::UTC)
    }

    #[test]
    fn strftime_as_c_writes_it_in_utc() {
        // 2024-02-29T13:05:09Z, a Thursday in a leap year.
        let leap_day = utc(1_709_211_909);
        assert_eq!(
            format_time(
                "%Y-%m-%d %H:%M:%S %a %A %b %B %j %y %I%p %e %% %h %Z %z",
                &leap_day
            ),
            "2024-02-29 13:05:09 Thu Thursday Feb February 060 24 01PM 29 % Feb UTC +0000"
        );
        assert_eq!(format_time("%d %b %Y", &utc(0)), "01 Jan 1970");
        // Padding flags as glibc takes them.
        assert_eq!(format_time("%e|%-d|%-m|%_H", &utc(0)), " 1|1|1| 0");
        // 2000-12-31T23:59:59Z: day 366 of a leap century year.
        assert_eq!(
            format_time("%F %T %j %A", &utc(978_307_199)),
            "2000-12-31 23:59:59 366 Sunday"
        );
    }

    #[test]
    fn strftime_copies_unknown_directives_through_as_glibc_does() {
        let leap_day = utc(1_709_211_909);
        assert_eq!(
            format_time("%K on %d %b, %-K %! %Y 100%", &leap_day),
            "%K on 29 Feb, %-K %! 2024 100%"
        );
        assert_eq!(format_time("%", &leap_day), "%");
        assert_eq!(format_time("no directives", &leap_day), "no directives");
    }

    /// A Hermes-style template written for these tests: tool schemas in the system turn,
    /// assistant calls in `<tool_call>` blocks, tool results in a `tool` turn.
    const HERMES_STYLE: &str = r#"{%- if tools %}
<|im_start|>system
Tools:
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
Call one inside <tool_call></tool_call>.<|im_end|>
{% endif %}
{%- for message in messages %}
<|im_start|>{{ message.role }}
{% if message.tool_calls is defined %}
{% for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{% endfor %}
{% elif message.role == 'tool' %}
[{{ message.tool_call_id }} {{ message.name }}] {{ message.content }}
{% else %}
{{ message.content }}
{% endif %}
<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"#;

    #[test]
    fn tools_and_tool_turns_reach_a_hermes_style_template() {
        let template = ChatTemplate::new(HERMES_STYLE, None, None).unwrap();
        assert!(template.supports_tools());
        assert_eq!(template.tool_call_format(), Some(ToolCallFormat::Hermes));
        let call = MessageToolCall {
            id: Some("call_1".into()),
            kind: "function".into(),
            function: MessageFunctionCall {
                name: "get_weather".into(),
                arguments: json!({"city": "Paris", "days": 2}),
            },
        };
        let conversation = vec![
            ChatMessage::new("user", "Weather in Paris?"),
            ChatMessage {
                tool_calls: Some(vec![call]),
                ..ChatMessage::new("assistant", "")
            },
            ChatMessage {
                tool_call_id: Some("call_1".into()),
                name: Some("get_weather".into()),
                ..ChatMessage::new("tool", "{\"sky\": \"clear\"}")
            },
        ];
        let tools = extra(json!({"tools": [{"type": "function", "function": {
            "name": "get_weather", "parameters": {"type": "object"}}}]}));
        let rendered = template.render(&conversation, true, &tools).unwrap();
        assert_eq!(
            rendered,
            concat!(
                "<|im_start|>system\nTools:\n",
                r#"{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}"#,
                "\nCall one inside <tool_call></tool_call>.<|im_end|>\n",
                "<|im_start|>user\nWeather in Paris?\n<|im_end|>\n",
                "<|im_start|>assistant\n<tool_call>\n",
                r#"{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}"#,
                "\n</tool_call>\n<|im_end|>\n",
                "<|im_start|>tool\n[call_1 get_weather] {\"sky\": \"clear\"}\n<|im_end|>\n",
                "<|im_start|>assistant\n"
            )
        );
        // Without tools and tool fields, none of it shows: they are undefined, not empty.
        let plain = template
            .render(&messages(&[("user", "Hi")]), false, &no_extra())
            .unwrap();
        assert_eq!(plain, "<|im_start|>user\nHi\n<|im_end|>\n");
    }

    #[test]
    fn templates_that_never_read_tools_are_told_apart() {
        let chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}";
        let template = ChatTemplate::new(chatml, None, None).unwrap();
        assert!(!template.supports_tools());
        assert_eq!(template.tool_call_format(), None);
        // Reading `tools` anywhere counts, even in a test or a loop inside a block.
        for source in [
            "{% if tools is defined %}x{% endif %}",
            "{% for m in messages %}{% for t in tools %}{{ t }}{% endfor %}{% endfor %}",
        ] {
            let template = ChatTemplate::new(source, None, None).unwrap();
            assert!(template.supports_tools(), "{source}");
        }
    }

    #[test]
    fn compile_and_render_errors() {
        let err = ChatTemplate::new("{% if %}", None, None).unwrap_err();
        assert!(matches!(err, ChatTemplateError::Compile { .. }), "{err}");
        let template = ChatTemplate::new("{{ messages[0].content.nope() }}", None, None).unwrap();
        let err = template
            .render(&messages(&[("user", "x")]), false, &no_extra())
            .unwrap_err();
        assert!(matches!(err, ChatTemplateError::Render { .. }), "{err}");
    }
}
