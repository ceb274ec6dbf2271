//! CUDA mode's device layer (`nccl::device::cuda`) against a driver: the stand-in libcuda of
//! `tests/cuda-stub/` always, and the machine's real driver too where one loads (a GPU machine).
//!
//! cudarc loads libcuda once per process, so every check runs in a child process: this test
//! binary again, filtered to the one test, with `NCCL_RS_CUDA_LAYER_CHILD` naming it and
//! `LD_LIBRARY_PATH` pointing at the stub (built once per run with `cc`, into
//! `<target>/cuda-stub/`). In the child, the same test function finds the variable set and runs
//! the check itself. Waits have deadlines; nothing sleeps to let work happen.

mod common;

use std::ffi::c_void;
use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use nccl::device::cuda::{self, Context, Desc, Event, Indirect, IpcHandle, IpcMapping, MappedHost, MemOp, PtrKind, Segment,
                         Stream, VmmMapping, WaitCond};
use nccl::transport::fdpass::{self, Address};
use nccl::device::host::{self, ElemOp, Region, UserPtr};
use nccl::device::mode::{self, Mode};
use nccl::types::{DataType, Scalar};
use nccl::Code;

const CHILD: &str = "NCCL_RS_CUDA_LAYER_CHILD";
const EXPECT_DEVICES: &str = "NCCL_RS_TEST_EXPECT_DEVICES";
const CASE: &str = "NCCL_RS_TEST_CASE";
const DRIVER: &str = "NCCL_RS_TEST_DRIVER";
const IPC_HANDLE: &str = "NCCL_RS_TEST_IPC_HANDLE";
const VMM_SEGMENTS: &str = "NCCL_RS_TEST_VMM_SEGMENTS";
const DEADLINE: Duration = Duration::from_secs(20);
const CHILD_DEADLINE: Duration = Duration::from_secs(300);

// ---- harness ---------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq)]
enum Driver {
    /// tests/cuda-stub, with its environment knobs.
    Stub,
    /// Whatever libcuda the machine has (none on most development machines).
    System,
}

fn stub_dir() -> &'static Path {
    common::cuda_stub_dir()
}

/// The drivers every check runs against: the stub, and the system's driver if it has one.
fn drivers() -> Vec<Driver> {
    match mode::current() {
        Mode::Cuda { .. } => vec![Driver::Stub, Driver::System],
        Mode::Host => vec![Driver::Stub],
    }
}

/// In a child: whether it runs against the stub (else the system's driver).
fn on_stub() -> bool {
    std::env::var_os(DRIVER).is_some()
}

/// In the child process of `name`: runs `body` and returns true. Otherwise false.
fn in_child(name: &str, body: fn()) -> bool {
    if std::env::var(CHILD).as_deref() != Ok(name) {
        return false;
    }
    body();
    true
}

/// Runs the test `name` in a child process against `driver`, with `env`; panics with its output
/// unless it passed.
fn run_child(name: &str, driver: Driver, env: &[(&str, &str)]) {
    run_child_output(name, driver, env);
}

/// [`run_child`], returning the child's output.
fn run_child_output(name: &str, driver: Driver, env: &[(&str, &str)]) -> String {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([name, "--exact", "--nocapture", "--test-threads=1"]).env(CHILD, name);
    // The system's driver is found as the environment says (LD_LIBRARY_PATH, the loader's cache).
    if driver == Driver::Stub {
        cmd.env("LD_LIBRARY_PATH", stub_dir()).env(DRIVER, "stub");
    }
    cmd.envs(env.iter().copied());
    let (ok, output) = run_with_deadline(cmd, CHILD_DEADLINE);
    let ran = output.contains(&format!("test {name} ... ok"));
    assert!(ok && ran, "{name} against {driver:?} {env:?} failed:\n{output}");
    output
}

/// Runs `cmd`, killing it after `deadline`; (exited 0, stdout + stderr).
fn run_with_deadline(mut cmd: Command, deadline: Duration) -> (bool, String) {
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawning a child");
    let pipes = [
        child.stdout.take().map(|p| Box::new(p) as Box<dyn Read + Send>),
        child.stderr.take().map(|p| Box::new(p) as _),
    ];
    let readers: Vec<_> = pipes
        .into_iter()
        .flatten()
        .map(|mut p| {
            std::thread::spawn(move || {
                let mut s = String::new();
                let _ = p.read_to_string(&mut s);
                s
            })
        })
        .collect();
    let end = Instant::now() + deadline;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let output: String = readers.into_iter().map(|r| r.join().unwrap()).collect();
    match status {
        Some(s) => (s.success(), output),
        None => (false, format!("killed after {deadline:?}\n{output}")),
    }
}

