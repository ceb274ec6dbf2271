//! The progress engine: executes planned units for one or several communicators at once
//! (one thread may drive every rank of a process). Each connection's sends, receives and the
//! local work advance in order as far as their dependencies and the transports allow; nothing
//! blocks on one peer while another could move. Waiting spins briefly (not where its CPU is
//! shared: [`Spin`]), then yields, then naps, and regularly checks the abort flag and that the
//! peers it waits for are alive.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::comm::Comm;
use crate::device::host;
use crate::error::{Error, Result};
use crate::plan::{Step, Unit, NO_DEP};
use crate::transport::{Conns, Sent, Stamp};

mod spin;
pub(crate) use spin::{pause, Backoff};
use spin::{cpu_not_shared, timed_yield, Spin, SLOW_YIELD_NAP};

/// A queue of unit indices (or posted tokens) for one peer, kept across runs.
struct Queue<T> {
    peer: usize,
    items: Vec<T>,
    head: usize,
}

impl<T: Copy> Queue<T> {
    fn front(&self) -> Option<T> {
        self.items.get(self.head).copied()
    }
    fn pop_front(&mut self) {
        self.head += 1;
    }
    fn len(&self) -> usize {
        self.items.len() - self.head
    }
}

/// Per-peer queues. Entries past `live` are spare, kept with their memory for the next run so
/// a repeated call allocates nothing.
struct Queues<T> {
    qs: Vec<Queue<T>>,
    live: usize,
}

impl<T> Default for Queues<T> {
    fn default() -> Self {
        Queues { qs: Vec::new(), live: 0 }
    }
}

impl<T: Copy> Queues<T> {
    /// Every live queue back to its first item (the same units run again).
    fn rewind(&mut self) {
        for q in &mut self.qs[..self.live] {
            q.head = 0;
        }
    }
    fn clear(&mut self) {
        for q in &mut self.qs[..self.live] {
            q.items.clear();
            q.head = 0;
        }
        self.live = 0;
    }
    fn push(&mut self, peer: usize, item: T) {
        if let Some(q) = self.qs[..self.live].iter_mut().find(|q| q.peer == peer) {
            q.items.push(item);
            return;
        }
        if self.live == self.qs.len() {
            self.qs.push(Queue { peer, items: Vec::new(), head: 0 });
        }
        let q = &mut self.qs[self.live];
        q.peer = peer;
        q.items.push(item);
        self.live += 1;
    }
    fn active(&self) -> impl Iterator<Item = &Queue<T>> {
        self.qs[..self.live].iter().filter(|q| q.len() > 0)
    }
    /// Those whose items are all done.
    fn done(&self) -> impl Iterator<Item = &Queue<T>> {
        self.qs[..self.live].iter().filter(|q| q.len() == 0)
    }
    fn pending(&self) -> bool {
        self.active().next().is_some()
    }
    fn for_peer(&self, peer: usize) -> usize {
        self.qs[..self.live].iter().find(|q| q.peer == peer).map_or(0, |q| q.len())
    }
}

/// The memory a job's bookkeeping lives in, reused from one run to the next.
#[derive(Default)]
pub struct JobBufs {
    done: Vec<bool>,
    /// Units of each operation not yet done: a send or receive whose last is done is taken out
    /// of what the rank publishes as running (`Ready::finished`).
    op_left: Vec<u32>,
    sends: Queues<u32>,
    /// Sends the peer reads itself (single copy), by peer: (unit, token), oldest first.
    posted: Queues<(u32, u64)>,
    recvs: Queues<u32>,
    local: Queues<u32>,
    /// The plan (`Builder::plan_id`) the queues above were filled from, and whether it reduces
    /// incoming data: a plan run again rewinds them rather than sorting its units anew.
    filled_from: Option<(u64, bool)>,
}

