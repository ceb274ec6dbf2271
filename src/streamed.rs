//! CUDA mode: collectives on device memory, ordered with the caller's streams.
//!
//! The calling thread does not run an operation whose buffers include device memory. It
//! records an event on the caller's stream (everything the stream did before the call), makes
//! that stream wait (`cuStreamWaitValue32`) until a completion counter in mapped host memory
//! reaches the operation's number, hands the operation to the communicator's stream worker and
//! returns: NCCL's semantics, where the host call only enqueues.
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
//! While a caller's stream waits on a completion word, only the worker can release it, so the
//! worker must not make driver calls that may wait for the whole context to go idle: freeing
//! or pinning memory, loading kernels (cuMemFree, cuMemFreeHost and lazy module loading are
//! documented or reported to synchronise). Everything such is done before a communicator's
//! first wait is queued — its stream, the kernels, the completion word (from a slab allocated
//! once per device) — and the worker stages through ordinary host memory, which it grows
//! without the driver. CUDA IPC mappings are kept for the communicator's life and closed when
//! its worker stops.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::comm::Comm;
use crate::device::cuda::{Context, Event, KeepCurrent, Kernels, MappedHost, MemOp, Stream, UserStream, WaitCond};
use crate::device::host::Region;
use crate::error::{Error, Result};
use crate::plan::Op;
use crate::transport::ipc::{self, Direct};

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
    static SLABS: Mutex<Vec<(i32, &'static MappedHost, usize)>> = Mutex::new(Vec::new());
    let mut slabs = SLABS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, mem, next)) = slabs.iter_mut().find(|(o, _, next)| *o == ordinal && *next < WORDS_PER_SLAB) {
        *next += 1;
        return Ok((*mem, (*next - 1) * WORD_STRIDE));
    }
    let mem: &'static MappedHost = Box::leak(Box::new(MappedHost::new(WORDS_PER_SLAB * WORD_STRIDE * 4)?));
    slabs.push((ordinal, mem, 1));
    Ok((mem, 0))
}

/// One operation for the worker: what to run and the stream it is ordered with.
#[derive(Clone, Copy, Debug)]
pub struct StreamOp {
    pub op: Op,
    pub stream: UserStream,
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
    state: Mutex<State>,
    /// Held through a whole submit (driver calls included, which may block while the device's
    /// launch queue is full) and while closing; never by the worker, which needs `state` to
    /// drain that queue.
    submitting: Mutex<()>,
    /// Signalled when a batch is queued, when one finishes, and on close.
    changed: Condvar,
    worker: Mutex<Option<JoinHandle<()>>>,
    /// Events of finished batches, recorded again by later calls (no create/destroy per call).
    events: Mutex<Vec<Event>>,
}

#[derive(Default)]
struct State {
    queue: VecDeque<Batch>,
    issued: u32,
    finished: u32,
    closing: bool,
}

