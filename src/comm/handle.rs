//! Communicator handles. A handle given to C is the address of a small token we allocate and
//! never free; a registry maps live tokens to their communicator. So a NULL, garbage or
//! destroyed handle is an `ncclInvalidArgument`, never a dereference of freed memory.

use std::collections::HashMap;
use std::sync::{Arc, RwLock, TryLockError};

use super::Comm;
use crate::abi::fork::PerFork;
use crate::error::{Error, Result};

/// Keys are addresses of our own tokens, not attacker-chosen: a multiplicative hash is enough
/// and costs a few instructions on every call (SipHash costs about a hundred).
#[derive(Default)]
struct AddrHasher(u64);

impl std::hash::Hasher for AddrHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ b as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_usize(&mut self, v: usize) {
        self.0 = (v as u64 ^ (v as u64 >> 29)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type Registry = HashMap<usize, Arc<Comm>, std::hash::BuildHasherDefault<AddrHasher>>;

/// A forked child gets a copy (its calls on an inherited handle are refused by name, and
/// destroying one forgets it), made without waiting: a thread of the parent may have held
/// the lock at the fork, and then would hold it for ever. If a thread was changing the map
/// then, the copy is empty and an inherited handle is "not a communicator".
static REGISTRY: PerFork<RwLock<Registry>> = PerFork::new(inherit);

fn inherit(parents: Option<&RwLock<Registry>>) -> RwLock<Registry> {
    let copy = parents.and_then(|lock| match lock.try_read() {
        Ok(map) => Some(map.clone()),
        Err(TryLockError::Poisoned(p)) => Some(p.into_inner().clone()),
        Err(TryLockError::WouldBlock) => None,
    });
    RwLock::new(copy.unwrap_or_default())
}

fn registry() -> &'static RwLock<Registry> {
    REGISTRY.get()
}

/// The value C holds for a communicator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Handle(usize);

impl Handle {
    pub fn as_ptr<T>(self) -> *mut T {
        self.0 as *mut T
    }
}

/// Give a communicator a handle. The token (8 bytes) is leaked on purpose so its address is
/// never reused by a later communicator.
pub fn register(comm: Arc<Comm>) -> Handle {
    let token: &'static mut u64 = Box::leak(Box::new(0u64));
    let key = token as *mut u64 as usize;
    let mut map = registry().write().unwrap_or_else(|p| p.into_inner());
    map.insert(key, comm);
    Handle(key)
}

fn not_a_comm(p: usize) -> Error {
    if p == 0 {
        Error::invalid_arg("comm is NULL")
    } else {
        Error::invalid_arg(format!("comm {p:#x} is not a communicator (destroyed, aborted or never created)"))
    }
}

/// The communicator behind a handle. The calling thread's log lines show its rank from here
/// on (a thread may drive several communicators).
///
/// In a child forked after the communicator was made, every use is refused: its connections
/// and threads are the parent's (the threads did not come along), and a call would write into
/// the parent's sockets or wait for a thread that is not there.
pub fn get<T>(p: *mut T) -> Result<Arc<Comm>> {
    let key = p as usize;
    let map = registry().read().unwrap_or_else(|p| p.into_inner());
    let comm = map.get(&key).cloned().ok_or_else(|| not_a_comm(key))?;
    crate::debug::set_rank(comm.rank as i32);
    if let Some(parent) = comm.forked_from() {
        return Err(Error::invalid_usage(format!(
            "comm {key:#x} was created by process {parent}, and this process ({}) is a fork of it: communicators \
             are not inherited across fork; create one in this process",
            std::process::id()
        )));
    }
    Ok(comm)
}

/// Remove a handle (destroy/abort): later uses of it are errors. None: the communicator is
/// a forked parent's (see [`get`]), which the caller must leave alone; it is forgotten here,
/// its memory left to the process's end.
pub fn take<T>(p: *mut T) -> Result<Option<Arc<Comm>>> {
    let key = p as usize;
    let mut map = registry().write().unwrap_or_else(|p| p.into_inner());
    let comm = map.remove(&key).ok_or_else(|| not_a_comm(key))?;
    if let Some(parent) = comm.forked_from() {
        crate::info!(INIT, "comm {key:#x}: created by process {parent}, of which this process is a fork: forgotten, \
                            its connections and threads left to the parent");
        std::mem::forget(comm);
        return Ok(None);
    }
    Ok(Some(comm))
}

/// Remove by handle value (an init that failed before C ever saw the handle).
pub fn forget(h: Handle) {
    let mut map = registry().write().unwrap_or_else(|p| p.into_inner());
    map.remove(&h.0);
}
