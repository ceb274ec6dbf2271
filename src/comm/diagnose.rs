//! What a rank waiting on a peer finds out about it ([`PeerRuns`]): that it runs the same call,
//! another, or nothing, is stopped or silent, and which rank holds the call up, followed along
//! the ranks each waits on.

use std::sync::atomic::Ordering;

#[cfg(doc)]
use super::ready::WaitNote;

use super::cycle::*;
use super::ready::Ready;
use super::status::*;
use super::Comm;
use crate::error::{Error, Result};
use crate::transport::{Stamp, STAMP_BYTES};

/// Where a peer in a call on another communicator says what holds that call up.
pub(super) const HELD_UP_THERE: &str = ", held up there by ";

/// What a peer this rank waits on is doing (see [`Comm::peer_runs`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PeerRuns {
    Same,
    Nothing,
    Unknown,
    /// It issued this operation (its stamp), or the one named, and waits for its CUDA stream
    /// to reach it: work queued on that stream before the call has not finished.
    Stream(Stamp),
    /// As `Stream`, while a stream of that rank waits in ncclWaitSignal for signals that have
    /// not come from the rank named, as the words say ([`Ready::note_held_stream`]): what holds
    /// its stream up, most likely.
    StreamHeld(Stamp, usize, String),
    /// Its communicator is suspended (ncclCommSuspend): it cannot issue the call until resumed.
    Suspended,
    /// It runs nothing on this communicator, and its process is in these calls on others.
    Elsewhere(String),
    /// It waits in ncclWaitSignal for these signals.
    Signals(String),
    /// No answer, again, after [`SILENT_AFTER`] of none (at the first unanswered request if its
    /// process is stopped): said once per silence (then `Unknown` again), with what its process
    /// is doing where that can be seen, and for how long it has not answered; and, where its
    /// process is of another host, the rank of that host that saw it ([`Comm::process_state`]).
    Silent(Silence, std::time::Duration, Option<usize>),
    /// It has not issued the call: it is in sends or receives with other ranks (the first
    /// shown), which it may well make first.
    OtherPeers(Stamp),
    /// As `OtherPeers`, where that rank found what holds its own call up: the rank named (the
    /// first), as it says ([`WaitNote`]). A pipeline's stages name its late stage this way.
    OtherHeld(Stamp, usize, String),
    /// As `OtherPeers`, having followed the notes of the ranks each waits on to the furthest
    /// (the rank), none of which has found yet what holds it up ([`Comm::follow_notes`]).
    OtherVia(Stamp, usize),
    /// It runs the call too, held up by this rank (the first) as it says ([`WaitNote`]: that
    /// rank described, with why).
    Waits(usize, String),
    /// It runs the collective too, as does this rank, the furthest reached along the ranks each
    /// waits on ([`Comm::follow`]), none of which has found yet what holds it up.
    Via(usize),
    /// It sends to this rank and receives nothing from it while this rank does the same (or
    /// both only receive): neither call can finish. The words say which. (`peer_runs` asks
    /// again and makes it an error.)
    Crossed(String),
}

/// How long a peer may leave status requests unanswered before a rank waiting on it says so.
pub const SILENT_AFTER: std::time::Duration = std::time::Duration::from_secs(10);

/// How long a status request waits for its answer.
const STATUS_WITHIN: std::time::Duration = std::time::Duration::from_secs(1);

/// What a peer that does not answer is doing, as far as this host can tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Silence {
    /// Its process is stopped (SIGSTOP, Ctrl-Z).
    Stopped,
    /// Its process is stopped by a debugger.
    Traced,
    /// Its process is in uninterruptible sleep (a disk, a driver).
    DiskSleep,
    /// Its process runs (or sleeps) but its bootstrap service did not answer in time.
    Busy,
    /// Another host's: nothing more to see from here.
    Remote,
}

/// The state letter of process `pid` of this host, from /proc (Linux: `stat`'s third field:
/// R, S, D, T, t, Z...), if it can be read.
pub(super) fn process_state(pid: u32) -> Option<u8> {
    let stat = std::fs::read(format!("/proc/{pid}/stat")).ok()?;
    // The command name (second field) may hold spaces and parentheses: the state follows the last ')'.
    let close = stat.iter().rposition(|&b| b == b')')?;
    stat[close + 1..].iter().copied().find(|b| !b.is_ascii_whitespace())
}

/// How long a rank of another host is given to say how a peer's process there is.
const WITNESS_WITHIN: std::time::Duration = std::time::Duration::from_millis(500);

impl Silence {
    /// Same host: from the process state in /proc.
    fn of_process(pid: u32) -> Silence {
        Silence::of_state(process_state(pid))
    }

    /// From a process state letter (`process_state`'s).
    fn of_state(state: Option<u8>) -> Silence {
        match state {
            Some(b'T') => Silence::Stopped,
            Some(b't') => Silence::Traced,
            Some(b'D') => Silence::DiskSleep,
            _ => Silence::Busy,
        }
    }

    /// Is its process stopped (a signal, or a debugger)?
    fn stopped(self) -> bool {
        matches!(self, Silence::Stopped | Silence::Traced)
    }

