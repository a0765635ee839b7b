//! Where dspec keeps files of its own, and names that stay the same across builds.

use std::ffi::OsString;
use std::path::PathBuf;

/// A user directory by the XDG convention: `$<xdg_var>` where set (and not empty), else
/// `$HOME/<home_default>` (e.g. `XDG_CACHE_HOME` and `.cache`); `None` where neither is.
pub fn xdg_dir(xdg_var: &str, home_default: &str) -> Option<PathBuf> {
    let nonempty = |v: OsString| (!v.is_empty()).then(|| PathBuf::from(v));
    std::env::var_os(xdg_var).and_then(nonempty).or_else(|| {
        std::env::var_os("HOME")
            .and_then(nonempty)
            .map(|home| home.join(home_default))
    })
}

/// 64-bit FNV-1a: the same on every platform and build, unlike std's hasher.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_is_stable() {
        // FNV-1a's published test vector: every build on every platform agrees.
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_ne!(fnv1a(b"prompt 1"), fnv1a(b"prompt 2"));
    }
}
