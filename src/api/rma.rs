//! One-sided operations (NCCL 2.29+): `ncclPutSignal` writes into a peer's registered window
//! and adds one to a signal there, `ncclSignal` adds one without data, `ncclWaitSignal` waits
//! until enough signals have come. The target makes no call for a put to land: every rank's
//! bootstrap service hands each peer's one-sided connection (`transport::rma`) to a thread of
//! its own that writes puts into the windows and counts signals, per (context, signal index,
//! sender). A wait consumes what it waited for: the next wait for one more signal needs one more.
//!
//! In CUDA mode the calls keep NCCL's stream semantics (`stream`): a put reads its source
//! when the caller's stream gets there, and a wait holds the caller's stream until its
//! signals have come. Within a host the caller's stream writes the target's window itself;
//! otherwise a put's bytes land in a device window through a copy the target's reader makes
//! before it counts the signal.
//!
//! Inside a group, puts and signals are issued at the outermost `ncclGroupEnd` before the
//! group's other operations, and waits after them.

use std::collections::HashMap;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use crate::api::mem::{self, Lookup};
use crate::comm::Comm;
use crate::device::cuda::{MappedHost, Stream, UserStream};
use crate::device::host::{Region, UserPtr};
use crate::error::{Error, Result};
use crate::transport::rma::{self as wire, Frame, OP_PUT, OP_SIGNAL};
use crate::types::DataType;

/// A signal's address at its target: (context, signal index, sending rank).
type SignalKey = (u32, u32, u32);

mod p2p;
mod stream;
mod target;
mod wait;
mod windows;
use wait::wait_for;
pub use p2p::{Message, ANSWER, DATA, RECORD};
pub use windows::{lsa_device_pointer, lsa_teams, peer_device_pointer};

/// One communicator's one-sided state.
pub struct Rma {
    inner: Arc<Inner>,
    /// CUDA mode with stream waits: the sender that issues puts and signals once their
    /// streams get there (None inside: host-wait mode, where calls run on the calling thread).
    gated: OnceLock<Option<Arc<stream::Gated>>>,
    /// Held while the first call starts `gated`.
    starting: Mutex<()>,
    /// CUDA mode: windows of ranks of this host as this rank writes or reads them directly,
    /// by (rank, window ordinal); None: not reachable that way (`windows::peer_window`).
    peer_windows: Mutex<HashMap<(usize, u64), stream::Direct>>,
    /// Mappings of deregistered windows that streams may still copy into (the deregistration
    /// was cut short by an abort): closed with the communicator, or at the next deregistration
    /// that finds the sender idle.
    retired: Mutex<Vec<Arc<crate::transport::rma::PeerWindow>>>,
}

struct Inner {
    /// The communicator (`Comm::serial`, rank): whose windows puts land in.
    comm: (u64, usize),
    /// Its device (CUDA mode) and the shape of its signals (contexts, signals, ranks).
    cuda_dev: i32,
    shape: (u32, u32, usize),
    state: Mutex<State>,
    changed: Condvar,
    closed: AtomicBool,
    /// This rank's connections to its targets, by rank, opened on first use.
    links: Mutex<Vec<Option<TcpStream>>>,
    /// CUDA mode: connections of their own for sends and receives between ranks of one host
    /// (`p2p`), by rank, opened on first use.
    p2p_links: Mutex<Vec<Option<TcpStream>>>,
    /// CUDA mode: the stream puts land in device windows with (made by the first such put).
    landing: Mutex<Option<Stream>>,
    /// The communicator, for the asynchronous errors of waits queued on streams.
    owner: OnceLock<Weak<Comm>>,
}

#[derive(Default)]
struct State {
    arrived: HashMap<SignalKey, u64>,
    consumed: HashMap<SignalKey, u64>,
    /// Copies of the incoming connections, to close them when the communicator goes, by a
    /// number of their own (a connection that ends takes its copy out).
    incoming: Vec<(u64, TcpStream)>,
    accepted: u64,
    /// Senders whose connection ended, and why (None: they closed it, destroying their
    /// communicator).
    ended: HashMap<u32, Option<Error>>,
    /// A put that could not land (a peer's bad call, so ncclRemoteError): every later wait
    /// of this rank fails with it (what it waits for may be what was lost).
    failed: Option<Error>,
    /// CUDA mode: the words streams wait on, one per signal (`Inner::word_of`), each the
    /// count that arrived; made by the first wait queued on a stream, never freed (a stream
    /// may still read it after the communicator is gone).
    words: Option<&'static MappedHost>,
    /// What streams were told to wait for, per signal (`Pending`).
    pending: HashMap<SignalKey, Pending>,
    /// Messages of sends and receives, by (sender, kind, message number), until taken; how
    /// many have come (waits watch it), and senders whose connection for them ended, and why.
    p2p: HashMap<(u32, u32, u64), Message>,
    p2p_arrived: u64,
    p2p_ended: HashMap<u32, String>,
}