/// Polls `done` until it is true; panics with `what` after the deadline.
fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let end = Instant::now() + DEADLINE;
    while !done() {
        assert!(Instant::now() < end, "{what}: not done after {DEADLINE:?}");
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// `stream` is still busy after `window` (work behind an unsatisfied wait must not run).
fn stays_busy(stream: &Stream, window: Duration) -> bool {
    let end = Instant::now() + window;
    while Instant::now() < end {
        if stream.query().unwrap() {
            return false;
        }
        std::thread::yield_now();
    }
    true
}

/// Device memory of the current context, freed on drop.
struct DeviceBuf {
    ptr: *mut c_void,
    len: usize,
}

impl DeviceBuf {
    fn new(len: usize) -> DeviceBuf {
        DeviceBuf { ptr: cuda::alloc(len).unwrap(), len }
    }
    fn region(&self) -> Region {
        device_region(self.ptr as usize, self.len)
    }
}

impl Drop for DeviceBuf {
    fn drop(&mut self) {
        cuda::free(self.ptr).unwrap();
    }
}

fn device_region(addr: usize, len: usize) -> Region {
    // SAFETY: tests only name memory they allocated, for its length.
    Region::user(unsafe { UserPtr::new(addr as *const u8) }, 0, len)
}

fn host_region(v: &mut [u8]) -> Region {
    Region::owned(v)
}

/// Copies `src` (device) to a new host vector, synchronously.
fn download(stream: &Stream, src: Region) -> Vec<u8> {
    let mut out = vec![0u8; src.len()];
    stream.copy(host_region(&mut out), src).unwrap();
    stream.synchronize().unwrap();
    out
}

fn upload(stream: &Stream, dst: Region, mut data: Vec<u8>) {
    stream.copy(dst, host_region(&mut data)).unwrap();
    stream.synchronize().unwrap();
}

// ---- mode and contexts -----------------------------------------------------------------------

#[test]
fn mode_is_cuda_with_a_driver_and_host_without() {
    if in_child("mode_is_cuda_with_a_driver_and_host_without", check_mode) {
        return;
    }
    run_child(
        "mode_is_cuda_with_a_driver_and_host_without",
        Driver::Stub,
        &[("NCCL_RS_STUB_DEVICES", "2"), (EXPECT_DEVICES, "2")],
    );
    // cuInit fails (CUDA_ERROR_NO_DEVICE): host mode.
    run_child(
        "mode_is_cuda_with_a_driver_and_host_without",
        Driver::Stub,
        &[("NCCL_RS_STUB_DEVICES", "0"), (EXPECT_DEVICES, "0")],
    );
    // No stub: host mode, unless this machine has a driver of its own.
    let devices = match mode::current() {
        Mode::Cuda { devices } => devices,
        Mode::Host => 0,
    };
    run_child("mode_is_cuda_with_a_driver_and_host_without", Driver::System, &[(EXPECT_DEVICES, &devices.to_string())]);
}

fn check_mode() {
    let expect: i32 = std::env::var(EXPECT_DEVICES).unwrap().parse().unwrap();
    if expect > 0 {
        assert_eq!(mode::current(), Mode::Cuda { devices: expect });
        assert_eq!(cuda::device_count().unwrap(), expect);
        return;
    }
    assert_eq!(mode::current(), Mode::Host);
    // Without a driver every entry point is an error, never a panic reaching the caller.
    let no_driver = |e: nccl::Error| assert_eq!(e.code, Code::UnhandledCudaError, "{e}");
    no_driver(cuda::device_count().unwrap_err());
    no_driver(cuda::current_device().unwrap_err());
    no_driver(Context::primary(0).err().unwrap());
    no_driver(cuda::alloc(4096).unwrap_err());
    no_driver(cuda::classify(&expect as *const i32 as usize).unwrap_err());
    no_driver(MappedHost::new(64).err().unwrap());
}

#[test]
fn primary_contexts_and_the_current_device() {
    if in_child("primary_contexts_and_the_current_device", check_contexts) {
        return;
    }
    for driver in drivers() {
        run_child("primary_contexts_and_the_current_device", driver, &[("NCCL_RS_STUB_DEVICES", "3")]);
    }
}

fn check_contexts() {
    let n = cuda::device_count().unwrap();
    assert_eq!(cuda::current_device().unwrap(), None, "no context is current before we make one");
    let ctx0 = Context::primary(0).unwrap();
    assert_eq!(ctx0.ordinal(), 0);
    assert_eq!(cuda::current_device().unwrap(), Some(0));
    assert!(std::ptr::eq(Context::primary(0).unwrap(), ctx0), "one Context per device");
    std::thread::spawn(move || {
        assert_eq!(cuda::current_device().unwrap(), None, "a new thread has no current context");
        ctx0.make_current().unwrap();
        assert_eq!(cuda::current_device().unwrap(), Some(0));
        let last = Context::primary(n - 1).unwrap();
        assert_eq!((last.ordinal(), cuda::current_device().unwrap()), (n - 1, Some(n - 1)));
    })
    .join()
    .unwrap();
    assert_eq!(cuda::current_device().unwrap(), Some(0), "other threads leave ours alone");
    assert_eq!(Context::primary(n).err().unwrap().code, Code::InvalidArgument);
}

// ---- streams, events, stream memory operations -----------------------------------------------

#[test]
fn streams_order_copies_memsets_and_events() {
    if in_child("streams_order_copies_memsets_and_events", check_streams) {
        return;
    }
    for driver in drivers() {
        run_child("streams_order_copies_memsets_and_events", driver, &[]);
    }
}

fn check_streams() {
    let ctx = Context::primary(0).unwrap();
    let (s1, s2) = (Stream::new(ctx).unwrap(), Stream::new(ctx).unwrap());
    const LEN: usize = 1 << 20;
    let bufs: Vec<DeviceBuf> = (0..3).map(|_| DeviceBuf::new(LEN)).collect();
    let pattern: Vec<u8> = (0..LEN).map(|i| (i * 7 + i / 251) as u8).collect();

    // d0 -> d1 on s1, held at a gate the host opens; s2 waits for s1's event, then d1 -> d2.
    upload(&s1, bufs[0].region(), pattern.clone());
    let gate = MappedHost::new(4).unwrap();
    assert_eq!(s1.wait_value32(&gate, 0, 1, WaitCond::Geq).unwrap(), MemOp::Enqueued);
    s1.copy(bufs[1].region(), bufs[0].region()).unwrap();
    let ev = Event::new(ctx).unwrap();
    ev.record(&s1).unwrap();
    s2.wait_event(&ev).unwrap();
    s2.copy(bufs[2].region(), bufs[1].region()).unwrap();
    assert!(stays_busy(&s2, Duration::from_millis(50)), "s2 ran ahead of the event it waits for");
    assert!(!ev.query().unwrap());
    gate.word(0).store(1, Ordering::Release);
    s2.synchronize().unwrap();
    assert!(ev.query().unwrap() && s1.query().unwrap() && s2.query().unwrap());
    ev.synchronize().unwrap();
    assert_eq!(download(&s2, bufs[2].region()), pattern, "the chain across two streams");

    // A memset, then a copy of part of it, in order on one stream.
    s1.memset(bufs[0].region(), 0xab).unwrap();
    s1.copy(bufs[1].region().sub(100, 1000), bufs[0].region().sub(5000, 1000)).unwrap();
    let got = download(&s1, bufs[1].region());
    assert!(got[100..1100].iter().all(|&b| b == 0xab));
    assert_eq!(got[..100], pattern[..100]);
    assert_eq!(got[1100..], pattern[1100..]);

    // The caller's legacy NULL stream, wrapped.
    // SAFETY: NULL is the legacy stream of the current context, always alive.
    let legacy = unsafe { Stream::wrap(ctx, std::ptr::null_mut()) };
    legacy.memset(bufs[2].region(), 0x11).unwrap();
    assert!(download(&legacy, bufs[2].region()).iter().all(|&b| b == 0x11));

    // An event never recorded is complete, and waiting for it is a no-op.
    let fresh = Event::new(ctx).unwrap();
    assert!(fresh.query().unwrap());
    s1.wait_event(&fresh).unwrap();
    s1.synchronize().unwrap();

    // A stream dropped with work pending finishes it (the driver releases it afterwards).
    let s3 = Stream::new(ctx).unwrap();
    s3.memset(bufs[0].region(), 0x22).unwrap();
    ev.record(&s3).unwrap();
    drop(s3);
    ev.synchronize().unwrap();
    assert!(download(&s1, bufs[0].region()).iter().all(|&b| b == 0x22));
}

#[test]
fn wait_value_holds_a_stream_until_a_write_value_releases_it() {
    if in_child("wait_value_holds_a_stream_until_a_write_value_releases_it", check_wait_value) {
        return;
    }
    for driver in drivers() {
        run_child("wait_value_holds_a_stream_until_a_write_value_releases_it", driver, &[]);
    }
}

fn check_wait_value() {
    let ctx = Context::primary(0).unwrap();
    let (s1, s2) = (Stream::new(ctx).unwrap(), Stream::new(ctx).unwrap());
    let flags = MappedHost::new(64).unwrap();
    let (a, b) = (DeviceBuf::new(4096), DeviceBuf::new(4096));
    s2.memset(a.region(), 1).unwrap();
    s2.memset(b.region(), 2).unwrap();
    s2.synchronize().unwrap();

    // s1: wait word 0 >= 1, copy a -> b, record, write word 1 = 7.
    assert_eq!(s1.wait_value32(&flags, 0, 1, WaitCond::Geq).unwrap(), MemOp::Enqueued);
    s1.copy(b.region(), a.region()).unwrap();
    let ev = Event::new(ctx).unwrap();
    ev.record(&s1).unwrap();
    assert_eq!(s1.write_value32(&flags, 1, 7).unwrap(), MemOp::Enqueued);
    // Another stream makes progress meanwhile, and changes a before the release.
    s2.memset(a.region(), 0x5c).unwrap();
    s2.synchronize().unwrap();
    assert!(stays_busy(&s1, Duration::from_millis(50)), "work behind an unsatisfied wait ran");
    assert!(!ev.query().unwrap());
    assert_eq!(flags.word(1).load(Ordering::Acquire), 0);
    // Released from another stream, in its order.
    assert_eq!(s2.write_value32(&flags, 0, 1).unwrap(), MemOp::Enqueued);
    wait_until("s1 after the release", || s1.query().unwrap());
    assert!(ev.query().unwrap());
    assert_eq!(flags.word(1).load(Ordering::Acquire), 7);
    assert!(download(&s2, b.region()).iter().all(|&x| x == 0x5c), "the copy ran after the wait");

    // Released by the host, for each condition: (word, initial, value, cond, a value that does
    // not release, one that does).
    let cases = [
        (2, 0, 5, WaitCond::Eq, 4, 5),
        (3, 0, 0b100, WaitCond::And, 0b011, 0b110),
        (4, u32::MAX, 0xffff_fff0, WaitCond::Nor, 0xffff_fff1 | 0xe, 0xffff_fffe),
        (5, 0, 10, WaitCond::Geq, 9, 11),
    ];
    for (word, initial, value, cond, not_yet, release) in cases {
        flags.word(word).store(initial, Ordering::Release);
        match s1.wait_value32(&flags, word, value, cond).unwrap() {
            MemOp::Enqueued => {}
            // A real device may lack NOR (CAN_USE_STREAM_WAIT_VALUE_NOR_V2); the stub has it.
            MemOp::Unsupported if cond == WaitCond::Nor && !on_stub() => continue,
            MemOp::Unsupported => panic!("{cond:?} unsupported"),
        }
        s1.memset(a.region(), word as u8).unwrap();
        assert!(stays_busy(&s1, Duration::from_millis(20)), "{cond:?} released by {initial:#x}");
        flags.word(word).store(not_yet, Ordering::Release);
        assert!(stays_busy(&s1, Duration::from_millis(20)), "{cond:?} released by {not_yet:#x}");
        flags.word(word).store(release, Ordering::Release);
        wait_until(&format!("{cond:?} released by {release:#x}"), || s1.query().unwrap());
    }
    // GEQ is a cyclic comparison: 1 is "after" 0xfffffffe.
    flags.word(6).store(1, Ordering::Release);
    assert_eq!(s1.wait_value32(&flags, 6, 0xffff_fffe, WaitCond::Geq).unwrap(), MemOp::Enqueued);
    wait_until("GEQ across the wrap", || s1.query().unwrap());

    // A word outside the buffer is an error, not a wild write.
    assert!(s1.write_value32(&flags, 16, 1).is_err());
}

#[test]
fn stream_memory_operations_report_unsupported_drivers() {
    if in_child("stream_memory_operations_report_unsupported_drivers", check_mem_ops_unsupported) {
        return;
    }
    let name = "stream_memory_operations_report_unsupported_drivers";
    run_child(name, Driver::Stub, &[("NCCL_RS_STUB_DRIVER_VERSION", "11060"), (CASE, "old")]);
    run_child(name, Driver::Stub, &[("NCCL_RS_STUB_WAIT_VALUE_NOR", "0"), (CASE, "no-nor")]);
}

fn check_mem_ops_unsupported() {
    let ctx = Context::primary(0).unwrap();
    let s = Stream::new(ctx).unwrap();
    let flags = MappedHost::new(16).unwrap();
    if std::env::var(CASE).unwrap() == "old" {
        // Before CUDA 11.7 there are no v2 stream memory operations: fall back to events.
        assert_eq!(s.wait_value32(&flags, 0, 1, WaitCond::Geq).unwrap(), MemOp::Unsupported);
        assert_eq!(s.write_value32(&flags, 0, 1).unwrap(), MemOp::Unsupported);
    } else {
        assert_eq!(s.wait_value32(&flags, 0, 0, WaitCond::Nor).unwrap(), MemOp::Unsupported);
        assert_eq!(s.wait_value32(&flags, 0, 0, WaitCond::Geq).unwrap(), MemOp::Enqueued);
        assert_eq!(s.write_value32(&flags, 0, 1).unwrap(), MemOp::Enqueued);
    }
    s.synchronize().unwrap();
}

// ---- memory ----------------------------------------------------------------------------------

#[test]
fn pointers_are_classified_by_kind() {
    if in_child("pointers_are_classified_by_kind", check_classify) {
        return;
    }
    for driver in drivers() {
        run_child("pointers_are_classified_by_kind", driver, &[("NCCL_RS_STUB_DEVICES", "2")]);
    }
}

fn check_classify() {
    let ctx = Context::primary(0).unwrap();
    let dev = DeviceBuf::new(1 << 16);
    assert_eq!(cuda::classify(dev.ptr as usize).unwrap(), PtrKind::Device { ordinal: 0 });
    assert_eq!(cuda::classify(dev.ptr as usize + 1000).unwrap(), PtrKind::Device { ordinal: 0 }, "inside");
    if cuda::device_count().unwrap() > 1 {
        Context::primary(1).unwrap();
        let dev1 = DeviceBuf::new(4096);
        assert_eq!(cuda::classify(dev1.ptr as usize).unwrap(), PtrKind::Device { ordinal: 1 });
        ctx.make_current().unwrap();
    }
    let mapped = MappedHost::new(4096).unwrap();
    assert_eq!(cuda::classify(mapped.host_ptr() as usize).unwrap(), PtrKind::HostRegistered);
    assert_eq!(cuda::classify(mapped.device_addr()).unwrap(), PtrKind::HostRegistered);
    let mut managed = 0;
    // SAFETY: a valid out-pointer; a context is current. Freed below.
    let r = unsafe { cudarc::driver::sys::cuMemAllocManaged(&mut managed, 4096, 1) };
    assert_eq!(r, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
    assert_eq!(cuda::classify(managed as usize).unwrap(), PtrKind::Managed);
    cuda::free(managed as *mut c_void).unwrap();
    let heap = vec![0u8; 4096];
    let stack = 0u64;
    assert_eq!(cuda::classify(heap.as_ptr() as usize).unwrap(), PtrKind::Host);
    assert_eq!(cuda::classify(&stack as *const u64 as usize).unwrap(), PtrKind::Host);
}

#[test]
fn ipc_handles_map_the_same_bytes_in_another_process() {
    if in_child("ipc_handles_map_the_same_bytes_in_another_process", check_ipc) {
        return;
    }
    for driver in drivers() {
        run_child("ipc_handles_map_the_same_bytes_in_another_process", driver, &[]);
    }
}

const IPC_LEN: usize = 1 << 20;

/// In a peer process of an IPC test: the handle its owner passed (hex in IPC_HANDLE), if any.
fn ipc_handle_from_env() -> Option<IpcHandle> {
    let hex = std::env::var(IPC_HANDLE).ok()?;
    let bytes: Vec<u8> = (0..64).map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap()).collect();
    Some(IpcHandle { bytes: bytes.try_into().unwrap() })
}

/// Runs this binary's test `name` as a peer process given `handle`; panics unless it passed.
/// Its output.
fn run_ipc_peer(name: &str, handle: &IpcHandle) -> String {
    let hex: String = handle.bytes.iter().map(|b| format!("{b:02x}")).collect();
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([name, "--exact", "--nocapture", "--test-threads=1"]).env(IPC_HANDLE, hex);
    let (ok, output) = run_with_deadline(cmd, CHILD_DEADLINE);
    assert!(ok && output.contains(&format!("test {name} ... ok")), "the peer process failed:\n{output}");
    output
}

fn ipc_pattern(i: usize) -> u8 {
    (i * 13 + (i >> 9)) as u8
}

fn check_ipc() {
    let ctx = Context::primary(0).unwrap();
    let stream = Stream::new(ctx).unwrap();
    if let Some(handle) = ipc_handle_from_env() {
        // The peer: open, read what the owner wrote, write the second half.
        let mapping = IpcMapping::open(&handle).unwrap();
        assert!(matches!(cuda::classify(mapping.addr()).unwrap(), PtrKind::Device { .. }));
        let region = device_region(mapping.addr(), IPC_LEN);
        let got = download(&stream, region);
        assert!(got.iter().enumerate().all(|(i, &b)| b == ipc_pattern(i)), "the peer sees the owner's bytes");
        // A second open of the handle in this context counts a reference and returns the same
        // mapping (the driver's documented behaviour); closing it leaves the first usable.
        let again = IpcMapping::open(&handle).unwrap();
        assert_eq!(again.addr(), mapping.addr(), "a second open maps the allocation again");
        drop(again);
        let got = download(&stream, region);
        assert!(got.iter().enumerate().all(|(i, &b)| b == ipc_pattern(i)), "one close left the other open");
        stream.memset(region.sub(IPC_LEN / 2, IPC_LEN / 2), 0xee).unwrap();
        stream.synchronize().unwrap();
        return;
    }
    // The owner: allocate, write, hand the handle to a second process.
    let buf = DeviceBuf::new(IPC_LEN);
    upload(&stream, buf.region(), (0..IPC_LEN).map(ipc_pattern).collect());
    let handle = IpcHandle::of(buf.ptr).unwrap();
    let own = IpcMapping::open(&handle).err().expect("CUDA refuses to open a handle in its own process");
    assert_eq!(own.code, Code::UnhandledCudaError);
    assert!(own.msg.starts_with("cuIpcOpenMemHandle_v2: CUDA_ERROR_"), "{own}");
    run_ipc_peer("ipc_handles_map_the_same_bytes_in_another_process", &handle);
    let got = download(&stream, buf.region());
    assert!(got[..IPC_LEN / 2].iter().enumerate().all(|(i, &b)| b == ipc_pattern(i)));
    assert!(got[IPC_LEN / 2..].iter().all(|&b| b == 0xee), "the owner sees the peer's write");
}

/// Whether mapping, freeing and unmapping (and, for the record, allocating) return while a
/// stream of the process waits on host memory. CUDA says frees "may perform implicit
/// synchronization". The stream worker maps peers' buffers (`cuIpcOpenMemHandle`, `cuMemMap`)
/// while callers' streams wait for it, which would hang on a driver where those wait: asserted
/// not to. Closes (`cuIpcCloseMemHandle`, `cuMemUnmap`) and frees run off the worker (the
/// closing thread, `cuda::OffThread`; callers' threads), so whether they wait is reported, for
/// the record. Each call is made while a stream is held; a helper lets the stream go after 2 s
/// whatever happens, so the test ends either way. Against the stand-in's model of a driver
/// whose frees synchronize (`NCCL_RS_STUB_FREE_SYNCS=1`) exactly the frees and closes must be
/// seen to wait: the probe can tell.
#[test]
fn maps_and_frees_return_while_a_stream_waits() {
    let name = "maps_and_frees_return_while_a_stream_waits";
    if in_child(name, check_frees) {
        return;
    }
    for driver in drivers() {
        // What each call did, for the record (scripts/device-check.sh keeps the lines).
        let output = run_child_output(name, driver, &[]);
        for line in output.lines().filter(|l| l.starts_with("held-stream probe")) {
            eprintln!("{driver:?} driver: {line}");
        }
    }
    run_child(name, Driver::Stub, &[("NCCL_RS_STUB_FREE_SYNCS", "1"), (CASE, "expect-waits")]);
}

/// How long a probe holds its stream before letting it go.
const HOLD: Duration = Duration::from_secs(2);

/// Runs `call` while `stream` waits on word 0 of `flags` (let go after [`HOLD`] by a helper);
/// whether `call` waited for the stream, printed.
fn waits_for_held_stream(what: &str, stream: &Stream, flags: &MappedHost, call: impl FnOnce()) -> bool {
    flags.word(0).store(0, Ordering::Release);
    assert_eq!(stream.wait_value32(flags, 0, 1, WaitCond::Geq).unwrap(), MemOp::Enqueued);
    let done = std::sync::atomic::AtomicBool::new(false);
    let waited = std::thread::scope(|scope| {
        scope.spawn(|| {
            let end = Instant::now() + HOLD;
            while Instant::now() < end && !done.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(5));
            }
            flags.word(0).store(1, Ordering::Release);
        });
        let t0 = Instant::now();
        call();
        let took = t0.elapsed();
        done.store(true, Ordering::Release);
        took >= HOLD
    });
    stream.synchronize().unwrap();
    // (On stderr: the harness's "test ... ok" line on stdout stays whole.)
    eprintln!("held-stream probe: {what}: {}", if waited { "waited for the held stream" } else { "returned at once" });
    waited
}

