//! Ctrl-C and SIGTERM for the commands that run long: the first one asks the command to
//! stop where it can say what it did (a generation after its current token, a training
//! run after its current step); a second one ends the process at once, as it would have
//! without this.

use std::sync::atomic::{AtomicBool, Ordering};

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// The exit status of a command stopped by Ctrl-C, as shells report one.
pub const EXIT_INTERRUPTED: i32 = 130;

extern "C" fn on_interrupt(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
    // SAFETY: `signal` is async-signal-safe, and SIG_DFL runs no handler code.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_DFL);
        libc::signal(libc::SIGTERM, libc::SIG_DFL);
    }
}

/// From here on, the first Ctrl-C or SIGTERM is noted for [`interrupted`] instead of
/// ending the process.
pub fn catch() {
    let handler = on_interrupt as extern "C" fn(libc::c_int);
    // SAFETY: the handler only stores to an atomic and calls `signal`, both
    // async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, handler as libc::sighandler_t);
        libc::signal(libc::SIGTERM, handler as libc::sighandler_t);
    }
}

/// Whether Ctrl-C or SIGTERM came since [`catch`].
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}