/// One communicator's work in a run.
pub struct Job<'a> {
    pub comm: &'a Comm,
    pub conns: &'a mut Conns,
    units: &'a [Unit],
    stamps: &'a [Stamp],
    /// Puts a stamp into words for a mismatch message.
    describe: &'a dyn Fn(&Stamp) -> String,
    b: &'a mut JobBufs,
    /// Does the job reduce incoming data (then one single-copy message per connection)?
    reducing: bool,
    remaining: usize,
    /// The peer whose connection failed, if that is how the job failed.
    pub failed_peer: Option<usize>,
    /// Ranks a watch has said this rank waits on: peers, or the rank a peer is held up by
    /// (`PeerRuns::culprit`; said once each).
    named: Vec<usize>,
    /// Whether the job's operations are published as running ([`Job::publish`]).
    published: bool,
}

impl<'a> Job<'a> {
    /// `plan`: what `units` and `stamps` are (`Builder::plan_id`).
    pub fn new(comm: &'a Comm, conns: &'a mut Conns, plan: (u64, &'a [Unit], &'a [Stamp]),
               describe: &'a dyn Fn(&Stamp) -> String, b: &'a mut JobBufs) -> Job<'a> {
        let (plan_id, units, stamps) = plan;
        b.done.clear();
        b.done.resize(units.len(), false);
        b.op_left.clear();
        // (Counted only where there are sends or receives to take out: a collective's job
        // pays nothing for it.)
        if stamps.iter().any(|s| crate::plan::ops::p2p_bytes(s).is_some()) {
            b.op_left.resize(stamps.len(), 0);
            for u in units {
                if let Some(n) = b.op_left.get_mut(u.op as usize) {
                    *n += 1;
                }
            }
        }
        b.posted.clear();
        let reducing = match b.filled_from {
            Some((id, reducing)) if id == plan_id => {
                b.sends.rewind();
                b.recvs.rewind();
                b.local.rewind();
                reducing
            }
            _ => {
                b.filled_from = None;
                b.sends.clear();
                b.recvs.clear();
                b.local.clear();
                for (i, u) in units.iter().enumerate() {
                    match u.step {
                        Step::Send { peer, .. } => b.sends.push(peer as usize, i as u32),
                        Step::Recv { peer, .. } | Step::RecvReduce { peer, .. } => b.recvs.push(peer as usize, i as u32),
                        _ => b.local.push(usize::MAX, i as u32),
                    }
                }
                let reducing = units.iter().any(|u| matches!(u.step, Step::RecvReduce { .. }));
                b.filled_from = Some((plan_id, reducing));
                reducing
            }
        };
        Job { comm, conns, units, stamps, describe, b, reducing, remaining: units.len(), failed_peer: None, named: Vec::new(),
              published: false }
    }

    /// Publish the job's operations as running (`Ready::set_running_plan`), its sends and
    /// receives already done marked so. Done once the run waits: peers ask what a rank runs
    /// only when they have waited on it, and a call that finishes without waiting (an 8-byte
    /// all-reduce) does not pay for the status's lock, twice.
    pub fn publish(&mut self) {
        if self.published {
            return;
        }
        self.published = true;
        let Some(r) = self.comm.ready_if_any() else { return };
        r.set_running_plan(self.units, self.stamps);
        // Sends and receives already done are marked so (a collective has none: nothing to
        // allocate, where a rank sharing its CPU publishes every call it waits in).
        if !self.stamps.iter().any(|s| crate::plan::ops::p2p_bytes(s).is_some()) {
            return;
        }
        // (One pass over the units: a group may hold 50,000 sends and receives.)
        let mut marked = vec![false; self.b.op_left.len()];
        for u in self.units {
            let op = u.op as usize;
            let (send, peer) = match u.step {
                Step::Send { peer, .. } => (true, peer as usize),
                Step::Recv { peer, .. } => (false, peer as usize),
                _ => continue,
            };
            if self.b.op_left.get(op) != Some(&0) || marked.get(op) != Some(&false) {
                continue;
            }
            marked[op] = true;
            if let Some(stamp) = self.stamps.get(op).filter(|s| crate::plan::ops::p2p_bytes(s).is_some()) {
                r.finished(&crate::plan::ops::with_role(*stamp, send, peer), op);
            }
        }
    }

    fn ready(&self, i: u32) -> bool {
        self.units[i as usize].deps.iter().all(|&d| d == NO_DEP || self.b.done[d as usize])
    }

    fn complete(&mut self, i: u32) {
        self.b.done[i as usize] = true;
        self.remaining -= 1;
        if !self.b.op_left.is_empty() {
            self.unit_of_op_done(i);
        }
    }

    /// (Out of line: the collectives' hot loop stays as small as it was.)
    #[inline(never)]
    fn unit_of_op_done(&mut self, i: u32) {
        let u = &self.units[i as usize];
        let Some(left) = self.b.op_left.get_mut(u.op as usize) else { return };
        *left -= 1;
        if *left > 0 {
            return;
        }
        // (Only sends and receives: a peer takes a collective this rank issued for one it is
        // behind on, finished or not. And not the job's last: the run's end clears the status,
        // or, while other communicators' jobs go on, `run` does.)
        let (send, peer) = match u.step {
            Step::Send { peer, .. } => (true, peer as usize),
            Step::Recv { peer, .. } => (false, peer as usize),
            _ => return,
        };
        let stamp = self.stamps[u.op as usize];
        if crate::plan::ops::p2p_bytes(&stamp).is_some() {
            if let Some(r) = self.comm.ready_if_any() {
                r.p2p_finished(peer, send);
                if self.remaining > 0 && self.published {
                    r.finished(&crate::plan::ops::with_role(stamp, send, peer), u.op as usize);
                }
            }
        }
    }

    /// Advance everything that can advance now; true if anything did.
    fn poll(&mut self) -> Result<bool> {
        let mut progressed = self.poll_posted(false)?;
        for qi in 0..self.b.sends.live {
            while let Some(i) = self.b.sends.qs[qi].front() {
                if !self.ready(i) {
                    break;
                }
                let Step::Send { peer, src } = self.units[i as usize].step else { break };
                let peer = peer as usize;
                // Without reductions in the job, a send that waits for nothing (a broadcast
                // root's, an all-gather's own block) may have more single-copy messages out.
                let free = self.units[i as usize].deps.iter().all(|&d| d == NO_DEP);
                let window = if free && !self.reducing { MAX_POSTED_MOVING } else { MAX_POSTED };
                if self.b.posted.for_peer(peer) >= window {
                    break;
                }
                let stamp = &self.stamps[self.units[i as usize].op as usize];
                // A single copy (the peer reads `src` in place) pays from a smaller size when
                // `src` is the caller's own data, waiting for nothing, of an operation that
                // does not reduce (a broadcast root's buffer, an all-gather's own block, a
                // plain send), and when this rank's CPU is its own. Not an in-place exchange's
                // scratch copy (it waits for the copy), nor a reduction's messages: the
                // receiver would read them into staging and reduce from there, and an in-place
                // all-reduce writes its result over what it sends, so its send's completion,
                // which waits for the reader, comes before it (16 KiB in place 5.5 -> 8.6
                // µs). On a shared CPU the wait for the reader costs a switch (4 ranks on 2
                // cores: all-gather 32 KiB 15-16 -> 23 µs).
                let early = free && !self.reducing && !crate::plan::ops::reduces(stamp) && cpu_not_shared();
                let sent = self.conns.send_mut(peer)?.try_send(src, stamp, early);
                if sent.is_err() {
                    self.failed_peer = Some(peer);
                }
                match sent? {
                    Sent::Blocked => break,
                    Sent::Done => self.complete(i),
                    Sent::Posted(token) => self.b.posted.push(peer, (i, token)),
                }
                self.b.sends.qs[qi].pop_front();
                progressed = true;
            }
        }
        for qi in 0..self.b.recvs.live {
            while let Some(i) = self.b.recvs.qs[qi].front() {
                if !self.ready(i) {
                    break;
                }
                let unit = self.units[i as usize];
                let (peer, len) = match unit.step {
                    Step::Recv { peer, dst } => (peer, dst.len()),
                    Step::RecvReduce { peer, dst, .. } => (peer, dst.len()),
                    _ => break,
                };
                let mine = &self.stamps[unit.op as usize];
                let comm = self.comm;
                let mut check = |theirs: &Stamp, got: usize| {
                    if theirs != mine || got != len {
                        return Err(Error::invalid_usage(crate::plan::ops::describe_arrival(
                            &comm.describe_peer(peer as usize), theirs, comm.rank, mine)));
                    }
                    Ok(())
                };
                let conn = self.conns.recv_mut(peer as usize)?;
                let got = match unit.step {
                    Step::Recv { dst, .. } => conn.try_recv_into(dst, &mut check),
                    Step::RecvReduce { dst, acc, dt, op, scaled, .. } => conn.try_recv(&mut |theirs, data| {
                        check(theirs, data.len())?;
                        match scaled {
                            Some(scalar) => host::reduce_in_scaled(dt, dst, acc, scalar, data),
                            None => host::reduce_in(dt, op, dst, acc, data),
                        }
                        Ok(())
                    }),
                    _ => break,
                };
                if got.is_err() {
                    self.failed_peer = Some(peer as usize);
                }
                if !got? {
                    break;
                }
                self.b.recvs.qs[qi].pop_front();
                self.complete(i);
                progressed = true;
            }
        }
        // Local copies and reductions run one slice per pass while transfers are pending, so
        // a long local copy (an out-of-place root's) never holds back the next message.
        let transfers_pending = self.b.sends.pending() || self.b.recvs.pending() || self.b.posted.pending();
        if self.b.local.live > 0 {
            while let Some(i) = self.b.local.qs[0].front() {
                if !self.ready(i) {
                    break;
                }
                match self.units[i as usize].step {
                    Step::Copy { dst, src, to_read: false } => host::copy(dst, src),
                    Step::Copy { dst, src, to_read: true } => host::copy_to_read(dst, src),
                    Step::Reduce { dst, a, b, dt, op } => host::reduce_local(dt, op, dst, a, b),
                    Step::Premul { dst, src, dt, scalar } => host::premul(dt, dst, src, scalar),
                    Step::Divide { dst, dt, divisor } => host::divide(dt, dst, divisor),
                    _ => {}
                }
                self.b.local.qs[0].pop_front();
                self.complete(i);
                progressed = true;
                if transfers_pending {
                    break;
                }
            }
        }
        // Nothing else moved: help the peers read what we posted (a broadcast root's core
        // would otherwise only wait).
        if !progressed && self.b.posted.pending() {
            progressed = self.poll_posted(true)?;
        }
        Ok(progressed)
    }

    /// Complete the posted sends the peers have read; true if any did.
    fn poll_posted(&mut self, help: bool) -> Result<bool> {
        let mut progressed = false;
        for pi in 0..self.b.posted.live {
            let peer = self.b.posted.qs[pi].peer;
            while let Some((i, token)) = self.b.posted.qs[pi].front() {
                let read = self.conns.send_mut(peer)?.consumed(token, help);
                if read.is_err() {
                    self.failed_peer = Some(peer);
                }
                if !read? {
                    break;
                }
                self.b.posted.qs[pi].pop_front();
                self.complete(i);
                progressed = true;
            }
        }
        Ok(progressed)
    }

    /// Checks made while idle: abort, and liveness of the peers we wait for.
    fn check(&mut self) -> Result<()> {
        if self.comm.abort.load(Ordering::Acquire) {
            return Err(Error::invalid_usage("communicator aborted"));
        }
        if self.comm.revoked.load(Ordering::Acquire) {
            return Err(Error::invalid_usage("communicator revoked"));
        }
        let senders: Vec<usize> = self.b.sends.active().map(|q| q.peer).chain(self.b.posted.active().map(|q| q.peer)).collect();
        for peer in senders {
            let checked = self.conns.send_mut(peer)?.check();
            self.failed_on(peer, checked)?;
        }
        // A connection whose sends are all made may yet fail them: a socket reset by a peer gone
        // before it read them. The job, waiting on others (which may never come: one stuck,
        // the rest waiting on the lost peer), fails naming it rather than wait on.
        let written: Vec<usize> = self.b.sends.done().map(|q| q.peer).collect();
        for peer in written {
            let checked = self.conns.send_mut(peer)?.check_written();
            self.failed_on(peer, checked)?;
        }
        let receivers: Vec<usize> = self.b.recvs.active().map(|q| q.peer).collect();
        for peer in receivers {
            let checked = self.conns.recv_mut(peer)?.check();
            self.failed_on(peer, checked)?;
        }
        Ok(())
    }

    /// A check of the connection with `peer`: failed, it names the peer and is the job's
    /// failed peer (whose reason the group asks for, as for a failed send or receive).
    fn failed_on(&mut self, peer: usize, checked: Result<()>) -> Result<()> {
        checked.map_err(|e| {
            self.failed_peer = Some(peer);
            e.context(self.comm.describe_peer(peer))
        })
    }

    fn finished(&self) -> bool {
        self.remaining == 0
    }

    /// What the job waits on, if all of it can be waited for in poll(2): a descriptor per
    /// send blocked on a socket (POLLOUT) and per receive whose turn it is on a socket
    /// (POLLIN). Units waiting for another unit of the job are left out (what they wait for
    /// is among these). False if anything it waits on has no descriptor (shared memory,
    /// rings of this process, a single-copy message out).
    fn wait_fds(&mut self, fds: &mut Vec<libc::pollfd>) -> Result<bool> {
        if self.b.posted.pending() {
            return Ok(false);
        }
        for qi in 0..self.b.sends.live {
            let q = &self.b.sends.qs[qi];
            if q.front().is_some_and(|i| self.ready(i)) {
                let Some(fd) = self.conns.send_mut(q.peer)?.wait_fd() else { return Ok(false) };
                fds.push(libc::pollfd { fd, events: libc::POLLOUT, revents: 0 });
            }
        }
        for qi in 0..self.b.recvs.live {
            let q = &self.b.recvs.qs[qi];
            if q.front().is_some_and(|i| self.ready(i)) {
                let Some(fd) = self.conns.recv_mut(q.peer)?.wait_fd() else { return Ok(false) };
                fds.push(libc::pollfd { fd, events: libc::POLLIN, revents: 0 });
            }
        }
        Ok(true)
    }

    /// Ask the peers this job is stuck on what they are running. A peer running other
    /// operations than the one we wait on it for issued different calls: that is an error
    /// naming both. A peer running nothing has not made the call yet: say so once (a slow
    /// rank is not an error; NCCL waits for it, and so do we).
    /// Whether every peer asked answered (none was `Unknown`: its status did not come in time).
    fn watch(&mut self, waited: Duration) -> Result<bool> {
        let heads: Vec<(usize, u32)> = self.b.sends.active().chain(self.b.recvs.active())
            .filter_map(|q| q.front().map(|i| (q.peer, i)))
            .chain(self.b.posted.active().filter_map(|q| q.front().map(|(i, _)| (q.peer, i))))
            .collect();
        let mut asked = Vec::new();
        let mut answered = true;
        for (peer, unit) in heads {
            if asked.contains(&peer) || peer == self.comm.rank {
                continue;
            }
            asked.push(peer);
            // (With its direction and peer, if a send or receive: see `Comm::peer_runs`.)
            let u = self.units[unit as usize];
            let mine = crate::plan::ops::with_role(self.stamps[u.op as usize], matches!(u.step, Step::Send { .. }), peer);
            let runs = self.comm.peer_runs(peer, &mine, self.describe)?;
            answered &= runs.answered();
            // (Each rank named once: peers held up by the same rank would each name it.)
            let culprit = runs.culprit(peer);
            if let Some(why) = runs.why_waiting(&mine, self.describe).filter(|_| !self.named.contains(&culprit)) {
                self.named.push(culprit);
                crate::warn!("rank {}: waited {:.1} s in {} for {}, {why}",
                             self.comm.rank, waited.as_secs_f64(), (self.describe)(&mine), self.comm.describe_peer(peer));
            }
        }
        Ok(answered)
    }

}

