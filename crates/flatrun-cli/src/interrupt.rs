//! Ctrl-C as a flag: a SIGINT handler that only sets an atomic, which the
//! generation loop checks between tokens (so Ctrl-C stops the current
//! answer of `flatrun chat` without leaving it).

use std::sync::atomic::{AtomicBool, Ordering};

/// Set by SIGINT; cleared by [`Interrupt::clear`].
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_signal: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// The process-wide Ctrl-C flag.
pub struct Interrupt;

impl Interrupt {
    /// Install the SIGINT handler; from then on Ctrl-C no longer ends the process.
    pub fn install() -> std::io::Result<Interrupt> {
        // SAFETY: `sigaction` is given a zeroed, then filled, `sigaction`
        // struct whose handler is an `extern "C"` function that only performs
        // an atomic store (async-signal-safe); no old action is requested.
        let rc = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_sigint as extern "C" fn(libc::c_int) as usize;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(libc::SIGINT, &action, std::ptr::null_mut())
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Interrupt)
    }

    /// The flag the generation loop reads.
    pub fn flag(&self) -> &'static AtomicBool {
        &INTERRUPTED
    }

    /// Forget an earlier Ctrl-C.
    pub fn clear(&self) {
        INTERRUPTED.store(false, Ordering::SeqCst);
    }
}
