//! Sends and receives that can never finish: two ranks crossed (each only sends to the other,
//! or each only receives), or a cycle of ranks each waiting for the next's matching call.

use super::ready::Ready;
use super::status::*;
use super::Comm;
use crate::error::{Code, Error};
use crate::transport::Stamp;

/// What the error of sends and receives that wait on each other for ever says to do.
pub(super) const DEADLOCK_ADVICE: &str = "(put a rank's sends and receives with its peers in one \
                                          ncclGroupStart/ncclGroupEnd group, or order them so that each send meets its \
                                          receive)";

/// Is `e` the error [`Comm::peer_runs`] gives for sends and receives that wait on each other
/// for ever (crossed, or round a cycle)?
pub fn is_deadlock(e: &Error) -> bool {
    e.code == Code::InvalidUsage && e.msg.contains(DEADLOCK_ADVICE)
}

/// Status requests one search for a cycle of waiting ranks may make ([`Comm::waits_in_cycle`]),
/// and the time it may take.
pub(super) const CYCLE_ASKS: usize = 64;
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

/// Are two ranks' sends and receives with each other crossed, so that neither can finish: each
/// only sends to the other (Some(true)), or each only receives from it (Some(false))? `own`,
/// `theirs`: the directions (true: a send) of what each runs with the other; `own_done`,
/// `theirs_done`: the sends to the other and the receives from it each has finished. Only
/// calls that still wait count ([`still_waits`]): a small send finishes at once, and its
/// receiver, stopped or slow, may show for a while the receive that will take it; a send whose
/// receiver finished taking it may show while its rank, stopped, has yet to mark it done.
pub(super) fn crossed(own: &[bool], theirs: &[bool], own_done: (u64, u64), theirs_done: (u64, u64)) -> Option<bool> {
    let &dir = own.first()?;
    if !own.iter().chain(theirs).all(|&s| s == dir) || theirs.is_empty() {
        return None;
    }
    (still_waits(dir, own_done, theirs_done) && still_waits(dir, theirs_done, own_done)).then_some(dir)
}

/// Can rank x's send (`send`) or receive with rank y still be waiting for y's call, given what
/// each has finished with the other (x_done: x's sends to y and receives from y; y_done:
/// y's to and from x)? Not if y has finished more receives from x than x sends to it (x's
/// send was taken: x, stopped or slow, has yet to mark it done), nor if y has finished more
/// sends to x than x receives from it (the message for x's receive is on its way).
fn still_waits(send: bool, x_done: (u64, u64), y_done: (u64, u64)) -> bool {
    if send { y_done.1 <= x_done.0 } else { y_done.0 <= x_done.1 }
}

impl Comm {
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
    pub(super) fn waits_in_cycle(&self, ready: &Ready, peer: Waiting, peer_done: (u64, u64),
                                 describe: &dyn Fn(&Stamp) -> String) -> Option<String> {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::STAMP_BYTES;

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
}
