//! The communicator: identity (rank, size, device, host), state, abort flag, asynchronous
//! error, the PreMulSum operators it owns, and — once init has completed — its bootstrap
//! service and its connections to peers.

mod caller;
pub use caller::Held;
mod elsewhere;
pub mod handle;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use crate::api::config::Config;
use crate::bootstrap::{PeerInfo, Service};
use crate::error::{Code, Error, Result};
use crate::transport::{Conns, Stamp, STAMP_BYTES};
use crate::types::{DataType, RedOp};

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
    silent: Mutex<HashMap<usize, (std::time::Instant, bool)>>,
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
    waits: Waits,
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
/// goes on from there ([`Comm::follow`]), and keeps the furthest it reached in turn, so that
/// the ranks of a long chain find the rank holding it up in a few looks, not one rank per look.
struct WaitNote {
    stamp: Stamp,
    rank: usize,
    text: String,
    at: std::time::Instant,
}

/// How long a [`WaitNote`] is shown after it was last found true (waits look every 1-2 s).
const NOTE_FRESH: std::time::Duration = std::time::Duration::from_secs(5);

/// Kept by a communicator, shared with its status handler and [`elsewhere`].
type Waits = std::sync::Arc<Mutex<Option<WaitNote>>>;

/// The note to show with status bytes `status`: fresh, and of a call that still runs.
fn shown_note<'a>(waits: &'a Option<WaitNote>, status: &[u8]) -> Option<&'a WaitNote> {
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

