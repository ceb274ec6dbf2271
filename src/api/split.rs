//! Communicators made from communicators: `ncclCommSplit` (colors and keys) and
//! `ncclCommShrink` (drop ranks, dead ones included). The members exchange, over the parent's
//! bootstrap service, the address of a fresh service for the child, so no root is needed and
//! a dead excluded rank is never waited for. `ncclCommGrow` (add ranks) does need one, since
//! the new ranks know nothing of the parent: its coordinator's `ncclCommGetUniqueId` starts
//! it, the parent's service hands its id to the other existing ranks, and every member joins
//! it as an init does, the existing ranks keeping their numbers.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::bootstrap::{self, wire::{Reader, Writer}, PeerInfo, Service, UniqueId};
use crate::comm::handle::{self, Handle};
use crate::comm::{Comm, Ready};
use crate::error::{Error, Result};

use super::config::Config;

pub const NOCOLOR: i32 = -1;
const TAG_SPLIT: u32 = 0x5350_0000;
const TAG_SHRINK: u32 = 0x5348_0000;
const TAG_GROW: u32 = 0x4752_0000;
/// NCCL_SHRINK_ABORT.
const SHRINK_ABORT: i32 = 1;

/// Where the new communicator's handle goes once it exists (NULL for "not a member").
pub type Sink = Box<dyn FnOnce(Option<Handle>) + Send>;

fn child_hash(parent: u64, seq: u64, what: u64) -> u64 {
    bootstrap::id::magic_of(&format!("{parent:x}/{seq}/{what}"))
}

fn me_info(comm: &Comm, parent: &Ready, addr: std::net::SocketAddr) -> PeerInfo {
    PeerInfo { addr, ..parent.peers[comm.rank].clone() }
}

/// What the members of a split, shrink or grow are known by: a hash of which ranks are left
/// out (none for a split or a grow), alike on every member.
fn set_key(excluded: &[bool]) -> u64 {
    bootstrap::id::magic_of(&format!("{excluded:?}"))
}

/// This rank's place in the exchange of a split, shrink or grow, while its part is not on its
/// way. The exchange passes parts round the members, so none gets past a member that never
/// sends its own: if this rank fails before it does (no thread to run it, no port for the
/// child), or never runs it (a spawn that failed, a dropped group), the last copy's drop tells
/// the other members why (`Service::refuse`), and their exchange fails, naming this rank,
/// instead of waiting for ever (NCCL_INIT_TIMEOUT_S unset, as PyTorch leaves it). One copy
/// goes with the exchange; the caller keeps one until the call has started, so that a start
/// that fails (its closure dropped unrun) is told with its reason.
#[derive(Clone)]
struct Absent(Arc<std::sync::Mutex<Absence>>);

struct Absence {
    comm: Arc<Comm>,
    call: &'static str,
    tag: u32,
    members: Vec<usize>,
    /// Set once the part is on its way: the exchange then fails, or not, on its own.
    joined: bool,
    why: Option<String>,
}

