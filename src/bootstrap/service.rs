//! A rank's bootstrap service: a listening socket and a thread that accepts connections from
//! peers, checks the communicator's magic, and files what arrives — small messages by (sender,
//! tag), raw data connections for the socket transport, and each peer's one-sided-operations
//! connection, handed to the communicator's handler. Waiting on it is bounded by a deadline
//! and the communicator's abort flag.

use std::collections::{HashMap, VecDeque};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::wire::{read_frame, write_frame, Reader, Writer};
use crate::error::{Error, Result};

const KIND_MSG: u8 = 1;
const KIND_DATA: u8 = 2;
/// Answered by the kernel's accept alone: proves the peer's process still listens.
const KIND_PING: u8 = 3;
/// "What are you running?": answered on the same connection with the rank's current status.
const KIND_STATUS: u8 = 4;
/// A connection carrying one-sided operations (puts and signals) from one peer, handed to the
/// communicator's handler for as long as it stays open.
const KIND_RMA: u8 = 5;
/// "I cannot take part in this exchange": a member of a split or shrink that failed before it
/// sent its part (no thread, no port) tells the others, whose parts could never come round.
const KIND_REFUSE: u8 = 6;
/// "I failed, for this reason": a rank that lost a peer tells the others before it returns its
/// error (and its process, often, exits): a rank that then finds it gone knows it went after
/// failing itself, not as the culprit.
const KIND_FAILED: u8 = 7;
/// "How is the process of this rank of yours, as your host sees it?": asked of a rank on the
/// host of a peer that does not answer, which this rank cannot see from its own.
const KIND_PROCESS: u8 = 8;
/// How long a rank may take in all to tell the members of an exchange that it cannot take part.
const REFUSE_WITHIN: Duration = Duration::from_secs(5);
/// How long an incoming connection may take to say who it is.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Default)]
struct Inbox {
    msgs: HashMap<(u32, u32), VecDeque<Vec<u8>>>,
    data: HashMap<(u32, u32), VecDeque<TcpStream>>,
    /// Why a member cannot take part in an exchange, by (its rank, the exchange's tag).
    refused: HashMap<(u32, u32), String>,
    /// Why a peer failed, as it told this rank (its first failure).
    failed: HashMap<u32, Vec<u8>>,
}

/// What a rank is doing now, as opaque bytes its communicator keeps up to date.
pub type Status = Arc<Mutex<Vec<u8>>>;

/// Whether a peer's service takes a connection ([`Service::reach`]), and why not.
#[derive(Debug, PartialEq, Eq)]
pub enum Reach {
    Answers,
    Refuses(String),
    Silent(String),
}

/// Answers a status request (the communicator's bytes, or more it adds when asked).
/// Called with the rank the asker asks about (itself, unless it names another).
pub type StatusAnswer = Box<dyn Fn(u32) -> Vec<u8> + Send + Sync>;

/// Takes an incoming one-sided-operations connection: (from rank, the stream).
pub type RmaHandler = Box<dyn Fn(u32, TcpStream, bool) + Send + Sync>;

struct Shared {
    magic: u64,
    status: std::sync::OnceLock<StatusAnswer>,
    /// Answers [`KIND_PROCESS`] requests, about the rank given.
    process: std::sync::OnceLock<StatusAnswer>,
    rma: std::sync::OnceLock<RmaHandler>,
    /// One-sided connections that came before the handler was set (a peer may finish init
    /// and put before this rank has finished its own).
    rma_early: Mutex<Vec<(u32, TcpStream)>>,
    /// Told when the one-sided handler is set, or the service stops (readers of early
    /// one-sided connections wait for it).
    rma_set: Condvar,
    stop: AtomicBool,
    /// Connections being read by their own threads.
    pending: super::pending::Pending,
    inbox: Mutex<Inbox>,
    arrived: Condvar,
    /// Tests: act as if no thread could be started for a connection.
    #[cfg(test)]
    no_threads: AtomicBool,
    /// Tests: act as if no descriptor were left to track a connection with.
    #[cfg(test)]
    no_tracking: AtomicBool,
}

pub struct Service {
    shared: Arc<Shared>,
    pub addr: SocketAddr,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Every rank's service address, once the peer table is known.
    peers: Mutex<Vec<SocketAddr>>,
    rank: std::sync::atomic::AtomicU32,
}

