//! Every `NCCL_*` environment variable the library reads, in one table, each with its default
//! and a one-line meaning. The environment is read once (on first use) into a snapshot;
//! nothing else in the crate calls `std::env::var`. `ncclResetDebugInit` re-reads it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use crate::abi::fork::{PerFork, PerForkMutex};

/// One variable: its name, its default as text (empty: unset), and what it does.
pub struct Param {
    pub name: &'static str,
    pub default: &'static str,
    pub doc: &'static str,
}

const fn p(name: &'static str, default: &'static str, doc: &'static str) -> Param {
    Param { name, default, doc }
}

/// The table. Order is the order `ncclParamDumpAll` prints. A static, not a const: the
/// parameter API hands out addresses of its entries as handles, which a const need not keep.
pub static ALL: &[Param] = &[
    p("NCCL_DEBUG", "", "log level: VERSION, WARN, INFO or TRACE; unset is silent"),
    p("NCCL_DEBUG_SUBSYS", "INIT,BOOTSTRAP,ENV", "comma list of subsystems logged at INFO; ^ excludes; ALL"),
    p("NCCL_DEBUG_FILE", "", "write logs to this file instead of stdout; %h is the host, %p the pid"),
    p("NCCL_DEBUG_TIMESTAMP_LEVELS", "WARN", "levels whose lines start with a timestamp: comma list of VERSION, WARN, INFO, ABORT, TRACE, ALL; ^ inverts"),
    p("NCCL_DEBUG_TIMESTAMP_FORMAT", "[%F %T] ", "strftime format of that timestamp (local time, TZ); %Nf: N digits of the second's fraction; _ is a space; empty: none"),
    p("NCCL_COMM_ID", "", "host:port of the bootstrap root; every rank derives the same unique id from it"),
    p("NCCL_SOCKET_IFNAME", "", "interfaces to use: prefixes, ^ to exclude, = for exact names"),
    p("NCCL_SOCKET_FAMILY", "", "AF_INET or AF_INET6 to force an address family"),
    p("NCCL_HOSTID", "", "overrides hostname+boot id as the identity of this host"),
    p("NCCL_SHM_DISABLE", "0", "1: never use shared memory between processes (sockets instead)"),
    p("NCCL_CMA_DISABLE", "0", "1: processes of one host always copy through shared memory, never read each other's buffers (CMA)"),
    p("NCCL_P2P_DISABLE", "0", "1: never copy directly between ranks of one process or GPU peers"),
    p("NCCL_RS_DIRECT_P2P", "1", "0: CUDA mode sends/receives between ranks of a host are staged through host memory instead of read from the sender's buffer directly"),
    p("NCCL_RS_HOST_WAIT", "", "1: CUDA mode calls return once their operation is done instead of making the stream wait for it (on nonblocking communicators they return ncclInProgress at once, and the communicator is in progress until then); 0: never; unset: when CUDA_DEVICE_MAX_CONNECTIONS is below 8"),
    p("NCCL_RS_STREAM_GATE", "memop", "CUDA mode: how a caller's stream waits for its operation (and ncclWaitSignal for its signals): memop (cuStreamWaitValue32) or kernel (a one-thread polling kernel, which stalls no hardware queue other streams share)"),
    p("NCCL_RS_CALLER_STAGING", "1", "CUDA mode: 0 makes the stream worker stage every operation on its own stream, instead of the caller's stream copying small operations through a pinned pool at call time"),
    p("NCCL_RS_DIRECT_MIN", "65536", "CUDA mode: bytes (count x datatype size) from which collectives between ranks of one host read each other's device buffers directly; smaller ones are staged through host memory (must be alike on every rank)"),
    p("NCCL_RS_PEER_MAPS", "256", "CUDA mode: peer allocations a stream worker keeps mapped for the direct path (least recently used closed first); a mapping keeps the peer's allocation alive after the peer frees it, so 0 closes them after each operation (for jobs close to their GPU memory limit)"),
    p("NCCL_RS_POOL_MAX", "67108864", "CUDA mode: bytes a communicator's pinned staging pool may grow to (at least 4 MiB); a staged operation whose input and output need more is staged by the stream worker on its own stream"),
    p("NCCL_RS_INPLACE_SCRATCH", "67108864", "CUDA mode: bytes of device memory a communicator allocates at a time (up to NCCL_RS_INPLACE_SCRATCH_MAX), the first at its first in-place exchange (ncclSend and ncclRecv of one buffer in a group, between ranks of one host), direct in-place all-to-all, or send or direct collective on memory without CUDA IPC (pinned or managed host memory, a stream-ordered allocator's pools), to copy their inputs into in stream order so that peers read those directly (an all-reduce's output too, copied back after); with 0 (or no room) such sends send their bytes over the pair's connection and such collectives are staged"),
    p("NCCL_RS_INPLACE_SCRATCH_MAX", "268435456", "CUDA mode: bytes of device memory a communicator's copies of buffers peers cannot read may take in all (NCCL_RS_INPLACE_SCRATCH at a time, more while earlier ones are busy, or one operation's size); an operation that needs more is staged (said at WARN)"),
    p("NCCL_RS_GRAPH_CAPTURE", "0", "CUDA mode: 1 records collectives issued on a capturing stream into the CUDA graph, staged through pinned memory of their own (experimental: not yet run on a GPU); 0 refuses them with ncclInvalidUsage"),
    p("NCCL_RS_DIRECT_ON_STREAM", "1", "CUDA mode: 0 runs the direct path's device work on the stream worker's stream, instead of kernels the caller's stream queues at call time"),
    p("NCCL_P2P_LEVEL", "", "CUDA mode: the farthest two GPUs of one host may be for ranks on them to read each other's device memory directly: LOC (never), NVL (the same GPU, or GPUs joined by NVLink or both on NVSwitches, as NVML says), PIX, PXB, PHB, SYS (PCI distance from sysfs; NVLink pairs are NVL), or NCCL's legacy 0-4; unset: wherever CUDA IPC works"),
    p("NCCL_RS_TOPO_SYSFS", "/sys", "where NCCL_P2P_LEVEL's PCI distances are read (a sysfs tree; for tests)"),
    p("NCCL_CHECK_POINTERS", "0", "CUDA mode: 1 checks every call's buffers, as NCCL does: plain host memory (which nccl-rs otherwise stages) and device memory of a device other than the communicator's fail the call with ncclInvalidArgument"),
    p("NCCL_ALGO", "", "all-reduce algorithms allowed, as NCCL spells them: Ring, Tree (also NVLS, PAT, CollNet*: our recursive doubling), ^ to exclude, allreduce:LIST;... per collective; unset, or both allowed, chooses by size"),
    p("NCCL_BUFFSIZE", "4194304", "bytes of staging buffer per connection to a peer"),
    p("NCCL_COMM_BLOCKING", "", "0: communicators are nonblocking unless their config says otherwise"),
    p("NCCL_SOCKET_NTHREADS", "1", "socket transport: groups of sockets per peer (nccl-rs drives them all from one thread)"),
    p("NCCL_NSOCKS_PERTHREAD", "1", "socket transport: sockets per group; messages are spread over all sockets of a peer"),
    p("NCCL_INIT_TIMEOUT_S", "", "seconds a rank waits for the others (init, split, shrink, grow, the first connection to a peer) before failing with ncclTimeout; unset: as long as it takes, as NCCL (the ranks waited for are named at WARN after 10 s; ncclCommAbort ends the wait)"),
    p("NCCL_PEER_TIMEOUT_S", "30", "seconds without any sign of life from a peer before it is declared lost"),
    p("NCCL_PARAM_DUMP_ALL", "0", "1: ncclParamGetAllParameterKeys and ncclParamDumpAll list every parameter"),
];

