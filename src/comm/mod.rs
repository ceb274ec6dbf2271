//! The communicator: identity (rank, size, device, host), state, abort flag, asynchronous
//! error, the PreMulSum operators it owns, and — once init has completed — its bootstrap
//! service and its connections to peers.

pub mod handle;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

use crate::api::config::Config;
use crate::bootstrap::{PeerInfo, Service};
use crate::error::{Code, Error, Result};
use crate::transport::Conns;
use crate::types::{DataType, RedOp};

/// What init produced: the peer table, the bootstrap service and the connections.
pub struct Ready {
    pub peers: Vec<PeerInfo>,
    pub service: Service,
    /// Bytes per transport message (the same on every rank: the minimum of all ranks' choice).
    pub slice: usize,
    conns: Mutex<Conns>,
}

impl Ready {
    pub fn new(peers: Vec<PeerInfo>, service: Service, slice: usize) -> Ready {
        let n = peers.len();
        Ready { peers, service, slice, conns: Mutex::new(Conns::new(n)) }
    }
    pub fn conns(&self) -> MutexGuard<'_, Conns> {
        self.conns.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A PreMulSum operator made by `ncclRedOpCreatePreMulSum`.
#[derive(Clone, Copy, Debug)]
pub enum ScalarSource {
    /// Read when the operator was created (ncclScalarHostImmediate).
    Immediate(crate::types::Scalar),
    /// Read when an operation using it runs (ncclScalarDevice; host memory in host mode).
    Pointer(crate::device::host::UserPtr),
}

#[derive(Clone, Copy, Debug)]
pub struct UserOp {
    pub datatype: DataType,
    pub scalar: ScalarSource,
}

pub struct Comm {
    pub rank: usize,
    pub nranks: usize,
    pub cuda_dev: i32,
    pub config: Config,
    /// Identifies the communicator across ranks (derived from the unique id).
    pub hash: u64,
    ready: OnceLock<Ready>,
    /// `ncclSuccess`, `ncclInProgress` while a nonblocking init or operation runs, or the error.
    async_code: AtomicI32,
    async_error: Mutex<Option<Error>>,
    pub abort: AtomicBool,
    pub suspended: AtomicBool,
    /// ncclCommRevoke: operations fail, management calls (destroy, split, shrink) still work.
    pub revoked: AtomicBool,
    /// Splits and shrinks made from this communicator (numbers them alike on every rank).
    pub splits: AtomicU64,
    pub finalized: AtomicBool,
    user_ops: Mutex<HashMap<i32, UserOp>>,
    next_user_op: AtomicI32,
    /// Operations issued, for messages and fingerprints.
    pub seq: AtomicU64,
}

impl Comm {
    pub fn new(rank: usize, nranks: usize, cuda_dev: i32, config: Config, hash: u64) -> Comm {
        Comm {
            rank,
            nranks,
            cuda_dev,
            config,
            hash,
            ready: OnceLock::new(),
            async_code: AtomicI32::new(Code::InProgress as i32),
            async_error: Mutex::new(None),
            abort: AtomicBool::new(false),
            suspended: AtomicBool::new(false),
            revoked: AtomicBool::new(false),
            splits: AtomicU64::new(0),
            finalized: AtomicBool::new(false),
            user_ops: Mutex::new(HashMap::new()),
            next_user_op: AtomicI32::new(crate::types::BuiltinOp::ALL.len() as i32),
            seq: AtomicU64::new(0),
        }
    }

    /// Init finished: the communicator can run operations.
    pub fn set_ready(&self, ready: Ready) {
        let _ = self.ready.set(ready);
        self.async_code.store(Code::Success as i32, Ordering::Release);
    }

    /// Record an error for `ncclCommGetAsyncError` (the first one wins: it is the cause).
    pub fn set_async_error(&self, e: &Error) {
        let mut slot = self.async_error.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            // Errors found in the background (nonblocking init, a failed group) are what
            // ncclGetLastError should show next, as in NCCL.
            crate::warn!("{}", e.msg);
            crate::error::set_last_error(&e.msg);
            *slot = Some(e.clone());
            self.async_code.store(e.code as i32, Ordering::Release);
        }
    }

    pub fn async_code(&self) -> Code {
        Code::from_raw(self.async_code.load(Ordering::Acquire)).unwrap_or(Code::InternalError)
    }

