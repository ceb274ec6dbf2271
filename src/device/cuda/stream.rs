//! Streams and events: the order in which the device does things. Our own streams are
//! created non-blocking (they never wait for the legacy NULL stream); a caller's stream
//! arrives as a raw `CUstream` and is wrapped without being owned. Copies between any two
//! addresses, memsets and the stream memory operations (wait on / write a 32-bit word of mapped
//! host memory) are enqueued here.

use std::ffi::c_uint;
use std::sync::atomic::{AtomicUsize, Ordering};

use cudarc::driver::sys::{self, CUcontext, CUevent, CUevent_flags, CUresult, CUstream, CUstreamWaitValue_flags, CUstream_flags};

use super::context::Context;
use super::memory::MappedHost;
use super::{check, driver};
use crate::device::host::Region;
use crate::error::{Error, Result};

/// The `cudaStream_t` an NCCL call received (NULL: the legacy default stream), carried to
/// where it is used without being dereferenced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UserStream(usize);

impl UserStream {
    pub const NULL: UserStream = UserStream(0);

    /// # Safety
    /// `raw` is the stream argument of an NCCL call: NULL or a stream of the communicator's
    /// device that stays alive until the operations enqueued on it have completed.
    pub unsafe fn new<T>(raw: *mut T) -> UserStream {
        UserStream(raw as usize)
    }

    /// NULL, `cudaStreamLegacy` (1) or `cudaStreamPerThread` (2): a default stream, which is
    /// the current context's wherever it is used.
    pub fn is_default(self) -> bool {
        self.0 <= 2
    }
}

/// Refuses a caller's stream of another device than `dev` (the communicator's): one created
/// while another device was current (a program that did not switch devices). The driver would
/// refuse the events and kernels queued on it, leaving the communicator in error; NCCL fails
/// such a call with "invalid resource handle". `last_ok` remembers the last stream found
/// right, so a caller that keeps to one stream pays the driver call (cuStreamGetCtx) once. A
/// stream the driver cannot place is let through: the calls on it report what is wrong.
pub fn check_caller_stream(dev: i32, s: UserStream, last_ok: &AtomicUsize) -> Result<()> {
    if s.is_default() || last_ok.load(Ordering::Relaxed) == s.0 {
        return Ok(());
    }
    // (A rank of ncclCommInitAll beyond the driver's devices has no context: its calls on
    // host buffers ignore the stream, and the others fail at their own driver calls.)
    let Ok(ctx) = Context::retain(dev) else { return Ok(()) };
    let mut of: CUcontext = std::ptr::null_mut();
    // SAFETY: `of` is a valid out-pointer; the stream is the caller's, alive during its call
    // (UserStream's contract). The call reads the stream's context and changes nothing.
    let found = driver("cuStreamGetCtx", || check("cuStreamGetCtx", unsafe { sys::cuStreamGetCtx(s.0 as CUstream, &mut of) }));
    if found.is_err() || of.is_null() {
        return Ok(());
    }
    // Another context of the same device (a green context's stream, say) is let through, as
    // before this check: only another device is known to fail.
    match (of == ctx.raw()).then_some(dev).or_else(|| context_device(of)) {
        Some(d) if d != dev => Err(Error::invalid_arg(format!(
            "stream {:#x} is a stream of CUDA device {d}, and the communicator is on device {dev}: a stream belongs \
             to the device current when it was created (cudaSetDevice({dev}) before cudaStreamCreate)",
            s.0
        ))),
        _ => {
            last_ok.store(s.0, Ordering::Relaxed);
            Ok(())
        }
    }
}

/// The device of context `c`, made current for the question; the context current before is
/// put back (so a KeepCurrent scope's knowledge of it stays true).
fn context_device(c: CUcontext) -> Option<i32> {
    driver("cuCtxGetDevice", || {
        let mut before: CUcontext = std::ptr::null_mut();
        // SAFETY: `before` is a valid out-pointer.
        check("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut before) })?;
        // SAFETY: `c` is a context the driver just named as a live stream's.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(c) })?;
        let mut dev = 0;
        // SAFETY: `dev` is a valid out-pointer; a context is current.
        let asked = check("cuCtxGetDevice", unsafe { sys::cuCtxGetDevice(&mut dev) });
        // SAFETY: `before` was current on this thread a moment ago (or NULL).
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(before) })?;
        asked.map(|()| dev)
    })
    .ok()
}

/// A stream: ours (destroyed on drop) or a caller's (left alone).
pub struct Stream {
    raw: CUstream,
    owned: bool,
    ctx: &'static Context,
}

// SAFETY: a CUstream is a driver handle usable from any thread; the driver synchronises.
unsafe impl Send for Stream {}
// SAFETY: as for Send.
unsafe impl Sync for Stream {}

