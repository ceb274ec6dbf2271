//! How a waiting thread waits: it spins briefly while its CPU is its own, then yields, then
//! naps ([`Spin`] for the progress engine, [`Backoff`] for other waiting threads), and stops
//! spinning and yielding where that would only take the CPU from a thread that shares it.

use std::time::{Duration, Instant};

const SPIN: u32 = 256;

thread_local! {
    /// Rounds a wait of this thread spins before it yields: [`SPIN`], or none while its CPU is
    /// shared ([`Spin`]).
    static SPIN_NOW: std::cell::Cell<u32> = const { std::cell::Cell::new(SPIN) };
    /// Runs that yielded without looking since this thread's CPU was last found shared.
    static UNLOOKED: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// While its CPU is shared, a thread looks again at every this many runs that yield (two
/// getrusage calls a run were about 4% of a 4-rank all-reduce's time on 2 cores).
const LOOK_EVERY: u32 = 8;

/// Whether a wait spins first. Spinning pays when the peer runs on another CPU; where ranks
/// outnumber the CPUs (4 processes on 2 cores, or a test suite's jobs beside them) a spinning
/// rank keeps the CPU from the very peer it waits for: an 8-byte all-reduce on 4 ranks took
/// 50-122 us against Open MPI's 5-13 (6-10 us now). So each run that had to yield looks at
/// whether its yields handed the CPU to another task (`abi::naps::involuntary_switches`): if
/// they did, this thread's next waits yield at once; if not, they spin again. A run that never
/// reaches a yield pays nothing for this.
pub(super) struct Spin {
    limit: Option<u32>,
    look: Look,
}

/// Whether a run looks at its thread's switches, once it yields.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Look {
    /// It has not yielded yet.
    NotYet,
    /// It yields without looking (see [`LOOK_EVERY`]).
    Skipped,
    /// The thread's switches when it first yielded.
    From(u64),
}

/// Whether this thread's CPU was last found its own (waits spin: [`Spin`]).
#[inline]
pub(super) fn cpu_not_shared() -> bool {
    SPIN_NOW.with(std::cell::Cell::get) != 0
}

impl Spin {
    #[inline]
    pub(super) fn new() -> Spin {
        Spin { limit: None, look: Look::NotYet }
    }

    #[inline]
    pub(super) fn limit(&mut self) -> u32 {
        *self.limit.get_or_insert_with(|| SPIN_NOW.with(std::cell::Cell::get))
    }

    pub(super) fn yielding(&mut self) {
        if self.look != Look::NotYet {
            return;
        }
        if self.limit() == 0 {
            let n = UNLOOKED.with(|u| u.replace(u.get() + 1));
            if n + 1 < LOOK_EVERY {
                self.look = Look::Skipped;
                return;
            }
            UNLOOKED.with(|u| u.set(0));
        }
        self.look = Look::From(crate::abi::naps::involuntary_switches());
    }
}

impl Drop for Spin {
    fn drop(&mut self) {
        if let Look::From(from) = self.look {
            let shared = crate::abi::naps::involuntary_switches() > from;
            SPIN_NOW.with(|s| s.set(if shared { 0 } else { SPIN }));
        }
    }
}

thread_local! {
    /// When this thread last found that its yields hand its CPU away for whole time slices;
    /// None while they come back at once.
    static SLOW_YIELDS: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
    /// When this thread's last slow yield ended.
    static LAST_SLOW_YIELD: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
}

/// A yield that took this long gave the CPU to a task that used it for a whole time slice
/// (4 ms on the development VM; a slice is a few ms on any Linux scheduler).
const SLOW_YIELD: Duration = Duration::from_millis(1);
/// Two slow yields this close make a thread's yields slow. One is not enough: a rank sharing
/// a CPU with the ranks it waits for sees one now and then (4 ranks on 2 cores over TCP: a
/// few a second, of 1.0-1.8 ms), where a thread beside a busy loop sees one in most waits.
const SLOW_YIELDS_WITHIN: Duration = Duration::from_millis(50);
/// While yields are slow, a thread yields again (to see whether they still are) this often.
const SLOW_YIELDS_AGAIN: Duration = Duration::from_secs(1);
/// What a waiting thread sleeps instead of a yield while its yields are slow.
pub(super) const SLOW_YIELD_NAP: Duration = Duration::from_micros(10);

