//! What a rank publishes of its buffers for the direct path, and how a peer maps them.
//!
//! A buffer is published as a CUDA IPC handle of its allocation, or, for memory of the virtual
//! memory API, as the run of allocations behind it (entries of the rank's segment table, whose
//! descriptors its process serves over `fdpass`), or by address alone where every peer is in
//! the publishing process. Records and tables have fixed layouts (little-endian), encoded here.
//!
//! Mappings of peers' allocations are kept (see the module notes of `ipc`), told apart by the
//! IPC handle or by the allocations' buffer IDs, and closed when their owner publishes other
//! memory at their place or when more than `NCCL_RS_PEER_MAPS` are open (with 0, after each
//! operation: a mapping keeps its allocation alive after its owner freed it).

use std::os::fd::OwnedFd;
use std::sync::{Arc, Weak};

use crate::bootstrap::PeerInfo;
use crate::device::cuda::{self, IpcHandle, IpcMapping, Segment, VmmMapping};
use crate::device::host::{Region, UserPtr};
use crate::error::{Error, Result};
use crate::transport::fdpass::{self, Address};
use crate::transport::{Stamp, STAMP_BYTES};

/// What a rank publishes about one buffer: a CUDA IPC handle of its allocation, or (`segs` >
/// 0) the allocations of the virtual memory API behind it, entries `first..first + segs` of
/// the rank's segment table; or neither, when every peer is in the publishing process.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Published {
    pub handle: [u8; 64],
    /// Offset of the buffer in the allocation the handle names (in the first segment).
    pub off: u64,
    /// Its address in the publishing process (ranks of the same process use it directly).
    pub addr: u64,
    pub len: u64,
    pub segs: u32,
    pub first: u32,
}

impl Default for Published {
    fn default() -> Published {
        Published { handle: [0; 64], off: 0, addr: 0, len: 0, segs: 0, first: 0 }
    }
}

const PUB_BYTES: usize = 64 + 8 + 8 + 8 + 4 + 4;
/// A record's flag, table length and descriptor server before its buffers.
const HEAD_BYTES: usize = 8 + 16;
pub(super) const RECORD_BYTES: usize = HEAD_BYTES + 2 * PUB_BYTES + STAMP_BYTES;
pub(super) const SEG_BYTES: usize = 8 + 8 + 8 + 8;
/// The longest segment table a record may announce (input and output).
pub(super) const MAX_TABLE: usize = 2 * cuda::MAX_SEGMENTS;

/// One rank's record: whether it could publish its buffers, input and output, the length of
/// its segment table (exchanged next, when some rank has one) and where its process serves
/// the table's descriptors, and the stamp of its operation (ranks that issued different
/// calls must not read each other's buffers: they stage, and the host transports report the
/// mismatch). Its process is in the peer table (`PeerInfo`). Byte 0 is the flag, bytes 4..8
/// the table's length, 8..24 the server; the buffers follow.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Record {
    pub ok: bool,
    pub input: Published,
    pub output: Published,
    pub table: u32,
    pub server: Address,
    pub stamp: Stamp,
}

impl Record {
    pub(super) fn encode(&self) -> [u8; RECORD_BYTES] {
        let mut b = [0u8; RECORD_BYTES];
        b[0] = self.ok as u8;
        b[4..8].copy_from_slice(&self.table.to_le_bytes());
        b[8..16].copy_from_slice(&self.server.name.to_le_bytes());
        b[16..24].copy_from_slice(&self.server.token.to_le_bytes());
        for (i, p) in [self.input, self.output].iter().enumerate() {
            let o = HEAD_BYTES + i * PUB_BYTES;
            b[o..o + 64].copy_from_slice(&p.handle);
            b[o + 64..o + 72].copy_from_slice(&p.off.to_le_bytes());
            b[o + 72..o + 80].copy_from_slice(&p.addr.to_le_bytes());
            b[o + 80..o + 88].copy_from_slice(&p.len.to_le_bytes());
            b[o + 88..o + 92].copy_from_slice(&p.segs.to_le_bytes());
            b[o + 92..o + 96].copy_from_slice(&p.first.to_le_bytes());
        }
        b[HEAD_BYTES + 2 * PUB_BYTES..].copy_from_slice(&self.stamp);
        b
    }

