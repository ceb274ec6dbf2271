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
//! them per operation costs time. Closes run on a thread of their own (`cuda::OffThread`): one
//! made while a caller's stream waits for the worker could stall in the driver, and the
//! worker with it. A peer's handle names one allocation, so a mapping is only used
//! while its owner publishes that allocation again. One is closed when its owner publishes a
//! new allocation at the same address (the old one is gone), when more than `NCCL_RS_PEER_MAPS`
//! (256) are open (the least recently used), and when the worker stops. The driver documents
//! freeing an exported allocation before its importers close it as undefined; in practice the
//! importer's mapping keeps it alive until closed (for the virtual memory API it is documented
//! so) — the trade-off the first GPU runs must confirm; `NCCL_RS_PEER_MAPS=0` closes mappings
//! after each operation instead.
//! The direct path has no scaling step: a PreMulSum and fp16 Avg go direct only from a copy of
//! each rank's input scaled at call time (`streamed::copy_unreadable_inputs`).
//!
//! Sends and receives ([`run_p2p`]) work pairwise, on connections of their own (`api::rma::p2p`):
//! the sender sends its receiver a record, the receiver copies from the mapped buffer and
//! answers "done" (the sender's buffer is free) or "send the bytes" (a buffer it cannot map);
//! a sender that could not publish its buffer sends the bytes with its record.

mod p2p;
mod share;

pub use p2p::{run_p2p, Bounce, P2p};

use std::sync::Arc;

use share::{decode_segment, encode_segment, Maps, Published, Record, Shared, MAX_TABLE, RECORD_BYTES, SEG_BYTES};

use crate::bootstrap::PeerInfo;
use crate::comm::Comm;
use crate::device::cuda::{self, Desc, Indirect, Segment, Stream};
use crate::device::host::{ElemOp, Region, UserPtr};
use crate::error::{Error, Result};
use crate::plan::{Op, OpKind};
use crate::streamed::board::{Board, Ticket};
use crate::transport::fdpass::{self, Address};
use crate::types::{BuiltinOp, DataType, RedOp};

/// A stream worker's state for direct operations: the peer mappings it keeps.
#[derive(Default)]
pub struct Direct {
    /// The ranks agreed that collectives never go direct again on this communicator (some
    /// rank cannot, ever: see [`agree`]); every rank stages them from the next one on.
    pub off: bool,
    maps: Maps,
    /// Mapping a peer's memory failed in a way that may pass (said once, at WARN).
    refused: bool,
    /// Some rank declined an operation, which every rank then staged (said once, at INFO).
    told_declined: bool,
    /// Operations run direct so far (the first is logged).
    ran: u64,
    /// Per peer: the direct sends to it and receives from it so far (they number messages).
    sent: Vec<u64>,
    received: Vec<u64>,
    /// Per peer of this process on another device: whether this rank's kernels may read its
    /// memory (`cuda::peer_access`, asked once here rather than under its lock per operation).
    peer_device: Vec<Option<bool>>,
}

impl Direct {
    /// Bytes of peers' device memory this worker keeps mapped.
    pub fn mapped_bytes(&self) -> u64 {
        self.maps.bytes()
    }

    /// Whether this rank's kernels may read the device memory of `theirs` (rank `peer`) by
    /// address: always, but for a rank of this process on another device without peer access.
    fn reaches_device(&mut self, comm: &Comm, peer: usize, ours: &PeerInfo, theirs: &PeerInfo) -> bool {
        if !theirs.same_process(ours) || theirs.cuda_dev == comm.cuda_dev {
            return true;
        }
        if self.peer_device.len() <= peer {
            self.peer_device.resize(comm.nranks.max(peer + 1), None);
        }
        *self.peer_device[peer].get_or_insert_with(|| cuda::peer_access(comm.cuda_dev, theirs.cuda_dev))
    }