struct Snapshot {
    values: HashMap<&'static str, String>,
}

/// A forked child keeps its parent's values, as NCCL's children do; it reads the environment
/// again only if a thread of the parent was replacing them at the fork.
static SLOT: PerFork<RwLock<Arc<Snapshot>>> = PerFork::new(|parents| {
    let kept = parents.and_then(|lock| lock.try_read().ok().map(|s| Arc::clone(&s)));
    RwLock::new(kept.unwrap_or_else(|| Arc::new(read_env())))
});

fn slot() -> &'static RwLock<Arc<Snapshot>> {
    SLOT.get()
}

fn read_env() -> Snapshot {
    let values = ALL
        .iter()
        .filter_map(|p| std::env::var(p.name).ok().map(|v| (p.name, v)))
        .collect();
    Snapshot { values }
}

fn snapshot() -> Arc<Snapshot> {
    match slot().read() {
        Ok(g) => g.clone(),
        Err(poisoned) => poisoned.into_inner().clone(),
    }
}

/// Re-read the environment (NCCL's `ncclResetDebugInit`).
pub fn reload() {
    let fresh = Arc::new(read_env());
    match slot().write() {
        Ok(mut g) => *g = fresh,
        Err(poisoned) => *poisoned.into_inner() = fresh,
    }
    READS.fetch_add(1, Ordering::AcqRel);
}

