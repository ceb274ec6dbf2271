//! The C spelling of each Rust type used at the boundary, so the signature of every export can
//! be printed and compared with the prototypes in `include/nccl.h` (the drift test).

#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_uint, c_void};

use super::types::*;

pub trait CType {
    const C: &'static str;
}

/// One export's signature: name, return type and (parameter name, C type) pairs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sig {
    pub name: &'static str,
    pub ret: &'static str,
    pub args: Vec<(&'static str, &'static str)>,
}

macro_rules! ctypes {
    ($($t:ty => $c:expr),* $(,)?) => {$(
        impl CType for $t { const C: &'static str = $c; }
    )*};
}

ctypes! {
    () => "void",
    c_int => "int",
    c_uint => "unsigned int",
    usize => "size_t",
    i8 => "int8_t", i16 => "int16_t", i64 => "int64_t",
    u8 => "uint8_t", u16 => "uint16_t", u64 => "uint64_t",
    *mut c_void => "void*",
    *const c_void => "const void*",
    *mut *mut c_void => "void**",
    *const c_char => "const char*",
    *mut *const c_char => "const char**",
    *mut *mut *const c_char => "const char***",
    *mut c_int => "int*",
    *const c_int => "const int*",
    *mut i8 => "int8_t*", *mut i16 => "int16_t*", *mut i64 => "int64_t*",
    *mut int32_t => "int32_t*",
    *mut u8 => "uint8_t*", *mut u16 => "uint16_t*", *mut u32 => "uint32_t*", *mut u64 => "uint64_t*",
    *mut usize => "size_t*",
    ncclResult_t => "ncclResult_t",
    *mut ncclResult_t => "ncclResult_t*",
    ncclDataType_t => "ncclDataType_t",
    ncclRedOp_t => "ncclRedOp_t",
    *mut ncclRedOp_t => "ncclRedOp_t*",
    ncclScalarResidence_t => "ncclScalarResidence_t",
    ncclCommMemStat_t => "ncclCommMemStat_t",
    ncclComm_t => "ncclComm_t",
    *mut ncclComm_t => "ncclComm_t*",
    ncclWindow_t => "ncclWindow_t",
    *mut ncclWindow_t => "ncclWindow_t*",
    ncclParamHandle_t => "ncclParamHandle_t",
    *mut ncclParamHandle_t => "ncclParamHandle_t*",
    cudaStream_t => "cudaStream_t",
    ncclUniqueId => "ncclUniqueId",
    *mut ncclUniqueId => "ncclUniqueId*",
    *const ncclUniqueId => "const ncclUniqueId*",
    *mut ncclConfig_t => "ncclConfig_t*",
    *const ncclCollConfig_t => "const ncclCollConfig_t*",
    *mut ncclSimInfo_t => "ncclSimInfo_t*",
    *const ncclEncryptionConfig_t => "const ncclEncryptionConfig_t*",
    *mut ncclWaitSignalDesc_t => "ncclWaitSignalDesc_t*",
    ncclTeam_t => "ncclTeam_t",
    ncclCftTeamMode_t => "ncclCftTeamMode_t",
    *mut ncclCftLeId => "ncclCftLeId*",
    *mut ncclDevComm_t => "ncclDevComm_t*",
    *const ncclDevComm_t => "const ncclDevComm_t*",
    *const ncclDevCommRequirements_t => "const ncclDevCommRequirements_t*",
    *mut ncclDevResourceRequirements_t => "ncclDevResourceRequirements_t*",
    *mut ncclCommProperties_t => "ncclCommProperties_t*",
    ncclMultimemHandle => "ncclMultimemHandle_t",
    *mut ncclLsaBarrierHandle_t => "ncclLsaBarrierHandle_t*",
    *mut ncclGinBarrierHandle_t => "ncclGinBarrierHandle_t*",
    *mut ncclLLA2AHandle_t => "ncclLLA2AHandle_t*",
    *mut ncclGinOutboxHandle => "ncclGinOutboxHandle*",
    *mut ncclGinInboxA2AHandle => "ncclGinInboxA2AHandle*",
}
