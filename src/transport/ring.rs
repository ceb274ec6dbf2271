//! A single-producer single-consumer ring of message slots in memory both sides map: the
//! shared-memory transport between processes and the local transport inside one process.
//!
//! Layout: `head` (consumer count) on its own cache line, the two "closed" flags, the
//! single-copy handshakes, one 64-byte header per slot (sequence word, length, kind, stamp, and
//! up to 24 bytes of payload), then the slots.
//!
//! Single copy between processes (CMA): a large message need not be copied into the ring.
//! The sender posts a descriptor (its address and length) and the receiver pulls the bytes
//! straight from the sender's memory with `process_vm_readv`; the send completes when the
//! receiver frees the slot. The receiver enables this at connect time by reading a probe value
//! from the sender's memory (`NCCL_CMA_DISABLE=1`, or a kernel that forbids it, keeps copies).
//!
//! The producer writes a slot and its header, then publishes with a release store of the
//! header's sequence word (message number + 1); the consumer polls that word (acquire), so a
//! small message costs the receiver one cache line, and frees the slot with a release store of
//! `head`, which the producer reads only when the ring looks full.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use super::{Kind, Sent, Stamp, STAMP_BYTES};
use crate::device::host::Region;
use crate::error::{Error, Result};

mod cma;
use cma::{cma_read, cma_write};

pub const SLOTS: usize = 8;
const HEAD: usize = 0;
const SENDER_CLOSED: usize = 128;
const RECEIVER_CLOSED: usize = 132;
/// Set by the receiver once it has read the sender's probe through CMA.
const CMA_OK: usize = 136;
/// Written by the sender: the address of [`PROBE`] in its memory.
const CMA_PROBE_ADDR: usize = 144;
/// One 64-byte header per slot: the slot's sequence word (the message number + 1, written
/// last: the receiver polls it), length, kind, stamp, and up to HEADER_DATA bytes of payload,
/// so a small message is one cache line from sender to receiver.
const HEADERS: usize = 1024;
const HDR_SEQ: usize = 0;
const HDR_LEN: usize = 8;
const HDR_KIND: usize = 12;
const HDR_STAMP: usize = 16;
const HDR_DATA: usize = 40;
const HEADER_DATA: usize = 24;
/// Shared reading of a large descriptor (see [`RingRecv::try_recv_into`]): the claim word
/// (tag << TAG_SHIFT | next block), blocks finished, and the message's destination and length.
const HELP_CLAIM: usize = 512;
const HELP_DONE: usize = 576;
const HELP_DST: usize = 640;
const HELP_LEN: usize = 656;
/// Written by the receiver: the address of [`WRITE_PROBE`] in its memory.
const HELP_PROBE_ADDR: usize = 664;
/// Descriptors at least this large are read by both ends, in blocks of HELP_BLOCK bytes.
const HELP_MIN: usize = 256 << 10;
const HELP_BLOCK: usize = 128 << 10;
const TAG_SHIFT: u32 = 20;
/// Messages at least this large go by descriptor when CMA is on.
const CMA_MIN: usize = 64 << 10;
/// ... and these, where the sender says a single copy pays from smaller sizes (`try_send`).
/// nccl-rs-perf -np 2 --bind 1, out-of-place, µs, 64 KiB -> 8 KiB: broadcast 8 KiB 3.1 -> 1.9,
/// 32 KiB 5.6-7.1 -> 3.1-3.8; all-gather (output) 32 KiB 4.1-5.0 -> 2.2-3.5; sendrecv 16 KiB
/// 4.6-4.7 -> 3.0-3.6. At 4 KiB they were slower again (the system call and the wait for the
/// reader outweigh a 4 KiB copy).
const CMA_MIN_EARLY: usize = 8 << 10;
const KIND_INLINE: u32 = 0;
const KIND_DESCRIPTOR: u32 = 1;
/// The payload is in the header itself (at most HEADER_DATA bytes).
const KIND_IN_HEADER: u32 = 2;

