//! Device memory for the buffers that go direct only as a copy: the sends of in-place
//! exchanges (`ncclSend` and `ncclRecv` of one buffer in a group, between ranks of one host)
//! and in-place all-to-alls, where a peer reading the input directly could read what the
//! operation's own output already wrote there, and buffers peers read that cannot be
//! published (pinned or managed host memory, device memory without CUDA IPC such as a
//! stream-ordered allocator's pools): the input of a send or a collective, and the output of
//! an all-reduce. The caller's stream copies the input into a carve of this memory at call
//! time, in stream order, and the carve is what peers read (`ipc::run_p2p`,
//! `ipc::run_on_stream`); the worker gives it back once its batch is done (every receiver
//! answered, or every rank passed the operation's last phase). An all-reduce's output carve is
//! copied out on the caller's stream after the operation, and comes back after the event
//! recorded behind that copy. Allocated in blocks of `NCCL_RS_INPLACE_SCRATCH` bytes (or one
//! operation's size, if larger), the first at the first such operation and another whenever
//! the earlier ones are busy, up to `NCCL_RS_INPLACE_SCRATCH_MAX` in all: so that operations
//! the host issues ahead of the device find room alike on every rank, rather than some ranks
//! falling back (every rank stages what any rank declines). Allocated on the calling thread, as
//! the application's own allocations are (never by the worker, which must not make driver
//! calls that may wait for the device: see `streamed`), kept for the communicator's life or
//! until ncclCommSuspend; an operation that finds no room goes as before (a send's bytes are
//! sent, a collective is staged).

use super::pool::{aligned, settle, Carves};
use crate::device::cuda::{DeviceMem, Event};
use crate::device::host::Region;

/// A carve's id: its block in the high bits, its id in the block's ring below.
const BLOCK_SHIFT: u32 = 48;

#[derive(Default)]
pub(super) struct Scratch {
    blocks: Vec<Block>,
    /// Turned off, or the first allocation failed: never tried again.
    off: bool,
    /// An operation larger than the scratch may grow was said (`too_small`); a full scratch
    /// (`full`).
    told: bool,
    told_full: bool,
}

/// One allocation, carved as a ring: carves are given back by hand (`give_back`), or after
/// events (`give_back_after`).
struct Block {
    mem: DeviceMem,
    carves: Carves<Vec<Event>>,
}

impl Scratch {
    /// `len` bytes of device memory, if there is room now: the region and its carve's id.
    pub(super) fn take(&mut self, len: usize) -> Option<(Region, u64)> {
        let need = aligned(len);
        if self.off || len == 0 || need > self.most() {
            return None;
        }
        self.blocks.iter_mut().enumerate().find_map(|(k, b)| {
            let at = b.carves.alloc(b.mem.len(), need)?;
            Some((b.mem.region(at, len), ((k as u64) << BLOCK_SHIFT) | b.carves.push(at)))
        })
    }

    /// The size of another block to allocate for `len` bytes that found no room (`take`), if
    /// the total stays within the most; None (said once, at INFO) if it would not, or never
    /// can (nothing is allocated for an operation that could never fit). The block is
    /// allocated by the caller without the scratch's lock (the worker takes it to give carves
    /// back, and an allocation may take a while), then added (`add_block`).
    pub(super) fn wants_block(&mut self, len: usize, rank: usize) -> Option<usize> {
        let (block, most, need) = (crate::params::inplace_scratch(), self.most(), aligned(len));
        if block == 0 {
            self.off = true;
        }
        if self.off || len == 0 || need > most {
            return None;
        }
        let size = block.max(need);
        if self.bytes() + size > most {
            if !self.told_full {
                self.told_full = true;
                crate::info!(P2P, "rank {rank}: the device scratch is busy ({} bytes, NCCL_RS_INPLACE_SCRATCH_MAX): an \
                                   operation that needs {len} more bytes of it is staged (and so on every rank)",
                             self.bytes());
            }
            return None;
        }
        Some(size)
    }

