//! The wire of one-sided operations (`ncclPutSignal`, `ncclSignal`): one TCP connection per
//! ordered pair of ranks, opened through the target's bootstrap service on the first operation
//! and read there by a thread of its own, so a put lands in the target's window without the
//! target making any call. One connection per pair keeps NCCL's order: operations to the same
//! peer are delivered, data and signals alike, in program order.
//!
//! Each operation is a fixed header ([`Frame`]) and, for a put, its bytes, which the reader
//! writes straight into the window.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;

use crate::device::host::Region;
use crate::error::{Error, Result};

pub const OP_PUT: u32 = 1;
pub const OP_SIGNAL: u32 = 2;
const HEADER_BYTES: usize = 40;

/// One operation's header: a put carries `len` bytes for offset `offset` of the window the
/// sender registered `window`-th on the communicator (windows are registered collectively, so
/// the same ordinal names the same window on every rank); both kinds then add one to the
/// target's signal (`ctx`, `sig`) from the sender.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Frame {
    pub op: u32,
    pub ctx: u32,
    pub sig: u32,
    pub window: u64,
    pub offset: u64,
    pub len: u64,
}

impl Frame {
    fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0..4].copy_from_slice(&self.op.to_le_bytes());
        b[4..8].copy_from_slice(&self.ctx.to_le_bytes());
        b[8..12].copy_from_slice(&self.sig.to_le_bytes());
        b[16..24].copy_from_slice(&self.window.to_le_bytes());
        b[24..32].copy_from_slice(&self.offset.to_le_bytes());
        b[32..40].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    fn decode(b: &[u8; HEADER_BYTES]) -> Result<Frame> {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        let f = Frame { op: u32_at(0), ctx: u32_at(4), sig: u32_at(8), window: u64_at(16), offset: u64_at(24), len: u64_at(32) };
        if f.op != OP_PUT && f.op != OP_SIGNAL || (f.op == OP_SIGNAL && f.len != 0) {
            return Err(Error::system(format!("one-sided operation with a bad header (op {}, {} bytes)", f.op, f.len)));
        }
        Ok(f)
    }
}

/// Send one operation: its header, then `data` (a put's source, or its first part; empty for
/// a signal).
pub fn send(s: &mut TcpStream, frame: &Frame, data: Region) -> Result<()> {
    s.write_all(&frame.encode()).map_err(|e| Error::os("one-sided operation: send", e))?;
    send_bytes(s, data)
}

/// Send more of a put's bytes, after its header (a put sent in parts).
pub fn send_bytes(s: &mut TcpStream, data: Region) -> Result<()> {
    if data.is_empty() {
        return Ok(());
    }
    // SAFETY: `data` is host memory (a put's source in pageable memory, or pinned staging)
    // that stays readable until this call returns, once the bytes are written to the socket.
    let bytes = unsafe { data.as_slice() };
    s.write_all(bytes).map_err(|e| Error::os("one-sided operation: send", e))
}

/// The next operation's header, or None when the sender closed the connection between
/// operations (its communicator was destroyed).
pub fn next(s: &mut TcpStream) -> Result<Option<Frame>> {
    let mut b = [0u8; HEADER_BYTES];
    let mut got = 0;
    while got < HEADER_BYTES {
        match s.read(&mut b[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(Error::remote("the connection closed in the middle of a one-sided operation")),
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::os("one-sided operation: receive", e)),
        }
    }
    Frame::decode(&b).map(Some)
}

/// Read a put's bytes straight into `dst` (part of a registered window).
pub fn receive_into(s: &mut TcpStream, dst: Region) -> Result<()> {
    if dst.is_empty() {
        return Ok(());
    }
    // SAFETY: `dst` lies inside a window this rank registered (the caller checked the bounds);
    // NCCL's contract keeps a window's memory valid and writable by the library until it is
    // deregistered, and what the target reads there before the put's signal is undefined.
    let bytes = unsafe { std::slice::from_raw_parts_mut(dst.addr() as *mut u8, dst.len()) };
    s.read_exact(bytes).map_err(|e| Error::os("one-sided operation: receive", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_garbage_is_refused() {
        let f = Frame { op: OP_PUT, ctx: 3, sig: 7, window: 9, offset: 1 << 40, len: 4096 };
        assert_eq!(Frame::decode(&f.encode()).unwrap(), f);
        let bad = Frame { op: 9, ..f };
        assert!(Frame::decode(&bad.encode()).is_err(), "an unknown op is refused");
        let signal_with_data = Frame { op: OP_SIGNAL, ..f };
        assert!(Frame::decode(&signal_with_data.encode()).is_err(), "a signal carrying bytes is refused");
    }
}
