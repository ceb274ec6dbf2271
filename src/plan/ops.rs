//! Operations as the planner receives them, and the plan of a whole group on one communicator.

use super::{Builder, Reduction, Ref};
use crate::algo::{self, Algo};
use crate::device::host::{ElemOp, Region, RegionSet};
use crate::error::{Error, Result};
use crate::transport::{Stamp, STAMP_BYTES};
use crate::types::{BuiltinOp, DataType, RedOp, Scalar};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    AllReduce,
    Broadcast,
    Reduce,
    AllGather,
    ReduceScatter,
    AlltoAll,
    Gather,
    Scatter,
    Send,
    Recv,
}

impl OpKind {
    pub fn name(self) -> &'static str {
        match self {
            OpKind::AllReduce => "AllReduce",
            OpKind::Broadcast => "Broadcast",
            OpKind::Reduce => "Reduce",
            OpKind::AllGather => "AllGather",
            OpKind::ReduceScatter => "ReduceScatter",
            OpKind::AlltoAll => "AlltoAll",
            OpKind::Gather => "Gather",
            OpKind::Scatter => "Scatter",
            OpKind::Send => "Send",
            OpKind::Recv => "Recv",
        }
    }
    pub fn is_p2p(self) -> bool {
        matches!(self, OpKind::Send | OpKind::Recv)
    }
    pub fn has_root(self) -> bool {
        matches!(self, OpKind::Broadcast | OpKind::Reduce | OpKind::Gather | OpKind::Scatter)
    }
    pub fn reduces(self) -> bool {
        matches!(self, OpKind::AllReduce | OpKind::Reduce | OpKind::ReduceScatter)
    }
}

/// One validated operation of one rank, with its buffers resolved to regions of the lengths
/// NCCL's semantics give them (EMPTY where the call does not use a buffer on this rank).
#[derive(Clone, Copy, Debug)]
pub struct Op {
    pub kind: OpKind,
    pub dt: DataType,
    pub op: RedOp,
    pub count: usize,
    /// Root for rooted collectives, peer for send/recv.
    pub root: usize,
    pub send: Region,
    pub recv: Region,
    pub seq: u64,
    /// CUDA mode: a PreMulSum scalar still in device memory, read in stream order (by the
    /// stream worker) before the operation is planned; `op` holds it from then on.
    pub scalar_at: Option<crate::device::host::UserPtr>,
    /// A control operation of CUDA mode's direct path (`transport::ipc`): the stamp of the
    /// user's operation it serves, marked with its step. Its messages carry that stamp, so a
    /// rank that issued something else is told which call this one was part of.
    pub of: Option<Stamp>,
}

impl Op {
    /// What every rank computes identically for the same collective (for point-to-point: the
    /// same byte count), carried on every message so a mismatch is detected and described.
    pub fn stamp(&self) -> Stamp {
        if let Some(s) = self.of {
            return s;
        }
        let mut s = [0u8; STAMP_BYTES];
        if self.kind.is_p2p() {
            s[0] = P2P_KIND;
            s[8..16].copy_from_slice(&((self.count * self.dt.size()) as u64).to_le_bytes());
            return s;
        }
        s[0] = self.kind as u8;
        s[1] = self.dt as u8;
        s[2] = if !self.kind.reduces() {
            NO_REDOP
        } else {
            match self.op {
                RedOp::Builtin(b) => b as u8,
                RedOp::PreMulSum(_) => PREMULSUM,
            }
        };
        let root = if self.kind.has_root() { self.root as u32 } else { 0 };
        s[4..8].copy_from_slice(&root.to_le_bytes());
        s[8..16].copy_from_slice(&(self.count as u64).to_le_bytes());
        s[16..24].copy_from_slice(&self.seq.to_le_bytes());
        s
    }

    /// Does this rank's input overlap its output other than as NCCL lays an in-place call out
    /// (the input at the output's start for all-reduce, broadcast and reduce; at the rank's
    /// block of the output for all-gather and gather, the output at the rank's block of the
    /// input for reduce-scatter and scatter; an all-to-all has no in-place form)? Such an
    /// input may be overwritten by what arrives before it was sent, so it is read from a
    /// copy. (NCCL leaves these calls undefined; its pipelined chunks happen to read some of
    /// them right, a program relying on which must not get garbage here.)
    pub fn input_overlaps_output(&self, rank: usize) -> bool {
        let (send, recv) = (self.send, self.recv);
        if self.kind.is_p2p() || !send.overlaps(recv) {
            return false;
        }
        let in_place = match self.kind {
            OpKind::AllReduce | OpKind::Broadcast | OpKind::Reduce => send.addr() == recv.addr() && send.len() == recv.len(),
            OpKind::AllGather | OpKind::Gather => send.offset_in(recv) == Some(rank * send.len()),
            OpKind::ReduceScatter | OpKind::Scatter => recv.offset_in(send) == Some(rank * recv.len()),
            OpKind::AlltoAll | OpKind::Send | OpKind::Recv => false,
        };
        !in_place
    }

