//! One-sided operations on registered windows: `ncclPutSignal`, `ncclSignal`, `ncclWaitSignal`
//! (see `api::rma`).

use std::ffi::{c_int, c_uint, c_void};

use super::types::*;
use crate::api::rma::{self, PutArgs, WaitDesc};
use crate::comm::handle;
use crate::device::cuda::UserStream;
use crate::device::host::UserPtr;
use crate::error::Error;

export! {
    fn ncclPutSignal(localbuff: *const c_void, count: usize, datatype: ncclDataType_t, peer: c_int,
                     peerWin: ncclWindow_t, peerWinOffset: usize, sigIdx: c_int, ctx: c_int, flags: c_uint,
                     comm: ncclComm_t, stream: cudaStream_t) {
        super::grouped(|| {
            let comm = handle::get(comm)?;
            // SAFETY: NCCL's contract: NULL or a live stream of the communicator's device.
            let stream = unsafe { UserStream::new(stream) };
            comm.check_stream(stream)?;
            // SAFETY: the source of a put: `count` elements the call may read until it completes.
            let local = unsafe { UserPtr::new(localbuff) };
            let a = PutArgs { local, count, datatype: datatype.0, peer, window: peerWin as usize, offset: peerWinOffset,
                              sig: sigIdx, ctx, flags, stream };
            let op = rma::put(&comm, &a)?;
            rma::enqueue(comm, op)
        })
    }
    fn ncclSignal(peer: c_int, sigIdx: c_int, ctx: c_int, flags: c_uint, comm: ncclComm_t, stream: cudaStream_t) {
        super::grouped(|| {
            let comm = handle::get(comm)?;
            // SAFETY: NCCL's contract: NULL or a live stream of the communicator's device.
            let stream = unsafe { UserStream::new(stream) };
            comm.check_stream(stream)?;
            let op = rma::signal(&comm, peer, sigIdx, ctx, flags, stream)?;
            rma::enqueue(comm, op)
        })
    }
    fn ncclWaitSignal(nDesc: c_int, signalDescs: *mut ncclWaitSignalDesc_t, comm: ncclComm_t, stream: cudaStream_t) {
        super::grouped(|| {
            let comm = handle::get(comm)?;
            // SAFETY: NCCL's contract: NULL or a live stream of the communicator's device.
            let stream = unsafe { UserStream::new(stream) };
            comm.check_stream(stream)?;
            ensure!(nDesc >= 0, Error::invalid_arg(format!("nDesc is {nDesc}")));
            ensure!(nDesc == 0 || !signalDescs.is_null(), Error::invalid_arg("signalDescs is NULL"));
            let descs = if nDesc == 0 {
                Vec::new()
            } else {
                // SAFETY: signalDescs points to nDesc descriptors (NCCL's contract), checked non-NULL.
                let raw = unsafe { std::slice::from_raw_parts(signalDescs as *const ncclWaitSignalDesc_t, nDesc as usize) };
                raw.iter().map(|d| WaitDesc { op_cnt: d.opCnt, peer: d.peer, sig: d.sigIdx, ctx: d.ctx }).collect()
            };
            let op = rma::wait(&comm, descs, stream)?;
            rma::enqueue(comm, op)
        })
    }
}
