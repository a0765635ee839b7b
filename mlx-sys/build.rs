//! Builds mlx-c 0.7.0 (the C API that mlx-rs binds) against MLX 0.32.2 on Linux and macOS.
//!
//! Steps, each failing with a message that names what to install or set:
//! 1. MLX: `MLX_DIR` (a dir with `include/` and `lib/`), else the pinned PyPI wheel
//!    (`mlx-cpu`, or `mlx-metal` on macOS) installed with pip into a cache we own.
//! 2. BLAS (Linux, wheel only): OpenBLAS substituted for the wheel's reference BLAS
//!    when Debian's `libopenblas0-pthread` is present (`MLX_SYS_BLAS=wheel|openblas`).
//! 3. mlx-c sources: from the upstream `mlx-sys` 0.7.0 crate, fetched by cargo itself.
//! 4. Compile mlx-c with the `cc` crate plus three portability fixes (see `shim/`),
//!    and, off Apple's platforms, dspec's own MLX primitives (`kernels/`); not for a
//!    `cargo clippy` run, which never links (see `lint_only`).
//! 5. Bindings with bindgen; `cargo:libdir` tells dependents where libmlx lives so
//!    their executables get a RUNPATH (see `build/runpath.rs` at the workspace root).

use std::env;
use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

const MLX_VERSION: (u32, u32, u32) = (0, 32, 2);
const MLX_C_CRATE_VERSION: &str = "0.7.0";

/// A build failure with the fix spelled out for the user.
struct BuildError(String);

impl fmt::Display for BuildError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn fail<T>(msg: impl Into<String>) -> Result<T, BuildError> {
    Err(BuildError(msg.into()))
}

fn main() {
    if let Err(err) = run() {
        eprintln!("\nerror: mlx-sys build failed\n\n{err}\n");
        std::process::exit(1);
    }
}

fn run() -> Result<(), BuildError> {
    for var in [
        "MLX_DIR",
        "MLX_SYS_BLAS",
        "MLX_SYS_CACHE_DIR",
        "MLX_C_SRC",
        "PYTHON",
        "RUSTC_WORKSPACE_WRAPPER",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed=shim");
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-changed=build.rs");

    let target_os = env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    let target_arch = env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let out_dir =
        PathBuf::from(env::var("OUT_DIR").map_err(|_| BuildError("OUT_DIR unset".into()))?);
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap_or_default());
    let shim = manifest_dir.join("shim");

    let mlx = locate_mlx(&target_os)?;
    check_mlx_version(&mlx.include_dir)?;
    let (lib_dir, blas) = choose_blas(&mlx, &target_os, &target_arch)?;

    let mlx_c = locate_mlx_c_sources(&out_dir)?;
    // mlx-c declares its half types only on ARM; elsewhere we provide MLX's own.
    let needs_half_shim = target_arch != "aarch64";
    if !lint_only() {
        let build = cxx_build(&mlx_c, &mlx.include_dir, &shim, needs_half_shim)?;
        compile_mlx_c(build.clone(), &mlx_c)?;
        // Apple's MLX build vectorizes its own CPU kernels.
        if env::var("CARGO_CFG_TARGET_VENDOR").unwrap_or_default() != "apple" {
            compile_kernels(build, &manifest_dir.join("kernels"))?;
        }
    }
    generate_bindings(&mlx_c, &shim, needs_half_shim, &out_dir)?;

    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    println!("cargo:rustc-link-lib=dylib=mlx");
    println!(
        "cargo:rustc-link-lib=dylib={}",
        if target_os == "macos" {
            "c++"
        } else {
            "stdc++"
        }
    );
    // Read by dependents' build scripts as DEP_MLX_LIBDIR to set their RUNPATH.
    println!("cargo:libdir={}", lib_dir.display());
    println!("cargo:rustc-env=MLX_SYS_LIBDIR={}", lib_dir.display());
    println!("cargo:rustc-env=MLX_SYS_BLAS={blas}");
    Ok(())
}

/// Whether this run only serves `cargo clippy`. Clippy type-checks mlx-sys and never
/// links it, and cargo gives a clippy run its own copy of this script's output (the
/// workspace wrapper is part of a member's artifact hash), so compiling mlx-c here would
/// only repeat the C++ build that `cargo build` and `cargo test` do, a minute or more on
/// two cores. Bindings are still generated: type-checking needs them. Were a build
/// script or proc-macro ever to link mlx-sys, clippy would then fail to link it.
fn lint_only() -> bool {
    env::var_os("RUSTC_WORKSPACE_WRAPPER")
        .map(PathBuf::from)
        .is_some_and(|wrapper| wrapper.file_stem().is_some_and(|s| s == "clippy-driver"))
}

