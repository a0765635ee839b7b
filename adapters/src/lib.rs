//! dspec's built-in target families, one file per config.json `model_type`, each a
//! config → [`transformer::DecoderSpec`] mapping over shared layers, self-registered
//! with `inventory`. To add a family: copy the closest file and adjust.

pub mod attention;
pub mod config;
pub mod fixtures;
// Public (unlike the other families) for its tiny test config, which drafter and
// engine tests build gemma4 targets from.
pub mod gemma4;
pub mod layers;
pub mod lora;
pub mod transformer;

mod gemma;
mod gemma2;
mod gemma3_text;
mod llama;
mod mistral;
mod qwen2;
mod qwen3;

/// Forces the linker to keep this crate (and so its `inventory` registrations) in
/// binaries that otherwise only reach it through the registry.
pub fn link() {}
