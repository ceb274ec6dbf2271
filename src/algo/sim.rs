//! Test-only: runs every rank's planned units against in-memory queues (no transport), to
//! check each algorithm's result exactly, for many rank counts, sizes and both algorithms.

use std::collections::{HashMap, VecDeque};

use super::Algo;
use crate::device::host::{self, Region};
use crate::plan::{plan_group, Builder, Op, OpKind, Step, NO_DEP};
use crate::types::{BuiltinOp, DataType, RedOp};

/// Execute all ranks' plans to completion; panics on a deadlock or a mismatched message.
/// `rendezvous`: a send completes only once its receiver has taken the message, and its bytes
/// are read then, from the sender's memory, as with single-copy descriptors (the strictest
/// transport: a sender that writes into a buffer it posted before the send completed sends
/// the new bytes); otherwise they are copied, and the send completes, as soon as it is queued.
fn run(plans: &[Builder], rendezvous: bool) {
    let n = plans.len();
    // The bytes (copied at once), or where to read them when the message is taken.
    type Msg = (crate::transport::Stamp, Result<Vec<u8>, Region>, (usize, usize));
    let mut queues: HashMap<(usize, usize), VecDeque<Msg>> = HashMap::new();
    let mut done: Vec<Vec<bool>> = plans.iter().map(|p| vec![false; p.units.len()]).collect();
    let mut posted: Vec<Vec<bool>> = plans.iter().map(|p| vec![false; p.units.len()]).collect();
    loop {
        let mut progressed = false;
        for r in 0..n {
            // Per-queue order: the first pending unit of each (kind, peer) may run.
            let mut blocked: std::collections::HashSet<(u8, u32)> = Default::default();
            for (i, u) in plans[r].units.iter().enumerate() {
                if done[r][i] {
                    continue;
                }
                let key = match u.step {
                    Step::Send { peer, .. } => (0, peer),
                    Step::Recv { peer, .. } | Step::RecvReduce { peer, .. } => (1, peer),
                    _ => (2, 0),
                };
                if blocked.contains(&key) {
                    continue;
                }
                let ready = u.deps.iter().all(|&d| d == NO_DEP || done[r][d as usize]);
                let ran = ready && match u.step {
                    Step::Send { peer, src } => {
                        if !posted[r][i] {
                            // SAFETY (test): regions point into buffers owned by the test.
                            let bytes = if rendezvous { Err(src) } else { Ok(unsafe { src.as_slice() }.to_vec()) };
                            queues.entry((r, peer as usize)).or_default()
                                .push_back((plans[r].stamps[u.op as usize], bytes, (r, i)));
                            posted[r][i] = true;
                            progressed = true;
                        }
                        !rendezvous
                    }
                    Step::Recv { peer, dst } | Step::RecvReduce { peer, dst, .. } => {
                        match queues.get_mut(&(peer as usize, r)).and_then(|q| q.pop_front()) {
                            None => false,
                            Some((stamp, bytes, (sr, si))) => {
                                done[sr][si] = true;
                                // SAFETY (test): as above; read now, as a single-copy receiver does.
                                let bytes = bytes.unwrap_or_else(|src| unsafe { src.as_slice() }.to_vec());
                                assert_eq!((stamp, bytes.len()), (plans[r].stamps[u.op as usize], dst.len()),
                                           "rank {r}: mismatched message from {peer}");
                                match u.step {
                                    Step::RecvReduce { dst, acc, dt, op, scaled: None, .. } =>
                                        host::reduce_in(dt, op, dst, acc, &bytes),
                                    Step::RecvReduce { dst, acc, dt, scaled: Some(s), .. } =>
                                        host::reduce_in_scaled(dt, dst, acc, s, &bytes),
                                    _ => host::copy_in(dst, &bytes),
                                }
                                true
                            }
                        }
                    }
                    Step::Copy { dst, src, .. } => { host::copy(dst, src); true }
                    Step::Reduce { dst, a, b, dt, op } => { host::reduce_local(dt, op, dst, a, b); true }
                    Step::Premul { dst, src, dt, scalar } => { host::premul(dt, dst, src, scalar); true }
                    Step::Divide { dst, dt, divisor } => { host::divide(dt, dst, divisor); true }
                };
                if ran {
                    done[r][i] = true;
                    progressed = true;
                } else if !posted[r][i] {
                    // A posted send (rendezvous) does not hold back the sends behind it, as
                    // with real single-copy transports; anything else not runnable does.
                    blocked.insert(key);
                }
            }
        }
        if done.iter().all(|d| d.iter().all(|&x| x)) {
            assert!(queues.values().all(|q| q.is_empty()), "messages left over");
            return;
        }
        assert!(progressed, "deadlock");
    }
}

