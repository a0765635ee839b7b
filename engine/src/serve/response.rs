//! Response bodies in OpenAI's shapes (`chat.completion`, `chat.completion.chunk`,
//! `text_completion`), each with dspec's speculation numbers under `"dspec"`.

use rand::distr::{Alphanumeric, SampleString};
use serde_json::{json, Value};

use crate::serve::worker::{finish_reason, Candidate, Finished, TokenChoice};
use crate::text::tool_calls::ToolCall;

/// Which endpoint a response is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
}

/// What every body of one response shares.
#[derive(Debug, Clone)]
pub struct Envelope {
    pub endpoint: Endpoint,
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl Envelope {
    fn object(&self, kind: &str, choice: Value) -> Value {
        json!({
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        })
    }

    /// `logprobs` of a choice: `null` when not asked for, else in the endpoint's shape.
    /// `offset`: characters of the answer before these tokens (completions'
    /// `text_offset`).
    pub fn logprobs(&self, choices: Option<&[TokenChoice]>, offset: usize) -> Value {
        let Some(choices) = choices else {
            return Value::Null;
        };
        match self.endpoint {
            Endpoint::Chat => {
                let entry = |c: &Candidate| json!({"token": c.text, "logprob": c.logprob, "bytes": c.text.as_bytes()});
                let content: Vec<Value> = choices
                    .iter()
                    .map(|c| {
                        let mut e = entry(&c.token);
                        e["top_logprobs"] = c.top.iter().map(entry).collect();
                        e
                    })
                    .collect();
                json!({"content": content, "refusal": null})
            }
            Endpoint::Completions => {
                let mut offsets = Vec::with_capacity(choices.len());
                let mut at = offset;
                for c in choices {
                    offsets.push(at);
                    at += c.token.text.chars().count();
                }
                let top: Vec<Value> = choices
                    .iter()
                    .map(|c| {
                        // Keyed by text, as the legacy API has it: tokens that read the
                        // same (pieces of a character) keep the likeliest's value.
                        let mut alternatives = serde_json::Map::new();
                        for t in &c.top {
                            alternatives
                                .entry(t.text.clone())
                                .or_insert(json!(t.logprob));
                        }
                        Value::Object(alternatives)
                    })
                    .collect();
                json!({
                    "tokens": choices.iter().map(|c| &c.token.text).collect::<Vec<_>>(),
                    "token_logprobs": choices.iter().map(|c| c.token.logprob).collect::<Vec<_>>(),
                    "top_logprobs": top,
                    "text_offset": offsets,
                })
            }
        }
    }

    /// The whole answer of a request that did not stream.
    pub fn complete(&self, done: &Finished) -> Value {
        let reason = finish_reason_of(done);
        let logprobs = self.logprobs(done.logprobs.as_deref(), 0);
        let mut body = match self.endpoint {
            Endpoint::Chat => self.object(
                "chat.completion",
                json!({"index": 0, "message": chat_message(done),
                       "logprobs": logprobs, "finish_reason": reason}),
            ),
            Endpoint::Completions => self.object(
                "text_completion",
                json!({"index": 0, "text": done.text, "logprobs": logprobs, "finish_reason": reason}),
            ),
        };
        add_numbers(&mut body, done);
        body
    }

    /// A streamed chunk of text (`None`: the chat stream's opening, naming the role),
    /// with the `logprobs` of its tokens when they are reported ([`Envelope::logprobs`]).
    pub fn chunk(&self, text: Option<&str>, logprobs: Value) -> Value {
        match self.endpoint {
            Endpoint::Chat => {
                let delta = match text {
                    Some(t) => json!({"content": t}),
                    None => json!({"role": "assistant", "content": ""}),
                };
                self.object(
                    "chat.completion.chunk",
                    json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": null}),
                )
            }
            Endpoint::Completions => self.object(
                "text_completion",
                json!({"index": 0, "text": text.unwrap_or(""), "logprobs": logprobs, "finish_reason": null}),
            ),
        }
    }

    /// A chat stream's tool calls, one chunk each, whole: they are parsed once the
    /// generation is done, so there are no partial arguments to stream.
    pub fn tool_call_chunks(&self, done: &Finished) -> Vec<Value> {
        done.tool_calls
            .iter()
            .enumerate()
            .map(|(index, call)| {
                let mut call = tool_call(call);
                call["index"] = index.into();
                self.object(
                    "chat.completion.chunk",
                    json!({"index": 0, "delta": {"tool_calls": [call]}, "logprobs": null,
                           "finish_reason": null}),
                )
            })
            .collect()
    }

    /// The stream's last chunk: no text, the finish reason, usage and dspec's numbers.
    pub fn last_chunk(&self, done: &Finished) -> Value {
        let reason = finish_reason_of(done);
        let mut body = match self.endpoint {
            Endpoint::Chat => self.object(
                "chat.completion.chunk",
                json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": reason}),
            ),
            Endpoint::Completions => self.object(
                "text_completion",
                json!({"index": 0, "text": "", "logprobs": null, "finish_reason": reason}),
            ),
        };
        add_numbers(&mut body, done);
        body
    }
}

/// OpenAI's `finish_reason`: "tool_calls" when the model called any, else how it ended.
fn finish_reason_of(done: &Finished) -> &'static str {
    if done.tool_calls.is_empty() {
        finish_reason(done.stats.stop_reason)
    } else {
        "tool_calls"
    }
}

