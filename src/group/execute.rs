//! Running a group's host-mode operations on the calling thread: each communicator's part
//! planned (plans and their scratch kept per thread for the next calls: [`Work`]), its
//! connections made, and the progress engine run over all of them at once.

use std::cell::RefCell;
use std::sync::Arc;
use std::time::Instant;

use crate::algo;
use crate::comm::Comm;
use crate::error::{Error, Result};
use crate::params;
use crate::plan::{ops::{renumber, replan}, Builder, Op, Step};
use crate::proxy::{self, Job, JobBufs};
use crate::transport::{self, Ctx};

use super::describe;

/// One communicator's part of a run, kept per thread from one call to the next so that a
/// repeated call plans and runs without allocating.
struct Slot {
    comm: Option<Arc<Comm>>,
    ops: Vec<Op>,
}

/// The memory a communicator's run plans and progresses in (any slot's will do).
#[derive(Default)]
struct Work {
    /// The plans of the calls run lately: a loop that alternates a few calls (a step's
    /// all-reduce and a barrier, a model's buckets) reuses each one's plan.
    kept: Vec<Kept>,
    /// The one in use.
    cur: usize,
    /// Runs planned here, to tell the least recently used plan.
    runs: u64,
}

/// A plan, with the job bookkeeping filled from it.
#[derive(Default)]
struct Kept {
    plan: Builder,
    job: JobBufs,
    /// The run that last used it ([`Work::runs`]).
    used: u64,
}

/// Plans a [`Work`] keeps.
const KEPT_PLANS: usize = 4;
/// A plan not in use for more than SPARE_RUNS runs holds at most this much memory (its units,
/// and scratch for PreMulSum's scaled inputs, copies of overlapping ones, partial sums): a
/// larger one is let go, so that the plans kept cost little. One used lately keeps its memory:
/// a loop that alternates a call needing scratch with another (a step and the perf tool's
/// barrier, FSDP's reduce-scatter and all-gather) would otherwise allocate and fault in fresh
/// scratch every time (nccl-rs-perf reducescatter -t 4, 4 MiB: 4207 -> 1678 us;
/// NCCL_ALGO=Tree allreduce -t 2, 1 MiB: 1354 -> 500 us).
const SPARE_BYTES: usize = 256 << 10;
const SPARE_RUNS: u64 = 16;

impl Work {
    /// Plan `ops`: the kept plan that fits them put in use if one does, else a new one or the
    /// least recently used planned anew.
    fn plan(&mut self, rank: usize, nranks: usize, slice: usize, ops: &[Op], algo: Option<algo::Algo>) -> Result<()> {
        self.runs += 1;
        let fits = |k: &Kept| k.plan.fits(rank, nranks, slice, ops, algo);
        let found = match self.kept.get(self.cur) {
            Some(k) if fits(k) => Some(self.cur),
            _ => self.kept.iter().position(fits),
        };
        let at = match found {
            Some(at) => at,
            // A group that is planned anew every time (a large group of sends and receives)
            // takes the plan in use, whose memory it reuses.
            None if !crate::plan::ops::reusable(ops) && self.cur < self.kept.len() => self.cur,
            None if self.kept.len() < KEPT_PLANS => {
                self.kept.push(Kept::default());
                self.kept.len() - 1
            }
            None => self.kept.iter().enumerate().min_by_key(|(_, k)| k.used).map_or(0, |(i, _)| i),
        };
        self.cur = at;
        let runs = self.runs;
        self.current().used = runs;
        for stale in self.kept.iter_mut().filter(|k| runs - k.used > SPARE_RUNS && k.plan.held_bytes() > SPARE_BYTES) {
            stale.plan.release();
        }
        let k = self.current();
        match found {
            Some(_) => {
                renumber(&mut k.plan, ops);
                Ok(())
            }
            None => replan(&mut k.plan, rank, nranks, slice, ops, algo),
        }
    }

    /// The plan in use.
    fn current(&mut self) -> &mut Kept {
        if self.cur >= self.kept.len() {
            self.kept.push(Kept::default());
            self.cur = self.kept.len() - 1;
        }
        &mut self.kept[self.cur]
    }

