//! The C types of `nccl.h` as Rust sees them. Enums that C passes in are integer newtypes
//! (`#[repr(transparent)]`): any int may arrive, and a PreMulSum op is `>= ncclNumOps`, so a
//! Rust enum there would be undefined behaviour. They are converted into `crate::types` once.

#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_uint, c_void};

use crate::error::{Error, Result};
use crate::types::{BuiltinOp, DataType};

#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ncclResult_t(pub c_int);

#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ncclDataType_t(pub c_int);

#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ncclRedOp_t(pub c_int);

#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ncclScalarResidence_t(pub c_int);

#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ncclCommMemStat_t(pub c_int);

#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ncclCftTeamMode_t(pub c_int);

/// Opaque to C; a handle is the address of a registry token (see `comm::handle`).
#[repr(C)]
pub struct ncclComm {
    _private: [u8; 0],
}
pub type ncclComm_t = *mut ncclComm;

#[repr(C)]
pub struct ncclWindow_vidmem {
    _private: [u8; 0],
}
pub type ncclWindow_t = *mut ncclWindow_vidmem;

#[repr(C)]
pub struct ncclParamHandle {
    _private: [u8; 0],
}
pub type ncclParamHandle_t = *mut ncclParamHandle;

#[repr(C)]
pub struct CUstream_st {
    _private: [u8; 0],
}
pub type cudaStream_t = *mut CUstream_st;

#[repr(C)]
pub struct CUevent_st {
    _private: [u8; 0],
}
pub type cudaEvent_t = *mut CUevent_st;

/// `int32_t`, spelled apart from `int` so the drift test sees the header's exact type.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct int32_t(pub i32);

pub const NCCL_UNIQUE_ID_BYTES: usize = 128;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ncclUniqueId {
    pub internal: [c_char; NCCL_UNIQUE_ID_BYTES],
}

pub const NCCL_API_MAGIC: c_uint = 0xcafe_beef;
pub const NCCL_CONFIG_UNDEF_INT: c_int = c_int::MIN;
pub const NCCL_SIM_INFO_MAGIC: c_uint = 0x7468_5283;

/// `ncclConfig_t` of 2.32.3 (120 bytes). Older headers pass a prefix of it: read only
/// `size` bytes (see `api::config`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclConfig_t {
    pub size: usize,
    pub magic: c_uint,
    pub version: c_uint,
    pub blocking: c_int,
    pub cgaClusterSize: c_int,
    pub minCTAs: c_int,
    pub maxCTAs: c_int,
    pub netName: *const c_char,
    pub splitShare: c_int,
    pub trafficClass: c_int,
    pub commName: *const c_char,
    pub collnetEnable: c_int,
    pub CTAPolicy: c_int,
    pub shrinkShare: c_int,
    pub nvlsCTAs: c_int,
    pub nChannelsPerNetPeer: c_int,
    pub nvlinkCentricSched: c_int,
    pub graphUsageMode: c_int,
    pub numRmaCtx: c_int,
    pub maxP2pPeers: c_int,
    pub graphStreamOrdering: c_int,
    pub launchOrderImplicit: c_int,
    pub numRmaSig: c_int,
    pub rmaEagerInit: c_int,
    pub hostCftMode: c_int,
    pub nvlsHostMode: c_int,
}

impl ncclConfig_t {
    /// NCCL_CONFIG_INITIALIZER.
    pub const INITIALIZER: ncclConfig_t = ncclConfig_t {
        size: std::mem::size_of::<ncclConfig_t>(),
        magic: NCCL_API_MAGIC,
        version: crate::NCCL_VERSION_CODE as c_uint,
        blocking: NCCL_CONFIG_UNDEF_INT,
        cgaClusterSize: NCCL_CONFIG_UNDEF_INT,
        minCTAs: NCCL_CONFIG_UNDEF_INT,
        maxCTAs: NCCL_CONFIG_UNDEF_INT,
        netName: std::ptr::null(),
        splitShare: NCCL_CONFIG_UNDEF_INT,
        trafficClass: NCCL_CONFIG_UNDEF_INT,
        commName: std::ptr::null(),
        collnetEnable: NCCL_CONFIG_UNDEF_INT,
        CTAPolicy: NCCL_CONFIG_UNDEF_INT,
        shrinkShare: NCCL_CONFIG_UNDEF_INT,
        nvlsCTAs: NCCL_CONFIG_UNDEF_INT,
        nChannelsPerNetPeer: NCCL_CONFIG_UNDEF_INT,
        nvlinkCentricSched: NCCL_CONFIG_UNDEF_INT,
        graphUsageMode: NCCL_CONFIG_UNDEF_INT,
        numRmaCtx: NCCL_CONFIG_UNDEF_INT,
        maxP2pPeers: NCCL_CONFIG_UNDEF_INT,
        graphStreamOrdering: NCCL_CONFIG_UNDEF_INT,
        launchOrderImplicit: NCCL_CONFIG_UNDEF_INT,
        numRmaSig: NCCL_CONFIG_UNDEF_INT,
        rmaEagerInit: NCCL_CONFIG_UNDEF_INT,
        hostCftMode: NCCL_CONFIG_UNDEF_INT,
        nvlsHostMode: NCCL_CONFIG_UNDEF_INT,
    };
}

#[repr(C)]
pub struct ncclConfigExt_t {
    pub next: *mut ncclConfigExt_t,
    pub vendorId: c_int,
    pub optionId: c_int,
    pub val: *mut c_void,
}

