//! Forks: how many times this process's ancestry forked since the library loaded, as seen by
//! the process asking. A communicator remembers the count when it is made; a different count
//! later means the caller is a child forked after it (its threads did not come along, and its
//! connections are the parent's). A counter bumped by a `pthread_atfork` child handler costs
//! a load per call, where asking the kernel for the pid would cost a system call.
//!
//! Also what a forked child needs of its own: the process-wide locks ([`PerFork`]: one held by
//! a parent's thread at the fork would be held for ever), and a way to stdout that takes no
//! lock ([`write_stdout`]).

use std::marker::PhantomData;
use std::sync::atomic::{AtomicI32, AtomicPtr, AtomicU64, Ordering};
use std::sync::{Mutex, TryLockError};

static FORKS: AtomicU64 = AtomicU64::new(0);

extern "C" fn in_child() {
    // (Async-signal-safe: one atomic add.)
    FORKS.fetch_add(1, Ordering::Relaxed);
}

/// What `pthread_atfork` answered when the library loaded (0: the hook is in place).
static HOOK_FAILED: AtomicI32 = AtomicI32::new(0);

/// The child hook is registered when the library loads, before any thread of the caller's
/// can be inside the library: registered at first use, a child forked while another thread
/// registered it would have waited for that registration for ever.
#[used]
#[link_section = ".init_array"]
static REGISTER_AT_LOAD: extern "C" fn() = register;

extern "C" fn register() {
    // SAFETY: `in_child` is a plain function with no captured state, valid while the library
    // is loaded (glibc drops a library's fork hooks when it is unloaded); the other two hooks
    // are none.
    let failed = unsafe { libc::pthread_atfork(None, None, Some(in_child)) };
    HOOK_FAILED.store(failed, Ordering::Relaxed);
}

/// The number of forks between the library's loading and the calling process.
pub fn generation() -> u64 {
    if HOOK_FAILED.load(Ordering::Relaxed) != 0 {
        let failed = HOOK_FAILED.swap(0, Ordering::Relaxed);
        if failed != 0 {
            crate::warn!("pthread_atfork failed ({failed}): a forked child's use of an inherited communicator goes unnoticed");
        }
    }
    FORKS.load(Ordering::Relaxed)
}

/// A process-wide value, most often a lock, that a forked child gets afresh. A lock another
/// thread held when the process forked stays held for ever in the child (that thread did not
/// come along): PyTorch's watchdog thread asks for a communicator's state many times a second,
/// and a child forked meanwhile hung in its first `ncclCommInitRank` (found by a probe: a
/// third of 100 forks of a busy process). So the first use in a child makes a new value with
/// `fresh`, given the parent's to copy from what it can take without waiting; the parent's is
/// left alone, never freed. In the parent this costs a load and a compare per use.
pub struct PerFork<L: 'static> {
    slot: AtomicPtr<Slot<L>>,
    fresh: fn(Option<&L>) -> L,
    /// Sync and Send as `L` is (the pointer alone would be both for any `L`).
    _holds: PhantomData<L>,
}

struct Slot<L> {
    generation: u64,
    value: L,
}

impl<L: 'static> PerFork<L> {
    /// `fresh(None)` makes the value at the first use; `fresh(Some(parent's))` in a child.
    pub const fn new(fresh: fn(Option<&L>) -> L) -> Self {
        PerFork { slot: AtomicPtr::new(std::ptr::null_mut()), fresh, _holds: PhantomData }
    }

    /// This process's value.
    pub fn get(&self) -> &L {
        let now = generation();
        let current = self.slot.load(Ordering::Acquire);
        // SAFETY: a slot, once published, is never freed (see `renew`), so a non-null pointer
        // read here stays valid for the life of the process.
        match unsafe { current.as_ref() } {
            Some(slot) if slot.generation == now => &slot.value,
            _ => self.renew(current, now),
        }
    }

    #[cold]
    fn renew(&self, stale: *mut Slot<L>, now: u64) -> &L {
        // SAFETY: as in `get`: published slots are never freed.
        let parents = unsafe { stale.as_ref() }.map(|slot| &slot.value);
        let made = Box::into_raw(Box::new(Slot { generation: now, value: (self.fresh)(parents) }));
        match self.slot.compare_exchange(stale, made, Ordering::AcqRel, Ordering::Acquire) {
            // The stale slot is leaked on purpose: a thread may still hold a reference into it
            // (a parent's thread, in the parent; in a child, no thread but this one runs).
            // SAFETY: `made` was published just now and is never freed.
            Ok(_) => unsafe { &(*made).value },
            Err(_) => {
                // Another thread published first: ours was never seen by anyone.
                // SAFETY: `made` came from Box::into_raw above and was not published.
                drop(unsafe { Box::from_raw(made) });
                self.get()
            }
        }
    }
}

