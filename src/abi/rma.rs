//! One-sided put/signal operations on memory windows: not implemented yet.

use std::ffi::{c_int, c_uint, c_void};

use super::types::*;
use crate::comm::handle;
use crate::error::Error;

export! {
    fn ncclPutSignal(localbuff: *const c_void, count: usize, datatype: ncclDataType_t, peer: c_int,
                     peerWin: ncclWindow_t, peerWinOffset: usize, sigIdx: c_int, ctx: c_int, flags: c_uint,
                     comm: ncclComm_t, stream: cudaStream_t) {
        let _ = (localbuff, count, datatype, peer, peerWin, peerWinOffset, sigIdx, ctx, flags, stream);
        handle::get(comm)?;
        Err(Error::not_implemented("ncclPutSignal (one-sided RMA)"))
    }
    fn ncclSignal(peer: c_int, sigIdx: c_int, ctx: c_int, flags: c_uint, comm: ncclComm_t, stream: cudaStream_t) {
        let _ = (peer, sigIdx, ctx, flags, stream);
        handle::get(comm)?;
        Err(Error::not_implemented("ncclSignal (one-sided RMA)"))
    }
    fn ncclWaitSignal(nDesc: c_int, signalDescs: *mut ncclWaitSignalDesc_t, comm: ncclComm_t, stream: cudaStream_t) {
        let _ = (nDesc, signalDescs, stream);
        handle::get(comm)?;
        Err(Error::not_implemented("ncclWaitSignal (one-sided RMA)"))
    }
}
