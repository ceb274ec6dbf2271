//! CUDA mode: collectives on device memory, ordered with the caller's streams.
//!
//! The calling thread does not run an operation whose buffers include device memory. It
//! marks the point on the caller's stream (everything the stream did before the call), makes
//! that stream wait (the gate: `cuStreamWaitValue32`, or a one-thread polling kernel with
//! `NCCL_RS_STREAM_GATE=kernel`) until a completion counter in mapped host memory reaches the
//! operation's number, hands the operation to the communicator's stream worker and returns:
//! NCCL's semantics, where the host call only enqueues. In host-wait mode
//! (`params::few_device_connections`) there is no gate: the call returns once done.
//!
//! The worker, a thread per communicator with its device's context current, waits for the
//! event, copies the buffers into host staging memory on a stream of its own, runs the same
//! plan and progress engine as host mode on the staged copies, copies the results back and
//! bumps the counter, which releases the caller's stream. A failure becomes the
//! communicator's asynchronous error (`ncclCommGetAsyncError`) and still bumps the counter:
//! a stream never waits forever for an operation that failed.
//!
//! Staging through host memory works for every pair of ranks (same GPU, peer GPUs, other
//! hosts); it is the correct baseline that peer copies between GPUs shortcut
//! (`transport::ipc`).
//!
//! Staged operations whose buffers the device copies asynchronously (device, pinned or managed
//! memory) and that fit the communicator's pinned pool are staged by the caller's own stream,
//! at call time: input copied into the pool before the event the worker waits for, the result
//! copied out after the wait. The worker then runs only host work for them, so the caller's
//! stream never waits for device work the worker issues later — which, on a GPU whose streams
//! share hardware queues, could sit behind that very wait (README, CUDA mode's limits). Other
//! operations are staged by the worker on its own stream.
//!
//! Where the device has stream memory operations, a caller's stream tells the worker that it
//! has reached a batch by raising a flag in the communicator's board (mapped host memory the
//! worker reads without the driver), not with an event the worker would query. Together with
//! the two paragraphs around this one, the worker needs no device call for an operation that
//! goes direct or that the callers' streams stage (tested: cuda_mode_worker_makes_no_device_calls).
//!
//! Direct operations (`transport::ipc`) queue their device work on the caller's stream too:
//! kernels whose arguments the worker fills in once it knows where the peers' buffers are,
//! between gates it opens (`board`). Only what cannot go that way (no slot free, too many
//! kernels, `NCCL_RS_DIRECT_ON_STREAM=0`, host-wait mode) runs on the worker's stream.
//!
//! A call on a stream that is capturing a CUDA graph is recorded into the graph instead (with
//! `NCCL_RS_GRAPH_CAPTURE=1`; refused otherwise), and every launch hands its operations to the
//! worker in stream order (`capture`).
//!
//! While a caller's stream waits on a completion word, only the worker can release it, so the
//! worker must not make driver calls that may wait for the whole context to go idle: freeing
//! or pinning memory, loading kernels (cuMemFree, cuMemFreeHost and lazy module loading are
//! documented or reported to synchronise). Everything such is done before a communicator's
//! first wait is queued — its stream, the kernels, the completion word (from a slab allocated
//! once per device), the pinned pool — and the worker stages through ordinary host memory,
//! which it grows without the driver. Peers' mappings (CUDA IPC, the virtual memory API) are
//! cached (`transport::ipc`), and closed on a thread of their own (`cuda::OffThread`), never by
//! the worker. Pinned memory is never freed: a destroyed communicator's pool goes to the next
//! one.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;

use crate::comm::Comm;
use crate::device::cuda::{self, Context, Event, KeepCurrent, Kernels, MappedHost, MemOp, Stream, UserStream, WaitCond};
use crate::device::host::{Region, RegionSet};
use crate::error::{Error, Result};
use crate::plan::{Op, OpKind};
use crate::transport::ipc::{self, Routes};
use crate::types::{RedOp, Scalar};

mod alone;
pub(crate) mod board;
mod capture;
mod pool;
mod scratch;
mod steps;
mod worker;
pub(crate) use worker::wait_for_stream;
use board::{Board, Ticket};
use pool::{plan_caller_staging, Pool};
use scratch::Scratch;
use steps::on_stream_shape;

/// Events kept for reuse per communicator.
const EVENTS_KEPT: usize = 8;

/// Completion words per slab of mapped host memory, one cache line (16 words) apart.
const WORDS_PER_SLAB: usize = 1024;
const WORD_STRIDE: usize = 16;

/// A completion word of its own for a new communicator on device `ordinal` (its slab holds the
/// index). Words come from slabs allocated when a slab runs out (the first communicator, then
/// every 1024th), are never freed and never reused: a stream may still wait on a word after
/// its communicator was aborted.
fn completion_word(ordinal: i32) -> Result<(&'static MappedHost, usize)> {
    static SLABS: crate::abi::fork::PerForkMutex<Vec<(i32, &'static MappedHost, usize)>> =
        crate::abi::fork::PerFork::new(crate::abi::fork::anew);
    let mut slabs = SLABS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, mem, next)) = slabs.iter_mut().find(|(o, _, next)| *o == ordinal && *next < WORDS_PER_SLAB) {
        *next += 1;
        return Ok((*mem, (*next - 1) * WORD_STRIDE));
    }
    let mem: &'static MappedHost = Box::leak(Box::new(MappedHost::new(WORDS_PER_SLAB * WORD_STRIDE * 4)?));
    slabs.push((ordinal, mem, 1));
    Ok((mem, 0))
}

/// One operation for the worker: what to run, the stream it is ordered with, and where its
/// buffers are.
#[derive(Clone, Copy, Debug)]
pub struct StreamOp {
    pub op: Op,
    pub stream: UserStream,
    pub placement: Placement,
}

/// Where a call's buffers (and its PreMulSum scalar) live, as CUDA mode needs to know:
/// classified once, at the call.
#[derive(Clone, Copy, Debug, Default)]
pub struct Placement {
    /// Some of them is device, pinned or managed memory: the call runs in stream order.
    pub device: bool,
    /// Some of them is plain host memory, which no stream (nor a CUDA graph) copies
    /// asynchronously.
    pub pageable: bool,
    /// Bit `i`: the `i`th region classified ([`Buffer`]'s order for a call) is host memory,
    /// pinned or pageable.
    pub host: u8,
}

/// A call's regions, in the order `api::coll::placement` classifies them.
#[derive(Clone, Copy, Debug)]
pub enum Buffer {
    Send = 0,
    Recv = 1,
    Scalar = 2,
}

impl Placement {
    /// Whether `b` is in host memory. The worker reads and writes such a buffer itself, once
    /// the caller's stream has reached the call; the caller's stream stages only the others
    /// (device or managed memory) through the pinned pool, since its copy between two host
    /// buffers would hold up the calling thread until the stream got there (CUDA: "fully
    /// synchronous" between host buffers), which may wait for this very call's peers.
    pub fn on_host(self, b: Buffer) -> bool {
        self.host & (1 << b as u8) != 0
    }
}

