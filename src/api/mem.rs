//! `ncclMemAlloc` / `ncclMemFree`: device memory of the caller's current device in CUDA mode
//! (what NCCL returns, and what PyTorch's NCCL memory pool expects), page-aligned host memory
//! in host mode. And windows (`ncclCommWindowRegister`): registration is accepted and hands
//! back a window that knows its buffer (`ncclWinGetUserPtr`); collectives on it run as on any
//! buffer (no symmetric kernels), and one-sided operations (`api::rma`) write into them.

use std::collections::HashSet;
use std::ffi::c_void;

use crate::device::cuda;
use crate::device::host::UserPtr;
use crate::device::mode::{self, Mode};
use crate::comm::Comm;
use crate::error::{Error, Result};

/// Device memory from `ncclMemAlloc` not freed yet. `ncclMemFree` frees only these: handed
/// any other allocation's start (PyTorch's, say) the driver would free it under its owner.
static DEVICE_BLOCKS: crate::abi::fork::PerForkMutex<Option<HashSet<usize>>> =
    crate::abi::fork::PerFork::new(crate::abi::fork::inherit);

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

/// A registered window: its communicator (`Comm::serial` and rank), its buffer, and its ordinal: the
/// number of windows the rank registered on the communicator before it. Registration is
/// collective, so an ordinal names the same window on every rank; one-sided operations use it
/// to name the target's window.
#[derive(Clone, Copy, Debug)]
pub struct Window {
    comm: (u64, usize),
    pub buff: UserPtr,
    pub size: usize,
    pub ordinal: u64,
    /// NCCL_WIN_COLL_SYMMETRIC: every rank registered the same size.
    pub symmetric: bool,
}

const WIN_COLL_SYMMETRIC: i32 = 0x01;

/// A window's name in this process: its communicator (serial, rank) and ordinal.
type WindowKey = ((u64, usize), u64);

/// Live windows by name, their tokens, and the next ordinal per communicator (serial, rank). A
/// token is leaked on purpose, as communicator handles are: its address is never reused, so a
/// deregistered window stays an error.
#[derive(Default)]
struct Windows {
    live: std::collections::HashMap<WindowKey, Window>,
    by_token: std::collections::HashMap<usize, WindowKey>,
    next: std::collections::HashMap<(u64, usize), u64>,
    /// The communicator of each live token (calls that name only a window need it).
    owners: std::collections::HashMap<usize, std::sync::Weak<Comm>>,
}

static WINDOWS: crate::abi::fork::PerForkMutex<Option<Windows>> = crate::abi::fork::PerFork::new(crate::abi::fork::anew);
/// Notified when a window is registered (a put may arrive before its target registered it).
static REGISTERED: std::sync::Condvar = std::sync::Condvar::new();

fn windows() -> std::sync::MutexGuard<'static, Option<Windows>> {
    WINDOWS.lock().unwrap_or_else(|p| p.into_inner())
}

/// `ncclCommWindowRegister`: a window over `buff` (`size` bytes) on `comm`; the token.
pub fn window_register(comm: &std::sync::Arc<Comm>, buff: UserPtr, size: usize, flags: i32) -> Result<usize> {
    if flags & !WIN_FLAGS != 0 {
        return Err(Error::invalid_arg(format!("unknown window flags {flags:#x}")));
    }
    if buff.is_null() || size == 0 {
        return Err(Error::invalid_arg(format!("a window needs a buffer and a size (buff {:#x}, size {size})", buff.addr())));
    }
    comm.ready()?;
    let token = Box::leak(Box::new(0u64)) as *mut u64 as usize;
    // (Not the hash: communicators of one unique id, NCCL_COMM_ID's, share it.)
    let key = (comm.serial, comm.rank);
    let mut guard = windows();
    let reg = guard.get_or_insert_with(Default::default);
    let next = reg.next.entry(key).or_insert(0);
    let w = Window { comm: key, buff, size, ordinal: *next, symmetric: flags & WIN_COLL_SYMMETRIC != 0 };
    *next += 1;
    reg.by_token.insert(token, (key, w.ordinal));
    reg.owners.insert(token, std::sync::Arc::downgrade(comm));
    reg.live.insert((key, w.ordinal), w);
    drop(guard);
    REGISTERED.notify_all();
    crate::trace!(INIT, "rank {}: window {token:#x} (#{}) over {size} bytes at {:#x} (flags {flags:#x})", comm.rank,
                  w.ordinal, buff.addr());
    Ok(token)
}

/// The window of `comm` behind a token.
pub fn window_of(comm: &Comm, token: usize) -> Result<Window> {
    let w = windows().as_ref().and_then(|m| m.by_token.get(&token).and_then(|k| m.live.get(k)).copied());
    match w {
        Some(w) if w.comm == (comm.serial, comm.rank) => Ok(w),
        Some(_) => Err(Error::invalid_arg(format!("window {token:#x} belongs to another communicator"))),
        None => Err(Error::invalid_arg(format!("{token:#x} is not a window (deregistered, or never registered)"))),
    }
}

/// A window named by its token alone, with its communicator (`ncclGetPeerDevicePointer`).
pub fn window_and_comm(token: usize) -> Result<(std::sync::Arc<Comm>, Window)> {
    let guard = windows();
    let found = guard.as_ref().and_then(|m| {
        let w = m.by_token.get(&token).and_then(|k| m.live.get(k)).copied()?;
        Some((m.owners.get(&token)?.upgrade()?, w))
    });
    found.ok_or_else(|| Error::invalid_arg(format!(
        "{token:#x} is not a window of a live communicator (deregistered, or never registered)")))
}

/// What became of the window a rank registered `ordinal`-th on a communicator (serial, rank).
pub enum Lookup {
    Live(Window),
    /// Registered, then deregistered.
    Gone,
    /// Not registered yet.
    NotYet,
}

/// The window registered `ordinal`-th by `comm` (serial, rank), waiting for its registration
/// while `wait` says so (a put may arrive before its target registered the window).
pub fn window_by_ordinal(comm: (u64, usize), ordinal: u64, mut wait: impl FnMut() -> bool) -> Lookup {
    let mut guard = windows();
    loop {
        let reg = guard.get_or_insert_with(Default::default);
        if let Some(w) = reg.live.get(&(comm, ordinal)) {
            return Lookup::Live(*w);
        }
        if reg.next.get(&comm).is_some_and(|n| ordinal < *n) {
            return Lookup::Gone;
        }
        if !wait() {
            return Lookup::NotYet;
        }
        guard = match REGISTERED.wait_timeout(guard, std::time::Duration::from_millis(100)) {
            Ok((g, _)) => g,
            Err(p) => p.into_inner().0,
        };
    }
}

/// `ncclWinGetUserPtr`: the buffer of a window of `comm`.
pub fn window_user_ptr(comm: &Comm, token: usize) -> Result<usize> {
    window_of(comm, token).map(|w| w.buff.addr())
}

/// `ncclCommWindowDeregister`.
pub fn window_deregister(comm: &Comm, token: usize) -> Result<()> {
    let w = window_of(comm, token)?;
    if let Some(m) = windows().as_mut() {
        m.by_token.remove(&token);
        m.owners.remove(&token);
        m.live.remove(&(w.comm, w.ordinal));
    }
    comm.rma.window_deregistered(comm, w.ordinal);
    crate::trace!(INIT, "rank {}: window {token:#x} over {} bytes deregistered", comm.rank, w.size);
    Ok(())
}
