//! Group semantics. `ncclGroupStart`/`ncclGroupEnd` nest per thread; calls inside a group are
//! recorded and launched together at the outermost `ncclGroupEnd` (one thread may drive every
//! rank of a process this way), and an error in any call is reported again there. A call
//! outside a group is a group of one.

use std::cell::RefCell;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::bootstrap::UniqueId;
use crate::comm::Comm;
use crate::error::{Error, Result};
use crate::plan::Op;
use crate::device::cuda::UserStream;
use crate::streamed::{Placement, StreamOp};

pub mod background;
mod execute;

pub use execute::{execute_now, release_kept_plans};
use execute::{execute, execute_one};

/// Work that needs every rank of the group at once (split, shrink): run in parallel threads.
pub type Deferred = Box<dyn FnOnce() -> Result<()> + Send>;

/// An operation recorded in a group: its communicator, the call's stream, and where its
/// buffers are (CUDA mode: with device memory it runs in stream order).
struct Queued {
    comm: Arc<Comm>,
    op: Op,
    stream: UserStream,
    placement: Placement,
}

#[derive(Default)]
struct Group {
    depth: u32,
    ops: Vec<Queued>,
    inits: Vec<(Arc<Comm>, UniqueId)>,
    deferred: Vec<Deferred>,
    /// One-sided calls (puts, signals, waits), in call order.
    rma: Vec<(Arc<Comm>, crate::api::rma::RmaOp)>,
    error: Option<Error>,
    /// The communicators this thread holds until the group closes (`Comm::hold`): the first
    /// here (most groups have one: no allocation), any others in `held_more`.
    held: Option<crate::comm::Held>,
    held_more: Vec<crate::comm::Held>,
}

thread_local! {
    static GROUP: RefCell<Group> = RefCell::new(Group::default());
}

pub fn depth() -> u32 {
    GROUP.with(|g| g.borrow().depth)
}

pub fn start() -> Result<()> {
    GROUP.with(|g| g.borrow_mut().depth += 1);
    Ok(())
}

/// Take the group's contents if this call closes the outermost group.
fn close() -> Result<Option<Group>> {
    GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 {
            return Err(Error::invalid_usage("ncclGroupEnd called without a matching ncclGroupStart"));
        }
        g.depth -= 1;
        if g.depth > 0 {
            return Ok(None);
        }
        Ok(Some(std::mem::take(&mut *g)))
    })
}

pub fn end() -> Result<()> {
    let Some(group) = close()? else { return Ok(()) };
    if let Some(e) = group.error {
        give_back_numbers(&group.ops);
        for (c, _) in &group.inits {
            c.set_async_error(&e);
        }
        return Err(e);
    }
    // Operations on host buffers of nonblocking communicators only (host mode's one-sided
    // operations too): on a thread of their own.
    if group.inits.is_empty() && group.deferred.is_empty() && (group.rma.is_empty() || !crate::device::mode::is_cuda())
        && !(group.ops.is_empty() && group.rma.is_empty())
        && background::eligible(group.ops.iter().map(|q| (&*q.comm, q.placement.device))
            .chain(group.rma.iter().map(|(c, _)| (&**c, false))))
    {
        return run_in_background(group.ops, group.rma);
    }
    // A nonblocking init finishes in the background (ncclInProgress); the group's other work is
    // on communicators that are ready (an operation on one being initialised fails at its call)
    // and runs now, as in a group without the init.
    let mut init_pending = false;
    if !group.inits.is_empty() {
        let nonblocking = group.inits.iter().any(|(c, _)| !c.config.blocking);
        if nonblocking {
            let inits = group.inits;
            let comms: Vec<Arc<Comm>> = inits.iter().map(|(c, _)| c.clone()).collect();
            crate::abi::stdio::keep_std_fds();
            let spawned = std::thread::Builder::new()
                .name("nccl-rs-init".into())
                .spawn(move || {
                    crate::device::cuda::relax_capture_mode();
                    // Whatever happens, no communicator of the group stays "in progress".
                    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_init_list(&inits)));
                    if let Err(p) = ran {
                        let e = Error::internal(format!("init thread panicked: {}", crate::abi::panic_message(&*p)));
                        inits.iter().for_each(|(c, _)| c.set_async_error(&e));
                    }
                });
            if let Err(e) = spawned {
                let e = Error::os("spawn init thread", e);
                comms.iter().for_each(|c| c.set_async_error(&e));
                return Err(e);
            }
            init_pending = true;
        } else {
            run_init_list(&group.inits)?;
        }
    }
    run_parallel(group.deferred)?;
    // Puts and signals first: they never wait for their targets, and a wait of this group (or
    // of a rank this thread drives) may need them.
    let (waits, issues): (Vec<_>, Vec<_>) = group.rma.into_iter().partition(|(_, op)| op.is_wait());
    // (After what nonblocking communicators still run in the background, as operations.)
    issues.iter().for_each(|(c, _)| background::wait_idle(c));
    issues.iter().try_for_each(|(c, op)| crate::api::rma::run(c, op))?;
    // Host-wait mode may leave the operations of nonblocking communicators to the background
    // (ncclInProgress): the group's waits still run.
    let ran = run_ops(group.ops);
    let ops_pending = matches!(&ran, Err(e) if e.code == crate::error::Code::InProgress);
    if !ops_pending {
        ran?;
    }
    waits.iter().try_for_each(|(c, op)| crate::api::rma::run(c, op))?;
    if init_pending || ops_pending {
        return Err(Error::in_progress());
    }
    Ok(())
}

