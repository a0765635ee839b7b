//! dspec's own CUDA kernels for short continuations (a speculative verify of up to
//! [`MAX_ROWS`] positions): a product of a few rows with a dense weight ([`product`])
//! and causal attention of a few queries over the KV cache ([`attention`]).
//!
//! Why: in MLX's CUDA backend a product of more than one row goes to cuBLASLt,
//! whose matmul MLX sets up and captures into its CUDA graph on every call, and
//! attention of more than one query with a mask goes to cuDNN, likewise captured. Each
//! such call costs the host more than a kernel node (docs/benchmarks.md), and a model
//! whose step is host-bound paid that on every layer of every verify. These kernels are plain kernel nodes,
//! compiled once per process by NVRTC through MLX's `fast::cuda_kernel`.
//!
//! They pay where a decode step is host-bound. Where the device is the bottleneck,
//! cuBLASLt's products still read the weights a little faster (see [`wanted`]).
//!
//! They round differently from MLX's one-row kernels, as cuBLASLt and cuDNN do: greedy
//! output stays plain decoding's up to near-ties (docs/verify-numerics.md), and
//! `--verify exact` keeps the bitwise row layout, which does not use them.
//!
//! MLX compiles a custom kernel at its first call in each process and keeps it out of its
//! disk cache: about two seconds per kernel on an H100 host, a one-off that a long-lived
//! process repays and a one-shot generation of a few hundred tokens does not. So the
//! kernels run where the command asks for them (`LoadOptions::verify_kernels`: `dspec
//! serve`, `dspec bench`), and [`warm_up`] compiles them on a thread of its own as soon as
//! the model's shapes are known. MLX holds its compile lock meanwhile, so the process's
//! first kernels of MLX's own wait for it too: the one-off lands in loading or prefill
//! rather than in a verify.

pub mod attention;
pub mod product;

use std::ffi::{CStr, CString};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::thread::JoinHandle;

use mlx_rs::{Array, Dtype, Stream};

use dspec_plugin_api::error::{ModelError, Result};
use dspec_runtime::files::{fnv1a, xdg_dir};
use dspec_runtime::Backend;

/// Most positions the kernels take in one call: two tensor-core products' worth of rows
/// ([`product`]), as many as `--max-draft auto:15` verifies.
pub const MAX_ROWS: i32 = 16;

/// Bytes of weights a decode step reads up to which a model's short continuations go
/// through the kernels (on an H100, about what the device reads in the time the host
/// takes to queue a step): Qwen2.5-Coder-1.5B in bf16 (3.1 GB) gains from them,
/// Qwen2.5-7B (14 GB), whose verify is bound by the device, loses a little
/// (docs/benchmarks.md, "dspec's CUDA kernels").
pub const HOST_BOUND_WEIGHT_BYTES: f64 = 5e9;

/// `DSPEC_CUDA_KERNELS`: unset (or any other value), where asked for and the model is
/// small enough ([`wanted`]); `0`, never; `1`, for every model size and command (A/B runs,
/// or a one-shot generation long enough to repay the compile); the kernels' own limits
/// (dtype, head size, no softcapping, `--verify exact` off) hold either way.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Setting {
    BySize,
    Never,
    Always,
}

fn setting() -> Setting {
    static SETTING: OnceLock<Setting> = OnceLock::new();
    *SETTING.get_or_init(|| setting_of(std::env::var("DSPEC_CUDA_KERNELS").ok().as_deref()))
}

fn setting_of(value: Option<&str>) -> Setting {
    match value {
        Some("0") => Setting::Never,
        Some("1") => Setting::Always,
        _ => Setting::BySize,
    }
}

/// Whether the kernels can run in this process for `dtype`: on CUDA, for 16-bit floats,
/// unless `DSPEC_CUDA_KERNELS=0`.
pub fn available(dtype: Dtype) -> bool {
    Backend::current() == Backend::Cuda
        && setting() != Setting::Never
        && matches!(dtype, Dtype::Bfloat16 | Dtype::Float16)
}

