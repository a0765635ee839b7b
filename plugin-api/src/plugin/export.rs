//! The plugin side of the ABI: C shims that run a Rust [`TargetModel`] behind opaque
//! handles, catch every panic, and turn every `Err` into a status and a message.
//! Plugins reach this through [`export_plugin!`](crate::export_plugin).

use std::any::Any;
use std::ffi::{c_char, c_void, CStr, CString};
use std::mem::ManuallyDrop;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::OnceLock;

use mlx_rs::{Array, Dtype};

use crate::cache::ModelCache;
use crate::error::Result;
use crate::plugin::abi::{
    mlx_array, null_array, CacheHandle, ErrorOut, LoadOptionsC, ModelHandle, ModelInfoC,
    PluginDescriptor, PluginFunctions, ProgressFn, RollbackFunctions, Status, ABI_VERSION,
    STATUS_ERROR, STATUS_OK, STATUS_PANIC,
};
use crate::target::{LoadOptions, LoadRequest, Quantization, TargetModel};

/// What [`export_plugin!`](crate::export_plugin) implements for the plugin's load function.
pub trait PluginExport {
    fn load(request: &LoadRequest<'_>) -> Result<Box<dyn TargetModel>>;
}

/// What a model handle points to.
struct ExportedModel {
    model: Box<dyn TargetModel>,
    /// Kept here so `model_info` can hand out a pointer that lives as long as the handle.
    model_type: CString,
}

/// A panic payload as text (panics carry `&str` or `String` almost always).
fn panic_message(payload: &(dyn Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

fn c_string(text: &str) -> CString {
    // Interior NULs would truncate the message on the host side; make them visible.
    CString::new(text.replace('\0', "\\0")).unwrap_or_default()
}

/// Stores `message` for the host, which frees it with [`free_error`].
unsafe fn set_error(error: ErrorOut, message: &str) {
    if !error.is_null() {
        *error = c_string(message).into_raw();
    }
}

/// Runs `body`, turning `Err` and panics into a status and an error message. This is
/// the only way the shims below run plugin code: nothing may unwind into the host.
fn guard(error: ErrorOut, body: impl FnOnce() -> std::result::Result<(), String>) -> Status {
    let (status, message) = match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => return STATUS_OK,
        Ok(Err(message)) => (STATUS_ERROR, message),
        Err(payload) => (STATUS_PANIC, panic_message(payload.as_ref())),
    };
    // Building the message allocates; even that must not unwind.
    let stored = catch_unwind(AssertUnwindSafe(|| unsafe { set_error(error, &message) }));
    drop(stored);
    status
}

fn text<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

/// An input array the host lends for the duration of the call: wrapped without taking
/// ownership, so dropping the wrapper does not free the host's reference.
unsafe fn borrowed(
    handle: mlx_array,
    what: &str,
) -> std::result::Result<ManuallyDrop<Array>, String> {
    if handle.ctx.is_null() {
        return Err(format!("{what}: the host passed a NULL array"));
    }
    Ok(ManuallyDrop::new(Array::from_ptr(handle)))
}

/// Hands `array`'s reference to the host, which frees it.
fn give(array: Array) -> mlx_array {
    let handle = array.as_ptr();
    std::mem::forget(array);
    handle
}

unsafe fn model_ref<'a>(model: ModelHandle) -> std::result::Result<&'a ExportedModel, String> {
    (model as *const ExportedModel)
        .as_ref()
        .ok_or_else(|| "NULL model handle".to_string())
}

unsafe fn cache_mut<'a>(cache: CacheHandle) -> std::result::Result<&'a mut ModelCache, String> {
    (cache as *mut ModelCache)
        .as_mut()
        .ok_or_else(|| "NULL cache handle".to_string())
}

unsafe fn write<T>(out: *mut T, value: T) -> std::result::Result<(), String> {
    if out.is_null() {
        return Err("NULL output pointer".into());
    }
    out.write(value);
    Ok(())
}

unsafe extern "C" fn free_error(message: *mut c_char) {
    if !message.is_null() {
        drop(CString::from_raw(message));
    }
}

fn load_options(options: &LoadOptionsC) -> std::result::Result<LoadOptions, String> {
    let dtype = match options.dtype {
        -1 => None,
        code => Some(
            u32::try_from(code)
                .ok()
                .and_then(|c| Dtype::try_from(c).ok())
                .ok_or_else(|| format!("unknown dtype code {code}"))?,
        ),
    };
    let quantize = (options.quantize_bits != 0).then_some(Quantization {
        bits: options.quantize_bits,
        group_size: options.quantize_group_size,
    });
    Ok(LoadOptions {
        dtype,
        quantize,
        ..LoadOptions::default()
    })
}

unsafe extern "C" fn load<E: PluginExport>(
    dir: *const c_char,
    config_json: *const c_char,
    options: *const LoadOptionsC,
    progress: Option<ProgressFn>,
    progress_ctx: *mut c_void,
    out_model: *mut ModelHandle,
    error: ErrorOut,
) -> Status {
    guard(error, || {
        if dir.is_null() || config_json.is_null() || options.is_null() {
            return Err("load: NULL argument".into());
        }
        let dir = CStr::from_ptr(dir)
            .to_str()
            .map_err(|_| "load: the model path is not UTF-8".to_string())?;
        let config: serde_json::Value = serde_json::from_str(
            CStr::from_ptr(config_json)
                .to_str()
                .map_err(|_| "load: config JSON is not UTF-8".to_string())?,
        )
        .map_err(|e| format!("load: config JSON: {e}"))?;
        let options = load_options(&*options)?;
        let report = |done: usize, total: usize| {
            if let Some(progress) = progress {
                progress(progress_ctx, done, total);
            }
        };
        let request = LoadRequest {
            dir: Path::new(dir),
            config: &config,
            options: &options,
            progress: &report,
        };
        let model = E::load(&request).map_err(text)?;
        let model_type = c_string(&model.info().model_type);
        let handle = Box::into_raw(Box::new(ExportedModel { model, model_type }));
        write(out_model, handle as ModelHandle).inspect_err(|_| {
            drop(Box::from_raw(handle));
        })
    })
}

unsafe extern "C" fn free_model(model: ModelHandle) {
    if !model.is_null() {
        // A panicking Drop must not unwind into the host; the memory is lost then.
        let _ = catch_unwind(AssertUnwindSafe(|| {
            drop(Box::from_raw(model as *mut ExportedModel))
        }));
    }
}

unsafe extern "C" fn model_info(
    model: ModelHandle,
    out: *mut ModelInfoC,
    error: ErrorOut,
) -> Status {
    guard(error, || {
        let exported = model_ref(model)?;
        let info = exported.model.info();
        write(
            out,
            ModelInfoC {
                model_type: exported.model_type.as_ptr(),
                num_layers: info.num_layers,
                hidden_size: info.hidden_size,
                vocab_size: info.vocab_size,
                dtype: info.dtype.into(),
                quantized_bits: info.quantized_bits.unwrap_or(0),
                max_context: info.max_context.unwrap_or(0),
            },
        )
    })
}

unsafe extern "C" fn new_cache(
    model: ModelHandle,
    out_cache: *mut CacheHandle,
    error: ErrorOut,
) -> Status {
    guard(error, || {
        let cache = Box::into_raw(Box::new(model_ref(model)?.model.new_cache()));
        write(out_cache, cache as CacheHandle).inspect_err(|_| {
            drop(Box::from_raw(cache));
        })
    })
}

unsafe extern "C" fn free_cache(cache: CacheHandle) {
    if !cache.is_null() {
        let _ = catch_unwind(AssertUnwindSafe(|| {
            drop(Box::from_raw(cache as *mut ModelCache))
        }));
    }
}

unsafe extern "C" fn cache_offset(cache: CacheHandle, out: *mut usize, error: ErrorOut) -> Status {
    guard(error, || write(out, cache_mut(cache)?.offset()))
}

unsafe extern "C" fn cache_trim(
    cache: CacheHandle,
    n: usize,
    out_trimmed: *mut usize,
    error: ErrorOut,
) -> Status {
    guard(error, || {
        if out_trimmed.is_null() {
            return Err("NULL output pointer".into());
        }
        cache_mut(cache)?.trim(n).map_err(text)?;
        write(out_trimmed, n)
    })
}

unsafe extern "C" fn cache_rollback_limit(
    cache: CacheHandle,
    out_limit: *mut usize,
    out_window: *mut usize,
    error: ErrorOut,
) -> Status {
    guard(error, || {
        let cache = cache_mut(cache)?;
        write(out_limit, cache.rollback_limit())?;
        write(out_window, cache.rollback_window().unwrap_or(usize::MAX))
    })
}

unsafe extern "C" fn cache_set_rollback_window(
    cache: CacheHandle,
    positions: usize,
    error: ErrorOut,
) -> Status {
    guard(error, || {
        cache_mut(cache)?.set_rollback_window(positions);
        Ok(())
    })
}

unsafe extern "C" fn cache_state(
    cache: CacheHandle,
    out: *mut mlx_array,
    capacity: usize,
    out_len: *mut usize,
    error: ErrorOut,
) -> Status {
    guard(error, || {
        if out_len.is_null() || (capacity > 0 && out.is_null()) {
            return Err("NULL output pointer".into());
        }
        let state: Vec<Array> = cache_mut(cache)?.state().cloned().collect();
        let len = state.len();
        for (i, array) in state.into_iter().take(capacity).enumerate() {
            out.add(i).write(give(array));
        }
        write(out_len, len)
    })
}

#[allow(clippy::too_many_arguments)] // The C signature of `ForwardFn`.
unsafe extern "C" fn forward(
    model: ModelHandle,
    cache: CacheHandle,
    tokens: mlx_array,
    taps: *const usize,
    taps_len: usize,
    out_logits: *mut mlx_array,
    out_hidden: *mut mlx_array,
    error: ErrorOut,
) -> Status {
    guard(error, || {
        if out_logits.is_null() || out_hidden.is_null() || (taps_len > 0 && taps.is_null()) {
            return Err("forward: NULL argument".into());
        }
        let exported = model_ref(model)?;
        let cache = cache_mut(cache)?;
        let tokens = borrowed(tokens, "forward tokens")?;
        let taps: &[usize] = if taps_len == 0 {
            &[]
        } else {
            std::slice::from_raw_parts(taps, taps_len)
        };
        let output = exported.model.forward(&tokens, cache, taps).map_err(text)?;
        out_hidden.write(output.hidden.map_or_else(null_array, give));
        out_logits.write(give(output.logits));
        Ok(())
    })
}

unsafe fn array_call(
    model: ModelHandle,
    input: mlx_array,
    out: *mut mlx_array,
    error: ErrorOut,
    what: &str,
    call: impl FnOnce(&dyn TargetModel, &Array) -> Result<Array>,
) -> Status {
    guard(error, || {
        let exported = model_ref(model)?;
        let input = borrowed(input, what)?;
        if out.is_null() {
            return Err(format!("{what}: NULL output pointer"));
        }
        let result = call(exported.model.as_ref(), &input).map_err(text)?;
        out.write(give(result));
        Ok(())
    })
}

unsafe extern "C" fn embed(
    model: ModelHandle,
    input: mlx_array,
    out: *mut mlx_array,
    error: ErrorOut,
) -> Status {
    array_call(model, input, out, error, "embed", |m, x| m.embed(x))
}

unsafe extern "C" fn lm_head(
    model: ModelHandle,
    input: mlx_array,
    out: *mut mlx_array,
    error: ErrorOut,
) -> Status {
    array_call(model, input, out, error, "lm_head", |m, x| m.lm_head(x))
}

unsafe extern "C" fn final_norm(
    model: ModelHandle,
    input: mlx_array,
    out: *mut mlx_array,
    error: ErrorOut,
) -> Status {
    array_call(model, input, out, error, "final_norm", |m, x| {
        m.final_norm(x)
    })
}

/// The function table for a plugin whose load function is `E`'s. Public so that a
/// plugin (or a test) can assemble its own descriptor; most use the macro.
pub fn functions<E: PluginExport>() -> PluginFunctions {
    PluginFunctions {
        free_error: Some(free_error),
        load: Some(load::<E>),
        free_model: Some(free_model),
        model_info: Some(model_info),
        new_cache: Some(new_cache),
        free_cache: Some(free_cache),
        cache_offset: Some(cache_offset),
        cache_trim: Some(cache_trim),
        cache_state: Some(cache_state),
        forward: Some(forward),
        embed: Some(embed),
        lm_head: Some(lm_head),
        final_norm: Some(final_norm),
    }
}

/// The rollback entries over the plugin's `ModelCache`s: what a plugin built with
/// [`export_plugin!`](crate::export_plugin) states about its caches. Public for plugins
/// (and tests) that assemble their own descriptor.
pub fn rollback_functions() -> RollbackFunctions {
    RollbackFunctions {
        rollback_limit: Some(cache_rollback_limit),
        set_rollback_window: Some(cache_set_rollback_window),
    }
}

/// A descriptor in a `static`. Its pointers are to leaked, immutable strings, so
/// sharing it between threads is sound.
pub struct StaticDescriptor(PluginDescriptor);

// SAFETY: every pointer in the descriptor is to data that is never written or freed.
unsafe impl Send for StaticDescriptor {}
unsafe impl Sync for StaticDescriptor {}

/// Strings that live as long as the process, as the ABI requires of descriptor data.
fn leak_strings(items: &[&str]) -> (*const *const c_char, usize) {
    let pointers: Vec<*const c_char> = items
        .iter()
        .map(|s| c_string(s).into_raw() as *const c_char)
        .collect();
    let len = pointers.len();
    (Box::leak(pointers.into_boxed_slice()).as_ptr(), len)
}

/// Builds (once) the descriptor the entry point returns. Used by [`export_plugin!`];
/// never panics into the host: a failure returns NULL, which the host reports.
pub fn descriptor<E: PluginExport>(
    cell: &'static OnceLock<StaticDescriptor>,
    name: &str,
    version: &str,
    model_types: &[&str],
    architectures: &[&str],
) -> *const PluginDescriptor {
    let built = catch_unwind(AssertUnwindSafe(|| {
        let made = cell.get_or_init(|| {
            let (model_types, model_types_len) = leak_strings(model_types);
            let (architectures, architectures_len) = leak_strings(architectures);
            StaticDescriptor(PluginDescriptor {
                struct_size: std::mem::size_of::<PluginDescriptor>() as u32,
                abi_version: ABI_VERSION,
                name: c_string(name).into_raw(),
                version: c_string(version).into_raw(),
                model_types,
                model_types_len,
                architectures,
                architectures_len,
                functions: functions::<E>(),
                rollback: rollback_functions(),
            })
        });
        &made.0 as *const PluginDescriptor
    }));
    built.unwrap_or(std::ptr::null())
}

/// Exports a Rust [`TargetModel`](crate::TargetModel) family from a `cdylib` through
/// dspec's C ABI. `load` is a `fn(&LoadRequest) -> Result<Box<dyn TargetModel>>`,
/// exactly as a built-in adapter's constructor:
///
/// ```ignore
/// dspec_plugin_api::export_plugin! {
///     name: "example-phi3",
///     version: env!("CARGO_PKG_VERSION"),
///     model_types: ["phi3"],
///     architectures: ["Phi3ForCausalLM"],
///     load: load_phi3,
/// }
/// ```
///
/// It defines the entry point `dspec_plugin_descriptor`; use it once per library.
#[macro_export]
macro_rules! export_plugin {
    (
        name: $name:expr,
        version: $version:expr,
        model_types: [$($model_type:expr),+ $(,)?],
        architectures: [$($architecture:expr),* $(,)?],
        load: $load:path $(,)?
    ) => {
        #[doc(hidden)]
        pub struct DspecPluginExport;

        impl $crate::plugin::export::PluginExport for DspecPluginExport {
            fn load(
                request: &$crate::LoadRequest<'_>,
            ) -> $crate::error::Result<::std::boxed::Box<dyn $crate::TargetModel>> {
                $load(request)
            }
        }

        /// The plugin's entry point: dspec calls it once after loading the library.
        #[unsafe(no_mangle)]
        pub extern "C" fn dspec_plugin_descriptor() -> *const $crate::plugin::abi::PluginDescriptor {
            static DESCRIPTOR: ::std::sync::OnceLock<$crate::plugin::export::StaticDescriptor> =
                ::std::sync::OnceLock::new();
            $crate::plugin::export::descriptor::<DspecPluginExport>(
                &DESCRIPTOR,
                $name,
                $version,
                &[$($model_type),+],
                &[$($architecture),*],
            )
        }
    };
}
