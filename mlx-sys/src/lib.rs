//! Raw bindings to mlx-c 0.7.0, built against MLX 0.32.2 (see build.rs).
//! Drop-in for the crates.io `mlx-sys` 0.7.0 that mlx-rs pins, but portable to Linux.
#![allow(
    non_upper_case_globals,
    non_camel_case_types,
    non_snake_case,
    clippy::all
)]

include!(concat!(env!("OUT_DIR"), "/bindings.rs"));

// Off ARM, bindgen sees 16-bit stand-ins for the half types (shim/bindgen_half.h);
// mlx-rs expects them in the shape bindgen gives them on Apple Silicon.
#[cfg(not(target_arch = "aarch64"))]
mod half_types {
    /// IEEE half, as bindgen spells `__fp16` on ARM.
    #[repr(transparent)]
    #[derive(Debug, Default, Copy, Clone, PartialEq)]
    pub struct __BindgenFloat16(pub u16);
    pub type float16_t = __BindgenFloat16;
    /// bfloat16 bits.
    pub type bfloat16_t = u16;
}
#[cfg(not(target_arch = "aarch64"))]
pub use half_types::*;

/// mlx-rs seeds its default PRNG from Mach's clock (through mach-sys); off Apple
/// platforms nothing defines that symbol, so we provide one with the same meaning
/// (a monotonic-enough nanosecond count).
#[cfg(not(target_vendor = "apple"))]
#[no_mangle]
pub extern "C" fn mach_approximate_time() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// The directory of the libmlx this crate linked against (embedded as RUNPATH).
pub const LINKED_LIBMLX_DIR: &str = env!("MLX_SYS_LIBDIR");

/// Which BLAS the linked libmlx uses on the CPU: `openblas`, `reference (wheel)`,
/// or `as-installed` for an `MLX_DIR` install.
pub const LINKED_BLAS: &str = env!("MLX_SYS_BLAS");

/// dspec's own MLX primitives (`kernels/cpu_exp_ops.cpp`), f32 on the CPU backend only,
/// built off Apple's platforms. Each returns 0 with `res` set, or 1 with the reason in
/// `error` (NUL-terminated, at most `error_len` bytes).
#[cfg(not(target_vendor = "apple"))]
pub mod dspec_kernels {
    use super::{mlx_array, mlx_stream};
    use std::os::raw::c_char;

    extern "C" {
        /// Softmax over the last axis.
        pub fn dspec_softmax_f32(
            res: *mut mlx_array,
            x: mlx_array,
            stream: mlx_stream,
            error: *mut c_char,
            error_len: usize,
        ) -> i32;
        /// `silu(gate) * up`, elementwise; both of one shape.
        pub fn dspec_silu_product_f32(
            res: *mut mlx_array,
            gate: mlx_array,
            up: mlx_array,
            stream: mlx_stream,
            error: *mut c_char,
            error_len: usize,
        ) -> i32;
    }
}