    /// Closes every peer mapping (ncclCommSuspend with NCCL_SUSPEND_MEM): the peers'
    /// allocations this worker held alive are freed once their owners have freed them. The
    /// direct path maps them again on next use. Returns how many were closed, and their bytes.
    pub fn close_mappings(&mut self) -> (usize, u64) {
        self.maps.close_all()
    }
}

/// Which operations of a communicator may go direct, decided once (when its stream worker
/// starts) from where the ranks run and what the settings of all of them allow
/// (`bootstrap::Links`, exchanged at init): the same answers on every rank, even when their
/// environments differ.
#[derive(Clone, Debug, Default)]
pub struct Routes {
    /// Collectives: every rank on this host, and direct access allowed on every rank.
    collectives: bool,
    /// The smallest collective that goes direct, in bytes (`NCCL_RS_DIRECT_MIN`, 64 KiB by
    /// default, the largest any rank asks for): smaller ones are latency-bound, and staging
    /// through the host transports costs fewer round trips.
    collectives_min: usize,
    /// Every rank in this process: buffers are published by address alone.
    one_process: bool,
    /// Sends and receives, per peer: the smallest that goes direct to that rank of this host,
    /// the larger of the two ranks' settings; None: none (another host, or either rank stages
    /// them: NCCL_RS_DIRECT_P2P=0, direct access disabled).
    p2p: Vec<Option<usize>>,
}

impl Routes {
    pub fn of(comm: &Comm) -> Routes {
        let Some(ready) = comm.ready_if_any() else { return Routes::default() };
        let me = &ready.peers[comm.rank];
        let min = |bytes: u64| usize::try_from(bytes).unwrap_or(usize::MAX).max(1);
        let p2p = ready.peers.iter().enumerate()
            .map(|(p, info)| {
                let both = me.links.with(info.links);
                let direct = p != comm.rank && me.direct_with(info);
                // Settings that allow it, and GPUs farther apart than the level: said why.
                if let (Some(level), false, true) = (both.level, direct, p != comm.rank && info.same_host(me) && both.direct) {
                    let how_far = crate::bootstrap::topo::distance(&me.gpu, &info.gpu).map_or("at an unknown distance", |d| d.name());
                    crate::info!(P2P, "rank {}: rank {p}'s GPU ({}) is {how_far} from this rank's ({}), farther than \
                                       NCCL_P2P_LEVEL={}: their buffers are staged through host memory", comm.rank,
                                 info.gpu.bus_id(), me.gpu.bus_id(), level.name());
                }
                (direct && both.direct_p2p).then(|| min(both.direct_min))
            })
            .collect();
        let all = ready.peers.iter().fold(me.links, |l, p| l.with(p.links));
        // Every pair, not only this rank's: the ranks must all choose alike.
        let every_pair = ready.peers.iter().all(|a| ready.peers.iter().all(|b| a.rank == b.rank || a.direct_with(b)));
        Routes { collectives: all.direct && every_pair, collectives_min: min(all.direct_min),
                 one_process: ready.peers.iter().all(|p| p.same_process(me)), p2p }
    }

    /// May collectives go direct at all?
    pub fn collectives(&self) -> bool {
        self.collectives
    }

    /// Does `op` go direct?
    pub fn eligible(&self, op: &Op) -> bool {
        let bytes = op.count.saturating_mul(op.dt.size());
        if op.kind.is_p2p() {
            let min = self.p2p.get(op.root).copied().flatten();
            return op.scalar_at.is_none() && min.is_some_and(|m| bytes >= m);
        }
        // What the planner scales first (PreMulSum, fp16 Avg: `plan::ops::scaling`) goes
        // direct from a copy of each rank's input scaled at call time
        // (`streamed::copy_unreadable_inputs`); a rank that cannot make one (no room in its
        // device scratch) declines it, and every rank stages it.
        self.collectives && bytes >= self.collectives_min
    }
}

