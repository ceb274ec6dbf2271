//! How a waiting thread gives up its CPU: naps that end when they should, and whether its
//! CPU is shared.
//!
//! Linux lets the sleep of a thread that is not real-time end up to the thread's timer slack
//! late, 50 us by default: a 50 us nap took 104 us on the 2-core development VM, a 10 us nap 64
//! us. A rank that naps while it waits for a late peer (the progress engine after 2 ms idle),
//! or a stream worker that naps while the caller's GPU works through what comes before a call,
//! so saw the event up to twice the nap late, ~52 us on average where ~27 was meant: in a ring
//! every waiting rank in turn. With a slack of 1 us the nap ends within a few us of its time;
//! it costs a little CPU (a nap loop took 7.6% of a core instead of 4.5%).

use std::marker::PhantomData;

/// The slack our naps run with, in nanoseconds.
const FINE_NS: libc::c_ulong = 1_000;

/// The calling thread's timer slack at [`FINE_NS`] until this is dropped (on the same thread:
/// it is not `Send`), then back at what it was. For a loop that may run on a caller's thread.
pub struct FineNaps {
    old: Option<libc::c_ulong>,
    _this_thread: PhantomData<*const ()>,
}

impl FineNaps {
    pub fn start() -> FineNaps {
        FineNaps { old: set_fine(), _this_thread: PhantomData }
    }
}

impl Drop for FineNaps {
    fn drop(&mut self) {
        if let Some(old) = self.old {
            // SAFETY: PR_SET_TIMERSLACK sets the calling thread's slack; it touches no memory.
            unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, old) };
        }
    }
}

/// The same for good, on a thread of the library's own (a stream worker).
pub fn fine_for_this_thread() {
    let _ = set_fine();
}

/// How many times the calling thread has been switched out while it could run: preempted, or
/// a yield that gave its CPU to another task. A thread that yields on a CPU of its own is not
/// switched out, so a count that grows while it waits says other tasks want its CPU.
pub fn involuntary_switches() -> u64 {
    // SAFETY: a zeroed rusage is a valid value of that plain C struct.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes one rusage into `usage`, which outlives the call.
    match unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut usage) } {
        0 => usage.ru_nivcsw as u64,
        _ => 0,
    }
}

/// Sets the fine slack; the old one if it was coarser and is now replaced.
fn set_fine() -> Option<libc::c_ulong> {
    // SAFETY: PR_GET_TIMERSLACK returns the calling thread's slack; it touches no memory.
    let old = unsafe { libc::prctl(libc::PR_GET_TIMERSLACK) };
    if old < 0 || old as libc::c_ulong <= FINE_NS {
        return None;
    }
    // SAFETY: PR_SET_TIMERSLACK sets the calling thread's slack; it touches no memory.
    let set = unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, FINE_NS) };
    (set == 0).then_some(old as libc::c_ulong)
}

/// (Tests) Pins the calling thread to the first CPU this process may use: two threads so pinned
/// share one CPU.
#[cfg(test)]
pub fn pin_to_first_cpu() {
    // SAFETY: a zeroed cpu_set_t is empty; sched_get/setaffinity and the CPU_* helpers use the
    // sets in place, each of its own size.
    unsafe {
        let mut all: libc::cpu_set_t = std::mem::zeroed();
        assert_eq!(libc::sched_getaffinity(0, std::mem::size_of_val(&all), &mut all), 0);
        let first = (0..libc::CPU_SETSIZE as usize).find(|&c| libc::CPU_ISSET(c, &all)).expect("a CPU");
        let mut one: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(first, &mut one);
        assert_eq!(libc::sched_setaffinity(0, std::mem::size_of_val(&one), &one), 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slack() -> i32 {
        // SAFETY: as above.
        unsafe { libc::prctl(libc::PR_GET_TIMERSLACK) }
    }

    /// The guard sets the fine slack and puts the thread's own back; a thread of ours keeps it.
    #[test]
    fn fine_naps_are_set_and_undone() {
        std::thread::spawn(|| {
            // (Linux's default, whatever this test was started with.)
            // SAFETY: as above.
            assert_eq!(unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 50_000 as libc::c_ulong) }, 0);
            let before = slack();
            assert_eq!(before, 50_000);
            {
                let _fine = FineNaps::start();
                assert_eq!(slack() as libc::c_ulong, FINE_NS);
                let _again = FineNaps::start();
                assert_eq!(slack() as libc::c_ulong, FINE_NS);
            }
            assert_eq!(slack(), before);
            fine_for_this_thread();
            assert_eq!(slack() as libc::c_ulong, FINE_NS);
        })
        .join()
        .expect("the thread's checks");
    }

    /// A yield that hands the CPU to another task counts; one with the CPU to itself does not.
    #[test]
    fn a_yield_to_another_task_counts_as_a_switch() {
        // Both threads on one CPU (this process's first), each yielding to the other.
        let pin = pin_to_first_cpu;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let other = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                pin();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    std::thread::yield_now();
                }
            })
        };
        let switched = std::thread::spawn(move || {
            pin();
            let before = involuntary_switches();
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while involuntary_switches() == before && std::time::Instant::now() < deadline {
                std::thread::yield_now();
            }
            involuntary_switches() - before
        })
        .join()
        .expect("the yielding thread");
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        other.join().expect("the other thread");
        assert!(switched > 0, "10 s of yields to a task on the same CPU never switched");
    }
}
