//! The model thread's loop when requests are decoded together (continuous batching):
//! jobs join the batch as they arrive, up to `--max-batch` at once (the rest wait in the
//! bounded queue, and past it the HTTP side answers 429); every step of the
//! [`BatchDecoder`] advances all of them, and each job's events go out on its own
//! channel as the one-at-a-time loop sends them. A client that goes away leaves the
//! batch before the next step; a request the model cannot take is refused as it joins.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;

use axum::http::StatusCode;
use tokio::sync::mpsc::UnboundedSender;

use crate::decoding::batch::{BatchDecoder, NewSequence, Progress, SequenceId};
use crate::decoding::prompt_cache::PromptCache;
use crate::decoding::speculative::store_sequence;
use crate::loading::LoadedModel;
use crate::serve::error::ApiError;
use crate::serve::worker::{
    call_parser, choices, generation_config, log_cancelled, prepare, send_done, send_text, Engine,
    Event, Job, Outcome,
};
use crate::text::chat_template::ChatTemplate;
use crate::text::tool_calls::ToolCallStream;

/// A job in the batch: where its events go, and what its output passes through.
struct Live {
    events: UnboundedSender<Event>,
    cancel: Arc<AtomicBool>,
    parser: Option<ToolCallStream>,
    max_tokens: usize,
    generated: usize,
}

/// Serves every job on `jobs` until the queue closes and the batch has drained.
pub(super) fn serve_together(
    engine: &mut Engine,
    template: &Result<ChatTemplate, String>,
    jobs: &Receiver<Job>,
) {
    let mut live: HashMap<SequenceId, Live> = HashMap::new();
    let mut open = true;
    // The batch borrows the model; the prompt cache is borrowed apart.
    let Engine {
        loaded,
        drafter,
        prompt_cache,
        max_draft,
        max_batch,
        default_max_tokens,
        ..
    } = engine;
    let loaded: &LoadedModel = loaded;
    let mut batch = BatchDecoder::new(loaded.model.as_ref(), &loaded.tokenizer, *max_draft);
    let facts = JoinFacts {
        loaded,
        template,
        max_batch: *max_batch,
        default_max_tokens: *default_max_tokens,
    };
    loop {
        // Wait for work when there is none; otherwise take what has arrived, up to a full
        // batch.
        while open && live.len() < facts.max_batch {
            let job = match live.is_empty() {
                true => jobs.recv().map_err(|_| TryRecvError::Disconnected),
                false => jobs.try_recv(),
            };
            match job {
                Ok(job) => {
                    let joined = catch_unwind(AssertUnwindSafe(|| {
                        join(&mut batch, drafter.as_ref(), prompt_cache, &facts, job)
                    }));
                    if let Ok(Some((id, job))) = joined {
                        live.insert(id, job);
                    }
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => open = false,
            }
        }
        // Clients that went away leave before the step.
        live.retain(|&id, job| {
            let gone = job.cancel.load(Ordering::Relaxed);
            if gone {
                batch.cancel(id);
                log_cancelled(job.generated, job.max_tokens);
            }
            !gone
        });
        if live.is_empty() {
            if open {
                continue;
            }
            return;
        }
        match catch_unwind(AssertUnwindSafe(|| batch.step())) {
            Ok(Ok(progress)) => {
                for p in progress {
                    deliver(&mut live, prompt_cache, &loaded.tokenizer, p);
                }
            }
            failed => {
                // A step is every job's: none of them can go on.
                let message = match failed {
                    Ok(Err(e)) => format!("generation failed: {e}"),
                    _ => "dspec failed on this request (an internal error; see the server's log)"
                        .to_string(),
                };
                for (id, job) in live.drain() {
                    batch.cancel(id);
                    let _ = job.events.send(Event::Failed(ApiError::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        message.clone(),
                    )));
                }
            }
        }
    }
}

/// What every joining job is checked against.
struct JoinFacts<'t> {
    loaded: &'t LoadedModel,
    template: &'t Result<ChatTemplate, String>,
    max_batch: usize,
    default_max_tokens: usize,
}

/// Starts `job` in the batch, or answers why it cannot start.
fn join(
    batch: &mut BatchDecoder,
    drafter: &dyn dspec_plugin_api::Drafter,
    prompt_cache: &mut PromptCache,
    facts: &JoinFacts,
    job: Job,
) -> Option<(SequenceId, Live)> {
    let Job {
        request,
        events,
        cancel,
    } = job;
    // A client that left while queued costs nothing.
    if cancel.load(Ordering::Relaxed) {
        return None;
    }
    let prepared = prepare(
        facts.loaded,
        facts.default_max_tokens,
        facts.template,
        &request,
    );
    let (prompt, max_tokens) = match prepared {
        Ok(p) => p,
        Err(e) => {
            let _ = events.send(Event::Failed(e));
            return None;
        }
    };
    let config = generation_config(&facts.loaded.tokenizer, &request, max_tokens);
    // A block drafter reads the target's states at every position: a stored cache
    // serves it where its states were kept too.
    let reused = prompt_cache.take(&prompt, !drafter.taps().is_empty());
    let joined = batch.add(NewSequence {
        prompt,
        config,
        drafter: drafter.fork(),
        logprobs: request.logprobs,
        reused,
    });
    let id = match joined {
        Ok(id) => id,
        Err(e) => {
            let _ = events.send(Event::Failed(ApiError::invalid(
                request.prompt.param(),
                e.to_string(),
            )));
            return None;
        }
    };
    if events.send(Event::Started).is_err() {
        batch.cancel(id);
        return None;
    }
    Some((
        id,
        Live {
            events,
            cancel,
            parser: call_parser(facts.template, &request),
            max_tokens,
            generated: 0,
        },
    ))
}

/// Sends what a step did for one job on: its text (through its tool-call parser), its
/// log-probabilities and, when it finished, its end; a finished sequence's cache goes
/// to the prompt cache. A job whose client is gone is marked to leave.
fn deliver(
    live: &mut HashMap<SequenceId, Live>,
    prompt_cache: &mut PromptCache,
    tokenizer: &crate::text::tokenizer::TextTokenizer,
    progress: Progress,
) {
    let Some(job) = live.get_mut(&progress.id) else {
        return;
    };
    job.generated += progress.tokens;
    if !send_text(&job.events, job.parser.as_mut(), &progress.text) {
        job.cancel.store(true, Ordering::Relaxed);
    }
    if !progress.logprobs.is_empty() {
        let _ = job
            .events
            .send(Event::Logprobs(choices(tokenizer, &progress.logprobs)));
    }
    let Some(finished) = progress.finished else {
        return;
    };
    let Some(job) = live.remove(&progress.id) else {
        return;
    };
    let finished = *finished;
    let logprobs = finished.logprobs.as_deref().map(|l| choices(tokenizer, l));
    // A cache that cannot be stored is only a prompt cache miss later.
    let _ = store_sequence(
        prompt_cache,
        &finished.prompt,
        &finished.tokens,
        finished.cache,
        finished.states,
    );
    send_done(
        &job.events,
        job.parser,
        Outcome {
            text: finished.text,
            stats: finished.stats,
            speculative: finished.speculative,
            prompt_cache: prompt_cache.usage(),
            logprobs,
        },
    );
}
