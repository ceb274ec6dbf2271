//! Moving messages between two ranks. One [`SendConn`]/[`RecvConn`] pair per direction and
//! peer, chosen per pair in priority order — `local` (ranks of one process), `shm` (processes
//! of one host), `socket` (anything else) — honouring `NCCL_P2P_DISABLE` and `NCCL_SHM_DISABLE`.
//!
//! A message is at most one slice (the communicator's `slice` bytes) and carries a [`Stamp`]
//! naming the operation it belongs to, so a receiver detects a peer that is running a
//! different operation (and can say which) instead of reading garbage. Connections are made lazily, in two phases
//! so one thread can connect many ranks of a process: every sender first *offers* (creates the
//! buffer or dials the socket, which never waits for the receiver), then receivers *accept*.

pub mod fdpass;
pub mod fds;
pub mod ipc;
pub mod local;
pub mod ring;
pub mod rma;
pub mod shm;
pub mod socket;

use std::sync::atomic::AtomicBool;
use std::time::Instant;

use crate::bootstrap::{PeerInfo, Service};
use crate::device::host::Region;
use crate::error::{Error, Result};

/// What every message carries besides its bytes: the identity of its operation, opaque to
/// transports (the planner writes and reads it).
pub const STAMP_BYTES: usize = 24;
pub type Stamp = [u8; STAMP_BYTES];

