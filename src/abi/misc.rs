//! Version, error strings, unique ids, logging reset, encryption.

use std::ffi::{c_char, c_int};

use super::types::*;
use super::write_out;
use crate::error::{Code, Error};

/// NUL-terminated copies of `Code::describe`, so C gets stable pointers.
fn error_string(code: c_int) -> *const c_char {
    let s: &'static [u8] = match Code::from_raw(code) {
        Some(Code::Success) => b"no error\0",
        Some(Code::UnhandledCudaError) => b"unhandled cuda error (run with NCCL_DEBUG=INFO for details)\0",
        Some(Code::SystemError) => b"unhandled system error (run with NCCL_DEBUG=INFO for details)\0",
        Some(Code::InternalError) => b"internal error - please report this issue to the NCCL developers\0",
        Some(Code::InvalidArgument) => b"invalid argument (run with NCCL_DEBUG=WARN for details)\0",
        Some(Code::InvalidUsage) => b"invalid usage (run with NCCL_DEBUG=WARN for details)\0",
        Some(Code::RemoteError) => b"remote process exited or there was a network error\0",
        Some(Code::InProgress) => b"NCCL operation in progress\0",
        Some(Code::Timeout) => b"NCCL operation timed out\0",
        None => b"unknown result code\0",
    };
    debug_assert!(Code::from_raw(code).is_none_or(|c| s.starts_with(c.describe().as_bytes())));
    s.as_ptr().cast()
}

export! {
    fn ncclGetVersion(version: *mut c_int) {
        write_out(version, "version", crate::NCCL_VERSION_CODE)
    }
    fn ncclGetUniqueId(uniqueId: *mut ncclUniqueId) {
        ensure!(!uniqueId.is_null(), Error::invalid_arg("uniqueId is NULL"));
        let bytes = crate::bootstrap::new_unique_id()?;
        write_out(uniqueId, "uniqueId", ncclUniqueId { internal: bytes.map(|b| b as c_char) })
    }
    fn ncclGetErrorString(result: ncclResult_t) -> *const c_char = error_string(-1); {
        Ok(error_string(result.0))
    }
    fn ncclGetLastError(comm: ncclComm_t) -> *const c_char = super::last_error_ptr(); {
        let _ = comm; // NCCL keeps one last error per process, whatever the communicator.
        Ok(super::last_error_ptr())
    }
    fn ncclResetDebugInit() -> () = (); {
        crate::params::reload();
        crate::debug::configure();
        Ok(())
    }
    fn ncclSetEncryption(config: *const ncclEncryptionConfig_t) {
        ensure!(!config.is_null(), Error::invalid_arg("config is NULL"));
        // SAFETY: non-NULL config starts with the common size/magic/version header.
        let (size, magic, mode) = unsafe { ((*config).size, (*config).magic, (*config).mode) };
        crate::api::config::check_header("ncclEncryptionConfig_t", size, magic)?;
        if mode == 0 {
            return Ok(()); // plaintext: what we do anyway
        }
        Err(Error::not_implemented("ncclSetEncryption (PSK encryption of sockets)"))
    }
}

/// NCCL exports this one without a `p` alias; it re-reads the logging environment.
#[no_mangle]
pub extern "C" fn ncclResetDebugInitInternal() {
    super::boundary_value("ncclResetDebugInitInternal", (), || {
        crate::params::reload();
        crate::debug::configure();
        Ok(())
    })
}
