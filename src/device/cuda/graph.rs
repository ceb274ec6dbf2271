//! What recording into a CUDA graph needs beyond ordinary stream work: the graph a stream is
//! capturing into, host functions (a graph's host nodes), and user objects, through which a
//! graph owns what its work refers to until the graph and every launch of it are gone.

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use cudarc::driver::sys::{self, CUgraph, CUresult, CUuserObject, CUuserObjectRetain_flags, CUuserObject_flags};

use super::stream::Stream;
use super::{check, driver};
use crate::error::{Error, Result};

/// The graph a stream is capturing into: valid while the capture lasts.
#[derive(Clone, Copy, Debug)]
pub struct Capture {
    graph: CUgraph,
}

impl Stream {
    /// The graph this stream is capturing into, or None if it is not capturing (the legacy
    /// stream while a blocking stream captures, which CUDA answers with
    /// CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, captures nothing itself).
    pub fn capture(&self) -> Result<Option<Capture>> {
        driver("cuStreamGetCaptureInfo_v2", || {
            let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
            let mut graph: CUgraph = std::ptr::null_mut();
            // SAFETY: `status` and `graph` are valid out-pointers; the others may be NULL; `raw`
            // is a live stream.
            match unsafe {
                sys::cuStreamGetCaptureInfo_v2(self.raw(), &mut status, std::ptr::null_mut(), &mut graph,
                                               std::ptr::null_mut(), std::ptr::null_mut())
            } {
                CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT => return Ok(None),
                r => check("cuStreamGetCaptureInfo_v2", r)?,
            }
            match status {
                sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE if !graph.is_null() => {
                    Ok(Some(Capture { graph }))
                }
                sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => Ok(None),
                _ => Err(Error::invalid_usage("the stream's graph capture was invalidated")),
            }
        })
    }
}

/// What a graph's host node calls: `f(value)`, every time a launch of the graph reaches it.
struct HostCall<T> {
    value: Arc<T>,
    f: fn(Arc<T>),
}

impl Capture {
    /// Records a host node into the graph at this point of `stream`'s capture: each launch
    /// that reaches it calls `f` with a clone of `value` on a thread of the driver's,
    /// once the work captured before it has completed, and work captured after it waits for
    /// `f` to return. `f` must return promptly and make no driver call (CUDA forbids it there).
    /// The graph owns `value`: it is dropped once the graph, its executable copies and their
    /// launches are all gone, on a driver thread, so its drop must make no driver call either.
    pub fn host_call<T: Send + Sync + 'static>(&self, stream: &Stream, value: Arc<T>, f: fn(Arc<T>)) -> Result<()> {
        unsafe extern "C" fn call<T>(data: *mut c_void) {
            // SAFETY: `data` is the HostCall the graph keeps while any launch of it can run.
            let hc = unsafe { &*data.cast_const().cast::<HostCall<T>>() };
            let _ = catch_unwind(AssertUnwindSafe(|| (hc.f)(hc.value.clone())));
        }
        let data = self.keep(Box::new(HostCall { value, f }))?;
        driver("cuLaunchHostFunc", || {
            // SAFETY: `raw` is a live stream; `call` never unwinds into the driver, and `data`
            // lives as long as the graph's launches (the graph owns it).
            check("cuLaunchHostFunc", unsafe { sys::cuLaunchHostFunc(stream.raw(), Some(call::<T>), data) })
        })
    }

    /// Hands `value` to the graph: it is dropped once the graph, its executable copies and
    /// their launches are all gone, on a thread of the driver's, which must make no driver
    /// call (so `T`'s drop must not). On failure it is dropped at once. Returns where it lives.
    fn keep<T: Send + 'static>(&self, value: Box<T>) -> Result<*mut c_void> {
        unsafe extern "C" fn drop_box<T>(p: *mut c_void) {
            // SAFETY: `p` is the Box::into_raw below, handed to the driver once, dropped once.
            let _ = catch_unwind(AssertUnwindSafe(|| drop(unsafe { Box::from_raw(p.cast::<T>()) })));
        }
        // Ours until the driver takes it: dropped here if it does not (an error, or a driver
        // without the call, which cudarc reports by panicking).
        let mut unclaimed = Unclaimed(Box::into_raw(value));
        let raw = unclaimed.0.cast::<c_void>();
        driver("cuUserObjectCreate", || {
            let mut object: CUuserObject = std::ptr::null_mut();
            let flags = CUuserObject_flags::CU_USER_OBJECT_NO_DESTRUCTOR_SYNC as u32;
            // SAFETY: `object` is a valid out-pointer; on success the destructor owns `raw`.
            check("cuUserObjectCreate", unsafe {
                sys::cuUserObjectCreate(&mut object, raw, Some(drop_box::<T>), 1, flags)
            })?;
            unclaimed.0 = std::ptr::null_mut();
            let flags = CUuserObjectRetain_flags::CU_GRAPH_USER_OBJECT_MOVE as u32;
            // SAFETY: both handles are live; MOVE hands our one reference to the graph.
            let moved = check("cuGraphRetainUserObject", unsafe {
                sys::cuGraphRetainUserObject(self.graph, object, 1, flags)
            });
            if moved.is_err() {
                // SAFETY: our reference is still ours: its release drops `raw`.
                let _ = unsafe { sys::cuUserObjectRelease(object, 1) };
            }
            moved.map(|()| raw)
        })
    }
}

