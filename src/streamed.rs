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
//!
//! A call comes in through `submit` (which copies the inputs peers cannot read with `inputs`);
//! the worker's loop is `worker`.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;

use crate::comm::Comm;
use crate::device::cuda::{self, Context, Event, KeepCurrent, Kernels, MappedHost, Stream, UserStream};
use crate::device::host::Region;
use crate::error::{Error, Result};
use crate::plan::Op;
use crate::transport::ipc::{self, Routes};

mod alone;
pub(crate) mod board;
mod capture;
mod inputs;
mod pool;
mod scratch;
mod steps;
mod submit;
mod worker;
pub(crate) use worker::wait_for_stream;
pub use submit::{commit_all, prepare, submit, HostWait, Prepared};
use board::{Board, Ticket};
use inputs::Unscaled;
use pool::Pool;
use scratch::Scratch;

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
