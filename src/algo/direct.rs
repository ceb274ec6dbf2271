//! Direct exchanges: every transfer goes straight to its destination.

use crate::device::host::Region;
use crate::plan::Builder;

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