/// A signal streams wait for: the highest count they were told to wait for (what is written
/// there to release them when the signals will never come), since when the count has been
/// short of what some wait needs, and whether a warning said so (after [`WARN_AFTER`]; or, at
/// once, that the sender's process is stopped).
#[derive(Clone, Copy, Debug)]
struct Pending {
    want: u64,
    since: Instant,
    warned: bool,
    said_stopped: bool,
}

/// A one-sided call, validated, as a group records it.
#[derive(Clone, Debug)]
pub enum RmaOp {
    Put { peer: usize, frame: Frame, data: Region, stream: UserStream },
    Signal { peer: usize, frame: Frame, stream: UserStream },
    Wait { descs: Vec<WaitDesc>, stream: UserStream },
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

/// Why a sender's connection ended without an error on it: its communicator closed, or its
/// process ended (a killed process says nothing first).
const CLOSED: &str = "it closed its connection (it destroyed or aborted its communicator, or its process ended)";
/// How long a wait goes before it names, at WARN, the signals it waits for.
const WARN_AFTER: Duration = Duration::from_secs(10);
/// How long a wait polls before it sleeps on the condition variable: a signal often follows
/// within microseconds, and being woken from the condition variable costs tens of them.
const SPIN: Duration = Duration::from_micros(100);
/// How often a waiting rank checks that the ranks it waits on are still there.
const PROBE_EVERY: Duration = Duration::from_secs(1);
/// How long a wait goes before it publishes what it waits for (`Published`): a wait that ends
/// sooner, as most do, formats and locks nothing for it; a peer asks only after 1 s of its own.
const PUBLISH_AFTER: Duration = Duration::from_millis(50);

impl Rma {
    /// `shape`: the config's contexts and signals per context.
    pub fn new(serial: u64, rank: usize, nranks: usize, cuda_dev: i32, shape: (u32, u32)) -> Rma {
        Rma {
            inner: Arc::new(Inner {
                comm: (serial, rank),
                cuda_dev,
                shape: (shape.0, shape.1, nranks),
                state: Mutex::new(State::default()),
                changed: Condvar::new(),
                closed: AtomicBool::new(false),
                links: Mutex::new((0..nranks).map(|_| None).collect()),
                p2p_links: Mutex::new((0..nranks).map(|_| None).collect()),
                landing: Mutex::new(None),
                owner: OnceLock::new(),
            }),
            gated: OnceLock::new(),
            starting: Mutex::new(()),
            peer_windows: Mutex::new(HashMap::new()),
            retired: Mutex::new(Vec::new()),
        }
    }

    /// What the bootstrap service calls with each peer's incoming one-sided connection.
    pub fn handler(&self) -> crate::bootstrap::service::RmaHandler {
        let inner = self.inner.clone();
        Box::new(move |from, stream, own_thread| inner.accept(from, stream, own_thread))
    }

    /// The communicator goes (destroy, abort): the puts and signals its streams queued are
    /// sent (unless it was aborted), every connection closed; waits end, streams that wait
    /// for signals are let go.
    pub fn close(&self) {
        if let Some(Some(g)) = self.gated.get() {
            g.close();
        }
        self.inner.closed.store(true, Ordering::Release);
        for links in [&self.inner.links, &self.inner.p2p_links] {
            for s in links.lock().unwrap_or_else(|p| p.into_inner()).iter_mut() {
                if let Some(s) = s.take() {
                    let _ = s.shutdown(Shutdown::Both);
                }
            }
        }
        let mut st = self.inner.lock();
        for (_, s) in st.incoming.drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
        drop(st);
        self.inner.changed.notify_all();
        self.inner.release_waits(|_| true, &Error::invalid_usage(
            "the communicator was destroyed or aborted while a stream waited for signals"));
        let windows: Vec<_> = self.peer_windows.lock().unwrap_or_else(|p| p.into_inner()).drain().collect();
        let retired: Vec<_> = self.retired.lock().unwrap_or_else(|p| p.into_inner()).drain(..).collect();
        if !windows.is_empty() || !retired.is_empty() {
            self.with_context(move || drop((windows, retired)));
        }
    }

    /// `f` (which closes mappings) with the communicator's context current, as the driver
    /// needs for it.
    fn with_context(&self, f: impl FnOnce()) {
        let _keep = crate::device::cuda::KeepCurrent::new();
        if let Ok(ctx) = crate::device::cuda::Context::primary(self.inner.cuda_dev) {
            let _ = ctx.make_current();
        }
        f();
    }