    /// "AllReduce #12 (count 1024, float, sum)" for messages.
    pub fn describe(&self) -> String {
        if let Some(s) = self.of {
            return describe_stamp(&s);
        }
        let mut s = format!("{} {} (count {}, {}", self.kind.name(), seq_text(self.seq), self.count, self.dt.name());
        if self.kind.reduces() {
            s.push_str(&format!(", {}", self.op.name()));
        }
        if self.kind.has_root() {
            s.push_str(&format!(", root {}", self.root));
        }
        if self.kind.is_p2p() {
            s.push_str(&format!(", peer {}", self.root));
        }
        s.push(')');
        s
    }
}

/// The stamp of a control operation serving the operation stamped `user`, at `step` (1-255)
/// of its exchanges.
pub fn control_stamp(user: &Stamp, step: u8) -> Stamp {
    let mut s = *user;
    s[CONTROL_STEP] = step;
    s
}

/// Do two stamps name one operation, whatever step of its exchanges each is at (a control
/// operation's, or the operation's own)?
pub fn same_operation(a: &Stamp, b: &Stamp) -> bool {
    let (mut a, mut b) = (*a, *b);
    a[CONTROL_STEP] = 0;
    b[CONTROL_STEP] = 0;
    a == b
}

const P2P_KIND: u8 = 200;
/// Byte of a stamp that marks a control operation's step (0: the user's own operation).
const CONTROL_STEP: usize = 3;
const NO_REDOP: u8 = 255;
const PREMULSUM: u8 = 99;
const KINDS: [OpKind; 8] = [OpKind::AllReduce, OpKind::Broadcast, OpKind::Reduce, OpKind::AllGather,
                            OpKind::ReduceScatter, OpKind::AlltoAll, OpKind::Gather, OpKind::Scatter];

/// Marks the sequence numbers of operations a CUDA graph runs: the top bit, then the launch
/// (24 bits), then the number the operation got when it was captured (39 bits). Every rank
/// that captured the same operations and launches its graphs alike computes the same.
pub(crate) const REPLAY_BIT: u64 = 1 << 63;
const REPLAY_SEQ_BITS: u32 = 39;

/// The sequence number of launch `launch` (counted from 0) of a captured operation numbered
/// `seq` when it was captured.
pub fn replay_seq(seq: u64, launch: u32) -> u64 {
    REPLAY_BIT | (u64::from(launch & 0xff_ffff) << REPLAY_SEQ_BITS) | (seq & ((1 << REPLAY_SEQ_BITS) - 1))
}

/// Whether `s` is the stamp of an operation a CUDA graph runs (or of a step of one).
pub fn launched_by_graph(s: &Stamp) -> bool {
    s[0] != P2P_KIND && u64::from_le_bytes([s[16], s[17], s[18], s[19], s[20], s[21], s[22], s[23]]) & REPLAY_BIT != 0
}

/// A collective's number (its stamp's, alike on every rank), unless the stamp is a send's or
/// receive's or a CUDA graph runs the operation (numbered by launch).
pub fn coll_seq(s: &Stamp) -> Option<u64> {
    (s[0] != P2P_KIND && !launched_by_graph(s))
        .then(|| u64::from_le_bytes([s[16], s[17], s[18], s[19], s[20], s[21], s[22], s[23]]))
}

/// "#12", or "#12 (CUDA graph launch 3)" for an operation a graph runs.
fn seq_text(seq: u64) -> String {
    if seq & REPLAY_BIT == 0 {
        return format!("#{seq}");
    }
    let launch = (seq & !REPLAY_BIT) >> REPLAY_SEQ_BITS;
    format!("#{} (CUDA graph launch {})", seq & ((1 << REPLAY_SEQ_BITS) - 1), launch + 1)
}

/// A point-to-point stamp as a rank's status shows it: with its direction (byte 1: 1 a send,
/// 2 a receive) and its peer (bytes 4..8), which its messages do not carry (a send and its
/// receive carry the same stamp). Other stamps come back unchanged.
pub fn with_role(mut s: Stamp, send: bool, peer: usize) -> Stamp {
    if s[0] == P2P_KIND {
        s[1] = if send { 1 } else { 2 };
        s[4..8].copy_from_slice(&(peer as u32).to_le_bytes());
    }
    s
}

/// A point-to-point stamp's direction (true: a send) and peer, if it shows them ([`with_role`]).
pub fn p2p_role(s: &Stamp) -> Option<(bool, usize)> {
    (s[0] == P2P_KIND && matches!(s[1], 1 | 2)).then(|| (s[1] == 1, u32::from_le_bytes([s[4], s[5], s[6], s[7]]) as usize))
}

/// A stamp without the direction and peer [`with_role`] shows.
pub fn without_role(mut s: Stamp) -> Stamp {
    if s[0] == P2P_KIND {
        s[1] = 0;
        s[4..8].fill(0);
    }
    s
}

