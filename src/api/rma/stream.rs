//! One-sided operations in CUDA mode, in the order of the callers' streams.
//!
//! A put starts after everything its stream did before the call, and the stream may reuse the
//! source once it has passed the call; a wait holds its stream until its signals have come.
//! But for one case (the last paragraph), no host thread makes a device call that a caller's
//! stream may be waiting for (the rule of `streamed`), so no copy of ours can sit behind such
//! a wait in a hardware queue:
//!
//! - **Puts written directly**: a put into a window of a rank of this host (its own, one of
//!   its process, or device memory of another process that CUDA IPC maps: `windows::direct_target`),
//!   where the source or the window is device or managed memory and neither is pageable, is
//!   copied there by the caller's stream, which then raises the mark of a unit that carries
//!   only the signal.
//! - **Other puts and signals** are split into units of at most [`CHUNK`] bytes, numbered per
//!   communicator, each with a mark (one of [`MARKS`], reused in turn) and, if it carries
//!   bytes, a slot of pinned staging (one of [`SLOTS`], reused in turn). For each unit the
//!   caller's stream, at call time, waits until the units that used its mark and its slot
//!   before are finished, copies its part of the source into the slot, and writes the unit's
//!   number into its mark. The sender (a thread per communicator) takes each peer's units in
//!   order, any peer's whose stream has got there first: it sends the slot's bytes over the
//!   one-sided connection and says it finished the unit, in done words beside the marks. A
//!   stream that has not got to its call holds up only its peer's later units (and, after
//!   [`SLOTS`] staged units, those that wait for its slot). A source in host memory, pageable
//!   or pinned, is read by the sender itself, once the mark says the stream got there, and that
//!   stream waits until the sender has finished with it. Those waits depend on host work only.
//!   (A stream's copy between two host buffers would hold up the calling thread until the
//!   stream got there: CUDA's API synchronization behavior, `PtrKind::copies_async_with`. So a
//!   put from pinned memory into a window in host memory goes as such a unit too, not directly.)
//! - **Waits**: the target's reader (`Inner::serve`) copies a put's bytes into the window on a
//!   stream of its own, waits for the copy, then counts the signal in a word of mapped host
//!   memory per (context, signal, sender). The call makes its stream wait until each word
//!   reaches what earlier waits consumed plus what this one asks (counted at call time).
//!   Streams whose signals will never come (the sender left, a put could not land, the
//!   communicator was aborted or revoked) are let go, with the communicator's asynchronous
//!   error saying why.
//!
//! The reader's copy of a staged put into a device window is the one device call a host thread
//! makes while a stream may wait, and only for the signal that copy precedes: with more streams
//! than hardware queues, it could share a queue with a stream that waits behind it (README,
//! CUDA mode's limits). Puts written directly have no such copy. Where streams cannot wait on
//! memory (host-wait mode), the calls run on the calling thread once their stream has got
//! there, and a wait returns when its signals came.
//!
//! The windows a rank reaches directly (`windows`) also answer `ncclGetPeerDevicePointer` and
//! `ncclGetLsaDevicePointer`.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::wait::{probe_waits, wanted_counts, wait_for};
use super::windows::direct_target;
use super::{deliver, put_to_self, RmaOp, WaitDesc, PROBE_EVERY};
use crate::comm::Comm;
use crate::device::cuda::{Context, KeepCurrent, MappedHost, MemOp, Stream, WaitCond};
use crate::device::host::Region;
use crate::error::{Error, Result};
use crate::transport::rma::{self as wire, Frame, PeerWindow, OP_PUT};

/// Slots of pinned staging per communicator, and the bytes of each: 4 MiB in all.
const SLOTS: usize = 16;
const CHUNK: usize = 256 << 10;
/// Units in flight before a stream waits for a mark to be free again (each unit has one).
const MARKS: usize = 1024;
/// Words of `marks`, each on a cache line of its own: a mark per unit (the stream writes the
/// unit's number there when it gets to it), the number of the unit the sender last finished
/// per mark, and of the unit that last used each slot, once finished.
const MARK_WORDS: usize = 16 * (2 * MARKS + SLOTS);
/// Signal words a communicator may have (4 bytes each): contexts x signals x ranks.
const MAX_WORDS: usize = 1 << 22;
/// How long the sender waits for a stream before it says so.
const STREAM_LATE: Duration = Duration::from_secs(10);

