//! Devices and their primary contexts. NCCL works in the primary context of the device the
//! caller selected (the CUDA runtime's context), so that is the one we retain: once per device
//! for the life of the process, with the reduction kernels loaded into it at most once.

use std::sync::{Mutex, OnceLock};

use cudarc::driver::sys::{self, CUcontext, CUdevice, CUdevice_attribute, CUresult, CUstreamCaptureMode};

use super::kernels::Kernels;
use super::{check, driver, ensure_init};
use crate::error::{Error, Result};

/// Number of CUDA devices the driver reports.
pub fn device_count() -> Result<i32> {
    driver("cuDeviceGetCount", || {
        ensure_init()?;
        let mut count = 0;
        // SAFETY: `count` is a valid out-pointer for the call; the driver is initialised.
        check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut count) })?;
        Ok(count)
    })
}

/// The device of the context current on the calling thread (what `cudaGetDevice` reports once
/// the caller has used the runtime), or None if the thread has no current context. The driver
/// numbers a `CUdevice` as its ordinal.
pub fn current_device() -> Result<Option<i32>> {
    driver("cuCtxGetDevice", || {
        ensure_init()?;
        let mut ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: `ctx` is a valid out-pointer for the call.
        check("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut ctx) })?;
        if ctx.is_null() {
            return Ok(None);
        }
        let mut dev = 0;
        // SAFETY: `dev` is a valid out-pointer; a context is current on this thread.
        check("cuCtxGetDevice", unsafe { sys::cuCtxGetDevice(&mut dev) })?;
        Ok(Some(dev))
    })
}

/// The calling thread's CUDA state, put back when this value is dropped: its current context
/// (an NCCL call that makes its communicator's context current must not change the caller's)
/// and its stream-capture interaction mode, relaxed meanwhile ([`relax_capture_mode`]).
///
/// Scopes nest (a call keeps the state, and so do the steps it runs): only the outermost one
/// of a thread asks the driver and puts its state back, and within it [`Context::make_current`]
/// skips the driver when its context is already current, so a call pays for this once, not
/// per step (`calls` in ffi-tests/cuda.c counts a call's driver calls).
pub struct KeepCurrent {
    /// Of the outermost scope: the context current when it opened (None if the driver could
    /// not say) and the capture mode to restore. Nested scopes hold neither.
    outer: Option<(Option<CUcontext>, Option<CUstreamCaptureMode>)>,
}

/// Per thread: how many [`KeepCurrent`] scopes are open, and (while any is) the context known
/// to be current (None if unknown: the driver is asked again).
#[derive(Clone, Copy)]
struct Kept {
    depth: u32,
    current: Option<CUcontext>,
}

thread_local! {
    static KEPT: std::cell::Cell<Kept> = const { std::cell::Cell::new(Kept { depth: 0, current: None }) };
}

impl KeepCurrent {
    pub fn new() -> KeepCurrent {
        let kept = KEPT.get();
        if kept.depth > 0 {
            KEPT.set(Kept { depth: kept.depth + 1, ..kept });
            return KeepCurrent { outer: None };
        }
        let saved = driver("cuCtxGetCurrent", || {
            let mut ctx: CUcontext = std::ptr::null_mut();
            // SAFETY: `ctx` is a valid out-pointer for the call.
            check("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut ctx) })?;
            Ok(ctx)
        })
        .ok();
        KEPT.set(Kept { depth: 1, current: saved });
        let mode = exchange_capture_mode(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .filter(|m| *m != CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED);
        KeepCurrent { outer: Some((saved, mode)) }
    }
}

impl Default for KeepCurrent {
    fn default() -> KeepCurrent {
        KeepCurrent::new()
    }
}

impl Drop for KeepCurrent {
    fn drop(&mut self) {
        let kept = KEPT.get();
        let depth = kept.depth.saturating_sub(1);
        let Some((saved, mode)) = self.outer else {
            KEPT.set(Kept { depth, ..kept });
            return;
        };
        if let Some(ctx) = saved.filter(|c| kept.current != Some(*c)) {
            // SAFETY: `ctx` was current on this thread (or NULL) when saved; contexts we hand
            // out are retained for the life of the process, and the caller's own stays alive
            // across its NCCL call.
            let _ = driver("cuCtxSetCurrent", || check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(ctx) }));
        }
        // (A scope still open, dropped out of order, knows the context put back.)
        KEPT.set(Kept { depth, current: saved.filter(|_| depth > 0) });
        if let Some(mode) = mode {
            exchange_capture_mode(mode);
        }
    }
}

/// The PCI bus id of device `ordinal`, as the driver writes it (`0000:3B:00.0`).
pub fn pci_bus_id(ordinal: i32) -> Result<String> {
    driver("cuDeviceGetPCIBusId", || {
        ensure_init()?;
        let mut dev = 0;
        // SAFETY: `dev` is a valid out-pointer; the driver checks the ordinal.
        check(format_args!("cuDeviceGet({ordinal})"), unsafe { sys::cuDeviceGet(&mut dev, ordinal) })?;
        let mut buf = [0 as std::ffi::c_char; 32];
        // SAFETY: `buf` holds `len` bytes, which the driver writes NUL-terminated.
        check("cuDeviceGetPCIBusId", unsafe { sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, dev) })?;
        let bytes: Vec<u8> = buf.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    })
}

