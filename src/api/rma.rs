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
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

use crate::api::mem::{self, Lookup};
use crate::comm::Comm;
use crate::device::cuda::{MappedHost, Stream, UserStream};
use crate::device::host::{self, Region, UserPtr};
use crate::error::{Error, Result};
use crate::transport::rma::{self as wire, Frame, OP_PUT, OP_SIGNAL};
use crate::types::DataType;

/// A signal's address at its target: (context, signal index, sending rank).
type SignalKey = (u32, u32, u32);

mod p2p;
mod stream;
pub use p2p::{Message, ANSWER, DATA, RECORD};
pub use stream::{lsa_device_pointer, lsa_teams, peer_device_pointer};

/// One communicator's one-sided state.
pub struct Rma {
    inner: Arc<Inner>,
    /// CUDA mode with stream waits: the sender that issues puts and signals once their
    /// streams get there (None inside: host-wait mode, where calls run on the calling thread).
    gated: OnceLock<Option<Arc<stream::Gated>>>,
    /// Held while the first call starts `gated`.
    starting: Mutex<()>,
    /// CUDA mode: windows of ranks of this host as this rank writes or reads them directly,
    /// by (rank, window ordinal); None: not reachable that way (`stream::peer_window`).
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

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `own_thread`: the caller is a thread of this connection's own (the bootstrap service's
    /// reader), which serves it; otherwise one is started for it.
    fn accept(self: &Arc<Inner>, from: u32, stream: TcpStream, own_thread: bool) {
        if self.closed.load(Ordering::Acquire) {
            return;
        }
        let id = {
            let mut st = self.lock();
            st.accepted += 1;
            let id = st.accepted;
            if let Ok(copy) = stream.try_clone() {
                st.incoming.push((id, copy));
            }
            id
        };
        let me = self.clone();
        let work = move || {
            crate::debug::set_rank(me.comm.1 as i32);
            // Its copies into windows must not fail, nor break, a graph the application
            // captures meanwhile (`relax_capture_mode`).
            crate::device::cuda::relax_capture_mode();
            let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| me.serve(from, stream)));
            // Its descriptor goes with it (each window a peer asks about opens one).
            me.lock().incoming.retain(|(i, _)| *i != id);
            if let Err(p) = served {
                me.fail(Error::internal(format!("one-sided operations from rank {from}: panic: {}",
                                                crate::abi::panic_message(&*p))));
            }
        };
        if own_thread {
            return work();
        }
        #[cfg(test)]
        let spawned = match tests::NO_THREADS.get() {
            true => Err(std::io::Error::from_raw_os_error(libc::EAGAIN)),
            false => std::thread::Builder::new().name("nccl-rs-rma".into()).spawn(work),
        };
        #[cfg(not(test))]
        let spawned = std::thread::Builder::new().name("nccl-rs-rma".into()).spawn(work);
        if let Err(e) = spawned {
            // The connection is closed (it went with `work`): the sender's next writes fail.
            // Nothing more comes from `from` here, so what waits for it must not wait on.
            self.lock().incoming.retain(|(i, _)| *i != id);
            self.lost(from, Error::os(format!("one-sided operations from rank {from}: spawn a thread"), e));
        }
    }

    /// `from`'s connection could not be read (`e`): sends, receives and signals from it end in
    /// `e`, as if it had closed the connection, and the communicator fails.
    fn lost(&self, from: u32, e: Error) {
        let mut st = self.lock();
        st.p2p_ended.entry(from).or_insert_with(|| e.msg.clone());
        st.ended.entry(from).or_insert_with(|| Some(e.clone()));
        drop(st);
        self.changed.notify_all();
        self.fail(e);
    }

    /// Read one sender's operations until it closes the connection.
    fn serve(&self, from: u32, mut s: TcpStream) {
        // A connection that asks for windows (`OP_WINDOW`) carries nothing else: its end says
        // nothing of the sender. Nor does one for sends and receives (`OP_P2P`): its end is
        // told to their waits.
        let mut asks = false;
        let mut p2p = false;
        let mut bounce = Vec::new();
        let ended = loop {
            let frame = match wire::next(&mut s) {
                Ok(Some(f)) => f,
                Ok(None) => break None,
                Err(e) => break Some(e),
            };
            if frame.op == wire::OP_WINDOW {
                asks = true;
                let info = self.window_info(from, frame.window);
                match wire::send_info(&mut s, &info) {
                    Ok(()) => continue,
                    Err(e) => break Some(e),
                }
            }
            if frame.op == wire::OP_P2P {
                p2p = true;
                match wire::receive_vec(&mut s, frame.len) {
                    Ok(bytes) => {
                        self.post(from, &frame, bytes);
                        continue;
                    }
                    Err(e) => break Some(e),
                }
            }
            if frame.op == OP_PUT {
                if let Err(e) = self.land(from, &frame, &mut s, &mut bounce) {
                    // The sender's later writes fail: the connection is closed below.
                    if !self.closed.load(Ordering::Acquire) {
                        self.fail(e);
                    }
                    break None;
                }
            }
            self.count((frame.ctx, frame.sig, from));
        };
        let _ = s.shutdown(Shutdown::Both);
        if self.closed.load(Ordering::Acquire) || asks {
            return;
        }
        if p2p {
            let why = ended.map_or_else(|| CLOSED.to_string(), |e| e.msg);
            self.lock().p2p_ended.insert(from, why);
            self.changed.notify_all();
            return;
        }
        let why = ended.as_ref().map_or_else(|| CLOSED.to_string(), |e| e.msg.clone());
        self.lock().ended.insert(from, ended);
        self.changed.notify_all();
        self.release_waits(|k| k.2 == from, &Error::remote(format!(
            "rank {}: a stream waits for signals that rank {from} will not send: {why}", self.comm.1)));
    }

    /// One more signal `key` arrived: counted, and written where streams wait for it.
    fn count(&self, key: SignalKey) {
        let mut st = self.lock();
        let n = st.arrived.entry(key).or_insert(0);
        *n += 1;
        let n = *n;
        if let (Some(words), Some(i)) = (st.words, self.word_of(key)) {
            words.word(i).store(n as u32, Ordering::Release);
        }
        drop(st);
        self.changed.notify_all();
    }

    /// The word of signal `key` among `State::words`.
    fn word_of(&self, (ctx, sig, from): SignalKey) -> Option<usize> {
        let (_, nsig, nranks) = self.shape;
        let i = ((ctx as usize) * nsig as usize + sig as usize) * nranks + from as usize;
        (i < self.words_len()).then_some(i)
    }

    fn words_len(&self) -> usize {
        let (nctx, nsig, nranks) = self.shape;
        nctx as usize * nsig as usize * nranks
    }

    /// Streams waiting for signals that `which` selects and that have not all come are let
    /// go (their word set to what they wait for), and the communicator's asynchronous error
    /// says why: what they read may not have landed.
    fn release_waits(&self, which: impl Fn(&SignalKey) -> bool, e: &Error) {
        let st = self.lock();
        let Some(words) = st.words else { return };
        let stuck: Vec<(SignalKey, u64)> = st.pending.iter()
            .filter(|(k, p)| which(k) && st.arrived.get(k).copied().unwrap_or(0) < p.want)
            .map(|(k, p)| (*k, p.want)).collect();
        drop(st);
        if stuck.is_empty() {
            return;
        }
        // The error before the streams go: a program that synchronises its stream, then asks
        // ncclCommGetAsyncError, must find it (the other order lost that race now and then:
        // the stream past its wait, the error not yet set).
        match self.owner.get().and_then(Weak::upgrade) {
            Some(comm) => comm.set_async_error(e),
            None => crate::warn!("{}", e.msg),
        }
        let mut st = self.lock();
        for (k, want) in &stuck {
            if let Some(i) = self.word_of(*k) {
                words.word(i).store(*want as u32, Ordering::Release);
            }
            st.pending.remove(k);
        }
    }

    /// `dst` <- `src` where either may be device memory (CUDA mode: on the landing stream,
    /// waited for; a put's bytes are in place before its signal counts).
    fn land_bytes(&self, dst: Region, src: Region) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        if !stream::needs_device_copy(&[dst, src])? {
            host::copy(dst, src);
            return Ok(());
        }
        let ctx = crate::device::cuda::Context::primary(self.cuda_dev)?;
        // Readers of several senders share the stream: its context current on each of them.
        ctx.make_current()?;
        let mut landing = self.landing.lock().unwrap_or_else(|p| p.into_inner());
        if landing.is_none() {
            *landing = Some(Stream::new(ctx)?);
        }
        let s = landing.as_ref().ok_or_else(|| Error::internal("no landing stream"))?;
        s.copy(dst, src)?;
        s.synchronize()
    }

    /// What this rank says of its window #`ordinal` to `from`, a rank of its host that would
    /// write it directly (waiting for this rank to register it): its CUDA IPC handle where it is
    /// device memory the driver shares that way, else no.
    fn window_info(&self, from: u32, ordinal: u64) -> wire::WindowInfo {
        let Lookup::Live(w) = self.await_window(ordinal, || format!("rank {from} asks for window #{ordinal}")) else {
            return wire::WindowInfo::NO;
        };
        let shared = || -> Result<wire::WindowInfo> {
            if !matches!(crate::device::cuda::classify(w.buff.addr())?, crate::device::cuda::PtrKind::Device { .. }) {
                return Ok(wire::WindowInfo::NO);
            }
            let (base, _) = crate::device::cuda::allocation_of(w.buff.addr())?;
            let handle = crate::device::cuda::IpcHandle::of(base as *mut std::ffi::c_void)?;
            Ok(wire::WindowInfo { ok: true, handle: handle.bytes, off: (w.buff.addr() - base) as u64, size: w.size as u64,
                                  addr: w.buff.addr() as u64 })
        };
        match crate::device::mode::current() {
            crate::device::mode::Mode::Host => wire::WindowInfo::NO,
            _ => shared().unwrap_or_else(|e| {
                crate::info!(P2P, "rank {}: window #{ordinal} is not shared with CUDA IPC ({})", self.comm.1, e.msg);
                wire::WindowInfo::NO
            }),
        }
    }

    /// This rank's window #`ordinal`, waiting while this rank has not registered it yet (and
    /// saying so at WARN after 10 s: `what` a peer wants of it), until the communicator closes.
    fn await_window(&self, ordinal: u64, what: impl FnOnce() -> String) -> Lookup {
        let started = Instant::now();
        let mut what = Some(what);
        mem::window_by_ordinal(self.comm, ordinal, || {
            if started.elapsed() >= WARN_AFTER {
                if let Some(what) = what.take() {
                    crate::warn!("rank {}: {} of this rank, which this rank has not registered \
                                  (ncclCommWindowRegister is collective: every rank registers each window)",
                                 self.comm.1, what());
                }
            }
            !self.closed.load(Ordering::Acquire)
        })
    }

    /// Write a put's bytes into the window it names (waiting for this rank to register it);
    /// `bounce`: the connection's buffer for device windows, kept across its puts.
    fn land(&self, from: u32, f: &Frame, s: &mut TcpStream, bounce: &mut Vec<u8>) -> Result<()> {
        let rank = self.comm.1;
        let w = match self.await_window(f.window, || format!("rank {from} puts into window #{}", f.window)) {
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
        let dst = Region::user(w.buff, f.offset as usize, f.len as usize);
        let landed = if stream::needs_device_copy(&[dst])? {
            self.receive_to_device(s, dst, bounce)
        } else {
            wire::receive_into(s, dst)
        };
        landed.map_err(|e| e.context(format!("rank {rank}: a put from rank {from}")))
    }

    /// A put's bytes into device memory: read in pieces through `buf`, each copied there.
    fn receive_to_device(&self, s: &mut TcpStream, dst: Region, buf: &mut Vec<u8>) -> Result<()> {
        const PIECE: usize = 1 << 20;
        if buf.len() < dst.len().min(PIECE) {
            buf.resize(dst.len().min(PIECE), 0);
        }
        let mut at = 0;
        while at < dst.len() {
            let n = (dst.len() - at).min(PIECE);
            wire::receive_into(s, Region::owned(&mut buf[..n]))?;
            self.land_bytes(dst.sub(at, n), Region::owned(&mut buf[..n]))?;
            at += n;
        }
        Ok(())
    }

    fn fail(&self, e: Error) {
        match self.owner.get().and_then(Weak::upgrade) {
            // Said at WARN once, as the communicator's error, which ends the waits (`Rma::failed`).
            Some(comm) => comm.set_async_error(&e),
            None => {
                crate::warn!("{}", e.msg);
                self.fail_quietly(&e);
            }
        }
    }

    /// Waits on the host return `e`; streams that wait are let go.
    fn fail_quietly(&self, e: &Error) {
        let mut st = self.lock();
        if st.failed.is_none() {
            st.failed = Some(e.clone());
        }
        drop(st);
        self.changed.notify_all();
        self.release_waits(|_| true, e);
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
        _ => CLOSED.to_string(),
    };
    Some(Error::remote(format!("rank {}: waiting for signals that {} will not send: {why}; {} came", comm.rank,
                               comm.describe_peer(from as usize), describe_missing(st, m))))
}

