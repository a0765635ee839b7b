//! The host side of the ABI: opens a plugin library, checks its descriptor (ABI
//! version first), and wraps its models and caches as `TargetModel` / `ModelCache`,
//! so that every plugin failure, panics included, reaches the engine as an `Err`.

use std::any::Any;
use std::ffi::{c_char, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use mlx_rs::{Array, Dtype};

use crate::cache::{ExternalCache, ModelCache};
use crate::error::{ModelError, Result};
use crate::plugin::abi::{
    mlx_array, null_array, ArrayFn, CacheHandle, CacheOffsetFn, CacheStateFn, CacheTrimFn,
    DescriptorHeader, EntryFn, ForwardFn, FreeCacheFn, FreeErrorFn, FreeModelFn, LoadFn,
    LoadOptionsC, ModelHandle, ModelInfoC, ModelInfoFn, NewCacheFn, PluginDescriptor, Status,
    ABI_VERSION, ENTRY_SYMBOL, STATUS_OK, STATUS_PANIC,
};
use crate::registry::{AdapterEntry, AdapterSource};
use crate::target::{ForwardOutput, LoadRequest, ModelInfo, TargetModel};

const AUTHOR_HINT: &str =
    "a dspec plugin is a cdylib that uses dspec_plugin_api::export_plugin! (see examples/adapter-plugin/README.md)";

/// The plugin's function table with every entry checked present.
struct Table {
    free_error: FreeErrorFn,
    load: LoadFn,
    free_model: FreeModelFn,
    model_info: ModelInfoFn,
    new_cache: NewCacheFn,
    free_cache: FreeCacheFn,
    cache_offset: CacheOffsetFn,
    cache_trim: CacheTrimFn,
    cache_state: CacheStateFn,
    forward: ForwardFn,
    embed: ArrayFn,
    lm_head: ArrayFn,
    final_norm: ArrayFn,
}

/// A loaded, checked plugin library. The library itself is never unloaded: models,
/// caches and arrays it made may outlive any owner we could tie it to.
pub struct PluginLibrary {
    path: PathBuf,
    name: String,
    version: String,
    model_types: Vec<String>,
    architectures: Vec<String>,
    table: Table,
}

fn plugin_error(path: &Path, message: impl Into<String>) -> ModelError {
    ModelError::Plugin {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// Reads a descriptor string; `what` names the field for the error.
unsafe fn descriptor_str(path: &Path, ptr: *const c_char, what: &str) -> Result<String> {
    if ptr.is_null() {
        return Err(plugin_error(path, format!("its descriptor has no {what}")));
    }
    CStr::from_ptr(ptr)
        .to_str()
        .map(str::to_string)
        .map_err(|_| plugin_error(path, format!("its descriptor's {what} is not UTF-8")))
}

unsafe fn descriptor_strs(
    path: &Path,
    ptr: *const *const c_char,
    len: usize,
    what: &str,
) -> Result<Vec<String>> {
    if len == 0 {
        return Ok(Vec::new());
    }
    if ptr.is_null() {
        return Err(plugin_error(path, format!("its descriptor has no {what}")));
    }
    (0..len)
        .map(|i| descriptor_str(path, *ptr.add(i), what))
        .collect()
}

/// Opens the plugin at `path` and checks it: a shared library, exporting the entry
/// point, speaking this ABI version, with a complete function table. The library
/// stays loaded for the rest of the process.
pub fn load_plugin(path: &Path) -> Result<Arc<PluginLibrary>> {
    if !path.is_file() {
        return Err(plugin_error(path, "no such file"));
    }
    // SAFETY: loading runs the library's initialisers; that is the trust a user gives
    // a plugin by naming it. Nothing else is touched before the checks below.
    let library = unsafe { libloading::Library::new(path) }.map_err(|e| {
        plugin_error(
            path,
            format!("cannot be loaded as a shared library ({e}); {AUTHOR_HINT}"),
        )
    })?;
    let entry: EntryFn = unsafe {
        let symbol = library
            .get::<EntryFn>(format!("{ENTRY_SYMBOL}\0").as_bytes())
            .map_err(|_| {
                plugin_error(
                    path,
                    format!(
                        "is a shared library but not a dspec plugin: it does not export `{ENTRY_SYMBOL}`; {AUTHOR_HINT}"
                    ),
                )
            })?;
        *symbol
    };
    // The library must outlive every function pointer and string taken from it, which
    // live as long as the process: never unload it.
    std::mem::forget(library);

    let descriptor = unsafe { entry() };
    if descriptor.is_null() {
        return Err(plugin_error(
            path,
            format!("`{ENTRY_SYMBOL}` returned no descriptor (the plugin failed to start)"),
        ));
    }
    // Only the header is read until the version is known to match.
    let header = unsafe { *(descriptor as *const DescriptorHeader) };
    if header.abi_version != ABI_VERSION {
        let fix = if header.abi_version > ABI_VERSION {
            "use a newer dspec, or rebuild the plugin against this dspec's dspec-plugin-api"
        } else {
            "rebuild the plugin against this dspec's dspec-plugin-api"
        };
        return Err(plugin_error(
            path,
            format!(
                "built for plugin ABI v{}, but this dspec speaks ABI v{ABI_VERSION}; {fix} ({})",
                header.abi_version,
                env!("CARGO_PKG_VERSION")
            ),
        ));
    }
    let expected = std::mem::size_of::<PluginDescriptor>();
    if (header.struct_size as usize) < expected {
        return Err(plugin_error(
            path,
            format!(
                "its descriptor is {} bytes, smaller than ABI v{ABI_VERSION}'s {expected}; rebuild the plugin",
                header.struct_size
            ),
        ));
    }
    let d = unsafe { &*descriptor };
    let name = unsafe { descriptor_str(path, d.name, "name")? };
    let version = unsafe { descriptor_str(path, d.version, "version")? };
    let model_types =
        unsafe { descriptor_strs(path, d.model_types, d.model_types_len, "model_types")? };
    let architectures =
        unsafe { descriptor_strs(path, d.architectures, d.architectures_len, "architectures")? };
    if name.is_empty() {
        return Err(plugin_error(path, "its descriptor has an empty name"));
    }
    if model_types.is_empty() || model_types.iter().any(String::is_empty) {
        return Err(plugin_error(
            path,
            "its descriptor lists no model_type (or an empty one)",
        ));
    }
    let f = d.functions;
    let missing = |what: &str| plugin_error(path, format!("its function table lacks `{what}`"));
    let table = Table {
        free_error: f.free_error.ok_or_else(|| missing("free_error"))?,
        load: f.load.ok_or_else(|| missing("load"))?,
        free_model: f.free_model.ok_or_else(|| missing("free_model"))?,
        model_info: f.model_info.ok_or_else(|| missing("model_info"))?,
        new_cache: f.new_cache.ok_or_else(|| missing("new_cache"))?,
        free_cache: f.free_cache.ok_or_else(|| missing("free_cache"))?,
        cache_offset: f.cache_offset.ok_or_else(|| missing("cache_offset"))?,
        cache_trim: f.cache_trim.ok_or_else(|| missing("cache_trim"))?,
        cache_state: f.cache_state.ok_or_else(|| missing("cache_state"))?,
        forward: f.forward.ok_or_else(|| missing("forward"))?,
        embed: f.embed.ok_or_else(|| missing("embed"))?,
        lm_head: f.lm_head.ok_or_else(|| missing("lm_head"))?,
        final_norm: f.final_norm.ok_or_else(|| missing("final_norm"))?,
    };
    Ok(Arc::new(PluginLibrary {
        path: path.to_path_buf(),
        name,
        version,
        model_types,
        architectures,
        table,
    }))
}

/// Copies the plugin's error message (and frees it), if it left one.
fn take_message(table: &Table, error: *mut c_char) -> Option<String> {
    if error.is_null() {
        return None;
    }
    let message = unsafe { CStr::from_ptr(error) }
        .to_string_lossy()
        .into_owned();
    unsafe { (table.free_error)(error) };
    Some(message)
}

impl PluginLibrary {
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn version(&self) -> &str {
        &self.version
    }

    pub fn abi_version(&self) -> u32 {
        ABI_VERSION
    }

    pub fn model_types(&self) -> &[String] {
        &self.model_types
    }

    pub fn architectures(&self) -> &[String] {
        &self.architectures
    }

    /// The registry entry that loads this plugin's models.
    pub fn adapter_entry(self: &Arc<Self>) -> AdapterEntry {
        let library = Arc::clone(self);
        AdapterEntry {
            name: format!("{} {}", self.name, self.version),
            model_types: self.model_types.clone(),
            aliases: Vec::new(),
            architectures: self.architectures.clone(),
            source: AdapterSource::Plugin {
                path: self.path.clone(),
                abi_version: ABI_VERSION,
            },
            load: Arc::new(move |request| library.load_model(request)),
        }
    }

    /// Runs one call: `call` gets the error out-pointer and returns the status.
    fn call(&self, what: &str, call: impl FnOnce(*mut *mut c_char) -> Status) -> CallResult {
        let mut error: *mut c_char = std::ptr::null_mut();
        let status = call(&mut error);
        let message = take_message(&self.table, error);
        if status == STATUS_OK {
            return Ok(());
        }
        let message = message.unwrap_or_else(|| "no error message".into());
        let (panicked, message) = if status == STATUS_PANIC {
            (true, format!("{what}: the plugin panicked: {message}"))
        } else {
            (false, format!("{what}: {message}"))
        };
        Err(CallError {
            panicked,
            error: plugin_error(&self.path, message),
        })
    }

    /// Loads a model through the plugin.
    pub fn load_model(self: &Arc<Self>, request: &LoadRequest) -> Result<Box<dyn TargetModel>> {
        let dir = request.dir.to_str().ok_or_else(|| {
            plugin_error(
                &self.path,
                format!(
                    "model paths passed to plugins must be UTF-8: {}",
                    request.dir.display()
                ),
            )
        })?;
        let dir = CString::new(dir)
            .map_err(|_| plugin_error(&self.path, "model path contains a NUL byte"))?;
        let config = CString::new(request.config.to_string())
            .map_err(|_| plugin_error(&self.path, "config.json contains a NUL byte"))?;
        let options = LoadOptionsC {
            dtype: request.options.dtype.map_or(-1, |d| u32::from(d) as i32),
            quantize_bits: request.options.quantize.map_or(0, |q| q.bits),
            quantize_group_size: request.options.quantize.map_or(0, |q| q.group_size),
        };
        // The trampoline gets a pointer to the request's `&dyn Fn`.
        let progress: &&dyn Fn(usize, usize) = &request.progress;
        let mut handle: ModelHandle = std::ptr::null_mut();
        self.call("load", |error| unsafe {
            (self.table.load)(
                dir.as_ptr(),
                config.as_ptr(),
                &options,
                Some(progress_trampoline),
                progress as *const &dyn Fn(usize, usize) as *mut c_void,
                &mut handle,
                error,
            )
        })
        .map_err(|e| e.error)?;
        if handle.is_null() {
            return Err(plugin_error(&self.path, "load succeeded but gave no model"));
        }
        let owned = Arc::new(OwnedModel {
            library: Arc::clone(self),
            handle,
            poisoned: AtomicBool::new(false),
        });
        let info = owned.info()?;
        Ok(Box::new(PluginModel { owned, info }))
    }
}

struct CallError {
    panicked: bool,
    error: ModelError,
}

type CallResult = std::result::Result<(), CallError>;

unsafe extern "C" fn progress_trampoline(ctx: *mut c_void, done: usize, total: usize) {
    if ctx.is_null() {
        return;
    }
    let report = &*(ctx as *const &dyn Fn(usize, usize));
    // The host's callback must not unwind into the plugin either.
    let _ = catch_unwind(AssertUnwindSafe(|| report(done, total)));
}

/// A model handle, freed when the last of its wrapper and caches goes.
struct OwnedModel {
    library: Arc<PluginLibrary>,
    handle: ModelHandle,
    /// Set once the plugin panicked: its state may be broken, so no further calls.
    poisoned: AtomicBool,
}

// SAFETY: the ABI requires handles to be usable from any thread, one at a time; the
// engine never calls one model from two threads at once (`TargetModel` is not `Sync`).
unsafe impl Send for OwnedModel {}
unsafe impl Sync for OwnedModel {}

impl Drop for OwnedModel {
    fn drop(&mut self) {
        unsafe { (self.library.table.free_model)(self.handle) };
    }
}

impl OwnedModel {
    fn call(&self, what: &str, call: impl FnOnce(*mut *mut c_char) -> Status) -> Result<()> {
        if self.poisoned.load(Ordering::Relaxed) {
            return Err(plugin_error(
                &self.library.path,
                format!("{what}: refused, the plugin panicked earlier and its model may be broken"),
            ));
        }
        self.library.call(what, call).map_err(|e| {
            if e.panicked {
                self.poisoned.store(true, Ordering::Relaxed);
            }
            e.error
        })
    }

    fn info(&self) -> Result<ModelInfo> {
        let mut out = ModelInfoC {
            model_type: std::ptr::null(),
            num_layers: 0,
            hidden_size: 0,
            vocab_size: 0,
            dtype: 0,
            quantized_bits: 0,
            max_context: 0,
        };
        self.call("model_info", |error| unsafe {
            (self.library.table.model_info)(self.handle, &mut out, error)
        })?;
        let path = &self.library.path;
        let model_type =
            unsafe { descriptor_str(path, out.model_type, "model info's model_type")? };
        let dtype = Dtype::try_from(out.dtype).map_err(|_| {
            plugin_error(
                path,
                format!("model_info: unknown dtype code {}", out.dtype),
            )
        })?;
        if out.num_layers == 0 || out.hidden_size == 0 || out.vocab_size == 0 {
            return Err(plugin_error(
                path,
                format!("model_info: implausible model ({out:?})"),
            ));
        }
        Ok(ModelInfo {
            model_type,
            num_layers: out.num_layers,
            hidden_size: out.hidden_size,
            vocab_size: out.vocab_size,
            dtype,
            quantized_bits: (out.quantized_bits != 0).then_some(out.quantized_bits),
            max_context: (out.max_context != 0).then_some(out.max_context),
        })
    }

    /// Takes ownership of an output array; `what` names the call for the error.
    fn take(&self, handle: mlx_array, what: &str) -> Result<Array> {
        if handle.ctx.is_null() {
            return Err(plugin_error(
                &self.library.path,
                format!("{what}: succeeded but returned no array"),
            ));
        }
        Ok(unsafe { Array::from_ptr(handle) })
    }

    /// Calls a one-array-in, one-array-out function.
    fn array_call(&self, what: &str, function: ArrayFn, input: &Array) -> Result<Array> {
        let mut out = null_array();
        self.call(what, |error| unsafe {
            function(self.handle, input.as_ptr(), &mut out, error)
        })?;
        self.take(out, what)
    }
}

/// A plugin model as the engine sees it.
struct PluginModel {
    owned: Arc<OwnedModel>,
    info: ModelInfo,
}

impl PluginModel {
    fn plugin_cache<'a>(&self, cache: &'a mut ModelCache) -> Result<&'a mut PluginCache> {
        let not_ours = || {
            ModelError::Unsupported(format!(
                "cache was not made by this model (plugin {})",
                self.owned.library.path.display()
            ))
        };
        let cache = cache
            .external_mut()
            .and_then(|c| c.as_any_mut().downcast_mut::<PluginCache>())
            .ok_or_else(not_ours)?;
        if !Arc::ptr_eq(&cache.model, &self.owned) {
            return Err(not_ours());
        }
        Ok(cache)
    }
}

impl TargetModel for PluginModel {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn new_cache(&self) -> ModelCache {
        let mut handle: CacheHandle = std::ptr::null_mut();
        let made = self.owned.call("new_cache", |error| unsafe {
            (self.owned.library.table.new_cache)(self.owned.handle, &mut handle, error)
        });
        // `new_cache` cannot fail in the trait; a failure is kept and reported by the
        // first call that uses the cache.
        let failure = match made {
            Ok(()) if handle.is_null() => Some(format!(
                "plugin {}: new_cache succeeded but gave no cache",
                self.owned.library.path.display()
            )),
            Ok(()) => None,
            Err(e) => Some(e.to_string()),
        };
        ModelCache::external(Box::new(PluginCache {
            model: Arc::clone(&self.owned),
            handle,
            offset: 0,
            state: Vec::new(),
            state_hint: 2 * self.info.num_layers,
            failure,
        }))
    }

    fn forward(
        &self,
        tokens: &Array,
        cache: &mut ModelCache,
        taps: &[usize],
    ) -> Result<ForwardOutput> {
        let cache = self.plugin_cache(cache)?;
        cache.check()?;
        let mut logits = null_array();
        let mut hidden = null_array();
        self.owned.call("forward", |error| unsafe {
            (self.owned.library.table.forward)(
                self.owned.handle,
                cache.handle,
                tokens.as_ptr(),
                taps.as_ptr(),
                taps.len(),
                &mut logits,
                &mut hidden,
                error,
            )
        })?;
        // Own both outputs before anything else can fail, so neither leaks.
        let hidden = (!hidden.ctx.is_null()).then(|| unsafe { Array::from_ptr(hidden) });
        let logits = self.owned.take(logits, "forward")?;
        if taps.is_empty() != hidden.is_none() {
            return Err(plugin_error(
                &self.owned.library.path,
                format!(
                    "forward: asked for {} taps, got {} hidden states",
                    taps.len(),
                    if hidden.is_some() { "some" } else { "no" }
                ),
            ));
        }
        cache.refresh()?;
        Ok(ForwardOutput { logits, hidden })
    }

    fn embed(&self, tokens: &Array) -> Result<Array> {
        self.owned
            .array_call("embed", self.owned.library.table.embed, tokens)
    }

    fn lm_head(&self, hidden: &Array) -> Result<Array> {
        self.owned
            .array_call("lm_head", self.owned.library.table.lm_head, hidden)
    }

    fn final_norm(&self, hidden: &Array) -> Result<Array> {
        self.owned
            .array_call("final_norm", self.owned.library.table.final_norm, hidden)
    }
}

/// A plugin's cache handle, mirrored on the host: its offset and its arrays as of
/// the latest forward (so `offset()` and `state()` need no call across the boundary).
struct PluginCache {
    model: Arc<OwnedModel>,
    handle: CacheHandle,
    offset: usize,
    state: Vec<Array>,
    /// How many state arrays to expect before the first forward (keys and values per
    /// layer); only sizes the first buffer, a wrong guess costs one more call.
    state_hint: usize,
    /// A failure that the `ModelCache` interface could not return (from `new_cache`
    /// or `trim`); the next forward reports it.
    failure: Option<String>,
}

// SAFETY: see `OwnedModel`; a cache handle is used by one thread at a time.
unsafe impl Send for PluginCache {}

impl Drop for PluginCache {
    fn drop(&mut self) {
        if !self.handle.is_null() {
            unsafe { (self.model.library.table.free_cache)(self.handle) };
        }
    }
}

impl PluginCache {
    fn check(&self) -> Result<()> {
        match &self.failure {
            Some(message) => Err(ModelError::Unsupported(format!(
                "the KV cache is unusable: {message}"
            ))),
            None => Ok(()),
        }
    }

    /// Re-reads offset and state after the plugin changed the cache.
    fn refresh(&mut self) -> Result<()> {
        let table = &self.model.library.table;
        let mut offset = 0usize;
        self.model.call("cache_offset", |error| unsafe {
            (table.cache_offset)(self.handle, &mut offset, error)
        })?;
        // Usually the count is as last time: one call.
        let mut capacity = self.state.len().max(self.state_hint);
        loop {
            let mut slots = vec![null_array(); capacity];
            let mut len = 0usize;
            self.model.call("cache_state", |error| unsafe {
                (table.cache_state)(self.handle, slots.as_mut_ptr(), capacity, &mut len, error)
            })?;
            let written = len.min(capacity);
            let arrays: Vec<Array> = slots[..written]
                .iter()
                .filter(|a| !a.ctx.is_null())
                .map(|&a| unsafe { Array::from_ptr(a) })
                .collect();
            if len <= capacity {
                self.state = arrays;
                break;
            }
            // Too small: the arrays just taken are dropped (freed); ask again.
            capacity = len;
        }
        self.offset = offset;
        Ok(())
    }
}

impl ExternalCache for PluginCache {
    fn offset(&self) -> usize {
        self.offset
    }

    fn trim(&mut self, n: usize) -> usize {
        if self.failure.is_some() {
            return 0;
        }
        let table = &self.model.library.table;
        let mut trimmed = 0usize;
        let result = self.model.call("cache_trim", |error| unsafe {
            (table.cache_trim)(self.handle, n, &mut trimmed, error)
        });
        match result {
            Ok(()) => {
                let trimmed = trimmed.min(self.offset);
                self.offset -= trimmed;
                trimmed
            }
            Err(e) => {
                self.failure = Some(e.to_string());
                0
            }
        }
    }

    fn state(&self) -> &[Array] {
        &self.state
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}
