//! Framing of every bootstrap message: a 4-byte length, then the payload, read with a bounded
//! length and a deadline so garbage, half-open or hostile connections cannot stall or crash us.
//! Payloads are built with [`Writer`] and parsed with [`Reader`], which never panics.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use crate::error::{Error, Result};

/// No bootstrap payload is larger (a peer table of thousands of ranks fits easily).
pub const MAX_FRAME: usize = 16 << 20;

/// What a frame past [`MAX_FRAME`] says of itself (callers that know who should have sent it
/// look for these words to say more).
pub const NOT_OURS: &str = "not a message of nccl-rs";

pub fn write_frame(s: &mut TcpStream, payload: &[u8]) -> Result<()> {
    let len = u32::try_from(payload.len()).map_err(|_| Error::internal("bootstrap frame too large"))?;
    let mut buf = Vec::with_capacity(4 + payload.len());
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(payload);
    s.write_all(&buf).map_err(|e| Error::os("bootstrap: send", e))
}

/// Read one frame, waiting at most `timeout` for each read.
pub fn read_frame(s: &mut TcpStream, timeout: Duration) -> Result<Vec<u8>> {
    s.set_read_timeout(Some(timeout.max(Duration::from_millis(1))))
        .map_err(|e| Error::os("bootstrap: set timeout", e))?;
    let mut len = [0u8; 4];
    s.read_exact(&mut len).map_err(|e| Error::os("bootstrap: receive", e))?;
    let first = len;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        // Printable bytes are another program's words ("HTTP" from a web server or a proxy
        // at that address): said as they are.
        let text = if first.iter().all(|b| b.is_ascii_graphic() || *b == b' ') {
            format!(", its first bytes \"{}\"", String::from_utf8_lossy(&first))
        } else {
            String::new()
        };
        return Err(Error::system(format!("bootstrap: frame of {len} bytes exceeds the limit{text}: {NOT_OURS}")));
    }
    let mut buf = vec![0u8; len];
    s.read_exact(&mut buf).map_err(|e| Error::os("bootstrap: receive", e))?;
    Ok(buf)
}

/// Wait until `s` has data (or the peer closed), checking `abort` every 100 ms.
pub fn wait_readable(s: &mut TcpStream, deadline: std::time::Instant, abort: &std::sync::atomic::AtomicBool) -> Result<()> {
    use std::sync::atomic::Ordering;
    loop {
        if abort.load(Ordering::Acquire) {
            return Err(Error::invalid_usage("communicator aborted during init"));
        }
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(Error::remote("timed out"));
        }
        s.set_read_timeout(Some(left.min(Duration::from_millis(100))))
            .map_err(|e| Error::os("bootstrap: set timeout", e))?;
        match s.peek(&mut [0u8; 1]) {
            Ok(_) => return Ok(()),
            // (Interrupted: a signal came to this thread; the program's handler has run.)
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                                | std::io::ErrorKind::Interrupted) => {}
            Err(e) => return Err(Error::os("bootstrap: receive", e)),
        }
    }
}

#[derive(Default)]
pub struct Writer {
    pub buf: Vec<u8>,
}

impl Writer {
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.u32(v.len() as u32);
        self.buf.extend_from_slice(v);
        self
    }
    pub fn str(&mut self, v: &str) -> &mut Self {
        self.bytes(v.as_bytes())
    }
}

pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Reader<'a> {
        Reader { buf, pos: 0 }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        match end {
            Some(e) => {
                let s = &self.buf[self.pos..e];
                self.pos = e;
                Ok(s)
            }
            None => Err(Error::system("bootstrap: malformed message (truncated)")),
        }
    }
    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    pub fn u32(&mut self) -> Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    pub fn u64(&mut self) -> Result<u64> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    pub fn bytes(&mut self) -> Result<&'a [u8]> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    pub fn str(&mut self) -> Result<String> {
        Ok(String::from_utf8_lossy(self.bytes()?).into_owned())
    }
    pub fn done(&self) -> bool {
        self.pos == self.buf.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let mut w = Writer::default();
        w.u8(7).u32(0xdead_beef).u64(42).str("host-a").bytes(&[1, 2, 3]);
        let mut r = Reader::new(&w.buf);
        assert_eq!(r.u8().unwrap(), 7);
        assert_eq!(r.u32().unwrap(), 0xdead_beef);
        assert_eq!(r.u64().unwrap(), 42);
        assert_eq!(r.str().unwrap(), "host-a");
        assert_eq!(r.bytes().unwrap(), &[1, 2, 3]);
        assert!(r.done());
    }

    /// Every prefix and every corruption of a valid message parses to an error or a value,
    /// never a panic (a bounded in-test fuzz loop over the reader).
    #[test]
    fn garbage_never_panics() {
        let mut w = Writer::default();
        w.u8(1).str("abc").u64(9).bytes(&[0; 40]);
        let msg = w.buf.clone();
        let mut seed = 0x1234_5678u64;
        for i in 0..5000 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let mut m = msg.clone();
            m.truncate((seed as usize) % (msg.len() + 1));
            if let Some(b) = m.get_mut(i % msg.len().max(1)) {
                *b ^= (seed >> 8) as u8;
            }
            let mut r = Reader::new(&m);
            let _ = r.u8().and_then(|_| r.str()).and_then(|_| r.u64()).and_then(|_| r.bytes().map(|_| 0));
        }
    }
}
