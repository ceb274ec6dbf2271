//! Bringing ranks together: unique ids, the root, each rank's bootstrap service, and the
//! peer table every rank receives at init (rank, host identity, pid, addresses).

#[cfg(test)]
mod fuzz;
pub mod id;
pub mod pending;
pub mod root;
pub mod service;
pub mod topo;
pub mod wire;

use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::params;
use crate::transport::fds;
use crate::transport::socket::ifaces;
pub use id::UniqueId;
pub use service::Service;
use wire::{read_frame, wait_readable, write_frame, Reader, Writer};

/// /dev/shm can hold rings; where it cannot, this process's settings refuse shared memory.
fn shm_usable() -> bool {
    let Some(why) = crate::transport::shm::unusable() else { return true };
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if crate::debug::first_time(&SAID) {
        crate::warn!("/dev/shm cannot hold shared-memory rings ({why}): this process talks TCP to the others of its \
                      host (NCCL_SHM_DISABLE=1 chooses that without this warning)");
    }
    false
}

/// What each rank tells the others about itself at init.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerInfo {
    pub rank: usize,
    pub pid: u32,
    pub cuda_dev: i32,
    /// Same value on every process of one host (hostname + boot id, or NCCL_HOSTID).
    pub host_hash: u64,
    /// Its pid namespace and its /dev/shm ([`process_space`]): two containers of one host
    /// that share its name and network may still have pids and /dev/shm of their own.
    pub pid_ns: u64,
    pub shm_fs: u64,
    pub hostname: String,
    /// The rank's bootstrap service.
    pub addr: SocketAddr,
    /// The transport message size this rank would use.
    pub slice: u32,
    /// Sockets this rank opens per peer (NCCL_SOCKET_NTHREADS x NCCL_NSOCKS_PERTHREAD).
    pub nsocks: u32,
    /// The links this rank's settings allow; a pair takes what both allow ([`Links::with`]).
    pub links: Links,
    /// Where its GPU is in the host's PCI tree (CUDA mode; unknown in host mode).
    pub gpu: topo::GpuPlace,
}

/// What a rank's settings allow between ranks of one host. Each rank reads its own
/// environment; a pair (or a communicator) takes what all its ranks allow, so ranks set up
/// differently (NCCL_SHM_DISABLE on one process only) still choose the same links and paths,
/// instead of one waiting on a link the other never opens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Links {
    /// Ranks of one process copy to each other directly (not NCCL_P2P_DISABLE).
    pub p2p: bool,
    /// Ranks of one host go through shared memory (not NCCL_SHM_DISABLE).
    pub shm: bool,
    /// Device buffers of ranks of one host are read directly (CUDA mode: not NCCL_P2P_DISABLE,
    /// nor NCCL_P2P_LEVEL=LOC).
    pub direct: bool,
    /// Sends and receives too (NCCL_RS_DIRECT_P2P).
    pub direct_p2p: bool,
    /// The smallest operation that goes direct, in bytes (NCCL_RS_DIRECT_MIN).
    pub direct_min: u64,
    /// The all-reduce algorithm NCCL_ALGO forces (None: chosen by size). Ranks that differ
    /// choose by size, as every rank then does alike.
    pub algo: Option<crate::algo::Algo>,
    /// How far apart two GPUs may be for `direct` (NCCL_P2P_LEVEL; None: any distance).
    pub level: Option<topo::Level>,
}

impl Links {
    /// This process's settings.
    pub fn local() -> Links {
        let p2p = !params::p2p_disable();
        let level = params::p2p_level();
        if let (None, Some(v)) = (level, params::raw("NCCL_P2P_LEVEL")) {
            crate::warn!("NCCL_P2P_LEVEL={v} is not a level (LOC, NVL, PIX, PXB, PHB, SYS or 0-4): ignored");
        }
        let shm = !params::shm_disable() && shm_usable();
        Links { p2p, shm, direct: p2p && !params::p2p_level_forbids(),
                direct_p2p: params::direct_p2p(), direct_min: params::direct_min() as u64,
                algo: params::raw("NCCL_ALGO").and_then(|v| crate::algo::parse_algo(&v)), level }
    }