/// Whether kernels on device `from` may read device `to`'s memory by its address: peer
/// access, which the first call for a pair enables (`cuCtxEnablePeerAccess` in `from`'s
/// primary context) where `cuDeviceCanAccessPeer` allows it; the answer is kept for the
/// process's life, so later calls ask the driver nothing. The caller's current context is
/// left as it was.
pub fn peer_access(from: i32, to: i32) -> bool {
    static KNOWN: crate::abi::fork::PerForkMutex<Vec<((i32, i32), bool)>> =
        crate::abi::fork::PerFork::new(crate::abi::fork::inherit);
    if from == to {
        return true;
    }
    let mut known = KNOWN.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(&(_, ok)) = known.iter().find(|(pair, _)| *pair == (from, to)) {
        return ok;
    }
    let _keep = KeepCurrent::new();
    let enabled = (|| -> Result<bool> {
        let (a, b) = (Context::primary(from)?, Context::primary(to)?);
        driver("cuCtxEnablePeerAccess", || {
            let mut can = 0;
            // SAFETY: `can` is a valid out-pointer; both devices came from cuDeviceGet.
            check("cuDeviceCanAccessPeer", unsafe { sys::cuDeviceCanAccessPeer(&mut can, a.dev, b.dev) })?;
            if can == 0 {
                return Ok(false);
            }
            a.make_current()?;
            // SAFETY: `b.raw` is a retained primary context; flags must be 0.
            match unsafe { sys::cuCtxEnablePeerAccess(b.raw, 0) } {
                CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(true),
                r => check(format_args!("cuCtxEnablePeerAccess(device {from} to {to})"), r).map(|()| true),
            }
        })
    })();
    let ok = match enabled {
        Ok(ok) => ok,
        Err(e) => {
            crate::info!(P2P, "device {from} cannot read device {to}'s memory ({})", e.msg);
            false
        }
    };
    crate::info!(P2P, "peer access from device {from} to device {to}: {}", if ok { "enabled" } else { "not available" });
    known.push(((from, to), ok));
    ok
}

/// Makes the calling thread's driver calls independent of graph captures other threads make
/// (for nccl-rs's own threads, for good; callers' threads get it for the length of a call from
/// [`KeepCurrent`]).
///
/// While some thread captures a CUDA graph in global mode (`torch.cuda.graph`'s default), the
/// driver refuses "potentially unsafe" calls — allocating, freeing, mapping, querying or
/// synchronising — from every thread whose mode is global, the default, and the refusal
/// invalidates that capture. Those calls of nccl-rs are never meant to be part of a graph (what
/// a collective records into one on a capturing stream is stream work, `streamed::capture`), so
/// they run relaxed, as NVIDIA's NCCL runs its allocations: a stream worker that stages an
/// operation, or a call that starts one, while the application captures something else neither
/// fails nor breaks the capture.
pub fn relax_capture_mode() {
    // (Host mode: no driver to ask.)
    if crate::device::mode::is_cuda() {
        exchange_capture_mode(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED);
    }
}

/// Sets the calling thread's capture interaction mode to `mode`; the one it had, if the
/// driver has the call.
fn exchange_capture_mode(mode: CUstreamCaptureMode) -> Option<CUstreamCaptureMode> {
    driver("cuThreadExchangeStreamCaptureMode", || {
        let mut m = mode;
        // SAFETY: `m` is a valid in/out pointer for the call.
        check("cuThreadExchangeStreamCaptureMode", unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut m) })?;
        Ok(m)
    })
    .ok()
}

/// The primary context of one device, retained for the life of the process.
pub struct Context {
    ordinal: i32,
    dev: CUdevice,
    raw: CUcontext,
    kernels: OnceLock<Kernels>,
    kernels_loading: Mutex<()>,
    mem_ops: OnceLock<MemOpSupport>,
}

// SAFETY: a CUcontext is a driver handle usable from any thread (the driver synchronises);
// the other fields are Sync.
unsafe impl Send for Context {}
// SAFETY: as for Send.
unsafe impl Sync for Context {}

/// Which stream memory operations the device runs (ARCHITECTURE.md, decision 4).
#[derive(Clone, Copy, Debug)]
pub(super) struct MemOpSupport {
    /// `cuStreamWaitValue32_v2` / `cuStreamWriteValue32_v2` with GEQ, EQ and AND.
    pub wait_write: bool,
    /// CU_STREAM_WAIT_VALUE_NOR as well.
    pub nor: bool,
}