/// Whether the stamp's operation reduces (all-reduce, reduce, reduce-scatter).
pub fn reduces(s: &Stamp) -> bool {
    s[0] != P2P_KIND && s[2] != NO_REDOP
}

/// A point-to-point call's size in bytes (its stamp's); None for a collective's stamp.
pub fn p2p_bytes(s: &Stamp) -> Option<u64> {
    (s[0] == P2P_KIND).then(|| u64::from_le_bytes([s[8], s[9], s[10], s[11], s[12], s[13], s[14], s[15]]))
}

/// What a receive found: `theirs` arrived from rank `from` where rank `to` waited for `mine`
/// (they differ). A point-to-point stamp is a send on the sender's side and a receive on ours.
pub fn describe_arrival(from: &str, theirs: &Stamp, to: usize, mine: &Stamp) -> String {
    match (p2p_bytes(theirs), p2p_bytes(mine)) {
        (Some(sent), Some(wanted)) => format!(
            "{from} sent {sent} bytes where rank {to}'s matching receive takes {wanted}: a send and its receive must \
             have the same size (count times the datatype's size)"),
        (Some(sent), None) => format!(
            "{from} issued a send of {sent} bytes to rank {to} where rank {to} issued {}: every rank must make the same \
             calls in the same order", describe_stamp(mine)),
        (None, Some(wanted)) => format!(
            "{from} issued {} where rank {to} issued a receive of {wanted} bytes from it: every rank must make the same \
             calls in the same order", describe_stamp(theirs)),
        (None, None) => format!(
            "{from} issued {} where rank {to} issued {}: every rank must make the same calls in the same order",
            describe_stamp(theirs), describe_stamp(mine)),
    }
}

/// Read a stamp back into words: "AllGather #12 (count 2048, float)".
pub fn describe_stamp(s: &Stamp) -> String {
    if s[CONTROL_STEP] != 0 {
        let mut user = *s;
        user[CONTROL_STEP] = 0;
        return format!("step {} of the device-buffer exchange for {}", s[CONTROL_STEP], describe_stamp(&user));
    }
    let u64_at = |i: usize| u64::from_le_bytes([s[i], s[i + 1], s[i + 2], s[i + 3], s[i + 4], s[i + 5], s[i + 6], s[i + 7]]);
    if s[0] == P2P_KIND {
        return match p2p_role(s) {
            Some((true, peer)) => format!("a send of {} bytes to rank {peer}", u64_at(8)),
            Some((false, peer)) => format!("a receive of {} bytes from rank {peer}", u64_at(8)),
            // (A send and the receive it matches carry the same stamp.)
            None => format!("a send or receive of {} bytes", u64_at(8)),
        };
    }
    let Some(kind) = KINDS.iter().find(|k| **k as u8 == s[0]) else {
        return format!("an unknown operation (stamp {s:02x?})");
    };
    let dt = DataType::from_raw(s[1] as i32).map_or("?", |d| d.name());
    let mut out = format!("{} {} (count {}, {}", kind.name(), seq_text(u64_at(16)), u64_at(8), dt);
    match s[2] {
        NO_REDOP => {}
        PREMULSUM => out.push_str(", premulsum"),
        b => out.push_str(&format!(", {}", BuiltinOp::from_raw(b as i32).map_or("?", |o| o.name()))),
    }
    if kind.has_root() {
        out.push_str(&format!(", root {}", u32::from_le_bytes([s[4], s[5], s[6], s[7]])));
    }
    out.push(')');
    out
}

/// How the reduction runs after [`scaling`]: a sum where the inputs were scaled (PreMulSum,
/// and Avg on the types NCCL averages that way); Avg on the others a sum and a division of
/// the result.
pub(crate) fn reduction(op: RedOp, dt: DataType, nranks: usize) -> Reduction {
    let mut red = summed_reduction(op, dt, nranks);
    if scaling(op, dt, nranks).is_some() {
        red.divide = None;
    }
    red
}

/// The factor every rank's input is multiplied by before the sum: PreMulSum's, or ncclAvg's
/// `1/nranks` on Float16, rounded to the type. NCCL's own Avg on its floating types is this
/// PreMulSum; on fp16 a sum before the division overflows where NCCL's does not (two inputs of
/// 32768 average to 32768, not infinity), so fp16 is averaged NCCL's way. Bfloat16, Float32 and
/// Float64 cannot overflow so in practice and keep the sum and one division: within rounding
/// of NCCL's bits, and cheaper than scaling, even now that inputs are scaled as they are read
/// (`Builder::scale_on_read`; before, a pass over the whole input cost 2.6x): all-reduce of 64
/// MiB float on 2 processes here, ms out of place, 21.3-23.3 with the division against
/// 24.6-25.8 for a PreMulSum, which the scaling would cost; and CUDA mode's direct path would
/// need scaled copies of such inputs (`scales_inputs`).
pub(crate) fn scaling(op: RedOp, dt: DataType, nranks: usize) -> Option<Scalar> {
    match op {
        RedOp::PreMulSum(scalar) => Some(scalar),
        RedOp::Builtin(_) if scales_inputs(op, dt) => crate::device::host::avg_scalar(dt, nranks),
        RedOp::Builtin(_) => None,
    }
}