struct MlxInstall {
    include_dir: PathBuf,
    lib_dir: PathBuf,
    /// Set when the install is our cached wheel (so we may build a BLAS variant of it).
    wheel_root: Option<PathBuf>,
}

fn locate_mlx(target_os: &str) -> Result<MlxInstall, BuildError> {
    if let Some(dir) = env::var_os("MLX_DIR").filter(|d| !d.is_empty()) {
        let dir = PathBuf::from(dir);
        // Accept either the wheel's `mlx/` dir or a CMake-style prefix.
        let install = MlxInstall {
            include_dir: dir.join("include"),
            lib_dir: dir.join("lib"),
            wheel_root: None,
        };
        if !install.include_dir.join("mlx/version.h").is_file() {
            return fail(format!(
                "MLX_DIR={} has no include/mlx/version.h.\n\
                 Point MLX_DIR at an MLX 0.32.2 install (the `mlx` dir of the mlx-cpu/mlx-metal wheel, \
                 or a CMake install prefix), or unset it to let the build install the wheel.",
                dir.display()
            ));
        }
        return Ok(install);
    }
    let package = if target_os == "macos" {
        "mlx-metal"
    } else {
        "mlx-cpu"
    };
    let root = install_wheel(package)?;
    Ok(MlxInstall {
        include_dir: root.join("mlx/include"),
        lib_dir: root.join("mlx/lib"),
        wheel_root: Some(root),
    })
}

fn cache_root() -> Result<PathBuf, BuildError> {
    if let Some(dir) = env::var_os("MLX_SYS_CACHE_DIR").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(dir));
    }
    if let Some(dir) = env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(dir).join("dspec"));
    }
    match env::var_os("HOME").filter(|d| !d.is_empty()) {
        Some(home) => Ok(PathBuf::from(home).join(".cache/dspec")),
        None => fail("Neither MLX_SYS_CACHE_DIR, XDG_CACHE_HOME nor HOME is set: set MLX_SYS_CACHE_DIR to a writable directory for the MLX wheel."),
    }
}

/// Installs `package==0.32.2` with pip into `<cache>/<package>-0.32.2`, once.
/// Installation goes to a temporary sibling first and is renamed into place, so an
/// interrupted build never leaves a half-installed MLX behind and a rerun resumes cleanly.
fn install_wheel(package: &str) -> Result<PathBuf, BuildError> {
    let (ma, mi, pa) = MLX_VERSION;
    let version = format!("{ma}.{mi}.{pa}");
    let cache = cache_root()?;
    let dest = cache.join(format!("{package}-{version}"));
    if dest.join("mlx/include/mlx/version.h").is_file() {
        return Ok(dest);
    }
    fs::create_dir_all(&cache).map_err(|e| {
        BuildError(format!("cannot create the MLX cache dir {}: {e}\nSet MLX_SYS_CACHE_DIR to a writable directory.", cache.display()))
    })?;
    let python = env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let has_pip = Command::new(&python)
        .args(["-m", "pip", "--version"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !has_pip {
        return fail(format!(
            "`{python} -m pip` is not available, and it is needed to fetch MLX {version} ({package} from PyPI).\n\
             Install Python 3 with pip (Debian: apt-get install python3-pip), set PYTHON to a python that has pip,\n\
             or set MLX_DIR to an existing MLX {version} install."
        ));
    }
    let staging = cache.join(format!(
        ".{package}-{version}.partial-{}",
        std::process::id()
    ));
    let _ = fs::remove_dir_all(&staging);
    let status = Command::new(&python)
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            "--no-compile",
            "--target",
        ])
        .arg(&staging)
        .arg(format!("{package}=={version}"))
        .status()
        .map_err(|e| BuildError(format!("could not run {python} -m pip: {e}")))?;
    if !status.success() {
        let _ = fs::remove_dir_all(&staging);
        return fail(format!(
            "pip could not install {package}=={version} (see pip's message above).\n\
             Without network access to PyPI, set MLX_DIR to an MLX {version} install \
             (e.g. the `mlx` dir of an unpacked {package}-{version} wheel)."
        ));
    }
    // Another build may have won the race; either copy is complete.
    if fs::rename(&staging, &dest).is_err() {
        let _ = fs::remove_dir_all(&staging);
    }
    if !dest.join("mlx/include/mlx/version.h").is_file() {
        return fail(format!(
            "{package}=={version} installed into {} but has no mlx/include/mlx/version.h",
            dest.display()
        ));
    }
    Ok(dest)
}