struct Case {
    kind: OpKind,
    n: usize,
    count: usize,
    op: RedOp,
    root: usize,
    in_place: bool,
}

fn value(rank: usize, i: usize) -> i32 {
    ((rank * 7 + i * 3) % 11) as i32 - 5
}

/// The reduction of every rank's value (rank, value).
fn reduce_ref(op: RedOp, vals: impl Iterator<Item = (usize, i32)>, n: usize) -> i32 {
    let v: Vec<i32> = vals.map(|(rank, x)| match op {
        RedOp::PreMulSum(_) => x.wrapping_mul(premul_scalar(rank)),
        RedOp::Builtin(_) => x,
    }).collect();
    match op {
        RedOp::Builtin(BuiltinOp::Sum) | RedOp::PreMulSum(_) => v.iter().fold(0i32, |a, b| a.wrapping_add(*b)),
        RedOp::Builtin(BuiltinOp::Prod) => v.iter().fold(1i32, |a, b| a.wrapping_mul(*b)),
        RedOp::Builtin(BuiltinOp::Max) => *v.iter().max().unwrap(),
        RedOp::Builtin(BuiltinOp::Min) => *v.iter().min().unwrap(),
        RedOp::Builtin(BuiltinOp::Avg) => v.iter().sum::<i32>() / n as i32,
    }
}

/// Each rank's PreMulSum factor: its own (NCCL lets them differ), 3 + rank.
fn premul_scalar(rank: usize) -> i32 {
    3 + rank as i32
}

/// Every reduction the sum-based algorithms see: the builtins, and PreMulSum, whose input is
/// scaled as it is read (the factor here a placeholder: each rank uses `premul_scalar`).
fn reductions() -> Vec<RedOp> {
    let premul = RedOp::PreMulSum(crate::types::Scalar { bytes: [0; 8] });
    BuiltinOp::ALL.iter().map(|&o| RedOp::Builtin(o)).chain([premul]).collect()
}