    pub(super) fn decode(b: &[u8]) -> Record {
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap_or([0; 8]));
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap_or([0; 4]));
        let published = |o: usize| {
            let mut handle = [0u8; 64];
            handle.copy_from_slice(&b[o..o + 64]);
            Published { handle, off: u64_at(o + 64), addr: u64_at(o + 72), len: u64_at(o + 80), segs: u32_at(o + 88),
                        first: u32_at(o + 92) }
        };
        let mut stamp = [0u8; STAMP_BYTES];
        stamp.copy_from_slice(&b[HEAD_BYTES + 2 * PUB_BYTES..RECORD_BYTES]);
        Record {
            ok: b[0] != 0,
            input: published(HEAD_BYTES),
            output: published(HEAD_BYTES + PUB_BYTES),
            table: u32_at(4),
            server: Address { name: u64_at(8), token: u64_at(16) },
            stamp,
        }
    }
}

pub(super) fn encode_segment(s: &Segment, b: &mut [u8]) {
    b[0..8].copy_from_slice(&s.addr.to_le_bytes());
    b[8..16].copy_from_slice(&s.size.to_le_bytes());
    b[16..24].copy_from_slice(&s.id.to_le_bytes());
    b[24..28].copy_from_slice(&s.device.to_le_bytes());
}

pub(super) fn decode_segment(b: &[u8]) -> Segment {
    let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap_or([0; 8]));
    let device = i32::from_le_bytes(b[24..28].try_into().unwrap_or([0; 4]));
    Segment { addr: u64_at(0), size: u64_at(8), id: u64_at(16), device }
}

/// Allocations of the virtual memory API that operations in flight published, with their
/// devices: the only ones the descriptor server exports. Each is held by its operation's
/// offer ([`InFlight`]).
static PUBLISHED: crate::abi::fork::PerForkMutex<Vec<(Segment, Weak<()>)>> =
    crate::abi::fork::PerFork::new(crate::abi::fork::anew);

/// Held by an operation's offer while it is in flight: the allocations it published may be
/// exported to peers until it is dropped.
#[derive(Clone, Debug)]
pub(super) struct InFlight {
    _held: Arc<()>,
}

/// Registers `table` (this operation's allocations) as published until the result is dropped.
pub(super) fn in_flight(table: &[Segment]) -> InFlight {
    let held = Arc::new(());
    let mut published = PUBLISHED.lock().unwrap_or_else(|p| p.into_inner());
    if published.len() >= 64 {
        published.retain(|(_, w)| w.strong_count() > 0);
    }
    published.extend(table.iter().map(|s| (*s, Arc::downgrade(&held))));
    InFlight { _held: held }
}

/// A peer's request for the descriptor of one of this process's allocations: exported now,
/// on the descriptor server's thread, in its device's context, if an operation in flight
/// published it (a request for anything else is refused). The thread is the server's own: its
/// context stays current, and its calls never break an application's graph capture.
pub(super) fn export_request(request: &[u8; fdpass::REQUEST_BYTES]) -> Result<OwnedFd> {
    let seg = decode_segment(request);
    let published = PUBLISHED.lock().unwrap_or_else(|p| p.into_inner())
        .iter().any(|(s, held)| *s == seg && held.strong_count() > 0);
    if !published {
        return Err(Error::system(format!("no operation in flight published the allocation at {:#x}", seg.addr)));
    }
    cuda::relax_capture_mode();
    cuda::Context::primary(seg.device)?.make_current()?;
    cuda::vmm_export(&seg)
}

