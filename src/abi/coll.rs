//! Collectives and point-to-point calls, and the PreMulSum operator they may use.

use std::ffi::{c_int, c_void};

use super::types::*;
use crate::api::coll::{self, Args, Kind};
use crate::comm::handle;
use crate::device::cuda::UserStream;
use crate::device::host::UserPtr;

/// The user's pointer, vouched for as NCCL's API does: valid for what the call's semantics say.
fn user(p: *const c_void) -> UserPtr {
    // SAFETY: `p` is a buffer argument of an NCCL call; the api layer only dereferences the
    // byte ranges NCCL's documentation of that call makes valid.
    unsafe { UserPtr::new(p) }
}

#[allow(clippy::too_many_arguments)]
fn args(kind: Kind, send: *const c_void, recv: *const c_void, count: usize, dt: ncclDataType_t, op: ncclRedOp_t,
        root: c_int, stream: cudaStream_t) -> Args {
    // SAFETY: `stream` is the stream argument of this NCCL call (NULL or a live stream of the
    // communicator's device until the operation completes: NCCL's contract); it is only used
    // by CUDA mode, to order the operation with it.
    let stream = unsafe { UserStream::new(stream) };
    Args { kind, send: user(send), recv: user(recv), count, datatype: dt.0, op: op.0, root, stream }
}

const NO_OP: ncclRedOp_t = ncclRedOp_t(0);

