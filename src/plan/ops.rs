//! Operations as the planner receives them, and the plan of a whole group on one communicator.

use super::{Builder, Reduction};
use crate::algo::{self, Algo};
use crate::device::host::{ElemOp, Region};
use crate::error::{Error, Result};
use crate::types::{BuiltinOp, DataType, RedOp};

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
}

impl Op {
    /// A fingerprint every rank computes identically for the same collective (for p2p: the
    /// same bytes), carried on every message so a mismatch is detected, not misread.
    pub fn tag(&self) -> u32 {
        let fields: [u64; 5] = if self.kind.is_p2p() {
            [0xfeed, (self.count * self.dt.size()) as u64, 0, 0, 0]
        } else {
            let op = match self.op {
                RedOp::Builtin(b) => b as u64,
                RedOp::PreMulSum(_) => 99,
            };
            let op = if self.kind.reduces() { op } else { 0 };
            let root = if self.kind.has_root() { self.root as u64 } else { 0 };
            [self.kind as u64, self.count as u64, self.dt as u64, op, root]
        };
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for f in fields {
            for b in f.to_le_bytes() {
                h ^= b as u64;
                h = h.wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
        (h ^ (h >> 32)) as u32
    }

    /// "AllReduce #12 (count 1024, float, sum)" for messages.
    pub fn describe(&self) -> String {
        let mut s = format!("{} #{} (count {}, {}", self.kind.name(), self.seq, self.count, self.dt.name());
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

/// How the reduction runs: PreMulSum becomes a local scaling and a sum, Avg a sum and a
/// division of the result.
fn reduction(op: RedOp, dt: DataType, nranks: usize) -> Reduction {
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
    for op in ops.iter().filter(|o| !o.kind.is_p2p() && o.count > 0) {
        b.begin(op.tag());
        let mut send = op.send;
        if let RedOp::PreMulSum(scalar) = op.op {
            if op.kind.reduces() && !send.is_empty() {
                let scaled = b.scratch(send.len());
                let done = b.premul(scaled, send, op.dt, scalar, &[]);
                b.set_fence(done);
                send = scaled;
            }
        }
        let red = reduction(op.op, op.dt, nranks);
        algo::build(&mut b, rank, nranks, op, send, red, algo);
    }
    plan_p2p(&mut b, rank, ops)?;
    Ok(b)
}

fn plan_p2p(b: &mut Builder, rank: usize, ops: &[Op]) -> Result<()> {
    let mut self_sends = Vec::new();
    let mut self_recvs = Vec::new();
    for op in ops.iter().filter(|o| o.kind.is_p2p() && o.count > 0) {
        b.begin(op.tag());
        match (op.kind, op.root == rank) {
            (OpKind::Send, true) => self_sends.push(op),
            (OpKind::Recv, true) => self_recvs.push(op),
            (OpKind::Send, false) => {
                b.send(op.root, op.send, &[]);
            }
            _ => {
                b.recv(op.root, op.recv, &[]);
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
    for (s, r) in self_sends.iter().zip(&self_recvs) {
        if s.send.len() != r.recv.len() {
            return Err(Error::invalid_usage(format!(
                "rank {rank} sends {} bytes to itself but receives {} bytes", s.send.len(), r.recv.len())));
        }
        b.begin(s.tag());
        b.copy(r.recv, s.send, &[]);
    }
    Ok(())
}
