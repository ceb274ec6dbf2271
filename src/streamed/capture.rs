//! CUDA graph capture (`NCCL_RS_GRAPH_CAPTURE=1`, experimental): a group's operations issued
//! on a stream that is capturing are recorded into its graph, and every launch of the graph
//! runs them, in stream order, with the buffers they were captured with.
//!
//! What the capture records on the stream, per call (after a write of the completion word's
//! idle value, which fails first where the driver cannot capture stream memory operations):
//! 1. copies of the inputs (and a PreMulSum scalar) in device or managed memory into pinned
//!    host memory of the call's own (a block, reused once its graph is gone); buffers in
//!    pinned host memory are used where they are (a copy between two host buffers is not
//!    asynchronous, and need not be captured);
//! 2. a host function, which hands the operations to the communicator's stream worker (it
//!    makes no driver call and returns at once);
//! 3. a wait until the block's first word is 1, then a write of 0 into it, ready for the next
//!    launch;
//! 4. copies of the results out of the block (into device or managed memory).
//!
//! The worker runs the operations with the host transports on the block (host work only, no
//! device work a waiting stream could hold up) and writes the word — also when they fail, the
//! failure becoming the communicator's asynchronous error, so a launch never waits forever.
//!
//! Ranks must run the same operations in the same order. A launch reaches the worker when its
//! stream gets to it, so while a graph holds any of a communicator's calls the worker also
//! takes the operations called outside graphs in stream order: it waits for a batch's streams
//! to reach it before exchanging anything for it, and runs a graph's operations that reach it
//! first (a batch called after a graph launch on the same stream comes after the launch's
//! work). Once the graphs are gone, it takes batches as before.
//! Each launch numbers its operations by the capture's number and the launch's, alike on every
//! rank that launches its graphs alike, and a rank that does otherwise is told which call
//! differs. Two executable copies of one graph must not run at once (their blocks are one).
//!
//! The graph owns what its work refers to (`Capture::host_call`, through a user object), dropped
//! on a driver thread that must not call the driver: the block goes back to a list of spares, the
//! rest is plain memory. A launch after its communicator was destroyed releases its stream at
//! once, with a warning, and produces nothing.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use super::pool::{aligned, on_device, stage_buffers, staged_bytes, POOL_ALIGN};
use super::{Buffer, Queue, StreamOp, Streamed};
use crate::comm::Comm;
use crate::device::cuda::{Capture, MappedHost, MemOp, Stream, WaitCond};
use crate::device::host::Region;
use crate::error::{Error, Result};
use crate::plan::Op;

/// Bytes before the first staged buffer of a block: its completion word, on a line of its own.
const HEAD: usize = 256;

/// Blocks of graphs that are gone, for later captures. Never freed: they come back on the
/// driver's thread, where freeing is not allowed.
static SPARES: crate::abi::fork::PerForkMutex<Vec<MappedHost>> = crate::abi::fork::PerFork::new(crate::abi::fork::anew);

/// Pinned host memory a captured call stages through; back to [`SPARES`] on drop.
struct Block(Option<MappedHost>);

impl Block {
    /// The smallest spare of at least `len` bytes, else a new one.
    fn take(len: usize) -> Result<Block> {
        let mut spares = SPARES.lock().unwrap_or_else(|p| p.into_inner());
        let best = spares.iter().enumerate().filter(|(_, m)| m.len() >= len).min_by_key(|(_, m)| m.len()).map(|(i, _)| i);
        if let Some(i) = best {
            let mem = spares.swap_remove(i);
            mem.word(0).store(0, Ordering::Release);
            return Ok(Block(Some(mem)));
        }
        drop(spares);
        Ok(Block(Some(MappedHost::new(len)?)))
    }

    fn mem(&self) -> Result<&MappedHost> {
        self.0.as_ref().ok_or_else(|| Error::internal("a captured call's staging block is gone"))
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        if let Some(mem) = self.0.take() {
            SPARES.lock().unwrap_or_else(|p| p.into_inner()).push(mem);
        }
    }
}

/// The operations of one captured call, as every launch of its graph runs them.
pub(super) struct Captured {
    queue: Arc<Queue>,
    rank: usize,
    /// On the block's regions; their sequence numbers are the ones they were captured with.
    ops: Vec<Op>,
    /// Per operation: where its PreMulSum scalar in device memory is staged.
    scalars: Vec<Option<Region>>,
    /// Launches that reached the host node so far (each numbers its operations).
    launches: AtomicU32,
    block: Block,
}

