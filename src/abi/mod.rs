//! The C boundary: every exported function, one file per API family.
//!
//! Each export is written once inside [`export!`], which produces `ncclX` and its profiling
//! alias `pncclX`, catches panics, maps `Result` onto `ncclResult_t` and records the message
//! for `ncclGetLastError` (prefixed with the call's name) and `NCCL_DEBUG=WARN`. Bodies are one
//! call into safe Rust below; raw pointers are turned into checked values here and nowhere else.

#![allow(non_snake_case)]
// The exports take C pointers by design; each dereference is checked and has its SAFETY note.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use std::ffi::{c_char, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::error::{Code, Error, Result};

#[macro_use]
mod export;
pub mod ctype;
pub mod types;

pub(crate) mod clock;
pub mod coll;
pub mod comm;
pub mod device_api;
pub mod fork;
pub mod group;
pub mod mem;
pub mod misc;
pub mod naps;
pub mod params;
pub mod rma;
pub mod stdio;

pub use types::*;

#[cfg(test)]
mod drift;

fn record(call: &str, e: &Error) {
    let text = format!("{call}: {}", e.msg);
    crate::warn!("{text}");
    crate::error::set_last_error(&text);
}

/// The pointer handed to C by `ncclGetLastError`.
pub(crate) fn last_error_ptr() -> *const c_char {
    crate::error::last_error_ptr().cast()
}

pub(crate) fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_string()
    }
}

/// Run a body that returns `Result<()>`; map it onto `ncclResult_t`.
pub(crate) fn boundary(call: &'static str, f: impl FnOnce() -> Result<()>) -> ncclResult_t {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => ncclResult_t(Code::Success as i32),
        Ok(Err(e)) if e.code == Code::InProgress => ncclResult_t(Code::InProgress as i32),
        Ok(Err(e)) => {
            record(call, &e);
            ncclResult_t(e.code as i32)
        }
        Err(p) => {
            let e = Error::internal(format!("internal error (panic: {})", panic_message(&*p)));
            record(call, &e);
            ncclResult_t(Code::InternalError as i32)
        }
    }
}

/// The body of a call that takes part in groups (collectives, point-to-point, init, split,
/// shrink, grow): inside a group, an error of the call itself is also kept for the outermost
/// ncclGroupEnd, which returns it and runs none of the group, as NCCL's does.
pub(crate) fn grouped(f: impl FnOnce() -> Result<()>) -> Result<()> {
    let r = f();
    if let Err(e) = &r {
        if e.code != Code::InProgress {
            crate::group::record_error(e);
        }
    }
    r
}

/// Run a body that returns a value; on error or panic record it and return `fallback`.
pub(crate) fn boundary_value<T>(call: &'static str, fallback: T, f: impl FnOnce() -> Result<T>) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            record(call, &e);
            fallback
        }
        Err(p) => {
            record(call, &Error::internal(format!("internal error (panic: {})", panic_message(&*p))));
            fallback
        }
    }
}

/// Write `value` through a C out-pointer, refusing NULL.
pub(crate) fn write_out<T>(ptr: *mut T, what: &str, value: T) -> Result<()> {
    if ptr.is_null() {
        return Err(Error::invalid_arg(format!("{what} is NULL")));
    }
    // SAFETY: non-NULL and, by the API contract, points to writable storage for a T; written
    // unaligned-tolerant because C callers may pass packed storage.
    unsafe { ptr.write_unaligned(value) };
    Ok(())
}

/// Read a C string argument (NULL allowed: None).
pub(crate) fn read_cstr(ptr: *const c_char) -> Option<String> {
    if ptr.is_null() {
        return None;
    }
    // SAFETY: non-NULL C strings passed to NCCL are NUL-terminated by the API contract.
    Some(unsafe { CStr::from_ptr(ptr) }.to_string_lossy().into_owned())
}

#[cfg(test)]
pub(crate) fn all_signatures() -> Vec<ctype::Sig> {
    let mut v = Vec::new();
    v.extend(coll::signatures());
    v.extend(comm::signatures());
    v.extend(device_api::signatures());
    v.extend(group::signatures());
    v.extend(mem::signatures());
    v.extend(misc::signatures());
    v.extend(params::signatures());
    v.extend(rma::signatures());
    v
}
