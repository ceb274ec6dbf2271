//! A call's operations handed to the stream worker ([`submit`]): prepared on the callers'
//! streams (inputs the streams stage, copies of inputs peers cannot read, the start signals),
//! then committed (the gates the streams wait at, the batch queued for the worker), or, in
//! host-wait mode, waited for ([`HostWait`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::inputs::{copy_unreadable_inputs, CopyOut};
use super::pool::{self, plan_caller_staging, Pool};
use super::steps::{self, on_stream_shape};
use super::{alone, board, capture, release_carve, streamed};
use super::{Batch, OnStream, Path, Start, StreamOp, Streamed, Unscaled};
use crate::comm::Comm;
use crate::device::cuda::{Event, KeepCurrent, MemOp, Stream, UserStream, WaitCond};
use crate::device::host::{Region, RegionSet};
use crate::error::{Error, Result};
use crate::plan::{Op, OpKind};
use crate::transport::ipc;

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
    pub(super) comm: Arc<Comm>,
    pub(super) lock: SubmitLock,
    pub(super) callers: Vec<Stream>,
    pub(super) ops: Vec<Op>,
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
    pub(super) caller_of: Vec<usize>,
    pub(super) shapes: Vec<Option<ipc::Shape>>,
    /// Per operation, once the slots are taken (`commit_all`): its slot, if it got one.
    pub(super) direct: Vec<Option<OnStream>>,
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
pub(super) struct SubmitLock(pub(super) Arc<Streamed>);

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
