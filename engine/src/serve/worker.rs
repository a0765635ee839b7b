//! The one thread that owns the model, the drafter and every MLX array: it loads them,
//! then takes jobs off the queue one at a time and streams each one's text back. On rank
//! 0 of a group it also hands each job to the other ranks first (see [`group`]).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::Arc;

use axum::http::StatusCode;
use tokio::sync::mpsc::UnboundedSender;

use dspec_plugin_api::Drafter;

use crate::decoding::generate::{GenerationConfig, GenerationStats, StopReason};
use crate::decoding::logprobs::TokenLogprob;
use crate::decoding::prompt_cache::{PromptCache, PromptCacheUsage};
use crate::decoding::speculative::VerifyAheadMode;
use crate::decoding::speculative::{
    generate_speculative, ServingOptions, Speculation, SpeculativeStats,
};
use crate::error::EngineError;
use crate::loading::distributed::Distributed;
use crate::loading::LoadedModel;
use crate::serve::error::ApiError;
use crate::serve::group::{self, SharedJob};
use crate::serve::request::{JobRequest, Prompt};
use crate::text::chat_template::{ChatMessage, ChatTemplate};
use crate::text::tokenizer::TextTokenizer;
use crate::text::tool_calls::{ToolCall, ToolCallStream};

/// A loaded target and its drafter, as the loader hands them to the worker.
pub struct Engine {
    pub loaded: LoadedModel,
    pub drafter: Box<dyn Drafter>,
    /// Most drafts per round and whether the count adapts (`--max-draft`).
    pub max_draft: usize,
    pub adaptive: bool,
    /// When rounds are queued ahead (`--verify-ahead`).
    pub verify_ahead: VerifyAheadMode,
    /// `max_tokens` of requests that give none (`--max-tokens`).
    pub default_max_tokens: usize,
    /// The target's caches of earlier requests (`--prompt-cache-bytes`).
    pub prompt_cache: PromptCache,
    /// The group the target is split over, if it is: rank 0 sends it every job it
    /// generates (see [`group`]).
    pub group: Option<Arc<Distributed>>,
    /// Requests decoded together at most (`--max-batch`); see [`Engine::batches`].
    pub max_batch: usize,
}

impl Engine {
    /// Whether requests are decoded together ([`crate::serve::batching`]): more than one
    /// at a time asked for, a target whose forward takes several sequences at once, a
    /// drafter each request can have its own fork of, and no group to keep in step.
    pub fn batches(&self) -> bool {
        self.max_batch > 1
            && self.group.is_none()
            && self.loaded.model.batches_rows()
            && self.drafter.forks()
    }

    /// The parts a generation borrows: the model, the drafting settings, the prompt cache.
    /// One place builds them, so that every rank of a group speculates alike.
    pub fn parts(&mut self) -> (&LoadedModel, Speculation<'_>, &mut PromptCache) {
        let speculation = Speculation {
            drafter: self.drafter.as_mut(),
            max_draft: self.max_draft,
            adaptive: self.adaptive,
            trace: None,
            verify_ahead: self.verify_ahead,
        };
        (&self.loaded, speculation, &mut self.prompt_cache)
    }
}

/// Builds the [`Engine`] on the worker thread, where its arrays must live.
pub type Loader = Box<dyn FnOnce() -> Result<Engine, EngineError> + Send>;

/// What the HTTP side learns of the model once it is loaded.
#[derive(Debug, Clone)]
pub struct ModelFacts {
    pub max_context: Option<usize>,
    pub drafter: String,
    /// Requests decoded together at most (1: one at a time).
    pub batch: usize,
}

/// A request on the queue: what to generate, where its events go, and the flag its
/// HTTP side raises when the client is gone.
pub struct Job {
    pub request: JobRequest,
    pub events: UnboundedSender<Event>,
    pub cancel: Arc<AtomicBool>,
}

/// How a job goes, in order: `Started` or `Failed` first, then `Text`s and `Done`; a
/// job that asked for log-probabilities gets them after each round's `Text`s.
#[derive(Debug)]
pub enum Event {
    Started,
    Text(String),
    Logprobs(Vec<TokenChoice>),
    Done(Box<Finished>),
    Failed(ApiError),
}

