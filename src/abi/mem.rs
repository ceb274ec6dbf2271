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
        let comm = handle::get(comm)?;
        ensure!(!win.is_null(), Error::invalid_arg("win is NULL"));
        // SAFETY: a window's buffer is, by NCCL's contract, `size` bytes of memory the library
        // may read and write until the window is deregistered.
        let buff = unsafe { crate::device::host::UserPtr::new(buff) };
        let token = crate::api::mem::window_register(&comm, buff, size, winFlags)?;
        write_out(win, "win", token as ncclWindow_t)
    }
    fn ncclCommWindowDeregister(comm: ncclComm_t, win: ncclWindow_t) {
        crate::api::mem::window_deregister(&*handle::get(comm)?, win as usize)
    }
    fn ncclWinGetUserPtr(comm: ncclComm_t, win: ncclWindow_t, outUserPtr: *mut *mut c_void) {
        let comm = handle::get(comm)?;
        ensure!(!outUserPtr.is_null(), Error::invalid_arg("outUserPtr is NULL"));
        let p = crate::api::mem::window_user_ptr(&comm, win as usize)?;
        write_out(outUserPtr, "outUserPtr", p as *mut c_void)
    }
}