fn check_frees() {
    let ctx = Context::primary(0).unwrap();
    let stream = Stream::new(ctx).unwrap();
    let flags = MappedHost::new(64).unwrap();
    let expect_waits = std::env::var(CASE).as_deref() == Ok("expect-waits");
    // Every call seen to wait; those the worker makes while streams may wait for it.
    let mut waited = Vec::new();
    let on_worker = ["cuIpcOpenMemHandle", "cuMemMap"];
    if let Some(handle) = ipc_handle_from_env() {
        // The peer: map and close the owner's allocation while this process's stream waits.
        let mut mapping = None;
        if waits_for_held_stream("cuIpcOpenMemHandle", &stream, &flags, || mapping = Some(IpcMapping::open(&handle).unwrap())) {
            waited.push("cuIpcOpenMemHandle");
        }
        if waits_for_held_stream("cuIpcCloseMemHandle", &stream, &flags, || drop(mapping.take())) {
            waited.push("cuIpcCloseMemHandle");
        }
    } else {
        // Allocations are reported, not asserted: the device scratch and the pinned pool grow
        // on the calling thread, where a wait stalls the call but hangs nothing.
        let mut buf = None;
        waits_for_held_stream("cuMemAlloc", &stream, &flags, || buf = Some(DeviceBuf::new(1 << 20)));
        if waits_for_held_stream("cuMemFree", &stream, &flags, || drop(buf.take())) {
            waited.push("cuMemFree");
        }
        let mut pinned = None;
        waits_for_held_stream("cuMemHostAlloc", &stream, &flags, || pinned = Some(MappedHost::new(1 << 20).unwrap()));
        if waits_for_held_stream("cuMemFreeHost", &stream, &flags, || drop(pinned.take())) {
            waited.push("cuMemFreeHost");
        }
        let mut vmm = None;
        let create = || vmm = Some(cuda::VmmAllocation::new(2 << 20, 2 << 20, false).unwrap());
        if waits_for_held_stream("cuMemCreate, cuMemMap and cuMemSetAccess", &stream, &flags, create) {
            waited.push("cuMemMap");
        }
        if waits_for_held_stream("cuMemUnmap (and release)", &stream, &flags, || drop(vmm.take())) {
            waited.push("cuMemUnmap");
        }
        // A peer process maps an allocation of this one and closes it while its stream waits.
        let shared = DeviceBuf::new(1 << 20);
        let output = run_ipc_peer("maps_and_frees_return_while_a_stream_waits", &IpcHandle::of(shared.ptr).unwrap());
        eprint!("{}", output.lines().filter(|l| l.starts_with("held-stream probe")).map(|l| format!("{l}\n")).collect::<String>());
    }
    if expect_waits {
        let frees: &[&str] = if std::env::var_os(IPC_HANDLE).is_some() {
            &["cuIpcCloseMemHandle"]
        } else {
            &["cuMemFree", "cuMemFreeHost", "cuMemUnmap"]
        };
        assert_eq!(waited, frees, "the model of a driver whose frees (only) synchronize");
    } else {
        let hazards: Vec<&&str> = waited.iter().filter(|w| on_worker.contains(w)).collect();
        assert!(hazards.is_empty(), "{hazards:?} waited for a stream held on host memory: the stream worker's maps of \
                                    peers' buffers would hang on this driver");
    }
}

