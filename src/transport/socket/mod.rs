//! TCP between ranks that share no memory (other hosts, or `NCCL_SHM_DISABLE=1`), over one or
//! several sockets per peer (`NCCL_SOCKET_NTHREADS` x `NCCL_NSOCKS_PERTHREAD`): message i
//! travels on socket i mod k, so several are in flight at once. Each
//! message is a 32-byte header (length, stamp) and its bytes, written and read without blocking
//! so one thread can drive many connections; a closed connection is a `ncclRemoteError`.

pub mod ifaces;

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use super::{Kind, RecvConn, SendConn, Sent, Stamp, STAMP_BYTES};

const HEADER: usize = 8 + STAMP_BYTES;
use crate::device::host::Region;
use crate::error::{Error, Result};

/// Make a dead link or host show up as a socket error within `timeout`, without mistaking a
/// slow but alive peer for a dead one: keepalive probes are answered by the peer's kernel
/// whatever its process is doing, and TCP_USER_TIMEOUT bounds how long sent data may stay
/// unacknowledged.
pub fn set_liveness(stream: &TcpStream, timeout: std::time::Duration) {
    use std::os::fd::AsRawFd;
    let fd = stream.as_raw_fd();
    let secs = timeout.as_secs().clamp(3, 3600) as libc::c_int;
    let idle = (secs / 3).max(1);
    let intvl = (secs / 10).max(1);
    let cnt = ((secs - idle) / intvl).max(1);
    let ms: libc::c_uint = (secs as libc::c_uint) * 1000;
    let set = |level: libc::c_int, opt: libc::c_int, v: &[u8]| {
        // SAFETY: fd is a live socket owned by `stream`; v points to an option value of v.len() bytes.
        unsafe { libc::setsockopt(fd, level, opt, v.as_ptr().cast(), v.len() as libc::socklen_t) };
    };
    set(libc::SOL_SOCKET, libc::SO_KEEPALIVE, &1i32.to_ne_bytes());
    set(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, &idle.to_ne_bytes());
    set(libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, &intvl.to_ne_bytes());
    set(libc::IPPROTO_TCP, libc::TCP_KEEPCNT, &cnt.to_ne_bytes());
    set(libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT, &ms.to_ne_bytes());
}

/// Wait until one of `fds` has something to read (a listener: a connection to accept; a
/// stream: bytes, or its end), at most `timeout`. An interrupted wait returns early, as the
/// timeout does: callers look at what came and wait again.
pub fn wait_any_readable(fds: &[std::os::fd::BorrowedFd<'_>], timeout: Duration) {
    use std::os::fd::AsRawFd;
    let mut polled: Vec<libc::pollfd> =
        fds.iter().map(|fd| libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 }).collect();
    wait_ready(&mut polled, timeout);
}

/// Wait until one of `fds` is ready for what it asks (its `events`), at most `timeout`; an
/// interrupted wait returns early, as the timeout does: callers look and wait again.
pub fn wait_ready(fds: &mut [libc::pollfd], timeout: Duration) {
    let ms = timeout.as_millis().min(i32::MAX as u128) as libc::c_int;
    // SAFETY: `fds` holds fds.len() initialised pollfds and outlives the call; the caller
    // keeps their descriptors open for it.
    unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
}

/// Connections a listener holds before they are accepted, as NCCL asks (the kernel caps it at
/// net.core.somaxconn). std listens with 128: when more ranks than that dialled one root or
/// service at once, the rest's SYNs were dropped and sent again a second later (init of 192
/// processes: 1.1 s, where 128 took 0.08 s).
const BACKLOG: libc::c_int = 16384;

