//! Response bodies in OpenAI's shapes (`chat.completion`, `chat.completion.chunk`,
//! `text_completion`), each with dspec's speculation numbers under `"dspec"`.

use serde_json::{json, Value};

use crate::serve::worker::{finish_reason, Candidate, Finished, TokenChoice};

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
        let reason = finish_reason(done.stats.stop_reason);
        let logprobs = self.logprobs(done.logprobs.as_deref(), 0);
        let mut body = match self.endpoint {
            Endpoint::Chat => self.object(
                "chat.completion",
                json!({"index": 0, "message": {"role": "assistant", "content": done.text},
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

    /// The stream's last chunk: no text, the finish reason, usage and dspec's numbers.
    pub fn last_chunk(&self, done: &Finished) -> Value {
        let reason = finish_reason(done.stats.stop_reason);
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
