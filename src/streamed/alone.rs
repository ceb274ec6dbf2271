//! Operations that involve no peer, queued on their callers' streams as the copies (or the
//! scaling) they are, without the stream worker: every collective of a communicator of one
//! rank ([`queue`]), and a rank's sends to itself with their receives ([`self_copies`]).

use super::StreamOp;
use crate::comm::Comm;
use crate::device::cuda::{Context, KeepCurrent, Stream};
use crate::device::host::Region;
use crate::error::Result;
use crate::plan::OpKind;
use crate::types::RedOp;

/// A communicator of one rank: each collective's output is its input (PreMulSum's scaled by
/// its scalar; every other operator, Avg included, leaves one input as it is), so the group's
/// collectives are queued on their callers' streams as copies (none in place) or the scaling
/// kernel, and nothing else happens: no stream worker, no gate.
/// Whether it did: not in host-wait mode (whose calls return once done), nor for a group over
/// several streams, nor with sends and receives, plain host memory (a copy with it would wait for the stream on this thread), a
/// stream that captures a CUDA graph (captures keep one set of rules whatever the size), or no
/// reduction kernels for a PreMulSum: those take the usual path.
pub(super) fn queue(comm: &Comm, ops: &[StreamOp]) -> Result<bool> {
    if comm.nranks != 1 || crate::params::few_device_connections() {
        return Ok(false);
    }
    // (A buffer of `Placement::host` is host memory: two of them would copy on this thread.
    // An input that overlaps the output elsewhere than at its start cannot be copied there:
    // a device copy between overlapping buffers is undefined.)
    let overlapping = |o: &StreamOp| o.op.send.addr() != o.op.recv.addr() && o.op.send.overlaps(o.op.recv);
    let eligible = |o: &StreamOp| {
        !o.op.kind.is_p2p() && !o.placement.pageable && o.placement.host & 0b11 != 0b11 && !overlapping(o)
    };
    // (A group over several streams runs after the work on all of them, as NCCL's does.)
    let Some(first) = ops.first() else { return Ok(false) };
    if !ops.iter().all(eligible) || ops.iter().any(|o| o.stream != first.stream) {
        return Ok(false);
    }
    let ctx = Context::primary(comm.cuda_dev)?;
    let _keep = KeepCurrent::new();
    ctx.make_current()?;
    let stream = Stream::caller(ctx, first.stream);
    // A capture (or the legacy stream beside one) takes the usual path: recorded as captures
    // are, with the same rules, or refused.
    if stream.is_capturing()? {
        return Ok(false);
    }
    let premul = ops.iter().any(|o| o.op.kind.reduces() && matches!(o.op.op, RedOp::PreMulSum(_)));
    let kernels = if premul {
        match ctx.kernels() {
            Ok(k) => Some(k),
            Err(_) => return Ok(false),
        }
    } else {
        None
    };
    for o in ops {
        let (op, dst, src) = (&o.op, o.op.recv, o.op.send);
        match (op.kind.reduces(), op.op, kernels) {
            (true, RedOp::PreMulSum(scalar), Some(k)) => match op.scalar_at {
                Some(at) => k.premul_at(op.dt, dst, src, Region::user(at, 0, op.dt.size()), &stream)?,
                None => k.premul(op.dt, dst, src, scalar, &stream)?,
            },
            _ if dst.addr() != src.addr() => stream.copy(dst, src)?,
            _ => {}
        }
        crate::trace!(COLL, "rank 0: {} of a one-rank communicator queued on its stream", op.describe());
    }
    Ok(true)
}

/// A rank's sends to itself and receives from itself in one group on one communicator, all on
/// `stream` (the caller passes groups on one stream only: a group on several runs after the
/// work on all of them), pair up in issue order, as NCCL matches them. A pair of one size,
/// whose copy is asynchronous (no plain host memory, not two host buffers), and whose receive
/// buffer no other operation of the group reads or writes (a PreMulSum scalar included), is
/// queued now as a device copy on that stream, ahead of the group's other work: it reads the
/// send's buffer before any of the group's receives could write it, as a send reads its
/// buffer in NCCL. Such pairs leave the group (an all-to-all's own part no longer goes
/// through host memory); the others stay, for the usual path (which reports a mismatch).
pub(super) fn self_copies(comm: &Comm, stream: &Stream, ops: Vec<StreamOp>) -> Result<Vec<StreamOp>> {
    let mine = |o: &StreamOp, kind: OpKind| o.op.kind == kind && o.op.root == comm.rank;
    let sends: Vec<usize> = (0..ops.len()).filter(|&i| mine(&ops[i], OpKind::Send)).collect();
    let recvs: Vec<usize> = (0..ops.len()).filter(|&i| mine(&ops[i], OpKind::Recv)).collect();
    let mut gone = vec![false; ops.len()];
    for (&si, &ri) in sends.iter().zip(&recvs) {
        let (s, r) = (&ops[si], &ops[ri]);
        let (src, dst) = (s.op.send, r.op.recv);
        let both_host = s.placement.host & 0b01 != 0 && r.placement.host & 0b10 != 0;
        let asynchronous = !(s.placement.pageable || r.placement.pageable || both_host);
        let scalar = |o: &StreamOp| o.op.scalar_at.map_or(Region::EMPTY, |at| Region::user(at, 0, o.op.dt.size()));
        let touched = |i: usize| {
            let o = &ops[i];
            i != si && i != ri && (o.op.send.overlaps(dst) || o.op.recv.overlaps(dst) || scalar(o).overlaps(dst))
        };
        let overlapping = src.addr() != dst.addr() && src.overlaps(dst);
        if src.len() != dst.len() || !asynchronous || overlapping || (0..ops.len()).any(touched) {
            continue;
        }
        if src.addr() != dst.addr() {
            stream.copy(dst, src)?;
        }
        gone[si] = true;
        gone[ri] = true;
    }
    if gone.iter().any(|&g| g) {
        crate::trace!(P2P, "rank {}: {} send(s) to itself copied on the caller's stream", comm.rank,
                      gone.iter().filter(|&&g| g).count() / 2);
    }
    Ok(ops.into_iter().zip(gone).filter(|(_, g)| !g).map(|(o, _)| o).collect())
}