/// A value every process holds at a known address, read by peers to test CMA.
static PROBE: u64 = 0x6e63_636c_2d72_7321;
/// Where senders test that they may write into this process (the value written is PROBE).
static WRITE_PROBE: AtomicU64 = AtomicU64::new(0);
const HEADER_BYTES: usize = 64;
pub const DATA: usize = 4096;
const _: () = assert!(HEADERS + SLOTS * HEADER_BYTES <= DATA && HELP_PROBE_ADDR + 8 <= HEADERS);

pub fn ring_bytes(slice: usize) -> usize {
    DATA + SLOTS * slice
}

/// A mapping of `len` bytes (anonymous or of a shared-memory file), unmapped on drop.
pub struct Mapping {
    base: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; all cross-thread access goes through atomics
// (head/tail/flags) that order the plain slot accesses.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Map `len` bytes of `fd` (or anonymous shared memory when `fd` is None).
    pub fn new(len: usize, fd: Option<i32>) -> Result<Mapping> {
        let (flags, fd) = match fd {
            Some(fd) => (libc::MAP_SHARED, fd),
            None => (libc::MAP_SHARED | libc::MAP_ANONYMOUS, -1),
        };
        // SAFETY: a fresh mapping at an address of the kernel's choosing; checked for failure.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, flags, fd, 0) };
        if p == libc::MAP_FAILED {
            return Err(Error::os(format!("mmap of {len} bytes"), std::io::Error::last_os_error()));
        }
        Ok(Mapping { base: p.cast(), len })
    }

    fn atomic_u64(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off + 8 <= self.len && off.is_multiple_of(8));
        // SAFETY: in bounds, 8-aligned (page-aligned base), lives as long as &self.
        unsafe { &*(self.base.add(off) as *const AtomicU64) }
    }

    fn atomic_u32(&self, off: usize) -> &AtomicU32 {
        debug_assert!(off + 4 <= self.len && off.is_multiple_of(4));
        // SAFETY: in bounds, 4-aligned, lives as long as &self.
        unsafe { &*(self.base.add(off) as *const AtomicU32) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: base/len are exactly what mmap returned; nothing uses the memory after drop.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

/// Is process `pid` still alive (same host)? A zombie (dead, not yet reaped) is not.
pub fn pid_alive(pid: u32) -> bool {
    // SAFETY: kill with signal 0 only checks for existence and permission.
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    if r != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) {
        return false;
    }
    // /proc/<pid>/stat: "pid (comm) S ..." — the state follows the last ')'.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !matches!(stat.rsplit_once(')').and_then(|(_, rest)| rest.trim_start().chars().next()), Some('Z' | 'X')),
        Err(_) => true, // another pid namespace: trust kill()
    }
}

pub struct RingSend {
    map: Arc<Mapping>,
    slice: usize,
    tail: u64,
    /// The receiver's count as last read: re-read only when the ring looks full, so a send
    /// does not pull the receiver's cache line every time.
    head_seen: u64,
    kind: Kind,
    /// The receiver's process, for liveness checks (None inside one process).
    peer_pid: Option<u32>,
    /// May we write into the receiver's memory (tested on first use)?
    can_write: Option<bool>,
    /// Descriptors posted and not yet known consumed: (token, address, length). Helping uses
    /// these, not the addresses in shared memory, to bound what it claims.
    posted: std::collections::VecDeque<(u64, usize, usize)>,
    /// A ring in a file (`shm`): its slots' memory, given as they are first written.
    reserve: Option<Reserve>,
}

/// The memory of a file-backed ring's slots, allocated (`posix_fallocate`) before a write
/// first reaches it, rather than all at creation or on the page fault: a page fault with no
/// room in `/dev/shm` (a container's is 64 MB by default) ends the process with SIGBUS, and a
/// ring whose messages are small would hold its whole size for nothing.
pub struct Reserve {
    fd: std::os::fd::OwnedFd,
    /// Bytes allocated from each slot's start.
    held: [usize; SLOTS],
}

impl Reserve {
    pub fn new(fd: std::os::fd::OwnedFd) -> Reserve {
        Reserve { fd, held: [0; SLOTS] }
    }