/// Is a sender this wait needs gone? As for a first connection ([`Comm::peer_gone`]): peers
/// of this host whose process exited, and peers of other hosts whose host refuses their
/// bootstrap port, at once; peers of other hosts that do not answer, after NCCL_PEER_TIMEOUT_S
/// (since when: in `unreachable`). So are peers of this host whose process goes on without the
/// communicator (destroyed or aborted), found so on two probes (a connection of theirs that
/// ended says so first, with what came on it). `peers`: (rank, what came from it).
fn gone_sender(comm: &Comm, peers: Vec<(u32, String)>, unreachable: &mut HashMap<u32, Instant>) -> Option<Error> {
    for (p, came) in peers {
        let (why, after) = match comm.peer_gone(p as usize) {
            Some((why, true)) => (why, Duration::ZERO),
            Some((why, false)) => (why, crate::params::peer_timeout()),
            None => match comm.peer_closed(p as usize) {
                Some(why) => (format!("it destroyed or aborted its communicator ({why})"), PROBE_EVERY / 2),
                None => {
                    unreachable.remove(&p);
                    // Its communicator is in error: it sends nothing more (every call on it
                    // fails), whatever it queued before may be cut off.
                    if let Some(e) = comm.peer_failure(p as usize) {
                        return Some(Error::remote(format!(
                            "rank {}: waiting for signals that will not come: {}; {came} came", comm.rank, e.msg)));
                    }
                    continue;
                }
            },
        };
        let since = *unreachable.entry(p).or_insert_with(Instant::now);
        if since.elapsed() >= after {
            return Some(Error::remote(format!(
                "rank {}: waiting for signals from {}, which is gone: {why}; {came} came", comm.rank,
                comm.describe_peer(p as usize))));
        }
    }
    None
}