    /// What both allow: a link either refuses is refused, and the larger smallest size holds.
    pub fn with(self, other: Links) -> Links {
        Links { p2p: self.p2p && other.p2p, shm: self.shm && other.shm, direct: self.direct && other.direct,
                direct_p2p: self.direct_p2p && other.direct_p2p, direct_min: self.direct_min.max(other.direct_min),
                algo: if self.algo == other.algo { self.algo } else { None },
                level: match (self.level, other.level) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                } }
    }

    fn encode(&self, w: &mut Writer) {
        use crate::algo::Algo;
        let flags = [self.p2p, self.shm, self.direct, self.direct_p2p].iter().enumerate()
            .fold(0u32, |f, (bit, &on)| f | (u32::from(on) << bit));
        let algo = match self.algo {
            None => 0u32,
            Some(Algo::Ring) => 1,
            Some(Algo::Tree) => 2,
        };
        w.u32(flags | algo << 4 | u32::from(topo::Level::encode(self.level)) << 8).u64(self.direct_min);
    }

    fn decode(r: &mut Reader<'_>) -> Result<Links> {
        use crate::algo::Algo;
        let flags = r.u32()?;
        let on = |bit: u32| flags & (1 << bit) != 0;
        let algo = match flags >> 4 & 3 {
            1 => Some(Algo::Ring),
            2 => Some(Algo::Tree),
            _ => None,
        };
        let level = topo::Level::decode((flags >> 8 & 0xff) as u8);
        Ok(Links { p2p: on(0), shm: on(1), direct: on(2), direct_p2p: on(3), direct_min: r.u64()?, algo, level })
    }
}

impl PeerInfo {
    pub fn encode(&self, w: &mut Writer) {
        w.u32(self.rank as u32)
            .u32(self.pid)
            .u32(self.cuda_dev as u32)
            .u64(self.host_hash)
            .u64(self.pid_ns)
            .u64(self.shm_fs)
            .str(&self.hostname)
            .str(&self.addr.to_string())
            .u32(self.slice)
            .u32(self.nsocks);
        self.links.encode(w);
        w.str(&self.gpu.bus).str(&self.gpu.path).u32(self.gpu.numa as u32).u32(self.gpu.nvlink.len() as u32);
        for g in &self.gpu.nvlink {
            w.str(g);
        }
        w.u8(u8::from(self.gpu.nvswitch));
    }
    pub fn decode(r: &mut Reader<'_>) -> Result<PeerInfo> {
        let rank = r.u32()? as usize;
        let pid = r.u32()?;
        let cuda_dev = r.u32()? as i32;
        let host_hash = r.u64()?;
        let (pid_ns, shm_fs) = (r.u64()?, r.u64()?);
        let hostname = r.str()?;
        let addr = r.str()?.parse().map_err(|_| Error::system("bootstrap: malformed peer address"))?;
        let slice = r.u32()?;
        let nsocks = r.u32()?;
        let links = Links::decode(r)?;
        let (bus, path, numa) = (r.str()?, r.str()?, r.u32()? as i32);
        // (Bounded by what the message holds: each id is at least its length field.)
        let nvlinks = r.u32()? as usize;
        let nvlink = (0..nvlinks).map(|_| r.str()).collect::<Result<Vec<_>>>()?;
        let gpu = topo::GpuPlace { bus, path, numa, nvlink, nvswitch: r.u8()? != 0 };
        Ok(PeerInfo { rank, pid, cuda_dev, host_hash, pid_ns, shm_fs, hostname, addr, slice, nsocks, links, gpu })
    }
    pub fn same_host(&self, other: &PeerInfo) -> bool {
        self.host_hash == other.host_hash
    }
    /// One host and one pid namespace: a pid of `other` names the same process here. Two
    /// containers on one host with its name (host networking) each have a pid 1, and were
    /// taken for one process: each waited for ever for the other's in-process ring.
    pub fn same_pids(&self, other: &PeerInfo) -> bool {
        self.same_host(other) && self.pid_ns == other.pid_ns
    }
    pub fn same_process(&self, other: &PeerInfo) -> bool {
        self.same_pids(other) && self.pid == other.pid
    }
    /// Shared-memory rings need one /dev/shm (a ring is a file there) and pids in common (a
    /// peer's exit is seen by its pid; large messages are read from its memory by pid).
    pub fn shares_memory(&self, other: &PeerInfo) -> bool {
        self.same_pids(other) && self.shm_fs == other.shm_fs
    }