/// Run one int32 case on all ranks and check every rank's output exactly.
fn check(c: &Case, algo: Option<Algo>, rendezvous: bool) {
    let (n, count) = (c.n, c.count);
    let (send_elems, recv_elems) = match c.kind {
        OpKind::AllReduce | OpKind::Broadcast | OpKind::Reduce => (count, count),
        OpKind::AllGather | OpKind::Gather => (count, count * n),
        OpKind::ReduceScatter | OpKind::Scatter => (count * n, count),
        OpKind::AlltoAll => (count * n, count * n),
        _ => unreachable!(),
    };
    let mut sends: Vec<Vec<i32>> = (0..n).map(|r| (0..send_elems).map(|i| value(r, i)).collect()).collect();
    let mut recvs: Vec<Vec<i32>> = vec![vec![-99; recv_elems]; n];
    // In place, NCCL's rules put the input inside the output (or the output inside the
    // input): (where the output lives, element offset of the input in the output or -1 for
    // the output inside the input at that offset).
    let mut out_in_send = vec![None; n];
    let mut plans = Vec::new();
    for r in 0..n {
        let is_root = r == c.root;
        let mut send = Region::owned(bytemuck(&mut sends[r]));
        let mut recv = Region::owned(bytemuck(&mut recvs[r]));
        if c.in_place {
            match c.kind {
                OpKind::AllReduce | OpKind::Broadcast | OpKind::Reduce => {
                    recvs[r].copy_from_slice(&sends[r]);
                    recv = Region::owned(bytemuck(&mut recvs[r]));
                    send = recv;
                }
                OpKind::AllGather => {
                    recvs[r][r * count..(r + 1) * count].copy_from_slice(&sends[r]);
                    recv = Region::owned(bytemuck(&mut recvs[r]));
                    send = recv.sub(r * count * 4, count * 4);
                }
                OpKind::Gather if is_root => {
                    recvs[r][r * count..(r + 1) * count].copy_from_slice(&sends[r]);
                    recv = Region::owned(bytemuck(&mut recvs[r]));
                    send = recv.sub(r * count * 4, count * 4);
                }
                OpKind::ReduceScatter => {
                    recv = send.sub(r * count * 4, count * 4);
                    out_in_send[r] = Some(r * count);
                }
                OpKind::Scatter if is_root => {
                    recv = send.sub(r * count * 4, count * 4);
                    out_in_send[r] = Some(r * count);
                }
                // (No in-place form in NCCL; one buffer for both still works.)
                OpKind::AlltoAll => {
                    recv = send;
                    out_in_send[r] = Some(0);
                }
                _ => {}
            }
        }
        let red = match c.op {
            RedOp::PreMulSum(_) => {
                RedOp::PreMulSum(crate::types::Scalar { bytes: (premul_scalar(r) as i64).to_le_bytes() })
            }
            builtin => builtin,
        };
        let op = Op { kind: c.kind, dt: DataType::Int32, op: red, count, root: c.root,
                      send, recv, seq: 0, scalar_at: None, of: None };
        plans.push(plan_group(r, n, 256, &[op], algo).unwrap());
    }
    run(&plans, rendezvous);
    for r in 0..n {
        if let Some(off) = out_in_send[r] {
            recvs[r] = sends[r][off..off + recv_elems].to_vec();
        }
        assert!(recvs[r].len() >= recv_elems, "rank {r}: {} elements received, {recv_elems} expected", recvs[r].len());
        for (i, &got) in recvs[r].iter().enumerate().take(recv_elems) {
            let want = match c.kind {
                OpKind::AllReduce => reduce_ref(c.op, (0..n).map(|q| (q, value(q, i))), n),
                OpKind::Reduce if r == c.root => reduce_ref(c.op, (0..n).map(|q| (q, value(q, i))), n),
                OpKind::Reduce => continue,
                OpKind::Broadcast => value(c.root, i),
                OpKind::AllGather => value(i / count, i % count),
                OpKind::Gather if r == c.root => value(i / count, i % count),
                OpKind::Gather => continue,
                OpKind::ReduceScatter => reduce_ref(c.op, (0..n).map(|q| (q, value(q, r * count + i))), n),
                OpKind::Scatter => value(c.root, r * count + i),
                OpKind::AlltoAll => value(i / count, r * count + i % count),
                _ => unreachable!(),
            };
            assert_eq!(got, want, "{:?} n={n} count={count} {:?} root={} algo={algo:?} rank {r} elem {i}",
                       c.kind, c.op, c.root);
        }
    }
}

fn bytemuck(v: &mut [i32]) -> &mut [u8] {
    // SAFETY (test): i32 has no invalid bit patterns and u8 alignment is 1.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), v.len() * 4) }
}

#[test]
fn every_collective_every_size_both_algorithms() {
    for n in 1..=9 {
        for count in [0, 1, 7, 13, 200] {
            for kind in [OpKind::AllReduce, OpKind::AllGather, OpKind::ReduceScatter, OpKind::Broadcast,
                         OpKind::Reduce, OpKind::AlltoAll, OpKind::Gather, OpKind::Scatter] {
                let ops = if kind.reduces() { reductions() } else { vec![RedOp::Builtin(BuiltinOp::Sum)] };
                let roots: Vec<usize> = if kind.has_root() { (0..n).collect() } else { vec![0] };
                for &op in &ops {
                    for &root in &roots {
                        for in_place in [false, true] {
                            let c = Case { kind, n, count, op, root, in_place };
                            for rendezvous in [false, true] {
                                check(&c, Some(Algo::Ring), rendezvous);
                                if kind == OpKind::AllReduce {
                                    check(&c, Some(Algo::Tree), rendezvous);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// A reduce long enough that the chain's middle ranks reuse their scratch slots (each receive
/// into a slot waits for the send that last went from it), on transports of both kinds.
#[test]
fn reduce_middle_ranks_pass_many_slices_through_their_slots() {
    for n in 3..=5 {
        for root in 0..n {
            for in_place in [false, true] {
                for op in reductions() {
                    let c = Case { kind: OpKind::Reduce, n, count: 2000, op, root, in_place };
                    for rendezvous in [false, true] {
                        check(&c, None, rendezvous);
                    }
                }
            }
        }
    }
}
