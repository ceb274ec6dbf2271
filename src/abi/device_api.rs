//! NCCL's device API (nccl_device/host.h): device communicators, symmetric-memory pointers,
//! teams and resource requirements. nccl-rs does not implement it yet; every entry point exists
//! (so programs load) and answers honestly: `ncclCommQueryProperties` says there is no device
//! API (a program that checks takes its fallback), the rest is `ncclInvalidUsage`, or an empty
//! team / -1.

use std::ffi::{c_int, c_void};

use super::types::*;
use super::write_out;
use crate::comm::handle;
use crate::error::{Error, Result};

fn unsupported<T>(what: &str) -> Result<T> {
    Err(Error::not_implemented(&format!("{what} (NCCL device API)")))
}

/// Team queries take a communicator: a bad handle is reported as such, a good one as unsupported.
fn team(comm: ncclComm_t, what: &str) -> Result<ncclTeam_t> {
    handle::get(comm)?;
    unsupported(what)
}

/// What nccl-rs says of a communicator: no device API, multimem, GIN or CFT; each rank its own
/// load/store team; host-initiated one-sided operations (`api::rma`).
fn properties(comm: &crate::comm::Comm, size: usize, magic: u32, version: u32) -> ncclCommProperties_t {
    let host = !crate::device::mode::is_cuda();
    ncclCommProperties_t {
        size,
        magic,
        version,
        rank: comm.rank as c_int,
        nRanks: comm.nranks as c_int,
        cudaDev: comm.cuda_dev,
        nvmlDev: if host { -1 } else { crate::params::nvml_index(comm.cuda_dev).unwrap_or(-1) },
        deviceApiSupport: false,
        multimemSupport: false,
        ginType: 0,
        nLsaTeams: crate::api::rma::lsa_teams(comm) as c_int,
        hostRmaSupport: true,
        railedGinType: 0,
        commHash: comm.hash,
        ginMinStride: 0,
        ginConnectionType: 0,
        ginSupport: [false; 64],
        devCommRuntimeVersionSize: 0,
        cftSupport: false,
        cftMulticastSupport: false,
        cftCountedSupport: false,
    }
}

