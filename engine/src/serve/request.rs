//! The request bodies of `/v1/chat/completions` and `/v1/completions`, parsed with the
//! failing field named, and checked into a [`JobRequest`] before anything is queued.

use serde::Deserialize;
use serde_json::Value;

use crate::decoding::logprobs::MAX_TOP_LOGPROBS;
use crate::decoding::sampling::SamplingParams;
use crate::serve::error::ApiError;
use crate::text::chat_template::{ChatMessage, MessageFunctionCall, MessageToolCall};

/// What the worker is asked to generate from.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Rendered through the model's chat template.
    Chat(Vec<ChatMessage>),
    /// Tokenized as it is.
    Text(String),
    /// Token ids, as the completions API also takes a prompt.
    Tokens(Vec<u32>),
}

impl Prompt {
    /// The request field the prompt came in.
    pub fn param(&self) -> &'static str {
        match self {
            Prompt::Chat(_) => "messages",
            Prompt::Text(_) | Prompt::Tokens(_) => "prompt",
        }
    }
}

/// A checked request: everything the worker needs, nothing it must validate again
/// except what only the tokenizer knows (the prompt's length in tokens).
#[derive(Debug, Clone)]
pub struct JobRequest {
    pub prompt: Prompt,
    /// `None`: the server's default, cut to the context left after the prompt.
    pub max_tokens: Option<usize>,
    /// The field `max_tokens` came in (`max_tokens` or `max_completion_tokens`).
    pub max_tokens_param: &'static str,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub stream: bool,
    /// Report each token's log-probability and this many likeliest alternatives.
    pub logprobs: Option<usize>,
    /// `tools` as the client wrote them (checked): the chat template's `tools`.
    pub tools: Vec<Value>,
    /// Whether tool calls are parsed out of the output (`tool_choice` "auto").
    pub parse_tool_calls: bool,
}

/// `stop`: one string or a list of them.
#[derive(Debug, Deserialize)]
#[serde(untagged, expecting = "a string or a list of strings")]
enum StopField {
    One(String),
    Many(Vec<String>),
}

/// A message's `content`: text, or a list of parts of which dspec reads the text ones.
#[derive(Debug, Deserialize)]
#[serde(
    untagged,
    expecting = "a string, or a list of parts such as {\"type\": \"text\", \"text\": \"...\"}"
)]
enum ContentField {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
#[serde(expecting = "a content part such as {\"type\": \"text\", \"text\": \"...\"}")]
struct ContentPart {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(expecting = "a message such as {\"role\": \"user\", \"content\": \"...\"}")]
struct RequestMessage {
    role: String,
    /// Absent or null for an assistant turn that only called tools.
    content: Option<ContentField>,
    tool_calls: Option<Vec<RequestToolCall>>,
    tool_call_id: Option<String>,
    name: Option<String>,
}

/// An assistant turn's call, as OpenAI writes it.
#[derive(Debug, Deserialize)]
#[serde(
    expecting = "a tool call such as {\"id\", \"type\": \"function\", \"function\": {\"name\", \"arguments\"}}"
)]
struct RequestToolCall {
    id: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
    function: RequestFunctionCall,
}

#[derive(Debug, Deserialize)]
#[serde(expecting = "a function call such as {\"name\", \"arguments\"}")]
struct RequestFunctionCall {
    name: String,
    /// OpenAI's JSON text; an object is taken too.
    arguments: Option<Value>,
}

/// Both endpoints' bodies (`messages` for chat, `prompt` for completions), in one
/// struct so that a bad field's path is exact. Unknown fields are ignored, as
/// OpenAI-compatible servers do, so clients that send extras (`user`,
/// `stream_options`) still work.
#[derive(Debug, Default, Deserialize)]
#[serde(expecting = "a JSON object with the request's fields")]
struct Body {
    messages: Option<Vec<RequestMessage>>,
    prompt: Option<PromptField>,
    model: Option<String>,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    /// Not in OpenAI's API; llama.cpp's and vLLM's servers take them too.
    top_k: Option<u64>,
    min_p: Option<f64>,
    seed: Option<u64>,
    stop: Option<StopField>,
    n: Option<u64>,
    stream: Option<bool>,
    /// Chat: a boolean, with `top_logprobs` alternatives; completions: the number of
    /// alternatives (see [`logprobs_asked`]).
    logprobs: Option<Value>,
    top_logprobs: Option<Value>,
    /// Checked by [`checked_tools`].
    tools: Option<Value>,
    tool_choice: Option<Value>,
    /// Refused: see [`refuse_unsupported`].
    functions: Option<Value>,
    function_call: Option<Value>,
    echo: Option<bool>,
    suffix: Option<Value>,
    best_of: Option<u64>,
}

/// `prompt`: a string, a list holding one string, or token ids (a list of them, or a
/// list holding one such list), as OpenAI's completions API takes them.
#[derive(Debug, Deserialize)]
#[serde(
    untagged,
    expecting = "a string, a list holding one string, or a list of token ids"
)]
enum PromptField {
    One(String),
    Many(Vec<String>),
    Tokens(Vec<u32>),
    ManyTokens(Vec<Vec<u32>>),
}

