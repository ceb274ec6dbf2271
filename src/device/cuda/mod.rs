//! CUDA mode's device layer: a small safe surface over the CUDA driver API (cudarc's `sys`,
//! loaded at run time). It owns contexts, streams, events, device and mapped host memory,
//! pointer classification, CUDA IPC and the sharing of virtual-memory allocations, stream
//! memory operations and the reduction kernels of `kernels/reduce.ptx`. It knows nothing of
//! ranks, schedules or transports.
//!
//! Every entry point runs its driver calls inside [`driver`]: cudarc panics when `libcuda.so.1`
//! or one of its symbols is missing, and a panic must never reach C. A failed call becomes
//! `Code::UnhandledCudaError` with the call and the CUresult's name in the message
//! ("cuMemcpyAsync: CUDA_ERROR_INVALID_VALUE").
//!
//! Addresses are unified (UVA): a device pointer, a mapped host pointer and a plain host
//! pointer live in one address space, so copies take [`Region`](super::host::Region)s whatever
//! memory they name. Operations on a stream are asynchronous: the memory a region names must
//! stay valid until the stream has passed the operation (NCCL's contract for user buffers).
//! Driver calls that use "the current context" (allocation, the legacy NULL stream) must run on
//! a thread where [`Context::make_current`] was called.

mod closer;
mod context;
mod graph;
mod ipc;
mod kernels;
mod memory;
pub mod nvml;
mod stream;
mod vmm;

use std::panic::{catch_unwind, AssertUnwindSafe};

use cudarc::driver::sys::CUresult;

use crate::error::{Code, Error, Result};

pub use closer::{settle as settle_closing, OffThread};
pub use context::{current_device, device_count, pci_bus_id, peer_access, relax_capture_mode, Context, KeepCurrent};
pub use cudarc::driver::sys::CUstream;
pub use graph::{Capture, GraphExec};
pub use ipc::{IpcHandle, IpcMapping};
pub use kernels::{Desc, Indirect, Kernels};
pub use memory::{alloc, allocation_of, buffer_id, classify, device_reaches_as_is, free, is_device_memory, is_host_memory, DeviceMem, MappedHost, PtrKind};
pub use stream::{check_caller_stream, Event, MemOp, Stream, UserStream, WaitCond};
pub use vmm::{export as vmm_export, segments as vmm_segments, Segment, VmmAllocation, VmmMapping, MAX_SEGMENTS};

/// Runs `f`, whose driver calls may panic inside cudarc (library or symbol missing), and turns
/// such a panic into an error naming `what`.
fn driver<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        let why = panic
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| panic.downcast_ref::<&str>().copied())
            .unwrap_or("unknown panic");
        Err(Error::new(Code::UnhandledCudaError, format!("{what}: the CUDA driver is unusable ({why})")))
    })
}

/// `Ok` for CUDA_SUCCESS, else the error "<call>: <CUresult name>".
fn check(call: impl std::fmt::Display, r: CUresult) -> Result<()> {
    if r == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::new(Code::UnhandledCudaError, format!("{call}: {}", result_name(r))))
    }
}

/// The name of a CUresult, as the driver gives it ("CUDA_ERROR_INVALID_VALUE"), else its number.
/// Never through cudarc's enum names: they are CUDA 12.0's, and a newer driver's code is not
/// one of them.
pub fn result_name(r: CUresult) -> String {
    let raw = r as u32;
    let mut name: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: `name` is a valid out-pointer; the driver returns a static string or an error.
    let known = unsafe { cudarc::driver::sys::cuGetErrorName(r, &mut name) } == CUresult::CUDA_SUCCESS;
    if known && !name.is_null() {
        // SAFETY: the driver returned a NUL-terminated static string.
        let s = unsafe { std::ffi::CStr::from_ptr(name) }.to_string_lossy();
        s.into_owned()
    } else {
        format!("CUDA error {raw}")
    }
}

/// The driver was loaded and initialised by the mode probe (which calls `cuInit`), or the error
/// that says CUDA mode is unavailable.
fn ensure_init() -> Result<()> {
    match super::mode::current() {
        super::mode::Mode::Cuda { .. } => Ok(()),
        super::mode::Mode::Host => Err(Error::new(
            Code::UnhandledCudaError,
            "CUDA mode is unavailable: libcuda.so.1 did not load, cuInit failed or there is no device",
        )),
    }
}
