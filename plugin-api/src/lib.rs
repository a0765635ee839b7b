//! The contract between dspec's engine and what plugs into it: the `TargetModel` trait
//! a model family implements, the cache it writes (keys and values, or recurrent
//! state) and rolls back, the `WeightSource` it loads its tensors through, the
//! `Drafter` trait, the registries both kinds join, the C ABI of dylib plugins, and
//! the conformance checker every `TargetModel` must pass.
//!
//! Built-in families (crate `dspec-adapters`) and external plugins implement these;
//! the engine only ever talks to a `Box<dyn TargetModel>`. External plugins cross a
//! C ABI ([`plugin`]) and are wrapped back into the same trait. Implementations of the
//! contract (the safetensors loader, backend detection, test fixtures) live in the
//! crates that use them, so that changing one never changes what plugins build against.

pub mod cache;
pub mod conformance;
pub mod drafter;
pub mod error;
pub mod kv_pool;
pub mod plugin;
pub mod registry;
pub mod target;
pub mod weights;

pub use cache::{ExternalCache, KvCache, LayerCache, ModelCache, RecurrentCache};
pub use drafter::{
    detect_drafter_kind, drafter_kind_by_name, drafter_kinds, Agreement, Draft, DraftAhead,
    Drafter, DrafterLoadRequest, DrafterOptions, DrafterRegistration, Picked, TokenPicker,
};
pub use error::ModelError;
pub use kv_pool::{KvPool, PoolView, LONGEST_POOLED};
pub use registry::{AdapterRegistration, AdapterRegistry, AdapterSource, Detection};
pub use target::{
    BatchRow, ForwardOutput, LoadOptions, LoadRequest, ModelInfo, Quantization, RowOutput,
    TargetModel,
};
pub use weights::{LoraUpdate, Part, WeightSource};

/// Re-exported so adapter crates and plugins submit registrations with the same
/// `inventory` instance the engine collects from.
pub use inventory;
/// Re-exported so plugins use the exact mlx-rs version the host was built with.
pub use mlx_rs;