/// The roles a conversation's messages may have: what chat templates are written for.
/// `developer` (OpenAI's newer name for instructions) is taken as `system`.
pub const ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];

/// What the checks need to know of the served model.
pub struct ServedModel<'a> {
    pub id: &'a str,
    /// The target's context in tokens, when it has a limit.
    pub max_context: Option<usize>,
}

/// Parses JSON into `T`, naming the field at fault.
fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    // serde would read a list as the body's fields in order, and name `[0]` at fault.
    let opening = body.iter().find(|b| !b.is_ascii_whitespace());
    if opening.is_some_and(|b| *b != b'{')
        && serde_json::from_slice::<serde::de::IgnoredAny>(body).is_ok()
    {
        return Err(ApiError::invalid(
            "body",
            "the request body must be a JSON object of the request's fields, such as {\"messages\": [...]} or {\"prompt\": \"...\"}",
        ));
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_syntax() || inner.is_eof() {
            return ApiError::invalid(
                "body",
                format!("the request body is not valid JSON: {inner}"),
            );
        }
        // serde names the field only for missing ones; the path names the others.
        let param = if path == "." {
            "body".to_string()
        } else {
            path
        };
        let message = in_api_words(&inner.to_string());
        ApiError::invalid(param.clone(), format!("`{param}`: {message}"))
    })
}

/// serde's words for JSON types as a client reads them: "u64" is "a whole number ≥ 0".
fn in_api_words(message: &str) -> String {
    const WORDS: [(&str, &str); 8] = [
        ("expected u64", "expected a whole number of 0 or more"),
        (
            "expected u32",
            "expected a token id (a whole number of 0 or more)",
        ),
        ("expected f64", "expected a number"),
        ("expected a sequence", "expected a list"),
        ("expected a map", "expected an object"),
        ("invalid type: map", "invalid type: object"),
        ("invalid type: sequence", "invalid type: list"),
        ("invalid type: unit value", "invalid type: null"),
    ];
    let mut message = message.to_string();
    for (serde, api) in WORDS {
        message = message.replace(serde, api);
    }
    // The position serde reports is the body's line and column: noise for a field.
    match message.find(" at line ") {
        Some(at) => message[..at].to_string(),
        None => message,
    }
}

/// `POST /v1/chat/completions`'s body.
pub fn chat_request(body: &[u8], served: &ServedModel) -> Result<JobRequest, ApiError> {
    let mut body: Body = parse(body)?;
    let Some(given) = body.messages.take() else {
        return Err(ApiError::invalid(
            "messages",
            "`messages` is missing; give the conversation as a list of {\"role\", \"content\"}",
        ));
    };
    if given.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "`messages` is empty; give at least one message",
        ));
    }
    let mut messages = Vec::with_capacity(given.len());
    for (i, m) in given.into_iter().enumerate() {
        let content = match m.content {
            None => String::new(),
            Some(ContentField::Text(t)) => t,
            Some(ContentField::Parts(parts)) => {
                let mut text = String::new();
                for (j, part) in parts.into_iter().enumerate() {
                    match (part.kind.as_str(), part.text) {
                        ("text", Some(t)) => text.push_str(&t),
                        (kind, _) => {
                            return Err(ApiError::invalid(
                                format!("messages[{i}].content[{j}]"),
                                format!("content parts of type `{kind}` are not supported; send text parts (`{{\"type\": \"text\", \"text\": ...}}`) only"),
                            ))
                        }
                    }
                }
                text
            }
        };
        let tool_calls = match m.tool_calls {
            Some(calls) if !calls.is_empty() => Some(message_tool_calls(i, calls)?),
            // An empty list is no calls: Llama's template would take it for some.
            _ => None,
        };
        let role = match m.role.as_str() {
            "developer" => "system".to_string(),
            role if ROLES.contains(&role) => m.role,
            role => {
                return Err(ApiError::invalid(
                    format!("messages[{i}].role"),
                    format!(
                        "`messages[{i}].role` is `{role}`; a message's role is one of {}",
                        ROLES.join(", ")
                    ),
                ))
            }
        };
        messages.push(ChatMessage {
            tool_calls,
            tool_call_id: m.tool_call_id,
            name: m.name,
            ..ChatMessage::new(role, content)
        });
    }
    job(Prompt::Chat(messages), body, served, false)
}