/// Where a peer in a call on another communicator says what holds that call up.
const HELD_UP_THERE: &str = ", held up there by ";

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
    fn may_walk(&self, peer: usize, mine: &Stamp) -> bool {
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
    fn note_wait(&self, peer: usize, mine: &Stamp, runs: &PeerRuns, why: Option<String>, describe_peer: impl FnOnce() -> String) {
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
fn process_state(pid: u32) -> Option<u8> {
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

/// `f()` until it gives something, every 5 ms for at most `grace`.
fn within<T>(grace: std::time::Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let until = std::time::Instant::now() + grace;
    loop {
        let got = f();
        if got.is_some() || std::time::Instant::now() >= until {
            return got;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// A failure as peers hear it (in a failed status, or told: [`Comm::tell_failure`]): its code,
/// then its message.
fn failure_bytes(e: &Error) -> Vec<u8> {
    let mut bytes = vec![e.code as u8];
    bytes.extend_from_slice(e.msg.as_bytes());
    bytes
}

/// Status bytes a rank publishes: a tag, then stamps (running, or waiting for their streams)
/// or code + message (failed).
const STATUS_RUNNING: u8 = 0;
const STATUS_FAILED: u8 = 1;
const STATUS_STREAM: u8 = 2;
const STATUS_SUSPENDED: u8 = 3;
/// Running nothing on this communicator; then, in words, what the process's others run.
const STATUS_ELSEWHERE: u8 = 4;
/// In ncclWaitSignal; then, in words, the signals it waits for.
const STATUS_SIGNALS: u8 = 5;
/// In place of a send or receive that finished while its group runs on ([`Ready::finished`]):
/// no operation's stamp (its first byte is no kind). Never sent: answers leave it out.
const DONE: Stamp = [0xFF; STAMP_BYTES];

/// [`Comm::tell_failure`] tells at most this many peers, within this long.
const TELL_NEAREST: usize = 64;
const TELL_WITHIN: std::time::Duration = std::time::Duration::from_millis(500);
/// How long [`Comm::lost_peers`] waits for the news of peers gone after failing.
const TELL_GRACE: std::time::Duration = std::time::Duration::from_millis(100);

/// Ranks a look follows past a peer that runs the same collective ([`Comm::follow`]): with
/// each rank keeping the furthest it reached, a chain of n ranks is followed to its end in
/// about log9(n) looks (a ring of 4096 ranks: 4).
const FOLLOW_HOPS: usize = 8;

/// What a walk along the ranks each waits on does after asking one ([`Comm::walk`]).
enum Step {
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

/// What another rank's status request is answered: the status, or, where this communicator
/// runs nothing, what this process's other communicators run, if anything.
fn status_answer(running: &crate::bootstrap::service::Status, serial: u64) -> Vec<u8> {
    let bytes = live_status(&running.lock().unwrap_or_else(|p| p.into_inner()));
    if bytes.len() <= 1 && bytes.first().is_none_or(|&t| t == STATUS_RUNNING) {
        if let Some(text) = elsewhere::running_except(serial) {
            let mut answer = vec![STATUS_ELSEWHERE];
            answer.extend_from_slice(text.as_bytes());
            return answer;
        }
    }
    bytes
}

/// What the error of sends and receives that wait on each other for ever says to do.
const DEADLOCK_ADVICE: &str = "(put a rank's sends and receives with its peers in one ncclGroupStart/ncclGroupEnd \
                               group, or order them so that each send meets its receive)";

/// Is `e` the error [`Comm::peer_runs`] gives for sends and receives that wait on each other
/// for ever (crossed, or round a cycle)?
pub fn is_deadlock(e: &Error) -> bool {
    e.code == Code::InvalidUsage && e.msg.contains(DEADLOCK_ADVICE)
}

/// Status requests one search for a cycle of waiting ranks may make ([`Comm::waits_in_cycle`]),
/// and the time it may take.
const CYCLE_ASKS: usize = 64;
const CYCLE_TIME: std::time::Duration = std::time::Duration::from_secs(3);

/// The first send or receive of rank `x` (running `xs`) with rank `y` (running `ys`) that `y`
/// has not issued: `y` runs no receive from `x` (send from `x`) of its size. Then `x` waits on
/// `y` to finish its call and issue another.
fn waits_on(x: usize, xs: &[Stamp], y: usize, ys: &[Stamp]) -> Option<Stamp> {
    use crate::plan::ops::{p2p_role, without_role};
    xs.iter().find(|s| match p2p_role(s) {
        Some((send, with)) => with == y && !ys.iter().any(|t| {
            without_role(*t) == without_role(**s) && p2p_role(t) == Some((!send, x))
        }),
        None => false,
    }).copied()
}

/// "a", "a and b", "a, b and c".
fn and_list(items: &[String]) -> String {
    match items.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
        Some((last, _)) => last.clone(),
        None => String::new(),
    }
}

/// A depth-first search for a cycle of ranks that wait on each other, back to `start`.
struct CycleWalk<'a> {
    ready: &'a Ready,
    start: usize,
    own: Vec<Stamp>,
    /// Ranks asked for their status (or not to be: the start and its first peer).
    asked: Vec<usize>,
    deadline: std::time::Instant,
}

/// Of per-peer counts (`Ready::p2p_done`): the sends to `peer` and the receives from it.
fn finished_with(done: &[[std::sync::atomic::AtomicU64; 2]], peer: usize) -> (u64, u64) {
    done.get(peer).map_or((0, 0), |d| (d[0].load(Ordering::Acquire), d[1].load(Ordering::Acquire)))
}

/// What a rank finished with each rank it runs sends or receives with ([`Answer::with`]).
type FinishedWith = Vec<(usize, (u64, u64))>;

/// A rank on a path of waiting ranks: its rank, what it runs, and what it finished.
type Waiting = (usize, Vec<Stamp>, FinishedWith);

/// Does rank x (running `xs`, having finished `x_with` with the ranks it runs sends or receives
/// with) wait on rank y (running `ys`, having finished `y_done` with x)? Its first send or
/// receive with y that y has not issued, unless that one no longer waits ([`still_waits`]:
/// stopped or slow, a rank may show a call whose message has gone, or come).
fn waits_for(x: usize, xs: &[Stamp], x_with: &[(usize, (u64, u64))], y: usize, ys: &[Stamp], y_done: (u64, u64)) -> bool {
    let Some((send, _)) = waits_on(x, xs, y, ys).as_ref().and_then(crate::plan::ops::p2p_role) else { return false };
    x_with.iter().find(|(p, _)| *p == y).is_some_and(|&(_, x_done)| still_waits(send, x_done, y_done))
}

impl CycleWalk<'_> {
    /// Extend `path` (ranks, each waiting on the next; the start waits on the first) back to
    /// the start: true, `path` the cycle. False: no cycle found from its end.
    fn from(&mut self, path: &mut Vec<Waiting>) -> bool {
        let Some((x, xs, x_with)) = path.last().cloned() else { return false };
        let mut next: Vec<usize> = Vec::new();
        for (_, p) in xs.iter().filter_map(crate::plan::ops::p2p_role) {
            if !next.contains(&p) {
                next.push(p);
            }
        }
        for y in next {
            if y == self.start {
                if waits_for(x, &xs, &x_with, y, &self.own, self.ready.finished_with(x)) {
                    return true;
                }
                continue;
            }
            if self.asked.contains(&y) || self.asked.len() >= CYCLE_ASKS || std::time::Instant::now() >= self.deadline {
                continue;
            }
            self.asked.push(y);
            let Some((ys, y_about_x, y_with)) = self.running_of(y, x) else { continue };
            if !waits_for(x, &xs, &x_with, y, &ys, y_about_x) {
                continue;
            }
            path.push((y, ys, y_with));
            if self.from(path) {
                return true;
            }
            path.pop();
        }
        false
    }

    /// The sends and receives `rank` runs, if it answers that it runs some (and nothing else),
    /// with what it finished with `about` and with each rank it runs them with.
    fn running_of(&self, rank: usize, about: usize) -> Option<(Vec<Stamp>, (u64, u64), FinishedWith)> {
        let answer = self.ready.service.status_about(rank, about as u32, std::time::Duration::from_secs(1)).ok()?;
        let answer = Answer::read(&answer);
        if answer.status.first() != Some(&STATUS_RUNNING) {
            return None;
        }
        let stamps: Vec<Stamp> = status_stamps(answer.status).collect();
        (!stamps.is_empty() && stamps.iter().all(|s| crate::plan::ops::p2p_role(s).is_some()))
            .then_some((stamps, answer.about, answer.with))
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
fn past(mine: &Stamp, issued: u64) -> bool {
    crate::plan::ops::coll_seq(mine).is_some_and(|m| issued > m)
}

/// Are two ranks' sends and receives with each other crossed, so that neither can finish: each
/// only sends to the other (Some(true)), or each only receives from it (Some(false))? `own`,
/// `theirs`: the directions (true: a send) of what each runs with the other; `own_done`,
/// `theirs_done`: the sends to the other and the receives from it each has finished. Only
/// calls that still wait count ([`still_waits`]): a small send finishes at once, and its
/// receiver, stopped or slow, may show for a while the receive that will take it; a send whose
/// receiver finished taking it may show while its rank, stopped, has yet to mark it done.
fn crossed(own: &[bool], theirs: &[bool], own_done: (u64, u64), theirs_done: (u64, u64)) -> Option<bool> {
    let &dir = own.first()?;
    if !own.iter().chain(theirs).all(|&s| s == dir) || theirs.is_empty() {
        return None;
    }
    (still_waits(dir, own_done, theirs_done) && still_waits(dir, theirs_done, own_done)).then_some(dir)
}

/// A peer's status answer, read: what it finished with the rank asked about, the collectives it
/// has issued, and what it finished with each rank it runs sends or receives with now (each
/// pair: the sends to that rank and the receives from it the peer has finished), the rank it
/// found holding up its call, in words ([`WaitNote`]), if any, then its status bytes.
#[derive(Debug, PartialEq)]
struct Answer<'a> {
    about: (u64, u64),
    issued: u64,
    with: Vec<(usize, (u64, u64))>,
    waits: Option<(usize, &'a [u8])>,
    status: &'a [u8],
}

impl Answer<'_> {
    /// The bytes [`Answer::read`] reads.
    fn write(&self) -> Vec<u8> {
        let note = self.waits.map_or(0, |(_, text)| 4 + text.len());
        let mut bytes = Vec::with_capacity(32 + self.with.len() * 20 + note + self.status.len());
        bytes.extend_from_slice(&self.about.0.to_le_bytes());
        bytes.extend_from_slice(&self.about.1.to_le_bytes());
        bytes.extend_from_slice(&self.issued.to_le_bytes());
        bytes.extend_from_slice(&(self.with.len() as u32).to_le_bytes());
        for &(p, (sent, received)) in &self.with {
            bytes.extend_from_slice(&(p as u32).to_le_bytes());
            bytes.extend_from_slice(&sent.to_le_bytes());
            bytes.extend_from_slice(&received.to_le_bytes());
        }
        bytes.extend_from_slice(&(note as u32).to_le_bytes());
        if let Some((rank, text)) = self.waits {
            bytes.extend_from_slice(&(rank as u32).to_le_bytes());
            bytes.extend_from_slice(text);
        }
        bytes.extend_from_slice(self.status);
        bytes
    }

    fn read(answer: &[u8]) -> Answer<'_> {
        let u64_at = |at: usize| answer.get(at..at + 8).and_then(|b| b.try_into().ok()).map_or(0, u64::from_le_bytes);
        let u32_at = |at: usize| answer.get(at..at + 4).and_then(|b| b.try_into().ok()).map(u32::from_le_bytes);
        let n = u32_at(24).unwrap_or(0) as usize;
        let note_at = 28usize.saturating_add(n.saturating_mul(20));
        let note_len = u32_at(note_at).unwrap_or(0) as usize;
        let start = note_at.saturating_add(4).saturating_add(note_len);
        if answer.len() < start || (note_len > 0 && note_len < 4) {
            // A short answer reads as nothing.
            return Answer { about: (0, 0), issued: 0, with: Vec::new(), waits: None, status: &[] };
        }
        let with = (0..n).map(|i| 28 + i * 20).map(|at| (u32_at(at).unwrap_or(0) as usize, (u64_at(at + 4), u64_at(at + 12))));
        let waits = (note_len > 0).then(|| (u32_at(note_at + 4).unwrap_or(0) as usize, &answer[note_at + 8..start]));
        Answer { about: (u64_at(0), u64_at(8)), issued: u64_at(16), with: with.collect(), waits, status: &answer[start..] }
    }
}

/// Can rank x's send (`send`) or receive with rank y still be waiting for y's call, given what
/// each has finished with the other (x_done: x's sends to y and receives from y; y_done:
/// y's to and from x)? Not if y has finished more receives from x than x sends to it (x's
/// send was taken: x, stopped or slow, has yet to mark it done), nor if y has finished more
/// sends to x than x receives from it (the message for x's receive is on its way).
fn still_waits(send: bool, x_done: (u64, u64), y_done: (u64, u64)) -> bool {
    if send { y_done.1 <= x_done.0 } else { y_done.0 <= x_done.1 }
}

/// The stamps of status bytes (after the tag).
pub(crate) fn status_stamps(bytes: &[u8]) -> impl Iterator<Item = Stamp> + '_ {
    bytes.get(1..).unwrap_or_default().chunks_exact(STAMP_BYTES).filter_map(|s| s.try_into().ok()).filter(|s| *s != DONE)
}

/// [`Ready::finished`] on the status bytes.
fn mark_finished(bytes: &mut [u8], shown: &Stamp, at: usize) {
    if bytes.first() != Some(&STATUS_RUNNING) {
        return;
    }
    let slot = |k: usize| 1 + k * STAMP_BYTES..1 + (k + 1) * STAMP_BYTES;
    let k = if bytes.get(slot(at)) == Some(shown.as_slice()) {
        Some(at)
    } else {
        bytes.get(1..).unwrap_or_default().chunks_exact(STAMP_BYTES).position(|s| s == shown.as_slice())
    };
    if let Some(place) = k.and_then(|k| bytes.get_mut(slot(k))) {
        place.copy_from_slice(&DONE);
    }
}

/// A copy of a status without the places of finished sends and receives.
fn live_status(bytes: &[u8]) -> Vec<u8> {
    if !matches!(bytes.first(), Some(&STATUS_RUNNING) | Some(&STATUS_STREAM)) {
        return bytes.to_vec();
    }
    let mut live = Vec::with_capacity(bytes.len());
    live.extend(bytes.first());
    status_stamps(bytes).for_each(|s| live.extend_from_slice(&s));
    live
}

/// `tag` and `stamps` as the status, unless it says the rank failed: that stays, for peers
/// that ask why its connections closed (another thread may have failed it meanwhile).
fn set_status(bytes: &mut Vec<u8>, tag: u8, stamps: impl Iterator<Item = Stamp>) {
    if bytes.first() == Some(&STATUS_FAILED) {
        return;
    }
    bytes.clear();
    bytes.push(tag);
    stamps.for_each(|s| bytes.extend_from_slice(&s));
}

/// A PreMulSum operator made by `ncclRedOpCreatePreMulSum`.
#[derive(Clone, Copy, Debug)]
pub enum ScalarSource {
    /// Read when the operator was created (ncclScalarHostImmediate).
    Immediate(crate::types::Scalar),
    /// Read when an operation using it runs (ncclScalarDevice; host memory in host mode).
    Pointer(crate::device::host::UserPtr),
}

#[derive(Clone, Copy, Debug)]
pub struct UserOp {
    pub datatype: DataType,
    pub scalar: ScalarSource,
}

pub struct Comm {
    pub rank: usize,
    pub nranks: usize,
    pub cuda_dev: i32,
    pub config: Config,
    /// Identifies the communicator across ranks (derived from the unique id; with NCCL_COMM_ID
    /// every communicator has the same, as in NCCL).
    pub hash: u64,
    /// Identifies it among this process's communicators (windows are registered under it).
    pub serial: u64,
    ready: OnceLock<Ready>,
    /// `ncclSuccess`, `ncclInProgress` while a nonblocking init or operation runs, or the error.
    async_code: AtomicI32,
    async_error: Mutex<Option<Error>>,
    pub abort: AtomicBool,
    pub suspended: AtomicBool,
    /// ncclCommRevoke: operations fail, management calls (destroy, split, shrink) still work.
    pub revoked: AtomicBool,
    /// Splits, shrinks and grows made from this communicator, counted per set of ranks taking
    /// part (keyed by a hash of the set): numbers them alike on every member, even after a
    /// shrink that some rank, excluded, never called.
    splits: Mutex<HashMap<u64, u64>>,
    pub finalized: AtomicBool,
    /// The thread (kernel id) inside an operation call, or holding this communicator in its
    /// open group; 0 for none (`caller`).
    caller: AtomicU64,
    user_ops: Mutex<HashMap<i32, UserOp>>,
    next_user_op: AtomicI32,
    /// Collectives issued, for messages and fingerprints (and told with the status: a peer
    /// past a rank's collective is not in another call).
    pub seq: Arc<AtomicU64>,
    /// CUDA mode: the worker that runs operations on device memory in stream order.
    pub streamed: OnceLock<Arc<crate::streamed::Streamed>>,
    /// One-sided operations: connections to targets, signals that came.
    pub rma: crate::api::rma::Rma,
    /// Nonblocking communicators: operations on host buffers running on threads of their own.
    pub background: crate::group::background::Background,
    /// CUDA mode: the last caller's stream found to be of this communicator's device.
    stream_ok: AtomicUsize,
    /// The process that made it, and the fork count then (a forked child inherits the handle,
    /// not the communicator: `crate::abi::fork`).
    pid: u32,
    forks: u64,
}

impl Comm {
    pub fn new(rank: usize, nranks: usize, cuda_dev: i32, config: Config, hash: u64) -> Comm {
        let rma_shape = (config.rma_contexts, config.rma_signals);
        static SERIAL: AtomicU64 = AtomicU64::new(1);
        let serial = SERIAL.fetch_add(1, Ordering::Relaxed);
        Comm {
            rank,
            nranks,
            cuda_dev,
            config,
            hash,
            serial,
            ready: OnceLock::new(),
            async_code: AtomicI32::new(Code::InProgress as i32),
            async_error: Mutex::new(None),
            abort: AtomicBool::new(false),
            suspended: AtomicBool::new(false),
            revoked: AtomicBool::new(false),
            splits: Mutex::new(HashMap::new()),
            finalized: AtomicBool::new(false),
            caller: AtomicU64::new(0),
            user_ops: Mutex::new(HashMap::new()),
            next_user_op: AtomicI32::new(crate::types::BuiltinOp::ALL.len() as i32),
            seq: Arc::new(AtomicU64::new(0)),
            streamed: OnceLock::new(),
            rma: crate::api::rma::Rma::new(serial, rank, nranks, cuda_dev, rma_shape),
            background: Default::default(),
            stream_ok: AtomicUsize::new(0),
            pid: std::process::id(),
            forks: crate::abi::fork::generation(),
        }
    }

    /// In a child forked after this communicator was made: the pid of the process that made it.
    pub fn forked_from(&self) -> Option<u32> {
        (crate::abi::fork::generation() != self.forks).then_some(self.pid)
    }

    /// CUDA mode: a call's stream must be of this communicator's device;
    /// a stream of another is refused with `ncclInvalidArgument` (`check_caller_stream`).
    pub fn check_stream(&self, stream: crate::device::cuda::UserStream) -> Result<()> {
        if stream.is_default() || !crate::device::mode::is_cuda() {
            return Ok(());
        }
        crate::device::cuda::check_caller_stream(self.cuda_dev, stream, &self.stream_ok)
    }

    /// Init finished: the communicator can run operations.
    pub fn set_ready(&self, ready: Ready) {
        ready.service.set_rma_handler(self.rma.handler());
        let (running, serial, done, waits, issued) =
            (ready.running.clone(), self.serial, ready.p2p_done.clone(), ready.waits.clone(), self.seq.clone());
        ready.service.set_status(Box::new(move |about| {
            // What this rank finished with the rank asked about, the collectives it issued, what
            // it finished with each it runs sends or receives with now, the rank holding it up
            // (see `Answer`), then its status.
            let status = status_answer(&running, serial);
            let mut with: Vec<usize> = Vec::new();
            if status.first() == Some(&STATUS_RUNNING) {
                for (_, p) in status_stamps(&status).filter_map(|s| crate::plan::ops::p2p_role(&s)) {
                    if !with.contains(&p) {
                        with.push(p);
                    }
                }
            }
            let with: Vec<(usize, (u64, u64))> = with.into_iter().map(|p| (p, finished_with(&done, p))).collect();
            let note = waits.lock().unwrap_or_else(|p| p.into_inner());
            let shown = shown_note(&note, &status);
            Answer { about: finished_with(&done, about as usize), issued: issued.load(Ordering::Relaxed), with,
                     waits: shown.map(|n| (n.rank, n.text.as_bytes())), status: &status }.write()
        }));
        // A rank of another host asks how a peer's process of this host is (`process_state`):
        // its state letter, for the members of this host only.
        let here: Vec<Option<u32>> = match ready.peers.get(self.rank) {
            Some(me) => ready.peers.iter().map(|p| p.same_pids(me).then_some(p.pid)).collect(),
            None => Vec::new(),
        };
        ready.service.set_process_answer(Box::new(move |about| {
            here.get(about as usize).copied().flatten().and_then(process_state).map_or(Vec::new(), |s| vec![s])
        }));
        elsewhere::enlist(self.serial, self.hash, self.rank, self.nranks, &ready.running, &ready.waits);
        let _ = self.ready.set(ready);
        self.async_code.store(Code::Success as i32, Ordering::Release);
    }

    /// Record an error for `ncclCommGetAsyncError` (the first one wins: it is the cause).
    pub fn set_async_error(&self, e: &Error) {
        let mut slot = self.async_error.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            // Errors found in the background (nonblocking init, a failed group) are what
            // ncclGetLastError should show next, as in NCCL. Those of operations the caller's
            // own ncclCommAbort stopped are no news (PyTorch aborts at shutdown): INFO.
            if self.abort.load(Ordering::Acquire) {
                crate::info!(INIT, "rank {}: after ncclCommAbort: {}", self.rank, e.msg);
            } else {
                crate::warn!("{}", e.msg);
            }
            crate::error::set_last_error(&e.msg);
            *slot = Some(e.clone());
            self.async_code.store(e.code as i32, Ordering::Release);
            drop(slot);
            self.rma.failed(e);
        }
    }

    /// This rank fails outside the host transports' own failure path (which does the same):
    /// the failure is published for peers that ask and the connections closed, so peers
    /// waiting on this rank learn it rather than wait; it becomes the asynchronous error.
    pub fn publish_failure(&self, e: &Error) {
        if self.async_code() == Code::Success {
            if let Some(r) = self.ready_if_any() {
                r.set_failed(e);
                r.conns().close_all();
            }
        }
        self.set_async_error(e);
    }

    /// Operations started in the background (`group::background`): `ncclInProgress` until
    /// they are done, unless an error is recorded.
    pub fn set_in_progress(&self) {
        let _ = self.async_code.compare_exchange(Code::Success as i32, Code::InProgress as i32, Ordering::AcqRel,
                                                 Ordering::Acquire);
    }

    /// The background operations are done: `ncclSuccess`, unless an error is recorded.
    pub fn clear_in_progress(&self) {
        let _ = self.async_code.compare_exchange(Code::InProgress as i32, Code::Success as i32, Ordering::AcqRel,
                                                 Ordering::Acquire);
    }

    pub fn async_code(&self) -> Code {
        Code::from_raw(self.async_code.load(Ordering::Acquire)).unwrap_or(Code::InternalError)
    }

    /// `ncclCommGetAsyncError`'s answer. While it is `ncclInProgress` the caller waits for the
    /// library's own threads (a nonblocking communicator's operation, an init or a split); a
    /// caller that asks in a tight loop, as NCCL's documentation shows it (the yield is
    /// optional there), kept the CPU from them where CPUs are shared: a nonblocking 8-byte
    /// all-reduce on 2 processes of 2 cores took 75-160 us (the perf tool spins 1024 times
    /// before it yields), 13-24 us with this. So the answer comes after a yield (a short nap
    /// where this thread's yields hand its CPU to a busy process: `proxy::pause`).
    pub fn polled_code(&self) -> Code {
        let code = self.async_code();
        if code == Code::InProgress {
            crate::proxy::pause();
        }
        code
    }

    pub fn async_error(&self) -> Option<Error> {
        // Fast path for every call: no error recorded means no lock to take.
        if matches!(self.async_code(), Code::Success | Code::InProgress) {
            return None;
        }
        self.async_error.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The initialised part, or why the communicator cannot be used now.
    pub fn ready(&self) -> Result<&Ready> {
        if self.abort.load(Ordering::Acquire) {
            return Err(Error::invalid_usage(format!("rank {}: communicator was destroyed or aborted", self.rank)));
        }
        if self.revoked.load(Ordering::Acquire) {
            return Err(Error::invalid_usage(format!("rank {}: communicator was revoked", self.rank)));
        }
        if let Some(e) = self.async_error() {
            return Err(Error::new(e.code, format!("rank {}: communicator is in error: {}", self.rank, e.msg)));
        }
        if self.suspended.load(Ordering::Acquire) {
            return Err(Error::invalid_usage(format!("rank {}: communicator is suspended (ncclCommResume it)", self.rank)));
        }
        self.ready.get().ok_or_else(|| self.not_ready())
    }

    /// For a new operation (a collective, point-to-point or one-sided call): ready, and not
    /// finalized (ncclCommFinalize flushes what was issued; only ncclCommDestroy may follow).
    pub fn ready_for_call(&self) -> Result<&Ready> {
        if self.finalized.load(Ordering::Acquire) {
            return Err(Error::invalid_usage(format!(
                "rank {}: communicator was finalized (ncclCommFinalize): no operation may follow, only \
                 ncclCommDestroy", self.rank)));
        }
        self.ready()
    }

    /// For split and shrink: allowed on a revoked or failed communicator (that is what
    /// shrinking away dead ranks is for), not on an aborted or uninitialised one.
    pub fn ready_for_management(&self) -> Result<&Ready> {
        if self.abort.load(Ordering::Acquire) {
            return Err(Error::invalid_usage(format!("rank {}: communicator was destroyed or aborted", self.rank)));
        }
        self.ready.get().ok_or_else(|| self.not_ready())
    }

    /// The number of the next split, shrink or grow among the ranks `members` (hashed by the
    /// caller), and a 16-bit tag for its messages on the parent's service that tells it apart
    /// from others with the same number among other members.
    pub fn next_split(&self, members: u64) -> (u64, u32) {
        let mut splits = self.splits.lock().unwrap_or_else(|p| p.into_inner());
        let n = splits.entry(members).or_insert(0);
        let seq = *n;
        *n += 1;
        let tag = crate::bootstrap::id::magic_of(&format!("{members:x}/{seq}")) as u32 & 0xffff;
        (seq, tag)
    }

    /// NCCL's answer to a call on a communicator whose nonblocking init has not finished.
    fn not_ready(&self) -> Error {
        Error::invalid_arg(format!(
            "rank {}: communicator is still initialising (ncclCommGetAsyncError must say ncclSuccess before it is \
             used)", self.rank))
    }

    pub fn ready_if_any(&self) -> Option<&Ready> {
        self.ready.get()
    }

    pub fn add_user_op(&self, op: UserOp) -> Result<i32> {
        let id = self.next_user_op.fetch_add(1, Ordering::Relaxed);
        if id < 0 {
            return Err(Error::internal("too many reduction operators created"));
        }
        self.user_ops.lock().unwrap_or_else(|p| p.into_inner()).insert(id, op);
        Ok(id)
    }

    pub fn user_op(&self, id: i32) -> Option<UserOp> {
        self.user_ops.lock().unwrap_or_else(|p| p.into_inner()).get(&id).copied()
    }

    pub fn remove_user_op(&self, id: i32) -> bool {
        self.user_ops.lock().unwrap_or_else(|p| p.into_inner()).remove(&id).is_some()
    }

    /// Describe a peer for messages: "rank 5 (host-b, pid 4242)".
    pub fn describe_peer(&self, peer: usize) -> String {
        match self.ready.get().and_then(|r| r.peers.get(peer)) {
            Some(p) => format!("rank {} ({}, pid {})", peer, p.hostname, p.pid),
            None => format!("rank {peer}"),
        }
    }

    /// The peers that are gone, with why, to name them when an operation fails: same-host
    /// peers by their pid, others by whether their bootstrap service still answers.
    pub fn lost_peers(&self) -> Vec<(usize, String)> {
        let Some(ready) = self.ready.get() else { return Vec::new() };
        let me = &ready.peers[self.rank];
        let probe = |p: &crate::bootstrap::PeerInfo| Self::gone(ready, me, p).map(|(why, _)| (p.rank, why));
        // Peers of this host are asked here (their pid: no waiting); the others are pinged,
        // by at most PROBERS threads, each taking a share of them (pings wait up to 1 s); a
        // thread that cannot start leaves its share to this one.
        let (here, others): (Vec<_>, Vec<_>) =
            ready.peers.iter().filter(|p| p.rank != self.rank).partition(|p| p.same_pids(me));
        const PROBERS: usize = 32;
        let share = others.len().div_ceil(PROBERS).max(1);
        std::thread::scope(|s| {
            let mut lost = Vec::new();
            let mut probes = Vec::new();
            for chunk in others.chunks(share) {
                let spawned = std::thread::Builder::new()
                    .name("nccl-rs-probe".into())
                    .spawn_scoped(s, move || chunk.iter().filter_map(|p| probe(p)).collect::<Vec<_>>());
                match spawned {
                    Ok(h) => probes.push(h),
                    Err(_) => lost.extend(chunk.iter().filter_map(|p| probe(p))),
                }
            }
            // While the pings wait.
            lost.extend(here.iter().filter_map(|p| probe(p)));
            lost.extend(probes.into_iter().filter_map(|h| h.join().ok()).flatten());
            self.after_failing(ready, lost)
        })
    }

    /// `lost` in order, those that went after failing themselves last and said so: they told
    /// this rank before going ([`Comm::tell_failure`]), or another rank of their process did.
    /// The news of a peer already gone has come, but perhaps not yet been read from the
    /// service's socket: it is waited for a little (this rank is failing: no hurry).
    fn after_failing(&self, ready: &Ready, lost: Vec<(usize, String)>) -> Vec<(usize, String)> {
        let process = |p: usize| ready.peers.get(p).map(|i| (i.host_hash, i.pid_ns, i.pid));
        let failed_processes = || {
            lost.iter().filter(|(p, _)| ready.service.told_failed(*p).is_some()).filter_map(|(p, _)| process(*p))
                .collect::<Vec<_>>()
        };
        let after = |failed: &[_], p: usize| process(p).is_some_and(|k| failed.contains(&k));
        let failed = within(TELL_GRACE, || {
            let failed = failed_processes();
            lost.iter().all(|(p, _)| after(&failed, *p)).then_some(failed)
        })
        .unwrap_or_else(failed_processes);
        let mut lost: Vec<(bool, usize, String)> = lost.into_iter().map(|(p, why)| (after(&failed, p), p, why)).collect();
        lost.sort();
        lost.into_iter().map(|(after, p, why)| (p, if after { format!("{why} after failing itself") } else { why })).collect()
    }

    /// Is `peer` gone, and why: a peer of this host whose process exited (certain), or one of
    /// another host whose bootstrap service refuses connections (certain) or does not answer
    /// within 1 s (certain only once it has gone on for a while: the bool says which).
    pub fn peer_gone(&self, peer: usize) -> Option<(String, bool)> {
        let ready = self.ready.get()?;
        Self::gone(ready, ready.peers.get(self.rank)?, ready.peers.get(peer)?)
    }

    fn gone(ready: &Ready, me: &crate::bootstrap::PeerInfo, p: &crate::bootstrap::PeerInfo) -> Option<(String, bool)> {
        use crate::bootstrap::service::Reach;
        if p.same_pids(me) {
            (!crate::transport::ring::pid_alive(p.pid)).then(|| ("its process exited".to_string(), true))
        } else {
            // Its host refusing the connection is as certain as an exited process here: its
            // communicator, and the service that lives as long, are gone.
            match ready.service.reach(p.rank, std::time::Duration::from_secs(1)) {
                Reach::Answers => None,
                Reach::Refuses(why) => Some((format!("{why}: it destroyed or aborted its communicator, or its process \
                                                      ended"), true)),
                Reach::Silent(why) => Some((why, false)),
            }
        }
    }

    /// The exchange of management call `call` (split, shrink, grow) over this communicator's
    /// bootstrap service: until NCCL_INIT_TIMEOUT_S, stopped by an abort, failed once a
    /// member it waits on is certainly gone.
    pub fn exchange(&self, call: &'static str, tag: u32) -> crate::bootstrap::service::Exchange<'_> {
        crate::bootstrap::service::Exchange { call, tag, deadline: crate::params::init_deadline(), abort: &self.abort,
                                              members: self }
    }

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
        let Some(ready) = self.ready.get() else { return false };
        matches!((ready.peers.get(self.rank), ready.peers.get(peer)), (Some(me), Some(p)) if p.same_pids(me))
    }

    /// How `peer`'s process is, if it is of this host (/proc).
    fn local_state(&self, ready: &Ready, peer: usize) -> Option<Silence> {
        let (me, p) = (ready.peers.get(self.rank)?, ready.peers.get(peer)?);
        p.same_pids(me).then(|| Silence::of_process(p.pid))
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

    fn peer_runs_once(&self, peer: usize, mine: &Stamp, describe: &dyn Fn(&Stamp) -> String, again: bool)
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

    /// Whether this rank, waiting on `peer` (its rank, what it runs, none of it with this rank,
    /// and what it finished with the ranks it runs those with; `peer_done`: what it finished
    /// with this rank), is in a cycle of ranks that wait on each other: each in a send or
    /// receive with the next that the next has not issued (its call has no matching receive or
    /// send), so none can finish, as two ranks that both only send to each other, round three
    /// or more (each sends to the next, then receives from the one before, outside a group).
    /// Only calls that still wait count ([`still_waits`], from what each pair finished with
    /// each other): a stopped rank may show a receive whose message is on its way. The cycle in
    /// words, if so. Found depth-first, asking each rank reached for its status (and what it
    /// finished with the rank before it); at most [`CYCLE_ASKS`] of them, for at most
    /// [`CYCLE_TIME`].
    fn waits_in_cycle(&self, ready: &Ready, peer: Waiting, peer_done: (u64, u64), describe: &dyn Fn(&Stamp) -> String)
                      -> Option<String> {
        let own: Vec<Stamp> = status_stamps(&ready.running.lock().unwrap_or_else(|p| p.into_inner())).collect();
        let own_with: Vec<(usize, (u64, u64))> = vec![(peer.0, ready.finished_with(peer.0))];
        if !waits_for(self.rank, &own, &own_with, peer.0, &peer.1, peer_done) {
            return None;
        }
        let mut walk = CycleWalk {
            ready,
            start: self.rank,
            own,
            asked: vec![self.rank, peer.0],
            deadline: std::time::Instant::now() + CYCLE_TIME,
        };
        let mut path = vec![peer];
        if !walk.from(&mut path) {
            return None;
        }
        // Each rank's first send or receive that its next has not issued, the last's with this one.
        let mut ranks = vec![(self.rank, walk.own.clone())];
        ranks.extend(path.into_iter().map(|(r, stamps, _)| (r, stamps)));
        let calls: Vec<String> = (0..ranks.len()).map(|i| {
            let ((x, xs), (y, ys)) = (&ranks[i], &ranks[(i + 1) % ranks.len()]);
            let s = waits_on(*x, xs, *y, ys).unwrap_or_default();
            format!("rank {x} is in {}", describe(&s))
        }).collect();
        let names: Vec<String> = ranks.iter().map(|(r, _)| r.to_string()).collect();
        Some(format!(
            "ranks {} wait on each other in a cycle: {}; each waits for the next to issue the matching call, which it \
             cannot do before its own call finishes, so none of them can finish {DEADLOCK_ADVICE}",
            and_list(&names), and_list(&calls)))
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

    /// Why `peer` stopped, if it says it failed (used when all this rank saw was a closed
    /// connection).
    pub fn peer_failure(&self, peer: usize) -> Option<Error> {
        self.told_failure(peer).or_else(|| {
            // (Not `peer_runs`: no wait of this rank's to note.)
            self.peer_runs_once(peer, &[0u8; STAMP_BYTES], &|_| String::new(), false).err()
                .filter(|e| e.msg.contains(" failed: "))
        })
    }

    /// [`Comm::told_failure`], waiting [`TELL_GRACE`] for it: a peer that failed told this
    /// rank before it closed its connections, but the news may not have been read yet.
    pub fn told_failure_within(&self, peer: usize) -> Option<Error> {
        within(TELL_GRACE, || self.told_failure(peer))
    }

    /// `peer`'s failure as it told this rank before it went ([`Comm::tell_failure`]).
    fn told_failure(&self, peer: usize) -> Option<Error> {
        let told = self.ready.get()?.service.told_failed(peer)?;
        let (&code, msg) = told.split_first()?;
        Some(self.peer_failed(peer, code, msg))
    }

    /// `peer`'s failure from its [`failure_bytes`]: "rank 3 (host, pid) failed: ...".
    fn peer_failed(&self, peer: usize, code: u8, msg: &[u8]) -> Error {
        let code = Code::from_raw(code as i32).unwrap_or(Code::RemoteError);
        Error::new(code, format!("{} failed: {}", self.describe_peer(peer), String::from_utf8_lossy(msg)))
    }

    /// This rank fails with `e`, having lost a peer: tell the peers nearest it in rank order
    /// (all of them in a communicator of up to [`TELL_NEAREST`]), before its connections close
    /// and its process perhaps exits, so that one that finds it gone knows it went after
    /// failing itself and names the rank lost first as the culprit. Same-host peers take the
    /// news at once; within [`TELL_WITHIN`] in all.
    pub fn tell_failure(&self, e: &Error, lost: &[usize]) {
        let Some(ready) = self.ready.get() else { return };
        let n = self.nranks;
        let mut told = vec![false; n];
        told[self.rank] = true;
        for &p in lost.iter().filter(|&&p| p < n) {
            told[p] = true;
        }
        let mut near = Vec::with_capacity(TELL_NEAREST.min(n));
        for p in (1..=n / 2).flat_map(|d| [(self.rank + d) % n, (self.rank + n - d) % n]) {
            if near.len() == TELL_NEAREST {
                break;
            }
            if !std::mem::replace(&mut told[p], true) {
                near.push(p);
            }
        }
        let asked = near.len();
        if asked == 0 {
            return;
        }
        let why = failure_bytes(e);
        let told = ready.service.tell_failed(near.into_iter(), &why, std::time::Duration::from_millis(100), TELL_WITHIN);
        let others = if told < asked { " (the others are gone or did not answer in time)" } else { "" };
        crate::info!(INIT, "rank {}: told {told} of {asked} peers that this rank failed{others}", self.rank);
    }

    /// Release connections and stop the bootstrap service (destroy/abort).
    pub fn shutdown(&self) {
        if let Some(s) = self.streamed.get() {
            s.close();
        }
        self.rma.close();
        if let Some(r) = self.ready.get() {
            let mut conns = r.conns();
            crate::transport::forget_unaccepted(self.rank, self.hash, &r.peers, &conns);
            conns.close_all();
            drop(conns);
            r.service.stop();
        }
    }
}

impl crate::bootstrap::service::Members for Comm {
    fn gone(&self, peer: usize) -> Option<String> {
        let (why, certain) = self.peer_gone(peer)?;
        certain.then(|| format!("{} is gone ({why})", self.describe_peer(peer)))
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        self.shutdown();
    }
}


/// A reduction resolved for one operation (built-ins, or a PreMulSum with its scalar read).
/// In CUDA mode a scalar in device, pinned or managed memory cannot be read now (the stream
/// may not have written it yet): its address comes back instead, for the stream worker to read
/// in stream order.
pub fn resolve_op(comm: &Comm, raw: i32, dt: DataType) -> Result<(RedOp, Option<crate::device::host::UserPtr>)> {
    if let Some(b) = crate::types::BuiltinOp::from_raw(raw) {
        return Ok((RedOp::Builtin(b), None));
    }
    let op = comm
        .user_op(raw)
        .ok_or_else(|| Error::invalid_arg(format!("invalid reduction operator {raw}")))?;
    if op.datatype != dt {
        return Err(Error::invalid_arg(format!(
            "reduction operator {raw} was created for {} but the operation uses {}",
            op.datatype.name(),
            dt.name()
        )));
    }
    let scalar = match op.scalar {
        ScalarSource::Immediate(s) => s,
        ScalarSource::Pointer(p) => {
            // Memory the stream may still be writing (device, pinned, managed) is read in
            // stream order, when the operation starts; pageable memory now, as in host mode.
            if crate::device::mode::is_cuda() {
                let kind = crate::device::cuda::classify(p.addr())
                    .map_err(|e| e.context(format!("classifying the PreMulSum scalar at {:#x}", p.addr())))?;
                if kind.stream_ordered() {
                    return Ok((RedOp::PreMulSum(crate::types::Scalar { bytes: [0; 8] }), Some(p)));
                }
            }
            crate::device::host::read_scalar(dt, p)?
        }
    };
    Ok((RedOp::PreMulSum(scalar), None))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two ranks each receiving from the other are crossed only when no finished send of
    /// either is still to be received (found by a probe that stopped processes with SIGSTOP: a
    /// rank whose small send to a stopped peer had finished was told its receive from that peer
    /// was crossed with the peer's, which the send would have satisfied). Sends both ways are
    /// crossed unless one was taken already (its rank, stopped, has yet to mark it done); mixed
    /// directions never are.
    #[test]
    fn receives_are_crossed_only_with_nothing_on_its_way() {
        assert_eq!(crossed(&[false], &[false], (3, 5), (5, 3)), Some(false), "nothing in flight");
        assert_eq!(crossed(&[false], &[false], (4, 5), (5, 3)), None, "this rank's 4th send is still to be received");
        assert_eq!(crossed(&[false], &[false], (3, 5), (6, 3)), None, "the peer's 6th send is still to be received here");
        assert_eq!(crossed(&[true, true], &[true], (9, 0), (0, 2)), Some(true), "sends both ways wait for ever");
        assert_eq!(crossed(&[true], &[true], (3, 5), (5, 4)), None, "the peer took this rank's 4th send");
        assert_eq!(crossed(&[true], &[true], (3, 6), (5, 3)), None, "this rank took the peer's 6th send");
        assert_eq!(crossed(&[false], &[true], (0, 0), (0, 0)), None, "a send meets a receive");
        assert_eq!(crossed(&[], &[false], (0, 0), (0, 0)), None);
        assert_eq!(crossed(&[false], &[], (0, 0), (0, 0)), None);
    }

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

    /// A status answer carries what the peer finished with the rank asked about, and with each
    /// rank it runs sends or receives with, ahead of the status.
    #[test]
    fn status_answers_lead_with_the_counts() {
        let sent = Answer { about: (7, 9), issued: 11, with: vec![(4, (2, 3))], waits: None,
                            status: &[STATUS_RUNNING, 1, 2][..] };
        let answer = sent.write();
        assert_eq!(&answer[..16], [7u64.to_le_bytes(), 9u64.to_le_bytes()].concat());
        assert_eq!(Answer::read(&answer), sent);
        let noted = Answer { waits: Some((5, b"rank 5 (h, pid 1), which has not issued that call")),
                             with: sent.with.clone(), ..sent };
        assert_eq!(Answer::read(&noted.write()), noted, "with the rank it waits for");
        let reached = Answer { waits: Some((6, b"")), ..sent };
        assert_eq!(Answer::read(&reached.write()), reached, "or the furthest rank it reached");
        let nothing = Answer { about: (0, 0), issued: 0, with: vec![], waits: None, status: &[][..] };
        assert_eq!(Answer::read(&[1, 2]), nothing, "a short answer reads as nothing");
        assert_eq!(Answer::read(&answer[..30]), nothing, "so does one cut short in its counts");
        assert_eq!(Answer::read(&noted.write()[..60]), nothing, "or in its note");
        let mut huge = answer.clone();
        huge[24..28].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(Answer::read(&huge), nothing, "or one that claims more counts than it has");
        let mut long_note = answer.clone();
        long_note[48..52].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(Answer::read(&long_note), nothing, "or a longer note");
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

    /// In a search for a cycle, a rank waits on the next only with a call that still waits:
    /// not a receive whose message the next has sent (finished) and is on its way, nor a send
    /// the next has finished receiving (its rank, stopped, has yet to mark it done). Before, a
    /// rank of a ring of three, stopped by a debugger, could make the others find a cycle.
    #[test]
    fn a_rank_waits_on_another_only_for_what_is_not_on_its_way() {
        use crate::plan::ops::with_role;
        let base = [200u8; STAMP_BYTES];
        let (recv_from_2, send_to_2) = ([with_role(base, false, 2)], [with_role(base, true, 2)]);
        let recv_from_1 = [with_role(base, false, 1)];
        // Rank 0 receives from rank 2, which receives from rank 1: 0 waits on 2 ...
        assert!(waits_for(0, &recv_from_2, &[(2, (1, 1))], 2, &recv_from_1, (1, 1)));
        // ... unless 2 has finished a send to 0 that 0 has yet to receive.
        assert!(!waits_for(0, &recv_from_2, &[(2, (1, 1))], 2, &recv_from_1, (2, 1)));
        // Rank 0 sends to rank 2 (which does not receive from it now): it waits ...
        assert!(waits_for(0, &send_to_2, &[(2, (3, 0))], 2, &recv_from_1, (0, 3)));
        // ... unless 2 finished receiving it.
        assert!(!waits_for(0, &send_to_2, &[(2, (3, 0))], 2, &recv_from_1, (0, 4)));
        // Without what 0 finished with 2, nothing is claimed.
        assert!(!waits_for(0, &recv_from_2, &[], 2, &recv_from_1, (1, 1)));
        // A rank that issued the matching call is not waited on.
        assert!(!waits_for(0, &recv_from_2, &[(2, (1, 1))], 2, &[with_role(base, true, 0)], (1, 1)));
    }

    #[test]
    fn a_communicator_running_nothing_says_what_the_others_run() {
        let (idle, busy) = (crate::bootstrap::service::Status::default(), crate::bootstrap::service::Status::default());
        let (idle_serial, busy_serial) = (u64::MAX - 1, u64::MAX - 2);
        let (idle_waits, busy_waits) = (Waits::default(), Waits::default());
        elsewhere::enlist(idle_serial, 0x1111, 0, 2, &idle, &idle_waits);
        elsewhere::enlist(busy_serial, 0x2222, 1, 3, &busy, &busy_waits);
        let stamp = [0u8; STAMP_BYTES];
        set_status(&mut busy.lock().unwrap(), STATUS_RUNNING, [stamp].into_iter());
        set_status(&mut idle.lock().unwrap(), STATUS_RUNNING, std::iter::empty());
        let answer = status_answer(&idle, idle_serial);
        let text = String::from_utf8_lossy(&answer[1..]).into_owned();
        assert_eq!(answer[0], STATUS_ELSEWHERE, "{text}");
        assert!(text.contains("on communicator 0x2222 as rank 1 of 3"), "{text}");
        assert!(!text.contains("0x1111"), "{text}");
        assert!(!text.contains("held up"), "{text}");
        // With what holds that call up, while the note is fresh and of that call.
        let note = |stamp: Stamp, at: std::time::Instant| {
            *busy_waits.lock().unwrap() = Some(WaitNote { stamp, rank: 2, text: "rank 2 (h, pid 3), which has not issued \
                                                                               that call".to_string(), at });
            String::from_utf8_lossy(&status_answer(&idle, idle_serial)[1..]).into_owned()
        };
        let held = note(stamp, std::time::Instant::now());
        assert!(held.ends_with("as rank 1 of 3, held up there by rank 2 (h, pid 3), which has not issued that call"),
                "{held}");
        let said = PeerRuns::Elsewhere(held).why_waiting(&stamp, &|_| String::new()).unwrap_or_default();
        assert!(!said.contains("different orders"), "{said}");
        let mut other = stamp;
        other[0] = 1;
        assert!(!note(other, std::time::Instant::now()).contains("held up"), "a note of another call");
        // Nor a note of how far it got (no rank found yet).
        *busy_waits.lock().unwrap() = Some(WaitNote { stamp, rank: 2, text: String::new(), at: std::time::Instant::now() });
        let reached = String::from_utf8_lossy(&status_answer(&idle, idle_serial)[1..]).into_owned();
        assert!(reached.ends_with("as rank 1 of 3"), "{reached}");
        if let Some(stale) = std::time::Instant::now().checked_sub(NOTE_FRESH) {
            assert!(!note(stamp, stale).contains("held up"), "a stale note");
        }
        // A communicator that runs something answers with that, whatever the others run.
        assert_eq!(status_answer(&busy, busy_serial)[0], STATUS_RUNNING);
        drop(busy);
        let after = status_answer(&idle, idle_serial);
        assert!(!String::from_utf8_lossy(&after).contains("0x2222"), "a gone communicator is not named");
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

    #[test]
    fn wait_notes_are_capped() {
        assert_eq!(capped("short".to_string()), "short");
        let long = capped("é".repeat(NOTE_MAX));
        assert!(long.len() <= NOTE_MAX + 3 && long.ends_with("...") && long.starts_with("éé"), "{}", long.len());
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

    /// A finished send or receive leaves what peers hear of the status, found at the index
    /// given or, where that holds another, by search; once every one finished, the status is
    /// empty, and the communicator answers with what the process's others run.
    #[test]
    fn finished_sends_and_receives_leave_the_status() {
        use crate::plan::ops::with_role;
        let p2p = |bytes: u8| {
            let mut s = [0u8; STAMP_BYTES];
            s[0] = 200; // (ops::P2P_KIND)
            s[8] = bytes;
            s
        };
        let ops = [with_role(p2p(4), true, 1), with_role(p2p(8), false, 1), with_role(p2p(4), false, 2)];
        let running = crate::bootstrap::service::Status::default();
        let serial = u64::MAX - 3;
        elsewhere::enlist(serial, 0x3333, 0, 3, &running, &Waits::default());
        set_status(&mut running.lock().unwrap(), STATUS_RUNNING, ops.iter().copied());
        mark_finished(&mut running.lock().unwrap(), &ops[1], 1);
        let live = |bytes: &[u8]| status_stamps(bytes).collect::<Vec<_>>();
        assert_eq!(live(&status_answer(&running, serial)), [ops[0], ops[2]]);
        // A wrong index: found by search; one not running: nothing changes.
        mark_finished(&mut running.lock().unwrap(), &ops[2], 0);
        mark_finished(&mut running.lock().unwrap(), &with_role(p2p(16), true, 2), 0);
        let answer = status_answer(&running, serial);
        assert_eq!((answer[0], live(&answer)), (STATUS_RUNNING, vec![ops[0]]));
        assert_eq!(answer.len(), 1 + STAMP_BYTES, "finished places are not sent");
        mark_finished(&mut running.lock().unwrap(), &ops[0], 0);
        assert!(live(&running.lock().unwrap()).is_empty());
        assert!(elsewhere::running_except(u64::MAX).is_none_or(|t| !t.contains("0x3333")), "it runs nothing");
        assert_ne!(status_answer(&running, serial).get(1..), Some(&[0xFF; STAMP_BYTES][..]));
    }

    #[test]
    fn a_failed_status_stays() {
        let mut bytes = Vec::new();
        set_status(&mut bytes, STATUS_STREAM, [[7u8; STAMP_BYTES]].into_iter());
        assert_eq!((bytes[0], bytes.len()), (STATUS_STREAM, 1 + STAMP_BYTES));
        set_status(&mut bytes, STATUS_RUNNING, std::iter::empty());
        assert_eq!(bytes, vec![STATUS_RUNNING]);
        bytes = vec![STATUS_FAILED, Code::UnhandledCudaError as u8, b'x'];
        set_status(&mut bytes, STATUS_RUNNING, std::iter::empty());
        set_status(&mut bytes, STATUS_STREAM, [[1u8; STAMP_BYTES]].into_iter());
        assert_eq!(bytes, vec![STATUS_FAILED, Code::UnhandledCudaError as u8, b'x'], "the failure is what peers hear");
    }
}