impl Absent {
    fn new(comm: &Arc<Comm>, call: &'static str, tag: u32, members: &[usize]) -> Absent {
        Absent(Arc::new(std::sync::Mutex::new(Absence {
            comm: comm.clone(), call, tag, members: members.to_vec(), joined: false, why: None,
        })))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Absence> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The part is on its way (the exchange starts).
    fn join(&self) {
        self.lock().joined = true;
    }

    /// `r`, noting why it failed, if it did (the first reason stays).
    fn noting<T>(&self, r: Result<T>) -> Result<T> {
        if let Err(e) = &r {
            if e.code != crate::error::Code::InProgress {
                self.lock().why.get_or_insert_with(|| e.msg.clone());
            }
        }
        r
    }
}

impl Drop for Absence {
    fn drop(&mut self) {
        if self.joined {
            return;
        }
        let Some(ready) = self.comm.ready_if_any() else { return };
        let why = self.why.clone()
            .or_else(|| self.comm.async_error().map(|e| e.msg))
            .unwrap_or_else(|| "its call ended before it sent its part".to_string());
        let said = match ready.peers.get(self.comm.rank) {
            Some(me) => format!("its call failed ({}, pid {}): {why}", me.hostname, me.pid),
            None => format!("its call failed: {why}"),
        };
        crate::info!(INIT, "rank {}: {} failed before this rank took part: telling the other members", self.comm.rank,
                     self.call);
        ready.service.refuse(self.tag, &self.members, &said);
    }
}

/// Finish a child: its peers (renumbered), its service, its communicator, its handle.
fn make_child(comm: &Comm, rank: usize, peers: Vec<PeerInfo>, service: Service, hash: u64, config: Config) -> Handle {
    let child = Arc::new(Comm::new(rank, peers.len(), comm.cuda_dev, config, hash));
    finish_child(comm, &child, peers, service);
    handle::register(child)
}

/// Make `child` (made from `comm`) ready: its peers, renumbered, and its service.
fn finish_child(comm: &Comm, child: &Comm, mut peers: Vec<PeerInfo>, service: Service) {
    for (i, p) in peers.iter_mut().enumerate() {
        p.rank = i;
    }
    service.set_rank(child.rank as u32);
    service.set_peers(peers.iter().map(|p| p.addr).collect());
    let slice = peers.iter().map(|p| p.slice as usize).min().unwrap_or(1 << 16).max(4096);
    child.set_ready(Ready::new(peers, service, slice));
    crate::info!(INIT, "comm {:#x} rank {} nranks {} - made from comm {:#x} rank {}", child.hash, child.rank, child.nranks,
                 comm.hash, comm.rank);
}

pub(crate) fn encode(color: i32, key: i32, info: Option<&PeerInfo>) -> Vec<u8> {
    let mut w = Writer::default();
    w.u32(color as u32).u32(key as u32).u8(info.is_some() as u8);
    if let Some(i) = info {
        i.encode(&mut w);
    }
    w.buf
}

pub(crate) fn decode(b: &[u8]) -> Result<(i32, i32, Option<PeerInfo>)> {
    let mut r = Reader::new(b);
    let color = r.u32()? as i32;
    let key = r.u32()? as i32;
    let info = if r.u8()? != 0 { Some(PeerInfo::decode(&mut r)?) } else { None };
    Ok((color, key, info))
}

/// `ncclCommSplit`, run now or (inside a group) at the outermost ncclGroupEnd.
pub fn split(comm: Arc<Comm>, color: i32, key: i32, config: Option<Config>, sink: Sink) -> Result<()> {
    if color < 0 && color != NOCOLOR {
        return Err(Error::invalid_arg(format!("color {color} must be non-negative or NCCL_SPLIT_NOCOLOR")));
    }
    comm.ready()?;
    let (seq, tag) = comm.next_split(set_key(&vec![false; comm.nranks]));
    let parent = comm.clone();
    let members: Vec<usize> = (0..comm.nranks).collect();
    let absence = Absent::new(&comm, "ncclCommSplit", TAG_SPLIT ^ tag, &members);
    let part = absence.clone();
    let run = move || -> Result<()> {
        let parent = comm.ready()?;
        let hash = child_hash(comm.hash, seq, color as u64);
        let service = match color {
            NOCOLOR => None,
            _ => Some(part.noting(bootstrap::local_ip().and_then(|ip| Service::start(ip, hash, 0)))?),
        };
        let mine = encode(color, key, service.as_ref().map(|s| me_info(&comm, parent, s.addr)).as_ref());
        let ex = comm.exchange("ncclCommSplit", TAG_SPLIT ^ tag);
        part.join();
        let all = parent.service.allgather(&ex, &members, comm.rank, mine)
            .map_err(|e| e.context(format!("rank {}: ncclCommSplit", comm.rank)))?;
        let Some(service) = service else {
            sink(None);
            return Ok(());
        };
        let mut group: Vec<(i32, usize, PeerInfo)> = Vec::new();
        for (old_rank, b) in all.iter().enumerate() {
            let (c, k, info) = decode(b)?;
            if c == color {
                let info = info.ok_or_else(|| Error::internal("split: a member sent no address"))?;
                group.push((k, old_rank, info));
            }
        }
        group.sort_by_key(|(k, r, _)| (*k, *r));
        let rank = group.iter().position(|(_, r, _)| *r == comm.rank).ok_or_else(|| Error::internal("split: not in own group"))?;
        let peers = group.into_iter().map(|(_, _, i)| i).collect();
        sink(Some(make_child(&comm, rank, peers, service, hash, config.unwrap_or_else(|| comm.config.clone()))));
        Ok(())
    };
    absence.noting(run_on(parent, Box::new(run)))
}

/// Run a split's or grow's exchange over `parent` now, at the outermost ncclGroupEnd, or, for
/// a nonblocking parent outside a group, in the background: the call returns
/// `ncclInProgress`, the parent says so until the exchange is done, and the new handle is
/// written then (NCCL's order: PyTorch polls the parent, then waits for the handle to appear).
/// So a rank that never makes the call leaves the others polling, free to abort, not stuck in it.
fn run_on(parent: Arc<Comm>, run: crate::group::Deferred) -> Result<()> {
    if !parent.config.blocking && crate::group::depth() == 0 {
        return crate::group::background::start(vec![parent], run);
    }
    crate::group::run_or_defer(run)
}

/// `ncclCommShrink`: the ranks not in `exclude` make a new communicator, in their old order.
pub fn shrink(comm: Arc<Comm>, exclude: Vec<i32>, config: Option<Config>, flags: i32, sink: Sink) -> Result<()> {
    if flags & !SHRINK_ABORT != 0 {
        return Err(Error::invalid_arg(format!("unknown shrink flags {flags:#x}")));
    }
    let n = comm.nranks;
    let mut excluded = vec![false; n];
    for &r in &exclude {
        if r < 0 || r as usize >= n {
            return Err(Error::invalid_arg(format!("excluded rank {r} is out of range for {n} ranks")));
        }
        excluded[r as usize] = true;
    }
    if excluded[comm.rank] {
        return Err(Error::invalid_arg(format!("rank {} calls ncclCommShrink but is in its exclude list", comm.rank)));
    }
    comm.ready_for_management()?;
    if flags & SHRINK_ABORT != 0 {
        // NCCL: the parent's outstanding operations are aborted (a call waiting on an
        // excluded, stuck rank returns, and the callers' streams get past it); its bootstrap
        // service, which the shrink uses, stays up, as after ncclCommRevoke.
        comm.revoked.store(true, Ordering::Release);
    }
    let list_hash = set_key(&excluded);
    let (seq, tag) = comm.next_split(list_hash);
    // Unlike a split's, the child's rank and size are known now: a nonblocking one is handed
    // back at once, in progress, and made ready in the background.
    let members: Vec<usize> = (0..n).filter(|r| !excluded[*r]).collect();
    let me = members.iter().position(|r| *r == comm.rank).unwrap_or(0);
    let hash = child_hash(comm.hash, seq, list_hash);
    let config = config.unwrap_or_else(|| comm.config.clone());
    let background = !config.blocking && crate::group::depth() == 0;
    let child = Arc::new(Comm::new(me, members.len(), comm.cuda_dev, config, hash));
    let made = child.clone();
    let absence = Absent::new(&comm, "ncclCommShrink", TAG_SHRINK ^ tag, &members);
    let part = absence.clone();
    let run = move || -> Result<()> {
        let parent = comm.ready_for_management()?;
        let service = part.noting(bootstrap::local_ip().and_then(|ip| Service::start(ip, hash, me as u32)))?;
        let mine = encode(list_hash as i32, 0, Some(&me_info(&comm, parent, service.addr)));
        let ex = comm.exchange("ncclCommShrink", TAG_SHRINK ^ tag);
        part.join();
        let all = parent.service.allgather(&ex, &members, me, mine)
            .map_err(|e| e.context(format!("rank {}: ncclCommShrink", comm.rank)))?;
        let mut peers = Vec::with_capacity(members.len());
        for (i, b) in all.iter().enumerate() {
            let (h, _, info) = decode(b)?;
            if h != list_hash as i32 {
                return Err(Error::invalid_usage(format!(
                    "ncclCommShrink: rank {} excluded different ranks than rank {}", members[i], comm.rank)));
            }
            peers.push(info.ok_or_else(|| Error::internal("shrink: a member sent no address"))?);
        }
        finish_child(&comm, &made, peers, service);
        Ok(())
    };
    if background {
        // Handed back only once the thread runs: a failed spawn leaves no handle behind.
        let failed = child.clone();
        let spawned = std::thread::Builder::new()
            .name("nccl-rs-shrink".into())
            .spawn(move || {
                let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(run))
                    .unwrap_or_else(|_| Err(Error::internal("ncclCommShrink panicked")));
                if let Err(e) = result {
                    failed.set_async_error(&e);
                }
            })
            .map_err(|e| Error::os("spawn the shrink thread", e));
        absence.noting(spawned)?;
        sink(Some(handle::register(child)));
        return Err(Error::in_progress());
    }
    absence.noting(crate::group::run_or_defer(Box::new(move || {
        run()?;
        sink(Some(handle::register(child)));
        Ok(())
    })))
}