    fn describe(self) -> &'static str {
        match self {
            Silence::Stopped => "its process is stopped (SIGSTOP or Ctrl-Z: SIGCONT resumes it)",
            Silence::Traced => "its process is stopped by a debugger",
            Silence::DiskSleep => "its process is in uninterruptible sleep (waiting on a disk or a driver)",
            Silence::Busy => "its process is there, but its bootstrap service did not answer within 1 s (an \
                              overloaded host, or the process is stuck)",
            Silence::Remote => "its host did not answer within 1 s",
        }
    }
}

impl PeerRuns {
    /// What a rank that waited on the peer in `mine` says of it, if anything: the peer has not
    /// issued the call (or not got to that launch of its CUDA graph), or its CUDA stream has not
    /// reached it.
    pub fn why_waiting(&self, mine: &Stamp, describe: &dyn Fn(&Stamp) -> String) -> Option<String> {
        match self {
            PeerRuns::Nothing if crate::plan::ops::launched_by_graph(mine) => Some(
                "which has not got to that launch of its CUDA graph (it has not launched the graph, or its stream has \
                 not reached the launch)".to_string()),
            PeerRuns::Nothing => Some("which has not issued that call".to_string()),
            PeerRuns::Elsewhere(calls) => Some(format!(
                "which {}: its process is in {calls}{}",
                if crate::plan::ops::launched_by_graph(mine) { "has not got to that launch of its CUDA graph" }
                else { "has not issued that call" },
                // (Held up there: the rank named is the cause, not the order of the calls.)
                if calls.contains(HELD_UP_THERE) { "" }
                else { " (ranks that call communicators in different orders wait for each other)" })),
            PeerRuns::Signals(what) => Some(format!("which has not issued that call: it is in ncclWaitSignal, waiting \
                                                     for {what}")),
            PeerRuns::Suspended => Some("which has not issued that call: its communicator is suspended (ncclCommSuspend \
                                         without ncclCommResume)".to_string()),
            PeerRuns::Stream(theirs) => Some(format!(
                "which issued {} and waits for its CUDA stream to get through it: work queued on that stream has not \
                 finished", describe(theirs))),
            PeerRuns::StreamHeld(theirs, _, text) => Some(format!(
                "which issued {} and waits for its CUDA stream to get through it, while a stream of that rank waits in \
                 ncclWaitSignal for signals from {text}", describe(theirs))),
            PeerRuns::Silent(how, for_, seen_by) => Some(format!(
                "which has not answered status requests for {:.0} s or more: {}{}", for_.as_secs_f64().floor(),
                how.describe(), seen_by_words(*seen_by))),
            PeerRuns::OtherPeers(theirs) | PeerRuns::OtherVia(theirs, _) => Some(format!(
                "which has not issued that call: it is in {} (and waits on that rank)", describe(theirs))),
            PeerRuns::OtherHeld(theirs, _, text) => Some(format!(
                "which has not issued that call: it is in {}, held up by {text}", describe(theirs))),
            PeerRuns::Waits(_, text) => Some(format!("which runs that call too and is held up by {text}")),
            PeerRuns::Crossed(how) => Some(how.clone()),
            PeerRuns::Same | PeerRuns::Via(_) | PeerRuns::Unknown => None,
        }
    }

    /// The rank to name for a wait on `peer`: the one holding it up, if it said so.
    pub fn culprit(&self, peer: usize) -> usize {
        match self {
            PeerRuns::Waits(rank, _) | PeerRuns::StreamHeld(_, rank, _) | PeerRuns::OtherHeld(_, rank, _) => *rank,
            _ => peer,
        }
    }

    /// Did the peer answer (anything but `Unknown` and `Silent`)?
    pub fn answered(&self) -> bool {
        !matches!(self, PeerRuns::Unknown | PeerRuns::Silent(..))
    }
}

/// Who saw a process of another host as described, in words (nothing for this host's).
fn seen_by_words(seen_by: Option<usize>) -> String {
    seen_by.map_or(String::new(), |w| format!(" (as rank {w}, of its host, sees it)"))
}

/// Ranks a look follows past a peer that runs the same collective ([`Comm::follow`]): with
/// each rank keeping the furthest it reached, a chain of n ranks is followed to its end in
/// about log9(n) looks (a ring of 4096 ranks: 4).
const FOLLOW_HOPS: usize = 8;

/// What a walk along the ranks each waits on does after asking one ([`Comm::walk`]).
pub(super) enum Step {
    /// It found what holds the call up.
    Found(PeerRuns),
    /// The rank asked is reached; on to the rank its note names, if any.
    On(Option<usize>),
    /// Stop before it: it tells nothing.
    Stop,
}

/// What a rank asked along the ranks a collective waits on does ([`Comm::hop`]).
enum Hop {
    /// It runs the call too; its note, if any: the rank holding it up, or, with no words, the
    /// furthest it reached ([`WaitNote`]).
    Runs(Option<(usize, String)>),
    /// It holds the call up: the rank to name (it, or the rank it found holding it up) and why
    /// (as `PeerRuns::why_waiting` says it).
    Holds(usize, String),
    /// Nothing to tell.
    Unknown,
}