impl<L: 'static> std::ops::Deref for PerFork<L> {
    type Target = L;
    fn deref(&self) -> &L {
        self.get()
    }
}

/// The usual kind: a lock around state.
pub type PerForkMutex<T> = PerFork<Mutex<T>>;

/// A `fresh` for state a child starts without: it begins empty.
pub fn anew<T: Default>(_parents: Option<&Mutex<T>>) -> Mutex<T> {
    Mutex::default()
}

/// A `fresh` for state a child keeps: a copy of the parent's when no thread held it at the
/// fork (the usual case), else empty (a copy could be half-changed).
pub fn inherit<T: Clone + Default>(parents: Option<&Mutex<T>>) -> Mutex<T> {
    let copy = parents.and_then(|m| match m.try_lock() {
        Ok(g) => Some(g.clone()),
        Err(TryLockError::Poisoned(p)) => Some(p.into_inner().clone()),
        Err(TryLockError::WouldBlock) => None,
    });
    Mutex::new(copy.unwrap_or_default())
}

/// Writes `bytes` to file descriptor 1 with write(2). Not through std's stdout: its lock, held
/// by a thread of the parent at the fork, would be held for ever in the child.
pub fn write_stdout(bytes: &[u8]) {
    let mut rest = bytes;
    while !rest.is_empty() {
        // SAFETY: the pointer and length describe `rest`, a live slice.
        let n = unsafe { libc::write(1, rest.as_ptr().cast(), rest.len()) };
        if n > 0 {
            rest = rest.get(n as usize..).unwrap_or_default();
        } else if n == 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lock another thread holds at the fork is free in the child, which starts with what its
    /// `fresh` makes of the parent's: empty for a lock it could not take, a copy for one it
    /// could. The parent's values are unchanged.
    #[test]
    fn a_lock_held_at_the_fork_is_free_in_the_child() {
        static HELD: PerFork<Mutex<Vec<u32>>> = PerFork::new(inherit);
        static FREE: PerFork<Mutex<Vec<u32>>> = PerFork::new(inherit);
        static FRESH: PerFork<Mutex<Vec<u32>>> = PerFork::new(anew);
        HELD.lock().unwrap().push(1);
        FREE.lock().unwrap().push(2);
        FRESH.lock().unwrap().push(3);
        let (taken, release) = (std::sync::mpsc::channel(), std::sync::mpsc::channel::<()>());
        let holder = std::thread::spawn(move || {
            let _held = HELD.lock().unwrap();
            taken.0.send(()).unwrap();
            let _ = release.1.recv();
        });
        taken.1.recv().unwrap();
        // SAFETY: the child only takes locks of its own (and allocates: glibc's malloc is
        // fork-safe), then leaves with _exit, running nothing of the test harness.
        let child = unsafe { libc::fork() };
        assert!(child >= 0, "fork: {}", std::io::Error::last_os_error());
        if child == 0 {
            let held = HELD.try_lock().map(|v| v.is_empty()).unwrap_or(false);
            let free = FREE.try_lock().map(|v| *v == [2]).unwrap_or(false);
            let fresh = FRESH.try_lock().map(|v| v.is_empty()).unwrap_or(false);
            // SAFETY: ends the child at once.
            unsafe { libc::_exit(held as i32 | (free as i32) << 1 | (fresh as i32) << 2) };
        }
        release.0.send(()).unwrap();
        holder.join().unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let mut status = 0;
        // SAFETY: `status` is a live int; `child` is ours.
        while unsafe { libc::waitpid(child, &mut status, libc::WNOHANG) } == 0 {
            if std::time::Instant::now() > deadline {
                // SAFETY: as above.
                unsafe { libc::kill(child, libc::SIGKILL) };
                panic!("the child hung (a lock held at the fork)");
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert!(libc::WIFEXITED(status), "child status {status:#x}");
        assert_eq!(libc::WEXITSTATUS(status), 7, "bits: 0 held lock free and empty, 1 free lock copied, 2 fresh one empty");
        assert_eq!(*HELD.lock().unwrap(), [1]);
        assert_eq!(*FREE.lock().unwrap(), [2]);
        assert_eq!(*FRESH.lock().unwrap(), [3]);
    }
}
