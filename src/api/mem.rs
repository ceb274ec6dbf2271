//! `ncclMemAlloc` / `ncclMemFree`: device memory of the caller's current device in CUDA mode
//! (what NCCL returns, and what PyTorch's NCCL memory pool expects), page-aligned host memory
//! in host mode. And windows (`ncclCommWindowRegister`): registration is accepted and hands
//! back a window that knows its buffer (`ncclWinGetUserPtr`); collectives on it run as on any
//! buffer (no symmetric kernels), and the one-sided operations on windows are not implemented.

use std::collections::HashSet;
use std::ffi::c_void;
use std::sync::Mutex;

use crate::device::cuda;
use crate::device::mode::{self, Mode};
use crate::comm::Comm;
use crate::error::{Error, Result};

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

/// Window flags NCCL 2.32 defines (NCCL_WIN_COLL_SYMMETRIC, STRICT_ORDERING, GIN_ONLY,
/// CFT_COUNTED); any other bit is refused.
const WIN_FLAGS: i32 = 0x0f;

/// A registered window: its communicator (hash and rank) and its buffer.
#[derive(Clone, Copy)]
struct Window {
    comm: (u64, usize),
    buff: usize,
    size: usize,
}

/// Live windows by token address. A token is leaked on purpose, as communicator handles are:
/// its address is never reused, so a deregistered window stays an error.
static WINDOWS: Mutex<Option<std::collections::HashMap<usize, Window>>> = Mutex::new(None);

fn windows() -> std::sync::MutexGuard<'static, Option<std::collections::HashMap<usize, Window>>> {
    WINDOWS.lock().unwrap_or_else(|p| p.into_inner())
}

/// `ncclCommWindowRegister`: a window over `buff` (`size` bytes) on `comm`; the token.
pub fn window_register(comm: &Comm, buff: usize, size: usize, flags: i32) -> Result<usize> {
    if flags & !WIN_FLAGS != 0 {
        return Err(Error::invalid_arg(format!("unknown window flags {flags:#x}")));
    }
    if buff == 0 || size == 0 {
        return Err(Error::invalid_arg(format!("a window needs a buffer and a size (buff {buff:#x}, size {size})")));
    }
    comm.ready()?;
    let token = Box::leak(Box::new(0u64)) as *mut u64 as usize;
    let w = Window { comm: (comm.hash, comm.rank), buff, size };
    windows().get_or_insert_with(Default::default).insert(token, w);
    crate::trace!(INIT, "rank {}: window {token:#x} over {size} bytes at {buff:#x} (flags {flags:#x})", comm.rank);
    Ok(token)
}

fn window_of(comm: &Comm, token: usize) -> Result<Window> {
    let w = windows().as_ref().and_then(|m| m.get(&token).copied());
    match w {
        Some(w) if w.comm == (comm.hash, comm.rank) => Ok(w),
        Some(_) => Err(Error::invalid_arg(format!("window {token:#x} belongs to another communicator"))),
        None => Err(Error::invalid_arg(format!("{token:#x} is not a window (deregistered, or never registered)"))),
    }
}

/// `ncclWinGetUserPtr`: the buffer of a window of `comm`.
pub fn window_user_ptr(comm: &Comm, token: usize) -> Result<usize> {
    window_of(comm, token).map(|w| w.buff)
}

/// `ncclCommWindowDeregister`.
pub fn window_deregister(comm: &Comm, token: usize) -> Result<()> {
    let w = window_of(comm, token)?;
    windows().as_mut().map(|m| m.remove(&token));
    crate::trace!(INIT, "rank {}: window {token:#x} over {} bytes deregistered", comm.rank, w.size);
    Ok(())
}
