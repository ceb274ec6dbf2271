//! Descriptors 0, 1 and 2 kept out of the library's hands.
//!
//! A program started with stdout closed (a daemon, `prog >&-`, a service manager) gives the
//! next descriptor opened the number 1. Were that one of our sockets, every line printed to
//! stdout — NCCL_DEBUG's, the program's own — would go into a peer's stream: found by a probe
//! (3 processes, `NCCL_DEBUG=INFO`, stdout closed), where an all-reduce of ones returned 0 on
//! rank 0 with success, and ranks 1 and 2 were killed by SIGPIPE. NVIDIA's library, which logs
//! to stdout too, has the same exposure.

use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};

/// Descriptors filled but not yet said at INFO (bit `1 << fd`).
static UNSAID: AtomicU8 = AtomicU8::new(0);
/// A descriptor that could not be filled (no /dev/null, no descriptor left), said once at WARN.
static UNFILLED: AtomicU8 = AtomicU8::new(0);
static UNFILLED_SAID: AtomicBool = AtomicBool::new(false);

/// Before a call that makes descriptors (an id, a communicator, a connection): each of 0, 1
/// and 2 that is closed gets `/dev/null`, close-on-exec (a program it starts sees the
/// descriptor closed, as it was), and an INFO line says so. Three `fcntl`s when all are open,
/// which is every time but the first in such a program.
pub fn keep_std_fds() {
    keep_std_fds_quietly();
    let unsaid = UNSAID.swap(0, Ordering::Relaxed);
    for fd in (0..3).filter(|fd| unsaid & (1 << fd) != 0) {
        crate::info!(INIT, "descriptor {fd} ({}) was closed: /dev/null stands in for it, so that no socket \
                            or file of this library takes its number", ["stdin", "stdout", "stderr"][fd]);
    }
    let unfilled = UNFILLED.load(Ordering::Relaxed);
    if unfilled != 0 && crate::debug::first_time(&UNFILLED_SAID) {
        crate::warn!("descriptor {} is closed and /dev/null could not be opened in its place: a socket of \
                      this library may take its number", unfilled.trailing_zeros());
    }
}

/// The same without a line, for the logger itself (which opens NCCL_DEBUG_FILE, and may not
/// log while it does): the next [`keep_std_fds`] says what it did.
pub fn keep_std_fds_quietly() {
    for fd in 0..=2 {
        // SAFETY: F_GETFD reads a descriptor's flags; it touches no memory of ours.
        if unsafe { libc::fcntl(fd, libc::F_GETFD) } != -1
            || std::io::Error::last_os_error().raw_os_error() != Some(libc::EBADF) {
            continue;
        }
        // SAFETY: a NUL-terminated path; /dev/null opened for reading and writing creates nothing.
        let got = unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if got < 0 {
            UNFILLED.store(1 << fd, Ordering::Relaxed);
            return;
        }
        if got != fd {
            // Another thread took the number first: the gap is filled either way.
            // SAFETY: `got` is the descriptor just opened above, owned by nobody else.
            unsafe { libc::close(got) };
            continue;
        }
        UNSAID.fetch_or(1 << fd, Ordering::Relaxed);
    }
}

/// `x` (a socket or file the library just made or received) at a descriptor above 2. The
/// guard above fills 0, 1 and 2 before the library makes descriptors, but another thread's
/// passing descriptor (a file read under /proc) may hold one of those numbers while the guard
/// looks, and free it after: the next socket made or accepted then took number 1, and
/// NCCL_DEBUG's lines went into a peer's stream (found in the suite: 2 processes of 2 ranks
/// each, stdout closed, sockets; the root dropped the garbled connection and the rank died of
/// SIGPIPE at its next line). So a socket at 0, 1 or 2 is moved up, and /dev/null put at its
/// old number. Files too: a ring file at 1 would take log lines into a ring's data, a log file
/// at 1 the program's output.
pub fn lifted<T: AsRawFd + IntoRawFd + FromRawFd>(x: T) -> T {
    let low = x.as_raw_fd();
    if low > 2 {
        return x;
    }
    // SAFETY: F_DUPFD_CLOEXEC duplicates a descriptor `x` owns, at 3 or above.
    let high = unsafe { libc::fcntl(low, libc::F_DUPFD_CLOEXEC, 3) };
    if high < 0 {
        // (No descriptor left: the socket stays where it is.)
        return x;
    }
    // SAFETY: a NUL-terminated path; /dev/null opened for reading and writing creates nothing.
    let null = unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    // The old number: /dev/null in one step (no gap another thread could take), else closed.
    let low = x.into_raw_fd();
    // SAFETY: `low` was `x`'s descriptor, now ours to replace or close; `null` is ours.
    unsafe {
        if null < 0 || libc::dup3(null, low, libc::O_CLOEXEC) < 0 {
            libc::close(low);
        }
        if null >= 0 {
            libc::close(null);
        }
    }
    UNSAID.fetch_or(1 << low, Ordering::Relaxed);
    // SAFETY: `high` was made above and is owned by nothing else.
    unsafe { T::from_raw_fd(high) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A socket or a file at one of 0, 1 and 2 moves above them, with /dev/null in its place.
    /// (Made at 0, stdin, which the test harness does not read.)
    #[test]
    fn a_socket_or_file_at_a_standard_descriptor_is_lifted() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a listener");
        let addr = listener.local_addr().expect("an address");
        // SAFETY: dup2 onto descriptor 0, which this test then owns through `at0`.
        let at0 = unsafe {
            assert_eq!(libc::dup2(listener.as_raw_fd(), 0), 0);
            std::net::TcpListener::from_raw_fd(0)
        };
        drop(listener);
        let lifted = lifted(at0);
        assert!(lifted.as_raw_fd() > 2);
        assert_eq!(lifted.local_addr().expect("still the listener"), addr);
        let zero = std::fs::read_link("/proc/self/fd/0").expect("descriptor 0 is open");
        assert_eq!(zero, std::path::Path::new("/dev/null"));
        std::net::TcpStream::connect(addr).expect("the lifted listener still listens");

        // A file too (a ring file, the log): what is written goes to the file, not to 0.
        let path = std::env::temp_dir().join(format!("nccl-rs-lifted-{}", std::process::id()));
        let file = std::fs::File::create(&path).expect("a file");
        // SAFETY: dup2 onto descriptor 0 again, owned by `at0` below; `file` is closed after.
        let at0 = unsafe {
            assert_eq!(libc::dup2(file.as_raw_fd(), 0), 0);
            std::fs::File::from_raw_fd(0)
        };
        drop(file);
        let mut high = super::lifted(at0);
        assert!(high.as_raw_fd() > 2);
        std::io::Write::write_all(&mut high, b"ring").expect("written");
        assert_eq!(std::fs::read(&path).expect("read back"), b"ring");
        assert_eq!(std::fs::read_link("/proc/self/fd/0").expect("0 open"), std::path::Path::new("/dev/null"));
        let _ = std::fs::remove_file(&path);
    }
}
