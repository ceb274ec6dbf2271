//! Communicator lifecycle and queries.

use std::ffi::{c_char, c_int};

use super::types::*;
use super::write_out;
use crate::api::config::{self, Config};
use crate::api::{init, split};
use crate::comm::handle;
use crate::error::{Error, Result};

/// Read a user's `ncclConfig_t`, whatever header version built it: only `size` bytes are read,
/// the rest keeps NCCL_CONFIG_INITIALIZER's values. NULL means "all defaults".
fn read_config(ptr: *mut ncclConfig_t) -> Result<Config> {
    if ptr.is_null() {
        return Ok(Config::default());
    }
    // SAFETY: a non-NULL config starts with the size/magic/version header in every NCCL version.
    let (size, magic, version) = unsafe { ((*ptr).size, (*ptr).magic, (*ptr).version) };
    config::check_header("ncclConfig_t", size, magic)?;
    let mut raw = ncclConfig_t::INITIALIZER;
    let n = size.min(std::mem::size_of::<ncclConfig_t>());
    // SAFETY: the caller's struct has `size` readable bytes (it set size = sizeof its type) and
    // `raw` is a plain-old-data ncclConfig_t of at least `n` bytes; the regions are distinct.
    unsafe {
        std::ptr::copy_nonoverlapping(ptr.cast::<u8>(), (&mut raw as *mut ncclConfig_t).cast::<u8>(), n);
    }
    // Fields newer than the caller's header version stay unset: they keep the initializer's
    // values above (numRmaCtx and numRmaSig came with 2.29 and 2.31).
    let _ = version;
    Config::resolve(raw.blocking, super::read_cstr(raw.commName), raw.splitShare)?.with_rma(raw.numRmaCtx, raw.numRmaSig)
}

/// Where a split or shrink writes the new handle, now or at the end of the group.
fn sink(out: *mut ncclComm_t) -> split::Sink {
    let addr = out as usize;
    Box::new(move |h: Option<crate::comm::handle::Handle>| {
        let p: ncclComm_t = h.map_or(std::ptr::null_mut(), |h| h.as_ptr());
        // SAFETY: newcomm was checked non-NULL and, by NCCL's contract, stays valid until the
        // call (or the group it is in) completes, which is when this runs.
        unsafe { (addr as *mut ncclComm_t).write_unaligned(p) };
    })
}

fn id_bytes(id: &ncclUniqueId) -> [u8; NCCL_UNIQUE_ID_BYTES] {
    id.internal.map(|c| c as u8)
}

fn write_handle(out: *mut ncclComm_t, started: init::Started) -> Result<()> {
    write_out(out, "comm", started.handle.as_ptr())?;
    if started.in_progress {
        return Err(Error::in_progress());
    }
    Ok(())
}