/// Start a group's operations (and host mode's one-sided operations, in the order a group
/// runs them: puts and signals, operations, waits) in the background (`background`):
/// ncclInProgress.
fn run_in_background(ops: Vec<Queued>, rma: Vec<(Arc<Comm>, crate::api::rma::RmaOp)>) -> Result<()> {
    let comms = distinct(ops.iter().map(|q| &q.comm).chain(rma.iter().map(|(c, _)| c)));
    let ops: Vec<(Arc<Comm>, Op)> = ops.into_iter().map(|q| (q.comm, q.op)).collect();
    let (waits, issues): (Vec<_>, Vec<_>) = rma.into_iter().partition(|(_, op)| op.is_wait());
    background::start(comms, Box::new(move || {
        for (c, _) in &ops {
            crate::streamed::drain(c);
        }
        issues.iter().try_for_each(|(c, op)| crate::api::rma::run(c, op))?;
        if !ops.is_empty() {
            execute(ops)?;
        }
        waits.iter().try_for_each(|(c, op)| crate::api::rma::run(c, op))
    }))
}

/// Each communicator once, in order of first appearance.
fn distinct<'a>(comms: impl Iterator<Item = &'a Arc<Comm>>) -> Vec<Arc<Comm>> {
    let mut out: Vec<Arc<Comm>> = Vec::new();
    for c in comms {
        if !out.iter().any(|k| Arc::ptr_eq(k, c)) {
            out.push(c.clone());
        }
    }
    out
}

/// Host mode: a one-sided operation outside a group on a nonblocking communicator runs in the
/// background after the communicator's earlier operations (ncclInProgress), as they do; on a
/// blocking one, now. Whether it went to the background (else: run it now).
pub fn rma_in_background(comm: &Arc<Comm>, op: crate::api::rma::RmaOp) -> std::result::Result<Result<()>, crate::api::rma::RmaOp> {
    if crate::device::mode::is_cuda() || comm.config.blocking {
        return Err(op);
    }
    Ok(run_in_background(Vec::new(), vec![(comm.clone(), op)]))
}

