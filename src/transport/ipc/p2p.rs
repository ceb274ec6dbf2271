//! Sends and receives between ranks of one host in CUDA mode ([`run_p2p`]), pairwise, on
//! connections of their own (`api::rma::p2p`): the sender sends its receiver a record of where
//! its buffer is, the receiver copies from the mapped buffer and answers "done" (the sender's
//! buffer is free) or "send the bytes" (a buffer it cannot map); a sender that could not
//! publish its buffer sends the bytes with its record.

use std::sync::Arc;

use super::share::{decode_segment, encode_segment, Record, Shared, MAX_TABLE, RECORD_BYTES, SEG_BYTES};
use super::{Direct, Offered};
use crate::api::rma::{ANSWER, DATA, RECORD};
use crate::comm::Comm;
use crate::device::cuda::{self, Desc, Segment, Stream};
use crate::device::host::Region;
use crate::error::{Error, Result};
use crate::plan::{Op, OpKind};
use crate::streamed::board::{Board, Ticket};

/// A send or receive between ranks of one host (`Routes::eligible`), as [`run_p2p`] takes it:
/// whether the caller's stream staged it (its regions are the pool's), and a send's buffer as
/// published at call time (None: it could not be; its bytes are staged).
pub struct P2p<'a> {
    pub op: Op,
    pub pre: bool,
    pub offered: Option<&'a Offered>,
    /// A receive whose copy its caller's stream queued at call time: its board slot (one
    /// phase, one copy kernel; see `streamed::board`). The worker closes the slot in any case.
    pub queued: Option<(&'a Board, &'a Ticket)>,
}

/// Pinned memory the copy kernel a receive's caller's stream queued can read: where the bytes
/// of a send the receiver cannot read directly go (`streamed`'s pool).
pub trait Bounce {
    /// `len` bytes, if free now: their host region, the address kernels read them at, and a
    /// key to give them back with once the kernel has read them.
    fn take(&self, len: usize) -> Option<(Region, usize, u64)>;
    fn give_back(&self, key: u64);
}

/// A record's codes: the sender published its buffer, or not (its bytes follow at once).
const RECORD_PUBLISHED: u64 = 1;
const RECORD_STAGED: u64 = 0;
/// An answer's codes: read directly (the sender's buffer is free), send the bytes, or the
/// receive does not match the send.
const ANSWER_DONE: u64 = 1;
const ANSWER_STAGE: u64 = 2;
const ANSWER_MISMATCH: u64 = 3;

/// Where a send or receive of [`run_p2p`] stands.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Awaits {
    /// A receive: the sender's record.
    Record,
    /// A receive: a staged message's bytes.
    Data,
    /// A receive: its caller's stream to run the copy queued there.
    Kernel,
    /// A send: the receiver's answer.
    Answer,
    Done,
}

/// How long a send or receive waits for its peer before it says so at WARN, and how often it
/// asks whether the peer failed.
const P2P_LATE: std::time::Duration = std::time::Duration::from_secs(10);
const P2P_PROBE_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// The sends and receives of one batch between ranks of one host, each with its peer over the
/// communicator's connections for them (`api::rma::p2p`): the sender sends a record of where
/// its buffer is; the receiver copies from the mapped buffer (the kernel its caller's stream
/// queued at call time, else on the worker's stream) and answers "done", or (a buffer the
/// sender could not publish, or this rank cannot map) gets the bytes from the sender instead,
/// which that kernel copies from `bounce` where it has room. Every operation goes on as its
/// messages come, whatever the order: a peer may issue its matching calls in other groups, in
/// any order the host transports allow. The caller runs the batch's other sends and receives
/// meanwhile.
pub fn run_p2p(comm: &Arc<Comm>, stream: &Stream, direct: &mut Direct, bounce: &dyn Bounce, ops: &[P2p]) -> Result<()> {
    if ops.is_empty() {
        return Ok(());
    }
    let mut batch = Batch::new(comm, stream, direct, bounce, ops)?;
    batch.send_records()?;
    let mut watch = Watch::new();
    while batch.waiting().next().is_some() {
        let seen = comm.rma.p2p_arrived();
        let mut progressed = false;
        for i in 0..ops.len() {
            progressed |= batch.advance(i)?;
        }
        batch.answer_copied()?;
        batch.show_done();
        if progressed {
            watch.lost_before = false;
            watch.back_off.progressed();
            continue;
        }
        // Nothing came: why not?
        if batch.stalled(&mut watch)? {
            continue;
        }
        if batch.awaits.contains(&Awaits::Kernel) {
            // A flag in host memory, not a message: polled.
            watch.back_off.wait();
        } else {
            comm.rma.p2p_wait(seen, std::time::Duration::from_millis(50));
        }
    }
    if batch.direct.ran == 0 && batch.ran > 0 {
        crate::info!(P2P, "rank {}: device buffers of peers on this host are read directly (CUDA IPC / same process), \
                           from point-to-point calls", comm.rank);
    }
    batch.direct.ran += batch.ran;
    batch.direct.maps.close_unkept();
    Ok(())
}

