//! Collectives and point-to-point calls: validate the arguments as NCCL does, resolve the
//! buffers to the regions NCCL's semantics define, and hand the operation to the group layer
//! (which runs it at once outside a group).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::comm::{resolve_op, Comm, ScalarSource, UserOp};
use crate::device::cuda::UserStream;
use crate::device::host::{self, Region, UserPtr};
use crate::error::{Error, Result};
use crate::plan::{Op, OpKind};
use crate::streamed::Placement;
use crate::types::{BuiltinOp, DataType, RedOp};

pub use crate::plan::OpKind as Kind;

/// The raw arguments of a call, as the boundary received them.
#[derive(Clone, Copy, Debug)]
pub struct Args {
    pub kind: Kind,
    pub send: UserPtr,
    pub recv: UserPtr,
    pub count: usize,
    pub datatype: i32,
    pub op: i32,
    /// Root, or peer for send/recv.
    pub root: i32,
    /// The call's stream (CUDA mode orders the operation with it; host mode ignores it).
    pub stream: UserStream,
}

fn need(p: UserPtr, what: &str, kind: OpKind) -> Result<()> {
    if p.is_null() {
        return Err(Error::invalid_arg(format!("{what} is NULL in {}", kind.name())));
    }
    Ok(())
}

/// Resolve buffers to regions: (send, recv) as this rank uses them.
fn regions(a: &Args, es: usize, n: usize, rank: usize, root: usize) -> Result<(Region, Region)> {
    let bytes = a.count.checked_mul(es).ok_or_else(|| Error::invalid_arg(format!("count {} is too large", a.count)))?;
    let all = bytes.checked_mul(n).ok_or_else(|| Error::invalid_arg(format!("count {} is too large", a.count)))?;
    let is_root = rank == root;
    let (s, r) = match a.kind {
        Kind::AllReduce => (bytes, bytes),
        Kind::Broadcast => (if is_root { bytes } else { 0 }, bytes),
        Kind::Reduce => (bytes, if is_root { bytes } else { 0 }),
        Kind::AllGather => (bytes, all),
        Kind::ReduceScatter => (all, bytes),
        Kind::AlltoAll => (all, all),
        Kind::Gather => (bytes, if is_root { all } else { 0 }),
        Kind::Scatter => (if is_root { all } else { 0 }, bytes),
        Kind::Send => (bytes, 0),
        Kind::Recv => (0, bytes),
    };
    if bytes > 0 {
        if s > 0 {
            need(a.send, "sendbuff", a.kind)?;
        }
        if r > 0 {
            need(a.recv, "recvbuff", a.kind)?;
        }
    }
    let region = |p: UserPtr, len: usize| if len == 0 { Region::EMPTY } else { Region::user(p, 0, len) };
    Ok((region(a.send, s), region(a.recv, r)))
}

/// In CUDA mode, where the call's buffers are (one classification each). A call naming memory
/// the device reaches in stream order (device, pinned or managed: what the stream's earlier
/// work may still be writing) runs on the communicator's stream worker (see `streamed`),
/// ordered with the call's stream; pageable host memory alone runs at once on the calling
/// thread, as in host mode.
///
/// A buffer the driver cannot classify (an error other than "not CUDA memory") fails the
/// call: taken for host memory, a device buffer would be read by this thread.
///
/// With `dev`, the communicator's device: memory of another device is read and written where
/// it is by `dev`'s kernels, which needs peer access from `dev` to it (enabled here if the
/// driver allows it); where there can be none, the call is refused (`ncclInvalidArgument`)
/// rather than let a kernel fault on it, which would end every CUDA call of the process.
pub(crate) fn placement(regions: &[Region], dev: Option<i32>) -> Result<Placement> {
    use crate::device::cuda::{classify, peer_access, PtrKind};
    if !crate::device::mode::is_cuda() {
        return Ok(Placement::default());
    }
    let mut p = Placement::default();
    for (i, r) in regions.iter().enumerate().filter(|(_, r)| !r.is_empty()) {
        let kind = classify(r.addr()).map_err(|e| e.context(format!("classifying the buffer at {:#x}", r.addr())))?;
        if let (PtrKind::Device { ordinal }, Some(dev)) = (kind, dev) {
            if !peer_access(dev, ordinal) {
                let name = ["sendbuff", "recvbuff", "the PreMulSum scalar"].get(i).copied().unwrap_or("a buffer");
                return Err(Error::invalid_arg(format!(
                    "{name} {:#x} is memory of CUDA device {ordinal}, which the communicator's device {dev} cannot \
                     access (no peer access between them): allocate it with device {dev} current",
                    r.addr()
                )));
            }
        }
        p.device |= kind.stream_ordered();
        p.pageable |= !kind.stream_ordered();
        if !kind.on_device() && i < 8 {
            p.host |= 1 << i;
        }
    }
    Ok(p)
}