export! {
    fn ncclAllReduce(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t,
                     op: ncclRedOp_t, comm: ncclComm_t, stream: cudaStream_t) {
        issue(comm, std::ptr::null(), args(Kind::AllReduce, sendbuff, recvbuff, count, datatype, op, 0, stream))
    }
    fn ncclBroadcast(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t,
                     root: c_int, comm: ncclComm_t, stream: cudaStream_t) {
        issue(comm, std::ptr::null(), args(Kind::Broadcast, sendbuff, recvbuff, count, datatype, NO_OP, root, stream))
    }
    fn ncclBcast(buff: *mut c_void, count: usize, datatype: ncclDataType_t, root: c_int, comm: ncclComm_t,
                 stream: cudaStream_t) {
        issue(comm, std::ptr::null(), args(Kind::Broadcast, buff, buff, count, datatype, NO_OP, root, stream))
    }
    fn ncclReduce(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t,
                  op: ncclRedOp_t, root: c_int, comm: ncclComm_t, stream: cudaStream_t) {
        issue(comm, std::ptr::null(), args(Kind::Reduce, sendbuff, recvbuff, count, datatype, op, root, stream))
    }
    fn ncclAllGather(sendbuff: *const c_void, recvbuff: *mut c_void, sendcount: usize, datatype: ncclDataType_t,
                     comm: ncclComm_t, stream: cudaStream_t) {
        issue(comm, std::ptr::null(), args(Kind::AllGather, sendbuff, recvbuff, sendcount, datatype, NO_OP, 0, stream))
    }
    fn ncclReduceScatter(sendbuff: *const c_void, recvbuff: *mut c_void, recvcount: usize, datatype: ncclDataType_t,
                         op: ncclRedOp_t, comm: ncclComm_t, stream: cudaStream_t) {
        issue(comm, std::ptr::null(), args(Kind::ReduceScatter, sendbuff, recvbuff, recvcount, datatype, op, 0, stream))
    }
    fn ncclAlltoAll(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t,
                    comm: ncclComm_t, stream: cudaStream_t) {
        issue(comm, std::ptr::null(), args(Kind::AlltoAll, sendbuff, recvbuff, count, datatype, NO_OP, 0, stream))
    }
    fn ncclGather(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t,
                  root: c_int, comm: ncclComm_t, stream: cudaStream_t) {
        issue(comm, std::ptr::null(), args(Kind::Gather, sendbuff, recvbuff, count, datatype, NO_OP, root, stream))
    }
    fn ncclScatter(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t,
                   root: c_int, comm: ncclComm_t, stream: cudaStream_t) {
        issue(comm, std::ptr::null(), args(Kind::Scatter, sendbuff, recvbuff, count, datatype, NO_OP, root, stream))
    }
    fn ncclSend(sendbuff: *const c_void, count: usize, datatype: ncclDataType_t, peer: c_int, comm: ncclComm_t,
                stream: cudaStream_t) {
        issue(comm, std::ptr::null(), args(Kind::Send, sendbuff, std::ptr::null(), count, datatype, NO_OP, peer, stream))
    }
    fn ncclRecv(recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t, peer: c_int, comm: ncclComm_t,
                stream: cudaStream_t) {
        issue(comm, std::ptr::null(), args(Kind::Recv, std::ptr::null(), recvbuff, count, datatype, NO_OP, peer, stream))
    }

    fn ncclAllReduceConfig(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t,
                           op: ncclRedOp_t, comm: ncclComm_t, stream: cudaStream_t, config: *const ncclCollConfig_t) {
        issue(comm, config, args(Kind::AllReduce, sendbuff, recvbuff, count, datatype, op, 0, stream))
    }
    fn ncclBroadcastConfig(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t,
                           root: c_int, comm: ncclComm_t, stream: cudaStream_t, config: *const ncclCollConfig_t) {
        issue(comm, config, args(Kind::Broadcast, sendbuff, recvbuff, count, datatype, NO_OP, root, stream))
    }
    fn ncclReduceConfig(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t,
                        op: ncclRedOp_t, root: c_int, comm: ncclComm_t, stream: cudaStream_t,
                        config: *const ncclCollConfig_t) {
        issue(comm, config, args(Kind::Reduce, sendbuff, recvbuff, count, datatype, op, root, stream))
    }
    fn ncclAllGatherConfig(sendbuff: *const c_void, recvbuff: *mut c_void, sendcount: usize, datatype: ncclDataType_t,
                           comm: ncclComm_t, stream: cudaStream_t, config: *const ncclCollConfig_t) {
        issue(comm, config, args(Kind::AllGather, sendbuff, recvbuff, sendcount, datatype, NO_OP, 0, stream))
    }
    fn ncclReduceScatterConfig(sendbuff: *const c_void, recvbuff: *mut c_void, recvcount: usize,
                               datatype: ncclDataType_t, op: ncclRedOp_t, comm: ncclComm_t, stream: cudaStream_t,
                               config: *const ncclCollConfig_t) {
        issue(comm, config, args(Kind::ReduceScatter, sendbuff, recvbuff, recvcount, datatype, op, 0, stream))
    }
    fn ncclAlltoAllConfig(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t,
                          comm: ncclComm_t, stream: cudaStream_t, config: *const ncclCollConfig_t) {
        issue(comm, config, args(Kind::AlltoAll, sendbuff, recvbuff, count, datatype, NO_OP, 0, stream))
    }
    fn ncclGatherConfig(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t,
                        root: c_int, comm: ncclComm_t, stream: cudaStream_t, config: *const ncclCollConfig_t) {
        issue(comm, config, args(Kind::Gather, sendbuff, recvbuff, count, datatype, NO_OP, root, stream))
    }
    fn ncclScatterConfig(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t,
                         root: c_int, comm: ncclComm_t, stream: cudaStream_t, config: *const ncclCollConfig_t) {
        issue(comm, config, args(Kind::Scatter, sendbuff, recvbuff, count, datatype, NO_OP, root, stream))
    }

    fn ncclRedOpCreatePreMulSum(op: *mut ncclRedOp_t, scalar: *mut c_void, datatype: ncclDataType_t,
                                residence: ncclScalarResidence_t, comm: ncclComm_t) {
        let comm = handle::get(comm)?;
        let created = coll::create_premulsum(&comm, user(scalar), datatype.0, residence.0)?;
        super::write_out(op, "op", ncclRedOp_t(created))
    }
    fn ncclRedOpDestroy(op: ncclRedOp_t, comm: ncclComm_t) {
        coll::destroy_redop(&*handle::get(comm)?, op.0)
    }
}

/// Issue one collective or point-to-point call. Any error, a bad communicator or config
/// included, is also kept for the enclosing group: NCCL's ncclGroupEnd then returns it and
/// runs none of the group.
fn issue(comm: ncclComm_t, config: *const ncclCollConfig_t, a: Args) -> crate::Result<()> {
    super::grouped(|| check_coll_config(config).and_then(|()| coll::enqueue(handle::get(comm)?, a)))
}

/// A per-collective config: NULL means defaults; otherwise the header must be one we know.
fn check_coll_config(config: *const ncclCollConfig_t) -> crate::Result<()> {
    if config.is_null() {
        return Ok(());
    }
    // SAFETY: non-NULL config points to at least the size/magic/version header every version has.
    let (size, magic) = unsafe { ((*config).size, (*config).magic) };
    crate::api::config::check_header("ncclCollConfig_t", size, magic)
}