/// The stream worker of one communicator.
pub struct Streamed {
    ctx: &'static Context,
    /// Word `word` of `done`: the number of the last batch the worker finished (it counts 1, 2,
    /// ...). See [`completion_word`].
    done: &'static MappedHost,
    word: usize,
    /// Loaded when the worker started; None (with a warning) if the driver refused them, and
    /// then every operation is staged.
    kernels: Option<&'static Kernels>,
    /// How callers' streams are ordered, decided from the parameters when the worker starts:
    /// host-wait mode (`params::few_device_connections`), else a gate — the polling kernel if
    /// asked for and loaded, else a stream wait on memory.
    host_wait: bool,
    gate_kernel: Option<&'static Kernels>,
    /// Which operations go direct (decided once, alike on every rank).
    routes: Routes,
    /// The batches queued for the worker, and the graph launches that reached it.
    queue: Arc<Queue>,
    /// True through a whole submit, both halves (driver calls included, which may block while
    /// the device's launch queue is full), and while closing; never set by the worker, which
    /// needs `state` to drain that queue. A flag, not a guard: the halves are separate calls.
    submit_busy: Mutex<bool>,
    submit_done: Condvar,
    worker: Mutex<Option<JoinHandle<()>>>,
    /// Events of finished batches, recorded again by later calls (no create/destroy per call).
    events: Mutex<Vec<Event>>,
    /// Pinned staging callers' streams copy through (None: caller staging is off, or pinning
    /// failed at start). Used under `submit_busy`.
    pool: Mutex<Option<Pool>>,
    /// Device memory the inputs peers cannot read directly are copied into at call time
    /// (`scratch`). Used under `submit_busy` and by the worker (giving carves back).
    scratch: Mutex<Scratch>,
    /// Whether callers' streams have staged anything yet (the first time is logged).
    caller_staged: std::sync::atomic::AtomicBool,
    /// Where callers' streams signal that they reached a batch, and where direct operations
    /// queued on them get their kernels' arguments (see `board`). None in host-wait mode or
    /// without stream memory operations: events, and direct operations on the worker's stream.
    board: Option<Board>,
    /// Direct operations queue their kernels on the callers' streams (a board, kernels, every
    /// rank on this host, NCCL_RS_DIRECT_ON_STREAM).
    direct_on_stream: bool,
    /// Direct receives queue their copy on the callers' streams (a board, kernels,
    /// NCCL_RS_DIRECT_ON_STREAM), whether or not every rank is on this host.
    p2p_on_stream: bool,
    /// The worker's `Direct::off`, for calls: no collective goes direct any more.
    direct_off: std::sync::atomic::AtomicBool,
    /// Whether the board ever had no free slot (logged the first time).
    slots_ran_out: std::sync::atomic::AtomicBool,
    /// Whether any operation was captured into a CUDA graph yet (logged the first time).
    captured: std::sync::atomic::AtomicBool,
    /// Bytes of peers' device memory the worker keeps mapped (the direct path's), as of its
    /// last batch: what ncclCommSuspend releases.
    peer_bytes: std::sync::atomic::AtomicU64,
}

impl Drop for Streamed {
    fn drop(&mut self) {
        // Streams may still have steps of its operations ahead of them (see `board`).
        if let Some(b) = self.board.take() {
            b.retire();
        }
        let mut scratch = std::mem::take(&mut *self.scratch.lock().unwrap_or_else(|p| p.into_inner()));
        // Freed in the communicator's context, whichever thread drops the last reference.
        let _keep = KeepCurrent::new();
        let _ = self.ctx.make_current();
        if !scratch.settled() {
            // A batch that did not finish well still holds a carve (aborted, failed), or a
            // stream has not yet copied a result out of one: a caller's stream may still use it
            // (and the free might wait for that stream), so the memory stays, as the pinned
            // pool does.
            std::mem::forget(scratch);
            return;
        }
        drop(scratch);
    }
}

/// Gives the carve `id` of `s`'s pool back after `events`.
fn release_carve(s: &Streamed, id: u64, events: Vec<Event>) {
    if let Some(p) = s.pool.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
        p.release(id, events);
    }
}

/// The worker's part of the callers' pinned pool: where the bytes a receive is sent go for the
/// copy kernel its caller's stream queued (no device call of the worker's own).
impl ipc::Bounce for Streamed {
    fn take(&self, len: usize) -> Option<(Region, usize, u64)> {
        self.pool.lock().unwrap_or_else(|p| p.into_inner()).as_mut()?.carve_for_worker(len)
    }
    fn give_back(&self, id: u64) {
        release_carve(self, id, Vec::new());
    }
}

/// What the worker takes work from: shared with the operations captured into CUDA graphs,
/// which may outlive the communicator (`capture`), so it holds nothing of the driver's once
/// the worker has stopped.
#[derive(Default)]
struct Queue {
    state: Mutex<State>,
    /// Signalled when a batch is queued, when one finishes, when a graph launch reaches the
    /// worker, and on close.
    changed: Condvar,
    /// Calls captured into CUDA graphs that still exist (a launch may still hand them over):
    /// while there are any, the worker takes batches in stream order (`capture`).
    graphs: std::sync::atomic::AtomicUsize,
}