impl Context {
    /// The primary context of device `ordinal`, made current on the calling thread.
    pub fn primary(ordinal: i32) -> Result<&'static Context> {
        let ctx = Context::retain(ordinal)?;
        ctx.make_current()?;
        Ok(ctx)
    }

    /// The primary context of device `ordinal`, retained on first use; what is current on
    /// the calling thread stays so.
    pub fn retain(ordinal: i32) -> Result<&'static Context> {
        static TABLE: crate::abi::fork::PerForkMutex<Vec<&'static Context>> = crate::abi::fork::PerFork::new(crate::abi::fork::anew);
        driver("cuDevicePrimaryCtxRetain", || {
            ensure_init()?;
            let mut table = TABLE.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(ctx) = table.iter().find(|c| c.ordinal == ordinal) {
                return Ok(*ctx);
            }
            let count = device_count()?;
            if !(0..count).contains(&ordinal) {
                return Err(Error::invalid_arg(format!("CUDA device {ordinal} does not exist ({count} devices)")));
            }
            let mut dev = 0;
            // SAFETY: `dev` is a valid out-pointer; the ordinal is in range.
            check(format_args!("cuDeviceGet({ordinal})"), unsafe { sys::cuDeviceGet(&mut dev, ordinal) })?;
            let mut raw: CUcontext = std::ptr::null_mut();
            // SAFETY: `raw` is a valid out-pointer; `dev` came from cuDeviceGet. The retain is
            // never released: the context lives as long as the process, as the table does.
            check(format_args!("cuDevicePrimaryCtxRetain({ordinal})"), unsafe {
                sys::cuDevicePrimaryCtxRetain(&mut raw, dev)
            })?;
            let ctx: &'static Context = Box::leak(Box::new(Context {
                ordinal,
                dev,
                raw,
                kernels: OnceLock::new(),
                kernels_loading: Mutex::new(()),
                mem_ops: OnceLock::new(),
            }));
            table.push(ctx);
            Ok(ctx)
        })
    }

    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    pub(super) fn raw(&self) -> CUcontext {
        self.raw
    }

    /// Makes this context current on the calling thread (each proxy thread does it once);
    /// within a [`KeepCurrent`] scope where it is current already, no driver call.
    pub fn make_current(&self) -> Result<()> {
        let kept = KEPT.get();
        if kept.depth > 0 && kept.current == Some(self.raw) {
            return Ok(());
        }
        let r = driver("cuCtxSetCurrent", || {
            // SAFETY: `raw` is a retained primary context, valid for the life of the process.
            check(format_args!("cuCtxSetCurrent(device {})", self.ordinal), unsafe { sys::cuCtxSetCurrent(self.raw) })
        });
        if kept.depth > 0 {
            KEPT.set(Kept { current: r.is_ok().then_some(self.raw), ..kept });
        }
        r
    }

    /// The reduction kernels, loaded into this context on first use. That first call makes the
    /// context current on the calling thread.
    pub fn kernels(&self) -> Result<&Kernels> {
        if let Some(k) = self.kernels.get() {
            return Ok(k);
        }
        let _loading = self.kernels_loading.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(k) = self.kernels.get() {
            return Ok(k);
        }
        self.make_current()?;
        let loaded = Kernels::load(self.dev).map_err(|e| e.context(format_args!("device {}", self.ordinal)))?;
        Ok(self.kernels.get_or_init(|| loaded))
    }

    /// Can streams of this device wait on memory (`cuStreamWaitValue32_v2` with GEQ)?
    pub fn can_wait_on_memory(&self) -> Result<bool> {
        Ok(self.mem_ops()?.wait_write)
    }

    /// What the device supports of the stream memory operations, asked once. The v2 entry
    /// points exist from CUDA 11.7 and "are available by default on all platforms" (CUDA driver
    /// API, Stream Memory Operations); the V1 attribute (CAN_USE_STREAM_MEM_OPS_V1) only says
    /// whether the kernel module enabled the legacy API, so it is not consulted. NOR has its
    /// own attribute (the V2 one, `CAN_USE_STREAM_WAIT_VALUE_NOR` in CUDA 12's enum).
    pub(super) fn mem_ops(&self) -> Result<MemOpSupport> {
        if let Some(s) = self.mem_ops.get() {
            return Ok(*s);
        }
        let support = driver("stream memory operations support", || {
            let mut version = 0;
            // SAFETY: `version` is a valid out-pointer.
            check("cuDriverGetVersion", unsafe { sys::cuDriverGetVersion(&mut version) })?;
            if version < 11070 {
                return Ok(MemOpSupport { wait_write: false, nor: false });
            }
            let mut nor = 0;
            let attr = CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR;
            // SAFETY: `nor` is a valid out-pointer; `dev` came from cuDeviceGet.
            check("cuDeviceGetAttribute(CAN_USE_STREAM_WAIT_VALUE_NOR)", unsafe {
                sys::cuDeviceGetAttribute(&mut nor, attr, self.dev)
            })?;
            Ok(MemOpSupport { wait_write: true, nor: nor != 0 })
        })?;
        Ok(*self.mem_ops.get_or_init(|| support))
    }
}