/// One batch of [`run_p2p`] under way: each operation's message number and where it stands.
struct Batch<'a> {
    comm: &'a Arc<Comm>,
    ready: &'a crate::comm::Ready,
    stream: &'a Stream,
    direct: &'a mut Direct,
    bounce: &'a dyn Bounce,
    ops: &'a [P2p<'a>],
    /// Each message's number: the pair's sends (receives) so far, alike on both ends.
    numbers: Vec<u64>,
    awaits: Vec<Awaits>,
    /// Per operation: the bounce its queued kernel copies from (its bytes were sent; nobody
    /// waits for an answer). Kept on an error: a kernel may still read it.
    bounced: Vec<Option<u64>>,
    /// Receives copied on the worker's stream, to answer once the copies are done.
    copied: Vec<usize>,
    /// Those shown as done to peers that ask ([`Batch::show_done`]).
    shown_done: Vec<bool>,
    /// Operations that read a peer's buffer directly.
    ran: u64,
}

/// What a batch of [`run_p2p`] that waits has found and said so far.
struct Watch {
    since: std::time::Instant,
    warned: bool,
    /// A connection found lost at the last look, after which what came before it is taken.
    lost_before: bool,
    back_off: crate::proxy::Backoff,
    last_probe: std::time::Instant,
    /// Peers named at WARN as not in their matching calls (once each).
    named: Vec<usize>,
    /// Peers whose communicator the last probe found closed ([`Batch::probe`]).
    closed: Vec<usize>,
}

impl Watch {
    fn new() -> Watch {
        let since = std::time::Instant::now();
        Watch { since, warned: false, lost_before: false, back_off: crate::proxy::Backoff::new(), last_probe: since,
                named: Vec::new(), closed: Vec::new() }
    }
}

