//! One-sided operations (NCCL 2.29+): `ncclPutSignal` writes into a peer's registered window
//! and adds one to a signal there, `ncclSignal` adds one without data, `ncclWaitSignal` waits
//! until enough signals have come. The target makes no call for a put to land: every rank's
//! bootstrap service hands each peer's one-sided connection (`transport::rma`) to a thread of
//! its own that writes puts into the windows and counts signals, per (context, signal index,
//! sender). A wait consumes what it waited for: the next wait for one more signal needs one more.
//!
//! Host mode only for now: in CUDA mode the calls are refused (`ncclInvalidUsage`).
//! Inside a group, puts and signals are issued at the outermost `ncclGroupEnd` before the
//! group's other operations, and waits after them.

use std::collections::HashMap;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::api::mem::{self, Lookup};
use crate::comm::Comm;
use crate::device::host::{self, Region, UserPtr};
use crate::error::{Error, Result};
use crate::transport::rma::{self as wire, Frame, OP_PUT, OP_SIGNAL};
use crate::types::DataType;

/// A signal's address at its target: (context, signal index, sending rank).
type SignalKey = (u32, u32, u32);

/// One communicator's one-sided state.
pub struct Rma {
    inner: Arc<Inner>,
}

struct Inner {
    /// The communicator (hash, rank): whose windows puts land in.
    comm: (u64, usize),
    state: Mutex<State>,
    changed: Condvar,
    closed: AtomicBool,
    /// This rank's connections to its targets, by rank, opened on first use.
    links: Mutex<Vec<Option<TcpStream>>>,
}

#[derive(Default)]
struct State {
    arrived: HashMap<SignalKey, u64>,
    consumed: HashMap<SignalKey, u64>,
    /// Copies of the incoming connections, to close them when the communicator goes.
    incoming: Vec<TcpStream>,
    /// Senders whose connection ended, and why (None: they closed it, destroying their
    /// communicator).
    ended: HashMap<u32, Option<Error>>,
    /// A put that could not land (a peer's bad call, so ncclRemoteError): every later wait
    /// of this rank fails with it (what it waits for may be what was lost).
    failed: Option<Error>,
}

/// A one-sided call, validated, as a group records it.
#[derive(Clone, Debug)]
pub enum RmaOp {
    Put { peer: usize, frame: Frame, data: Region },
    Signal { peer: usize, frame: Frame },
    Wait { descs: Vec<WaitDesc> },
}

impl RmaOp {
    /// Waits run after the group's other operations; puts and signals before them.
    pub fn is_wait(&self) -> bool {
        matches!(self, RmaOp::Wait { .. })
    }
}

/// One entry of `ncclWaitSignal`'s array, as the caller passed it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WaitDesc {
    pub op_cnt: i32,
    pub peer: i32,
    pub sig: i32,
    pub ctx: i32,
}

/// How long a wait goes before it names, at WARN, the signals it waits for.
const WARN_AFTER: Duration = Duration::from_secs(10);
/// How long a wait polls before it sleeps on the condition variable: a signal often follows
/// within microseconds, and being woken from the condition variable costs tens of them.
const SPIN: Duration = Duration::from_micros(100);
/// How often a waiting rank checks that the ranks it waits on are still there.
const PROBE_EVERY: Duration = Duration::from_secs(1);

impl Rma {
    pub fn new(hash: u64, rank: usize, nranks: usize) -> Rma {
        Rma {
            inner: Arc::new(Inner {
                comm: (hash, rank),
                state: Mutex::new(State::default()),
                changed: Condvar::new(),
                closed: AtomicBool::new(false),
                links: Mutex::new((0..nranks).map(|_| None).collect()),
            }),
        }
    }

    /// What the bootstrap service calls with each peer's incoming one-sided connection.
    pub fn handler(&self) -> crate::bootstrap::service::RmaHandler {
        let inner = self.inner.clone();
        Box::new(move |from, stream| inner.accept(from, stream))
    }