    /// Allocate `[off, off + len)` of the file now; a file system that cannot is left as is.
    pub fn allocate(fd: &impl std::os::fd::AsRawFd, off: usize, len: usize) -> std::io::Result<()> {
        loop {
            // SAFETY: posix_fallocate on a descriptor we own; it returns the error number.
            let r = unsafe { libc::posix_fallocate(fd.as_raw_fd(), off as libc::off_t, len as libc::off_t) };
            match r {
                0 | libc::EOPNOTSUPP | libc::EINVAL => return Ok(()),
                // A signal (a handler without SA_RESTART): again.
                libc::EINTR => continue,
                e => return Err(std::io::Error::from_raw_os_error(e)),
            }
        }
    }

    /// Slot `slot` (of `slice` bytes) is about to get `n` bytes: allocate them first, in
    /// whole pages, at least doubling what the slot holds (a few calls per slot, ever).
    fn ensure(&mut self, slot: usize, slice: usize, n: usize) -> Result<()> {
        if n <= self.held[slot] {
            return Ok(());
        }
        // (n <= slice: a message never exceeds its slot.)
        let want = n.next_multiple_of(4096).max(self.held[slot] * 2).min(slice);
        Reserve::allocate(&self.fd, DATA + slot * slice, want).map_err(|e| {
            Error::system(format!("shm: no room for {want} more bytes of a ring in /dev/shm ({e}): it is too small or too full{} (a \
                                   container's is 64 MB by default: docker run --shm-size=1g, or NCCL_SHM_DISABLE=1 \
                                   to use sockets)", crate::transport::shm::room()))
        })?;
        self.held[slot] = want;
        Ok(())
    }
}

pub struct RingRecv {
    map: Arc<Mapping>,
    slice: usize,
    head: u64,
    kind: Kind,
    peer_pid: Option<u32>,
    /// Where descriptor messages are pulled to (allocated on first use).
    staging: Vec<u8>,
    /// A shared read whose last blocks the sender is still writing: (tag, blocks).
    helped: Option<(u64, u64)>,
}

impl RingSend {
    pub fn new(map: Arc<Mapping>, slice: usize, kind: Kind, peer_pid: Option<u32>) -> RingSend {
        if peer_pid.is_some() {
            map.atomic_u64(CMA_PROBE_ADDR).store(&PROBE as *const u64 as u64, Ordering::Release);
        }
        RingSend { map, slice, tail: 0, head_seen: 0, kind, peer_pid, can_write: None, posted: std::collections::VecDeque::new(),
                   reserve: None }
    }

    /// A ring in a file: its slots' memory is allocated as they are first written.
    pub fn with_reserve(mut self, reserve: Reserve) -> RingSend {
        self.reserve = Some(reserve);
        self
    }