    /// Whether this rank and `other` may read each other's device buffers directly (CUDA
    /// mode): ranks of one host whose settings both allow it, on GPUs no farther apart than
    /// the stricter NCCL_P2P_LEVEL of the two (a distance not known counts as SYS). Alike on
    /// both ends: it depends only on what both published.
    pub fn direct_with(&self, other: &PeerInfo) -> bool {
        let both = self.links.with(other.links);
        if !(self.same_host(other) && both.direct) {
            return false;
        }
        both.level.is_none_or(|level| topo::distance(&self.gpu, &other.gpu).unwrap_or(topo::Level::Sys) <= level)
    }
}

/// NCCL's host identity: `NCCL_HOSTID` if set, else hostname plus the kernel's boot id.
pub fn host_hash() -> u64 {
    let text = params::raw("NCCL_HOSTID").unwrap_or_else(|| {
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
        format!("{}{}", crate::debug::hostname(), boot.trim())
    });
    id::magic_of(&text)
}

/// This process's pid namespace and /dev/shm, as numbers that are equal where they are the
/// same (the namespace's inode; the file system's device and inode). 0 for one that cannot be
/// read (no /proc): then alike for every process that cannot, as before they were told apart.
/// Read once (a process never changes its pid namespace).
pub fn process_space() -> (u64, u64) {
    static SPACE: std::sync::OnceLock<(u64, u64)> = std::sync::OnceLock::new();
    *SPACE.get_or_init(read_process_space)
}

fn read_process_space() -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    let pid_ns = std::fs::read_link("/proc/self/ns/pid").ok().and_then(|l| {
        let text = l.to_string_lossy().into_owned();
        text.strip_prefix("pid:[")?.strip_suffix(']')?.parse().ok()
    });
    let shm_fs = std::fs::metadata("/dev/shm").ok().map(|m| id::magic_of(&format!("{}:{}", m.dev(), m.ino())));
    (pid_ns.unwrap_or(0), shm_fs.unwrap_or(0))
}

/// The address this process listens on: the first chosen interface (loopback if none). An
/// `NCCL_SOCKET_IFNAME` or `NCCL_SOCKET_FAMILY` that leaves no interface is an error, as in
/// NCCL ("no socket interface found"): loopback instead would leave every other host unable
/// to reach this one, a hang whose cause is a typo.
pub fn local_ip() -> Result<IpAddr> {
    let listed = ifaces::interfaces();
    if let Some(i) = listed.as_ref().ok().and_then(|l| l.first()) {
        return Ok(i.addr);
    }
    let (name, family) = (params::raw("NCCL_SOCKET_IFNAME"), params::raw("NCCL_SOCKET_FAMILY"));
    if name.is_none() && family.is_none() {
        // Interfaces that cannot be listed: loopback, and what listens there says what is short.
        if listed.is_err() {
            return Ok(IpAddr::V4(std::net::Ipv4Addr::LOCALHOST));
        }
        // Loopback is chosen whenever it is up and nothing else is: none chosen, none is up.
        // (Listening on 127.0.0.1 works even so, and every connection then failed with
        // "Network is unreachable" under a guess at a stale unique id: found by a probe in a
        // new network namespace, whose lo starts down.)
        return Err(Error::system(
            "no socket interface found: no network interface of this host is up, loopback included (a new \
             network namespace starts with lo down: `ip link set lo up`)"));
    }
    let set: Vec<String> = [("NCCL_SOCKET_IFNAME", name), ("NCCL_SOCKET_FAMILY", family)]
        .into_iter()
        .filter_map(|(k, v)| v.map(|v| format!("{k}={v}")))
        .collect();
    Err(Error::invalid_arg(format!(
        "no socket interface found: {} leaves none of this host's interfaces with an address ({})",
        set.join(" and "),
        ifaces::describe_all()
    )))
}

