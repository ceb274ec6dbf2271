//! The pinned pool callers' streams stage operations through at call time (module notes of
//! `streamed`): which operations qualify, a ring of pinned memory carved per batch, and when a
//! carve may be reused (after the events that end every stream's use of it). It owns no
//! thread and makes no driver call but pinning (when a communicator starts or its pool grows
//! while idle) and event queries; the streams' copies are queued by `streamed`.

use std::collections::VecDeque;
use std::time::Duration;

use super::{Buffer, StreamOp};
use crate::device::cuda::{Event, MappedHost};
use crate::device::host::Region;
use crate::plan::Op;

/// Pinned staging per communicator for operations its callers' streams stage at call time: to
/// begin with, and at most (grown, while nothing is in flight, to fit a larger batch).
const POOL_BYTES: usize = 4 << 20;
/// What a pool may grow to (`NCCL_RS_POOL_MAX`, never below its first size).
fn pool_max() -> usize {
    crate::params::pool_max().max(POOL_BYTES)
}
/// Alignment of each buffer carved from it.
pub(super) const POOL_ALIGN: usize = 256;

/// `n` rounded up to [`POOL_ALIGN`]: where the next staged buffer may start.
pub(super) fn aligned(n: usize) -> usize {
    n.div_ceil(POOL_ALIGN) * POOL_ALIGN
}

/// A ring of pinned memory, carved per batch and given back once every stream of the batch
/// has finished copying out of it (its release events have completed).
pub(super) struct Pool {
    /// Always Some until dropped.
    mem: Option<MappedHost>,
    /// Released by the events after which no stream touches the carve any more.
    carves: Carves<Vec<Event>>,
}

/// The carves of a ring of memory, taken in order and released in any order: a carve's space
/// comes back once it and every older carve are done (`reclaim`). `R` says when a carve is
/// done (the pool's release events; nothing, for memory given back by hand).
pub(super) struct Carves<R> {
    head: usize,
    inflight: VecDeque<Carve<R>>,
    next_id: u64,
}

struct Carve<R> {
    id: u64,
    start: usize,
    /// What releases it; None until known (the carve, and every later one, stays taken).
    released: Option<R>,
}

impl<R> Default for Carves<R> {
    fn default() -> Self {
        Carves { head: 0, inflight: VecDeque::new(), next_id: 0 }
    }
}

impl<R> Carves<R> {
    /// The offset of `len` free bytes of a ring of `cap` (its free space is [head, end) and
    /// [0, oldest) when not wrapped, [head, oldest) when wrapped; `head` never catches up
    /// with `oldest`).
    pub(super) fn alloc(&mut self, cap: usize, len: usize) -> Option<usize> {
        let at = ring_alloc(cap, self.head, self.inflight.front().map(|c| c.start), len)?;
        self.head = at + len;
        Some(at)
    }

    /// A new carve at `start` (from [`Carves::alloc`]); its id.
    pub(super) fn push(&mut self, start: usize) -> u64 {
        self.next_id += 1;
        self.inflight.push_back(Carve { id: self.next_id, start, released: None });
        self.next_id
    }

    /// What releases carve `id`.
    pub(super) fn release(&mut self, id: u64, by: R) {
        if let Some(c) = self.inflight.iter_mut().find(|c| c.id == id) {
            c.released = Some(by);
        }
    }

    /// The oldest carves that are `done` go; what released them is returned.
    pub(super) fn reclaim(&mut self, done: impl Fn(&R) -> bool) -> Vec<R> {
        let mut gone = Vec::new();
        while self.inflight.front().is_some_and(|c| c.released.as_ref().is_some_and(&done)) {
            if let Some(r) = self.inflight.pop_front().and_then(|c| c.released) {
                gone.push(r);
            }
        }
        if self.inflight.is_empty() {
            self.head = 0;
        }
        gone
    }

    pub(super) fn is_empty(&self) -> bool {
        self.inflight.is_empty()
    }

    /// Some carve has not been released yet.
    pub(super) fn any_taken(&self) -> bool {
        self.inflight.iter().any(|c| c.released.is_none())
    }
}

/// Pools of destroyed communicators, for new ones: pinned memory is never freed (freeing may
/// wait for the whole context while other communicators' callers wait for their workers).
static SPARE_POOLS: crate::abi::fork::PerForkMutex<Vec<MappedHost>> = crate::abi::fork::PerFork::new(crate::abi::fork::anew);

