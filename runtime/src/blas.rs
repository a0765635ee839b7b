//! Which OpenBLAS kernels this process's f32 products on the CPU run, and what is known of
//! how they sum a product of several rows.

use std::ffi::{c_char, CStr};

/// The name of the kernels the loaded OpenBLAS runs (`openblas_get_corename`), or `None`
/// where the process has no OpenBLAS (the MLX wheel's reference BLAS, Accelerate).
pub fn loaded_kernels() -> Option<String> {
    // SAFETY: dlsym on the global scope with a NUL-terminated name; the symbol, where
    // present, is OpenBLAS's `char *openblas_get_corename(void)`, which returns a static
    // string.
    unsafe {
        let symbol = libc::dlsym(libc::RTLD_DEFAULT, c"openblas_get_corename".as_ptr());
        if symbol.is_null() {
            return None;
        }
        let corename: extern "C" fn() -> *const c_char = std::mem::transmute(symbol);
        let name = corename();
        (!name.is_null()).then(|| CStr::from_ptr(name).to_string_lossy().into_owned())
    }
}

/// Most rows of one f32 product for which OpenBLAS's kernels `name` give every row the
/// bits of that row's one-row product, whatever the thread count, where a C probe against
/// Debian 12's OpenBLAS found a limit below 64 rows (docs/verify-numerics.md, "Which OpenBLAS
/// kernels run"). `None` where every count up to 64 agreed, or where nothing was probed.
pub fn rows_summed_alike(name: &str) -> Option<i32> {
    match name {
        // AVX2 without AVX-512: groups of four rows are summed apart from one row.
        "Haswell" | "Zen" => Some(3),
        // SSE3 and older Intel kernels: two rows already are.
        "Prescott" | "Atom" | "Core2" | "Penryn" | "Dunnington" => Some(1),
        _ => None,
    }
}

/// Whether OpenBLAS's kernels `name` multiply by an f32 weight stored `[in, out]` faster
/// than by one stored `[out, in]` and read transposed (the checkpoint's layout, and
/// mlx-lm's), at the row counts of decoding and verifying. Measured through MLX with
/// each kernel set forced (docs/benchmarks.md, "Weight layout on the CPU"): Haswell's
/// and Prescott's kernels read
/// `[in, out]` faster, SkylakeX's, Cooperlake's and Sandybridge's read `[out, in]`
/// faster. Zen runs Haswell's f32 kernel and packing. Kernels not measured, and a BLAS
/// that is not OpenBLAS (`None` from [`loaded_kernels`]), keep the checkpoint's layout.
pub fn reads_inputs_by_outputs_faster(name: &str) -> bool {
    matches!(name, "Haswell" | "Zen" | "Prescott")
}
