//! `ncclMemAlloc` / `ncclMemFree`: device memory of the caller's current device in CUDA mode
//! (what NCCL returns, and what PyTorch's NCCL memory pool expects), page-aligned host memory
//! in host mode.

use std::ffi::c_void;

use crate::device::cuda;
use crate::device::mode::{self, Mode};
use crate::error::Result;

pub fn alloc(size: usize) -> Result<*mut c_void> {
    match mode::current() {
        Mode::Cuda { .. } => {
            let _keep = cuda::KeepCurrent::new();
            let dev = cuda::current_device()?.unwrap_or(0);
            cuda::Context::primary(dev)?;
            cuda::alloc(size.max(1))
        }
        Mode::Host => crate::device::host::alloc(size),
    }
}

pub fn free(ptr: *mut c_void) -> Result<()> {
    if matches!(mode::current(), Mode::Cuda { .. })
        && matches!(cuda::classify(ptr as usize), Ok(cuda::PtrKind::Device { .. }))
    {
        let _keep = cuda::KeepCurrent::new();
        return cuda::free(ptr);
    }
    crate::device::host::free(ptr)
}
