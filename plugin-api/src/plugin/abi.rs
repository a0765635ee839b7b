//! The C ABI between dspec and an adapter plugin: one entry point, a `#[repr(C)]`
//! descriptor, and a table of C functions over opaque handles. Nothing Rust-specific
//! crosses it; tensors cross as mlx-c `mlx_array` handles of the one shared libmlx.
//!
//! # Versioning
//!
//! [`ABI_VERSION`] changes whenever anything in this file changes meaning or layout,
//! and whenever the MLX / mlx-c pair changes (the plugin's mlx-c copy must agree with
//! the host's on what an `mlx_array` points to). The host accepts exactly its own
//! version. The descriptor starts with its size and the version, in that order, in
//! every ABI version ever, so any host can read them and refuse a plugin cleanly.
//!
//! Within a version the descriptor grows only at its end, by optional entries (NULL
//! means what the version meant without them). `struct_size` says which ones a plugin
//! was built with: the host reads only what it covers and treats the rest as NULL, and
//! ignores entries past its own layout (a plugin built against a newer
//! dspec-plugin-api of the same version). So plugins built before an entry existed keep
//! loading, and so do newer plugins in older hosts. The first layout of v1 ends with
//! `functions` ([`V1_DESCRIPTOR_SIZE`]); [`RollbackFunctions`] came after it.
//!
//! # Calls
//!
//! Every function except the `free_*` ones returns a [`Status`]. On anything but
//! [`STATUS_OK`] the plugin may store an error message in `*error`: a NUL-terminated
//! UTF-8 string it allocated, which the host copies and hands back to `free_error`.
//! Out-parameters are written only on success. A panic must never unwind into the
//! host: the Rust shims of [`export_plugin!`](crate::export_plugin) catch it and
//! return [`STATUS_PANIC`].
//!
//! # Ownership of tensors
//!
//! - Input `mlx_array`s (tokens, hidden states) are *borrowed*: the plugin must not
//!   free them; to keep one it takes its own reference (`mlx_array_set`).
//! - Output `mlx_array`s (logits, taps, embeddings, cache state) are *new references
//!   owned by the host*, which frees each with `mlx_array_free`. An output the plugin
//!   has nothing for (hidden states without taps) is written as `{ ctx: NULL }`.
//!
//! # Handles
//!
//! A model handle (from `load`) lives until `free_model`; a cache handle (from
//! `new_cache`) until `free_cache`, and the host frees every cache of a model before
//! the model. Handles are used by one thread at a time, but possibly by different
//! threads over their life.

use std::ffi::{c_char, c_void};

pub use mlx_sys::mlx_array;

/// The ABI this build of dspec speaks. See the module docs for when it changes.
pub const ABI_VERSION: u32 = 1;

/// The one symbol a plugin exports, of type [`EntryFn`].
pub const ENTRY_SYMBOL: &str = "dspec_plugin_descriptor";

/// The entry point: returns a descriptor that stays valid for the life of the process.
pub type EntryFn = unsafe extern "C" fn() -> *const PluginDescriptor;

/// Result of a call across the boundary.
pub type Status = i32;
pub const STATUS_OK: Status = 0;
/// The call failed; `*error` says why.
pub const STATUS_ERROR: Status = 1;
/// The plugin panicked (caught on its side); `*error` holds the panic message.
pub const STATUS_PANIC: Status = 2;

/// Where the plugin stores an error message it allocated (may be left NULL).
pub type ErrorOut = *mut *mut c_char;

/// Opaque handle of a loaded model.
pub type ModelHandle = *mut c_void;
/// Opaque handle of one KV cache of a model.
pub type CacheHandle = *mut c_void;

/// The first two fields of every [`PluginDescriptor`], in every ABI version: what a
/// host reads before anything else.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DescriptorHeader {
    /// `size_of::<PluginDescriptor>()` as the plugin was compiled.
    pub struct_size: u32,
    pub abi_version: u32,
}

