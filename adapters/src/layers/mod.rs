//! Building blocks shared by every family: linear and embedding layers (dense or
//! MLX-quantized), RMSNorm, rotary embeddings with the HF scaling variants, gated MLPs.
//!
//! One concept per file. The model-facing layers ([`Linear`], [`Embedding`],
//! [`RmsNorm`], [`Rope`], [`GatedMlp`], [`SparseMoe`]) sit over how their products are computed:
//! MLX's affine quantization (`quantized`), dense products (`dense`) and the two rules
//! that keep speculative decoding exact, the row layout (`row_layout`) and the CPU's
//! BLAS layout and padding (`cpu_layout`).

mod activation;
mod cpu_layout;
mod dense;
mod embedding;
mod experts;
mod feed_forward;
mod linear;
mod lora_delta;
mod mlp;
mod norm;
mod parallel;
mod quantized;
mod rope;
mod row_layout;
mod views;

pub use activation::{softcap, Activation};
pub use embedding::Embedding;
pub use experts::{ExpertsSpec, SparseMoe};
pub use feed_forward::{FeedForward, FeedForwardSpec};
pub use linear::Linear;
pub use mlp::GatedMlp;
pub use norm::{rms_norm_unscaled, NormWeight, RmsNorm};
pub use parallel::Split;
pub use rope::Rope;
pub use row_layout::is_row_layout;
pub use views::{seq_slice, split_last};
