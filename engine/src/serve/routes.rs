//! The HTTP side: routes, request logging, and turning a job's events into a JSON
//! answer or a Server-Sent Events stream. Nothing here touches MLX.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use serde_json::{json, Value};
use subtle::ConstantTimeEq;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::serve::error::ApiError;
use crate::serve::request::{chat_request, completion_request, JobRequest, ServedModel};
use crate::serve::response::{Endpoint, Envelope};
use crate::serve::worker::{Event, Job};

/// What the handlers share.
pub struct AppState {
    pub jobs: SyncSender<Job>,
    pub model_id: String,
    pub max_context: Option<usize>,
    pub drafter: String,
    pub max_body_bytes: usize,
    /// See [`crate::serve::ServerConfig::api_key`].
    pub api_key: Option<String>,
    /// See [`crate::serve::ServerConfig::read_timeout`].
    pub read_timeout: Duration,
    pub started: u64,
    next_id: AtomicU64,
}

impl AppState {
    pub fn new(
        jobs: SyncSender<Job>,
        model_id: String,
        max_context: Option<usize>,
        drafter: String,
        max_body_bytes: usize,
        api_key: Option<String>,
        read_timeout: Duration,
    ) -> Self {
        Self {
            jobs,
            model_id,
            max_context,
            drafter,
            max_body_bytes,
            api_key,
            read_timeout,
            started: unix_seconds(),
            next_id: AtomicU64::new(1),
        }
    }
}

fn unix_seconds() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state.clone())
        // `read_body` bounds the body (and answers 413); the extractor's own default
        // bound would refuse a body it already took.
        .layer(DefaultBodyLimit::disable())
        .layer(middleware::from_fn_with_state(state.clone(), read_body))
        .layer(middleware::from_fn_with_state(state, authorize))
        .layer(middleware::from_fn(log_requests))
}

/// With `--api-key`, every request but `/health` (which load balancers probe without
/// credentials) must carry `Authorization: Bearer KEY`; the key is compared in constant
/// time, so the answer's timing tells nothing of how much of a guess was right.
async fn authorize(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let Some(key) = state.api_key.as_deref() else {
        return next.run(req).await;
    };
    if req.uri().path() == "/health" {
        return next.run(req).await;
    }
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let (message, code) = match given {
        None => (
            "this server needs an API key: send the header `Authorization: Bearer KEY` (the openai client's `api_key`)",
            "missing_api_key",
        ),
        Some(given) if bool::from(given.as_bytes().ct_eq(key.as_bytes())) => {
            return next.run(req).await
        }
        Some(_) => (
            "the API key in `Authorization` is not this server's (--api-key)",
            "invalid_api_key",
        ),
    };
    ApiError::new(StatusCode::UNAUTHORIZED, message)
        .with_code(code)
        .into_response()
}

/// A POST's body: JSON (415 otherwise), read whole within the read timeout (408 for a
/// client that sends less, which would otherwise hold its connection and the request
/// open for as long as it liked) and at most `--max-body-bytes` long (413).
async fn read_body(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if req.method() != Method::POST {
        return next.run(req).await;
    }
    let content_type = req
        .headers()
        .get(header::CONTENT_TYPE)
        .map(|v| v.to_str().unwrap_or("(not text)").to_string());
    if let Some(given) = content_type.filter(|t| !is_json(t)) {
        return ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            format!("the request's Content-Type is `{given}`; send the body as JSON with `Content-Type: application/json`"),
        )
        .with_code("unsupported_media_type")
        .into_response();
    }
    let (parts, body) = req.into_parts();
    let limit = state.max_body_bytes;
    let read = Limited::new(body, limit).collect();
    let bytes = match tokio::time::timeout(state.read_timeout, read).await {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(e)) if e.is::<LengthLimitError>() => return too_large(limit).into_response(),
        Ok(Err(e)) => {
            return ApiError::invalid("body", format!("reading the request body: {e}"))
                .into_response()
        }
        Err(_) => {
            return ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                format!(
                    "the request body did not arrive within {} s; send it whole (or start the server with a longer --read-timeout)",
                    state.read_timeout.as_secs_f64()
                ),
            )
            .with_code("request_timeout")
            .into_response()
        }
    };
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}

/// `application/json`, or a JSON-based type (`application/vnd.x+json`), parameters aside.
fn is_json(content_type: &str) -> bool {
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}

fn too_large(limit: usize) -> ApiError {
    ApiError {
        status: StatusCode::PAYLOAD_TOO_LARGE,
        message: format!(
            "the request body is over {limit} bytes; send a shorter one (or start the server with a larger --max-body-bytes)"
        ),
        param: None,
        code: Some("request_too_large"),
    }
}

/// One stderr line per request, written when it ends.
#[derive(Clone)]
struct RequestLog {
    method: Method,
    path: String,
    start: Instant,
}

