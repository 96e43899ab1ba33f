//! Preemption: SIGTERM (what Slurm and Kubernetes send before they stop a job), SIGINT (Ctrl-C),
//! SIGUSR1 (Slurm's `--signal` choice) and SIGHUP (a closed terminal or SSH connection) raise one
//! stop flag; the trainer finishes its current
//! step, writes a checkpoint and returns, and the binary exits with `EXIT_PREEMPTED`. A second
//! signal exits at once with 128 + the signal's number (committed checkpoints stay intact: the
//! commit protocol survives any kill).

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

pub use crate::exit::EXIT_PREEMPTED;

const SIGNALS: [libc::c_int; 4] = [libc::SIGTERM, libc::SIGINT, libc::SIGUSR1, libc::SIGHUP];

static STOP: AtomicBool = AtomicBool::new(false);
static RECEIVED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(signal: libc::c_int) {
    // Only async-signal-safe calls here: atomics, write(2), _exit(2).
    if STOP.swap(true, Ordering::SeqCst) {
        // SAFETY: _exit is async-signal-safe and takes no pointers.
        unsafe { libc::_exit(128 + signal) };
    }
    RECEIVED.store(signal, Ordering::SeqCst);
    let message = b"\nstoke: stopping after this step and writing a checkpoint (signal again to quit now)\n";
    // SAFETY: write(2) is async-signal-safe; the buffer is a static byte string of that length.
    unsafe { libc::write(2, message.as_ptr().cast(), message.len()) };
}

/// Installs the handler for SIGTERM, SIGINT, SIGUSR1 and SIGHUP and returns the stop flag it raises.
pub fn install() -> &'static AtomicBool {
    for signal in SIGNALS {
        // SAFETY: a zeroed sigaction is a valid starting value; we set the handler to a function
        // of the right signature that only does async-signal-safe work, with an empty mask and
        // SA_RESTART so interrupted system calls of other threads resume.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut());
        }
    }
    &STOP
}

/// The signal that raised the stop flag, if one did.
pub fn received() -> Option<i32> {
    match RECEIVED.load(Ordering::SeqCst) {
        0 => None,
        signal => Some(signal),
    }
}
