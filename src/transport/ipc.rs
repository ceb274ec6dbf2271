//! CUDA mode, ranks of one host: collectives that read the peers' device buffers directly.
//!
//! Every rank publishes where its input and output are (a CUDA IPC handle of the allocation
//! and the offset; for memory of the virtual memory API — PyTorch's expandable segments — the
//! allocations behind the buffer, whose file descriptors peers receive over a Unix socket
//! (`fdpass`) and map side by side; or the raw address for ranks of the same process) with a
//! small all-gather over the host transports; each rank maps the others' buffers (NVLink or
//! PCIe peer access, or the same GPU) and computes its own part with copies and the reduction
//! kernels of `kernels/reduce.ptx`, reading peers and writing only its own output. Small host-transport
//! all-reduces are the barriers: after the last one every peer has finished reading this
//! rank's buffers, so the caller's stream may move on. [`compute`] says what runs, once, for
//! three executors: the kernels queued on the caller's stream at call time ([`shape`] counts
//! them; [`run_on_stream`] fills in their descriptors and opens their gates, see
//! `streamed::board`), or copies and kernels on the worker's own stream ([`run`]).
//!
//! All ranks take this path or none: whether an operation is eligible depends only on what
//! every rank knows alike (the operation, its size, where the ranks run), and when a rank
//! cannot publish or map a buffer (memory without IPC support, GPUs without peer access, an
//! in-place all-to-all) all of them learn it in the agreement step and stage the operation
//! through host memory instead — for good, when a rank never can ([`agree`]).
//!
//! Mappings of peers' allocations are kept (as UCX's CUDA IPC cache does): opening and closing
//! them per operation costs time, and unmapping while a caller's stream waits for the worker
//! could stall in the driver. A peer's handle names one allocation, so a mapping is only used
//! while its owner publishes that allocation again. One is closed when its owner publishes a
//! new allocation at the same address (the old one is gone), when more than `NCCL_RS_PEER_MAPS`
//! (256) are open (the least recently used), and when the worker stops. The driver documents
//! freeing an exported allocation before its importers close it as undefined; in practice the
//! importer's mapping keeps it alive until closed (for the virtual memory API it is documented
//! so) — the trade-off the first GPU runs must confirm; `NCCL_RS_PEER_MAPS=0` closes mappings
//! after each operation instead.
//! PreMulSum is staged (its scaled input would need device scratch memory, allocated while
//! streams wait).
//!
//! Sends and receives ([`run_p2p`]) work pairwise: the sender sends its receiver a record, the
//! receiver copies from the mapped buffer and answers "done" (the sender's buffer is free) or
//! "stage it" (both ends then stage that message).

mod share;

use std::sync::Arc;

use share::{decode_segment, encode_segment, Maps, Published, Record, Shared, MAX_TABLE, RECORD_BYTES, SEG_BYTES};

use crate::comm::Comm;
use crate::device::cuda::{self, Desc, Indirect, Segment, Stream};
use crate::device::host::{ElemOp, Region, UserPtr};
use crate::error::{Error, Result};
use crate::plan::{Op, OpKind};
use crate::streamed::board::{Board, Ticket};
use crate::transport::fdpass::{self, Address};
use crate::types::{BuiltinOp, DataType, RedOp};

/// Operations at least this large go direct (`NCCL_RS_DIRECT_MIN`, 64 KiB by default); smaller
/// ones are latency-bound, and staging through the host transports costs fewer round trips.
/// Like every parameter that decides a path, it must be alike on every rank.
fn direct_min() -> usize {
    crate::params::direct_min()
}

/// A stream worker's state for direct operations: the peer mappings it keeps.
#[derive(Default)]
pub struct Direct {
    /// The ranks agreed that collectives never go direct again on this communicator (some
    /// rank cannot, ever: see [`agree`]); every rank stages them from the next one on.
    pub off: bool,
    maps: Maps,
    /// Mapping a peer's memory failed in a way that may pass (said once, at WARN).
    refused: bool,
    /// Operations run direct so far (the first is logged).
    ran: u64,
}

impl Direct {
    /// Bytes of peers' device memory this worker keeps mapped.
    pub fn mapped_bytes(&self) -> u64 {
        self.maps.bytes()
    }

