//! Ranks of one process: a ring in anonymous shared memory, handed from the sending
//! communicator to the receiving one through a process-wide rendezvous table.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::ring::{ring_bytes, Mapping, RingRecv, RingSend};
use super::Kind;
use crate::error::{Error, Result};

/// (communicator hash, receiver's bootstrap port, from, to).
type Key = (u64, u16, usize, usize);

struct Table {
    rings: Mutex<HashMap<Key, Arc<Mapping>>>,
    posted: Condvar,
}

/// A forked child starts empty: the rings offered are its parent's communicators'.
static TABLE: crate::abi::fork::PerFork<Table> =
    crate::abi::fork::PerFork::new(|_| Table { rings: Mutex::new(HashMap::new()), posted: Condvar::new() });

fn table() -> &'static Table {
    TABLE.get()
}

/// The ring rank `from` offers rank `to`, whose bootstrap service listens on `to_port` (which
/// tells apart communicators of the same hash: see `shm::name_for`).
pub fn offer(hash: u64, from: usize, to: usize, to_port: u16, slice: usize) -> Result<RingSend> {
    let map = Arc::new(Mapping::new(ring_bytes(slice), None)?);
    let t = table();
    t.rings.lock().unwrap_or_else(|p| p.into_inner()).insert((hash, to_port, from, to), map.clone());
    t.posted.notify_all();
    Ok(RingSend::new(map, slice, Kind::Local, None))
}

/// The receiving communicator ends without having accepted rank `from`'s ring: the table lets
/// go of it (its memory goes with the sender's side).
pub fn forget(hash: u64, from: usize, to: usize, to_port: u16) {
    table().rings.lock().unwrap_or_else(|p| p.into_inner()).remove(&(hash, to_port, from, to));
}

pub fn accept(hash: u64, from: usize, to: usize, to_port: u16, slice: usize, deadline: Instant, abort: &AtomicBool)
              -> Result<RingRecv> {
    let t = table();
    let mut rings = t.rings.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        if let Some(map) = rings.remove(&(hash, to_port, from, to)) {
            return Ok(RingRecv::new(map, slice, Kind::Local, None));
        }
        if abort.load(Ordering::Acquire) {
            return Err(Error::invalid_usage("communicator aborted while connecting"));
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(Error::timeout(format!("rank {from} (same process) never connected to rank {to}")));
        }
        rings = match t.posted.wait_timeout(rings, (deadline - now).min(Duration::from_millis(100))) {
            Ok((g, _)) => g,
            Err(p) => p.into_inner().0,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ring offered to a communicator that ends without accepting it leaves the table.
    #[test]
    fn an_unaccepted_ring_is_forgotten() {
        let (hash, port, slice) = (0x10ca1_u64 ^ std::process::id() as u64, 4242, 4096);
        let abort = AtomicBool::new(false);
        let soon = || Instant::now() + Duration::from_millis(50);
        let _kept = offer(hash, 0, 1, port, slice).expect("a ring");
        assert!(accept(hash, 0, 1, port, slice, soon(), &abort).is_ok(), "an offered ring is there to accept");
        let _dropped = offer(hash, 0, 1, port, slice).expect("a ring");
        forget(hash, 0, 1, port);
        assert!(accept(hash, 0, 1, port, slice, soon(), &abort).is_err(), "a forgotten ring is still in the table");
    }
}
