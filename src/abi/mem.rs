//! Memory allocation and registration.

use std::ffi::{c_int, c_void};

use super::types::*;
use super::write_out;
use crate::comm::handle;
use crate::error::Error;

export! {
    fn ncclMemAlloc(ptr: *mut *mut c_void, size: usize) {
        ensure!(!ptr.is_null(), Error::invalid_arg("ptr is NULL"));
        let p = crate::api::mem::alloc(size)?;
        write_out(ptr, "ptr", p)
    }
    fn ncclMemFree(ptr: *mut c_void) {
        crate::api::mem::free(ptr)
    }
    fn ncclCommRegister(comm: ncclComm_t, buff: *mut c_void, size: usize, handle: *mut *mut c_void) {
        let _comm = handle::get(comm)?;
        ensure!(!handle.is_null(), Error::invalid_arg("handle is NULL"));
        // Host mode has nothing to pin or map: registration only hands back a token to deregister.
        let _ = size;
        write_out(handle, "handle", buff)
    }
    fn ncclCommDeregister(comm: ncclComm_t, handle: *mut c_void) {
        let _ = (handle::get(comm)?, handle);
        Ok(())
    }
    fn ncclCommWindowRegister(comm: ncclComm_t, buff: *mut c_void, size: usize, win: *mut ncclWindow_t,
                              winFlags: c_int) {
        let _ = (handle::get(comm)?, buff, size, win, winFlags);
        Err(Error::not_implemented("ncclCommWindowRegister (symmetric memory windows)"))
    }
    fn ncclCommWindowDeregister(comm: ncclComm_t, win: ncclWindow_t) {
        let _ = (handle::get(comm)?, win);
        Err(Error::not_implemented("ncclCommWindowDeregister (symmetric memory windows)"))
    }
    fn ncclWinGetUserPtr(comm: ncclComm_t, win: ncclWindow_t, outUserPtr: *mut *mut c_void) {
        let _ = (handle::get(comm)?, win, outUserPtr);
        Err(Error::not_implemented("ncclWinGetUserPtr (symmetric memory windows)"))
    }
}