    pub fn async_error(&self) -> Option<Error> {
        self.async_error.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The initialised part, or why the communicator cannot be used now.
    pub fn ready(&self) -> Result<&Ready> {
        if self.abort.load(Ordering::Acquire) {
            return Err(Error::invalid_usage(format!("rank {}: communicator was aborted", self.rank)));
        }
        if self.revoked.load(Ordering::Acquire) {
            return Err(Error::invalid_usage(format!("rank {}: communicator was revoked", self.rank)));
        }
        if let Some(e) = self.async_error() {
            return Err(Error::new(e.code, format!("rank {}: communicator is in error: {}", self.rank, e.msg)));
        }
        if self.suspended.load(Ordering::Acquire) {
            return Err(Error::invalid_usage(format!("rank {}: communicator is suspended (ncclCommResume it)", self.rank)));
        }
        self.ready
            .get()
            .ok_or_else(|| Error::invalid_usage(format!("rank {}: communicator is still initialising", self.rank)))
    }

    /// For split and shrink: allowed on a revoked or failed communicator (that is what
    /// shrinking away dead ranks is for), not on an aborted or uninitialised one.
    pub fn ready_for_management(&self) -> Result<&Ready> {
        if self.abort.load(Ordering::Acquire) {
            return Err(Error::invalid_usage(format!("rank {}: communicator was aborted", self.rank)));
        }
        self.ready
            .get()
            .ok_or_else(|| Error::invalid_usage(format!("rank {}: communicator is still initialising", self.rank)))
    }

    pub fn ready_if_any(&self) -> Option<&Ready> {
        self.ready.get()
    }

    pub fn add_user_op(&self, op: UserOp) -> Result<i32> {
        let id = self.next_user_op.fetch_add(1, Ordering::Relaxed);
        if id < 0 {
            return Err(Error::internal("too many reduction operators created"));
        }
        self.user_ops.lock().unwrap_or_else(|p| p.into_inner()).insert(id, op);
        Ok(id)
    }

    pub fn user_op(&self, id: i32) -> Option<UserOp> {
        self.user_ops.lock().unwrap_or_else(|p| p.into_inner()).get(&id).copied()
    }

    pub fn remove_user_op(&self, id: i32) -> bool {
        self.user_ops.lock().unwrap_or_else(|p| p.into_inner()).remove(&id).is_some()
    }

    /// Describe a peer for messages: "rank 5 (host-b, pid 4242)".
    pub fn describe_peer(&self, peer: usize) -> String {
        match self.ready.get().and_then(|r| r.peers.get(peer)) {
            Some(p) => format!("rank {} ({}, pid {})", peer, p.hostname, p.pid),
            None => format!("rank {peer}"),
        }
    }

    /// The peers that are gone, with why, to name them when an operation fails: same-host
    /// peers by their pid, others by whether their bootstrap service still answers.
    pub fn lost_peers(&self) -> Vec<(usize, String)> {
        let Some(ready) = self.ready.get() else { return Vec::new() };
        let me = &ready.peers[self.rank];
        let timeout = std::time::Duration::from_secs(1);
        std::thread::scope(|s| {
            let probes: Vec<_> = ready.peers.iter().filter(|p| p.rank != self.rank).map(|p| {
                s.spawn(move || {
                    if p.same_host(me) {
                        (!crate::transport::ring::pid_alive(p.pid)).then(|| (p.rank, "its process exited".to_string()))
                    } else {
                        ready.service.ping(p.rank, timeout).err().map(|e| (p.rank, e.msg))
                    }
                })
            }).collect();
            probes.into_iter().filter_map(|h| h.join().ok().flatten()).collect()
        })
    }

    /// Release connections and stop the bootstrap service (destroy/abort).
    pub fn shutdown(&self) {
        if let Some(r) = self.ready.get() {
            r.conns().close_all();
            r.service.stop();
        }
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        self.shutdown();
    }
}


/// A reduction resolved for one operation (built-ins, or a PreMulSum with its scalar read).
pub fn resolve_op(comm: &Comm, raw: i32, dt: DataType) -> Result<RedOp> {
    if let Some(b) = crate::types::BuiltinOp::from_raw(raw) {
        return Ok(RedOp::Builtin(b));
    }
    let op = comm
        .user_op(raw)
        .ok_or_else(|| Error::invalid_arg(format!("invalid reduction operator {raw}")))?;
    if op.datatype != dt {
        return Err(Error::invalid_arg(format!(
            "reduction operator {raw} was created for {} but the operation uses {}",
            op.datatype.name(),
            dt.name()
        )));
    }
    let scalar = match op.scalar {
        ScalarSource::Immediate(s) => s,
        ScalarSource::Pointer(p) => crate::device::host::read_scalar(dt, p)?,
    };
    Ok(RedOp::PreMulSum(scalar))
}