    /// Closes every peer mapping (ncclCommSuspend with NCCL_SUSPEND_MEM): the peers'
    /// allocations this worker held alive are freed once their owners have freed them. The
    /// direct path maps them again on next use. Returns how many were closed, and their bytes.
    pub fn close_mappings(&mut self) -> (usize, u64) {
        self.maps.close_all()
    }
}

/// Which operations of a communicator may go direct, decided once (when its stream worker
/// starts) from the parameters and where the ranks run: the same answers on every rank.
#[derive(Clone, Debug, Default)]
pub struct Routes {
    /// Collectives: every rank on this host, and direct access not disabled.
    collectives: bool,
    /// Every rank in this process: buffers are published by address alone.
    one_process: bool,
    /// Sends and receives, per peer: only with NCCL_RS_DIRECT_P2P=1 (the exchange assumes
    /// both ends group their sends and receives alike: a rank that sends and receives in two
    /// calls while its peer groups both would read the peer's record where it expects an
    /// answer; staging has no such assumption), to other ranks of this host.
    p2p: Vec<bool>,
}

impl Routes {
    pub fn of(comm: &Comm) -> Routes {
        let Some(ready) = comm.ready_if_any() else { return Routes::default() };
        if crate::params::p2p_disable() || crate::params::p2p_level_forbids() {
            return Routes::default();
        }
        let me = &ready.peers[comm.rank];
        let p2p = if crate::params::direct_p2p() {
            ready.peers.iter().enumerate().map(|(p, info)| p != comm.rank && info.same_host(me)).collect()
        } else {
            Vec::new()
        };
        Routes { collectives: ready.peers.iter().all(|p| p.same_host(me)),
                 one_process: ready.peers.iter().all(|p| p.same_process(me)), p2p }
    }

    /// May collectives go direct at all?
    pub fn collectives(&self) -> bool {
        self.collectives
    }

    /// Does `op` go direct?
    pub fn eligible(&self, op: &Op) -> bool {
        let big = op.count.saturating_mul(op.dt.size()) >= direct_min().max(1);
        if op.kind.is_p2p() {
            return big && op.scalar_at.is_none() && self.p2p.get(op.root).copied().unwrap_or(false);
        }
        // The direct path has no scaling step: what the planner scales first (PreMulSum, fp16
        // Avg; see `plan::ops::scaling`) is staged.
        let scaled = crate::plan::ops::scales_inputs(op.op, op.dt) || op.scalar_at.is_some();
        self.collectives && big && !scaled
    }
}

/// The steps of the exchanges, as the control operations' stamps name them.
const STEP_RECORDS: u8 = 1;
const STEP_AGREE: u8 = 2;
const STEP_HALFWAY: u8 = 3;
const STEP_DONE: u8 = 4;
const STEP_P2P_RECORD: u8 = 5;
const STEP_P2P_ANSWER: u8 = 6;
const STEP_TABLES: u8 = 7;

/// A control operation on the host transports (every rank issues the same ones) at `step` of
/// the user's operation `user`: a rank that issued another call is told which one this was.
#[allow(clippy::too_many_arguments)]
fn control(comm: &Arc<Comm>, kind: OpKind, dt: DataType, op: BuiltinOp, count: usize, send: Region, recv: Region,
           user: &Op, step: u8) -> Result<()> {
    let c = Op { kind, dt, op: RedOp::Builtin(op), count, root: 0, send, recv, seq: user.seq, scalar_at: None,
                 of: Some(crate::plan::ops::control_stamp(&user.stamp(), step)) };
    crate::group::execute_now(comm, &[c])
}

fn barrier(comm: &Arc<Comm>, user: &Op, step: u8) -> Result<()> {
    let mut v = [1i32.to_le_bytes()];
    let r = Region::owned(v[0].as_mut_slice());
    control(comm, OpKind::AllReduce, DataType::Int32, BuiltinOp::Sum, 1, r, r, user, step)
}

/// This rank's buffers of a direct operation, published at call time (the worker then makes
/// no driver call for them while a caller's stream may be waiting), with the allocations of
/// the virtual memory API behind them.
#[derive(Clone, Debug)]
pub struct Offered {
    input: Published,
    output: Published,
    table: Vec<Segment>,
    /// Where this process serves the table's descriptors (none without a table), and what
    /// keeps them on offer while the operation is in flight.
    server: Address,
    _in_flight: Option<share::InFlight>,
}

