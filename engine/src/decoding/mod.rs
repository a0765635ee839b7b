//! The decode loops and what they are made of: plain decoding, speculative decoding with
//! lossless acceptance, sampling, the per-round draft length, queueing verifies ahead,
//! loading a drafter, and what a round costs.

pub mod acceptance;
pub mod draft_length;
pub mod drafting;
pub mod generate;
pub mod logprobs;
pub mod prompt_cache;
pub mod round_cost;
pub mod sampling;
pub mod speculative;
pub mod verify_ahead;