    /// Write blocks of the posted message `token` that the receiver shares (a large
    /// descriptor): claim one at a time while any is left. The claim word names the message,
    /// and block indices are bounded by our own record of the message (several may be
    /// posted, so the shared addresses may already describe a later one): a claim that
    /// succeeds is for a block of `token` while the receiver still reads it, and the receiver
    /// only rewrites the shared destination once every block of `token` is claimed and done.
    fn help(&mut self, token: u64) -> Result<()> {
        let claim = self.map.atomic_u64(HELP_CLAIM);
        let tag = help_tag(token);
        let mut word = claim.load(Ordering::Acquire);
        if word >> TAG_SHIFT != tag || self.can_write == Some(false) {
            return Ok(());
        }
        let Some(&(_, src, len)) = self.posted.iter().find(|p| p.0 == token) else { return Ok(()) };
        let (src, len) = (src as u64, len);
        let dst = self.map.atomic_u64(HELP_DST).load(Ordering::Relaxed);
        if self.map.atomic_u64(HELP_LEN).load(Ordering::Relaxed) as usize != len {
            return Ok(()); // the shared fields already describe another message
        }
        if self.can_write.is_none() {
            let ok = match self.peer_pid {
                None => true,
                Some(pid) => {
                    let at = self.map.atomic_u64(HELP_PROBE_ADDR).load(Ordering::Acquire);
                    at != 0 && cma_write(pid, at, &PROBE.to_ne_bytes()).is_ok()
                }
            };
            self.can_write = Some(ok);
            if !ok {
                crate::info!(P2P, "single-copy writes into the receiving process are not allowed; it reads alone");
                return Ok(());
            }
        }
        let blocks = len.div_ceil(HELP_BLOCK) as u64;
        loop {
            let idx = word & ((1 << TAG_SHIFT) - 1);
            // A receiver that gave up (closed) no longer wants our blocks.
            if word >> TAG_SHIFT != tag || idx >= blocks || self.map.atomic_u32(RECEIVER_CLOSED).load(Ordering::Acquire) != 0 {
                return Ok(());
            }
            match claim.compare_exchange_weak(word, word + 1, Ordering::AcqRel, Ordering::Acquire) {
                Err(now) => word = now,
                Ok(_) => {
                    let off = idx as usize * HELP_BLOCK;
                    let n = HELP_BLOCK.min(len - off);
                    match self.peer_pid {
                        Some(pid) => {
                            // SAFETY: src + off .. + n lies in our posted message (the receiver
                            // copied its address and length from our descriptor), which stays
                            // valid and unwritten until the receiver frees the slot.
                            let ours = unsafe { std::slice::from_raw_parts((src as usize + off) as *const u8, n) };
                            cma_write(pid, dst + off as u64, ours)?;
                        }
                        // SAFETY: one process: dst is the receiving rank's region for this
                        // message (it waits, not touching it, until every block is done); src
                        // as above.
                        None => unsafe { std::ptr::copy((src as usize + off) as *const u8, (dst as usize + off) as *mut u8, n) },
                    }
                    self.map.atomic_u64(HELP_DONE).fetch_add(1, Ordering::AcqRel);
                    word = claim.load(Ordering::Acquire);
                }
            }
        }
    }
}

/// The claim tag of slot sequence number `seq` (never 0, which means "nothing shared").
fn help_tag(seq: u64) -> u64 {
    (seq + 1) & ((1 << (64 - TAG_SHIFT)) - 1)
}

impl RingRecv {
    /// The general path of `try_recv_into`: take the message and copy it into `dst`.
    fn recv_copying(&mut self, dst: Region, accept: &mut dyn FnMut(&Stamp, usize) -> Result<()>) -> Result<bool> {
        use super::RecvConn;
        self.try_recv(&mut |stamp, data| {
            accept(stamp, data.len())?;
            crate::device::host::copy_in(dst, data);
            Ok(())
        })
    }

    pub fn new(map: Arc<Mapping>, slice: usize, kind: Kind, peer_pid: Option<u32>) -> RingRecv {
        if crate::params::cma_disable() {
            static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
            if crate::debug::first_time(&SAID) {
                crate::info!(P2P, "NCCL_CMA_DISABLE=1: no single-copy reads, every message is copied through the \
                                   shared-memory ring");
            }
        }
        if let Some(pid) = peer_pid {
            let ok = match probe_single_copy(&map, pid) {
                Ok(()) => {
                    crate::info!(P2P, "single-copy reads from process {pid}: on (large messages are read from its memory)");
                    true
                }
                Err(why) => {
                    crate::info!(P2P, "single-copy reads from process {pid}: off ({why}); large messages are copied \
                                       through the shared-memory ring");
                    false
                }
            };
            map.atomic_u32(CMA_OK).store(ok as u32, Ordering::Release);
        } else if !crate::params::cma_disable() {
            // One address space: descriptors are read with a plain copy, or reduced in place.
            map.atomic_u32(CMA_OK).store(1, Ordering::Release);
        }
        map.atomic_u64(HELP_PROBE_ADDR).store(&WRITE_PROBE as *const AtomicU64 as u64, Ordering::Release);
        RingRecv { map, slice, head: 0, kind, peer_pid, staging: Vec::new(), helped: None }
    }