fn segment_request(s: &Segment) -> [u8; fdpass::REQUEST_BYTES] {
    let mut r = [0u8; fdpass::REQUEST_BYTES];
    encode_segment(s, &mut r);
    r
}

/// One peer allocation mapped into this process (closed on drop), or a run of them.
struct Mapped {
    key: Key,
    /// Closed off the worker's thread (`cuda::OffThread`: a close may wait for the device).
    _mapping: cuda::OffThread<Mapping>,
    /// Where the allocation starts in this process.
    addr: usize,
    size: usize,
    /// Its owner (pid namespace and pid) and its address there: a new handle at the same place
    /// means this one is gone.
    owner: (u64, u64),
    used: u64,
}

/// What a mapping is of: the allocation an IPC handle names, or allocations of the virtual
/// memory API (told apart by their buffer IDs, never reused in their process). Kept with the
/// segments owned; what a peer publishes is looked up with them borrowed from its table.
enum Key<S = Vec<Segment>> {
    Ipc(IpcHandle),
    Vmm(S),
}

impl<S: AsRef<[Segment]>> Key<S> {
    fn same<T: AsRef<[Segment]>>(&self, other: &Key<T>) -> bool {
        match (self, other) {
            (Key::Ipc(a), Key::Ipc(b)) => a == b,
            (Key::Vmm(a), Key::Vmm(b)) => {
                let (a, b) = (a.as_ref(), b.as_ref());
                a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.same_memory(y))
            }
            _ => false,
        }
    }

    fn to_owned(&self) -> Key {
        match self {
            Key::Ipc(h) => Key::Ipc(*h),
            Key::Vmm(s) => Key::Vmm(s.as_ref().to_vec()),
        }
    }
}

/// The memory of a mapping of `old` (published by process and address `at`) is gone if its
/// owner now publishes `new` (at `new_at`): a new IPC handle for an allocation at the same
/// address, or other allocations of the virtual memory API where some of the old ones were.
fn replaced<S: AsRef<[Segment]>, T: AsRef<[Segment]>>(old: &Key<S>, at: (u64, u64), new: &Key<T>, new_at: (u64, u64))
                                                        -> bool {
    let end = |x: &Segment| x.addr.saturating_add(x.size);
    let overlap = |x: &Segment, y: &Segment| x.addr < end(y) && y.addr < end(x);
    at.0 == new_at.0 && match (old, new) {
        (Key::Ipc(a), Key::Ipc(b)) => at == new_at && a != b,
        (Key::Vmm(a), Key::Vmm(b)) => {
            a.as_ref().iter().any(|x| b.as_ref().iter().any(|y| overlap(x, y) && !x.same_memory(y)))
        }
        _ => false,
    }
}

enum Mapping {
    Ipc(IpcMapping),
    Vmm(VmmMapping),
}

impl Mapping {
    fn addr(&self) -> usize {
        match self {
            Mapping::Ipc(m) => m.addr(),
            Mapping::Vmm(m) => m.addr(),
        }
    }
}

/// A rank's allocations of the virtual memory API, as its record and table publish them.
#[derive(Clone, Copy, Default)]
pub(super) struct Shared<'a> {
    pub table: &'a [Segment],
    pub server: Address,
}

/// The peer allocations a stream worker keeps mapped, and the operations it has seen.
#[derive(Default)]
pub(super) struct Maps {
    maps: Vec<Mapped>,
    /// Their bytes, summed whenever the set changes (the worker reads it after every batch).
    bytes: u64,
    /// Operations so far (a mapping used by the current one is never closed).
    epoch: u64,
}

impl Maps {
    /// A new operation begins: mappings the last one used may be closed from now on.
    pub(super) fn next_operation(&mut self) {
        self.epoch += 1;
    }

    /// Bytes of peer allocations mapped now (ncclCommMemStats).
    pub(super) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Closes every mapping (ncclCommSuspend): how many there were, and their bytes.
    pub(super) fn close_all(&mut self) -> (usize, u64) {
        let closed = (self.maps.len(), self.bytes);
        self.maps.clear();
        self.bytes = 0;
        closed
    }