/// mlx-c 0.7.0 compiles against MLX 0.32.2 only (0.32.4 changed signatures it uses).
fn check_mlx_version(include_dir: &Path) -> Result<(), BuildError> {
    let header = include_dir.join("mlx/version.h");
    let text = fs::read_to_string(&header)
        .map_err(|e| BuildError(format!("cannot read {}: {e}", header.display())))?;
    let field = |name: &str| -> Option<u32> {
        text.lines().find_map(|l| {
            l.trim()
                .strip_prefix("#define ")?
                .strip_prefix(name)?
                .trim()
                .parse()
                .ok()
        })
    };
    let found = (
        field("MLX_VERSION_MAJOR"),
        field("MLX_VERSION_MINOR"),
        field("MLX_VERSION_PATCH"),
    );
    let (ma, mi, pa) = MLX_VERSION;
    if found != (Some(ma), Some(mi), Some(pa)) {
        return fail(format!(
            "{} says MLX {:?}.{:?}.{:?}, but mlx-c {MLX_C_CRATE_VERSION} needs MLX {ma}.{mi}.{pa} exactly.\n\
             Point MLX_DIR at MLX {ma}.{mi}.{pa}, or unset MLX_DIR to use the pinned wheel.",
            header.display(),
            found.0,
            found.1,
            found.2
        ));
    }
    Ok(())
}

/// Returns the lib dir to link and embed, and the BLAS in use.
///
/// The CPU wheel's libmlx loads `libblas-<hash>.so` from `$ORIGIN/../../mlx_cpu.libs`
/// (its RPATH). A variant tree whose libblas/liblapack point at OpenBLAS makes the same
/// libmlx use it; the cached wheel itself stays untouched.
fn choose_blas(
    mlx: &MlxInstall,
    target_os: &str,
    target_arch: &str,
) -> Result<(PathBuf, &'static str), BuildError> {
    let choice = env::var("MLX_SYS_BLAS").unwrap_or_default();
    let Some(wheel) = mlx.wheel_root.as_ref().filter(|_| target_os == "linux") else {
        return Ok((mlx.lib_dir.clone(), "as-installed"));
    };
    if choice == "wheel" {
        return Ok((mlx.lib_dir.clone(), "reference (wheel)"));
    }
    let multiarch = format!("/usr/lib/{target_arch}-linux-gnu");
    let candidates = [
        format!("{multiarch}/openblas-pthread"),
        format!("{multiarch}/openblas-openmp"),
        format!("{multiarch}/openblas-serial"),
    ];
    let openblas = candidates
        .iter()
        .map(PathBuf::from)
        .find(|d| d.join("libblas.so.3").is_file() && d.join("liblapack.so.3").is_file());
    let Some(openblas) = openblas else {
        if choice == "openblas" {
            return fail(format!(
                "MLX_SYS_BLAS=openblas but no OpenBLAS was found in {}.\n\
                 Install it (Debian: apt-get install libopenblas0-pthread) or unset MLX_SYS_BLAS.",
                candidates.join(", ")
            ));
        }
        println!("cargo:warning=OpenBLAS not found; using the MLX wheel's reference BLAS (slower on CPU). Install libopenblas0-pthread and rebuild mlx-sys to switch.");
        return Ok((mlx.lib_dir.clone(), "reference (wheel)"));
    };

    let libs = wheel.join("mlx_cpu.libs");
    let variant = PathBuf::from(format!("{}-openblas", wheel.display()));
    let variant_lib = variant.join("mlx/lib");
    let variant_libs = variant.join("mlx_cpu.libs");
    let io = |e: std::io::Error| {
        BuildError(format!(
            "while preparing the OpenBLAS variant of MLX in {}: {e}",
            variant.display()
        ))
    };
    fs::create_dir_all(&variant_lib).map_err(io)?;
    fs::create_dir_all(&variant_libs).map_err(io)?;
    let entries = fs::read_dir(&libs).map_err(io)?;
    for entry in entries {
        let entry = entry.map_err(io)?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let target = if name.starts_with("libblas-") {
            openblas.join("libblas.so.3")
        } else if name.starts_with("liblapack-") {
            openblas.join("liblapack.so.3")
        } else {
            entry.path()
        };
        replace_symlink(&target, &variant_libs.join(&name)).map_err(io)?;
    }
    // A real copy, not a link: the loader resolves $ORIGIN from where libmlx is found.
    let lib_name = "libmlx.so";
    let src = mlx.lib_dir.join(lib_name);
    let dst = variant_lib.join(lib_name);
    let stale = match (fs::metadata(&src), fs::metadata(&dst)) {
        (Ok(a), Ok(b)) => a.len() != b.len(),
        _ => true,
    };
    if stale {
        let tmp = variant_lib.join(format!(".{lib_name}.{}", std::process::id()));
        fs::copy(&src, &tmp).map_err(io)?;
        fs::rename(&tmp, &dst).map_err(io)?;
    }
    Ok((variant_lib, "openblas"))
}

