//! dspec's engine: everything between a model directory on disk and streamed text —
//! resolving and loading targets, tokenization and chat templates, sampling, the decode loops.

pub mod acceptance;
pub mod bench;
pub mod chat_template;
pub mod convert;
pub mod detokenize;
pub mod draft_length;
pub mod drafting;
pub mod error;
pub mod generate;
pub mod gguf;
pub mod loading;
pub mod model_source;
pub mod plugins;
pub mod runtime;
pub mod sampling;
pub mod score_batch;
pub mod scoring;
pub mod speculative;
pub mod stop;
pub mod tiny_model;
pub mod tokenizer;

pub use error::EngineError;