/// Whether [`scaling`] multiplies the inputs before the sum (the direct path has no such step:
/// it reads copies of such inputs scaled at call time).
pub(crate) fn scales_inputs(op: RedOp, dt: DataType) -> bool {
    match op {
        RedOp::PreMulSum(_) => true,
        RedOp::Builtin(b) => b == BuiltinOp::Avg && dt == DataType::Float16,
    }
}

/// The reduction with every Avg a sum and a division of the result, for a path with no
/// scaling step of its own (the direct path reduces peers' inputs where they are).
pub(crate) fn summed_reduction(op: RedOp, dt: DataType, nranks: usize) -> Reduction {
    let elem = match op {
        RedOp::Builtin(BuiltinOp::Sum) | RedOp::Builtin(BuiltinOp::Avg) | RedOp::PreMulSum(_) => ElemOp::Sum,
        RedOp::Builtin(BuiltinOp::Prod) => ElemOp::Prod,
        RedOp::Builtin(BuiltinOp::Max) => ElemOp::Max,
        RedOp::Builtin(BuiltinOp::Min) => ElemOp::Min,
    };
    let divide = matches!(op, RedOp::Builtin(BuiltinOp::Avg)).then_some(nranks as u64);
    Reduction { dt, op: elem, divide }
}

/// Plan every operation one rank issued in a group: collectives in issue order, then
/// point-to-point operations (both sides order them the same way, so they pair up).
pub fn plan_group(rank: usize, nranks: usize, slice: usize, ops: &[Op], algo: Option<Algo>) -> Result<Builder> {
    let mut b = Builder::new(slice);
    plan_into(&mut b, rank, nranks, slice, ops, algo)?;
    Ok(b)
}

/// What a builder's plan was made from ([`plan_into`]'s arguments), kept for a group of a few
/// operations: the same call repeated (a training loop's all-reduce of one bucket, a benchmark)
/// differs only in its collectives' numbers, which only the stamps carry, so its plan is
/// reused with them renumbered. (Planning an 8-byte all-reduce was a fifth of the call.)
pub(super) struct Planned {
    rank: usize,
    nranks: usize,
    slice: usize,
    algo: Option<Algo>,
    /// Per operation, everything of it but its number ([`reuse_key`]).
    keys: Vec<ReuseKey>,
    /// Per stamp of the plan, the operation (its index in the group) it is the stamp of.
    stamp_of: Vec<u32>,
}

/// Groups of at most this many operations are kept for reuse (their stamps are matched to
/// their operations by search).
const REUSE_MAX_OPS: usize = 4;

type ReuseKey = [u64; 8];

/// What the planner reads of an operation other than its number, as plain words: compared on
/// every call, an `Op`'s fields one by one cost 60 instructions more.
fn reuse_key(o: &Op) -> ReuseKey {
    let (red, scalar) = match o.op {
        RedOp::Builtin(b) => (1 | (b as u64) << 8, 0),
        RedOp::PreMulSum(s) => (2, u64::from_le_bytes(s.bytes)),
    };
    let head = o.kind as u64 | (o.dt as u64) << 8 | red << 16;
    [head, scalar, o.count as u64, o.root as u64, o.send.addr() as u64, o.send.len() as u64,
     o.recv.addr() as u64, o.recv.len() as u64]
}

/// Whether a plan of `ops` is kept for reuse ([`Planned`]).
pub fn reusable(ops: &[Op]) -> bool {
    ops.len() <= REUSE_MAX_OPS && ops.iter().all(|o| o.of.is_none() && o.scalar_at.is_none())
}

impl Planned {
    /// What `b` was just planned from, if a plan of it may be reused; `kept`'s memory is
    /// reused (a run that alternates calls replans without allocating).
    fn of(b: &Builder, rank: usize, nranks: usize, slice: usize, ops: &[Op], algo: Option<Algo>,
          kept: Option<Planned>) -> Option<Planned> {
        if !reusable(ops) {
            return None;
        }
        let mut p = kept.unwrap_or(Planned { rank, nranks, slice, algo, keys: Vec::new(), stamp_of: Vec::new() });
        (p.rank, p.nranks, p.slice, p.algo) = (rank, nranks, slice, algo);
        p.keys.clear();
        p.keys.extend(ops.iter().map(reuse_key));
        p.stamp_of.clear();
        for s in &b.stamps {
            p.stamp_of.push(ops.iter().position(|o| o.stamp() == *s)? as u32);
        }
        Some(p)
    }

