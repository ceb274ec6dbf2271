//! Windows of ranks of this host that a rank reaches directly in CUDA mode: puts into them are
//! copies on the caller's stream ([`direct_target`]), and they answer `ncclGetPeerDevicePointer`
//! and `ncclGetLsaDevicePointer` (a rank's load/store team is itself and the ranks of its host,
//! peer access not disabled). A peer's window is asked of it once, at first use, and its CUDA
//! IPC mapping kept.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::stream::{needs_device_copy, Direct};
use crate::comm::Comm;
use crate::device::cuda::{Context, KeepCurrent};
use crate::device::host::Region;
use crate::error::{Error, Result};
use crate::transport::rma::{self as wire, Frame, PeerWindow, OP_WINDOW};

/// Where a put of `frame` to `peer` goes directly, if it does: this rank's own window, or a
/// window of a rank of this host that CUDA IPC maps here (asked of the target once, at the
/// first put into it; `NCCL_P2P_DISABLE`, `NCCL_P2P_LEVEL=LOC` stage every put). A put past
/// the end of such a window is refused here.
pub(super) fn direct_target(comm: &Comm, peer: usize, frame: &Frame) -> Result<Option<Region>> {
    let (offset, len) = (frame.offset as usize, frame.len as usize);
    if peer == comm.rank {
        let w = super::own_window(&comm.rma.inner, frame)?;
        let whole = Region::user(w.buff, 0, w.size);
        if !needs_device_copy(&[whole])? {
            return Ok(None);
        }
        super::fits(frame, w.size)?;
        return Ok(Some(whole.sub(offset, len)));
    }
    match peer_window(comm, peer, frame.window)? {
        None => Ok(None),
        Some(pw) => {
            super::fits(frame, pw.size()).map_err(|e| e.context(format!("rank {peer}'s window #{}", frame.window)))?;
            pw.region(offset, len).map(Some).ok_or_else(|| Error::internal("a put that fits is outside its window"))
        }
    }
}

/// Can this rank reach `peer`'s windows directly (CUDA mode, a rank of this host, peer access
/// not disabled)? Its load/store team is the ranks it can.
fn reaches(comm: &Comm, peer: usize) -> Result<bool> {
    if !crate::device::mode::is_cuda() {
        return Ok(false);
    }
    let ready = comm.ready()?;
    // What both ranks' settings allow (`bootstrap::Links`).
    Ok(match (ready.peers.get(comm.rank), ready.peers.get(peer)) {
        (Some(a), Some(b)) => a.direct_with(b),
        _ => false,
    })
}

/// `peer`'s window #`ordinal` as this rank reaches it directly (another rank: see `reaches`),
/// asked of the peer and mapped once, then kept for the communicator's life.
pub(super) fn peer_window(comm: &Comm, peer: usize, ordinal: u64) -> Result<Direct> {
    if !reaches(comm, peer)? {
        return Ok(None);
    }
    let key = (peer, ordinal);
    if let Some(known) = comm.rma.peer_windows.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
        return Ok(known.clone());
    }
    let ready = comm.ready()?;
    let same_process = match (ready.peers.get(comm.rank), ready.peers.get(peer)) {
        (Some(a), Some(b)) => a.same_process(b),
        _ => false,
    };
    let ctx = Context::primary(comm.cuda_dev)?;
    let _keep = KeepCurrent::new();
    ctx.make_current()?;
    let pw = open_peer_window(comm, peer, ordinal, same_process);
    Ok(comm.rma.peer_windows.lock().unwrap_or_else(|p| p.into_inner()).entry(key).or_insert(pw).clone())
}

/// `ncclGetPeerDevicePointer`: where this rank's device reaches `offset` of `peer`'s part of
/// the window — its own buffer for itself, a mapping of a peer's for a rank of this host whose
/// window CUDA IPC shares (or that is in this process), else 0 (NULL: not reachable by load
/// and store, as NCCL answers for peers outside the team).
pub fn peer_device_pointer(token: usize, offset: usize, peer: i32) -> Result<usize> {
    let (comm, w) = crate::api::mem::window_and_comm(token)?;
    let peer = super::check_peer(&comm, peer, "peer")?;
    if offset > w.size {
        return Err(Error::invalid_arg(format!("offset {offset} is past the window's {} bytes", w.size)));
    }
    if peer == comm.rank {
        return Ok(w.buff.addr() + offset);
    }
    Ok(peer_window(&comm, peer, w.ordinal)?.map_or(0, |pw| pw.addr() + offset.min(pw.size())))
}

