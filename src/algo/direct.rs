//! Direct exchanges: every transfer goes straight to its destination.

use crate::device::host::Region;
use crate::plan::{Builder, Ref};

pub fn alltoall(b: &mut Builder, r: usize, n: usize, send: Region, recv: Region) {
    let len = recv.len() / n;
    for k in 1..n {
        // Stagger peers (r+k, r-k) so every rank talks to a different peer at first.
        let to = (r + k) % n;
        let from = (r + n - k) % n;
        b.send(to, send.sub(to * len, len), &[]);
        b.recv(from, recv.sub(from * len, len), &[]);
    }
    b.copy(recv.sub(r * len, len), send.sub(r * len, len), &[]);
}

/// An all-to-all given one buffer: what arrives in block j overwrites what goes to rank j, so
/// the blocks sent go from a copy taken first (blocks 0..r, then r+1..n, packed), every
/// receive waits for it, and block r, this rank's to itself, is left where it is.
pub fn alltoall_in_place(b: &mut Builder, r: usize, n: usize, buf: Region) {
    let len = buf.len() / n;
    if n == 1 {
        return;
    }
    let copy = b.scratch((n - 1) * len);
    let before = b.copy_to_read(copy.sub(0, r * len), buf.sub(0, r * len), &[]);
    let after = b.copy_to_read(copy.sub(r * len, (n - 1 - r) * len), buf.sub((r + 1) * len, (n - 1 - r) * len),
                               &[before.last()]);
    // (Either copy is empty, and no unit, for the first and last rank.)
    let copied = if after == Ref::NONE { before } else { after }.last();
    let at = |j: usize| if j < r { j * len } else { (j - 1) * len };
    for k in 1..n {
        let to = (r + k) % n;
        let from = (r + n - k) % n;
        b.send(to, copy.sub(at(to), len), &[copied]);
        b.recv(from, buf.sub(from * len, len), &[copied]);
    }
}

pub fn gather(b: &mut Builder, r: usize, n: usize, root: usize, send: Region, recv: Region) {
    let len = send.len();
    if r != root {
        b.send(root, send, &[]);
        return;
    }
    for k in 1..n {
        let from = (root + k) % n;
        b.recv(from, recv.sub(from * len, len), &[]);
    }
    b.copy(recv.sub(root * len, len), send, &[]);
}

pub fn scatter(b: &mut Builder, r: usize, n: usize, root: usize, send: Region, recv: Region) {
    let len = recv.len();
    if r != root {
        b.recv(root, recv, &[]);
        return;
    }
    for k in 1..n {
        let to = (root + k) % n;
        b.send(to, send.sub(to * len, len), &[]);
    }
    b.copy(recv, send.sub(root * len, len), &[]);
}
