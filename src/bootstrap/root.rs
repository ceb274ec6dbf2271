//! The root: a thread that waits for every rank of one job, checks that they agree (same
//! magic, same size, distinct ranks), and sends each of them the whole peer table — or, when
//! something is wrong, the same clear error to every rank that came. It serves one job and
//! exits, so a stale id finds nobody instead of a half-finished job.

use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::wire::{read_frame, write_frame, Reader, Writer};
use super::PeerInfo;
use crate::error::{Error, Result};

pub const HELLO: u8 = 1;
pub const TABLE: u8 = 2;
pub const FAILED: u8 = 3;

/// Run the root for one job on `listener` in a detached thread.
pub fn spawn(listener: TcpListener, magic: u64, timeout: Duration) -> Result<()> {
    std::thread::Builder::new()
        .name("nccl-rs-root".into())
        .spawn(move || serve(listener, magic, timeout))
        .map(|_| ())
        .map_err(|e| Error::os("bootstrap: spawn root thread", e))
}

struct Joined {
    stream: TcpStream,
    info: PeerInfo,
}

fn serve(listener: TcpListener, magic: u64, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    let _ = listener.set_nonblocking(true);
    let mut joined: Vec<Joined> = Vec::new();
    let mut expected: Option<usize> = None;
    let (tx, rx) = std::sync::mpsc::channel::<Hello>();
    let in_flight = Arc::new(AtomicUsize::new(0));
    loop {
        if Instant::now() >= deadline {
            let missing = missing_ranks(&joined, expected.unwrap_or(0));
            let msg = format!(
                "bootstrap: only {} of {} ranks joined within {} s; missing ranks: {}",
                joined.len(), expected.map_or("?".to_string(), |n| n.to_string()), timeout.as_secs(), missing);
            fail(&mut joined, None, &msg);
            return;
        }
        match listener.accept() {
            Ok((s, _)) => read_hello_aside(s, magic, &tx, &in_flight),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => continue,
        }
        let Ok((mut stream, rank, nranks, info)) = rx.try_recv() else {
            std::thread::sleep(Duration::from_millis(1));
            continue;
        };
        let n = *expected.get_or_insert(nranks);
        let problem = if nranks != n {
            Some(format!("bootstrap: rank {rank} says the job has {nranks} ranks but an earlier rank said {n}"))
        } else if rank >= n {
            Some(format!("bootstrap: rank {rank} is out of range for {n} ranks"))
        } else if joined.iter().any(|j| j.info.rank == rank) {
            Some(format!("bootstrap: two processes claim rank {rank} (pids {} and {}): each rank must be used once",
                         joined.iter().find(|j| j.info.rank == rank).map_or(0, |j| j.info.pid), info.pid))
        } else {
            None
        };
        if let Some(msg) = problem {
            fail(&mut joined, Some(&mut stream), &msg);
            return;
        }
        joined.push(Joined { stream, info });
        if joined.len() == n {
            joined.sort_by_key(|j| j.info.rank);
            let mut w = Writer::default();
            w.u8(TABLE).u32(n as u32);
            for j in &joined {
                j.info.encode(&mut w);
            }
            for j in &mut joined {
                let _ = write_frame(&mut j.stream, &w.buf);
            }
            return;
        }
    }
}

type Hello = (TcpStream, usize, usize, PeerInfo);

/// Connections that have not said who they are yet: at most this many at once.
const MAX_PENDING: usize = 256;

/// Read a connection's hello on a thread of its own, so a silent or slow connection (half-open,
/// hostile) delays nobody; only a valid hello reaches the root's loop.
fn read_hello_aside(s: TcpStream, magic: u64, tx: &std::sync::mpsc::Sender<Hello>, in_flight: &Arc<AtomicUsize>) {
    if in_flight.fetch_add(1, Ordering::AcqRel) >= MAX_PENDING {
        in_flight.fetch_sub(1, Ordering::AcqRel);
        return; // dropped: a flood of connections cannot exhaust threads
    }
    let (tx, mine) = (tx.clone(), in_flight.clone());
    let spawned = std::thread::Builder::new().name("nccl-rs-hello".into()).spawn(move || {
        let _ = s.set_nonblocking(false);
        let _ = s.set_nodelay(true);
        if let Some(h) = hello(s, magic) {
            let _ = tx.send(h);
        }
        mine.fetch_sub(1, Ordering::AcqRel);
    });
    if spawned.is_err() {
        in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

fn hello(mut s: TcpStream, magic: u64) -> Option<Hello> {
    let frame = read_frame(&mut s, Duration::from_secs(5)).ok()?;
    let (rank, nranks, info) = parse_hello(&frame, magic)?;
    Some((s, rank, nranks, info))
}

/// A rank's hello: (rank, nranks, info), or None for anything that is not one of ours.
pub fn parse_hello(frame: &[u8], magic: u64) -> Option<(usize, usize, PeerInfo)> {
    let mut r = Reader::new(frame);
    if r.u8().ok()? != HELLO || r.u64().ok()? != magic {
        return None; // not one of ours: drop it without disturbing the job
    }
    let rank = r.u32().ok()? as usize;
    let nranks = r.u32().ok()? as usize;
    let info = PeerInfo::decode(&mut r).ok()?;
    Some((rank, nranks, info))
}

fn missing_ranks(joined: &[Joined], n: usize) -> String {
    let missing: Vec<String> = (0..n).filter(|r| !joined.iter().any(|j| j.info.rank == *r)).map(|r| r.to_string()).collect();
    if missing.is_empty() { "unknown (no rank arrived)".into() } else { missing.join(", ") }
}

fn fail(joined: &mut [Joined], extra: Option<&mut TcpStream>, msg: &str) {
    crate::warn!("{msg}");
    let mut w = Writer::default();
    w.u8(FAILED).str(msg);
    for j in joined.iter_mut() {
        let _ = write_frame(&mut j.stream, &w.buf);
    }
    if let Some(s) = extra {
        let _ = write_frame(s, &w.buf);
    }
}
