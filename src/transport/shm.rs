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

use super::ring::{ring_bytes, Mapping, Reserve, RingRecv, RingSend, DATA};
use super::{Kind, SendConn, Sent, Stamp};
use crate::device::host::Region;
use crate::error::{Error, Result};

pub const PREFIX: &str = "nccl-rs-";

/// Whether this process can make rings in /dev/shm: a directory it may write (None), or why
/// not. A sandbox without /dev/shm, or with a read-only one, cannot; its processes then talk
/// TCP (said once, at WARN) where before their first collective failed ("Read-only file
/// system", "No such file or directory"). Asked once.
pub fn unusable() -> Option<&'static str> {
    static WHY: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    WHY.get_or_init(|| {
        // SAFETY: a NUL-terminated path; faccessat only reads it.
        let r = unsafe { libc::faccessat(libc::AT_FDCWD, c"/dev/shm".as_ptr(), libc::W_OK | libc::X_OK, libc::AT_EACCESS) };
        (r != 0).then(|| std::io::Error::last_os_error().to_string())
    })
    .as_deref()
}

/// The sending side; unlinks its file on drop (harmless if the receiver already did), unless
/// the receiver has yet to open it and read what was sent.
pub struct ShmSend {
    ring: RingSend,
    path: String,
}

impl SendConn for ShmSend {
    fn try_send(&mut self, src: Region, stamp: &Stamp, single_copy_early: bool) -> Result<Sent> {
        self.ring.try_send(src, stamp, single_copy_early)
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
/// rank has a service, and so a port, of its own. The pid namespace (the same for both ends:
/// `PeerInfo::shares_memory`) says whose pids the pid is in, for [`sweep_stale`].
pub fn name_for(hash: u64, from: usize, to: usize, pid: u32, to_port: u16) -> String {
    format!("{PREFIX}{hash:016x}-{from}-{to}-{pid}-{to_port}-{:x}", crate::bootstrap::process_space().0)
}

/// A receiver whose sender died before handing over its segment removes it (survivors clean
/// up), as does one whose communicator ends without having connected to the sender.
pub fn remove_expected(hash: u64, from: usize, to: usize, pid: u32, to_port: u16) {
    let _ = std::fs::remove_file(format!("/dev/shm/{}", name_for(hash, from, to, pid, to_port)));
}

/// What [`create`] made: a ring and its name, or nothing because `/dev/shm` has no room for
/// one (why, in words).
pub enum Made {
    Ring(ShmSend, String),
    NoRoom(String),
}

/// Create the ring rank `from` sends to rank `to` through: its header page is allocated here
/// (no room for it: `Made::NoRoom`, and the pair takes a socket), its slots as they are first
/// written (`ring::Reserve`), so that a full `/dev/shm` is an error, never SIGBUS at a page
/// fault, and a ring of small messages holds little memory.
pub fn create(hash: u64, from: usize, to: usize, to_port: u16, slice: usize, peer_pid: u32) -> Result<Made> {
    // (Once per process; callers meanwhile do not wait for it, nor would a forked child.)
    static SWEPT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if crate::debug::first_time(&SWEPT) {
        sweep_stale();
    }
    let name = name_for(hash, from, to, std::process::id(), to_port);
    let path = format!("/dev/shm/{name}");
    let len = ring_bytes(slice);
    let no_room = |e: &std::io::Error| {
        matches!(e.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT))
            .then(|| format!("/dev/shm has no room for a ring ({e}{})", room()))
    };
    let created = super::fds::made(|| std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(&path));
    let file = match created {
        Ok(f) => f,
        Err(e) => return no_room(&e).map(Made::NoRoom).ok_or_else(|| Error::os(format!("shm: create {path}"), e)),
    };
    let sized = file.set_len(len as u64).and_then(|_| Reserve::allocate(&file, 0, DATA));
    let fd = std::os::fd::OwnedFd::from(file);
    if let Err(e) = sized {
        let _ = std::fs::remove_file(&path);
        return no_room(&e).map(Made::NoRoom).ok_or_else(|| Error::os(format!("shm: size {path}"), e));
    }
    let map = match Mapping::new(len, Some(fd.as_raw_fd())) {
        Ok(m) => m,
        Err(e) => {
            let _ = std::fs::remove_file(&path);
            return Err(e);
        }
    };
    let ring = RingSend::new(Arc::new(map), slice, Kind::Shm, Some(peer_pid)).with_reserve(Reserve::new(fd));
    Ok(Made::Ring(ShmSend { ring, path }, name))
}

/// How old a ring file of a process that is gone must be before anyone removes it. A ring's
/// file lives from its sender's offer until its receiver opens it (usually milliseconds), or
/// until that receiver's communicator ends (see the module's words on messages left for a
/// receiver); one this old, of a sender that is gone, was left by processes that were killed.
const STALE_AFTER: std::time::Duration = std::time::Duration::from_secs(600);

/// Remove ring files that killed jobs left behind (their senders are gone, and they are older
/// than [`STALE_AFTER`]): they hold memory in /dev/shm, which a container has little of. Once
/// per process, at its first ring.
fn sweep_stale() {
    let Ok(dir) = std::fs::read_dir("/dev/shm") else { return };
    let mut removed = 0;
    for entry in dir.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str().filter(|n| n.starts_with(PREFIX)) else { continue };
        // nccl-rs-<hash>-<from>-<to>-<pid>-<port>-<pid namespace> (older builds': without the
        // namespace, or the port too). A pid of another namespace (a container that shares this
        // /dev/shm, not its pids) says nothing here: its file is left to its own processes.
        let fields: Vec<&str> = name[PREFIX.len()..].split('-').collect();
        let ours = fields.get(5).is_none_or(|ns| u64::from_str_radix(ns, 16).ok() == Some(crate::bootstrap::process_space().0));
        let pid = ((4..=6).contains(&fields.len()) && ours).then(|| fields[3].parse::<u32>().ok()).flatten();
        let Some(pid) = pid.filter(|&p| p != std::process::id()) else { continue };
        let old = entry.metadata().ok().and_then(|m| m.modified().ok())
            .and_then(|t| t.elapsed().ok()).is_some_and(|age| age >= STALE_AFTER);
        if old && !super::ring::pid_alive(pid) && std::fs::remove_file(entry.path()).is_ok() {
            removed += 1;
        }
    }
    if removed > 0 {
        crate::info!(INIT, "shm: removed {removed} ring file(s) of processes that are gone from /dev/shm");
    }
}

