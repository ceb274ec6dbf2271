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
/// CUDA mode: asks for a window's CUDA IPC handle (a [`WindowInfo`] answers on the same
/// connection, which carries nothing else); counts no signal.
pub const OP_WINDOW: u32 = 3;
/// CUDA mode: a message of a send or receive between ranks of one host (`transport::ipc`) on a
/// connection of its own: its kind in `ctx`, the pair's message number in `window`, a code in
/// `offset`, and `len` bytes of payload; counts no signal.
pub const OP_P2P: u32 = 4;
const HEADER_BYTES: usize = 40;
const INFO_BYTES: usize = 4 + 4 + 64 + 8 + 8 + 8;

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
    /// The signal of this put alone, without its bytes (what follows a put written directly).
    pub fn signal_only(&self) -> Frame {
        Frame { op: OP_SIGNAL, window: 0, offset: 0, len: 0, ..*self }
    }

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
        let carries_bytes = matches!(f.op, OP_PUT | OP_P2P);
        if !matches!(f.op, OP_PUT | OP_SIGNAL | OP_WINDOW | OP_P2P) || (!carries_bytes && f.len != 0) {
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
    // SAFETY: `dst` lies inside a window this rank registered (the caller checked the bounds);
    // NCCL's contract keeps a window's memory valid and writable by the library until it is
    // deregistered, and what the target reads there before the put's signal is undefined.
    let bytes = unsafe { dst.as_mut_slice() };
    s.read_exact(bytes).map_err(|e| Error::os("one-sided operation: receive", e))
}

/// `len` bytes of a message's payload, into memory of their own; a length the system cannot
/// hold is refused, not allocated.
pub fn receive_vec(s: &mut TcpStream, len: u64) -> Result<Vec<u8>> {
    let n = usize::try_from(len).map_err(|_| Error::system(format!("a message of {len} bytes")))?;
    let mut v = crate::device::host::zeroed(n, &|| "a point-to-point message".to_string())?;
    s.read_exact(&mut v).map_err(|e| Error::os("point-to-point message: receive", e))?;
    Ok(v)
}

/// What a target says of its window (`OP_WINDOW`): whether a peer of its host may write it
/// directly, the CUDA IPC handle of its allocation, where the window starts in it, the
/// window's size and its address in the target's process (for ranks of that process).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowInfo {
    pub ok: bool,
    pub handle: [u8; 64],
    pub off: u64,
    pub size: u64,
    pub addr: u64,
}

impl WindowInfo {
    pub const NO: WindowInfo = WindowInfo { ok: false, handle: [0; 64], off: 0, size: 0, addr: 0 };

    fn encode(&self) -> [u8; INFO_BYTES] {
        let mut b = [0u8; INFO_BYTES];
        b[0] = self.ok as u8;
        b[8..72].copy_from_slice(&self.handle);
        b[72..80].copy_from_slice(&self.off.to_le_bytes());
        b[80..88].copy_from_slice(&self.size.to_le_bytes());
        b[88..96].copy_from_slice(&self.addr.to_le_bytes());
        b
    }

    fn decode(b: &[u8; INFO_BYTES]) -> WindowInfo {
        let u64_at = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        let mut handle = [0u8; 64];
        handle.copy_from_slice(&b[8..72]);
        WindowInfo { ok: b[0] == 1, handle, off: u64_at(72), size: u64_at(80), addr: u64_at(88) }
    }
}

pub fn send_info(s: &mut TcpStream, info: &WindowInfo) -> Result<()> {
    s.write_all(&info.encode()).map_err(|e| Error::os("one-sided operations: window answer", e))
}

pub fn read_info(s: &mut TcpStream) -> Result<WindowInfo> {
    let mut b = [0u8; INFO_BYTES];
    s.read_exact(&mut b).map_err(|e| Error::os("one-sided operations: window answer", e))?;
    Ok(WindowInfo::decode(&b))
}

/// A window of a rank of this host as this process writes it: the target's allocation mapped
/// through CUDA IPC, or its address where the target is a rank of this process. Open for the
/// communicator's life (a mapping keeps the allocation; the target freeing it meanwhile is the
/// case `ipc` describes).
pub struct PeerWindow {
    base: usize,
    size: usize,
    _mapping: Option<crate::device::cuda::IpcMapping>,
}

impl PeerWindow {
    /// Map what `info` describes (the current context's device must reach the target's).
    pub fn open(info: &WindowInfo, same_process: bool) -> Result<PeerWindow> {
        let size = info.size as usize;
        if same_process {
            return Ok(PeerWindow { base: info.addr as usize, size, _mapping: None });
        }
        let m = crate::device::cuda::IpcMapping::open(&crate::device::cuda::IpcHandle { bytes: info.handle })?;
        Ok(PeerWindow { base: m.addr() + info.off as usize, size, _mapping: Some(m) })
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// Where the window starts in this process (a device address).
    pub fn addr(&self) -> usize {
        self.base
    }

    /// `len` bytes at `offset` of the window, None past its end.
    pub fn region(&self, offset: usize, len: usize) -> Option<Region> {
        if offset.checked_add(len)? > self.size {
            return None;
        }
        // SAFETY: the window's memory is mapped here for `size` bytes while `self` lives (the
        // target keeps it registered, NCCL's contract for a put); it is only reached through
        // device copies on a stream.
        let p = unsafe { crate::device::host::UserPtr::new(self.base as *mut u8) };
        Some(Region::user(p, offset, len))
    }
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
        let ask = Frame { op: OP_WINDOW, len: 0, ..f };
        assert_eq!(Frame::decode(&ask.encode()).unwrap(), ask);
        let message = Frame { op: OP_P2P, ..f };
        assert_eq!(Frame::decode(&message.encode()).unwrap(), message, "a point-to-point message carries bytes");
    }

    #[test]
    fn window_answers_round_trip() {
        let mut handle = [0u8; 64];
        handle.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8 ^ 0x5a);
        let info = WindowInfo { ok: true, handle, off: 4096, size: 1 << 33, addr: 0x7f00_0000_1000 };
        assert_eq!(WindowInfo::decode(&info.encode()), info);
        assert!(!WindowInfo::decode(&WindowInfo::NO.encode()).ok);
    }
}