impl Drop for Pool {
    /// Back to the spares once the callers' streams are done copying out of it (a short
    /// wait: destroy has drained the worker); a pool still in use is leaked, never reused.
    fn drop(&mut self) {
        let settled = settle(|| {
            drop(self.reclaim());
            self.carves.is_empty().then_some(true)
        });
        match self.mem.take() {
            Some(mem) if settled => SPARE_POOLS.lock().unwrap_or_else(|p| p.into_inner()).push(mem),
            other => std::mem::forget(other),
        }
    }
}

/// Polls `step` (which gives back what it can) until it says every carve is free (Some(true))
/// or that some never will be (Some(false)), for at most 2 s (then false): before a ring's
/// memory is freed or reused, the streams' last copies may still be running.
pub(super) fn settle(mut step: impl FnMut() -> Option<bool>) -> bool {
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    loop {
        if let Some(settled) = step() {
            return settled;
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_micros(100));
    }
}

impl Pool {
    /// A pool: a destroyed communicator's, else newly pinned.
    pub(super) fn new() -> crate::error::Result<Pool> {
        let spare = SPARE_POOLS.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let mem = match spare {
            Some(m) => m,
            None => MappedHost::new(POOL_BYTES)?,
        };
        Ok(Pool { mem: Some(mem), carves: Carves::default() })
    }

    pub(super) fn capacity(&self) -> usize {
        self.mem.as_ref().map_or(0, |m| m.len())
    }

    /// Carves whose streams are done with them go; their events are returned for reuse.
    pub(super) fn reclaim(&mut self) -> Vec<Event> {
        self.carves.reclaim(|events| events.iter().all(|e| e.query().unwrap_or(false))).into_iter().flatten().collect()
    }

    /// The offset of `len` free bytes.
    fn alloc(&mut self, len: usize) -> Option<usize> {
        let cap = self.capacity();
        self.carves.alloc(cap, len)
    }

    /// A new carve at `start` (from [`Pool::alloc`]); its id.
    pub(super) fn push(&mut self, start: usize) -> u64 {
        self.carves.push(start)
    }

    /// `len` bytes for the stream worker, if free now (nothing waits for space): their host
    /// region, the address kernels read them at, and the carve's id, to give back
    /// ([`Pool::release`], with no events) once the kernel reading them has finished.
    pub(super) fn carve_for_worker(&mut self, len: usize) -> Option<(Region, usize, u64)> {
        let n = aligned(len.max(1));
        let start = self.alloc(n)?;
        let mem = self.mem.as_ref()?;
        let host = mem.region().sub(start, len);
        let device = mem.device_addr() + start;
        Some((host, device, self.push(start)))
    }

    /// The events that give carve `id` back.
    pub(super) fn release(&mut self, id: u64, events: Vec<Event>) {
        self.carves.release(id, events);
    }
}

/// Where `len` bytes go in a ring of `cap` bytes whose next free byte is `head` and whose
/// oldest live carve starts at `oldest` (None: nothing live).
fn ring_alloc(cap: usize, head: usize, oldest: Option<usize>, len: usize) -> Option<usize> {
    match oldest {
        None => (len <= cap).then_some(0),
        Some(oldest) if head >= oldest => {
            if head + len <= cap {
                Some(head)
            } else {
                (len < oldest).then_some(0)
            }
        }
        Some(oldest) => (head + len < oldest).then_some(head),
    }
}