/// The steps of the exchanges, as the control operations' stamps name them.
const STEP_RECORDS: u8 = 1;
const STEP_AGREE: u8 = 2;
const STEP_HALFWAY: u8 = 3;
const STEP_DONE: u8 = 4;
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
    /// Its input is a copy already scaled (PreMulSum, fp16 Avg): the ranks sum the inputs.
    scaled: bool,
}

impl Offered {
    pub fn scaled(&self) -> bool {
        self.scaled
    }
}

/// What the direct path computes for `op`: with inputs already scaled (`Offered::scaled`), a
/// plain sum of them (for fp16 Avg: no division after).
pub fn computed(op: &Op, scaled: bool) -> Op {
    match scaled {
        true => Op { op: RedOp::Builtin(BuiltinOp::Sum), ..*op },
        false => *op,
    }
}

/// What this rank offers for `op` on the direct path, known at call time; None when it
/// declines whatever the others say: an input its output overlaps other than as NCCL's
/// in-place calls lay them out, an all-to-all given one buffer among them (unless the input
/// was copied first: `streamed::copy_unreadable_inputs`), a buffer peers read that it cannot share
/// (pinned or pageable host memory, device memory without CUDA IPC; memory of the virtual
/// memory API is shared as descriptors), an output that is not device memory, a PreMulSum
/// or fp16 Avg whose input is not yet scaled (`scaled`: it is a copy, scaled at call time), or
/// no kernels.
/// Every rank then stages `op`, and this one's caller's stream can stage it at call time (it
/// still takes part in the agreement, [`decline`]).
pub fn offer(op: &Op, rank: usize, kernels: bool, routes: &Routes, scaled: bool) -> Option<Offered> {
    let overlapping = op.input_overlaps_output(rank);
    // A send needs no kernels of its own: its receiver copies from it. A receive offers nothing.
    let needs_kernels = op.kind != OpKind::Send;
    let needs_scaling = crate::plan::ops::scales_inputs(op.op, op.dt);
    let unscaled = needs_scaling && !scaled;
    if (needs_kernels && !kernels) || overlapping || op.kind == OpKind::Recv || unscaled {
        return None;
    }
    let mut table = Vec::new();
    let input = share::publish(op.send, !routes.one_process, &mut table)?;
    // Peers read a rank's output only in an all-reduce (its second half, `compute_steps`);
    // otherwise only this rank's kernels write it, which needs no handle: device memory.
    let output = match op.kind {
        OpKind::AllReduce => share::publish(op.recv, !routes.one_process, &mut table)?,
        _ => device_memory(op.recv).then(Published::default)?,
    };
    let (server, in_flight) = if table.is_empty() {
        (Address::default(), None)
    } else {
        (fdpass::serve(share::export_request).ok()?, Some(share::in_flight(&table)))
    };
    Some(Offered { input, output, table, server, _in_flight: in_flight, scaled: needs_scaling })
}

/// Whether peers could read `r` where it is (`offer`): device memory with a CUDA IPC handle
/// or shareable allocations of the virtual memory API, or any device memory when every rank
/// is in this process.
pub fn publishable(r: Region, routes: &Routes) -> bool {
    share::publish(r, !routes.one_process, &mut Vec::new()).is_some()
}