/// What this rank offers for `op` on the direct path, known at call time; None when it
/// declines whatever the others say: an in-place all-to-all, a buffer it cannot share (pinned
/// or pageable host memory; memory of the virtual memory API is shared as descriptors), or no
/// kernels.
/// Every rank then stages `op`, and this one's caller's stream can stage it at call time (it
/// still takes part in the agreement, [`decline`]).
pub fn offer(op: &Op, kernels: bool, routes: &Routes) -> Option<Offered> {
    let in_place_alltoall = op.kind == OpKind::AlltoAll && op.send.addr() == op.recv.addr();
    if !kernels || in_place_alltoall {
        return None;
    }
    let mut table = Vec::new();
    let input = share::publish(op.send, !routes.one_process, &mut table)?;
    let output = share::publish(op.recv, !routes.one_process, &mut table)?;
    let (server, in_flight) = if table.is_empty() {
        (Address::default(), None)
    } else {
        (fdpass::serve(share::export_request).ok()?, Some(share::in_flight(&table)))
    };
    Some(Offered { input, output, table, server, _in_flight: in_flight })
}

/// This rank's part of the agreement for an operation it declines ([`offer`]): every rank
/// stages it (and, with `never` — this rank has no kernels — every later one too).
pub fn decline(comm: &Arc<Comm>, direct: &mut Direct, op: &Op, never: bool, started: Started) -> Result<()> {
    agree(comm, if never { Offer::Never } else { Offer::Declines }, direct, op, started).map(|_| ())
}

/// Returns once the caller's stream has reached the operation (the worker's wait for its
/// batch's start, done once). The agreement calls it after mapping the peers' buffers and
/// before its last exchange, so that the mapping — driver work on page tables — is done while
/// the stream is typically still busy with earlier work rather than waiting for the worker,
/// and the last exchange still tells every rank that every stream has arrived.
pub type Started<'a> = &'a mut dyn FnMut() -> Result<()>;

/// A direct operation's kernels queued on the caller's stream: its board slot and shape.
pub struct Queued<'a> {
    pub board: &'a Board,
    pub ticket: &'a Ticket,
    pub shape: &'a [Phase],
}

/// What a rank brings to the agreement on one operation.
#[derive(Clone, Copy, Debug)]
enum Offer<'a> {
    /// Its buffers, published at call time.
    Buffers(&'a Offered),
    /// Nothing, this time (its buffers have no CUDA IPC, an in-place all-to-all).
    Declines,
    /// Nothing, ever (no kernels on this rank).
    Never,
}

/// The agreement's verdicts, as the ranks' minimum: stage this operation and every later
/// one; stage this one; go direct.
const NEVER: i32 = -1;
const STAGE: i32 = 0;
const GO: i32 = 1;