/// A window puts write directly, or None: puts into it are staged.
pub(super) type Direct = Option<Arc<PeerWindow>>;

fn mark_word(n: u32) -> usize {
    16 * (n as usize % MARKS)
}

fn mark_done_word(n: u32) -> usize {
    16 * (MARKS + n as usize % MARKS)
}

fn slot_done_word(slot: u32) -> usize {
    16 * (2 * MARKS + slot as usize % SLOTS)
}

/// `a` is `b` or later, counting as stream memory operations compare (wrapping at 2^32).
fn reached(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) >= 0
}

/// Does a copy between these regions need the device (CUDA mode, and one of them is device,
/// pinned or managed memory: what a collective runs in stream order for)?
pub(super) fn needs_device_copy(regions: &[Region]) -> Result<bool> {
    Ok(crate::api::coll::placement(regions, None)?.device)
}

/// Staging of a destroyed communicator, for the next one on its device, with its numbering:
/// its words hold numbers up to `issued` (units) and `slots` (slot uses), which a new count
/// from 1 would take as reached.
struct Spare {
    ordinal: i32,
    data: &'static MappedHost,
    marks: &'static MappedHost,
    issued: u32,
    slots: u32,
}

static SPARES: crate::abi::fork::PerForkMutex<Vec<Spare>> = crate::abi::fork::PerFork::new(crate::abi::fork::anew);

/// One communicator's sender and staging (CUDA mode with stream waits).
pub(super) struct Gated {
    ctx: &'static Context,
    /// SLOTS x CHUNK bytes of pinned staging, and the words of `mark_word` and the done words.
    /// Never freed: a stream may still be on its way to them.
    data: &'static MappedHost,
    marks: &'static MappedHost,
    queue: Mutex<Queue>,
    changed: Condvar,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// The driver refused a stream memory operation when asked (though it says it has them):
    /// from then on calls run on the calling thread, as in host-wait mode.
    refused: AtomicBool,
}

#[derive(Default)]
struct Queue {
    /// Every unit reserved and not yet finished, in number order (a call reserves its units
    /// together, then fills each in once its stream work is queued).
    units: VecDeque<Unit>,
    /// The number of the last unit reserved, and of the last use of a slot.
    issued: u32,
    slots: u32,
    closing: bool,
    /// The sender has taken a unit out of `units` and not finished it yet: the work reserved
    /// so far is done only once `units` is empty and this is false.
    sending: bool,
    /// Some unit was given up before its stream reached it (abort, revoke): that stream may
    /// still write its mark and slot, so the staging is not handed on.
    abandoned: bool,
}

impl Queue {
    /// Has the sender finished every unit reserved so far?
    fn idle(&self) -> bool {
        self.units.is_empty() && !self.sending
    }
}

/// Part of one put or signal, as the sender sends it.
#[derive(Clone, Copy)]
struct Unit {
    n: u32,
    peer: usize,
    frame: Frame,
    /// Its bytes start `at` bytes into the put; the first unit sends the header, the last one
    /// completes the put (its signal counts at the target once it has landed).
    at: usize,
    first: bool,
    last: bool,
    src: Source,
    /// Its use of a slot (`Source::Slot`): slot `slot % SLOTS`.
    slot: u32,
    /// Its call filled it in: its stream work is queued (or `void`).
    filled: bool,
    /// Its call failed before queueing its stream work: the sender only counts it finished.
    void: bool,
}

#[derive(Clone, Copy)]
enum Source {
    None,
    /// `len` bytes in the unit's slot, copied there by the caller's stream.
    Slot(usize),
    /// Pageable host memory, read by the sender.
    User(Region),
}

/// What the sender knows of the put in progress to one peer.
#[derive(Clone, Copy, Default)]
struct PeerState {
    /// Its header went out and more of its bytes are to come.
    in_put: bool,
    /// The rest of it is not sent (it failed).
    skip: bool,
}