    fn fits(&self, rank: usize, nranks: usize, slice: usize, ops: &[Op], algo: Option<Algo>) -> bool {
        // (Word by word: `==` on the arrays calls memcmp.)
        let same = |o: &Op, k: &ReuseKey| reuse_key(o).iter().zip(k).all(|(a, b)| a == b);
        self.keys.len() == ops.len()
            && ops.iter().zip(&self.keys).all(|(o, k)| same(o, k) && o.of.is_none() && o.scalar_at.is_none())
            && (self.rank, self.nranks, self.slice, self.algo) == (rank, nranks, slice, algo)
    }
}

impl Builder {
    /// Would [`plan_into`] reuse this builder's plan for these arguments?
    pub fn fits(&self, rank: usize, nranks: usize, slice: usize, ops: &[Op], algo: Option<Algo>) -> bool {
        self.planned.as_ref().is_some_and(|p| p.fits(rank, nranks, slice, ops, algo))
    }
}

/// [`plan_group`] into a builder kept from an earlier call (its memory is reused, and its plan
/// where the call is the same: see [`Planned`]).
pub fn plan_into(b: &mut Builder, rank: usize, nranks: usize, slice: usize, ops: &[Op], algo: Option<Algo>) -> Result<()> {
    if b.fits(rank, nranks, slice, ops, algo) {
        renumber(b, ops);
        return Ok(());
    }
    replan(b, rank, nranks, slice, ops, algo)
}

/// The plan of `b`, which [`Builder::fits`] `ops`, for `ops`: their stamps, with their numbers.
pub fn renumber(b: &mut Builder, ops: &[Op]) {
    if let Some(p) = &b.planned {
        for (s, &k) in b.stamps.iter_mut().zip(&p.stamp_of) {
            if let Some(o) = ops.get(k as usize) {
                *s = o.stamp();
            }
        }
    }
}

/// [`plan_into`] without looking for a plan to reuse.
pub fn replan(b: &mut Builder, rank: usize, nranks: usize, slice: usize, ops: &[Op], algo: Option<Algo>) -> Result<()> {
    let kept = b.planned.take();
    let planned = plan_afresh(b, rank, nranks, slice, ops, algo);
    b.trim_scratch();
    planned?;
    b.planned = Planned::of(b, rank, nranks, slice, ops, algo, kept);
    Ok(())
}

fn plan_afresh(b: &mut Builder, rank: usize, nranks: usize, slice: usize, ops: &[Op], algo: Option<Algo>) -> Result<()> {
    b.reset(slice);
    if ops.iter().any(|o| o.scalar_at.is_some()) {
        return Err(Error::internal("a PreMulSum scalar in device memory reached the planner unread"));
    }
    let b = &mut *b;
    for op in ops.iter().filter(|o| !o.kind.is_p2p() && o.count > 0) {
        b.begin(op.stamp());
        let mut send = op.send;
        if op.kind == OpKind::AlltoAll && op.send == op.recv {
            // One buffer for both (nccl-tests' in-place column): only the blocks it sends
            // are copied first, and its own block stays where it is.
            algo::direct::alltoall_in_place(b, rank, nranks, op.recv);
            b.short().map_err(|e| e.context(op.describe()))?;
            continue;
        }
        // PreMulSum (and fp16 Avg): the input scaled as it is read, or in the copy below.
        let scalar = scaling(op.op, op.dt, nranks).filter(|_| op.kind.reduces());
        if op.input_overlaps_output(rank) {
            // An input inside the output but not where NCCL's in-place rules put it (an
            // all-to-all given one buffer, an all-gather's input at another rank's block...):
            // what arrives could land on it before this rank has sent from it, so it goes
            // from a copy.
            let copy = b.scratch(send.len());
            let done = match scalar {
                Some(scalar) => b.premul(copy, send, op.dt, scalar, &[]),
                None => b.copy_to_read(copy, send, &[]),
            };
            b.set_fence(done);
            send = copy;
        } else if let Some(scalar) = scalar {
            b.scale_on_read(send, op.dt, scalar);
        }
        let red = reduction(op.op, op.dt, nranks);
        algo::build(b, rank, nranks, op, send, red, algo);
        b.short().map_err(|e| e.context(op.describe()))?;
    }
    plan_p2p(b, rank, ops)?;
    b.short().map_err(|e| e.context("the group's sends and receives"))
}