impl Service {
    /// Listen on `ip` (port chosen by the OS) for connections proving `magic`.
    pub fn start(ip: std::net::IpAddr, magic: u64, rank: u32) -> Result<Service> {
        let listener = crate::transport::fds::with_room(|| crate::transport::socket::listen(SocketAddr::new(ip, 0)))
            .map_err(|e| Error::os(format!("bootstrap: listen on {ip}"), e))?;
        let addr = listener.local_addr().map_err(|e| Error::os("bootstrap: local address", e))?;
        let shared = Arc::new(Shared { magic, status: std::sync::OnceLock::new(), process: std::sync::OnceLock::new(), rma: std::sync::OnceLock::new(), rma_early: Mutex::default(), rma_set: Condvar::new(), stop: AtomicBool::new(false), pending: Default::default(), inbox: Mutex::default(), arrived: Condvar::new(),
                                         #[cfg(test)]
                                         no_threads: AtomicBool::new(false),
                                         #[cfg(test)]
                                         no_tracking: AtomicBool::new(false) });
        let s2 = shared.clone();
        let thread = std::thread::Builder::new()
            .name("nccl-rs-boot".into())
            .spawn(move || accept_loop(listener, s2))
            .map_err(|e| Error::os("bootstrap: spawn service thread", e))?;
        Ok(Service { shared, addr, thread: Mutex::new(Some(thread)), peers: Mutex::new(Vec::new()),
                     rank: std::sync::atomic::AtomicU32::new(rank) })
    }

    /// The rank messages are sent as (a split learns it after starting the service).
    pub fn set_rank(&self, rank: u32) {
        self.rank.store(rank, Ordering::Release);
    }

    fn rank(&self) -> u32 {
        self.rank.load(Ordering::Acquire)
    }

    pub fn set_peers(&self, addrs: Vec<SocketAddr>) {
        *self.peers.lock().unwrap_or_else(|p| p.into_inner()) = addrs;
    }

    fn peer_addr(&self, peer: usize) -> Result<SocketAddr> {
        let peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        peers.get(peer).copied().ok_or_else(|| Error::internal(format!("bootstrap: no address for rank {peer}")))
    }

    fn open(&self, peer: usize, kind: u8, tag: u32, payload: &[u8]) -> Result<TcpStream> {
        self.open_within(peer, kind, tag, payload, Duration::from_secs(10))
    }

    /// [`Service::open`], the connection made within `timeout`.
    fn open_within(&self, peer: usize, kind: u8, tag: u32, payload: &[u8], timeout: Duration) -> Result<TcpStream> {
        let addr = self.peer_addr(peer)?;
        let mut s = crate::transport::socket::dial(&addr, timeout).map_err(|e| {
            // Its service ran as long as its communicator: refused, the communicator is gone.
            if crate::transport::fds::out_of_fds(&e) {
                // This process's shortage, not the peer's doing.
                return Error::os(format!("bootstrap: cannot reach rank {peer} at {addr}"), e);
            }
            let hint = if e.kind() == std::io::ErrorKind::ConnectionRefused {
                " (it destroyed or aborted its communicator, or its process ended)"
            } else {
                ""
            };
            Error::remote(format!("bootstrap: cannot reach rank {peer} at {addr}: {e}{hint}"))
        })?;
        let _ = s.set_nodelay(true);
        let mut w = Writer::default();
        w.u64(self.shared.magic).u8(kind).u32(self.rank()).u32(tag).bytes(payload);
        // The peer's listener took the connection but the peer is gone by the time it is
        // written to (it exited meanwhile: reset, broken pipe): a lost peer, as a refused
        // connection above is, not a fault of this rank.
        write_frame(&mut s, &w.buf).map_err(|e| Error::remote(format!("bootstrap: rank {peer} at {addr}: {}", e.msg)))?;
        Ok(s)
    }

