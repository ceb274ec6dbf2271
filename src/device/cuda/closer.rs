//! Closing on a thread of its own. CUDA documents that freeing memory "may perform implicit
//! synchronization", and a driver may do the same in `cuIpcCloseMemHandle` and `cuMemUnmap`:
//! wait until the device has finished the work queued so far. A stream worker that made such
//! a call while a caller's stream waited for that very worker would wait forever (`streamed`'s
//! module docs). So the worker does not close a peer's mapping itself: it wraps it in
//! [`OffThread`], whose drop hands it to one thread per process that closes it, in the
//! context of the device it was opened on. If the driver waits for the device there, the
//! worker goes on meanwhile and the wait ends.
//!
//! [`settle`] waits until what was handed over so far is closed (ncclCommSuspend, whose
//! caller expects the memory released when it returns, and comm destroy).

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::Context;

/// `T`, dropped on the closing thread (in the primary context of its device) rather than where
/// the value goes.
pub struct OffThread<T: Send + 'static> {
    value: Option<T>,
    device: i32,
}

impl<T: Send + 'static> OffThread<T> {
    /// `value`, to be dropped in the primary context of `device`.
    pub fn new(value: T, device: i32) -> OffThread<T> {
        OffThread { value: Some(value), device }
    }
}

impl<T: Send + 'static> Drop for OffThread<T> {
    fn drop(&mut self) {
        if let Some(value) = self.value.take() {
            hand_over(self.device, Box::new(value));
        }
    }
}

/// What the closing thread has: values to drop, in order, and how many were handed over and
/// dropped so far.
#[derive(Default)]
struct Queue {
    items: VecDeque<(i32, Box<dyn Send>)>,
    handed: u64,
    dropped: u64,
    /// The thread could not be started: values are dropped where they are handed over.
    inline: bool,
}

struct Closer {
    queue: Mutex<Queue>,
    changed: Condvar,
}

static CLOSER: OnceLock<Closer> = OnceLock::new();

/// The closing thread's queue, the thread started on first use.
fn closer() -> &'static Closer {
    static STARTED: std::sync::Once = std::sync::Once::new();
    let c = CLOSER.get_or_init(|| Closer { queue: Mutex::new(Queue::default()), changed: Condvar::new() });
    STARTED.call_once(|| {
        let started = std::thread::Builder::new().name("nccl-rs-close".into()).spawn(move || {
            super::relax_capture_mode();
            closing(c)
        });
        if let Err(e) = started {
            crate::warn!("could not start the thread that closes peer mappings ({e}): they close where they are let go");
            c.queue.lock().unwrap_or_else(|p| p.into_inner()).inline = true;
        }
    });
    c
}

fn hand_over(device: i32, value: Box<dyn Send>) {
    let c = closer();
    let mut q = c.queue.lock().unwrap_or_else(|p| p.into_inner());
    if q.inline {
        drop(q);
        drop_in(device, value);
        return;
    }
    q.items.push_back((device, value));
    q.handed += 1;
    c.changed.notify_all();
}

/// The closing thread's loop (it lives as long as the process).
fn closing(c: &'static Closer) {
    let mut q = c.queue.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        match q.items.pop_front() {
            Some((device, value)) => {
                drop(q);
                // A panic in a driver call is caught in `driver`; this one keeps the thread.
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop_in(device, value)));
                q = c.queue.lock().unwrap_or_else(|p| p.into_inner());
                q.dropped += 1;
                c.changed.notify_all();
            }
            None => q = c.changed.wait(q).unwrap_or_else(|p| p.into_inner()),
        }
    }
}

fn drop_in(device: i32, value: Box<dyn Send>) {
    // (If the context cannot be made current, the close fails in the driver and says so.)
    let _ = Context::primary(device);
    drop(value);
}

/// Waits until every value handed over before this call is dropped, for at most `limit`:
/// whether they all were.
pub fn settle(limit: Duration) -> bool {
    let Some(c) = CLOSER.get() else {
        return true; // nothing was ever handed over
    };
    let deadline = Instant::now() + limit;
    let mut q = c.queue.lock().unwrap_or_else(|p| p.into_inner());
    let target = q.handed;
    while q.dropped < target {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        q = c.changed.wait_timeout(q, left).unwrap_or_else(|p| p.into_inner()).0;
    }
    true
}