/// Whether a model whose decode step reads `step_weight_bytes` runs its short
/// continuations through the kernels, when the command `asked` for them
/// (`LoadOptions::verify_kernels`): where a step is host-bound
/// ([`HOST_BOUND_WEIGHT_BYTES`]), or at any size where every verify is `waited_on`
/// (`LoadOptions::verifies_waited_on`: then no device work hides the host's part of a
/// verify, which the kernels cut), unless `DSPEC_CUDA_KERNELS` says otherwise.
pub fn wanted(step_weight_bytes: f64, asked: bool, waited_on: bool) -> bool {
    wanted_under(setting(), step_weight_bytes, asked, waited_on)
}

fn wanted_under(setting: Setting, step_weight_bytes: f64, asked: bool, waited_on: bool) -> bool {
    match setting {
        Setting::Always => true,
        Setting::Never => false,
        Setting::BySize => asked && (waited_on || step_weight_bytes <= HOST_BOUND_WEIGHT_BYTES),
    }
}

/// The template arguments of one attention kernel build: head size, sliding window,
/// score scale, and whether it is causal (a verify) or a drafter's block.
#[derive(Clone, Copy, PartialEq)]
pub struct AttentionShape {
    pub head_dim: i32,
    pub window: Option<i32>,
    pub scale: f32,
    pub causal: bool,
}

/// A compile started by [`warm_up`]; dropping it waits for the compile to end, so that
/// it never outlives the model that asked for it (nor runs into the process's exit).
pub struct WarmUp(Option<JoinHandle<()>>);

impl Drop for WarmUp {
    fn drop(&mut self) {
        if let Some(compile) = self.0.take() {
            let _ = compile.join();
        }
    }
}

/// Compiles the kernels a model in `dtype` whose layers have these attention shapes will
/// call, on a thread of its own (MLX evaluates from several threads, each on its own
/// stream, and shares what it compiled). Calls that come first wait for the compile instead of
/// starting another. A failure is left for the real call to report.
pub fn warm_up(dtype: Dtype, layers: Vec<AttentionShape>) -> WarmUp {
    // One build per distinct shape: layers share them.
    let mut shapes: Vec<AttentionShape> = Vec::new();
    for shape in layers {
        if !shapes.contains(&shape) {
            shapes.push(shape);
        }
    }
    let compile = move || -> Result<()> {
        let zeros = |shape: &[i32]| Array::zeros::<f32>(shape)?.as_dtype(dtype);
        let mut outs = vec![product::product(&zeros(&[1, 2, 8])?, &zeros(&[8, 8])?)?];
        for s in shapes {
            let (q, kv) = (
                zeros(&[1, 1, 2, s.head_dim])?,
                zeros(&[1, 1, 2, s.head_dim])?,
            );
            outs.push(attention::attend(
                &q, &kv, &kv, s.scale, s.window, s.causal,
            )?);
        }
        mlx_rs::transforms::eval(&outs)?;
        Ok(())
    };
    WarmUp(
        std::thread::Builder::new()
            .name("dspec-cuda-kernels".into())
            .spawn(move || {
                let _ = compile();
            })
            .ok(),
    )
}

/// One kernel: its name, parameter names and body (MLX writes the signature, with
/// `NAME_shape`/`NAME_strides` parameters for the inputs whose shape or strides the
/// body mentions).
struct Kernel(mlx_sys::mlx_fast_cuda_kernel);

/// A C string of one of this module's constant names or sources.
fn c_string(s: &str) -> CString {
    CString::new(s).unwrap_or_default()
}