/// The operations of a batch the callers' streams stage at call time, and their buffers: the
/// offset of the batch's carve of `pool` and, per operation, (index, send, recv) regions of
/// it. None when no operation qualifies or they do not fit.
pub(super) fn plan_caller_staging(pool: &mut Pool, ops: &[StreamOp], paths: &[super::Path])
                                  -> Option<(usize, Vec<Staged>)> {
    // The direct path moves its own data; an operation larger than the pool can ever be never
    // fits (and its size must not overflow the sum).
    let max = pool_max();
    let staged = |i: usize| !paths.get(i).is_some_and(|p| p.goes_direct());
    // Only what a stream stages (`on_device`): an operation with nothing of it is not picked.
    let bytes = |i: usize| staged_bytes(&on_device(&ops[i]));
    let staged_scalar = |i: usize| ops[i].op.scalar_at.is_some() && !ops[i].placement.on_host(Buffer::Scalar);
    let picked: Vec<usize> = (0..ops.len())
        .filter(|&i| staged(i) && bytes(i).is_some_and(|n| n <= max && (n > 0 || staged_scalar(i))))
        .collect();
    let scalar = |i: usize| if staged_scalar(i) { POOL_ALIGN } else { 0 };
    let total: usize = picked.iter().map(|&i| bytes(i).unwrap_or(0) + scalar(i)).sum();
    if total == 0 {
        return None;
    }
    let cap = pool.mem.as_ref().map_or(0, |m| m.len());
    if total > cap && total <= max && pool.carves.is_empty() {
        // Grown while nothing is in flight; the old memory goes to the spares (never freed).
        if let Ok(bigger) = MappedHost::new(total.next_power_of_two().min(max)) {
            crate::info!(P2P, "pinned staging pool grown to {} bytes", bigger.len());
            if let Some(old) = pool.mem.replace(bigger) {
                SPARE_POOLS.lock().unwrap_or_else(|p| p.into_inner()).push(old);
            }
        }
    }
    let start = pool.alloc(total)?;
    let whole = pool.mem.as_ref()?.region();
    let mut at = start;
    let mut take = |n: usize| {
        let r = if n == 0 { Region::EMPTY } else { whole.sub(at, n) };
        at += aligned(n);
        r
    };
    let mut planned = Vec::with_capacity(picked.len());
    for i in picked {
        let (send, recv) = stage_buffers(&ops[i], &mut take);
        let scalar = staged_scalar(i).then(|| take(ops[i].op.dt.size()));
        planned.push(Staged { i, send, recv, scalar });
    }
    Some((start, planned))
}

/// `o`'s operation with only its buffers in device or managed memory, the ones a stream stages
/// (the others empty): the worker uses those in host memory as they are
/// (`Placement::on_host`), and so a PreMulSum scalar there.
pub(super) fn on_device(o: &StreamOp) -> Op {
    let keep = |r: Region, b: Buffer| if o.placement.on_host(b) { Region::EMPTY } else { r };
    Op { send: keep(o.op.send, Buffer::Send), recv: keep(o.op.recv, Buffer::Recv), ..o.op }
}

/// Where `o`'s input and output are staged, from `take` ([`stage_pair`]), for the buffers a
/// stream stages ([`on_device`]); the user's own for the others.
pub(super) fn stage_buffers(o: &StreamOp, take: impl FnMut(usize) -> Region) -> (Region, Region) {
    let view = on_device(o);
    let (send, recv) = stage_pair(&view, take);
    (if view.send.is_empty() { o.op.send } else { send }, if view.recv.is_empty() { o.op.recv } else { recv })
}

/// How `op` is in place, if it is and its plans run it in place (the kinds `algo::sim` checks
/// in place; an all-to-all has no in-place form in NCCL, and its plan reads one buffer given
/// for both from a copy): the input inside the output (true) or the output inside the input,
/// at that offset.
fn in_place(op: &Op) -> Option<(bool, usize)> {
    use crate::plan::OpKind::*;
    if !matches!(op.kind, AllReduce | Broadcast | Reduce | AllGather | ReduceScatter | Gather | Scatter) {
        return None;
    }
    op.send.offset_in(op.recv).map(|at| (true, at)).or_else(|| op.recv.offset_in(op.send).map(|at| (false, at)))
}

/// Bytes `op`'s input and output take in staging memory, each [`aligned`]: the larger once for
/// a call in place ([`in_place`]). None on overflow.
pub(super) fn staged_bytes(op: &Op) -> Option<usize> {
    match in_place(op) {
        Some(_) => Some(aligned(op.send.len().max(op.recv.len()))),
        None => aligned(op.send.len()).checked_add(aligned(op.recv.len())),
    }
}

/// Where `op`'s input and output go in staging memory `take` hands out: in place, the smaller
/// lies inside the larger at the same offset as in the user's buffers.
pub(super) fn stage_pair(op: &Op, mut take: impl FnMut(usize) -> Region) -> (Region, Region) {
    match in_place(op) {
        Some((true, at)) => {
            let recv = take(op.recv.len());
            (recv.sub(at, op.send.len()), recv)
        }
        Some((false, at)) => {
            let send = take(op.send.len());
            (send, send.sub(at, op.recv.len()))
        }
        None => (take(op.send.len()), take(op.recv.len())),
    }
}