/// What the entry point returns. All strings are NUL-terminated UTF-8 and, like the
/// descriptor itself, live as long as the process.
#[repr(C)]
pub struct PluginDescriptor {
    /// `size_of::<PluginDescriptor>()` as the plugin was compiled.
    pub struct_size: u32,
    pub abi_version: u32,
    /// Plugin name, shown in `dspec adapters` (e.g. `example-phi3`).
    pub name: *const c_char,
    /// Plugin version, free-form (usually its crate version).
    pub version: *const c_char,
    /// config.json `model_type` values the plugin loads.
    pub model_types: *const *const c_char,
    pub model_types_len: usize,
    /// HF `architectures` entries, consulted when no model_type matches.
    pub architectures: *const *const c_char,
    pub architectures_len: usize,
    pub functions: PluginFunctions,
    /// Optional, after v1's first layout: how far back a cache can roll.
    pub rollback: RollbackFunctions,
}

/// `struct_size` of v1's first layout (everything up to `functions`): the least a v1
/// descriptor may be.
pub const V1_DESCRIPTOR_SIZE: usize = std::mem::offset_of!(PluginDescriptor, rollback);

/// A cache's rollback contract, for plugins whose caches cannot forget every position
/// they hold (recurrent state keeps a bounded window of past states). Both entries are
/// optional. Without `rollback_limit` the host takes a cache to be able to forget
/// everything it holds, and learns otherwise only from a failing `cache_trim`; without
/// `set_rollback_window` it never says how far it will roll back.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct RollbackFunctions {
    pub rollback_limit: Option<CacheRollbackLimitFn>,
    pub set_rollback_window: Option<CacheSetRollbackWindowFn>,
}

/// How the user asked the weights to be loaded (`LoadOptions` in C).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct LoadOptionsC {
    /// An `mlx_dtype` value to cast float weights to, or -1 to keep the checkpoint's.
    pub dtype: i32,
    /// Quantize on load to this many bits; 0 = no.
    pub quantize_bits: i32,
    pub quantize_group_size: i32,
}

/// Called by the plugin while weights load: (context, tensors loaded, tensors total).
pub type ProgressFn = unsafe extern "C" fn(ctx: *mut c_void, done: usize, total: usize);

/// `ModelInfo` in C.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ModelInfoC {
    /// Owned by the model; valid until `free_model`.
    pub model_type: *const c_char,
    pub num_layers: usize,
    pub hidden_size: usize,
    pub vocab_size: usize,
    /// An `mlx_dtype` value.
    pub dtype: u32,
    /// Bits of quantized linear layers; 0 = not quantized.
    pub quantized_bits: i32,
    /// Longest context the config declares; 0 = not declared.
    pub max_context: usize,
}

/// Frees an error message the plugin stored in an [`ErrorOut`].
pub type FreeErrorFn = unsafe extern "C" fn(message: *mut c_char);
/// Loads the model in `dir` (UTF-8 path) whose parsed config.json is `config_json`.
/// `progress` may be NULL.
pub type LoadFn = unsafe extern "C" fn(
    dir: *const c_char,
    config_json: *const c_char,
    options: *const LoadOptionsC,
    progress: Option<ProgressFn>,
    progress_ctx: *mut c_void,
    out_model: *mut ModelHandle,
    error: ErrorOut,
) -> Status;
pub type FreeModelFn = unsafe extern "C" fn(model: ModelHandle);
pub type ModelInfoFn =
    unsafe extern "C" fn(model: ModelHandle, out: *mut ModelInfoC, error: ErrorOut) -> Status;
/// A fresh, empty cache for `model`.
pub type NewCacheFn = unsafe extern "C" fn(
    model: ModelHandle,
    out_cache: *mut CacheHandle,
    error: ErrorOut,
) -> Status;
pub type FreeCacheFn = unsafe extern "C" fn(cache: CacheHandle);
/// Tokens the cache holds.
pub type CacheOffsetFn =
    unsafe extern "C" fn(cache: CacheHandle, out: *mut usize, error: ErrorOut) -> Status;
