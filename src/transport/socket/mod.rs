//! TCP between ranks that share no memory (other hosts, or `NCCL_SHM_DISABLE=1`). Each
//! message is an 8-byte header (length, tag) and its bytes, written and read without blocking
//! so one thread can drive many connections; a closed connection is a `ncclRemoteError`.

pub mod ifaces;

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;

use super::{Kind, RecvConn, SendConn};
use crate::device::host::Region;
use crate::error::{Error, Result};

fn lost(peer: usize, e: impl std::fmt::Display) -> Error {
    Error::remote(format!("connection to rank {peer} lost: {e}"))
}

pub struct SocketSend {
    stream: TcpStream,
    peer: usize,
    /// Bytes of the current message (header included) already written.
    sent: usize,
}

impl SocketSend {
    pub fn new(stream: TcpStream, peer: usize) -> Result<SocketSend> {
        stream.set_nonblocking(true).map_err(|e| Error::os("socket: nonblocking", e))?;
        let _ = stream.set_nodelay(true);
        Ok(SocketSend { stream, peer, sent: 0 })
    }
}

impl SendConn for SocketSend {
    fn try_send(&mut self, src: Region, tag: u32) -> Result<bool> {
        let mut header = [0u8; 8];
        header[..4].copy_from_slice(&(src.len() as u32).to_le_bytes());
        header[4..].copy_from_slice(&tag.to_le_bytes());
        // SAFETY: the schedule does not write `src` until this send completes.
        let body = unsafe { src.as_slice() };
        let total = 8 + body.len();
        while self.sent < total {
            let r = if self.sent < 8 {
                self.stream.write(&header[self.sent..])
            } else {
                self.stream.write(&body[self.sent - 8..])
            };
            match r {
                Ok(0) => return Err(lost(self.peer, "closed")),
                Ok(n) => self.sent += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(lost(self.peer, e)),
            }
        }
        self.sent = 0;
        Ok(true)
    }
    fn check(&mut self) -> Result<()> {
        match self.stream.take_error() {
            Ok(None) => Ok(()),
            Ok(Some(e)) | Err(e) => Err(lost(self.peer, e)),
        }
    }
    fn kind(&self) -> Kind {
        Kind::Socket
    }
}

pub struct SocketRecv {
    stream: TcpStream,
    peer: usize,
    header: [u8; 8],
    got: usize,
    body: Vec<u8>,
}

impl SocketRecv {
    pub fn new(stream: TcpStream, peer: usize, slice: usize) -> Result<SocketRecv> {
        stream.set_nonblocking(true).map_err(|e| Error::os("socket: nonblocking", e))?;
        let _ = stream.set_nodelay(true);
        Ok(SocketRecv { stream, peer, header: [0; 8], got: 0, body: Vec::with_capacity(slice) })
    }

    fn read_some(&mut self, want_total: usize) -> Result<bool> {
        while self.got < want_total {
            let r = if self.got < 8 {
                self.stream.read(&mut self.header[self.got..])
            } else {
                let start = self.got - 8;
                self.stream.read(&mut self.body[start..])
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
}

impl RecvConn for SocketRecv {
    fn try_recv(&mut self, len: usize, tag: u32, deliver: &mut dyn FnMut(&[u8])) -> Result<bool> {
        if self.got < 8 {
            if !self.read_some(8)? {
                return Ok(false);
            }
            let got_len = u32::from_le_bytes([self.header[0], self.header[1], self.header[2], self.header[3]]) as usize;
            let got_tag = u32::from_le_bytes([self.header[4], self.header[5], self.header[6], self.header[7]]);
            if got_len != len || got_tag != tag {
                return Err(Error::invalid_usage(format!(
                    "rank {} sent a message of {got_len} bytes for operation {got_tag:#010x} while this rank expected \
                     {len} bytes for operation {tag:#010x}: the ranks issued different operations", self.peer)));
            }
            self.body.resize(len, 0);
        }
        if !self.read_some(8 + len)? {
            return Ok(false);
        }
        deliver(&self.body[..len]);
        self.got = 0;
        Ok(true)
    }
    fn check(&mut self) -> Result<()> {
        match self.stream.take_error() {
            Ok(None) => Ok(()),
            Ok(Some(e)) | Err(e) => Err(lost(self.peer, e)),
        }
    }
    fn kind(&self) -> Kind {
        Kind::Socket
    }
}