impl RequestLog {
    fn write(&self, status: u16, tokens: Option<usize>, note: &str) {
        let tokens = tokens.map_or_else(|| "-".to_string(), |t| t.to_string());
        eprintln!(
            "[dspec] {} {} {} tokens={} {:.0}ms{}",
            self.method,
            self.path,
            status,
            tokens,
            self.start.elapsed().as_secs_f64() * 1e3,
            note
        );
    }
}

/// Marks a response whose log line is written by its stream, when it ends.
#[derive(Clone)]
struct LoggedByStream;

/// Tokens generated for a response, for its log line.
#[derive(Clone)]
struct Tokens(usize);

async fn log_requests(mut req: Request, next: Next) -> Response {
    let log = RequestLog {
        method: req.method().clone(),
        path: req.uri().path().to_string(),
        start: Instant::now(),
    };
    req.extensions_mut().insert(log.clone());
    let response = next.run(req).await;
    if response.extensions().get::<LoggedByStream>().is_none() {
        let tokens = response.extensions().get::<Tokens>().map(|t| t.0);
        log.write(response.status().as_u16(), tokens, "");
    }
    response
}

async fn not_found(req: Request) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!(
            "no route {} {}; dspec serves POST /v1/chat/completions, POST /v1/completions, GET /v1/models and GET /health",
            req.method(),
            req.uri().path()
        ),
    )
}

async fn method_not_allowed(req: Request) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{} is not allowed on {}", req.method(), req.uri().path()),
    )
}

async fn health(State(state): State<Arc<AppState>>) -> Json<serde_json::Value> {
    Json(json!({"status": "ok", "model": state.model_id, "drafter": state.drafter}))
}

async fn models(State(state): State<Arc<AppState>>) -> Json<serde_json::Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": state.model_id,
            "object": "model",
            "created": state.started,
            "owned_by": "dspec",
            "max_model_len": state.max_context,
        }],
    }))
}

async fn chat(
    State(state): State<Arc<AppState>>,
    Extension(log): Extension<RequestLog>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    handle(state, log, Endpoint::Chat, body).await
}

async fn completions(
    State(state): State<Arc<AppState>>,
    Extension(log): Extension<RequestLog>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    handle(state, log, Endpoint::Completions, body).await
}

/// Raises a job's cancel flag when dropped before the job is done: the handler's
/// future (a client gone before a plain answer) or the stream (a client gone mid-stream).
struct Cancellation {
    flag: Arc<AtomicBool>,
    log: RequestLog,
    done: bool,
    pieces: usize,
}

impl Drop for Cancellation {
    fn drop(&mut self) {
        if !self.done {
            self.flag.store(true, Ordering::Relaxed);
            self.log.write(
                499,
                None,
                &format!(
                    " client went away after {} text pieces; generation cancelled",
                    self.pieces
                ),
            );
        }
    }
}

fn body_error(rejection: BytesRejection) -> ApiError {
    ApiError::invalid(
        "body",
        format!("reading the request body: {}", rejection.body_text()),
    )
}

fn parse(endpoint: Endpoint, body: &[u8], served: &ServedModel) -> Result<JobRequest, ApiError> {
    match endpoint {
        Endpoint::Chat => chat_request(body, served),
        Endpoint::Completions => completion_request(body, served),
    }
}

async fn handle(
    state: Arc<AppState>,
    log: RequestLog,
    endpoint: Endpoint,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let served = ServedModel {
        id: &state.model_id,
        max_context: state.max_context,
    };
    let request = match body
        .map_err(body_error)
        .and_then(|b| parse(endpoint, &b, &served))
    {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let stream = request.stream;
    let with_logprobs = request.logprobs.is_some();
    let (events_tx, mut events) = unbounded_channel();
    let mut cancellation = Cancellation {
        flag: Arc::new(AtomicBool::new(false)),
        log,
        done: true,
        pieces: 0,
    };
    let job = Job {
        request,
        events: events_tx,
        cancel: cancellation.flag.clone(),
    };
    match state.jobs.try_send(job) {
        Ok(()) => {}
        Err(TrySendError::Full(_)) => {
            return ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "the server's queue is full; retry later (or start it with a larger --queue-size)",
            )
            .with_code("queue_full")
            .into_response()
        }
        Err(TrySendError::Disconnected(_)) => {
            return ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "the model thread has stopped",
            )
            .into_response()
        }
    }
    cancellation.done = false;
    match events.recv().await {
        Some(Event::Started) => {}
        Some(Event::Failed(e)) => {
            cancellation.done = true;
            return e.into_response();
        }
        _ => {
            cancellation.done = true;
            return worker_gone().into_response();
        }
    }
    let id = state.next_id.fetch_add(1, Ordering::Relaxed);
    let envelope = Envelope {
        endpoint,
        id: match endpoint {
            Endpoint::Chat => format!("chatcmpl-{id}"),
            Endpoint::Completions => format!("cmpl-{id}"),
        },
        created: unix_seconds(),
        model: state.model_id.clone(),
    };
    if stream {
        return streamed(envelope, events, cancellation, with_logprobs);
    }
    loop {
        match events.recv().await {
            Some(Event::Text(_)) => cancellation.pieces += 1,
            // The answer's log-probabilities come whole with `Done`.
            Some(Event::Started | Event::Logprobs(_)) => {}
            Some(Event::Done(done)) => {
                cancellation.done = true;
                let mut response = Json(envelope.complete(&done)).into_response();
                response
                    .extensions_mut()
                    .insert(Tokens(done.stats.generated_tokens));
                return response;
            }
            Some(Event::Failed(e)) => {
                cancellation.done = true;
                return e.into_response();
            }
            None => {
                cancellation.done = true;
                return worker_gone().into_response();
            }
        }
    }
}