/// The sending half of a connection to one peer.
pub trait SendConn: Send {
    /// Try to send `src` as one message. `Done`: all of it was accepted and `src` may be
    /// reused. `Posted(token)`: the peer will read `src` itself (single copy); it must stay
    /// untouched until [`SendConn::consumed`] says so, but the next message may be sent.
    /// `Blocked`: no room now; call again with the same message (partial progress is kept).
    /// `single_copy_early`: a transport that can let the peer read `src` in place may do so
    /// from a smaller size (see `proxy::Job::poll` for when it pays).
    fn try_send(&mut self, src: Region, stamp: &Stamp, single_copy_early: bool) -> Result<Sent>;
    /// Has the peer read the posted message `token`? With `help`, this side has nothing
    /// else to do and may move part of the message itself, if the transport can.
    fn consumed(&mut self, token: u64, help: bool) -> Result<bool> {
        let _ = (token, help);
        Ok(true)
    }
    /// Is the peer still there, to take what this side has yet to send? Called while waiting.
    fn check(&mut self) -> Result<()>;
    /// Did everything sent reach the peer, as far as can be told now? Called while the
    /// operation waits on others, this side's sends all made. A peer that read them may have
    /// gone since, as it may; one gone before it read them fails the operation, where the
    /// transport can tell (a socket reset).
    fn check_written(&mut self) -> Result<()> {
        Ok(())
    }
    fn kind(&self) -> Kind;
    /// Bytes of buffer memory this connection holds (for ncclCommMemStats).
    fn mem_bytes(&self) -> u64 {
        0
    }
    /// A descriptor that turns writable when a blocked send can go on, for a connection
    /// whose sends wait on one (sockets); None where progress shows only by looking.
    fn wait_fd(&self) -> Option<std::os::fd::RawFd> {
        None
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sent {
    Done,
    Posted(u64),
    Blocked,
}

/// The receiving half of a connection to one peer.
pub trait RecvConn: Send {
    /// If the next message has fully arrived, hand its stamp and bytes to `deliver` (which
    /// checks them against what it expects) and consume it.
    fn try_recv(&mut self, deliver: &mut dyn FnMut(&Stamp, &[u8]) -> Result<()>) -> Result<bool>;
    /// Receive the next message into `dst`: `accept(stamp, len)` runs first and may refuse
    /// (nothing is written then). A transport that can write straight into `dst` saves a copy.
    fn try_recv_into(&mut self, dst: Region, accept: &mut dyn FnMut(&Stamp, usize) -> Result<()>) -> Result<bool> {
        self.try_recv(&mut |stamp, data| {
            accept(stamp, data.len())?;
            crate::device::host::copy_in(dst, data);
            Ok(())
        })
    }
    fn check(&mut self) -> Result<()>;
    fn kind(&self) -> Kind;
    /// Bytes of buffer memory this connection holds (for ncclCommMemStats).
    fn mem_bytes(&self) -> u64 {
        0
    }
    /// A descriptor that turns readable when the next message (or more of it) comes, for a
    /// connection that has one (sockets); None where arrivals show only by looking.
    fn wait_fd(&self) -> Option<std::os::fd::RawFd> {
        None
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Local,
    Shm,
    Socket,
}

/// Which transport connects `me` and `peer` (both sides compute the same answer: from what
/// both ranks' settings allow).
pub fn choose(me: &PeerInfo, peer: &PeerInfo) -> Kind {
    let links = me.links.with(peer.links);
    if me.same_process(peer) && links.p2p {
        Kind::Local
    } else if me.shares_memory(peer) && links.shm {
        Kind::Shm
    } else {
        Kind::Socket
    }
}

/// One communicator's connections, by peer.
pub struct Conns {
    send: Vec<Option<Box<dyn SendConn>>>,
    recv: Vec<Option<Box<dyn RecvConn>>>,
}

impl Conns {
    pub fn new(n: usize) -> Conns {
        Conns { send: (0..n).map(|_| None).collect(), recv: (0..n).map(|_| None).collect() }
    }
    pub fn has_send(&self, peer: usize) -> bool {
        self.send.get(peer).is_some_and(|c| c.is_some())
    }
    pub fn has_recv(&self, peer: usize) -> bool {
        self.recv.get(peer).is_some_and(|c| c.is_some())
    }
    pub fn send_mut(&mut self, peer: usize) -> Result<&mut dyn SendConn> {
        match self.send.get_mut(peer) {
            Some(Some(c)) => Ok(c.as_mut()),
            _ => Err(Error::internal(format!("no send connection to rank {peer}"))),
        }
    }
    pub fn recv_mut(&mut self, peer: usize) -> Result<&mut dyn RecvConn> {
        match self.recv.get_mut(peer) {
            Some(Some(c)) => Ok(c.as_mut()),
            _ => Err(Error::internal(format!("no receive connection from rank {peer}"))),
        }
    }
    /// Buffer memory held by every connection: each ring once (its sender's), staging areas.
    pub fn mem_bytes(&self) -> u64 {
        let sends = self.send.iter().flatten().map(|c| c.mem_bytes());
        let recvs = self.recv.iter().flatten().map(|c| c.mem_bytes());
        sends.chain(recvs).sum()
    }
    pub fn close_all(&mut self) {
        self.send.iter_mut().for_each(|c| *c = None);
        self.recv.iter_mut().for_each(|c| *c = None);
    }
}

/// A communicator ends: the rings peers of this host or process may have offered it, with
/// messages it never received (`shm`), go, for peers it never accepted: files in /dev/shm,
/// or entries of the process's rendezvous table.
pub fn forget_unaccepted(rank: usize, hash: u64, peers: &[PeerInfo], conns: &Conns) {
    let Some(me) = peers.get(rank) else { return };
    for (p, other) in peers.iter().enumerate() {
        if p == rank || conns.has_recv(p) {
            continue;
        }
        match choose(me, other) {
            Kind::Shm => shm::remove_expected(hash, p, rank, other.pid, me.addr.port()),
            Kind::Local => local::forget(hash, p, rank, me.addr.port()),
            Kind::Socket => {}
        }
    }
}

/// What connecting needs to know about the communicator.
pub struct Ctx<'a> {
    pub rank: usize,
    pub hash: u64,
    pub peers: &'a [PeerInfo],
    pub service: &'a Service,
    pub slice: usize,
    pub abort: &'a AtomicBool,
    pub deadline: Instant,
}

/// Bootstrap tags used while connecting.
const TAG_SHM: u32 = 0x5348_4d00;
const TAG_SOCKET: u32 = 0x534f_4b00;
/// Sent instead of a ring's name when the sender found no room for one in `/dev/shm`: the
/// pair connects by socket (never a ring's name: those start with `shm::PREFIX`).
const SOCKET_INSTEAD: &[u8] = b"socket";

fn socket_send(ctx: &Ctx<'_>, me: &PeerInfo, other: &PeerInfo, peer: usize) -> Result<socket::SocketSend> {
    let k = me.nsocks.min(other.nsocks).max(1);
    let streams = (0..k).map(|j| ctx.service.connect_data(peer, TAG_SOCKET + j)).collect::<Result<Vec<_>>>()?;
    socket::SocketSend::new(streams, peer)
}

fn socket_recv(ctx: &Ctx<'_>, me: &PeerInfo, other: &PeerInfo, peer: usize) -> Result<socket::SocketRecv> {
    let k = me.nsocks.min(other.nsocks).max(1);
    let streams = (0..k).map(|j| ctx.service.accept_data(peer, TAG_SOCKET + j, ctx.deadline, ctx.abort))
        .collect::<Result<Vec<_>>>()?;
    socket::SocketRecv::new(streams, peer, ctx.slice)
}

/// Phase 1: create the sending side towards `peer`.
pub fn offer(ctx: &Ctx<'_>, conns: &mut Conns, peer: usize) -> Result<()> {
    if conns.has_send(peer) {
        return Ok(());
    }
    let me = &ctx.peers[ctx.rank];
    let other = &ctx.peers[peer];
    let conn: Box<dyn SendConn> = match choose(me, other) {
        Kind::Local => Box::new(local::offer(ctx.hash, ctx.rank, peer, other.addr.port(), ctx.slice)?),
        Kind::Shm => match shm::create(ctx.hash, ctx.rank, peer, other.addr.port(), ctx.slice, other.pid)? {
            shm::Made::Ring(conn, name) => {
                ctx.service.send(peer, TAG_SHM, name.as_bytes())?;
                Box::new(conn)
            }
            shm::Made::NoRoom(why) => {
                // The receiver expects a ring's name: it is told to take a socket instead.
                static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
                if crate::debug::first_time(&SAID) {
                    crate::warn!(
                        "rank {} -> rank {peer}: {why}: sockets instead, for this pair and any other that finds no \
                         room (a container's /dev/shm is 64 MB by default: docker run --shm-size=1g, or \
                         NCCL_SHM_DISABLE=1 to use sockets from the start)", ctx.rank);
                }
                crate::info!(INIT, "rank {} -> rank {peer}: {why}: socket instead of shared memory", ctx.rank);
                ctx.service.send(peer, TAG_SHM, SOCKET_INSTEAD)?;
                Box::new(socket_send(ctx, me, other, peer)?)
            }
        },
        Kind::Socket => Box::new(socket_send(ctx, me, other, peer)?),
    };
    let why = if conn.kind() == Kind::Socket && me.same_host(other) && !me.shares_memory(other) {
        " (same host, but another pid namespace or /dev/shm: a container of its own)"
    } else {
        ""
    };
    crate::info!(INIT, "rank {} -> rank {} via {:?}{why}", ctx.rank, peer, conn.kind());
    conns.send[peer] = Some(conn);
    Ok(())
}

/// Phase 2: take the receiving side from `peer` (waits for its offer, bounded).
pub fn accept(ctx: &Ctx<'_>, conns: &mut Conns, peer: usize) -> Result<()> {
    if conns.has_recv(peer) {
        return Ok(());
    }
    let me = &ctx.peers[ctx.rank];
    let other = &ctx.peers[peer];
    let conn: Box<dyn RecvConn> = match choose(me, other) {
        Kind::Local => Box::new(local::accept(ctx.hash, peer, ctx.rank, me.addr.port(), ctx.slice, ctx.deadline, ctx.abort)?),
        Kind::Shm => {
            let name = ctx.service.recv(peer, TAG_SHM, ctx.deadline, ctx.abort);
            if name.as_deref().is_ok_and(|n| n == SOCKET_INSTEAD) {
                Box::new(socket_recv(ctx, me, other, peer)?)
            } else {
                let opened = name.and_then(|name| shm::open(&String::from_utf8_lossy(&name), ctx.slice, other.pid));
                // Not after a wait that only ran out (callers wait in slices, `accept_watching`):
                // the sender creates its ring before it sends the name, so the file may be there
                // already, its name on its way; removing it then failed the next slice's open.
                // (One never taken is removed when the communicator ends: `forget_unaccepted`.)
                if opened.as_ref().is_err_and(|e| e.code != crate::Code::Timeout) {
                    shm::remove_expected(ctx.hash, peer, ctx.rank, other.pid, me.addr.port());
                }
                Box::new(opened?)
            }
        }
        Kind::Socket => Box::new(socket_recv(ctx, me, other, peer)?),
    };
    conns.recv[peer] = Some(conn);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::{Links, PeerInfo};
    use std::time::Duration;

    fn peer(rank: usize, pid: u32, service: &Service) -> PeerInfo {
        PeerInfo { rank, pid, cuda_dev: 0, host_hash: 0x5eed, pid_ns: 7, shm_fs: 9, hostname: "here".into(),
                   addr: service.addr, slice: 1 << 16, nsocks: 1, links: Links { shm: true, p2p: true, ..Links::local() },
                   gpu: Default::default() }
    }

    /// Containers of one host that share its name and network (so its host hash) but not its
    /// pids or its /dev/shm: the same pid in two of them is two processes, and a ring in one's
    /// /dev/shm cannot be opened in the other. Sockets connect them. Before, two processes of
    /// pid 1 (each its container's first) took in-process rings, and each waited for ever
    /// for the other's (found by a probe with `unshare --pid`).
    #[test]
    fn containers_of_one_host_connect_through_sockets() {
        let ip: std::net::IpAddr = "127.0.0.1".parse().unwrap();
        let service = Service::start(ip, 0xfeed, 0).unwrap();
        let a = peer(0, 1, &service);
        assert_eq!(choose(&a, &peer(1, 1, &service)), Kind::Local, "one process");
        assert_eq!(choose(&a, &peer(1, 2, &service)), Kind::Shm, "two processes of one host");
        let own_pids = |rank, pid| PeerInfo { pid_ns: 8, ..peer(rank, pid, &service) };
        assert_eq!(choose(&a, &own_pids(1, 1)), Kind::Socket, "pid 1 of another pid namespace");
        assert_eq!(choose(&a, &own_pids(1, 2)), Kind::Socket, "pid 2 of another pid namespace");
        assert!(!a.same_process(&own_pids(1, 1)) && a.same_host(&own_pids(1, 1)));
        let own_shm = PeerInfo { shm_fs: 10, ..peer(1, 2, &service) };
        assert_eq!(choose(&a, &own_shm), Kind::Socket, "a /dev/shm of its own");
        assert_eq!(choose(&own_pids(0, 5), &own_pids(1, 6)), Kind::Shm, "two processes of one container");
    }

    /// A receiver waits for a ring's name in slices (`group::accept_watching`). A slice that
    /// runs out while the sender has created its ring but not yet sent the name (a sender
    /// stopped or slow right then) leaves the ring, so the next slice opens it. Before, it was
    /// removed, and the open failed: "the sending rank removed its ring before this rank
    /// opened it" (found by a probe that stopped processes with SIGSTOP).
    #[test]
    fn a_slice_that_runs_out_leaves_the_senders_ring() {
        let ip: std::net::IpAddr = "127.0.0.1".parse().unwrap();
        let (to, from) = (Service::start(ip, 0xfeed, 1).unwrap(), Service::start(ip, 0xfeed, 0).unwrap());
        to.set_peers(vec![from.addr, to.addr]);
        from.set_peers(vec![from.addr, to.addr]);
        let me = std::process::id();
        // (The sender claims another process of this host: the pair takes a ring in /dev/shm.)
        let peers = vec![peer(0, me + 1, &from), peer(1, me, &to)];
        let hash = 0x7e57_0000_0000_0000 | u64::from(me);
        let slice = 1 << 16;
        let shm::Made::Ring(ring, made) = shm::create(hash, 0, 1, to.addr.port(), slice, me).unwrap() else {
            panic!("no room in /dev/shm for a test ring");
        };
        // (Named as the other process would name it.)
        let name = shm::name_for(hash, 0, 1, me + 1, to.addr.port());
        std::fs::rename(format!("/dev/shm/{made}"), format!("/dev/shm/{name}")).unwrap();
        let abort = AtomicBool::new(false);
        let mut conns = Conns::new(2);
        let ctx = |wait: Duration| Ctx { rank: 1, hash, peers: &peers, service: &to, slice, abort: &abort,
                                         deadline: Instant::now() + wait };
        let first = accept(&ctx(Duration::from_millis(50)), &mut conns, 0);
        assert!(first.as_ref().is_err_and(|e| e.code == crate::Code::Timeout), "no name yet: {:?}", first.err());
        assert!(std::path::Path::new(&format!("/dev/shm/{name}")).exists(), "the ring is still there after the slice");
        from.send(1, TAG_SHM, name.as_bytes()).unwrap();
        let second = accept(&ctx(Duration::from_secs(10)), &mut conns, 0);
        assert!(second.is_ok(), "the next slice takes the ring: {:?}", second.err());
        drop(ring);
    }
}