/// A box handed to the driver as a raw pointer, dropped on drop unless the driver took it
/// (the pointer is then null).
struct Unclaimed<T>(*mut T);

impl<T> Drop for Unclaimed<T> {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: a Box::into_raw the driver did not take: still ours, dropped once.
            drop(unsafe { Box::from_raw(self.0) });
        }
    }
}

/// An executable CUDA graph captured from one stream's work (what an application does with
/// `torch.cuda.graph`; nccl-rs-perf's `-G`): the graph and its executable copy, destroyed on
/// drop.
pub struct GraphExec {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
}

// SAFETY: graph handles are driver objects usable from any thread; the driver synchronises.
unsafe impl Send for GraphExec {}

impl Stream {
    /// Starts capturing this stream's work into a graph (global mode, `torch.cuda.graph`'s).
    pub fn begin_capture(&self) -> Result<()> {
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL;
        // SAFETY: `raw` is a live stream.
        driver("cuStreamBeginCapture_v2", || check("cuStreamBeginCapture_v2", unsafe {
            sys::cuStreamBeginCapture_v2(self.raw(), mode)
        }))
    }

    /// Ends the capture begun by [`Stream::begin_capture`]: the graph, instantiated.
    pub fn end_capture(&self) -> Result<GraphExec> {
        driver("cuStreamEndCapture", || {
            let mut graph: CUgraph = std::ptr::null_mut();
            // SAFETY: `graph` is a valid out-pointer; `raw` is a live stream.
            check("cuStreamEndCapture", unsafe { sys::cuStreamEndCapture(self.raw(), &mut graph) })?;
            let mut exec: sys::CUgraphExec = std::ptr::null_mut();
            // SAFETY: `graph` is the graph just captured; `exec` a valid out-pointer.
            let made = check("cuGraphInstantiateWithFlags", unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) });
            if let Err(e) = made {
                // SAFETY: the graph is ours and nothing else holds it.
                unsafe { sys::cuGraphDestroy(graph) };
                return Err(e);
            }
            Ok(GraphExec { graph, exec })
        })
    }
}

impl GraphExec {
    /// Runs the graph's work on `stream`, after what the stream holds.
    pub fn launch(&self, stream: &Stream) -> Result<()> {
        // SAFETY: `exec` is live (owned); `raw` is a live stream.
        driver("cuGraphLaunch", || check("cuGraphLaunch", unsafe { sys::cuGraphLaunch(self.exec, stream.raw()) }))
    }
}

impl Drop for GraphExec {
    fn drop(&mut self) {
        // SAFETY: both are ours; the driver keeps what a pending launch needs until it is done.
        let _ = driver("cuGraphExecDestroy", || {
            unsafe {
                sys::cuGraphExecDestroy(self.exec);
                sys::cuGraphDestroy(self.graph);
            }
            Ok(())
        });
    }
}
