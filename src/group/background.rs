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
//! Each communicator's operations run in issue order: a job starts once the earlier jobs of
//! every communicator it uses are done (tickets taken under one lock, so two jobs on
//! overlapping sets never wait for each other). Until then it waits in a list, not on a
//! thread: a program may issue many calls before it polls. Anything else that runs
//! operations on a communicator — a group mixing blocking and nonblocking communicators,
//! device buffers, destroy, abort — first waits until its earlier jobs are done
//! (`wait_idle`). A nonblocking communicator's ncclCommFinalize is a job of its own: it
//! returns `ncclInProgress`, and the state turns to `ncclSuccess` once everything issued
//! before it is done.

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

/// Jobs issued while an earlier job of one of their communicators was not done; locked while a
/// job takes its tickets on every communicator it uses. (Before, each job waited for its turn
/// on a thread of its own: 2000 nonblocking all-reduces issued before one poll held 1942
/// threads per process.)
static WAITING: crate::abi::fork::PerForkMutex<std::collections::VecDeque<Job>> =
    crate::abi::fork::PerFork::new(crate::abi::fork::anew);

/// A group's operations (or a finalize, a split...) on nonblocking communicators, and its
/// ticket on each.
struct Job {
    comms: Vec<Arc<Comm>>,
    tickets: Vec<u64>,
    run: Box<dyn FnOnce() -> Result<()> + Send>,
    /// The rank the caller's log lines show.
    shown: i32,
}

impl Job {
    /// Whether every earlier job of its communicators is done.
    fn turn(&self) -> bool {
        self.comms.iter().zip(&self.tickets).all(|(c, &t)| c.background.done() >= t)
    }
}

fn waiting() -> std::sync::MutexGuard<'static, std::collections::VecDeque<Job>> {
    WAITING.lock().unwrap_or_else(|p| p.into_inner())
}

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

    /// How many of its jobs are done.
    fn done(&self) -> u64 {
        self.lock().done
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
    let now = {
        let mut w = waiting();
        let tickets = comms.iter().map(|c| c.background.issue(c)).collect();
        let job = Job { comms, tickets, run, shown: crate::debug::shown_rank() };
        if job.turn() {
            Some(job)
        } else {
            // Started by the job that makes it its turn (`run_jobs`).
            w.push_back(job);
            None
        }
    };
    match now {
        Some(job) => match on_a_thread_or_fail(job) {
            Some(e) => Err(e),
            None => Err(Error::in_progress()),
        },
        None => Err(Error::in_progress()),
    }
}

/// Start `job` on a thread. If none can be started, the job fails (its communicators get the
/// error, which is returned) and the jobs whose turn that makes are started in its place.
fn on_a_thread_or_fail(job: Job) -> Option<Error> {
    let mut to_start = vec![job];
    let mut first_error = None;
    while let Some(job) = to_start.pop() {
        let Err((job, e)) = on_a_thread(job) else { continue };
        let e = Error::os("spawn a thread for a nonblocking communicator's operations", e);
        for c in &job.comms {
            c.set_async_error(&e);
            c.background.finish(c);
        }
        to_start.extend(now_their_turn(&job.comms));
        first_error.get_or_insert(e);
    }
    first_error
}

/// Run `job`, then each job whose turn it makes (one here, any others on threads of their own).
fn run_jobs(job: Job) {
    let mut next = Some(job);
    while let Some(job) = next.take() {
        crate::debug::set_rank(job.shown);
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job.run));
        let failed = match ran {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e),
            Err(p) => Some(Error::internal(format!("operation thread panicked: {}", crate::abi::panic_message(&*p)))),
        };
        for c in &job.comms {
            if let Some(e) = &failed {
                c.set_async_error(e);
            }
            c.background.finish(c);
        }
        let mut ready = now_their_turn(&job.comms).into_iter();
        next = ready.next();
        for other in ready {
            // (Its error, if no thread starts, is its communicators'.)
            let _ = on_a_thread_or_fail(other);
        }
    }
}

/// The waiting jobs whose turn it is now that a job on `comms` is done, in the order they were
/// issued, taken off the list.
fn now_their_turn(comms: &[Arc<Comm>]) -> Vec<Job> {
    let mut w = waiting();
    if w.is_empty() {
        return Vec::new();
    }
    // Only a job holding the next ticket of one of these communicators can be ready, and one
    // job at most holds each: the scan ends once each is found (at once for a program's calls
    // issued back to back on one communicator).
    let mut next: Vec<(*const Comm, u64)> = comms.iter().map(|c| (Arc::as_ptr(c), c.background.done())).collect();
    let mut ready = Vec::new();
    let mut k = 0;
    while k < w.len() && !next.is_empty() {
        let before = next.len();
        let job = &w[k];
        next.retain(|&(c, t)| !job.comms.iter().zip(&job.tickets).any(|(d, &u)| Arc::as_ptr(d) == c && u == t));
        if next.len() < before && job.turn() {
            ready.extend(w.remove(k));
        } else {
            k += 1;
        }
    }
    ready
}

