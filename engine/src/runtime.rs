//! What MLX runtime this process got: the libmlx actually loaded (the linked CPU
//! build, or a CUDA/Metal one through LD_LIBRARY_PATH), its version and default device.

use std::ffi::CStr;

pub use dspec_runtime::Backend;

/// MLX's version string as reported by the loaded libmlx.
pub fn mlx_version() -> String {
    // SAFETY: mlx_string_new/mlx_version/mlx_string_data/mlx_string_free are used as
    // mlx-c documents: the string is owned here and freed after copying it out.
    unsafe {
        let mut s = mlx_sys::mlx_string_new();
        let status = mlx_sys::mlx_version(&mut s);
        let data = mlx_sys::mlx_string_data(s);
        let version = if status == 0 && !data.is_null() {
            CStr::from_ptr(data).to_string_lossy().into_owned()
        } else {
            "unknown".to_string()
        };
        mlx_sys::mlx_string_free(s);
        version
    }
}

/// Ends the process with `code` once output is flushed, without running C++ static and
/// thread-local destructors or exit handlers. MLX's CUDA backend destroys its command
/// encoders (streams, CUDA graphs) in such destructors, which can run after the CUDA
/// runtime has unloaded; the failed `Destroy` then throws from a destructor and the
/// process aborts (SIGABRT, exit 134) after a successful run (docs/mlx-on-linux.md has
/// the upstream report). Skipping the exit handlers
/// also keeps OpenBLAS's from waiting forever on a worker that MLX's stream thread left
/// mid-call (the CPU hang of a step still queued at exit). The operating system frees
/// what the destructors would have.
pub fn exit_process(code: i32) -> ! {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // SAFETY: `_exit` ends the process at once; everything buffered was flushed above and
    // no file dspec writes is left half-done (each is closed where it is written).
    unsafe { libc::_exit(code) }
}

/// The multi-line text of `dspec --version`.
pub fn version_report() -> String {
    let backend = Backend::detect();
    let linked = mlx_sys::LINKED_LIBMLX_DIR;
    let loaded = loaded_libmlx_dir();
    let blas = if loaded
        .as_deref()
        .is_none_or(|d| d == std::path::Path::new(linked))
    {
        format!("CPU BLAS: {}", mlx_sys::LINKED_BLAS)
    } else {
        format!("redirected from the linked {linked}")
    };
    let mut report = format!(
        "dspec {}\nmlx {}\ndevice {}\nlibmlx {} ({blas})",
        env!("CARGO_PKG_VERSION"),
        mlx_version(),
        backend.device_name(),
        loaded
            .map(|d| d.display().to_string())
            .unwrap_or_else(|| linked.to_string()),
    );
    if let Some(kernels) = crate::cpu_blas::report() {
        report.push('\n');
        report.push_str(&kernels);
    }
    report
}

/// Directory of the loaded libmlx, from the dynamic loader's own map of this process.
pub fn loaded_libmlx_dir() -> Option<std::path::PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| p.ends_with("/libmlx.so") || p.contains("/libmlx.so."))
        .and_then(|p| std::path::Path::new(p).parent().map(|d| d.to_path_buf()))
}

/// MLX settings for a process that runs for long (a server, a benchmark), unless the user
/// set them; called before MLX starts. MLX's CUDA backend keeps its CUDA graphs (one per
/// sequence of kernels) in a cache of bounded size and, by default, fails the running
/// computation once that cache has missed twice its size over the process's life
/// (`lru_cache.h`): a server meets new kernel sequences as contexts grow and batches change
/// their make-up, so it would fail requests after a while (a full batch of 32 did within
/// a minute). The cache keeps working without that check.
pub fn settings_for_a_long_lived_process() {
    if std::env::var_os("MLX_ENABLE_CACHE_THRASHING_CHECK").is_none() {
        std::env::set_var("MLX_ENABLE_CACHE_THRASHING_CHECK", "0");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_the_pinned_mlx_version() {
        assert_eq!(mlx_version(), "0.32.2");
    }
}