#[test]
fn vmm_allocations_map_side_by_side_in_another_process() {
    if in_child("vmm_allocations_map_side_by_side_in_another_process", check_vmm) {
        return;
    }
    for driver in drivers() {
        run_child("vmm_allocations_map_side_by_side_in_another_process", driver, &[]);
    }
}

/// The test's descriptor server: a request is a segment (address, size, buffer ID, device).
fn export_for_test(request: &[u8; fdpass::REQUEST_BYTES]) -> nccl::Result<std::os::fd::OwnedFd> {
    let u = |k: usize| u64::from_le_bytes(request[8 * k..8 * k + 8].try_into().unwrap());
    let seg = Segment { addr: u(0), size: u(1), id: u(2), device: u(3) as i32 };
    Context::primary(seg.device)?.make_current()?;
    cuda::vmm_export(&seg)
}

fn segment_request(s: &Segment) -> [u8; fdpass::REQUEST_BYTES] {
    let mut r = [0u8; fdpass::REQUEST_BYTES];
    for (k, v) in [s.addr, s.size, s.id, s.device as u64].into_iter().enumerate() {
        r[8 * k..8 * k + 8].copy_from_slice(&v.to_le_bytes());
    }
    r
}

fn check_vmm() {
    let ctx = Context::primary(0).unwrap();
    let stream = Stream::new(ctx).unwrap();
    if let Ok(spec) = std::env::var(VMM_SEGMENTS) {
        // The peer: ask the owner for its allocations' descriptors, map them side by side,
        // read what the owner wrote (from 100 bytes into the first), write the second half.
        let mut fields = spec.split(',');
        let mut next = || fields.next().unwrap().parse::<u64>().unwrap();
        let at = Address { name: next(), token: next() };
        let len = next() as usize;
        let segments: Vec<Segment> = fields.map(|f| {
            let v: Vec<u64> = f.split(':').map(|x| x.parse().unwrap()).collect();
            Segment { addr: v[0], size: v[1], id: v[2], device: v[3] as i32 }
        }).collect();
        let mut source = fdpass::Source::connect(at).unwrap();
        let mapping = VmmMapping::import(&segments, 0, &mut |s| source.get(&segment_request(s))).unwrap();
        assert_eq!(mapping.size() as u64, segments.iter().map(|s| s.size).sum::<u64>());
        assert!(matches!(cuda::classify(mapping.addr()).unwrap(), PtrKind::Device { .. }));
        let region = device_region(mapping.addr() + 100, len);
        let got = download(&stream, region);
        assert!(got.iter().enumerate().all(|(i, &b)| b == ipc_pattern(i)), "the peer sees the owner's bytes");
        stream.memset(region.sub(len / 2, len - len / 2), 0xee).unwrap();
        stream.synchronize().unwrap();
        // An allocation described with another buffer ID (freed, and another mapped there) is
        // refused; so is a mapping that does not start where the request says.
        let first = segments[0];
        for stale in [Segment { id: first.id + 1000, ..first }, Segment { addr: first.addr + 4096, ..first }] {
            let refused = source.get(&segment_request(&stale)).expect_err("a stale description");
            assert!(refused.msg.contains("refused"), "{refused}");
        }
        let mut stale = |s: &Segment| source.get(&segment_request(&Segment { id: 0, ..*s }));
        let gone = VmmMapping::import(&segments[..1], 0, &mut stale).err().expect("no descriptor");
        assert_eq!(gone.code, Code::SystemError, "a descriptor not received may pass: {gone}");
        return;
    }
    // The owner: three allocations side by side; a buffer from 100 bytes into the first to 100
    // bytes before the end of the last.
    let gran = 2 << 20; // a GPU's granularity, the smallest allocation
    let buf = cuda::VmmAllocation::new(3 * gran, gran, true).unwrap();
    let base = buf.ptr() as usize;
    let (start, len) = (base + 100, 3 * gran - 200);
    assert!(matches!(cuda::classify(start).unwrap(), PtrKind::Device { ordinal: 0 }));
    assert!(IpcHandle::of(buf.ptr()).is_err(), "CUDA IPC handles do not cover this memory");
    assert_eq!(cuda::allocation_of(start + gran).unwrap(), (base + gran, gran), "one mapping");
    let segs = cuda::vmm_segments(start, len).unwrap();
    assert_eq!(segs.iter().map(|s| (s.addr, s.size as usize, s.device)).collect::<Vec<_>>(),
               (0..3).map(|k| ((base + k * gran) as u64, gran, 0)).collect::<Vec<_>>());
    assert!(segs[0].id != segs[1].id && segs[1].id != segs[2].id, "buffer IDs tell the allocations apart: {segs:?}");
    assert_eq!(cuda::vmm_segments(start + gran, 10).unwrap(), vec![segs[1]], "the same description again");
    upload(&stream, device_region(start, len), (0..len).map(ipc_pattern).collect());
    let at = fdpass::serve(export_for_test).unwrap();
    let spec: Vec<String> = [at.name.to_string(), at.token.to_string(), len.to_string()].into_iter()
        .chain(segs.iter().map(|s| format!("{}:{}:{}:{}", s.addr, s.size, s.id, s.device)))
        .collect();
    let name = "vmm_allocations_map_side_by_side_in_another_process";
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([name, "--exact", "--nocapture", "--test-threads=1"]).env(VMM_SEGMENTS, spec.join(","));
    let (ok, output) = run_with_deadline(cmd, CHILD_DEADLINE);
    assert!(ok && output.contains(&format!("test {name} ... ok")), "the peer process failed:\n{output}");
    let got = download(&stream, device_region(start, len));
    assert!(got[..len / 2].iter().enumerate().all(|(i, &b)| b == ipc_pattern(i)));
    assert!(got[len / 2..].iter().all(|&b| b == 0xee), "the owner sees the peer's write");
    // Memory created without the POSIX descriptor handle type is not described for sharing.
    let private = cuda::VmmAllocation::new(gran, gran, false).unwrap();
    assert!(cuda::vmm_segments(private.ptr() as usize, 4096).is_err());
}