/// A generated token's log-probability with its text, and its position's likeliest
/// tokens (most likely first).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenChoice {
    pub token: Candidate,
    pub top: Vec<Candidate>,
}

/// A token as a client reads it: its text (decoded alone; a piece of a multi-byte
/// character reads as U+FFFD) and its log-probability.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    pub text: String,
    pub logprob: f32,
}

/// A finished generation's text and numbers.
#[derive(Debug)]
pub struct Finished {
    /// The text, less the tool calls parsed out of it.
    pub text: String,
    /// The calls, when the request offered tools and the template's format is known.
    pub tool_calls: Vec<ToolCall>,
    pub stats: GenerationStats,
    pub speculative: SpeculativeStats,
    /// The prompt cache after this request was stored in it.
    pub prompt_cache: PromptCacheUsage,
    /// When asked for: one entry per generated token but an ending EOS.
    pub logprobs: Option<Vec<TokenChoice>>,
}

/// The running model thread.
pub struct Worker {
    pub facts: ModelFacts,
    thread: std::thread::JoinHandle<Result<(), EngineError>>,
}

impl Worker {
    /// Waits for the thread to end, once every job sender is gone: in a group, that is
    /// once it has told the other ranks to stop and they have.
    pub fn join(self) -> Result<(), EngineError> {
        self.thread.join().unwrap_or_else(|_| {
            Err(EngineError::Invalid(
                "the model thread failed while stopping".into(),
            ))
        })
    }
}

/// Starts the worker, which loads with `load` and then serves `jobs` until every
/// sender is gone. Returns once loading is done, with its outcome.
pub fn spawn(load: Loader, jobs: Receiver<Job>) -> Result<Worker, EngineError> {
    let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
    let thread = std::thread::Builder::new()
        .name("dspec-model".into())
        .spawn(move || run(load, jobs, ready_tx))
        .map_err(|e| EngineError::Invalid(format!("starting the model thread: {e}")))?;
    let facts = ready_rx.recv().unwrap_or_else(|_| {
        Err(EngineError::Invalid(
            "the model thread ended while loading".into(),
        ))
    })?;
    Ok(Worker { facts, thread })
}

fn run(
    load: Loader,
    jobs: Receiver<Job>,
    ready: SyncSender<Result<ModelFacts, EngineError>>,
) -> Result<(), EngineError> {
    let mut engine = match load() {
        Ok(engine) => engine,
        Err(e) => {
            let _ = ready.send(Err(e));
            return Ok(());
        }
    };
    let facts = ModelFacts {
        max_context: engine.loaded.model.info().max_context,
        drafter: engine.drafter.name().to_string(),
        batch: if engine.batches() {
            engine.max_batch
        } else {
            1
        },
    };
    if ready.send(Ok(facts)).is_err() {
        return Ok(());
    }
    let template = match engine.loaded.tokenizer.chat_template() {
        Some(source) => ChatTemplate::new(
            source,
            engine.loaded.tokenizer.bos_token(),
            engine.loaded.tokenizer.eos_token(),
        )
        .map_err(|e| e.to_string()),
        None => Err("the model has no chat template; use /v1/completions with raw text".into()),
    };
    if engine.batches() {
        crate::serve::batching::serve_together(&mut engine, &template, &jobs);
        return Ok(());
    }
    while let Some(job) = next_job(&engine, &jobs) {
        // A client that left while queued costs nothing.
        if job.cancel.load(Ordering::Relaxed) {
            continue;
        }
        let events = job.events.clone();
        // A bug in one request must not take the server down with it.
        let outcome = catch_unwind(AssertUnwindSafe(|| serve(&mut engine, &template, job)));
        if outcome.is_err() {
            let _ = events.send(Event::Failed(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "dspec failed on this request (an internal error; see the server's log)",
            )));
            // Unless the other ranks were left mid-generation, waiting on this one.
            if let Some(group) = &engine.group {
                group::abandon(
                    group,
                    &EngineError::Invalid("an internal error ended a generation".into()),
                );
            }
        }
    }
    match &engine.group {
        Some(group) => stop_followers(group),
        None => Ok(()),
    }
}

