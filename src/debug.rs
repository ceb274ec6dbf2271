//! Logging in NCCL's line format, driven by `NCCL_DEBUG`, `NCCL_DEBUG_SUBSYS`,
//! `NCCL_DEBUG_FILE` and NCCL's timestamp variables. Silent by default. Lines look like NCCL's
//! so existing log tooling works (WARN lines carry a timestamp by default, as NCCL's do):
//!
//! ```text
//! host:pid:tid [rank] NCCL INFO Bootstrap: using eth0 10.0.0.1
//! [2026-12-02 04:49:00] host:pid:tid [rank] comm/mod.rs:42 NCCL WARN rank 3: peer rank 5 closed the connection
//! ```
//!
//! Where NCCL shows the CUDA device in `[...]`, nccl-rs shows the communicator's rank (ranks
//! may share a device): on a communicator's own threads, and on a caller's thread from its
//! last call on one.

use std::cell::Cell;
use std::fmt;
use std::fs::File;
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, Ordering};
use std::sync::Mutex;

use crate::abi::fork::{self, PerFork, PerForkMutex};
use crate::params;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[repr(u8)]
pub enum Level {
    None = 0,
    Version = 1,
    Warn = 2,
    Info = 3,
    Trace = 5,
}

/// Subsystem bits, NCCL's names and values.
pub mod subsys {
    pub const INIT: u32 = 0x1;
    pub const COLL: u32 = 0x2;
    pub const P2P: u32 = 0x4;
    pub const SHM: u32 = 0x8;
    pub const NET: u32 = 0x10;
    pub const GRAPH: u32 = 0x20;
    pub const TUNING: u32 = 0x40;
    pub const ENV: u32 = 0x80;
    pub const ALLOC: u32 = 0x100;
    pub const CALL: u32 = 0x200;
    pub const PROXY: u32 = 0x400;
    pub const NVLS: u32 = 0x800;
    pub const BOOTSTRAP: u32 = 0x1000;
    pub const REG: u32 = 0x2000;
    pub const PROFILE: u32 = 0x4000;
    pub const RAS: u32 = 0x8000;
    pub const ALL: u32 = !0;

    pub const NAMES: &[(&str, u32)] = &[
        ("INIT", INIT),
        ("COLL", COLL),
        ("P2P", P2P),
        ("SHM", SHM),
        ("NET", NET),
        ("GRAPH", GRAPH),
        ("TUNING", TUNING),
        ("ENV", ENV),
        ("ALLOC", ALLOC),
        ("CALL", CALL),
        ("PROXY", PROXY),
        ("NVLS", NVLS),
        ("BOOTSTRAP", BOOTSTRAP),
        ("REG", REG),
        ("PROFILE", PROFILE),
        ("RAS", RAS),
        ("ALL", ALL),
    ];
}

static INITIALISED: AtomicBool = AtomicBool::new(false);
static LEVEL: AtomicU8 = AtomicU8::new(0);
static MASK: AtomicU32 = AtomicU32::new(0);
/// NCCL_DEBUG_FILE's file (None: stdout). A forked child opens it again, appending, with its
/// own pid for `%p`: a thread of the parent may have been writing a line at the fork (with
/// NCCL_DEBUG=TRACE, often), so the parent's may not be taken then.
static SINK: PerForkMutex<Option<File>> = PerFork::new(|parents| Mutex::new(parents.and_then(|_| open_sink(true))));
static VERSION_PRINTED: AtomicBool = AtomicBool::new(false);
/// Levels (bit `1 << level`) whose lines start with a timestamp, and its strftime format.
static TS_LEVELS: AtomicU32 = AtomicU32::new(1 << Level::Warn as u8);
static TS_FORMAT: PerForkMutex<String> = PerFork::new(fork::inherit);

