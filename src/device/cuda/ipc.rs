//! CUDA IPC: device memory of one process mapped into another on the same host (the p2p
//! transport). The handle is 64 opaque bytes sent over the bootstrap.

use std::ffi::{c_uint, c_void};

use cudarc::driver::sys::{self, CUdeviceptr, CUipcMemHandle, CUipcMem_flags};

use super::{check, driver};
use crate::error::Result;

/// The driver's handle for a device allocation, as sent to a peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpcHandle {
    pub bytes: [u8; 64],
}

impl IpcHandle {
    /// The handle of the allocation that contains `ptr`, device memory from [`super::alloc`].
    /// A peer that opens it maps the whole allocation and gets its start, so pass the start.
    pub fn of(ptr: *mut c_void) -> Result<IpcHandle> {
        driver("cuIpcGetMemHandle", || {
            let mut h = CUipcMemHandle { reserved: [0; 64] };
            // SAFETY: `h` is a valid out-pointer; the driver checks `ptr`.
            check("cuIpcGetMemHandle", unsafe { sys::cuIpcGetMemHandle(&mut h, ptr as CUdeviceptr) })?;
            Ok(IpcHandle { bytes: h.reserved.map(|c| c as u8) })
        })
    }
}

/// A peer's allocation mapped into this process; unmapped on drop.
pub struct IpcMapping {
    addr: CUdeviceptr,
}

// SAFETY: the mapping is a device address owned by this value; the driver is thread-safe.
unsafe impl Send for IpcMapping {}
// SAFETY: as for Send.
unsafe impl Sync for IpcMapping {}

impl IpcMapping {
    /// Maps a peer's handle in the current context, enabling peer access lazily if the
    /// allocation is on another device. A handle of this very process is refused by CUDA.
    pub fn open(handle: &IpcHandle) -> Result<IpcMapping> {
        driver("cuIpcOpenMemHandle_v2", || {
            let h = CUipcMemHandle { reserved: handle.bytes.map(|b| b as _) };
            let mut addr: CUdeviceptr = 0;
            let flags = CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as c_uint;
            // SAFETY: `addr` is a valid out-pointer; the driver validates the handle.
            check("cuIpcOpenMemHandle_v2", unsafe { sys::cuIpcOpenMemHandle_v2(&mut addr, h, flags) })?;
            Ok(IpcMapping { addr })
        })
    }

    /// Where the peer's allocation starts in this process.
    pub fn addr(&self) -> usize {
        self.addr as usize
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        // SAFETY: `addr` came from cuIpcOpenMemHandle_v2 and is not used after drop. A failure
        // cannot be reported from drop.
        let _ = driver("cuIpcCloseMemHandle", || {
            check("cuIpcCloseMemHandle", unsafe { sys::cuIpcCloseMemHandle(self.addr) })
        });
    }
}
