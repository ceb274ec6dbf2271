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
//! recorded behind that copy. Allocated at the first such operation (`NCCL_RS_INPLACE_SCRATCH`
//! bytes), on the calling thread as the application's own allocations are (never by the
//! worker, which must not make driver calls that may wait for the device: see `streamed`),
//! kept for the communicator's life; an operation that finds no room goes as before (a send's
//! bytes are sent, a collective is staged).

use std::time::{Duration, Instant};

use super::pool::{aligned, Carves};
use crate::device::cuda::{DeviceMem, Event};
use crate::device::host::Region;

#[derive(Default)]
pub(super) struct Scratch {
    mem: Option<DeviceMem>,
    /// The allocation failed or is turned off: never tried again.
    off: bool,
    /// An operation larger than the whole scratch was said (`too_small`).
    told: bool,
    /// Given back by hand (`give_back`), or after events (`give_back_after`).
    carves: Carves<Vec<Event>>,
}

impl Scratch {
    /// `len` bytes of device memory, if there is room now: the region and its carve's id.
    /// The communicator's context must be current (the first call allocates).
    pub(super) fn take(&mut self, len: usize, rank: usize) -> Option<(Region, u64)> {
        if self.capacity() == 0 {
            self.off = true;
        }
        // (Nothing is allocated for an operation that could never fit.)
        if self.off || len == 0 || aligned(len) > self.capacity() {
            return None;
        }
        if self.mem.is_none() {
            let bytes = crate::params::inplace_scratch();
            match DeviceMem::new(bytes) {
                Ok(m) => {
                    crate::info!(P2P, "rank {rank}: buffers peers cannot read directly (in place, or without CUDA IPC) \
                                       are copied on the caller's stream into {bytes} bytes of device memory, which \
                                       peers read");
                    self.mem = Some(m);
                }
                Err(e) => {
                    crate::info!(P2P, "rank {rank}: no device memory to copy buffers peers cannot read into ({}): such \
                                       sends send their bytes, such collectives are staged", e.msg);
                    self.off = true;
                }
            }
        }
        let mem = self.mem.as_ref()?;
        let at = self.carves.alloc(mem.len(), aligned(len))?;
        Some((mem.region(at, len), self.carves.push(at)))
    }

    /// Says once, at WARN, that an operation needing `len` bytes (`what`) has no room at all:
    /// more than the scratch holds (`NCCL_RS_INPLACE_SCRATCH` is the knob). Not when the
    /// scratch is turned off or could not be allocated (said at INFO), nor when it is merely
    /// busy.
    pub(super) fn too_small(&mut self, len: usize, what: &dyn Fn() -> String, rank: usize) {
        let capacity = self.capacity();
        if self.off || self.told || aligned(len) <= capacity {
            return;
        }
        self.told = true;
        crate::warn!("rank {rank}: {} needs {len} bytes of device memory to be read directly (a copy of buffers peers \
                      cannot read, or of its input scaled), more than NCCL_RS_INPLACE_SCRATCH ({} bytes): such \
                      operations are staged through host memory, which is slower; a larger NCCL_RS_INPLACE_SCRATCH \
                      lets them go direct", what(), capacity);
    }

    /// Bytes allocated.
    pub(super) fn bytes(&self) -> usize {
        self.mem.as_ref().map_or(0, DeviceMem::len)
    }

    /// Its size: as allocated, or as it will be (`NCCL_RS_INPLACE_SCRATCH`).
    fn capacity(&self) -> usize {
        self.mem.as_ref().map_or_else(crate::params::inplace_scratch, DeviceMem::len)
    }

    /// Carves that are free again go (their events have completed); the events are returned
    /// for reuse. Before [`Scratch::take`].
    pub(super) fn reclaim(&mut self) -> Vec<Event> {
        self.carves.reclaim(|events| events.iter().all(|e| e.query().unwrap_or(false))).into_iter().flatten().collect()
    }

    /// Carve `id` is free again (its receiver, or every peer, has read it).
    pub(super) fn give_back(&mut self, id: u64) {
        self.carves.release(id, Vec::new());
    }

    /// Carve `id` is free again once `events` have completed (its copy out to the user's
    /// buffer is done; the copies into it of a batch never queued have run).
    pub(super) fn give_back_after(&mut self, id: u64, events: Vec<Event>) {
        self.carves.release(id, events);
    }

    /// Whether every carve is free (waiting a little for copies out still running), so that
    /// the memory may be freed: the communicator's context current, its worker stopped. Not
    /// when a batch that did not finish well still holds a carve (a caller's stream may still
    /// copy into it, and a free might wait for that stream).
    pub(super) fn settled(&mut self) -> bool {
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            drop(self.reclaim());
            if self.carves.is_empty() {
                return true;
            }
            if self.carves.any_taken() || Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    }

    /// No carve will be taken: turned off, or the allocation failed.
    pub(super) fn is_off(&self) -> bool {
        self.off
    }
}