impl Kernel {
    /// `row_contiguous`: MLX copies inputs that are not (a body that indexes them
    /// densely needs it; one that reads `_strides` does not).
    /// `header`: code placed before the kernel, outside its body (device functions).
    /// Both reach MLX as [`included`] makes them.
    fn new(
        name: &str,
        inputs: &[&str],
        header: &str,
        source: &str,
        row_contiguous: bool,
    ) -> Kernel {
        let dir = cache_dir();
        let header = included(header, "", &dir);
        let source = included(source, &shape_parameters(source, inputs), &dir);
        let strings = |names: &[&str]| {
            // SAFETY: a fresh vector; mlx-c copies each name in.
            unsafe {
                let v = mlx_sys::mlx_vector_string_new();
                for name in names {
                    let c = c_string(name);
                    mlx_sys::mlx_vector_string_append_value(v, c.as_ptr());
                }
                v
            }
        };
        let (inputs, outputs) = (strings(inputs), strings(&["out"]));
        let (name, source, header) = (c_string(name), c_string(&source), c_string(&header));
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

impl Drop for Kernel {
    fn drop(&mut self) {
        // SAFETY: made by `mlx_fast_cuda_kernel_new`, freed once.
        unsafe { mlx_sys::mlx_fast_cuda_kernel_free(self.0) };
    }
}

/// The parameters MLX adds to a kernel's signature for the inputs whose `_shape`,
/// `_strides` or `_ndim` the body mentions, named in a comment (MLX looks for the names
/// in the source it is given).
fn shape_parameters(source: &str, inputs: &[&str]) -> String {
    let used: Vec<String> = inputs
        .iter()
        .flat_map(|input| ["_shape", "_strides", "_ndim"].map(|suffix| format!("{input}{suffix}")))
        .filter(|parameter| source.contains(parameter.as_str()))
        .collect();
    match used.is_empty() {
        true => String::new(),
        false => format!("// reads {}\n", used.join(" ")),
    }
}

/// Where kernel texts are written for NVRTC to include: `$XDG_CACHE_HOME/dspec/cuda`,
/// else `~/.cache/dspec/cuda`; `None` where neither is set.
fn cache_dir() -> Option<PathBuf> {
    xdg_dir("XDG_CACHE_HOME", ".cache").map(|cache| cache.join("dspec").join("cuda"))
}

/// `body` with `constants` written in front of it as `constexpr int`s: for values that
/// never vary, since every template argument is text MLX formats again at each call.
fn with_constants(constants: &[(&str, i32)], body: &str) -> String {
    let lines: String = constants
        .iter()
        .map(|(name, value)| format!("    constexpr int {name} = {value};\n"))
        .collect();
    lines + body
}

/// What MLX is handed for one piece of a kernel's text (its header or its body).
///
/// MLX pastes a custom kernel's whole text into a new source at every call and
/// hashes that source at every evaluation (`mlx/backend/cuda/custom_kernel.cpp`): host
/// time that grows with the text, paid by every product and attention of every verify
/// (docs/benchmarks.md has the measurement). So the text is written once, to a file
/// under `dir` named by its content, and MLX gets a one-line `#include` of it (NVRTC
/// opens absolute include paths), followed by `also` (the parameter names MLX must still
/// find). Where no file can be written, MLX gets the text itself.
fn included(text: &str, also: &str, dir: &Option<PathBuf>) -> String {
    if text.is_empty() {
        return String::new();
    }
    // A directory the `#include` line can spell exactly (the file names are hex):
    // absolute, UTF-8, no quote, backslash or line break.
    let spelled = |dir: &&Path| {
        dir.is_absolute()
            && dir
                .to_str()
                .is_some_and(|d| !d.contains(['"', '\\', '\n', '\r']))
    };
    let path = dir
        .as_deref()
        .filter(spelled)
        .and_then(|dir| written(text, dir).ok());
    match path.as_deref().and_then(Path::to_str) {
        Some(path) => format!("#include \"{path}\"\n{also}"),
        None => text.to_string(),
    }
}

/// `text` in a file of `dir` named by its content: written there unless a file of that
/// name already holds exactly it (another process's, or an earlier run's), through a
/// temporary file renamed into place so that a reader never sees it half written.
fn written(text: &str, dir: &Path) -> std::io::Result<PathBuf> {
    let path = dir.join(format!("dspec-{:016x}.cuh", fnv1a(text.as_bytes())));
    if std::fs::read(&path).is_ok_and(|held| held == text.as_bytes()) {
        return Ok(path);
    }
    std::fs::create_dir_all(dir)?;
    let mut temporary = tempfile::NamedTempFile::new_in(dir)?;
    temporary.write_all(text.as_bytes())?;
    temporary.persist(&path).map_err(|e| e.error)?;
    Ok(path)
}

/// How one call runs: the output's shape and dtype (also the template type `T`), the
/// grid in threads (MLX's convention, as for Metal), the block size, and the integer
/// template arguments.
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
        status |= mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_dtype(
            config,
            c"T".as_ptr(),
            dtype,
        );
        for (name, value) in launch.ints {
            status |= mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_int(
                config,
                name.as_ptr(),
                *value,
            );
        }
        let ins = mlx_sys::mlx_vector_array_new();
        for a in inputs {
            status |= mlx_sys::mlx_vector_array_append_value(ins, a.as_ptr());
        }
        let mut outs = mlx_sys::mlx_vector_array_new();
        if status == 0 {
            status = mlx_sys::mlx_fast_cuda_kernel_apply(
                &mut outs,
                kernel.0,
                ins,
                config,
                stream.as_ref().as_ptr(),
            );
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
                "MLX refused one of dspec's CUDA kernels (set DSPEC_CUDA_KERNELS=0 to run \
                 without them)"
                    .into(),
            ));
        }
        Ok(Array::from_ptr(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `DSPEC_CUDA_KERNELS` overrides both the command and the size; unset, the kernels
    /// run only where the command asks and the model is host-bound.
    #[test]
    fn the_setting_and_the_size_decide() {
        assert_eq!(setting_of(None), Setting::BySize);
        assert_eq!(setting_of(Some("yes")), Setting::BySize);
        let (small, large) = (3.1e9, 14.1e9);
        assert!(wanted_under(Setting::BySize, small, true, false));
        assert!(!wanted_under(Setting::BySize, small, false, false));
        assert!(!wanted_under(Setting::BySize, large, true, false));
        // Rounds that wait on every verify take them at any size, where asked.
        assert!(wanted_under(Setting::BySize, large, true, true));
        assert!(!wanted_under(Setting::BySize, large, false, true));
        assert!(wanted_under(setting_of(Some("1")), large, false, false));
        assert!(!wanted_under(setting_of(Some("0")), small, true, true));
    }

    /// MLX gets an `#include` of a file holding the text exactly (the same file for the
    /// same text, rewritten where it holds something else), with the shape parameters
    /// the text reads still named; where nothing can be written, the text itself.
    #[test]
    fn kernel_texts_reach_mlx_through_a_file() {
        let body = "    out[0] = x[x_shape[0] - 1] + w[w_ndim];\n";
        let also = shape_parameters(body, &["x", "w"]);
        assert_eq!(also, "// reads x_shape w_ndim\n");
        assert_eq!(shape_parameters("out[0] = x[0];", &["x"]), "");

        let home = tempfile::tempdir().unwrap();
        let dir = Some(home.path().join("dspec").join("cuda"));
        let source = included(body, &also, &dir);
        let path = source
            .strip_prefix("#include \"")
            .and_then(|rest| rest.split_once("\"\n"))
            .map(|(path, rest)| {
                assert_eq!(rest, also);
                PathBuf::from(path)
            })
            .expect("an #include line");
        assert!(path.is_absolute());
        assert_eq!(std::fs::read_to_string(&path).unwrap(), body);
        assert_eq!(included(body, &also, &dir), source, "one file per text");
        assert_ne!(included("other text", "", &dir), source);

        std::fs::write(&path, "stale").unwrap();
        assert_eq!(included(body, &also, &dir), source);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), body, "rewritten");

        assert_eq!(included(body, &also, &None), body);
        let quoted = home.path().join("a \"quoted\" dir");
        assert_eq!(
            included(body, &also, &Some(quoted.clone())),
            body,
            "a path #include cannot spell"
        );
        assert!(
            !quoted.exists(),
            "nothing written where it cannot be included"
        );
        assert_eq!(
            included(body, &also, &Some(PathBuf::from("relative"))),
            body
        );
        let blocked = home.path().join("a file");
        std::fs::write(&blocked, "").unwrap();
        assert_eq!(included(body, &also, &Some(blocked.join("cuda"))), body);
        assert_eq!(included("", "", &dir), "");
    }

    /// Constants go in front of the body, one `constexpr int` each.
    #[test]
    fn constants_are_written_before_the_body() {
        assert_eq!(
            with_constants(&[("A", 1), ("B", -2)], "body;\n"),
            "    constexpr int A = 1;\n    constexpr int B = -2;\nbody;\n"
        );
    }
}