fn replace_symlink(target: &Path, link: &Path) -> std::io::Result<()> {
    if fs::read_link(link).map(|t| t == target).unwrap_or(false) {
        return Ok(());
    }
    let tmp = link.with_extension(format!("tmp{}", std::process::id()));
    let _ = fs::remove_file(&tmp);
    #[cfg(unix)]
    std::os::unix::fs::symlink(target, &tmp)?;
    #[cfg(not(unix))]
    fs::copy(target, &tmp).map(|_| ())?;
    fs::rename(&tmp, link)
}

/// Finds mlx-c inside the upstream `mlx-sys` crate, letting cargo download it.
///
/// A throwaway manifest with its own `[workspace]` table depends on the upstream crate;
/// `cargo metadata` fetches and unpacks it into cargo's registry and reports its path.
/// Our workspace's `[patch]` does not apply there, so this really is the crates.io crate.
fn locate_mlx_c_sources(out_dir: &Path) -> Result<PathBuf, BuildError> {
    if let Some(dir) = env::var_os("MLX_C_SRC").filter(|d| !d.is_empty()) {
        let dir = PathBuf::from(dir);
        if !dir.join("mlx/c/mlx.h").is_file() {
            return fail(format!("MLX_C_SRC={} has no mlx/c/mlx.h: point it at an mlx-c {MLX_C_CRATE_VERSION} source tree.", dir.display()));
        }
        return Ok(dir);
    }
    let probe = out_dir.join("mlx-c-fetch");
    let io = |e: std::io::Error| BuildError(format!("cannot write {}: {e}", probe.display()));
    fs::create_dir_all(probe.join("src")).map_err(io)?;
    fs::write(
        probe.join("Cargo.toml"),
        format!(
            "[package]\nname = \"mlx-c-source-probe\"\nversion = \"0.0.0\"\nedition = \"2021\"\npublish = false\n\n\
             [dependencies]\nmlx-sys = {{ version = \"={MLX_C_CRATE_VERSION}\", default-features = false }}\n\n[workspace]\n"
        ),
    )
    .map_err(io)?;
    fs::write(probe.join("src/lib.rs"), "").map_err(io)?;
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let output = Command::new(&cargo)
        .args(["metadata", "--format-version", "1", "--manifest-path"])
        .arg(probe.join("Cargo.toml"))
        // Don't let the outer build's target dir or flags leak into the probe.
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("RUSTFLAGS")
        .output()
        .map_err(|e| BuildError(format!("could not run `{cargo} metadata`: {e}")))?;
    if !output.status.success() {
        return fail(format!(
            "cargo could not fetch the upstream mlx-sys {MLX_C_CRATE_VERSION} crate (which carries the mlx-c sources):\n{}\n\
             Make crates.io reachable once (the crate is then cached), or set MLX_C_SRC to an mlx-c {MLX_C_CRATE_VERSION} source tree.",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    let meta: serde_json::Value = serde_json::from_slice(&output.stdout)
        .map_err(|e| BuildError(format!("cargo metadata printed invalid JSON: {e}")))?;
    let manifest = meta["packages"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["name"] == "mlx-sys" && p["version"] == MLX_C_CRATE_VERSION)
        .and_then(|p| p["manifest_path"].as_str())
        .map(PathBuf::from);
    let Some(manifest) = manifest else {
        return fail(format!("cargo metadata did not list mlx-sys {MLX_C_CRATE_VERSION}; set MLX_C_SRC to an mlx-c source tree."));
    };
    let src = manifest
        .parent()
        .map(|d| d.join("src/mlx-c"))
        .unwrap_or_default();
    if !src.join("mlx/c/mlx.h").is_file() {
        return fail(format!(
            "{} has no mlx/c/mlx.h; set MLX_C_SRC to an mlx-c {MLX_C_CRATE_VERSION} source tree.",
            src.display()
        ));
    }
    Ok(src)
}

/// A C++ build against MLX's and mlx-c's headers, with the portability prelude: what
/// mlx-c and dspec's own kernels share.
fn cxx_build(
    mlx_c: &Path,
    mlx_include: &Path,
    shim: &Path,
    half_shim: bool,
) -> Result<cc::Build, BuildError> {
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++20")
        .include(mlx_c)
        .include(mlx_include)
        .include(shim)
        .warnings(false);
    let compiler = build.try_get_compiler().map_err(|e| {
        BuildError(format!(
            "no C++ compiler found ({e}).\nInstall one (Debian: apt-get install g++), or set CXX."
        ))
    })?;
    let runs = Command::new(compiler.path())
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !runs {
        return fail(format!(
            "the C++ compiler `{}` does not run.\nInstall one (Debian: apt-get install g++), or set CXX.",
            compiler.path().display()
        ));
    }
    // Force-include the portability prelude: std::format for gcc 12, half types off ARM.
    let prelude = if half_shim {
        "mlxc_prelude.h"
    } else {
        "format_compat.h"
    };
    build.flag("-include").flag(prelude);
    Ok(build)
}

fn compile_mlx_c(mut build: cc::Build, mlx_c: &Path) -> Result<(), BuildError> {
    // mlx-c is thin glue; keep it optimised even in debug builds, it costs little.
    build.opt_level(2).debug(false);
    let mut sources: Vec<PathBuf> = fs::read_dir(mlx_c.join("mlx/c"))
        .map_err(|e| {
            BuildError(format!(
                "cannot list {}: {e}",
                mlx_c.join("mlx/c").display()
            ))
        })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "cpp"))
        // object.cpp is commented out of mlx-c's own CMake source list.
        .filter(|p| p.file_name().is_some_and(|n| n != "object.cpp"))
        .collect();
    sources.sort();
    if sources.is_empty() {
        return fail(format!(
            "no mlx-c sources in {}",
            mlx_c.join("mlx/c").display()
        ));
    }
    build.files(&sources);
    compile(build, "mlxc", "mlx-c")
}

/// dspec's own MLX primitives (`kernels/`): optimised in every profile, and with no
/// contraction into fused multiply-adds, so that their vector loops and scalar tails
/// round alike (see the file's head).
fn compile_kernels(mut build: cc::Build, kernels: &Path) -> Result<(), BuildError> {
    let source = kernels.join("cpu_exp_ops.cpp");
    build
        .opt_level(3)
        .debug(false)
        .flag("-ffp-contract=off")
        .file(&source);
    compile(build, "dspec_kernels", &source.display().to_string())
}

/// Compiles `build` into the static library `lib`; `what` names it in the error.
fn compile(build: cc::Build, lib: &str, what: &str) -> Result<(), BuildError> {
    build.try_compile(lib).map_err(|e| {
        BuildError(format!(
            "compiling {what} failed: {e}\nA C++20 compiler is needed (Debian 12: g++ 12)."
        ))
    })
}

fn generate_bindings(
    mlx_c: &Path,
    shim: &Path,
    half_shim: bool,
    out_dir: &Path,
) -> Result<(), BuildError> {
    let mut headers: Vec<PathBuf> = fs::read_dir(mlx_c.join("mlx/c"))
        .map_err(|e| BuildError(format!("cannot list mlx-c headers: {e}")))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "h"))
        .collect();
    headers.sort();
    let mut builder = bindgen::Builder::default()
        .clang_arg(format!("-I{}", mlx_c.display()))
        // Rust declares these itself; bindgen's c_ulong signatures trip a rustc lint.
        .blocklist_function("malloc")
        .blocklist_function("realloc")
        .layout_tests(false);
    if half_shim {
        builder = builder
            .clang_arg("-DHAS_FLOAT16")
            .clang_arg("-DHAS_BFLOAT16")
            .clang_arg("-include")
            .clang_arg(shim.join("bindgen_half.h").display().to_string())
            .blocklist_type("float16_t")
            .blocklist_type("bfloat16_t");
    }
    for h in &headers {
        builder = builder.header(h.display().to_string());
    }
    // bindgen panics when it cannot load libclang; turn that into an actionable message.
    let generated =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || builder.generate()));
    let bindings = match generated {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => return fail(format!("bindgen could not parse the mlx-c headers: {e}")),
        Err(panic) => {
            let why = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            return fail(format!(
                "bindgen failed: {why}\n\
                 bindgen needs libclang: install it (Debian: apt-get install libclang-dev), \
                 or set LIBCLANG_PATH to the directory holding libclang.so."
            ));
        }
    };
    bindings
        .write_to_file(out_dir.join("bindings.rs"))
        .map_err(|e| BuildError(format!("cannot write bindings: {e}")))
}