/// Operation `i` of a batch, staged by its caller's stream into these pool regions (and its
/// device PreMulSum scalar into `scalar`).
#[derive(Clone, Copy)]
pub(super) struct Staged {
    pub i: usize,
    pub send: Region,
    pub recv: Region,
    pub scalar: Option<Region>,
}



#[cfg(test)]
mod tests {
    use super::{aligned, ring_alloc, stage_pair, staged_bytes};
    use crate::device::host::Region;
    use crate::plan::{Op, OpKind};
    use crate::testing::Rng;
    use crate::types::{BuiltinOp, DataType, RedOp};
    use std::collections::VecDeque;

    /// In place (NCCL's layouts: all-gather's input inside its output, reduce-scatter's output
    /// inside its input, the others one buffer), staging takes the larger buffer once, with the
    /// other at the same offset inside it; out of place, and for an all-to-all (no in-place
    /// form, and its plan needs both), two buffers.
    #[test]
    fn in_place_calls_stage_one_buffer() {
        let mut user = vec![0u8; 4096];
        let whole = Region::owned(&mut user);
        let op = |kind, send: Region, recv: Region| Op { kind, dt: DataType::Float32, op: RedOp::Builtin(BuiltinOp::Sum),
                                                          count: 0, root: 0, send, recv, seq: 0, scalar_at: None, of: None };
        let mut staging = vec![0u8; 8192];
        let pool = Region::owned(&mut staging);
        let cases = [
            (op(OpKind::AllReduce, whole.sub(0, 1000), whole.sub(0, 1000)), 1024, Some(0)),
            (op(OpKind::AllGather, whole.sub(1000, 500), whole.sub(0, 2000)), 2048, Some(1000)),
            (op(OpKind::ReduceScatter, whole.sub(0, 2000), whole.sub(500, 500)), 2048, Some(500)),
            (op(OpKind::AllReduce, whole.sub(0, 1000), whole.sub(1000, 1000)), 2048, None),
            (op(OpKind::AlltoAll, whole.sub(0, 1000), whole.sub(0, 1000)), 2048, None),
        ];
        for (o, bytes, offset) in cases {
            assert_eq!(staged_bytes(&o), Some(bytes), "{:?}", o.kind);
            let mut at = 0;
            let (send, recv) = stage_pair(&o, |n| {
                let r = pool.sub(at, n);
                at += aligned(n);
                r
            });
            assert_eq!((send.len(), recv.len()), (o.send.len(), o.recv.len()));
            assert_eq!(at, bytes, "{:?}: staging taken", o.kind);
            match offset {
                Some(off) if o.send.len() <= o.recv.len() => assert_eq!(send.addr(), recv.addr() + off),
                Some(off) => assert_eq!(recv.addr(), send.addr() + off),
                None => assert!(!send.overlaps(recv), "{:?}: staged buffers overlap", o.kind),
            }
        }
    }

    /// Random carves taken and given back in order: live carves never overlap, stay inside
    /// the ring, and a request that fits an empty ring always succeeds.
    #[test]
    fn ring_carves_never_overlap() {
        const CAP: usize = 1000;
        let mut rng = Rng(7);
        let mut next = |n: usize| rng.below(n);
        let (mut head, mut live) = (0usize, VecDeque::<(usize, usize)>::new());
        let mut granted = 0;
        for _ in 0..200_000 {
            if next(3) == 0 && !live.is_empty() {
                live.pop_front();
                if live.is_empty() {
                    head = 0;
                }
                continue;
            }
            let len = 1 + next(400);
            let Some(at) = ring_alloc(CAP, head, live.front().map(|c| c.0), len) else {
                assert!(!live.is_empty(), "{len} bytes refused by an empty ring");
                continue;
            };
            assert!(at + len <= CAP, "carve {at}+{len} outside the ring");
            for &(s, l) in &live {
                assert!(at + len <= s || s + l <= at, "carve {at}+{len} overlaps live {s}+{l}");
            }
            head = at + len;
            live.push_back((at, len));
            granted += 1;
        }
        assert!(granted > 50_000, "only {granted} carves granted");
    }
}