/// How many times the environment has been read ([`Kept`] values of an older reading are
/// worked out again).
static READS: AtomicU64 = AtomicU64::new(1);

/// A value worked out from the environment that every call asks for, kept until the
/// environment is read again: two atomic loads, where a lookup takes a lock, a hash, a copy of
/// the text and a search of [`ALL`] (on an 8-byte all-reduce, about a tenth of its time, found
/// by profiling: `NCCL_CHECK_POINTERS` on every call).
pub struct Kept {
    read: AtomicU64,
    value: AtomicI64,
}

impl Default for Kept {
    fn default() -> Kept {
        Kept::new()
    }
}

impl Kept {
    pub const fn new() -> Kept {
        Kept { read: AtomicU64::new(0), value: AtomicI64::new(0) }
    }

    /// The kept value, or `work()`'s, kept, if the environment was read since.
    pub fn get(&self, work: impl FnOnce() -> i64) -> i64 {
        let now = READS.load(Ordering::Acquire);
        if self.read.load(Ordering::Acquire) == now {
            return self.value.load(Ordering::Relaxed);
        }
        let v = work();
        self.value.store(v, Ordering::Relaxed);
        self.read.store(now, Ordering::Release);
        v
    }
}

/// [`int`] of a variable read on every call, kept in `cell`.
fn kept_int(cell: &Kept, name: &str) -> i64 {
    cell.get(|| int(name))
}

/// Once per process, at its first communicator (INFO, subsystem ENV): each `NCCL_*` variable
/// set, as NCCL says it ("NCCL_X set by environment to V"), and among them those nccl-rs does
/// not read (a setting meant for NVIDIA's library's own machinery, or a typo such as
/// NCCL_DEBGU), so that a setting that changes nothing is no mystery. (Not where the
/// environment is read: the logger reads it too, and may not log from inside that read.)
pub fn report_once() {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !crate::debug::enabled(crate::debug::Level::Info, crate::debug::subsys::ENV) || !crate::debug::first_time(&SAID) {
        return;
    }
    let mut set: Vec<(String, String)> = std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.to_string_lossy().into_owned())))
        .filter(|(k, _)| k.starts_with("NCCL_"))
        .collect();
    set.sort();
    for (k, v) in &set {
        match find(k) {
            Some(_) => crate::info!(ENV, "{k} set by environment to {v}"),
            None => crate::info!(ENV, "{k} is set (to {v}), but nccl-rs does not read it: a variable of NVIDIA's \
                                       library that has no counterpart here, or a misspelt one"),
        }
    }
}

pub fn find(name: &str) -> Option<&'static Param> {
    ALL.iter().find(|p| p.name == name)
}

/// The value set in the environment, if any (an empty value counts as unset).
pub fn raw(name: &str) -> Option<String> {
    debug_assert!(find(name).is_some(), "{name} missing from params::ALL");
    snapshot().values.get(name).filter(|v| !v.is_empty()).cloned()
}

/// The value set in the environment, empty included (for the few variables where "set but
/// empty" means something: an empty NCCL_DEBUG_TIMESTAMP_FORMAT prints no timestamp).
pub fn raw_even_empty(name: &str) -> Option<String> {
    debug_assert!(find(name).is_some(), "{name} missing from params::ALL");
    snapshot().values.get(name).cloned()
}

