//! The communicator: identity (rank, size, device, host), state, abort flag, asynchronous
//! error, the PreMulSum operators it owns, and — once init has completed — its bootstrap
//! service and its connections to peers ([`Ready`]).
//!
//! How a rank tells why it waits lives beside it: the status each rank shows its peers
//! ([`status`]), what a rank waiting on a peer finds out from it ([`diagnose`]), and sends
//! and receives that can never finish ([`cycle`]).

mod caller;
mod cycle;
mod diagnose;
mod elsewhere;
pub mod handle;
mod ready;
mod status;

pub use caller::Held;
pub use cycle::is_deadlock;
pub use diagnose::{PeerRuns, Silence, SILENT_AFTER};
pub use ready::Ready;
pub(crate) use status::status_stamps;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use crate::api::config::Config;
use crate::error::{Code, Error, Result};
use crate::transport::STAMP_BYTES;
use crate::types::{DataType, RedOp};
use diagnose::process_state;
use ready::shown_note;
use status::{failure_bytes, finished_with, status_answer, Answer, STATUS_RUNNING};

/// `f()` until it gives something, every 5 ms for at most `grace`.
fn within<T>(grace: std::time::Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let until = std::time::Instant::now() + grace;
    loop {
        let got = f();
        if got.is_some() || std::time::Instant::now() >= until {
            return got;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// [`Comm::tell_failure`] tells at most this many peers, within this long.
const TELL_NEAREST: usize = 64;
const TELL_WITHIN: std::time::Duration = std::time::Duration::from_millis(500);
/// How long [`Comm::lost_peers`] waits for the news of peers gone after failing.
const TELL_GRACE: std::time::Duration = std::time::Duration::from_millis(100);

/// A PreMulSum operator made by `ncclRedOpCreatePreMulSum`.
#[derive(Clone, Copy, Debug)]
pub enum ScalarSource {
    /// Read when the operator was created (ncclScalarHostImmediate).
    Immediate(crate::types::Scalar),
    /// Read when an operation using it runs (ncclScalarDevice; host memory in host mode).
    Pointer(crate::device::host::UserPtr),
}

#[derive(Clone, Copy, Debug)]
pub struct UserOp {
    pub datatype: DataType,
    pub scalar: ScalarSource,
}

pub struct Comm {
    pub rank: usize,
    pub nranks: usize,
    pub cuda_dev: i32,
    pub config: Config,
    /// Identifies the communicator across ranks (derived from the unique id; with NCCL_COMM_ID
    /// every communicator has the same, as in NCCL).
    pub hash: u64,
    /// Identifies it among this process's communicators (windows are registered under it).
    pub serial: u64,
    ready: OnceLock<Ready>,
    /// `ncclSuccess`, `ncclInProgress` while a nonblocking init or operation runs, or the error.
    async_code: AtomicI32,
    async_error: Mutex<Option<Error>>,
    pub abort: AtomicBool,
    pub suspended: AtomicBool,
    /// ncclCommRevoke: operations fail, management calls (destroy, split, shrink) still work.
    pub revoked: AtomicBool,
    /// Splits, shrinks and grows made from this communicator, counted per set of ranks taking
    /// part (keyed by a hash of the set): numbers them alike on every member, even after a
    /// shrink that some rank, excluded, never called.
    splits: Mutex<HashMap<u64, u64>>,
    pub finalized: AtomicBool,
    /// The thread (kernel id) inside an operation call, or holding this communicator in its
    /// open group; 0 for none (`caller`).
    caller: AtomicU64,
    user_ops: Mutex<HashMap<i32, UserOp>>,
    next_user_op: AtomicI32,
    /// Collectives issued, for messages and fingerprints (and told with the status: a peer
    /// past a rank's collective is not in another call).
    pub seq: Arc<AtomicU64>,
    /// CUDA mode: the worker that runs operations on device memory in stream order.
    pub streamed: OnceLock<Arc<crate::streamed::Streamed>>,
    /// One-sided operations: connections to targets, signals that came.
    pub rma: crate::api::rma::Rma,
    /// Nonblocking communicators: operations on host buffers running on threads of their own.
    pub background: crate::group::background::Background,
    /// CUDA mode: the last caller's stream found to be of this communicator's device.
    stream_ok: AtomicUsize,
    /// The process that made it, and the fork count then (a forked child inherits the handle,
    /// not the communicator: `crate::abi::fork`).
    pid: u32,
    forks: u64,
}

impl Comm {
    pub fn new(rank: usize, nranks: usize, cuda_dev: i32, config: Config, hash: u64) -> Comm {
        let rma_shape = (config.rma_contexts, config.rma_signals);
        static SERIAL: AtomicU64 = AtomicU64::new(1);
        let serial = SERIAL.fetch_add(1, Ordering::Relaxed);
        Comm {
            rank,
            nranks,
            cuda_dev,
            config,
            hash,
            serial,
            ready: OnceLock::new(),
            async_code: AtomicI32::new(Code::InProgress as i32),
            async_error: Mutex::new(None),
            abort: AtomicBool::new(false),
            suspended: AtomicBool::new(false),
            revoked: AtomicBool::new(false),
            splits: Mutex::new(HashMap::new()),
            finalized: AtomicBool::new(false),
            caller: AtomicU64::new(0),
            user_ops: Mutex::new(HashMap::new()),
            next_user_op: AtomicI32::new(crate::types::BuiltinOp::ALL.len() as i32),
            seq: Arc::new(AtomicU64::new(0)),
            streamed: OnceLock::new(),
            rma: crate::api::rma::Rma::new(serial, rank, nranks, cuda_dev, rma_shape),
            background: Default::default(),
            stream_ok: AtomicUsize::new(0),
            pid: std::process::id(),
            forks: crate::abi::fork::generation(),
        }
    }

    /// In a child forked after this communicator was made: the pid of the process that made it.
    pub fn forked_from(&self) -> Option<u32> {
        (crate::abi::fork::generation() != self.forks).then_some(self.pid)
    }

    /// CUDA mode: a call's stream must be of this communicator's device;
    /// a stream of another is refused with `ncclInvalidArgument` (`check_caller_stream`).
    pub fn check_stream(&self, stream: crate::device::cuda::UserStream) -> Result<()> {
        if stream.is_default() || !crate::device::mode::is_cuda() {
            return Ok(());
        }
        crate::device::cuda::check_caller_stream(self.cuda_dev, stream, &self.stream_ok)
    }

    /// Init finished: the communicator can run operations.
    pub fn set_ready(&self, ready: Ready) {
        ready.service.set_rma_handler(self.rma.handler());
        let (running, serial, done, waits, issued) =
            (ready.running.clone(), self.serial, ready.p2p_done.clone(), ready.waits.clone(), self.seq.clone());
        ready.service.set_status(Box::new(move |about| {
            // What this rank finished with the rank asked about, the collectives it issued, what
            // it finished with each it runs sends or receives with now, the rank holding it up
            // (see `Answer`), then its status.
            let status = status_answer(&running, serial);
            let mut with: Vec<usize> = Vec::new();
            if status.first() == Some(&STATUS_RUNNING) {
                for (_, p) in status_stamps(&status).filter_map(|s| crate::plan::ops::p2p_role(&s)) {
                    if !with.contains(&p) {
                        with.push(p);
                    }
                }
            }
            let with: Vec<(usize, (u64, u64))> = with.into_iter().map(|p| (p, finished_with(&done, p))).collect();
            let note = waits.lock().unwrap_or_else(|p| p.into_inner());
            let shown = shown_note(&note, &status);
            Answer { about: finished_with(&done, about as usize), issued: issued.load(Ordering::Relaxed), with,
                     waits: shown.map(|n| (n.rank, n.text.as_bytes())), status: &status }.write()
        }));
        // A rank of another host asks how a peer's process of this host is (`process_state`):
        // its state letter, for the members of this host only.
        let here: Vec<Option<u32>> = match ready.peers.get(self.rank) {
            Some(me) => ready.peers.iter().map(|p| p.same_pids(me).then_some(p.pid)).collect(),
            None => Vec::new(),
        };
        ready.service.set_process_answer(Box::new(move |about| {
            here.get(about as usize).copied().flatten().and_then(process_state).map_or(Vec::new(), |s| vec![s])
        }));
        elsewhere::enlist(self.serial, self.hash, self.rank, self.nranks, &ready.running, &ready.waits);
        let _ = self.ready.set(ready);
        self.async_code.store(Code::Success as i32, Ordering::Release);
    }

    /// Record an error for `ncclCommGetAsyncError` (the first one wins: it is the cause).
    pub fn set_async_error(&self, e: &Error) {
        let mut slot = self.async_error.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            // Errors found in the background (nonblocking init, a failed group) are what
            // ncclGetLastError should show next, as in NCCL. Those of operations the caller's
            // own ncclCommAbort stopped are no news (PyTorch aborts at shutdown): INFO.
            if self.abort.load(Ordering::Acquire) {
                crate::info!(INIT, "rank {}: after ncclCommAbort: {}", self.rank, e.msg);
            } else {
                crate::warn!("{}", e.msg);
            }
            crate::error::set_last_error(&e.msg);
            *slot = Some(e.clone());
            self.async_code.store(e.code as i32, Ordering::Release);
            drop(slot);
            self.rma.failed(e);
        }
    }

    /// This rank fails outside the host transports' own failure path (which does the same):
    /// the failure is published for peers that ask and the connections closed, so peers
    /// waiting on this rank learn it rather than wait; it becomes the asynchronous error.
    pub fn publish_failure(&self, e: &Error) {
        if self.async_code() == Code::Success {
            if let Some(r) = self.ready_if_any() {
                r.set_failed(e);
                r.conns().close_all();
            }
        }
        self.set_async_error(e);
    }

    /// Operations started in the background (`group::background`): `ncclInProgress` until
    /// they are done, unless an error is recorded.
    pub fn set_in_progress(&self) {
        let _ = self.async_code.compare_exchange(Code::Success as i32, Code::InProgress as i32, Ordering::AcqRel,
                                                 Ordering::Acquire);
    }

    /// The background operations are done: `ncclSuccess`, unless an error is recorded.
    pub fn clear_in_progress(&self) {
        let _ = self.async_code.compare_exchange(Code::InProgress as i32, Code::Success as i32, Ordering::AcqRel,
                                                 Ordering::Acquire);
    }

    pub fn async_code(&self) -> Code {
        Code::from_raw(self.async_code.load(Ordering::Acquire)).unwrap_or(Code::InternalError)
    }

    /// `ncclCommGetAsyncError`'s answer. While it is `ncclInProgress` the caller waits for the
    /// library's own threads (a nonblocking communicator's operation, an init or a split); a
    /// caller that asks in a tight loop, as NCCL's documentation shows it (the yield is
    /// optional there), kept the CPU from them where CPUs are shared: a nonblocking 8-byte
    /// all-reduce on 2 processes of 2 cores took 75-160 us (the perf tool spins 1024 times
    /// before it yields), 13-24 us with this. So the answer comes after a yield (a short nap
    /// where this thread's yields hand its CPU to a busy process: `proxy::pause`).
    pub fn polled_code(&self) -> Code {
        let code = self.async_code();
        if code == Code::InProgress {
            crate::proxy::pause();
        }
        code
    }

    pub fn async_error(&self) -> Option<Error> {
        // Fast path for every call: no error recorded means no lock to take.
        if matches!(self.async_code(), Code::Success | Code::InProgress) {
            return None;
        }
        self.async_error.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The initialised part, or why the communicator cannot be used now.
    pub fn ready(&self) -> Result<&Ready> {
        if self.abort.load(Ordering::Acquire) {
            return Err(Error::invalid_usage(format!("rank {}: communicator was destroyed or aborted", self.rank)));
        }
        if self.revoked.load(Ordering::Acquire) {
            return Err(Error::invalid_usage(format!("rank {}: communicator was revoked", self.rank)));
        }
        if let Some(e) = self.async_error() {
            return Err(Error::new(e.code, format!("rank {}: communicator is in error: {}", self.rank, e.msg)));
        }
        if self.suspended.load(Ordering::Acquire) {
            return Err(Error::invalid_usage(format!("rank {}: communicator is suspended (ncclCommResume it)", self.rank)));
        }
        self.ready.get().ok_or_else(|| self.not_ready())
    }

    /// For a new operation (a collective, point-to-point or one-sided call): ready, and not
    /// finalized (ncclCommFinalize flushes what was issued; only ncclCommDestroy may follow).
    pub fn ready_for_call(&self) -> Result<&Ready> {
        if self.finalized.load(Ordering::Acquire) {
            return Err(Error::invalid_usage(format!(
                "rank {}: communicator was finalized (ncclCommFinalize): no operation may follow, only \
                 ncclCommDestroy", self.rank)));
        }
        self.ready()
    }

    /// For split and shrink: allowed on a revoked or failed communicator (that is what
    /// shrinking away dead ranks is for), not on an aborted or uninitialised one.
    pub fn ready_for_management(&self) -> Result<&Ready> {
        if self.abort.load(Ordering::Acquire) {
            return Err(Error::invalid_usage(format!("rank {}: communicator was destroyed or aborted", self.rank)));
        }
        self.ready.get().ok_or_else(|| self.not_ready())
    }

    /// The number of the next split, shrink or grow among the ranks `members` (hashed by the
    /// caller), and a 16-bit tag for its messages on the parent's service that tells it apart
    /// from others with the same number among other members.
    pub fn next_split(&self, members: u64) -> (u64, u32) {
        let mut splits = self.splits.lock().unwrap_or_else(|p| p.into_inner());
        let n = splits.entry(members).or_insert(0);
        let seq = *n;
        *n += 1;
        let tag = crate::bootstrap::id::magic_of(&format!("{members:x}/{seq}")) as u32 & 0xffff;
        (seq, tag)
    }

    /// NCCL's answer to a call on a communicator whose nonblocking init has not finished.
    fn not_ready(&self) -> Error {
        Error::invalid_arg(format!(
            "rank {}: communicator is still initialising (ncclCommGetAsyncError must say ncclSuccess before it is \
             used)", self.rank))
    }

    pub fn ready_if_any(&self) -> Option<&Ready> {
        self.ready.get()
    }

    pub fn add_user_op(&self, op: UserOp) -> Result<i32> {
        let id = self.next_user_op.fetch_add(1, Ordering::Relaxed);
        if id < 0 {
            return Err(Error::internal("too many reduction operators created"));
        }
        self.user_ops.lock().unwrap_or_else(|p| p.into_inner()).insert(id, op);
        Ok(id)
    }

    pub fn user_op(&self, id: i32) -> Option<UserOp> {
        self.user_ops.lock().unwrap_or_else(|p| p.into_inner()).get(&id).copied()
    }

    pub fn remove_user_op(&self, id: i32) -> bool {
        self.user_ops.lock().unwrap_or_else(|p| p.into_inner()).remove(&id).is_some()
    }

    /// Describe a peer for messages: "rank 5 (host-b, pid 4242)".
    pub fn describe_peer(&self, peer: usize) -> String {
        match self.ready.get().and_then(|r| r.peers.get(peer)) {
            Some(p) => format!("rank {} ({}, pid {})", peer, p.hostname, p.pid),
            None => format!("rank {peer}"),
        }
    }

    /// The peers that are gone, with why, to name them when an operation fails: same-host
    /// peers by their pid, others by whether their bootstrap service still answers.
    pub fn lost_peers(&self) -> Vec<(usize, String)> {
        let Some(ready) = self.ready.get() else { return Vec::new() };
        let me = &ready.peers[self.rank];
        let probe = |p: &crate::bootstrap::PeerInfo| Self::gone(ready, me, p).map(|(why, _)| (p.rank, why));
        // Peers of this host are asked here (their pid: no waiting); the others are pinged,
        // by at most PROBERS threads, each taking a share of them (pings wait up to 1 s); a
        // thread that cannot start leaves its share to this one.
        let (here, others): (Vec<_>, Vec<_>) =
            ready.peers.iter().filter(|p| p.rank != self.rank).partition(|p| p.same_pids(me));
        const PROBERS: usize = 32;
        let share = others.len().div_ceil(PROBERS).max(1);
        std::thread::scope(|s| {
            let mut lost = Vec::new();
            let mut probes = Vec::new();
            for chunk in others.chunks(share) {
                let spawned = std::thread::Builder::new()
                    .name("nccl-rs-probe".into())
                    .spawn_scoped(s, move || chunk.iter().filter_map(|p| probe(p)).collect::<Vec<_>>());
                match spawned {
                    Ok(h) => probes.push(h),
                    Err(_) => lost.extend(chunk.iter().filter_map(|p| probe(p))),
                }
            }
            // While the pings wait.
            lost.extend(here.iter().filter_map(|p| probe(p)));
            lost.extend(probes.into_iter().filter_map(|h| h.join().ok()).flatten());
            self.after_failing(ready, lost)
        })
    }

    /// `lost` in order, those that went after failing themselves last and said so: they told
    /// this rank before going ([`Comm::tell_failure`]), or another rank of their process did.
    /// The news of a peer already gone has come, but perhaps not yet been read from the
    /// service's socket: it is waited for a little (this rank is failing: no hurry).
    fn after_failing(&self, ready: &Ready, lost: Vec<(usize, String)>) -> Vec<(usize, String)> {
        let process = |p: usize| ready.peers.get(p).map(|i| (i.host_hash, i.pid_ns, i.pid));
        let failed_processes = || {
            lost.iter().filter(|(p, _)| ready.service.told_failed(*p).is_some()).filter_map(|(p, _)| process(*p))
                .collect::<Vec<_>>()
        };
        let after = |failed: &[_], p: usize| process(p).is_some_and(|k| failed.contains(&k));
        let failed = within(TELL_GRACE, || {
            let failed = failed_processes();
            lost.iter().all(|(p, _)| after(&failed, *p)).then_some(failed)
        })
        .unwrap_or_else(failed_processes);
        let mut lost: Vec<(bool, usize, String)> = lost.into_iter().map(|(p, why)| (after(&failed, p), p, why)).collect();
        lost.sort();
        lost.into_iter().map(|(after, p, why)| (p, if after { format!("{why} after failing itself") } else { why })).collect()
    }

    /// Is `peer` gone, and why: a peer of this host whose process exited (certain), or one of
    /// another host whose bootstrap service refuses connections (certain) or does not answer
    /// within 1 s (certain only once it has gone on for a while: the bool says which).
    pub fn peer_gone(&self, peer: usize) -> Option<(String, bool)> {
        let ready = self.ready.get()?;
        Self::gone(ready, ready.peers.get(self.rank)?, ready.peers.get(peer)?)
    }

    fn gone(ready: &Ready, me: &crate::bootstrap::PeerInfo, p: &crate::bootstrap::PeerInfo) -> Option<(String, bool)> {
        use crate::bootstrap::service::Reach;
        if p.same_pids(me) {
            (!crate::transport::ring::pid_alive(p.pid)).then(|| ("its process exited".to_string(), true))
        } else {
            // Its host refusing the connection is as certain as an exited process here: its
            // communicator, and the service that lives as long, are gone.
            match ready.service.reach(p.rank, std::time::Duration::from_secs(1)) {
                Reach::Answers => None,
                Reach::Refuses(why) => Some((format!("{why}: it destroyed or aborted its communicator, or its process \
                                                      ended"), true)),
                Reach::Silent(why) => Some((why, false)),
            }
        }
    }

    /// The exchange of management call `call` (split, shrink, grow) over this communicator's
    /// bootstrap service: until NCCL_INIT_TIMEOUT_S, stopped by an abort, failed once a
    /// member it waits on is certainly gone.
    pub fn exchange(&self, call: &'static str, tag: u32) -> crate::bootstrap::service::Exchange<'_> {
        crate::bootstrap::service::Exchange { call, tag, deadline: crate::params::init_deadline(), abort: &self.abort,
                                              members: self }
    }

    /// Why `peer` stopped, if it says it failed (used when all this rank saw was a closed
    /// connection).
    pub fn peer_failure(&self, peer: usize) -> Option<Error> {
        self.told_failure(peer).or_else(|| {
            // (Not `peer_runs`: no wait of this rank's to note.)
            self.peer_runs_once(peer, &[0u8; STAMP_BYTES], &|_| String::new(), false).err()
                .filter(|e| e.msg.contains(" failed: "))
        })
    }

    /// [`Comm::told_failure`], waiting [`TELL_GRACE`] for it: a peer that failed told this
    /// rank before it closed its connections, but the news may not have been read yet.
    pub fn told_failure_within(&self, peer: usize) -> Option<Error> {
        within(TELL_GRACE, || self.told_failure(peer))
    }

    /// `peer`'s failure as it told this rank before it went ([`Comm::tell_failure`]).
    fn told_failure(&self, peer: usize) -> Option<Error> {
        let told = self.ready.get()?.service.told_failed(peer)?;
        let (&code, msg) = told.split_first()?;
        Some(self.peer_failed(peer, code, msg))
    }

    /// `peer`'s failure from its [`failure_bytes`]: "rank 3 (host, pid) failed: ...".
    fn peer_failed(&self, peer: usize, code: u8, msg: &[u8]) -> Error {
        let code = Code::from_raw(code as i32).unwrap_or(Code::RemoteError);
        Error::new(code, format!("{} failed: {}", self.describe_peer(peer), String::from_utf8_lossy(msg)))
    }

    /// This rank fails with `e`, having lost a peer: tell the peers nearest it in rank order
    /// (all of them in a communicator of up to [`TELL_NEAREST`]), before its connections close
    /// and its process perhaps exits, so that one that finds it gone knows it went after
    /// failing itself and names the rank lost first as the culprit. Same-host peers take the
    /// news at once; within [`TELL_WITHIN`] in all.
    pub fn tell_failure(&self, e: &Error, lost: &[usize]) {
        let Some(ready) = self.ready.get() else { return };
        let n = self.nranks;
        let mut told = vec![false; n];
        told[self.rank] = true;
        for &p in lost.iter().filter(|&&p| p < n) {
            told[p] = true;
        }
        let mut near = Vec::with_capacity(TELL_NEAREST.min(n));
        for p in (1..=n / 2).flat_map(|d| [(self.rank + d) % n, (self.rank + n - d) % n]) {
            if near.len() == TELL_NEAREST {
                break;
            }
            if !std::mem::replace(&mut told[p], true) {
                near.push(p);
            }
        }
        let asked = near.len();
        if asked == 0 {
            return;
        }
        let why = failure_bytes(e);
        let told = ready.service.tell_failed(near.into_iter(), &why, std::time::Duration::from_millis(100), TELL_WITHIN);
        let others = if told < asked { " (the others are gone or did not answer in time)" } else { "" };
        crate::info!(INIT, "rank {}: told {told} of {asked} peers that this rank failed{others}", self.rank);
    }

    /// Release connections and stop the bootstrap service (destroy/abort).
    pub fn shutdown(&self) {
        if let Some(s) = self.streamed.get() {
            s.close();
        }
        self.rma.close();
        if let Some(r) = self.ready.get() {
            let mut conns = r.conns();
            crate::transport::forget_unaccepted(self.rank, self.hash, &r.peers, &conns);
            conns.close_all();
            drop(conns);
            r.service.stop();
        }
    }
}

impl crate::bootstrap::service::Members for Comm {
    fn gone(&self, peer: usize) -> Option<String> {
        let (why, certain) = self.peer_gone(peer)?;
        certain.then(|| format!("{} is gone ({why})", self.describe_peer(peer)))
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        self.shutdown();
    }
}


/// A reduction resolved for one operation (built-ins, or a PreMulSum with its scalar read).
/// In CUDA mode a scalar in device, pinned or managed memory cannot be read now (the stream
/// may not have written it yet): its address comes back instead, for the stream worker to read
/// in stream order.
pub fn resolve_op(comm: &Comm, raw: i32, dt: DataType) -> Result<(RedOp, Option<crate::device::host::UserPtr>)> {
    if let Some(b) = crate::types::BuiltinOp::from_raw(raw) {
        return Ok((RedOp::Builtin(b), None));
    }
    let op = comm
        .user_op(raw)
        .ok_or_else(|| Error::invalid_arg(format!("invalid reduction operator {raw}")))?;
    if op.datatype != dt {
        return Err(Error::invalid_arg(format!(
            "reduction operator {raw} was created for {} but the operation uses {}",
            op.datatype.name(),
            dt.name()
        )));
    }
    let scalar = match op.scalar {
        ScalarSource::Immediate(s) => s,
        ScalarSource::Pointer(p) => {
            // Memory the stream may still be writing (device, pinned, managed) is read in
            // stream order, when the operation starts; pageable memory now, as in host mode.
            if crate::device::mode::is_cuda() {
                let kind = crate::device::cuda::classify(p.addr())
                    .map_err(|e| e.context(format!("classifying the PreMulSum scalar at {:#x}", p.addr())))?;
                if kind.stream_ordered() {
                    return Ok((RedOp::PreMulSum(crate::types::Scalar { bytes: [0; 8] }), Some(p)));
                }
            }
            crate::device::host::read_scalar(dt, p)?
        }
    };
    Ok((RedOp::PreMulSum(scalar), None))
}