    /// Read a large descriptor (`src`, `len`) into `dst` together with the sender: publish
    /// it, then claim blocks until none is left. True when every block is in `dst`; false when
    /// the sender is still writing its last ones (call again: [`RingRecv::finish_shared`]).
    fn read_shared(&mut self, src: u64, dst: Region) -> Result<bool> {
        let len = dst.len();
        let blocks = len.div_ceil(HELP_BLOCK) as u64;
        let tag = help_tag(self.head);
        let (claim, done) = (self.map.atomic_u64(HELP_CLAIM), self.map.atomic_u64(HELP_DONE));
        // The previous shared message is complete (all claimed and done): nobody writes these.
        done.store(0, Ordering::Relaxed);
        self.map.atomic_u64(HELP_DST).store(dst.addr() as u64, Ordering::Relaxed);
        self.map.atomic_u64(HELP_LEN).store(len as u64, Ordering::Relaxed);
        claim.store(tag << TAG_SHIFT, Ordering::Release);
        loop {
            let idx = claim.fetch_add(1, Ordering::AcqRel) & ((1 << TAG_SHIFT) - 1);
            if idx >= blocks {
                break;
            }
            let off = idx as usize * HELP_BLOCK;
            // The block is within dst, and no other block overlaps it.
            if let Err(e) = self.pull(src + off as u64, dst.sub(off, HELP_BLOCK.min(len - off))) {
                // Giving up, with our block `idx` unfinished; the caller gets `dst` back.
                self.abandon_shared(tag, blocks, 1);
                return Err(self.sender_gone(e));
            }
            done.fetch_add(1, Ordering::AcqRel);
        }
        self.helped = Some((tag, blocks));
        self.finish_shared()
    }

    /// Copy the sender's bytes at `src` (a descriptor's address, in its memory) into `dst`.
    fn pull(&self, src: u64, dst: Region) -> Result<()> {
        match self.peer_pid {
            Some(pid) => {
                // SAFETY: dst is a region the schedule lets this receive write (Region
                // contract), and nothing else touches it until this unit completes.
                cma_read(pid, src, unsafe { dst.as_mut_slice() })
            }
            None => {
                // SAFETY: one process: the sender's message is valid and unwritten until we
                // free the slot; dst as above. Different ranks' buffers do not overlap, and
                // ptr::copy tolerates it anyway.
                unsafe { std::ptr::copy(src as usize as *const u8, dst.addr() as *mut u8, dst.len()) };
                Ok(())
            }
        }
    }

    /// Stop sharing message `tag` (the receive failed, or the connection is dropped while the
    /// sender still writes its blocks): no more claims, then wait for the blocks the sender
    /// already claimed — it is writing them into the destination the caller is about to get
    /// back (and may free). `unfinished` of the claimed blocks are ours and will never be
    /// done. Bounded: a sender that closed or died writes no more, and a block is 128 KiB.
    fn abandon_shared(&mut self, tag: u64, blocks: u64, unfinished: u64) {
        let mask = (1u64 << TAG_SHIFT) - 1;
        let old = self.map.atomic_u64(HELP_CLAIM).swap((tag << TAG_SHIFT) | mask, Ordering::AcqRel);
        self.helped = None;
        if old >> TAG_SHIFT != tag {
            return;
        }
        let claimed = (old & mask).min(blocks);
        let done = self.map.atomic_u64(HELP_DONE);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        while done.load(Ordering::Acquire) + unfinished < claimed
            && self.map.atomic_u32(SENDER_CLOSED).load(Ordering::Acquire) == 0
            && self.peer_pid.is_none_or(pid_alive)
            && std::time::Instant::now() < deadline
        {
            std::thread::yield_now();
        }
    }

    /// A failed read of the sender's memory after the sender closed the connection (it stopped
    /// on an error of its own and may have freed the buffer) is a lost peer, whose own reason
    /// the caller then reports, not a system error of ours.
    fn sender_gone(&self, e: Error) -> Error {
        if e.code != crate::Code::RemoteError && self.map.atomic_u32(SENDER_CLOSED).load(Ordering::Acquire) != 0 {
            return Error::remote(format!("the sending rank closed its connection ({})", e.msg));
        }
        e
    }

    /// Has the sender published the next message (its slot's sequence word)?
    fn published(&self) -> bool {
        let slot = (self.head % SLOTS as u64) as usize;
        self.map.atomic_u64(HEADERS + slot * HEADER_BYTES + HDR_SEQ).load(Ordering::Acquire) == self.head + 1
    }

