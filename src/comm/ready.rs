//! What init leaves a communicator ([`Ready`]): its peers, bootstrap service and connections,
//! and what it shows the peers that ask how it is doing: the status of its calls
//! ([`super::status`]) and the note of what holds them up ([`WaitNote`]).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Mutex, MutexGuard};

use super::diagnose::PeerRuns;
use super::status::*;
use crate::bootstrap::{PeerInfo, Service};
use crate::error::Error;
use crate::transport::{Conns, Stamp, STAMP_BYTES};

/// What init produced: the peer table, the bootstrap service and the connections.
pub struct Ready {
    pub peers: Vec<PeerInfo>,
    pub service: Service,
    /// Bytes per transport message (the same on every rank: the minimum of all ranks' choice).
    pub slice: usize,
    /// The all-reduce algorithm every rank forces (NCCL_ALGO); None: chosen by size, as when
    /// the ranks' settings differ (each would plan another exchange, and wait forever).
    pub algo: Option<crate::algo::Algo>,
    conns: Mutex<Conns>,
    /// Peers that have not answered a status request, since when, and whether that was said.
    pub(super) silent: Mutex<HashMap<usize, (std::time::Instant, bool)>>,
    /// The stamps of the operations this rank is running now (concatenated), which peers
    /// may ask for through the bootstrap service when they wait on this rank.
    pub running: crate::bootstrap::service::Status,
    /// Whether `running` may show anything but an idle rank: if not, a run that ends (and
    /// published nothing: see `proxy::Job::publish`) leaves it alone, without taking its lock.
    shows: std::sync::atomic::AtomicBool,
    /// Per peer, the sends to it and the receives from it this rank has finished (their
    /// last unit done), told with the status to the peer that asks: two ranks that each
    /// receive from the other are crossed only if no message of either is still on its way.
    pub p2p_done: std::sync::Arc<Vec<[std::sync::atomic::AtomicU64; 2]>>,
    /// Per peer waited on: the call waiting, when this rank may next look for a cycle through
    /// that peer, and the gap after that ([`Ready::may_walk`]).
    walks: Mutex<HashMap<usize, (Stamp, std::time::Instant, std::time::Duration)>>,
    /// What this rank last found it waits for ([`WaitNote`]), shown to peers that ask.
    pub(super) waits: Waits,
}

/// The rank a waiting rank found holding up its call (`stamp`): the peer it waits on, if that
/// peer has not issued the call (or is stopped, or in others), or the rank such a peer named in
/// turn; `text` is that rank described with why ("rank 3 (host, pid 12), which has not issued
/// that call"). A rank's status answer carries it while it is fresh and the call still runs,
/// so that ranks waiting on it in the same call, which by themselves see only a peer that runs
/// it too, name the rank holding them all up: in a ring, otherwise only that rank's
/// successor could.
///
/// With an empty `text`, a collective's rank found nothing yet but `rank`: a rank that runs
/// the call too, the furthest it reached along the ranks each waits on. A rank that asks it
/// goes on from there ([`super::Comm::follow`]), and keeps the furthest it reached in turn, so that
/// the ranks of a long chain find the rank holding it up in a few looks, not one rank per look.
pub(super) struct WaitNote {
    pub(super) stamp: Stamp,
    pub(super) rank: usize,
    pub(super) text: String,
    pub(super) at: std::time::Instant,
}

/// How long a [`WaitNote`] is shown after it was last found true (waits look every 1-2 s).
pub(super) const NOTE_FRESH: std::time::Duration = std::time::Duration::from_secs(5);

/// Kept by a communicator, shared with its status handler and [`super::elsewhere`].
pub(super) type Waits = std::sync::Arc<Mutex<Option<WaitNote>>>;

/// The note to show with status bytes `status`: fresh, and of a call that still runs.
pub(super) fn shown_note<'a>(waits: &'a Option<WaitNote>, status: &[u8]) -> Option<&'a WaitNote> {
    let plain = |s: &Stamp| crate::plan::ops::without_role(*s);
    waits.as_ref().filter(|n| n.at.elapsed() < NOTE_FRESH && status_stamps(status).any(|s| plain(&s) == plain(&n.stamp)))
}

