//! Planning: the units a rank executes for a group of operations on one communicator.
//!
//! An algorithm describes whole transfers ("send chunk 3 to the next rank after the reduction
//! that produced it"); the [`Builder`] cuts each into units of at most one slice and maps
//! dependencies slice by slice, which is what pipelines a ring. Units only depend on earlier
//! units, and sends to a peer, receives from a peer and local work each execute in order, so
//! two ranks that plan the same operations always agree on what travels on each connection.

pub mod ops;

use crate::device::host::{ElemOp, Region};
use crate::error::{Error, Result};
use crate::transport::Stamp;
use crate::types::{DataType, Scalar};

pub use ops::{plan_group, Op, OpKind};

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Step {
    Send { peer: u32, src: Region },
    Recv { peer: u32, dst: Region },
    /// dst = acc op incoming (acc may be dst). `scaled`: PreMulSum's `acc * scalar + incoming`,
    /// `acc` the rank's input as the call gave it (see [`Builder::scale_on_read`]).
    RecvReduce { peer: u32, dst: Region, acc: Region, dt: DataType, op: ElemOp, scaled: Option<Scalar> },
    /// `to_read`: the copy is read again at once (scratch a send goes from, an all-reduce's
    /// output sent and reduced into), so it is made with ordinary stores, which leave it in
    /// the cache (`host::copy_to_read`).
    Copy { dst: Region, src: Region, to_read: bool },
    /// dst = a op b, all local.
    Reduce { dst: Region, a: Region, b: Region, dt: DataType, op: ElemOp },
    Premul { dst: Region, src: Region, dt: DataType, scalar: Scalar },
    Divide { dst: Region, dt: DataType, divisor: u64 },
}

pub const MAX_DEPS: usize = 4;
pub const NO_DEP: u32 = u32::MAX;

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Unit {
    pub step: Step,
    pub deps: [u32; MAX_DEPS],
    /// Index of the unit's operation in [`Builder::stamps`].
    pub op: u32,
}

/// The units of one logical transfer: `n` consecutive units from `first`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ref {
    first: u32,
    n: u32,
}

impl Ref {
    pub const NONE: Ref = Ref { first: 0, n: 0 };

    /// Its last unit alone. A step that depends on a `Ref` of as many units as it has waits
    /// for the matching unit (pipelining: right where both cover the same bytes in order); on
    /// this one it waits for the last, and so for everything queued locally before it (local
    /// steps run in order): use it where the bytes differ.
    pub fn last(self) -> Ref {
        match self.n {
            0 => self,
            n => Ref { first: self.first + n - 1, n: 1 },
        }
    }
}

/// Reduction parameters of an operation as algorithms see them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Reduction {
    pub dt: DataType,
    pub op: ElemOp,
    /// ncclAvg: divide the final sum by this.
    pub divide: Option<u64>,
}

pub struct Builder {
    pub units: Vec<Unit>,
    /// The identity of each planned operation, carried on its messages and checked on receipt.
    pub stamps: Vec<Stamp>,
    slice: usize,
    /// A dependency added to every unit of the current operation (e.g. PreMulSum's scaling).
    fence: Ref,
    /// Scratch memory the units refer to; kept alive as long as the builder. A builder is
    /// reused call after call: its first `scratch_used` buffers belong to the current plan, the
    /// rest wait for the next one (their contents are stale, and scratch is always written
    /// before it is read).
    scratch: Vec<Vec<u8>>,
    scratch_used: usize,
    /// Why this plan cannot run: memory for its scratch ([`Builder::scratch`]) or its units
    /// could not be had.
    short: Option<Error>,
    /// What the plan was made from, where [`ops::plan_into`] may reuse it for the same call
    /// repeated.
    planned: Option<ops::Planned>,
    /// Names the plan: a new number each time the builder starts one ([`Builder::reset`]).
    plan_id: u64,
    /// The current operation's input that reads scale on the way ([`Builder::scale_on_read`]):
    /// the input, its type and the factor.
    scaled: Option<(Region, DataType, Scalar)>,
    /// What the current operation wrote inside that input (in place): read as it is.
    written: Vec<Region>,
}

/// Scratch buffers up to this size are kept by a reused builder whatever its next plan needs;
/// a larger one only while a plan uses it, and not when more than twice the size asked for.
/// (A loop of large calls whose buffers move, such as a reduce-scatter into a new tensor each
/// step, replans every call: giving large scratch back at each replan cost an allocation and
/// its page faults each time.)
const SCRATCH_KEEP: usize = 4 << 20;

impl Default for Builder {
    fn default() -> Builder {
        Builder::new(0)
    }
}