    /// The signal streams of this rank have waited for in ncclWaitSignal for longest, short of
    /// the count for `at_least` or more, from a rank other than this one: (the sender, the
    /// signal in words). What may hold up a call that waits for its stream.
    pub fn oldest_short_stream_wait(&self, at_least: Duration) -> Option<(usize, String)> {
        let st = self.inner.lock();
        let got = |k: &SignalKey| st.arrived.get(k).copied().unwrap_or(0);
        let (k, p) = st.pending.iter()
            .filter(|(k, p)| k.2 as usize != self.inner.comm.1 && got(k) < p.want && p.since.elapsed() >= at_least)
            .min_by_key(|(k, p)| (p.since, **k))?;
        Some((k.2 as usize, format!("signal {} of context {}: {} of {} have come since the communicator's start", k.1,
                                    k.0, got(k), p.want)))
    }

    /// ncclCommWindowDeregister: this rank's mappings of the peers' parts of the window are
    /// closed once no put queued before can still copy into them: the sender has finished the
    /// units issued so far (their streams have got past the copies; this waits for them, but
    /// not past an abort, after which they are closed with the communicator). The pointers
    /// `ncclGetPeerDevicePointer` gave for the window are the caller's to stop using, as in
    /// NCCL.
    pub fn window_deregistered(&self, comm: &Comm, ordinal: u64) {
        let mut windows = self.peer_windows.lock().unwrap_or_else(|p| p.into_inner());
        let keys: Vec<(usize, u64)> = windows.keys().filter(|k| k.1 == ordinal).copied().collect();
        let gone: Vec<_> = keys.iter().filter_map(|k| windows.remove(k).flatten()).collect();
        drop(windows);
        if gone.is_empty() {
            return;
        }
        let idle = self.gated.get().and_then(Option::as_ref).is_none_or(|g| g.wait_idle(comm));
        let mut retired = self.retired.lock().unwrap_or_else(|p| p.into_inner());
        retired.extend(gone);
        if idle {
            let done = std::mem::take(&mut *retired);
            drop(retired);
            self.with_context(move || drop(done));
        }
    }

    /// ncclCommFinalize, ncclCommDestroy (CUDA mode): the puts and signals issued on streams
    /// are sent first, once their streams get there (failing fast on abort).
    pub fn drain(&self) {
        if let Some(Some(g)) = self.gated.get() {
            g.drain();
        }
    }

    /// The communicator is in error (its first asynchronous error, `e`): nothing can be
    /// assumed about the operations it queued (NCCL), so waits for signals end, and streams
    /// that wait for them are let go, rather than wait for ever on signals the failure may
    /// have cut off (the caller learns it from `ncclCommGetAsyncError`, as it must anyway).
    pub fn failed(&self, e: &Error) {
        self.inner.fail_quietly(e);
    }