    /// The plan in use, if there is one yet.
    fn in_use(&self) -> Option<&Builder> {
        self.kept.get(self.cur).map(|k| &k.plan)
    }
}

#[derive(Default)]
struct Workspace {
    slots: Vec<Slot>,
    work: Vec<Work>,
    live: usize,
}

impl Workspace {
    fn add(&mut self, comm: Arc<Comm>, op: Op) {
        if let Some(s) = self.slots[..self.live].iter_mut().find(|s| s.comm.as_ref().is_some_and(|c| Arc::ptr_eq(c, &comm))) {
            s.ops.push(op);
            return;
        }
        if self.live == self.slots.len() {
            self.slots.push(Slot { comm: None, ops: Vec::new() });
            self.work.push(Work::default());
        }
        let s = &mut self.slots[self.live];
        s.comm = Some(comm);
        s.ops.push(op);
        self.live += 1;
    }

    /// Drop this run's communicators and operations; keep the memory.
    fn release(&mut self) {
        for s in &mut self.slots[..self.live] {
            s.comm = None;
            s.ops.clear();
        }
        self.live = 0;
    }
}

thread_local! {
    static WORKSPACE: RefCell<Workspace> = RefCell::new(Workspace::default());
}

/// A communicator destroyed or aborted on this thread: the plans this thread kept give their
/// memory back (scratch kept for calls that may never come again). They may be another
/// communicator's too, whose next call then plans afresh.
pub fn release_kept_plans() {
    WORKSPACE.with(|w| {
        if let Ok(mut ws) = w.try_borrow_mut() {
            for work in &mut ws.work {
                (work.kept, work.cur) = (Vec::new(), 0);
            }
        }
    });
}

/// One item or several, without allocating for one (the common case: one communicator).
enum Few<T> {
    One([T; 1]),
    Many(Vec<T>),
}

impl<T> Few<T> {
    fn collect(mut it: impl Iterator<Item = T>) -> Few<T> {
        let Some(first) = it.next() else { return Few::Many(Vec::new()) };
        let Some(second) = it.next() else { return Few::One([first]) };
        let mut v = vec![first, second];
        v.extend(it);
        Few::Many(v)
    }
    fn as_mut_slice(&mut self) -> &mut [T] {
        match self {
            Few::One(a) => a,
            Few::Many(v) => v,
        }
    }
}

/// Plan, connect and run the operations of one group, every communicator together.
pub(super) fn execute(ops: impl IntoIterator<Item = (Arc<Comm>, Op)>) -> Result<()> {
    let mut ops = ops.into_iter().peekable();
    if ops.peek().is_none() {
        return Ok(());
    }
    with_workspace(|ws| {
        for (c, op) in ops {
            ws.add(c, op);
        }
    })
}

/// Run operations of one communicator now, on this thread (the stream worker's way in).
pub fn execute_now(comm: &Arc<Comm>, ops: &[Op]) -> Result<()> {
    with_workspace(|ws| {
        for op in ops {
            ws.add(comm.clone(), *op);
        }
    })
}

/// Run one operation issued outside a group.
pub(super) fn execute_one(comm: Arc<Comm>, op: Op) -> Result<()> {
    with_workspace(|ws| ws.add(comm, op))
}

fn with_workspace(fill: impl FnOnce(&mut Workspace)) -> Result<()> {
    let run = |ws: &mut Workspace| {
        // (What a run that panicked left behind, caught at the C boundary: never run again.)
        ws.release();
        fill(ws);
        let result = run_workspace(ws);
        ws.release();
        result
    };
    // Borrowed for the run (one thread-local access: each costs a small call about 2%). A run
    // never starts another on this thread; if it did, that one would get a fresh workspace.
    WORKSPACE.with(|w| match w.try_borrow_mut() {
        Ok(mut ws) => run(&mut ws),
        Err(_) => run(&mut Workspace::default()),
    })
}

