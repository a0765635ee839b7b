//! How dspec runs on MLX, below the plugin contract: which backend this process computes
//! on, and slicing that builds one graph node, for the hot path of decoding.
//!
//! The KV cache of `dspec-plugin-api` and the built-in layers of `dspec-adapters` both
//! build on these; neither is part of what a plugin must implement or call.

pub mod backend;
pub mod slicing;

pub use backend::Backend;
