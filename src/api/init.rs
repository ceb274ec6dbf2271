//! Communicator creation and teardown: init (blocking, nonblocking, in a group, all ranks of a
//! process), finalize, destroy, abort, suspend/resume and memory statistics.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::bootstrap::{self, PeerInfo, UniqueId};
use crate::comm::handle::{self, Handle};
use crate::comm::{Comm, Ready};
use crate::error::{Error, Result};
use crate::params;
use crate::transport::ring::SLOTS;

use super::config::Config;

/// What an init call hands back: the handle, and whether init still runs in the background.
pub struct Started {
    pub handle: Handle,
    pub in_progress: bool,
}

fn check_rank(nranks: i32, rank: i32) -> Result<(usize, usize)> {
    if nranks < 1 {
        return Err(Error::invalid_arg(format!("nranks {nranks} must be at least 1")));
    }
    if rank < 0 || rank >= nranks {
        return Err(Error::invalid_arg(format!("rank {rank} is out of range for {nranks} ranks")));
    }
    Ok((nranks as usize, rank as usize))
}

/// The device of the caller's current context (CUDA mode), as NCCL takes it for a new
/// communicator; 0 in host mode.
pub(crate) fn caller_device() -> i32 {
    match crate::device::mode::current() {
        crate::device::mode::Mode::Cuda { .. } => crate::device::cuda::current_device().ok().flatten().unwrap_or(0),
        crate::device::mode::Mode::Host => 0,
    }
}

pub fn init_rank(nranks: i32, id: [u8; 128], rank: i32, config: Config) -> Result<Started> {
    let (n, r) = check_rank(nranks, rank)?;
    let id = UniqueId::decode(&id)?;
    let comm = Arc::new(Comm::new(r, n, caller_device(), config, id.magic));
    let handle = handle::register(comm.clone());
    if crate::group::depth() > 0 {
        crate::group::add_init(comm, id);
        return Ok(Started { handle, in_progress: false });
    }
    if comm.config.blocking {
        if let Err(e) = run_init(&comm, &id) {
            handle::forget(handle);
            return Err(e);
        }
        return Ok(Started { handle, in_progress: false });
    }
    spawn_init(comm, id)?;
    Ok(Started { handle, in_progress: true })
}

/// Several ids speed up NCCL's init at scale; one root suffices here, so the first is used.
pub fn init_rank_scalable(nranks: i32, rank: i32, ids: &[[u8; 128]], config: Config) -> Result<Started> {
    let first = *ids.first().ok_or_else(|| Error::invalid_arg("no unique id given"))?;
    for other in &ids[1..] {
        UniqueId::decode(other)?;
    }
    init_rank(nranks, first, rank, config)
}

/// The most ranks `ncclCommInitAll` makes (NCCL's are bounded by the GPUs of one machine).
pub const MAX_INIT_ALL: i32 = 4096;

/// `ncclCommInitAll`: every rank in this process, initialised together; rank i on `devlist[i]`,
/// or on device i without a list. A list's devices must exist, as NCCL checks (in CUDA mode: a
/// device of the driver's; in host mode devices are only numbers, but not negative ones).
/// Without a list, CUDA mode accepts more ranks than devices, for ranks that only use host
/// buffers (NCCL refuses them; ours fail at their first call on device memory, naming it).
pub fn init_all(ndev: i32, devlist: Option<Vec<i32>>) -> Result<Vec<Handle>> {
    let devs: Vec<i32> = match devlist {
        None => (0..ndev).collect(),
        Some(devs) => {
            let count = match crate::device::mode::current() {
                crate::device::mode::Mode::Cuda { .. } => Some(crate::device::cuda::device_count()?),
                crate::device::mode::Mode::Host => None,
            };
            for (i, &d) in devs.iter().enumerate() {
                if d < 0 || count.is_some_and(|c| d >= c) {
                    let have = count.map_or(String::new(), |c| format!(" (this process sees {c} CUDA device(s))"));
                    return Err(Error::invalid_arg(format!("devlist[{i}] is {d}, not a device{have}")));
                }
            }
            devs
        }
    };
    let n = devs.len();
    let id = UniqueId::decode(&bootstrap::new_unique_id()?)?;
    let comms: Vec<Arc<Comm>> =
        devs.iter().enumerate().map(|(r, &d)| Arc::new(Comm::new(r, n, d, Config { blocking: true, ..Config::default() }, id.magic))).collect();
    run_inits(&comms, &id)?;
    Ok(comms.into_iter().map(handle::register).collect())
}