/// "; N MiB free of M MiB" for /dev/shm, for messages about its room (empty if unknown).
pub fn room() -> String {
    let Some((free, total)) = free_bytes() else { return String::new() };
    let size = |b: u64| if b >= 1 << 20 { format!("{} MiB", b >> 20) } else { format!("{} KiB", b >> 10) };
    format!("; {} free of {}", size(free), size(total))
}

/// Free and total bytes of /dev/shm. (`statvfs`'s counts are 32 bits on some targets: the
/// casts.)
#[allow(clippy::unnecessary_cast)]
fn free_bytes() -> Option<(u64, u64)> {
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: a NUL-terminated path and a buffer of the right type, read only on success.
    let r = unsafe { libc::statvfs(c"/dev/shm".as_ptr(), st.as_mut_ptr()) };
    if r != 0 {
        return None;
    }
    // SAFETY: statvfs succeeded, so it filled the buffer.
    let st = unsafe { st.assume_init() };
    Some((st.f_bavail as u64 * st.f_frsize as u64, st.f_blocks as u64 * st.f_frsize as u64))
}

pub fn open(name: &str, slice: usize, peer_pid: u32) -> Result<RingRecv> {
    if !name.starts_with(PREFIX) || name.contains('/') {
        return Err(Error::system(format!("shm: refusing segment name '{name}'")));
    }
    let path = format!("/dev/shm/{name}");
    let file = super::fds::made(|| std::fs::OpenOptions::new().read(true).write(true).open(&path))
        .map_err(|e| match e.kind() {
            // Offered, then removed by its sender before this rank got to it: the sender's
            // communicator failed or ended (the caller asks it why).
            std::io::ErrorKind::NotFound => Error::remote(format!(
                "shm: the sending rank removed its ring {path} before this rank opened it: it failed, or destroyed \
                 or aborted its communicator")),
            _ => Error::os(format!("shm: open {path}"), e),
        })?;
    let len = ring_bytes(slice);
    let actual = file.metadata().map(|m| m.len()).unwrap_or(0);
    let map = if actual as usize == len { Mapping::new(len, Some(file.as_raw_fd())) } else {
        Err(Error::system(format!("shm: {path} has {actual} bytes, expected {len}")))
    };
    let _ = std::fs::remove_file(&path);
    Ok(RingRecv::new(Arc::new(map?), slice, Kind::Shm, Some(peer_pid)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only files of senders that are gone, and older than STALE_AFTER, go.
    #[test]
    fn stale_rings_of_gone_processes_are_swept() {
        let gone = std::process::Command::new("true").spawn().and_then(|mut c| c.wait().map(|_| c.id())).expect("a pid");
        let old = std::time::SystemTime::now() - STALE_AFTER - std::time::Duration::from_secs(60);
        let make = |name: String, at: std::time::SystemTime| {
            let path = format!("/dev/shm/{name}");
            let f = std::fs::File::create(&path).expect("a file in /dev/shm");
            f.set_modified(at).expect("set its time");
            path
        };
        let tag = format!("{:016x}", std::process::id() as u64 * 7919);
        let stale = make(format!("{PREFIX}{tag}-0-1-{gone}-4242"), old);
        let older_build = make(format!("{PREFIX}{tag}-1-0-{gone}"), old);
        let fresh = make(format!("{PREFIX}{tag}-2-0-{gone}-4242"), std::time::SystemTime::now());
        let alive = make(format!("{PREFIX}{tag}-3-0-1-4242"), old);
        let ns = crate::bootstrap::process_space().0;
        let named = make(format!("{PREFIX}{tag}-4-0-{gone}-4242-{ns:x}"), old);
        let elsewhere = make(format!("{PREFIX}{tag}-5-0-{gone}-4242-{:x}", ns ^ 1), old);
        sweep_stale();
        let exists = |p: &str| std::path::Path::new(p).exists();
        let (a, b, c, d) = (exists(&stale), exists(&older_build), exists(&fresh), exists(&alive));
        let (e, f) = (exists(&named), exists(&elsewhere));
        for p in [&stale, &older_build, &fresh, &alive, &named, &elsewhere] {
            let _ = std::fs::remove_file(p);
        }
        assert!(!a && !b && !e, "old rings of a gone process stayed");
        assert!(f, "a ring named with another pid namespace was removed (its pid means another process there)");
        assert!(c, "a recent ring of a gone process was removed (its receiver may not have opened it yet)");
        assert!(d, "a ring of a live process (pid 1) was removed");
    }
}