    /// ncclCommRevoke: streams that wait for signals are let go, with the communicator's
    /// asynchronous error saying so (waits on the host stop by themselves).
    pub fn revoke(&self) {
        self.inner.release_waits(|_| true, &Error::invalid_usage(
            "the communicator was revoked while a stream waited for signals"));
    }
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
    pub stream: UserStream,
}

/// Validate `ncclPutSignal`.
pub fn put(comm: &Comm, a: &PutArgs) -> Result<RmaOp> {
    comm.ready_for_call()?;
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
    Ok(RmaOp::Put { peer, frame, data, stream: a.stream })
}

/// Validate `ncclSignal`.
pub fn signal(comm: &Comm, peer: i32, sig: i32, ctx: i32, flags: u32, stream: UserStream) -> Result<RmaOp> {
    comm.ready_for_call()?;
    let peer = check_peer(comm, peer, "peer")?;
    let (ctx, sig) = check_signal(comm, ctx, sig)?;
    check_flags(flags)?;
    let frame = Frame { op: OP_SIGNAL, ctx, sig, window: 0, offset: 0, len: 0 };
    crate::info!(COLL, "Signal: rank {} -> rank {peer} (signal {sig}, context {ctx})", comm.rank);
    Ok(RmaOp::Signal { peer, frame, stream })
}

/// Validate `ncclWaitSignal`.
pub fn wait(comm: &Comm, descs: Vec<WaitDesc>, stream: UserStream) -> Result<RmaOp> {
    comm.ready_for_call()?;
    for (i, d) in descs.iter().enumerate() {
        check_peer(comm, d.peer, &format!("signalDescs[{i}].peer"))?;
        check_signal(comm, d.ctx, d.sig).map_err(|e| e.context(format!("signalDescs[{i}]")))?;
        if d.op_cnt < 0 {
            return Err(Error::invalid_arg(format!("signalDescs[{i}].opCnt is {}: it counts signals", d.op_cnt)));
        }
    }
    Ok(RmaOp::Wait { descs, stream })
}

/// Issue a validated call now, or record it in the enclosing group.
pub fn enqueue(comm: Arc<Comm>, op: RmaOp) -> Result<()> {
    match crate::group::add_rma(comm, op) {
        None => Ok(()),
        Some((comm, op)) => match crate::group::rma_in_background(&comm, op) {
            Ok(started) => started,
            Err(op) => run(&comm, &op),
        },
    }
}

/// Run one call. Host mode, on this thread: a put or signal is on its way when this returns
/// (the source buffer may be reused); a wait returns once its signals have come (on a
/// nonblocking communicator this runs in the background, after its earlier operations:
/// `group::rma_in_background`). CUDA mode: in the order of the call's stream (`stream`).
pub fn run(comm: &Arc<Comm>, op: &RmaOp) -> Result<()> {
    let ready = comm.ready()?;
    if crate::device::mode::is_cuda() {
        let _ = comm.rma.inner.owner.set(Arc::downgrade(comm));
        return stream::run(comm, op);
    }
    match op {
        RmaOp::Put { peer, frame, data, .. } => deliver(comm, ready, *peer, frame, *data),
        RmaOp::Signal { peer, frame, .. } => deliver(comm, ready, *peer, frame, Region::EMPTY),
        RmaOp::Wait { descs, .. } => wait_for(comm, descs),
    }
}

fn deliver(comm: &Comm, ready: &crate::comm::Ready, peer: usize, frame: &Frame, data: Region) -> Result<()> {
    let inner = &comm.rma.inner;
    let me = comm.rank as u32;
    if peer == comm.rank {
        // To itself: a copy into its own window.
        if frame.op == OP_PUT {
            put_to_self(inner, frame, 0, data)?;
        }
        inner.count((frame.ctx, frame.sig, me));
        return Ok(());
    }
    with_link(comm, ready, peer, |s| wire::send(s, frame, data))
}

/// `write` on this rank's one-sided connection to `peer` (opened on first use); a failed write
/// closes it and names what became of the peer.
fn with_link(comm: &Comm, ready: &crate::comm::Ready, peer: usize, write: impl FnOnce(&mut TcpStream) -> Result<()>)
             -> Result<()> {
    on_connection(comm, ready, &comm.rma.inner.links, peer, ("one-sided operations", "a one-sided operation"), write)
}

/// `write` on this rank's connection to `peer` among `links` (opened on first use, for what
/// `what` names: the connection's use, and one write); a failed write closes it and names what
/// became of the peer.
fn on_connection(comm: &Comm, ready: &crate::comm::Ready, links: &Mutex<Vec<Option<TcpStream>>>, peer: usize,
                 (what, one): (&str, &str), write: impl FnOnce(&mut TcpStream) -> Result<()>) -> Result<()> {
    let me = comm.rank;
    let mut links = links.lock().unwrap_or_else(|p| p.into_inner());
    let link = links.get_mut(peer).ok_or_else(|| Error::internal(format!("no connection slot for rank {peer}")))?;
    if link.is_none() {
        let s = ready.service.connect_rma(peer).map_err(|e| e.context(format!("rank {me}: {what}")))?;
        let _ = s.set_nodelay(true);
        crate::info!(NET, "rank {me} -> rank {peer}: {what} over TCP");
        *link = Some(s);
    }
    let sent = link.as_mut().map_or(Ok(()), write);
    if let Err(e) = sent {
        *link = None;
        drop(links);
        let why = comm.peer_failure(peer).map_or(e.msg, |f| f.msg);
        return Err(Error::remote(format!("rank {me}: {one} to {} failed: {why}", comm.describe_peer(peer))));
    }
    Ok(())
}

/// Part of a put to this rank itself (`data`, `at` bytes into it) copied into its window.
fn put_to_self(inner: &Inner, frame: &Frame, at: usize, data: Region) -> Result<()> {
    let w = own_window(inner, frame)?;
    fits(frame, w.size)?;
    inner.land_bytes(Region::user(w.buff, frame.offset as usize + at, data.len()), data)
}

/// The window of this rank a put of `frame` to itself names.
fn own_window(inner: &Inner, frame: &Frame) -> Result<mem::Window> {
    match mem::window_by_ordinal(inner.comm, frame.window, || false) {
        Lookup::Live(w) => Ok(w),
        _ => Err(Error::invalid_arg(format!("window #{} is not registered", frame.window))),
    }
}

/// Does a put of `frame` fit a window of `size` bytes?
fn fits(frame: &Frame, size: usize) -> Result<()> {
    if frame.offset.checked_add(frame.len).is_none_or(|end| end > size as u64) {
        return Err(Error::invalid_arg(format!(
            "a put of {} bytes at offset {} does not fit the window's {size} bytes", frame.len, frame.offset)));
    }
    Ok(())
}
