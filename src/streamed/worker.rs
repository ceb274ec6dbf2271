//! The stream worker of a communicator in CUDA mode (see `streamed`): a thread that takes the
//! batches its callers queued, in order (and the launches of CUDA graphs that reach it:
//! `capture`), waits until their streams have reached them, runs
//! them (host transports, the direct path's exchanges and descriptors, staging where the
//! callers' streams did not) and releases the streams. It must never make a driver call that
//! may wait for the device while a caller's stream waits for it (the module docs of
//! `streamed` say which it makes and why they are safe).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::time::Duration;

use super::{capture, Batch, Path, Start, Streamed};
use crate::comm::Comm;
use crate::device::cuda::{Context, Stream};
use crate::device::host::Region;
use crate::error::{Error, Result};
use crate::plan::{Op, OpKind};
use crate::transport::ipc::{self, Direct};

/// The worker's loop: batches in order until the communicator closes.
pub(super) fn run(comm: Arc<Comm>, s: Arc<Streamed>, stream: Stream) {
    let mut staging = Staging::default();
    let mut direct = Direct::default();
    // Its queries, copies and mappings must not break a graph the application captures.
    crate::device::cuda::relax_capture_mode();
    // (Shared with the thread that stages beside direct operations: `Staging::helper`.)
    let stream = s.ctx.make_current().map(|()| Arc::new(stream));
    loop {
        let batch = match next(&s) {
            Next::Batch(b) => b,
            Next::Replay(r) => {
                capture::run(&comm, r);
                continue;
            }
            Next::Release => {
                // Every batch queued before ncclCommSuspend has finished: nothing reads them.
                let (n, bytes) = direct.close_mappings();
                staging = Staging::default();
                s.peer_bytes.store(0, Ordering::Relaxed);
                crate::info!(INIT, "rank {}: ncclCommSuspend: closed {n} peer mapping(s) of {bytes} bytes and freed the \
                                    worker's staging", comm.rank);
                s.state().release = false;
                s.queue.changed.notify_all();
                continue;
            }
            Next::Stop => break,
        };
        // Stream order while graphs hold this communicator's calls (`capture`): a launch its
        // stream reaches before this batch runs first.
        while capture::captured_any(&s) {
            match replay_first(&comm, &s, &batch) {
                Some(r) => capture::run(&comm, r),
                None => break,
            }
        }
        let result = match &stream {
            // A panic must not strand the callers' streams: it becomes this batch's error (the
            // worker keeps its staging and mappings: closing mappings while streams wait is
            // what this module avoids).
            Ok(stream) => {
                catch_unwind(AssertUnwindSafe(|| run_batch(&comm, stream, &s, &mut staging, &mut direct, &batch)))
                    .unwrap_or_else(|_| Err(Error::internal("the stream worker panicked")))
            }
            Err(e) => Err(e.clone()),
        };
        finish(&comm, &s, stream.as_ref().ok(), &direct, batch, result);
    }
    // Closing: no launch is queued after this (`capture::hand_over`).
    let left = std::mem::take(&mut s.state().replays);
    capture::abandon_all(left);
}

/// What the worker does next: a launch of a CUDA graph its stream reached, else the next
/// batch, else what ncclCommSuspend or the communicator's end asks; waited for.
fn next(s: &Streamed) -> Next {
    let mut st = s.state();
    loop {
        if let Some(r) = st.replays.pop_front() {
            return Next::Replay(r);
        }
        if let Some(b) = st.queue.pop_front() {
            return Next::Batch(b);
        }
        if st.release {
            return Next::Release;
        }
        if st.closing {
            return Next::Stop;
        }
        st = s.queue.changed.wait(st).unwrap_or_else(|p| p.into_inner());
    }
}