/// Rounds of the engine after which a run publishes what it runs even if it never waited
/// ([`Job::publish`]): a small call is over in a few.
const PUBLISH_AFTER: u32 = 1024;
/// Single-copy messages a connection may have out at once. Measured (2 processes, 64 MiB,
/// busbw GB/s, out-of-place): 1 -> allreduce 2.5-2.65, broadcast 3.6-3.8; 2 -> allreduce
/// 1.5-1.6, broadcast 4.2-4.7. All-reduce matters most, so one.
const MAX_POSTED: usize = 1;
/// The same for jobs that only move data, for sends that wait for nothing (see the commit that
/// set it for the measurements: broadcast and all-gather +15-20%; all-reduce lost 25-35% with
/// more than one, which is why reducing jobs keep MAX_POSTED).
const MAX_POSTED_MOVING: usize = 4;
const YIELD_FOR: Duration = Duration::from_millis(2);
const NAP: Duration = Duration::from_micros(50);
/// Idle this long, a job naps [`LONG_NAP`] instead: a rank waiting seconds for a late peer (at
/// a barrier while another rank checkpoints) took 5% of a core napping 50 µs at a time, 1% so.
/// The peer's arrival is then seen up to a millisecond later, at each rank a ring's first
/// pass wakes in turn: a few ms on a wait of seconds. (Not sooner: a stall of 100 ms in a
/// ring of 64 would grow by a third.)
const LONG_NAP_AFTER: Duration = Duration::from_secs(1);
const LONG_NAP: Duration = Duration::from_millis(1);
const CHECK_EVERY: Duration = Duration::from_millis(100);
/// After this long without progress, ask the peers we wait on what they are doing.
const WATCH_AFTER: Duration = Duration::from_secs(1);
/// Still without progress after a watch every peer answered, watch again this often: a rank
/// further down a chain of waits may fail, or a cycle close, after the first look. (Watched
/// once only, a rank of a cycle of three that looked as the other two were already failing
/// waited for ever, where they had named the cycle: found under load.)
const WATCH_AGAIN: Duration = Duration::from_secs(2);