/// The operations one group issued on this communicator, run together (their sends and
/// receives may pair up with each other).
struct Batch {
    seq: u32,
    starts: Vec<Event>,
    ops: Vec<Op>,
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
        let s = Arc::new(Streamed { ctx, done, word, kernels, state: Mutex::new(State::default()),
                                    submitting: Mutex::new(()), changed: Condvar::new(), worker: Mutex::new(None),
                                    events: Mutex::new(Vec::new()) });
        let (c, w) = (comm.clone(), s.clone());
        let handle = std::thread::Builder::new()
            .name(format!("nccl-rs-stream-{}", comm.rank))
            .spawn(move || worker(c, w, stream))
            .map_err(|e| Error::os("spawn the stream worker", e))?;
        *s.worker.lock().unwrap_or_else(|p| p.into_inner()) = Some(handle);
        crate::info!(INIT, "rank {}: CUDA mode on device {}, stream worker started", comm.rank, comm.cuda_dev);
        if crate::params::few_device_connections() {
            crate::info!(INIT, "rank {}: calls on device memory wait on the host until done (NCCL_RS_HOST_WAIT=1, or \
                                CUDA_DEVICE_MAX_CONNECTIONS below 8 and NCCL_RS_HOST_WAIT unset)", comm.rank);
        } else if crate::params::stream_gate_kernel() && s.kernels.is_some() {
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
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wait until every batch issued so far has finished.
    pub fn drain(&self) {
        let mut st = self.state();
        while st.finished != st.issued && !st.closing {
            st = self.changed.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Stop the worker after the batches already queued (they fail fast on an aborted
    /// communicator) and wait for it.
    pub fn close(&self) {
        {
            // Not while a submit is between numbering its batch and queueing it.
            let _no_submit = self.submitting.lock().unwrap_or_else(|p| p.into_inner());
            self.state().closing = true;
        }
        self.changed.notify_all();
        let handle = self.worker.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(h) = handle {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }
}

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
    static STARTING: Mutex<()> = Mutex::new(());
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
    if ops.is_empty() {
        return Ok(None);
    }
    comm.ready()?;
    // The communicator's context is current for the calls below (the legacy stream, NULL, is
    // that context's); the caller's comes back.
    let _keep = KeepCurrent::new();
    let s = streamed(comm)?;
    s.ctx.make_current()?;
    let mut streams: Vec<UserStream> = Vec::new();
    for o in &ops {
        if !streams.contains(&o.stream) {
            streams.push(o.stream);
        }
    }
    let callers: Vec<Stream> = streams.iter().map(|u| Stream::caller(s.ctx, *u)).collect();
    for st in &callers {
        if st.is_capturing()? {
            return Err(Error::invalid_usage(
                "the stream is capturing a CUDA graph: nccl-rs cannot record collectives into graphs yet; \
                 issue them outside the capture"));
        }
    }
    let mut starts = Vec::with_capacity(callers.len());
    for st in &callers {
        let e = s.event()?;
        e.record(st)?;
        starts.push(e);
    }
    let _one = s.submitting.lock().unwrap_or_else(|p| p.into_inner());
    let seq = {
        let state = s.state();
        if state.closing {
            return Err(Error::invalid_usage("communicator is being destroyed"));
        }
        state.issued.wrapping_add(1)
    };
    let host_wait = crate::params::few_device_connections();
    let mut waits_on_host = host_wait;
    let gate_kernel = s.kernels.filter(|_| crate::params::stream_gate_kernel());
    for st in callers.iter().filter(|_| !host_wait) {
        let gated = match gate_kernel {
            Some(k) => k.wait_geq(st, s.done, s.word, seq).map(|()| MemOp::Enqueued),
            None => st.wait_value32(s.done, s.word, seq, WaitCond::Geq),
        };
        match gated {
            Ok(MemOp::Enqueued) => {}
            Ok(MemOp::Unsupported) => waits_on_host = true,
            Err(e) => {
                // Streams already told to wait for `seq` must get it: an empty batch releases
                // them (the next batch must not reuse the number behind their wait).
                let mut state = s.state();
                state.issued = seq;
                state.queue.push_back(Batch { seq, starts: Vec::new(), ops: Vec::new() });
                drop(state);
                s.changed.notify_all();
                return Err(e);
            }
        }
    }
    let mut state = s.state();
    state.issued = seq;
    state.queue.push_back(Batch { seq, starts, ops: ops.into_iter().map(|o| o.op).collect() });
    drop(state);
    s.changed.notify_all();
    // No stream memory operations on this device, or host waits asked for: the caller orders
    // its stream by waiting here instead (after submitting the rest of its group).
    Ok(waits_on_host.then(|| HostWait { s: s.clone(), seq }))
}

/// A batch whose caller orders its stream by waiting on the host until it is done.
#[must_use = "the caller's stream is ordered only once the wait returns"]
pub struct HostWait {
    s: Arc<Streamed>,
    seq: u32,
}

impl HostWait {
    /// Returns once the batch has finished (or failed). Closing does not cut it short: the
    /// worker runs every queued batch before it stops (failing fast after an abort), and the
    /// caller may reuse its buffers once this returns.
    pub fn wait(self) {
        let mut st = self.s.state();
        while st.finished.wrapping_sub(self.seq) as i32 <= -1 {
            st = self.s.changed.wait_timeout(st, Duration::from_millis(100)).unwrap_or_else(|p| p.into_inner()).0;
        }
    }
}

fn worker(comm: Arc<Comm>, s: Arc<Streamed>, stream: Stream) {
    let mut staging = Staging::default();
    let mut direct = Direct::default();
    let stream = s.ctx.make_current().map(|()| stream);
    loop {
        let batch = {
            let mut st = s.state();
            loop {
                if let Some(b) = st.queue.pop_front() {
                    break Some(b);
                }
                if st.closing {
                    break None;
                }
                st = s.changed.wait(st).unwrap_or_else(|p| p.into_inner());
            }
        };
        let Some(mut batch) = batch else { break };
        let result = match &stream {
            // A panic must not strand the callers' streams: it becomes this batch's error,
            // and the worker starts over with fresh staging.
            Ok(stream) => {
                catch_unwind(AssertUnwindSafe(|| run_batch(&comm, stream, s.kernels, &mut staging, &mut direct, &batch)))
                    .unwrap_or_else(|_| Err(Error::internal("the stream worker panicked")))
            }
            Err(e) => Err(e.clone()),
        };
        if result.is_ok() {
            s.recycle(std::mem::take(&mut batch.starts));
        }
        if let Err(e) = result {
            crate::warn!("rank {}: operation on the stream failed: {}", comm.rank, e.msg);
            comm.set_async_error(&e);
            // Copies the failed batch queued may still be writing the caller's buffers: they
            // finish before the caller's stream moves on.
            if let Ok(stream) = &stream {
                let _ = stream.synchronize();
            }
        }
        // Released even on failure: the caller's stream must never wait forever.
        s.done.word(s.word).store(batch.seq, Ordering::Release);
        s.state().finished = batch.seq;
        s.changed.notify_all();
    }
}

/// Wait until the caller's stream has reached the call (its event), but not past an abort:
/// a stream that never gets there (held by the caller, a hung kernel) must not make
/// ncclCommAbort wait forever for this worker.
fn wait_started(comm: &Comm, e: &Event) -> Result<()> {
    let mut spins = 0u32;
    while !e.query()? {
        if comm.abort.load(Ordering::Acquire) || comm.revoked.load(Ordering::Acquire) {
            return Err(Error::invalid_usage("communicator aborted or revoked while waiting for the caller's stream"));
        }
        spins += 1;
        if spins < 256 {
            std::hint::spin_loop();
        } else if spins < 4096 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
    Ok(())
}

/// Host memory operations are staged in, kept across batches. Ordinary memory, not pinned:
/// pinning or unpinning while a caller's stream waits for this worker could stall in the driver
/// (see the module's notes); the device copies it synchronously, through the driver's own
/// pinned buffers.
#[derive(Default)]
struct Staging {
    plain: Vec<Vec<u8>>,
}

impl Staging {
    /// Buffer `i`, at least `len` bytes.
    fn get(&mut self, i: usize, len: usize) -> Region {
        if self.plain.len() <= i {
            self.plain.resize_with(i + 1, Vec::new);
        }
        let v = &mut self.plain[i];
        if v.len() < len {
            v.resize(len, 0);
        }
        Region::owned(&mut v[..len])
    }
}

fn run_batch(comm: &Arc<Comm>, stream: &Stream, kernels: Option<&Kernels>, staging: &mut Staging, direct: &mut Direct,
             batch: &Batch) -> Result<()> {
    for e in &batch.starts {
        wait_started(comm, e)?;
    }
    comm.ready()?;
    let mut ops = batch.ops.clone();
    // PreMulSum scalars in device memory: read now, after the stream's earlier work.
    for op in ops.iter_mut() {
        if let Some(p) = op.scalar_at.take() {
            let n = op.dt.size();
            let mut bytes = [0u8; 8];
            stream.copy(Region::owned(&mut bytes[..n]), Region::user(p, 0, n))?;
            stream.synchronize()?;
            let value = crate::device::host::reduce::scalar_from_bytes(op.dt, &bytes[..n])
                .ok_or_else(|| Error::internal("PreMulSum scalar conversion"))?;
            op.op = crate::types::RedOp::PreMulSum(value);
        }
    }
    // Collectives first, in issue order, each direct or staged by rules every rank applies
    // alike whatever else its group holds (as the host planner also runs a group's
    // collectives before its sends and receives); then the sends and receives, which pair up
    // within their group and so are staged together.
    let (p2p, colls): (Vec<Op>, Vec<Op>) = ops.into_iter().partition(|o| o.kind.is_p2p());
    for op in &colls {
        if ipc::eligible(comm, op) && ipc::run(comm, stream, kernels, direct, op)? {
            continue;
        }
        run_staged(comm, stream, staging, std::slice::from_ref(op))?;
    }
    if p2p.is_empty() {
        return Ok(());
    }
    let done = ipc::run_p2p(comm, stream, direct, &p2p)?;
    let rest: Vec<Op> = p2p.iter().zip(&done).filter(|(_, d)| !**d).map(|(o, _)| *o).collect();
    if rest.is_empty() { Ok(()) } else { run_staged(comm, stream, staging, &rest) }
}

/// Copy the operations' buffers into host staging memory, run them with the host transports,
/// copy the results back.
fn run_staged(comm: &Arc<Comm>, stream: &Stream, staging: &mut Staging, ops: &[Op]) -> Result<()> {
    let mut host_ops = Vec::with_capacity(ops.len());
    for (k, op) in ops.iter().enumerate() {
        let send = if op.send.is_empty() { Region::EMPTY } else { staging.get(2 * k, op.send.len()) };
        let recv = if op.recv.is_empty() { Region::EMPTY } else { staging.get(2 * k + 1, op.recv.len()) };
        stream.copy(send, op.send)?;
        host_ops.push(Op { send, recv, ..*op });
    }
    stream.synchronize()?;
    crate::group::execute_now(comm.clone(), host_ops.clone())?;
    for (op, h) in ops.iter().zip(&host_ops) {
        stream.copy(op.recv, h.recv)?;
    }
    stream.synchronize()
}
