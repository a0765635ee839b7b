//! dspec's built-in target families, one file per config.json `model_type`, each a
//! config → [`transformer::DecoderSpec`] mapping over shared layers (or, for the hybrid
//! linear-attention families, a [`hybrid::HybridSpec`]), self-registered with
//! `inventory`. To add a family: copy the closest file and adjust. Mixture-of-experts
//! families (`qwen3_moe`, and the hybrids' sparse configs) put [`layers::SparseMoe`] in
//! place of the dense MLP on their sparse layers.
//!
//! Modules depend one way: [`layers`] ← [`attention`] ← [`transformer`] ← [`config`] ←
//! the family files and [`lora`]; [`layers`] ← [`gated_delta`] ← [`hybrid`] ← the hybrid
//! family files (`qwen3_5`, `qwen3_next`); [`continuation`] (how a verify's positions are
//! laid out) sits between [`attention`] and both decoders; [`weights`] (the safetensors loader) sits
//! under `config` and `lora`; [`tensor_parallel`] splits [`transformer`]'s decoder
//! across an MLX distributed group; [`cuda`] (dspec's CUDA kernels for short
//! continuations) sits under [`layers`] and [`attention`].

pub mod attention;
pub mod batch;
pub mod config;
pub mod continuation;
pub mod cpu_attention;
pub mod cuda;
#[cfg(any(test, feature = "test-fixtures"))]
pub mod fixtures;
pub mod gated_delta;
pub mod hybrid;
pub mod layers;
pub mod lora;
pub mod pooled_attention;
pub mod tensor_parallel;
pub mod transformer;
pub mod weights;

mod gemma;
mod gemma2;
mod gemma3_text;
mod gemma4;
mod llama;
mod mistral;
mod qwen2;
mod qwen3;
mod qwen3_5;
mod qwen3_5_moe;
mod qwen3_moe;
mod qwen3_next;

/// Forces the linker to keep this crate (and so its `inventory` registrations) in
/// binaries that otherwise only reach it through the registry.
pub fn link() {}