impl Gated {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn slot(&self, slot: u32, len: usize) -> Region {
        self.data.region().sub((slot as usize % SLOTS) * CHUNK, len)
    }

    /// The sender's staging, from a destroyed communicator of this device if there is one.
    fn start(comm: &Arc<Comm>, ctx: &'static Context) -> Result<Arc<Gated>> {
        let spare = {
            let mut spares = SPARES.lock().unwrap_or_else(|p| p.into_inner());
            let at = spares.iter().position(|s| s.ordinal == comm.cuda_dev);
            at.map(|i| spares.swap_remove(i))
        };
        let (data, marks, issued, slots) = match spare {
            Some(s) => (s.data, s.marks, s.issued, s.slots),
            None => {
                // Both made before either is leaked: a failure frees what was made.
                let (data, marks) = (MappedHost::new(SLOTS * CHUNK)?, MappedHost::new(MARK_WORDS * 4)?);
                let (data, marks): (&'static MappedHost, &'static MappedHost) =
                    (Box::leak(Box::new(data)), Box::leak(Box::new(marks)));
                (data, marks, 0, 0)
            }
        };
        let g = Arc::new(Gated { ctx, data, marks, queue: Mutex::new(Queue { issued, slots, ..Queue::default() }),
                                 changed: Condvar::new(), thread: Mutex::new(None), refused: AtomicBool::new(false) });
        let (c, s) = (comm.clone(), g.clone());
        let handle = std::thread::Builder::new()
            .name(format!("nccl-rs-rma-{}", comm.rank))
            .spawn(move || {
                crate::debug::set_rank(c.rank as i32);
                crate::device::cuda::relax_capture_mode();
                crate::abi::naps::fine_for_this_thread();
                s.run(&c)
            })
            .map_err(|e| Error::os("spawn the one-sided sender", e))?;
        *g.thread.lock().unwrap_or_else(|p| p.into_inner()) = Some(handle);
        crate::info!(INIT, "rank {}: one-sided operations ordered with CUDA streams ({} KiB of pinned staging)",
                     comm.rank, (SLOTS * CHUNK) >> 10);
        Ok(g)
    }

