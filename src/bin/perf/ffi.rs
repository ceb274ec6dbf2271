//! The tool's calls into the library, through its C API as an application makes them: the
//! communicators of this process, their buffers, one iteration of a collective, and the small
//! allreduces the tool needs for itself (barrier, max of times, sum of errors).

use std::alloc::{alloc, dealloc, Layout};
use std::ffi::c_void;
use std::ptr::null_mut;

use nccl::abi::coll::*;
use nccl::abi::comm::*;
use nccl::abi::group::*;
use nccl::abi::misc::*;
use nccl::abi::types::*;

use nccl::device::cuda;
use nccl::device::host::{Region, UserPtr};

use crate::opts::{Coll, Opts, PREMULSUM};

const FLOAT64: ncclDataType_t = ncclDataType_t(8);
const UINT64: ncclDataType_t = ncclDataType_t(5);
const SUM: ncclRedOp_t = ncclRedOp_t(0);
const MAX: ncclRedOp_t = ncclRedOp_t(2);

/// The library's result as a Rust error with its last error message.
pub fn check(r: ncclResult_t, what: &str) -> Result<(), String> {
    if r.0 == 0 {
        return Ok(());
    }
    let p = ncclGetLastError(null_mut());
    let msg = if p.is_null() {
        String::new()
    } else {
        // SAFETY: the library returns a NUL-terminated string that lives until its next error.
        unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned()
    };
    Err(format!("{what} failed (ncclResult {}): {msg}", r.0))
}

const IN_PROGRESS: i32 = 7;

/// [`check`] for a call on nonblocking communicators: whether it returned `ncclInProgress`
/// (the operation goes on; [`settle`] waits for it).
pub fn check_pending(r: ncclResult_t, what: &str) -> Result<bool, String> {
    if r.0 == IN_PROGRESS {
        return Ok(true);
    }
    check(r, what).map(|()| false)
}

/// Wait until none of `comms` is in progress, as NCCL documents for nonblocking communicators:
/// poll `ncclCommGetAsyncError` in a plain loop, as a program would (the library yields inside
/// the call while the operation is in progress); the first error any reports fails the wait
/// with its message.
pub fn settle(comms: impl IntoIterator<Item = ncclComm_t>, what: &str) -> Result<(), String> {
    for comm in comms {
        loop {
            let mut state = ncclResult_t(0);
            check(ncclCommGetAsyncError(comm, &mut state), "ncclCommGetAsyncError")?;
            match state.0 {
                0 => break,
                IN_PROGRESS => {}
                _ => return check(state, what),
            }
        }
    }
    Ok(())
}

/// A page-aligned, pre-touched host buffer, as the baselines allocate theirs
/// (`aligned_alloc(4096, ...)` and `memset`), so no tool pays page faults another does not.
pub struct Buf {
    ptr: *mut u8,
    len: usize,
}