/// The file NCCL_DEBUG_FILE names, if logging is on: emptied first (as NCCL's), or appended
/// to (a forked child's, which may be its parent's).
fn open_sink(append: bool) -> Option<File> {
    let level = params::raw("NCCL_DEBUG").map(|v| parse_level(&v)).unwrap_or(Level::None);
    let pattern = params::raw("NCCL_DEBUG_FILE").filter(|_| level > Level::None)?;
    let path = expand_file_name(&pattern, &hostname(), std::process::id());
    // (Not at stdin's number, where a program that reads stdin would read the log.)
    crate::abi::stdio::keep_std_fds_quietly();
    let file = std::fs::OpenOptions::new().create(true).write(true).append(append).truncate(!append).open(path);
    // (Nor at stdout's or stderr's, where the program's own lines would go into the log.)
    file.ok().map(crate::abi::stdio::lifted)
}

thread_local! {
    /// The rank shown in `[...]` on lines this thread writes (-1: none known yet, shown as 0
    /// like NCCL's device index).
    static RANK: Cell<i32> = const { Cell::new(-1) };
    /// This thread's kernel id, and the fork generation it was read in (a forked child's
    /// thread has another id than the thread of the parent it continues).
    static TID: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
}

pub fn parse_level(v: &str) -> Level {
    match v.trim().to_ascii_uppercase().as_str() {
        "VERSION" => Level::Version,
        "WARN" => Level::Warn,
        "INFO" => Level::Info,
        "TRACE" => Level::Trace,
        _ => Level::None,
    }
}

/// A comma list of names, each `bit` of its upper-case name (0: unknown), OR-ed; a leading
/// `^` inverts the whole list (NCCL_DEBUG_SUBSYS and NCCL_DEBUG_TIMESTAMP_LEVELS alike).
fn parse_mask(v: &str, bit: impl Fn(&str) -> u32) -> u32 {
    let (invert, list) = match v.trim().strip_prefix('^') {
        Some(rest) => (true, rest),
        None => (false, v.trim()),
    };
    let mask = list.split(',').map(|s| bit(&s.trim().to_ascii_uppercase())).fold(0, |m, b| m | b);
    if invert {
        !mask
    } else {
        mask
    }
}

/// NCCL_DEBUG_SUBSYS: a comma list; a leading `^` inverts the whole list.
pub fn parse_subsys(v: &str) -> u32 {
    parse_mask(v, |name| subsys::NAMES.iter().find(|(n, _)| *n == name).map_or(0, |(_, b)| *b))
}

/// NCCL_DEBUG_TIMESTAMP_LEVELS: a comma list of levels (VERSION, WARN, INFO, ABORT, TRACE,
/// ALL); a leading `^` inverts it. Bit `1 << level` per level.
pub fn parse_timestamp_levels(v: &str) -> u32 {
    parse_mask(v, |name| match name {
        "VERSION" => 1 << Level::Version as u8,
        "WARN" => 1 << Level::Warn as u8,
        "INFO" => 1 << Level::Info as u8,
        "ABORT" => 1 << 4,
        "TRACE" => 1 << Level::Trace as u8,
        "ALL" => !0,
        _ => 0,
    })
}

/// True for the first caller only: for a line said once per process. (Not `Once`: a child
/// forked while another thread of the parent was inside `call_once`, writing the line, would
/// wait for that thread for ever.)
pub fn first_time(said: &std::sync::atomic::AtomicBool) -> bool {
    !said.load(Ordering::Relaxed) && !said.swap(true, Ordering::Relaxed)
}

/// When logging was first configured (TRACE lines count from it).
fn epoch() -> std::time::Instant {
    static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(std::time::Instant::now)
}

/// The timestamp a line of `level` starts with ("" for none).
fn timestamp(level: Level) -> String {
    if TS_LEVELS.load(Ordering::Relaxed) & (1 << level as u8) == 0 {
        return String::new();
    }
    let format = match TS_FORMAT.lock() {
        Ok(g) => g.clone(),
        Err(p) => p.into_inner().clone(),
    };
    crate::abi::clock::local_strftime(&format, std::time::SystemTime::now())
}

/// `%h` is replaced by the host name and `%p` by the pid, as in NCCL.
pub fn expand_file_name(pattern: &str, host: &str, pid: u32) -> String {
    let mut out = String::new();
    let mut chars = pattern.chars().peekable();
    while let Some(c) = chars.next() {
        match (c, chars.peek()) {
            ('%', Some('h')) => {
                chars.next();
                out.push_str(host);
            }
            ('%', Some('p')) => {
                chars.next();
                out.push_str(&pid.to_string());
            }
            _ => out.push(c),
        }
    }
    out
}