/// The buffers of every rank (its own included) mapped into this process, or None if some
/// rank could not publish or map them, or issued another call: every rank learns it alike in
/// the agreement and stages the operation. A rank that never can (no kernels, a peer it can
/// never map: the driver refused, or a device of its own process) says so, and then every
/// rank stages every later collective without asking (`Direct::off`).
fn agree(comm: &Arc<Comm>, offer: Offer, direct: &mut Direct, op: &Op, started: Started)
         -> Result<Option<(Vec<Region>, Vec<Region>)>> {
    let ready = comm.ready()?;
    let (n, me) = (comm.nranks, comm.rank);
    direct.maps.next_operation();
    let input = op.send;
    let mine = match offer {
        Offer::Buffers(o) => Record { ok: true, input: o.input, output: o.output, table: o.table.len() as u32,
                                      server: o.server, stamp: op.stamp() },
        _ => Record { ok: false, stamp: op.stamp(), ..Record::default() },
    };
    let mut all = vec![0u8; RECORD_BYTES * n];
    let mut enc = mine.encode();
    control(comm, OpKind::AllGather, DataType::Int8, BuiltinOp::Sum, RECORD_BYTES, Region::owned(&mut enc),
            Region::owned(&mut all), op, STEP_RECORDS)?;
    let records: Vec<Record> = all.chunks(RECORD_BYTES).map(Record::decode).collect();
    // Every rank must have issued this very call (else: stage, where the mismatch is reported).
    let mut verdict = match offer {
        Offer::Never => NEVER,
        _ if records.iter().all(|r| r.ok && r.stamp == mine.stamp && r.table as usize <= MAX_TABLE) => GO,
        _ => STAGE,
    };
    // The segment tables, when some rank has one (every rank knows it from the records alike);
    // none (no allocation) otherwise.
    let longest = records.iter().map(|r| r.table as usize).max().unwrap_or(0);
    let tables = if longest > 0 && longest <= MAX_TABLE {
        let own = match offer { Offer::Buffers(o) => &o.table[..], _ => &[] };
        exchange_tables(comm, op, own, longest)?
    } else {
        Vec::new()
    };
    // Map every peer's buffers; then agree that everyone could.
    let mut ins = Vec::with_capacity(n);
    let mut outs = Vec::with_capacity(n);
    for (p, rec) in records.iter().enumerate() {
        if verdict != GO {
            break;
        }
        if p == me {
            ins.push(input);
            outs.push(op.recv);
            continue;
        }
        let (theirs, ours) = (&ready.peers[p], &ready.peers[me]);
        if theirs.same_process(ours) && theirs.cuda_dev != comm.cuda_dev {
            // Another device of this process: its memory needs peer access we have not enabled.
            crate::info!(P2P, "rank {me}: rank {p} is on device {} of this process; staging through host memory",
                         ready.peers[p].cuda_dev);
            verdict = NEVER;
            break;
        }
        // Only the entries its record announced (the exchange pads every table alike).
        let table = tables.get(p).and_then(|t| t.get(..rec.table as usize)).unwrap_or_default();
        let shared = Shared { table, server: rec.server };
        let mapped = direct.maps.map(ours, theirs, &rec.input, shared, comm.cuda_dev)
            .and_then(|i| Ok((i, direct.maps.map(ours, theirs, &rec.output, shared, comm.cuda_dev)?)));
        match mapped {
            Ok((i, o)) => {
                ins.push(i);
                outs.push(o);
            }
            Err(e) => {
                if e.code == crate::Code::SystemError && !direct.refused {
                    direct.refused = true;
                    crate::warn!("rank {me}: cannot map rank {p}'s device memory ({}): collectives on it are staged \
                                  through host memory, which is slower", e.msg);
                }
                crate::info!(P2P, "rank {me}: cannot map rank {p}'s buffers ({}); staging through host memory", e.msg);
                // The driver refused (no peer access between the devices, no IPC): it will
                // again. A buffer outside what its owner published, or descriptors the system
                // would not hand over, are this call's problem.
                verdict = if e.code == crate::Code::UnhandledCudaError { NEVER } else { STAGE };
            }
        }
    }
    // Every rank enters the last exchange only once its own stream has arrived.
    started()?;
    let mut flag = [verdict.to_le_bytes()];
    let f = Region::owned(flag[0].as_mut_slice());
    control(comm, OpKind::AllReduce, DataType::Int32, BuiltinOp::Min, 1, f, f, op, STEP_AGREE)?;
    let verdict = i32::from_le_bytes(flag[0]);
    if verdict != GO {
        // Staged: what this operation mapped is not read.
        direct.maps.close_unkept();
    }
    match verdict {
        GO if matches!(offer, Offer::Buffers(_)) => Ok(Some((ins, outs))),
        NEVER => {
            if !direct.off {
                crate::info!(P2P, "rank {me}: some rank can never read its peers' device buffers directly; from {} on, \
                                   collectives on device memory are staged through host memory", op.describe());
            }
            direct.off = true;
            Ok(None)
        }
        _ => Ok(None),
    }
}

/// Every rank's segment table (`mine` is this rank's), each entry padded to `longest` (the
/// longest any record announced, at most [`MAX_TABLE`]).
fn exchange_tables(comm: &Arc<Comm>, op: &Op, mine: &[Segment], longest: usize) -> Result<Vec<Vec<Segment>>> {
    let mut enc = vec![0u8; longest * SEG_BYTES];
    for (s, b) in mine.iter().zip(enc.chunks_mut(SEG_BYTES)) {
        encode_segment(s, b);
    }
    let mut all = vec![0u8; enc.len() * comm.nranks];
    control(comm, OpKind::AllGather, DataType::Int8, BuiltinOp::Sum, enc.len(), Region::owned(&mut enc),
            Region::owned(&mut all), op, STEP_TABLES)?;
    Ok(all.chunks(enc.len()).map(|t| t.chunks(SEG_BYTES).map(decode_segment).collect()).collect())
}