impl<'a> Batch<'a> {
    fn new(comm: &'a Arc<Comm>, stream: &'a Stream, direct: &'a mut Direct, bounce: &'a dyn Bounce, ops: &'a [P2p<'a>])
           -> Result<Batch<'a>> {
        let ready = comm.ready()?;
        let n = comm.nranks;
        direct.sent.resize(n, 0);
        direct.received.resize(n, 0);
        direct.maps.next_operation();
        let mut numbers = Vec::with_capacity(ops.len());
        for o in ops {
            let count = if o.op.kind == OpKind::Send { &mut direct.sent } else { &mut direct.received };
            let c = count.get_mut(o.op.root).ok_or_else(|| Error::internal("a peer outside the communicator"))?;
            numbers.push(*c);
            *c += 1;
        }
        Ok(Batch { comm, ready, stream, direct, bounce, ops, numbers, awaits: Vec::with_capacity(ops.len()),
                   bounced: vec![None; ops.len()], copied: Vec::new(), shown_done: vec![false; ops.len()], ran: 0 })
    }

    /// Each send's record to its receiver (with its bytes, where it could not publish its
    /// buffer), and where each operation starts waiting.
    fn send_records(&mut self) -> Result<()> {
        let (comm, rma) = (self.comm, &self.comm.rma);
        for (o, &m) in self.ops.iter().zip(&self.numbers) {
            let (op, peer) = (&o.op, o.op.root);
            if op.kind == OpKind::Recv {
                self.awaits.push(Awaits::Record);
                continue;
            }
            match o.offered.filter(|_| !o.pre) {
                Some(offered) => {
                    let rec = Record { ok: true, input: offered.input, table: offered.table.len() as u32,
                                       server: offered.server, stamp: op.stamp(), ..Record::default() };
                    let mut table = vec![0u8; offered.table.len() * SEG_BYTES];
                    for (seg, b) in offered.table.iter().zip(table.chunks_mut(SEG_BYTES)) {
                        encode_segment(seg, b);
                    }
                    let mut head = rec.encode();
                    rma.p2p_send(comm, peer, RECORD, m, RECORD_PUBLISHED,
                                 &[Region::owned(&mut head), Region::owned(&mut table)])?;
                    self.awaits.push(Awaits::Answer);
                }
                None => {
                    let mut head = Record { ok: false, stamp: op.stamp(), ..Record::default() }.encode();
                    rma.p2p_send(comm, peer, RECORD, m, RECORD_STAGED, &[Region::owned(&mut head)])?;
                    send_bytes(comm, self.stream, o, m)?;
                    self.awaits.push(Awaits::Done);
                }
            }
        }
        Ok(())
    }

    /// Operation `i` one step on, if what it waits for is there: whether it was.
    fn advance(&mut self, i: usize) -> Result<bool> {
        match self.awaits[i] {
            Awaits::Record => self.take_record(i),
            Awaits::Data => self.take_data(i),
            Awaits::Kernel => self.kernel_ran(i),
            Awaits::Answer => self.take_answer(i),
            Awaits::Done => Ok(false),
        }
    }

    /// A receive: its sender's record, if it came. A mapped buffer is copied (by the kernel
    /// queued on the caller's stream, else on the worker's stream); the bytes of one not
    /// published follow by themselves; one that cannot be mapped is asked for.
    fn take_record(&mut self, i: usize) -> Result<bool> {
        let ops = self.ops;
        let (o, m) = (&ops[i], self.numbers[i]);
        let (op, peer) = (&o.op, o.op.root);
        let Some(msg) = self.comm.rma.p2p_take(peer, RECORD, m) else { return Ok(false) };
        self.awaits[i] = Awaits::Data;
        match read_record(self.comm, self.ready, self.direct, op, m, &msg)? {
            Sender::Staged => {}
            Sender::Mapped(src) => match o.queued {
                Some((board, t)) => {
                    board.write(t, 0, Desc::Copy { dst: op.recv.addr(), src: src.addr(), bytes: op.recv.len() });
                    board.open(t, t.step_value(1));
                    self.awaits[i] = Awaits::Kernel;
                }
                None => {
                    self.stream.copy(op.recv, src)?;
                    self.copied.push(i);
                    self.awaits[i] = Awaits::Done;
                }
            },
            Sender::Unmapped => self.comm.rma.p2p_send(self.comm, peer, ANSWER, m, ANSWER_STAGE, &[])?,
        }
        Ok(true)
    }

    /// A receive: the sender's bytes, if they came: to the kernel queued on the caller's stream
    /// through a bounce where there is room, else copied here.
    fn take_data(&mut self, i: usize) -> Result<bool> {
        let ops = self.ops;
        let (o, m) = (&ops[i], self.numbers[i]);
        let (op, peer) = (&o.op, o.op.root);
        let Some(mut msg) = self.comm.rma.p2p_take(peer, DATA, m) else { return Ok(false) };
        if msg.bytes.len() != op.recv.len() {
            return Err(Error::internal(format!("{}: {} bytes came from rank {peer} for {} expected",
                                               op.describe(), msg.bytes.len(), op.recv.len())));
        }
        let bytes = Region::owned(&mut msg.bytes);
        let pinned = match o.queued {
            Some(_) if !o.pre => self.bounce.take(bytes.len()),
            _ => None,
        };
        if let (Some((board, t)), Some((host, device, key))) = (o.queued, pinned) {
            // The caller's stream copies them, with the kernel it queued.
            crate::device::host::copy(host, bytes);
            board.write(t, 0, Desc::Copy { dst: op.recv.addr(), src: device, bytes: op.recv.len() });
            board.open(t, t.step_value(1));
            self.bounced[i] = Some(key);
            self.awaits[i] = Awaits::Kernel;
            return Ok(true);
        }
        if o.pre || cuda::is_host_memory(op.recv.addr()) {
            crate::device::host::copy(op.recv, bytes);
        } else {
            // Done before the message is dropped (and before the caller's stream, which may
            // wait at the copy it queued, moves on: that copy now does nothing).
            self.stream.copy(op.recv, bytes)?;
            self.stream.synchronize()?;
        }
        if let Some((board, t)) = o.queued {
            board.close(t);
        }
        self.awaits[i] = Awaits::Done;
        Ok(true)
    }

    /// A receive: whether the copy its caller's stream queued has run. Then the stream moves
    /// on, and the bounce is given back or the sender told its buffer is free.
    fn kernel_ran(&mut self, i: usize) -> Result<bool> {
        let ops = self.ops;
        let (o, m) = (&ops[i], self.numbers[i]);
        let Some((board, t)) = o.queued else { return Err(Error::internal("a queued copy without a slot")) };
        if !board.flag_reached(t, t.step_value(1)) {
            return Ok(false);
        }
        board.open(t, t.final_gate());
        match self.bounced[i].take() {
            Some(key) => self.bounce.give_back(key),
            None => {
                self.comm.rma.p2p_send(self.comm, o.op.root, ANSWER, m, ANSWER_DONE, &[])?;
                self.ran += 1;
            }
        }
        self.awaits[i] = Awaits::Done;
        Ok(true)
    }

    /// A send: its receiver's answer, if it came: done (read directly), or send the bytes.
    fn take_answer(&mut self, i: usize) -> Result<bool> {
        let ops = self.ops;
        let (o, m) = (&ops[i], self.numbers[i]);
        let (op, peer) = (&o.op, o.op.root);
        let Some(msg) = self.comm.rma.p2p_take(peer, ANSWER, m) else { return Ok(false) };
        match msg.code {
            ANSWER_DONE => self.ran += 1,
            ANSWER_STAGE => send_bytes(self.comm, self.stream, o, m)?,
            _ => return Err(Error::invalid_usage(format!(
                "rank {}: {} does not match what rank {peer} receives", self.comm.rank, op.describe()))),
        }
        self.awaits[i] = Awaits::Done;
        Ok(true)
    }

    /// The senders of the receives copied on the worker's stream are told their buffers are
    /// free, once the copies are done.
    fn answer_copied(&mut self) -> Result<()> {
        if self.copied.is_empty() {
            return Ok(());
        }
        self.stream.synchronize()?;
        for &i in &self.copied {
            self.comm.rma.p2p_send(self.comm, self.ops[i].op.root, ANSWER, self.numbers[i], ANSWER_DONE, &[])?;
        }
        self.ran += self.copied.len() as u64;
        self.copied.clear();
        Ok(())
    }

    /// Those done no longer show as running: peers waiting on this rank see what it waits on.
    fn show_done(&mut self) {
        for (i, o) in self.ops.iter().enumerate() {
            if self.awaits[i] == Awaits::Done && !self.shown_done[i] {
                self.shown_done[i] = true;
                let send = o.op.kind == OpKind::Send;
                self.ready.p2p_finished(o.op.root, send);
                self.ready.finished(&crate::plan::ops::with_role(o.op.stamp(), send, o.op.root), i);
            }
        }
    }

    /// The operations not done.
    fn waiting(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.ops.len()).filter(|&i| self.awaits[i] != Awaits::Done)
    }

    /// Those that still need their peer: a receive whose bytes came and wait for its caller's
    /// stream to copy them does not (its sender is done and may have left).
    fn on_peer(&self) -> impl Iterator<Item = usize> + '_ {
        self.waiting().filter(|&i| self.awaits[i] != Awaits::Kernel || self.bounced[i].is_none())
    }

    /// Nothing came: an error if it never will (the communicator aborted or failed, a peer's
    /// connection lost, a peer failed or gone), said at WARN where a peer is late. True: look
    /// again at once (what came before a lost connection is taken first).
    fn stalled(&self, watch: &mut Watch) -> Result<bool> {
        let comm = self.comm;
        use std::sync::atomic::Ordering::Acquire;
        if comm.abort.load(Acquire) || comm.revoked.load(Acquire) {
            return Err(Error::invalid_usage("communicator aborted or revoked during a send or receive"));
        }
        if let Some(e) = comm.async_error() {
            return Err(e);
        }
        let lost = self.on_peer().find_map(|i| comm.rma.p2p_lost(self.ops[i].op.root).map(|e| (i, e)));
        if let Some((i, e)) = lost {
            if watch.lost_before {
                return Err(e.context(format!("rank {}: {}", comm.rank, self.ops[i].op.describe())));
            }
            watch.lost_before = true;
            return Ok(true);
        }
        if watch.last_probe.elapsed() >= P2P_PROBE_EVERY {
            // A peer that failed elsewhere (its host transports, a kernel) or is gone sends
            // nothing more: ask, once a second.
            watch.last_probe = std::time::Instant::now();
            let mut peers: Vec<usize> = self.on_peer().map(|i| self.ops[i].op.root).collect();
            peers.sort_unstable();
            peers.dedup();
            for p in peers {
                self.probe(p, watch)?;
            }
        }
        if !watch.warned && watch.since.elapsed() >= P2P_LATE {
            watch.warned = true;
            let what: Vec<String> =
                self.waiting().map(|i| format!("{} ({:?})", self.ops[i].op.describe(), self.awaits[i])).collect();
            crate::warn!("rank {}: waiting {:.0} s for peers' matching calls: {}", comm.rank,
                         watch.since.elapsed().as_secs_f64(), what.join(", "));
        }
        Ok(false)
    }

    /// Is peer `p`, which an operation waits on, in its matching call, and if not, why not?
    /// Said at WARN (once per rank named); an error where it failed, is gone, closed its
    /// communicator, or waits on this rank for ever.
    fn probe(&self, p: usize, watch: &mut Watch) -> Result<()> {
        let comm = self.comm;
        // The first operation that waits on it.
        let Some(op) = self.on_peer().map(|i| &self.ops[i].op).find(|o| o.root == p) else { return Ok(()) };
        let describe = &crate::plan::ops::describe_stamp;
        let mine = crate::plan::ops::with_role(op.stamp(), op.kind == OpKind::Send, p);
        let unknown = match comm.peer_runs(p, &mine, describe) {
            // It failed, or it only sends to this rank while this rank only sends to it (or
            // both only receive), or they wait round a cycle: no call can finish.
            Err(e) if e.msg.contains(" failed: ") || crate::comm::is_deadlock(&e) => {
                return Err(e.context(format!("rank {}: a send or receive with rank {p}", comm.rank)));
            }
            // It runs other calls: a peer may, between its sends and receives.
            Err(_) => false,
            Ok(runs) => {
                let culprit = runs.culprit(p);
                if let Some(why) = runs.why_waiting(&mine, describe).filter(|_| !watch.named.contains(&culprit)) {
                    watch.named.push(culprit);
                    crate::warn!("rank {}: waited {:.1} s in {} for {}, {why}", comm.rank,
                                 watch.since.elapsed().as_secs_f64(), op.describe(), comm.describe_peer(p));
                }
                !runs.answered()
            }
        };
        if let Some((why, true)) = comm.peer_gone(p) {
            return Err(Error::remote(format!("rank {}: lost {} ({why}) during a send or receive", comm.rank,
                                             comm.describe_peer(p))));
        }
        // Its process goes on without this communicator (destroyed or aborted before it made
        // the matching call, so no connection of its own says so). Found on two probes a second
        // apart: a message it sent just before closing has come by then.
        match unknown.then(|| comm.peer_closed(p)).flatten() {
            Some(why) if watch.closed.contains(&p) => Err(Error::remote(format!(
                "rank {}: {} destroyed or aborted its communicator ({why}) without making the matching call",
                comm.rank, comm.describe_peer(p)))),
            Some(_) => {
                watch.closed.push(p);
                Ok(())
            }
            None => {
                watch.closed.retain(|&q| q != p);
                Ok(())
            }
        }
    }
}