fn plan_p2p(b: &mut Builder, rank: usize, ops: &[Op]) -> Result<()> {
    let p2p = || ops.iter().filter(|o| o.kind.is_p2p() && o.count > 0);
    // (A group of collectives only, the common case, skips the sets below: building them,
    // empty, was 6% of a one-rank all-reduce's call.)
    if p2p().next().is_none() {
        return Ok(());
    }
    // A send from a buffer a receive of the group writes (an in-place exchange, as nccl-tests'
    // sendrecv in place): the receive may land before the peer has what was there. Such sends
    // go from copies taken first (one after the other), and every receive into one of their
    // buffers waits for the last copy.
    let both = p2p().any(|o| o.kind == OpKind::Send) && p2p().any(|o| o.kind == OpKind::Recv);
    let written = RegionSet::new(p2p().filter(|o| both && o.kind == OpKind::Recv).map(|o| o.recv));
    // (Per operation, its copy; none kept for a group without both.)
    let mut copies: Vec<Option<Region>> = Vec::new();
    let mut copied = Ref::NONE;
    for op in p2p().filter(|_| both) {
        let copy = (op.kind == OpKind::Send && written.overlaps(op.send)).then(|| {
            b.begin(op.stamp());
            let copy = b.scratch(op.send.len());
            // Every copy waits for the whole of the ones before, and the sends and receives
            // below for the whole of the last (`Ref::last`): their bytes are other bytes, so a
            // matching slice would say nothing (a receive's second slice landed before the
            // copy of what it overwrote: found with small slices, NCCL_BUFFSIZE=65536).
            copied = b.copy_to_read(copy, op.send, &[copied]).last();
            copy
        });
        copies.push(copy);
    }
    let overwritten = RegionSet::new(p2p().zip(&copies).filter(|(_, c)| c.is_some()).map(|(o, _)| o.send));
    let mut self_sends = Vec::new();
    let mut self_recvs = Vec::new();
    for (k, op) in p2p().enumerate() {
        b.begin(op.stamp());
        let copy = copies.get(k).copied().flatten();
        let send = copy.unwrap_or(op.send);
        match (op.kind, op.root == rank) {
            (OpKind::Send, true) => self_sends.push((op, send)),
            (OpKind::Recv, true) => self_recvs.push(op),
            (OpKind::Send, false) => {
                b.send(op.root, send, &[if copy.is_some() { copied } else { Ref::NONE }]);
            }
            _ => {
                b.recv(op.root, op.recv, &[if overwritten.overlaps(op.recv) { copied } else { Ref::NONE }]);
            }
        }
    }
    if self_sends.len() != self_recvs.len() {
        return Err(Error::invalid_usage(format!(
            "rank {rank} sends {} message(s) to itself but receives {} in the same group",
            self_sends.len(),
            self_recvs.len()
        )));
    }
    for ((s, send), r) in self_sends.iter().zip(&self_recvs) {
        if s.send.len() != r.recv.len() {
            return Err(Error::invalid_usage(format!(
                "rank {rank} sends {} bytes to itself but receives {} bytes", s.send.len(), r.recv.len())));
        }
        b.begin(s.stamp());
        b.copy(r.recv, *send, &[copied]);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Step;

    /// An in-place exchange whose receive lands one slice further on than its send starts
    /// (as in an uneven all-to-all by sends and receives): each slice of the receive
    /// overwrites bytes a later slice of the send's copy takes, so every unit of the receive
    /// and of the send waits for the whole copy, not for its matching slice. (With matching
    /// slices, NCCL_BUFFSIZE=65536 made a random-call soak send overwritten bytes.)
    #[test]
    fn exchanges_in_place_wait_for_the_whole_copy() {
        const SLICE: usize = 256;
        let mut buf = vec![0u8; 4 * SLICE];
        let r = Region::owned(&mut buf);
        let op = |kind, send: Region, recv: Region, seq| Op { kind, dt: DataType::Uint8,
            op: RedOp::Builtin(BuiltinOp::Sum), count: 3 * SLICE, root: 1, send, recv, seq, scalar_at: None, of: None };
        let ops = [op(OpKind::Send, r.sub(0, 3 * SLICE), Region::EMPTY, 1),
                   op(OpKind::Recv, Region::EMPTY, r.sub(SLICE, 3 * SLICE), 2)];
        let b = plan_group(0, 2, SLICE, &ops, None).expect("a plan");
        let last_copy = b.units.iter().rposition(|u| matches!(u.step, Step::Copy { .. })).expect("the send is copied");
        let transfers: Vec<_> = b.units.iter().filter(|u| matches!(u.step, Step::Send { .. } | Step::Recv { .. })).collect();
        assert_eq!(transfers.len(), 6, "3 slices each way");
        for u in transfers {
            assert!(u.deps.contains(&(last_copy as u32)), "{:?} waits for {:?}, not the copy's last unit {last_copy}",
                    u.step, u.deps);
        }
    }

    /// Copies that sends go from at once (an in-place exchange's, an all-to-all given one
    /// buffer) are made to be read (`to_read`: cached stores); a copy into the caller's output
    /// (an out-of-place all-gather's own block) is not, so large ones still write around the
    /// cache. (Written around it, the copy of a 256 KiB in-place exchange was read back from
    /// memory: 2x slower.)
    #[test]
    fn only_copies_that_sends_read_are_made_to_be_read() {
        let mut buf = vec![0u8; 4096];
        let mut out = vec![0u8; 8192];
        let (r, o) = (Region::owned(&mut buf), Region::owned(&mut out));
        let op = |kind, count, send: Region, recv: Region, seq| Op { kind, dt: DataType::Uint8,
            op: RedOp::Builtin(BuiltinOp::Sum), count, root: 1, send, recv, seq, scalar_at: None, of: None };
        let copies = |ops: &[Op]| -> Vec<bool> {
            let b = plan_group(0, 2, 1 << 20, ops, None).expect("a plan");
            let copy = |u: &crate::plan::Unit| match u.step { Step::Copy { to_read, .. } => Some(to_read), _ => None };
            b.units.iter().filter_map(copy).collect()
        };
        let exchange = [op(OpKind::Send, 4096, r, Region::EMPTY, 1), op(OpKind::Recv, 4096, Region::EMPTY, r, 2)];
        assert_eq!(copies(&exchange), [true], "an in-place exchange's copy");
        let a2a_in_place = [op(OpKind::AlltoAll, 2048, r, r, 1)];
        assert_eq!(copies(&a2a_in_place), [true], "an all-to-all given one buffer: the block it sends (its own block \
                                                   stays where it is)");
        let gather = [op(OpKind::AllGather, 4096, r, o, 1)];
        assert_eq!(copies(&gather), [false], "an out-of-place all-gather's own block");
    }

    /// The same call repeated reuses its plan with the stamps renumbered (each rank's next
    /// collective has the next number); anything else the planner reads makes a new plan.
    #[test]
    fn a_repeated_call_reuses_its_plan_renumbered() {
        let mut buf = vec![0u8; 4096];
        let r = Region::owned(&mut buf);
        let op = |seq, recv: Region, op| Op { kind: OpKind::AllReduce, dt: DataType::Float32, op, count: 64, root: 0,
            send: r.sub(0, 256), recv, seq, scalar_at: None, of: None };
        let sum = RedOp::Builtin(BuiltinOp::Sum);
        let mut b = Builder::default();
        plan_into(&mut b, 1, 4, 1024, &[op(7, r.sub(256, 256), sum)], None).expect("a plan");
        let (id, units) = (b.plan_id(), b.units.clone());
        plan_into(&mut b, 1, 4, 1024, &[op(8, r.sub(256, 256), sum)], None).expect("a plan");
        assert_eq!((b.plan_id(), &b.units), (id, &units), "reused");
        assert_eq!(b.stamps, vec![op(8, r.sub(256, 256), sum).stamp()], "renumbered");
        let mut fresh = |ops: &[Op], nranks, algo| {
            plan_into(&mut b, 1, nranks, 1024, ops, algo).expect("a plan");
            assert_ne!(b.plan_id(), id, "{ops:?} on {nranks} ranks, {algo:?}: planned anew");
            let again = plan_group(1, nranks, 1024, ops, algo).expect("a plan");
            assert_eq!((shape(&b.units), &b.stamps), (shape(&again.units), &again.stamps), "as a new builder plans it");
        };
        fresh(&[op(9, r.sub(512, 256), sum)], 4, None);
        fresh(&[op(10, r.sub(512, 256), RedOp::Builtin(BuiltinOp::Max))], 4, None);
        let times = |x: f32| RedOp::PreMulSum(Scalar { bytes: [x.to_le_bytes(), [0; 4]].concat().try_into().unwrap() });
        fresh(&[op(11, r.sub(512, 256), times(2.0))], 4, None);
        fresh(&[op(12, r.sub(512, 256), times(3.0))], 4, None);
        fresh(&[op(13, r.sub(512, 256), sum)], 3, None);
        fresh(&[op(14, r.sub(512, 256), sum)], 3, Some(Algo::Ring));
        // Two collectives and a pair of a send and a receive: each stamp follows its operation.
        let p2p = |kind| Op { kind, dt: DataType::Uint8, op: sum, count: 32, root: 2, send: r.sub(1024, 32),
            recv: r.sub(2048, 32), seq: 0, scalar_at: None, of: None };
        let group = |s| [op(s, r.sub(256, 256), sum), p2p(OpKind::Recv), op(s + 1, r.sub(256, 256), sum), p2p(OpKind::Send)];
        plan_into(&mut b, 1, 4, 1024, &group(20), None).expect("a plan");
        let id = b.plan_id();
        plan_into(&mut b, 1, 4, 1024, &group(30), None).expect("a plan");
        let again = plan_group(1, 4, 1024, &group(30), None).expect("a plan");
        assert_eq!((b.plan_id(), shape(&b.units), &b.stamps), (id, shape(&again.units), &again.stamps));
    }

    /// Units as steps, dependencies and operations, without addresses (scratch is each
    /// builder's own).
    fn shape(units: &[crate::plan::Unit]) -> Vec<(String, [u32; crate::plan::MAX_DEPS], u32)> {
        units.iter().map(|u| (format!("{:?}", u.step).split(' ').next().unwrap_or("").to_string(), u.deps, u.op)).collect()
    }

    /// A send and its receive carry one stamp on the wire; a status shows each with its
    /// direction and peer, which come off again, and a collective's stamp is left alone.
    #[test]
    fn sends_and_receives_show_their_direction_and_peer() {
        let op = |kind, count| Op { kind, dt: DataType::Float32, op: RedOp::Builtin(BuiltinOp::Sum), count, root: 3,
            send: Region::EMPTY, recv: Region::EMPTY, seq: 5, scalar_at: None, of: None };
        let (send, recv) = (op(OpKind::Send, 10).stamp(), op(OpKind::Recv, 10).stamp());
        assert_eq!(send, recv);
        let shown = with_role(send, true, 3);
        assert_eq!((p2p_role(&shown), p2p_role(&send)), (Some((true, 3)), None));
        assert_eq!(p2p_role(&with_role(recv, false, 7)), Some((false, 7)));
        assert_eq!(without_role(shown), send);
        assert_eq!(p2p_bytes(&shown), Some(40));
        assert_eq!(describe_stamp(&shown), "a send of 40 bytes to rank 3");
        assert_eq!(describe_stamp(&with_role(recv, false, 7)), "a receive of 40 bytes from rank 7");
        assert_eq!(describe_stamp(&send), "a send or receive of 40 bytes");
        let coll = op(OpKind::AllReduce, 10).stamp();
        assert_eq!((with_role(coll, true, 3), p2p_role(&coll), p2p_bytes(&coll)), (coll, None, None));
    }

    /// NCCL's in-place layouts are not overlaps to copy around; every other overlap is, and
    /// disjoint buffers are not. Rank 1 of 3, blocks of 4 bytes.
    #[test]
    fn overlaps_outside_the_in_place_layouts() {
        let mut buf = vec![0u8; 64];
        let r = Region::owned(&mut buf);
        let op = |kind, send: Region, recv: Region| Op { kind, dt: DataType::Uint8, op: RedOp::Builtin(BuiltinOp::Sum),
            count: 4, root: 0, send, recv, seq: 0, scalar_at: None, of: None };
        let cases = [
            (OpKind::AllReduce, r.sub(0, 4), r.sub(0, 4), false),
            (OpKind::AllReduce, r.sub(2, 4), r.sub(0, 4), true),
            (OpKind::AllReduce, r.sub(4, 4), r.sub(0, 4), false),
            (OpKind::Broadcast, r.sub(1, 4), r.sub(0, 4), true),
            (OpKind::AllGather, r.sub(4, 4), r.sub(0, 12), false),
            (OpKind::AllGather, r.sub(0, 4), r.sub(0, 12), true),
            (OpKind::AllGather, r.sub(8, 4), r.sub(0, 12), true),
            (OpKind::AllGather, r.sub(12, 4), r.sub(0, 12), false),
            (OpKind::Gather, r.sub(4, 4), r.sub(0, 12), false),
            (OpKind::Gather, r.sub(4, 4), Region::EMPTY, false),
            (OpKind::ReduceScatter, r.sub(0, 12), r.sub(4, 4), false),
            (OpKind::ReduceScatter, r.sub(0, 12), r.sub(8, 4), true),
            (OpKind::Scatter, r.sub(0, 12), r.sub(0, 4), true),
            (OpKind::AlltoAll, r.sub(0, 12), r.sub(0, 12), true),
            (OpKind::AlltoAll, r.sub(0, 12), r.sub(12, 12), false),
            (OpKind::Send, r.sub(0, 4), Region::EMPTY, false),
        ];
        for (kind, send, recv, want) in cases {
            let o = op(kind, send, recv);
            assert_eq!(o.input_overlaps_output(1), want, "{kind:?}: send at {}, recv at {} ({} bytes)",
                       send.addr() - r.addr(), recv.addr().wrapping_sub(r.addr()), recv.len());
        }
    }

    /// Launches of one captured operation differ from each other and from every operation
    /// called outside a graph, and say which they are.
    #[test]
    fn graph_launches_number_their_operations_apart() {
        let (a, b) = (replay_seq(12, 0), replay_seq(12, 1));
        assert_ne!(a, b);
        assert_ne!(a, 12);
        assert_ne!(replay_seq(13, 0), a);
        assert_eq!(seq_text(12), "#12");
        assert_eq!(seq_text(b), "#12 (CUDA graph launch 2)");
        assert_eq!(seq_text(replay_seq(7, 0xff_ffff)), "#7 (CUDA graph launch 16777216)");
        let op = |seq| Op { kind: OpKind::AllReduce, dt: DataType::Float32, op: RedOp::Builtin(BuiltinOp::Sum), count: 4,
                            root: 0, send: Region::EMPTY, recv: Region::EMPTY, seq, scalar_at: None, of: None };
        assert!(launched_by_graph(&op(b).stamp()));
        assert!(launched_by_graph(&control_stamp(&op(b).stamp(), 2)));
        assert!(!launched_by_graph(&op(12).stamp()));
    }
}
