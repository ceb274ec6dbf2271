//! Connections that have not yet said who they are. Each is read on a thread of its own, so a
//! silent one delays nobody; at most [`MAX`] wait at once, and when a flood of silent or
//! half-open connections fills the list, the oldest is shut down to make room — a real rank,
//! which speaks as soon as it connects, always gets in.

use std::collections::VecDeque;
use std::net::{Shutdown, TcpStream};
use std::sync::Mutex;

pub const MAX: usize = 128;

#[derive(Default)]
pub struct Pending {
    conns: Mutex<(u64, VecDeque<(u64, TcpStream)>)>,
}

impl Pending {
    /// Track `s` (through a clone of its socket); returns its ticket, or None if it cannot be
    /// tracked: no descriptor for the clone. (Then the caller reads it all the same: dropping
    /// it lost what a peer sent, and a rank waited for it for ever.)
    pub fn admit(&self, s: &TcpStream) -> Option<u64> {
        let clone = crate::transport::fds::with_room(|| s.try_clone()).ok()?;
        let mut g = self.conns.lock().unwrap_or_else(|p| p.into_inner());
        if g.1.len() >= MAX {
            if let Some((_, oldest)) = g.1.pop_front() {
                let _ = oldest.shutdown(Shutdown::Both); // its reader sees EOF and gives up
            }
        }
        g.0 += 1;
        let id = g.0;
        g.1.push_back((id, clone));
        Some(id)
    }

    /// The connection with this ticket has been read (or given up on).
    pub fn done(&self, id: u64) {
        let mut g = self.conns.lock().unwrap_or_else(|p| p.into_inner());
        g.1.retain(|(i, _)| *i != id);
    }

    pub fn len(&self) -> usize {
        self.conns.lock().unwrap_or_else(|p| p.into_inner()).1.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_makes_room() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let p = Pending::default();
        let mut held = Vec::new();
        let mut first = None;
        for i in 0..MAX + 1 {
            let c = TcpStream::connect(addr).unwrap();
            let (s, _) = l.accept().unwrap();
            let id = p.admit(&s).unwrap();
            if i == 0 {
                first = Some((id, c.try_clone().unwrap()));
            }
            held.push((c, s));
        }
        assert_eq!(p.len(), MAX);
        // The first connection was shut down: its client reads EOF.
        let (_, mut c) = first.unwrap();
        c.set_read_timeout(Some(std::time::Duration::from_secs(5))).unwrap();
        let mut b = [0u8; 1];
        assert_eq!(std::io::Read::read(&mut c, &mut b).unwrap(), 0);
    }
}
