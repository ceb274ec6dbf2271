//! CUDA mode: the mailboxes of sends and receives between ranks of one host
//! (`transport::ipc::run_p2p`). A sender's record (where its buffer is), the receiver's answer
//! and the bytes of a message that is staged after all travel on a connection of their own per
//! ordered pair (the one-sided sender writes a put to its connection in parts), and the
//! target's reader files each by (sender, kind, message number) until it is taken. So the
//! order in which two ranks group their calls never mixes one kind of message up with another.

use std::time::Duration;

use super::{on_connection, Inner, Rma};
use crate::comm::Comm;
use crate::device::host::Region;
use crate::error::{Error, Result};
use crate::transport::rma::{self as wire, Frame, OP_P2P};

/// The kinds of messages: a sender's record, a receiver's answer, a staged message's bytes.
pub const RECORD: u32 = 1;
pub const ANSWER: u32 = 2;
pub const DATA: u32 = 3;

/// One message as it arrived: its code and payload.
#[derive(Clone, Debug, Default)]
pub struct Message {
    pub code: u64,
    pub bytes: Vec<u8>,
}

impl Inner {
    /// The reader filed `frame`'s message from `from` (see the module's notes).
    pub(super) fn post(&self, from: u32, frame: &Frame, bytes: Vec<u8>) {
        let mut st = self.lock();
        st.p2p.insert((from, frame.ctx, frame.window), Message { code: frame.offset, bytes });
        st.p2p_arrived += 1;
        drop(st);
        self.changed.notify_all();
    }
}

impl Rma {
    /// Sends `peer` message `m` of `kind` with `code` and the bytes of `payload` (host memory)
    /// after each other.
    pub fn p2p_send(&self, comm: &Comm, peer: usize, kind: u32, m: u64, code: u64, payload: &[Region]) -> Result<()> {
        let ready = comm.ready()?;
        let len = payload.iter().map(|r| r.len() as u64).sum();
        let frame = Frame { op: OP_P2P, ctx: kind, sig: 0, window: m, offset: code, len };
        on_connection(comm, ready, &self.inner.p2p_links, peer, ("sends and receives", "a point-to-point message"), |s| {
            wire::send(s, &frame, Region::EMPTY)?;
            payload.iter().try_for_each(|r| wire::send_bytes(s, *r))
        })
    }

    /// Message `m` of `kind` from `from`, if it has come (it is taken).
    pub fn p2p_take(&self, from: usize, kind: u32, m: u64) -> Option<Message> {
        self.inner.lock().p2p.remove(&(from as u32, kind, m))
    }

    /// How many messages have come so far (for [`Rma::p2p_wait`]).
    pub fn p2p_arrived(&self) -> u64 {
        self.inner.lock().p2p_arrived
    }

    /// Returns once more than `seen` messages have come, or after `timeout`, or when the
    /// communicator closes.
    pub fn p2p_wait(&self, seen: u64, timeout: Duration) {
        let st = self.inner.lock();
        if st.p2p_arrived != seen || self.inner.closed.load(std::sync::atomic::Ordering::Acquire) {
            return;
        }
        drop(self.inner.changed.wait_timeout(st, timeout));
    }

    /// Why `from`'s connection for sends and receives ended, if it did (or this communicator
    /// closed): nothing more comes from it.
    pub fn p2p_lost(&self, from: usize) -> Option<Error> {
        if self.inner.closed.load(std::sync::atomic::Ordering::Acquire) {
            return Some(Error::invalid_usage("the communicator was destroyed or aborted"));
        }
        let why = self.inner.lock().p2p_ended.get(&(from as u32)).cloned()?;
        Some(Error::remote(format!("rank {from}'s connection for sends and receives ended: {why}")))
    }
}
