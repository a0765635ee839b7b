//! `dspec serve` with its target split over an MLX distributed group: rank 0 serves HTTP
//! and sends every job it takes to the other ranks (the followers), which generate it
//! alongside, in step, and discard the text.
//!
//! A job is all that decides what a generation computes: the prompt's token ids and the
//! [`GenerationConfig`] with a seed rank 0 chose, serialized as JSON and broadcast. The
//! ranks then agree on everything else by computing it from the same inputs (see
//! [`crate::loading::distributed`]), except cancellation, which only rank 0 knows of:
//! each round asks it through a collective (see [`ServingOptions::cancelled`]).

use serde::{Deserialize, Serialize};

use crate::decoding::generate::GenerationConfig;
use crate::decoding::speculative::{generate_speculative, ServingOptions};
use crate::error::EngineError;
use crate::loading::distributed::Distributed;
use crate::runtime::exit_process;
use crate::serve::worker::Engine;

/// What rank 0 sends the followers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Message {
    /// Generate this, as rank 0 does.
    Job(SharedJob),
    /// Rank 0 stops serving: finish and exit.
    Stop,
}

/// A job as the followers need it: no text, no client, nothing they would have to check.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SharedJob {
    pub prompt: Vec<u32>,
    /// With a concrete seed when sampling: a seed drawn on each rank would draw different
    /// tokens on each.
    pub config: GenerationConfig,
}

/// Rank 0: sends `message` to every follower.
pub fn send(group: &Distributed, message: &Message) -> Result<(), EngineError> {
    let bytes = serde_json::to_vec(message)
        .map_err(|e| EngineError::Invalid(format!("writing a job for the other ranks: {e}")))?;
    group.group().broadcast_bytes(&bytes)?;
    Ok(())
}

/// A follower: the message rank 0 sends next.
pub fn receive(group: &Distributed) -> Result<Message, EngineError> {
    let bytes = group.group().broadcast_bytes(&[])?;
    serde_json::from_slice(&bytes).map_err(|e| {
        EngineError::Invalid(format!(
            "rank 0 sent a job this rank cannot read ({e}); every rank must run the same \
             dspec build"
        ))
    })
}

/// Checks that every rank was started with the same serving settings: ranks that draft
/// differently or keep different prompt caches would fall out of step.
pub fn check_settings(group: &Distributed, engine: &Engine) -> Result<(), EngineError> {
    let info = engine.loaded.model.info();
    let settings = format!(
        "{} {} {} {:?} {:?} {}",
        engine.drafter.name(),
        engine.max_draft,
        engine.adaptive,
        engine.verify_ahead,
        info.dtype,
        engine.prompt_cache.usage().budget_bytes,
    );
    group.check_same(
        "serving settings (drafter, --max-draft, --verify-ahead, --dtype, --prompt-cache-bytes)",
        settings.as_bytes(),
    )
}

/// Checks, before the ranks compute anything for `prompt`, that every rank's prompt cache
/// will reuse the same prefix of it: ranks that read prompts of different lengths would
/// exchange activations of different shapes. They should: each cache saw the same
/// requests and took the same decisions, and its entries weigh the same bytes on every
/// rank (each rank caches its own share of the KV heads, and the heads split evenly or
/// the model is refused; the drafter's hidden states are whole on every rank), so the
/// same budget evicts the same entries. This makes sure of it at the price of one small
/// collective per request.
pub fn check_in_step(
    group: &Distributed,
    engine: &Engine,
    prompt: &[u32],
) -> Result<(), EngineError> {
    let with_hidden = !engine.drafter.taps().is_empty();
    let plan = format!(
        "{} {:?}",
        engine.prompt_cache.reusable(prompt, with_hidden),
        engine.prompt_cache.usage()
    );
    group.check_same(
        "prompt cache contents (the ranks fell out of step)",
        plan.as_bytes(),
    )
}

/// Rank 0: hands `job` to the followers before generating it.
pub fn lead(group: &Distributed, engine: &Engine, job: SharedJob) -> Result<(), EngineError> {
    let prompt = job.prompt.clone();
    send(group, &Message::Job(job))?;
    check_in_step(group, engine, &prompt)
}

/// Ends rank 0 when the group failed under it: the followers can no longer be trusted to
/// be in step with it, and a server that went on would answer wrongly or hang. They exit
/// in turn when they find rank 0 gone.
pub fn abandon(group: &Distributed, error: &EngineError) -> ! {
    eprintln!(
        "error: {}: {error}; the server stops, since the ranks can no longer serve together",
        group.describe_failure()
    );
    exit_process(1)
}

/// A follower once loaded: waits for rank 0's next job and generates it in step, until
/// rank 0 stops.
pub fn follow(engine: &mut Engine, group: &Distributed) -> Result<(), EngineError> {
    loop {
        {
            // A server may be idle for days: no timeout, no core kept busy.
            let _idle = group.idle();
            group.wait_for_root();
        }
        let _watch = group.watch();
        let job = match receive(group)? {
            Message::Stop => return Ok(()),
            Message::Job(job) => job,
        };
        check_in_step(group, engine, &job.prompt)?;
        // Rank 0 alone knows whether its client left; it says so in this collective.
        let cancelled = || Ok(group.group().any(false)?);
        let (loaded, speculation, prompt_cache) = engine.parts();
        generate_speculative(
            loaded.model.as_ref(),
            &loaded.tokenizer,
            &job.prompt,
            &job.config,
            speculation,
            &mut |_| {},
            ServingOptions {
                cancelled: Some(&cancelled),
                prompt_cache: Some(prompt_cache),
                // Log-probabilities are read from logits every rank has and decide
                // nothing: only rank 0, which answers, computes them.
                logprobs: None,
                on_logprobs: None,
            },
        )?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decoding::sampling::SamplingParams;

    /// What the followers read is what rank 0 sent, to the bit: floats, a seed past
    /// 2^53, stop strings with any characters.
    #[test]
    fn messages_read_back_exactly() {
        let job = SharedJob {
            prompt: vec![0, 1, u32::MAX],
            config: GenerationConfig {
                max_tokens: 7,
                sampling: SamplingParams {
                    temperature: 0.7,
                    top_k: 40,
                    top_p: 0.95,
                    min_p: 0.05,
                    seed: Some(u64::MAX - 3),
                },
                stop_strings: vec!["\n\n".into(), "é\"}".into()],
                eos_ids: vec![2, 151_645],
            },
        };
        for message in [Message::Job(job), Message::Stop] {
            let bytes = serde_json::to_vec(&message).expect("serialize");
            let back: Message = serde_json::from_slice(&bytes).expect("deserialize");
            assert_eq!(back, message);
        }
    }

    /// JSON writes an f32 as its shortest decimal, read back through f64: the same bits
    /// over a sweep of the values sampling settings take.
    #[test]
    fn sampling_floats_survive_json_bit_for_bit() {
        let mut bits = 0f32.to_bits();
        while bits < 100f32.to_bits() {
            let x = f32::from_bits(bits);
            let text = serde_json::to_string(&x).expect("serialize");
            let back: f32 = serde_json::from_str(&text).expect("deserialize");
            assert_eq!(back.to_bits(), bits, "{x:e} written as {text}");
            bits += 4099;
        }
    }
}