/// `messages[i].tool_calls` as templates read them, the arguments parsed from their
/// JSON text.
fn message_tool_calls(
    i: usize,
    calls: Vec<RequestToolCall>,
) -> Result<Vec<MessageToolCall>, ApiError> {
    calls
        .into_iter()
        .enumerate()
        .map(|(j, call)| {
            let at = format!("messages[{i}].tool_calls[{j}]");
            if let Some(kind) = call.kind.as_deref().filter(|k| *k != "function") {
                return Err(ApiError::invalid(
                    format!("{at}.type"),
                    format!("`{at}.type` is `{kind}`; only `function` calls exist"),
                ));
            }
            let arguments = match call.function.arguments {
                None | Some(Value::Null) => Value::Object(Default::default()),
                Some(Value::String(text)) => serde_json::from_str(&text).map_err(|e| {
                    ApiError::invalid(
                        format!("{at}.function.arguments"),
                        format!("`{at}.function.arguments` is not valid JSON ({e}); send the arguments object as JSON text"),
                    )
                })?,
                Some(other) => other,
            };
            Ok(MessageToolCall {
                id: call.id,
                kind: "function".into(),
                function: MessageFunctionCall {
                    name: call.function.name,
                    arguments,
                },
            })
        })
        .collect()
}

/// `tools` and `tool_choice`: the checked list of tools and whether calls are parsed
/// back. A tool needs `type` "function" and a named `function`, what both OpenAI and
/// the templates (`tool.function.name`) rely on; the rest goes to the template as given.
fn checked_tools(s: &Body, completions: bool) -> Result<(Vec<Value>, bool), ApiError> {
    let list = match &s.tools {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(list)) => list.clone(),
        Some(_) => {
            return Err(ApiError::invalid(
                "tools",
                "`tools` must be a list of {\"type\": \"function\", \"function\": {\"name\", \"description\", \"parameters\"}}",
            ))
        }
    };
    if completions && !list.is_empty() {
        return Err(ApiError::invalid(
            "tools",
            "`tools` work through the chat template: send them to /v1/chat/completions",
        ));
    }
    let mut names: Vec<&str> = Vec::with_capacity(list.len());
    for (i, tool) in list.iter().enumerate() {
        if tool.get("type").and_then(Value::as_str) != Some("function") {
            return Err(ApiError::invalid(
                format!("tools[{i}].type"),
                format!("`tools[{i}].type` must be \"function\", the only kind of tool"),
            ));
        }
        let Some(function) = tool.get("function").filter(|f| f.is_object()) else {
            return Err(ApiError::invalid(
                format!("tools[{i}].function"),
                format!("`tools[{i}].function` must be an object with `name`, `description` and `parameters`"),
            ));
        };
        let name = match function.get("name").and_then(Value::as_str) {
            Some(name) if !name.is_empty() => name,
            _ => {
                return Err(ApiError::invalid(
                    format!("tools[{i}].function.name"),
                    format!("`tools[{i}].function.name` must be a non-empty string"),
                ))
            }
        };
        if let Some(first) = names.iter().position(|n| *n == name) {
            return Err(ApiError::invalid(
                format!("tools[{i}].function.name"),
                format!("`tools[{i}].function.name` `{name}` is also the name of tools[{first}]; a call could not tell them apart"),
            ));
        }
        names.push(name);
        if function
            .get("parameters")
            .is_some_and(|p| !p.is_null() && !p.is_object())
        {
            return Err(ApiError::invalid(
                format!("tools[{i}].function.parameters"),
                format!("`tools[{i}].function.parameters` must be a JSON Schema object"),
            ));
        }
    }
    // "none" still renders the tools and only leaves the output unparsed: vLLM's default
    // since 0.10, and OpenAI's models too still see the tools they may not call. The
    // prompt then does not depend on the choice. (transformers has no tool_choice; it
    // renders whatever tools it is given.)
    let parse = match &s.tool_choice {
        None | Some(Value::Null) => true,
        Some(Value::String(choice)) if choice == "auto" => true,
        Some(Value::String(choice)) if choice == "none" => false,
        Some(choice) => {
            let asked = match choice {
                Value::String(c) if c == "required" => "\"required\"".to_string(),
                Value::Object(_) => "a named function".to_string(),
                other => {
                    return Err(ApiError::invalid(
                        "tool_choice",
                        format!("`tool_choice` is {other}; give \"auto\" or \"none\""),
                    ))
                }
            };
            return Err(ApiError::invalid(
                "tool_choice",
                format!("`tool_choice` {asked} would need decoding constrained to a call, which dspec does not do; use \"auto\" (the default) and read `finish_reason`, which is \"tool_calls\" when the model called one"),
            )
            .with_code("unsupported_parameter"));
        }
    };
    let any = !list.is_empty();
    Ok((list, parse && any))
}

/// `POST /v1/completions`'s body.
pub fn completion_request(body: &[u8], served: &ServedModel) -> Result<JobRequest, ApiError> {
    let mut body: Body = parse(body)?;
    let prompt = match body.prompt.take() {
        None => {
            return Err(ApiError::invalid(
                "prompt",
                "`prompt` is missing; give the text to continue",
            ))
        }
        Some(PromptField::One(p)) => Prompt::Text(p),
        Some(PromptField::Many(mut list)) if list.len() == 1 => Prompt::Text(list.remove(0)),
        Some(PromptField::Tokens(ids)) => Prompt::Tokens(ids),
        Some(PromptField::ManyTokens(mut list)) if list.len() == 1 => {
            Prompt::Tokens(list.remove(0))
        }
        Some(PromptField::Many(list)) => return Err(one_prompt(list.len())),
        Some(PromptField::ManyTokens(list)) => return Err(one_prompt(list.len())),
    };
    job(prompt, body, served, true)
}