/// The next job, or `None` once the server stops. In a group, waiting for it is idle
/// time: the other ranks are watched for dying, not for progress.
fn next_job(engine: &Engine, jobs: &Receiver<Job>) -> Option<Job> {
    let _idle = engine.group.as_deref().map(Distributed::idle);
    jobs.recv().ok()
}

/// Tells the followers that the server stops, and waits until every rank has.
fn stop_followers(group: &Distributed) -> Result<(), EngineError> {
    let watching = group.watch();
    group::send(group, &group::Message::Stop)?;
    drop(watching);
    group.finish()
}

/// The prompt as token ids, or the request's fault.
fn encode(
    loaded: &LoadedModel,
    template: &Result<ChatTemplate, String>,
    prompt: &Prompt,
    tools: &[serde_json::Value],
) -> Result<Vec<u32>, ApiError> {
    let tokenizer = &loaded.tokenizer;
    let ids = match prompt {
        Prompt::Text(text) => tokenizer
            .encode_prompt(text, false)
            .map_err(|e| ApiError::invalid("prompt", e.to_string()))?,
        Prompt::Tokens(ids) => {
            // The target's embedding table may be wider than the tokenizer's vocabulary
            // (padded), but an id past the table would read outside it.
            let vocab = loaded.model.info().vocab_size;
            if let Some((i, id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
                return Err(ApiError::invalid(
                    format!("prompt[{i}]"),
                    format!("`prompt[{i}]` is token id {id}, past the model's vocabulary of {vocab} ids (0 to {})", vocab - 1),
                ));
            }
            ids.clone()
        }
        Prompt::Chat(messages) => {
            let template = template
                .as_ref()
                .map_err(|e| ApiError::invalid("messages", e.clone()))?;
            let rendered = render_chat(template, messages, tools)?;
            tokenizer
                .encode_prompt(&rendered, true)
                .map_err(|e| ApiError::invalid("messages", e.to_string()))?
        }
    };
    let param = prompt.param();
    if ids.is_empty() {
        return Err(ApiError::invalid(
            param,
            format!("`{param}` is empty after tokenization; give some text"),
        ));
    }
    Ok(ids)
}

/// A conversation through the chat template, with the request's tools as its `tools`.
fn render_chat(
    template: &ChatTemplate,
    messages: &[ChatMessage],
    tools: &[serde_json::Value],
) -> Result<String, ApiError> {
    let mut extra = serde_json::Map::new();
    if !tools.is_empty() {
        // Dropping them would answer as if the model had seen them and chose no call.
        if !template.supports_tools() {
            return Err(ApiError::invalid(
                "tools",
                "the model's chat template does not support tools (it never reads `tools`); send the request without them",
            ));
        }
        extra.insert("tools".into(), tools.to_vec().into());
    }
    template
        .render(messages, true, &extra)
        .map_err(|e| ApiError::invalid("messages", e.to_string()))
}

/// How many tokens a job may generate: what it asked for, else the server's default
/// cut to the context left.
fn max_tokens(
    loaded: &LoadedModel,
    default_max_tokens: usize,
    request: &JobRequest,
    prompt: usize,
) -> Result<usize, ApiError> {
    let limit = loaded.model.info().max_context.unwrap_or(usize::MAX);
    if prompt >= limit {
        return Err(ApiError::invalid(
            request.prompt.param(),
            format!(
                "the prompt has {prompt} tokens but the model's context is {limit}; shorten it"
            ),
        )
        .with_code("context_length_exceeded"));
    }
    let left = limit - prompt;
    match request.max_tokens {
        Some(m) if m > left => Err(ApiError::invalid(
            request.max_tokens_param,
            format!("the prompt ({prompt} tokens) and `{}` ({m}) exceed the model's context of {limit} tokens; ask for at most {left}", request.max_tokens_param),
        )
        .with_code("context_length_exceeded")),
        Some(m) => Ok(m),
        None => Ok(default_max_tokens.min(left)),
    }
}

/// The job's prompt as token ids and how many tokens it may generate, or the request's
/// fault.
pub(super) fn prepare(
    loaded: &LoadedModel,
    default_max_tokens: usize,
    template: &Result<ChatTemplate, String>,
    request: &JobRequest,
) -> Result<(Vec<u32>, usize), ApiError> {
    let ids = encode(loaded, template, &request.prompt, &request.tools)?;
    let max = max_tokens(loaded, default_max_tokens, request, ids.len())?;
    Ok((ids, max))
}

/// The job's generation settings.
pub(super) fn generation_config(
    tokenizer: &TextTokenizer,
    request: &JobRequest,
    max_tokens: usize,
) -> GenerationConfig {
    GenerationConfig {
        max_tokens,
        sampling: request.sampling.clone(),
        stop_strings: request.stop.clone(),
        eos_ids: tokenizer.eos_token_ids().to_vec(),
    }
}

/// What the job's output goes through when it offered tools and the template's call
/// format is known. Parsing runs on the model's side, where the text is; the HTTP side
/// only shapes the calls as JSON.
pub(super) fn call_parser(
    template: &Result<ChatTemplate, String>,
    request: &JobRequest,
) -> Option<ToolCallStream> {
    template
        .as_ref()
        .ok()
        .and_then(ChatTemplate::tool_call_format)
        .filter(|_| request.parse_tool_calls)
        .map(ToolCallStream::new)
}

/// Sends a piece of text on, through the job's tool-call parser; false once the client
/// is gone.
pub(super) fn send_text(
    events: &UnboundedSender<Event>,
    parser: Option<&mut ToolCallStream>,
    piece: &str,
) -> bool {
    let piece = match parser {
        Some(parser) => parser.push(piece),
        None => piece.to_string(),
    };
    piece.is_empty() || events.send(Event::Text(piece)).is_ok()
}

/// Log-probabilities as a client reads them: each token with its text.
pub(super) fn choices(tokenizer: &TextTokenizer, entries: &[TokenLogprob]) -> Vec<TokenChoice> {
    let candidate = |id: u32, logprob: f32| Candidate {
        text: tokenizer.decode(&[id], false).unwrap_or_default(),
        logprob,
    };
    entries
        .iter()
        .map(|e| TokenChoice {
            token: candidate(e.token, e.logprob),
            top: e.top.iter().map(|&(id, lp)| candidate(id, lp)).collect(),
        })
        .collect()
}

/// A finished generation's last events: the text the parser held back (content after
/// all: a marker's start that began no call, text after the calls), then `Done`.
pub(super) struct Outcome {
    pub text: String,
    pub stats: GenerationStats,
    pub speculative: SpeculativeStats,
    pub prompt_cache: PromptCacheUsage,
    pub logprobs: Option<Vec<TokenChoice>>,
}

pub(super) fn send_done(
    events: &UnboundedSender<Event>,
    parser: Option<ToolCallStream>,
    outcome: Outcome,
) {
    let (text, tool_calls) = match parser {
        Some(parser) => {
            let (rest, parsed) = parser.finish(&outcome.text);
            if !rest.is_empty() {
                let _ = events.send(Event::Text(rest));
            }
            (parsed.content, parsed.calls)
        }
        None => (outcome.text, Vec::new()),
    };
    let _ = events.send(Event::Done(Box::new(Finished {
        text,
        tool_calls,
        stats: outcome.stats,
        speculative: outcome.speculative,
        prompt_cache: outcome.prompt_cache,
        logprobs: outcome.logprobs,
    })));
}

fn serve(engine: &mut Engine, template: &Result<ChatTemplate, String>, job: Job) {
    let Job {
        request,
        events,
        cancel,
    } = job;
    let prepared = prepare(
        &engine.loaded,
        engine.default_max_tokens,
        template,
        &request,
    );
    let (prompt, max_tokens) = match prepared {
        Ok(p) => p,
        Err(e) => {
            let _ = events.send(Event::Failed(e));
            return;
        }
    };
    if events.send(Event::Started).is_err() {
        return;
    }
    let mut config = generation_config(&engine.loaded.tokenizer, &request, max_tokens);
    let group = engine.group.clone();
    // Watched from the job's first exchange with the other ranks to its last.
    let _watch = group.as_deref().map(Distributed::watch);
    if let Some(group) = group.as_deref() {
        share_job(engine, group, &prompt, &mut config);
    }
    let mut call_parser = call_parser(template, &request);
    let mut on_text = |piece: &str| {
        // The receiver is gone once the client is: stop generating for nobody.
        if !send_text(&events, call_parser.as_mut(), piece) {
            cancel.store(true, Ordering::Relaxed);
        }
    };
    let (loaded, speculation, prompt_cache) = engine.parts();
    let tokenizer = &loaded.tokenizer;
    let mut on_logprobs = |entries: &[TokenLogprob]| {
        let _ = events.send(Event::Logprobs(choices(tokenizer, entries)));
    };
    // In a group, the followers learn of a client that left in the same round.
    let cancelled = || match group.as_deref() {
        Some(group) => Ok(group.group().any(cancel.load(Ordering::Relaxed))?),
        None => Ok(cancel.load(Ordering::Relaxed)),
    };
    let outcome = generate_speculative(
        loaded.model.as_ref(),
        tokenizer,
        &prompt,
        &config,
        speculation,
        &mut on_text,
        ServingOptions {
            cancelled: Some(&cancelled),
            prompt_cache: Some(&mut *prompt_cache),
            logprobs: request.logprobs,
            on_logprobs: Some(&mut on_logprobs),
        },
    );
    match outcome {
        Ok(out) if out.stats.stop_reason == StopReason::Cancelled => {
            log_cancelled(out.stats.generated_tokens, max_tokens);
        }
        Ok(out) => send_done(
            &events,
            call_parser,
            Outcome {
                text: out.text,
                stats: out.stats,
                speculative: out.speculative,
                prompt_cache: prompt_cache.usage(),
                logprobs: out.logprobs.as_deref().map(|l| choices(tokenizer, l)),
            },
        ),
        Err(e) => {
            let _ = events.send(Event::Failed(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("generation failed: {e}"),
            )));
            // The other ranks may have failed elsewhere, or not at all: out of step.
            if let Some(group) = group.as_deref() {
                group::abandon(group, &e);
            }
        }
    }
}