impl Builder {
    pub fn new(slice: usize) -> Builder {
        let mut b = Builder { units: Vec::new(), stamps: Vec::new(), slice: 0, fence: Ref::NONE, scratch: Vec::new(),
                              scratch_used: 0, short: None, planned: None, plan_id: 0, scaled: None,
                              written: Vec::new() };
        b.reset(slice);
        b
    }

    /// Forget the last plan, keeping the memory for the next (no allocation on a repeated call).
    pub fn reset(&mut self, slice: usize) {
        self.slice = (slice / 64).max(1) * 64;
        self.units.clear();
        self.stamps.clear();
        self.fence = Ref::NONE;
        self.scaled = None;
        self.scratch_used = 0;
        self.short = None;
        self.planned = None;
        static PLANS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        self.plan_id = PLANS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Memory this builder holds (its plan's units, stamps and scratch, kept for later plans).
    pub fn held_bytes(&self) -> usize {
        self.scratch.iter().map(|v| v.capacity()).sum::<usize>()
            + self.units.capacity() * std::mem::size_of::<Unit>()
            + self.stamps.capacity() * std::mem::size_of::<Stamp>()
    }

    /// Give the memory back, and with it the plan.
    pub fn release(&mut self) {
        self.reset(self.slice);
        (self.scratch, self.units, self.stamps) = (Vec::new(), Vec::new(), Vec::new());
    }

    /// What the units and stamps are: the same number means the same units (a plan reused by
    /// [`ops::plan_into`] keeps its number; any other plan has its own).
    pub fn plan_id(&self) -> u64 {
        self.plan_id
    }

    /// The size transfers are cut into (each slice one message, one unit).
    pub fn slice(&self) -> usize {
        self.slice
    }

    /// Start a new operation: its stamp, and no fence or scaled input.
    pub fn begin(&mut self, stamp: Stamp) {
        self.stamps.push(stamp);
        self.fence = Ref::NONE;
        self.scaled = None;
    }

    /// From here to the next operation, what is read of `input` is scaled by `scalar` on the
    /// way (PreMulSum, fp16 Avg), instead of a pass over all of it into scratch first: a
    /// reduction of it with what arrives scales as it reduces (`Step::RecvReduce`'s `scaled`),
    /// a copy of it is a scaled copy, and a send of it (or a local reduction) goes from a
    /// scaled copy of just what it reads, made slice by slice ahead of it. What the operation
    /// has already written inside `input` (in place) is read as it is: the algorithms write
    /// a part only after their last read of the input there, so each read is of either.
    pub fn scale_on_read(&mut self, input: Region, dt: DataType, scalar: Scalar) {
        self.scaled = Some((input, dt, scalar));
        self.written.clear();
    }

    /// The factor a read of `r` takes: some where it reads the scaled input as the call gave it.
    fn scaling(&mut self, r: Region) -> Option<(DataType, Scalar)> {
        let (input, dt, scalar) = self.scaled?;
        if !r.overlaps(input) {
            return None;
        }
        if !self.written.iter().any(|w| w.overlaps(r)) {
            if r.offset_in(input).is_none() {
                self.short.get_or_insert(Error::internal("a read reaches past the input it scales"));
            }
            return Some((dt, scalar));
        }
        if !self.written.iter().any(|w| r.offset_in(*w).is_some()) {
            // Half input, half written: no algorithm reads so, and the plan is refused rather
            // than half scaled.
            self.short.get_or_insert(Error::internal("a read of an input to scale, partly written over"));
        }
        None
    }

    /// Notes a write of `dst` (inside the scaled input, it is read as it is from then on).
    fn wrote(&mut self, dst: Region) {
        if self.scaled.is_some_and(|(input, ..)| dst.overlaps(input)) {
            self.written.push(dst);
        }
    }

    pub fn set_fence(&mut self, r: Ref) {
        self.fence = r;
    }

    /// `len` bytes of scratch for this plan. Where the system cannot give them (a count far
    /// larger than the caller's memory, or a machine out of it), the plan is marked
    /// ([`Builder::short`]) and a placeholder returned: allocation failure would abort the
    /// process, where the caller should get `ncclSystemError`.
    pub fn scratch(&mut self, len: usize) -> Region {
        let used = self.scratch_used;
        // Of the buffers no scratch of this plan has taken yet, the smallest that holds `len`,
        // else the largest (replaced below).
        let spare = self.scratch[used..].iter().enumerate();
        let best = spare.clone().filter(|(_, v)| v.capacity() >= len).min_by_key(|(_, v)| v.capacity())
            .or_else(|| spare.max_by_key(|(_, v)| v.capacity()));
        match best {
            Some((i, _)) => self.scratch.swap(used, used + i),
            None => self.scratch.push(Vec::new()),
        }
        let v = &mut self.scratch[used];
        if v.capacity() < len || (v.capacity() > SCRATCH_KEEP && v.capacity() / 2 > len) {
            // (Given back before the new one is had; its contents are stale anyway.)
            *v = Vec::new();
            match crate::device::host::zeroed(len, &|| "scratch".to_string()) {
                Ok(fresh) => *v = fresh,
                Err(e) => return self.unbacked(len, e),
            }
        }
        if v.len() < len {
            v.resize(len, 0); // within its capacity
        }
        self.scratch_used += 1;
        // (Not truncated: a buffer used for a smaller plan and then a larger one again is not
        // zeroed again up to its old length.)
        Region::owned(&mut v[..len])
    }

    /// After planning: large buffers the plan did not take are given back (see SCRATCH_KEEP).
    pub fn trim_scratch(&mut self) {
        let used = self.scratch_used;
        let mut i = 0;
        self.scratch.retain(|v| {
            i += 1;
            i <= used || v.capacity() <= SCRATCH_KEEP
        });
    }

    #[cold]
    fn unbacked(&mut self, len: usize, e: Error) -> Region {
        self.short.get_or_insert(e);
        Region::unbacked(len)
    }

    /// Why this plan cannot run, if it cannot (see the field): such a plan must not run.
    pub fn short(&mut self) -> Result<()> {
        self.short.take().map_or(Ok(()), Err)
    }

    fn push(&mut self, len: usize, deps: &[Ref], make: impl Fn(usize, usize) -> Step) -> Ref {
        if len == 0 || self.short.is_some() {
            // (A plan short of memory is refused: nothing more is worth planning.)
            return Ref::NONE;
        }
        let k = len.div_ceil(self.slice);
        let first = self.units.len() as u32;
        if self.units.try_reserve(k).is_err() || u32::try_from(self.units.len() + k).is_err() {
            let e = Error::system(format!("no memory to plan a transfer of {len} bytes in {k} slices"));
            self.short.get_or_insert(e);
            return Ref::NONE;
        }
        for i in 0..k {
            let off = i * self.slice;
            let mut d = [NO_DEP; MAX_DEPS];
            let live = deps.iter().chain(std::iter::once(&self.fence)).filter(|r| r.n > 0);
            for (nd, r) in live.enumerate() {
                assert!(nd < MAX_DEPS, "too many dependencies");
                // Same slicing: wait for the matching slice (pipelining); else for the last one.
                d[nd] = if r.n as usize == k { r.first + i as u32 } else { r.first + r.n - 1 };
            }
            let op = self.stamps.len().saturating_sub(1) as u32;
            self.units.push(Unit { step: make(off, self.slice.min(len - off)), deps: d, op });
        }
        Ref { first, n: k as u32 }
    }

    pub fn send(&mut self, peer: usize, src: Region, deps: &[Ref]) -> Ref {
        if let Some((dt, scalar)) = self.scaling(src) {
            // (Each slice of the send waits for its own slice of the scaled copy.)
            let copy = self.scratch(src.len());
            let scaled = self.premul(copy, src, dt, scalar, deps);
            return self.send(peer, copy, &[scaled]);
        }
        self.push(src.len(), deps, |o, l| Step::Send { peer: peer as u32, src: src.sub(o, l) })
    }
    pub fn recv(&mut self, peer: usize, dst: Region, deps: &[Ref]) -> Ref {
        self.wrote(dst);
        self.push(dst.len(), deps, |o, l| Step::Recv { peer: peer as u32, dst: dst.sub(o, l) })
    }
    pub fn recv_reduce(&mut self, peer: usize, dst: Region, acc: Region, red: Reduction, deps: &[Ref]) -> Ref {
        // (What arrives is a partial sum or a peer's input already scaled: each rank scales
        // its own input by its own factor, which may differ from its peers'.)
        let scaled = self.scaling(acc).map(|(_, scalar)| scalar);
        self.wrote(dst);
        self.push(dst.len(), deps, |o, l| Step::RecvReduce {
            peer: peer as u32,
            dst: dst.sub(o, l),
            acc: acc.sub(o, l),
            dt: red.dt,
            op: red.op,
            scaled,
        })
    }
    pub fn copy(&mut self, dst: Region, src: Region, deps: &[Ref]) -> Ref {
        self.copy_as(dst, src, deps, false)
    }
    /// [`Builder::copy`] of what sends (and reductions) read at once (see `Step::Copy`).
    pub fn copy_to_read(&mut self, dst: Region, src: Region, deps: &[Ref]) -> Ref {
        self.copy_as(dst, src, deps, true)
    }
    fn copy_as(&mut self, dst: Region, src: Region, deps: &[Ref], to_read: bool) -> Ref {
        if let Some((dt, scalar)) = self.scaling(src) {
            // (In place too: the input scaled where it is.)
            return self.premul(dst, src, dt, scalar, deps);
        }
        if dst.addr() == src.addr() {
            return Ref::NONE;
        }
        self.wrote(dst);
        self.push(dst.len(), deps, |o, l| Step::Copy { dst: dst.sub(o, l), src: src.sub(o, l), to_read })
    }
    pub fn reduce(&mut self, dst: Region, a: Region, b: Region, red: Reduction, deps: &[Ref]) -> Ref {
        for (input, other) in [(a, b), (b, a)] {
            if let Some((dt, scalar)) = self.scaling(input) {
                let copy = self.scratch(input.len());
                let scaled = self.premul(copy, input, dt, scalar, deps);
                let (a, b) = if input == a { (copy, other) } else { (other, copy) };
                return self.reduce(dst, a, b, red, &[scaled]);
            }
        }
        self.wrote(dst);
        self.push(dst.len(), deps, |o, l| Step::Reduce {
            dst: dst.sub(o, l),
            a: a.sub(o, l),
            b: b.sub(o, l),
            dt: red.dt,
            op: red.op,
        })
    }
    pub fn premul(&mut self, dst: Region, src: Region, dt: DataType, scalar: Scalar, deps: &[Ref]) -> Ref {
        self.wrote(dst);
        self.push(dst.len(), deps, |o, l| Step::Premul { dst: dst.sub(o, l), src: src.sub(o, l), dt, scalar })
    }
    /// The Avg finish on `dst`, if the reduction asks for it.
    pub fn finish(&mut self, dst: Region, red: Reduction, deps: &[Ref]) -> Ref {
        match red.divide {
            Some(d) if d > 1 => {
                self.wrote(dst);
                self.push(dst.len(), deps, |o, l| Step::Divide { dst: dst.sub(o, l), dt: red.dt, divisor: d })
            }
            _ => deps.iter().rev().copied().find(|r| r.n > 0).unwrap_or(Ref::NONE),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_and_maps_dependencies() {
        let mut buf = vec![0u8; 1000];
        let r = Region::owned(&mut buf);
        let mut b = Builder::new(256);
        b.begin([1; crate::transport::STAMP_BYTES]);
        let a = b.recv(1, r, &[]);
        let s = b.send(2, r, &[a]);
        assert_eq!(a.n, 4);
        assert_eq!(s.n, 4);
        for i in 0..4 {
            assert_eq!(b.units[(s.first + i) as usize].deps[0], a.first + i, "slice {i} waits for its own slice");
        }
        let tail = b.send(3, r.sub(0, 100), &[a]);
        assert_eq!(b.units[tail.first as usize].deps[0], a.first + 3, "different slicing waits for the whole");
        assert_eq!(b.recv(1, Region::EMPTY, &[]), Ref::NONE);
    }

    /// A builder replanned for other calls reuses its scratch: each request takes the spare
    /// buffer that fits best, large buffers stay while a plan uses them (whatever their size),
    /// and one far larger than asked for, or left unused by a plan, is given back.
    #[test]
    fn scratch_is_reused_best_fit_and_large_buffers_given_back_when_unneeded() {
        const BIG: usize = 2 * SCRATCH_KEEP;
        let mut b = Builder::new(256);
        let plan = |b: &mut Builder, lens: &[usize]| -> Vec<usize> {
            b.reset(256);
            let addrs = lens.iter().map(|&l| b.scratch(l).addr()).collect();
            b.trim_scratch();
            addrs
        };
        let first = plan(&mut b, &[1, BIG]);
        // The small request comes first this time: it must not take (and regrow) the big one.
        assert_eq!(plan(&mut b, &[BIG, 1]), vec![first[1], first[0]], "each buffer reused where it fits");
        assert_eq!(plan(&mut b, &[1, BIG - 4096]), first, "a large buffer kept for a slightly smaller plan");
        assert!(b.held_bytes() >= BIG);
        let again = plan(&mut b, &[1, BIG / 4]);
        assert!(b.scratch.iter().all(|v| v.capacity() < BIG), "one more than twice as large as needed is given back");
        assert_eq!(again[0], first[0]);
        plan(&mut b, &[1, BIG]);
        plan(&mut b, &[1]);
        assert!(b.held_bytes() <= SCRATCH_KEEP + 64, "a large buffer the plan did not use is given back");
        let r = b.scratch(BIG);
        assert_eq!(r.len(), BIG);
        assert!(b.short().is_ok());
    }
}
