//! The process's open-file limit. Every connection is a file descriptor, and a job's root holds
//! one per rank until all have come: at a soft limit of 1024 (a common default) a job of about
//! a thousand ranks, or a few hundred ranks in one process, runs out. When a socket call finds
//! no descriptor left (EMFILE), the soft limit is raised to the hard limit, as Go's runtime does
//! for every program at start, and the call is tried again; where it cannot be raised, errors
//! say which limit ran out and how to raise it.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd};
use std::sync::atomic::{AtomicU64, Ordering};

/// How many times the soft limit has been raised (read before a call, so a call that ran out
/// can tell whether room was made since, by it or another thread, without asking the kernel).
static RAISED: AtomicU64 = AtomicU64::new(0);

/// Out of file descriptors: this process's (EMFILE) or the host's (ENFILE).
pub fn out_of_fds(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE) | Some(libc::ENFILE))
}

/// The soft and hard limits on open files. (`rlim_t` is 32 bits on some targets: the casts.)
#[allow(clippy::unnecessary_cast)]
fn limits() -> Option<(u64, u64)> {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one rlimit into `r`, which lives for the call.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) };
    (rc == 0).then_some((r.rlim_cur as u64, r.rlim_max as u64))
}

/// After running out: raise the soft limit to the hard one if it is below it. True when room
/// was made since `before` (what [`RAISED`] said then), whoever made it.
fn make_room(before: u64) -> bool {
    if let Some((soft, hard)) = limits().filter(|(soft, hard)| soft < hard) {
        let r = libc::rlimit { rlim_cur: hard as libc::rlim_t, rlim_max: hard as libc::rlim_t };
        // SAFETY: setrlimit reads one rlimit from `r`, which lives for the call.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &r) } == 0 {
            RAISED.fetch_add(1, Ordering::AcqRel);
            crate::info!(INIT, "out of file descriptors at the open-file limit {soft}: raised it to the hard limit {hard}");
        }
    }
    RAISED.load(Ordering::Acquire) != before
}

/// `f`, tried once more after making room when it ran out of file descriptors.
pub fn with_room<T>(mut f: impl FnMut() -> io::Result<T>) -> io::Result<T> {
    let before = RAISED.load(Ordering::Acquire);
    match f() {
        Err(e) if out_of_fds(&e) && make_room(before) => f(),
        r => r,
    }
}

/// A descriptor the library makes or accepts: [`with_room`], and never at 0, 1 or 2, where a
/// log line or the program's output would go into it (`abi::stdio::lifted`).
pub fn made<T: AsRawFd + IntoRawFd + FromRawFd>(f: impl FnMut() -> io::Result<T>) -> io::Result<T> {
    with_room(f).map(crate::abi::stdio::lifted)
}

/// What to add to a message about `e`: which limit ran out and how to raise it (empty for
/// other errors).
pub fn hint(e: &io::Error) -> String {
    match e.raw_os_error() {
        Some(libc::EMFILE) => match limits() {
            Some((soft, hard)) => format!(
                " (this process has used all {soft} file descriptors its open-file limit allows; the hard limit is \
                 {hard}: raise it, e.g. `ulimit -n` or the container's nofile limit)"),
            None => " (this process is out of file descriptors: raise its open-file limit, `ulimit -n`)".into(),
        },
        Some(libc::ENFILE) => " (the host's table of open files is full: fs.file-max)".into(),
        Some(libc::ENOMEM) => match mappings().map_or_else(String::new, |(used, max)| mappings_hint(used, max)) {
            none if none.is_empty() => address_space_hint(address_space_limit(), address_space_used()),
            named => named,
        },
        _ => String::new(),
    }
}

/// ENOMEM with memory to spare: the process is at its count of mappings. Each ring is one,
/// both ways for every pair of ranks in one process: 256 ranks driven by one process need
/// 65,280, past the usual 65,530 with the rest of the process's.
fn mappings_hint(used: usize, max: usize) -> String {
    if used + 64 < max {
        return String::new();
    }
    format!(" (this process has {used} memory mappings, near vm.max_map_count = {max}: raise it, e.g. \
             `sysctl -w vm.max_map_count={}`, or use fewer communicators or ranks per process)", max.saturating_mul(4))
}

