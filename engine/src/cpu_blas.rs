//! Which kernels OpenBLAS runs this process's f32 products with on the CPU, and the
//! restart that corrects them where OpenBLAS took the CPU for a much older one.
//!
//! OpenBLAS built for many CPUs (`DYNAMIC_ARCH`, as Debian ships it) picks its kernels
//! once, as it loads. Older releases take an Intel CPU of family 6 whose model they do
//! not know for a Prescott (SSE3) instead of choosing by instruction set as they do for
//! other unknown CPUs; Debian 12's does this on Emerald Rapids Xeons
//! (docs/mlx-on-linux.md names the releases and the fix). Those kernels are slower, and they sum a product of two rows
//! differently from a product of one, so a verify's rows would round apart from
//! one-token decoding and f32 speculative greedy output could leave plain decoding's.
//!
//! OpenBLAS reads `OPENBLAS_CORETYPE` only as it loads, which is before `main`: the
//! command line starts itself again with it set ([`restart_on_the_cpu_s_kernels`]).

use std::ffi::OsString;

/// The variable OpenBLAS reads its kernels' name from.
pub const CORETYPE: &str = "OPENBLAS_CORETYPE";

/// Set by the restart to the kernels OpenBLAS had picked, so that the restarted process
/// can say why its kernels were chosen.
const REPLACED: &str = "DSPEC_OPENBLAS_REPLACED_CORE";

/// OpenBLAS's kernels for CPUs without AVX. A CPU with AVX running one of them was not
/// recognised.
const WITHOUT_AVX: &[&str] = &[
    "Katmai",
    "Coppermine",
    "Northwood",
    "Prescott",
    "Banias",
    "Atom",
    "Core2",
    "Penryn",
    "Dunnington",
    "Nehalem",
    "Athlon",
    "Opteron",
    "Opteron_SSE3",
    "Barcelona",
    "Nano",
];

use dspec_runtime::blas::loaded_kernels;

/// OpenBLAS's kernels for this CPU by its instruction sets, as current OpenBLAS picks
/// them for a CPU it does not know: AVX-512 (with VL) SkylakeX, AVX2 Haswell, AVX
/// Sandybridge. `None` without AVX.
pub fn kernels_by_instruction_set() -> Option<&'static str> {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512vl") {
            return Some("SkylakeX");
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            return Some("Haswell");
        }
        if std::arch::is_x86_feature_detected!("avx") {
            return Some("Sandybridge");
        }
    }
    None
}

/// The kernels OpenBLAS should run here when it runs kernels for a CPU without AVX on one
/// that has it; `None` where its choice stands.
fn correction(
    loaded: Option<&str>,
    by_instruction_set: Option<&'static str>,
) -> Option<&'static str> {
    let loaded = loaded?;
    let by_instruction_set = by_instruction_set?;
    WITHOUT_AVX
        .iter()
        .any(|k| k.eq_ignore_ascii_case(loaded))
        .then_some(by_instruction_set)
}

/// The kernels to run instead of those OpenBLAS picked, where it did not recognise this CPU.
pub fn misidentified() -> Option<&'static str> {
    correction(loaded_kernels().as_deref(), kernels_by_instruction_set())
}

/// Where OpenBLAS did not recognise this CPU and `OPENBLAS_CORETYPE` is unset, starts this
/// program again, with the same arguments and `OPENBLAS_CORETYPE` naming the kernels its
/// instruction sets call for; returns only where nothing needs doing or the restart
/// failed (which it reports). Call it first thing in `main`, before any thread starts.
pub fn restart_on_the_cpu_s_kernels() {
    use std::os::unix::process::CommandExt;
    if std::env::var_os(CORETYPE).is_some() {
        return;
    }
    let Some(replaced) = loaded_kernels() else {
        return;
    };
    let Some(kernels) = correction(Some(&replaced), kernels_by_instruction_set()) else {
        return;
    };
    let error = match std::env::current_exe() {
        Ok(exe) => {
            let mut args = std::env::args_os();
            let mut command = std::process::Command::new(exe);
            if let Some(arg0) = args.next() {
                command.arg0(arg0);
            }
            let args: Vec<OsString> = args.collect();
            command
                .args(args)
                .env(CORETYPE, kernels)
                .env(REPLACED, &replaced)
                .exec()
        }
        Err(e) => e,
    };
    eprintln!(
        "warning: OpenBLAS runs its {replaced} kernels on this CPU, which has newer \
         instruction sets, and dspec could not restart itself with {CORETYPE}={kernels} \
         ({error}). f32 products on the CPU are slower, and speculative greedy output may \
         differ from plain decoding. Set {CORETYPE}={kernels} before starting dspec."
    );
}

/// The line of `dspec --version` about OpenBLAS's kernels, or `None` without OpenBLAS.
pub fn report() -> Option<String> {
    let loaded = loaded_kernels()?;
    let chosen = match (std::env::var(CORETYPE), std::env::var(REPLACED)) {
        (Ok(set), Ok(replaced)) => format!(
            " (OpenBLAS took this CPU for one without AVX and picked {replaced}; dspec set \
             {CORETYPE}={set})"
        ),
        (Ok(set), Err(_)) => format!(" ({CORETYPE}={set})"),
        _ => match misidentified() {
            Some(better) => {
                format!(" (OpenBLAS took this CPU for one without AVX: set {CORETYPE}={better})")
            }
            None => String::new(),
        },
    };
    Some(format!("blas-kernels {loaded}{chosen}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Kernels for CPUs without AVX are replaced on a CPU with AVX, by the instruction
    /// sets' choice; any other choice of OpenBLAS's, or a CPU without AVX, keeps its own.
    #[test]
    fn only_kernels_older_than_the_cpu_are_replaced() {
        assert_eq!(
            correction(Some("Prescott"), Some("SkylakeX")),
            Some("SkylakeX")
        );
        assert_eq!(
            correction(Some("NEHALEM"), Some("Haswell")),
            Some("Haswell")
        );
        assert_eq!(correction(Some("Haswell"), Some("SkylakeX")), None);
        assert_eq!(correction(Some("Zen"), Some("Haswell")), None);
        assert_eq!(correction(Some("Prescott"), None), None);
        assert_eq!(correction(None, Some("SkylakeX")), None);
    }

    /// The tests compute in this process: OpenBLAS must run kernels this CPU's
    /// instruction sets call for, or the exactness tests would check kernels dspec itself
    /// never runs on (`scripts/test.sh` sets `OPENBLAS_CORETYPE` where it must).
    #[test]
    fn the_tests_run_on_kernels_for_this_cpu() {
        let Some(loaded) = loaded_kernels() else {
            return;
        };
        assert_eq!(
            misidentified(),
            None,
            "OpenBLAS runs its {loaded} kernels on this CPU; run the tests through \
             scripts/test.sh, or with {CORETYPE} set as `dspec --version` says"
        );
    }
}