/// A listener on `addr` ([`BACKLOG`] deep).
pub fn listen(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    use std::os::fd::AsRawFd;
    crate::abi::stdio::keep_std_fds();
    let listener = crate::abi::stdio::lifted(std::net::TcpListener::bind(addr)?);
    // SAFETY: listen(2) on a socket this function owns; calling it again on a listening socket
    // only changes its backlog.
    if unsafe { libc::listen(listener.as_raw_fd(), BACKLOG) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(listener)
}

/// `TcpStream::connect_timeout`, refusing a connection to itself. Connecting to a port of this
/// host where nothing listens yet (the root of `NCCL_COMM_ID` before rank 0 starts it, a dead
/// peer's service) may be answered by TCP's simultaneous open when the kernel happens to pick
/// that very port as the source: the socket is then connected to itself, reads back what it
/// writes, and holds the port the listener was to bind. Such a connection is closed and reported
/// as refused, so callers that retry try again.
pub fn dial(addr: &SocketAddr, timeout: Duration) -> std::io::Result<TcpStream> {
    crate::abi::stdio::keep_std_fds();
    not_to_itself(super::fds::made(|| TcpStream::connect_timeout(addr, timeout))?)
}

fn not_to_itself(s: TcpStream) -> std::io::Result<TcpStream> {
    match (s.local_addr(), s.peer_addr()) {
        (Ok(local), Ok(peer)) if local == peer => Err(std::io::Error::new(
            ErrorKind::ConnectionRefused,
            format!("nothing listens at {peer} (the connection reached itself)"),
        )),
        _ => Ok(s),
    }
}

fn lost(peer: usize, e: impl std::fmt::Display) -> Error {
    Error::remote(format!("connection to rank {peer} lost: {e}"))
}

fn prepare(streams: &[TcpStream]) -> Result<()> {
    for s in streams {
        s.set_nonblocking(true).map_err(|e| Error::os("socket: nonblocking", e))?;
        let _ = s.set_nodelay(true);
        set_liveness(s, crate::params::peer_timeout());
    }
    if streams.is_empty() {
        return Err(Error::internal("socket transport without sockets"));
    }
    Ok(())
}

fn check_all(streams: &[TcpStream], peer: usize) -> Result<()> {
    for s in streams {
        match s.take_error() {
            Ok(None) => {}
            Ok(Some(e)) | Err(e) => return Err(lost(peer, e)),
        }
    }
    Ok(())
}

/// Write `a` then `b` in one sendmsg(2); how many bytes went. With MSG_NOSIGNAL, as std's
/// `write` on a socket: a peer gone is an EPIPE error, never a SIGPIPE that would end the
/// process (`write_vectored` is writev(2), which raises it).
fn send_both(stream: &TcpStream, a: &[u8], b: &[u8]) -> std::io::Result<usize> {
    use std::os::fd::AsRawFd;
    let mut iov = [
        libc::iovec { iov_base: a.as_ptr() as *mut libc::c_void, iov_len: a.len() },
        libc::iovec { iov_base: b.as_ptr() as *mut libc::c_void, iov_len: b.len() },
    ];
    // SAFETY: a zeroed msghdr is a valid empty one; it then names the two iovecs above, which
    // describe live slices the kernel only reads, for the duration of the call.
    let sent = unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = iov.len() as _;
        libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL)
    };
    if sent < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(sent as usize)
}

pub struct SocketSend {
    streams: Vec<TcpStream>,
    /// The socket the current message goes on.
    next: usize,
    peer: usize,
    /// Bytes of the current message (header included) already written.
    sent: usize,
}

impl SocketSend {
    pub fn new(streams: Vec<TcpStream>, peer: usize) -> Result<SocketSend> {
        prepare(&streams)?;
        Ok(SocketSend { streams, next: 0, peer, sent: 0 })
    }
}

