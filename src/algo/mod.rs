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

/// The all-reduce algorithm `NCCL_ALGO` forces, read as NCCL reads it: a list of allowed
/// algorithms (`Ring`, `Tree`, ...; case-insensitive), a list of excluded ones after `^`, and
/// per-collective lists (`allreduce:tree;broadcast:ring`, where the `allreduce` entry, or else
/// an entry without a collective, applies). NCCL's latency-oriented algorithms (Tree, CollNet,
/// NVLS, PAT) all mean our recursive doubling. None when both of ours stay allowed (we choose
/// by size) or when the value names nothing we know.
pub fn parse_algo(v: &str) -> Option<Algo> {
    let entries: Vec<&str> = v.split(';').map(str::trim).filter(|e| !e.is_empty()).collect();
    let for_allreduce = entries.iter().find_map(|e| {
        let (func, list) = e.split_once(':')?;
        func.trim().eq_ignore_ascii_case("allreduce").then_some(list)
    });
    let list = for_allreduce.or_else(|| entries.iter().copied().find(|e| !e.contains(':')))?.trim();
    let (exclude, list) = match list.strip_prefix('^') {
        Some(rest) => (true, rest),
        None => (false, list),
    };
    let (mut ring, mut tree) = (false, false);
    for name in list.split(',') {
        match name.trim().to_ascii_lowercase().as_str() {
            "ring" => ring = true,
            "tree" | "collnetdirect" | "collnetchain" | "collnet" | "nvls" | "nvlstree" | "pat" => tree = true,
            _ => {}
        }
    }
    // The algorithms left allowed.
    let (ring, tree) = if exclude { (!ring, !tree) } else { (ring, tree) };
    match (ring, tree) {
        (true, false) => Some(Algo::Ring),
        (false, true) => Some(Algo::Tree),
        _ => None,
    }
}

/// Messages up to this size use the latency-optimal all-reduce. Above, the ring is faster
/// whatever the rank count, a whole-buffer exchange being a single-copy message from 64 KiB
/// whose send completes only once the peer has read it (nccl-rs-perf allreduce, µs, ring
/// against recursive doubling, 64 KiB: 2 processes 11 vs 27-29, 3 processes 24-34 vs
/// 46-56, 2 processes without CMA 11 vs 12-15; 32 KiB: 7.8-8.5 vs 7.0-7.8). Before, up to
/// 64 KiB, and 256 KiB for 2 ranks (256 KiB: 40 vs 88 µs).
pub const SMALL_ALLREDUCE: usize = 32 << 10;

pub fn choose_allreduce(bytes: usize, forced: Option<Algo>) -> Algo {
    match forced {
        Some(a) => a,
        None if bytes <= SMALL_ALLREDUCE => Algo::Tree,
        None => Algo::Ring,
    }
}

/// Append one rank's units for `op` (with `send` possibly replaced by a scaled copy).
pub fn build(b: &mut Builder, rank: usize, n: usize, op: &Op, send: Region, red: Reduction, forced: Option<Algo>) {
    match op.kind {
        OpKind::AllReduce => match choose_allreduce(op.recv.len(), forced) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_algo_is_read_as_nccl_reads_it() {
        let cases = [
            ("Ring", Some(Algo::Ring)),
            ("tree", Some(Algo::Tree)),
            ("NVLS,PAT", Some(Algo::Tree)),
            ("Ring,Tree", None),
            ("^Ring", Some(Algo::Tree)),
            ("^tree,collnetdirect", Some(Algo::Ring)),
            ("^Ring,Tree", None),
            ("allreduce:tree;broadcast:ring", Some(Algo::Tree)),
            ("broadcast:tree;ring", Some(Algo::Ring)),
            ("broadcast:tree", None),
            ("AllReduce:^ring", Some(Algo::Tree)),
            ("nonsense", None),
            ("", None),
        ];
        for (v, want) in cases {
            assert_eq!(parse_algo(v), want, "NCCL_ALGO={v:?}");
        }
    }

    #[test]
    fn allreduce_algorithm_by_size_unless_forced() {
        assert_eq!(choose_allreduce(4 << 10, None), Algo::Tree);
        assert_eq!(choose_allreduce(1 << 20, None), Algo::Ring);
        assert_eq!(choose_allreduce(32 << 10, None), Algo::Tree);
        assert_eq!(choose_allreduce(64 << 10, None), Algo::Ring);
        assert_eq!(choose_allreduce(200 << 10, None), Algo::Ring);
        assert_eq!(choose_allreduce(4 << 10, Some(Algo::Ring)), Algo::Ring);
        assert_eq!(choose_allreduce(1 << 20, Some(Algo::Tree)), Algo::Tree);
    }
}
