//! The target's side of one-sided operations: each peer's connection served on a thread of
//! its own (or on the service's reader) that writes puts into this rank's windows and counts
//! signals ([`Inner::serve`]), and what waits learn when a connection ends.

use std::net::{Shutdown, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard, Weak};
use std::time::Instant;

use super::{stream, Inner, SignalKey, State, CLOSED, WARN_AFTER};
use crate::api::mem::{self, Lookup};
use crate::device::cuda::Stream;
use crate::device::host::{self, Region};
use crate::error::{Error, Result};
use crate::transport::rma::{self as wire, Frame, OP_PUT};

impl Inner {
    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `own_thread`: the caller is a thread of this connection's own (the bootstrap service's
    /// reader), which serves it; otherwise one is started for it.
    pub(super) fn accept(self: &Arc<Inner>, from: u32, stream: TcpStream, own_thread: bool) {
        if self.closed.load(Ordering::Acquire) {
            return;
        }
        let id = {
            let mut st = self.lock();
            st.accepted += 1;
            let id = st.accepted;
            if let Ok(copy) = stream.try_clone() {
                st.incoming.push((id, copy));
            }
            id
        };
        let me = self.clone();
        let work = move || {
            crate::debug::set_rank(me.comm.1 as i32);
            // Its copies into windows must not fail, nor break, a graph the application
            // captures meanwhile (`relax_capture_mode`).
            crate::device::cuda::relax_capture_mode();
            let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| me.serve(from, stream)));
            // Its descriptor goes with it (each window a peer asks about opens one).
            me.lock().incoming.retain(|(i, _)| *i != id);
            if let Err(p) = served {
                me.fail(Error::internal(format!("one-sided operations from rank {from}: panic: {}",
                                                crate::abi::panic_message(&*p))));
            }
        };
        if own_thread {
            return work();
        }
        #[cfg(test)]
        let spawned = match tests::NO_THREADS.get() {
            true => Err(std::io::Error::from_raw_os_error(libc::EAGAIN)),
            false => std::thread::Builder::new().name("nccl-rs-rma".into()).spawn(work),
        };
        #[cfg(not(test))]
        let spawned = std::thread::Builder::new().name("nccl-rs-rma".into()).spawn(work);
        if let Err(e) = spawned {
            // The connection is closed (it went with `work`): the sender's next writes fail.
            // Nothing more comes from `from` here, so what waits for it must not wait on.
            self.lock().incoming.retain(|(i, _)| *i != id);
            self.lost(from, Error::os(format!("one-sided operations from rank {from}: spawn a thread"), e));
        }
    }

    /// `from`'s connection could not be read (`e`): sends, receives and signals from it end in
    /// `e`, as if it had closed the connection, and the communicator fails.
    pub(super) fn lost(&self, from: u32, e: Error) {
        let mut st = self.lock();
        st.p2p_ended.entry(from).or_insert_with(|| e.msg.clone());
        st.ended.entry(from).or_insert_with(|| Some(e.clone()));
        drop(st);
        self.changed.notify_all();
        self.fail(e);
    }

    /// Read one sender's operations until it closes the connection.
    pub(super) fn serve(&self, from: u32, mut s: TcpStream) {
        // A connection that asks for windows (`OP_WINDOW`) carries nothing else: its end says
        // nothing of the sender. Nor does one for sends and receives (`OP_P2P`): its end is
        // told to their waits.
        let mut asks = false;
        let mut p2p = false;
        let mut bounce = Vec::new();
        let ended = loop {
            let frame = match wire::next(&mut s) {
                Ok(Some(f)) => f,
                Ok(None) => break None,
                Err(e) => break Some(e),
            };
            if frame.op == wire::OP_WINDOW {
                asks = true;
                let info = self.window_info(from, frame.window);
                match wire::send_info(&mut s, &info) {
                    Ok(()) => continue,
                    Err(e) => break Some(e),
                }
            }
            if frame.op == wire::OP_P2P {
                p2p = true;
                match wire::receive_vec(&mut s, frame.len) {
                    Ok(bytes) => {
                        self.post(from, &frame, bytes);
                        continue;
                    }
                    Err(e) => break Some(e),
                }
            }
            if frame.op == OP_PUT {
                if let Err(e) = self.land(from, &frame, &mut s, &mut bounce) {
                    // The sender's later writes fail: the connection is closed below.
                    if !self.closed.load(Ordering::Acquire) {
                        self.fail(e);
                    }
                    break None;
                }
            }
            self.count((frame.ctx, frame.sig, from));
        };
        let _ = s.shutdown(Shutdown::Both);
        if self.closed.load(Ordering::Acquire) || asks {
            return;
        }
        if p2p {
            let why = ended.map_or_else(|| CLOSED.to_string(), |e| e.msg);
            self.lock().p2p_ended.insert(from, why);
            self.changed.notify_all();
            return;
        }
        let why = ended.as_ref().map_or_else(|| CLOSED.to_string(), |e| e.msg.clone());
        self.lock().ended.insert(from, ended);
        self.changed.notify_all();
        self.release_waits(|k| k.2 == from, &Error::remote(format!(
            "rank {}: a stream waits for signals that rank {from} will not send: {why}", self.comm.1)));
    }

    /// One more signal `key` arrived: counted, and written where streams wait for it.
    pub(super) fn count(&self, key: SignalKey) {
        let mut st = self.lock();
        let n = st.arrived.entry(key).or_insert(0);
        *n += 1;
        let n = *n;
        if let (Some(words), Some(i)) = (st.words, self.word_of(key)) {
            words.word(i).store(n as u32, Ordering::Release);
        }
        drop(st);
        self.changed.notify_all();
    }

    /// The word of signal `key` among `State::words`.
    pub(super) fn word_of(&self, (ctx, sig, from): SignalKey) -> Option<usize> {
        let (_, nsig, nranks) = self.shape;
        let i = ((ctx as usize) * nsig as usize + sig as usize) * nranks + from as usize;
        (i < self.words_len()).then_some(i)
    }

    pub(super) fn words_len(&self) -> usize {
        let (nctx, nsig, nranks) = self.shape;
        nctx as usize * nsig as usize * nranks
    }

    /// Streams waiting for signals that `which` selects and that have not all come are let
    /// go (their word set to what they wait for), and the communicator's asynchronous error
    /// says why: what they read may not have landed.
    pub(super) fn release_waits(&self, which: impl Fn(&SignalKey) -> bool, e: &Error) {
        let st = self.lock();
        let Some(words) = st.words else { return };
        let stuck: Vec<(SignalKey, u64)> = st.pending.iter()
            .filter(|(k, p)| which(k) && st.arrived.get(k).copied().unwrap_or(0) < p.want)
            .map(|(k, p)| (*k, p.want)).collect();
        drop(st);
        if stuck.is_empty() {
            return;
        }
        // The error before the streams go: a program that synchronises its stream, then asks
        // ncclCommGetAsyncError, must find it (the other order lost that race now and then:
        // the stream past its wait, the error not yet set).
        match self.owner.get().and_then(Weak::upgrade) {
            Some(comm) => comm.set_async_error(e),
            None => crate::warn!("{}", e.msg),
        }
        let mut st = self.lock();
        for (k, want) in &stuck {
            if let Some(i) = self.word_of(*k) {
                words.word(i).store(*want as u32, Ordering::Release);
            }
            st.pending.remove(k);
        }
    }

    /// `dst` <- `src` where either may be device memory (CUDA mode: on the landing stream,
    /// waited for; a put's bytes are in place before its signal counts).
    pub(super) fn land_bytes(&self, dst: Region, src: Region) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        if !stream::needs_device_copy(&[dst, src])? {
            host::copy(dst, src);
            return Ok(());
        }
        let ctx = crate::device::cuda::Context::primary(self.cuda_dev)?;
        // Readers of several senders share the stream: its context current on each of them.
        ctx.make_current()?;
        let mut landing = self.landing.lock().unwrap_or_else(|p| p.into_inner());
        if landing.is_none() {
            *landing = Some(Stream::new(ctx)?);
        }
        let s = landing.as_ref().ok_or_else(|| Error::internal("no landing stream"))?;
        s.copy(dst, src)?;
        s.synchronize()
    }

    /// What this rank says of its window #`ordinal` to `from`, a rank of its host that would
    /// write it directly (waiting for this rank to register it): its CUDA IPC handle where it is
    /// device memory the driver shares that way, else no.
    pub(super) fn window_info(&self, from: u32, ordinal: u64) -> wire::WindowInfo {
        let Lookup::Live(w) = self.await_window(ordinal, || format!("rank {from} asks for window #{ordinal}")) else {
            return wire::WindowInfo::NO;
        };
        let shared = || -> Result<wire::WindowInfo> {
            if !matches!(crate::device::cuda::classify(w.buff.addr())?, crate::device::cuda::PtrKind::Device { .. }) {
                return Ok(wire::WindowInfo::NO);
            }
            let (base, _) = crate::device::cuda::allocation_of(w.buff.addr())?;
            let handle = crate::device::cuda::IpcHandle::of(base as *mut std::ffi::c_void)?;
            Ok(wire::WindowInfo { ok: true, handle: handle.bytes, off: (w.buff.addr() - base) as u64, size: w.size as u64,
                                  addr: w.buff.addr() as u64 })
        };
        match crate::device::mode::current() {
            crate::device::mode::Mode::Host => wire::WindowInfo::NO,
            _ => shared().unwrap_or_else(|e| {
                crate::info!(P2P, "rank {}: window #{ordinal} is not shared with CUDA IPC ({})", self.comm.1, e.msg);
                wire::WindowInfo::NO
            }),
        }
    }

    /// This rank's window #`ordinal`, waiting while this rank has not registered it yet (and
    /// saying so at WARN after 10 s: `what` a peer wants of it), until the communicator closes.
    pub(super) fn await_window(&self, ordinal: u64, what: impl FnOnce() -> String) -> Lookup {
        let started = Instant::now();
        let mut what = Some(what);
        mem::window_by_ordinal(self.comm, ordinal, || {
            if started.elapsed() >= WARN_AFTER {
                if let Some(what) = what.take() {
                    crate::warn!("rank {}: {} of this rank, which this rank has not registered \
                                  (ncclCommWindowRegister is collective: every rank registers each window)",
                                 self.comm.1, what());
                }
            }
            !self.closed.load(Ordering::Acquire)
        })
    }

    /// Write a put's bytes into the window it names (waiting for this rank to register it);
    /// `bounce`: the connection's buffer for device windows, kept across its puts.
    pub(super) fn land(&self, from: u32, f: &Frame, s: &mut TcpStream, bounce: &mut Vec<u8>) -> Result<()> {
        let rank = self.comm.1;
        let w = match self.await_window(f.window, || format!("rank {from} puts into window #{}", f.window)) {
            Lookup::Live(w) => w,
            Lookup::Gone => return Err(Error::remote(format!(
                "rank {from} put {} bytes into window #{} of rank {rank}, which rank {rank} has deregistered",
                f.len, f.window))),
            Lookup::NotYet => return Err(Error::invalid_usage("the communicator was closed")),
        };
        let fits = f.offset.checked_add(f.len).is_some_and(|end| end <= w.size as u64);
        if !fits {
            return Err(Error::remote(format!(
                "rank {from} put {} bytes at offset {} into window #{} of rank {rank}, which is {} bytes: ncclPutSignal \
                 must stay inside the target's window", f.len, f.offset, f.window, w.size)));
        }
        let dst = Region::user(w.buff, f.offset as usize, f.len as usize);
        let landed = if stream::needs_device_copy(&[dst])? {
            self.receive_to_device(s, dst, bounce)
        } else {
            wire::receive_into(s, dst)
        };
        landed.map_err(|e| e.context(format!("rank {rank}: a put from rank {from}")))
    }

    /// A put's bytes into device memory: read in pieces through `buf`, each copied there.
    pub(super) fn receive_to_device(&self, s: &mut TcpStream, dst: Region, buf: &mut Vec<u8>) -> Result<()> {
        const PIECE: usize = 1 << 20;
        if buf.len() < dst.len().min(PIECE) {
            buf.resize(dst.len().min(PIECE), 0);
        }
        let mut at = 0;
        while at < dst.len() {
            let n = (dst.len() - at).min(PIECE);
            wire::receive_into(s, Region::owned(&mut buf[..n]))?;
            self.land_bytes(dst.sub(at, n), Region::owned(&mut buf[..n]))?;
            at += n;
        }
        Ok(())
    }

    pub(super) fn fail(&self, e: Error) {
        match self.owner.get().and_then(Weak::upgrade) {
            // Said at WARN once, as the communicator's error, which ends the waits (`Rma::failed`).
            Some(comm) => comm.set_async_error(&e),
            None => {
                crate::warn!("{}", e.msg);
                self.fail_quietly(&e);
            }
        }
    }

    /// Waits on the host return `e`; streams that wait are let go.
    pub(super) fn fail_quietly(&self, e: &Error) {
        let mut st = self.lock();
        if st.failed.is_none() {
            st.failed = Some(e.clone());
        }
        drop(st);
        self.changed.notify_all();
        self.release_waits(|_| true, e);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::rma::Rma;
    use std::io::Read;
    use std::time::Duration;

    thread_local! {
        /// `Inner::accept` on this thread finds no thread to start.
        pub static NO_THREADS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

    /// A connection that no thread can be started for is closed, and what waits for its
    /// sender ends, naming why, instead of waiting for ever for messages nobody reads.
    #[test]
    fn a_connection_no_thread_can_read_ends_what_waits_for_its_sender() {
        let rma = Rma::new(1, 0, 3, -1, (1, 1));
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut peer = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mine, _) = l.accept().unwrap();
        assert!(rma.p2p_lost(2).is_none());
        NO_THREADS.set(true);
        (rma.handler())(2, mine, false);
        NO_THREADS.set(false);
        let lost = rma.p2p_lost(2).expect("sends and receives from rank 2 end");
        assert!(lost.msg.contains("spawn a thread") && lost.msg.contains("ulimit -u"), "{}", lost.msg);
        assert!(rma.p2p_lost(1).is_none(), "rank 1 is not concerned");
        assert!(rma.inner.lock().ended.contains_key(&2));
        assert!(rma.inner.lock().incoming.is_empty());
        peer.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        assert_eq!(peer.read(&mut [0u8; 8]).unwrap(), 0, "the sender sees its connection closed");
    }

    /// On a thread of its own (the service's reader), a connection is served there: no thread
    /// is started for it.
    #[test]
    fn a_connection_on_its_own_thread_is_served_there() {
        let rma = Rma::new(1, 0, 3, -1, (1, 1));
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let peer = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mine, _) = l.accept().unwrap();
        drop(peer); // served until the sender closes it: here at once
        NO_THREADS.set(true);
        (rma.handler())(2, mine, true);
        NO_THREADS.set(false);
        let lost = rma.p2p_lost(2);
        assert!(lost.is_none(), "read to its end, not refused: {lost:?}");
        assert!(rma.inner.lock().ended.get(&2).is_some_and(Option::is_none), "ended by its sender, without error");
    }
}
