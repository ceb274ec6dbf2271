//! Algorithms: pure schedule generators. Each describes one rank's part of a collective in
//! terms of the planner's transfers; none knows about transports or memory kinds.
//!
//! - `ring`: bandwidth-optimal rings (all-reduce as reduce-scatter + all-gather, all-gather,
//!   reduce-scatter) and pipelined chains (broadcast, reduce);
//! - `rd`: recursive doubling all-reduce, latency-optimal for small messages;
//! - `direct`: all-to-all, gather, scatter.

pub mod direct;
pub mod rd;
pub mod ring;

use crate::device::host::Region;
use crate::plan::{Builder, Op, OpKind, Reduction};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algo {
    Ring,
    /// Latency-optimal: recursive doubling for all-reduce.
    Tree,
}

/// `NCCL_ALGO` as NCCL spells it (Ring, Tree; case-insensitive; first known name wins).
pub fn parse_algo(v: &str) -> Option<Algo> {
    v.split(',').find_map(|a| match a.trim().to_ascii_lowercase().as_str() {
        "ring" => Some(Algo::Ring),
        "tree" | "collnetdirect" | "collnetchain" | "nvls" | "nvlstree" | "pat" => Some(Algo::Tree),
        _ => None,
    })
}

/// Messages up to this size use the latency-optimal all-reduce.
pub const SMALL_ALLREDUCE: usize = 64 << 10;

pub fn choose_allreduce(bytes: usize, nranks: usize, forced: Option<Algo>) -> Algo {
    match forced {
        Some(a) => a,
        None if bytes <= SMALL_ALLREDUCE || nranks <= 2 && bytes <= 4 * SMALL_ALLREDUCE => Algo::Tree,
        None => Algo::Ring,
    }
}

/// Append one rank's units for `op` (with `send` possibly replaced by a scaled copy).
pub fn build(b: &mut Builder, rank: usize, n: usize, op: &Op, send: Region, red: Reduction, forced: Option<Algo>) {
    match op.kind {
        OpKind::AllReduce => match choose_allreduce(op.recv.len(), n, forced) {
            Algo::Ring => ring::allreduce(b, rank, n, send, op.recv, red),
            Algo::Tree => rd::allreduce(b, rank, n, send, op.recv, red),
        },
        OpKind::AllGather => ring::allgather(b, rank, n, send, op.recv),
        OpKind::ReduceScatter => ring::reduce_scatter(b, rank, n, send, op.recv, red),
        OpKind::Broadcast => ring::broadcast(b, rank, n, op.root, send, op.recv),
        OpKind::Reduce => ring::reduce(b, rank, n, op.root, send, op.recv, red),
        OpKind::AlltoAll => direct::alltoall(b, rank, n, send, op.recv),
        OpKind::Gather => direct::gather(b, rank, n, op.root, send, op.recv),
        OpKind::Scatter => direct::scatter(b, rank, n, op.root, send, op.recv),
        OpKind::Send | OpKind::Recv => {}
    }
}

/// Byte range of chunk `c` when `count` elements of `es` bytes are split into `n` chunks.
pub fn chunk(count: usize, es: usize, n: usize, c: usize) -> (usize, usize) {
    let start = c * count / n;
    let end = (c + 1) * count / n;
    (start * es, (end - start) * es)
}

#[cfg(test)]
pub mod sim;