/// A chat answer's `message`: its text, and its tool calls when it made any (then the
/// text is null when there is none, as OpenAI sends it).
fn chat_message(done: &Finished) -> Value {
    if done.tool_calls.is_empty() {
        return json!({"role": "assistant", "content": done.text});
    }
    let content = Some(done.text.as_str()).filter(|t| !t.is_empty());
    let calls: Vec<Value> = done.tool_calls.iter().map(tool_call).collect();
    json!({"role": "assistant", "content": content, "tool_calls": calls})
}

/// A call as OpenAI writes it, under a fresh id: the client sends the id back with the
/// tool's result, so ids must not repeat within a conversation, across server restarts
/// included (a counter would).
fn tool_call(call: &ToolCall) -> Value {
    let id = format!("call_{}", Alphanumeric.sample_string(&mut rand::rng(), 24));
    json!({"id": id, "type": "function",
           "function": {"name": call.name, "arguments": call.arguments}})
}

/// `usage` as OpenAI counts it, and `dspec`: how speculation went.
fn add_numbers(body: &mut Value, done: &Finished) {
    let s = &done.stats;
    let sp = &done.speculative;
    body["usage"] = json!({
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.generated_tokens,
        "total_tokens": s.prompt_tokens + s.generated_tokens,
        "prompt_tokens_details": { "cached_tokens": s.cached_prompt_tokens },
    });
    body["dspec"] = json!({
        "drafter": sp.drafter,
        "tau": sp.tau,
        "drafted": sp.drafted_tokens,
        "accepted": sp.accepted_tokens,
        "target_forwards": sp.target_forwards,
        "acceptance_histogram": sp.acceptance_histogram,
        "draft_histogram": sp.draft_histogram,
        "draft_time_share": sp.draft_time_share,
        "prefill_seconds": s.prefill_seconds,
        "prefill_tokens_per_second": s.prefill_tokens_per_second,
        "prompt_cache": {
            "hit": s.cached_prompt_tokens > 0,
            "cached_tokens": s.cached_prompt_tokens,
            "prefilled_tokens": s.prompt_tokens - s.cached_prompt_tokens,
            "entries": done.prompt_cache.entries,
            "bytes": done.prompt_cache.bytes,
            "budget_bytes": done.prompt_cache.budget_bytes,
        },
        "decode_tokens_per_second": s.decode_tokens_per_second,
        "stop_reason": s.stop_reason,
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decoding::generate::{GenerationStats, StopReason};
    use crate::decoding::prompt_cache::PromptCacheUsage;
    use crate::decoding::speculative::SpeculativeStats;

    fn finished(text: &str, calls: &[(&str, &str)]) -> Finished {
        Finished {
            text: text.into(),
            tool_calls: calls
                .iter()
                .map(|(name, arguments)| ToolCall {
                    name: name.to_string(),
                    arguments: arguments.to_string(),
                })
                .collect(),
            stats: GenerationStats::new(5, 7, 0.1, 0.2, StopReason::Eos),
            speculative: SpeculativeStats {
                drafter: "ngram".into(),
                target_forwards: 3,
                drafted_tokens: 4,
                accepted_tokens: 2,
                tau: 2.0,
                acceptance_histogram: vec![1, 1],
                draft_histogram: vec![0, 3],
                draft_time_share: 0.1,
                round_cost: None,
                round_times: Vec::new(),
            },
            prompt_cache: PromptCacheUsage::default(),
            logprobs: None,
        }
    }

    fn chat() -> Envelope {
        Envelope {
            endpoint: Endpoint::Chat,
            id: "chatcmpl-1".into(),
            created: 1,
            model: "tiny".into(),
        }
    }

    #[test]
    fn tool_calls_answer_in_openai_shape() {
        let done = finished(
            "",
            &[("get_weather", r#"{"city":"Paris"}"#), ("get_time", "{}")],
        );
        let body = chat().complete(&done);
        let choice = &body["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls");
        let message = &choice["message"];
        assert_eq!(message["role"], "assistant");
        assert!(message["content"].is_null(), "{message}");
        let calls = message["tool_calls"].as_array().expect("tool_calls");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0]["type"], "function");
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        // Arguments stay JSON text, as OpenAI sends them.
        assert_eq!(calls[0]["function"]["arguments"], r#"{"city":"Paris"}"#);
        assert_eq!(calls[1]["function"]["name"], "get_time");
        let ids: Vec<&str> = calls.iter().filter_map(|c| c["id"].as_str()).collect();
        assert_eq!(ids.len(), 2);
        assert!(ids
            .iter()
            .all(|id| id.starts_with("call_") && id.len() > 10));
        assert_ne!(ids[0], ids[1]);
        assert_eq!(body["usage"]["completion_tokens"], 7);

        // Text beside the calls is the content.
        let with_text = chat().complete(&finished("Checking.", &[("f", "{}")]));
        assert_eq!(with_text["choices"][0]["message"]["content"], "Checking.");
        // No calls: as before, no tool_calls key, and an empty text stays a string.
        let plain = chat().complete(&finished("", &[]));
        let message = &plain["choices"][0]["message"];
        assert_eq!(message["content"], "");
        assert!(message.get("tool_calls").is_none(), "{message}");
        assert_eq!(plain["choices"][0]["finish_reason"], "stop");
    }

    #[test]
    fn streamed_tool_calls_come_one_chunk_each_before_the_last() {
        let done = finished("", &[("a", r#"{"x":1}"#), ("b", "{}")]);
        let envelope = chat();
        let chunks = envelope.tool_call_chunks(&done);
        assert_eq!(chunks.len(), 2);
        for (i, chunk) in chunks.iter().enumerate() {
            assert_eq!(chunk["object"], "chat.completion.chunk");
            assert_eq!(chunk["id"], "chatcmpl-1");
            assert!(chunk["choices"][0]["finish_reason"].is_null());
            let call = &chunk["choices"][0]["delta"]["tool_calls"][0];
            assert_eq!(call["index"], i);
            assert!(call["id"]
                .as_str()
                .is_some_and(|id| id.starts_with("call_")));
            assert_eq!(call["type"], "function");
        }
        let first = &chunks[0]["choices"][0]["delta"]["tool_calls"][0]["function"];
        assert_eq!(first["name"], "a");
        assert_eq!(first["arguments"], r#"{"x":1}"#);
        let last = envelope.last_chunk(&done);
        assert_eq!(last["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(last["choices"][0]["delta"], json!({}));
        assert!(envelope.tool_call_chunks(&finished("hi", &[])).is_empty());
    }
}