fn run_workspace(ws: &mut Workspace) -> Result<()> {
    // Per communicator, in issue order; communicators ordered by address so two threads
    // locking overlapping sets never deadlock.
    ws.slots[..ws.live].sort_by_key(|s| s.comm.as_ref().map_or(0, |c| Arc::as_ptr(c) as usize));
    let slots = &ws.slots[..ws.live];
    let work = &mut ws.work[..ws.live];
    say_algo_once();

    let mut comms: Few<&Comm> = Few::collect(slots.iter().filter_map(|s| s.comm.as_deref()));
    let comms = comms.as_mut_slice();
    for ((s, w), c) in slots.iter().zip(work.iter_mut()).zip(comms.iter()) {
        let ready = c.ready()?;
        // What every rank of the communicator forces (`Ready::algo`).
        w.plan(c.rank, c.nranks, ready.slice, &s.ops, ready.algo)?;
    }
    // Every communicator was ready above, and a ready part, once set, stays.
    let mut guards = Few::collect(comms.iter().filter_map(|c| c.ready_if_any().map(|r| r.conns())));
    let guards = guards.as_mut_slice();
    if guards.len() != comms.len() {
        return Err(Error::internal("a communicator lost its connections while planning"));
    }

    // (The jobs publish what they run once they wait: `Job::publish`.)
    if let Err(e) = connect(comms, work, guards) {
        // As a failed run below: the communicators are in error, say why to peers that ask
        // (a peer waiting on an established connection learns it when the connection closes),
        // and close their connections so nobody waits on them.
        for (c, g) in comms.iter().zip(guards.iter_mut()) {
            if let Some(r) = c.ready_if_any() {
                r.set_running(&[]);
                r.set_failed(&e);
            }
            g.close_all();
            c.set_async_error(&e);
        }
        return Err(e);
    }

    let mut jobs = Few::collect(comms.iter().zip(guards.iter_mut()).zip(work.iter_mut()).map(|((c, g), w)| {
        let k = w.current();
        Job::new(c, g, (k.plan.plan_id(), &k.plan.units, &k.plan.stamps), &crate::plan::ops::describe_stamp, &mut k.job)
    }));
    let jobs = jobs.as_mut_slice();
    let result = proxy::run(jobs);
    let failed_peer = result.as_ref().err().and_then(|(j, _)| jobs[*j].failed_peer);
    for c in comms.iter() {
        if let Some(r) = c.ready_if_any() {
            r.set_running(&[]);
        }
    }
    let Err((j, e)) = result else { return Ok(()) };
    let c = comms[j];
    let (e, lost) = name_the_culprit(c, e, failed_peer);
    let e = e.context(format!("rank {}: {}", c.rank, describe(&slots[j].ops)));
    // The connections are in an unknown state: close them so peers stop waiting, and keep
    // the error for ncclCommGetAsyncError.
    if let Some(r) = c.ready_if_any() {
        r.set_failed(&e);
    }
    if e.code == crate::Code::RemoteError {
        c.tell_failure(&e, &lost.iter().map(|(p, _)| *p).collect::<Vec<_>>());
    }
    jobs[j].conns.close_all();
    c.set_async_error(&e);
    Err(e)
}

/// Says once, at INFO, what NCCL_ALGO asks of all-reduces. (The flag first: reading the
/// variable on every group cost an 8-byte all-reduce 3%.)
fn say_algo_once() {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if let Some(v) = crate::debug::first_time(&SAID).then(|| params::raw("NCCL_ALGO")).flatten() {
        match algo::parse_algo(&v) {
            Some(algo::Algo::Ring) => crate::info!(TUNING, "NCCL_ALGO={v}: every all-reduce by ring"),
            Some(algo::Algo::Tree) => crate::info!(TUNING, "NCCL_ALGO={v}: every all-reduce by recursive doubling (Tree)"),
            None => crate::info!(TUNING, "NCCL_ALGO={v}: all-reduce algorithm chosen by size (ring and tree allowed)"),
        }
    }
}

