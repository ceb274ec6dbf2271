//! Nonblocking communicators (`config.blocking = 0`) with host buffers: a group's operations
//! run on a thread of their own (kept for later ones: `on_a_thread`), and the call returns
//! `ncclInProgress` at once, as NCCL's do. In CUDA mode's host-wait mode the operations on
//! device buffers are queued by the call and only the wait for them (with the group's
//! host-buffer part) is such a job. `ncclCommGetAsyncError` says `ncclInProgress`
//! until they are done, then `ncclSuccess` or their error; `ncclCommAbort` from the calling
//! thread stops them. So the fault-tolerance pattern NCCL documents (issue, poll with a
//! deadline, abort) works in host mode too, instead of the call itself waiting for a late or
//! lost peer.
//!
//! Each communicator's operations run in issue order: a job waits for the earlier jobs of
//! every communicator it uses (tickets taken under one lock, so two jobs on overlapping sets
//! never wait for each other). Anything else that runs operations on a communicator — a
//! group mixing blocking and nonblocking communicators, device buffers, destroy, abort —
//! first waits until its earlier jobs are done (`wait_idle`). A nonblocking communicator's
//! ncclCommFinalize is a job of its own: it returns `ncclInProgress`, and the state turns to
//! `ncclSuccess` once everything issued before it is done.

use std::sync::{Arc, Condvar, Mutex};

use crate::comm::Comm;
use crate::error::{Error, Result};

/// One communicator's background jobs: how many were issued, how many are done.
#[derive(Default)]
pub struct Background {
    state: Mutex<Counts>,
    changed: Condvar,
}

#[derive(Default)]
struct Counts {
    issued: u64,
    done: u64,
}

/// Taken while a job takes its tickets on every communicator it uses.
static ISSUE: crate::abi::fork::PerForkMutex<()> = crate::abi::fork::PerFork::new(crate::abi::fork::anew);

impl Background {
    fn lock(&self) -> std::sync::MutexGuard<'_, Counts> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A ticket for the next job; the communicator is in progress until every job is done.
    fn issue(&self, comm: &Comm) -> u64 {
        let mut c = self.lock();
        c.issued += 1;
        comm.set_in_progress();
        c.issued - 1
    }

    /// Wait until the jobs issued before ticket `t` are done.
    fn wait_turn(&self, t: u64) {
        let mut c = self.lock();
        while c.done < t {
            c = self.changed.wait(c).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn finish(&self, comm: &Comm) {
        let mut c = self.lock();
        c.done += 1;
        if c.done == c.issued {
            comm.clear_in_progress();
        }
        self.changed.notify_all();
    }
}

/// Wait until every job issued on `comm` so far is done (they end on their own: an abort
/// stops them within the progress engine's check interval).
pub fn wait_idle(comm: &Comm) {
    wait_done(comm, None);
}

/// [`wait_idle`] for at most `limit`; whether they are done.
pub fn wait_idle_for(comm: &Comm, limit: std::time::Duration) -> bool {
    wait_done(comm, Some(std::time::Instant::now() + limit))
}

fn wait_done(comm: &Comm, until: Option<std::time::Instant>) -> bool {
    // Only nonblocking communicators have jobs: every call on a blocking one comes here, and
    // takes no lock.
    if comm.config.blocking {
        return true;
    }
    let b = &comm.background;
    let mut c = b.lock();
    let upto = c.issued;
    while c.done < upto {
        c = match until {
            None => b.changed.wait(c).unwrap_or_else(|p| p.into_inner()),
            Some(until) => {
                let now = std::time::Instant::now();
                if now >= until {
                    return false;
                }
                b.changed.wait_timeout(c, until - now).unwrap_or_else(|p| p.into_inner()).0
            }
        };
    }
    true
}

/// Whether a group of these operations runs in the background: host buffers only, every
/// communicator nonblocking.
pub fn eligible<'a>(mut ops: impl Iterator<Item = (&'a Comm, bool)>) -> bool {
    ops.all(|(c, device)| !device && !c.config.blocking)
}

/// Start `run` on a thread of its own after the earlier jobs of `comms`, and return
/// `ncclInProgress`. Its error goes to every communicator of the group
/// (`ncclCommGetAsyncError`; the first one recorded on each wins).
pub fn start(comms: Vec<Arc<Comm>>, run: Box<dyn FnOnce() -> Result<()> + Send>) -> Result<()> {
    for c in &comms {
        c.ready()?;
    }
    start_anyway(comms, run)
}

/// [`start`] whatever state the communicators are in (ncclCommFinalize).
pub fn start_anyway(comms: Vec<Arc<Comm>>, run: Box<dyn FnOnce() -> Result<()> + Send>) -> Result<()> {
    let tickets: Vec<u64> = {
        let _g = ISSUE.lock().unwrap_or_else(|p| p.into_inner());
        comms.iter().map(|c| c.background.issue(c)).collect()
    };
    let shown = crate::debug::shown_rank();
    let job_comms = comms.clone();
    let spawned = on_a_thread(Box::new(move || {
        crate::debug::set_rank(shown);
        for (c, &t) in job_comms.iter().zip(&tickets) {
            c.background.wait_turn(t);
        }
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(run));
        let failed = match ran {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e),
            Err(p) => Some(Error::internal(format!("operation thread panicked: {}", crate::abi::panic_message(&*p)))),
        };
        for c in &job_comms {
            if let Some(e) = &failed {
                c.set_async_error(e);
            }
            c.background.finish(c);
        }
    }));
    if let Err(e) = spawned {
        let e = Error::os("spawn a thread for a nonblocking communicator's operations", e);
        for c in &comms {
            c.set_async_error(&e);
            c.background.finish(c);
        }
        return Err(e);
    }
    Err(Error::in_progress())
}