/// Whether this rank's kernels can write `r` as a direct operation's output (nothing to write
/// counts): device memory (a pinned or managed output is staged).
fn device_memory(r: Region) -> bool {
    r.is_empty() || cuda::is_device_memory(r.addr())
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
    let verdict = match offer {
        Offer::Never => NEVER,
        _ if records.iter().all(|r| r.ok && r.stamp == mine.stamp && r.table as usize <= MAX_TABLE) => GO,
        _ => STAGE,
    };
    // (Said once: no list is built on the direct path's every call.)
    if verdict == STAGE && !direct.told_declined && records.iter().any(|r| !r.ok) {
        direct.told_declined = true;
        let declined: Vec<usize> = (0..n).filter(|&p| !records[p].ok).collect();
        crate::info!(P2P, "rank {me}: {} is staged through host memory, as are later ones like it: rank(s) {declined:?} \
                           could not offer buffers for peers to read (device memory without CUDA IPC, pinned or \
                           managed memory, an in-place all-to-all, PreMulSum or fp16 Avg, with no room to copy \
                           them into its device scratch; host memory, a PreMulSum scalar in pageable memory)",
                     op.describe());
    }
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
    let (verdict, ins, outs) = match verdict {
        GO => match map_peers(comm, ready, direct, op, &records, &tables) {
            Ok((ins, outs)) => (GO, ins, outs),
            Err(v) => (v, Vec::new(), Vec::new()),
        },
        v => (v, Vec::new(), Vec::new()),
    };
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

/// Every rank's input and output (`records`, with their segment `tables`) mapped into this
/// process, this rank's own as they are. Err: the verdict where one cannot be (stage this
/// operation, or, where the driver refused or the peer is a device of this process without
/// peer access, every later one).
fn map_peers(comm: &Comm, ready: &crate::comm::Ready, direct: &mut Direct, op: &Op, records: &[Record],
             tables: &[Vec<Segment>]) -> std::result::Result<(Vec<Region>, Vec<Region>), i32> {
    let (n, me) = (comm.nranks, comm.rank);
    let mut ins = Vec::with_capacity(n);
    let mut outs = Vec::with_capacity(n);
    for (p, rec) in records.iter().enumerate() {
        if p == me {
            ins.push(op.send);
            outs.push(op.recv);
            continue;
        }
        let (theirs, ours) = (&ready.peers[p], &ready.peers[me]);
        if !direct.reaches_device(comm, p, ours, theirs) {
            // Another device of this process, whose memory this one's kernels cannot read.
            crate::info!(P2P, "rank {me}: rank {p} is on device {} of this process, without peer access from device {}; \
                               staging through host memory", theirs.cuda_dev, comm.cuda_dev);
            return Err(NEVER);
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
                return Err(if e.code == crate::Code::UnhandledCudaError { NEVER } else { STAGE });
            }
        }
    }
    Ok((ins, outs))
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
    let c = computed(op, offered.scaled);
    compute(comm, &c, &ins, &outs, &mut Immediate { comm, user: op, stream, k })?;
    direct.maps.close_unkept();
    log_first(comm, direct, op, false);
    Ok(true)
}

/// The kernels `op` needs on the direct path (as [`computed`]), per phase: each kernel's element count (bytes
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
    let c = computed(op, offered.scaled);
    let mut fill = Filler { comm, user: op, board, t, shape, phase: 0, next: 0 };
    compute(comm, &c, &ins, &outs, &mut fill)?;
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
    /// The caller's operation (not as [`computed`]: see `Filler::user`).
    user: &'a Op,
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
        barrier(self.comm, self.user, step)
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
    /// The caller's operation, whose stamp the phases' barriers carry, as the steps before
    /// them do: not the operation [`computed`] (a PreMulSum's is a sum), whose stamps a peer
    /// still in an earlier step took for another call ("rank 2 issued step 2 of the
    /// device-buffer exchange for ReduceScatter #64 (..., premulsum) where rank 0 issued step 4
    /// of the device-buffer exchange for ReduceScatter #64 (..., sum)", a stop hunt).
    user: &'a Op,
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
                "direct {}: kernel {} of phase {} covers {n}, the one queued {queued:?}", self.user.describe(), self.next,
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
                                               self.user.describe(), self.phase)));
        }
        self.phase += 1;
        self.next = 0;
        let value = self.t.step_value(self.phase);
        self.board.open(self.t, value);
        // The caller's stream runs the phase when it gets there; the host waits for its flag.
        crate::streamed::wait_for_stream(self.comm, std::slice::from_ref(self.user),
                                         "its CUDA stream has not finished a phase of the call's device work",
                                         || Ok(self.board.flag_reached(self.t, value)))?;
        barrier(self.comm, self.user, step)
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