/// `batch` ran (`result`): what it held goes back, a failure is published, and the callers'
/// streams are released, even on failure: a caller's stream must never wait forever.
fn finish(comm: &Comm, s: &Streamed, stream: Option<&Arc<Stream>>, direct: &Direct, mut batch: Batch,
          result: Result<()>) {
    if result.is_ok() {
        // Peers have read the copies of its inputs (a failed batch keeps them: a peer may
        // still be reading).
        if !batch.scratch.is_empty() {
            let mut scratch = s.scratch.lock().unwrap_or_else(|p| p.into_inner());
            batch.scratch.iter().for_each(|&id| scratch.give_back(id));
        }
        let events = std::mem::take(&mut batch.starts).into_iter().filter_map(|st| match st {
            Start::Event(e) => Some(e),
            Start::Word(_) => None,
        });
        s.recycle(events.collect());
    }
    if let Err(e) = result {
        crate::warn!("rank {}: operation on the stream failed: {}", comm.rank, e.msg);
        comm.publish_failure(&e);
        // Copies the failed batch queued may still be writing the caller's buffers: they
        // finish before the caller's stream moves on.
        if let Some(stream) = stream {
            let _ = stream.synchronize();
        }
    }
    if let Some(b) = &s.board {
        batch.direct.iter().flatten().for_each(|d| b.close(&d.ticket));
    }
    s.peer_bytes.store(direct.mapped_bytes(), Ordering::Relaxed);
    s.done.word(s.word).store(batch.seq, Ordering::Release);
    s.state().finished = batch.seq;
    s.queue.changed.notify_all();
}

/// What the worker takes next.
enum Next {
    Batch(Batch),
    Replay(capture::Replay),
    /// ncclCommSuspend asked for the worker's memory (`Streamed::release_memory`).
    Release,
    Stop,
}

/// Waits until the callers' streams reach `batch`, unless a graph launch reaches the worker
/// first: that launch, to run before the batch. (A failed wait, on abort, is the batch's to
/// report.)
fn replay_first(comm: &Comm, s: &Streamed, batch: &Batch) -> Option<capture::Replay> {
    let mut first = None;
    let mut arrived = 0;
    let _ = wait_for_stream(comm, &batch.ops, "its CUDA stream has not reached the call", || {
        if let Some(r) = s.state().replays.pop_front() {
            first = Some(r);
            return Ok(true);
        }
        all_reached(s, batch, &mut arrived)
    });
    first
}

/// Polls `done` until it holds (spinning, then yielding, then napping 50 us), or fails once
/// the communicator is aborted or revoked.
fn poll(comm: &Comm, what: &str, mut done: impl FnMut() -> bool) -> Result<()> {
    let mut back_off = crate::proxy::Backoff::new();
    while !done() {
        if comm.abort.load(Ordering::Acquire) || comm.revoked.load(Ordering::Acquire) {
            return Err(Error::invalid_usage(format!("communicator aborted or revoked while waiting for {what}")));
        }
        back_off.wait();
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
    /// The thread that runs a batch's sends and receives through the host transports while
    /// this one runs its direct ones (either may wait for what a peer does in the other),
    /// started at the first such batch and kept, with staging of its own, until this goes.
    helper: Option<Helper>,
}

/// See [`Staging::helper`]: the worker hands it a batch's staged sends and receives and takes
/// its result once its own direct ones are done.
struct Helper {
    jobs: mpsc::Sender<Vec<Flagged>>,
    results: mpsc::Receiver<Result<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Helper {
    fn start(comm: &Arc<Comm>, stream: &Arc<Stream>, ctx: &'static Context) -> Result<Helper> {
        let (jobs, todo) = mpsc::channel::<Vec<Flagged>>();
        let (done, results) = mpsc::channel();
        let rank = comm.rank;
        let (comm, stream) = (comm.clone(), stream.clone());
        let thread = std::thread::Builder::new().name(format!("nccl-rs-staged-{rank}")).spawn(move || {
            crate::debug::set_rank(comm.rank as i32);
            crate::device::cuda::relax_capture_mode();
            crate::abi::naps::fine_for_this_thread();
            let current = ctx.make_current();
            let mut staging = Staging::default();
            for ops in todo {
                let run = || run_staged(&comm, &stream, &mut staging, &ops);
                let result = current.clone().and_then(|()| {
                    catch_unwind(AssertUnwindSafe(run))
                        .unwrap_or_else(|_| Err(Error::internal("staged sends and receives panicked")))
                });
                if done.send(result).is_err() {
                    break;
                }
            }
        });
        let thread = thread.map_err(|e| Error::os("spawn a thread for staged sends and receives", e))?;
        crate::info!(P2P, "rank {}: sends and receives through the host transports run beside direct ones, on a \
                           thread kept for them", rank);
        Ok(Helper { jobs, results, thread: Some(thread) })
    }
}

/// A job handed to the [`Helper`], whose result is yet to be taken.
struct Pending<'a>(&'a Helper);

impl Pending<'_> {
    fn result(self) -> Result<()> {
        let r = self.0.results.recv().unwrap_or_else(|_| Err(Error::internal("the staging thread is gone")));
        std::mem::forget(self);
        r
    }
}

