//! `ncclMemAlloc` / `ncclMemFree`: device memory of the caller's current device in CUDA mode
//! (what NCCL returns, and what PyTorch's NCCL memory pool expects), page-aligned host memory
//! in host mode.

use std::collections::HashSet;
use std::ffi::c_void;
use std::sync::Mutex;

use crate::device::cuda;
use crate::device::mode::{self, Mode};
use crate::error::Result;

/// Device memory from `ncclMemAlloc` not freed yet. `ncclMemFree` frees only these: handed
/// any other allocation's start (PyTorch's, say) the driver would free it under its owner.
static DEVICE_BLOCKS: Mutex<Option<HashSet<usize>>> = Mutex::new(None);

fn device_blocks() -> std::sync::MutexGuard<'static, Option<HashSet<usize>>> {
    DEVICE_BLOCKS.lock().unwrap_or_else(|p| p.into_inner())
}

pub fn alloc(size: usize) -> Result<*mut c_void> {
    match mode::current() {
        Mode::Cuda { .. } => {
            let _keep = cuda::KeepCurrent::new();
            let dev = cuda::current_device()?.unwrap_or(0);
            cuda::Context::primary(dev)?;
            let p = cuda::alloc(size.max(1))?;
            device_blocks().get_or_insert_with(HashSet::new).insert(p as usize);
            Ok(p)
        }
        Mode::Host => crate::device::host::alloc(size),
    }
}

/// `ncclMemFree`: a block of `ncclMemAlloc` (NULL is a no-op); anything else is refused.
pub fn free(ptr: *mut c_void) -> Result<()> {
    let ours = device_blocks().as_mut().is_some_and(|b| b.remove(&(ptr as usize)));
    if ours {
        let _keep = cuda::KeepCurrent::new();
        return cuda::free(ptr);
    }
    crate::device::host::free(ptr)
}