/// Threads that ran a job and wait for the next (each with its number): jobs run on them
/// rather than on a thread started per call. Jobs may wait for each other (ranks of this
/// process), so each runs on a thread of its own: one is started when none is idle. A forked
/// child starts with none: it inherits the list, not the threads, and a job sent to one would
/// never run (found by a probe: a child's nonblocking all-reduce stayed in progress for ever).
static IDLE: crate::abi::fork::PerForkMutex<Vec<Idle>> = crate::abi::fork::PerFork::new(crate::abi::fork::anew);

type Idle = (u64, std::sync::mpsc::Sender<Job>);
/// How long an idle thread waits for a job before it ends.
const IDLE_FOR: std::time::Duration = std::time::Duration::from_secs(30);

fn idle() -> std::sync::MutexGuard<'static, Vec<Idle>> {
    IDLE.lock().unwrap_or_else(|p| p.into_inner())
}

/// Run `job` (and the jobs whose turn it makes: `run_jobs`) on an idle thread, or on a new
/// one; the job back if no thread could be started.
fn on_a_thread(job: Job) -> std::result::Result<(), (Job, std::io::Error)> {
    let mut job = job;
    loop {
        let Some((_, tx)) = idle().pop() else { break };
        // A thread takes what is sent to it once it is taken off the list (`serve`); only one
        // that died (it cannot: jobs catch their panics) would hand the job back.
        match tx.send(job) {
            Ok(()) => return Ok(()),
            Err(std::sync::mpsc::SendError(j)) => job = j,
        }
    }
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let me = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    // The job goes by the channel once the thread exists, so a failed start leaves it here.
    let (tx, rx) = std::sync::mpsc::channel::<Job>();
    let started = std::thread::Builder::new().name("nccl-rs-nonblock".into()).spawn({
        let tx = tx.clone();
        move || serve(me, tx, rx)
    });
    if let Err(e) = started {
        return Err((job, e));
    }
    crate::info!(INIT, "started thread {me} for nonblocking communicators' operations");
    // (The thread holds the receiver until it ends, which it does only once idle.)
    tx.send(job).map_err(|std::sync::mpsc::SendError(j)| (j, std::io::Error::other("the new thread ended")))
}

/// How long a thread that ran a job looks for the next before it sleeps: a program that
/// issues a call, polls it done and issues the next (NCCL's nonblocking pattern) hands it over
/// within a few µs, and a sleeping thread takes as long again to wake.
const LOOK_FOR: std::time::Duration = std::time::Duration::from_micros(100);

/// The next job if one comes within [`LOOK_FOR`] (spinning or yielding as the engine does
/// while it waits: `proxy::Backoff`).
fn soon(rx: &std::sync::mpsc::Receiver<Job>) -> Option<Job> {
    let until = std::time::Instant::now() + LOOK_FOR;
    let mut back_off = crate::proxy::Backoff::new();
    let mut rounds = 0u32;
    loop {
        if let Ok(t) = rx.try_recv() {
            return Some(t);
        }
        rounds += 1;
        // (The clock is read every 16 rounds: a spin round is far shorter than a read.)
        if rounds.is_multiple_of(16) && std::time::Instant::now() >= until {
            return None;
        }
        back_off.wait();
    }
}

/// A thread's life: run the job sent to it, offer itself for the next, and end after
/// `IDLE_FOR` without one. Once taken off the list by a caller it waits for that caller's job.
fn serve(me: u64, tx: std::sync::mpsc::Sender<Job>, rx: std::sync::mpsc::Receiver<Job>) {
    // (Host-wait mode's jobs copy results out and synchronise: no capture may forbid them.)
    crate::device::cuda::relax_capture_mode();
    let mut next = rx.recv().ok();
    while let Some(job) = next.take() {
        run_jobs(job);
        idle().push((me, tx.clone()));
        if let Some(j) = soon(&rx) {
            next = Some(j);
            continue;
        }
        next = match rx.recv_timeout(IDLE_FOR) {
            Ok(j) => Some(j),
            Err(_) => {
                let mut list = idle();
                match list.iter().position(|(n, _)| *n == me) {
                    // Nobody took it: it ends.
                    Some(k) => {
                        list.remove(k);
                        None
                    }
                    // A caller took it and sends (or sent) its job.
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
        let (tx, rx) = std::sync::mpsc::channel::<Job>();
        assert!(soon(&rx).is_none(), "nothing sent: it stops looking");
        let ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let r = ran.clone();
        let run = Box::new(move || {
            r.store(true, std::sync::atomic::Ordering::Relaxed);
            Ok(())
        });
        tx.send(Job { comms: Vec::new(), tickets: Vec::new(), run, shown: 0 }).expect("send");
        let job = soon(&rx).expect("the job sent is taken");
        (job.run)().expect("the job runs");
        assert!(ran.load(std::sync::atomic::Ordering::Relaxed));
        assert!(soon(&rx).is_none(), "taken once");
    }
}