    /// A block the caller allocated (`wants_block`), or why it could not.
    pub(super) fn add_block(&mut self, mem: crate::error::Result<DeviceMem>, rank: usize) {
        match mem {
            Ok(mem) => {
                if self.blocks.is_empty() {
                    crate::info!(P2P, "rank {rank}: buffers peers cannot read directly (in place, or without CUDA IPC) \
                                       are copied on the caller's stream into device memory, which peers read ({} \
                                       bytes, up to {} as needed)", mem.len(), self.most());
                }
                self.blocks.push(Block { mem, carves: Carves::default() });
            }
            Err(e) => {
                crate::info!(P2P, "rank {rank}: no device memory to copy buffers peers cannot read into ({}): such \
                                   sends send their bytes, such collectives are staged", e.msg);
                // A first block that cannot be had is not asked for again.
                self.off = self.blocks.is_empty();
            }
        }
    }

    /// Says once, at WARN, that an operation needing `len` bytes (`what`) can never have room:
    /// more than the scratch may grow to (`NCCL_RS_INPLACE_SCRATCH_MAX` is the knob). Not when
    /// the scratch is turned off or could not be allocated (said at INFO), nor when it is
    /// merely busy.
    pub(super) fn too_small(&mut self, len: usize, what: &dyn Fn() -> String, rank: usize) {
        let most = self.most();
        if self.off || self.told || aligned(len) <= most {
            return;
        }
        self.told = true;
        crate::warn!("rank {rank}: {} needs {len} bytes of device memory to be read directly (a copy of buffers peers \
                      cannot read, or of its input scaled), more than NCCL_RS_INPLACE_SCRATCH_MAX ({most} bytes): such \
                      operations are staged through host memory, which is slower; a larger NCCL_RS_INPLACE_SCRATCH_MAX \
                      lets them go direct", what());
    }

    /// The most it may hold (`NCCL_RS_INPLACE_SCRATCH_MAX`, at least one block; 0 when off).
    fn most(&self) -> usize {
        match crate::params::inplace_scratch() {
            0 => 0,
            block => crate::params::inplace_scratch_max().max(block),
        }
    }

    /// Bytes allocated.
    pub(super) fn bytes(&self) -> usize {
        self.blocks.iter().map(|b| b.mem.len()).sum()
    }

    /// Carves that are free again go (their events have completed); the events are returned
    /// for reuse. Before [`Scratch::take`].
    pub(super) fn reclaim(&mut self) -> Vec<Event> {
        let done = |events: &Vec<Event>| events.iter().all(|e| e.query().unwrap_or(false));
        self.blocks.iter_mut().flat_map(|b| b.carves.reclaim(done)).flatten().collect()
    }

    /// Carve `id` is free again (its receiver, or every peer, has read it).
    pub(super) fn give_back(&mut self, id: u64) {
        self.give_back_after(id, Vec::new());
    }

    /// Carve `id` is free again once `events` have completed (its copy out to the user's
    /// buffer is done; the copies into it of a batch never queued have run).
    pub(super) fn give_back_after(&mut self, id: u64, events: Vec<Event>) {
        let (block, carve) = ((id >> BLOCK_SHIFT) as usize, id & ((1 << BLOCK_SHIFT) - 1));
        if let Some(b) = self.blocks.get_mut(block) {
            b.carves.release(carve, events);
        }
    }

    /// Whether every carve is free (waiting a little for copies out still running), so that
    /// the memory may be freed: the communicator's context current, its worker stopped. Not
    /// when a batch that did not finish well still holds a carve (a caller's stream may still
    /// copy into it, and a free might wait for that stream).
    pub(super) fn settled(&mut self) -> bool {
        settle(|| {
            drop(self.reclaim());
            if self.blocks.iter().all(|b| b.carves.is_empty()) {
                return Some(true);
            }
            self.blocks.iter().any(|b| b.carves.any_taken()).then_some(false)
        })
    }

    /// No carve will be taken: turned off, or the first allocation failed.
    pub(super) fn is_off(&self) -> bool {
        self.off
    }
}
