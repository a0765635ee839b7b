//! `dspec serve`: an OpenAI-compatible HTTP server over one target and its drafter,
//! speculative decoding on for every request.
//!
//! Two sides, joined by channels. The model side is one thread ([`worker`]) that loads
//! the target and drafter and owns every MLX array (MLX binds arrays to the thread that
//! made them); it takes [`worker::Job`]s off a bounded queue one at a time and sends
//! each job's [`worker::Event`]s (started or refused, text pieces, the finished numbers)
//! back on that job's own channel. The HTTP side ([`routes`]) runs on tokio: it parses
//! and checks a request ([`request`]) before queueing it, answers 429 when the queue is
//! full, and turns the events into one JSON body or a Server-Sent Events stream
//! ([`response`]). A client that goes away drops its receiver, which raises the job's
//! cancel flag; the worker checks it after every committed token, so the model is free
//! again within one speculative round, and `/health` never waits on the model.
//!
//! Across an MLX distributed group ([`group`]), rank 0 runs all of this; before each job
//! it generates, its worker sends the job to the other ranks, which generate it in step.
//!
//! Continuous batching later: the worker's loop is the only place that decides what
//! runs. It would drain every queued job into a set of live sequences and advance them
//! together, one batched verify forward per round over all their drafts (each sequence
//! with its own cache, drafter state and sampler), sending each job's events on its own
//! channel as now; the queue, the events and the HTTP side stay as they are.

mod batching;
pub mod error;
pub mod group;
pub mod request;
pub mod response;
mod routes;
pub mod worker;

use std::sync::Arc;
use std::time::Duration;

use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::error::EngineError;
use routes::{router, AppState};
use worker::Loader;

/// How the server is set up (from `dspec serve`'s flags).
pub struct ServerConfig {
    pub host: String,
    pub port: u16,
    /// The id clients name in `model` and `/v1/models` lists.
    pub model_id: String,
    /// Requests waiting beyond the one being generated; more get 429.
    pub queue_size: usize,
    /// Larger request bodies get 413.
    pub max_body_bytes: usize,
    /// Requests must carry `Authorization: Bearer KEY` (all but `/health`).
    pub api_key: Option<String>,
    /// A request's headers, and then its body, must arrive within this long each; a
    /// client that sends less is cut off, so it cannot hold a connection open.
    pub read_timeout: std::time::Duration,
    /// Connections open at once; more wait to be accepted until one closes.
    pub max_connections: usize,
}

/// How long a stopping server lets requests in flight finish before it cancels them.
pub const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// Loads the model on its thread, then serves until interrupted (Ctrl-C or SIGTERM),
/// and returns once the model thread has finished (in a group: has stopped the others).
pub fn run(config: ServerConfig, load: Loader) -> Result<(), EngineError> {
    let (jobs, queue) = std::sync::mpsc::sync_channel(config.queue_size);
    let worker = worker::spawn(load, queue)?;
    let served = serve_http(config, jobs, &worker.facts);
    // The job queue closed with the HTTP side: the model thread finishes what it has.
    let stopped = worker.join();
    served.and(stopped)
}

/// Serves HTTP until interrupted; every handle on the job queue is gone when it returns.
fn serve_http(
    config: ServerConfig,
    jobs: std::sync::mpsc::SyncSender<worker::Job>,
    facts: &worker::ModelFacts,
) -> Result<(), EngineError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| EngineError::Invalid(format!("starting the HTTP runtime: {e}")))?;
    let state = Arc::new(AppState::new(
        jobs,
        config.model_id.clone(),
        facts.max_context,
        facts.drafter.clone(),
        config.max_body_bytes,
        config.api_key.clone(),
        config.read_timeout,
    ));
    let served = runtime.block_on(async move {
        let listener = TcpListener::bind((config.host.as_str(), config.port))
            .await
            .map_err(|e| {
                EngineError::Invalid(format!(
                    "--host {} --port {}: cannot listen there ({e}); pick a free port or another address",
                    config.host, config.port
                ))
            })?;
        let addr = listener
            .local_addr()
            .map_err(|e| EngineError::Invalid(format!("reading the listening address: {e}")))?;
        // Tests and scripts read this line for the address (with --port 0, the port).
        eprintln!(
            "[dspec] serving {} with drafter {} on http://{addr} (batch {}, queue {})",
            config.model_id, facts.drafter, facts.batch, config.queue_size
        );
        accept(listener, router(state), &config).await;
        Ok(())
    });
    // Ends the tasks still holding the queue, so the model thread sees it close.
    drop(runtime);
    served
}

/// Serves every connection accepted until interrupted, each through hyper with a
/// deadline on its request headers, at most `max_connections` at once; then lets the
/// requests in flight finish for up to [`SHUTDOWN_GRACE`] and cancels the rest (a
/// dropped request cancels its generation).
async fn accept(listener: TcpListener, app: axum::Router, config: &ServerConfig) {
    let slots = Arc::new(Semaphore::new(config.max_connections));
    let connections = GracefulShutdown::new();
    let mut stop = std::pin::pin!(interrupted());
    loop {
        // A free slot before the next accept: connections past the limit wait in the
        // listening socket's backlog.
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => break,
            },
            _ = &mut stop => break,
        };
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors and the like: say so, and try again soon
                    // rather than spin.
                    eprintln!("[dspec] accepting a connection failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = &mut stop => break,
        };
        let connection = http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(config.read_timeout)
            .serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
        let connection = connections.watch(connection);
        tokio::spawn(async move {
            // A client that breaks off is its own business; the request log has it.
            let _ = connection.await;
            drop(slot);
        });
    }
    let open = config.max_connections - slots.available_permits();
    eprintln!(
        "[dspec] shutting down: {open} connection(s) open, waiting up to {} s for requests in flight",
        SHUTDOWN_GRACE.as_secs()
    );
    tokio::select! {
        _ = connections.shutdown() => eprintln!("[dspec] stopped; every request finished"),
        _ = tokio::time::sleep(SHUTDOWN_GRACE) => eprintln!(
            "[dspec] stopped; requests still running after {} s were cancelled",
            SHUTDOWN_GRACE.as_secs()
        ),
    }
}

/// Ctrl-C, or SIGTERM (what service managers and `kill` send): either stops the server
/// the same graceful way, which in a group stops the other ranks too.
async fn interrupted() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}
