//! Recursive doubling all-reduce: log2(n) exchanges of the whole buffer. With a rank count
//! that is not a power of two, the ranks beyond the largest power of two first fold their
//! input into a partner and get the result back at the end. Every pairwise step computes
//! `a op b` with commutative operators, so all ranks end with the same bits.

use crate::device::host::Region;
use crate::plan::{Builder, Reduction};

pub fn allreduce(b: &mut Builder, r: usize, n: usize, send: Region, recv: Region, red: Reduction) {
    // (Sent and reduced into at once: a copy to be read, kept in the cache.)
    let mut last = b.copy_to_read(recv, send, &[]);
    let p = if n.is_power_of_two() { n } else { n.next_power_of_two() / 2 };
    let extra = n - p;
    if r >= p {
        let partner = r - p;
        let sent = b.send(partner, recv, &[last]);
        b.recv(partner, recv, &[sent]);
        return;
    }
    if r < extra {
        last = b.recv_reduce(r + p, recv, recv, red, &[last]);
    }
    // The partner's data lands in scratch, not in `recv`: a receive that waited for our own
    // send of `recv` to complete would deadlock with a transport whose sends complete only
    // when the peer has read them (single-copy descriptors).
    let theirs = b.scratch(recv.len());
    let mut mask = 1;
    while mask < p {
        let partner = r ^ mask;
        let sent = b.send(partner, recv, &[last]);
        let got = b.recv(partner, theirs, &[last]);
        last = b.reduce(recv, recv, theirs, red, &[sent, got]);
        mask <<= 1;
    }
    last = b.finish(recv, red, &[last]);
    if r < extra {
        b.send(r + p, recv, &[last]);
    }
}