fn one_prompt(given: usize) -> ApiError {
    ApiError::invalid(
        "prompt",
        format!("`prompt` is a list of {given} prompts; dspec serves one prompt per request"),
    )
}

/// Fields that ask for what dspec does not do yet: refused rather than ignored, so a
/// client never takes a missing feature for an empty answer.
fn refuse_unsupported(s: &Body, completions: bool) -> Result<(), ApiError> {
    let non_empty = |v: &Option<Value>| {
        v.as_ref()
            .is_some_and(|v| !v.is_null() && v.as_array().is_none_or(|a| !a.is_empty()))
    };
    // OpenAI's deprecated predecessors of `tools` and `tool_choice`.
    for (param, value, instead) in [
        (
            "functions",
            &s.functions,
            "`tools`, each function as {\"type\": \"function\", \"function\": {...}}",
        ),
        ("function_call", &s.function_call, "`tool_choice`"),
    ] {
        if non_empty(value) {
            return Err(ApiError::invalid(
                param,
                format!("`{param}` is OpenAI's deprecated form of tool calling; send {instead}"),
            )
            .with_code("unsupported_parameter"));
        }
    }
    if completions {
        if s.echo == Some(true) {
            return Err(ApiError::unsupported("echo"));
        }
        if s.suffix.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(ApiError::unsupported("suffix"));
        }
        if s.best_of.is_some_and(|b| b != 1) {
            return Err(ApiError::invalid(
                "best_of",
                "only `best_of` 1 is supported: dspec generates one completion per request",
            ));
        }
    }
    Ok(())
}

/// Most stop strings a request may give: each is checked at every token.
pub const MAX_STOP_STRINGS: usize = 16;

/// Most alternatives per token the legacy completions API allows.
const MAX_COMPLETION_LOGPROBS: u64 = 5;

/// How many alternatives per token a request asks for, when it asks for log-probabilities
/// at all: chat takes `logprobs: true` and `top_logprobs` (0–20), completions an integer
/// `logprobs` (0–5), as OpenAI's API does.
fn logprobs_asked(s: &Body, completions: bool) -> Result<Option<usize>, ApiError> {
    let given = |v: &Option<Value>| v.as_ref().filter(|v| !v.is_null()).cloned();
    let count = |param: &str, v: Value, most: u64| -> Result<usize, ApiError> {
        match v.as_u64() {
            Some(n) if n <= most => Ok(n as usize),
            _ => Err(ApiError::invalid(
                param,
                format!("`{param}` must be an integer from 0 to {most}, got {v}"),
            )),
        }
    };
    if completions {
        return given(&s.logprobs)
            .map(|v| count("logprobs", v, MAX_COMPLETION_LOGPROBS))
            .transpose();
    }
    let asked = match given(&s.logprobs) {
        None => false,
        Some(Value::Bool(b)) => b,
        Some(v) => {
            return Err(ApiError::invalid(
                "logprobs",
                format!("`logprobs` is true or false on /v1/chat/completions, got {v}; the number of alternatives goes in `top_logprobs`"),
            ))
        }
    };
    let top = given(&s.top_logprobs)
        .map(|v| count("top_logprobs", v, MAX_TOP_LOGPROBS as u64))
        .transpose()?;
    match (asked, top) {
        (true, top) => Ok(Some(top.unwrap_or(0))),
        (false, Some(_)) => Err(ApiError::invalid(
            "top_logprobs",
            "`top_logprobs` needs `logprobs: true`",
        )),
        (false, None) => Ok(None),
    }
}