    /// With none to be kept (`NCCL_RS_PEER_MAPS=0`), every mapping closes once its operation
    /// is done, or staged (the peers' allocations are then never held past it).
    pub(super) fn close_unkept(&mut self) {
        if crate::params::peer_maps() == 0 && !self.maps.is_empty() {
            self.maps.clear();
            self.bytes = 0;
            crate::trace!(P2P, "closed the peer mappings of the operation (NCCL_RS_PEER_MAPS=0)");
        }
    }

    /// Where the buffer `p` that rank `theirs` published (with its allocations `shared`) is
    /// in this process (rank `mine`'s, on `device`).
    pub(super) fn map(&mut self, mine: &PeerInfo, theirs: &PeerInfo, p: &Published, shared: Shared, device: i32)
           -> Result<Region> {
        if p.len == 0 {
            return Ok(Region::EMPTY);
        }
        let len = p.len as usize;
        let their_pid = theirs.pid;
        // (Its pid namespace too: containers of one host each have their own pid 1.)
        let process = (theirs.pid_ns << 32) | u64::from(their_pid);
        if theirs.same_process(mine) {
            // SAFETY: a rank of this process published the address of its own buffer (valid
            // for `len` bytes by its caller's contract) and keeps it until the final barrier.
            return Ok(Region::user(unsafe { UserPtr::new(p.addr as usize as *const u8) }, 0, len));
        }
        let key: Key<&[Segment]> = if p.segs == 0 {
            Key::Ipc(IpcHandle { bytes: p.handle })
        } else {
            let (first, segs) = (p.first as usize, p.segs as usize);
            match shared.table.get(first..first.saturating_add(segs)) {
                Some(run) => Key::Vmm(run),
                None => {
                    let n = shared.table.len();
                    return Err(Error::internal(format!("segments {first}+{segs} outside a table of {n}")));
                }
            }
        };
        let owner = (process, p.addr.wrapping_sub(p.off));
        let i = match self.maps.iter().position(|m| m.owner.0 == process && m.key.same(&key)) {
            Some(i) => i,
            None => {
                // The allocation that was at this address is gone; too many open: the least
                // recently used one goes (never one this operation uses).
                let before = self.maps.len();
                let epoch = self.epoch;
                self.maps.retain(|m| m.used == epoch || !replaced(&m.key, m.owner, &key, owner));
                if self.maps.len() < before {
                    crate::trace!(P2P, "closed the mapping of pid {their_pid}'s allocation at {:#x}: a new one is there",
                                  owner.1);
                }
                let kept = crate::params::peer_maps();
                if kept > 0 && self.maps.len() >= kept {
                    let oldest = self.maps.iter().enumerate().filter(|(_, m)| m.used != self.epoch).min_by_key(|(_, m)| m.used);
                    if let Some((k, _)) = oldest {
                        self.maps.swap_remove(k);
                        crate::trace!(P2P, "closed the least recently used of {kept} peer mappings");
                    }
                }
                let (mapping, size) = match &key {
                    Key::Ipc(handle) => {
                        let m = IpcMapping::open(handle)?;
                        let (_, size) = cuda::allocation_of(m.addr())?;
                        (Mapping::Ipc(m), size)
                    }
                    Key::Vmm(segments) => {
                        let mut source = fdpass::Source::connect(shared.server)?;
                        let m = VmmMapping::import(segments, device, &mut |s| source.get(&segment_request(s)))?;
                        let size = m.size();
                        (Mapping::Vmm(m), size)
                    }
                };
                crate::trace!(P2P, "mapped {size} bytes of pid {their_pid}'s device memory at {:#x}", owner.1);
                let addr = mapping.addr();
                let _mapping = cuda::OffThread::new(mapping, device);
                self.maps.push(Mapped { key: key.to_owned(), _mapping, addr, size, owner, used: self.epoch });
                self.bytes = self.maps.iter().map(|m| m.size as u64).sum();
                self.maps.len() - 1
            }
        };
        let m = &mut self.maps[i];
        m.used = self.epoch;
        if (p.off as usize).checked_add(len).is_none_or(|e| e > m.size) {
            return Err(Error::internal(format!("peer buffer {}+{len} outside its allocation of {}", p.off, m.size)));
        }
        // SAFETY: inside the peer allocation this mapping holds open (checked just above); the
        // peer keeps the buffer until the final barrier, and a mapping used by the current
        // operation is not closed before the next one.
        Ok(Region::user(unsafe { UserPtr::new((m.addr + p.off as usize) as *const u8) }, 0, len))
    }
}