/// ENOMEM under a limit on the process's address space (`ulimit -v`, RLIMIT_AS: set by some
/// batch schedulers), which each ring's mapping counts against: found by a probe at 150 MB,
/// where the message said only "mmap of 4198400 bytes: Cannot allocate memory".
fn address_space_hint(limit: Option<u64>, used: Option<u64>) -> String {
    let Some(limit) = limit else { return String::new() };
    let used = used.map_or(String::new(), |u| format!(", {} MiB of it in use", u >> 20));
    format!(" (this process's address space is limited to {} MiB by `ulimit -v` (RLIMIT_AS){used}: raise the limit, \
             or use fewer communicators or a smaller NCCL_BUFFSIZE)", limit >> 20)
}

/// The soft limit on the process's address space, if it has one.
#[allow(clippy::unnecessary_cast)]
fn address_space_limit() -> Option<u64> {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one rlimit into `r`, which lives for the call.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut r) };
    (rc == 0 && r.rlim_cur != libc::RLIM_INFINITY).then_some(r.rlim_cur as u64)
}

/// The process's address space in use (VmSize), in bytes.
fn address_space_used() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb = status.lines().find_map(|l| l.strip_prefix("VmSize:"))?.trim().strip_suffix("kB")?.trim().parse::<u64>().ok()?;
    Some(kb << 10)
}

/// The number of this process's memory mappings and the most the kernel allows it.
fn mappings() -> Option<(usize, usize)> {
    use std::io::Read;
    let max = std::fs::read_to_string("/proc/sys/vm/max_map_count").ok()?.trim().parse().ok()?;
    let mut maps = Vec::new();
    std::fs::File::open("/proc/self/maps").ok()?.read_to_end(&mut maps).ok()?;
    Some((maps.iter().filter(|&&b| b == b'\n').count(), max))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only EMFILE and ENFILE are a shortage of descriptors, and only they get a hint.
    #[test]
    fn only_running_out_of_descriptors_is_one() {
        let emfile = io::Error::from_raw_os_error(libc::EMFILE);
        assert!(out_of_fds(&emfile) && out_of_fds(&io::Error::from_raw_os_error(libc::ENFILE)));
        assert!(!out_of_fds(&io::Error::from_raw_os_error(libc::ECONNREFUSED)));
        assert!(hint(&emfile).contains("open-file limit"), "{}", hint(&emfile));
        assert_eq!(hint(&io::Error::from_raw_os_error(libc::ECONNREFUSED)), "");
    }

    /// Out of memory at the count of mappings says so; elsewhere, nothing is claimed (this
    /// test process is far from its limit).
    #[test]
    fn out_of_mappings_is_named() {
        assert!(mappings_hint(65_530, 65_530).contains("vm.max_map_count = 65530"), "{}", mappings_hint(65_530, 65_530));
        assert!(mappings_hint(65_500, 65_530).contains("sysctl -w vm.max_map_count=262120"));
        assert_eq!(mappings_hint(1_000, 65_530), "");
        assert!(mappings().is_some_and(|(used, max)| used > 0 && max > used));
        assert_eq!(hint(&io::Error::from_raw_os_error(libc::ENOMEM)), "");
    }

    /// Out of memory under an address-space limit names it and what is in use; without one
    /// (this test process), nothing is claimed.
    #[test]
    fn an_address_space_limit_is_named() {
        let h = address_space_hint(Some(150 << 20), Some(147 << 20));
        assert!(h.contains("limited to 150 MiB by `ulimit -v`") && h.contains("147 MiB of it in use"), "{h}");
        assert_eq!(address_space_hint(None, Some(1 << 30)), "");
        assert!(address_space_used().is_some_and(|u| u > 0));
    }
}