/// `ncclCommGetUniqueId`: the id of one grow of `comm`, asked for by the rank that coordinates
/// it (a new root, listening from now on for the grown communicator's ranks).
pub fn grow_id(comm: &Comm) -> Result<[u8; bootstrap::id::ID_BYTES]> {
    comm.ready()?;
    bootstrap::new_root_id()
}

/// Who calls `ncclCommGrow`.
pub enum Grower {
    /// A rank of the communicator, which keeps its number; the coordinator passes the id.
    Existing(Arc<Comm>, Option<[u8; bootstrap::id::ID_BYTES]>),
    /// A new rank: its number in the grown communicator, and the coordinator's id.
    Joining(i32, [u8; bootstrap::id::ID_BYTES]),
}

/// `ncclCommGrow`, run now or (inside a group) at the outermost ncclGroupEnd: a communicator
/// of `nranks`, the parent's ranks and the new ones.
pub fn grow(who: Grower, nranks: i32, config: Option<Config>, sink: Sink) -> Result<()> {
    let n = usize::try_from(nranks).map_err(|_| Error::invalid_arg(format!("nRanks {nranks} is negative")))?;
    match who {
        Grower::Existing(comm, id) => {
            if n <= comm.nranks {
                return Err(Error::invalid_arg(format!(
                    "nRanks {nranks} must be larger than the communicator's {} ranks", comm.nranks)));
            }
            if let Some(id) = &id {
                UniqueId::decode(id)?;
            }
            comm.ready()?;
            let (_, tag) = comm.next_split(set_key(&vec![false; comm.nranks]));
            let parent = comm.clone();
            let members: Vec<usize> = (0..comm.nranks).collect();
            let absence = Absent::new(&comm, "ncclCommGrow", TAG_GROW ^ tag, &members);
            let part = absence.clone();
            let run = move || -> Result<()> {
                let parent = comm.ready()?;
                let mut w = Writer::default();
                w.u8(id.is_some() as u8).bytes(&id.unwrap_or([0; bootstrap::id::ID_BYTES]));
                let ex = comm.exchange("ncclCommGrow", TAG_GROW ^ tag);
                part.join();
                let all = parent.service.allgather(&ex, &members, comm.rank, w.buf)
                    .map_err(|e| e.context(format!("rank {}: ncclCommGrow", comm.rank)))?;
                let id = coordinators_id(&all)?;
                let config = config.unwrap_or_else(|| comm.config.clone());
                join_grown(comm.rank, n, comm.cuda_dev, config, &id, sink)
            };
            absence.noting(run_on(parent, Box::new(run)))
        }
        Grower::Joining(rank, id) => {
            if rank < 0 || rank >= nranks {
                return Err(Error::invalid_arg(format!("rank {rank} is out of range for {nranks} ranks")));
            }
            let id = UniqueId::decode(&id)?;
            let dev = super::init::caller_device();
            let config = config.unwrap_or_default();
            if !config.blocking && crate::group::depth() == 0 {
                // As a nonblocking init: there is no parent to poll, so the new communicator is
                // handed back at once, in progress, and joins the job in the background.
                let comm = Arc::new(Comm::new(rank as usize, n, dev, config, id.magic));
                super::init::spawn_init(comm.clone(), id)?;
                sink(Some(handle::register(comm)));
                return Err(Error::in_progress());
            }
            crate::group::run_or_defer(Box::new(move || join_grown(rank as usize, n, dev, config, &id, sink)))
        }
    }
}