/// The CUDA IPC handles of this process's allocations, by the driver's buffer id (unique in
/// the process: an entry never stands for another allocation, and a freed one's lingers only
/// until the table is full, when all go), with the allocation's start and size as
/// `cuMemGetAddressRange` gave them (the start the handle names); no handle for one without
/// (the virtual memory API's, a stream-ordered allocator's pools). A buffer published again
/// costs one driver call, not two (`calls` in ffi-tests/cuda.c counts them).
static HANDLES: crate::abi::fork::PerForkMutex<Option<std::collections::HashMap<u64, Handled>>> =
    crate::abi::fork::PerFork::new(crate::abi::fork::anew);
/// An allocation's start, size and CUDA IPC handle (see [`HANDLES`]).
type Handled = (usize, usize, Option<IpcHandle>);
const HANDLES_KEPT: usize = 4096;

/// The start of the allocation that contains `addr` and its CUDA IPC handle, if it has one.
fn ipc_handle(addr: usize) -> Option<(usize, IpcHandle)> {
    let id = cuda::buffer_id(addr).ok();
    let known = id.and_then(|id| HANDLES.lock().unwrap_or_else(|p| p.into_inner()).as_ref()?.get(&id).copied());
    if let Some((base, _, handle)) = known.filter(|&(base, size, _)| (base..base.saturating_add(size)).contains(&addr)) {
        return handle.map(|h| (base, h));
    }
    let (base, size) = cuda::allocation_of(addr).ok()?;
    let handle = IpcHandle::of(base as *mut std::ffi::c_void).ok();
    if let Some(id) = id {
        let mut table = HANDLES.lock().unwrap_or_else(|p| p.into_inner());
        let table = table.get_or_insert_with(Default::default);
        if table.len() >= HANDLES_KEPT {
            table.clear();
        }
        table.insert(id, (base, size, handle));
    }
    handle.map(|h| (base, h))
}