    /// Does `peer`'s service take a connection within `timeout`? It runs as long as the peer's
    /// communicator: a refusal (nothing listens at its address: its host said so) means the
    /// peer destroyed or aborted that communicator, or its process ended; silence may be a
    /// loaded host or a network in trouble, and says nothing yet.
    pub fn reach(&self, peer: usize, timeout: Duration) -> Reach {
        let addr = match self.peer_addr(peer) {
            Ok(a) => a,
            Err(e) => return Reach::Silent(e.msg),
        };
        match crate::transport::socket::dial(&addr, timeout) {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                Reach::Refuses(format!("its bootstrap service at {addr} refuses connections"))
            }
            Err(e) => Reach::Silent(format!("rank {peer} at {addr} does not answer: {e}")),
            Ok(mut s) => {
                let mut w = Writer::default();
                w.u64(self.shared.magic).u8(KIND_PING).u32(self.rank()).u32(0).bytes(&[]);
                let _ = write_frame(&mut s, &w.buf);
                Reach::Answers
            }
        }
    }

    /// What answers status requests (set once).
    pub fn set_status(&self, answer: StatusAnswer) {
        let _ = self.shared.status.set(answer);
    }

    /// What answers requests about a rank's process (set once, with the status).
    pub fn set_process_answer(&self, answer: StatusAnswer) {
        let _ = self.shared.process.set(answer);
    }

    /// Who takes incoming one-sided-operations connections (set once, when the communicator is
    /// ready; those that came before are handed over then).
    pub fn set_rma_handler(&self, handler: RmaHandler) {
        let early = {
            let mut early = self.shared.rma_early.lock().unwrap_or_else(|p| p.into_inner());
            let _ = self.shared.rma.set(handler);
            self.shared.rma_set.notify_all();
            std::mem::take(&mut *early)
        };
        if let Some(handler) = self.shared.rma.get() {
            early.into_iter().for_each(|(from, s)| handler(from, s, false));
        }
    }

    /// Open the connection that carries this rank's one-sided operations to `peer`.
    pub fn connect_rma(&self, peer: usize) -> Result<TcpStream> {
        self.open(peer, KIND_RMA, 0, &[])
    }

    /// Ask `peer` what it is running (its status bytes), waiting at most `timeout`.
    pub fn status(&self, peer: usize, timeout: Duration) -> Result<Vec<u8>> {
        self.status_about(peer, self.rank(), timeout)
    }

    /// The same, its answer's account of what it did with rank `about` (this rank's by default;
    /// a search for a cycle of waiting ranks asks a rank about the one before it).
    pub fn status_about(&self, peer: usize, about: u32, timeout: Duration) -> Result<Vec<u8>> {
        let mut s = self.open(peer, KIND_STATUS, 0, &about.to_le_bytes())?;
        read_frame(&mut s, timeout).map_err(|e| e.context(format!("status of rank {peer}")))
    }

    /// Ask `witness` how the process of rank `about` is, as its host sees it (the answer of
    /// [`Service::set_process_answer`]; empty if it has none), waiting at most `timeout`.
    pub fn process_of(&self, witness: usize, about: u32, timeout: Duration) -> Result<Vec<u8>> {
        let mut s = self.open_within(witness, KIND_PROCESS, 0, &about.to_le_bytes(), timeout)?;
        read_frame(&mut s, timeout).map_err(|e| e.context(format!("rank {witness}'s look at rank {about}'s process")))
    }

    /// Deliver a small message to `peer` under `tag`.
    pub fn send(&self, peer: usize, tag: u32, payload: &[u8]) -> Result<()> {
        self.open(peer, KIND_MSG, tag, payload).map(|_| ())
    }

    /// Tell `peers` that this rank failed (`why`: what its status says once failed), each
    /// connection made within `each`, all of them within `budget`: peers that do not take the
    /// news by then (gone, or slow to answer) go without it. How many took it.
    pub fn tell_failed(&self, peers: impl Iterator<Item = usize>, why: &[u8], each: Duration, budget: Duration) -> usize {
        self.tell_each(peers, KIND_FAILED, 0, why, each, budget).0
    }

    /// Send `peers`, one after another, a message of `kind`, each connection made within
    /// `each`, all within `budget`: how many took it, and the first left untold when the
    /// budget ran out.
    fn tell_each(&self, peers: impl Iterator<Item = usize>, kind: u8, tag: u32, payload: &[u8], each: Duration,
                 budget: Duration) -> (usize, Option<usize>) {
        let until = Instant::now() + budget;
        let mut told = 0;
        for peer in peers {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return (told, Some(peer));
            }
            told += self.open_within(peer, kind, tag, payload, each.min(left)).is_ok() as usize;
        }
        (told, None)
    }

    /// What `peer` said of its failure ([`Service::tell_failed`]), if it did.
    pub fn told_failed(&self, peer: usize) -> Option<Vec<u8>> {
        self.shared.inbox.lock().unwrap_or_else(|p| p.into_inner()).failed.get(&(peer as u32)).cloned()
    }

    /// Open a data connection to `peer` (the socket transport); the peer takes it with `accept_data`.
    pub fn connect_data(&self, peer: usize, tag: u32) -> Result<TcpStream> {
        self.open(peer, KIND_DATA, tag, &[])
    }

    fn wait<T>(&self, what: &str, deadline: Instant, abort: &AtomicBool,
               mut take: impl FnMut(&mut Inbox) -> Option<T>) -> Result<T> {
        let mut inbox = self.shared.inbox.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(v) = take(&mut inbox) {
                return Ok(v);
            }
            if abort.load(Ordering::Acquire) {
                return Err(Error::invalid_usage(format!("communicator aborted while waiting for {what}")));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::timeout(format!("timed out waiting for {what}")));
            }
            let slice = (deadline - now).min(Duration::from_millis(100));
            inbox = match self.shared.arrived.wait_timeout(inbox, slice) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
    }

    pub fn recv(&self, peer: usize, tag: u32, deadline: Instant, abort: &AtomicBool) -> Result<Vec<u8>> {
        let key = (peer as u32, tag);
        self.wait(&format!("a bootstrap message from rank {peer}"), deadline, abort, |i| {
            i.msgs.get_mut(&key).and_then(|q| q.pop_front())
        })
    }

    pub fn accept_data(&self, peer: usize, tag: u32, deadline: Instant, abort: &AtomicBool) -> Result<TcpStream> {
        let key = (peer as u32, tag);
        self.wait(&format!("a data connection from rank {peer}"), deadline, abort, |i| {
            i.data.get_mut(&key).and_then(|q| q.pop_front())
        })
    }

    /// Every member's `mine`, by a ring over the members (ranks of this service's job, in
    /// order; `me` indexes this rank in it), for the exchange `ex` of a management call. Each
    /// step waits for one member's part, passed on by the previous member: the part that does
    /// not come is that of a rank that has not made the call (every rank sends its own part
    /// first), so that rank is named, at WARN once half the time allowed (at most 10 s) has
    /// gone, and in the error at the deadline.
    pub fn allgather(&self, ex: &Exchange, members: &[usize], me: usize, mine: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        let Exchange { call, tag, deadline, abort, members: group } = *ex;
        let n = members.len();
        let mut out = vec![Vec::new(); n];
        out[me] = mine;
        let (next, prev) = (members[(me + 1) % n], members[(me + n - 1) % n]);
        let mut warn_at = Some(Instant::now() + warn_after(deadline));
        for s in 0..n.saturating_sub(1) {
            let step_tag = tag ^ ((s as u32) << 20);
            self.send(next, step_tag, &out[(me + n - s) % n])?;
            let from = (me + 2 * n - s - 1) % n;
            let origin = members[from];
            let by = if origin == prev { String::new() } else { format!(", passed on by rank {prev},") };
            let mut check_at = Instant::now() + GONE_CHECK_EVERY;
            out[from] = loop {
                let until = warn_at.map_or(deadline, |w| w.min(deadline)).min(check_at);
                match self.recv(prev, step_tag, until, abort) {
                    Err(e) if e.code == crate::error::Code::Timeout && Instant::now() < deadline => {
                        if Instant::now() >= check_at {
                            check_at = Instant::now() + GONE_CHECK_EVERY;
                            // A member that cannot take part: no part gets past it.
                            if let Some((r, why)) = self.refused(tag, members) {
                                return Err(Error::remote(format!("rank {r} cannot take part in {call}: {why}")));
                            }
                            // The part comes from its origin through the members after it: one
                            // of them gone, it never will (unless already on its way).
                            let chain = (0..(me + n - from) % n).map(|k| members[(from + k) % n]);
                            if let Some(why) = chain.filter_map(|r| group.gone(r)).next() {
                                let last = Instant::now() + Duration::from_millis(200);
                                match self.recv(prev, step_tag, last, abort) {
                                    Ok(part) => break part,
                                    Err(_) => return Err(Error::remote(format!(
                                        "rank {origin}'s part{by} will never come: {why}"))),
                                }
                            }
                        }
                        if warn_at.is_some_and(|w| Instant::now() >= w) {
                            warn_at = None;
                            crate::warn!("rank {}: {call} waits for rank {origin}, which has not made the call (its \
                                          part{by} has not come); waiting {}", members[me], crate::params::init_limit_text());
                        }
                    }
                    Err(e) if e.code == crate::error::Code::Timeout => {
                        return Err(Error::timeout(format!("rank {origin} never made the call (its part{by} did \
                                                           not come within NCCL_INIT_TIMEOUT_S)")));
                    }
                    other => break other?,
                }
            };
        }
        Ok(out)
    }

    /// This rank cannot take part in the exchange `tag` (why: `why`): the other `members` are
    /// told, so that their exchange fails at its next check instead of waiting for ever for
    /// parts that cannot get past this rank (best effort, within [`REFUSE_WITHIN`] in all,
    /// so that the failing call returns: a member that cannot be reached meanwhile is most
    /// likely gone).
    pub fn refuse(&self, tag: u32, members: &[usize], why: &str) {
        let others = members.iter().copied().filter(|&m| m != self.rank() as usize);
        let (_, untold) = self.tell_each(others, KIND_REFUSE, tag, why.as_bytes(), Duration::from_secs(1), REFUSE_WITHIN);
        if let Some(m) = untold {
            crate::warn!("rank {}: telling the members that it cannot take part took over {} s: rank {m} and those \
                          after it were not told", self.rank(), REFUSE_WITHIN.as_secs());
        }
    }

    /// A member of exchange `tag` that said it cannot take part, and why.
    fn refused(&self, tag: u32, members: &[usize]) -> Option<(usize, String)> {
        let inbox = self.shared.inbox.lock().unwrap_or_else(|p| p.into_inner());
        members.iter().find_map(|&m| inbox.refused.get(&(m as u32, tag)).map(|why| (m, why.clone())))
    }

    /// Stop accepting and join the thread (idempotent).
    pub fn stop(&self) {
        self.shared.stop.store(true, Ordering::Release);
        let handle = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(h) = handle {
            // Wake the blocking accept with a connection of our own. If that fails (no file
            // descriptor left, the address gone), the thread is left to end with the process
            // rather than joined: destroy and abort must return.
            if TcpStream::connect_timeout(&self.addr, Duration::from_secs(1)).is_ok() {
                let _ = h.join();
            }
            // Let connection threads that are mid-message finish (bounded: a silent hostile
            // connection is left to its own read timeout).
            let until = Instant::now() + Duration::from_millis(200);
            while !self.shared.pending.is_empty() && Instant::now() < until {
                std::thread::yield_now();
            }
        }
        let mut inbox = self.shared.inbox.lock().unwrap_or_else(|p| p.into_inner());
        inbox.msgs.clear();
        inbox.data.clear();
        inbox.refused.clear();
        inbox.failed.clear();
        drop(inbox);
        self.shared.rma_early.lock().unwrap_or_else(|p| p.into_inner()).clear();
        self.shared.rma_set.notify_all();
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.stop();
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut warned = false;
    loop {
        let conn = crate::transport::fds::made(|| listener.accept().map(|(s, _)| s));
        if shared.stop.load(Ordering::Acquire) {
            return;
        }
        let s = match conn {
            Ok(s) => s,
            Err(e) if crate::transport::fds::out_of_fds(&e) => {
                // The connection stays queued, and its peer waits, until a descriptor frees up.
                if !warned {
                    warned = true;
                    crate::warn!("bootstrap: the service at {} cannot take a peer's connection: {e}{}",
                                 listener.local_addr().map_or("?".to_string(), |a| a.to_string()),
                                 crate::transport::fds::hint(&e));
                }
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            Err(_) => {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        // (Untracked when no descriptor is left for the tracking clone: read all the same.)
        #[cfg(test)]
        let ticket = match shared.no_tracking.load(Ordering::Acquire) {
            true => None,
            false => shared.pending.admit(&s),
        };
        #[cfg(not(test))]
        let ticket = shared.pending.admit(&s);
        // Each connection is read on a thread of its own, so a silent one delays nobody.
        let conn = Arc::new(Mutex::new(Some(s)));
        let (mine, theirs) = (shared.clone(), conn.clone());
        let reader = move || {
            if let Some(s) = theirs.lock().unwrap_or_else(|p| p.into_inner()).take() {
                file_connection(s, &mine, ticket, true);
            }
        };
        #[cfg(test)]
        let spawned = match shared.no_threads.load(Ordering::Acquire) {
            true => Err(std::io::Error::from_raw_os_error(libc::EAGAIN)),
            false => std::thread::Builder::new().name("nccl-rs-conn".into()).spawn(reader),
        };
        #[cfg(not(test))]
        let spawned = std::thread::Builder::new().name("nccl-rs-conn".into()).spawn(reader);
        if spawned.is_err() {
            // No thread to be had (the process, or its user, is at its limit): read it here,
            // the next connections waiting meanwhile, rather than drop what a peer sent.
            let s = conn.lock().unwrap_or_else(|p| p.into_inner()).take();
            if let Some(s) = s {
                file_connection(s, &shared, ticket, false);
            }
        }
    }
}

/// Read who a connection is and file what it brought. A connection that does not prove the
/// magic, or says nothing in time, is dropped. `ticket`: its place among the pending ones, left
/// once it has said who it is; `own_thread`: this is a thread of its own, which a one-sided
/// connection is served on (the accept thread, reading it for want of one, is not).
fn file_connection(mut s: TcpStream, shared: &Shared, ticket: Option<u64>, own_thread: bool) {
    let hello = read_hello(&mut s, shared.magic);
    if let Some(t) = ticket {
        shared.pending.done(t);
    }
    let Ok(Some((kind, from, tag, payload))) = hello else { return };
    if shared.stop.load(Ordering::Acquire) {
        return;
    }
    if kind == KIND_STATUS || kind == KIND_PROCESS {
        let about = payload.get(..4).and_then(|b| b.try_into().ok()).map_or(from, u32::from_le_bytes);
        let answers = if kind == KIND_STATUS { &shared.status } else { &shared.process };
        let now = answers.get().map(|answer| answer(about)).unwrap_or_default();
        let _ = write_frame(&mut s, &now);
        return;
    }
    if kind == KIND_RMA {
        let _ = s.set_read_timeout(None);
        let mut early = shared.rma_early.lock().unwrap_or_else(|p| p.into_inner());
        // One that comes before its communicator is ready: its own thread waits for the
        // handler and serves it then (the accept thread, which must go on, leaves it to be
        // handed over).
        while own_thread && shared.rma.get().is_none() && !shared.stop.load(Ordering::Acquire) {
            early = match shared.rma_set.wait_timeout(early, Duration::from_millis(200)) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
        if shared.stop.load(Ordering::Acquire) {
            return;
        }
        match shared.rma.get() {
            Some(handler) => {
                drop(early);
                handler(from, s, own_thread);
            }
            None => early.push((from, s)),
        }
        return;
    }
    let mut inbox = shared.inbox.lock().unwrap_or_else(|p| p.into_inner());
    match kind {
        KIND_MSG => inbox.msgs.entry((from, tag)).or_default().push_back(payload),
        KIND_REFUSE => {
            inbox.refused.insert((from, tag), String::from_utf8_lossy(&payload).into_owned());
        }
        KIND_FAILED => {
            inbox.failed.entry(from).or_insert(payload);
        }
        KIND_DATA => {
            let _ = s.set_read_timeout(None);
            inbox.data.entry((from, tag)).or_default().push_back(s);
        }
        _ => {}
    }
    shared.arrived.notify_all();
}

/// A filed message: (kind, from rank, tag, payload).
type Incoming = (u8, u32, u32, Vec<u8>);

fn read_hello(s: &mut TcpStream, magic: u64) -> Result<Option<Incoming>> {
    parse_hello(&read_frame(s, HELLO_TIMEOUT)?, magic)
}

/// A peer's message header: (kind, from, tag, payload), None if the magic is not ours.
pub fn parse_hello(frame: &[u8], magic: u64) -> Result<Option<Incoming>> {
    let mut r = Reader::new(frame);
    if r.u64()? != magic {
        return Ok(None);
    }
    let kind = r.u8()?;
    let from = r.u32()?;
    let tag = r.u32()?;
    let payload = r.bytes()?.to_vec();
    Ok(Some((kind, from, tag, payload)))
}

/// One exchange of a management call over a parent's service: the call (for messages), a tag
/// unique to the exchange, until when it may wait, and the flag that aborts it.
#[derive(Clone, Copy)]
pub struct Exchange<'a> {
    pub call: &'a str,
    pub tag: u32,
    pub deadline: Instant,
    pub abort: &'a AtomicBool,
    /// Who the members are: whether one is gone (a part it has not passed on never comes).
    pub members: &'a dyn Members,
}

/// What a management exchange asks of the communicator whose members it gathers.
pub trait Members {
    /// `rank` described with why it is gone, if it certainly is (its process exited, its
    /// service refuses).
    fn gone(&self, rank: usize) -> Option<String>;
}

/// How often a management exchange waiting for a part checks that the members it comes
/// through are still there.
const GONE_CHECK_EVERY: Duration = Duration::from_secs(1);

/// How long a management exchange or an init waits before it names, at WARN, the ranks it
/// waits for: half the time it is allowed (`deadline` from now), at most 10 s.
pub fn warn_after(deadline: Instant) -> Duration {
    (deadline.saturating_duration_since(Instant::now()) / 2).min(Duration::from_secs(10))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A rank's service (the bootstrap and transport port) keeps filing real messages while
    /// garbage, wrong magics, instantly closed and silent half-open connections pour in.
    #[test]
    fn hostile_connections_do_not_disturb_real_messages() {
        let ip: std::net::IpAddr = "127.0.0.1".parse().unwrap();
        let a = Service::start(ip, 0xfeed, 0).unwrap();
        let b = Service::start(ip, 0xfeed, 1).unwrap();
        a.set_peers(vec![a.addr, b.addr]);
        b.set_peers(vec![a.addr, b.addr]);
        let target = b.addr;
        let stop = Arc::new(AtomicBool::new(false));
        let attacker = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut silent = Vec::new();
                let mut i = 0u32;
                while !stop.load(Ordering::Acquire) && i < 2000 {
                    i += 1;
                    let Ok(mut s) = TcpStream::connect(target) else { continue };
                    match i % 4 {
                        0 => silent.push(s), // half-open: says nothing, stays
                        1 => {}              // connects and closes at once
                        2 => {
                            let _ = s.write_all(&[0xde, 0xad, 0xbe, 0xef, 1, 2, 3]);
                        }
                        _ => {
                            let mut w = Writer::default();
                            w.u64(0xbad).u8(KIND_MSG).u32(0).u32(7).bytes(b"wrong magic");
                            let _ = write_frame(&mut s, &w.buf);
                        }
                    }
                    if silent.len() > 300 {
                        silent.remove(0);
                    }
                }
            })
        };
        let never = AtomicBool::new(false);
        for k in 0..50u32 {
            a.send(1, 7, &k.to_le_bytes()).unwrap();
            let got = b.recv(0, 7, Instant::now() + Duration::from_secs(10), &never).unwrap();
            assert_eq!(got, k.to_le_bytes(), "message {k} arrived intact and in order");
        }
        // The wrong-magic frames under the same (from, tag) were never filed.
        assert!(b.recv(0, 7, Instant::now() + Duration::from_millis(50), &never).is_err());
        stop.store(true, Ordering::Release);
        attacker.join().unwrap();
    }

    /// A service that can start no thread for a connection (its process, or its user, at the
    /// limit of threads) reads it on its accept thread: what peers send still arrives (before,
    /// the connection was dropped, and a rank waited for ever for a message sent to it).
    #[test]
    fn connections_are_read_when_no_thread_can_be_started_for_them() {
        messages_arrive_when(|b| b.shared.no_threads.store(true, Ordering::Release));
    }

    /// Nor when no descriptor is left for the clone that tracks a connection (found by a run
    /// under a low open-file limit: the connection was dropped, and a split waited for ever).
    #[test]
    fn connections_are_read_when_they_cannot_be_tracked() {
        messages_arrive_when(|b| b.shared.no_tracking.store(true, Ordering::Release));
    }

    /// A one-sided connection that comes before its communicator is ready is served, once it
    /// is, on the thread that read it (no thread is started for it: under a thread limit, one
    /// could not be); read for want of a thread on the accept thread, it is handed over.
    #[test]
    fn early_one_sided_connections_are_served_on_their_own_thread() {
        for no_threads in [false, true] {
            let ip: std::net::IpAddr = "127.0.0.1".parse().unwrap();
            let a = Service::start(ip, 0xfeed, 0).unwrap();
            let b = Service::start(ip, 0xfeed, 1).unwrap();
            a.set_peers(vec![a.addr, b.addr]);
            b.set_peers(vec![a.addr, b.addr]);
            b.shared.no_threads.store(no_threads, Ordering::Release);
            let _early = a.connect_rma(1).unwrap();
            // (Its hello read, it waits: on the reader's thread, or in the early list.)
            let deadline = Instant::now() + Duration::from_secs(10);
            while !b.shared.pending.is_empty() && Instant::now() < deadline {
                std::thread::yield_now();
            }
            let (tx, rx) = std::sync::mpsc::channel();
            let tx = Mutex::new(tx);
            b.set_rma_handler(Box::new(move |from, _s, own_thread| {
                let _ = tx.lock().unwrap().send((from, own_thread));
            }));
            let got = rx.recv_timeout(Duration::from_secs(10)).expect("the early connection is handed to the handler");
            assert_eq!(got, (0, !no_threads), "served on its own thread: {}", !no_threads);
        }
    }

    /// `n` services on loopback, each knowing the others' addresses.
    fn services(n: u32) -> Vec<Service> {
        let ip: std::net::IpAddr = "127.0.0.1".parse().unwrap();
        let svcs: Vec<Service> = (0..n).map(|r| Service::start(ip, 0xfeed, r).unwrap()).collect();
        let addrs: Vec<_> = svcs.iter().map(|s| s.addr).collect();
        svcs.iter().for_each(|s| s.set_peers(addrs.clone()));
        svcs
    }

    /// A member's refusal reaches the others, filed by its rank and the exchange's tag, and
    /// an exchange waiting for parts fails with it at its next check.
    #[test]
    fn a_refusal_fails_the_exchange_it_names() {
        let svcs = services(3);
        svcs[2].refuse(0x77, &[0, 1, 2], "no thread for it");
        assert_eq!(svcs[0].refused(0x78, &[0, 1, 2]), None, "another exchange is not concerned");
        struct Nobody;
        impl Members for Nobody {
            fn gone(&self, _: usize) -> Option<String> {
                None
            }
        }
        let never = AtomicBool::new(false);
        let ex = Exchange { call: "ncclCommSplit", tag: 0x77, deadline: Instant::now() + Duration::from_secs(20),
                            abort: &never, members: &Nobody };
        let started = Instant::now();
        let e = svcs[0].allgather(&ex, &[0, 1, 2], 0, vec![1]).expect_err("rank 2 refused");
        assert_eq!(e.code, crate::error::Code::RemoteError);
        assert!(e.msg.contains("rank 2 cannot take part in ncclCommSplit: no thread for it"), "{}", e.msg);
        assert!(started.elapsed() < Duration::from_secs(10), "failed only after {:?}", started.elapsed());
    }

    /// A failure told reaches every peer that still listens within the budget, kept by who
    /// told it; one that is gone costs the others nothing.
    #[test]
    fn a_failure_told_is_kept_by_its_teller() {
        let svcs = services(4);
        svcs[1].stop(); // gone: refuses
        let each = Duration::from_millis(100);
        let told = svcs[0].tell_failed([1, 2, 3].into_iter(), b"\x06lost rank 5", each, Duration::from_secs(5));
        assert_eq!(told, 2, "ranks 2 and 3 took it");
        for r in [2, 3] {
            let deadline = Instant::now() + Duration::from_secs(10);
            while svcs[r].told_failed(0).is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            assert_eq!(svcs[r].told_failed(0).as_deref(), Some(&b"\x06lost rank 5"[..]), "rank {r} kept it");
            assert_eq!(svcs[r].told_failed(1), None, "rank 1 told nothing");
        }
    }

    fn messages_arrive_when(handicap: impl Fn(&Service)) {
        let ip: std::net::IpAddr = "127.0.0.1".parse().unwrap();
        let a = Service::start(ip, 0xfeed, 0).unwrap();
        let b = Service::start(ip, 0xfeed, 1).unwrap();
        a.set_peers(vec![a.addr, b.addr]);
        b.set_peers(vec![a.addr, b.addr]);
        handicap(&b);
        let never = AtomicBool::new(false);
        for k in 0..5u32 {
            a.send(1, 9, &k.to_le_bytes()).unwrap();
            let got = b.recv(0, 9, Instant::now() + Duration::from_secs(10), &never);
            assert_eq!(got.ok(), Some(k.to_le_bytes().to_vec()), "message {k} arrived");
        }
    }
}