/// The longest [`WaitNote`] text kept: ranks calling two communicators in different orders hold
/// each other up, and each one's note quotes the other's (through the process's other
/// communicators), which would grow a layer at every look for as long as they wait.
const NOTE_MAX: usize = 1024;

/// `text`, cut to [`NOTE_MAX`] bytes (at a character), "..." marking the cut.
fn capped(mut text: String) -> String {
    if text.len() > NOTE_MAX {
        let mut at = NOTE_MAX;
        while !text.is_char_boundary(at) {
            at -= 1;
        }
        text.truncate(at);
        text.push_str("...");
    }
    text
}

/// The gap between the first two looks for a cycle through one peer during one wait; it doubles
/// after each look, up to [`WALK_GAP_MAX`].
const WALK_GAP_FIRST: std::time::Duration = std::time::Duration::from_secs(2);
const WALK_GAP_MAX: std::time::Duration = std::time::Duration::from_secs(16);

impl Ready {
    pub fn new(peers: Vec<PeerInfo>, service: Service, slice: usize) -> Ready {
        let n = peers.len();
        let running = crate::bootstrap::service::Status::default();
        let first = peers.first().and_then(|p| p.links.algo);
        let algo = if peers.iter().all(|p| p.links.algo == first) {
            first
        } else {
            let name = |a: Option<crate::algo::Algo>| a.map_or("by size".to_string(), |a| format!("{a:?}"));
            let said: Vec<String> = peers.iter().map(|p| format!("rank {}: {}", p.rank, name(p.links.algo))).collect();
            crate::warn!("the ranks force different all-reduce algorithms (NCCL_ALGO; {}): every rank chooses by size",
                         said.join(", "));
            None
        };
        let p2p_done = std::sync::Arc::new((0..n).map(|_| Default::default()).collect());
        Ready { peers, service, slice, algo, conns: Mutex::new(Conns::new(n)), silent: Mutex::new(HashMap::new()), running,
                shows: Default::default(), p2p_done, walks: Mutex::default(), waits: Default::default() }
    }

    /// Whether to look now for a cycle through `peer`, which this rank waits on in `mine`: at
    /// once for a new wait, then 2, 4, 8, 16 s apart. A look asks every rank along the chain
    /// of waits (up to CYCLE_ASKS, each a connection), and ranks waiting in a long chain (a
    /// pipeline's stages for its first) looked each second: 16 in a chain opened about 60
    /// connections a second between them.
    pub(super) fn may_walk(&self, peer: usize, mine: &Stamp) -> bool {
        let now = std::time::Instant::now();
        let mut walks = self.walks.lock().unwrap_or_else(|p| p.into_inner());
        match walks.get_mut(&peer) {
            Some((waiting, next, gap)) if waiting == mine => {
                if now < *next {
                    return false;
                }
                *next = now + *gap;
                *gap = (*gap * 2).min(WALK_GAP_MAX);
            }
            _ => {
                walks.insert(peer, (*mine, now + WALK_GAP_FIRST, WALK_GAP_FIRST * 2));
            }
        }
        true
    }