/// The server's log line for a generation whose client went away.
pub(super) fn log_cancelled(generated: usize, max_tokens: usize) {
    eprintln!(
        "[dspec] generation cancelled after {generated} of {max_tokens} tokens: the client went away"
    );
}

/// In a group, before generating: every rank is to draw with one seed, the request's or
/// one rank 0 picks, and the other ranks get the job. A group that fails here ends the
/// server.
fn share_job(engine: &Engine, group: &Distributed, prompt: &[u32], config: &mut GenerationConfig) {
    config.sampling.seed.get_or_insert_with(rand::random);
    let job = SharedJob {
        prompt: prompt.to_vec(),
        config: config.clone(),
    };
    if let Err(e) = group::lead(group, engine, job) {
        group::abandon(group, &e);
    }
}

/// OpenAI's `finish_reason` for how a generation ended.
pub fn finish_reason(stop: StopReason) -> &'static str {
    match stop {
        StopReason::Eos | StopReason::StopString | StopReason::Cancelled => "stop",
        StopReason::MaxTokens | StopReason::ContextLength => "length",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn weather() -> Vec<serde_json::Value> {
        vec![json!({"type": "function", "function": {"name": "get_weather"}})]
    }

    #[test]
    fn tools_reach_a_template_that_reads_them_and_are_refused_by_one_that_does_not() {
        let messages = [ChatMessage::new("user", "Weather?")];
        let with_tools = ChatTemplate::new(
            "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{{ messages[0].content }}",
            None,
            None,
        )
        .unwrap();
        assert_eq!(
            render_chat(&with_tools, &messages, &weather()).unwrap(),
            "[get_weather]Weather?"
        );
        let without = ChatTemplate::new("{{ messages[0].content }}", None, None).unwrap();
        let err = render_chat(&without, &messages, &weather()).unwrap_err();
        assert_eq!(err.status, StatusCode::BAD_REQUEST);
        assert_eq!(err.param.as_deref(), Some("tools"));
        assert!(
            err.message
                .contains("the model's chat template does not support tools"),
            "{}",
            err.message
        );
        // No tools: no question asked of the template.
        assert_eq!(render_chat(&without, &messages, &[]).unwrap(), "Weather?");
    }
}