export! {
    fn ncclCommInitRank(comm: *mut ncclComm_t, nranks: c_int, commId: ncclUniqueId, rank: c_int) {
        super::grouped(|| {
            ensure!(!comm.is_null(), Error::invalid_arg("comm is NULL"));
            write_handle(comm, init::init_rank(nranks, id_bytes(&commId), rank, Config::default())?)
        })
    }
    fn ncclCommInitRankConfig(comm: *mut ncclComm_t, nranks: c_int, commId: ncclUniqueId, rank: c_int,
                              config: *mut ncclConfig_t) {
        super::grouped(|| {
            ensure!(!comm.is_null(), Error::invalid_arg("comm is NULL"));
            write_handle(comm, init::init_rank(nranks, id_bytes(&commId), rank, read_config(config)?)?)
        })
    }
    fn ncclCommInitRankScalable(newcomm: *mut ncclComm_t, nranks: c_int, myrank: c_int, nId: c_int,
                                commIds: *mut ncclUniqueId, config: *mut ncclConfig_t) {
        super::grouped(|| {
            ensure!(!newcomm.is_null(), Error::invalid_arg("newcomm is NULL"));
            ensure!(!commIds.is_null(), Error::invalid_arg("commIds is NULL"));
            ensure!(nId > 0, Error::invalid_arg(format!("nId {nId} must be at least 1")));
            // SAFETY: the caller passes nId ids (nId > 0 checked above).
            let ids = unsafe { std::slice::from_raw_parts(commIds, nId as usize) };
            let ids: Vec<_> = ids.iter().map(id_bytes).collect();
            write_handle(newcomm, init::init_rank_scalable(nranks, myrank, &ids, read_config(config)?)?)
        })
    }
    fn ncclCommInitAll(comm: *mut ncclComm_t, ndev: c_int, devlist: *const c_int) {
        ensure!(!comm.is_null(), Error::invalid_arg("comm is NULL"));
        ensure!(ndev > 0, Error::invalid_arg(format!("ndev {ndev} must be at least 1")));
        // Every rank is a communicator of this process with a thread of its own: a number far
        // past any machine's GPUs (a bad count, or an uninitialised variable) would exhaust
        // memory and threads instead of failing.
        ensure!(ndev <= init::MAX_INIT_ALL, Error::invalid_arg(format!(
            "ndev {ndev} is more ranks than ncclCommInitAll makes in one process (at most {})", init::MAX_INIT_ALL)));
        let devs: Option<Vec<c_int>> = (!devlist.is_null()).then(|| {
            // SAFETY: devlist holds ndev ints by the API contract (ndev > 0 checked).
            unsafe { std::slice::from_raw_parts(devlist, ndev as usize) }.to_vec()
        });
        let handles = init::init_all(ndev, devs)?;
        for (i, h) in handles.iter().enumerate() {
            // SAFETY: the caller's array has room for ndev communicators; i < ndev.
            unsafe { comm.add(i).write_unaligned(h.as_ptr()) };
        }
        Ok(())
    }
    fn ncclCommFinalize(comm: ncclComm_t) {
        if comm.is_null() {
            return Ok(()); // NCCL: finalizing NULL is a no-op, like destroying it.
        }
        init::finalize(&handle::get(comm)?)
    }
    fn ncclCommDestroy(comm: ncclComm_t) {
        if comm.is_null() {
            return Ok(()); // NCCL: destroying NULL is a no-op.
        }
        handle::take(comm)?.map_or(Ok(()), init::destroy)
    }
    fn ncclCommAbort(comm: ncclComm_t) {
        if comm.is_null() {
            return Ok(());
        }
        handle::take(comm)?.map_or(Ok(()), init::abort)
    }
    fn ncclCommRevoke(comm: ncclComm_t, revokeFlags: c_int) {
        if comm.is_null() {
            return Ok(()); // as NVIDIA's library
        }
        init::revoke(&*handle::get(comm)?, revokeFlags)
    }
    fn ncclCommSplit(comm: ncclComm_t, color: c_int, key: c_int, newcomm: *mut ncclComm_t, config: *mut ncclConfig_t) {
        super::grouped(|| {
            let parent = handle::get(comm)?;
            // As NCCL: NULL until the new communicator exists (a nonblocking split's caller
            // may poll the parent, then wait for the handle to appear).
            write_out(newcomm, "newcomm", std::ptr::null_mut())?;
            let config = if config.is_null() { None } else { Some(read_config(config)?) };
            split::split(parent, color, key, config, sink(newcomm))
        })
    }
    fn ncclCommShrink(comm: ncclComm_t, excludeRanksList: *mut c_int, excludeRanksCount: c_int,
                      newcomm: *mut ncclComm_t, config: *mut ncclConfig_t, shrinkFlags: c_int) {
        super::grouped(|| {
            let parent = handle::get(comm)?;
            write_out(newcomm, "newcomm", std::ptr::null_mut())?;
            ensure!(excludeRanksCount >= 0, Error::invalid_arg(format!("excludeRanksCount {excludeRanksCount} is negative")));
            ensure!(excludeRanksCount == 0 || !excludeRanksList.is_null(), Error::invalid_arg("excludeRanksList is NULL"));
            let exclude = if excludeRanksCount == 0 { Vec::new() } else {
                // SAFETY: the list holds excludeRanksCount ints by the API contract (checked non-NULL, count > 0).
                unsafe { std::slice::from_raw_parts(excludeRanksList, excludeRanksCount as usize) }.to_vec()
            };
            let config = if config.is_null() { None } else { Some(read_config(config)?) };
            split::shrink(parent, exclude, config, shrinkFlags, sink(newcomm))
        })
    }
    fn ncclCommGetUniqueId(comm: ncclComm_t, uniqueId: *mut ncclUniqueId) {
        let comm = handle::get(comm)?;
        ensure!(!uniqueId.is_null(), Error::invalid_arg("uniqueId is NULL"));
        let id = split::grow_id(&comm)?;
        write_out(uniqueId, "uniqueId", ncclUniqueId { internal: id.map(|b| b as c_char) })
    }
    fn ncclCommGrow(comm: ncclComm_t, nRanks: c_int, uniqueId: *const ncclUniqueId, rank: c_int,
                    newcomm: *mut ncclComm_t, config: *mut ncclConfig_t) {
        super::grouped(|| {
            write_out(newcomm, "newcomm", std::ptr::null_mut())?;
            // SAFETY: a non-NULL uniqueId points to an ncclUniqueId by the API contract.
            let id = (!uniqueId.is_null()).then(|| id_bytes(unsafe { &*uniqueId }));
            let who = if comm.is_null() {
                let id = id.ok_or_else(|| Error::invalid_arg("a new rank (comm NULL) must pass the coordinator's uniqueId"))?;
                split::Grower::Joining(rank, id)
            } else {
                ensure!(rank == -1, Error::invalid_arg(format!(
                    "rank {rank}: a rank of the communicator passes -1 (it keeps its number)")));
                split::Grower::Existing(handle::get(comm)?, id)
            };
            let config = if config.is_null() { None } else { Some(read_config(config)?) };
            split::grow(who, nRanks, config, sink(newcomm))
        })
    }
    fn ncclCommGetAsyncError(comm: ncclComm_t, asyncError: *mut ncclResult_t) {
        let code = handle::get(comm)?.polled_code();
        write_out(asyncError, "asyncError", ncclResult_t(code as c_int))
    }
    fn ncclCommCount(comm: ncclComm_t, count: *mut c_int) {
        let n = handle::get(comm)?.nranks;
        write_out(count, "count", n as c_int)
    }
    fn ncclCommCuDevice(comm: ncclComm_t, device: *mut c_int) {
        let d = handle::get(comm)?.cuda_dev;
        write_out(device, "device", d)
    }
    fn ncclCommUserRank(comm: ncclComm_t, rank: *mut c_int) {
        let r = handle::get(comm)?.rank;
        write_out(rank, "rank", r as c_int)
    }
    fn ncclCommSuspend(comm: ncclComm_t, flags: c_int) {
        init::suspend(&*handle::get(comm)?, flags)
    }
    fn ncclCommResume(comm: ncclComm_t) {
        init::resume(&*handle::get(comm)?)
    }
    fn ncclCommMemStats(comm: ncclComm_t, stat: ncclCommMemStat_t, value: *mut u64) {
        let v = init::mem_stat(&*handle::get(comm)?, stat.0)?;
        write_out(value, "value", v)
    }
}