/// Forgets the last `n` positions; `*out_trimmed` = how many were dropped. The host
/// asks for no more than the cache holds, nor more than [`CacheRollbackLimitFn`]
/// allows when the plugin has it, and counts anything but `n` dropped as a failure. A
/// cache that cannot go back `n` positions (recurrent state keeps only a window of past
/// states) fails the call with `STATUS_ERROR` and a message saying how far it can go,
/// and drops nothing. A plugin without [`RollbackFunctions`] can say so only through
/// that failure, which ends the generation with the plugin's message (the shims of
/// `export_plugin!` do all this through `ModelCache::trim`).
pub type CacheTrimFn = unsafe extern "C" fn(
    cache: CacheHandle,
    n: usize,
    out_trimmed: *mut usize,
    error: ErrorOut,
) -> Status;
/// The arrays backing the cache: `*out_len` = how many there are; the first
/// `min(len, capacity)` are written to `out` (new references, host-owned).
pub type CacheStateFn = unsafe extern "C" fn(
    cache: CacheHandle,
    out: *mut mlx_array,
    capacity: usize,
    out_len: *mut usize,
    error: ErrorOut,
) -> Status;
/// `TargetModel::forward`: `tokens` `[1, L]`; `taps` decoder layer ids (may be NULL
/// when `taps_len` is 0). `*out_hidden` is `{ NULL }` when no taps were asked for.
pub type ForwardFn = unsafe extern "C" fn(
    model: ModelHandle,
    cache: CacheHandle,
    tokens: mlx_array,
    taps: *const usize,
    taps_len: usize,
    out_logits: *mut mlx_array,
    out_hidden: *mut mlx_array,
    error: ErrorOut,
) -> Status;
/// How far back the cache can go: `*out_limit` = how many of the latest positions a
/// trim can forget now (at most what the cache holds); `*out_window` = how many it can
/// always forget after any forward once it holds that many, or `SIZE_MAX` when nothing
/// bounds it but what it holds (keys and values). `ModelCache::rollback_limit` and
/// `ModelCache::rollback_window` in C.
pub type CacheRollbackLimitFn = unsafe extern "C" fn(
    cache: CacheHandle,
    out_limit: *mut usize,
    out_window: *mut usize,
    error: ErrorOut,
) -> Status;
/// The host will trim no more than `positions` after a forward: a cache that keeps
/// past states for rolling back keeps that many from now on (a cache whose window is
/// fixed may keep fewer, and says so through [`CacheRollbackLimitFn`]).
/// `ModelCache::set_rollback_window` in C.
pub type CacheSetRollbackWindowFn =
    unsafe extern "C" fn(cache: CacheHandle, positions: usize, error: ErrorOut) -> Status;
/// One array in, one out: `embed` (`[1, L] -> [1, L, hidden]`), `lm_head`
/// (`[.., hidden] -> [.., vocab]`) and `final_norm`.
pub type ArrayFn = unsafe extern "C" fn(
    model: ModelHandle,
    input: mlx_array,
    out: *mut mlx_array,
    error: ErrorOut,
) -> Status;

/// The plugin's functions. `Option` is a nullable C function pointer; every entry
/// must be set, which the host checks before calling any.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct PluginFunctions {
    pub free_error: Option<FreeErrorFn>,
    pub load: Option<LoadFn>,
    pub free_model: Option<FreeModelFn>,
    pub model_info: Option<ModelInfoFn>,
    pub new_cache: Option<NewCacheFn>,
    pub free_cache: Option<FreeCacheFn>,
    pub cache_offset: Option<CacheOffsetFn>,
    pub cache_trim: Option<CacheTrimFn>,
    pub cache_state: Option<CacheStateFn>,
    pub forward: Option<ForwardFn>,
    pub embed: Option<ArrayFn>,
    pub lm_head: Option<ArrayFn>,
    pub final_norm: Option<ArrayFn>,
}

/// The "no array" value of an output slot.
pub fn null_array() -> mlx_array {
    mlx_array {
        ctx: std::ptr::null_mut(),
    }
}