/// Whether this thread's yields were last found slow (see [`timed_yield`]).
fn yields_are_slow() -> bool {
    SLOW_YIELDS.with(|s| s.get().is_some_and(|at| at.elapsed() < SLOW_YIELDS_AGAIN))
}

/// Yield the CPU, unless this thread's yields are slow (then false, having done nothing: the
/// caller sleeps instead). A yield hands the CPU to another runnable task of its CPU: where
/// that is a rank this one waits for, it runs at once and gives the CPU back soon; where it is
/// a busy process (a data loader, a build beside the job), it keeps the CPU for its whole time
/// slice, ~4 ms, where a thread that sleeps is woken on time. Measured: 2 processes, each
/// core shared with a busy loop, an 8-byte all-reduce took 3.9-4.0 ms with yields (Open MPI
/// 0.7 µs through shared memory, 22 µs over TCP). Two yields of 1 ms or more within 50 ms
/// mark the thread's yields slow for a second.
pub(super) fn timed_yield() -> bool {
    if yields_are_slow() {
        return false;
    }
    let t = Instant::now();
    std::thread::yield_now();
    let now = Instant::now();
    if now.duration_since(t) >= SLOW_YIELD {
        let again = LAST_SLOW_YIELD.with(|l| l.replace(Some(now)))
            .is_some_and(|last| now.duration_since(last) < SLOW_YIELDS_WITHIN);
        SLOW_YIELDS.with(|s| s.set(again.then_some(now)));
    }
    true
}

/// Give the CPU up for a moment in a wait that polls: a yield, or, while this thread's yields
/// are slow ([`timed_yield`]), a nap of [`SLOW_YIELD_NAP`].
pub(crate) fn pause() {
    if !timed_yield() {
        std::thread::sleep(SLOW_YIELD_NAP);
    }
}

/// Rounds of a [`Backoff`] after which it naps instead of yielding.
const BACK_OFF_YIELDS: u32 = 4096;
const BACK_OFF_NAP: Duration = Duration::from_micros(50);

/// The polls of the library's other waiting threads (the CUDA stream worker, one-sided
/// operations' streams, direct sends and receives waiting for a kernel): each round that
/// finds nothing spins, as [`super::run`] does while this thread's CPU is not shared ([`Spin`]), then
/// yields, then naps 50 µs (with a fine timer slack where the thread asked for it:
/// `abi::naps`). Before, they spun 256 rounds whatever the CPU, which on ranks that outnumber
/// the cores kept it from the thread they waited for.
pub(crate) struct Backoff {
    rounds: u32,
    spin: Spin,
}

impl Backoff {
    pub(crate) fn new() -> Backoff {
        Backoff { rounds: 0, spin: Spin::new() }
    }

    /// One more round that found nothing.
    pub(crate) fn wait(&mut self) {
        self.rounds = self.rounds.saturating_add(1);
        if self.rounds <= self.spin.limit() {
            std::hint::spin_loop();
        } else if self.rounds < BACK_OFF_YIELDS {
            self.spin.yielding();
            pause();
        } else {
            std::thread::sleep(BACK_OFF_NAP);
        }
    }