/// What status bytes say a rank does, for a rank waiting on it in `mine`, where their tag says
/// it (it waits for its CUDA stream, is suspended, runs nothing here but other communicators,
/// waits for signals; an unknown tag: `Unknown`). None: running (or failed: see the caller).
fn tagged_runs(status: &[u8], mine: &Stamp) -> Option<PeerRuns> {
    match status.split_first() {
        Some((&STATUS_STREAM, rest)) => {
            // Ours, if it waits for its stream to reach this very call; else the first.
            let mut stamps = rest.chunks_exact(STAMP_BYTES);
            // (Stamps as their messages carry them: without a send's or receive's direction.)
            let plain = crate::plan::ops::without_role(*mine);
            let theirs = stamps.clone().find(|s| *s == plain.as_slice()).or_else(|| stamps.next());
            Some(theirs.and_then(|t| t.try_into().ok()).map_or(PeerRuns::Unknown, PeerRuns::Stream))
        }
        Some((&STATUS_SUSPENDED, _)) => Some(PeerRuns::Suspended),
        Some((&STATUS_ELSEWHERE, rest)) => Some(PeerRuns::Elsewhere(String::from_utf8_lossy(rest).into_owned())),
        Some((&STATUS_SIGNALS, rest)) => Some(PeerRuns::Signals(String::from_utf8_lossy(rest).into_owned())),
        Some((&STATUS_RUNNING, _)) | Some((&STATUS_FAILED, _)) | None => None,
        Some(_) => Some(PeerRuns::Unknown),
    }
}

/// `runs`, a peer's tagged status, with what its note says holds its stream up, where it waits
/// for its stream and says that ([`Ready::note_held_stream`]).
fn held_stream(runs: PeerRuns, waits: Option<(usize, &[u8])>) -> PeerRuns {
    match (runs, waits) {
        (PeerRuns::Stream(theirs), Some((rank, text))) if !text.is_empty() => {
            PeerRuns::StreamHeld(theirs, rank, String::from_utf8_lossy(text).into_owned())
        }
        (runs, _) => runs,
    }
}

/// A peer in sends or receives with other ranks (the first: `first`), with what its note says
/// holds it up there, if it found that (not this rank `me`: a cycle's ranks say so otherwise).
fn other_held(first: Stamp, waits: Option<(usize, &[u8])>, me: usize) -> PeerRuns {
    match waits {
        Some((rank, text)) if rank != me && !text.is_empty() => {
            PeerRuns::OtherHeld(first, rank, String::from_utf8_lossy(text).into_owned())
        }
        _ => PeerRuns::OtherPeers(first),
    }
}

/// Is a peer in collective `theirs` ahead of this rank, in `mine`? Past this rank's collective,
/// which it finished, so made too (had it made another, what it sent would fail here on
/// arrival); or, while this rank is in a send or receive with it, with one of the two's
/// finished sends still to be received (`settled` false: it finished its part). Either way
/// it is this rank that is behind, stopped or slow, not a mismatch (found by a probe that
/// stopped processes with SIGSTOP: a rank continued in broadcast #16 asked the peer it waited
/// on, which had sent its part and gone on to all-reduce #17, and called that a mismatch).
fn ahead_of(theirs: &Stamp, mine: &Stamp, settled: bool) -> bool {
    use crate::plan::ops::{coll_seq, p2p_bytes, same_operation};
    // (Another step of the same operation's exchanges, CUDA mode's: ahead or behind, the same
    // call; a stopped rank continued in step 2 found its peer in step 4.)
    if p2p_bytes(mine).is_none() && theirs != mine && same_operation(theirs, mine) {
        return true;
    }
    match (coll_seq(theirs), coll_seq(mine), p2p_bytes(mine)) {
        (Some(t), Some(m), None) => t > m,
        (Some(_), _, Some(_)) => !settled,
        _ => false,
    }
}

/// Is a peer that has issued `issued` collectives past this rank's collective `mine`? Then it
/// issued it and runs a later call: what it sent for it is on its way, not a call in its place
/// (found by stopping a process of a CUDA-mode soak: a rank, resumed, finished its part and
/// went on to a send to the rank that asked, which called that a mismatch). A rank that made
/// a send in place of the collective has issued only the ones before it.
pub(super) fn past(mine: &Stamp, issued: u64) -> bool {
    crate::plan::ops::coll_seq(mine).is_some_and(|m| issued > m)
}