type Task = Box<dyn FnOnce() + Send>;

/// Threads that ran a job and wait for the next (each with its number): jobs run on them
/// rather than on a thread started per call. Jobs may wait for each other (ranks of this
/// process), so each runs on a thread of its own: one is started when none is idle. A forked
/// child starts with none: it inherits the list, not the threads, and a task sent to one would
/// never run (found by a probe: a child's nonblocking all-reduce stayed in progress for ever).
static IDLE: crate::abi::fork::PerForkMutex<Vec<Idle>> = crate::abi::fork::PerFork::new(crate::abi::fork::anew);

type Idle = (u64, std::sync::mpsc::Sender<Task>);
/// How long an idle thread waits for a job before it ends.
const IDLE_FOR: std::time::Duration = std::time::Duration::from_secs(30);

fn idle() -> std::sync::MutexGuard<'static, Vec<Idle>> {
    IDLE.lock().unwrap_or_else(|p| p.into_inner())
}

/// Run `task` on an idle thread, or on a new one.
fn on_a_thread(task: Task) -> std::io::Result<()> {
    let mut task = task;
    loop {
        let Some((_, tx)) = idle().pop() else { break };
        // A thread takes what is sent to it once it is taken off the list (`serve`); only one
        // that died (it cannot: tasks catch their panics) would hand the task back.
        match tx.send(task) {
            Ok(()) => return Ok(()),
            Err(std::sync::mpsc::SendError(t)) => task = t,
        }
    }
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let me = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    std::thread::Builder::new().name("nccl-rs-nonblock".into()).spawn(move || serve(me, task))?;
    crate::info!(INIT, "started thread {me} for nonblocking communicators' operations");
    Ok(())
}

/// How long a thread that ran a task looks for the next before it sleeps: a program that
/// issues a call, polls it done and issues the next (NCCL's nonblocking pattern) hands it over
/// within a few µs, and a sleeping thread takes as long again to wake.
const LOOK_FOR: std::time::Duration = std::time::Duration::from_micros(100);

/// The next task if one comes within [`LOOK_FOR`] (spinning or yielding as the engine does
/// while it waits: `proxy::Backoff`).
fn soon(rx: &std::sync::mpsc::Receiver<Task>) -> Option<Task> {
    let until = std::time::Instant::now() + LOOK_FOR;
    let mut back_off = crate::proxy::Backoff::new();
    let mut rounds = 0u32;
    loop {
        if let Ok(t) = rx.try_recv() {
            return Some(t);
        }
        rounds += 1;
        // (The clock is read every 16 rounds: a spin round is far shorter than a read.)
        if rounds % 16 == 0 && std::time::Instant::now() >= until {
            return None;
        }
        back_off.wait();
    }
}

/// A thread's life: run its task, offer itself for the next, and end after `IDLE_FOR`
/// without one. Once taken off the list by a caller it waits for that caller's task.
fn serve(me: u64, first: Task) {
    // (Host-wait mode's jobs copy results out and synchronise: no capture may forbid them.)
    crate::device::cuda::relax_capture_mode();
    let (tx, rx) = std::sync::mpsc::channel::<Task>();
    let mut next = Some(first);
    while let Some(task) = next.take() {
        task();
        idle().push((me, tx.clone()));
        if let Some(t) = soon(&rx) {
            next = Some(t);
            continue;
        }
        next = match rx.recv_timeout(IDLE_FOR) {
            Ok(t) => Some(t),
            Err(_) => {
                let mut list = idle();
                match list.iter().position(|(n, _)| *n == me) {
                    // Nobody took it: it ends.
                    Some(k) => {
                        list.remove(k);
                        None
                    }
                    // A caller took it and sends (or sent) its task.
                    None => {
                        drop(list);
                        rx.recv().ok()
                    }
                }
            }
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A thread that ran a task takes the next one if it is there while it looks, and stops
    /// looking (to sleep in `recv_timeout`) when none comes.
    #[test]
    fn a_thread_looks_for_its_next_task_then_sleeps() {
        let (tx, rx) = std::sync::mpsc::channel::<Task>();
        assert!(soon(&rx).is_none(), "nothing sent: it stops looking");
        let ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let r = ran.clone();
        tx.send(Box::new(move || r.store(true, std::sync::atomic::Ordering::Relaxed))).expect("send");
        let task = soon(&rx).expect("the task sent is taken");
        task();
        assert!(ran.load(std::sync::atomic::Ordering::Relaxed));
        assert!(soon(&rx).is_none(), "taken once");
    }
}