    /// Has the sender finished its blocks of the shared message? Then free the slot.
    fn finish_shared(&mut self) -> Result<bool> {
        let Some((_, blocks)) = self.helped else { return Ok(true) };
        if self.map.atomic_u64(HELP_DONE).load(Ordering::Acquire) < blocks {
            if self.map.atomic_u32(SENDER_CLOSED).load(Ordering::Acquire) != 0
                && self.map.atomic_u64(HELP_DONE).load(Ordering::Acquire) < blocks
            {
                return Err(Error::remote("the sending rank closed its connection while writing a message (it destroyed or aborted its communicator, or its process ended)"));
            }
            return Ok(false);
        }
        self.helped = None;
        self.head += 1;
        self.map.atomic_u64(HEAD).store(self.head, Ordering::Release);
        Ok(true)
    }
}

/// Can this process read the sending process `pid`'s memory (process_vm_readv)? It reads the
/// probe word the sender published. The error says why not: disabled, or the kernel refused
/// (e.g. Yama's ptrace_scope, or a container without the permission).
fn probe_single_copy(map: &Mapping, pid: u32) -> std::result::Result<(), String> {
    if crate::params::cma_disable() {
        return Err("NCCL_CMA_DISABLE=1".into());
    }
    let addr = map.atomic_u64(CMA_PROBE_ADDR).load(Ordering::Acquire);
    if addr == 0 {
        return Err("the sender published no probe".into());
    }
    let mut got = [0u8; 8];
    cma_read(pid, addr, &mut got).map_err(|e| format!("{}; see /proc/sys/kernel/yama/ptrace_scope", e.msg))?;
    if u64::from_ne_bytes(got) != PROBE {
        return Err("the probe read back other bytes".into());
    }
    Ok(())
}

fn check_pid(pid: Option<u32>) -> Result<()> {
    match pid {
        Some(p) if !pid_alive(p) => Err(Error::remote(format!("peer process {p} exited"))),
        _ => Ok(()),
    }
}