/// While a wait blocks: what it publishes as this rank's status (`Ready::set_signal_wait`),
/// taken back when it ends, however it ends.
struct Published<'a>(&'a Comm);

impl Published<'_> {
    fn set(&self, what: &str) {
        if let Some(ready) = self.0.ready_if_any() {
            ready.set_signal_wait(Some(what));
        }
    }
}

impl Drop for Published<'_> {
    fn drop(&mut self) {
        if let Some(ready) = self.0.ready_if_any() {
            ready.set_signal_wait(None);
        }
    }
}

/// The senders of `peers` (rank, what came from it) whose process is stopped (SIGSTOP, Ctrl-Z, a
/// debugger) on two looks in a row, as "; rank N (...): its process is stopped ..." for the
/// published status; each said at WARN once, instead of only after [`WARN_AFTER`]. A sender of
/// this host is looked at in /proc at every probe; one of another host is asked of a rank of
/// its host (`Comm::peer_stopped_anywhere`) at the first two probes, then every fourth: before,
/// it was named only after 10 s, as a peer gone silent.
fn stopped_senders(comm: &Comm, peers: &[(u32, String)], seen: &mut HashMap<u32, Looks>, waited: Duration)
                   -> Vec<String> {
    let mut held = Vec::new();
    for (p, came) in peers {
        let looks = seen.entry(*p).or_default();
        looks.probes += 1;
        let look = comm.of_this_host(*p as usize) || looks.probes <= 2 || looks.probes.is_multiple_of(4);
        if look {
            match comm.peer_stopped_anywhere(*p as usize) {
                Some(how) => {
                    looks.stopped += 1;
                    looks.how = how;
                }
                None => looks.stopped = 0,
            }
        }
        if looks.stopped < 2 {
            continue;
        }
        let who = comm.describe_peer(*p as usize);
        if !looks.said {
            looks.said = true;
            crate::warn!("rank {}: ncclWaitSignal has waited {:.1} s for signals from {who}: {}; {came} came",
                         comm.rank, waited.as_secs_f64(), looks.how);
        }
        held.push(format!("; {who}: {}", looks.how));
    }
    held
}

