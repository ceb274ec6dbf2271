//! Rings and chains.

use super::chunk;
use crate::device::host::Region;
use crate::plan::{Builder, Reduction, Ref};

fn part(r: Region, count: usize, es: usize, n: usize, c: usize) -> Region {
    let (off, len) = chunk(count, es, n, c);
    r.sub(off, len)
}

/// Reduce-scatter then all-gather around the ring; chunk (r+1) is finished on rank r.
pub fn allreduce(b: &mut Builder, r: usize, n: usize, send: Region, recv: Region, red: Reduction) {
    if n == 1 {
        let c = b.copy(recv, send, &[]);
        b.finish(recv, red, &[c]);
        return;
    }
    let es = red.dt.size();
    let count = recv.len() / es;
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let sc = |c: usize| part(send, count, es, n, c);
    let rc = |c: usize| part(recv, count, es, n, c);
    let mut produced = Ref::NONE;
    let mut rs_sends = Vec::with_capacity(n - 1);
    for s in 0..n - 1 {
        let cs = (r + n - s) % n;
        let src = if s == 0 { sc(cs) } else { rc(cs) };
        rs_sends.push(b.send(next, src, &[produced]));
        let cr = (r + 2 * n - s - 1) % n;
        produced = b.recv_reduce(prev, rc(cr), sc(cr), red, &[]);
    }
    produced = b.finish(rc((r + 1) % n), red, &[produced]);
    for (s, rs_send) in rs_sends.iter().enumerate() {
        let cs = (r + 1 + n - s) % n;
        b.send(next, rc(cs), &[produced]);
        let cr = (r + n - s) % n;
        // The reduce-scatter step s sent chunk cr from this buffer (in place): wait for it.
        produced = b.recv(prev, rc(cr), &[*rs_send]);
    }
}

pub fn allgather(b: &mut Builder, r: usize, n: usize, send: Region, recv: Region) {
    let count = send.len();
    let rc = |c: usize| recv.sub(c * count, count);
    b.copy(rc(r), send, &[]);
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let mut produced = Ref::NONE;
    for s in 0..n.saturating_sub(1) {
        let cs = (r + n - s) % n;
        let src = if s == 0 { send } else { rc(cs) };
        b.send(next, src, &[produced]);
        produced = b.recv(prev, rc((r + 2 * n - s - 1) % n), &[]);
    }
}

/// Chunk c travels c+1, c+2, ..., c, accumulating; partials alternate between two chunks, so
/// memory stays at two chunks whatever the rank count. Out of place, one of the two is the
/// output itself (its partials end in it at the last step), so the scratch is one chunk; in
/// place the output is this rank's own input chunk, read at the last step, so two.
pub fn reduce_scatter(b: &mut Builder, r: usize, n: usize, send: Region, recv: Region, red: Reduction) {
    let len = recv.len();
    let sc = |c: usize| send.sub(c * len, len);
    if n == 1 {
        let c = b.copy(recv, sc(0), &[]);
        b.finish(recv, red, &[c]);
        return;
    }
    let out_of_place = !recv.overlaps(send);
    let tmp = match n {
        2 => Region::EMPTY,
        _ if out_of_place => b.scratch(len),
        _ => b.scratch(2 * len),
    };
    // The partial sum step i writes (and step i+1 sends): step n-2 writes the output, and
    // consecutive steps use different chunks.
    let t = |i: usize| {
        let k = (n - 2 - i) % 2; // 0: the output's parity
        if i == n - 2 || (out_of_place && k == 0) {
            recv
        } else if out_of_place {
            tmp
        } else {
            tmp.sub(k * len, len)
        }
    };
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let mut produced = Ref::NONE;
    let mut sends: Vec<Ref> = Vec::with_capacity(n - 1);
    for s in 0..n - 1 {
        let cs = (r + 2 * n - 1 - s) % n;
        let src = if s == 0 { sc(cs) } else { t(s - 1) };
        sends.push(b.send(next, src, &[produced]));
        let cr = (r + 2 * n - 2 - s) % n;
        let dst = t(s);
        // t(s) was last read by the send of step s-1 (which sent t(s-2)).
        let war = if s >= 2 { sends[s - 1] } else { Ref::NONE };
        produced = b.recv_reduce(prev, dst, sc(cr), red, &[war]);
    }
    b.finish(recv, red, &[produced]);
}

/// Pipelined chain root, root+1, ..., root-1. The first rank of the chain acknowledges to
/// the root with a one-byte message: a root that only sent would otherwise never read a
/// stamp, and two ranks that both believe they are the root would each return success.
pub fn broadcast(b: &mut Builder, r: usize, n: usize, root: usize, send: Region, recv: Region) {
    let pos = (r + n - root) % n;
    let next = (r + 1) % n;
    let prev = (r + n - 1) % n;
    if pos == 0 {
        if n > 1 {
            b.send(next, send, &[]);
            let ack = b.scratch(1);
            b.recv(next, ack, &[]);
        }
        b.copy(recv, send, &[]);
    } else {
        let got = b.recv(prev, recv, &[]);
        if pos == 1 {
            let ack = b.scratch(1);
            b.send(prev, ack, &[got]);
        }
        if pos < n - 1 {
            b.send(next, recv, &[got]);
        }
    }
}

/// Slices of scratch a middle rank of [`reduce`]'s chain passes partial sums through.
const REDUCE_SLOTS: usize = 4;

/// Pipelined chain root+1, root+2, ..., root: each rank adds its input and passes it on. A
/// middle rank does so slice by slice through REDUCE_SLOTS slices of scratch, not a copy of
/// the whole buffer: the receive into a slot waits for the send that last went from it.
pub fn reduce(b: &mut Builder, r: usize, n: usize, root: usize, send: Region, recv: Region, red: Reduction) {
    let pos = (r + n - root - 1) % n;
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    if n == 1 {
        let c = b.copy(recv, send, &[]);
        b.finish(recv, red, &[c]);
    } else if pos == 0 {
        b.send(next, send, &[]);
    } else if pos < n - 1 {
        let (len, slice) = (send.len(), b.slice());
        let k = len.div_ceil(slice);
        let slots = k.min(REDUCE_SLOTS);
        let tmp = b.scratch(slots * slice.min(len));
        let mut sent = Vec::with_capacity(k);
        for i in 0..k {
            let (off, l) = (i * slice, slice.min(len - i * slice));
            let slot = tmp.sub((i % slots) * slice, l);
            let war = if i >= slots { sent[i - slots] } else { Ref::NONE };
            let got = b.recv_reduce(prev, slot, send.sub(off, l), red, &[war]);
            sent.push(b.send(next, slot, &[got]));
        }
    } else {
        let got = b.recv_reduce(prev, recv, send, red, &[]);
        b.finish(recv, red, &[got]);
    }
}