/// The error `e` of a run of `c` that failed (`failed_peer`: the peer whose connection failed,
/// if one did), with the rank to blame named, and the peers found gone (told of this failure).
fn name_the_culprit(c: &Comm, mut e: Error, failed_peer: Option<usize>) -> (Error, Vec<(usize, String)>) {
    // A peer that stopped on an error of its own closed its connections: its reason is
    // the real one (a mismatch it detected, a peer it lost).
    let mut lost = Vec::new();
    if e.code == crate::Code::RemoteError {
        // A peer whose connection failed is aborting (its reason is asked for) or exiting (it
        // is found gone once a zombie); a survivor that reacted to a lost rank may close its
        // connections before that rank is found gone. So both are asked again for a while,
        // to name the culprit rather than the peer that passed its failure on.
        let settle = std::time::Instant::now() + std::time::Duration::from_secs(2);
        loop {
            if let Some(theirs) = failed_peer.and_then(|p| c.peer_failure(p)) {
                e = theirs;
                if e.code == crate::Code::RemoteError {
                    lost = c.lost_peers();
                }
                break;
            }
            lost = c.lost_peers();
            if !lost.is_empty() || failed_peer.is_none() || std::time::Instant::now() >= settle {
                break;
            }
            // Its bootstrap service refuses (and no peer is found gone): it destroyed or aborted
            // its communicator, as the transport's message says, or its process is ending (not
            // yet found gone). If it failed, it told this rank why before it closed: that news
            // may be still unread (it reacted to a rank this rank does not yet find gone).
            if let Some(p) = failed_peer.filter(|&p| c.peer_closed(p).is_some()) {
                if let Some(theirs) = c.told_failure_within(p) {
                    e = theirs;
                    lost = c.lost_peers();
                }
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
    if e.code == crate::Code::RemoteError {
        // Name the culprit: the peer this rank waited on may only have reacted to it.
        if !lost.is_empty() {
            let names: Vec<String> = lost.iter().map(|(p, why)| format!("{} ({why})", c.describe_peer(*p))).collect();
            e = crate::Error::remote(format!("lost {}; this rank saw: {}", names.join(", "), e.msg));
        } else if let Some(p) = failed_peer {
            // A process still exiting is not yet found gone (kill(0) and /proc say alive until
            // it is a zombie) though the transport already saw it go: name the peer whose
            // connection failed, so ranks that quote this message name it too.
            e = crate::Error::remote(format!("{}: {}", c.describe_peer(p), e.msg));
        }
    }
    (e, lost)
}

/// Accept `peer`'s connection; while it does not come, ask the peer what it runs, so two
/// ranks that wait for each other in different operations get an error, not a hang.
fn accept_watching(c: &Comm, plan: &crate::plan::Builder, ctx: &Ctx<'_>, conns: &mut transport::Conns, peer: usize) -> Result<()> {
    let mine = plan.units.iter().find_map(|u| match u.step {
        Step::Recv { peer: p, .. } | Step::RecvReduce { peer: p, .. } if p as usize == peer => {
            Some(crate::plan::ops::with_role(plan.stamps[u.op as usize], false, peer))
        }
        _ => None,
    });
    let started = Instant::now();
    // The ranks named (once each: a later look may find what holds the peer up).
    let mut named: Vec<usize> = Vec::new();
    let mut unreachable_since: Option<Instant> = None;
    // Set once the peer is found gone or closed: what it offered just before it went may still
    // be on its way to this rank's bootstrap service, so one more slice is waited for it.
    let mut hopeless: Option<crate::Error> = None;
    loop {
        let slice_end = (Instant::now() + std::time::Duration::from_secs(1)).min(ctx.deadline);
        let attempt = Ctx { deadline: slice_end, ..*ctx };
        match transport::accept(&attempt, conns, peer) {
            // Revoked (ncclCommRevoke, or a shrink with NCCL_SHRINK_ABORT) while waiting for a
            // peer that never connects: stop, as every other wait of an operation does.
            Err(e) if e.code == crate::Code::Timeout && c.revoked.load(std::sync::atomic::Ordering::Acquire) => {
                return Err(crate::Error::invalid_usage(format!(
                    "communicator revoked while waiting for {} to connect", c.describe_peer(peer))));
            }
            Err(e) if e.code == crate::Code::Timeout && Instant::now() < ctx.deadline => {
                if let Some(e) = hopeless {
                    return Err(e);
                }
                if let Some(mine) = mine {
                    let describe = &crate::plan::ops::describe_stamp;
                    // Asked every slice (a mismatch is an error whenever it shows); said once, as the
                    // progress engine's watch does for a peer already connected.
                    let runs = c.peer_runs(peer, &mine, describe)?;
                    // No status: a peer that is gone never connects (the wait may have no limit).
                    if !runs.answered() {
                        if let Some((why, certain)) = c.peer_gone(peer) {
                            let since = *unreachable_since.get_or_insert_with(Instant::now);
                            if certain || since.elapsed() >= params::peer_timeout() {
                                hopeless = Some(crate::Error::remote(format!(
                                    "lost {} ({why}) while waiting for its first connection", c.describe_peer(peer))));
                            }
                        } else if let Some(why) = c.peer_closed(peer) {
                            // Its process goes on, without this communicator. (The caller's
                            // context names the peer.)
                            hopeless = Some(crate::Error::remote(format!(
                                "it destroyed or aborted its communicator ({why}) before connecting to this rank: it \
                                 will not make this call")));
                        }
                    } else {
                        unreachable_since = None;
                    }
                    let culprit = runs.culprit(peer);
                    if let Some(why) = runs.why_waiting(&mine, describe).filter(|_| !named.contains(&culprit)) {
                        named.push(culprit);
                        crate::warn!("rank {}: waited {} s in {} for {}, {why}",
                                     c.rank, started.elapsed().as_secs(), describe(&mine), c.describe_peer(peer));
                    }
                }
            }
            // A peer whose connection is gone may have failed: its reason is the one to give.
            Err(e) if e.code == crate::Code::RemoteError => return Err(c.peer_failure(peer).unwrap_or(e)),
            other => return other,
        }
    }
}

fn connect(comms: &[&Comm], work: &[Work], guards: &mut [std::sync::MutexGuard<'_, transport::Conns>]) -> Result<()> {
    // Usually every connection exists already: check without allocating or reading the clock.
    let connected = work.iter().zip(guards.iter()).all(|(w, g)| w.in_use().map_or(&[][..], |p| &p.units).iter().all(|u| match u.step {
        Step::Send { peer, .. } => g.has_send(peer as usize),
        Step::Recv { peer, .. } | Step::RecvReduce { peer, .. } => g.has_recv(peer as usize),
        _ => true,
    }));
    if connected {
        return Ok(());
    }
    // Connecting waits on peers: what this rank runs is published first, for peers that ask.
    for (c, w) in comms.iter().zip(work) {
        if let (Some(r), Some(p)) = (c.ready_if_any(), w.in_use()) {
            r.set_running_plan(&p.units, &p.stamps);
        }
    }
    // (Rings, shared files and sockets are made next: none may take stdout's number.)
    crate::abi::stdio::keep_std_fds();
    let deadline = params::init_deadline();
    let peers_of = |p: &crate::plan::Builder, want_send: bool| {
        let mut v: Vec<usize> = p.units.iter().filter_map(|u| match (u.step, want_send) {
            (Step::Send { peer, .. }, true) => Some(peer as usize),
            (Step::Recv { peer, .. } | Step::RecvReduce { peer, .. }, false) => Some(peer as usize),
            _ => None,
        }).collect();
        v.sort_unstable();
        v.dedup();
        v
    };
    for phase_send in [true, false] {
        for ((c, w), g) in comms.iter().zip(work).zip(guards.iter_mut()) {
            let Some(p) = w.in_use() else { continue };
            let ready = c.ready()?;
            let ctx = Ctx { rank: c.rank, hash: c.hash, peers: &ready.peers, service: &ready.service,
                            slice: ready.slice, abort: &c.abort, deadline };
            for peer in peers_of(p, phase_send) {
                let r = if phase_send { transport::offer(&ctx, g, peer) } else { accept_watching(c, p, &ctx, g, peer) };
                r.map_err(|e| e.context(format!("rank {}: connecting to {}", c.rank, c.describe_peer(peer))))?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::host::Region;
    use crate::plan::OpKind;
    use crate::types::{BuiltinOp, DataType, RedOp};

    /// A loop that alternates a few calls (a step and a barrier) reuses each one's plan; the
    /// plans kept are few, and those not in use hold little memory.
    #[test]
    fn alternating_calls_reuse_their_plans() {
        let mut buf = vec![0u8; 4 << 20];
        let r = Region::owned(&mut buf);
        let call = |k: usize, count: usize, op| [Op { kind: OpKind::AllReduce, dt: DataType::Float32, op, count, root: 0,
            send: r.sub(0, count * 4), recv: r.sub(k * 64, count * 4), seq: k as u64, scalar_at: None, of: None }];
        let sum = RedOp::Builtin(BuiltinOp::Sum);
        let mut w = Work::default();
        let plan = |w: &mut Work, ops: &[Op]| {
            w.plan(0, 2, 4096, ops, None).expect("a plan");
            w.current().plan.plan_id()
        };
        let (a, b) = (plan(&mut w, &call(1, 2, sum)), plan(&mut w, &call(2, 2, sum)));
        assert_ne!(a, b);
        for _ in 0..3 {
            assert_eq!((plan(&mut w, &call(1, 2, sum)), plan(&mut w, &call(2, 2, sum))), (a, b));
        }
        for k in 3..10 {
            plan(&mut w, &call(k, 2, sum));
        }
        assert_eq!(w.kept.len(), KEPT_PLANS);
        assert_ne!(plan(&mut w, &call(1, 2, sum)), a, "the least recently used plans were let go");
        // An input that overlaps its output 64 bytes further on is read from a copy: 4 MiB of
        // scratch, kept while the call comes back (alternating with a barrier), let go once out
        // of use for SPARE_RUNS runs.
        let overlapping = call(1, (1 << 20) - 16, sum);
        let big = plan(&mut w, &overlapping);
        assert!(w.current().plan.held_bytes() >= (4 << 20) - 64);
        for _ in 0..3 {
            plan(&mut w, &call(1, 2, sum));
            assert_eq!(plan(&mut w, &overlapping), big, "the overlapping call's plan, kept with its scratch");
        }
        for _ in 0..SPARE_RUNS {
            plan(&mut w, &call(1, 2, sum));
        }
        assert!(w.kept.iter().any(|k| k.plan.held_bytes() > SPARE_BYTES), "let go only after SPARE_RUNS runs");
        plan(&mut w, &call(1, 2, sum));
        assert!(w.kept.iter().all(|k| k.plan.held_bytes() <= SPARE_BYTES));
        // A group of more operations than are kept for reuse is planned anew each time, in the
        // plan in use (its memory kept), and the plans kept stay.
        let many: Vec<Op> = (0..8).map(|k| Op { kind: if k % 2 == 0 { OpKind::Send } else { OpKind::Recv }, root: 1,
            seq: 0, ..call(k + 1, 1 << 16, sum)[0] }).collect();
        let before: Vec<u64> = w.kept.iter().map(|k| k.plan.plan_id()).collect();
        plan(&mut w, &many);
        let (cur, held) = (w.cur, w.current().plan.held_bytes());
        assert!(held > SPARE_BYTES);
        for _ in 0..3 {
            plan(&mut w, &many);
            assert_eq!((w.cur, w.current().plan.held_bytes()), (cur, held), "the same plan's memory, reused");
        }
        let after: Vec<u64> = w.kept.iter().map(|k| k.plan.plan_id()).collect();
        assert_eq!(before.iter().zip(&after).filter(|(b, a)| b != a).count(), 1, "only the plan in use was replaced");

        // A communicator destroyed on this thread: the thread's kept plans and their scratch go.
        WORKSPACE.with(|ws| ws.borrow_mut().work.push(w));
        let held = || WORKSPACE.with(|ws| {
            ws.borrow().work.iter().flat_map(|w| &w.kept).map(|k| k.plan.held_bytes()).sum::<usize>()
        });
        assert!(held() > SPARE_BYTES);
        release_kept_plans();
        assert_eq!(held(), 0);
        let mut w = WORKSPACE.with(|ws| ws.borrow_mut().work.pop()).expect("the work pushed above");
        plan(&mut w, &call(1, 2, sum));
        assert_eq!(w.kept.len(), 1, "the next call planned afresh, in a new plan");
    }
}