/// Run the operations of a closed group.
fn run_ops(ops: Vec<Queued>) -> Result<()> {
    // After what nonblocking communicators of the group still run in the background.
    for q in &ops {
        background::wait_idle(&q.comm);
    }
    if !ops.iter().any(|q| q.placement.device) {
        // Host buffers only (no allocation): after what the communicators' streams already hold.
        for q in &ops {
            crate::streamed::drain(&q.comm);
        }
        return execute(ops.into_iter().map(|q| (q.comm, q.op)));
    }
    // A communicator with any operation on device memory runs all of its operations of the
    // group on its stream worker (its sends and receives may pair up with each other). Those
    // are queued first: the worker runs them while this thread runs the others.
    let device_comms: Vec<*const Comm> = ops.iter().filter(|q| q.placement.device).map(|q| Arc::as_ptr(&q.comm)).collect();
    let comms = distinct(ops.iter().map(|q| &q.comm));
    let (on_stream, host): (Vec<Queued>, Vec<Queued>) =
        ops.into_iter().partition(|q| device_comms.contains(&Arc::as_ptr(&q.comm)));
    let mut per_comm: Vec<(Arc<Comm>, Vec<StreamOp>)> = Vec::new();
    for q in on_stream {
        let o = StreamOp { op: q.op, stream: q.stream, placement: q.placement };
        match per_comm.iter_mut().find(|(c, _)| Arc::ptr_eq(c, &q.comm)) {
            Some((_, v)) => v.push(o),
            None => per_comm.push((q.comm, vec![o])),
        }
    }
    // Every communicator's part prepared (inputs staged, start events recorded) before any is
    // committed (streams made to wait): streams may share a hardware queue. Preparing holds
    // each communicator's submit lock until its commit: taken in one global order.
    per_comm.sort_by_key(|(c, _)| Arc::as_ptr(c) as usize);
    // The caller's CUDA state kept once for all of it (`KeepCurrent`: the steps' scopes nest).
    let keep = crate::device::cuda::KeepCurrent::new();
    let mut prepared = Vec::with_capacity(per_comm.len());
    for (c, ops) in per_comm {
        let p = crate::streamed::prepare(&c, ops).map_err(|e| e.context(format!("rank {}", c.rank)))?;
        prepared.extend(p.map(|p| (c.rank, p)));
    }
    let host_waits = crate::streamed::commit_all(prepared)?;
    drop(keep);
    // Host-wait mode on nonblocking communicators only: the waits (and the host-buffer part)
    // in the background, and ncclInProgress until they are done, instead of this call waiting.
    if !host_waits.is_empty() && comms.iter().all(|c| !c.config.blocking) {
        let host: Vec<(Arc<Comm>, Op)> = host.into_iter().map(|q| (q.comm, q.op)).collect();
        return background::start_anyway(comms, Box::new(move || {
            for (c, _) in &host {
                crate::streamed::drain(c);
            }
            let hosted = execute(host);
            host_waits.into_iter().for_each(crate::streamed::HostWait::wait);
            hosted
        }));
    }
    for q in &host {
        crate::streamed::drain(&q.comm);
    }
    // Host-wait mode: waited for only once every communicator's part is in, host-buffer
    // parts included (ranks of this thread may need each other's).
    let hosted = execute(host.into_iter().map(|q| (q.comm, q.op)));
    // Even when the host part failed: the queued parts' results are copied out only here.
    let waited = host_waited(&comms, host_waits);
    hosted.and(waited)
}

/// Host-wait mode: the call returns once its operations are done, so one that failed on the
/// stream worker fails the call, as well as setting the asynchronous error (all NCCL does, on
/// a stream): a caller must not take a result for complete that is not.
fn host_waited(comms: &[Arc<Comm>], waits: Vec<crate::streamed::HostWait>) -> Result<()> {
    if waits.is_empty() {
        return Ok(());
    }
    waits.into_iter().for_each(crate::streamed::HostWait::wait);
    comms.iter().find_map(|c| c.async_error()).map_or(Ok(()), Err)
}

/// Run now outside a group; inside one, at the outermost ncclGroupEnd, concurrently with the
/// group's other deferred work (one thread may be driving several ranks).
pub fn run_or_defer(work: Deferred) -> Result<()> {
    let mut work = Some(work);
    GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth > 0 {
            if let Some(w) = work.take() {
                g.deferred.push(w);
            }
        }
    });
    match work {
        Some(w) => w(),
        None => Ok(()),
    }
}

/// Run each piece on a thread of its own and wait for all; the first error wins.
pub fn run_parallel(work: Vec<Deferred>) -> Result<()> {
    if work.len() <= 1 {
        return work.into_iter().try_for_each(|w| w());
    }
    // The threads below make descriptors while others read files: 0, 1 and 2 are filled first,
    // while this thread is the library's only one (see `abi::stdio::lifted`).
    crate::abi::stdio::keep_std_fds();
    let results: Vec<Result<()>> = std::thread::scope(|s| {
        // A piece whose thread cannot start fails (the others still run, and time out or
        // fail on their own if they needed it).
        let shown = crate::debug::shown_rank();
        let joins: Vec<_> = work.into_iter().map(|w| std::thread::Builder::new().name("nccl-rs-group".into())
            .spawn_scoped(s, move || {
                crate::debug::set_rank(shown);
                w()
            })).collect();
        joins.into_iter().map(|j| match j {
            Ok(j) => j.join().unwrap_or_else(|_| Err(Error::internal("group thread panicked"))),
            Err(e) => Err(Error::os("spawn a group thread", e)),
        }).collect()
    });
    results.into_iter().collect()
}