impl Drop for Pending<'_> {
    /// Unwinding past a job: wait for its result.
    fn drop(&mut self) {
        let _ = self.0.results.recv();
    }
}

impl Drop for Helper {
    /// Its channel closed, the thread (idle: the worker waits for every job) ends.
    fn drop(&mut self) {
        self.jobs = mpsc::channel().0;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Staging {
    /// Buffer `i`, at least `len` bytes, or `ncclSystemError` where the system has not as many.
    fn get(&mut self, i: usize, len: usize) -> Result<Region> {
        if self.plain.len() <= i {
            self.plain.resize_with(i + 1, Vec::new);
        }
        let v = &mut self.plain[i];
        crate::device::host::grow(v, len, &|| "host staging of a device buffer".to_string())?;
        Ok(Region::owned(&mut v[..len]))
    }
}

/// An operation of a batch and whether the caller's stream staged it.
type Flagged = (Op, bool);

/// Has the caller's stream reached the point `start` marks?
fn reached(s: &Streamed, start: &Start) -> Result<bool> {
    match (start, &s.board) {
        (Start::Word(t), Some(b)) => Ok(b.flag_reached(t, t.step_value(1))),
        (Start::Event(e), _) => e.query(),
        (Start::Word(_), None) => Err(Error::internal("a start signal without a board")),
    }
}

/// Waits until every caller's stream of `batch` has reached it, but not past an abort: a
/// stream that never gets there (held by the caller, a hung kernel) must not make
/// ncclCommAbort wait forever for this worker.
fn wait_starts(comm: &Comm, s: &Streamed, batch: &Batch) -> Result<()> {
    let mut arrived = 0;
    wait_for_stream(comm, &batch.ops, "its CUDA stream has not reached the call", || all_reached(s, batch, &mut arrived))
}

/// Have all the callers' streams of `batch` reached it? The first `arrived` have (and are not
/// asked again); `arrived` counts those found since.
fn all_reached(s: &Streamed, batch: &Batch, arrived: &mut usize) -> Result<bool> {
    while let Some(st) = batch.starts.get(*arrived) {
        if !reached(s, st)? {
            return Ok(false);
        }
        *arrived += 1;
    }
    Ok(true)
}

/// Polls `done` while this rank waits for a caller's CUDA stream to get through `ops` (to
/// reach them, or to run their device work), failing once the communicator is aborted or
/// revoked. Meanwhile peers that wait on this rank learn that it issued them and waits for its
/// stream (not that it has not made the call); after [`STREAM_LATE`], this rank says `late`.
pub(crate) fn wait_for_stream(comm: &Comm, ops: &[Op], late: &str, mut done: impl FnMut() -> Result<bool>)
                              -> Result<()> {
    if done()? {
        return Ok(());
    }
    let Some(ready) = comm.ready_if_any() else { return Err(Error::internal("a stream worker before init")) };
    ready.set_waiting_for_stream(ops.iter().map(Op::stamp));
    let since = std::time::Instant::now();
    let (mut warned, mut failed) = (false, None);
    let (mut looked, mut held) = (since, None::<(usize, String)>);
    let waited = poll(comm, "the caller's stream", || match done() {
        Ok(true) => true,
        Ok(false) => {
            // (One clock read a poll for both looks below.)
            let now = std::time::Instant::now();
            // Each second, from the first: what may hold the stream up, shown to the peers.
            if now.duration_since(looked) >= HELD_LOOK_EVERY {
                looked = now;
                let was = held.is_some();
                held = held_by_signals(comm);
                if let Some(first) = ops.first().filter(|_| was || held.is_some()) {
                    ready.note_held_stream(&first.stamp(), held.clone());
                }
            }
            if !warned && now.duration_since(since) >= STREAM_LATE {
                warned = true;
                let first = ops.first().map_or_else(String::new, Op::describe);
                let more = ops.len().saturating_sub(1);
                let more = if more > 0 { format!(" (and {more} more of its group)") } else { String::new() };
                let signals = held.as_ref().map_or(String::new(), |(_, text)| {
                    format!("; a stream of this rank waits in ncclWaitSignal for signals from {text}")
                });
                crate::warn!("rank {}: {first}{more}: {late} in {:.1} s: work queued on that stream has not \
                              finished, and the other ranks wait for this one{signals}", comm.rank,
                             now.duration_since(since).as_secs_f64());
            }
            false
        }
        Err(e) => {
            failed = Some(e);
            true
        }
    });
    ready.set_running(&[]);
    waited?;
    failed.map_or(Ok(()), Err)
}

/// How often a rank waiting for its stream looks at what may hold it up ([`held_by_signals`]);
/// the first look is after as long.
const HELD_LOOK_EVERY: Duration = Duration::from_secs(1);

/// What may hold up this rank's stream: a stream of this rank that has waited a second or more
/// in ncclWaitSignal for signals that have not come (this communicator's), as (the sender,
/// it described with the signal, and its process where that is stopped). Seen in a stop hunt:
/// a rank waiting on a rank of its own process was told only that that rank waits for its
/// stream, while the stream waited for signals of the process that was stopped.
fn held_by_signals(comm: &Comm) -> Option<(usize, String)> {
    let (rank, what) = comm.rma.oldest_short_stream_wait(HELD_LOOK_EVERY)?;
    let how = comm.peer_stopped_anywhere(rank).map_or(String::new(), |how| format!(": {how}"));
    Some((rank, format!("{}, which has not sent them ({what}){how}", comm.describe_peer(rank))))
}

/// How long a caller's stream may take to get through a call before this rank says so: long
/// enough that a host running ahead of its GPU, or a large phase of device work, says nothing.
/// (Peers waiting on this rank hear why after a second, from their own watch.)
const STREAM_LATE: Duration = Duration::from_secs(10);

/// What the parts of a batch run with: the communicator, the worker's stream and staging, and
/// its peer mappings.
struct Runner<'a> {
    comm: &'a Arc<Comm>,
    stream: &'a Arc<Stream>,
    s: &'a Streamed,
    staging: &'a mut Staging,
    direct: &'a mut Direct,
}

fn run_batch(comm: &Arc<Comm>, stream: &Arc<Stream>, s: &Streamed, staging: &mut Staging, direct: &mut Direct,
             batch: &Batch) -> Result<()> {
    comm.ready()?;
    // The wait for the callers' streams, once, as late as possible: a direct operation maps
    // its peers' buffers first (`ipc::Started`); everything else needs the streams there.
    let mut arrived = false;
    let mut started = || -> Result<()> {
        if !arrived {
            wait_starts(comm, s, batch)?;
            arrived = true;
        }
        Ok(())
    };
    let mut ops = batch.ops.clone();
    if ops.iter().any(|o| o.scalar_at.is_some()) || batch.prestaged.iter().any(|&(_, scalar)| scalar.is_some()) {
        started()?;
    }
    // PreMulSum scalars in device memory: read now, after the stream's earlier work (from the
    // pool, on the host, where the caller's stream staged it).
    for (op, &(_, pooled)) in ops.iter_mut().zip(&batch.prestaged) {
        read_scalar(stream, op, pooled)?;
    }
    // Collectives first, in issue order, each direct or staged by rules every rank applies
    // alike whatever else its group holds (as the host planner also runs a group's
    // collectives before its sends and receives); then the sends and receives, which pair up
    // within their group and so are staged together. An operation the caller's stream staged
    // (`prestaged`) is host work only: its regions are the pool's.
    let mut w = Runner { comm, stream, s, staging, direct };
    run_collectives(&mut w, batch, &ops, &mut started)?;
    // Calls from now on see it (the ranks agreed in this batch, or earlier).
    s.direct_off.store(w.direct.off, Ordering::Relaxed);
    started()?;
    run_sends_and_receives(&mut w, batch, &ops)
}

/// The collectives of `batch` (`ops`: its operations, scalars read), in issue order. Once the
/// ranks agreed that collectives never go direct again (`Direct::off`, set in the same
/// operation on every rank), they are staged without asking.
fn run_collectives(w: &mut Runner, batch: &Batch, ops: &[Op], started: ipc::Started) -> Result<()> {
    let (comm, stream, s) = (w.comm, w.stream, w.s);
    for (i, op) in ops.iter().enumerate().filter(|(_, o)| !o.kind.is_p2p()) {
        let pre = batch.prestaged.get(i).is_some_and(|&(pre, _)| pre);
        let path = batch.paths.get(i).unwrap_or(&Path::Staged);
        // Staged, an operation whose input went direct as a scaled copy scales the user's
        // (reading a scalar in device memory only then: the stream has got there).
        let staged = || -> Result<Op> {
            let Some(&Some(u)) = batch.unscaled.get(i) else { return Ok(*op) };
            let mut o = Op { send: u.send, scalar_at: u.scalar_at, ..*op };
            read_scalar(stream, &mut o, None)?;
            Ok(o)
        };
        if let (Some(Some(d)), Some(board), Path::Direct(Some(offered))) = (batch.direct.get(i), &s.board, path) {
            let queued = ipc::Queued { board, ticket: &d.ticket, shape: &d.shape };
            if !w.direct.off && ipc::run_on_stream(comm, w.direct, op, offered, &queued, started)? {
                continue;
            }
            // Every rank stages it; the caller's stream waits at the first gate meanwhile, and
            // then runs kernels that do nothing.
            started()?;
            run_staged(comm, stream, w.staging, &[(staged()?, false)])?;
            board.close(&d.ticket);
            continue;
        }
        match path {
            _ if w.direct.off => {}
            // Its regions may be the pool's now: the agreement must not publish those either.
            Path::Declined => ipc::decline(comm, w.direct, op, s.kernels.is_none(), started)?,
            // Run on the worker's stream (no board slot); false: every rank stages it.
            Path::Direct(Some(offered)) if !pre && ipc::run(comm, stream, s.kernels, w.direct, op, offered, started)? => {
                continue
            }
            _ => {}
        }
        started()?;
        run_staged(comm, stream, w.staging, &[(staged()?, pre)])?;
    }
    Ok(())
}

/// The sends and receives of `batch` (`ops`), the callers' streams there. Those between ranks
/// of this host (`Routes::eligible`, alike on both ends) pair up over their own connections
/// (`ipc::run_p2p`); the others go through the host transports meanwhile: either may wait for
/// what a peer does in the other.
fn run_sends_and_receives(w: &mut Runner, batch: &Batch, ops: &[Op]) -> Result<()> {
    let (comm, stream, s) = (w.comm, w.stream, w.s);
    let mut snapshots = take_overwritten_sends(stream, ops)?;
    let mut direct_ops = Vec::new();
    let mut host: Vec<Flagged> = Vec::new();
    for (i, op) in ops.iter().enumerate().filter(|(_, o)| o.kind.is_p2p()) {
        let pre = batch.prestaged.get(i).is_some_and(|&(pre, _)| pre);
        // (The copy lives in `snapshots` until the batch is done.)
        let (op, pre) = match snapshots.get_mut(i).and_then(Option::as_mut) {
            Some(bytes) => (Op { send: Region::owned(bytes), ..*op }, true),
            None => (*op, pre),
        };
        if s.routes.eligible(&op) {
            let offered = match batch.paths.get(i) {
                Some(Path::Direct(Some(o))) => Some(o),
                _ => None,
            };
            // A receive's copy queued on its caller's stream (`steps::receive_shape`).
            let queued = match (batch.direct.get(i), &s.board) {
                (Some(Some(d)), Some(board)) => Some((board, &d.ticket)),
                _ => None,
            };
            direct_ops.push(ipc::P2p { op, pre, offered, queued });
        } else {
            host.push((op, pre));
        }
    }
    match (direct_ops.is_empty(), host.is_empty()) {
        (true, true) => Ok(()),
        (true, false) => run_staged(comm, stream, w.staging, &host),
        (false, true) => {
            // What this rank runs, for peers that wait on it (each send and receive with its
            // direction and peer: two ranks that only send to each other are told so). Not
            // with a staged part beside it, which publishes its own.
            let shown: Vec<crate::transport::Stamp> = direct_ops.iter()
                .map(|o| crate::plan::ops::with_role(o.op.stamp(), o.op.kind == crate::plan::OpKind::Send, o.op.root))
                .collect();
            let ready = comm.ready()?;
            ready.set_running(&shown);
            let result = ipc::run_p2p(comm, stream, w.direct, s, &direct_ops);
            // (A failure is published in its place, for peers that ask: not cleared first.)
            if result.is_ok() {
                ready.set_running(&[]);
            }
            result
        }
        // Only this rank's sends to itself and receives from itself (an all-to-all as PyTorch
        // issues it, by sends and receives): they wait for no peer, so they run first, on this
        // thread, rather than on one spawned for them.
        (false, false) if host.iter().all(|(op, _)| op.root == comm.rank) => {
            run_staged(comm, stream, w.staging, &host)?;
            ipc::run_p2p(comm, stream, w.direct, s, &direct_ops)
        }
        (false, false) => {
            let helper = match &mut w.staging.helper {
                Some(h) => h,
                None => w.staging.helper.insert(Helper::start(comm, stream, s.ctx)?),
            };
            helper.jobs.send(host).map_err(|_| Error::internal("the staging thread is gone"))?;
            // Its result is taken even if the direct ones panic (the worker catches that), so
            // that the next batch's is not this one's.
            let pending = Pending(helper);
            let result = ipc::run_p2p(comm, stream, w.direct, s, &direct_ops);
            if let Err(e) = &result {
                // The staged ones may wait for peers that now never come.
                comm.publish_failure(e);
            }
            result.and(pending.result())
        }
    }
}

/// A PreMulSum scalar still in memory (`Op::scalar_at`), into `op.op`: from `pooled` (the
/// pool, where the caller's stream staged it), else read where it is (`to_host`: the caller's
/// stream has reached the operation).
fn read_scalar(stream: &Stream, op: &mut Op, pooled: Option<Region>) -> Result<()> {
    let n = op.dt.size();
    let mut bytes = [0u8; 8];
    match (pooled, op.scalar_at.take()) {
        (Some(r), _) => crate::device::host::copy(Region::owned(&mut bytes[..n]), r),
        (None, Some(p)) => {
            if to_host(stream, Region::owned(&mut bytes[..n]), Region::user(p, 0, n))? {
                stream.synchronize()?;
            }
        }
        (None, None) => return Ok(()),
    }
    let value = crate::device::host::reduce::scalar_from_bytes(op.dt, &bytes[..n])
        .ok_or_else(|| Error::internal("PreMulSum scalar conversion"))?;
    op.op = crate::types::RedOp::PreMulSum(value);
    Ok(())
}

/// The sends of a batch whose buffers a receive of the batch writes into (an in-place
/// exchange: ncclSend and ncclRecv of one buffer in a group), each read whole into host memory
/// now: the receive may land before a peer reading it directly, or the host transports, have
/// read it (`streamed::paths` declined these the direct path). What the caller's stream staged
/// is in carves of its pool, which overlap nothing else (a buffer in host memory it left where
/// it is: `Placement::on_host`). Per operation: the copy of its input, if it took one.
fn take_overwritten_sends(stream: &Stream, ops: &[Op]) -> Result<Vec<Option<Vec<u8>>>> {
    let written = crate::device::host::RegionSet::new(ops.iter().filter(|o| o.kind == OpKind::Recv).map(|o| o.recv));
    let mut taken: Vec<Option<Vec<u8>>> = (0..ops.len()).map(|_| None).collect();
    let mut queued = false;
    for (i, op) in ops.iter().enumerate() {
        if op.kind != OpKind::Send || !written.overlaps(op.send) {
            continue;
        }
        let mut bytes = crate::device::host::zeroed(op.send.len(), &|| format!("a copy of {}", op.describe()))?;
        queued |= to_host(stream, Region::owned(&mut bytes), op.send)?;
        taken[i] = Some(bytes);
    }
    if queued {
        stream.synchronize()?;
    }
    Ok(taken)
}

/// Run the operations with the host transports: those the caller's stream staged (flag set)
/// as they are, and so their buffers in host memory (`on_host`); the others' copied into host
/// staging memory first and their results back.
fn run_staged(comm: &Arc<Comm>, stream: &Stream, staging: &mut Staging, ops: &[(Op, bool)]) -> Result<()> {
    let mut host_ops = Vec::with_capacity(ops.len());
    let staged = |r: Region, pre: bool| !pre && !r.is_empty() && !on_host(r);
    let mut copies = false;
    for (k, &(op, pre)) in ops.iter().enumerate() {
        let send = if staged(op.send, pre) { staging.get(2 * k, op.send.len())? } else { op.send };
        let recv = if staged(op.recv, pre) { staging.get(2 * k + 1, op.recv.len())? } else { op.recv };
        if send.addr() != op.send.addr() {
            stream.copy(send, op.send)?;
            copies = true;
        }
        host_ops.push(Op { send, recv, ..op });
    }
    if copies {
        stream.synchronize()?;
    }
    crate::group::execute_now(comm, &host_ops)?;
    copies = false;
    for ((op, _), h) in ops.iter().zip(&host_ops) {
        if h.recv.addr() != op.recv.addr() {
            stream.copy(op.recv, h.recv)?;
            copies = true;
        }
    }
    if copies { stream.synchronize() } else { Ok(()) }
}

/// `src` into `dst`, plain host memory of the worker's: by this thread if `src` is in host
/// memory too (`on_host`), else queued on `stream`. True: queued (the caller synchronizes).
fn to_host(stream: &Stream, dst: Region, src: Region) -> Result<bool> {
    if on_host(src) {
        crate::device::host::copy(dst, src);
        return Ok(false);
    }
    stream.copy(dst, src).map(|()| true)
}

/// Whether the worker reads and writes `r` itself: host memory (pinned, or pageable in a
/// group with device buffers), which the callers' streams have done with once they reached
/// the operation; no device call for it.
fn on_host(r: Region) -> bool {
    !r.is_empty() && crate::device::cuda::is_host_memory(r.addr())
}