#[repr(C)]
pub struct ncclCollConfig_t {
    pub size: usize,
    pub magic: c_uint,
    pub version: c_uint,
    pub ext: *mut ncclConfigExt_t,
    pub minCTAs: c_int,
    pub maxCTAs: c_int,
    pub nvlsCTAs: c_int,
    pub cgaClusterSize: c_int,
    pub algSelection: *const c_char,
    pub forceAlgSelection: c_int,
    pub CTAPolicy: c_int,
    pub userProfilerTag: u64,
    pub launchCompletionEvent: cudaEvent_t,
}

#[repr(C)]
pub struct ncclSimInfo_t {
    pub size: usize,
    pub magic: c_uint,
    pub version: c_uint,
    pub estimatedTime: f32,
}

#[repr(C)]
pub struct ncclEncryptionConfig_t {
    pub size: usize,
    pub magic: c_uint,
    pub version: c_uint,
    pub mode: c_int,
    pub psk: *const c_char,
}

#[repr(C)]
pub struct ncclWaitSignalDesc_t {
    pub opCnt: c_int,
    pub peer: c_int,
    pub sigIdx: c_int,
    pub ctx: c_int,
}

/// The device API's team, returned by value (nccl_device/core.h).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ncclTeam_t {
    pub nRanks: c_int,
    pub rank: c_int,
    pub stride: c_int,
}

impl ncclTeam_t {
    /// What a team query returns when it cannot answer: an empty team.
    pub const EMPTY: ncclTeam_t = ncclTeam_t { nRanks: 0, rank: -1, stride: 0 };
}

/// `ncclCommProperties_t` of 2.32.3 (nccl_device/host.h, 152 bytes): versioned and
/// append-only like `ncclConfig_t`; a caller built with an older header passes a prefix.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ncclCommProperties_t {
    pub size: usize,
    pub magic: c_uint,
    pub version: c_uint,
    pub rank: c_int,
    pub nRanks: c_int,
    pub cudaDev: c_int,
    pub nvmlDev: c_int,
    pub deviceApiSupport: bool,
    pub multimemSupport: bool,
    /// ncclGinType_t (NCCL_GIN_TYPE_NONE = 0).
    pub ginType: c_int,
    pub nLsaTeams: c_int,
    pub hostRmaSupport: bool,
    pub railedGinType: c_int,
    pub commHash: u64,
    pub ginMinStride: c_int,
    /// ncclGinConnectionType_t (NCCL_GIN_CONNECTION_NONE = 0).
    pub ginConnectionType: c_int,
    pub ginSupport: [bool; 64],
    pub devCommRuntimeVersionSize: usize,
    pub cftSupport: bool,
    pub cftMulticastSupport: bool,
    pub cftCountedSupport: bool,
}

/// Opaque device-API structures we only ever see by pointer.
macro_rules! opaque {
    ($($name:ident),*) => {$(
        #[repr(C)]
        pub struct $name { _private: [u8; 0] }
    )*};
}
opaque!(
    ncclDevComm_t,
    ncclDevCommRequirements_t,
    ncclDevResourceRequirements_t,
    ncclLsaBarrierHandle_t,
    ncclGinBarrierHandle_t,
    ncclLLA2AHandle_t,
    ncclGinOutboxHandle,
    ncclGinInboxA2AHandle
);
#[repr(transparent)]
pub struct ncclCftLeId(pub u32);

/// Passed by value to `ncclGetMultimemDevicePointer` (nccl_device/impl/core__types.h).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ncclMultimemHandle {
    pub mcBasePtr: *mut c_void,
}

impl TryFrom<ncclDataType_t> for DataType {
    type Error = Error;
    fn try_from(v: ncclDataType_t) -> Result<DataType> {
        DataType::from_raw(v.0).ok_or_else(|| Error::invalid_arg(format!("invalid datatype {}", v.0)))
    }
}

impl ncclRedOp_t {
    /// A built-in op, or None for a value in the user-defined range (`>= ncclNumOps`).
    pub fn builtin(self) -> Option<BuiltinOp> {
        BuiltinOp::from_raw(self.0)
    }
}

#[cfg(test)]
mod layout_tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    /// Offsets of NVIDIA's 2.32.3 ncclCommProperties_t (x86-64 and aarch64 Linux), which no
    /// header of ours declares and the C layout check therefore cannot compare.
    #[test]
    fn comm_properties_has_nvidias_layout() {
        assert_eq!(size_of::<ncclCommProperties_t>(), 152);
        let at = [
            (offset_of!(ncclCommProperties_t, rank), 16),
            (offset_of!(ncclCommProperties_t, deviceApiSupport), 32),
            (offset_of!(ncclCommProperties_t, ginType), 36),
            (offset_of!(ncclCommProperties_t, hostRmaSupport), 44),
            (offset_of!(ncclCommProperties_t, railedGinType), 48),
            (offset_of!(ncclCommProperties_t, commHash), 56),
            (offset_of!(ncclCommProperties_t, ginConnectionType), 68),
            (offset_of!(ncclCommProperties_t, ginSupport), 72),
            (offset_of!(ncclCommProperties_t, devCommRuntimeVersionSize), 136),
            (offset_of!(ncclCommProperties_t, cftCountedSupport), 146),
        ];
        for (i, (got, want)) in at.iter().enumerate() {
            assert_eq!(got, want, "field {i}");
        }
    }
}
