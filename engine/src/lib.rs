//! dspec's engine: everything between a model directory on disk and streamed text —
//! resolving and loading targets, tokenization and chat templates, sampling, the decode loops.

pub mod chat_template;
pub mod detokenize;
pub mod runtime;
pub mod sampling;
pub mod stop;
pub mod tokenizer;