fn log_first(comm: &Comm, direct: &mut Direct, op: &Op, on_stream: bool) {
    if direct.ran == 0 {
        let by = if on_stream { "on the caller's stream" } else { "on the stream worker's stream" };
        crate::info!(P2P, "rank {}: device buffers of the {} ranks of this host are read directly (CUDA IPC, \
                           shared allocations of the virtual memory API, or the same process), {by}, from {}",
                     comm.rank, comm.nranks, op.describe());
    }
    direct.ran += 1;
}

/// Run `op` directly, its device work on the worker's `stream`. Ok(false): some rank could
/// not, and every rank falls back alike. On an error, copies already queued may still read
/// peers' memory or write the caller's: the worker synchronises its stream before it reports
/// a failed batch.
pub fn run(comm: &Arc<Comm>, stream: &Stream, kernels: Option<&cuda::Kernels>, direct: &mut Direct, op: &Op,
           offered: &Offered, started: Started) -> Result<bool> {
    let offer = if kernels.is_some() { Offer::Buffers(offered) } else { Offer::Never };
    let Some((ins, outs)) = agree(comm, offer, direct, op, started)? else { return Ok(false) };
    let Some(k) = kernels else { return Ok(false) };
    compute(comm, op, &ins, &outs, &mut Immediate { comm, op, stream, k })?;
    direct.maps.close_unkept();
    log_first(comm, direct, op, false);
    Ok(true)
}

/// The kernels `op` needs on the direct path, per phase: each kernel's element count (bytes
/// for a copy), which sizes its grid, and which kernel it is. Known at call time on every rank
/// alike (peers' buffers have this rank's sizes; the worker checks that it fills in exactly
/// these).
pub fn shape(comm: &Comm, op: &Op) -> Shape {
    let n = comm.nranks;
    let mut plan = Planner { phases: vec![Vec::new()] };
    // Stand-ins for every rank's buffers, with the sizes the root's (or any rank's) have.
    let input = match op.kind {
        OpKind::Broadcast => op.count * op.dt.size(),
        OpKind::Scatter => n * op.count * op.dt.size(),
        _ => op.send.len(),
    };
    // SAFETY: never dereferenced: the planner only takes the lengths of these regions.
    let stand_in = |len: usize| Region::user(unsafe { UserPtr::new(std::ptr::null::<u8>()) }, 0, len);
    let ins = vec![stand_in(input); n];
    let outs = vec![stand_in(op.recv.len()); n];
    if compute_steps(comm.rank, n, op, &ins, &outs, &mut plan).is_err() {
        return Vec::new();
    }
    plan.phases.pop();
    plan.phases
}

/// Run `op` directly, its device work queued at call time on the caller's stream (the
/// kernels of `shape` in slot `t` of `board`, see `streamed::board`): this fills in their
/// descriptors phase by phase and opens the gates. Ok(false): every rank stages it (the
/// caller does, then closes the slot). The caller closes the slot in every case.
pub fn run_on_stream(comm: &Arc<Comm>, direct: &mut Direct, op: &Op, offered: &Offered, queued: &Queued,
                     started: Started) -> Result<bool> {
    let Some((ins, outs)) = agree(comm, Offer::Buffers(offered), direct, op, started)? else { return Ok(false) };
    let Queued { board, ticket: t, shape } = *queued;
    let mut fill = Filler { comm, op, board, t, shape, phase: 0, next: 0 };
    compute(comm, op, &ins, &outs, &mut fill)?;
    if fill.phase != shape.len() {
        return Err(Error::internal(format!("direct {}: {} phases filled, {} queued", op.describe(), fill.phase,
                                           shape.len())));
    }
    board.open(t, t.final_gate());
    direct.maps.close_unkept();
    log_first(comm, direct, op, true);
    Ok(true)
}

/// Where the steps of [`compute`] go.
trait Exec {
    fn copy(&mut self, dst: Region, src: Region) -> Result<()>;
    fn reduce(&mut self, dt: DataType, op: ElemOp, dst: Region, a: Region, b: Region) -> Result<()>;
    fn divide(&mut self, dt: DataType, dst: Region, src: Region, divisor: u64) -> Result<()>;
    /// The end of a phase: every rank has done its part before any goes on. `step` names it
    /// in the control operations' stamps.
    fn phase_end(&mut self, step: u8) -> Result<()>;
}

/// Device work on the worker's stream, host barriers between phases.
struct Immediate<'a> {
    comm: &'a Arc<Comm>,
    op: &'a Op,
    stream: &'a Stream,
    k: &'a cuda::Kernels,
}