/// The condition of [`Stream::wait_value32`], as `cuStreamWaitValue32_v2` defines them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaitCond {
    /// `(int32_t)(*addr - value) >= 0`: a counter that wraps.
    Geq,
    Eq,
    /// `(*addr & value) != 0`.
    And,
    /// `~(*addr | value) != 0`.
    Nor,
}

/// What became of a stream memory operation: enqueued, or not supported by this driver or
/// device, in which case nothing was enqueued and the caller falls back to events.
#[must_use]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemOp {
    Enqueued,
    Unsupported,
}

impl Stream {
    /// A new non-blocking stream on `ctx`, which becomes current on the calling thread.
    pub fn new(ctx: &'static Context) -> Result<Stream> {
        ctx.make_current()?;
        driver("cuStreamCreate", || {
            let mut raw: CUstream = std::ptr::null_mut();
            let flags = CUstream_flags::CU_STREAM_NON_BLOCKING as c_uint;
            // SAFETY: `raw` is a valid out-pointer; a context is current.
            check("cuStreamCreate", unsafe { sys::cuStreamCreate(&mut raw, flags) })?;
            Ok(Stream { raw, owned: true, ctx })
        })
    }

    /// The caller's stream (NULL: the legacy default stream of the current context).
    ///
    /// # Safety
    /// `raw` is NULL or a stream of `ctx`'s device that stays alive while this value is used
    /// (NCCL's contract for the `cudaStream_t` of a call).
    pub unsafe fn wrap(ctx: &'static Context, raw: CUstream) -> Stream {
        Stream { raw, owned: false, ctx }
    }

    /// The stream of a call ([`UserStream`] carries its caller's promise).
    pub fn caller(ctx: &'static Context, s: UserStream) -> Stream {
        Stream { raw: s.0 as CUstream, owned: false, ctx }
    }

    pub fn raw(&self) -> CUstream {
        self.raw
    }

    /// Is the stream capturing a CUDA graph (work enqueued now would be recorded, not run)?
    pub fn is_capturing(&self) -> Result<bool> {
        driver("cuStreamIsCapturing", || {
            let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
            // SAFETY: `status` is a valid out-pointer; `raw` is a live stream.
            match unsafe { sys::cuStreamIsCapturing(self.raw, &mut status) } {
                // The legacy stream while another stream captures in global mode: enqueueing
                // on it would invalidate that capture, so it counts as capturing.
                CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT => return Ok(true),
                r => check("cuStreamIsCapturing", r)?,
            }
            Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
        })
    }