/// Initialise several communicators of this process concurrently (they rendezvous with each
/// other, so they cannot run one after the other on one thread).
pub fn run_inits(comms: &[Arc<Comm>], id: &UniqueId) -> Result<()> {
    let list: Vec<(Arc<Comm>, UniqueId)> = comms.iter().map(|c| (c.clone(), *id)).collect();
    let result = run_together(&list);
    if result.is_err() {
        comms.iter().for_each(|c| c.shutdown());
    }
    result
}

/// The inits of one group (or ncclCommInitAll), in parallel. When one fails on its own (rank 0
/// cannot host the root, a root that is not ours), the others stop too rather than wait for a
/// job that cannot form: each gets that failure as its error, named, and returns. The error
/// returned is that first failure.
pub fn run_together(list: &[(Arc<Comm>, UniqueId)]) -> Result<()> {
    let cause: Arc<std::sync::Mutex<Option<Error>>> = Arc::default();
    let all: Vec<Arc<Comm>> = list.iter().map(|(c, _)| c.clone()).collect();
    let work = list.iter().map(|(c, id)| {
        let (c, id, all, cause) = (c.clone(), *id, all.clone(), cause.clone());
        Box::new(move || {
            let r = run_init(&c, &id);
            if let Err(e) = &r {
                let mut first = cause.lock().unwrap_or_else(|p| p.into_inner());
                if first.is_none() && !c.abort.load(Ordering::Acquire) {
                    *first = Some(e.clone());
                    for other in all.iter().filter(|o| !Arc::ptr_eq(o, &c)) {
                        other.set_async_error(&Error::new(e.code, format!(
                            "rank {} of {}: init stopped: rank {} of the same call failed: {}",
                            other.rank, other.nranks, c.rank, e.msg)));
                        other.abort.store(true, Ordering::Release);
                    }
                }
            }
            r
        }) as crate::group::Deferred
    }).collect();
    let result = crate::group::run_parallel(work);
    let first = cause.lock().unwrap_or_else(|p| p.into_inner()).take();
    match first {
        Some(e) => Err(e),
        None => result,
    }
}

pub fn spawn_init(comm: Arc<Comm>, id: UniqueId) -> Result<()> {
    crate::abi::stdio::keep_std_fds();
    std::thread::Builder::new()
        .name("nccl-rs-init".into())
        .spawn(move || {
            crate::device::cuda::relax_capture_mode();
            let _ = run_init(&comm, &id);
        })
        .map(|_| ())
        .map_err(|e| Error::os("spawn init thread", e))
}

/// The work of init: join the job, learn the peers. Errors — a panic included, since this
/// often runs on a background thread nobody joins — also become the async error, so a
/// nonblocking init never stays "in progress" forever.
pub fn run_init(comm: &Comm, id: &UniqueId) -> Result<()> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| join_job(comm, id))).unwrap_or_else(|_| {
        let e = Error::internal(format!("rank {} of {}: init panicked", comm.rank, comm.nranks));
        comm.set_async_error(&e);
        Err(e)
    })
}