/// `ncclGetUniqueId`: with NCCL_COMM_ID, the id every rank derives from it (rank 0 will host
/// the root); otherwise a new root, listening now, and a random magic.
pub fn new_unique_id() -> Result<[u8; id::ID_BYTES]> {
    if let Some(v) = params::raw("NCCL_COMM_ID") {
        // (Blanks around it, as a value read from a file brings a newline, are no part of it:
        // they failed as "does not resolve", and the magic is the same without them.)
        let v = v.trim();
        let root = id::parse_comm_id(v)?;
        return Ok(UniqueId { magic: id::magic_of(v), root, rank0_hosts_root: true }.encode());
    }
    new_root_id()
}

/// A new root, listening now, and a random magic: the id of one job (`ncclCommGetUniqueId`
/// uses it whatever NCCL_COMM_ID says, since the grown communicator is a job of its own).
pub fn new_root_id() -> Result<[u8; id::ID_BYTES]> {
    let ip = local_ip()?;
    let listener = fds::with_room(|| crate::transport::socket::listen(SocketAddr::new(ip, 0)))
        .map_err(|e| Error::os(format!("bootstrap: listen on {ip}"), e))?;
    let root = listener.local_addr().map_err(|e| Error::os("bootstrap: local address", e))?;
    let magic = id::random_u64();
    root::spawn(listener, magic, params::init_timeout())?;
    crate::info!(BOOTSTRAP, "unique id: root listening on {root}");
    Ok(UniqueId { magic, root, rank0_hosts_root: false }.encode())
}

fn connect_root(id: &UniqueId, deadline: Instant, abort: &AtomicBool) -> Result<TcpStream> {
    loop {
        if abort.load(Ordering::Acquire) {
            return Err(Error::invalid_usage("communicator aborted during init"));
        }
        match crate::transport::socket::dial(&id.root, Duration::from_secs(2)) {
            Ok(s) => return Ok(s),
            // With NCCL_COMM_ID rank 0 may not have started the root yet: keep trying (a
            // connection that reached itself included: `dial`).
            Err(_) if id.rank0_hosts_root && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) if fds::out_of_fds(&e) => return Err(Error::os(format!("bootstrap: cannot reach the root at {}", id.root), e)),
            Err(e) => {
                let why = match e.raw_os_error() {
                    Some(libc::ENETUNREACH | libc::EHOSTUNREACH) => {
                        format!("no route from this host to {} ({})", id.root.ip(), ifaces::describe_all())
                    }
                    _ => "a stale unique id, or the process that created it exited?".into(),
                };
                return Err(Error::remote(format!("bootstrap: cannot reach the root at {}: {e} ({why})", id.root)));
            }
        }
    }
}

/// A rank that fails before it can join (no interface, no port, no thread for its service)
/// says so to the root, which fails the job: the other ranks learn why at once instead of
/// waiting for it with no end (NCCL_INIT_TIMEOUT_S unset). Best effort: the root may be out
/// of reach too.
fn tell_root_cannot_join(id: &UniqueId, rank: usize, nranks: usize, e: &Error, abort: &AtomicBool) {
    let Ok(mut s) = connect_root(id, Instant::now() + CANNOT_JOIN_REACH, abort) else { return };
    let mut w = Writer::default();
    w.u8(root::CANNOT_JOIN).u64(id.magic).u32(rank as u32).u32(nranks as u32)
        .str(&format!("{} (host {}, pid {})", e.msg, crate::debug::hostname(), std::process::id()));
    let _ = write_frame(&mut s, &w.buf);
}