// ---- kernels ---------------------------------------------------------------------------------

#[test]
fn kernels_match_host_reductions() {
    if in_child("kernels_match_host_reductions", check_kernels) {
        return;
    }
    for driver in drivers() {
        run_child("kernels_match_host_reductions", driver, &[]);
    }
}

/// The stream gate kernel (NCCL_RS_STREAM_GATE=kernel) holds its stream until the host moves
/// the word to the value, compared as a wrapping counter, while other streams run.
#[test]
fn gate_kernel_holds_a_stream_until_the_host_releases_it() {
    if in_child("gate_kernel_holds_a_stream_until_the_host_releases_it", check_gate_kernel) {
        return;
    }
    for driver in drivers() {
        run_child("gate_kernel_holds_a_stream_until_the_host_releases_it", driver, &[]);
    }
}

fn check_gate_kernel() {
    let ctx = Context::primary(0).unwrap();
    let k = ctx.kernels().unwrap();
    let (s1, s2) = (Stream::new(ctx).unwrap(), Stream::new(ctx).unwrap());
    let words = MappedHost::new(64).unwrap();
    let a = DeviceBuf::new(4096);
    for (start, value, not_yet) in [(0u32, 3u32, 2u32), (0xffff_fff0, 5, 0xffff_ffff)] {
        words.word(0).store(start, Ordering::Release);
        k.wait_geq(&s1, &words, 0, value).unwrap();
        s1.memset(a.region(), value as u8).unwrap();
        // Another stream runs meanwhile.
        s2.memset(a.region(), 0xee).unwrap();
        s2.synchronize().unwrap();
        assert!(stays_busy(&s1, Duration::from_millis(30)), "the gate opened at {start:#x} for {value:#x}");
        words.word(0).store(not_yet, Ordering::Release);
        assert!(stays_busy(&s1, Duration::from_millis(30)), "the gate opened at {not_yet:#x} for {value:#x}");
        words.word(0).store(value.wrapping_add(1), Ordering::Release);
        wait_until(&format!("the gate for {value:#x}"), || s1.query().unwrap());
        assert!(download(&s1, a.region()).iter().all(|&x| x == value as u8), "the memset behind the gate did not run");
    }
    // A word outside the memory is an error, not a wild read.
    assert!(k.wait_geq(&s1, &words, 16, 1).is_err());
}