impl Exec for Immediate<'_> {
    fn copy(&mut self, dst: Region, src: Region) -> Result<()> {
        if dst.addr() == src.addr() { Ok(()) } else { self.stream.copy(dst, src) }
    }
    fn reduce(&mut self, dt: DataType, op: ElemOp, dst: Region, a: Region, b: Region) -> Result<()> {
        self.k.reduce(dt, op, dst, a, b, self.stream)
    }
    fn divide(&mut self, dt: DataType, dst: Region, src: Region, divisor: u64) -> Result<()> {
        self.k.divide(dt, dst, src, divisor, self.stream)
    }
    fn phase_end(&mut self, step: u8) -> Result<()> {
        self.stream.synchronize()?;
        barrier(self.comm, self.op, step)
    }
}

/// One phase of a direct operation queued at call time: per kernel, its grid size (elements,
/// or bytes of a copy) and which kernel it is.
pub type Phase = Vec<(usize, Indirect)>;
pub type Shape = Vec<Phase>;

/// Counts the kernels per phase (call time).
struct Planner {
    phases: Shape,
}

impl Planner {
    fn push(&mut self, n: usize, kind: Indirect) -> Result<()> {
        match self.phases.last_mut() {
            Some(p) => p.push((n, kind)),
            None => self.phases.push(vec![(n, kind)]),
        }
        Ok(())
    }
}

impl Exec for Planner {
    fn copy(&mut self, dst: Region, src: Region) -> Result<()> {
        self.push(dst.len().min(src.len()), Indirect::Copy)
    }
    fn reduce(&mut self, dt: DataType, _: ElemOp, dst: Region, a: Region, b: Region) -> Result<()> {
        self.push(dst.len().min(a.len()).min(b.len()) / dt.size(), Indirect::Of(dt))
    }
    fn divide(&mut self, dt: DataType, dst: Region, src: Region, _: u64) -> Result<()> {
        self.push(dst.len().min(src.len()) / dt.size(), Indirect::Of(dt))
    }
    fn phase_end(&mut self, _: u8) -> Result<()> {
        self.phases.push(Vec::new());
        Ok(())
    }
}

/// Fills in the descriptors of the kernels the caller queued, opens each phase's gate, waits
/// for the caller's stream to finish the phase, then for the peers (worker).
struct Filler<'a> {
    comm: &'a Arc<Comm>,
    op: &'a Op,
    board: &'a Board,
    t: &'a Ticket,
    shape: &'a [Phase],
    /// Phases opened so far, and the next descriptor of the current one.
    phase: usize,
    next: usize,
}

impl Filler<'_> {
    /// The next descriptor, for `n` elements (bytes of a copy) by the `kind` kernel.
    fn put(&mut self, desc: Desc, n: usize, kind: Indirect) -> Result<()> {
        let first: usize = self.shape.iter().take(self.phase).map(Vec::len).sum();
        match self.shape.get(self.phase).and_then(|p| p.get(self.next)) {
            Some(&queued) if queued == (n, kind) => {
                self.board.write(self.t, first + self.next, desc);
                self.next += 1;
                Ok(())
            }
            queued => Err(Error::internal(format!(
                "direct {}: kernel {} of phase {} covers {n}, the one queued {queued:?}", self.op.describe(), self.next,
                self.phase))),
        }
    }
}

impl Exec for Filler<'_> {
    fn copy(&mut self, dst: Region, src: Region) -> Result<()> {
        let bytes = dst.len().min(src.len());
        let desc = if dst.addr() == src.addr() { Desc::Skip } else { Desc::Copy { dst: dst.addr(), src: src.addr(), bytes } };
        self.put(desc, bytes, Indirect::Copy)
    }
    fn reduce(&mut self, dt: DataType, op: ElemOp, dst: Region, a: Region, b: Region) -> Result<()> {
        let n = dst.len().min(a.len()).min(b.len()) / dt.size();
        self.put(Desc::Reduce { dt, op, dst: dst.addr(), a: a.addr(), b: b.addr(), n }, n, Indirect::Of(dt))
    }
    fn divide(&mut self, dt: DataType, dst: Region, src: Region, divisor: u64) -> Result<()> {
        let n = dst.len().min(src.len()) / dt.size();
        self.put(Desc::Divide { dt, dst: dst.addr(), src: src.addr(), divisor, n }, n, Indirect::Of(dt))
    }
    fn phase_end(&mut self, step: u8) -> Result<()> {
        let filled = self.next;
        let queued = self.shape.get(self.phase).map_or(0, Vec::len);
        if filled != queued {
            return Err(Error::internal(format!("direct {}: phase {} filled {filled} kernels of {queued}",
                                               self.op.describe(), self.phase)));
        }
        self.phase += 1;
        self.next = 0;
        let value = self.t.step_value(self.phase);
        self.board.open(self.t, value);
        // The caller's stream runs the phase when it gets there; the host waits for its flag.
        crate::streamed::wait_for_stream(self.comm, std::slice::from_ref(self.op),
                                         "its CUDA stream has not finished a phase of the call's device work",
                                         || Ok(self.board.flag_reached(self.t, value)))?;
        barrier(self.comm, self.op, step)
    }
}

