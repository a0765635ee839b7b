//! The decode loops and what they are made of: what plain and speculative decoding share
//! (`session`), plain decoding, speculative decoding with lossless acceptance, choosing
//! tokens, the per-round draft length, log-probabilities, the prompt cache, and what a
//! round costs. Drafters are loaded in [`crate::loading::drafting`].

pub mod batch;
pub mod draft_length;
pub mod generate;
pub mod logprobs;
pub mod prompt_cache;
pub mod round_cost;
pub mod sampling;
pub mod session;
pub mod speculative;

// Paths from before the loader and queueing ahead moved, kept for callers outside this
// crate and for `training`, which names them.
pub use crate::loading::drafting;
pub use speculative::pipelined as verify_ahead;