impl Buf {
    pub fn new(len: usize, fill: u8) -> Buf {
        let layout = Layout::from_size_align(len.max(1), 4096).expect("buffer size");
        // SAFETY: the layout has a non-zero size; a null result is handled.
        let ptr = unsafe { alloc(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        // SAFETY: ptr is valid for len.max(1) bytes.
        unsafe { std::ptr::write_bytes(ptr, fill, len.max(1)) };
        Buf { ptr, len }
    }
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: ptr is valid for len bytes for the lifetime of self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
    fn at(&self, byte: usize) -> *mut c_void {
        // SAFETY: callers pass offsets inside the buffer (shapes come from Coll::elems).
        unsafe { self.ptr.add(byte) as *mut c_void }
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        // SAFETY: allocated in new() with this layout.
        unsafe { dealloc(self.ptr, Layout::from_size_align(self.len.max(1), 4096).unwrap()) }
    }
}

/// A rank's buffers in device memory (`--device 1|2`), and the stream its calls go to.
pub struct DeviceBufs {
    send: *mut c_void,
    recv: *mut c_void,
    stream: cuda::Stream,
    /// `--device 2`: where both buffers are carved from.
    vmm: Option<cuda::VmmAllocation>,
}

/// The allocations PyTorch's expandable segments map for large tensors.
const VMM_CHUNK: usize = 20 << 20;

impl DeviceBufs {
    /// From `cuMemAlloc`, or (`vmm`) one after the other in memory of the virtual memory API,
    /// the first 512 bytes in, as a caching allocator places tensors in an expandable segment;
    /// `private`: that memory not exportable.
    fn new(send_bytes: usize, recv_bytes: usize, vmm: bool, private: bool) -> Result<DeviceBufs, String> {
        let flag = match (vmm, private) {
            (false, _) => "--device 1",
            (true, false) => "--device 2",
            (true, true) => "--device 3",
        };
        let ctx = cuda::Context::primary(0).map_err(|e| format!("{flag}: {}", e.msg))?;
        let stream = cuda::Stream::new(ctx).map_err(|e| format!("{flag}: {}", e.msg))?;
        if vmm {
            let recv_at = (512 + send_bytes).div_ceil(256) * 256;
            let a = cuda::VmmAllocation::new(recv_at + recv_bytes.max(1), VMM_CHUNK, !private)
                .map_err(|e| format!("{flag}: {}", e.msg))?;
            // SAFETY: both offsets lie inside the allocation of recv_at + recv_bytes bytes.
            let (send, recv) = unsafe { (a.ptr().cast::<u8>().add(512).cast(), a.ptr().cast::<u8>().add(recv_at).cast()) };
            return Ok(DeviceBufs { send, recv, stream, vmm: Some(a) });
        }
        let send = cuda::alloc(send_bytes.max(1)).map_err(|e| e.msg)?;
        let recv = cuda::alloc(recv_bytes.max(1)).map_err(|e| {
            let _ = cuda::free(send);
            e.msg
        })?;
        Ok(DeviceBufs { send, recv, stream, vmm: None })
    }
}

impl Drop for DeviceBufs {
    fn drop(&mut self) {
        if self.vmm.is_none() {
            let _ = cuda::free(self.send);
            let _ = cuda::free(self.recv);
        }
    }
}

fn region(p: *mut c_void, len: usize) -> Region {
    // SAFETY: p is one of our own allocations of at least len bytes (host or device).
    Region::user(unsafe { UserPtr::new(p as *const u8) }, 0, len)
}

/// One rank of this process: its communicator and buffers. With `--device 1` the calls use
/// the device buffers; the host ones then stage the checker's inputs and outputs.
pub struct Rank {
    pub comm: ncclComm_t,
    pub rank: usize,
    pub send: Buf,
    pub recv: Buf,
    pub dev: Option<DeviceBufs>,
    /// `-G`: the call of the size and mode being measured, captured on the rank's stream.
    pub graph: Option<cuda::GraphExec>,
    /// `-o premulsum`: the reduction this communicator created.
    pub premul: Option<ncclRedOp_t>,
}

impl Rank {
    /// Device mode: the host buffers' contents to the device (before a checked call).
    pub fn upload(&self) -> Result<(), String> {
        let Some(d) = &self.dev else { return Ok(()) };
        let (s, r) = (region(self.send.ptr.cast(), self.send.len), region(self.recv.ptr.cast(), self.recv.len));
        d.stream.copy(region(d.send, self.send.len), s).map_err(|e| e.msg)?;
        d.stream.copy(region(d.recv, self.recv.len), r).map_err(|e| e.msg)?;
        d.stream.synchronize().map_err(|e| e.msg)
    }
    /// Device mode: the device buffers' contents back to the host ones (after a checked call).
    pub fn download(&self) -> Result<(), String> {
        let Some(d) = &self.dev else { return Ok(()) };
        let (s, r) = (region(self.send.ptr.cast(), self.send.len), region(self.recv.ptr.cast(), self.recv.len));
        d.stream.copy(s, region(d.send, self.send.len)).map_err(|e| e.msg)?;
        d.stream.copy(r, region(d.recv, self.recv.len)).map_err(|e| e.msg)?;
        d.stream.synchronize().map_err(|e| e.msg)
    }
}

/// Device mode: the device-to-device copy bandwidth at `bytes` on this rank's stream (its send
/// buffer into its receive buffer, `cuMemcpyAsync`), as bytes over time in GB/s: what the
/// tables stand beside, measured in the same run on the same device. None without device
/// buffers.
pub fn copy_gbps(r: &Rank, bytes: usize) -> Result<Option<f64>, String> {
    let Some(d) = &r.dev else { return Ok(None) };
    let len = bytes.min(r.send.len).min(r.recv.len);
    if len == 0 {
        return Ok(None);
    }
    let (dst, src) = (region(d.recv, len), region(d.send, len));
    let times = ((1usize << 30) / len).clamp(3, 20);
    d.stream.copy(dst, src).map_err(|e| e.msg)?;
    d.stream.synchronize().map_err(|e| e.msg)?;
    let t0 = std::time::Instant::now();
    for _ in 0..times {
        d.stream.copy(dst, src).map_err(|e| e.msg)?;
    }
    d.stream.synchronize().map_err(|e| e.msg)?;
    Ok(Some((len * times) as f64 / t0.elapsed().as_secs_f64() / 1e9))
}

/// Create this process's `local` communicators of an `n`-rank job and their buffers.
pub fn init_ranks(o: &Opts, proc_index: usize, nprocs: usize, send_bytes: usize, recv_bytes: usize)
                  -> Result<Vec<Rank>, String> {
    let local = o.threads;
    let n = nprocs * local;
    let mut comms: Vec<ncclComm_t> = vec![null_mut(); local];
    let pending = if o.nonblocking {
        // ncclCommInitAll takes no config: every rank joins through ncclCommInitRankConfig.
        let mut config = ncclConfig_t::INITIALIZER;
        config.blocking = 0;
        let mut id = ncclUniqueId { internal: [0; 128] };
        check(ncclGetUniqueId(&mut id), "ncclGetUniqueId (NCCL_COMM_ID must be set for several processes)")?;
        check(ncclGroupStart(), "ncclGroupStart")?;
        for (l, c) in comms.iter_mut().enumerate() {
            check_pending(ncclCommInitRankConfig(c, n as i32, id, (proc_index * local + l) as i32, &mut config),
                          "ncclCommInitRankConfig")?;
        }
        check_pending(ncclGroupEnd(), "ncclGroupEnd")?
    } else if nprocs == 1 {
        // Device buffers: every rank on device 0 (nccl-rs lets ranks share a GPU); host
        // buffers: NCCL's default device list.
        let zeros = vec![0i32; local];
        let devs = if o.device { zeros.as_ptr() } else { std::ptr::null() };
        check_pending(ncclCommInitAll(comms.as_mut_ptr(), local as i32, devs), "ncclCommInitAll")?
    } else {
        let mut id = ncclUniqueId { internal: [0; 128] };
        check(ncclGetUniqueId(&mut id), "ncclGetUniqueId (NCCL_COMM_ID must be set for several processes)")?;
        check(ncclGroupStart(), "ncclGroupStart")?;
        for (l, c) in comms.iter_mut().enumerate() {
            check_pending(ncclCommInitRank(c, n as i32, id, (proc_index * local + l) as i32), "ncclCommInitRank")?;
        }
        check_pending(ncclGroupEnd(), "ncclGroupEnd")?
    };
    // (NCCL_COMM_BLOCKING=0 makes communicators without a config nonblocking too.)
    if pending {
        settle(comms.iter().copied(), "communicator initialisation")?;
    }
    comms.into_iter().enumerate().map(|(l, comm)| Ok(Rank {
        comm,
        rank: proc_index * local + l,
        send: Buf::new(send_bytes, 1),
        recv: Buf::new(recv_bytes, 0),
        dev: if o.device { Some(DeviceBufs::new(send_bytes, recv_bytes, o.vmm, o.private)?) } else { None },
        graph: None,
        premul: if o.op.id == PREMULSUM { Some(premul_of_one(o, comm)?) } else { None },
    })).collect()
}

/// A PreMulSum of `comm` with the host-immediate scalar 1 in `-d`'s datatype.
fn premul_of_one(o: &Opts, comm: ncclComm_t) -> Result<ncclRedOp_t, String> {
    // ncclDataType_t: int8 uint8 int32 uint32 int64 uint64 half float double bfloat16 f8e4m3 f8e5m2.
    let one: u64 = match o.dtype.id {
        6 => 0x3c00,
        7 => 0x3f80_0000,
        8 => 0x3ff0_0000_0000_0000,
        9 => 0x3f80,
        10 => 0x38,
        11 => 0x3c,
        _ => 1,
    };
    let mut bytes = one.to_le_bytes();
    let mut op = ncclRedOp_t(0);
    check(ncclRedOpCreatePreMulSum(&mut op, bytes.as_mut_ptr().cast(), ncclDataType_t(o.dtype.id),
                                   ncclScalarResidence_t(1), comm), "ncclRedOpCreatePreMulSum")?;
    Ok(op)
}

pub fn destroy(ranks: Vec<Rank>) -> Result<(), String> {
    for r in ranks {
        if let Some(op) = r.premul {
            check(ncclRedOpDestroy(op, r.comm), "ncclRedOpDestroy")?;
        }
        // A nonblocking communicator is finalized first, as NCCL documents (a blocking one's
        // ncclCommFinalize returns when it is done).
        if check_pending(ncclCommFinalize(r.comm), "ncclCommFinalize")? {
            settle([r.comm], "ncclCommFinalize")?;
        }
        check(ncclCommDestroy(r.comm), "ncclCommDestroy")?;
    }
    Ok(())
}

/// Where a rank's input and output live: (buffer is `recv`, byte offset) for each, as
/// nccl-tests places them out of place and in place.
pub fn regions(c: Coll, rank: usize, count: usize, es: usize, in_place: bool) -> ((bool, usize), (bool, usize)) {
    if !in_place {
        return ((false, 0), (true, 0));
    }
    match c {
        Coll::AllGather | Coll::Gather => ((true, rank * count * es), (true, 0)),
        Coll::ReduceScatter | Coll::Scatter => ((false, 0), (false, rank * count * es)),
        _ => ((true, 0), (true, 0)),
    }
}

fn issue(o: &Opts, r: &mut Rank, n: usize, count: usize, in_place: bool) -> ncclResult_t {
    let dt = ncclDataType_t(o.dtype.id);
    let op = r.premul.unwrap_or(ncclRedOp_t(o.op.id));
    let ((sin, soff), (rin, roff)) = regions(o.coll, r.rank, count, o.dtype.size, in_place);
    let (sp, rp, s): (*const c_void, *mut c_void, cudaStream_t) = match &r.dev {
        None => {
            let sp = if sin { r.recv.at(soff) } else { r.send.at(soff) } as *const c_void;
            (sp, if rin { r.recv.at(roff) } else { r.send.at(roff) }, null_mut())
        }
        Some(d) => {
            let at = |p: *mut c_void, off: usize| (p as usize + off) as *mut c_void;
            let sp = if sin { at(d.recv, soff) } else { at(d.send, soff) } as *const c_void;
            (sp, if rin { at(d.recv, roff) } else { at(d.send, roff) }, d.stream.raw() as cudaStream_t)
        }
    };
    match o.coll {
        Coll::AllReduce => ncclAllReduce(sp, rp, count, dt, op, r.comm, s),
        Coll::AllGather => ncclAllGather(sp, rp, count, dt, r.comm, s),
        Coll::ReduceScatter => ncclReduceScatter(sp, rp, count, dt, op, r.comm, s),
        Coll::Broadcast => ncclBroadcast(sp, rp, count, dt, o.root, r.comm, s),
        Coll::Reduce => ncclReduce(sp, rp, count, dt, op, o.root, r.comm, s),
        Coll::AlltoAll => ncclAlltoAll(sp, rp, count, dt, r.comm, s),
        Coll::Gather => ncclGather(sp, rp, count, dt, o.root, r.comm, s),
        Coll::Scatter => ncclScatter(sp, rp, count, dt, o.root, r.comm, s),
        Coll::SendRecv => {
            let (to, from) = ((r.rank + 1) % n, (r.rank + n - 1) % n);
            let g = ncclGroupStart();
            if g.0 != 0 {
                return g;
            }
            let a = ncclSend(sp, count, dt, to as i32, r.comm, s);
            let b = ncclRecv(rp, count, dt, from as i32, r.comm, s);
            let e = ncclGroupEnd();
            if a.0 != 0 { a } else if b.0 != 0 { b } else { e }
        }
    }
}

/// Run one call on every local rank (in one group when there are several, as nccl-tests does).
/// Returns the seconds the calling thread spent in the calls (with device buffers, the calls
/// only queue the work: what an application's thread pays before it can go on).
pub fn step(o: &Opts, ranks: &mut [Rank], n: usize, count: usize, in_place: bool) -> Result<f64, String> {
    if ranks.iter().any(|r| r.graph.is_some()) {
        return launch(o, ranks, o.graph);
    }
    // (Timed only where the time in the calls is shown, with device buffers or nonblocking
    // communicators: in host mode the two clock reads were inside every timed iteration.)
    let t0 = (o.device || o.nonblocking).then(std::time::Instant::now);
    let pending = issue_all(o, ranks, n, count, in_place)?;
    let in_calls = t0.map_or(0.0, |t| t.elapsed().as_secs_f64());
    if pending {
        settle(ranks.iter().map(|r| r.comm), o.coll.name())?;
    }
    sync_all(o, ranks)?;
    Ok(in_calls)
}

/// One call per local rank, in one group when there are several (as nccl-tests does).
/// Whether some call returned `ncclInProgress` (nonblocking communicators): see [`settle`].
fn issue_all(o: &Opts, ranks: &mut [Rank], n: usize, count: usize, in_place: bool) -> Result<bool, String> {
    let grouped = ranks.len() > 1;
    if grouped {
        check(ncclGroupStart(), "ncclGroupStart")?;
    }
    let mut pending = false;
    for r in ranks.iter_mut() {
        pending |= check_pending(issue(o, r, n, count, in_place), o.coll.name())?;
    }
    if grouped {
        pending |= check_pending(ncclGroupEnd(), "ncclGroupEnd")?;
    }
    Ok(pending)
}

/// Device mode: a call has finished when its stream has.
fn sync_all(o: &Opts, ranks: &[Rank]) -> Result<(), String> {
    for d in ranks.iter().filter_map(|r| r.dev.as_ref()) {
        d.stream.synchronize().map_err(|e| format!("{}: cuStreamSynchronize: {}", o.coll.name(), e.msg))?;
    }
    Ok(())
}

/// `-G`: every local rank's call captured into a graph on its stream (as `torch.cuda.graph`
/// captures: the whole group, each rank's stream its own capture). Dropped with the ranks'
/// `graph` (see [`release_graphs`]).
pub fn capture(o: &Opts, ranks: &mut [Rank], n: usize, count: usize, in_place: bool) -> Result<(), String> {
    let what = |e: nccl::error::Error| format!("-G: {}", e.msg);
    let mut begun = 0;
    let mut issued = Ok(());
    for d in ranks.iter().filter_map(|r| r.dev.as_ref()) {
        match d.stream.begin_capture() {
            Ok(()) => begun += 1,
            Err(e) => {
                issued = Err(what(e));
                break;
            }
        }
    }
    if issued.is_ok() {
        issued = issue_all(o, ranks, n, count, in_place).and_then(|pending| match pending {
            true => settle(ranks.iter().map(|r| r.comm), o.coll.name()),
            false => Ok(()),
        });
    }
    // Every capture begun ends, whatever happened: a stream left capturing would break the rest.
    let mut ended = Ok(());
    for r in ranks.iter_mut().filter(|r| r.dev.is_some()).take(begun) {
        if let Some(d) = &r.dev {
            match d.stream.end_capture() {
                Ok(g) => r.graph = Some(g),
                Err(e) => ended = ended.and(Err(what(e))),
            }
        }
    }
    issued.and(ended).inspect_err(|_| release_graphs(ranks))
}

pub fn release_graphs(ranks: &mut [Rank]) {
    ranks.iter_mut().for_each(|r| r.graph = None);
}

/// The call whose results are checked: one call, or (`-G`) one launch of its graph (an in-place
/// call run twice would not give what one gives).
pub fn checked_step(o: &Opts, ranks: &mut [Rank], n: usize, count: usize, in_place: bool) -> Result<f64, String> {
    if ranks.iter().any(|r| r.graph.is_some()) {
        return launch(o, ranks, 1);
    }
    step(o, ranks, n, count, in_place)
}

/// `times` launches of every rank's graph, then their streams synchronised; the seconds the
/// calling thread spent launching, per launch.
fn launch(o: &Opts, ranks: &mut [Rank], times: usize) -> Result<f64, String> {
    let t0 = std::time::Instant::now();
    for _ in 0..times {
        for r in ranks.iter() {
            if let (Some(g), Some(d)) = (&r.graph, &r.dev) {
                g.launch(&d.stream).map_err(|e| format!("-G: {}", e.msg))?;
            }
        }
    }
    let in_calls = t0.elapsed().as_secs_f64() / times.max(1) as f64;
    sync_all(o, ranks)?;
    Ok(in_calls)
}

/// In-place allreduce of `len` elements of every local rank's buffer `bufs[l]`.
fn allreduce_each<T>(ranks: &[Rank], bufs: &mut [Vec<T>], dt: ncclDataType_t, op: ncclRedOp_t, what: &str)
                     -> Result<(), String> {
    let grouped = ranks.len() > 1;
    if grouped {
        check(ncclGroupStart(), "ncclGroupStart")?;
    }
    let mut pending = false;
    for (r, b) in ranks.iter().zip(bufs.iter_mut()) {
        let p = b.as_mut_ptr() as *mut c_void;
        pending |= check_pending(ncclAllReduce(p, p, b.len(), dt, op, r.comm, null_mut()), what)?;
    }
    if grouped {
        pending |= check_pending(ncclGroupEnd(), "ncclGroupEnd")?;
    }
    if pending {
        settle(ranks.iter().map(|r| r.comm), what)?;
    }
    Ok(())
}

/// Every rank waits for all others: a one-element allreduce, the tool's MPI_Barrier.
pub fn barrier(ranks: &[Rank]) -> Result<(), String> {
    let mut bufs = vec![vec![0u64; 1]; ranks.len()];
    allreduce_each(ranks, &mut bufs, UINT64, SUM, "barrier (ncclAllReduce)")
}

/// Element-wise max over all ranks of this process's per-iteration times.
pub fn max_over_ranks(ranks: &[Rank], times: &[f64]) -> Result<Vec<f64>, String> {
    let mut bufs = vec![times.to_vec(); ranks.len()];
    allreduce_each(ranks, &mut bufs, FLOAT64, MAX, "max of times (ncclAllReduce)")?;
    Ok(bufs.swap_remove(0))
}

/// Sum over all ranks of one count per local rank.
pub fn sum_over_ranks(ranks: &[Rank], local: &[u64]) -> Result<u64, String> {
    let mut bufs: Vec<Vec<u64>> = local.iter().map(|&v| vec![v]).collect();
    allreduce_each(ranks, &mut bufs, UINT64, SUM, "sum of errors (ncclAllReduce)")?;
    Ok(bufs[0][0])
}
