//! Inputs the direct path cannot give peers as they are, copied on the callers' streams into
//! device memory of the communicator's (`scratch`) at call time, and scaled there where the
//! operation needs it (PreMulSum, fp16 Avg): that copy is what peers read
//! ([`copy_unreadable_inputs`]).

use super::{pool, Path, StreamOp, Streamed};
use crate::comm::Comm;
use crate::device::cuda::Stream;
use crate::device::host::{Region, RegionSet};
use crate::error::{Error, Result};
use crate::plan::{Op, OpKind};
use crate::transport::ipc::{self, Routes};
use crate::types::{RedOp, Scalar};

/// An output a direct operation wrote into a carve of `Streamed::scratch` (an all-reduce's
/// whose buffer peers could not read), copied out on its caller's stream once the operation is
/// done: the caller's index, the user's output, the carve's region and id.
#[derive(Clone, Copy, Debug)]
pub(super) struct CopyOut {
    pub(super) caller: usize,
    pub(super) user: Region,
    pub(super) carve: Region,
    pub(super) id: u64,
}

/// The operations `paths` declined whose buffers peers could not read directly, but could
/// read a copy of (see `scratch`): sends a receive of their batch writes into (an in-place
/// exchange) and in-place all-to-alls (peers could read what their own output already wrote
/// there), sends and collectives on memory that cannot be published (pinned or managed host
/// memory, device memory without CUDA IPC such as a stream-ordered allocator's pools), and
/// PreMulSum and fp16 Avg collectives (the direct path has no scaling step). Each such input
/// is copied now on its caller's stream into device memory of the communicator's where it
/// finds room (scaled by the PreMulSum's scalar, or by 1/n), and that copy is the input that goes direct (its peers
/// read it); an all-reduce whose output cannot be published runs in place on such a copy,
/// copied out after it.
pub(super) fn copy_unreadable_inputs(comm: &Comm, s: &Streamed, callers: &[Stream], on: &dyn Fn(&StreamOp) -> usize,
                                     ops: &mut [StreamOp], paths: &mut [Path]) -> Result<Copied> {
    let mut copied = Copied::default();
    let declined = |o: &StreamOp, p: &Path| {
        let kernels = s.kernels.is_some() || o.op.kind == OpKind::Send;
        matches!(p, Path::Declined) && kernels && !(o.op.send.is_empty() && o.op.recv.is_empty())
    };
    let scratch_off = || s.scratch.lock().unwrap_or_else(|p| p.into_inner()).is_off();
    if !ops.iter().zip(paths.iter()).any(|(o, p)| declined(o, p)) || scratch_off() {
        return Ok(copied);
    }
    let received = RegionSet::new(ops.iter().filter(|o| o.op.kind == OpKind::Recv).map(|o| o.op.recv));
    s.recycle(s.scratch.lock().unwrap_or_else(|p| p.into_inner()).reclaim());
    for (i, (o, path)) in ops.iter_mut().zip(paths.iter_mut()).enumerate() {
        if !declined(o, path) {
            continue;
        }
        let Some((copy_in, copy_out)) = copies(&o.op, comm.rank, comm.nranks, &received, &s.routes) else { continue };
        let op = o.op;
        let len = if copy_out { op.recv.len() } else { op.send.len() };
        // A scalar in memory goes after the operation's bytes, in the same carve.
        let scalar_slot = matches!(copy_in, CopyIn::ScaleAt(_)).then(|| pool::aligned(len));
        let whole = scalar_slot.map_or(len, |at| at + op.dt.size());
        let lock = || s.scratch.lock().unwrap_or_else(|p| p.into_inner());
        let mut scratch = lock();
        let mut got = scratch.take(whole);
        if got.is_none() {
            if let Some(size) = scratch.wants_block(whole, comm.rank) {
                // Allocated without the lock (the worker gives carves back under it); the
                // submit lock keeps other callers out meanwhile. The context is current.
                drop(scratch);
                let mem = crate::device::cuda::DeviceMem::new(size);
                scratch = lock();
                scratch.add_block(mem, comm.rank);
                got = scratch.take(whole);
            }
        }
        let Some((taken, id)) = got else {
            scratch.too_small(whole, &|| op.describe(), comm.rank);
            continue;
        };
        let carve = taken.sub(0, len);
        let direct = match (&copy_in, copy_out) {
            // In place on the copy of its input: peers read both from it.
            (CopyIn::No, _) => Op { recv: carve, ..op },
            (_, true) => Op { send: carve, recv: carve, ..op },
            (_, false) => Op { send: carve, ..op },
        };
        // (The worker reads no scalar of it: the kernel does.)
        let direct = Op { scalar_at: None, ..direct };
        let scaled = matches!(copy_in, CopyIn::Scale(_) | CopyIn::ScaleAt(_));
        let Some(offered) = ipc::offer(&direct, comm.rank, s.kernels.is_some(), &s.routes, scaled) else {
            scratch.give_back(id);
            continue;
        };
        drop(scratch);
        let caller = &callers[on(o)];
        let input = carve.sub(0, op.send.len());
        // On a failure what this carve got may still run: it stays taken (as do the earlier ones).
        match copy_in {
            CopyIn::No => {}
            CopyIn::Copy => caller.copy(input, op.send)?,
            CopyIn::Scale(by) => scale(s, caller, op, input, Factor::Value(by))?,
            CopyIn::ScaleAt(at) => {
                let slot = taken.sub(scalar_slot.unwrap_or(0), op.dt.size());
                caller.copy(slot, Region::user(at, 0, op.dt.size()))?;
                scale(s, caller, op, input, Factor::At(slot))?;
            }
        }
        match copy_out {
            true => copied.outs.push(CopyOut { caller: on(o), user: op.recv, carve, id }),
            false => copied.inputs.push(id),
        }
        if scaled {
            copied.unscaled.resize(i + 1, None);
            copied.unscaled[i] = Some(Unscaled { send: op.send, scalar_at: op.scalar_at });
        }
        o.op = direct;
        *path = Path::Direct(Some(offered));
    }
    Ok(copied)
}

