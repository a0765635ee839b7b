//! Custom CUDA kernels (MLX's `fast::cuda_kernel`, compiled by NVRTC on first use and
//! cached by MLX per template arguments) for the two operations of a decode step whose
//! MLX kernels round differently for one position than for several: attention over the
//! cache ([`attention`]) and products with dense weights ([`matvec`]).
//!
//! Decoding and speculative verifies both go through them on CUDA, and each computes
//! every position with the same code in the same order however many positions share
//! the call. So a verify's logits are bitwise those of decoding the same tokens one by
//! one, with one graph node per operation for all positions. (The portable row layout,
//! used elsewhere, keeps MLX's kernels and pays for it with several nodes per position
//! and per product; a host-bound GPU step pays for every node.)

pub mod attention;
pub mod matvec;

use std::ffi::{CStr, CString};
use std::sync::OnceLock;

use mlx_rs::{Array, Dtype, Stream};

use dspec_plugin_api::backend::Backend;
use dspec_plugin_api::error::{ModelError, Result};

/// Whether the kernels are switched on and run here: on CUDA, with
/// `DSPEC_CUDA_KERNELS=1`, read once. Checked first on the decode path, before anything
/// asks MLX for shapes or dtypes.
///
/// Opt-in while they are slower where it counts: on an H100 with the real Qwen2.5-Coder
/// pair, plain decoding with them ran at 261 tok/s (2.15x mlx-lm's on that machine), but
/// speculative decoding with the 0.5B draft model at 84 tok/s against mlx-lm's 90, its
/// 5-token verifies still taking 7.4 ms and its drafting rounds after a fully kept draft
/// 29 ms against 12 ms after a rejection. Until that is understood, MLX's kernels in the
/// portable row layout stay the default.
pub fn enabled() -> bool {
    static ENABLED: OnceLock<bool> = OnceLock::new();
    *ENABLED.get_or_init(|| {
        std::env::var("DSPEC_CUDA_KERNELS").is_ok_and(|v| v == "1")
            && Backend::current() == Backend::Cuda
    })
}

/// Whether the kernels run here and take `dtype`.
pub fn available(dtype: Dtype) -> bool {
    enabled() && matches!(dtype, Dtype::Float16 | Dtype::Bfloat16 | Dtype::Float32)
}

/// One kernel: its name, parameter names and body (MLX writes the signature).
struct Kernel(mlx_sys::mlx_fast_cuda_kernel);

impl Kernel {
    /// `row_contiguous`: MLX copies inputs that are not (the body indexes them densely).
    fn new(name: &str, inputs: &[&str], source: &str, row_contiguous: bool) -> Kernel {
        let strings = |names: &[&str]| {
            // SAFETY: a fresh vector; each name is copied in by mlx-c.
            unsafe {
                let v = mlx_sys::mlx_vector_string_new();
                for name in names {
                    let c = CString::new(*name).expect("kernel names have no NUL");
                    mlx_sys::mlx_vector_string_append_value(v, c.as_ptr());
                }
                v
            }
        };
        let (inputs, outputs) = (strings(inputs), strings(&["out"]));
        let name = CString::new(name).expect("no NUL");
        let source = CString::new(source).expect("no NUL");
        let header = CString::new("").expect("no NUL");
        // SAFETY: all arguments are valid for the call; mlx-c copies what it keeps.
        unsafe {
            let kernel = mlx_sys::mlx_fast_cuda_kernel_new(
                name.as_ptr(),
                inputs,
                outputs,
                source.as_ptr(),
                header.as_ptr(),
                row_contiguous,
                0,
            );
            mlx_sys::mlx_vector_string_free(inputs);
            mlx_sys::mlx_vector_string_free(outputs);
            Kernel(kernel)
        }
    }
}

/// How one call runs: output shape and dtype (also the template type `T`), grid in
/// threads, block size, and the integer template arguments (names as C literals: a call
/// per layer and token allocates nothing for them).
struct Launch<'a> {
    out_shape: &'a [i32],
    dtype: Dtype,
    grid: (i32, i32, i32),
    block: i32,
    ints: &'a [(&'a CStr, i32)],
}

fn apply(kernel: &Kernel, inputs: &[&Array], launch: Launch<'_>) -> Result<Array> {
    let stream = Stream::thread_local_or_default();
    // SAFETY: the config and the vectors are created, used and freed here; the arrays
    // they hold are reference-counted by MLX.
    unsafe {
        let config = mlx_sys::mlx_fast_cuda_kernel_config_new();
        let dtype = launch.dtype.into();
        let mut status = mlx_sys::mlx_fast_cuda_kernel_config_add_output_arg(
            config,
            launch.out_shape.as_ptr(),
            launch.out_shape.len(),
            dtype,
        );
        let (gx, gy, gz) = launch.grid;
        status |= mlx_sys::mlx_fast_cuda_kernel_config_set_grid(config, gx, gy, gz);
        status |= mlx_sys::mlx_fast_cuda_kernel_config_set_thread_group(config, launch.block, 1, 1);
        status |= mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_dtype(config, c"T".as_ptr(), dtype);
        for (name, value) in launch.ints {
            status |= mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_int(config, name.as_ptr(), *value);
        }
        let ins = mlx_sys::mlx_vector_array_new();
        for a in inputs {
            status |= mlx_sys::mlx_vector_array_append_value(ins, a.as_ptr());
        }
        let mut outs = mlx_sys::mlx_vector_array_new();
        if status == 0 {
            status = mlx_sys::mlx_fast_cuda_kernel_apply(&mut outs, kernel.0, ins, config, stream.as_ref().as_ptr());
        }
        let mut out = mlx_sys::mlx_array_new();
        if status == 0 {
            status = mlx_sys::mlx_vector_array_get(&mut out, outs, 0);
        }
        mlx_sys::mlx_vector_array_free(ins);
        mlx_sys::mlx_vector_array_free(outs);
        mlx_sys::mlx_fast_cuda_kernel_config_free(config);
        if status != 0 {
            mlx_sys::mlx_array_free(out);
            return Err(ModelError::Unsupported(
                "MLX refused a custom CUDA kernel call".into(),
            ));
        }
        Ok(Array::from_ptr(out))
    }
}