/// What a receiver makes of its sender's record.
enum Sender {
    /// The sender could not publish its buffer: its bytes follow.
    Staged,
    /// Its buffer, mapped here.
    Mapped(Region),
    /// Published, but this rank cannot map it (it answers so, and the bytes follow).
    Unmapped,
}

/// The record of the send that `op` (a receive) matches, checked against it: a send of
/// another size or type is an error on both ends (the sender is answered so).
fn read_record(comm: &Comm, ready: &crate::comm::Ready, direct: &mut Direct, op: &Op, m: u64,
               msg: &crate::api::rma::Message) -> Result<Sender> {
    let (me, peer) = (comm.rank, op.root);
    let theirs = (msg.bytes.len() >= RECORD_BYTES).then(|| Record::decode(&msg.bytes));
    let Some(theirs) = theirs.filter(|r| r.stamp == op.stamp()) else {
        let _ = comm.rma.p2p_send(comm, peer, ANSWER, m, ANSWER_MISMATCH, &[]);
        let Some(theirs) = theirs else {
            return Err(Error::invalid_usage(format!("rank {me}: {} matched a malformed record from rank {peer}",
                                                    op.describe())));
        };
        let from = comm.describe_peer(peer);
        return Err(Error::invalid_usage(format!("rank {me}: {}: {}", op.describe(),
                                                crate::plan::ops::describe_arrival(&from, &theirs.stamp, me, &op.stamp()))));
    };
    if msg.code != RECORD_PUBLISHED {
        return Ok(Sender::Staged);
    }
    let table: Vec<Segment> = msg.bytes[RECORD_BYTES..].chunks_exact(SEG_BYTES).map(decode_segment).collect();
    let (sender, ours) = (&ready.peers[peer], &ready.peers[me]);
    if table.len() != theirs.table as usize || table.len() > MAX_TABLE {
        return Err(Error::internal(format!("rank {me}: a record from rank {peer} with a table of {} entries", table.len())));
    }
    if !direct.reaches_device(comm, peer, ours, sender) {
        // Another device of this process, whose memory this one's kernels cannot read.
        return Ok(Sender::Unmapped);
    }
    let shared = Shared { table: &table, server: theirs.server };
    match direct.maps.map(ours, sender, &theirs.input, shared, comm.cuda_dev) {
        Ok(src) if src.len() == op.recv.len() => Ok(Sender::Mapped(src)),
        Ok(src) => Err(Error::internal(format!("rank {me}: rank {peer} published {} bytes for {}", src.len(),
                                               op.describe()))),
        Err(e) => {
            crate::info!(P2P, "rank {me}: cannot map rank {peer}'s buffer ({}); staging", e.msg);
            Ok(Sender::Unmapped)
        }
    }
}

/// A send's bytes to its receiver as message `m`: from the pool where its caller's stream
/// staged them, or from host memory where they are, else copied to host memory first.
fn send_bytes(comm: &Comm, stream: &Stream, o: &P2p, m: u64) -> Result<()> {
    let (op, peer) = (&o.op, o.op.root);
    if o.pre || cuda::is_host_memory(op.send.addr()) {
        return comm.rma.p2p_send(comm, peer, DATA, m, 0, &[op.send]);
    }
    let mut bytes = crate::device::host::zeroed(op.send.len(), &|| format!("a copy of {}", op.describe()))?;
    stream.copy(Region::owned(&mut bytes), op.send)?;
    stream.synchronize()?;
    comm.rma.p2p_send(comm, peer, DATA, m, 0, &[Region::owned(&mut bytes)])
}