/// How long a rank that cannot join tries to reach the root to say so.
const CANNOT_JOIN_REACH: Duration = Duration::from_secs(5);

/// How long a rank tries to reach the root when NCCL_INIT_TIMEOUT_S is unset.
const UNLIMITED_CONNECT: Duration = Duration::from_secs(300);

/// How much longer than NCCL_INIT_TIMEOUT_S a rank waits for the root's answer.
const ROOT_VERDICT_GRACE: Duration = Duration::from_secs(2);

/// Join the job: start our service, say hello to the root, receive everyone's info.
pub fn join(id: &UniqueId, rank: usize, nranks: usize, mut me: PeerInfo, abort: &AtomicBool)
            -> Result<(Vec<PeerInfo>, Service)> {
    let timeout = params::init_timeout();
    // Reaching the root is quick once it listens (with NCCL_COMM_ID, rank 0 may start it
    // late): bounded even without a limit on the wait that follows.
    let connect_deadline = Instant::now() + timeout.unwrap_or(UNLIMITED_CONNECT);
    let deadline = params::init_deadline();
    if id.rank0_hosts_root && rank == 0 {
        let listener = bind_reusable(id.root)?;
        root::spawn(listener, id.magic, timeout)?;
    }
    let service = match local_ip().and_then(|ip| Service::start(ip, id.magic, rank as u32)) {
        Ok(s) => s,
        Err(e) => {
            tell_root_cannot_join(id, rank, nranks, &e, abort);
            return Err(e);
        }
    };
    me.addr = service.addr;
    let mut s = connect_root(id, connect_deadline, abort)?;
    let _ = s.set_nodelay(true);
    let mut w = Writer::default();
    w.u8(root::HELLO).u64(id.magic).u64(crate::SOURCE).u32(rank as u32).u32(nranks as u32);
    me.encode(&mut w);
    write_frame(&mut s, &w.buf).map_err(|e| e.context("bootstrap: hello to root"))?;
    let reply = await_verdict(&mut s, id, rank, timeout, deadline, abort)?;
    let peers = read_table(&reply, nranks)?;
    service.set_peers(peers.iter().map(|p| p.addr).collect());
    Ok((peers, service))
}

/// The root's answer to this rank's hello on `s` (the peer table, or why the job failed): what
/// it says of the ranks it waits for meanwhile is said at WARN, and so is its silence, where it
/// lasts so long that another program may be listening at its address.
fn await_verdict(s: &mut TcpStream, id: &UniqueId, rank: usize, timeout: Option<Duration>, deadline: Instant,
                 abort: &AtomicBool) -> Result<Vec<u8>> {
    // The root gives up NCCL_INIT_TIMEOUT_S after it started and then says which ranks are
    // missing; its verdict is waited for a little longer than that, so a rank whose own clock
    // started at the same moment (the root's host, above) gets it rather than a bare timeout.
    let reply_deadline = deadline + ROOT_VERDICT_GRACE;
    let no_answer = |e: Error| if Instant::now() >= reply_deadline {
        Error::remote(format!("bootstrap: no answer from the root within {} s",
                              timeout.map_or(0, |t| (t + ROOT_VERDICT_GRACE).as_secs())))
    } else if e.msg.contains(wire::NOT_OURS) {
        // Found by a probe whose NCCL_COMM_ID named an address a proxy answered ("HTTP").
        Error::system(format!("bootstrap: the root's address {} answers, but not as a root of nccl-rs ({}): another \
                               program listens there (NCCL_COMM_ID's port in use, or a unique id whose root is long gone)",
                              id.root, e.msg))
    } else {
        Error::remote(format!("bootstrap: lost the connection to the root at {}: {} (the root runs in the process \
                               that called ncclGetUniqueId: that process ended, or the root failed the job and \
                               said why there)",
                              id.root, e.msg))
    };
    // A root of ours answers, or names the ranks it waits for, within `warn_after`: silence
    // for half as long again means another program listens at its address (an NCCL_COMM_ID
    // port in use), said once at WARN; the wait goes on (it may end at NCCL_INIT_TIMEOUT_S).
    let speaks_within = timeout.map_or(Duration::from_secs(10), |t| (t / 2).min(Duration::from_secs(10)));
    let mut quiet_until = Some(Instant::now() + speaks_within * 3 / 2);
    let reply = loop {
        let until = quiet_until.map_or(reply_deadline, |q| q.min(reply_deadline));
        match wait_readable(s, until, abort) {
            // (Silence only: the connection's end is an answer, below.)
            Err(e) if e.code != crate::error::Code::InvalidUsage && Instant::now() < reply_deadline
                && quiet_until.is_some_and(|q| Instant::now() >= q) => {
                quiet_until = None;
                crate::warn!("rank {rank}: bootstrap: the root at {} has said nothing in {} s (ours answers within {} s): \
                              is another program listening there (NCCL_COMM_ID's port in use)?",
                             id.root, (speaks_within * 3 / 2).as_secs(), speaks_within.as_secs());
                continue;
            }
            r => r.map_err(|e| if e.code == crate::error::Code::InvalidUsage { e } else { no_answer(e) })?,
        }
        quiet_until = None;
        let frame = read_frame(s, reply_deadline.saturating_duration_since(Instant::now()).max(Duration::from_secs(1)))
            .map_err(no_answer)?;
        let mut r = Reader::new(&frame);
        if r.u8()? != root::WAITING {
            break frame;
        }
        crate::warn!("rank {rank}: {}", r.str()?);
    };
    Ok(reply)
}

