//! Device memory for the inputs that go direct only as a copy: the sends of in-place
//! exchanges (`ncclSend` and `ncclRecv` of one buffer in a group, between ranks of one host)
//! and in-place all-to-alls, where a peer reading the input directly could read what the
//! operation's own output already wrote there, and sends from memory that cannot be
//! published (pinned or managed host memory, device memory without CUDA IPC). The caller's
//! stream copies the input into a carve of this memory at call time, in stream order, and the
//! carve is what peers read (`ipc::run_p2p`, `ipc::run_on_stream`); the worker gives it back
//! once its batch is done (every receiver answered, or every rank passed the operation's last
//! phase). Allocated at the first such operation (`NCCL_RS_INPLACE_SCRATCH` bytes), on the
//! calling thread as the application's own allocations are (never by the worker, which must
//! not make driver calls that may wait for the device: see `streamed`), kept for the
//! communicator's life; an operation that finds no room goes as before (a send's bytes are
//! sent, an all-to-all is staged).

use super::pool::{aligned, Carves};
use crate::device::cuda::DeviceMem;
use crate::device::host::Region;

#[derive(Default)]
pub(super) struct Scratch {
    mem: Option<DeviceMem>,
    /// The allocation failed or is turned off: never tried again.
    off: bool,
    /// Given back by hand (`give_back`).
    carves: Carves<()>,
}

impl Scratch {
    /// `len` bytes of device memory, if there is room now: the region and its carve's id.
    /// The communicator's context must be current (the first call allocates).
    pub(super) fn take(&mut self, len: usize, rank: usize) -> Option<(Region, u64)> {
        if self.off || len == 0 {
            return None;
        }
        if self.mem.is_none() {
            let bytes = crate::params::inplace_scratch();
            match (bytes > 0).then(|| DeviceMem::new(bytes)) {
                Some(Ok(m)) => {
                    crate::info!(P2P, "rank {rank}: sends and all-to-alls whose buffers peers cannot read directly (in \
                                       place, or without CUDA IPC) are copied on the caller's stream into {bytes} \
                                       bytes of device memory, which peers read");
                    self.mem = Some(m);
                }
                Some(Err(e)) => {
                    crate::info!(P2P, "rank {rank}: no device memory to copy sends and all-to-alls into ({}): such sends \
                                       send their bytes, such all-to-alls are staged", e.msg);
                    self.off = true;
                }
                None => self.off = true,
            }
        }
        let mem = self.mem.as_ref()?;
        self.carves.reclaim(|_| true);
        let at = self.carves.alloc(mem.len(), aligned(len))?;
        Some((mem.region(at, len), self.carves.push(at)))
    }

    /// Some carve is still taken (its batch did not finish well, or has not yet).
    pub(super) fn in_use(&self) -> bool {
        self.carves.any_taken()
    }

    /// Carve `id` is free again (its receiver has read it).
    pub(super) fn give_back(&mut self, id: u64) {
        self.carves.release(id, ());
    }

    /// No carve will be taken: turned off, or the allocation failed.
    pub(super) fn is_off(&self) -> bool {
        self.off
    }
}