/// The effective value as text: the environment's, else the default.
pub fn text(name: &str) -> String {
    raw(name).unwrap_or_else(|| find(name).map(|p| p.default.to_string()).unwrap_or_default())
}

/// The effective value as an integer; a malformed value falls back to the default, said once
/// per variable at WARN (NCCL's "Invalid value ... using default").
pub fn int(name: &str) -> i64 {
    let default = find(name).and_then(|p| p.default.parse().ok()).unwrap_or(0);
    match raw(name) {
        None => default,
        Some(v) => parse_int(&v).unwrap_or_else(|| {
            static SAID: PerForkMutex<Vec<String>> = PerFork::new(crate::abi::fork::inherit);
            let mut said = SAID.lock().unwrap_or_else(|p| p.into_inner());
            if !said.iter().any(|n| n == name) {
                said.push(name.to_string());
                crate::warn!("{name}='{v}' is not an integer NCCL reads (decimal or 0x hex, at most 2^63 - 1): \
                              using the default, {default}");
            }
            default
        }),
    }
}

/// Integers as NCCL accepts them: decimal or 0x hex, optional sign.
pub fn parse_int(v: &str) -> Option<i64> {
    let v = v.trim();
    let (neg, digits) = match v.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, v.strip_prefix('+').unwrap_or(v)),
    };
    let n = match digits.strip_prefix("0x").or_else(|| digits.strip_prefix("0X")) {
        Some(hex) => i64::from_str_radix(hex, 16).ok()?,
        None => digits.parse::<i64>().ok()?,
    };
    Some(if neg { -n } else { n })
}

// Typed accessors for the variables the code reads often.