/// What a wait's probes saw of a sender's process ([`stopped_senders`]): how many probes, how
/// many looks in a row found it stopped, how, and whether that was said.
#[derive(Default)]
struct Looks {
    probes: u32,
    stopped: u32,
    how: String,
    said: bool,
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
    let mut published: Option<Published<'_>> = None;
    // Senders of this host found stopped: on how many probes in a row, and whether said.
    let mut stopped: HashMap<u32, Looks> = HashMap::new();
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
            crate::proxy::pause();
            st = inner.lock();
            continue;
        }
        let missing: Vec<Missing> = want.iter().map(|&(k, n)| (k, got(&k), n)).filter(|&(_, g, n)| g < n).collect();
        if let Some(e) = hopeless(comm, &st, &missing) {
            return Err(e);
        }
        let now = Instant::now();
        let first = published.is_none() && now.duration_since(started) >= PUBLISH_AFTER;
        if first || now.duration_since(probed) >= PROBE_EVERY {
            let described: Vec<(u32, String)> = missing.iter().map(|m| (m.0 .2, describe_missing(&st, m))).collect();
            let list: Vec<&str> = described.iter().map(|(_, d)| d.as_str()).collect();
            let text = list.join(", ");
            let peers: Vec<(u32, String)> = described.into_iter().filter(|(p, _)| *p as usize != comm.rank).collect();
            drop(st);
            let held = if first { Vec::new() } else { stopped_senders(comm, &peers, &mut stopped, now - started) };
            published.get_or_insert(Published(comm)).set(&format!("{text}{}", held.concat()));
            if !first {
                probed = now;
                if let Some(e) = gone_sender(comm, peers, &mut unreachable) {
                    return Err(e);
                }
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
    use std::io::Read;

    thread_local! {
        /// `Inner::accept` on this thread finds no thread to start.
        pub static NO_THREADS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

    /// A connection that no thread can be started for is closed, and what waits for its
    /// sender ends, naming why, instead of waiting for ever for messages nobody reads.
    #[test]
    fn a_connection_no_thread_can_read_ends_what_waits_for_its_sender() {
        let rma = Rma::new(1, 0, 3, -1, (1, 1));
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut peer = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mine, _) = l.accept().unwrap();
        assert!(rma.p2p_lost(2).is_none());
        NO_THREADS.set(true);
        (rma.handler())(2, mine, false);
        NO_THREADS.set(false);
        let lost = rma.p2p_lost(2).expect("sends and receives from rank 2 end");
        assert!(lost.msg.contains("spawn a thread") && lost.msg.contains("ulimit -u"), "{}", lost.msg);
        assert!(rma.p2p_lost(1).is_none(), "rank 1 is not concerned");
        assert!(rma.inner.lock().ended.contains_key(&2));
        assert!(rma.inner.lock().incoming.is_empty());
        peer.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        assert_eq!(peer.read(&mut [0u8; 8]).unwrap(), 0, "the sender sees its connection closed");
    }

    /// On a thread of its own (the service's reader), a connection is served there: no thread
    /// is started for it.
    #[test]
    fn a_connection_on_its_own_thread_is_served_there() {
        let rma = Rma::new(1, 0, 3, -1, (1, 1));
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let peer = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mine, _) = l.accept().unwrap();
        drop(peer); // served until the sender closes it: here at once
        NO_THREADS.set(true);
        (rma.handler())(2, mine, true);
        NO_THREADS.set(false);
        let lost = rma.p2p_lost(2);
        assert!(lost.is_none(), "read to its end, not refused: {lost:?}");
        assert!(rma.inner.lock().ended.get(&2).is_some_and(Option::is_none), "ended by its sender, without error");
    }

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