    /// Keep what a look at `peer`, waited on in `mine`, found (`runs`; `describe_peer` names
    /// the peer): the rank holding the call up, if it found one ([`WaitNote`]), else the
    /// furthest rank it reached that runs the call too; no news (an answer not yet come, a
    /// silence already said) keeps the note of the same call fresh.
    pub(super) fn note_wait(&self, peer: usize, mine: &Stamp, runs: &PeerRuns, why: Option<String>,
                            describe_peer: impl FnOnce() -> String) {
        let now = std::time::Instant::now();
        let mut note = self.waits.lock().unwrap_or_else(|p| p.into_inner());
        match (runs, why) {
            // (The words of the rank found, not the way to it: a chain's notes stay one rank long.)
            (PeerRuns::Waits(rank, text) | PeerRuns::OtherHeld(_, rank, text), _) => {
                *note = Some(WaitNote { stamp: *mine, rank: *rank, text: capped(text.clone()), at: now });
            }
            // (A rank found holding the call up is shown until stale, rather than the way to it.)
            // A peer in calls with other ranks is a way too, not what holds the call up: the
            // stages of a pipeline behind a late one each named the stage before it, then the one
            // before that, and so on, a line each, until the late one.
            (PeerRuns::Via(_) | PeerRuns::OtherPeers(_) | PeerRuns::OtherVia(..), _) => {
                let rank = match runs {
                    PeerRuns::Via(rank) | PeerRuns::OtherVia(_, rank) => *rank,
                    _ => peer,
                };
                if !note.as_ref().is_some_and(|n| n.stamp == *mine && !n.text.is_empty() && n.at.elapsed() < NOTE_FRESH) {
                    *note = Some(WaitNote { stamp: *mine, rank, text: String::new(), at: now });
                }
            }
            (PeerRuns::Unknown, _) => {
                if let Some(n) = note.as_mut().filter(|n| n.stamp == *mine) {
                    n.at = now;
                }
            }
            (_, Some(why)) => {
                let text = capped(format!("{}, {why}", describe_peer()));
                *note = Some(WaitNote { stamp: *mine, rank: runs.culprit(peer), text, at: now });
            }
            (_, None) => {}
        }
    }

    /// Show, with this rank's status, that a stream of it waits in ncclWaitSignal for signals
    /// from `rank` (`text`: that rank described, and how it is) while this rank waits for its
    /// stream to reach `stamp` (a peer waiting on it says both: [`PeerRuns::StreamHeld`]). Shown
    /// while fresh, as any [`WaitNote`]: the waiting thread says it again every second. None:
    /// no longer (the signals came; what still holds the stream is not known), said at once.
    pub fn note_held_stream(&self, stamp: &Stamp, held: Option<(usize, String)>) {
        let at = std::time::Instant::now();
        let mut note = self.waits.lock().unwrap_or_else(|p| p.into_inner());
        match held {
            Some((rank, text)) => *note = Some(WaitNote { stamp: *stamp, rank, text: capped(text), at }),
            None if note.as_ref().is_some_and(|n| n.stamp == *stamp) => *note = None,
            None => {}
        }
    }

    /// The sends to `peer` and the receives from it this rank has finished.
    pub fn finished_with(&self, peer: usize) -> (u64, u64) {
        finished_with(&self.p2p_done, peer)
    }

    /// A send to `peer` (`send`) or a receive from it finished: counted for `finished_with`.
    pub fn p2p_finished(&self, peer: usize, send: bool) {
        if let Some(done) = self.p2p_done.get(peer) {
            done[usize::from(!send)].fetch_add(1, Ordering::AcqRel);
        }
    }

