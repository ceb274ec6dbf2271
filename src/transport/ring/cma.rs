//! Cross-memory attach (Linux `process_vm_readv`/`process_vm_writev`): the single copy between
//! the processes of a ring, straight from the sender's memory or into the receiver's.

use super::pid_alive;
use crate::error::{Error, Result};

/// Which way a cross-memory-attach copy goes.
#[derive(Clone, Copy)]
enum Cma {
    Read,
    Write,
}

/// Copy `len` bytes between our `local` memory and `addr` in process `pid` (Linux
/// cross-memory attach), in as many calls as the kernel needs.
///
/// # Safety
/// `local` is valid for `len` bytes: readable for `Cma::Write`, writable and ours alone for
/// `Cma::Read`.
unsafe fn cma(dir: Cma, pid: u32, addr: u64, local: *mut u8, len: usize) -> Result<()> {
    let mut done = 0;
    while done < len {
        // SAFETY: within the caller's `len` bytes.
        let here = libc::iovec { iov_base: unsafe { local.add(done) }.cast(), iov_len: len - done };
        let there = libc::iovec { iov_base: (addr as usize + done) as *mut libc::c_void, iov_len: len - done };
        // SAFETY: `here` is memory the caller vouches for; the kernel validates `there` against
        // the other process and fails cleanly (EFAULT/EPERM/ESRCH) if it is not valid.
        let n = unsafe {
            match dir {
                Cma::Read => libc::process_vm_readv(pid as libc::pid_t, &here, 1, &there, 1, 0),
                Cma::Write => libc::process_vm_writev(pid as libc::pid_t, &here, 1, &there, 1, 0),
            }
        };
        if n <= 0 {
            let e = std::io::Error::last_os_error();
            // A process that is exiting (or a zombie) may answer EFAULT before ESRCH.
            if e.raw_os_error() == Some(libc::ESRCH) || !pid_alive(pid) {
                return Err(Error::remote(format!("peer process {pid} exited")));
            }
            let what = match dir {
                Cma::Read => format!("reading {len} bytes from process {pid}"),
                Cma::Write => format!("writing {len} bytes into process {pid}"),
            };
            return Err(Error::os(what, e));
        }
        done += n as usize;
    }
    Ok(())
}

/// Read `buf.len()` bytes at `addr` in process `pid`.
pub(super) fn cma_read(pid: u32, addr: u64, buf: &mut [u8]) -> Result<()> {
    // SAFETY: `buf` is ours and writable for its length.
    unsafe { cma(Cma::Read, pid, addr, buf.as_mut_ptr(), buf.len()) }
}

/// Write `buf` at `addr` in process `pid`.
pub(super) fn cma_write(pid: u32, addr: u64, buf: &[u8]) -> Result<()> {
    // SAFETY: `buf` is readable for its length, and the kernel only reads it for a write.
    unsafe { cma(Cma::Write, pid, addr, buf.as_ptr() as *mut u8, buf.len()) }
}