impl SendConn for SocketSend {
    fn try_send(&mut self, src: Region, stamp: &Stamp, _single_copy_early: bool) -> Result<Sent> {
        let mut header = [0u8; HEADER];
        header[..4].copy_from_slice(&(src.len() as u32).to_le_bytes());
        header[8..].copy_from_slice(stamp);
        // SAFETY: the schedule does not write `src` until this send completes.
        let body = unsafe { src.as_slice() };
        let total = HEADER + body.len();
        let stream = &mut self.streams[self.next];
        while self.sent < total {
            let r = if self.sent < HEADER {
                // Header and body in one call: one segment for a small message, not two.
                send_both(stream, &header[self.sent..], body)
            } else {
                stream.write(&body[self.sent - HEADER..])
            };
            match r {
                Ok(0) => return Err(lost(self.peer, "closed")),
                Ok(n) => self.sent += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(Sent::Blocked),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(lost(self.peer, e)),
            }
        }
        self.sent = 0;
        self.next = (self.next + 1) % self.streams.len();
        Ok(Sent::Done)
    }
    fn check(&mut self) -> Result<()> {
        check_all(&self.streams, self.peer)?;
        // Nothing comes back on a sending socket but its end: a receiver that closed it (its
        // process ended, or it destroyed its communicator) will not read what is still to
        // come. Seen only here while the next message waits on something else (a receive
        // from a third rank): a write would find it out too, but may never be made.
        for s in &self.streams {
            match s.peek(&mut [0u8; 1]) {
                Ok(0) => return Err(lost(self.peer, "the peer closed the connection")),
                Ok(_) => {}
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {}
                Err(e) => return Err(lost(self.peer, e)),
            }
        }
        Ok(())
    }
    fn check_written(&mut self) -> Result<()> {
        check_all(&self.streams, self.peer)
    }
    fn kind(&self) -> Kind {
        Kind::Socket
    }
    fn wait_fd(&self) -> Option<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        Some(self.streams[self.next].as_raw_fd())
    }
}

pub struct SocketRecv {
    streams: Vec<TcpStream>,
    next: usize,
    peer: usize,
    header: [u8; HEADER],
    got: usize,
    body: Vec<u8>,
    slice: usize,
    /// The region the current message's body is being read into (`try_recv_into`), once
    /// some of it is there; None while it goes to `body`.
    into: Option<Region>,
}

impl SocketRecv {
    pub fn new(streams: Vec<TcpStream>, peer: usize, slice: usize) -> Result<SocketRecv> {
        prepare(&streams)?;
        Ok(SocketRecv {
            streams, next: 0, peer, header: [0; HEADER], got: 0, body: Vec::with_capacity(slice), slice, into: None,
        })
    }

    /// Read until `want_total` bytes of the message (header included) are in: the header
    /// into `header`, the body into `body` (the connection's own buffer, or the receive's
    /// region: HEADER + its length is `want_total`).
    fn read_some(&mut self, want_total: usize, body: Region) -> Result<bool> {
        let stream = &mut self.streams[self.next];
        while self.got < want_total {
            let r = if self.got < HEADER {
                stream.read(&mut self.header[self.got..])
            } else {
                // SAFETY: `body` is valid for its length (the connection's buffer, or the
                // receive's region, which nobody else reads or writes until the receive
                // completes), and got - HEADER is below it (got < want_total).
                stream.read(unsafe { &mut body.as_mut_slice()[self.got - HEADER..] })
            };
            match r {
                Ok(0) => return Err(lost(self.peer, "the peer closed the connection")),
                Ok(n) => self.got += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(lost(self.peer, e)),
            }
        }
        Ok(true)
    }

    /// The next message's header, once it is all in: its stamp and body length.
    fn header(&mut self) -> Result<Option<(Stamp, usize)>> {
        if self.got < HEADER && !self.read_some(HEADER, Region::EMPTY)? {
            return Ok(None);
        }
        let len = u32::from_le_bytes([self.header[0], self.header[1], self.header[2], self.header[3]]) as usize;
        if len > self.slice {
            return Err(lost(self.peer, format!("malformed message of {len} bytes (limit {})", self.slice)));
        }
        let mut stamp = [0u8; STAMP_BYTES];
        stamp.copy_from_slice(&self.header[8..]);
        Ok(Some((stamp, len)))
    }

    fn next_message(&mut self) {
        self.got = 0;
        self.into = None;
        self.next = (self.next + 1) % self.streams.len();
    }
}