    /// Something came: the next wait starts from the spin again, spinning or not as this
    /// wait found the CPU (a long-lived loop's waits each count, as [`super::run`]'s runs do).
    pub(crate) fn progressed(&mut self) {
        if self.rounds > 0 {
            self.rounds = 0;
            self.spin = Spin::new();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    /// The other waiting threads' back-off follows the same verdict: it spins while the CPU is
    /// free, yields at once while shared, and each wait that ends in progress gives its verdict.
    #[test]
    fn back_off_spins_only_while_the_cpu_is_free() {
        std::thread::spawn(|| {
            let mut b = Backoff::new();
            b.wait();
            assert_eq!(b.spin.look, Look::NotYet, "a new thread spins first");
            SPIN_NOW.with(|s| s.set(0));
            let mut b = Backoff::new();
            b.wait();
            assert_ne!(b.spin.look, Look::NotYet, "a thread whose CPU is shared yields at once");
            // This wait found the CPU free after all (no switch since it looked): once it
            // progresses, the next spins again.
            b.spin.look = Look::From(u64::MAX);
            b.progressed();
            assert_eq!(SPIN_NOW.with(std::cell::Cell::get), SPIN);
            b.wait();
            assert_eq!(b.spin.look, Look::NotYet, "spinning again");
            // Up to BACK_OFF_YIELDS rounds it yields, then naps.
            for _ in 1..BACK_OFF_YIELDS {
                b.wait();
            }
            let t = Instant::now();
            b.wait();
            assert!(t.elapsed() >= BACK_OFF_NAP, "the round after the yields naps");
        })
        .join()
        .expect("the checks");
    }

    /// Runs `check` on a thread pinned to the first CPU beside another pinned there that
    /// spins (`busy`) or yields in a loop until `check` is over.
    fn beside_a_pinned_thread(busy: bool, check: impl FnOnce() + Send + 'static) {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let pin = crate::abi::naps::pin_to_first_cpu;
        let other = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                pin();
                while !stop.load(Ordering::Relaxed) {
                    if busy {
                        std::hint::spin_loop();
                    } else {
                        std::thread::yield_now();
                    }
                }
            })
        };
        let checked = std::thread::spawn(move || {
            pin();
            check();
        });
        let result = checked.join();
        stop.store(true, Ordering::Relaxed);
        other.join().expect("the other thread");
        result.expect("the checks");
    }

    /// A thread sharing its CPU with a busy loop finds its yields slow (each hands the CPU over
    /// for a time slice) and stops yielding: `timed_yield` says so, and its waits nap instead.
    /// (Not checked the other way: any busy test beside this one makes yields slow.)
    #[test]
    fn a_thread_beside_a_busy_loop_stops_yielding() {
        beside_a_pinned_thread(true, || {
            assert!(!yields_are_slow(), "a new thread's yields are not slow");
            // Yields until they are found slow, for at most 5 s (a busy loop's time slice is a
            // few ms: two slow yields come within 10 ms).
            let deadline = Instant::now() + Duration::from_secs(5);
            let mut yields = 0;
            while Instant::now() < deadline && timed_yield() {
                yields += 1;
            }
            assert!(yields_are_slow(), "{yields} yields beside a busy thread, none found slow");
            assert!(!timed_yield(), "slow yields: the next wait does not yield");
        });
    }

    /// A thread whose yields hand its CPU to another task stops spinning, and then looks again
    /// only at every LOOK_EVERY-th run that yields.
    #[test]
    fn a_thread_whose_cpu_is_shared_stops_spinning() {
        beside_a_pinned_thread(false, || {
            assert_eq!(Spin::new().limit(), SPIN, "a new thread spins");
            // A run that yields until its yields have handed the CPU over.
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut run = Spin::new();
            let _ = run.limit();
            run.yielding();
            let Look::From(from) = run.look else { panic!("a run that spins looks when it yields") };
            while crate::abi::naps::involuntary_switches() == from && Instant::now() < deadline {
                std::thread::yield_now();
            }
            drop(run);
            assert_eq!(Spin::new().limit(), 0, "its CPU was shared: the next run yields at once");
            // While shared, 7 runs of 8 yield without looking, the 8th looks.
            let looked: Vec<bool> = (0..LOOK_EVERY * 2)
                .map(|_| {
                    let mut run = Spin::new();
                    run.yielding();
                    let looked = matches!(run.look, Look::From(_));
                    // (Kept as shared whatever the 8th finds: the count is what is checked.)
                    run.look = Look::Skipped;
                    looked
                })
                .collect();
            let want: Vec<bool> = (1..=LOOK_EVERY * 2).map(|k| k % LOOK_EVERY == 0).collect();
            assert_eq!(looked, want);
        });
    }
}
