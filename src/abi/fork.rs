//! Forks: how many times this process's ancestry forked since the library loaded, as seen by
//! the process asking. A communicator remembers the count when it is made; a different count
//! later means the caller is a child forked after it (its threads did not come along, and its
//! connections are the parent's). A counter bumped by a `pthread_atfork` child handler costs
//! a load per call, where asking the kernel for the pid would cost a system call.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Once;

static FORKS: AtomicU64 = AtomicU64::new(0);

extern "C" fn in_child() {
    // (Async-signal-safe: one atomic add.)
    FORKS.fetch_add(1, Ordering::Relaxed);
}

/// The number of forks between the library's first use of this and the calling process.
pub fn generation() -> u64 {
    static HOOK: Once = Once::new();
    let mut failed = 0;
    HOOK.call_once(|| {
        // SAFETY: `in_child` is a plain function with no captured state, valid for the life
        // of the process (the library is never unloaded while communicators exist); the
        // other two hooks are none.
        failed = unsafe { libc::pthread_atfork(None, None, Some(in_child)) };
    });
    if failed != 0 {
        // (Outside call_once: a log line asks for this again, for its thread id.)
        crate::warn!("pthread_atfork failed ({failed}): a forked child's use of an inherited communicator goes unnoticed");
    }
    FORKS.load(Ordering::Relaxed)
}