impl RecvConn for SocketRecv {
    fn try_recv(&mut self, deliver: &mut dyn FnMut(&Stamp, &[u8]) -> Result<()>) -> Result<bool> {
        if self.into.is_some() {
            return Err(Error::internal("a socket receive read partly into a buffer is taken over by another step"));
        }
        let Some((stamp, len)) = self.header()? else { return Ok(false) };
        if self.got == HEADER {
            self.body.resize(len, 0);
        }
        let body = Region::owned(&mut self.body);
        if !self.read_some(HEADER + len, body)? {
            return Ok(false);
        }
        self.next_message();
        deliver(&stamp, &self.body)?;
        Ok(true)
    }
    /// A message of `dst`'s length is read from the socket straight into `dst` (the kernel's
    /// copy only); `accept` runs once its header is in, before any of its body is read, and a
    /// refusal leaves the message unread, as the shared-memory ring does.
    fn try_recv_into(&mut self, dst: Region, accept: &mut dyn FnMut(&Stamp, usize) -> Result<()>) -> Result<bool> {
        if self.into.is_some_and(|r| r != dst) {
            return Err(Error::internal("a socket receive read partly into one buffer is continued into another"));
        }
        let Some((stamp, len)) = self.header()? else { return Ok(false) };
        if len != dst.len() || (self.got > HEADER && self.into.is_none()) {
            // Not this receive's size (`accept` refuses it after the generic read), or a
            // body already going to `body`.
            return self.try_recv(&mut |stamp, data| {
                accept(stamp, data.len())?;
                crate::device::host::copy_in(dst, data);
                Ok(())
            });
        }
        if self.into.is_none() {
            accept(&stamp, len)?;
            self.into = Some(dst);
        }
        if !self.read_some(HEADER + len, dst)? {
            return Ok(false);
        }
        self.next_message();
        Ok(true)
    }
    fn check(&mut self) -> Result<()> {
        check_all(&self.streams, self.peer)
    }
    fn kind(&self) -> Kind {
        Kind::Socket
    }
    fn mem_bytes(&self) -> u64 {
        self.body.capacity() as u64
    }
    fn wait_fd(&self) -> Option<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        Some(self.streams[self.next].as_raw_fd())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::FromRawFd;