fn job(
    prompt: Prompt,
    s: Body,
    served: &ServedModel,
    completions: bool,
) -> Result<JobRequest, ApiError> {
    if let Some(model) = &s.model {
        if model != served.id {
            return Err(ApiError {
                status: axum::http::StatusCode::NOT_FOUND,
                message: format!(
                    "the model `{model}` is not served here; this server serves `{}` (see GET /v1/models)",
                    served.id
                ),
                param: Some("model".into()),
                code: Some("model_not_found"),
            });
        }
    }
    if s.n.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid(
            "n",
            "only `n` 1 is supported: dspec generates one choice per request",
        ));
    }
    refuse_unsupported(&s, completions)?;
    let logprobs = logprobs_asked(&s, completions)?;
    let (tools, parse_tool_calls) = checked_tools(&s, completions)?;
    let (param, max_tokens) = match (s.max_completion_tokens, s.max_tokens) {
        (Some(m), _) => ("max_completion_tokens", Some(m)),
        (None, m) => ("max_tokens", m),
    };
    if let Some(m) = max_tokens {
        let most = served
            .max_context
            .map_or(u64::MAX, |limit| (limit as u64).saturating_sub(1));
        if m == 0 {
            return Err(ApiError::invalid(
                param,
                format!("`{param}` must be from 1 to {most}, got 0"),
            ));
        }
        if m > most {
            return Err(ApiError::invalid(
                param,
                format!("`{param}` is {m} but the model's context is {} tokens, prompt included; ask for at most {most}", most + 1),
            )
            .with_code("context_length_exceeded"));
        }
    }
    let sampling = SamplingParams {
        temperature: s.temperature.unwrap_or(1.0) as f32,
        top_k: usize::try_from(s.top_k.unwrap_or(0)).unwrap_or(usize::MAX),
        top_p: s.top_p.unwrap_or(1.0) as f32,
        min_p: s.min_p.unwrap_or(0.0) as f32,
        seed: s.seed,
    };
    if let Some(bad) = sampling.out_of_range() {
        // The value as sent: one past f32's range reads as infinity once narrowed.
        let sent = match bad.field {
            "temperature" => s.temperature.map(|v| format!("{v:?}")),
            "top_p" => s.top_p.map(|v| format!("{v:?}")),
            "min_p" => s.min_p.map(|v| format!("{v:?}")),
            "top_k" => s.top_k.map(|v| v.to_string()),
            _ => None,
        };
        return Err(ApiError::invalid(
            bad.field,
            format!(
                "`{}` must be {}, got {}",
                bad.field,
                bad.range,
                sent.unwrap_or(bad.got)
            ),
        ));
    }
    let stop = match s.stop {
        None => Vec::new(),
        Some(StopField::One(s)) => vec![s],
        Some(StopField::Many(list)) => list,
    };
    if stop.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "`stop` holds {} strings; give at most {MAX_STOP_STRINGS}",
                stop.len()
            ),
        ));
    }
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid(
            "stop",
            "`stop` holds an empty string, which would stop before the first token; remove it",
        ));
    }
    Ok(JobRequest {
        prompt,
        max_tokens: max_tokens.map(|m| m as usize),
        max_tokens_param: param,
        sampling,
        stop,
        stream: s.stream.unwrap_or(false),
        logprobs,
        tools,
        parse_tool_calls,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SERVED: ServedModel = ServedModel {
        id: "tiny",
        max_context: Some(256),
    };

    fn chat(body: &str) -> Result<JobRequest, ApiError> {
        chat_request(body.as_bytes(), &SERVED)
    }

    fn refused(body: &str, param: &str) -> ApiError {
        let err = chat(body).expect_err(body);
        assert_eq!(err.param.as_deref(), Some(param), "{body}: {}", err.message);
        err
    }

    #[test]
    fn a_chat_request_becomes_a_job() {
        let job = chat(
            r#"{"model":"tiny","messages":[{"role":"system","content":"be brief"},
            {"role":"user","content":[{"type":"text","text":"hi"},{"type":"text","text":"!"}]}],
            "max_tokens":5,"temperature":0,"stop":"x","seed":3,"stream":true,"user":"ignored"}"#,
        )
        .expect("valid");
        assert_eq!(
            job.prompt,
            Prompt::Chat(vec![
                ChatMessage::new("system", "be brief"),
                ChatMessage::new("user", "hi!")
            ])
        );
        assert_eq!(job.max_tokens, Some(5));
        assert!(job.sampling.is_greedy());
        assert_eq!(job.sampling.seed, Some(3));
        assert_eq!(job.stop, ["x"]);
        assert!(job.stream);
    }

    #[test]
    fn max_completion_tokens_wins_and_completions_take_a_one_prompt_list() {
        let job = chat(r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":9,"max_completion_tokens":4}"#)
            .expect("valid");
        assert_eq!(job.max_tokens, Some(4));
        let job =
            completion_request(br#"{"prompt":["abc"],"stop":["a","b"]}"#, &SERVED).expect("valid");
        assert_eq!(job.prompt, Prompt::Text("abc".into()));
        assert_eq!(job.stop, ["a", "b"]);
        assert!(
            !job.sampling.is_greedy(),
            "OpenAI's default temperature is 1"
        );
    }

    #[test]
    fn bad_fields_are_named() {
        let msgs = r#""messages":[{"role":"user","content":"hi"}]"#;
        refused(&format!("{{{msgs},\"temperature\":-1}}"), "temperature");
        refused(&format!("{{{msgs},\"top_p\":0}}"), "top_p");
        refused(&format!("{{{msgs},\"top_p\":1.5}}"), "top_p");
        refused(&format!("{{{msgs},\"max_tokens\":0}}"), "max_tokens");
        refused(
            &format!("{{{msgs},\"max_completion_tokens\":256}}"),
            "max_completion_tokens",
        );
        refused(&format!("{{{msgs},\"n\":2}}"), "n");
        refused(&format!("{{{msgs},\"stop\":[\"\"]}}"), "stop");
        refused(
            &format!("{{{msgs},\"temperature\":\"hot\"}}"),
            "temperature",
        );
        refused(&format!("{{{msgs},\"logprobs\":3}}"), "logprobs");
        refused(&format!("{{{msgs},\"top_logprobs\":2}}"), "top_logprobs");
        refused(
            &format!("{{{msgs},\"logprobs\":true,\"top_logprobs\":21}}"),
            "top_logprobs",
        );
        refused(r#"{"messages":[]}"#, "messages");
        refused(
            r#"{"messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#,
            "messages[0].content[0]",
        );
        let missing = refused("{}", "messages");
        assert!(missing.message.contains("messages"), "{}", missing.message);
        let err = refused(&format!("{{{msgs},\"model\":\"gpt-4\"}}"), "model");
        assert_eq!(err.status, axum::http::StatusCode::NOT_FOUND);
        assert!(err.message.contains("tiny"), "{}", err.message);
        let err = refused("{not json", "body");
        assert!(err.message.contains("not valid JSON"), "{}", err.message);
        // Asking for nothing unsupported is fine.
        chat(&format!(
            "{{{msgs},\"logprobs\":false,\"tools\":[],\"n\":1}}"
        ))
        .expect("valid");
    }

    /// Each numeric field is refused just outside its range, with the range in the
    /// message, and taken at the range's ends.
    #[test]
    fn numeric_fields_are_refused_outside_their_ranges_with_the_range() {
        let msgs = r#""messages":[{"role":"user","content":"hi"}]"#;
        let with = |field: &str| format!("{{{msgs},{field}}}");
        for (field, param, range) in [
            (r#""temperature":0.0001"#, "temperature", "0.001 to 100"),
            (r#""temperature":101"#, "temperature", "0.001 to 100"),
            (r#""temperature":1e300"#, "temperature", "got 1e300"),
            (r#""top_p":-0.5"#, "top_p", "(0, 1]"),
            (r#""min_p":1"#, "min_p", "[0, 1)"),
            (r#""top_k":1000001"#, "top_k", "to 1000000"),
            (r#""max_tokens":0"#, "max_tokens", "from 1 to 255"),
            (r#""max_tokens":256"#, "max_tokens", "at most 255"),
            (
                r#""top_logprobs":21,"logprobs":true"#,
                "top_logprobs",
                "0 to 20",
            ),
        ] {
            let err = refused(&with(field), param);
            assert!(err.message.contains(range), "{field}: {}", err.message);
        }
        let many_stops: Vec<String> = (0..=MAX_STOP_STRINGS).map(|i| format!("s{i}")).collect();
        let err = refused(
            &with(&format!(r#""stop":{}"#, serde_json::json!(many_stops))),
            "stop",
        );
        assert!(err.message.contains("at most 16"), "{}", err.message);
        for field in [
            r#""temperature":0"#,
            r#""temperature":0.001"#,
            r#""temperature":100"#,
            r#""top_p":1"#,
            r#""min_p":0"#,
            r#""top_k":1000000"#,
            r#""max_tokens":255"#,
            r#""seed":18446744073709551615"#,
        ] {
            chat(&with(field)).unwrap_or_else(|e| panic!("{field}: {}", e.message));
        }
        let err = completion_request(br#"{"prompt":"x","logprobs":6}"#, &SERVED)
            .expect_err("logprobs above 5");
        assert!(err.message.contains("0 to 5"), "{}", err.message);
    }

    /// Errors read in the API's words: JSON types and example shapes, never the Rust
    /// types the body is parsed into.
    #[test]
    fn errors_name_fields_in_the_apis_words() {
        let rust_words = [
            "untagged enum",
            "struct ",
            "PromptField",
            "RequestMessage",
            "ContentField",
            "u64",
            "f64",
            "sequence",
            " map",
            " at line ",
        ];
        let msgs = r#""messages":[{"role":"user","content":"hi"}]"#;
        for (body, param, words) in [
            (
                r#"{"messages":[3]}"#.to_string(),
                "messages[0]",
                "a message such as",
            ),
            (
                r#"{"messages":[{"role":"user","content":7}]}"#.to_string(),
                "messages[0].content",
                "a string, or a list of parts",
            ),
            (
                format!("{{{msgs},\"stop\":5}}"),
                "stop",
                "a string or a list of strings",
            ),
            (
                format!("{{{msgs},\"max_tokens\":\"9\"}}"),
                "max_tokens",
                "a whole number",
            ),
            (
                format!("{{{msgs},\"max_tokens\":-1}}"),
                "max_tokens",
                "a whole number",
            ),
            (
                format!("{{{msgs},\"temperature\":[1]}}"),
                "temperature",
                "expected a number",
            ),
            ("[1, 2]".to_string(), "body", "a JSON object"),
            ("\"hi\"".to_string(), "body", "a JSON object"),
        ] {
            let err = refused(&body, param);
            assert!(err.message.contains(words), "{body}: {}", err.message);
            for rust in rust_words {
                assert!(!err.message.contains(rust), "{body}: {}", err.message);
            }
        }
        let err = completion_request(br#"{"prompt": {"a": 1}}"#, &SERVED).expect_err("object");
        assert_eq!(err.param.as_deref(), Some("prompt"));
        assert!(err.message.contains("list of token ids"), "{}", err.message);
        assert!(!err.message.contains("PromptField"), "{}", err.message);
    }

    /// Roles outside what templates are written for are refused with the list; OpenAI's
    /// `developer` is a system message.
    #[test]
    fn roles_are_the_templates_set() {
        let err = refused(
            r#"{"messages":[{"role":"user","content":"hi"},{"role":"wizard","content":"x"}]}"#,
            "messages[1].role",
        );
        assert!(err.message.contains("wizard"), "{}", err.message);
        assert!(
            err.message.contains("system, user, assistant, tool"),
            "{}",
            err.message
        );
        let job = chat(r#"{"messages":[{"role":"developer","content":"be brief"},{"role":"user","content":"hi"}]}"#)
            .expect("developer is taken");
        let Prompt::Chat(messages) = job.prompt else {
            panic!("a chat prompt")
        };
        assert_eq!(messages[0].role, "system");
    }

    /// Token ids are a completions prompt, as OpenAI's API takes them: a list, or a
    /// list holding one list; several prompts are refused as several strings are.
    #[test]
    fn completions_take_token_id_prompts() {
        let ids = |body: &str| completion_request(body.as_bytes(), &SERVED).map(|j| j.prompt);
        assert_eq!(
            ids(r#"{"prompt":[1,2,3]}"#).unwrap(),
            Prompt::Tokens(vec![1, 2, 3])
        );
        assert_eq!(
            ids(r#"{"prompt":[[4,5]]}"#).unwrap(),
            Prompt::Tokens(vec![4, 5])
        );
        let err = ids(r#"{"prompt":[[4,5],[6]]}"#).unwrap_err();
        assert!(err.message.contains("2 prompts"), "{}", err.message);
        let err = ids(r#"{"prompt":[1,-2]}"#).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("prompt"));
    }

    #[test]
    fn log_probabilities_are_asked_for_as_each_endpoint_spells_it() {
        let msgs = r#""messages":[{"role":"user","content":"hi"}]"#;
        let asked = |body: String| chat(&body).expect("valid").logprobs;
        assert_eq!(asked(format!("{{{msgs}}}")), None);
        assert_eq!(asked(format!("{{{msgs},\"logprobs\":false}}")), None);
        assert_eq!(asked(format!("{{{msgs},\"logprobs\":true}}")), Some(0));
        assert_eq!(
            asked(format!("{{{msgs},\"logprobs\":true,\"top_logprobs\":20}}")),
            Some(20)
        );
        let completion = |body: &str| completion_request(body.as_bytes(), &SERVED);
        assert_eq!(
            completion(r#"{"prompt":"a","logprobs":3}"#)
                .expect("valid")
                .logprobs,
            Some(3)
        );
        assert_eq!(
            completion(r#"{"prompt":"a","logprobs":null}"#)
                .expect("valid")
                .logprobs,
            None
        );
        let err = completion(r#"{"prompt":"a","logprobs":6}"#).expect_err("over 5");
        assert_eq!(err.param.as_deref(), Some("logprobs"));
        let err = completion(r#"{"prompt":"a","logprobs":true}"#).expect_err("a boolean");
        assert!(err.message.contains("0 to 5"), "{}", err.message);
    }

    const WEATHER: &str = r#"{"type": "function", "function": {"name": "get_weather",
        "description": "Weather in a city", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}}, "required": ["city"]}}}"#;

    #[test]
    fn tools_and_tool_turns_become_what_templates_read() {
        let job = chat(&format!(
            r#"{{"tools": [{WEATHER}], "messages": [
                {{"role": "user", "content": "Weather in Paris?"}},
                {{"role": "assistant", "content": null, "tool_calls": [{{"id": "call_7",
                  "type": "function", "function": {{"name": "get_weather",
                  "arguments": "{{\"city\": \"Paris\"}}"}}}}]}},
                {{"role": "tool", "tool_call_id": "call_7", "name": "get_weather",
                  "content": "sunny"}},
                {{"role": "assistant", "content": "Sunny.", "tool_calls": []}}]}}"#
        ))
        .expect("valid");
        // The tools reach the template as written, key order included.
        let tool: Value = serde_json::from_str(WEATHER).unwrap();
        assert_eq!(job.tools.len(), 1);
        assert_eq!(
            serde_json::to_string(&job.tools[0]).unwrap(),
            serde_json::to_string(&tool).unwrap()
        );
        assert!(job.parse_tool_calls, "tool_choice defaults to auto");
        let Prompt::Chat(messages) = &job.prompt else {
            panic!("a chat prompt")
        };
        let call = MessageToolCall {
            id: Some("call_7".into()),
            kind: "function".into(),
            function: MessageFunctionCall {
                name: "get_weather".into(),
                arguments: serde_json::json!({"city": "Paris"}),
            },
        };
        assert_eq!(
            messages[1],
            ChatMessage {
                tool_calls: Some(vec![call]),
                ..ChatMessage::new("assistant", "")
            }
        );
        assert_eq!(
            messages[2],
            ChatMessage {
                tool_call_id: Some("call_7".into()),
                name: Some("get_weather".into()),
                ..ChatMessage::new("tool", "sunny")
            }
        );
        assert_eq!(messages[3], ChatMessage::new("assistant", "Sunny."));

        // "none" keeps the tools for the template and turns parsing off.
        let none = chat(&format!(
            r#"{{"tools": [{WEATHER}], "tool_choice": "none", "messages": [{{"role": "user", "content": "hi"}}]}}"#
        ))
        .expect("valid");
        assert_eq!(none.tools.len(), 1);
        assert!(!none.parse_tool_calls);
        let auto =
            chat(r#"{"tool_choice": "auto", "messages": [{"role": "user", "content": "hi"}]}"#)
                .expect("valid");
        assert!(auto.tools.is_empty() && !auto.parse_tool_calls);
    }

    #[test]
    fn bad_tools_and_tool_choices_are_named() {
        let with = |extra: &str| {
            format!(r#"{{"messages": [{{"role": "user", "content": "hi"}}], {extra}}}"#)
        };
        refused(&with(r#""tools": {"type": "function"}"#), "tools");
        refused(
            &with(r#""tools": [{"function": {"name": "f"}}]"#),
            "tools[0].type",
        );
        refused(
            &with(&format!(r#""tools": [{WEATHER}, {{"type": "retrieval"}}]"#)),
            "tools[1].type",
        );
        refused(
            &with(r#""tools": [{"type": "function"}]"#),
            "tools[0].function",
        );
        refused(
            &with(&format!(
                r#""tools": [{WEATHER}, {{"type": "function", "function": {{"name": "g"}}}},
                    {{"type": "function", "function": {{"name": ""}}}}]"#
            )),
            "tools[2].function.name",
        );
        refused(
            &with(&format!(r#""tools": [{WEATHER}, {WEATHER}]"#)),
            "tools[1].function.name",
        );
        refused(
            &with(
                r#""tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]"#,
            ),
            "tools[0].function.parameters",
        );
        for choice in [
            r#""required""#,
            r#"{"type": "function", "function": {"name": "get_weather"}}"#,
        ] {
            let err = refused(
                &with(&format!(r#""tools": [{WEATHER}], "tool_choice": {choice}"#)),
                "tool_choice",
            );
            assert!(err.message.contains("constrained"), "{}", err.message);
        }
        refused(&with(r#""tool_choice": "sometimes""#), "tool_choice");
        let err = refused(&with(r#""functions": [{"name": "f"}]"#), "functions");
        assert!(err.message.contains("`tools`"), "{}", err.message);
        refused(&with(r#""function_call": "auto""#), "function_call");
        // Tools need the chat template.
        let err = completion_request(
            format!(r#"{{"prompt": "hi", "tools": [{WEATHER}]}}"#).as_bytes(),
            &SERVED,
        )
        .expect_err("tools on completions");
        assert_eq!(err.param.as_deref(), Some("tools"));
    }

    #[test]
    fn bad_tool_calls_in_messages_are_named() {
        let with_call = |call: &str| {
            format!(
                r#"{{"messages": [{{"role": "user", "content": "hi"}},
                    {{"role": "assistant", "tool_calls": [{{"id": "a", "type": "function",
                      "function": {{"name": "f", "arguments": "{{}}"}}}}, {call}]}}]}}"#
            )
        };
        let err = refused(
            &with_call(
                r#"{"type": "function", "function": {"name": "f", "arguments": "{\"city\": "}}"#,
            ),
            "messages[1].tool_calls[1].function.arguments",
        );
        assert!(err.message.contains("not valid JSON"), "{}", err.message);
        refused(
            &with_call(r#"{"type": "code", "function": {"name": "f"}}"#),
            "messages[1].tool_calls[1].type",
        );
        refused(
            &with_call(r#"{"type": "function", "function": {"arguments": "{}"}}"#),
            "messages[1].tool_calls[1].function",
        );
        // Arguments given as an object, or not at all, are taken as they are.
        let job = chat(&with_call(
            r#"{"function": {"name": "g", "arguments": {"x": [1]}}}, {"function": {"name": "h"}}"#,
        ))
        .expect("valid");
        let Prompt::Chat(messages) = job.prompt else {
            panic!("a chat prompt")
        };
        let calls = messages[1].tool_calls.clone().expect("calls");
        let arguments: Vec<Value> = calls.into_iter().map(|c| c.function.arguments).collect();
        assert_eq!(
            arguments,
            [
                serde_json::json!({}),
                serde_json::json!({"x": [1]}),
                serde_json::json!({})
            ]
        );
    }
}