    /// Blocks until everything enqueued so far has completed.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: `raw` is a live stream (owned, or the caller's by `wrap`'s contract).
        driver("cuStreamSynchronize", || check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(self.raw) }))
    }

    /// True when everything enqueued so far has completed.
    pub fn query(&self) -> Result<bool> {
        driver("cuStreamQuery", || {
            // SAFETY: as in `synchronize`.
            match unsafe { sys::cuStreamQuery(self.raw) } {
                CUresult::CUDA_ERROR_NOT_READY => Ok(false),
                r => check("cuStreamQuery", r).map(|()| true),
            }
        })
    }

    /// dst <- src, in stream order (`cuMemcpyAsync`: any memory, unified addressing).
    pub fn copy(&self, dst: Region, src: Region) -> Result<()> {
        debug_assert_eq!(dst.len(), src.len());
        let n = dst.len().min(src.len());
        if n == 0 {
            return Ok(());
        }
        driver("cuMemcpyAsync", || {
            // SAFETY: both regions are valid for n bytes until the stream passes the copy (the
            // Region contract and this module's); `raw` is a live stream.
            check(format_args!("cuMemcpyAsync({n} bytes)"), unsafe {
                sys::cuMemcpyAsync(dst.addr() as u64, src.addr() as u64, n, self.raw)
            })
        })
    }

    /// Every byte of `dst` <- `byte`, in stream order. `dst` must be device-accessible memory
    /// (device, mapped host or managed), as `cuMemsetD8Async` requires.
    pub fn memset(&self, dst: Region, byte: u8) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        driver("cuMemsetD8Async", || {
            // SAFETY: dst is valid for its length until the stream passes the memset.
            check(format_args!("cuMemsetD8Async({} bytes)", dst.len()), unsafe {
                sys::cuMemsetD8Async(dst.addr() as u64, byte, dst.len(), self.raw)
            })
        })
    }

    /// Work enqueued after this waits until `event` has completed (its latest record).
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        driver("cuStreamWaitEvent", || {
            // SAFETY: both handles are live.
            check("cuStreamWaitEvent", unsafe { sys::cuStreamWaitEvent(self.raw, event.raw, 0) })
        })
    }

    /// Work enqueued after this waits until word `word` of `mem` satisfies `cond` against
    /// `value`. `mem` must stay alive until the stream has passed the wait.
    pub fn wait_value32(&self, mem: &MappedHost, word: usize, value: u32, cond: WaitCond) -> Result<MemOp> {
        let support = self.ctx.mem_ops()?;
        if !support.wait_write || (cond == WaitCond::Nor && !support.nor) {
            return Ok(MemOp::Unsupported);
        }
        let addr = word_addr(mem, word)?;
        let flags = match cond {
            WaitCond::Geq => CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ,
            WaitCond::Eq => CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_EQ,
            WaitCond::And => CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_AND,
            WaitCond::Nor => CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_NOR,
        } as c_uint;
        driver("cuStreamWaitValue32_v2", || {
            // SAFETY: `addr` is the device address of a word of live mapped host memory.
            let r = unsafe { sys::cuStreamWaitValue32_v2(self.raw, addr, value, flags) };
            mem_op_result("cuStreamWaitValue32_v2", r)
        })
    }

    /// Word `word` of `mem` <- `value` once the work enqueued before has completed (with a
    /// memory barrier: the device's earlier writes are visible first). `mem` must stay alive
    /// until the stream has passed the write.
    pub fn write_value32(&self, mem: &MappedHost, word: usize, value: u32) -> Result<MemOp> {
        if !self.ctx.mem_ops()?.wait_write {
            return Ok(MemOp::Unsupported);
        }
        let addr = word_addr(mem, word)?;
        driver("cuStreamWriteValue32_v2", || {
            // SAFETY: `addr` is the device address of a word of live mapped host memory; flags 0
            // is CU_STREAM_WRITE_VALUE_DEFAULT.
            let r = unsafe { sys::cuStreamWriteValue32_v2(self.raw, addr, value, 0) };
            mem_op_result("cuStreamWriteValue32_v2", r)
        })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.owned {
            // SAFETY: we created the stream and nobody uses it after drop. The driver releases
            // it once its pending work completes. A failure cannot be reported from drop.
            let _ = driver("cuStreamDestroy_v2", || {
                check("cuStreamDestroy_v2", unsafe { sys::cuStreamDestroy_v2(self.raw) })
            });
        }
    }
}

pub(super) fn word_addr(mem: &MappedHost, word: usize) -> Result<u64> {
    if word >= mem.len() / 4 {
        return Err(Error::internal(format!("word {word} lies outside the {}-byte mapped host buffer", mem.len())));
    }
    Ok((mem.device_addr() + 4 * word) as u64)
}

fn mem_op_result(call: &str, r: CUresult) -> Result<MemOp> {
    match r {
        CUresult::CUDA_ERROR_NOT_SUPPORTED => Ok(MemOp::Unsupported),
        r => check(call, r).map(|()| MemOp::Enqueued),
    }
}

/// An event without timing: a point in a stream that other streams and the host can wait for.
pub struct Event {
    raw: CUevent,
}

// SAFETY: a CUevent is a driver handle usable from any thread.
unsafe impl Send for Event {}
// SAFETY: as for Send.
unsafe impl Sync for Event {}

impl Event {
    /// A new event on `ctx`, which becomes current on the calling thread.
    pub fn new(ctx: &'static Context) -> Result<Event> {
        ctx.make_current()?;
        driver("cuEventCreate", || {
            let mut raw: CUevent = std::ptr::null_mut();
            let flags = CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint;
            // SAFETY: `raw` is a valid out-pointer; a context is current.
            check("cuEventCreate", unsafe { sys::cuEventCreate(&mut raw, flags) })?;
            Ok(Event { raw })
        })
    }

    /// The event completes when `stream` reaches this point.
    pub fn record(&self, stream: &Stream) -> Result<()> {
        // SAFETY: both handles are live.
        driver("cuEventRecord", || check("cuEventRecord", unsafe { sys::cuEventRecord(self.raw, stream.raw) }))
    }

    /// True when the latest record has completed (or the event was never recorded).
    pub fn query(&self) -> Result<bool> {
        driver("cuEventQuery", || {
            // SAFETY: the event is live.
            match unsafe { sys::cuEventQuery(self.raw) } {
                CUresult::CUDA_ERROR_NOT_READY => Ok(false),
                r => check("cuEventQuery", r).map(|()| true),
            }
        })
    }

    /// Blocks until the latest record has completed.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: the event is live.
        driver("cuEventSynchronize", || check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(self.raw) }))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: we created the event; the driver releases it once pending records complete.
        let _ = driver("cuEventDestroy_v2", || check("cuEventDestroy_v2", unsafe { sys::cuEventDestroy_v2(self.raw) }));
    }
}