    /// Send the units queued so far (failing fast once the communicator is aborted), then stop.
    /// Streams still waiting for a mark or a slot are let go; the staging goes to the next
    /// communicator when every unit got its stream's mark (nothing will write it any more).
    pub(super) fn close(&self) {
        if std::mem::replace(&mut self.lock().closing, true) {
            return; // closed already (destroy, then the communicator's drop)
        }
        self.changed.notify_all();
        let handle = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(h) = handle {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
        let q = self.lock();
        for i in 0..MARKS as u32 {
            self.marks.word(mark_done_word(i)).store(q.issued, Ordering::Release);
        }
        for j in 0..SLOTS as u32 {
            self.marks.word(slot_done_word(j)).store(q.slots, Ordering::Release);
        }
        if q.idle() && !q.abandoned {
            let spare = Spare { ordinal: self.ctx.ordinal(), data: self.data, marks: self.marks, issued: q.issued,
                                slots: q.slots };
            SPARES.lock().unwrap_or_else(|p| p.into_inner()).push(spare);
        }
    }

    /// Wait until the sender has finished every unit reserved so far, but not past an abort,
    /// the communicator's closing or [`STREAM_LATE`] (a stream that never gets to its call must
    /// not hold up the caller for good): whether it has.
    pub(super) fn wait_idle(&self, comm: &Comm) -> bool {
        let deadline = Instant::now() + STREAM_LATE;
        let mut q = self.lock();
        while !q.idle() && !q.closing && !comm.abort.load(Ordering::Acquire) && Instant::now() < deadline {
            q = self.changed.wait_timeout(q, PROBE_EVERY).unwrap_or_else(|p| p.into_inner()).0;
        }
        q.idle()
    }

    /// Wait until the sender has finished every unit reserved so far.
    pub(super) fn drain(&self) {
        let mut q = self.lock();
        while !q.idle() {
            q = self.changed.wait(q).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// The driver refused a stream memory operation before this call queued anything: later
    /// calls run on their threads, after what the sender still has.
    fn refuse(&self, rank: usize) {
        if !self.refused.swap(true, Ordering::AcqRel) {
            crate::info!(INIT, "rank {rank}: the driver refused a stream wait: one-sided operations run on the calling \
                                thread");
        }
        self.drain();
    }

    /// The unit to send next, taken out of the queue: the first, in number order, of a peer
    /// whose earlier units are all finished, once filled in and its stream has got to it (or
    /// at once, to fail it, once the communicator is aborted or revoked). Units to one peer go
    /// in order; a stream that has not got to its call holds up only that peer.
    /// `held`: the sender's own list, kept across polls (nothing is allocated while it polls).
    fn pick(&self, q: &mut Queue, stopping: bool, held: &mut Vec<usize>) -> Option<(Unit, bool)> {
        held.clear();
        let mut found = None;
        for (i, u) in q.units.iter().enumerate() {
            if held.contains(&u.peer) {
                continue;
            }
            let reached_mark = u.filled && !u.void && reached(self.marks.word(mark_word(u.n)).load(Ordering::Acquire), u.n);
            if u.filled && (u.void || reached_mark || stopping) {
                found = Some((i, reached_mark));
                break;
            }
            held.push(u.peer);
        }
        let (i, reached_mark) = found?;
        let unit = q.units.remove(i)?;
        q.sending = true;
        Some((unit, reached_mark))
    }

    /// The sender's loop: each unit once its stream has got there, in order per peer.
    fn run(&self, comm: &Comm) {
        let mut peers: HashMap<usize, PeerState> = HashMap::new();
        let mut unreachable = HashMap::new();
        let mut held = Vec::new();
        let mut back_off = crate::proxy::Backoff::new();
        let (mut probed, mut late) = (Instant::now(), None::<(u32, Instant, bool)>);
        loop {
            let stopping = comm.abort.load(Ordering::Acquire) || comm.revoked.load(Ordering::Acquire);
            let picked = {
                let mut q = self.lock();
                match self.pick(&mut q, stopping, &mut held) {
                    Some(p) => Some(p),
                    None if q.units.is_empty() => {
                        if q.closing {
                            return;
                        }
                        q = self.changed.wait_timeout(q, PROBE_EVERY).unwrap_or_else(|p| p.into_inner()).0;
                        let idle = q.units.is_empty() && !q.closing;
                        drop(q);
                        if idle {
                            probe_waits(comm, &mut unreachable);
                        }
                        continue;
                    }
                    None => {
                        // Streams have not got to their calls yet: say so after a while.
                        say_late(comm, &q, &mut late);
                        None
                    }
                }
            };
            let Some((unit, reached_mark)) = picked else {
                back_off.wait();
                if probed.elapsed() >= PROBE_EVERY {
                    // Such a stream may be waiting for a rank that is gone.
                    probe_waits(comm, &mut unreachable);
                    probed = Instant::now();
                }
                continue;
            };
            back_off.progressed();
            self.finish_unit(comm, &mut peers, unit, reached_mark);
        }
    }

    /// Unit `unit`, its stream there (`reached_mark`; else the communicator stops): sent, or
    /// skipped after a failure of its call or of an earlier unit of its put (said as the
    /// communicator's error); then done, its mark and slot free for the units after it.
    fn finish_unit(&self, comm: &Comm, peers: &mut HashMap<usize, PeerState>, unit: Unit, reached_mark: bool) {
        let st = peers.entry(unit.peer).or_default();
        if unit.first {
            *st = PeerState::default();
        }
        let outcome = if st.skip {
            Ok(())
        } else if unit.void {
            // Its call failed (or was refused) before it queued this unit's stream work.
            st.skip = true;
            match st.in_put {
                true => Err(Error::internal("a put could not be queued whole on its stream")),
                false => Ok(()),
            }
        } else if !reached_mark {
            self.lock().abandoned = true;
            Err(Error::invalid_usage("communicator aborted or revoked before the stream reached the call"))
        } else {
            self.send(comm, &unit)
        };
        match outcome {
            Ok(()) => st.in_put |= !st.skip && unit.first && !unit.last,
            Err(e) => {
                // Part of a put is out: the target must not read what follows as its bytes.
                if st.in_put {
                    self.drop_link(comm, unit.peer);
                }
                st.skip = true;
                comm.publish_failure(&e.context(format!("rank {}: a one-sided operation on a stream", comm.rank)));
            }
        }
        if unit.last {
            st.in_put = false;
        }
        self.marks.word(mark_done_word(unit.n)).store(unit.n, Ordering::Release);
        if matches!(unit.src, Source::Slot(_)) {
            self.marks.word(slot_done_word(unit.slot)).store(unit.slot, Ordering::Release);
        }
        self.lock().sending = false;
        self.changed.notify_all();
    }

    /// Close the one-sided connection to `peer` (its reader sees a put cut short).
    fn drop_link(&self, comm: &Comm, peer: usize) {
        let mut links = comm.rma.inner.links.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = links.get_mut(peer).and_then(Option::take) {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }

    fn source(&self, u: &Unit) -> Region {
        match u.src {
            Source::None => Region::EMPTY,
            Source::Slot(len) => self.slot(u.slot, len),
            Source::User(r) => r,
        }
    }

    fn send(&self, comm: &Comm, u: &Unit) -> Result<()> {
        let inner = &comm.rma.inner;
        let data = self.source(u);
        if u.peer == comm.rank {
            if u.frame.op == OP_PUT {
                put_to_self(inner, &u.frame, u.at, data)?;
            }
            if u.last {
                inner.count((u.frame.ctx, u.frame.sig, comm.rank as u32));
            }
            return Ok(());
        }
        let ready = comm.ready()?;
        // A put in several units: the header with the first, the bytes as they come (this
        // thread is the only one that writes to the connection in this mode, and a peer's
        // units go in order).
        super::with_link(comm, ready, u.peer, |s| match u.first {
            true => wire::send(s, &u.frame, data),
            false => wire::send_bytes(s, data),
        })
    }

    /// Numbers for `units` (consecutive: a put's units go out one after the other, and a slot
    /// use each for those that stage data), queued unfilled. No lock is held while the driver
    /// queues their stream work (it may block while the device's queue is full).
    fn reserve(&self, units: &mut [Unit], staged: bool) -> Result<()> {
        let mut q = self.lock();
        if q.closing {
            return Err(Error::invalid_usage("communicator is being destroyed"));
        }
        for u in units.iter_mut() {
            q.issued = q.issued.wrapping_add(1);
            u.n = q.issued;
            if staged && u.frame.len > 0 {
                q.slots = q.slots.wrapping_add(1);
                u.slot = q.slots;
            }
            q.units.push_back(*u);
        }
        Ok(())
    }

    /// Unit `u` as its call queued it (or `void`).
    fn fill(&self, u: Unit) {
        let mut q = self.lock();
        if let Some(slot) = q.units.iter_mut().find(|x| x.n == u.n) {
            *slot = Unit { filled: true, ..u };
        }
        drop(q);
        self.changed.notify_all();
    }

    /// Queue a put or signal behind the work on `st` (see the module docs). `copyable`: the
    /// source is device or managed memory, staged by the stream (others are read by the
    /// sender).
    /// False: the driver refused the first stream wait, nothing was queued on the stream.
    fn issue(&self, st: &Stream, peer: usize, frame: Frame, data: Region, copyable: bool) -> Result<bool> {
        let parts: Vec<(usize, usize)> = if copyable && data.len() > CHUNK {
            (0..data.len()).step_by(CHUNK).map(|at| (at, CHUNK.min(data.len() - at))).collect()
        } else {
            vec![(0, data.len())]
        };
        let last = parts.len() - 1;
        let mut units: Vec<Unit> = parts.iter().enumerate()
            .map(|(i, &(at, _))| Unit { n: 0, peer, frame, at, first: i == 0, last: i == last, src: Source::None, slot: 0,
                                        filled: false, void: true })
            .collect();
        self.reserve(&mut units, copyable)?;
        let mut failed: Option<Error> = None;
        let mut refused = false;
        for (mut unit, &(at, len)) in units.into_iter().zip(&parts) {
            if failed.is_none() && !refused {
                match self.queue_unit(st, &unit, data.sub(at, len), copyable) {
                    Ok(Some(src)) => (unit.src, unit.void) = (src, false),
                    Ok(None) if unit.first => refused = true,
                    Ok(None) => failed = Some(Error::internal("the device refused a stream memory operation it said it supports")),
                    Err(e) => failed = Some(e),
                }
            }
            self.fill(unit);
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(!refused),
        }
    }

    /// A put written directly into the target's window (`dst`, of a rank of this host) by the
    /// caller's stream, then its signal: the stream copies, raises the unit's mark, and the
    /// sender sends the signal once it is up. False: the driver refused the first stream wait.
    fn issue_direct(&self, st: &Stream, peer: usize, frame: Frame, dst: Region, data: Region) -> Result<bool> {
        let mut units = [Unit { n: 0, peer, frame: frame.signal_only(), at: 0, first: true, last: true, src: Source::None, slot: 0,
                                filled: false, void: true }];
        self.reserve(&mut units, false)?;
        let mut unit = units[0];
        let queued = (|| -> Result<bool> {
            if !self.mark_free(st, unit.n)? {
                return Ok(false);
            }
            st.copy(dst, data)?;
            enqueued(st.write_value32(self.marks, mark_word(unit.n), unit.n)?)?;
            Ok(true)
        })();
        unit.void = !matches!(queued, Ok(true));
        self.fill(unit);
        queued
    }

    /// The stream waits until unit `n`'s mark is free (the unit that used it before is
    /// finished). False: the driver refused the wait.
    fn mark_free(&self, st: &Stream, n: u32) -> Result<bool> {
        let op = st.wait_value32(self.marks, mark_done_word(n), n.wrapping_sub(MARKS as u32), WaitCond::Geq)?;
        Ok(op == MemOp::Enqueued)
    }

    /// Unit `u`'s stream work (`part`: its bytes of the source). None: the driver refused the
    /// first stream wait.
    fn queue_unit(&self, st: &Stream, u: &Unit, part: Region, copyable: bool) -> Result<Option<Source>> {
        if !self.mark_free(st, u.n)? {
            return Ok(None);
        }
        let src = match (part.len(), copyable) {
            (0, _) => Source::None,
            (len, true) => {
                // Its slot is free once the unit that used it before is finished.
                let free = u.slot.wrapping_sub(SLOTS as u32);
                enqueued(st.wait_value32(self.marks, slot_done_word(u.slot), free, WaitCond::Geq)?)?;
                st.copy(self.slot(u.slot, len), part)?;
                Source::Slot(len)
            }
            (_, false) => Source::User(part),
        };
        enqueued(st.write_value32(self.marks, mark_word(u.n), u.n)?)?;
        if matches!(src, Source::User(_)) {
            // The source may be reused once the sender has read it.
            enqueued(st.wait_value32(self.marks, mark_done_word(u.n), u.n, WaitCond::Geq)?)?;
        }
        Ok(Some(src))
    }
}

/// Says at WARN, once per unit, that the first unit of `q` whose stream has not got to its call
/// has waited [`STREAM_LATE`] (`late`: the unit found waiting, since when, and whether it was said).
fn say_late(comm: &Comm, q: &Queue, late: &mut Option<(u32, Instant, bool)>) {
    let Some(u) = q.units.iter().find(|u| u.filled && !u.void) else { return };
    match late {
        Some((n, _, _)) if *n == u.n => {}
        _ => *late = Some((u.n, Instant::now(), false)),
    }
    if let Some((_, since, warned)) = late.as_mut() {
        if !*warned && since.elapsed() >= STREAM_LATE {
            *warned = true;
            crate::warn!("rank {}: a one-sided operation to rank {}: its CUDA stream has not reached the call in {} s \
                          (work queued on that stream has not finished)", comm.rank, u.peer, STREAM_LATE.as_secs());
        }
    }
}

fn enqueued(m: MemOp) -> Result<()> {
    match m {
        MemOp::Enqueued => Ok(()),
        MemOp::Unsupported => Err(Error::internal("the device refused a stream memory operation it said it supports")),
    }
}

/// Run one validated call in CUDA mode.
pub(super) fn run(comm: &Arc<Comm>, op: &RmaOp) -> Result<()> {
    let ctx = Context::primary(comm.cuda_dev)?;
    // The communicator's context is current for the calls below (the legacy stream, NULL, is
    // that context's); the caller's comes back.
    let _keep = KeepCurrent::new();
    ctx.make_current()?;
    let stream = match op {
        RmaOp::Put { stream, .. } | RmaOp::Signal { stream, .. } | RmaOp::Wait { stream, .. } => *stream,
    };
    let st = Stream::caller(ctx, stream);
    if st.is_capturing()? {
        return Err(Error::invalid_usage(
            "one-sided operations (ncclPutSignal, ncclSignal, ncclWaitSignal) on a stream capturing a CUDA graph are not \
             supported: issue them outside the capture"));
    }
    let gated = gated(comm, ctx)?;
    if let Some(g) = gated.as_ref().filter(|g| !g.refused.load(Ordering::Acquire)) {
        let queued = match op {
            RmaOp::Put { peer, frame, data, .. } => {
                // Only copies the stream makes without holding up this thread (not between two
                // host buffers: `PtrKind::on_device`); a pinned source is read by the sender.
                use crate::device::cuda::classify;
                let src = if data.is_empty() { None } else { Some(classify(data.addr())?) };
                match (direct_target(comm, *peer, frame)?, src) {
                    (Some(dst), Some(s)) if s.copies_async_with(classify(dst.addr())?) => {
                        g.issue_direct(&st, *peer, *frame, dst, *data)?
                    }
                    _ => g.issue(&st, *peer, *frame, *data, src.is_some_and(|s| s.on_device()))?,
                }
            }
            RmaOp::Signal { peer, frame, .. } => g.issue(&st, *peer, *frame, Region::EMPTY, false)?,
            RmaOp::Wait { descs, .. } => wait_on_stream(comm, &st, descs)?,
        };
        if queued {
            return Ok(());
        }
        g.refuse(comm.rank);
    }
    on_this_thread(comm, &st, op)
}

/// The communicator's sender of one-sided operations, started by its first call; None: the
/// calls run on the calling thread (host-wait mode), where streams cannot wait on memory or
/// the device has few hardware queues (`params::few_device_connections`). A sender that cannot
/// be started (no pinned memory, no thread) fails the call, and the next call tries again:
/// running it on the calling thread instead would hold that thread until the stream gets
/// there, which a program that releases its stream after the call (as NCCL allows) never
/// sees happen.
fn gated<'a>(comm: &'a Arc<Comm>, ctx: &'static Context) -> Result<&'a Option<Arc<Gated>>> {
    if let Some(g) = comm.rma.gated.get() {
        return Ok(g);
    }
    let _one = comm.rma.starting.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(g) = comm.rma.gated.get() {
        return Ok(g);
    }
    let waits = !crate::params::few_device_connections() && ctx.can_wait_on_memory().unwrap_or(false);
    let g = match waits {
        true => Some(Gated::start(comm, ctx).map_err(|e| {
            e.context(format!("rank {}: start the sender of one-sided operations", comm.rank))
        })?),
        false => None,
    };
    Ok(comm.rma.gated.get_or_init(|| g))
}

/// A call run on the calling thread once its stream has got there (host-wait mode).
fn on_this_thread(comm: &Comm, st: &Stream, op: &RmaOp) -> Result<()> {
    match op {
        RmaOp::Put { peer, frame, data, .. } => {
            // Host-wait mode: once the stream got here, the put made on this thread (written
            // directly where it can be, as on a stream).
            let direct = direct_target(comm, *peer, frame)?;
            let copyable = needs_device_copy(&[*data])?;
            st.synchronize()?;
            let ready = comm.ready()?;
            match direct {
                Some(dst) if copyable && !data.is_empty() => {
                    st.copy(dst, *data)?;
                    st.synchronize()?;
                    return deliver(comm, ready, *peer, &frame.signal_only(), Region::EMPTY);
                }
                _ if !copyable => return deliver(comm, ready, *peer, frame, *data),
                _ => {}
            }
            let mut bytes = vec![0u8; data.len()];
            st.copy(Region::owned(&mut bytes), *data)?;
            st.synchronize()?;
            deliver(comm, ready, *peer, frame, Region::owned(&mut bytes))
        }
        RmaOp::Signal { peer, frame, .. } => {
            st.synchronize()?;
            deliver(comm, comm.ready()?, *peer, frame, Region::EMPTY)
        }
        // The signals' puts have landed when they count: work the stream gets later sees them.
        RmaOp::Wait { descs, .. } => wait_for(comm, descs),
    }
}

/// `ncclWaitSignal` on a stream: the stream waits until each signal's word reaches its count.
/// False: the driver refused the first wait, nothing was queued or counted.
fn wait_on_stream(comm: &Comm, st: &Stream, descs: &[WaitDesc]) -> Result<bool> {
    let inner = &comm.rma.inner;
    let mut state = inner.lock();
    if let Some(e) = state.failed.clone() {
        return Err(e);
    }
    let words = match state.words {
        Some(w) => w,
        None => {
            let n = inner.words_len();
            if n > MAX_WORDS {
                return Err(Error::invalid_usage(format!(
                    "{n} signals (contexts x signals per context x ranks) is more than CUDA mode keeps ({MAX_WORDS}): \
                     use fewer (config.numRmaCtx, config.numRmaSig)")));
            }
            let w: &'static MappedHost = Box::leak(Box::new(MappedHost::new(n.max(1) * 4)?));
            for (k, got) in &state.arrived {
                if let Some(i) = inner.word_of(*k) {
                    w.word(i).store(*got as u32, Ordering::Release);
                }
            }
            state.words = Some(w);
            w
        }
    };
    let want = wanted_counts(&state, descs);
    for &(k, n) in &want {
        let got = state.arrived.get(&k).copied().unwrap_or(0);
        if got < n && state.ended.contains_key(&k.2) {
            return Err(Error::remote(format!(
                "rank {}: waiting for signals that {} will not send: it closed its connection; {} came", comm.rank,
                comm.describe_peer(k.2 as usize), super::wait::describe_missing(&state, &(k, got, n)))));
        }
    }
    let mut at = Vec::with_capacity(want.len());
    for &(k, n) in &want {
        at.push((inner.word_of(k).ok_or_else(|| Error::internal("a signal outside the words"))?, n));
    }
    // With NCCL_RS_STREAM_GATE=kernel the stream waits with the polling kernel, as for
    // collectives: it stalls no hardware queue, so the reader's copy of a staged put cannot sit
    // behind it. Queued under the lock: a refused first wait leaves the counts as they were.
    let gate = crate::params::stream_gate_kernel().then(|| Context::primary(comm.cuda_dev).and_then(Context::kernels));
    for (j, &(i, n)) in at.iter().enumerate() {
        if let Some(Ok(k)) = &gate {
            k.wait_geq(st, words, i, n as u32)?;
            continue;
        }
        match st.wait_value32(words, i, n as u32, WaitCond::Geq)? {
            MemOp::Unsupported if j == 0 => return Ok(false),
            m => enqueued(m)?,
        }
    }
    let now = Instant::now();
    for &(k, n) in &want {
        state.consumed.insert(k, n);
        let got = state.arrived.get(&k).copied().unwrap_or(0);
        let fresh = super::Pending { want: n, since: now, warned: false, said_stopped: false };
        let p = state.pending.entry(k).or_insert(fresh);
        // Counted from when the signal fell short of a wait (an earlier one may be satisfied).
        if p.want <= got {
            *p = fresh;
        }
        p.want = p.want.max(n);
    }
    Ok(true)
}