/// Where this rank's GPU is in the host's PCI tree (CUDA mode), for NCCL_P2P_LEVEL
/// (`bootstrap::topo`); unknown in host mode or where the driver or sysfs cannot say.
fn gpu_place(cuda_dev: i32) -> bootstrap::topo::GpuPlace {
    if !crate::device::mode::is_cuda() {
        return bootstrap::topo::GpuPlace::default();
    }
    match crate::device::cuda::pci_bus_id(cuda_dev) {
        Ok(bus) => {
            let sysfs = params::text("NCCL_RS_TOPO_SYSFS");
            let mut place = bootstrap::topo::GpuPlace::of_bus_id(&sysfs, &bus);
            let path = if place.path.is_empty() { "not found in sysfs" } else { &place.path };
            crate::info!(P2P, "CUDA device {cuda_dev}: PCI {} ({path}), NUMA node {}", place.bus_id(), place.numa);
            // NVLinks matter only against a level (`PeerInfo::direct_with`): NVML, whose
            // initialisation may take a while, is asked only then. (A peer without a level
            // publishes none: its pairs weigh only the links this rank lists.)
            if params::p2p_level().is_none() {
                return place;
            }
            let t0 = std::time::Instant::now();
            let links = crate::device::cuda::nvml::nvlinks(&place.bus, &sysfs);
            let took = format!("NVML, {:.1} ms", t0.elapsed().as_secs_f64() * 1e3);
            match links {
                Ok(links) if links.active > 0 => {
                    crate::info!(P2P, "CUDA device {cuda_dev}: {} active NVLink(s) to {}{} ({took})", links.active,
                                 if links.gpus.is_empty() { "no GPU".to_string() } else { links.gpus.join(", ") },
                                 if links.switch { ", and NVSwitch" } else { "" });
                    (place.nvlink, place.nvswitch) = (links.gpus, links.switch);
                }
                Ok(_) => crate::info!(P2P, "CUDA device {cuda_dev}: no active NVLink ({took})"),
                Err(why) => crate::info!(P2P, "CUDA device {cuda_dev}: NVLinks unknown ({why}): PCI distances only"),
            }
            place
        }
        Err(e) => {
            crate::info!(INIT, "no PCI bus id for CUDA device {cuda_dev} ({}): its distance to other GPUs is unknown", e.msg);
            bootstrap::topo::GpuPlace::default()
        }
    }
}

fn join_job(comm: &Comm, id: &UniqueId) -> Result<()> {
    crate::debug::set_rank(comm.rank as i32);
    crate::debug::print_version_once();
    crate::params::report_once();
    let (pid_ns, shm_fs) = bootstrap::process_space();
    let me = PeerInfo {
        rank: comm.rank,
        pid: std::process::id(),
        cuda_dev: comm.cuda_dev,
        host_hash: bootstrap::host_hash(),
        pid_ns,
        shm_fs,
        hostname: crate::debug::hostname(),
        addr: ([0, 0, 0, 0], 0).into(),
        slice: (params::buffsize() / SLOTS) as u32,
        nsocks: params::nsocks() as u32,
        links: bootstrap::Links::local(),
        gpu: gpu_place(comm.cuda_dev),
    };
    let result = bootstrap::join(id, comm.rank, comm.nranks, me, &comm.abort).map(|(peers, service)| {
        let slice = peers.iter().map(|p| p.slice as usize).min().unwrap_or(1 << 16).max(4096);
        comm.set_ready(Ready::new(peers, service, slice));
    });
    match &result {
        Ok(()) => {
            // NCCL's fields, for tools that read them; busId is NCCL's number for the PCI
            // bus id, its hex digits run together ("0000:57:00.0" is 57000).
            let bus_id = comm.ready_if_any().and_then(|r| r.peers.get(comm.rank))
                .map_or(0, |p| bootstrap::topo::bus_id_number(&p.gpu.bus));
            crate::info!(INIT, "comm {:p} rank {} nranks {} cudaDev {} nvmlDev {} busId {bus_id:x} commId {:#x} - Init COMPLETE",
                         comm, comm.rank, comm.nranks, comm.cuda_dev, comm.cuda_dev, comm.hash);
            if comm.abort.load(Ordering::Acquire) {
                comm.shutdown(); // destroyed or aborted while we were joining
            }
        }
        Err(e) => {
            let e = e.clone().context(format!("rank {} of {}", comm.rank, comm.nranks));
            comm.set_async_error(&e);
            return Err(e);
        }
    }
    result
}

/// Host mode: every operation has completed when its call returned, so nothing is left to
/// flush.
pub fn finalize(comm: &Arc<Comm>) -> Result<()> {
    if comm.finalized.swap(true, Ordering::AcqRel) {
        return Err(Error::invalid_arg("communicator was already finalized"));
    }
    if !comm.config.blocking {
        // As NCCL's: ncclInProgress, done once what was issued before it is (polled with
        // ncclCommGetAsyncError; ncclCommAbort stops it).
        let c = comm.clone();
        return crate::group::background::start_anyway(vec![comm.clone()], Box::new(move || {
            crate::streamed::drain(&c);
            c.rma.drain();
            Ok(())
        }));
    }
    // Flush what was issued on streams (CUDA mode) and what a nonblocking communicator runs
    // in the background; other host-mode calls have completed already.
    crate::group::background::wait_idle(comm);
    crate::streamed::drain(comm);
    comm.rma.drain();
    Ok(())
}