fn init() {
    if INITIALISED.load(Ordering::Acquire) {
        return;
    }
    configure();
}

/// (Re)read the logging variables. Called once lazily, and by `ncclResetDebugInit`.
pub fn configure() {
    let level = params::raw("NCCL_DEBUG").map(|v| parse_level(&v)).unwrap_or(Level::None);
    let mask = parse_subsys(&params::text("NCCL_DEBUG_SUBSYS"));
    let file = open_sink(false);
    if let Ok(mut sink) = SINK.lock() {
        *sink = file;
    }
    TS_LEVELS.store(parse_timestamp_levels(&params::text("NCCL_DEBUG_TIMESTAMP_LEVELS")), Ordering::Relaxed);
    let format = params::raw_even_empty("NCCL_DEBUG_TIMESTAMP_FORMAT")
        .unwrap_or_else(|| params::find("NCCL_DEBUG_TIMESTAMP_FORMAT").map_or("", |p| p.default).to_string());
    match TS_FORMAT.lock() {
        Ok(mut g) => *g = format,
        Err(p) => *p.into_inner() = format,
    }
    epoch();
    if level > Level::None {
        HOST.get_or_init(hostname);
    }
    LEVEL.store(level as u8, Ordering::Relaxed);
    MASK.store(mask, Ordering::Relaxed);
    INITIALISED.store(true, Ordering::Release);
}

pub fn enabled(level: Level, sub: u32) -> bool {
    init();
    let current = LEVEL.load(Ordering::Relaxed);
    if current < level as u8 {
        return false;
    }
    level <= Level::Warn || MASK.load(Ordering::Relaxed) & sub != 0
}

/// Set the rank shown on this thread's log lines; returns the previous one. A communicator's
/// own threads set its rank, so every line about it shows the same one.
pub fn set_rank(rank: i32) -> i32 {
    RANK.with(|r| r.replace(rank))
}

/// The rank shown on this thread's log lines (-1: none yet), for a thread it starts to show.
pub fn shown_rank() -> i32 {
    RANK.with(|r| r.get())
}

pub fn hostname() -> String {
    let full = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_else(|_| "localhost".into());
    // NCCL shows the name up to the first dot.
    full.trim().split('.').next().unwrap_or("localhost").to_string()
}

/// The calling thread's kernel id (as `gettid`), read once per thread (again in a forked
/// child). 0 if it cannot be read (no file descriptor left).
pub(crate) fn tid() -> u64 {
    let generation = crate::abi::fork::generation();
    TID.with(|t| {
        let (id, seen) = t.get();
        if id != 0 && seen == generation {
            return id;
        }
        // /proc/thread-self -> "<pid>/task/<tid>": no unsafe needed for gettid().
        let id = std::fs::read_link("/proc/thread-self")
            .ok()
            .and_then(|p| p.file_name().and_then(|s| s.to_str()).and_then(|s| s.parse().ok()))
            .unwrap_or(0);
        t.set((id, generation));
        id
    })
}

/// This host's name for line prefixes, read once: when logging is configured on (it reads a
/// file, which may fail later, when the process has run out of descriptors), else at the
/// first line.
static HOST: std::sync::OnceLock<String> = std::sync::OnceLock::new();

fn prefix() -> String {
    let host = HOST.get_or_init(hostname);
    let rank = RANK.with(|r| r.get()).max(0);
    format!("{}:{}:{} [{}]", host, std::process::id(), tid(), rank)
}

fn emit(line: &str) {
    let mut guard = match SINK.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    };
    match guard.as_mut() {
        Some(f) => {
            let _ = f.write_all(line.as_bytes());
            let _ = f.flush();
        }
        None => fork::write_stdout(line.as_bytes()),
    }
}

