//! What this process's other communicators are running, for a peer that asks one of them why
//! it runs nothing. Two ranks that call two communicators in different orders wait for each
//! other for ever (each blocked in the call the other has not made yet); the peer that waits
//! is told where this process is instead, which names the cause.

use std::sync::{Mutex, Weak};

use super::{STATUS_RUNNING, STATUS_STREAM};
use crate::transport::STAMP_BYTES;

struct Entry {
    /// `Comm::serial`: communicators of one job share their hash under NCCL_COMM_ID.
    serial: u64,
    hash: u64,
    rank: usize,
    nranks: usize,
    running: Weak<Mutex<Vec<u8>>>,
    /// The fork generation of the process that made it (`abi::fork::generation`): a forked
    /// child inherits the list, not the communicators, whose statuses stay as they were at
    /// the fork.
    generation: u64,
}

static LIVE: Mutex<Vec<Entry>> = Mutex::new(Vec::new());

/// Enlist a communicator that has become ready (its status bytes, kept up to date by it).
/// Entries whose communicator is gone are dropped here.
pub fn enlist(serial: u64, hash: u64, rank: usize, nranks: usize, running: &crate::bootstrap::service::Status) {
    enlist_in(crate::abi::fork::generation(), serial, hash, rank, nranks, running);
}

fn enlist_in(generation: u64, serial: u64, hash: u64, rank: usize, nranks: usize, running: &crate::bootstrap::service::Status) {
    let mut live = LIVE.lock().unwrap_or_else(|p| p.into_inner());
    live.retain(|e| e.running.strong_count() > 0);
    live.push(Entry { serial, hash, rank, nranks, running: std::sync::Arc::downgrade(running), generation });
}

/// The calls this process's communicators other than `serial` are in now, in words (None:
/// none). Each communicator's first operation; one waiting for its CUDA stream says so.
pub fn running_except(serial: u64) -> Option<String> {
    let live = LIVE.lock().unwrap_or_else(|p| p.into_inner());
    let mut said = Vec::new();
    let generation = crate::abi::fork::generation();
    for e in live.iter().filter(|e| e.serial != serial && e.generation == generation) {
        let Some(running) = e.running.upgrade() else { continue };
        let bytes = running.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let (tag, stamps) = match bytes.split_first() {
            Some((&tag, rest)) if tag == STATUS_RUNNING || tag == STATUS_STREAM => (tag, rest),
            _ => continue,
        };
        let Some(first) = stamps.chunks_exact(STAMP_BYTES).next().and_then(|s| <[u8; STAMP_BYTES]>::try_from(s).ok()) else {
            continue;
        };
        let how = if tag == STATUS_STREAM { " (issued, waiting for its CUDA stream)" } else { "" };
        said.push(format!("{}{how} on communicator {:#x} as rank {} of {}", crate::plan::ops::describe_stamp(&first),
                          e.hash, e.rank, e.nranks));
    }
    (!said.is_empty()).then(|| said.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A communicator of the parent a forked child inherits the list from is not named: its
    /// status is what it was at the fork.
    #[test]
    fn a_parents_communicators_are_not_named_in_a_forked_child() {
        let (mine, parents) = (crate::bootstrap::service::Status::default(), crate::bootstrap::service::Status::default());
        let now = crate::abi::fork::generation();
        let stamp = [0u8; STAMP_BYTES];
        for s in [&mine, &parents] {
            let mut b = s.lock().unwrap();
            b.push(STATUS_RUNNING);
            b.extend_from_slice(&stamp);
        }
        enlist_in(now, u64::MAX - 10, 0xaaa1, 0, 2, &mine);
        enlist_in(now.wrapping_sub(1), u64::MAX - 11, 0xbbb2, 1, 2, &parents);
        let said = running_except(u64::MAX - 12).unwrap_or_default();
        assert!(said.contains("0xaaa1"), "{said}");
        assert!(!said.contains("0xbbb2"), "{said}");
    }
}
