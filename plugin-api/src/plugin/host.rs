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
    LoadOptionsC, ModelHandle, ModelInfoC, ModelInfoFn, NewCacheFn, PluginDescriptor,
    RollbackFunctions, Status, ABI_VERSION, ENTRY_SYMBOL, STATUS_OK, STATUS_PANIC,
    V1_DESCRIPTOR_SIZE,
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
    /// Optional entries: `None` when the plugin has not got them (see `RollbackFunctions`).
    rollback: RollbackFunctions,
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
    // SAFETY: the entry point has the ABI's signature (it is the ABI's symbol name).
    let descriptor = unsafe { entry() };
    // SAFETY: the descriptor comes from the library's entry point, as required.
    unsafe { from_descriptor(path, descriptor) }
}

/// Checks a descriptor and wraps it: the ABI version first (reading only the header),
/// then its size, strings and function table. `path` names the plugin in errors.
///
/// # Safety
/// `descriptor` must be NULL or point to at least a [`DescriptorHeader`]; when that
/// header has this ABI version and a size of at least [`V1_DESCRIPTOR_SIZE`], to that
/// many bytes of a [`PluginDescriptor`] layout, whose pointers stay valid for the life
/// of the process.
pub(crate) unsafe fn from_descriptor(
    path: &Path,
    descriptor: *const PluginDescriptor,
) -> Result<Arc<PluginLibrary>> {
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
    if (header.struct_size as usize) < V1_DESCRIPTOR_SIZE {
        return Err(plugin_error(
            path,
            format!(
                "its descriptor is {} bytes, smaller than ABI v{ABI_VERSION}'s {V1_DESCRIPTOR_SIZE}; rebuild the plugin",
                header.struct_size
            ),
        ));
    }
    let d = unsafe { read_descriptor(descriptor, header.struct_size as usize) };
    let d = &d;
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
        rollback: d.rollback,
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

/// A copy of the descriptor's first `size` bytes, the rest left zero: a plugin built
/// before an optional entry existed has a shorter descriptor, and a zero entry is the
/// NULL that means "not given". Bytes past this host's layout (a newer plugin's
/// entries) are not read; an entry only partly covered counts as not given.
///
/// # Safety
/// `descriptor` must point to at least `size` readable bytes.
unsafe fn read_descriptor(descriptor: *const PluginDescriptor, size: usize) -> PluginDescriptor {
    let size = size.min(std::mem::size_of::<PluginDescriptor>());
    // Optional entries are pointer-sized: round down to whole entries.
    let size = size - size % std::mem::size_of::<usize>();
    let mut copy = std::mem::MaybeUninit::<PluginDescriptor>::zeroed();
    // SAFETY: the caller vouches for `size` bytes; all-zero bytes are a valid
    // descriptor (NULL pointers, zero lengths, `None` functions).
    unsafe {
        std::ptr::copy_nonoverlapping(descriptor as *const u8, copy.as_mut_ptr() as *mut u8, size);
        copy.assume_init()
    }
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
        let mut cache = PluginCache {
            model: Arc::clone(&self.owned),
            handle,
            offset: 0,
            state: Vec::new(),
            state_hint: 2 * self.info.num_layers,
            stated_limit: None,
            window: None,
            failure,
        };
        // The model's own window holds until the engine sets one.
        if cache.failure.is_none() {
            if let Err(e) = cache.read_rollback() {
                cache.failure = Some(e.to_string());
            }
        }
        ModelCache::external(Box::new(cache))
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
    /// How far back the plugin says its cache can go now, as of the latest call that
    /// changed it; `None` when it does not say (everything held, as ABI v1 began).
    stated_limit: Option<usize>,
    /// How far back it can always go after a forward; `None`: no bound but what is held.
    window: Option<usize>,
    /// A failure that a call without a `Result` (`TargetModel::new_cache`,
    /// `set_rollback_window`) could not return; the next call that uses the cache
    /// reports it.
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

    /// Asks the plugin how far back its cache can go, when it can say
    /// (`RollbackFunctions::rollback_limit`).
    fn read_rollback(&mut self) -> Result<()> {
        let Some(rollback_limit) = self.model.library.table.rollback.rollback_limit else {
            return Ok(());
        };
        let (mut limit, mut window) = (0usize, usize::MAX);
        self.model.call("cache_rollback_limit", |error| unsafe {
            rollback_limit(self.handle, &mut limit, &mut window, error)
        })?;
        self.stated_limit = Some(limit);
        self.window = (window != usize::MAX).then_some(window);
        Ok(())
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
        self.read_rollback()
    }
}

impl ExternalCache for PluginCache {
    fn offset(&self) -> usize {
        self.offset
    }

    /// What the plugin states, never more than is held; without the entry, everything
    /// held (the plugin's `cache_trim` then refuses what it cannot honour, see
    /// `CacheTrimFn`).
    fn rollback_limit(&self) -> usize {
        self.stated_limit.unwrap_or(self.offset).min(self.offset)
    }

    fn rollback_window(&self) -> Option<usize> {
        self.window
    }

    fn set_rollback_window(&mut self, positions: usize) {
        if self.failure.is_some() {
            return;
        }
        let Some(set_window) = self.model.library.table.rollback.set_rollback_window else {
            return;
        };
        let set = self
            .model
            .call("cache_set_rollback_window", |error| unsafe {
                set_window(self.handle, positions, error)
            });
        if let Err(e) = set.and_then(|()| self.read_rollback()) {
            self.failure = Some(e.to_string());
        }
    }

    fn trim(&mut self, n: usize) -> Result<()> {
        self.check()?;
        if n > self.rollback_limit() {
            return Err(ModelError::CannotRollBack {
                asked: n,
                held: self.offset,
                limit: self.rollback_limit(),
            });
        }
        let table = &self.model.library.table;
        let mut trimmed = 0usize;
        self.model.call("cache_trim", |error| unsafe {
            (table.cache_trim)(self.handle, n, &mut trimmed, error)
        })?;
        let trimmed = trimmed.min(self.offset);
        self.offset -= trimmed;
        if trimmed != n {
            return Err(plugin_error(
                &self.model.library.path,
                format!(
                    "cache_trim: asked to forget {n} positions, the plugin forgot {trimmed}; \
                     its cache now holds {} positions",
                    self.offset
                ),
            ));
        }
        self.read_rollback()
    }

    fn state(&self) -> &[Array] {
        &self.state
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use std::sync::OnceLock;

    use mlx_rs::ops::zeros;

    use super::*;
    use crate::cache::{KvCache, LayerCache, RecurrentCache};
    use crate::plugin::abi::PluginFunctions;
    use crate::plugin::export::{
        descriptor, functions, rollback_functions, PluginExport, StaticDescriptor,
    };
    use crate::target::LoadOptions;

    const VOCAB: i32 = 11;
    const HIDDEN: i32 = 4;

    /// A stand-in model exported through the real shims, in-process: zero outputs of the
    /// right shapes, a one-layer cache; token 98 makes forward fail, 99 makes it panic.
    struct Stub {
        info: ModelInfo,
    }

    impl TargetModel for Stub {
        fn info(&self) -> &ModelInfo {
            &self.info
        }

        fn new_cache(&self) -> ModelCache {
            // Keys and values, and a recurrent state that goes back two positions at most.
            ModelCache::with_layers(vec![
                LayerCache::Attention(KvCache::new()),
                LayerCache::Recurrent(RecurrentCache::new(2)),
            ])
        }

        fn forward(
            &self,
            tokens: &Array,
            cache: &mut ModelCache,
            taps: &[usize],
        ) -> Result<ForwardOutput> {
            let ids = tokens.as_dtype(Dtype::Uint32)?;
            if ids.as_slice::<u32>().contains(&99) {
                panic!("token 99 is poison");
            }
            if ids.as_slice::<u32>().contains(&98) {
                return Err(ModelError::Unsupported("token 98 failed on purpose".into()));
            }
            let len = tokens.shape()[1];
            let kv = zeros::<f32>(&[1, 1, len, 2])?;
            cache.layers_mut()[0].kv_mut()?.update_and_fetch(&kv, &kv)?;
            let mut states = Vec::new();
            for _ in 0..len {
                states.push(vec![zeros::<f32>(&[1])?]);
            }
            cache.layers_mut()[1]
                .recurrent_mut()?
                .advance(len as usize, states)?;
            let hidden = if taps.is_empty() {
                None
            } else {
                Some(zeros::<f32>(&[1, len, HIDDEN * taps.len() as i32])?)
            };
            Ok(ForwardOutput {
                logits: zeros::<f32>(&[1, len, VOCAB])?,
                hidden,
            })
        }

        fn embed(&self, tokens: &Array) -> Result<Array> {
            Ok(zeros::<f32>(&[1, tokens.shape()[1], HIDDEN])?)
        }

        fn lm_head(&self, hidden: &Array) -> Result<Array> {
            Ok(zeros::<f32>(&[1, hidden.shape()[1], VOCAB])?)
        }

        fn final_norm(&self, hidden: &Array) -> Result<Array> {
            Ok(hidden.clone())
        }
    }

    struct StubExport;

    impl PluginExport for StubExport {
        fn load(request: &LoadRequest<'_>) -> Result<Box<dyn TargetModel>> {
            if request.config["fail"].as_bool() == Some(true) {
                return Err(ModelError::config(request.dir, "asked to fail"));
            }
            (request.progress)(1, 1);
            Ok(Box::new(Stub {
                info: ModelInfo {
                    model_type: "stub".into(),
                    num_layers: 1,
                    hidden_size: HIDDEN as usize,
                    vocab_size: VOCAB as usize,
                    dtype: Dtype::Float32,
                    quantized_bits: None,
                    max_context: Some(64),
                },
            }))
        }
    }

    fn stub_library() -> Arc<PluginLibrary> {
        static DESCRIPTOR: OnceLock<StaticDescriptor> = OnceLock::new();
        let d = descriptor::<StubExport>(&DESCRIPTOR, "stub", "1.2.3", &["stub"], &["StubLM"]);
        unsafe { from_descriptor(Path::new("libstub.so"), d) }.unwrap_or_else(|e| panic!("{e}"))
    }

    fn load(config: serde_json::Value) -> Result<Box<dyn TargetModel>> {
        load_from(&stub_library(), config)
    }

    fn load_from(
        library: &Arc<PluginLibrary>,
        config: serde_json::Value,
    ) -> Result<Box<dyn TargetModel>> {
        let reported = std::cell::Cell::new(0);
        let progress = |done: usize, _total: usize| reported.set(done);
        let model = library.load_model(&LoadRequest {
            dir: Path::new("/models/stub"),
            config: &config,
            options: &LoadOptions::default(),
            progress: &progress,
        })?;
        assert_eq!(reported.get(), 1, "progress crosses the ABI");
        Ok(model)
    }

    fn ids(tokens: &[u32]) -> Array {
        Array::from_slice(tokens, &[1, tokens.len() as i32])
    }

    #[test]
    fn a_model_round_trips_through_the_c_abi() {
        let library = stub_library();
        assert_eq!(library.name(), "stub");
        assert_eq!(library.architectures(), ["StubLM".to_string()]);
        let entry = library.adapter_entry();
        assert_eq!(entry.name, "stub 1.2.3");
        assert!(matches!(
            entry.source,
            AdapterSource::Plugin {
                abi_version: ABI_VERSION,
                ..
            }
        ));

        let model = load(serde_json::json!({})).unwrap();
        assert_eq!(model.info().model_type, "stub");
        assert_eq!(model.info().max_context, Some(64));
        let mut cache = model.new_cache();
        let out = model.forward(&ids(&[1, 2, 3]), &mut cache, &[0]).unwrap();
        assert_eq!(out.logits.shape(), &[1, 3, VOCAB]);
        assert_eq!(
            out.hidden.map(|h| h.shape().to_vec()),
            Some(vec![1, 3, HIDDEN])
        );
        assert_eq!(cache.offset(), 3);
        assert_eq!(
            cache.state().count(),
            5,
            "keys, values, the recurrent state and the two kept before it"
        );
        cache.trim(2).unwrap();
        assert_eq!(cache.offset(), 1);
        // Past what is held: refused on the host side, nothing forgotten.
        assert!(cache.trim(2).is_err());
        assert_eq!(cache.offset(), 1);
        // Held, but past the plugin's recurrent window, which the plugin states: refused
        // before the plugin is asked.
        model.forward(&ids(&[4, 5, 6]), &mut cache, &[]).unwrap();
        assert_eq!(cache.rollback_limit(), 2);
        let err = cache.trim(3).expect_err("past the window");
        assert!(
            matches!(
                err,
                ModelError::CannotRollBack {
                    asked: 3,
                    held: 4,
                    limit: 2
                }
            ),
            "{err}"
        );
        assert_eq!(cache.offset(), 4, "nothing forgotten");
        cache.trim(2).unwrap();
        let out = model.forward(&ids(&[4]), &mut cache, &[]).unwrap();
        assert!(out.hidden.is_none());
        assert_eq!(cache.offset(), 3);
        // Arrays handed over stay valid after the model and its cache are gone.
        let embedded = model.embed(&ids(&[1, 2])).unwrap();
        drop(cache);
        drop(model);
        assert_eq!(embedded.shape(), &[1, 2, HIDDEN]);
        assert_eq!(
            embedded.sum(None).unwrap().try_item_cast::<f32>().unwrap(),
            0.0
        );
    }

    #[test]
    fn plugin_errors_and_panics_become_errs_and_a_panic_poisons_the_model() {
        let err = load(serde_json::json!({"fail": true}))
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("libstub.so") && err.contains("asked to fail"),
            "{err}"
        );

        let model = load(serde_json::json!({})).unwrap();
        let mut cache = model.new_cache();
        let err = model
            .forward(&ids(&[98]), &mut cache, &[])
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("forward") && err.contains("failed on purpose"),
            "{err}"
        );
        model
            .forward(&ids(&[1]), &mut cache, &[])
            .expect("an Err leaves the model usable");

        let err = model
            .forward(&ids(&[99]), &mut cache, &[])
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("panicked") && err.contains("poison"), "{err}");
        let err = model.embed(&ids(&[1])).expect_err("refused").to_string();
        assert!(err.contains("panicked earlier"), "{err}");
    }

    #[test]
    fn the_abi_version_is_checked_before_anything_else() {
        let path = Path::new("libother.so");
        // Only a header: reading past it would be a bug the version check must prevent.
        let newer = DescriptorHeader {
            struct_size: 8,
            abi_version: ABI_VERSION + 1,
        };
        let err = unsafe { from_descriptor(path, &newer as *const _ as *const PluginDescriptor) }
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains(&format!("ABI v{}", ABI_VERSION + 1)) && err.contains("newer dspec"),
            "{err}"
        );
        let short = DescriptorHeader {
            struct_size: 8,
            abi_version: ABI_VERSION,
        };
        let err = unsafe { from_descriptor(path, &short as *const _ as *const PluginDescriptor) }
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("8 bytes"), "{err}");
        let err = unsafe { from_descriptor(path, std::ptr::null()) }
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("no descriptor"), "{err}");
    }

    #[test]
    fn an_incomplete_descriptor_is_refused() {
        let types = [c"stub".as_ptr()];
        let make = |functions: PluginFunctions, model_types_len: usize| PluginDescriptor {
            struct_size: std::mem::size_of::<PluginDescriptor>() as u32,
            abi_version: ABI_VERSION,
            name: c"partial".as_ptr(),
            version: c"0".as_ptr(),
            model_types: types.as_ptr(),
            model_types_len,
            architectures: std::ptr::null(),
            architectures_len: 0,
            functions,
            rollback: RollbackFunctions::default(),
        };
        let path = Path::new("libpartial.so");
        let no_forward = make(
            PluginFunctions {
                forward: None,
                ..functions::<StubExport>()
            },
            1,
        );
        let err = unsafe { from_descriptor(path, &no_forward) }
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("lacks `forward`"), "{err}");
        let no_types = make(functions::<StubExport>(), 0);
        let err = unsafe { from_descriptor(path, &no_types) }
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("no model_type"), "{err}");
    }

    /// The descriptor as plugins built before `RollbackFunctions` lay it out: exactly
    /// the fields up to `functions`, nothing after them in memory.
    #[repr(C)]
    struct FirstV1Layout {
        struct_size: u32,
        abi_version: u32,
        name: *const c_char,
        version: *const c_char,
        model_types: *const *const c_char,
        model_types_len: usize,
        architectures: *const *const c_char,
        architectures_len: usize,
        functions: PluginFunctions,
    }

    /// A descriptor from a plugin built against a newer dspec-plugin-api of the same ABI
    /// version: this host's layout followed by an entry it does not know.
    #[repr(C)]
    struct NewerLayout {
        known: PluginDescriptor,
        unknown: usize,
    }

    /// The stub's model_types, as the ABI wants them: alive for the whole process.
    fn stub_types() -> *const *const c_char {
        Box::leak(Box::new([c"stub".as_ptr()])).as_ptr()
    }

    fn stub_descriptor(struct_size: usize, rollback: RollbackFunctions) -> PluginDescriptor {
        PluginDescriptor {
            struct_size: struct_size as u32,
            abi_version: ABI_VERSION,
            name: c"stub".as_ptr(),
            version: c"0".as_ptr(),
            model_types: stub_types(),
            model_types_len: 1,
            architectures: std::ptr::null(),
            architectures_len: 0,
            functions: functions::<StubExport>(),
            rollback,
        }
    }

    /// Loads the stub from a descriptor laid out as a plugin built before the rollback
    /// entries (only that many bytes exist), as one built with them, as one that claims
    /// to have been built with only the first of them, and as a newer one.
    fn stub_libraries() -> [(&'static str, Arc<PluginLibrary>); 4] {
        assert_eq!(std::mem::size_of::<FirstV1Layout>(), V1_DESCRIPTOR_SIZE);
        let path = Path::new("libstub.so");
        let old: &'static FirstV1Layout = Box::leak(Box::new(FirstV1Layout {
            struct_size: V1_DESCRIPTOR_SIZE as u32,
            abi_version: ABI_VERSION,
            name: c"stub".as_ptr(),
            version: c"0".as_ptr(),
            model_types: stub_types(),
            model_types_len: 1,
            architectures: std::ptr::null(),
            architectures_len: 0,
            functions: functions::<StubExport>(),
        }));
        let size = std::mem::size_of::<PluginDescriptor>();
        let current: &'static PluginDescriptor =
            Box::leak(Box::new(stub_descriptor(size, rollback_functions())));
        // A size that covers `rollback_limit` only: `set_rollback_window` is not read,
        // though the bytes behind it hold a function.
        let first_entry: &'static PluginDescriptor = Box::leak(Box::new(stub_descriptor(
            V1_DESCRIPTOR_SIZE + std::mem::size_of::<usize>(),
            rollback_functions(),
        )));
        let newer: &'static NewerLayout = Box::leak(Box::new(NewerLayout {
            known: stub_descriptor(std::mem::size_of::<NewerLayout>(), rollback_functions()),
            unknown: 7,
        }));
        let load = |d: *const PluginDescriptor| {
            unsafe { from_descriptor(path, d) }.unwrap_or_else(|e| panic!("{e}"))
        };
        [
            (
                "first v1 layout",
                load(old as *const FirstV1Layout as *const _),
            ),
            ("current layout", load(current)),
            ("rollback_limit only", load(first_entry)),
            ("newer layout", load(&newer.known)),
        ]
    }

    /// A plugin with recurrent state tells the host how far its cache rolls back when
    /// its descriptor has the rollback entries; one built before them keeps v1's first
    /// meaning (everything held, the plugin's `cache_trim` refusing what it cannot do).
    #[test]
    fn the_rollback_entries_are_read_only_where_the_descriptor_has_them() {
        for (layout, library) in stub_libraries() {
            let model = load_from(&library, serde_json::json!({})).unwrap();
            let mut cache = model.new_cache();
            model.forward(&ids(&[1, 2, 3]), &mut cache, &[]).unwrap();
            let stated = layout != "first v1 layout";
            let can_set = stated && layout != "rollback_limit only";
            assert_eq!(
                (cache.rollback_limit(), cache.rollback_window()),
                if stated { (2, Some(2)) } else { (3, None) },
                "{layout}"
            );
            cache.set_rollback_window(3);
            model.forward(&ids(&[4, 5, 6]), &mut cache, &[]).unwrap();
            let expected = match (stated, can_set) {
                (false, _) => (6, None),
                (true, false) => (2, Some(2)),
                (true, true) => (3, Some(3)),
            };
            assert_eq!(
                (cache.rollback_limit(), cache.rollback_window()),
                expected,
                "{layout}"
            );
            let err = cache.trim(4).expect_err("past the recurrent window");
            if stated {
                assert!(
                    matches!(err, ModelError::CannotRollBack { asked: 4, .. }),
                    "{layout}: {err}"
                );
            } else {
                let err = err.to_string();
                assert!(
                    err.contains("cache_trim") && err.contains("at most 2"),
                    "{layout}: the plugin refuses: {err}"
                );
            }
            assert_eq!(cache.offset(), 6, "{layout}: nothing forgotten");
            cache.trim(2).unwrap();
            assert_eq!(cache.offset(), 4, "{layout}");
            if stated {
                assert_eq!(cache.rollback_limit(), expected.0 - 2, "{layout}: re-read");
            }
        }
    }

    /// The conformance checker trusts what a cache says about its rollback: a plugin
    /// with recurrent state passes it across the ABI only when it can say it.
    #[test]
    fn a_recurrent_plugin_passes_the_conformance_checker_when_it_states_its_limit() {
        for (layout, library) in stub_libraries() {
            let model = load_from(&library, serde_json::json!({})).unwrap();
            let checked = crate::conformance::check_target_model(model.as_ref());
            if layout == "first v1 layout" {
                let err = checked.expect_err("a trim past the window it could not state");
                assert!(err.contains("at most 2"), "{err}");
            } else {
                checked.unwrap_or_else(|e| panic!("{layout}: {e}"));
            }
        }
    }
}