impl super::SendConn for RingSend {
    fn try_send(&mut self, src: Region, stamp: &Stamp, single_copy_early: bool) -> Result<Sent> {
        if src.len() > self.slice {
            return Err(Error::internal(format!("message of {} bytes exceeds the slot size {}", src.len(), self.slice)));
        }
        if self.tail - self.head_seen >= SLOTS as u64 {
            let head = self.map.atomic_u64(HEAD).load(Ordering::Acquire);
            self.head_seen = head;
            if self.tail - head >= SLOTS as u64 {
                // A closed receiver consumed all it will: re-read head after seeing the flag, so
                // a message it took just before closing still counts as delivered.
                if self.map.atomic_u32(RECEIVER_CLOSED).load(Ordering::Acquire) != 0
                    && self.map.atomic_u64(HEAD).load(Ordering::Acquire) == head
                {
                    return Err(Error::remote("the receiving rank closed its connection (it destroyed or aborted its communicator, or its process ended)"));
                }
                return Ok(Sent::Blocked);
            }
        }
        let min = if single_copy_early { CMA_MIN_EARLY } else { CMA_MIN };
        let by_descriptor = src.len() >= min && self.map.atomic_u32(CMA_OK).load(Ordering::Acquire) == 1;
        let kind = if by_descriptor {
            KIND_DESCRIPTOR
        } else if src.len() <= HEADER_DATA {
            KIND_IN_HEADER
        } else {
            KIND_INLINE
        };
        let slot = (self.tail % SLOTS as u64) as usize;
        let hdr_off = HEADERS + slot * HEADER_BYTES;
        if let Some(r) = &mut self.reserve {
            match kind {
                KIND_DESCRIPTOR => r.ensure(slot, self.slice, 16)?,
                KIND_INLINE => r.ensure(slot, self.slice, src.len())?,
                _ => {}
            }
        }
        // SAFETY: the slot is free (tail - head < SLOTS) so only we touch it until we publish;
        // slot and header lie inside the mapping (ring_bytes). src is a valid region.
        unsafe {
            let dst = self.map.base.add(DATA + slot * self.slice);
            let hdr = self.map.base.add(hdr_off);
            match kind {
                KIND_DESCRIPTOR => {
                    (dst as *mut u64).write_volatile(src.addr() as u64);
                    (dst as *mut u64).add(1).write_volatile(src.len() as u64);
                }
                KIND_IN_HEADER => std::ptr::copy_nonoverlapping(src.addr() as *const u8, hdr.add(HDR_DATA), src.len()),
                _ => std::ptr::copy_nonoverlapping(src.addr() as *const u8, dst, src.len()),
            }
            (hdr.add(HDR_LEN) as *mut u32).write_volatile(src.len() as u32);
            (hdr.add(HDR_KIND) as *mut u32).write_volatile(kind);
            std::ptr::copy_nonoverlapping(stamp.as_ptr(), hdr.add(HDR_STAMP), STAMP_BYTES);
        }
        self.tail += 1;
        // The sequence word publishes the slot: the receiver polls it, in the line it reads.
        self.map.atomic_u64(hdr_off + HDR_SEQ).store(self.tail, Ordering::Release);
        // A descriptor's bytes are read by the receiver later: the send completes only then.
        if by_descriptor {
            self.posted.push_back((self.tail - 1, src.addr(), src.len()));
            return Ok(Sent::Posted(self.tail - 1));
        }
        Ok(Sent::Done)
    }
    fn consumed(&mut self, token: u64, help: bool) -> Result<bool> {
        let head = self.map.atomic_u64(HEAD).load(Ordering::Acquire);
        while self.posted.front().is_some_and(|p| p.0 < head) {
            self.posted.pop_front();
        }
        if head > token {
            return Ok(true);
        }
        if help {
            self.help(token)?;
        }
        if self.map.atomic_u64(HEAD).load(Ordering::Acquire) > token {
            return Ok(true);
        }
        if self.map.atomic_u32(RECEIVER_CLOSED).load(Ordering::Acquire) != 0
            && self.map.atomic_u64(HEAD).load(Ordering::Acquire) <= token
        {
            return Err(Error::remote("the receiving rank closed its connection (it destroyed or aborted its communicator, or its process ended)"));
        }
        Ok(false)
    }
    fn check(&mut self) -> Result<()> {
        check_pid(self.peer_pid)
    }
    fn kind(&self) -> Kind {
        self.kind
    }
    fn mem_bytes(&self) -> u64 {
        self.map.len as u64
    }
}