/// Publish one of our buffers: handle of its allocation and offset, or the allocations of the
/// virtual memory API behind it (added to `table` unless there already); only its address
/// where `handles` is false (every peer is in this process). None if it has neither kind of
/// handle.
pub(super) fn publish(r: Region, handles: bool, table: &mut Vec<Segment>) -> Option<Published> {
    if r.is_empty() {
        return Some(Published::default());
    }
    let (addr, len) = (r.addr() as u64, r.len() as u64);
    if !handles {
        // Peers read it by address: device memory only (host memory is staged).
        return cuda::is_device_memory(r.addr()).then_some(Published { addr, len, ..Published::default() });
    }
    if let Some((base, handle)) = ipc_handle(r.addr()) {
        let off = (r.addr() - base) as u64;
        return Some(Published { handle: handle.bytes, off, addr, len, ..Published::default() });
    }
    let run = cuda::vmm_segments(r.addr(), r.len()).ok()?;
    let same = |at: usize| run.iter().enumerate().all(|(k, s)| table.get(at + k).is_some_and(|t| t.same_memory(s)));
    let first = match (0..table.len()).find(|&at| same(at)) {
        Some(at) => at,
        None => {
            table.extend_from_slice(&run);
            table.len() - run.len()
        }
    };
    let start = run.first()?.addr;
    let (segs, first) = (run.len() as u32, first as u32);
    Some(Published { off: addr - start, addr, len, segs, first, ..Published::default() })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(addr: u64, size: u64, id: u64) -> Segment {
        Segment { addr, size, id, device: 0 }
    }

    #[test]
    fn records_and_segments_round_trip() {
        let input = Published { handle: [3; 64], off: 17, addr: 0x7000_0011, len: 1 << 20, segs: 0, first: 0 };
        let output = Published { handle: [0; 64], off: 256, addr: 0x7f00_0100, len: 5 << 20, segs: 3, first: 1 };
        let server = Address { name: 0x0123_4567_89ab_cdef, token: u64::MAX };
        let r = Record { ok: true, input, output, table: 4, server, stamp: [9; STAMP_BYTES] };
        let d = Record::decode(&r.encode());
        assert_eq!((d.ok, d.input, d.output, d.table, d.server, d.stamp), (true, input, output, 4, server, [9; STAMP_BYTES]));
        let s = Segment { addr: 0x7f00_0000, size: 2 << 20, id: u64::MAX - 1, device: 7 };
        let mut b = [0u8; SEG_BYTES];
        encode_segment(&s, &mut b);
        assert_eq!(decode_segment(&b), s);
    }

    #[test]
    fn only_allocations_of_operations_in_flight_are_exported() {
        let seg = Segment { addr: 0x7e00_0000, size: 2 << 20, id: 4242, device: 0 };
        let refused = |s: &Segment| export_request(&segment_request(s)).is_err_and(|e| e.msg.contains("no operation in flight"));
        assert!(refused(&seg), "never published");
        let held = in_flight(&[seg]);
        // Past the check (the export itself then needs a driver, which unit tests lack).
        assert!(!refused(&seg), "published by an operation in flight");
        assert!(refused(&Segment { device: 1, ..seg }) && refused(&Segment { id: 4243, ..seg }), "not as published");
        drop(held);
        assert!(refused(&seg), "its operation is done");
    }

    #[test]
    fn vmm_mappings_are_told_apart_by_buffer_id() {
        let two = Key::Vmm(vec![seg(0x20_0000, 0x20_0000, 1), seg(0x40_0000, 0x20_0000, 2)]);
        // The same allocations, published again by a later operation.
        let again = Key::Vmm(vec![seg(0x20_0000, 0x20_0000, 1), seg(0x40_0000, 0x20_0000, 2)]);
        assert!(two.same(&again));
        // A buffer within one of them is another run (another mapping), and does not replace it.
        let inner = Key::Vmm(vec![seg(0x40_0000, 0x20_0000, 2)]);
        assert!(!two.same(&inner));
        let at = (5, 0x20_0000);
        assert!(!replaced(&two, at, &inner, (5, 0x40_0000)));
        // New allocations where one of them was: that one was freed.
        let reused = Key::Vmm(vec![seg(0x40_0000, 0x20_0000, 3)]);
        assert!(replaced(&two, at, &reused, (5, 0x40_0000)));
        // ... unless they belong to another process (pid 5 of another pid namespace too), or lie
        // elsewhere.
        assert!(!replaced(&two, at, &reused, (6, 0x40_0000)));
        assert!(!replaced(&two, at, &reused, ((1 << 32) | 5, 0x40_0000)));
        assert!(!replaced(&two, at, &Key::Vmm(vec![seg(0x60_0000, 0x20_0000, 4)]), (5, 0x60_0000)));
        // An IPC handle is replaced by another one at the same address only.
        let (h1, h2): (Key, Key) = (Key::Ipc(IpcHandle { bytes: [1; 64] }), Key::Ipc(IpcHandle { bytes: [2; 64] }));
        assert!(replaced(&h1, at, &h2, at));
        assert!(!replaced(&h1, at, &h2, (5, 0x40_0000)));
        assert!(!replaced(&h1, at, &h1, at));
    }
}