impl Queue {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[derive(Default)]
struct State {
    queue: VecDeque<Batch>,
    /// Operations of CUDA graphs whose launches have reached them on their streams.
    replays: VecDeque<capture::Replay>,
    issued: u32,
    finished: u32,
    closing: bool,
    /// ncclCommSuspend asks the worker to release its memory once the batches queued before
    /// are done; the worker clears it when it has.
    release: bool,
}

/// The operations one group issued on this communicator, run together (their sends and
/// receives may pair up with each other).
#[derive(Default)]
struct Batch {
    seq: u32,
    starts: Vec<Start>,
    ops: Vec<Op>,
    /// Per operation: staged by the caller's stream (its regions are the pool's), with its
    /// device PreMulSum scalar, if any, copied into this pool region.
    prestaged: Vec<(bool, Option<Region>)>,
    /// Per operation: direct, its kernels queued on the caller's stream (see `board`).
    direct: Vec<Option<OnStream>>,
    /// Per operation: its path as its call saw it.
    paths: Vec<Path>,
    /// The carves of `scratch` its inputs were copied into (`copy_unreadable_inputs`), given
    /// back once it is done.
    scratch: Vec<u64>,
    /// Per operation (none past the last): the user's input of one whose input goes direct as
    /// a scaled copy (and its PreMulSum scalar, if in device memory), which it is staged from
    /// instead if the ranks do not go direct.
    unscaled: Vec<Option<Unscaled>>,
}

/// How an operation goes, as far as this rank can tell at call time (alike on every rank but
/// for `Declined`, which the agreement tells the others).
#[derive(Clone, Debug)]
// Boxing the offer would allocate on every direct call; the paths of a call are few.
#[allow(clippy::large_enum_variant)]
enum Path {
    /// Through host memory: small, other hosts, or no collective goes direct any more
    /// (`Direct::off`).
    Staged,
    /// A collective that could go direct but this rank cannot take (`ipc::offer`: its buffers
    /// have no CUDA IPC, an in-place all-to-all not copied by `copy_unreadable_inputs`, no
    /// kernels): it takes part in the agreement, then every rank stages it. A send whose
    /// buffer cannot be published, or that a receive of its batch writes into, and that
    /// `copy_unreadable_inputs` did not copy: its bytes are staged to the receiver
    /// (`ipc::run_p2p`).
    Declined,
    /// Direct: a collective or send with its buffers published at call time, or a receive on
    /// the direct path (which learns at run time whether it can read the sender's buffer).
    Direct(Option<ipc::Offered>),
}

impl Path {
    fn goes_direct(&self) -> bool {
        matches!(self, Path::Direct(_))
    }
}

/// How the worker learns that a caller's stream has reached a batch (everything it did before
/// the call is done, the inputs staged into the pool included): the stream raises the flag of
/// a board slot (host memory the worker reads without the driver), or, without a board or a
/// free slot, an event the worker queries through the driver.
enum Start {
    Word(Ticket),
    Event(Event),
}

/// A direct operation whose kernels the caller's stream queued: its slot of the board and
/// its kernels per phase (`ipc::shape`).
#[derive(Clone, Debug)]
struct OnStream {
    ticket: Ticket,
    shape: ipc::Shape,
}

impl Streamed {
    /// Everything the worker will use is made here, before any stream waits for it.
    fn start(comm: &Arc<Comm>) -> Result<Arc<Streamed>> {
        let ctx = Context::primary(comm.cuda_dev)?;
        let (done, word) = completion_word(comm.cuda_dev)?;
        done.word(word).store(0, Ordering::Release);
        let stream = Stream::new(ctx)?;
        let kernels = match ctx.kernels() {
            Ok(k) => Some(k),
            Err(e) => {
                crate::warn!("rank {}: the reduction kernels did not load ({}); every operation on device memory is \
                              staged through host memory", comm.rank, e.msg);
                None
            }
        };
        let pool = match crate::params::caller_staging().then(Pool::new) {
            None => None,
            Some(Ok(p)) => Some(p),
            Some(Err(e)) => {
                crate::info!(INIT, "rank {}: no pinned staging pool ({}); the worker stages every operation",
                             comm.rank, e.msg);
                None
            }
        };
        let host_wait = crate::params::few_device_connections();
        let gate_kernel = kernels.filter(|_| crate::params::stream_gate_kernel());
        let routes = Routes::of(comm);
        // Peer access to the devices of this process's other ranks, asked for now (by the
        // caller's thread, before any stream waits for this worker), so the direct path finds
        // the answer kept and the worker makes no driver call for it.
        if let Some(ready) = comm.ready_if_any() {
            let me = &ready.peers[comm.rank];
            for p in ready.peers.iter().filter(|p| p.same_process(me) && p.cuda_dev != comm.cuda_dev && me.direct_with(p)) {
                crate::device::cuda::peer_access(comm.cuda_dev, p.cuda_dev);
            }
        }
        // The board: callers' streams signal their start there, and direct operations queued on
        // them get their kernels' arguments there.
        let board = match !host_wait && ctx.can_wait_on_memory().unwrap_or(false) {
            false => None,
            true => match Board::new() {
                Ok(b) => Some(b),
                Err(e) => {
                    crate::info!(INIT, "rank {}: no board ({}): the worker queries events, and direct operations run \
                                        on its stream", comm.rank, e.msg);
                    None
                }
            },
        };
        let p2p_on_stream = board.is_some() && kernels.is_some() && crate::params::direct_on_stream();
        let direct_on_stream = p2p_on_stream && routes.collectives();
        let s = Arc::new(Streamed { ctx, done, word, kernels, host_wait, gate_kernel, routes,
                                    queue: Arc::new(Queue::default()),
                                    submit_busy: Mutex::new(false), submit_done: Condvar::new(),
                                    worker: Mutex::new(None), events: Mutex::new(Vec::new()), pool: Mutex::new(pool),
                                    scratch: Mutex::new(Scratch::default()),
                                    caller_staged: std::sync::atomic::AtomicBool::new(false), board, direct_on_stream, p2p_on_stream,
                                    direct_off: std::sync::atomic::AtomicBool::new(false),
                                    slots_ran_out: std::sync::atomic::AtomicBool::new(false),
                                    captured: std::sync::atomic::AtomicBool::new(false),
                                    peer_bytes: std::sync::atomic::AtomicU64::new(0) });
        let (c, w) = (comm.clone(), s.clone());
        let handle = std::thread::Builder::new()
            .name(format!("nccl-rs-stream-{}", comm.rank))
            .spawn(move || {
                crate::debug::set_rank(c.rank as i32);
                crate::abi::naps::fine_for_this_thread();
                worker::run(c, w, stream)
            })
            .map_err(|e| Error::os("spawn the stream worker", e))?;
        *s.worker.lock().unwrap_or_else(|p| p.into_inner()) = Some(handle);
        crate::info!(INIT, "rank {}: CUDA mode on device {}, stream worker started", comm.rank, comm.cuda_dev);
        if host_wait {
            crate::info!(INIT, "rank {}: calls on device memory wait on the host until done (NCCL_RS_HOST_WAIT=1, or \
                                CUDA_DEVICE_MAX_CONNECTIONS below 8 and NCCL_RS_HOST_WAIT unset){}", comm.rank,
                         if comm.config.blocking { "" } else { "; nonblocking: ncclInProgress until then" });
        } else if gate_kernel.is_some() {
            crate::info!(INIT, "rank {}: callers' streams wait for operations with a polling kernel", comm.rank);
        }
        Ok(s)
    }

    /// An event for a call to record (a pooled one, or a new one).
    fn event(&self) -> Result<Event> {
        let pooled = self.events.lock().unwrap_or_else(|p| p.into_inner()).pop();
        match pooled {
            Some(e) => Ok(e),
            None => Event::new(self.ctx),
        }
    }