/// A group closed without running (an error in one of its calls, or ncclGroupSimulateEnd):
/// its collectives took their communicators' next numbers at their calls, which the next
/// calls take again, as they would on a rank that never made the dropped ones. (Collectives
/// are numbered alike on every rank; a communicator's calls come from one thread at a time,
/// so a communicator's dropped numbers are the last it gave.)
fn give_back_numbers(ops: &[Queued]) {
    for q in ops.iter().filter(|q| !q.op.kind.is_p2p()) {
        q.comm.seq.fetch_min(q.op.seq, Ordering::Relaxed);
    }
}

fn run_init_list(inits: &[(Arc<Comm>, UniqueId)]) -> Result<()> {
    crate::api::init::run_together(inits)
}

/// ncclGroupSimulateEnd: close the group without running it and estimate its time (seconds):
/// a latency per operation plus its bytes at host memory bandwidth.
pub fn simulate_end() -> Result<f32> {
    let Some(group) = close()? else { return Ok(0.0) };
    give_back_numbers(&group.ops);
    if let Some(e) = group.error {
        return Err(e);
    }
    const LATENCY_S: f64 = 5e-6;
    const BYTES_PER_S: f64 = 5e9;
    let t: f64 = group.ops.iter().map(|Queued { op, .. }| LATENCY_S + (op.send.len().max(op.recv.len()) as f64) / BYTES_PER_S).sum();
    Ok(t as f32)
}

pub fn add_init(comm: Arc<Comm>, id: UniqueId) {
    GROUP.with(|g| g.borrow_mut().inits.push((comm, id)));
}

/// Record an error of a call made inside a group, to report it at the outermost end too.
pub fn record_error(e: &Error) {
    GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth > 0 && g.error.is_none() {
            g.error = Some(e.clone());
        }
    });
}

/// Record a one-sided call in the open group; outside a group it comes back, to run now.
pub fn add_rma(comm: Arc<Comm>, op: crate::api::rma::RmaOp) -> Option<(Arc<Comm>, crate::api::rma::RmaOp)> {
    GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth > 0 {
            g.rma.push((comm, op));
            None
        } else {
            Some((comm, op))
        }
    })
}

/// Record an operation in the open group, or run it now. `held`: the communicator, held by
/// this thread for the call (outside a group) or until the group closes.
pub fn add_op(comm: Arc<Comm>, op: Op, stream: UserStream, placement: Placement,
              held: Option<crate::comm::Held>) -> Result<()> {
    let mut held = held;
    let queued = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth > 0 {
            g.ops.push(Queued { comm: comm.clone(), op, stream, placement });
            if let Some(h) = held.take() {
                match g.held {
                    None => g.held = Some(h),
                    Some(_) => g.held_more.push(h),
                }
            }
            true
        } else {
            false
        }
    });
    if queued {
        return Ok(());
    }
    if background::eligible(std::iter::once((&*comm, placement.device))) {
        return run_in_background(vec![Queued { comm, op, stream, placement }], Vec::new());
    }
    background::wait_idle(&comm);
    if placement.device {
        let o = StreamOp { op, stream, placement };
        return match crate::streamed::submit(&comm, vec![o])? {
            // Host-wait mode on a nonblocking communicator: waited for in the background.
            Some(w) if !comm.config.blocking => background::start_anyway(vec![comm], Box::new(move || {
                w.wait();
                Ok(())
            })),
            w => host_waited(std::slice::from_ref(&comm), w.into_iter().collect()),
        };
    }
    crate::streamed::drain(&comm);
    execute_one(comm, op)
}

fn describe(ops: &[Op]) -> String {
    match ops {
        [] => "empty group".into(),
        [one] => one.describe(),
        [first, rest @ ..] => format!("{} and {} more operation(s) in the group", first.describe(), rest.len()),
    }
}