/// The peer table of the root's answer `reply`, for a job of `nranks`; or the job's failure as
/// the root says it.
fn read_table(reply: &[u8], nranks: usize) -> Result<Vec<PeerInfo>> {
    let mut r = Reader::new(reply);
    match r.u8()? {
        root::TABLE => {}
        root::FAILED => return Err(Error::invalid_arg(r.str()?)),
        root::FAILED_USAGE => return Err(Error::invalid_usage(r.str()?)),
        root::FAILED_SYSTEM => return Err(Error::system(r.str()?)),
        root::FAILED_REMOTE => return Err(Error::remote(r.str()?)),
        root::TIMED_OUT => return Err(Error::timeout(r.str()?)),
        // A failure of a kind a later build added: its text still says why.
        k => return Err(Error::system(match r.str() {
            Ok(why) if !why.is_empty() => format!("bootstrap: the root failed the job (answer {k}): {why}"),
            _ => format!("bootstrap: unexpected reply {k} from the root"),
        })),
    }
    let n = r.u32()? as usize;
    ensure!(n == nranks, Error::invalid_arg(format!("bootstrap: the root formed a job of {n} ranks, we expected {nranks}")));
    let peers = (0..n).map(|_| PeerInfo::decode(&mut r)).collect::<Result<Vec<_>>>()?;
    ensure!(peers.iter().enumerate().all(|(i, p)| p.rank == i), Error::system("bootstrap: malformed peer table"));
    Ok(peers)
}

fn bind_reusable(addr: SocketAddr) -> Result<TcpListener> {
    // std sets SO_REUSEADDR on Unix listeners, so a root restarted on the same port binds. A
    // rank that dials the port before it listens may hold it for a moment with a connection to
    // itself (`transport::socket::dial` drops those): the port in use is tried again briefly.
    let until = Instant::now() + BIND_RETRY;
    loop {
        match fds::with_room(|| crate::transport::socket::listen(addr)) {
            Ok(l) => return Ok(l),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && Instant::now() < until => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(Error::os(format!("bootstrap: rank 0 cannot host the root at {addr} (NCCL_COMM_ID)"), e)),
        }
    }
}

/// How long rank 0 tries again to bind the root's port (`NCCL_COMM_ID`) while it is in use.
const BIND_RETRY: Duration = Duration::from_secs(1);