    /// Events whose records have completed, back to the pool (a few are enough).
    fn recycle(&self, events: Vec<Event>) {
        let mut pool = self.events.lock().unwrap_or_else(|p| p.into_inner());
        for e in events {
            if pool.len() < EVENTS_KEPT {
                pool.push(e);
            }
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.queue.state()
    }

    fn lock_submits(&self) {
        let mut busy = self.submit_busy.lock().unwrap_or_else(|p| p.into_inner());
        while *busy {
            busy = self.submit_done.wait(busy).unwrap_or_else(|p| p.into_inner());
        }
        *busy = true;
    }

    fn unlock_submits(&self) {
        *self.submit_busy.lock().unwrap_or_else(|p| p.into_inner()) = false;
        self.submit_done.notify_all();
    }

    /// Bytes of pinned memory this communicator holds: its staging pool and its board
    /// (ncclCommMemStats).
    pub fn pool_bytes(&self) -> u64 {
        let pool = self.pool.lock().unwrap_or_else(|p| p.into_inner()).as_ref().map_or(0, |p| p.capacity() as u64);
        pool + self.board.as_ref().map_or(0, |b| b.mem().len() as u64)
    }

    /// Bytes of peers' device memory the worker keeps mapped (ncclCommMemStats).
    pub fn peer_bytes(&self) -> u64 {
        self.peer_bytes.load(Ordering::Relaxed)
    }

    /// Bytes of device memory the communicator allocated for copies of buffers peers cannot
    /// read (`scratch`; ncclCommMemStats).
    pub fn scratch_bytes(&self) -> u64 {
        self.scratch.lock().unwrap_or_else(|p| p.into_inner()).bytes() as u64
    }

    /// ncclCommSuspend with NCCL_SUSPEND_MEM: once the batches issued so far are done, the
    /// worker closes its peer mappings (the peers' allocations they keep alive are freed if
    /// their owners freed them) and frees its host staging, and this thread frees the device
    /// scratch (allocated again at its next use). NCCL asks that nothing be in flight: this
    /// waits for what is (saying so after a second), but not past an abort.
    pub fn release_memory(&self, comm: &Comm) -> Result<()> {
        let since = std::time::Instant::now();
        let mut warned = false;
        let mut st = self.state();
        st.release = true;
        self.queue.changed.notify_all();
        while st.release && !st.closing {
            if comm.abort.load(Ordering::Acquire) {
                st.release = false;
                return Err(Error::invalid_usage("communicator aborted while ncclCommSuspend waited for its operations"));
            }
            if !warned && since.elapsed() >= std::time::Duration::from_secs(1) {
                warned = true;
                crate::warn!("rank {}: ncclCommSuspend waits for {} operation(s) still queued on its CUDA streams \
                              (synchronize them before suspending)", comm.rank, st.issued.wrapping_sub(st.finished));
            }
            st = self.queue.changed.wait_timeout(st, std::time::Duration::from_millis(50))
                .unwrap_or_else(|p| p.into_inner()).0;
        }
        if st.closing && st.release {
            return Err(Error::invalid_usage("communicator closed while ncclCommSuspend waited for its operations"));
        }
        drop(st);
        // The worker handed its peer mappings to the closing thread: they are closed when this
        // returns (the peers' freed allocations are then released).
        if !cuda::settle_closing(CLOSING_LIMIT) {
            crate::warn!("rank {}: ncclCommSuspend: peer mappings still closing after {} s (the driver waits for the \
                          device to go idle)", comm.rank, CLOSING_LIMIT.as_secs());
        }
        // Under the submit lock (a call on another thread would take a carve), in its context.
        self.lock_submits();
        let freed = {
            let _keep = KeepCurrent::new();
            self.ctx.make_current().map(|()| {
                let mut scratch = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
                let bytes = scratch.bytes();
                // (Kept if a copy out of it has not run yet, or a failed batch holds a carve.)
                if bytes > 0 && scratch.settled() {
                    *scratch = Scratch::default();
                    crate::info!(INIT, "rank {}: ncclCommSuspend: freed {bytes} bytes of device scratch", comm.rank);
                }
            })
        };
        self.unlock_submits();
        freed
    }

    /// Wait until every batch issued so far has finished.
    pub fn drain(&self) {
        let mut st = self.state();
        while st.finished != st.issued && !st.closing {
            st = self.queue.changed.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Stop the worker after the batches already queued (they fail fast on an aborted
    /// communicator) and wait for it.
    pub fn close(&self) {
        // Not while a submit is between numbering its batch and queueing it.
        self.lock_submits();
        self.state().closing = true;
        self.unlock_submits();
        self.queue.changed.notify_all();
        let handle = self.worker.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(h) = handle {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
                // Its peer mappings close on the closing thread: closed when destroy returns.
                if !cuda::settle_closing(CLOSING_LIMIT) {
                    crate::info!(INIT, "peer mappings still closing after {} s (the driver waits for the device to go \
                                        idle)", CLOSING_LIMIT.as_secs());
                }
            }
        }
    }
}

/// How long ncclCommSuspend and destroy wait for the peer mappings their worker let go to
/// close (`cuda::OffThread`): a driver may make each close wait for the device to go idle.
const CLOSING_LIMIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Before an operation runs on the calling thread (host buffers only): let the operations
/// already issued on the communicator's streams finish, so every rank runs them in issue
/// order.
pub fn drain(comm: &Comm) {
    if let Some(s) = comm.streamed.get() {
        s.drain();
    }
}

/// The communicator's worker, started on first use.
fn streamed(comm: &Arc<Comm>) -> Result<&Arc<Streamed>> {
    static STARTING: crate::abi::fork::PerForkMutex<()> = crate::abi::fork::PerFork::new(crate::abi::fork::anew);
    let cell: &OnceLock<Arc<Streamed>> = &comm.streamed;
    if let Some(s) = cell.get() {
        return Ok(s);
    }
    let _one = STARTING.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(s) = cell.get() {
        return Ok(s);
    }
    let s = Streamed::start(comm)?;
    Ok(cell.get_or_init(|| s))
}

/// Enqueue one group's operations on `comm` (in issue order) behind the work already on their
/// streams; returns once they are queued. Where the streams cannot be made to wait for them
/// (no stream memory operations, or host waits asked for: `params::few_device_connections`),
/// the caller must wait for the returned [`HostWait`] once it has submitted its whole group.
pub fn submit(comm: &Arc<Comm>, ops: Vec<StreamOp>) -> Result<Option<HostWait>> {
    // One scope for the whole call: its steps' scopes nest in it at no cost.
    let _keep = KeepCurrent::new();
    match prepare(comm, ops)? {
        Some(p) => commit_all(vec![(comm.rank, p)]).map(|mut w| w.pop()),
        None => Ok(None),
    }
}

/// The first half of [`submit`]: the operations' inputs staged into the pool and the events
/// the worker waits for, on the callers' streams. A group over several communicators
/// prepares every one before committing any: with streams sharing a hardware queue, one
/// communicator's wait must not sit before another's inputs.
pub fn prepare(comm: &Arc<Comm>, ops: Vec<StreamOp>) -> Result<Option<Prepared>> {
    if ops.is_empty() {
        return Ok(None);
    }
    comm.ready()?;
    if alone::queue(comm, &ops)? {
        return Ok(None);
    }
    // A group over several communicators prepares each on this thread: its lines show each.
    crate::debug::set_rank(comm.rank as i32);
    // The communicator's context is current for the calls below (the legacy stream, NULL, is
    // that context's); the caller's comes back.
    let _keep = KeepCurrent::new();
    let s = streamed(comm)?;
    s.ctx.make_current()?;
    let (streams, callers) = caller_streams(s, &ops);
    let capturing = callers.iter().try_fold(false, |any, st| Ok::<_, Error>(st.is_capturing()? || any))?;
    match (&callers[..], capturing) {
        (_, false) => {}
        ([one], true) => return capture::record(comm, s, &ops, one).map(|()| None),
        _ => return Err(Error::invalid_usage(
            "a group's operations on one communicator are captured into a CUDA graph only if they are all on \
             one stream")),
    }
    // Sends to this rank itself, with their receives, are copies on the caller's stream (not in
    // host-wait mode, whose calls return once done). Only for a group on one stream: one over
    // several runs after the work already on all of them, as NCCL's does, which the usual path
    // waits for. What is left is on that same stream.
    let to_itself = ops.iter().any(|o| o.op.kind.is_p2p() && o.op.root == comm.rank);
    let ops = match &callers[..] {
        [one] if to_itself && !s.host_wait => alone::self_copies(comm, one, ops)?,
        _ => ops,
    };
    if ops.is_empty() {
        return Ok(None);
    }
    let lock = SubmitLock::acquire(s);
    let seq = {
        let state = s.state();
        if state.closing {
            return Err(Error::invalid_usage("communicator is being destroyed"));
        }
        state.issued.wrapping_add(1)
    };
    let on = |o: &StreamOp| streams.iter().position(|u| *u == o.stream).unwrap_or(0);
    // The callers' streams stage what they can (module docs): inputs into the pool now, before
    // the events the worker waits for.
    let mut pool = s.pool.lock().unwrap_or_else(|p| p.into_inner());
    let gated = !s.host_wait && (s.gate_kernel.is_some() || s.ctx.can_wait_on_memory()?);
    let mut paths = paths(s, comm.rank, &ops);
    let mut ops = ops;
    let copied = copy_unreadable_inputs(comm, s, &callers, &on, &mut ops, &mut paths)?;
    let carve = match pool.as_mut() {
        Some(p) if gated => {
            s.recycle(p.reclaim());
            plan_caller_staging(p, &ops, &paths)
        }
        _ => None,
    };
    let CallerStaged { prestaged, outs, carve_id } =
        stage_on_callers(comm, s, pool.as_mut(), carve, &callers, &on, &mut ops)?;
    drop(pool);
    let caller_of: Vec<usize> = ops.iter().map(on).collect();
    let shapes = queued_shapes(comm, s, &ops, &prestaged, &paths);
    let ops = ops.into_iter().map(|o| o.op).collect();
    let mut prepared = Prepared { comm: comm.clone(), lock, callers, ops, prestaged, paths, outs, carve_id,
                                  starts: Vec::new(), seq, committed: false, caller_of, shapes, direct: Vec::new(),
                                  scratch: copied.inputs, copies_out: copied.outs, unscaled: copied.unscaled };
    for st in &prepared.callers {
        let start = start_signal(s, st)?;
        prepared.starts.push(start);
    }
    Ok(Some(prepared))
}

/// The streams of `ops`, each once, in the order of their first operation, and the callers'
/// streams for them.
fn caller_streams(s: &Streamed, ops: &[StreamOp]) -> (Vec<UserStream>, Vec<Stream>) {
    let mut streams: Vec<UserStream> = Vec::new();
    for o in ops {
        if !streams.contains(&o.stream) {
            streams.push(o.stream);
        }
    }
    let callers = streams.iter().map(|u| Stream::caller(s.ctx, *u)).collect();
    (streams, callers)
}

/// Per operation, the kernels per phase its stream will run if this call queues them there
/// (slots are taken at commit): collectives that go direct, with kernels the board can hold,
/// and receives from peers whose buffers they read.
fn queued_shapes(comm: &Comm, s: &Streamed, ops: &[StreamOp], prestaged: &[(bool, Option<Region>)], paths: &[Path])
                 -> Vec<Option<ipc::Shape>> {
    ops.iter().zip(prestaged).zip(paths)
        .map(|((o, &(pre, _)), path)| match path {
            Path::Direct(Some(off)) if s.direct_on_stream && !pre => {
                on_stream_shape(comm, &ipc::computed(&o.op, off.scaled()))
            }
            Path::Direct(None) if s.p2p_on_stream && !pre => steps::receive_shape(&o.op),
            _ => None,
        })
        .collect()
}

/// What the callers' streams staged into the pool at call time ([`stage_on_callers`]).
struct CallerStaged {
    /// Per operation: whether it was staged, and where its device PreMulSum scalar went.
    prestaged: Vec<(bool, Option<Region>)>,
    /// Per staged operation: its caller's index, the user's output, the pool's copy.
    outs: Vec<(usize, Region, Region)>,
    /// The carve of the pool taken, given back after the events that end its use ([`Prepared`]).
    carve_id: Option<u64>,
}

/// The operations of `carve` (`pool::plan_caller_staging`) staged by their callers' streams
/// (`on`: each one's index in `callers`): their inputs and device scalars copied into the carve
/// of `pool` now, and `ops` changed to read and write there.
fn stage_on_callers(comm: &Comm, s: &Streamed, pool: Option<&mut Pool>, carve: Option<(usize, Vec<pool::Staged>)>,
                    callers: &[Stream], on: &dyn Fn(&StreamOp) -> usize, ops: &mut [StreamOp]) -> Result<CallerStaged> {
    let mut prestaged = vec![(false, None); ops.len()];
    let mut outs: Vec<(usize, Region, Region)> = Vec::new();
    let Some((start, picked)) = carve else { return Ok(CallerStaged { prestaged, outs, carve_id: None }) };
    if !s.caller_staged.swap(true, Ordering::Relaxed) {
        crate::info!(P2P, "rank {}: callers' streams stage operations through a pinned pool ({} bytes)", comm.rank,
                     pool.as_deref().map_or(0, Pool::capacity));
    }
    // Taken from here on; given back after the events that end its use (see Prepared).
    let carve_id = pool.map(|p| p.push(start));
    let staged_in = picked.iter().try_for_each(|st| {
        let (caller, op) = (&callers[on(&ops[st.i])], &ops[st.i].op);
        if let (Some(at), Some(to)) = (op.scalar_at, st.scalar) {
            caller.copy(to, Region::user(at, 0, to.len()))?;
        }
        match st.send.addr() == op.send.addr() {
            true => Ok(()), // in host memory: the worker reads it there
            false => caller.copy(st.send, op.send),
        }
    });
    // Failed: copies into the carve may be in flight, and nothing says when they end: it stays
    // taken (with the rest of the ring behind it; later batches stage on the worker).
    staged_in?;
    for st in &picked {
        let op = ops[st.i].op;
        if st.recv.addr() != op.recv.addr() {
            outs.push((on(&ops[st.i]), op.recv, st.recv));
        }
        // (Buffers it did not stage, in host memory, are the worker's to use as they are; so is
        // a scalar there.)
        ops[st.i].op = Op { send: st.send, recv: st.recv, scalar_at: op.scalar_at.filter(|_| st.scalar.is_none()), ..op };
        prestaged[st.i] = (true, st.scalar);
    }
    Ok(CallerStaged { prestaged, outs, carve_id })
}

/// Each operation's path (see [`Path`]). No collective goes direct once the ranks agreed they
/// never do.
fn paths(s: &Streamed, rank: usize, ops: &[StreamOp]) -> Vec<Path> {
    let off = s.direct_off.load(Ordering::Relaxed);
    let received = RegionSet::new(ops.iter().filter(|o| o.op.kind == OpKind::Recv).map(|o| o.op.recv));
    ops.iter()
        .map(|o| {
            let p2p = o.op.kind.is_p2p();
            match (s.routes.eligible(&o.op) && (p2p || !off), o.op.kind) {
                (false, _) => Path::Staged,
                // The receiver learns at run time whether it can read the sender's buffer.
                (true, OpKind::Recv) => Path::Direct(None),
                // A peer reading it directly could read what a receive of this batch already
                // wrote there (an in-place exchange: ncclSend and ncclRecv of one buffer in a
                // group): copied now, in stream order, into device memory that goes direct
                // instead (`copy_unreadable_inputs`), or else its bytes taken and staged.
                (true, OpKind::Send) if received.overlaps(o.op.send) => Path::Declined,
                (true, _) => ipc::offer(&o.op, rank, s.kernels.is_some(), &s.routes, false)
                    .map_or(Path::Declined, |o| Path::Direct(Some(o))),
            }
        })
        .collect()
}

/// An output a direct operation wrote into a carve of `Streamed::scratch` (an all-reduce's
/// whose buffer peers could not read), copied out on its caller's stream once the operation is
/// done: the caller's index, the user's output, the carve's region and id.
#[derive(Clone, Copy, Debug)]
struct CopyOut {
    caller: usize,
    user: Region,
    carve: Region,
    id: u64,
}

/// The operations `paths` declined whose buffers peers could not read directly, but could
/// read a copy of (see `scratch`): sends a receive of their batch writes into (an in-place
/// exchange) and in-place all-to-alls (peers could read what their own output already wrote
/// there), sends and collectives on memory that cannot be published (pinned or managed host
/// memory, device memory without CUDA IPC such as a stream-ordered allocator's pools), and
/// PreMulSum and fp16 Avg collectives (the direct path has no scaling step). Each such input
/// is copied now on its caller's stream into device memory of the communicator's where it
/// finds room (scaled by the PreMulSum's scalar, or by 1/n), and that copy is the input that goes direct (its peers
/// read it); an all-reduce whose output cannot be published runs in place on such a copy,
/// copied out after it.
fn copy_unreadable_inputs(comm: &Comm, s: &Streamed, callers: &[Stream], on: &dyn Fn(&StreamOp) -> usize,
                          ops: &mut [StreamOp], paths: &mut [Path]) -> Result<Copied> {
    let mut copied = Copied::default();
    let declined = |o: &StreamOp, p: &Path| {
        let kernels = s.kernels.is_some() || o.op.kind == OpKind::Send;
        matches!(p, Path::Declined) && kernels && !(o.op.send.is_empty() && o.op.recv.is_empty())
    };
    let scratch_off = || s.scratch.lock().unwrap_or_else(|p| p.into_inner()).is_off();
    if !ops.iter().zip(paths.iter()).any(|(o, p)| declined(o, p)) || scratch_off() {
        return Ok(copied);
    }
    let received = RegionSet::new(ops.iter().filter(|o| o.op.kind == OpKind::Recv).map(|o| o.op.recv));
    s.recycle(s.scratch.lock().unwrap_or_else(|p| p.into_inner()).reclaim());
    for (i, (o, path)) in ops.iter_mut().zip(paths.iter_mut()).enumerate() {
        if !declined(o, path) {
            continue;
        }
        let Some((copy_in, copy_out)) = copies(&o.op, comm.rank, comm.nranks, &received, &s.routes) else { continue };
        let op = o.op;
        let len = if copy_out { op.recv.len() } else { op.send.len() };
        // A scalar in memory goes after the operation's bytes, in the same carve.
        let scalar_slot = matches!(copy_in, CopyIn::ScaleAt(_)).then(|| pool::aligned(len));
        let whole = scalar_slot.map_or(len, |at| at + op.dt.size());
        let lock = || s.scratch.lock().unwrap_or_else(|p| p.into_inner());
        let mut scratch = lock();
        let mut got = scratch.take(whole);
        if got.is_none() {
            if let Some(size) = scratch.wants_block(whole, comm.rank) {
                // Allocated without the lock (the worker gives carves back under it); the
                // submit lock keeps other callers out meanwhile. The context is current.
                drop(scratch);
                let mem = crate::device::cuda::DeviceMem::new(size);
                scratch = lock();
                scratch.add_block(mem, comm.rank);
                got = scratch.take(whole);
            }
        }
        let Some((taken, id)) = got else {
            scratch.too_small(whole, &|| op.describe(), comm.rank);
            continue;
        };
        let carve = taken.sub(0, len);
        let direct = match (&copy_in, copy_out) {
            // In place on the copy of its input: peers read both from it.
            (CopyIn::No, _) => Op { recv: carve, ..op },
            (_, true) => Op { send: carve, recv: carve, ..op },
            (_, false) => Op { send: carve, ..op },
        };
        // (The worker reads no scalar of it: the kernel does.)
        let direct = Op { scalar_at: None, ..direct };
        let scaled = matches!(copy_in, CopyIn::Scale(_) | CopyIn::ScaleAt(_));
        let Some(offered) = ipc::offer(&direct, comm.rank, s.kernels.is_some(), &s.routes, scaled) else {
            scratch.give_back(id);
            continue;
        };
        drop(scratch);
        let caller = &callers[on(o)];
        let input = carve.sub(0, op.send.len());
        // On a failure what this carve got may still run: it stays taken (as do the earlier ones).
        match copy_in {
            CopyIn::No => {}
            CopyIn::Copy => caller.copy(input, op.send)?,
            CopyIn::Scale(by) => scale(s, caller, op, input, Factor::Value(by))?,
            CopyIn::ScaleAt(at) => {
                let slot = taken.sub(scalar_slot.unwrap_or(0), op.dt.size());
                caller.copy(slot, Region::user(at, 0, op.dt.size()))?;
                scale(s, caller, op, input, Factor::At(slot))?;
            }
        }
        match copy_out {
            true => copied.outs.push(CopyOut { caller: on(o), user: op.recv, carve, id }),
            false => copied.inputs.push(id),
        }
        if scaled {
            copied.unscaled.resize(i + 1, None);
            copied.unscaled[i] = Some(Unscaled { send: op.send, scalar_at: op.scalar_at });
        }
        o.op = direct;
        *path = Path::Direct(Some(offered));
    }
    Ok(copied)
}

/// What `copy_unreadable_inputs` copied.
#[derive(Default)]
struct Copied {
    /// The carves of copied inputs, given back when the batch is done.
    inputs: Vec<u64>,
    outs: Vec<CopyOut>,
    /// Per operation (none past the last scaled one): the user's input of a scaled one,
    /// which it is staged from if the ranks do not go direct after all.
    unscaled: Vec<Option<Unscaled>>,
}

/// What a scaled operation is staged from if the ranks do not go direct after all: the
/// user's input, and its PreMulSum scalar if that is in device memory (read then).
#[derive(Clone, Copy, Debug)]
pub(super) struct Unscaled {
    pub send: Region,
    pub scalar_at: Option<crate::device::host::UserPtr>,
}

/// How an operation's input goes direct (`copies`): as it is, copied, or copied scaled (by a
/// PreMulSum's scalar, or fp16 Avg's 1/n).
enum CopyIn {
    No,
    Copy,
    Scale(Scalar),
    /// By a PreMulSum scalar in device, pinned or managed memory, copied in stream order next
    /// to the input and read there by the scaling kernel.
    ScaleAt(crate::device::host::UserPtr),
}

/// Which of `op`'s buffers go direct as copies (`copy_unreadable_inputs`): (its input; its
/// output, copied out), or None if that does not help. Only buffers the device copies
/// asynchronously (device, pinned or managed memory; plain host memory is never on the direct
/// path) are copied. `n`: the communicator's ranks.
fn copies(op: &Op, rank: usize, n: usize, received: &RegionSet, routes: &Routes) -> Option<(CopyIn, bool)> {
    let reachable = |r: Region| crate::device::cuda::classify(r.addr()).is_ok_and(|k| k.stream_ordered());
    let unreadable = |r: Region| !r.is_empty() && !ipc::publishable(r, routes) && reachable(r);
    // Peers read an all-reduce's output too: it runs on a copy (in place if its input is one
    // as well).
    let output = op.kind == OpKind::AllReduce && unreadable(op.recv);
    match op.kind {
        OpKind::Send if received.overlaps(op.send) || unreadable(op.send) => Some((CopyIn::Copy, false)),
        OpKind::Send | OpKind::Recv => None,
        // Scaled now: a PreMulSum by its scalar as the call gave it (one in memory by the value
        // the stream leaves there, read by the kernel), fp16 Avg by 1/n as the planner scales
        // it (`plan::ops::scaling`).
        _ if crate::plan::ops::scales_inputs(op.op, op.dt) => {
            let by = match (op.op, op.scalar_at) {
                (RedOp::PreMulSum(_), Some(at)) => reachable(Region::user(at, 0, op.dt.size())).then_some(CopyIn::ScaleAt(at)),
                (RedOp::PreMulSum(by), None) => Some(CopyIn::Scale(by)),
                (RedOp::Builtin(_), _) => crate::device::host::avg_scalar(op.dt, n).map(CopyIn::Scale),
            };
            Some((by?, output)).filter(|_| reachable(op.send))
        }
        // An input the output overlaps outside NCCL's in-place layout (an all-to-all given
        // one buffer, say): peers read the copy, not what this rank's output already wrote.
        _ if op.input_overlaps_output(rank) => Some((CopyIn::Copy, output)),
        _ if output => Some((if op.send.addr() == op.recv.addr() || unreadable(op.send) { CopyIn::Copy } else { CopyIn::No },
                             true)),
        _ => unreadable(op.send).then_some((CopyIn::Copy, false)),
    }
}

/// What an input is scaled by (`scale`): a value, or the element at a device address.
enum Factor {
    Value(Scalar),
    At(Region),
}

/// Queues on `caller` the copy of `op`'s input into `to` scaled by `by` (PreMulSum, fp16 Avg):
/// the scaling kernel reads device memory in place; other memory is copied first.
fn scale(s: &Streamed, caller: &Stream, op: Op, to: Region, by: Factor) -> Result<()> {
    let k = s.kernels.ok_or_else(|| Error::internal("an input scaled for the direct path without kernels"))?;
    let from = if crate::device::cuda::is_device_memory(op.send.addr()) { op.send } else { caller.copy(to, op.send).map(|()| to)? };
    match by {
        Factor::Value(v) => k.premul(op.dt, to, from, v, caller),
        Factor::At(at) => k.premul_at(op.dt, to, from, at, caller),
    }
}

/// The signal `st` gives when it reaches this point (see [`Start`]).
fn start_signal(s: &Streamed, st: &Stream) -> Result<Start> {
    if let Some((board, t)) = s.board.as_ref().and_then(|b| b.take(1, 0).map(|t| (b, t))) {
        match st.write_value32(board.mem(), board.flag_word(&t), t.step_value(1)) {
            Ok(MemOp::Enqueued) => return Ok(Start::Word(t)),
            // Nothing queued: the slot is free again.
            Ok(MemOp::Unsupported) => board.untake(&t),
            Err(e) => {
                board.untake(&t);
                return Err(e);
            }
        }
    }
    let e = s.event()?;
    e.record(st)?;
    Ok(Start::Event(e))
}

/// A submit between its two halves (see [`prepare`]). Dropped uncommitted (a later
/// communicator of the group failed), its batch is never queued; its carve of the pool is
/// given back after the start events (recorded after every copy into it).
pub struct Prepared {
    comm: Arc<Comm>,
    lock: SubmitLock,
    callers: Vec<Stream>,
    ops: Vec<Op>,
    prestaged: Vec<(bool, Option<Region>)>,
    paths: Vec<Path>,
    /// Per caller-staged operation: its caller's index, the user's output, the pool's copy.
    outs: Vec<(usize, Region, Region)>,
    carve_id: Option<u64>,
    starts: Vec<Start>,
    seq: u32,
    committed: bool,
    /// Per operation: the index of its caller's stream, and the kernels per phase of a direct
    /// one its stream will run (`ipc::shape`).
    caller_of: Vec<usize>,
    shapes: Vec<Option<ipc::Shape>>,
    /// Per operation, once the slots are taken (`commit_all`): its slot, if it got one.
    direct: Vec<Option<OnStream>>,
    /// The carves of `Streamed::scratch` its inputs were copied into, and the outputs copied
    /// out of it after the batch. Never queued, they stay taken: a copy into one may be in
    /// flight.
    scratch: Vec<u64>,
    copies_out: Vec<CopyOut>,
    /// See `Batch::unscaled`.
    unscaled: Vec<Option<Unscaled>>,
}

impl Drop for Prepared {
    fn drop(&mut self) {
        if !self.committed {
            // Never queued for the worker: whatever of it the streams got runs nothing, and
            // their gates open.
            if let Some(b) = &self.lock.0.board {
                self.direct.iter().flatten().for_each(|d| b.close(&d.ticket));
            }
        }
        if let (false, Some(id)) = (self.committed, self.carve_id) {
            // Complete start events mean complete copies in; nothing else touches the carve. A
            // stream that signals its start through the board gets an event now, behind it.
            if self.starts.len() == self.callers.len() {
                let s = self.lock.0.clone();
                let events: Result<Vec<Event>> = std::mem::take(&mut self.starts).into_iter().zip(&self.callers)
                    .map(|(start, st)| match start {
                        Start::Event(e) => Ok(e),
                        Start::Word(_) => {
                            let _keep = KeepCurrent::new();
                            s.ctx.make_current()?;
                            let e = s.event()?;
                            e.record(st)?;
                            Ok(e)
                        }
                    })
                    .collect();
                // Without events nothing says when the copies in end: the carve stays taken.
                if let Ok(events) = events {
                    release_carve(&s, id, events);
                }
            }
        }
        if !self.committed {
            // The device copies of its buffers (copies in, or a carve an output was to be
            // copied out of) were queued before anything else on their streams: events recorded
            // now come after them. (If recording fails, the carves stay taken.)
            let s = self.lock.0.clone();
            let carves: Vec<u64> = self.scratch.drain(..).chain(self.copies_out.drain(..).map(|c| c.id)).collect();
            let _keep = KeepCurrent::new();
            for id in carves {
                let events: Result<Vec<Event>> = s.ctx.make_current().and_then(|()| {
                    self.callers.iter().map(|st| s.event().and_then(|e| e.record(st).map(|()| e))).collect()
                });
                if let Ok(events) = events {
                    s.scratch.lock().unwrap_or_else(|p| p.into_inner()).give_back_after(id, events);
                }
            }
        }
    }
}

/// Copies of results out of the pool and the device scratch, on their callers' streams, then
/// the events that give their carves back.
struct StageOut {
    callers: Vec<Stream>,
    /// (caller index, the user's output, the pool's copy), all in the pool's carve `carve`.
    copies: Vec<(usize, Region, Region)>,
    carve: Option<u64>,
    /// Outputs direct operations wrote into carves of the scratch.
    scratch: Vec<CopyOut>,
}

impl StageOut {
    /// Queues the copies and the release events; with `finish`, also waits for them (host-wait
    /// mode: the call returns with its results in place). A copy that cannot be queued leaves
    /// its carve taken (with the rest of its ring behind it).
    fn enqueue(self, s: &Streamed, finish: bool) -> Result<()> {
        for &(k, user, pooled) in &self.copies {
            self.callers[k].copy(user, pooled)?;
        }
        let mut released = Vec::new();
        for (k, st) in self.callers.iter().enumerate() {
            if self.copies.iter().any(|&(c, ..)| c == k) {
                let e = s.event()?;
                e.record(st)?;
                released.push(e);
            }
        }
        let finished = if finish { released.iter().try_for_each(Event::synchronize) } else { Ok(()) };
        if let Some(carve) = self.carve {
            release_carve(s, carve, released);
        }
        finished?;
        // (Given back after the copy even if the batch fails: a peer may then still read the
        // carve, but a failed communicator runs nothing more through its scratch.)
        for out in &self.scratch {
            let st = &self.callers[out.caller];
            st.copy(out.user, out.carve)?;
            let e = s.event()?;
            e.record(st)?;
            if finish {
                e.synchronize()?;
            }
            s.scratch.lock().unwrap_or_else(|p| p.into_inner()).give_back_after(out.id, vec![e]);
        }
        Ok(())
    }
}

/// The second half of a group's submits (see [`prepare`]), in an order that lets streams
/// sharing one hardware queue progress: the direct operations' steps round-robin over the
/// communicators (step k of every one before step k+1 of any: ranks of this process wait for
/// each other's steps), then each communicator's batch. On a failure the parts not yet
/// committed are dropped (their streams' gates open, nothing runs).
pub fn commit_all(prepared: Vec<(usize, Prepared)>) -> Result<Vec<HostWait>> {
    let mut prepared = prepared;
    let mut steps = Vec::with_capacity(prepared.len());
    for (_, p) in prepared.iter_mut() {
        steps.push(p.take_slots());
    }
    let most = steps.iter().map(Vec::len).max().unwrap_or(0);
    let failed = 'steps: {
        for i in 0..most {
            for ((rank, p), st) in prepared.iter().zip(&steps) {
                if let Some(Err(e)) = st.get(i).map(|step| p.enqueue_step(step)) {
                    break 'steps Some(e.context(format!("rank {rank}")));
                }
            }
        }
        None
    };
    if let Some(e) = failed {
        prepared.iter().for_each(|(_, p)| p.comm.publish_failure(&e));
        return Err(e);
    }
    let mut host_waits = Vec::new();
    let mut rest = prepared.into_iter();
    while let Some((rank, p)) = rest.next() {
        let comm = p.comm.clone();
        match p.commit() {
            Ok(w) => host_waits.extend(w),
            Err(e) => {
                // No waiting for the parts already queued: they may need the ones never queued,
                // and fail on their own (or on abort), their streams released.
                let e = e.context(format!("rank {rank}"));
                comm.publish_failure(&e);
                rest.for_each(|(_, p)| p.comm.publish_failure(&e));
                return Err(e);
            }
        }
    }
    Ok(host_waits)
}

impl Prepared {
    /// The second half: the callers' streams made to wait for the batch, the batch queued for
    /// the worker, and the results copied out of the pool after the wait (or, in host-wait
    /// mode, once the batch is done).
    pub fn commit(mut self) -> Result<Option<HostWait>> {
        let _keep = KeepCurrent::new();
        let s = self.lock.0.clone();
        s.ctx.make_current()?;
        let seq = self.seq;
        let mut waits_on_host = s.host_wait;
        let gate_kernel = s.gate_kernel;
        for st in self.callers.iter().filter(|_| !s.host_wait) {
            let gated = match gate_kernel {
                Some(k) => k.wait_geq(st, s.done, s.word, seq).map(|()| MemOp::Enqueued),
                None => st.wait_value32(s.done, s.word, seq, WaitCond::Geq),
            };
            match gated {
                Ok(MemOp::Enqueued) => {}
                Ok(MemOp::Unsupported) => waits_on_host = true,
                Err(e) => {
                    // Streams already told to wait for `seq` must get it: an empty batch releases
                    // them (the next batch must not reuse the number behind their wait). The
                    // carve goes back after the start events (Prepared's drop).
                    let mut state = s.state();
                    state.issued = seq;
                    state.queue.push_back(Batch { seq, ..Batch::default() });
                    drop(state);
                    s.queue.changed.notify_all();
                    return Err(e);
                }
            }
        }
        self.committed = true;
        let mut direct = std::mem::take(&mut self.direct);
        direct.resize(self.ops.len(), None);
        let batch = Batch { seq, starts: std::mem::take(&mut self.starts), ops: std::mem::take(&mut self.ops),
                            prestaged: std::mem::take(&mut self.prestaged), direct,
                            paths: std::mem::take(&mut self.paths), scratch: std::mem::take(&mut self.scratch),
                            unscaled: std::mem::take(&mut self.unscaled) };
        // Queued before the results are copied out: a copy the driver runs synchronously must
        // find its gate already on the way to opening.
        let mut state = s.state();
        state.issued = seq;
        state.queue.push_back(batch);
        drop(state);
        s.queue.changed.notify_all();
        let stage_out = (self.carve_id.is_some() || !self.copies_out.is_empty()).then(|| StageOut {
            callers: std::mem::take(&mut self.callers),
            copies: std::mem::take(&mut self.outs),
            carve: self.carve_id,
            scratch: std::mem::take(&mut self.copies_out),
        });
        if !waits_on_host {
            // After the gates on the streams: the results once the worker has put them there.
            // A copy that cannot be queued leaves the carve taken (the rest of the ring too).
            if let Some(out) = stage_out {
                out.enqueue(&s, false)?;
            }
            return Ok(None);
        }
        // No gate on some stream (host waits asked for, or the device has no stream memory
        // operations after all): the results are copied out once the batch is done.
        Ok(Some(HostWait { s: s.clone(), seq, stage_out }))
    }
}

/// A batch whose caller orders its stream by waiting on the host until it is done.
#[must_use = "the caller's stream is ordered only once the wait returns"]
pub struct HostWait {
    s: Arc<Streamed>,
    seq: u32,
    stage_out: Option<StageOut>,
}

impl HostWait {
    /// Returns once the batch has finished (or failed), its staged results copied out on their
    /// streams. Closing does not cut it short: the worker runs every queued batch before it
    /// stops (failing fast after an abort), and the caller may reuse its buffers once this
    /// returns.
    pub fn wait(self) {
        {
            let mut st = self.s.state();
            while !board::reached(st.finished, self.seq) {
                st = self.s.queue.changed.wait(st).unwrap_or_else(|p| p.into_inner());
            }
        }
        if let Some(out) = self.stage_out {
            let _keep = KeepCurrent::new();
            let copied = self.s.ctx.make_current().and_then(|()| out.enqueue(&self.s, true));
            if let Err(e) = copied {
                crate::warn!("results of an operation could not be copied out of the staging pool: {}", e.msg);
            }
        }
    }
}

/// Held through both halves of a submit and while closing (see `Streamed::submit_busy`).
struct SubmitLock(Arc<Streamed>);

impl SubmitLock {
    fn acquire(s: &Arc<Streamed>) -> SubmitLock {
        s.lock_submits();
        SubmitLock(s.clone())
    }
}

impl Drop for SubmitLock {
    fn drop(&mut self) {
        self.0.unlock_submits();
    }
}
