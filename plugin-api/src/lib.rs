//! The stable contract between dspec's engine and model families: the `TargetModel`
//! trait, the KV cache, weight loading by HF tensor name, and the adapter registry.
//!
//! Built-in families (crate `dspec-adapters`) and external plugins implement these;
//! the engine only ever talks to a `Box<dyn TargetModel>`. External plugins cross a
//! C ABI ([`plugin`]) and are wrapped back into the same trait.

pub mod backend;
pub mod cache;
pub mod conformance;
pub mod drafter;
pub mod error;
pub mod plugin;
pub mod registry;
pub mod slicing;
pub mod target;
pub mod weights;

pub use cache::{ExternalCache, KvCache, ModelCache};
pub use drafter::{
    detect_drafter_kind, drafter_kind_by_name, drafter_kinds, Draft, DraftAhead, Drafter,
    DrafterLoadRequest, DrafterOptions, DrafterRegistration, Picked, TokenPicker,
};
pub use error::ModelError;
pub use registry::{AdapterRegistration, AdapterRegistry, AdapterSource, Detection};
pub use target::{ForwardOutput, LoadOptions, LoadRequest, ModelInfo, Quantization, TargetModel};
pub use weights::{LoraUpdate, WeightSource, Weights};

/// Re-exported so adapter crates and plugins submit registrations with the same
/// `inventory` instance the engine collects from.
pub use inventory;
/// Re-exported so plugins use the exact mlx-rs version the host was built with.
pub use mlx_rs;