/// splitmix64: deterministic test data without a dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let z = (self.0 ^ (self.0 >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        let z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// Zeros, ones, extremes, subnormals, infinities and NaNs of each type, as bits.
fn specials(dt: DataType) -> &'static [u64] {
    match dt {
        DataType::Int8 | DataType::Uint8 | DataType::Float8e4m3 => &[0, 1, 0x7f, 0x80, 0xff, 0x7e, 0x38, 0xb8, 8],
        DataType::Float8e5m2 => &[0, 0x80, 1, 0x7b, 0xfb, 0x7c, 0xfc, 0x7d, 0x7f, 0x3c, 0xbc],
        DataType::Int32 | DataType::Uint32 => &[0, 1, 0x7fff_ffff, 0x8000_0000, 0xffff_ffff],
        DataType::Int64 | DataType::Uint64 => &[0, 1, i64::MAX as u64, 1 << 63, u64::MAX],
        DataType::Float16 => &[0, 0x8000, 1, 0x3ff, 0x400, 0x7bff, 0xfbff, 0x7c00, 0xfc00, 0x7e00, 0x7c01, 0x3c00],
        DataType::Bfloat16 => &[0, 0x8000, 1, 0x7f, 0x80, 0x7f7f, 0xff7f, 0x7f80, 0xff80, 0x7fc0, 0x7f81, 0x3f80],
        DataType::Float32 => {
            &[0, 1 << 31, 1, 0x80_0000, 0x7f7f_ffff, 0xff7f_ffff, 0x7f80_0000, 0x7fc0_0000, 0x3f80_0000]
        }
        DataType::Float64 => {
            &[0, 1 << 63, 1, 0x7fef_ffff_ffff_ffff, 0x7ff0_0000_0000_0000, 0x7ff8_0000_0000_0001, 0x3ff0_0000_0000_0000]
        }
    }
}

/// `n` elements: specials, values near 1 (which round when combined) and random bits.
fn elements(dt: DataType, n: usize, rng: &mut Rng) -> Vec<u8> {
    let mut out = Vec::with_capacity(n * dt.size());
    for _ in 0..n {
        let r = rng.next();
        let near_one = (r >> 11) as f64 / (1u64 << 53) as f64 * 6.0 - 3.0;
        let bits = match r % 3 {
            0 => specials(dt)[(r >> 32) as usize % specials(dt).len()],
            1 if dt.is_float() => match dt {
                DataType::Float64 => near_one.to_bits(),
                DataType::Float32 => u64::from((near_one as f32).to_bits()),
                DataType::Float16 => u64::from(half::f16::from_f64(near_one).to_bits()),
                DataType::Bfloat16 => u64::from(half::bf16::from_f64(near_one).to_bits()),
                DataType::Float8e4m3 => u64::from(host::fp8::f32_to_e4m3(near_one as f32)),
                _ => u64::from(host::fp8::f32_to_e5m2(near_one as f32)),
            },
            _ => r,
        };
        out.extend_from_slice(&bits.to_le_bytes()[..dt.size()]);
    }
    out
}

/// Bit-exact, except that any NaN matches any NaN where the host leaves NaN payloads to the
/// CPU (f32/f64 sum, prod, premul, divide) and the GPU writes its canonical NaN.
fn assert_same(dt: DataType, got: &[u8], want: &[u8], what: &dyn Fn() -> String) {
    for (i, (g, w)) in got.chunks(dt.size()).zip(want.chunks(dt.size())).enumerate() {
        let nan = |e: &[u8]| match dt {
            DataType::Float32 => f32::from_le_bytes(e.try_into().unwrap()).is_nan(),
            DataType::Float64 => f64::from_le_bytes(e.try_into().unwrap()).is_nan(),
            _ => false,
        };
        assert!(g == w || (nan(g) && nan(w)), "{} [{i}]: got {g:02x?}, want {w:02x?}", what());
    }
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    Reduce(ElemOp),
    Premul(u64),
    Divide(u64),
}

/// One kernel run: `kind` on `n` elements of `dt`, with dst/a/b at byte offsets `offs` into
/// their buffers, or dst = a (`in_place`, dst's offset unused); with `indirect`, by
/// nccl_rs_indirect and a descriptor (reductions and divisions), or for PreMulSum by
/// nccl_rs_premul_at with the scalar in device memory (b).
#[derive(Clone, Copy, Debug)]
struct Case {
    dt: DataType,
    kind: Kind,
    n: usize,
    offs: [usize; 3],
    in_place: bool,
    indirect: bool,
}

/// Writes `desc` into `mem` (word 0 on) and queues the indirect kernel for it (the copy
/// kernel for a no-op).
fn launch_indirect(k: &cuda::Kernels, s: &Stream, mem: &MappedHost, desc: Desc, n: usize) {
    for (i, w) in desc.words().iter().enumerate() {
        mem.word(i).store(*w, Ordering::Relaxed);
    }
    k.indirect(s, mem.device_addr(), n, desc.kernel().unwrap_or(Indirect::Copy), 1).unwrap();
}

/// Runs `case` on the device and on the host, on the same inputs, and compares.
fn compare(k: &cuda::Kernels, s: &Stream, case: Case, rng: &mut Rng) {
    let Case { dt, kind, n, offs, in_place, indirect } = case;
    let descs = MappedHost::new(64).unwrap();
    let bytes = n * dt.size();
    let (ea, eb) = (elements(dt, n, rng), elements(dt, n, rng));
    let bufs: Vec<DeviceBuf> = (0..3).map(|_| DeviceBuf::new(bytes + 64)).collect();
    let [d, a, b] = [0, 1, 2].map(|i| bufs[i].region().sub(offs[i], bytes));
    let d = if in_place { a } else { d };
    upload(s, a, ea.clone());
    upload(s, b, eb.clone());
    let (mut wa, mut wb, mut want) = (ea.clone(), eb.clone(), vec![0u8; bytes]);
    let (ha, hb, hw) = (host_region(&mut wa), host_region(&mut wb), host_region(&mut want));
    match kind {
        Kind::Reduce(op) if indirect => {
            let desc = Desc::Reduce { dt, op, dst: d.addr(), a: a.addr(), b: b.addr(), n };
            launch_indirect(k, s, &descs, desc, n);
            host::reduce_local(dt, op, hw, ha, hb);
        }
        Kind::Reduce(op) => {
            k.reduce(dt, op, d, a, b, s).unwrap();
            host::reduce_local(dt, op, hw, ha, hb);
        }
        Kind::Premul(bits) => {
            let scalar = Scalar { bytes: (bits & (u64::MAX >> (64 - 8 * dt.size()))).to_le_bytes() };
            if indirect {
                let at = b.sub(0, dt.size());
                upload(s, at, scalar.bytes[..dt.size()].to_vec());
                k.premul_at(dt, d, a, at, s).unwrap();
            } else {
                k.premul(dt, d, a, scalar, s).unwrap();
            }
            host::premul(dt, hw, ha, scalar);
        }
        Kind::Divide(divisor) => {
            if indirect {
                launch_indirect(k, s, &descs, Desc::Divide { dt, dst: d.addr(), src: a.addr(), divisor, n }, n);
            } else {
                k.divide(dt, d, a, divisor, s).unwrap();
            }
            host::copy(hw, ha);
            host::divide(dt, hw, divisor);
        }
    }
    let got = download(s, d);
    assert_same(dt, &got, &want, &|| format!("{case:?}"));
    if !in_place {
        assert_eq!(download(s, a), ea, "{dt:?} {kind:?}: input a changed");
    }
}