impl Comm {
    /// What to say of `peer`'s process if it is of this host and stopped (SIGSTOP, Ctrl-Z, a
    /// debugger), for waits that cannot ask it what it runs.
    /// Another host's is not asked here: for threads that must not wait on a request (a
    /// sender's), or that look every second (see [`Comm::peer_stopped_anywhere`]).
    pub fn peer_stopped(&self, peer: usize) -> Option<&'static str> {
        let how = self.local_state(self.ready.get()?, peer)?;
        how.stopped().then(|| how.describe())
    }

    /// As [`Comm::peer_stopped`], for a peer of any host: one of another host is seen by a rank
    /// of its host ([`Comm::process_state`], up to two requests of [`WITNESS_WITHIN`]), which
    /// the words name. For waits that may take that long to look (not a sender's thread).
    pub fn peer_stopped_anywhere(&self, peer: usize) -> Option<String> {
        let (how, seen_by) = self.process_state(self.ready.get()?, peer)?;
        how.stopped().then(|| format!("{}{}", how.describe(), seen_by_words(seen_by)))
    }

    /// Is `peer`'s process of this host (its state can be read here)?
    pub fn of_this_host(&self, peer: usize) -> bool {
        self.ready.get().and_then(|ready| self.host_peer(ready, peer)).is_some()
    }

    /// `peer`'s entry, if its process is of this host (its pid means something here).
    fn host_peer<'r>(&self, ready: &'r Ready, peer: usize) -> Option<&'r crate::bootstrap::PeerInfo> {
        let (me, p) = (ready.peers.get(self.rank)?, ready.peers.get(peer)?);
        p.same_pids(me).then_some(p)
    }

    /// How `peer`'s process is, if it is of this host (/proc).
    fn local_state(&self, ready: &Ready, peer: usize) -> Option<Silence> {
        self.host_peer(ready, peer).map(|p| Silence::of_process(p.pid))
    }

    /// How `peer`'s process is: seen in /proc if it is of this host, else as a rank of its host
    /// (another process) says it sees it, asked within [`WITNESS_WITHIN`] (at most two asked),
    /// with that rank. None: nothing can be seen (no rank of its host answered). Before, a
    /// stopped process of another host was named only after [`SILENT_AFTER`], as one whose host
    /// did not answer.
    fn process_state(&self, ready: &Ready, peer: usize) -> Option<(Silence, Option<usize>)> {
        if let Some(how) = self.local_state(ready, peer) {
            return Some((how, None));
        }
        let p = ready.peers.get(peer)?;
        let witnesses = ready.peers.iter().filter(|w| w.rank != self.rank && w.same_pids(p) && !w.same_process(p));
        witnesses.take(2).find_map(|w| {
            let said = ready.service.process_of(w.rank, peer as u32, WITNESS_WITHIN).ok()?;
            let &state = said.first()?;
            Some((Silence::of_state(Some(state)), Some(w.rank)))
        })
    }

    /// Has `peer` closed this communicator (destroyed or aborted it) while its process goes on?
    /// Then it will never connect or send again. For waits on a peer that has no connection to
    /// carry that news (one it had is closed by it and says so itself, after what came on it).
    pub fn peer_closed(&self, peer: usize) -> Option<String> {
        match self.ready.get()?.service.reach(peer, std::time::Duration::from_secs(1)) {
            crate::bootstrap::service::Reach::Refuses(why) => Some(why),
            _ => None,
        }
    }

    /// Ask `peer` what it is running, when this rank has waited on it for `mine` for a while.
    /// Err: it runs other operations, so the two ranks issued different calls. Otherwise
    /// whether it runs `mine` too (a slow peer) or nothing (it has not made the call yet).
    pub fn peer_runs(&self, peer: usize, mine: &Stamp, describe: &dyn Fn(&Stamp) -> String) -> Result<PeerRuns> {
        let runs = self.peer_runs_once(peer, mine, describe, false)?;
        if let Some(ready) = self.ready.get() {
            ready.note_wait(peer, mine, &runs, runs.why_waiting(mine, describe), || self.describe_peer(peer));
        }
        Ok(runs)
    }

    pub(super) fn peer_runs_once(&self, peer: usize, mine: &Stamp, describe: &dyn Fn(&Stamp) -> String, again: bool)
                      -> Result<PeerRuns> {
        let Some(ready) = self.ready.get() else { return Ok(PeerRuns::Unknown) };
        let answer = match ready.service.status(peer, STATUS_WITHIN) {
            Ok(s) => {
                ready.silent.lock().unwrap_or_else(|p| p.into_inner()).remove(&peer);
                s
            }
            Err(e) => {
                crate::info!(COLL, "rank {}: no status from rank {peer}: {}", self.rank, e.msg);
                return Ok(self.silence(ready, peer));
            }
        };
        let answer = Answer::read(&answer);
        let (counts, status) = (answer.about, answer.status);
        if let Some((&STATUS_FAILED, [code, msg @ ..])) = status.split_first() {
            return Err(self.peer_failed(peer, *code, msg));
        }
        if let Some(runs) = tagged_runs(status, mine) {
            return Ok(held_stream(runs, answer.waits));
        }
        let theirs: Vec<Stamp> = status_stamps(status).collect();
        if theirs.is_empty() {
            return Ok(PeerRuns::Nothing);
        }
        let runs = match self.judge_running(ready, peer, mine, (&theirs, answer.issued), counts, describe)? {
            // In sends or receives with other ranks: fine, unless those wait round to this one.
            // (The second look of a confirmation walks again, whatever the pace.)
            // Else it may have found what holds it up there.
            PeerRuns::OtherPeers(first) if again || ready.may_walk(peer, mine) => {
                let waits = answer.waits;
                match self.waits_in_cycle(ready, (peer, theirs, answer.with), counts, describe) {
                    Some(how) => PeerRuns::Crossed(how),
                    None => match other_held(first, waits, self.rank) {
                        PeerRuns::OtherPeers(first) => self.follow_notes(ready, peer, first, waits.map(|(rank, _)| rank)),
                        held => held,
                    },
                }
            }
            // Held up, it may have found by whom, or how far along the ranks it waits on
            // (a collective's; looked further every 2, 4, 8, 16 s, as cycles are).
            PeerRuns::Same => match answer.waits {
                Some((rank, text)) if rank != self.rank && rank != peer && !text.is_empty() => {
                    PeerRuns::Waits(rank, String::from_utf8_lossy(text).into_owned())
                }
                via if crate::plan::ops::coll_seq(mine).is_some() => {
                    let via = via.map(|(rank, _)| rank).filter(|&r| r != self.rank);
                    match via {
                        Some(_) if again || ready.may_walk(peer, mine) => self.follow(ready, peer, via, mine, describe),
                        // (Between looks further: as far as the peer got.)
                        via => PeerRuns::Via(via.unwrap_or(peer)),
                    }
                }
                _ => PeerRuns::Same,
            },
            PeerRuns::OtherPeers(first) => other_held(first, answer.waits, self.rank),
            runs => runs,
        };
        match runs {
            // A snapshot: a small send of the peer's completes without a receive. Crossed
            // calls are still so a moment later.
            PeerRuns::Crossed(_) if !again => {
                std::thread::sleep(std::time::Duration::from_millis(200));
                self.peer_runs_once(peer, mine, describe, true)
            }
            PeerRuns::Crossed(how) => Err(Error::invalid_usage(how)),
            runs => Ok(runs),
        }
    }

    /// What `peer`, found running `theirs` while this rank waits on it in `mine`, is doing.
    /// Sends and receives are not ordered with the calls of other pairs, so a peer in ones with
    /// other ranks only has not got to this rank's call yet; one whose sends or receives with
    /// this rank cross this rank's (both only send, or both only receive) waits for ever.
    /// Collectives are: a peer in another is an error naming both calls.
    fn judge_running(&self, ready: &Ready, peer: usize, mine: &Stamp, (theirs, issued): (&[Stamp], u64), counts: (u64, u64),
                     describe: &dyn Fn(&Stamp) -> String) -> Result<PeerRuns> {
        use crate::plan::ops::{coll_seq, launched_by_graph, p2p_bytes, p2p_role, without_role};
        let plain = without_role(*mine);
        // The same call: a collective, or the send or receive that matches this rank's (where
        // both show their direction: the other one, with this rank).
        let matches = |t: &Stamp| without_role(*t) == plain && match (p2p_role(t), p2p_role(mine)) {
            (Some((theirs_send, with)), Some((mine_send, _))) => with == self.rank && theirs_send != mine_send,
            _ => true,
        };
        if theirs.iter().any(matches) {
            return Ok(PeerRuns::Same);
        }
        let with_me: Vec<(bool, Stamp)> =
            theirs.iter().filter_map(|t| p2p_role(t).filter(|&(_, p)| p == self.rank).map(|(s, _)| (s, *t))).collect();
        let mismatch = |first: &Stamp| Error::invalid_usage(format!(
            "{} issued {} where rank {} issued {}: every rank must make the same calls in the same order",
            self.describe_peer(peer), describe(first), self.rank, describe(mine)));
        // A collective against another collective, or a send or receive between the two
        // against a collective: neither finishes without the other's call. Unless the peer is
        // behind: in a collective this rank got past (an earlier one than this rank's, or, for
        // a send or receive, one this rank issued: done, or in this rank's group and waiting
        // on others), which it finishes without this rank.
        let behind = |t: &Stamp| match (coll_seq(t), coll_seq(mine), p2p_bytes(mine)) {
            (Some(theirs), Some(ours), None) => theirs < ours,
            (Some(theirs), _, Some(_)) => theirs < self.seq.load(Ordering::Relaxed),
            _ => false,
        };
        let done = ready.finished_with(peer);
        let settled = done.0 == counts.1 && counts.0 == done.1;
        let ahead = |t: &Stamp| ahead_of(t, mine, settled);
        // (The operations of a CUDA graph's launch carry no number to order them by, with the
        // calls made outside graphs or with another launch's: a peer in one may be behind or
        // ahead, found so by a stop hunt of a soak that launches graphs. Its messages' stamps
        // still tell a real mismatch when they come.)
        let unordered = |t: &Stamp| launched_by_graph(t) || launched_by_graph(mine);
        if let Some(c) = theirs.iter().find(|t| p2p_bytes(t).is_none() && !behind(t) && !ahead(t) && !unordered(t)) {
            return Err(mismatch(c));
        }
        if theirs.iter().any(|t| p2p_bytes(t).is_none() && ahead(t)) {
            return Ok(PeerRuns::Same);
        }
        let Some(&(_, first_with_me)) = with_me.first() else {
            // (Named by a send or receive it is in, if any: the collectives it is behind on
            // wait on other ranks.)
            let first = theirs.iter().find(|t| p2p_bytes(t).is_some()).unwrap_or(&theirs[0]);
            return Ok(PeerRuns::OtherPeers(*first));
        };
        if p2p_bytes(mine).is_none() {
            // (Or a message between the two is on its way: the peer, in a send or receive with
            // this rank that came before the collective, is behind, stopped or slow; found by a
            // stop hunt.)
            if past(mine, issued) || !settled {
                return Ok(PeerRuns::Same);
            }
            return Err(mismatch(&first_with_me));
        }
        // Sends and receives between the two: crossed if each only sends to the other, or
        // only receives from it (this rank's own, from its status).
        let own: Vec<bool> = status_stamps(&ready.running.lock().unwrap_or_else(|p| p.into_inner()))
            .filter_map(|s| p2p_role(&s).filter(|&(_, p)| p == peer).map(|(send, _)| send)).collect();
        let theirs_dirs: Vec<bool> = with_me.iter().map(|&(s, _)| s).collect();
        if let Some(dir) = crossed(&own, &theirs_dirs, done, counts) {
            let (what, none) = if dir { ("sends to", "receives from") } else { ("receives from", "sends to") };
            return Ok(PeerRuns::Crossed(format!(
                "{} is in {} while rank {} is in {}: each {what} the other and neither {none} it, so neither call \
                 can finish {DEADLOCK_ADVICE}",
                self.describe_peer(peer), describe(&first_with_me), self.rank, describe(mine))));
        }
        Ok(PeerRuns::Same)
    }

    /// What holds up the collective `mine`, in which this rank waits on `peer`, which runs it
    /// too and has reached rank `via` (its [`WaitNote`]) that runs it too: asked, and on along
    /// what each says it reached, for at most [`FOLLOW_HOPS`] ranks, until one that has found
    /// what holds the call up (`Waits`: that), or one that has not issued the call (`Waits`:
    /// it, with why). Else `Via`: the furthest rank reached, kept as this rank's note for the
    /// ranks that wait on it. Without it, the news of what holds a call up went back one rank
    /// per look (2 s), round a ring: in one of 16 ranks, up to 9 s; of 64, over 30 s.
    fn follow(&self, ready: &Ready, peer: usize, via: Option<usize>, mine: &Stamp, describe: &dyn Fn(&Stamp) -> String)
              -> PeerRuns {
        let walked = self.walk(ready, peer, via, |at| match self.hop(ready, at, mine, describe) {
            Hop::Runs(Some((rank, text))) if !text.is_empty() => match rank == self.rank {
                true => Step::Stop,
                false => Step::Found(PeerRuns::Waits(rank, text)),
            },
            Hop::Runs(via) => Step::On(via.map(|(rank, _)| rank)),
            Hop::Holds(culprit, why) => {
                Step::Found(PeerRuns::Waits(culprit, format!("{}, {why}", self.describe_peer(at))))
            }
            Hop::Unknown => Step::Stop,
        });
        walked.unwrap_or_else(PeerRuns::Via)
    }

    /// What holds up `peer`, which is in sends or receives with other ranks (the first: `first`)
    /// and has got as far as rank `via` (its note) along the ranks each waits on: that rank
    /// asked for its note, and on along the notes, for at most [`FOLLOW_HOPS`] ranks, until one
    /// names the rank holding it up (`OtherHeld`: that). Else `OtherVia`: the furthest rank
    /// reached, kept as this rank's note. As [`Comm::follow`] does for a collective: without it,
    /// the news went back a few stages per look along a pipeline (32 stages: 13 s, now 3 s).
    fn follow_notes(&self, ready: &Ready, peer: usize, first: Stamp, via: Option<usize>) -> PeerRuns {
        let walked = self.walk(ready, peer, via, |at| {
            let Ok(bytes) = ready.service.status(at, STATUS_WITHIN) else { return Step::Stop };
            match Answer::read(&bytes).waits {
                Some((rank, text)) if !text.is_empty() => match rank == self.rank {
                    true => Step::Stop,
                    false => Step::Found(PeerRuns::OtherHeld(first, rank, String::from_utf8_lossy(text).into_owned())),
                },
                // (The way on; or none: it has found nothing yet.)
                note => Step::On(note.map(|(rank, _)| rank)),
            }
        });
        walked.unwrap_or_else(|reached| PeerRuns::OtherVia(first, reached))
    }

    /// A walk from `peer` (which this rank waits on) along the ranks each waits on, from `via`
    /// on, each asked once (`look`), for at most [`FOLLOW_HOPS`] ranks: what one found holds
    /// the call up, else the furthest rank reached (`peer` if none).
    fn walk(&self, ready: &Ready, peer: usize, via: Option<usize>, mut look: impl FnMut(usize) -> Step)
            -> std::result::Result<PeerRuns, usize> {
        let (mut reached, mut next) = (peer, via);
        let mut asked = vec![self.rank, peer];
        while let Some(at) = next.filter(|r| !asked.contains(r) && *r < ready.peers.len()) {
            if asked.len() >= FOLLOW_HOPS + 2 {
                break;
            }
            asked.push(at);
            match look(at) {
                Step::Found(runs) => return Ok(runs),
                Step::On(way) => {
                    reached = at;
                    next = way;
                }
                Step::Stop => break,
            }
        }
        Err(reached)
    }

    /// What rank `at`, not a peer this rank waits on directly, does about the collective `mine`
    /// ([`Comm::follow`]). Only what holds the call up counts against it: a rank that issued
    /// the call (and is past it, or in it on another thread) or failed (its failure is told
    /// otherwise) or does not answer, tells nothing.
    fn hop(&self, ready: &Ready, at: usize, mine: &Stamp, describe: &dyn Fn(&Stamp) -> String) -> Hop {
        use crate::plan::ops::{p2p_bytes, same_operation};
        let Ok(bytes) = ready.service.status(at, STATUS_WITHIN) else { return Hop::Unknown };
        let answer = Answer::read(&bytes);
        let issued = past(mine, answer.issued);
        let runs = match answer.status.first() {
            Some(&STATUS_FAILED) => return Hop::Unknown,
            Some(&STATUS_RUNNING) | None => {
                let theirs: Vec<Stamp> = status_stamps(answer.status).collect();
                if theirs.iter().any(|t| same_operation(t, mine)) {
                    return Hop::Runs(answer.waits.map(|(rank, text)| (rank, String::from_utf8_lossy(text).into_owned())));
                }
                match (theirs.iter().find(|t| p2p_bytes(t).is_some()), theirs.first()) {
                    _ if issued => return Hop::Unknown,
                    (Some(first), _) => other_held(*first, answer.waits, self.rank),
                    // (An earlier collective: it has yet to finish it.)
                    (None, Some(first)) => return Hop::Holds(at, format!("which has not issued that call: it is in {}",
                                                                     describe(first))),
                    (None, None) => PeerRuns::Nothing,
                }
            }
            _ => match tagged_runs(answer.status, mine) {
                Some(PeerRuns::Stream(theirs)) if issued && !same_operation(&theirs, mine) => return Hop::Unknown,
                Some(PeerRuns::Unknown) | None => return Hop::Unknown,
                Some(PeerRuns::Stream(theirs)) => held_stream(PeerRuns::Stream(theirs), answer.waits),
                Some(_) if issued => return Hop::Unknown,
                Some(runs) => runs,
            },
        };
        // (The rank to name: it, or the one it says holds it up, as a stage of a pipeline may.)
        runs.why_waiting(mine, describe).map_or(Hop::Unknown, |why| Hop::Holds(runs.culprit(at), why))
    }

    /// `peer` did not answer: `Silent` once it has not for [`SILENT_AFTER`] (once per silence,
    /// whoever asks), else `Unknown`. A process of this host that is stopped (SIGSTOP, Ctrl-Z,
    /// a debugger) is said at once: it answers nothing until resumed, and a rank stopped for
    /// less than [`SILENT_AFTER`] was otherwise named only once resumed, as one that had not
    /// issued the call.
    fn silence(&self, ready: &Ready, peer: usize) -> PeerRuns {
        {
            let silent = ready.silent.lock().unwrap_or_else(|p| p.into_inner());
            if silent.get(&peer).is_some_and(|&(_, said)| said) {
                return PeerRuns::Unknown;
            }
        }
        // (Not under the lock: another host's rank may take a while to say.)
        let (how, seen_by) = self.process_state(ready, peer).unwrap_or((Silence::Remote, None));
        let mut silent = ready.silent.lock().unwrap_or_else(|p| p.into_inner());
        let (since, said) = silent.entry(peer).or_insert((std::time::Instant::now(), false));
        if *said || (!how.stopped() && since.elapsed() < SILENT_AFTER) {
            return PeerRuns::Unknown;
        }
        *said = true;
        // (Its first request went unanswered for the time a request is given before `since`.)
        PeerRuns::Silent(how, since.elapsed() + STATUS_WITHIN, seen_by)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer in a later collective is ahead, not in another call; one in a collective while
    /// this rank is in a send or receive with it is ahead only with a send still on its way.
    #[test]
    fn a_peer_past_this_ranks_call_is_ahead() {
        let coll = |seq: u64| {
            let mut s = [0u8; STAMP_BYTES];
            s[0] = 1;
            s[16..24].copy_from_slice(&seq.to_le_bytes());
            s
        };
        let p2p = crate::plan::ops::with_role([200u8; STAMP_BYTES], false, 1);
        assert!(crate::plan::ops::p2p_bytes(&p2p).is_some(), "a point-to-point stamp");
        assert!(ahead_of(&coll(17), &coll(16), true));
        assert!(!ahead_of(&coll(16), &coll(16), true), "the same number: the same call, or a mismatch");
        let (step2, step4) = (crate::plan::ops::control_stamp(&coll(16), 2), crate::plan::ops::control_stamp(&coll(16), 4));
        assert!(ahead_of(&step4, &step2, true) && ahead_of(&step2, &step4, true), "steps of one operation's exchanges");
        assert!(ahead_of(&step2, &coll(16), true), "a step of this rank's own operation");
        assert!(!ahead_of(&coll(15), &coll(16), true), "behind is judged apart");
        assert!(ahead_of(&coll(3), &p2p, false), "a send of the two still to be received");
        assert!(!ahead_of(&coll(3), &p2p, true), "nothing on its way: a collective against a send is a mismatch");
    }

    /// A peer that waits for its stream and notes what holds the stream (signals of a third
    /// rank) is said with that rank as the one to name; without such a note, as before.
    #[test]
    fn a_stream_held_by_signals_names_their_sender() {
        let (theirs, mine) = ([3u8; STAMP_BYTES], [4u8; STAMP_BYTES]);
        let described = |_: &Stamp| "Send #0".to_string();
        let held = held_stream(PeerRuns::Stream(theirs), Some((2, b"rank 2 (h, pid 9), which has not sent them")));
        assert_eq!(held, PeerRuns::StreamHeld(theirs, 2, "rank 2 (h, pid 9), which has not sent them".into()));
        assert_eq!(held.culprit(1), 2);
        let why = held.why_waiting(&mine, &described).unwrap_or_default();
        assert!(why.contains("issued Send #0 and waits for its CUDA stream") && why.ends_with("signals from rank 2 (h, \
                              pid 9), which has not sent them"), "{why}");
        assert_eq!(held_stream(PeerRuns::Stream(theirs), Some((2, b""))), PeerRuns::Stream(theirs), "a note of no words");
        assert_eq!(held_stream(PeerRuns::Stream(theirs), None), PeerRuns::Stream(theirs));
        assert_eq!(held_stream(PeerRuns::Suspended, Some((2, b"x"))), PeerRuns::Suspended, "only a wait for a stream");
    }

    /// A peer in sends or receives with other ranks that found what holds it up there (a
    /// pipeline's stage behind a late one) is said with that rank as the one to name; a note of
    /// no words (the way to it), or one naming the asking rank, leaves it as it was.
    #[test]
    fn a_peer_held_up_in_calls_with_others_names_what_holds_it() {
        let first = [5u8; STAMP_BYTES];
        let text = "rank 0 (h, pid 3), which has not issued that call";
        let held = other_held(first, Some((0, text.as_bytes())), 3);
        assert_eq!(held, PeerRuns::OtherHeld(first, 0, text.into()));
        assert_eq!(held.culprit(2), 0);
        let why = held.why_waiting(&[6u8; STAMP_BYTES], &|_| "a receive of 8 bytes from rank 1".to_string());
        assert_eq!(why.as_deref(), Some("which has not issued that call: it is in a receive of 8 bytes from rank 1, held up \
                                         by rank 0 (h, pid 3), which has not issued that call"));
        assert_eq!(other_held(first, Some((1, b"")), 3), PeerRuns::OtherPeers(first), "the way, not a culprit");
        assert_eq!(other_held(first, Some((3, text.as_bytes())), 3), PeerRuns::OtherPeers(first), "this rank itself");
        assert_eq!(other_held(first, None, 3), PeerRuns::OtherPeers(first));
    }

    /// A process's state as /proc shows it: this one runs or sleeps (its main thread waits for
    /// the test threads); a pid that is no process has none. The letters a rank of another host
    /// answers with map as this host's own look does.
    #[test]
    fn process_states_are_read_and_mapped() {
        assert!(matches!(process_state(std::process::id()), Some(b'R' | b'S')));
        assert_eq!(process_state(u32::MAX), None);
        assert_eq!(Silence::of_state(Some(b'T')), Silence::Stopped);
        assert_eq!(Silence::of_state(Some(b't')), Silence::Traced);
        assert_eq!(Silence::of_state(Some(b'D')), Silence::DiskSleep);
        assert_eq!(Silence::of_state(Some(b'S')), Silence::Busy);
        assert!(Silence::Stopped.stopped() && Silence::Traced.stopped() && !Silence::DiskSleep.stopped());
    }

    /// A peer that issued this rank's collective is past it; one that issued only those before
    /// is not (its send in that place is a mismatch), nor is anything for a send or receive or
    /// a graph's launch, which carry no collective number.
    #[test]
    fn a_peer_that_issued_the_collective_is_past_it() {
        let mut coll = [0u8; STAMP_BYTES];
        coll[0] = crate::plan::ops::OpKind::AllReduce as u8;
        coll[16..24].copy_from_slice(&5u64.to_le_bytes());
        assert_eq!(crate::plan::ops::coll_seq(&coll), Some(5));
        assert!(past(&coll, 6) && !past(&coll, 5) && !past(&coll, 0));
        let mut p2p = [0u8; STAMP_BYTES];
        p2p[0] = 200; // (ops::P2P_KIND)
        assert!(!past(&p2p, 100));
        let mut launch = coll;
        launch[16..24].copy_from_slice(&(crate::plan::ops::REPLAY_BIT | 5).to_le_bytes());
        assert!(!past(&launch, 100));
    }

    #[test]
    fn a_peer_elsewhere_is_described_for_calls_and_graph_launches() {
        let elsewhere = PeerRuns::Elsewhere("AllReduce #0 on communicator 0x1 as rank 1 of 2".to_string());
        let call = [0u8; STAMP_BYTES];
        let mut launch = call;
        launch[16..24].copy_from_slice(&crate::plan::ops::REPLAY_BIT.to_le_bytes());
        assert!(crate::plan::ops::launched_by_graph(&launch));
        let said = |s: &Stamp| elsewhere.why_waiting(s, &|_| String::new()).unwrap_or_default();
        assert!(said(&call).starts_with("which has not issued that call: its process is in AllReduce #0"), "{}", said(&call));
        assert!(said(&launch).starts_with("which has not got to that launch of its CUDA graph: its process is in"),
                "{}", said(&launch));
        assert!(elsewhere.answered() && !PeerRuns::Silent(Silence::Busy, SILENT_AFTER, None).answered());
    }
}