/// This rank's part, reading `ins`/`outs` of every rank (its own included), into `x`.
fn compute(comm: &Arc<Comm>, op: &Op, ins: &[Region], outs: &[Region], x: &mut dyn Exec) -> Result<()> {
    compute_steps(comm.rank, comm.nranks, op, ins, outs, x)
}

fn compute_steps(me: usize, n: usize, op: &Op, ins: &[Region], outs: &[Region], x: &mut dyn Exec) -> Result<()> {
    let es = op.dt.size();
    let block = op.count * es;
    let crate::plan::Reduction { dt, op: elem, divide } = crate::plan::ops::summed_reduction(op.op, op.dt, n);
    let out = op.recv;
    // dst <- op over every rank's `part` of its input, then the Avg division. Our own input
    // comes first: in place, `dst` is our own input, and the first step overwrites it. (Each
    // result is computed by one rank only, so the order need not agree across ranks.)
    let order: Vec<usize> = std::iter::once(me).chain((0..n).filter(|&p| p != me)).collect();
    let reduce_all = |x: &mut dyn Exec, dst: Region, part: &dyn Fn(Region) -> Region| -> Result<()> {
        if n == 1 {
            x.copy(dst, part(ins[me]))?;
        } else {
            x.reduce(dt, elem, dst, part(ins[order[0]]), part(ins[order[1]]))?;
            for &p in &order[2..] {
                x.reduce(dt, elem, dst, dst, part(ins[p]))?;
            }
        }
        if let Some(d) = divide {
            x.divide(dt, dst, dst, d)?;
        }
        Ok(())
    };
    match op.kind {
        OpKind::AllReduce => {
            let chunk = |c: usize| crate::algo::chunk(op.count, es, n, c);
            let (off, len) = chunk(me);
            reduce_all(x, out.sub(off, len), &|r: Region| r.sub(off, len))?;
            x.phase_end(STEP_HALFWAY)?;
            for (p, o) in outs.iter().enumerate().filter(|(p, _)| *p != me) {
                let (off, len) = chunk(p);
                x.copy(out.sub(off, len), o.sub(off, len))?;
            }
        }
        OpKind::ReduceScatter => reduce_all(x, out, &|r: Region| r.sub(me * block, block))?,
        OpKind::AllGather => {
            for (p, i) in ins.iter().enumerate() {
                x.copy(out.sub(p * block, block), *i)?;
            }
        }
        OpKind::Broadcast => x.copy(out, ins[op.root])?,
        OpKind::Reduce => {
            if me == op.root {
                reduce_all(x, out, &|r: Region| r)?;
            }
        }
        OpKind::Gather => {
            if me == op.root {
                for (p, i) in ins.iter().enumerate() {
                    x.copy(out.sub(p * block, block), *i)?;
                }
            }
        }
        OpKind::Scatter => x.copy(out, ins[op.root].sub(me * block, block))?,
        OpKind::AlltoAll => {
            for (p, i) in ins.iter().enumerate() {
                x.copy(out.sub(p * block, block), i.sub(me * block, block))?;
            }
        }
        OpKind::Send | OpKind::Recv => return Err(Error::internal("point-to-point operation on the direct path")),
    }
    // Every peer has finished reading our buffers once all passed this point.
    x.phase_end(STEP_DONE)
}