    /// A socket bound to a port of 127.0.0.1 and connected to that same address: what TCP's
    /// simultaneous open makes of a connect that picks the port it dials as its source.
    fn connected_to_itself() -> TcpStream {
        let addr = |port: u16| libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: port.to_be(),
            sin_addr: libc::in_addr { s_addr: u32::from(std::net::Ipv4Addr::LOCALHOST).to_be() },
            sin_zero: [0; 8],
        };
        let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        // SAFETY: plain socket calls on a descriptor this function owns; every sockaddr passed
        // is a sockaddr_in of `len` bytes that outlives the call.
        unsafe {
            let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
            assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
            let mut bound = addr(0);
            assert_eq!(libc::bind(fd, (&bound as *const libc::sockaddr_in).cast(), len), 0, "bind");
            let mut got = len;
            assert_eq!(libc::getsockname(fd, (&mut bound as *mut libc::sockaddr_in).cast(), &mut got), 0);
            let to = addr(u16::from_be(bound.sin_port));
            assert_eq!(libc::connect(fd, (&to as *const libc::sockaddr_in).cast(), len), 0,
                       "connect to itself: {}", std::io::Error::last_os_error());
            TcpStream::from_raw_fd(fd)
        }
    }

    #[test]
    fn a_connection_to_itself_is_refused() {
        let s = connected_to_itself();
        assert_eq!(s.local_addr().unwrap(), s.peer_addr().unwrap(), "the setup makes a self-connection");
        let e = not_to_itself(s).expect_err("a connection to itself must be refused");
        assert_eq!(e.kind(), ErrorKind::ConnectionRefused);
        assert!(e.to_string().contains("reached itself"), "{e}");
    }

    /// More ranks than std's backlog of 128 dial one listener before it accepts any: every
    /// connection completes at once (before, those past the backlog waited a second for their
    /// SYN to be sent again). Up to net.core.somaxconn, which caps any backlog.
    #[test]
    fn a_listener_holds_hundreds_of_connections_before_accepting() {
        let cap: usize = std::fs::read_to_string("/proc/sys/net/core/somaxconn").ok()
            .and_then(|s| s.trim().parse().ok()).unwrap_or(128);
        let n = cap.min(300);
        let l = listen("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = l.local_addr().unwrap();
        let mut held = Vec::new();
        for i in 0..n {
            match std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(500)) {
                Ok(s) => held.push(s),
                Err(e) => panic!("connection {i} of {n} (somaxconn {cap}) did not complete: {e}"),
            }
        }
        assert_eq!(held.len(), n);
    }

    fn pair(slice: usize) -> (SocketSend, SocketRecv) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (SocketSend::new(vec![a], 1).unwrap(), SocketRecv::new(vec![b], 0, slice).unwrap())
    }

    /// `try_recv_into` reads a message of the buffer's size straight into it, in as many calls
    /// as the socket takes; a refused stamp leaves the message whole for the next call (as
    /// the shared-memory ring does); a message of another size goes the general way.
    #[test]
    fn a_receive_reads_into_its_buffer_after_its_stamp_is_accepted() {
        const BIG: usize = 8 << 20; // more than a socket buffer holds: read in several calls
        let (mut tx, mut rx) = pair(BIG);
        let msg: Vec<u8> = (0..BIG).map(|i| (i * 7 + i / 4096) as u8).collect();
        let stamp: Stamp = [9; STAMP_BYTES];
        let mut out = msg.clone();
        let src = Region::owned(&mut out);
        let mut dst = vec![0u8; BIG];
        let region = Region::owned(&mut dst);
        let refuse = |_: &Stamp, _: usize| -> Result<()> { Err(Error::invalid_usage("not this one")) };
        let mut accepted = 0;
        let (mut sent, mut got, mut refused) = (false, false, false);
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while !got {
            assert!(std::time::Instant::now() < deadline, "the message did not arrive");
            if !sent {
                sent = tx.try_send(src, &stamp, false).unwrap() == Sent::Done;
            }
            if !refused {
                match rx.try_recv_into(region, &mut { refuse }) {
                    Ok(false) => continue,
                    Ok(true) => panic!("a refused message was received"),
                    Err(e) => assert!(e.to_string().contains("not this one"), "{e}"),
                }
                refused = true;
                assert!(dst.iter().all(|&b| b == 0), "a refused message wrote into the buffer");
            }
            got = rx.try_recv_into(region, &mut |s, n| {
                assert_eq!((s, n), (&stamp, BIG));
                accepted += 1;
                Ok(())
            }).unwrap();
        }
        assert_eq!(accepted, 1, "accepted once, before its body was read");
        assert!(dst == msg, "the message's bytes");
        assert!(rx.body.is_empty(), "read into the buffer, not through the connection's own");

        // Another size: through `body`, and refused by the caller's check.
        let mut short = vec![5u8; 100];
        while tx.try_send(Region::owned(&mut short), &stamp, false).unwrap() != Sent::Done {}
        let mut small = vec![0u8; 99];
        let e = loop {
            match rx.try_recv_into(Region::owned(&mut small), &mut |_, n| {
                if n == 99 { Ok(()) } else { Err(Error::invalid_usage(format!("{n} bytes"))) }
            }) {
                Ok(false) => assert!(std::time::Instant::now() < deadline, "the short message did not arrive"),
                Ok(true) => panic!("a message of the wrong size was received"),
                Err(e) => break e,
            }
        };
        assert!(e.to_string().contains("100 bytes"), "{e}");
        assert!(small.iter().all(|&b| b == 0));
    }

    #[test]
    fn an_ordinary_connection_passes() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let s = dial(&l.local_addr().unwrap(), Duration::from_secs(5)).expect("a listener is there");
        assert_eq!(s.peer_addr().unwrap(), l.local_addr().unwrap());
    }
}