pub fn destroy(comm: Arc<Comm>) -> Result<()> {
    // As ncclCommFinalize: operations already issued on streams, or running in the
    // background, complete first.
    crate::group::background::wait_idle(&comm);
    crate::streamed::drain(&comm);
    comm.rma.drain();
    comm.abort.store(true, Ordering::Release);
    comm.shutdown();
    crate::group::release_kept_plans();
    Ok(())
}

/// How long ncclCommAbort waits for the communicator's background operations to stop.
const ABORT_WAITS: std::time::Duration = std::time::Duration::from_secs(10);

pub fn abort(comm: Arc<Comm>) -> Result<()> {
    comm.abort.store(true, Ordering::Release);
    // Operations running in the background stop at the flag (within the progress engine's
    // check interval) and let go of the connections. One still waiting for its turn behind
    // another communicator's (a group over several) finds the flag when it starts, and runs
    // nothing: abort does not wait for it.
    if !crate::group::background::wait_idle_for(&comm, ABORT_WAITS) {
        crate::warn!("rank {}: ncclCommAbort: operations issued in the background still wait behind another \
                      communicator's after {} s; they will stop when they start", comm.rank, ABORT_WAITS.as_secs());
    }
    comm.shutdown();
    crate::group::release_kept_plans();
    Ok(())
}

/// ncclCommRevoke: stop operations (a call blocked in another thread returns within the
/// progress engine's check interval); host mode has nothing else in flight, so the
/// communicator is quiescent at once.
pub fn revoke(comm: &Comm, flags: i32) -> Result<()> {
    if flags != 0 {
        return Err(Error::invalid_arg(format!("revokeFlags {flags:#x} must be NCCL_REVOKE_DEFAULT (0)")));
    }
    comm.ready_for_management()?;
    comm.revoked.store(true, Ordering::Release);
    comm.rma.revoke();
    Ok(())
}

pub const SUSPEND_MEM: i32 = 1;

pub fn suspend(comm: &Comm, flags: i32) -> Result<()> {
    if flags & !SUSPEND_MEM != 0 {
        return Err(Error::invalid_arg(format!("unknown suspend flags {flags:#x}")));
    }
    comm.ready()?;
    // CUDA mode: the device memory the communicator holds is its peers', mapped for the direct
    // path; host-mode rings and the pinned staging pool stay (they are persistent).
    if flags & SUSPEND_MEM != 0 {
        if let Some(s) = comm.streamed.get() {
            s.release_memory(comm)?;
        }
    }
    comm.suspended.store(true, Ordering::Release);
    if let Some(r) = comm.ready_if_any() {
        r.set_suspended();
    }
    Ok(())
}

pub fn resume(comm: &Comm) -> Result<()> {
    if !comm.suspended.swap(false, Ordering::AcqRel) {
        return Err(Error::invalid_usage("communicator is not suspended"));
    }
    if let Some(r) = comm.ready_if_any() {
        r.set_running(&[]);
    }
    Ok(())
}

/// ncclCommMemStats. What a communicator holds: its connections' rings and staging areas, and
/// in CUDA mode its pinned staging pool (host memory: data is staged through the host),
/// reported as persistent; and in CUDA mode the peers' device memory its direct path keeps
/// mapped and its device scratch (copies of buffers peers cannot read), which
/// ncclCommSuspend(NCCL_SUSPEND_MEM) releases. Total is the two together.
pub fn mem_stat(comm: &Comm, stat: i32) -> Result<u64> {
    let pool = || comm.streamed.get().map_or(0, |s| s.pool_bytes());
    let persist = || comm.ready_if_any().map_or(0, |r| r.conns().mem_bytes()) + pool();
    let suspendable = || comm.streamed.get().map_or(0, |s| s.peer_bytes() + s.scratch_bytes());
    match stat {
        0 => Ok(suspendable()),
        2 => Ok(persist()),
        3 => Ok(persist() + suspendable()),
        1 => Ok(comm.suspended.load(Ordering::Acquire) as u64),
        _ => Err(Error::invalid_arg(format!("invalid memory statistic {stat}"))),
    }
}