export! {
    fn ncclCommQueryProperties(comm: ncclComm_t, props: *mut ncclCommProperties_t) {
        let comm = handle::get(comm)?;
        ensure!(!props.is_null(), Error::invalid_arg("props is NULL"));
        comm.ready()?;
        // SAFETY: a non-NULL props starts with the size/magic/version header in every version.
        let (size, magic, version) = unsafe { ((*props).size, (*props).magic, (*props).version) };
        crate::api::config::check_header("ncclCommProperties_t", size, magic)?;
        let full = properties(&comm, size, magic, version);
        let n = size.min(std::mem::size_of::<ncclCommProperties_t>());
        const HEADER: usize = crate::api::config::HEADER_BYTES;
        // SAFETY: the caller's struct has `size` writable bytes (NCCL_COMM_PROPERTIES_INITIALIZER
        // set size to sizeof its type); only the fields after the header that fit are written,
        // from a plain-old-data struct of ours, which is at least `n` bytes.
        unsafe {
            std::ptr::copy_nonoverlapping((&full as *const ncclCommProperties_t).cast::<u8>().add(HEADER),
                                          props.cast::<u8>().add(HEADER), n - HEADER);
        }
        Ok(())
    }
    fn ncclDevCommCreate(comm: ncclComm_t, reqs: *const ncclDevCommRequirements_t, outDevComm: *mut ncclDevComm_t) {
        let _ = (handle::get(comm)?, reqs, outDevComm);
        unsupported("ncclDevCommCreate")
    }
    fn ncclDevCommDestroy(comm: ncclComm_t, devComm: *const ncclDevComm_t) {
        let _ = (handle::get(comm)?, devComm);
        unsupported("ncclDevCommDestroy")
    }
    fn ncclGetLsaMultimemDevicePointer(window: ncclWindow_t, offset: usize, outPtr: *mut *mut c_void) {
        let _ = (window, offset, outPtr);
        unsupported("ncclGetLsaMultimemDevicePointer")
    }
    fn ncclGetMultimemDevicePointer(window: ncclWindow_t, offset: usize, multimem: ncclMultimemHandle,
                                    outPtr: *mut *mut c_void) {
        let _ = (window, offset, multimem, outPtr);
        unsupported("ncclGetMultimemDevicePointer")
    }
    fn ncclGetLsaDevicePointer(window: ncclWindow_t, offset: usize, lsaRank: c_int, outPtr: *mut *mut c_void) {
        ensure!(!window.is_null(), Error::invalid_arg("window is NULL"));
        ensure!(!outPtr.is_null(), Error::invalid_arg("outPtr is NULL"));
        let p = crate::api::rma::lsa_device_pointer(window as usize, offset, lsaRank)?;
        write_out(outPtr, "outPtr", p as *mut c_void)
    }
    fn ncclGetPeerDevicePointer(window: ncclWindow_t, offset: usize, peer: c_int, outPtr: *mut *mut c_void) {
        ensure!(!window.is_null(), Error::invalid_arg("window is NULL"));
        ensure!(!outPtr.is_null(), Error::invalid_arg("outPtr is NULL"));
        let p = crate::api::rma::peer_device_pointer(window as usize, offset, peer)?;
        write_out(outPtr, "outPtr", p as *mut c_void)
    }
    fn ncclGetMultimemDeviceLeInfo(window: ncclWindow_t, offset: usize, leId: *mut ncclCftLeId, leOffset: *mut usize) {
        let _ = (window, offset, leId, leOffset);
        unsupported("ncclGetMultimemDeviceLeInfo")
    }
    fn ncclGetCftDeviceLeInfo(window: ncclWindow_t, offset: usize, peerCft: c_int, cftTeam: ncclTeam_t,
                              leId: *mut ncclCftLeId, leOffset: *mut usize) {
        let _ = (window, offset, peerCft, cftTeam, leId, leOffset);
        unsupported("ncclGetCftDeviceLeInfo")
    }
    fn ncclGetPeerDeviceLeInfo(window: ncclWindow_t, offset: usize, peerWorld: c_int, leId: *mut ncclCftLeId,
                               leOffset: *mut usize) {
        let _ = (window, offset, peerWorld, leId, leOffset);
        unsupported("ncclGetPeerDeviceLeInfo")
    }
    fn ncclTeamWorld(comm: ncclComm_t) -> ncclTeam_t = ncclTeam_t::EMPTY; {
        team(comm, "ncclTeamWorld")
    }
    fn ncclTeamLsa(comm: ncclComm_t) -> ncclTeam_t = ncclTeam_t::EMPTY; {
        team(comm, "ncclTeamLsa")
    }
    fn ncclTeamRail(comm: ncclComm_t) -> ncclTeam_t = ncclTeam_t::EMPTY; {
        team(comm, "ncclTeamRail")
    }
    fn ncclTeamCft(comm: ncclComm_t, mode: ncclCftTeamMode_t) -> ncclTeam_t = ncclTeam_t::EMPTY; {
        let _ = mode;
        team(comm, "ncclTeamCft")
    }
    fn ncclTeamCftMultimem(comm: ncclComm_t) -> ncclTeam_t = ncclTeam_t::EMPTY; {
        team(comm, "ncclTeamCftMultimem")
    }
    fn ncclTeamRankToWorld(comm: ncclComm_t, team: ncclTeam_t, rank: c_int) -> c_int = -1; {
        let _ = (team, rank);
        handle::get(comm)?;
        unsupported("ncclTeamRankToWorld")
    }
    fn ncclTeamRankToLsa(comm: ncclComm_t, team: ncclTeam_t, rank: c_int) -> c_int = -1; {
        let _ = (team, rank);
        handle::get(comm)?;
        unsupported("ncclTeamRankToLsa")
    }
    fn ncclLsaBarrierCreateRequirement(team: ncclTeam_t, nBarriers: c_int, outHandle: *mut ncclLsaBarrierHandle_t,
                                       outReq: *mut ncclDevResourceRequirements_t) {
        let _ = (team, nBarriers, outHandle, outReq);
        unsupported("ncclLsaBarrierCreateRequirement")
    }
    fn ncclGinBarrierCreateRequirement(comm: ncclComm_t, team: ncclTeam_t, nBarriers: c_int,
                                       outHandle: *mut ncclGinBarrierHandle_t,
                                       outReq: *mut ncclDevResourceRequirements_t) {
        let _ = (comm, team, nBarriers, outHandle, outReq);
        unsupported("ncclGinBarrierCreateRequirement")
    }
    fn ncclLLA2ACalcSlots(maxElts: c_int, maxEltSize: c_int) -> c_int = -1; {
        let _ = (maxElts, maxEltSize);
        unsupported("ncclLLA2ACalcSlots")
    }
    fn ncclLLA2ACreateRequirement(nBlocks: c_int, nSlots: c_int, outHandle: *mut ncclLLA2AHandle_t,
                                  outReq: *mut ncclDevResourceRequirements_t) {
        let _ = (nBlocks, nSlots, outHandle, outReq);
        unsupported("ncclLLA2ACreateRequirement")
    }
    fn ncclGinOutboxCreateRequirement(nBlocks: c_int, size_log2: c_int, outHandle: *mut ncclGinOutboxHandle,
                                      outReq: *mut ncclDevResourceRequirements_t) {
        let _ = (nBlocks, size_log2, outHandle, outReq);
        unsupported("ncclGinOutboxCreateRequirement")
    }
    fn ncclGinInboxA2ACreateRequirement(peers: ncclTeam_t, nBlocks: c_int, size_log2: c_int,
                                        outHandle: *mut ncclGinInboxA2AHandle,
                                        outReq: *mut ncclDevResourceRequirements_t) {
        let _ = (peers, nBlocks, size_log2, outHandle, outReq);
        unsupported("ncclGinInboxA2ACreateRequirement")
    }
}