    /// The status, to change; it may show more than an idle rank from then on.
    fn status(&self) -> MutexGuard<'_, Vec<u8>> {
        let bytes = self.running.lock().unwrap_or_else(|p| p.into_inner());
        self.shows.store(true, Ordering::Relaxed);
        bytes
    }

    /// Publish what this rank runs (empty: nothing).
    pub fn set_running(&self, stamps: &[crate::transport::Stamp]) {
        // (Nothing to clear: the common end of a small call, which published nothing.)
        if stamps.is_empty() && !self.shows.load(Ordering::Relaxed) {
            return;
        }
        let mut bytes = self.status();
        set_status(&mut bytes, STATUS_RUNNING, stamps.iter().copied());
        self.shows.store(!stamps.is_empty(), Ordering::Relaxed);
    }

    /// Publish the operations of a plan (its `units` and `stamps`) as running, its sends and
    /// receives with their direction and peer (`ops::with_role`), so that a peer waiting on
    /// this rank can tell a send of it from a receive.
    pub fn set_running_plan(&self, units: &[crate::plan::Unit], stamps: &[Stamp]) {
        use crate::plan::{ops, Step};
        let mut bytes = self.status();
        set_status(&mut bytes, STATUS_RUNNING, stamps.iter().copied());
        if bytes.first() != Some(&STATUS_RUNNING) || !stamps.iter().any(|s| ops::p2p_bytes(s).is_some()) {
            return;
        }
        for u in units {
            let (send, peer) = match u.step {
                Step::Send { peer, .. } => (true, peer as usize),
                Step::Recv { peer, .. } => (false, peer as usize),
                _ => continue,
            };
            let at = 1 + u.op as usize * STAMP_BYTES;
            let Some(slot) = bytes.get_mut(at..at + STAMP_BYTES) else { continue };
            let mut s = [0u8; STAMP_BYTES];
            s.copy_from_slice(slot);
            if ops::p2p_role(&s).is_none() {
                slot.copy_from_slice(&ops::with_role(s, send, peer));
            }
        }
    }

    /// Take a send or receive that finished (`shown`: its stamp with direction and peer, as the
    /// status shows it) out of what this rank publishes as running. Its group may wait on other
    /// peers for long; a peer that saw it there would think it still waits for that peer's call
    /// (two ranks that each receive from the other look crossed, though one's receive is done).
    /// Collectives stay: a peer takes one this rank issued for one it is behind on.
    ///
    /// `at`: where it should be, its index among the operations published (the plan's); else
    /// it is looked for. It is marked done in place ([`DONE`]), not taken out: a group of n
    /// sends and receives took O(n²) to finish when each finish moved the rest down (50,000
    /// of them: 7 s).
    pub fn finished(&self, shown: &Stamp, at: usize) {
        mark_finished(&mut self.running.lock().unwrap_or_else(|p| p.into_inner()), shown, at);
    }

    /// Publish that this rank issued these operations (CUDA mode) and waits for their streams
    /// to reach them: peers waiting on it are told so, not that it has not made the call.
    pub fn set_waiting_for_stream(&self, stamps: impl Iterator<Item = crate::transport::Stamp>) {
        set_status(&mut self.status(), STATUS_STREAM, stamps);
    }

    /// Publish that this rank waits in ncclWaitSignal for `what` (in words), or, with None, that
    /// it no longer does: a peer waiting on it is told where it is, not that it issued nothing.
    /// Only over a status that shows nothing else (operations running on another thread of the
    /// communicator's say more).
    pub fn set_signal_wait(&self, what: Option<&str>) {
        let mut bytes = self.status();
        let idle = match bytes.first() {
            None | Some(&STATUS_SIGNALS) => true,
            Some(&STATUS_RUNNING) => status_stamps(&bytes).next().is_none(),
            Some(_) => false,
        };
        match what {
            Some(_) if !idle => {}
            Some(what) => {
                set_status(&mut bytes, STATUS_SIGNALS, std::iter::empty());
                bytes.extend_from_slice(what.as_bytes());
            }
            None if bytes.first() == Some(&STATUS_SIGNALS) => set_status(&mut bytes, STATUS_RUNNING, std::iter::empty()),
            None => {}
        }
    }

    /// Publish that this rank is suspended (ncclCommSuspend): peers waiting on it are told so.
    pub fn set_suspended(&self) {
        set_status(&mut self.status(), STATUS_SUSPENDED, std::iter::empty());
    }

    /// Publish why this rank stopped, for peers that only saw its connections close.
    pub fn set_failed(&self, e: &Error) {
        let mut bytes = vec![STATUS_FAILED];
        bytes.extend(failure_bytes(e));
        *self.status() = bytes;
    }
    pub fn conns(&self) -> MutexGuard<'_, Conns> {
        self.conns.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_notes_are_capped() {
        assert_eq!(capped("short".to_string()), "short");
        let long = capped("é".repeat(NOTE_MAX));
        assert!(long.len() <= NOTE_MAX + 3 && long.ends_with("...") && long.starts_with("éé"), "{}", long.len());
    }
}
