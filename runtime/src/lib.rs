//! How dspec runs on MLX, below the plugin contract: which backend this process computes
//! on (and, on the CPU, which BLAS kernels), dspec's own softmax and SiLU kernels for the
//! CPU, slicing that builds one graph node, for the hot path of decoding, MLX's
//! distributed groups and collectives, and where dspec keeps files of its own.
//!
//! The KV cache of `dspec-plugin-api` and the built-in layers of `dspec-adapters` both
//! build on these; neither is part of what a plugin must implement or call.

pub mod backend;
pub mod blas;
pub mod cpu_kernels;
pub mod distributed;
pub mod files;
pub mod host_transpose;
pub mod slicing;

pub use backend::Backend;