pub fn shm_disable() -> bool {
    int("NCCL_SHM_DISABLE") != 0
}
pub fn cma_disable() -> bool {
    static KEPT: Kept = Kept::new();
    kept_int(&KEPT, "NCCL_CMA_DISABLE") != 0
}
pub fn p2p_disable() -> bool {
    int("NCCL_P2P_DISABLE") != 0
}
/// CUDA mode: the NCCL call waits on the host until its operation is done, instead of making
/// the caller's stream wait for it on the device. `NCCL_RS_HOST_WAIT=1` or `0` decides; unset,
/// it is taken when `CUDA_DEVICE_MAX_CONNECTIONS` is below its default of 8 (Megatron-LM sets 1):
/// with few hardware queues, the streams share them, and a stream waiting for the stream
/// worker could hold up the worker's own copies queued behind it.
pub fn few_device_connections() -> bool {
    static KEPT: Kept = Kept::new();
    KEPT.get(|| few_device_connections_now() as i64) != 0
}
fn few_device_connections_now() -> bool {
    if raw("NCCL_RS_HOST_WAIT").is_some() {
        return int("NCCL_RS_HOST_WAIT") != 0;
    }
    // CUDA's own variable (not an NCCL parameter), read once, as the driver reads it once.
    static CONNECTIONS: std::sync::OnceLock<Option<i64>> = std::sync::OnceLock::new();
    let connections = *CONNECTIONS
        .get_or_init(|| std::env::var("CUDA_DEVICE_MAX_CONNECTIONS").ok().and_then(|v| v.trim().parse::<i64>().ok()));
    connections.is_some_and(|n| n < 8)
}
/// The NVML index of CUDA device `cuda_dev`: NVML numbers GPUs as the machine does, CUDA as
/// `CUDA_VISIBLE_DEVICES` (CUDA's variable, not an NCCL parameter) lists them. Known when that
/// variable is unset or a list of indices; None otherwise (UUIDs, MIG names).
pub fn nvml_index(cuda_dev: i32) -> Option<i32> {
    let Ok(list) = std::env::var("CUDA_VISIBLE_DEVICES") else { return Some(cuda_dev) };
    let picked = usize::try_from(cuda_dev).ok().and_then(|i| list.split(',').nth(i));
    picked.and_then(|v| v.trim().parse::<i32>().ok())
}
/// `NCCL_RS_STREAM_GATE=kernel`: callers' streams wait with a polling kernel, not a stream
/// memory operation.
pub fn stream_gate_kernel() -> bool {
    static KEPT: Kept = Kept::new();
    KEPT.get(|| text("NCCL_RS_STREAM_GATE").trim().eq_ignore_ascii_case("kernel") as i64) != 0
}
/// CUDA mode: callers' streams stage what fits the pinned pool at call time (default on).
pub fn caller_staging() -> bool {
    static KEPT: Kept = Kept::new();
    kept_int(&KEPT, "NCCL_RS_CALLER_STAGING") != 0
}
/// `NCCL_RS_DIRECT_MIN` (default 64 KiB): the smallest collective that goes direct.
pub fn direct_min() -> usize {
    static KEPT: Kept = Kept::new();
    usize::try_from(kept_int(&KEPT, "NCCL_RS_DIRECT_MIN")).unwrap_or(0)
}
/// `NCCL_RS_PEER_MAPS` (default 256): peer allocations a stream worker keeps mapped.
pub fn peer_maps() -> usize {
    static KEPT: Kept = Kept::new();
    usize::try_from(kept_int(&KEPT, "NCCL_RS_PEER_MAPS")).unwrap_or(0)
}
/// `NCCL_RS_POOL_MAX` (default 64 MiB): what a communicator's pinned staging pool may grow to.
pub fn pool_max() -> usize {
    static KEPT: Kept = Kept::new();
    usize::try_from(kept_int(&KEPT, "NCCL_RS_POOL_MAX")).unwrap_or(0)
}
/// `NCCL_RS_INPLACE_SCRATCH` (default 64 MiB): device memory for copies of the buffers peers
/// cannot read directly (`streamed::scratch`).
pub fn inplace_scratch() -> usize {
    static KEPT: Kept = Kept::new();
    usize::try_from(kept_int(&KEPT, "NCCL_RS_INPLACE_SCRATCH")).unwrap_or(0)
}
/// `NCCL_RS_INPLACE_SCRATCH_MAX` (default 256 MiB): what that device memory may grow to.
pub fn inplace_scratch_max() -> usize {
    static KEPT: Kept = Kept::new();
    usize::try_from(kept_int(&KEPT, "NCCL_RS_INPLACE_SCRATCH_MAX")).unwrap_or(0)
}
/// `NCCL_RS_DIRECT_ON_STREAM` (default 1): direct operations' device work is queued on the
/// caller's stream at call time (`streamed::board`).
pub fn direct_on_stream() -> bool {
    static KEPT: Kept = Kept::new();
    kept_int(&KEPT, "NCCL_RS_DIRECT_ON_STREAM") != 0
}
/// `NCCL_RS_GRAPH_CAPTURE=1`: collectives on a capturing stream are recorded into its graph
/// (`streamed::capture`).
pub fn graph_capture() -> bool {
    static KEPT: Kept = Kept::new();
    kept_int(&KEPT, "NCCL_RS_GRAPH_CAPTURE") != 0
}
/// `NCCL_CHECK_POINTERS=1`: every call's buffers are checked (`api::coll::check_pointers`).
pub fn check_pointers() -> bool {
    static KEPT: Kept = Kept::new();
    kept_int(&KEPT, "NCCL_CHECK_POINTERS") != 0
}
/// `NCCL_RS_DIRECT_P2P` (on by default): the direct path for sends and receives (CUDA mode).
pub fn direct_p2p() -> bool {
    static KEPT: Kept = Kept::new();
    kept_int(&KEPT, "NCCL_RS_DIRECT_P2P") != 0
}
/// `NCCL_P2P_LEVEL`: the farthest apart two GPUs may be for the direct path between their
/// ranks (`bootstrap::topo`); None if unset or not a level.
pub fn p2p_level() -> Option<crate::bootstrap::topo::Level> {
    raw("NCCL_P2P_LEVEL").and_then(|v| crate::bootstrap::topo::Level::parse(&v))
}
/// `NCCL_P2P_LEVEL` forbids direct device access between ranks (LOC, or 0).
pub fn p2p_level_forbids() -> bool {
    p2p_level() == Some(crate::bootstrap::topo::Level::Loc)
}
pub fn buffsize() -> usize {
    usize::try_from(int("NCCL_BUFFSIZE")).unwrap_or(1 << 22).clamp(1 << 16, 1 << 30)
}
/// Sockets per peer for the socket transport (NCCL caps the product at 64).
pub fn nsocks() -> usize {
    let t = int("NCCL_SOCKET_NTHREADS").clamp(1, 16) as usize;
    let s = int("NCCL_NSOCKS_PERTHREAD").clamp(1, 64) as usize;
    (t * s).clamp(1, 64)
}