fn check_kernels() {
    let ctx = Context::primary(0).unwrap();
    let k = ctx.kernels().unwrap();
    assert!(std::ptr::eq(k, ctx.kernels().unwrap()), "loaded once per context");
    let s = Stream::new(ctx).unwrap();
    let mut rng = Rng(7);
    for dt in DataType::ALL {
        let size = dt.size();
        let scalars: Vec<u64> = specials(dt).iter().copied().chain([rng.next(), rng.next()]).collect();
        let mut run = |kind, n, offs, in_place, indirect| {
            compare(k, &s, Case { dt, kind, n, offs, in_place, indirect }, &mut rng)
        };
        // Aligned (vector path), element-aligned (element path), mixed 16-byte phases, bytes.
        let offsets = [[0, 0, 0], [size, size, size], [0, size, 2 * size], [1, 1, 1]];
        for op in [ElemOp::Sum, ElemOp::Prod, ElemOp::Max, ElemOp::Min] {
            for n in [1, 7, 33, 1000, 5000] {
                for offs in offsets {
                    run(Kind::Reduce(op), n, offs, false, false);
                }
            }
            run(Kind::Reduce(op), 777, [0, 0, 0], true, false);
            // The direct path's kernel, as its descriptor says.
            run(Kind::Reduce(op), 5000, [0, 0, 0], false, true);
            run(Kind::Reduce(op), 33, [1, 1, 1], false, true);
            run(Kind::Reduce(op), 777, [0, 0, 0], true, true);
        }
        for scalar in scalars {
            run(Kind::Premul(scalar), 1000, [0, 0, 0], false, false);
            run(Kind::Premul(scalar), 333, [size, 0, 0], true, false);
            run(Kind::Premul(scalar), 1000, [0, 0, 0], false, true);
            run(Kind::Premul(scalar), 333, [1, 1, 0], true, true);
        }
        for divisor in [0, 1, 2, 3, 7, 1000, 1 << 31, 1 << 40, 1 << 63, u64::MAX] {
            run(Kind::Divide(divisor), 1000, [0, 0, 0], false, false);
            run(Kind::Divide(divisor), 333, [1, 1, 0], true, false);
            run(Kind::Divide(divisor), 1000, [0, 0, 0], true, true);
        }
    }
    check_indirect_copies(k, &s);
    // n == 0 launches nothing.
    let empty = device_region(0, 0);
    k.reduce(DataType::Float32, ElemOp::Sum, empty, empty, empty, &s).unwrap();
    s.synchronize().unwrap();
}

/// nccl_rs_indirect's copies and no-ops, and a descriptor written after its kernel was queued
/// (behind a gate): the kernel reads it when it runs, as the direct path needs.
fn check_indirect_copies(k: &cuda::Kernels, s: &Stream) {
    let descs = MappedHost::new(4096).unwrap();
    let mut rng = Rng(11);
    for (n, off) in [(1usize, 0usize), (15, 1), (4096, 0), (100_003, 3)] {
        let src: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
        let (a, b) = (DeviceBuf::new(n + 16), DeviceBuf::new(n + 16));
        let (ra, rb) = (a.region().sub(off, n), b.region().sub(16 - off.max(1), n));
        upload(s, ra, src.clone());
        upload(s, rb, vec![0x5a; n]);
        launch_indirect(k, s, &descs, Desc::Skip, n);
        assert_eq!(download(s, rb), vec![0x5a; n], "a skipped descriptor wrote");
        launch_indirect(k, s, &descs, Desc::Copy { dst: rb.addr(), src: ra.addr(), bytes: n }, n);
        assert_eq!(download(s, rb), src, "copy of {n} bytes at offset {off}");
    }
    // Three copies side by side in one launch (one descriptor per row of blocks), of
    // different sizes; the grid is sized for the largest.
    let sizes = [5000usize, 70_000, 123];
    let srcs: Vec<DeviceBuf> = sizes.iter().map(|&n| DeviceBuf::new(n)).collect();
    let dsts: Vec<DeviceBuf> = sizes.iter().map(|&n| DeviceBuf::new(n)).collect();
    let mut want = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let bytes: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
        upload(s, srcs[i].region(), bytes.clone());
        upload(s, dsts[i].region(), vec![0; n]);
        want.push(bytes);
        let desc = Desc::Copy { dst: dsts[i].region().addr(), src: srcs[i].region().addr(), bytes: n };
        for (w, v) in desc.words().iter().enumerate() {
            descs.word(16 * i + w).store(*v, Ordering::Relaxed);
        }
    }
    k.indirect(s, descs.device_addr(), 70_000, Indirect::Copy, 3).unwrap();
    for (i, w) in want.iter().enumerate() {
        assert_eq!(&download(s, dsts[i].region()), w, "copy {i} of a launch of three");
    }
    let gate = MappedHost::new(64).unwrap();
    let (a, b) = (DeviceBuf::new(4096), DeviceBuf::new(4096));
    upload(s, a.region(), vec![7; 4096]);
    upload(s, b.region(), vec![0; 4096]);
    launch_indirect(k, s, &descs, Desc::Skip, 4096);
    k.wait_geq(s, &gate, 0, 1).unwrap();
    k.indirect(s, descs.device_addr(), 4096, Indirect::Copy, 1).unwrap();
    assert!(stays_busy(s, Duration::from_millis(20)), "the gate did not hold the stream");
    for (i, w) in (Desc::Copy { dst: b.region().addr(), src: a.region().addr(), bytes: 4096 }).words().iter().enumerate() {
        descs.word(i).store(*w, Ordering::Relaxed);
    }
    gate.word(0).store(1, Ordering::Release);
    assert_eq!(download(s, b.region()), vec![7; 4096], "the kernel did not read the descriptor written after its launch");
}

// ---- errors ----------------------------------------------------------------------------------

#[test]
fn driver_errors_name_the_call_and_the_result() {
    if in_child("driver_errors_name_the_call_and_the_result", check_errors) {
        return;
    }
    run_child("driver_errors_name_the_call_and_the_result", Driver::Stub, &[]);
}

fn check_errors() {
    use cudarc::driver::sys;
    let ctx = Context::primary(0).unwrap();
    let mut heap = vec![0u8; 4096];
    let e = cuda::free(heap.as_mut_ptr().cast()).unwrap_err();
    assert_eq!((e.code, e.msg.as_str()), (Code::UnhandledCudaError, "cuMemFree_v2: CUDA_ERROR_INVALID_VALUE"));
    let e = cuda::alloc(0).unwrap_err();
    assert_eq!(e.msg, "cuMemAlloc_v2(0 bytes): CUDA_ERROR_INVALID_VALUE");
    let e = IpcHandle::of(heap.as_mut_ptr().cast()).unwrap_err();
    assert_eq!(e.msg, "cuIpcGetMemHandle: CUDA_ERROR_INVALID_VALUE");
    // The stub, like a GPU, cannot reach pageable host memory from a kernel.
    let s = Stream::new(ctx).unwrap();
    let h = host_region(&mut heap);
    let e = ctx.kernels().unwrap().reduce(DataType::Float32, ElemOp::Sum, h, h, h, &s).unwrap_err();
    assert_eq!(e.msg, "cuLaunchKernel(1 blocks, n 1024): CUDA_ERROR_ILLEGAL_ADDRESS");
    // The stub's module checks: not PTX, and a kernel the module lacks.
    let (mut module, mut f) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: NUL-terminated images and names; valid out-pointers; a context is current.
    unsafe {
        assert_eq!(
            sys::cuModuleLoadData(&mut module, c"garbage".as_ptr().cast()),
            sys::CUresult::CUDA_ERROR_INVALID_IMAGE
        );
        let ptx = c".version 8.0\n.target sm_70\n.visible .entry nccl_rs_premul_float(\n";
        assert_eq!(sys::cuModuleLoadData(&mut module, ptx.as_ptr().cast()), sys::CUresult::CUDA_SUCCESS);
        assert_eq!(
            sys::cuModuleGetFunction(&mut f, module, c"nccl_rs_premul_float".as_ptr()),
            sys::CUresult::CUDA_SUCCESS
        );
        let missing = sys::cuModuleGetFunction(&mut f, module, c"nccl_rs_divide_float".as_ptr());
        assert_eq!(missing, sys::CUresult::CUDA_ERROR_NOT_FOUND);
        assert_eq!(sys::cuModuleUnload(module), sys::CUresult::CUDA_SUCCESS);
    }
}

/// CUDA mode through the C API on one rank: a collective on device memory runs in order on
/// the caller's stream (here the legacy NULL stream); a PreMulSum whose scalar lives in device
/// memory reads it in stream order; host memory keeps working in the same process.
#[test]
fn collectives_run_on_device_memory_in_stream_order() {
    if in_child("collectives_run_on_device_memory_in_stream_order", check_device_collective) {
        return;
    }
    for driver in drivers() {
        run_child("collectives_run_on_device_memory_in_stream_order", driver, &[]);
    }
}