/// NCCL_CHECK_POINTERS=1, in CUDA mode: each buffer of `op` must be memory the device
/// addresses, and device memory of the communicator's own device, as NCCL's check asks
/// (ncclInvalidArgument otherwise). Without it, plain host memory is staged, and a buffer of
/// another device is read and written where it is, which needs peer access between the two.
fn check_pointers(comm: &Comm, op: &Op) -> Result<()> {
    use crate::device::cuda::{classify, PtrKind};
    if !crate::device::mode::is_cuda() {
        return Ok(());
    }
    let named = [("sendbuff", op.send), ("recvbuff", op.recv)];
    for (name, r) in named.into_iter().filter(|(_, r)| !r.is_empty()) {
        let at = r.addr();
        match classify(at)? {
            PtrKind::Device { ordinal } if ordinal != comm.cuda_dev => {
                return Err(Error::invalid_arg(format!(
                    "{}: {name} {at:#x} is memory of CUDA device {ordinal}, not of the communicator's device {} \
                     (NCCL_CHECK_POINTERS=1)", op.describe(), comm.cuda_dev)));
            }
            PtrKind::Host => {
                return Err(Error::invalid_arg(format!(
                    "{}: {name} {at:#x} is not a valid pointer: plain host memory, which the device cannot address \
                     (NCCL_CHECK_POINTERS=1; without it, nccl-rs stages such buffers through host memory)",
                    op.describe())));
            }
            _ => {}
        }
    }
    Ok(())
}

/// Validate and issue one call.
pub fn enqueue(comm: Arc<Comm>, a: Args) -> Result<()> {
    let held = comm.hold(a.kind.name())?;
    let (op, placement) = validate(&comm, &a)?;
    crate::group::add_op(comm, op, a.stream, placement, held)
}

fn validate(comm: &Comm, a: &Args) -> Result<(Op, Placement)> {
    comm.ready_for_call()?;
    comm.check_stream(a.stream)?;
    let dt = DataType::from_raw(a.datatype).ok_or_else(|| Error::invalid_arg(format!("invalid datatype {}", a.datatype)))?;
    let n = comm.nranks;
    let root = if a.kind.has_root() || a.kind.is_p2p() {
        let what = if a.kind.is_p2p() { "peer" } else { "root" };
        if a.root < 0 || a.root as usize >= n {
            return Err(Error::invalid_arg(format!("{what} {} is out of range for {n} ranks", a.root)));
        }
        a.root as usize
    } else {
        0
    };
    let (op, scalar_at) = if a.kind.reduces() { resolve_op(comm, a.op, dt)? } else { (RedOp::Builtin(BuiltinOp::Sum), None) };
    let (send, recv) = regions(a, dt.size(), n, comm.rank, root)?;
    // A scalar the stream may still be writing is read in stream order: the operation goes to
    // the stream too. (resolve_op gives such a scalar only in device, pinned or managed memory.)
    let scalar = scalar_at.map_or(Region::EMPTY, |at| Region::user(at, 0, dt.size()));
    let placement = placement(&[send, recv, scalar], Some(comm.cuda_dev))?; // (`streamed::Buffer`'s order)
    // (Named in a refusal by the number it would take.)
    let next = if a.kind.is_p2p() { 0 } else { comm.seq.load(Ordering::Relaxed) };
    let mut op = Op { kind: a.kind, dt, op, count: a.count, root, send, recv, seq: next, scalar_at, of: None };
    if crate::params::check_pointers() {
        check_pointers(comm, &op)?;
    }
    // Collectives are numbered alike on every rank (a refused call takes no number);
    // point-to-point calls are not.
    if !a.kind.is_p2p() {
        op.seq = comm.seq.fetch_add(1, Ordering::Relaxed);
    }
    crate::info!(COLL, "{}: rank {} send {:#x} recv {:#x}", op.describe(), comm.rank, send.addr(), recv.addr());
    Ok((op, placement))
}

/// ncclRedOpCreatePreMulSum.
pub fn create_premulsum(comm: &Comm, scalar: UserPtr, datatype: i32, residence: i32) -> Result<i32> {
    let dt = DataType::from_raw(datatype).ok_or_else(|| Error::invalid_arg(format!("invalid datatype {datatype}")))?;
    let source = match residence {
        // ncclScalarDevice: in host mode "device-visible" memory is host memory, read per use.
        0 => {
            if scalar.is_null() {
                return Err(Error::invalid_arg("scalar is NULL"));
            }
            ScalarSource::Pointer(scalar)
        }
        1 => ScalarSource::Immediate(host::read_scalar(dt, scalar)?),
        r => return Err(Error::invalid_arg(format!("invalid scalar residence {r}"))),
    };
    comm.add_user_op(UserOp { datatype: dt, scalar: source })
}

pub fn destroy_redop(comm: &Comm, op: i32) -> Result<()> {
    if BuiltinOp::from_raw(op).is_some() {
        return Err(Error::invalid_arg(format!("reduction operator {op} is built in and cannot be destroyed")));
    }
    if !comm.remove_user_op(op) {
        return Err(Error::invalid_arg(format!("reduction operator {op} was not created on this communicator")));
    }
    Ok(())
}