    /// The communicator goes (destroy, abort): close every connection; waits end.
    pub fn close(&self) {
        self.inner.closed.store(true, Ordering::Release);
        for s in self.inner.links.lock().unwrap_or_else(|p| p.into_inner()).iter_mut() {
            if let Some(s) = s.take() {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
        let mut st = self.inner.lock();
        for s in st.incoming.drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
        drop(st);
        self.inner.changed.notify_all();
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn accept(self: &Arc<Inner>, from: u32, stream: TcpStream) {
        if self.closed.load(Ordering::Acquire) {
            return;
        }
        if let Ok(copy) = stream.try_clone() {
            self.lock().incoming.push(copy);
        }
        let me = self.clone();
        let spawned = std::thread::Builder::new().name("nccl-rs-rma".into()).spawn(move || {
            let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| me.serve(from, stream)));
            if let Err(p) = served {
                me.fail(Error::internal(format!("one-sided operations from rank {from}: panic: {}",
                                                crate::abi::panic_message(&*p))));
            }
        });
        if let Err(e) = spawned {
            self.fail(Error::os(format!("one-sided operations from rank {from}: spawn a thread"), e));
        }
    }

    /// Read one sender's operations until it closes the connection.
    fn serve(&self, from: u32, mut s: TcpStream) {
        let ended = loop {
            let frame = match wire::next(&mut s) {
                Ok(Some(f)) => f,
                Ok(None) => break None,
                Err(e) => break Some(e),
            };
            if frame.op == OP_PUT {
                if let Err(e) = self.land(from, &frame, &mut s) {
                    // The sender's later writes fail: the connection is closed below.
                    if !self.closed.load(Ordering::Acquire) {
                        self.fail(e);
                    }
                    break None;
                }
            }
            let mut st = self.lock();
            *st.arrived.entry((frame.ctx, frame.sig, from)).or_insert(0) += 1;
            drop(st);
            self.changed.notify_all();
        };
        let _ = s.shutdown(Shutdown::Both);
        if self.closed.load(Ordering::Acquire) {
            return;
        }
        self.lock().ended.insert(from, ended);
        self.changed.notify_all();
    }

    /// Write a put's bytes into the window it names (waiting for this rank to register it).
    fn land(&self, from: u32, f: &Frame, s: &mut TcpStream) -> Result<()> {
        let (hash, rank) = self.comm;
        let started = Instant::now();
        let mut warned = false;
        let lookup = mem::window_by_ordinal((hash, rank), f.window, || {
            if !warned && started.elapsed() >= WARN_AFTER {
                warned = true;
                crate::warn!("rank {rank}: rank {from} puts into window #{} of this rank, which this rank has not \
                              registered (ncclCommWindowRegister is collective: every rank registers each window)",
                             f.window);
            }
            !self.closed.load(Ordering::Acquire)
        });
        let w = match lookup {
            Lookup::Live(w) => w,
            Lookup::Gone => return Err(Error::remote(format!(
                "rank {from} put {} bytes into window #{} of rank {rank}, which rank {rank} has deregistered",
                f.len, f.window))),
            Lookup::NotYet => return Err(Error::invalid_usage("the communicator was closed")),
        };
        let fits = f.offset.checked_add(f.len).is_some_and(|end| end <= w.size as u64);
        if !fits {
            return Err(Error::remote(format!(
                "rank {from} put {} bytes at offset {} into window #{} of rank {rank}, which is {} bytes: ncclPutSignal \
                 must stay inside the target's window", f.len, f.offset, f.window, w.size)));
        }
        wire::receive_into(s, Region::user(w.buff, f.offset as usize, f.len as usize))
            .map_err(|e| e.context(format!("rank {rank}: a put from rank {from}")))
    }

    fn fail(&self, e: Error) {
        crate::warn!("{}", e.msg);
        let mut st = self.lock();
        if st.failed.is_none() {
            st.failed = Some(e);
        }
        drop(st);
        self.changed.notify_all();
    }
}

/// Refuse one-sided calls where they do not run (CUDA mode).
fn host_mode_only(call: &str) -> Result<()> {
    if matches!(crate::device::mode::current(), crate::device::mode::Mode::Cuda { .. }) {
        return Err(Error::not_implemented(&format!("{call} in CUDA mode (one-sided operations run in host mode)")));
    }
    Ok(())
}

fn check_peer(comm: &Comm, peer: i32, what: &str) -> Result<usize> {
    if peer < 0 || peer as usize >= comm.nranks {
        return Err(Error::invalid_arg(format!("{what} {peer} is out of range for {} ranks", comm.nranks)));
    }
    Ok(peer as usize)
}

/// The signal (`ctx`, `sig`) within what the communicator's config provides.
fn check_signal(comm: &Comm, ctx: i32, sig: i32) -> Result<(u32, u32)> {
    let (nctx, nsig) = (comm.config.rma_contexts, comm.config.rma_signals);
    if ctx < 0 || ctx as u32 >= nctx {
        return Err(Error::invalid_arg(format!("context {ctx} is out of range: the communicator has {nctx} (config.numRmaCtx)")));
    }
    if sig < 0 || sig as u32 >= nsig {
        return Err(Error::invalid_arg(format!(
            "signal index {sig} is out of range: the communicator has {nsig} (config.numRmaSig)")));
    }
    Ok((ctx as u32, sig as u32))
}

fn check_flags(flags: u32) -> Result<()> {
    if flags != 0 {
        return Err(Error::invalid_arg(format!("flags {flags:#x}: no flags are defined (pass 0)")));
    }
    Ok(())
}

/// The raw arguments of `ncclPutSignal`.
pub struct PutArgs {
    pub local: UserPtr,
    pub count: usize,
    pub datatype: i32,
    pub peer: i32,
    pub window: usize,
    pub offset: usize,
    pub sig: i32,
    pub ctx: i32,
    pub flags: u32,
}

/// Validate `ncclPutSignal`.
pub fn put(comm: &Comm, a: &PutArgs) -> Result<RmaOp> {
    host_mode_only("ncclPutSignal")?;
    comm.ready()?;
    let dt = DataType::from_raw(a.datatype).ok_or_else(|| Error::invalid_arg(format!("invalid datatype {}", a.datatype)))?;
    let peer = check_peer(comm, a.peer, "peer")?;
    let (ctx, sig) = check_signal(comm, a.ctx, a.sig)?;
    check_flags(a.flags)?;
    if a.window == 0 {
        return Err(Error::invalid_arg("peerWin is NULL"));
    }
    let w = mem::window_of(comm, a.window).map_err(|e| e.context("peerWin"))?;
    let bytes = a.count.checked_mul(dt.size()).ok_or_else(|| Error::invalid_arg(format!("count {} is too large", a.count)))?;
    if bytes > 0 && a.local.is_null() {
        return Err(Error::invalid_arg("localbuff is NULL"));
    }
    let end = a.offset.checked_add(bytes);
    // A symmetric window is the same size on every rank: a put past its end is known here.
    if end.is_none() || (w.symmetric && end.is_some_and(|e| e > w.size)) {
        return Err(Error::invalid_arg(format!(
            "a put of {bytes} bytes at offset {} does not fit the window's {} bytes", a.offset, w.size)));
    }
    let frame = Frame { op: OP_PUT, ctx, sig, window: w.ordinal, offset: a.offset as u64, len: bytes as u64 };
    let data = if bytes == 0 { Region::EMPTY } else { Region::user(a.local, 0, bytes) };
    crate::info!(COLL, "PutSignal: rank {} -> rank {peer}: {bytes} bytes at offset {} of window #{} (signal {sig}, \
                        context {ctx})", comm.rank, a.offset, w.ordinal);
    Ok(RmaOp::Put { peer, frame, data })
}

/// Validate `ncclSignal`.
pub fn signal(comm: &Comm, peer: i32, sig: i32, ctx: i32, flags: u32) -> Result<RmaOp> {
    host_mode_only("ncclSignal")?;
    comm.ready()?;
    let peer = check_peer(comm, peer, "peer")?;
    let (ctx, sig) = check_signal(comm, ctx, sig)?;
    check_flags(flags)?;
    let frame = Frame { op: OP_SIGNAL, ctx, sig, window: 0, offset: 0, len: 0 };
    crate::info!(COLL, "Signal: rank {} -> rank {peer} (signal {sig}, context {ctx})", comm.rank);
    Ok(RmaOp::Signal { peer, frame })
}

/// Validate `ncclWaitSignal`.
pub fn wait(comm: &Comm, descs: Vec<WaitDesc>) -> Result<RmaOp> {
    host_mode_only("ncclWaitSignal")?;
    comm.ready()?;
    for (i, d) in descs.iter().enumerate() {
        check_peer(comm, d.peer, &format!("signalDescs[{i}].peer"))?;
        check_signal(comm, d.ctx, d.sig).map_err(|e| e.context(format!("signalDescs[{i}]")))?;
        if d.op_cnt < 0 {
            return Err(Error::invalid_arg(format!("signalDescs[{i}].opCnt is {}: it counts signals", d.op_cnt)));
        }
    }
    Ok(RmaOp::Wait { descs })
}

/// Issue a validated call now, or record it in the enclosing group.
pub fn enqueue(comm: Arc<Comm>, op: RmaOp) -> Result<()> {
    match crate::group::add_rma(comm, op) {
        None => Ok(()),
        Some((comm, op)) => run(&comm, &op),
    }
}

/// Run one call on this thread: a put or signal is on its way when this returns (the source
/// buffer may be reused); a wait returns once its signals have come.
pub fn run(comm: &Comm, op: &RmaOp) -> Result<()> {
    let ready = comm.ready()?;
    match op {
        RmaOp::Put { peer, frame, data } => deliver(comm, ready, *peer, frame, *data),
        RmaOp::Signal { peer, frame } => deliver(comm, ready, *peer, frame, Region::EMPTY),
        RmaOp::Wait { descs } => wait_for(comm, descs),
    }
}

fn deliver(comm: &Comm, ready: &crate::comm::Ready, peer: usize, frame: &Frame, data: Region) -> Result<()> {
    let inner = &comm.rma.inner;
    let me = comm.rank as u32;
    if peer == comm.rank {
        // To itself: a copy into its own window.
        if frame.op == OP_PUT {
            let w = match mem::window_by_ordinal(inner.comm, frame.window, || false) {
                Lookup::Live(w) => w,
                _ => return Err(Error::invalid_arg(format!("window #{} is not registered", frame.window))),
            };
            if frame.offset + frame.len > w.size as u64 {
                return Err(Error::invalid_arg(format!(
                    "a put of {} bytes at offset {} does not fit the window's {} bytes", frame.len, frame.offset, w.size)));
            }
            host::copy(Region::user(w.buff, frame.offset as usize, data.len()), data);
        }
        *inner.lock().arrived.entry((frame.ctx, frame.sig, me)).or_insert(0) += 1;
        inner.changed.notify_all();
        return Ok(());
    }
    let mut links = inner.links.lock().unwrap_or_else(|p| p.into_inner());
    let link = links.get_mut(peer).ok_or_else(|| Error::internal(format!("no one-sided link slot for rank {peer}")))?;
    if link.is_none() {
        let s = ready.service.connect_rma(peer).map_err(|e| e.context(format!("rank {me}: one-sided operations")))?;
        let _ = s.set_nodelay(true);
        crate::info!(NET, "rank {me} -> rank {peer}: one-sided operations over TCP");
        *link = Some(s);
    }
    let sent = link.as_mut().map_or(Ok(()), |s| wire::send(s, frame, data));
    if let Err(e) = sent {
        *link = None;
        drop(links);
        let why = comm.peer_failure(peer).map_or(e.msg, |f| f.msg);
        return Err(Error::remote(format!("rank {me}: a one-sided operation to {} failed: {why}", comm.describe_peer(peer))));
    }
    Ok(())
}

/// What a wait needs of one signal: the count it must reach (what earlier waits consumed plus
/// what this one asks; a signal named twice asks both counts).
fn wanted_counts(st: &State, descs: &[WaitDesc]) -> Vec<(SignalKey, u64)> {
    let mut want: Vec<(SignalKey, u64)> = Vec::new();
    for d in descs {
        let key = (d.ctx as u32, d.sig as u32, d.peer as u32);
        match want.iter_mut().find(|(k, _)| *k == key) {
            Some((_, n)) => *n += d.op_cnt as u64,
            None => want.push((key, st.consumed.get(&key).copied().unwrap_or(0) + d.op_cnt as u64)),
        }
    }
    want
}

/// A signal still short of its count: (signal, count so far, count wanted).
type Missing = (SignalKey, u64, u64);

/// "1 of 2 signal(s) from rank 3 (signal 0, context 0)": counted from what earlier waits consumed.
fn describe_missing(st: &State, &((ctx, sig, from), got, want): &Missing) -> String {
    let before = st.consumed.get(&(ctx, sig, from)).copied().unwrap_or(0);
    format!("{} of {} signal(s) from rank {from} (signal {sig}, context {ctx})", got.saturating_sub(before), want - before)
}

/// Why a wait cannot end, if it cannot: its communicator was aborted or revoked (as every wait
/// of an operation stops), or a sender it waits on closed its connection.
fn hopeless(comm: &Comm, st: &State, missing: &[Missing]) -> Option<Error> {
    let stopped = if comm.abort.load(Ordering::Acquire) || comm.rma.inner.closed.load(Ordering::Acquire) {
        Some("aborted")
    } else if comm.revoked.load(Ordering::Acquire) {
        Some("revoked")
    } else {
        None
    };
    if let Some(how) = stopped {
        return Some(Error::invalid_usage(format!(
            "rank {}: communicator was {how} while waiting for signals ({} came)", comm.rank,
            describe_missing(st, &missing[0]))));
    }
    let m = missing.iter().find(|m| st.ended.contains_key(&m.0 .2))?;
    let from = m.0 .2;
    let why = match st.ended.get(&from) {
        Some(Some(e)) => e.msg.clone(),
        _ => "it closed its connection (destroyed its communicator)".to_string(),
    };
    Some(Error::remote(format!("rank {}: waiting for signals that {} will not send: {why}; {} came", comm.rank,
                               comm.describe_peer(from as usize), describe_missing(st, m))))
}

/// Is a sender this wait needs gone? Same-host peers whose process exited are; peers of other
/// hosts whose bootstrap service has not answered for NCCL_PEER_TIMEOUT_S (since when: in
/// `unreachable`), as for a first connection. `peers`: (rank, what came from it).
fn gone_sender(comm: &Comm, peers: Vec<(u32, String)>, unreachable: &mut HashMap<u32, Instant>) -> Option<Error> {
    for (p, came) in peers {
        match comm.peer_gone(p as usize) {
            Some((why, certain)) => {
                let since = *unreachable.entry(p).or_insert_with(Instant::now);
                if certain || since.elapsed() >= crate::params::peer_timeout() {
                    return Some(Error::remote(format!(
                        "rank {}: waiting for signals from {}, which is gone: {why}; {came} came", comm.rank,
                        comm.describe_peer(p as usize))));
                }
            }
            None => {
                unreachable.remove(&p);
            }
        }
    }
    None
}

/// Block until every descriptor's signals have come, then consume them.
fn wait_for(comm: &Comm, descs: &[WaitDesc]) -> Result<()> {
    let inner = &comm.rma.inner;
    let mut st = inner.lock();
    let want = wanted_counts(&st, descs);
    let started = Instant::now();
    let mut warned = false;
    let mut probed = started;
    let mut unreachable: HashMap<u32, Instant> = HashMap::new();
    loop {
        if let Some(e) = st.failed.clone() {
            return Err(e);
        }
        let got = |k: &SignalKey| st.arrived.get(k).copied().unwrap_or(0);
        if want.iter().all(|(k, n)| got(k) >= *n) {
            for (k, n) in want {
                st.consumed.insert(k, n);
            }
            return Ok(());
        }
        if started.elapsed() < SPIN {
            drop(st);
            std::thread::yield_now();
            st = inner.lock();
            continue;
        }
        let missing: Vec<Missing> = want.iter().map(|&(k, n)| (k, got(&k), n)).filter(|&(_, g, n)| g < n).collect();
        if let Some(e) = hopeless(comm, &st, &missing) {
            return Err(e);
        }
        let now = Instant::now();
        if now.duration_since(probed) >= PROBE_EVERY {
            probed = now;
            let peers = missing.iter().filter(|m| m.0 .2 as usize != comm.rank)
                .map(|m| (m.0 .2, describe_missing(&st, m))).collect();
            drop(st);
            if let Some(e) = gone_sender(comm, peers, &mut unreachable) {
                return Err(e);
            }
            st = inner.lock();
            continue;
        }
        if !warned && now.duration_since(started) >= WARN_AFTER {
            warned = true;
            let list: Vec<String> = missing.iter().map(|m| describe_missing(&st, m)).collect();
            crate::warn!("rank {}: ncclWaitSignal has waited {} s; so far {} came", comm.rank,
                         WARN_AFTER.as_secs(), list.join(", "));
        }
        st = match inner.changed.wait_timeout(st, Duration::from_millis(100)) {
            Ok((g, _)) => g,
            Err(p) => p.into_inner().0,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A wait asks for what earlier waits consumed plus its own counts, a signal named twice
    /// for both; what is missing is counted from what was consumed.
    #[test]
    fn waits_count_from_what_was_consumed() {
        let mut st = State::default();
        st.consumed.insert((0, 1, 3), 5);
        let d = |op_cnt, peer, sig| WaitDesc { op_cnt, peer, sig, ctx: 0 };
        let want = wanted_counts(&st, &[d(2, 3, 1), d(1, 2, 0), d(4, 3, 1)]);
        assert_eq!(want, vec![((0, 1, 3), 11), ((0, 0, 2), 1)]);
        assert_eq!(describe_missing(&st, &((0, 1, 3), 7, 11)), "2 of 6 signal(s) from rank 3 (signal 1, context 0)");
        assert_eq!(describe_missing(&st, &((0, 0, 2), 0, 1)), "0 of 1 signal(s) from rank 2 (signal 0, context 0)");
    }
}
