//! The operations of a communicator of one rank (see [`queue`]): queued on their callers'
//! streams as the copies (or the scaling) they are, without the stream worker.

use super::StreamOp;
use crate::comm::Comm;
use crate::device::cuda::{Context, KeepCurrent, Stream, UserStream};
use crate::device::host::Region;
use crate::error::Result;
use crate::types::RedOp;

/// A communicator of one rank: each collective's output is its input (PreMulSum's scaled by
/// its scalar; every other operator, Avg included, leaves one input as it is), so the group's
/// collectives are queued on their callers' streams as copies (none in place) or the scaling
/// kernel, and nothing else happens: no stream worker, no gate.
/// Whether it did: not in host-wait mode (whose calls return once done), nor with sends and
/// receives, plain host memory (a copy with it would wait for the stream on this thread), a
/// stream that captures a CUDA graph (captures keep one set of rules whatever the size), or no
/// reduction kernels for a PreMulSum: those take the usual path.
pub(super) fn queue(comm: &Comm, ops: &[StreamOp]) -> Result<bool> {
    if comm.nranks != 1 || crate::params::few_device_connections() {
        return Ok(false);
    }
    // (A buffer of `Placement::host` is host memory: two of them would copy on this thread.)
    let eligible = |o: &StreamOp| !o.op.kind.is_p2p() && !o.placement.pageable && o.placement.host & 0b11 != 0b11;
    if !ops.iter().all(eligible) {
        return Ok(false);
    }
    let ctx = Context::primary(comm.cuda_dev)?;
    let _keep = KeepCurrent::new();
    ctx.make_current()?;
    let premul = ops.iter().any(|o| o.op.kind.reduces() && matches!(o.op.op, RedOp::PreMulSum(_)));
    let kernels = if premul {
        match ctx.kernels() {
            Ok(k) => Some(k),
            Err(_) => return Ok(false),
        }
    } else {
        None
    };
    let mut streams: Vec<(UserStream, Stream)> = Vec::new();
    for o in ops {
        if !streams.iter().any(|(u, _)| *u == o.stream) {
            let st = Stream::caller(ctx, o.stream);
            // A capture (or the legacy stream beside one) takes the usual path: recorded as
            // captures are, with the same rules, or refused.
            if st.is_capturing()? {
                return Ok(false);
            }
            streams.push((o.stream, st));
        }
    }
    for o in ops {
        let Some((_, stream)) = streams.iter().find(|(u, _)| *u == o.stream) else { continue };
        let (op, dst, src) = (&o.op, o.op.recv, o.op.send);
        match (op.kind.reduces(), op.op, kernels) {
            (true, RedOp::PreMulSum(scalar), Some(k)) => match op.scalar_at {
                Some(at) => k.premul_at(op.dt, dst, src, Region::user(at, 0, op.dt.size()), stream)?,
                None => k.premul(op.dt, dst, src, scalar, stream)?,
            },
            _ if dst.addr() != src.addr() => stream.copy(dst, src)?,
            _ => {}
        }
        crate::trace!(COLL, "rank 0: {} of a one-rank communicator queued on its stream", op.describe());
    }
    Ok(true)
}