/// A control message of a point-to-point exchange (host transports) at `step` of `user`'s.
fn p2p_control(kind: OpKind, peer: usize, buf: Region, user: &Op, step: u8) -> Op {
    let (send, recv) = if kind == OpKind::Send { (buf, Region::EMPTY) } else { (Region::EMPTY, buf) };
    Op { kind, dt: DataType::Int8, op: RedOp::Builtin(BuiltinOp::Sum), count: buf.len(), root: peer, send, recv, seq: 0,
         scalar_at: None, of: Some(crate::plan::ops::control_stamp(&user.stamp(), step)) }
}

/// The sends and receives of one group on `comm` between ranks of one host, directly: each
/// sender tells its receiver where its buffer is, the receiver copies from it on its stream
/// and answers whether it did. Returns, per operation, whether it was done; the others (other
/// hosts, small, self, or a buffer that could not be published or mapped — both ends learn
/// it from the answer) are for the caller to stage, in their order.
pub fn run_p2p(comm: &Arc<Comm>, stream: &Stream, routes: &Routes, direct: &mut Direct, ops: &[Op])
               -> Result<Vec<bool>> {
    let mut done = vec![false; ops.len()];
    let picked: Vec<usize> = (0..ops.len()).filter(|&i| routes.eligible(&ops[i])).collect();
    if picked.is_empty() {
        return Ok(done);
    }
    let ready = comm.ready()?;
    direct.maps.next_operation();
    // 1. Senders publish their buffers to their receivers.
    let mut records = vec![[0u8; RECORD_BYTES]; picked.len()];
    for (slot, &i) in records.iter_mut().zip(&picked) {
        if ops[i].kind == OpKind::Send {
            // (Memory of the virtual memory API is staged here: a record holds no segment table.)
            let mut table = Vec::new();
            let p = share::publish(ops[i].send, true, &mut table).filter(|_| table.is_empty());
            *slot = Record { ok: p.is_some(), input: p.unwrap_or_default(), stamp: ops[i].stamp(), ..Record::default() }
                .encode();
        }
    }
    let control: Vec<Op> = picked.iter().zip(records.iter_mut())
        .map(|(&i, rec)| p2p_control(ops[i].kind, ops[i].root, Region::owned(rec.as_mut_slice()), &ops[i], STEP_P2P_RECORD))
        .collect();
    crate::group::execute_now(comm, &control)?;
    // 2. Receivers copy what they can map.
    let mut answers = vec![[0u8; 1]; picked.len()];
    for ((&i, rec), answer) in picked.iter().zip(&records).zip(answers.iter_mut()) {
        let op = &ops[i];
        if op.kind != OpKind::Recv {
            continue;
        }
        let theirs = Record::decode(rec);
        let (sender, ours) = (&ready.peers[op.root], &ready.peers[comm.rank]);
        let other_device = sender.same_process(ours) && sender.cuda_dev != comm.cuda_dev;
        // A message that is not the one this receive expects is staged: the host transports
        // then report the mismatch on both ends.
        if !theirs.ok || other_device || theirs.stamp != op.stamp() || theirs.input.len as usize != op.recv.len() {
            continue;
        }
        match direct.maps.map(ours, sender, &theirs.input, Shared::default(), comm.cuda_dev) {
            Ok(src) => {
                stream.copy(op.recv, src)?;
                answer[0] = 1;
            }
            Err(e) => crate::info!(P2P, "rank {}: cannot map rank {}'s buffer ({}); staging", comm.rank, op.root, e.msg),
        }
    }
    stream.synchronize()?;
    // 3. Receivers answer: done (the sender's buffer is free again) or stage it.
    let control: Vec<Op> = picked.iter().zip(answers.iter_mut())
        .map(|(&i, a)| {
            let kind = if ops[i].kind == OpKind::Recv { OpKind::Send } else { OpKind::Recv };
            p2p_control(kind, ops[i].root, Region::owned(a.as_mut_slice()), &ops[i], STEP_P2P_ANSWER)
        })
        .collect();
    crate::group::execute_now(comm, &control)?;
    for (&i, a) in picked.iter().zip(&answers) {
        done[i] = a[0] == 1;
    }
    if direct.ran == 0 && done.iter().any(|&d| d) {
        crate::info!(P2P, "rank {}: device buffers of peers on this host are read directly (CUDA IPC / same process), \
                           from point-to-point calls", comm.rank);
    }
    direct.ran += done.iter().filter(|&&d| d).count() as u64;
    direct.maps.close_unkept();
    Ok(done)
}