/// The longest timeout honoured (about 31 years): "forever" as a huge number must not
/// overflow the deadlines computed from it.
const MAX_TIMEOUT_S: u64 = 1 << 30;

/// NCCL_INIT_TIMEOUT_S, if set: how long a rank waits for the others. Unset (the default), it
/// waits as NCCL does, as long as it takes: ranks reach a first collective or a split minutes
/// apart in real jobs (a rank preparing data while the others wait at a barrier).
pub fn init_timeout() -> Option<std::time::Duration> {
    let secs = raw("NCCL_INIT_TIMEOUT_S").and_then(|v| parse_int(&v))?;
    Some(std::time::Duration::from_secs(u64::try_from(secs).unwrap_or(1).clamp(1, MAX_TIMEOUT_S)))
}

/// The deadline of a wait for the other ranks started now: NCCL_INIT_TIMEOUT_S away, or too far
/// to come.
pub fn init_deadline() -> std::time::Instant {
    std::time::Instant::now() + init_timeout().unwrap_or(std::time::Duration::from_secs(MAX_TIMEOUT_S))
}

/// How a message names the limit of such a wait.
pub fn init_limit_text() -> String {
    limit_text(init_timeout())
}

/// How a message names a wait of `timeout` (None: NCCL_INIT_TIMEOUT_S unset).
pub fn limit_text(timeout: Option<std::time::Duration>) -> String {
    match timeout {
        Some(t) => format!("up to NCCL_INIT_TIMEOUT_S, {} s", t.as_secs()),
        None => "as long as it takes: NCCL_INIT_TIMEOUT_S is unset".to_string(),
    }
}
pub fn peer_timeout() -> std::time::Duration {
    static KEPT: Kept = Kept::new();
    std::time::Duration::from_secs(u64::try_from(kept_int(&KEPT, "NCCL_PEER_TIMEOUT_S")).unwrap_or(30).clamp(1, MAX_TIMEOUT_S))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kept value is worked out once per reading of the environment (ncclResetDebugInit
    /// reads it again, and the next call works it out again).
    #[test]
    fn kept_values_are_worked_out_once_per_reading() {
        static KEPT: Kept = Kept::new();
        let worked = AtomicI64::new(0);
        let get = || KEPT.get(|| worked.fetch_add(1, Ordering::Relaxed) + 10);
        assert_eq!((get(), get(), worked.load(Ordering::Relaxed)), (10, 10, 1));
        reload();
        assert_eq!((get(), get(), worked.load(Ordering::Relaxed)), (11, 11, 2));
    }

    #[test]
    fn parses_ints_like_nccl() {
        assert_eq!(parse_int("42"), Some(42));
        assert_eq!(parse_int(" -7 "), Some(-7));
        assert_eq!(parse_int("0x10"), Some(16));
        assert_eq!(parse_int("+3"), Some(3));
        assert_eq!(parse_int("ten"), None);
        assert_eq!(parse_int(""), None);
    }

    #[test]
    fn every_param_is_named_nccl_and_unique() {
        let mut names: Vec<_> = ALL.iter().map(|p| p.name).collect();
        assert!(names.iter().all(|n| n.starts_with("NCCL_")));
        names.sort();
        names.dedup();
        assert_eq!(names.len(), ALL.len());
        for p in ALL {
            assert!(!p.doc.is_empty(), "{} has no doc", p.name);
        }
    }

    #[test]
    fn defaults_apply_when_unset() {
        // NCCL_PARAM_DUMP_ALL is never set by the test environment.
        assert_eq!(int("NCCL_PARAM_DUMP_ALL"), 0);
        assert!(buffsize() >= 1 << 16);
    }
}
