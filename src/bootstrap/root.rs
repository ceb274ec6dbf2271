//! The root: a thread that waits for every rank of one job, checks that they agree (same
//! magic, same size, distinct ranks), and sends each of them the whole peer table — or, when
//! something is wrong, the same clear error to every rank that came. It serves one job and
//! exits, so a stale id finds nobody instead of a half-finished job.

use std::net::{TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use super::wire::{write_frame, Reader, Writer};
use super::PeerInfo;
use crate::error::{Error, Result};

pub const HELLO: u8 = 1;
pub const TABLE: u8 = 2;
pub const FAILED: u8 = 3;
/// Like FAILED, for a job some ranks never joined in time (ncclTimeout, not a bad argument).
pub const TIMED_OUT: u8 = 4;
/// Like FAILED, for a job the root itself cannot serve (out of file descriptors):
/// ncclSystemError, not a bad argument.
pub const FAILED_SYSTEM: u8 = 6;
/// From a rank, instead of its hello: it failed before it could join (no listening port, no
/// interface, no thread), and why; the root then fails the job rather than wait for it.
pub const CANNOT_JOIN: u8 = 7;
/// Like FAILED, for a job one of whose ranks could not join: ncclRemoteError.
pub const FAILED_REMOTE: u8 = 8;
/// Like FAILED, for a job whose ranks run different builds: ncclInvalidUsage, as NVIDIA's
/// library answers mismatched versions.
pub const FAILED_USAGE: u8 = 9;
/// Not an answer yet: the ranks that joined are told which ones the root still waits for
/// (once, after half the time allowed), and keep waiting.
pub const WAITING: u8 = 5;

/// Run the root for one job on `listener` in a detached thread.
/// `timeout`: NCCL_INIT_TIMEOUT_S, or None to wait for the ranks as long as it takes.
pub fn spawn(listener: TcpListener, magic: u64, timeout: Option<Duration>) -> Result<()> {
    std::thread::Builder::new()
        .name("nccl-rs-root".into())
        .spawn(move || {
            serve(listener, magic, timeout);
        })
        .map(|_| ())
        .map_err(|e| Error::os("bootstrap: spawn root thread", e))
}

struct Joined {
    stream: TcpStream,
    info: PeerInfo,
}

/// A connection that has not sent a whole hello yet.
struct Unheard {
    stream: TcpStream,
    buf: Vec<u8>,
    since: Instant,
}

/// How long a connection may take to send its hello, and how many may wait at once (the
/// oldest is dropped first: a real rank speaks as soon as it connects, so it always gets in).
const HELLO_TIME: Duration = Duration::from_secs(5);
const MAX_UNHEARD: usize = 512;
/// How long the root may find no file descriptor for a rank's connection before the job fails.
const STARVED_FOR: Duration = Duration::from_secs(2);
/// How long a root whose job a rank could not join still tells the ranks that come.
const LINGER: Duration = Duration::from_secs(10);

/// What one look at the listener and the unheard connections found.
#[derive(Default)]
struct Polled {
    /// Something came (a connection, bytes).
    busy: bool,
    hello: Option<Hello>,
    /// A connection waits that this process has no file descriptor left to take.
    starved: Option<std::io::Error>,
    /// A rank that could not join: its connection, its rank, the job's size and why.
    cannot_join: Option<(TcpStream, usize, usize, String)>,
    /// A hello of this job from another build: its connection, its rank and its source.
    other_build: Option<(TcpStream, u32, u64)>,
}

/// Accept everything waiting, read what each unheard connection sent, and return the first
/// complete, valid hello. Garbage, silence past HELLO_TIME and closed connections are dropped.
fn poll_hellos(listener: &TcpListener, unheard: &mut Vec<Unheard>, magic: u64) -> Polled {
    let mut busy = false;
    let mut starved = None;
    loop {
        let s = match crate::transport::fds::made(|| listener.accept().map(|(s, _)| s)) {
            Ok(s) => s,
            Err(e) if crate::transport::fds::out_of_fds(&e) => {
                starved = Some(e);
                break;
            }
            Err(_) => break,
        };
        busy = true;
        if s.set_nonblocking(true).is_err() {
            continue;
        }
        if unheard.len() >= MAX_UNHEARD {
            unheard.remove(0);
        }
        unheard.push(Unheard { stream: s, buf: Vec::new(), since: Instant::now() });
    }
    let mut k = 0;
    while k < unheard.len() {
        let u = &mut unheard[k];
        let mut chunk = [0u8; 4096];
        let keep = match std::io::Read::read(&mut u.stream, &mut chunk) {
            Ok(0) => false,
            Ok(n) => {
                busy = true;
                u.buf.extend_from_slice(&chunk[..n]);
                let want = u.buf.get(..4).map(|l| 4 + u32::from_le_bytes([l[0], l[1], l[2], l[3]]) as usize);
                match want {
                    Some(w) if w > 4 + super::wire::MAX_FRAME => false,
                    Some(w) if u.buf.len() >= w => {
                        match parse_hello(&u.buf[4..w], magic) {
                            Some(Heard::Hello(r, n, info)) => {
                                let u = unheard.swap_remove(k);
                                let _ = u.stream.set_nonblocking(false);
                                let _ = u.stream.set_nodelay(true);
                                return Polled { busy: true, hello: Some((u.stream, r, n, info)), starved, ..Polled::default() };
                            }
                            Some(Heard::OtherBuild { rank, source }) => {
                                let u = unheard.swap_remove(k);
                                let _ = u.stream.set_nonblocking(false);
                                return Polled { busy: true, starved, other_build: Some((u.stream, rank, source)), ..Polled::default() };
                            }
                            None => {}
                        }
                        if let Some((r, n, why)) = parse_cannot_join(&u.buf[4..w], magic) {
                            let u = unheard.swap_remove(k);
                            let _ = u.stream.set_nonblocking(false);
                            return Polled { busy: true, starved, cannot_join: Some((u.stream, r, n, why)), ..Polled::default() };
                        }
                        false // a whole frame that is not a hello of ours
                    }
                    _ => true,
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => u.since.elapsed() < HELLO_TIME,
            Err(_) => false,
        };
        if keep {
            k += 1;
        } else {
            unheard.swap_remove(k);
        }
    }
    Polled { busy, starved, ..Polled::default() }
}

/// How a root's job ended.
#[derive(Debug, PartialEq)]
enum Served {
    /// Every rank came and has the peer table.
    Table,
    /// Nobody used the id.
    Unused,
    /// The ranks that came were told why not (this message).
    Failed(String),
}

/// A root that no rank has used for this long (NCCL_INIT_TIMEOUT_S unset) stops: one of
/// ncclCommInitRankScalable's spare ids, or one never handed out.
const UNUSED_ROOT: Duration = Duration::from_secs(300);
/// How long a root with nothing coming sleeps before it looks at its deadlines again.
const ROOT_TICK: Duration = Duration::from_millis(200);

fn serve(listener: TcpListener, magic: u64, timeout: Option<Duration>) -> Served {
    // `gather` owns the listener, so it is closed before any rank hears back: rank 0 may host
    // the next root at the same address (NCCL_COMM_ID) as soon as it has its answer, and a
    // listener still open there would make that bind fail.
    match gather(listener, magic, timeout) {
        Gathered::Unused => Served::Unused,
        Gathered::All(mut joined) => {
            joined.sort_by_key(|j| j.info.rank);
            let mut w = Writer::default();
            w.u8(TABLE).u32(joined.len() as u32);
            for j in &joined {
                j.info.encode(&mut w);
            }
            // This process's own ranks last: one of them may finish its init, and its process
            // end, at once (a rank with nothing more to do), and with it this thread; by then
            // every other rank's table is in its socket, which delivers it all the same.
            let own = std::process::id();
            joined.sort_by_key(|j| j.info.pid == own);
            for j in &mut joined {
                let _ = write_frame(&mut j.stream, &w.buf);
            }
            Served::Table
        }
        Gathered::Failed { mut joined, mut extra, kind, msg } => {
            fail(&mut joined, extra.as_mut(), kind, &msg);
            Served::Failed(msg)
        }
    }
}

/// How the wait for a job's ranks ended ([`gather`]).
enum Gathered {
    /// Every rank came.
    All(Vec<Joined>),
    /// Nobody used the id.
    Unused,
    /// The ranks that came (and `extra`, one not counted among them) are to be told why not.
    Failed { joined: Vec<Joined>, extra: Option<TcpStream>, kind: u8, msg: String },
}

/// Wait on `listener` (closed when this returns) until every rank of the job has joined, the
/// job cannot go on, or nobody used the id.
fn gather(listener: TcpListener, magic: u64, timeout: Option<Duration>) -> Gathered {
    let started = Instant::now();
    let deadline = timeout.map(|t| started + t);
    let unused_after = timeout.unwrap_or(UNUSED_ROOT);
    let limit = crate::params::limit_text(timeout);
    let mut warn_at = Some(started + deadline.map_or(Duration::from_secs(10), super::service::warn_after));
    let _ = listener.set_nonblocking(true);
    let mut joined: Vec<Joined> = Vec::new();
    let mut expected: Option<usize> = None;
    let mut unheard: Vec<Unheard> = Vec::new();
    let mut starved_since: Option<Instant> = None;
    loop {
        // An init that hangs names the ranks it waits for long before it gives up.
        if let (Some(at), Some(n)) = (warn_at, expected) {
            if Instant::now() >= at {
                warn_at = None;
                say_waiting(&mut joined, n, started.elapsed(), &limit);
            }
        }
        if joined.is_empty() && unheard.is_empty() && started.elapsed() >= unused_after {
            // An id nobody used (one of ncclCommInitRankScalable's spares, or one never handed
            // out): nobody waits, so nothing to report but at INFO.
            crate::info!(BOOTSTRAP, "bootstrap: no rank used this unique id within {} s; its root stops",
                         unused_after.as_secs());
            return Gathered::Unused;
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            let missing = missing_ranks(&joined, expected.unwrap_or(0));
            let msg = format!(
                "bootstrap: only {} of {} ranks joined within {} s; missing: {}",
                joined.len(), expected.map_or("?".to_string(), |n| n.to_string()), timeout.unwrap_or_default().as_secs(),
                missing);
            return Gathered::Failed { joined, extra: None, kind: TIMED_OUT, msg };
        }
        let Polled { busy, hello, starved: out_of_fds, cannot_join, other_build } = poll_hellos(&listener, &mut unheard, magic);
        if let Some((stream, rank, source)) = other_build {
            // Its messages, and ours to it, would be misread: the job is refused, it included.
            let at = stream.peer_addr().map_or("?".into(), |a| a.ip().to_string());
            let msg = format!(
                "bootstrap: rank {rank} (at {at}) runs another build of nccl-rs than the root's process (its source \
                 {source:016x}, the root's {:016x}): every rank must load the same libnccl.so.2 (NCCL_DEBUG=VERSION \
                 names each process's source)", crate::SOURCE);
            return Gathered::Failed { joined, extra: Some(stream), kind: FAILED_USAGE, msg };
        }
        if let Some((stream, rank, n, why)) = cannot_join {
            // It will never come: the others are told at once, not left waiting for it, those
            // still on their way too for a while (after that they find no root).
            take_the_others(&listener, &mut unheard, magic, &mut joined, rank, n);
            let msg = format!("bootstrap: rank {rank} could not join the job: {why}");
            return Gathered::Failed { joined, extra: Some(stream), kind: FAILED_REMOTE, msg };
        }
        match out_of_fds {
            // A rank that connected cannot be taken: it would wait for ever, and the others
            // with it. Briefly (another thread may be closing files), then the job fails.
            Some(e) if starved_since.get_or_insert_with(Instant::now).elapsed() >= STARVED_FOR => {
                let msg = format!(
                    "bootstrap: the root (in process {}, with rank 0) cannot take the connections of the job's ranks \
                     ({} of {} have joined): {e}{}", std::process::id(), joined.len(),
                    expected.map_or("?".to_string(), |n| n.to_string()), crate::transport::fds::hint(&e));
                return Gathered::Failed { joined, extra: None, kind: FAILED_SYSTEM, msg };
            }
            Some(_) => {}
            None => starved_since = None,
        }
        let Some((stream, rank, nranks, info)) = hello else {
            if out_of_fds.is_some() {
                // (The waiting connection keeps the listener readable: no wait for it.)
                std::thread::sleep(Duration::from_millis(1));
            } else if !busy {
                // Asleep until a connection or bytes come, looking at the clock every tick.
                // (It slept 1-20 ms and looked again: 100 unused ids, each a root until
                // UNUSED_ROOT, took 13% of a core between them.)
                let fds: Vec<_> = std::iter::once(listener.as_fd()).chain(unheard.iter().map(|u| u.stream.as_fd())).collect();
                crate::transport::socket::wait_any_readable(&fds, ROOT_TICK);
            }
            continue;
        };
        let n = *expected.get_or_insert(nranks);
        if let Some(msg) = hello_problem(&joined, rank, nranks, n, info.pid) {
            return Gathered::Failed { joined, extra: Some(stream), kind: FAILED, msg };
        }
        joined.push(Joined { stream, info });
        if joined.len() == n {
            return Gathered::All(joined);
        }
    }
}

/// Tell every rank that joined (`joined`, of `n`) that the job still waits, after `waited`, for
/// the ranks missing: each says it at WARN, not only the process of the root.
fn say_waiting(joined: &mut [Joined], n: usize, waited: Duration, limit: &str) {
    let msg = format!("bootstrap: {} of {n} ranks have joined after {} s; waiting for {} ({limit})",
                      joined.len(), waited.as_secs(), missing_ranks(joined, n));
    let mut w = Writer::default();
    w.u8(WAITING).str(&msg);
    for j in joined {
        let _ = write_frame(&mut j.stream, &w.buf);
    }
}

/// Rank `rank` of `n` cannot join: take the others still on their way for a while
/// ([`LINGER`]), so that they are told at once rather than left to find no root.
fn take_the_others(listener: &TcpListener, unheard: &mut Vec<Unheard>, magic: u64, joined: &mut Vec<Joined>,
                   rank: usize, n: usize) {
    let until = Instant::now() + LINGER;
    let mut cannot = 1; // ranks that said they cannot join (each has its own error)
    while joined.len() + cannot < n && Instant::now() < until {
        let polled = poll_hellos(listener, unheard, magic);
        match (polled.hello, polled.cannot_join) {
            (Some((stream, r, _, info)), _) if r != rank => joined.push(Joined { stream, info }),
            (_, Some(_)) => cannot += 1,
            (Some(_), None) => {}
            (None, None) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
}

/// What is wrong with a hello from rank `rank` (process `pid`) saying the job has `nranks`,
/// where the ranks before it said `n` and `joined` have joined, if anything.
fn hello_problem(joined: &[Joined], rank: usize, nranks: usize, n: usize, pid: u32) -> Option<String> {
    if nranks != n {
        return Some(format!("bootstrap: rank {rank} says the job has {nranks} ranks but an earlier rank said {n}"));
    }
    if rank >= n {
        return Some(format!("bootstrap: rank {rank} is out of range for {n} ranks"));
    }
    joined.iter().find(|j| j.info.rank == rank).map(|first| {
        format!("bootstrap: two processes claim rank {rank} (pids {} and {pid}): each rank must be used once",
                first.info.pid)
    })
}

type Hello = (TcpStream, usize, usize, PeerInfo);

/// A rank's word that it cannot join: (rank, nranks, why), or None for anything else.
pub fn parse_cannot_join(frame: &[u8], magic: u64) -> Option<(usize, usize, String)> {
    let mut r = Reader::new(frame);
    if r.u8().ok()? != CANNOT_JOIN || r.u64().ok()? != magic {
        return None;
    }
    let rank = r.u32().ok()? as usize;
    let nranks = r.u32().ok()? as usize;
    let why = r.str().ok()?;
    Some((rank, nranks, why.chars().take(2000).collect()))
}

/// A hello of this job's magic. (Its large variant is the one the root keeps, once per rank:
/// boxing it would buy nothing.)
#[allow(clippy::large_enum_variant)]
pub enum Heard {
    /// (rank, nranks, info).
    Hello(usize, usize, PeerInfo),
    /// From a rank of another build, whose info this one may misread.
    OtherBuild { rank: u32, source: u64 },
}

/// A rank's hello, or None for anything that is not one of ours. Its first fields — kind,
/// magic, source, rank — are the same in every build, and so is the root's failure frame
/// (kind, text), so that a root can refuse a rank of another build and tell it why.
/// (Builds before the source was sent have the rank and size where it is: a mismatch too.)
pub fn parse_hello(frame: &[u8], magic: u64) -> Option<Heard> {
    let mut r = Reader::new(frame);
    if r.u8().ok()? != HELLO || r.u64().ok()? != magic {
        return None; // not one of ours: drop it without disturbing the job
    }
    let source = r.u64().ok()?;
    let rank = r.u32().ok()?;
    if source != crate::SOURCE {
        return Some(Heard::OtherBuild { rank, source });
    }
    let nranks = r.u32().ok()? as usize;
    let info = PeerInfo::decode(&mut r).ok()?;
    Some(Heard::Hello(rank as usize, nranks, info))
}

fn missing_ranks(joined: &[Joined], n: usize) -> String {
    missing_text(joined.iter().map(|j| j.info.rank), n)
}

/// The ranks below `n` not among `seen`, for a message.
fn missing_text(seen: impl Iterator<Item = usize>, n: usize) -> String {
    // At most SHOWN named (n comes from a hello: a wrong nranks may be huge), then a count.
    const SHOWN: usize = 32;
    let mut seen: Vec<usize> = seen.collect();
    seen.sort_unstable();
    seen.dedup();
    let absent = n.saturating_sub(seen.iter().filter(|&&r| r < n).count());
    let named: Vec<String> = (0..n).filter(|r| seen.binary_search(r).is_err()).take(SHOWN).map(|r| r.to_string()).collect();
    let more = if absent > named.len() { format!(" and {} more", absent - named.len()) } else { String::new() };
    match named.len() {
        0 => "unknown (no rank arrived)".into(),
        1 => format!("rank {}{more}", named[0]),
        _ => format!("ranks {}{more}", named.join(", ")),
    }
}

fn fail(joined: &mut [Joined], extra: Option<&mut TcpStream>, kind: u8, msg: &str) {
    crate::warn!("{msg}");
    let mut w = Writer::default();
    w.u8(kind).str(msg);
    if let Some(s) = extra {
        let _ = write_frame(s, &w.buf);
    }
    // This process's own ranks last, as with the table: one told may end the process, and
    // this thread with it, before the others are.
    let own = std::process::id();
    joined.sort_by_key(|j| j.info.pid == own);
    for j in joined.iter_mut() {
        let _ = write_frame(&mut j.stream, &w.buf);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An id nobody uses ends quietly (nothing at WARN: ncclCommInitRankScalable's spare ids
    /// are such); a job some rank never joins fails, naming it.
    #[test]
    fn missing_ranks_are_named_up_to_a_limit() {
        assert_eq!(missing_text([0, 2].into_iter(), 3), "rank 1");
        assert_eq!(missing_text([1].into_iter(), 4), "ranks 0, 2, 3");
        assert_eq!(missing_text(std::iter::empty(), 0), "unknown (no rank arrived)");
        let huge = missing_text([0].into_iter(), usize::MAX / 2);
        assert!(huge.starts_with("ranks 1, 2, 3,") && huge.ends_with(&format!(" and {} more", usize::MAX / 2 - 1 - 32)), "{huge}");
    }

    fn info(rank: usize) -> PeerInfo {
        PeerInfo { rank, pid: 1, cuda_dev: 0, host_hash: 1, pid_ns: 1, shm_fs: 1, hostname: "h".into(),
                   addr: "127.0.0.1:1".parse().expect("an address"), slice: 4096, nsocks: 1,
                   links: crate::bootstrap::Links::local(), gpu: Default::default() }
    }

    /// A hello that disagrees on the job's size, names a rank past its end, or claims a rank
    /// already taken fails the job, saying which.
    #[test]
    fn a_hello_that_cannot_be_taken_says_why() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a listener");
        let stream = TcpStream::connect(listener.local_addr().expect("its address")).expect("a connection");
        let joined = [Joined { stream, info: PeerInfo { pid: 41, ..info(1) } }];
        assert_eq!(hello_problem(&joined, 2, 4, 4, 42), None);
        let size = hello_problem(&joined, 2, 8, 4, 42).unwrap_or_default();
        assert!(size.contains("rank 2 says the job has 8 ranks but an earlier rank said 4"), "{size}");
        let past = hello_problem(&joined, 4, 4, 4, 42).unwrap_or_default();
        assert!(past.contains("rank 4 is out of range for 4 ranks"), "{past}");
        let twice = hello_problem(&joined, 1, 4, 4, 42).unwrap_or_default();
        assert!(twice.contains("two processes claim rank 1 (pids 41 and 42)"), "{twice}");
    }

    /// A rank of another build (another source) fails the job with ncclInvalidUsage, naming
    /// both builds, for it and for the ranks that came before it; its info, which this build
    /// may misread, is never decoded. Before, a hello in another layout was misread or taken
    /// for garbage, and the job waited for that rank.
    #[test]
    fn a_rank_of_another_build_fails_the_job() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a listener");
        let addr = listener.local_addr().expect("its address");
        let root = std::thread::spawn(move || serve(listener, 7, Some(Duration::from_secs(20))));
        let hello = |source: u64, rank: u32| {
            let mut s = TcpStream::connect(addr).expect("a connection");
            let mut w = Writer::default();
            w.u8(HELLO).u64(7).u64(source).u32(rank).u32(2);
            info(rank as usize).encode(&mut w);
            write_frame(&mut s, &w.buf).expect("the hello");
            s
        };
        let mut ours = hello(crate::SOURCE, 0);
        // (Rank 0's hello in first, or the other's may be heard first: either way, failed.)
        std::thread::sleep(Duration::from_millis(100));
        let mut theirs = hello(crate::SOURCE ^ 0xff, 1);
        let theirs_hex = format!("{:016x}", crate::SOURCE ^ 0xff);
        match root.join().expect("the root") {
            Served::Failed(msg) => assert!(msg.contains("rank 1 (at 127.0.0.1) runs another build")
                                           && msg.contains(&theirs_hex) && msg.contains(&format!("{:016x}", crate::SOURCE)), "{msg}"),
            other => panic!("{other:?}"),
        }
        for s in [&mut ours, &mut theirs] {
            let frame = super::super::wire::read_frame(s, Duration::from_secs(5)).expect("the root's answer");
            let mut r = Reader::new(&frame);
            assert_eq!(r.u8().expect("a kind"), FAILED_USAGE);
            assert!(r.str().expect("a text").contains("runs another build"));
        }
    }

    #[test]
    fn an_unused_id_ends_quietly_and_a_missing_rank_is_named() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a listener");
        assert_eq!(serve(listener, 7, Some(Duration::from_millis(50))), Served::Unused);

        let listener = TcpListener::bind("127.0.0.1:0").expect("a listener");
        let addr = listener.local_addr().expect("its address");
        let root = std::thread::spawn(move || serve(listener, 7, Some(Duration::from_millis(500))));
        let mut s = TcpStream::connect(addr).expect("a connection");
        let mut w = Writer::default();
        w.u8(HELLO).u64(7).u64(crate::SOURCE).u32(0).u32(2);
        info(0).encode(&mut w);
        write_frame(&mut s, &w.buf).expect("the hello");
        match root.join().expect("the root") {
            Served::Failed(msg) => assert!(msg.contains("only 1 of 2") && msg.contains("missing: rank 1"), "{msg}"),
            other => panic!("{other:?}"),
        }
    }
}
