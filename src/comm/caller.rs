//! One thread at a time: a communicator's operation calls (collectives, point-to-point) come
//! from one thread at a time, as with NCCL, whose communicators are not thread-safe. Two
//! threads calling one communicator at once number their collectives in one order and run
//! them in another, or pair up differently on different ranks: a mismatch error at best,
//! silently wrong sums at worst. So the thread inside such a call, or holding the
//! communicator in its open group, holds it, and another thread's call is refused with
//! `ncclInvalidUsage` naming both threads. Calls meant for other threads (abort, destroy,
//! `ncclCommGetAsyncError`) take nothing.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::Comm;
use crate::error::{Error, Result};

/// A communicator held by this thread; given back when dropped.
pub struct Held(Arc<Comm>);

impl Drop for Held {
    fn drop(&mut self) {
        self.0.caller.store(0, Ordering::Release);
    }
}

impl Comm {
    /// Hold this communicator for the calling thread during `ncclX` (`call` is X, for the
    /// message). None when this thread holds it already (its open group does).
    pub fn hold(self: &Arc<Self>, call: &str) -> Result<Option<Held>> {
        let me = crate::debug::tid();
        // (A plain load first: a group's later calls find it theirs without a locked write.)
        if self.caller.load(Ordering::Acquire) == me {
            return Ok(None);
        }
        match self.caller.compare_exchange(0, me, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => Ok(Some(Held(self.clone()))),
            Err(holder) if holder == me => Ok(None),
            Err(holder) => Err(Error::invalid_usage(format!(
                "rank {}: thread {me} calls nccl{call} while thread {holder} of this process is in a call on this \
                 communicator or has it in an open group: a communicator takes calls from one thread at a time, as \
                 NCCL's (give each thread a communicator of its own, with ncclCommSplit, or serialize the calls)",
                self.rank
            ))),
        }
    }
}