/// Run jobs to completion. On error, the index of the job that failed comes with it.
pub fn run(jobs: &mut [Job<'_>]) -> std::result::Result<(), (usize, Error)> {
    // The clock is read only once the engine has spun idle for a while: a small operation
    // that completes within the spin never pays for a clock_gettime.
    let mut idle_since: Option<Instant> = None;
    let mut spins = 0u32;
    let mut spin = Spin::new();
    let mut last_check: Option<Instant> = None;
    // The idle time at which to ask the peers waited on what they run: a second in, then every
    // WATCH_AGAIN (a second while some peer's answer did not come).
    let mut watch_at = WATCH_AFTER;
    let mut rounds = 0u32;
    let mut fine = None;
    loop {
        // A run that goes on (a large message, progressing all the time) is published too.
        rounds = rounds.saturating_add(1);
        if rounds == PUBLISH_AFTER {
            jobs.iter_mut().filter(|j| !j.finished()).for_each(Job::publish);
        }
        let mut progressed = false;
        let mut all_done = true;
        let several = jobs.len() > 1;
        for (j, job) in jobs.iter_mut().enumerate() {
            if job.finished() {
                continue;
            }
            progressed |= job.poll().map_err(|e| (j, e))?;
            if job.finished() && several {
                // Its communicator runs nothing more while the others' jobs go on (a peer
                // asking it must not see the sends and receives it finished).
                if let Some(r) = job.comm.ready_if_any() {
                    r.set_running(&[]);
                }
            }
            all_done &= job.finished();
        }
        if all_done {
            return Ok(());
        }
        if progressed {
            idle_since = None;
            spins = 0;
            watch_at = WATCH_AFTER;
            continue;
        }
        if spins < spin.limit() {
            spins += 1;
            std::hint::spin_loop();
            continue;
        }
        spin.yielding();
        let now = Instant::now();
        if idle_since.is_none() {
            // The run waits: peers waiting on this rank may ask what it runs.
            jobs.iter_mut().filter(|j| !j.finished()).for_each(Job::publish);
        }
        let since = *idle_since.get_or_insert(now);
        if now.duration_since(*last_check.get_or_insert(now)) >= CHECK_EVERY {
            last_check = Some(now);
            for (j, job) in jobs.iter_mut().enumerate() {
                if !job.finished() {
                    job.check().map_err(|e| (j, e))?;
                }
            }
            let waited = now.duration_since(since);
            if waited >= watch_at {
                let mut answered = true;
                for (j, job) in jobs.iter_mut().enumerate() {
                    if !job.finished() {
                        answered &= job.watch(waited).map_err(|e| (j, e))?;
                    }
                }
                watch_at = waited + if answered { WATCH_AGAIN } else { WATCH_AFTER };
            }
        }
        let idle = now.duration_since(since);
        // A yield first: the peers this rank waits for may be what wants its CPU. Where
        // yields are slow, or the wait is long: asleep in poll(2) if it waits only on sockets
        // (woken when data or room comes), else naps that end on time.
        if (idle < YIELD_FOR && timed_yield()) || wait_on_sockets(jobs)? {
            continue;
        }
        fine.get_or_insert_with(crate::abi::naps::FineNaps::start);
        std::thread::sleep(if idle < YIELD_FOR {
            SLOW_YIELD_NAP
        } else if idle < LONG_NAP_AFTER {
            NAP
        } else {
            LONG_NAP
        });
    }
}

/// The longest a wait in poll(2) sleeps: events end it at once; this bounds how late the
/// engine's own checks (abort, revocation, peers' liveness, a watch) come.
const POLL_FOR: Duration = Duration::from_millis(10);

thread_local! {
    /// [`wait_on_sockets`]'s descriptors, kept from one wait to the next: a repeated call
    /// waits without allocating.
    static POLL_FDS: std::cell::Cell<Vec<libc::pollfd>> = const { std::cell::Cell::new(Vec::new()) };
}

/// If every unfinished job waits only on sockets ([`Job::wait_fds`]), wait in poll(2) until
/// one is ready (at most [`POLL_FOR`]) and say so; otherwise false, having waited for nothing.
fn wait_on_sockets(jobs: &mut [Job<'_>]) -> std::result::Result<bool, (usize, Error)> {
    let mut fds = POLL_FDS.with(std::cell::Cell::take);
    fds.clear();
    let mut pollable = Ok(true);
    for (j, job) in jobs.iter_mut().enumerate().filter(|(_, j)| !j.finished()) {
        pollable = job.wait_fds(&mut fds).map_err(|e| (j, e));
        if !matches!(pollable, Ok(true)) {
            break;
        }
    }
    let waited = pollable.map(|all| all && !fds.is_empty());
    if let Ok(true) = waited {
        crate::transport::socket::wait_ready(&mut fds, POLL_FOR);
    }
    POLL_FDS.with(|kept| kept.set(fds));
    waited
}
