//! Shared build script of every workspace crate that produces executables (binaries,
//! test and example programs): embeds libmlx's directory as RUNPATH so they start
//! without LD_LIBRARY_PATH, while LD_LIBRARY_PATH (searched first) can still point a
//! built binary at another libmlx with the same ABI, such as MLX's CUDA build.
//!
//! mlx-sys reports the directory as `cargo:libdir`; cargo hands it to direct
//! dependents as DEP_MLX_LIBDIR, which is why each such crate depends on mlx-sys.

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_MLX_LIBDIR");
    let Ok(dir) = std::env::var("DEP_MLX_LIBDIR") else {
        return;
    };
    let target_os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if target_os == "macos" {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    } else {
        // --enable-new-dtags writes DT_RUNPATH (not DT_RPATH), which LD_LIBRARY_PATH overrides.
        println!("cargo:rustc-link-arg=-Wl,--enable-new-dtags,-rpath,{dir}");
    }
}