fn worker_gone() -> ApiError {
    ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "the model thread dropped this request; see the server's log",
    )
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Opening,
    Text,
    Closing,
    Ended,
}

/// A stream in progress; dropping it early (the client left) cancels the job.
struct StreamState {
    envelope: Envelope,
    events: UnboundedReceiver<Event>,
    phase: Phase,
    cancellation: Cancellation,
    /// With log-probabilities, text waits for its round's (which follow it): each chunk
    /// then carries its text and its tokens' log-probabilities together.
    with_logprobs: bool,
    pending_text: String,
    /// Characters sent before the pending text (completions' `text_offset`).
    sent_chars: usize,
    /// The closing chunks still to send (text still pending, tool calls, then the last
    /// chunk).
    closing: VecDeque<serde_json::Value>,
}

fn sse(value: &serde_json::Value) -> Result<SseEvent, Infallible> {
    Ok(SseEvent::default().data(value.to_string()))
}

impl StreamState {
    /// The next event to send, `None` once `[DONE]` is out.
    async fn next(&mut self) -> Option<Result<SseEvent, Infallible>> {
        loop {
            match self.phase {
                Phase::Opening => {
                    self.phase = Phase::Text;
                    if self.envelope.endpoint == Endpoint::Chat {
                        return Some(sse(&self.envelope.chunk(None, Value::Null)));
                    }
                }
                Phase::Text => {
                    let event = self.events.recv().await;
                    let (status, tokens) = match event {
                        Some(Event::Started) => continue,
                        Some(Event::Text(t)) if self.with_logprobs => {
                            self.pending_text.push_str(&t);
                            continue;
                        }
                        Some(Event::Text(t)) => {
                            self.cancellation.pieces += 1;
                            return Some(sse(&self.envelope.chunk(Some(&t), Value::Null)));
                        }
                        Some(Event::Logprobs(choices)) => {
                            let logprobs = self.envelope.logprobs(Some(&choices), self.sent_chars);
                            let text = std::mem::take(&mut self.pending_text);
                            self.sent_chars += choices
                                .iter()
                                .map(|c| c.token.text.chars().count())
                                .sum::<usize>();
                            self.cancellation.pieces += 1;
                            return Some(sse(&self.envelope.chunk(Some(&text), logprobs)));
                        }
                        Some(Event::Done(done)) => {
                            // Text still waiting (the end of a stop string's or a tool
                            // call marker's hold-back) goes out before the end.
                            if !self.pending_text.is_empty() {
                                let text = std::mem::take(&mut self.pending_text);
                                let none = self.envelope.logprobs(Some(&[]), self.sent_chars);
                                self.closing
                                    .push_back(self.envelope.chunk(Some(&text), none));
                            }
                            self.closing.extend(self.envelope.tool_call_chunks(&done));
                            self.closing.push_back(self.envelope.last_chunk(&done));
                            (200, Some(done.stats.generated_tokens))
                        }
                        // Headers are out: a failure now can only be told in the stream.
                        Some(Event::Failed(e)) => {
                            self.closing.push_back(e.body());
                            (e.status.as_u16(), None)
                        }
                        None => {
                            self.closing.push_back(worker_gone().body());
                            (500, None)
                        }
                    };
                    self.phase = Phase::Closing;
                    self.cancellation.done = true;
                    self.cancellation.log.write(status, tokens, " streamed");
                }
                Phase::Closing => {
                    if let Some(chunk) = self.closing.pop_front() {
                        return Some(sse(&chunk));
                    }
                    self.phase = Phase::Ended;
                    return Some(Ok(SseEvent::default().data("[DONE]")));
                }
                Phase::Ended => return None,
            }
        }
    }
}

fn streamed(
    envelope: Envelope,
    events: UnboundedReceiver<Event>,
    cancellation: Cancellation,
    with_logprobs: bool,
) -> Response {
    let state = StreamState {
        envelope,
        events,
        phase: Phase::Opening,
        cancellation,
        with_logprobs,
        pending_text: String::new(),
        sent_chars: 0,
        closing: VecDeque::new(),
    };
    let stream = futures_util::stream::unfold(state, |mut state| async move {
        state.next().await.map(|event| (event, state))
    });
    let mut response = Sse::new(stream).into_response();
    response.extensions_mut().insert(LoggedByStream);
    response
}
