//! dspec's engine: everything between a model directory on disk and streamed text —
//! resolving and loading targets, tokenization and chat templates, sampling, the decode loops.
//!
//! Laid out by concern: `loading` (a `--target` to a loaded model and tokenizer, plugins,
//! `--drafter` to a drafter), `text` (tokenizer, chat template, streaming detokenization,
//! stop strings), `decoding` (plain and speculative decoding, sampling, acceptance, draft
//! lengths),
//! `scoring` (log-probabilities), `serve` (the OpenAI-compatible server), `bench`, and
//! `formats` (GGUF reading and conversion, used only by `dspec convert`); `runtime` and
//! `cpu_blas` say what this process runs on. The command line is the binary's `cli`
//! module.

pub mod bench;
pub mod cpu_blas;
pub mod decoding;
pub mod error;
pub mod formats;
pub mod loading;
pub mod runtime;
pub mod scoring;
pub mod serve;
pub mod text;
#[cfg(feature = "test-fixtures")]
pub mod tiny_model;
pub mod training;

pub use error::EngineError;