pub fn log(level: Level, sub: u32, file: &str, line: u32, args: fmt::Arguments<'_>) {
    if !enabled(level, sub) {
        return;
    }
    let ts = timestamp(level);
    let text = match level {
        Level::Warn => {
            let short = file.rsplit_once("src/").map(|(_, f)| f).unwrap_or(file);
            format!("{ts}{} {}:{} NCCL WARN {}\n", prefix(), short, line, args)
        }
        // As NCCL: milliseconds since logging started, then where the line comes from.
        Level::Trace => {
            let short = file.rsplit_once("src/").map(|(_, f)| f).unwrap_or(file);
            let ms = epoch().elapsed().as_secs_f64() * 1e3;
            format!("{ts}{} {ms:.6} {}:{} NCCL TRACE {}\n", prefix(), short, line, args)
        }
        _ => format!("{ts}{} NCCL INFO {}\n", prefix(), args),
    };
    emit(&text);
}

/// The "NCCL version" line, once per process, at NCCL_DEBUG=VERSION and above.
pub fn print_version_once() {
    // As NCCL: shown at VERSION and at INFO or above, not at WARN.
    init();
    let level = LEVEL.load(Ordering::Relaxed);
    let wanted = level == Level::Version as u8 || level >= Level::Info as u8;
    if wanted && !VERSION_PRINTED.swap(true, Ordering::Relaxed) {
        emit(&format!(
            "{}{} NCCL INFO NCCL version {}.{}.{}+nccl-rs-{} (source {:016x}, {} mode)\n",
            timestamp(Level::Version),
            prefix(),
            crate::NCCL_MAJOR,
            crate::NCCL_MINOR,
            crate::NCCL_PATCH,
            env!("CARGO_PKG_VERSION"),
            crate::SOURCE,
            crate::device::mode::current().name()
        ));
    }
}

#[macro_export]
macro_rules! warn {
    ($($arg:tt)*) => {
        $crate::debug::log($crate::debug::Level::Warn, $crate::debug::subsys::ALL, file!(), line!(), format_args!($($arg)*))
    };
}

#[macro_export]
macro_rules! info {
    ($sub:ident, $($arg:tt)*) => {
        if $crate::debug::enabled($crate::debug::Level::Info, $crate::debug::subsys::$sub) {
            $crate::debug::log($crate::debug::Level::Info, $crate::debug::subsys::$sub, file!(), line!(), format_args!($($arg)*))
        }
    };
}

#[macro_export]
macro_rules! trace {
    ($sub:ident, $($arg:tt)*) => {
        if $crate::debug::enabled($crate::debug::Level::Trace, $crate::debug::subsys::$sub) {
            $crate::debug::log($crate::debug::Level::Trace, $crate::debug::subsys::$sub, file!(), line!(), format_args!($($arg)*))
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels() {
        assert_eq!(parse_level("info"), Level::Info);
        assert_eq!(parse_level("WARN"), Level::Warn);
        assert_eq!(parse_level("VERSION"), Level::Version);
        assert_eq!(parse_level("TRACE"), Level::Trace);
        assert_eq!(parse_level("bogus"), Level::None);
    }

    #[test]
    fn subsystems() {
        assert_eq!(parse_subsys("INIT,NET"), subsys::INIT | subsys::NET);
        assert_eq!(parse_subsys("^INIT"), !subsys::INIT);
        assert_eq!(parse_subsys("ALL"), !0);
        assert_eq!(parse_subsys("coll"), subsys::COLL);
    }

    #[test]
    fn timestamp_levels() {
        let bit = |l: Level| 1u32 << l as u8;
        assert_eq!(parse_timestamp_levels("WARN"), bit(Level::Warn));
        assert_eq!(parse_timestamp_levels("warn, info"), bit(Level::Warn) | bit(Level::Info));
        assert_eq!(parse_timestamp_levels("^WARN") & bit(Level::Warn), 0);
        assert_ne!(parse_timestamp_levels("^WARN") & bit(Level::Info), 0);
        assert_eq!(parse_timestamp_levels("ALL"), !0);
        assert_eq!(parse_timestamp_levels(""), 0);
    }

    #[test]
    fn file_name_expansion() {
        assert_eq!(expand_file_name("/tmp/nccl.%h.%p.log", "node1", 42), "/tmp/nccl.node1.42.log");
        assert_eq!(expand_file_name("plain%", "h", 1), "plain%");
    }
}