/// The id that exactly one existing rank (the coordinator) passed, from everyone's part of
/// the exchange: a flag byte and the id.
fn coordinators_id(all: &[Vec<u8>]) -> Result<UniqueId> {
    let mut found: Option<(usize, Vec<u8>)> = None;
    for (r, b) in all.iter().enumerate() {
        let mut rd = Reader::new(b);
        let (has, id) = (rd.u8()?, rd.bytes()?);
        if has == 0 {
            continue;
        }
        match &found {
            Some((first, theirs)) if theirs.as_slice() != id => {
                return Err(Error::invalid_usage(format!(
                    "ncclCommGrow: ranks {first} and {r} passed different ids (only the coordinator passes one)")));
            }
            Some(_) => {}
            None => found = Some((r, id.to_vec())),
        }
    }
    let (_, id) = found.ok_or_else(|| Error::invalid_usage(
        "ncclCommGrow: no rank of the communicator passed the id (the rank that called ncclCommGetUniqueId must)"))?;
    let id: [u8; bootstrap::id::ID_BYTES] =
        id.try_into().map_err(|_| Error::internal("grow: an id of the wrong size"))?;
    UniqueId::decode(&id)
}

/// Joins the grown communicator as rank `rank` of `nranks`, as an init does.
fn join_grown(rank: usize, nranks: usize, dev: i32, config: Config, id: &UniqueId, sink: Sink) -> Result<()> {
    let comm = Arc::new(Comm::new(rank, nranks, dev, config, id.magic));
    if let Err(e) = super::init::run_init(&comm, id) {
        comm.shutdown();
        return Err(e.context(format!("rank {rank}: ncclCommGrow")));
    }
    crate::info!(INIT, "comm {:#x} rank {} nranks {} - grown", comm.hash, rank, nranks);
    sink(Some(handle::register(comm)));
    Ok(())
}