/// `ncclGetLsaDevicePointer`: as [`peer_device_pointer`] for the `lsa_rank`-th rank of this
/// rank's load/store team (itself and the ranks `reaches` says, in rank order).
pub fn lsa_device_pointer(token: usize, offset: usize, lsa_rank: i32) -> Result<usize> {
    let (comm, _) = crate::api::mem::window_and_comm(token)?;
    let mut team = Vec::new();
    for p in 0..comm.nranks {
        if p == comm.rank || reaches(&comm, p)? {
            team.push(p);
        }
    }
    let peer = usize::try_from(lsa_rank).ok().and_then(|i| team.get(i).copied()).ok_or_else(|| Error::invalid_arg(
        format!("lsaRank {lsa_rank} is out of range: this rank's load/store team has {} rank(s)", team.len())))?;
    peer_device_pointer(token, offset, peer as i32)
}

/// The number of load/store teams (`ncclCommProperties_t.nLsaTeams`): the hosts, where ranks
/// of a host reach each other's windows (CUDA mode), else one per rank.
pub fn lsa_teams(comm: &Comm) -> usize {
    let Some(ready) = comm.ready_if_any() else { return comm.nranks };
    if !matches!(reaches(comm, comm.rank), Ok(true)) {
        return comm.nranks;
    }
    let mut hosts: Vec<&crate::bootstrap::PeerInfo> = Vec::new();
    for p in &ready.peers {
        if !hosts.iter().any(|h| h.same_host(p)) {
            hosts.push(p);
        }
    }
    hosts.len()
}

/// Ask `peer` (a rank of this host) for its window #`ordinal` and map it: None where it is not
/// device memory CUDA IPC shares, or cannot be mapped here (puts into it are staged).
fn open_peer_window(comm: &Comm, peer: usize, ordinal: u64, same_process: bool) -> Direct {
    let asked = (|| -> Result<PeerWindow> {
        let ready = comm.ready()?;
        let mut s = ready.service.connect_rma(peer)?;
        let ask = Frame { op: OP_WINDOW, ctx: 0, sig: 0, window: ordinal, offset: 0, len: 0 };
        wire::send(&mut s, &ask, Region::EMPTY)?;
        await_answer(comm, &s, peer, ordinal)?;
        let _ = s.set_read_timeout(Some(crate::params::peer_timeout()));
        let info = wire::read_info(&mut s)?;
        if !info.ok {
            return Err(Error::invalid_usage("not device memory that CUDA IPC shares"));
        }
        PeerWindow::open(&info, same_process)
    })();
    match asked {
        Ok(pw) => {
            crate::info!(P2P, "rank {} -> rank {peer}: puts into window #{ordinal} are written directly by the caller's \
                               stream ({})", comm.rank, if same_process { "same process" } else { "CUDA IPC" });
            Some(Arc::new(pw))
        }
        Err(e) => {
            crate::info!(P2P, "rank {} -> rank {peer}: puts into window #{ordinal} are staged through host memory ({})",
                         comm.rank, e.msg);
            None
        }
    }
}

/// Waits for `peer`'s answer about its window #`ordinal` on `s`, at most the peer timeout, a
/// second at a time: a peer whose process is stopped (SIGSTOP, a debugger) is named at WARN
/// once, about a second in, and an abort of this communicator ends the wait. Before, the put
/// waited in silence for as long (a stop hunt's survivors named no one). (The first put into a
/// window asks on the calling thread, in the call: `run` needs the route before it queues.)
fn await_answer(comm: &Comm, s: &std::net::TcpStream, peer: usize, ordinal: u64) -> Result<()> {
    let (since, limit) = (Instant::now(), crate::params::peer_timeout());
    let mut said = false;
    let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
    loop {
        match s.peek(&mut [0u8; 1]) {
            // (Its answer, or the end of the connection: the read says which.)
            Ok(_) => return Ok(()),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                                         | std::io::ErrorKind::Interrupted) => {}
            Err(e) => return Err(Error::os("one-sided operations: window answer", e)),
        }
        if comm.abort.load(Ordering::Acquire) {
            return Err(Error::invalid_usage("communicator aborted while asking a peer for its window"));
        }
        let waited = since.elapsed();
        if waited >= limit {
            return Err(Error::remote(format!("{} did not say where its window #{ordinal} is within {} s",
                                             comm.describe_peer(peer), limit.as_secs())));
        }
        if !said {
            if let Some(how) = comm.peer_stopped(peer) {
                said = true;
                crate::warn!("rank {}: a put waited {:.1} s for {} to say where its window #{ordinal} is: {how}",
                             comm.rank, waited.as_secs_f64(), comm.describe_peer(peer));
            }
        }
    }
}
