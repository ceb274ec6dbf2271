//! CUDA mode: the direct path's device work on the caller's own stream.
//!
//! A direct operation (`transport::ipc`) reads peers' buffers, whose mapped addresses only the
//! stream worker learns, after the call has returned. So the caller queues, at call time, the
//! kernels of every step with their arguments left blank: per phase, a gate (the stream waits
//! until the worker opens it), `nccl_rs_indirect` kernels that each read a descriptor, and a
//! flag the stream raises when the phase's kernels are done; then a last gate, opened once
//! every peer has finished reading this rank's buffers. The worker fills a phase's
//! descriptors in before it opens that phase's gate, and waits for the flag before its host
//! barrier with the peers. It makes no device call for these operations: nothing on its
//! stream can sit behind a caller's wait in a hardware queue they share (README, CUDA mode).
//!
//! The board is one communicator's mapped host memory for this: [`SLOTS`] slots, one per
//! operation in flight, each a gate word, a flag word and [`DESCS`] descriptors. A caller's
//! stream also signals through a slot's flag that it has reached a batch (a one-phase ticket,
//! `streamed::Start`), so the worker polls host memory instead of querying an event. Gate and
//! flag values only grow (each operation takes four numbers from one counter), so a stream
//! still waiting for an old operation's last gate passes when a later one reuses the slot. A
//! slot is free again once its flag reached its operation's last value: the stream has run
//! every kernel that reads its descriptors. A slot whose stream never gets that far (the call
//! failed while queueing its steps) is never reused.
//!
//! A board is never freed: a stream may still wait on a gate of a destroyed communicator's
//! board (it is open, but the stream has not got there). It goes to the next communicator,
//! numbers and slots as they are, so that stream's steps stay safe.

use std::sync::atomic::Ordering;
use std::sync::Mutex;

use crate::device::cuda::{Desc, MappedHost};
use crate::error::Result;

/// Operations in flight per communicator (a training step may queue hundreds of gradient
/// all-reduces ahead of its stream; one without a slot runs on the worker's stream), and
/// descriptors (kernels) per operation (2n - 1 for an all-reduce of n ranks).
pub const SLOTS: usize = 512;
pub const DESCS: usize = 31;
/// Phases per operation at most (gate values base+1 ..= base+PHASES+1 stay below the next base).
pub const PHASES: usize = 3;

/// 32-bit words: a slot is 2 KiB, a 64-byte header (gate at word 0, flag at word 8: not the
/// same 32-byte sector) and 31 descriptors of 64 bytes.
const SLOT_WORDS: usize = 512;
const GATE: usize = 0;
const FLAG: usize = 8;
const DESC_WORDS: usize = 16;
const HEADER_WORDS: usize = 16;

/// One communicator's board.
pub struct Board {
    mem: MappedHost,
    state: Mutex<State>,
}

struct State {
    /// The next operation's base value.
    next: u32,
    /// Where the search for a free slot starts (after the last one taken).
    cursor: usize,
    /// Per slot: the flag value its operation's stream raises last (None: never used).
    last_flag: [Option<u32>; SLOTS],
}

/// One operation's slot and its numbers: phase k (1-based) opens at gate `base + k` and raises
/// the flag to `base + k`; the last gate is `base + phases + 1`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Ticket {
    pub slot: usize,
    pub base: u32,
    pub phases: usize,
    /// Descriptors its kernels read (the first ones of the slot; none for a start signal).
    pub descs: usize,
}

impl Ticket {
    pub fn step_value(&self, k: usize) -> u32 {
        self.base.wrapping_add(k as u32)
    }

    pub fn final_gate(&self) -> u32 {
        self.step_value(self.phases + 1)
    }
}

impl State {
    fn new() -> State {
        State { next: 4, cursor: 0, last_flag: [None; SLOTS] }
    }

    /// A free slot (its flag, read by `flag`, has reached its last operation's last value)
    /// and the next numbers.
    fn take(&mut self, phases: usize, descs: usize, flag: impl Fn(usize) -> u32) -> Option<Ticket> {
        let slot = (0..SLOTS).map(|k| (self.cursor + k) % SLOTS).find(|&i| match self.last_flag[i] {
            None => true,
            Some(last) => reached(flag(i), last),
        })?;
        let t = Ticket { slot, base: self.next, phases, descs };
        self.next = self.next.wrapping_add(4);
        self.cursor = (slot + 1) % SLOTS;
        self.last_flag[slot] = Some(t.step_value(phases));
        Some(t)
    }
}

/// `a >= b` for counters that wrap.
pub(super) fn reached(a: u32, b: u32) -> bool {
    a.wrapping_sub(b) as i32 >= 0
}

/// Boards of destroyed communicators, for new ones (see the module's notes).
static SPARE_BOARDS: crate::abi::fork::PerForkMutex<Vec<Board>> = crate::abi::fork::PerFork::new(crate::abi::fork::anew);

impl Board {
    /// A destroyed communicator's board, else a new one: made before any stream waits on
    /// this communicator (pinning memory may synchronise).
    pub fn new() -> Result<Board> {
        if let Some(b) = SPARE_BOARDS.lock().unwrap_or_else(|p| p.into_inner()).pop() {
            return Ok(b);
        }
        let mem = MappedHost::new(SLOTS * SLOT_WORDS * 4)?;
        Ok(Board { mem, state: Mutex::new(State::new()) })
    }