impl Drop for Captured {
    fn drop(&mut self) {
        self.queue.graphs.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Captured {
    fn word(&self) -> Option<&AtomicU32> {
        self.block.0.as_ref().map(|m| m.word(0))
    }

    /// Lets the stream of a launch go on (its work ran, failed, or never will).
    fn release(&self) {
        if let Some(w) = self.word() {
            w.store(1, Ordering::Release);
        }
    }

    fn describe(&self) -> String {
        let first = self.ops.first().map_or_else(String::new, Op::describe);
        match self.ops.len() {
            0 | 1 => first,
            n => format!("{first} and {} more of its group", n - 1),
        }
    }
}

/// One launch of a captured call that has reached the worker: launch number `launch`.
pub(super) struct Replay {
    call: Arc<Captured>,
    launch: u32,
}

/// Records the operations `ops` of one group on `comm` into the graph `stream` captures (see
/// the module's notes). The caller checked that the stream is capturing.
pub(super) fn record(comm: &Arc<Comm>, s: &Streamed, ops: &[StreamOp], stream: &Stream) -> Result<()> {
    // (None: the legacy stream, which counts as capturing while another stream does.)
    let Some(capture) = stream.capture()? else {
        return Err(Error::invalid_usage(
            "the legacy default stream cannot take a collective while another stream captures a CUDA graph"));
    };
    if !crate::params::graph_capture() {
        return Err(Error::invalid_usage(
            "the stream is capturing a CUDA graph: nccl-rs records collectives into graphs only with \
             NCCL_RS_GRAPH_CAPTURE=1 (experimental); issue them outside the capture"));
    }
    // Host-wait mode is no obstacle: a launch waits on the device for host work only.
    if !s.ctx.can_wait_on_memory()? {
        return Err(Error::invalid_usage(
            "a collective captured into a CUDA graph needs stream memory operations, which this driver does not \
             offer"));
    }
    if ops.iter().any(|o| o.placement.pageable) {
        return Err(Error::invalid_usage(
            "a collective captured into a CUDA graph needs device, pinned or managed buffers: a graph cannot copy \
             pageable host memory"));
    }
    // The block: the word, then per operation its input, its output (once, in place) and its
    // scalar, where they are in device or managed memory: the worker uses those in host memory
    // where they are (a graph's copy between two host buffers is one CUDA need not capture).
    let scalar_in_block = |o: &StreamOp| o.op.scalar_at.is_some() && !o.placement.on_host(Buffer::Scalar);
    let scalar_bytes = |o: &StreamOp| if scalar_in_block(o) { POOL_ALIGN } else { 0 };
    let total = ops.iter().try_fold(HEAD, |sum: usize, o| {
        sum.checked_add(staged_bytes(&on_device(o))?)?.checked_add(scalar_bytes(o))
    });
    let total = total.ok_or_else(|| Error::invalid_arg("a captured call's buffers are too large"))?;
    let block = Block::take(total)?;
    let whole = block.mem()?.region();
    let mut at = HEAD;
    let mut take = |n: usize| {
        let r = if n == 0 { Region::EMPTY } else { whole.sub(at, n) };
        at += aligned(n);
        r
    };
    let mut staged = Vec::with_capacity(ops.len());
    let mut scalars = Vec::with_capacity(ops.len());
    for o in ops {
        let (send, recv) = stage_buffers(o, &mut take);
        let size = o.op.dt.size();
        scalars.push(o.op.scalar_at.map(|at| if scalar_in_block(o) { take(size) } else { Region::user(at, 0, size) }));
        staged.push(Op { send, recv, scalar_at: None, ..o.op });
    }
    s.queue.graphs.fetch_add(1, Ordering::AcqRel);
    let call = Arc::new(Captured { queue: s.queue.clone(), rank: comm.rank, ops: staged, scalars,
                                   launches: AtomicU32::new(0), block });
    queue_work(stream, &capture, ops, &call).map_err(|e| e.context("recording the call into a CUDA graph"))?;
    if !s.captured.swap(true, Ordering::AcqRel) {
        crate::info!(P2P, "rank {}: operations captured into CUDA graphs are staged through pinned memory of their \
                           own ({} bytes for the first call); while such graphs exist, the worker runs this \
                           communicator's operations in stream order", comm.rank, total);
    }
    Ok(())
}

/// The graph's work for `call`, on the capturing stream.
fn queue_work(stream: &Stream, capture: &Capture, ops: &[StreamOp], call: &Arc<Captured>) -> Result<()> {
    let mem = call.block.mem()?;
    let refused = || Error::invalid_usage("the driver refused a stream memory operation in a CUDA graph capture");
    // First the word's idle value: a driver that refuses stream memory operations in a capture
    // refuses this one, before the graph holds anything that touches the user's buffers or
    // hands a launch to the worker. (A later failure leaves a graph whose launches change no
    // user buffer of this rank: the results are copied out last.)
    if stream.write_value32(mem, 0, 0)? == MemOp::Unsupported {
        return Err(refused());
    }
    // (Only what is in the block: the rest is the user's own memory.)
    let copy = |dst: Region, src: Region| if dst.addr() == src.addr() { Ok(()) } else { stream.copy(dst, src) };
    for ((o, staged), scalar) in ops.iter().zip(&call.ops).zip(&call.scalars) {
        if let (Some(at), Some(to)) = (o.op.scalar_at, scalar) {
            copy(*to, Region::user(at, 0, to.len()))?;
        }
        copy(staged.send, o.op.send)?;
    }
    capture.host_call(stream, call.clone(), hand_over)?;
    let gated = stream.wait_value32(mem, 0, 1, WaitCond::Eq)?;
    let reset = match gated {
        MemOp::Enqueued => stream.write_value32(mem, 0, 0)?,
        MemOp::Unsupported => MemOp::Unsupported,
    };
    if reset == MemOp::Unsupported {
        return Err(refused());
    }
    for (o, staged) in ops.iter().zip(&call.ops) {
        copy(o.op.recv, staged.recv)?;
    }
    Ok(())
}

/// The host node of a captured call: a launch of its graph has reached it. Queues the launch
/// for the communicator's worker, or, if the worker has stopped, releases its stream at once.
fn hand_over(call: Arc<Captured>) {
    let launch = call.launches.fetch_add(1, Ordering::Relaxed);
    let queue = call.queue.clone();
    let mut st = queue.state();
    if !st.closing {
        st.replays.push_back(Replay { call, launch });
        drop(st);
        queue.changed.notify_all();
        return;
    }
    drop(st);
    abandon(&call);
}

/// A launch nobody will run: its stream goes on without results.
fn abandon(call: &Captured) {
    crate::warn!("rank {}: a CUDA graph launched {} after its communicator was destroyed: its stream goes on \
                  without the results", call.rank, call.describe());
    call.release();
}

/// Launches that reached a worker that is stopping (see [`abandon`]).
pub(super) fn abandon_all(replays: impl IntoIterator<Item = Replay>) {
    replays.into_iter().for_each(|r| abandon(&r.call));
}

/// Runs one launch's operations on the block with the host transports, then releases its
/// stream; a failure becomes the communicator's asynchronous error.
pub(super) fn run(comm: &Arc<Comm>, r: Replay) {
    let ran = catch_unwind(AssertUnwindSafe(|| {
        let mut ops = Vec::with_capacity(r.call.ops.len());
        for (op, scalar) in r.call.ops.iter().zip(&r.call.scalars) {
            let mut op = Op { seq: crate::plan::ops::replay_seq(op.seq, r.launch), ..*op };
            if let Some(at) = scalar {
                let mut bytes = [0u8; 8];
                let n = op.dt.size().min(bytes.len());
                crate::device::host::copy(Region::owned(&mut bytes[..n]), at.sub(0, n));
                let value = crate::device::host::reduce::scalar_from_bytes(op.dt, &bytes[..n])
                    .ok_or_else(|| Error::internal("PreMulSum scalar conversion"))?;
                op.op = crate::types::RedOp::PreMulSum(value);
            }
            ops.push(op);
        }
        comm.ready()?;
        crate::group::execute_now(comm, &ops)
    }))
    .unwrap_or_else(|_| Err(Error::internal("a CUDA graph's operation panicked in the stream worker")));
    if let Err(e) = ran {
        crate::warn!("rank {}: {} in a CUDA graph failed: {}", comm.rank, r.call.describe(), e.msg);
        comm.publish_failure(&e);
    }
    r.call.release();
}

/// Whether the worker takes this communicator's batches in stream order: while a graph holds
/// any of its calls, a batch may come after a launch.
pub(super) fn captured_any(s: &Streamed) -> bool {
    s.queue.graphs.load(Ordering::Acquire) > 0
}