impl super::RecvConn for RingRecv {
    fn try_recv(&mut self, deliver: &mut dyn FnMut(&Stamp, &[u8]) -> Result<()>) -> Result<bool> {
        if !self.published() {
            if self.map.atomic_u32(SENDER_CLOSED).load(Ordering::Acquire) == 0 {
                return Ok(false);
            }
            // The sender may have published its last message just before closing: only an
            // empty slot after seeing the flag means the message will never come.
            if !self.published() {
                return Err(Error::remote("the sending rank closed its connection (it destroyed or aborted its communicator, or its process ended)"));
            }
        }
        let slot = (self.head % SLOTS as u64) as usize;
        // SAFETY: the slot's sequence word says the producer published it (acquire in
        // `published`) and it will not touch it until we advance head. Bounds as in try_send.
        let (stamp, kind, data) = unsafe {
            let hdr = self.map.base.add(HEADERS + slot * HEADER_BYTES);
            let kind = (hdr.add(HDR_KIND) as *const u32).read_volatile();
            let cap = if kind == KIND_IN_HEADER { HEADER_DATA } else { self.slice };
            let n = ((hdr.add(HDR_LEN) as *const u32).read_volatile() as usize).min(cap);
            let mut stamp = [0u8; STAMP_BYTES];
            std::ptr::copy_nonoverlapping(hdr.add(HDR_STAMP), stamp.as_mut_ptr(), STAMP_BYTES);
            let at = if kind == KIND_IN_HEADER { hdr.add(HDR_DATA) } else { self.map.base.add(DATA + slot * self.slice) };
            (stamp, kind, std::slice::from_raw_parts(at, n))
        };
        if kind == KIND_DESCRIPTOR {
            // A peer's header may say descriptor with fewer bytes than one: read as zeros.
            let word = |i: usize| data.get(i * 8..i * 8 + 8).and_then(|b| b.try_into().ok()).map_or(0, u64::from_ne_bytes);
            let (addr, len) = (word(0), (word(1) as usize).min(self.slice));
            match self.peer_pid {
                Some(pid) => {
                    if self.staging.len() < len {
                        self.staging.resize(self.slice, 0);
                    }
                    let read = cma_read(pid, addr, &mut self.staging[..len]);
                    read.map_err(|e| self.sender_gone(e))?;
                    deliver(&stamp, &self.staging[..len])?;
                }
                None => {
                    // SAFETY: the sender is a rank of this process; its buffer stays valid and
                    // unwritten until we free the slot (its send completes only then).
                    let theirs = unsafe { std::slice::from_raw_parts(addr as usize as *const u8, len) };
                    deliver(&stamp, theirs)?;
                }
            }
        } else {
            deliver(&stamp, data)?;
        }
        self.head += 1;
        self.map.atomic_u64(HEAD).store(self.head, Ordering::Release);
        Ok(true)
    }
    /// A descriptor whose length matches `dst` is pulled straight into it: one copy in all.
    ///
    /// A large one is read by both ends at once: the receiver publishes where it goes and
    /// both claim blocks from a shared counter, the sender writing with `process_vm_writev`
    /// (or a plain copy inside one process). Both cores copy, so a transfer whose sender is
    /// otherwise idle (a broadcast root) takes about half the time.
    fn try_recv_into(&mut self, dst: Region, accept: &mut dyn FnMut(&Stamp, usize) -> Result<()>) -> Result<bool> {
        if self.helped.is_some() {
            return self.finish_shared();
        }
        if !self.published() {
            return self.recv_copying(dst, accept);
        }
        let slot = (self.head % SLOTS as u64) as usize;
        // SAFETY: published, as in try_recv: the slot and its header are ours until we free it.
        let (stamp, addr, len) = unsafe {
            let hdr = self.map.base.add(HEADERS + slot * HEADER_BYTES);
            let kind = (hdr.add(HDR_KIND) as *const u32).read_volatile();
            if kind != KIND_DESCRIPTOR {
                return self.recv_copying(dst, accept);
            }
            let mut stamp = [0u8; STAMP_BYTES];
            std::ptr::copy_nonoverlapping(hdr.add(HDR_STAMP), stamp.as_mut_ptr(), STAMP_BYTES);
            let data = self.map.base.add(DATA + slot * self.slice) as *const u64;
            (stamp, data.read_volatile(), data.add(1).read_volatile() as usize)
        };
        if len != dst.len() {
            return self.recv_copying(dst, accept);
        }
        accept(&stamp, len)?;
        if len >= HELP_MIN {
            return self.read_shared(addr, dst);
        }
        self.pull(addr, dst).map_err(|e| self.sender_gone(e))?;
        self.head += 1;
        self.map.atomic_u64(HEAD).store(self.head, Ordering::Release);
        Ok(true)
    }
    fn check(&mut self) -> Result<()> {
        check_pid(self.peer_pid)
    }
    fn kind(&self) -> Kind {
        self.kind
    }
    fn mem_bytes(&self) -> u64 {
        self.staging.capacity() as u64
    }
}

impl RingSend {
    /// Messages published that the receiver has not consumed, while its process lives (or
    /// it is of this process)?
    pub fn undelivered(&self) -> bool {
        self.map.atomic_u64(HEAD).load(Ordering::Acquire) < self.tail && self.peer_pid.is_none_or(pid_alive)
    }
}

impl Drop for RingSend {
    fn drop(&mut self) {
        self.map.atomic_u32(SENDER_CLOSED).store(1, Ordering::Release);
    }
}

impl Drop for RingRecv {
    fn drop(&mut self) {
        self.map.atomic_u32(RECEIVER_CLOSED).store(1, Ordering::Release);
        // A failed job drops its connections while the sender may still be writing blocks of
        // a shared message into the user's buffer.
        if let Some((tag, blocks)) = self.helped {
            self.abandon_shared(tag, blocks, 0);
        }
    }
}

#[cfg(test)]
mod tests;
