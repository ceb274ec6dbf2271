//! What this process's other communicators are running, for a peer that asks one of them why
//! it runs nothing. Two ranks that call two communicators in different orders wait for each
//! other for ever (each blocked in the call the other has not made yet); the peer that waits
//! is told where this process is instead, which names the cause.

use std::sync::{Mutex, Weak};

use crate::abi::fork::{self, PerFork, PerForkMutex};

use super::diagnose::HELD_UP_THERE;
use super::ready::{shown_note, WaitNote, Waits};
use super::status::{status_stamps, STATUS_RUNNING, STATUS_SIGNALS, STATUS_STREAM};

struct Entry {
    /// `Comm::serial`: communicators of one job share their hash under NCCL_COMM_ID.
    serial: u64,
    hash: u64,
    rank: usize,
    nranks: usize,
    running: Weak<Mutex<Vec<u8>>>,
    /// What holds its call up, as far as it found (`Ready::waits`).
    waits: Weak<Mutex<Option<WaitNote>>>,
}

/// A forked child starts with none: it inherits the parent's communicators' statuses, not the
/// communicators, and their statuses stay as they were at the fork.
static LIVE: PerForkMutex<Vec<Entry>> = PerFork::new(fork::anew);

/// Enlist a communicator that has become ready (its status bytes and what holds it up, kept up
/// to date by it). Entries whose communicator is gone are dropped here.
pub fn enlist(serial: u64, hash: u64, rank: usize, nranks: usize, running: &crate::bootstrap::service::Status,
              waits: &Waits) {
    let mut live = LIVE.lock().unwrap_or_else(|p| p.into_inner());
    live.retain(|e| e.running.strong_count() > 0);
    live.push(Entry { serial, hash, rank, nranks, running: std::sync::Arc::downgrade(running),
                      waits: std::sync::Arc::downgrade(waits) });
}

/// The calls this process's communicators other than `serial` are in now, in words (None:
/// none). Each communicator's first operation; one waiting for its CUDA stream says so, and
/// one that found what holds it up names that rank.
pub fn running_except(serial: u64) -> Option<String> {
    let live = LIVE.lock().unwrap_or_else(|p| p.into_inner());
    let mut said = Vec::new();
    for e in live.iter().filter(|e| e.serial != serial) {
        let Some(running) = e.running.upgrade() else { continue };
        let bytes = running.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let tag = match bytes.first() {
            Some(&tag) if tag == STATUS_RUNNING || tag == STATUS_STREAM => tag,
            Some(&STATUS_SIGNALS) => {
                said.push(format!("ncclWaitSignal (waiting for {}) on communicator {:#x} as rank {} of {}",
                                  String::from_utf8_lossy(&bytes[1..]), e.hash, e.rank, e.nranks));
                continue;
            }
            _ => continue,
        };
        let Some(first) = status_stamps(&bytes).next() else { continue };
        let how = if tag == STATUS_STREAM { " (issued, waiting for its CUDA stream)" } else { "" };
        let held = e.waits.upgrade().and_then(|w| {
            let note = w.lock().unwrap_or_else(|p| p.into_inner());
            // (Not a note of how far it got: no rank found yet.)
            shown_note(&note, &bytes).filter(|n| !n.text.is_empty()).map(|n| format!("{HELD_UP_THERE}{}", n.text))
        });
        said.push(format!("{}{how} on communicator {:#x} as rank {} of {}{}", crate::plan::ops::describe_stamp(&first),
                          e.hash, e.rank, e.nranks, held.unwrap_or_default()));
    }
    (!said.is_empty()).then(|| said.join("; "))
}