/// What `copy_unreadable_inputs` copied.
#[derive(Default)]
pub(super) struct Copied {
    /// The carves of copied inputs, given back when the batch is done.
    pub(super) inputs: Vec<u64>,
    pub(super) outs: Vec<CopyOut>,
    /// Per operation (none past the last scaled one): the user's input of a scaled one,
    /// which it is staged from if the ranks do not go direct after all.
    pub(super) unscaled: Vec<Option<Unscaled>>,
}

/// What a scaled operation is staged from if the ranks do not go direct after all: the
/// user's input, and its PreMulSum scalar if that is in device memory (read then).
#[derive(Clone, Copy, Debug)]
pub(super) struct Unscaled {
    pub send: Region,
    pub scalar_at: Option<crate::device::host::UserPtr>,
}

/// How an operation's input goes direct (`copies`): as it is, copied, or copied scaled (by a
/// PreMulSum's scalar, or fp16 Avg's 1/n).
enum CopyIn {
    No,
    Copy,
    Scale(Scalar),
    /// By a PreMulSum scalar in device, pinned or managed memory, copied in stream order next
    /// to the input and read there by the scaling kernel.
    ScaleAt(crate::device::host::UserPtr),
}

/// Which of `op`'s buffers go direct as copies (`copy_unreadable_inputs`): (its input; its
/// output, copied out), or None if that does not help. Only buffers the device copies
/// asynchronously (device, pinned or managed memory; plain host memory is never on the direct
/// path) are copied. `n`: the communicator's ranks.
fn copies(op: &Op, rank: usize, n: usize, received: &RegionSet, routes: &Routes) -> Option<(CopyIn, bool)> {
    let reachable = |r: Region| crate::device::cuda::classify(r.addr()).is_ok_and(|k| k.stream_ordered());
    let unreadable = |r: Region| !r.is_empty() && !ipc::publishable(r, routes) && reachable(r);
    // Peers read an all-reduce's output too: it runs on a copy (in place if its input is one
    // as well).
    let output = op.kind == OpKind::AllReduce && unreadable(op.recv);
    match op.kind {
        OpKind::Send if received.overlaps(op.send) || unreadable(op.send) => Some((CopyIn::Copy, false)),
        OpKind::Send | OpKind::Recv => None,
        // Scaled now: a PreMulSum by its scalar as the call gave it (one in memory by the value
        // the stream leaves there, read by the kernel), fp16 Avg by 1/n as the planner scales
        // it (`plan::ops::scaling`).
        _ if crate::plan::ops::scales_inputs(op.op, op.dt) => {
            let by = match (op.op, op.scalar_at) {
                (RedOp::PreMulSum(_), Some(at)) => reachable(Region::user(at, 0, op.dt.size())).then_some(CopyIn::ScaleAt(at)),
                (RedOp::PreMulSum(by), None) => Some(CopyIn::Scale(by)),
                (RedOp::Builtin(_), _) => crate::device::host::avg_scalar(op.dt, n).map(CopyIn::Scale),
            };
            Some((by?, output)).filter(|_| reachable(op.send))
        }
        // An input the output overlaps outside NCCL's in-place layout (an all-to-all given
        // one buffer, say): peers read the copy, not what this rank's output already wrote.
        _ if op.input_overlaps_output(rank) => Some((CopyIn::Copy, output)),
        _ if output => Some((if op.send.addr() == op.recv.addr() || unreadable(op.send) { CopyIn::Copy } else { CopyIn::No },
                             true)),
        _ => unreadable(op.send).then_some((CopyIn::Copy, false)),
    }
}

/// What an input is scaled by (`scale`): a value, or the element at a device address.
enum Factor {
    Value(Scalar),
    At(Region),
}

/// Queues on `caller` the copy of `op`'s input into `to` scaled by `by` (PreMulSum, fp16 Avg):
/// the scaling kernel reads device memory in place; other memory is copied first.
fn scale(s: &Streamed, caller: &Stream, op: Op, to: Region, by: Factor) -> Result<()> {
    let k = s.kernels.ok_or_else(|| Error::internal("an input scaled for the direct path without kernels"))?;
    let from = if crate::device::cuda::is_device_memory(op.send.addr()) { op.send } else { caller.copy(to, op.send).map(|()| to)? };
    match by {
        Factor::Value(v) => k.premul(op.dt, to, from, v, caller),
        Factor::At(at) => k.premul_at(op.dt, to, from, at, caller),
    }
}
