//! Processes of one host: a ring in a `/dev/shm` file. The sender creates and maps the file
//! and tells the receiver its name; the receiver maps it and unlinks it at once, so no file
//! outlives the connection even if both processes crash afterwards. A sender whose receiver
//! never came unlinks its file when the connection is dropped, unless it holds messages:
//! a send that completed into the ring before the receiver connected (small messages are
//! sent eagerly) is the receiver's to read after the sender destroyed its communicator or
//! exited, as it is once connected. The receiver unlinks it when it opens it, or when its
//! communicator ends without having connected ([`remove_expected`]).

use std::os::fd::AsRawFd;
use std::sync::Arc;

use super::ring::{ring_bytes, Mapping, RingRecv, RingSend};
use super::{Kind, SendConn, Sent, Stamp};
use crate::device::host::Region;
use crate::error::{Error, Result};

pub const PREFIX: &str = "nccl-rs-";

/// The sending side; unlinks its file on drop (harmless if the receiver already did), unless
/// the receiver has yet to open it and read what was sent.
pub struct ShmSend {
    ring: RingSend,
    path: String,
}

impl SendConn for ShmSend {
    fn try_send(&mut self, src: Region, stamp: &Stamp) -> Result<Sent> {
        self.ring.try_send(src, stamp)
    }
    fn consumed(&mut self, token: u64, help: bool) -> Result<bool> {
        self.ring.consumed(token, help)
    }
    fn check(&mut self) -> Result<()> {
        self.ring.check()
    }
    fn kind(&self) -> Kind {
        Kind::Shm
    }
    fn mem_bytes(&self) -> u64 {
        self.ring.mem_bytes()
    }
}

impl Drop for ShmSend {
    fn drop(&mut self) {
        // (The receiver unlinks the file when it opens it: one still there was not opened.)
        if self.ring.undelivered() && std::path::Path::new(&self.path).exists() {
            crate::info!(INIT, "shm: {} left for its receiver, which has not connected yet: it holds messages sent \
                                to it", self.path);
            return;
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The segment rank `from` (process `pid`) creates for rank `to`, whose bootstrap service
/// listens on `to_port`. The port tells apart communicators with the same hash (NCCL_COMM_ID
/// gives every communicator the same unique id) that connect the same pair at once: each
/// rank has a service, and so a port, of its own.
pub fn name_for(hash: u64, from: usize, to: usize, pid: u32, to_port: u16) -> String {
    format!("{PREFIX}{hash:016x}-{from}-{to}-{pid}-{to_port}")
}

/// A receiver whose sender died before handing over its segment removes it (survivors clean
/// up), as does one whose communicator ends without having connected to the sender.
pub fn remove_expected(hash: u64, from: usize, to: usize, pid: u32, to_port: u16) {
    let _ = std::fs::remove_file(format!("/dev/shm/{}", name_for(hash, from, to, pid, to_port)));
}

pub fn create(hash: u64, from: usize, to: usize, to_port: u16, slice: usize, peer_pid: u32) -> Result<(ShmSend, String)> {
    let name = name_for(hash, from, to, std::process::id(), to_port);
    let path = format!("/dev/shm/{name}");
    let len = ring_bytes(slice);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)
        .map_err(|e| Error::os(format!("shm: create {path}"), e))?;
    let mapped = file.set_len(len as u64).map_err(|e| Error::os(format!("shm: size {path}"), e))
        .and_then(|_| Mapping::new(len, Some(file.as_raw_fd())));
    let map = match mapped {
        Ok(m) => m,
        Err(e) => {
            let _ = std::fs::remove_file(&path);
            return Err(e);
        }
    };
    let ring = RingSend::new(Arc::new(map), slice, Kind::Shm, Some(peer_pid));
    Ok((ShmSend { ring, path }, name))
}

pub fn open(name: &str, slice: usize, peer_pid: u32) -> Result<RingRecv> {
    if !name.starts_with(PREFIX) || name.contains('/') {
        return Err(Error::system(format!("shm: refusing segment name '{name}'")));
    }
    let path = format!("/dev/shm/{name}");
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .map_err(|e| Error::os(format!("shm: open {path}"), e))?;
    let len = ring_bytes(slice);
    let actual = file.metadata().map(|m| m.len()).unwrap_or(0);
    let map = if actual as usize == len { Mapping::new(len, Some(file.as_raw_fd())) } else {
        Err(Error::system(format!("shm: {path} has {actual} bytes, expected {len}")))
    };
    let _ = std::fs::remove_file(&path);
    Ok(RingRecv::new(Arc::new(map?), slice, Kind::Shm, Some(peer_pid)))
}