    /// Hands the board on to a later communicator.
    pub fn retire(self) {
        SPARE_BOARDS.lock().unwrap_or_else(|p| p.into_inner()).push(self);
    }

    pub fn mem(&self) -> &MappedHost {
        &self.mem
    }

    /// A free slot for an operation of `phases` phases whose kernels read `descs` descriptors
    /// (reset to do nothing); None when every slot is in flight, or it would not fit.
    pub fn take(&self, phases: usize, descs: usize) -> Option<Ticket> {
        if phases == 0 || phases > PHASES || descs > DESCS {
            return None;
        }
        let flag = |i: usize| self.mem.word(i * SLOT_WORDS + FLAG).load(Ordering::Acquire);
        let t = self.state.lock().unwrap_or_else(|p| p.into_inner()).take(phases, descs, flag)?;
        for d in 0..descs {
            self.write(&t, d, Desc::Skip);
        }
        Some(t)
    }

    /// Gives back a slot just taken whose stream got nothing queued for it.
    pub fn untake(&self, t: &Ticket) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if st.last_flag[t.slot] == Some(t.step_value(t.phases)) {
            st.last_flag[t.slot] = None;
        }
    }

    /// Word indexes (into [`Board::mem`]) of the slot's gate and flag.
    pub fn gate_word(&self, t: &Ticket) -> usize {
        t.slot * SLOT_WORDS + GATE
    }

    pub fn flag_word(&self, t: &Ticket) -> usize {
        t.slot * SLOT_WORDS + FLAG
    }

    /// The device address of descriptor `d` of the slot.
    pub fn desc_addr(&self, t: &Ticket, d: usize) -> usize {
        self.mem.device_addr() + 4 * (t.slot * SLOT_WORDS + HEADER_WORDS + d * DESC_WORDS)
    }

    /// Descriptor `d` of the slot (`d < DESCS`), before its gate opens.
    pub fn write(&self, t: &Ticket, d: usize, desc: Desc) {
        let at = t.slot * SLOT_WORDS + HEADER_WORDS + d.min(DESCS - 1) * DESC_WORDS;
        for (i, w) in desc.words().iter().enumerate() {
            self.mem.word(at + i).store(*w, Ordering::Relaxed);
        }
    }

    /// Opens gate `value` (the descriptors written before are visible to the stream first).
    pub fn open(&self, t: &Ticket, value: u32) {
        self.mem.word(self.gate_word(t)).store(value, Ordering::Release);
    }

    /// Has the stream raised the flag to `value`?
    pub fn flag_reached(&self, t: &Ticket, value: u32) -> bool {
        reached(self.mem.word(self.flag_word(t)).load(Ordering::Acquire), value)
    }

    /// Whatever happened to the operation, its stream gets past it: every descriptor does
    /// nothing (a failed operation's output is undefined; the kernels of a phase already
    /// open may have done part of it) and the last gate opens.
    pub fn close(&self, t: &Ticket) {
        for d in 0..t.descs {
            self.write(t, d, Desc::Skip);
        }
        self.open(t, t.final_gate());
    }
}

#[cfg(test)]
mod tests {
    use super::{reached, State, SLOTS};
    use std::cell::RefCell;

    /// Slots are reused only once their stream raised the last flag; every operation's numbers
    /// lie above every earlier one's, so a stream late on an old gate always passes.
    #[test]
    fn slots_come_back_after_their_last_flag() {
        let flags = RefCell::new(vec![0u32; SLOTS]);
        let mut st = State::new();
        let mut taken = Vec::new();
        for k in 0..SLOTS {
            let t = st.take(1 + k % 3, 3, |i| flags.borrow()[i]).expect("a free slot");
            assert!(taken.iter().all(|o: &super::Ticket| o.slot != t.slot), "slot {} handed out twice", t.slot);
            if let Some(prev) = taken.last() {
                assert!(reached(t.base, prev.final_gate()), "numbers went down: {} after {}", t.base, prev.final_gate());
            }
            taken.push(t);
        }
        assert!(st.take(1, 3, |i| flags.borrow()[i]).is_none(), "a slot while all are in flight");
        // The stream of operation 5 is past its next-to-last step: not yet free; past its last: free.
        let t5 = taken[5];
        flags.borrow_mut()[t5.slot] = t5.step_value(t5.phases - 1);
        assert!(t5.phases == 1 || st.take(1, 3, |i| flags.borrow()[i]).is_none());
        flags.borrow_mut()[t5.slot] = t5.step_value(t5.phases);
        let again = st.take(2, 3, |i| flags.borrow()[i]).expect("the finished slot");
        assert_eq!(again.slot, t5.slot);
        assert!(reached(again.base, taken[SLOTS - 1].final_gate()));
        // A later operation's flag values free the slot for an operation behind on it too.
        assert!(reached(again.step_value(1), t5.step_value(t5.phases)));
    }

    #[test]
    fn counters_compare_across_the_wrap() {
        assert!(reached(5, 5) && reached(6, 5) && !reached(4, 5));
        assert!(reached(2, u32::MAX - 1), "2 comes after u32::MAX - 1");
        assert!(!reached(u32::MAX - 1, 2));
    }
}