fn check_device_collective() {
    use nccl::abi::coll::{ncclAllReduce, ncclRedOpCreatePreMulSum};
    use nccl::abi::comm::{ncclCommDestroy, ncclCommInitAll};
    use nccl::abi::misc::ncclGetLastError;
    use nccl::abi::types::*;
    let ctx = Context::primary(0).unwrap();
    let mut comm: ncclComm_t = std::ptr::null_mut();
    assert_eq!(ncclCommInitAll(&mut comm, 1, std::ptr::null()).0, 0);
    let (send, recv) = (DeviceBuf::new(64), DeviceBuf::new(64));
    // SAFETY: NULL is the legacy stream of the current context.
    let legacy = Stream::caller(ctx, unsafe { cuda::UserStream::new(std::ptr::null_mut::<c_void>()) });
    let mut input: Vec<u8> = (1..=16u32).flat_map(|i| (i as f32).to_ne_bytes()).collect();
    legacy.copy(send.region(), host_region(&mut input)).unwrap();
    let r = ncclAllReduce(send.ptr, recv.ptr, 16, ncclDataType_t(7), ncclRedOp_t(0), comm, std::ptr::null_mut());
    assert_eq!(r.0, 0, "allreduce on device memory");
    let got = download(&legacy, recv.region());
    assert_eq!(got, input, "one rank's all-reduce is a copy, after the upload on the same stream");

    // A PreMulSum scalar in device memory is read in stream order: written by the stream
    // just before the call, it is the value used.
    let scalar = DeviceBuf::new(4);
    let mut op = ncclRedOp_t(0);
    let r = ncclRedOpCreatePreMulSum(&mut op, scalar.ptr, ncclDataType_t(7), ncclScalarResidence_t(0), comm);
    assert_eq!(r.0, 0);
    let mut three = 3.0f32.to_ne_bytes().to_vec();
    legacy.copy(scalar.region(), host_region(&mut three)).unwrap();
    let r = ncclAllReduce(send.ptr, recv.ptr, 16, ncclDataType_t(7), op, comm, std::ptr::null_mut());
    assert_eq!(r.0, 0, "PreMulSum with a device scalar: {}",
               // SAFETY: the library returns a NUL-terminated string.
               unsafe { std::ffi::CStr::from_ptr(ncclGetLastError(comm)) }.to_string_lossy());
    let got = download(&legacy, recv.region());
    let want: Vec<u8> = (1..=16u32).flat_map(|i| (3.0 * i as f32).to_ne_bytes()).collect();
    assert_eq!(got, want, "x * scalar, the scalar as the stream left it");

    let mut host = vec![1.0f32; 16];
    let p = host.as_mut_ptr() as *mut c_void;
    assert_eq!(ncclAllReduce(p, p, 16, ncclDataType_t(7), ncclRedOp_t(0), comm, std::ptr::null_mut()).0, 0);
    assert_eq!(host[0], 1.0);
    assert_eq!(ncclCommDestroy(comm).0, 0);
}

// ---- graphs ----------------------------------------------------------------------------------

/// What `streamed::capture` records into a graph, launched twice: a copy, a host call (run by
/// each launch, not by the capture), a wait on mapped host memory and the write that resets
/// it, a memset after them. The value the host call holds lives as long as the executable
/// graph (not the graph, destroyed first) and is dropped after it. A stream that is not
/// capturing has no capture.
#[test]
fn graphs_run_host_calls_and_memory_operations_per_launch() {
    if in_child("graphs_run_host_calls_and_memory_operations_per_launch", check_graphs) {
        return;
    }
    for driver in drivers() {
        run_child("graphs_run_host_calls_and_memory_operations_per_launch", driver, &[]);
    }
}

static GRAPH_VALUE_DROPPED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
static GRAPH_CALLS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

struct Calls;

impl Drop for Calls {
    fn drop(&mut self) {
        GRAPH_VALUE_DROPPED.store(true, Ordering::Release);
    }
}

fn check_graphs() {
    use cudarc::driver::sys::{self, CUgraph, CUgraphExec, CUresult, CUstreamCaptureMode};
    let ctx = Context::primary(0).unwrap();
    let (s, other) = (Stream::new(ctx).unwrap(), Stream::new(ctx).unwrap());
    assert!(s.capture().unwrap().is_none());
    const LEN: usize = 4096;
    let (a, b) = (DeviceBuf::new(LEN), DeviceBuf::new(LEN));
    let pattern: Vec<u8> = (0..LEN).map(|i| (i * 13 + 1) as u8).collect();
    upload(&s, a.region(), pattern.clone());
    upload(&s, b.region(), vec![0; LEN]);
    let gate = MappedHost::new(64).unwrap();
    let calls = std::sync::Arc::new(Calls);

    let mode = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL;
    // SAFETY: a live stream of the current context.
    assert_eq!(unsafe { sys::cuStreamBeginCapture_v2(s.raw(), mode) }, CUresult::CUDA_SUCCESS);
    let capture = s.capture().unwrap().expect("the stream captures");
    s.copy(b.region(), a.region()).unwrap();
    capture.host_call(&s, calls.clone(), |_| {
        GRAPH_CALLS.fetch_add(1, Ordering::AcqRel);
    }).unwrap();
    assert_eq!(s.wait_value32(&gate, 0, 1, WaitCond::Eq).unwrap(), MemOp::Enqueued);
    assert_eq!(s.write_value32(&gate, 0, 0).unwrap(), MemOp::Enqueued);
    s.memset(b.region().sub(0, 16), 0x33).unwrap();
    let mut graph: CUgraph = std::ptr::null_mut();
    // SAFETY: the stream is capturing; `graph` is a valid out-pointer.
    assert_eq!(unsafe { sys::cuStreamEndCapture(s.raw(), &mut graph) }, CUresult::CUDA_SUCCESS);
    let mut exec: CUgraphExec = std::ptr::null_mut();
    // SAFETY: `graph` is the captured graph; `exec` a valid out-pointer.
    assert_eq!(unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) }, CUresult::CUDA_SUCCESS);
    // SAFETY: the executable copy does not need the graph.
    assert_eq!(unsafe { sys::cuGraphDestroy(graph) }, CUresult::CUDA_SUCCESS);
    drop(calls);
    assert_eq!(GRAPH_CALLS.load(Ordering::Acquire), 0, "the capture ran the host call");
    assert_eq!(download(&s, b.region()), vec![0; LEN], "the capture ran the copy");

    let mut want = pattern.clone();
    want[..16].fill(0x33);
    for launch in 1..=2u32 {
        // SAFETY: `exec` is live; `other` a live stream.
        assert_eq!(unsafe { sys::cuGraphLaunch(exec, other.raw()) }, CUresult::CUDA_SUCCESS);
        wait_until("the launch's host call", || GRAPH_CALLS.load(Ordering::Acquire) == launch);
        // Alive: the executable graph holds it.
        assert!(!GRAPH_VALUE_DROPPED.load(Ordering::Acquire));
        assert!(stays_busy(&other, Duration::from_millis(20)), "launch {launch} went past its wait");
        gate.word(0).store(1, Ordering::Release);
        wait_until("the launch after its wait", || other.query().unwrap());
        assert_eq!(gate.word(0).load(Ordering::Acquire), 0, "launch {launch} did not reset its word");
        assert_eq!(download(&other, b.region()), want, "launch {launch}");
        upload(&other, b.region(), vec![0; LEN]);
    }
    assert!(!GRAPH_VALUE_DROPPED.load(Ordering::Acquire));
    // SAFETY: nothing of `exec` is pending (its stream is idle).
    assert_eq!(unsafe { sys::cuGraphExecDestroy(exec) }, CUresult::CUDA_SUCCESS);
    wait_until("the value dropped with the executable graph", || GRAPH_VALUE_DROPPED.load(Ordering::Acquire));
}
