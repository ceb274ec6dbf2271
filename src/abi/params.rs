//! NCCL's parameter API over our table of `NCCL_*` variables (`crate::params`). Keys are the
//! variable names, with or without the `NCCL_` prefix. Returned strings live in thread-local
//! storage until the next call of the same function on the same thread, as NCCL documents.

use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CString};

use super::types::*;
use super::{read_cstr, write_out};
use crate::error::{Error, Result};
use crate::params::{self, Param};

thread_local! {
    static STR_OUT: RefCell<CString> = RefCell::new(CString::default());
    static PARAM_OUT: RefCell<CString> = RefCell::new(CString::default());
    static KEYS_OUT: RefCell<(Vec<CString>, Vec<*const c_char>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

fn lookup(key: *const c_char) -> Result<&'static Param> {
    let key = read_cstr(key).ok_or_else(|| Error::invalid_arg("key is NULL"))?;
    let full = if key.starts_with("NCCL_") { key.clone() } else { format!("NCCL_{key}") };
    params::find(&full).ok_or_else(|| Error::invalid_arg(format!("unknown parameter '{key}'")))
}

fn from_handle(h: ncclParamHandle_t) -> Result<&'static Param> {
    params::ALL
        .iter()
        .find(|p| std::ptr::eq(*p as *const Param, h as *const Param))
        .ok_or_else(|| Error::invalid_arg("not a parameter handle from ncclParamBind"))
}

fn int_value<T: TryFrom<i64>>(h: ncclParamHandle_t) -> Result<T> {
    let p = from_handle(h)?;
    let text = params::text(p.name);
    let v = params::parse_int(&text)
        .ok_or_else(|| Error::invalid_arg(format!("{} = '{text}' is not an integer", p.name)))?;
    T::try_from(v).map_err(|_| Error::invalid_arg(format!("{} = {v} does not fit the requested type", p.name)))
}

fn stash(slot: &'static std::thread::LocalKey<RefCell<CString>>, text: String) -> *const c_char {
    let c = CString::new(text.replace('\0', "")).unwrap_or_default();
    slot.with(|s| {
        *s.borrow_mut() = c;
        s.borrow().as_ptr()
    })
}

fn visible() -> Vec<&'static Param> {
    // Without NCCL_PARAM_DUMP_ALL NCCL lists only documented parameters; all of ours are.
    params::ALL.iter().collect()
}

export! {
    fn ncclParamBind(out: *mut ncclParamHandle_t, key: *const c_char) {
        let p = lookup(key)?;
        write_out(out, "out", p as *const Param as ncclParamHandle_t)
    }
    fn ncclParamGetI8(h: ncclParamHandle_t, out: *mut i8) { write_out(out, "out", int_value(h)?) }
    fn ncclParamGetI16(h: ncclParamHandle_t, out: *mut i16) { write_out(out, "out", int_value(h)?) }
    fn ncclParamGetI32(h: ncclParamHandle_t, out: *mut int32_t) { write_out(out, "out", int32_t(int_value(h)?)) }
    fn ncclParamGetI64(h: ncclParamHandle_t, out: *mut i64) { write_out(out, "out", int_value(h)?) }
    fn ncclParamGetU8(h: ncclParamHandle_t, out: *mut u8) { write_out(out, "out", int_value(h)?) }
    fn ncclParamGetU16(h: ncclParamHandle_t, out: *mut u16) { write_out(out, "out", int_value(h)?) }
    fn ncclParamGetU32(h: ncclParamHandle_t, out: *mut u32) { write_out(out, "out", int_value(h)?) }
    fn ncclParamGetU64(h: ncclParamHandle_t, out: *mut u64) { write_out(out, "out", int_value(h)?) }
    fn ncclParamGetStr(h: ncclParamHandle_t, out: *mut *const c_char) {
        let p = from_handle(h)?;
        ensure!(!out.is_null(), Error::invalid_arg("out is NULL"));
        write_out(out, "out", stash(&STR_OUT, params::text(p.name)))
    }
    fn ncclParamGet(h: ncclParamHandle_t, out: *mut c_void, maxLen: c_int, len: *mut c_int) {
        let p = from_handle(h)?;
        ensure!(!out.is_null() && !len.is_null(), Error::invalid_arg("out or len is NULL"));
        let mut bytes = params::text(p.name).into_bytes();
        bytes.push(0);
        let n = bytes.len();
        ensure!(n <= usize::try_from(maxLen).unwrap_or(0),
                Error::invalid_arg(format!("{} needs {n} bytes, maxLen is {maxLen}", p.name)));
        // SAFETY: out has maxLen writable bytes by contract, and n <= maxLen.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), out.cast::<u8>(), n) };
        write_out(len, "len", n as c_int)
    }
    fn ncclParamGetParameter(key: *const c_char, value: *mut *const c_char, valueLen: *mut c_int) {
        let p = lookup(key)?;
        ensure!(!value.is_null() && !valueLen.is_null(), Error::invalid_arg("value or valueLen is NULL"));
        let text = params::text(p.name);
        let n = text.len() as c_int;
        write_out(value, "value", stash(&PARAM_OUT, text))?;
        write_out(valueLen, "valueLen", n)
    }
    fn ncclParamGetAllParameterKeys(table: *mut *mut *const c_char, tableLen: *mut c_int) {
        ensure!(!table.is_null() && !tableLen.is_null(), Error::invalid_arg("table or tableLen is NULL"));
        let keys = visible();
        let ptr = KEYS_OUT.with(|k| {
            let mut k = k.borrow_mut();
            k.0 = keys.iter().map(|p| CString::new(p.name).unwrap_or_default()).collect();
            k.1 = k.0.iter().map(|c| c.as_ptr()).collect();
            k.1.as_mut_ptr()
        });
        write_out(table, "table", ptr)?;
        write_out(tableLen, "tableLen", keys.len() as c_int)
    }
    fn ncclParamDumpAll() -> () = (); {
        for p in visible() {
            crate::info!(ENV, "{} = {} ({})", p.name, params::text(p.name), p.doc);
        }
        Ok(())
    }
}
