//! `ncclWaitSignal` waited for on the calling thread (host memory, or host-wait mode): until
//! the signals have come, naming at WARN the senders that are late, stopped, gone, or closed
//! their communicator, and failing once one never can send them ([`wait_for`]). The same
//! looks for the waits of callers' streams, made by the sender thread ([`probe_waits`]).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::{SignalKey, State, WaitDesc, CLOSED, PROBE_EVERY, PUBLISH_AFTER, SPIN, WARN_AFTER};
use crate::comm::Comm;
use crate::error::{Error, Result};

/// What a wait needs of one signal: the count it must reach (what earlier waits consumed plus
/// what this one asks; a signal named twice asks both counts).
pub(super) fn wanted_counts(st: &State, descs: &[WaitDesc]) -> Vec<(SignalKey, u64)> {
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
pub(super) type Missing = (SignalKey, u64, u64);

/// "1 of 2 signal(s) from rank 3 (signal 0, context 0)": counted from what earlier waits consumed.
pub(super) fn describe_missing(st: &State, &((ctx, sig, from), got, want): &Missing) -> String {
    let before = st.consumed.get(&(ctx, sig, from)).copied().unwrap_or(0);
    format!("{} of {} signal(s) from rank {from} (signal {sig}, context {ctx})", got.saturating_sub(before), want - before)
}

/// Why a wait cannot end, if it cannot: its communicator was aborted or revoked (as every wait
/// of an operation stops), or a sender it waits on closed its connection.
pub(super) fn hopeless(comm: &Comm, st: &State, missing: &[Missing]) -> Option<Error> {
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
pub(super) fn gone_sender(comm: &Comm, peers: Vec<(u32, String)>, unreachable: &mut HashMap<u32, Instant>) -> Option<Error> {
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
pub(super) struct Published<'a>(&'a Comm);

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
pub(super) fn stopped_senders(comm: &Comm, peers: &[(u32, String)], seen: &mut HashMap<u32, Looks>, waited: Duration)
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
pub(super) struct Looks {
    probes: u32,
    stopped: u32,
    how: String,
    said: bool,
}

/// Block until every descriptor's signals have come, then consume them.
pub(super) fn wait_for(comm: &Comm, descs: &[WaitDesc]) -> Result<()> {
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

/// Streams that wait for signals from ranks that are gone (see `gone_sender`) are let go, with
/// the communicator's asynchronous error naming the rank: no thread waits on the host for them.
/// A signal short of what a stream waits for after 10 s is named at WARN (once per wait), as
/// a wait on the host says (`wait_for`); one from a sender whose process, of this host, is
/// stopped, at once (a second in).
pub(super) fn probe_waits(comm: &Comm, unreachable: &mut HashMap<u32, Instant>) {
    let inner = &comm.rma.inner;
    let mut short = Vec::new();
    let mut senders: Vec<u32> = {
        let mut st = inner.lock();
        let st = &mut *st;
        let mut late = Vec::new();
        for (k, p) in st.pending.iter_mut() {
            let got = st.arrived.get(k).copied().unwrap_or(0);
            if got < p.want && !p.said_stopped && k.2 as usize != comm.rank && p.since.elapsed() >= PROBE_EVERY {
                short.push((*k, p.since.elapsed(), format!("{got} of {} have come", p.want)));
            }
            if got < p.want && !p.warned && p.since.elapsed() >= super::WARN_AFTER {
                p.warned = true;
                late.push(format!("from rank {} (signal {}, context {}), {got} of {} have come (counted from the \
                                   communicator's start)", k.2, k.1, k.0, p.want));
            }
        }
        if !late.is_empty() {
            late.sort();
            crate::warn!("rank {}: a stream has waited {} s or more in ncclWaitSignal for signals {}", comm.rank,
                         super::WARN_AFTER.as_secs(), late.join("; "));
        }
        st.pending.iter()
            .filter(|(k, p)| k.2 as usize != comm.rank && st.arrived.get(k).copied().unwrap_or(0) < p.want)
            .map(|(k, _)| k.2).collect()
    };
    said_stopped(comm, short);
    senders.sort_unstable();
    senders.dedup();
    for p in senders {
        let what = "not all of the signals a stream waits for".to_string();
        if let Some(e) = gone_sender(comm, vec![(p, what)], unreachable) {
            inner.release_waits(|k| k.2 == p, &e);
        }
    }
}

/// Of signals that streams have waited for a second or more (`short`: the signal, how long,
/// how many came), those whose sender's process, of this host, is stopped (SIGSTOP, Ctrl-Z, a
/// debugger) are named at WARN, each once per wait. A rank whose stream is held so said nothing
/// for 10 s ([`super::WARN_AFTER`]).
fn said_stopped(comm: &Comm, mut short: Vec<(SignalKey, Duration, String)>) {
    short.sort_by_key(|(k, ..)| *k);
    let mut said = Vec::new();
    let mut looked: Vec<(u32, Option<&str>)> = Vec::new();
    for (k, waited, came) in short {
        let how = match looked.iter().find(|(p, _)| *p == k.2) {
            Some(&(_, how)) => how,
            None => {
                let how = comm.peer_stopped(k.2 as usize);
                looked.push((k.2, how));
                how
            }
        };
        let Some(how) = how else { continue };
        crate::warn!("rank {}: a stream has waited {:.1} s in ncclWaitSignal for signal {} (context {}) from {}, {came}: \
                      {how}", comm.rank, waited.as_secs_f64(), k.1, k.0, comm.describe_peer(k.2 as usize));
        said.push(k);
    }
    if said.is_empty() {
        return;
    }
    let mut st = comm.rma.inner.lock();
    for k in said {
        if let Some(p) = st.pending.get_mut(&k) {
            p.said_stopped = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
