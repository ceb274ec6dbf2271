//! The reduction kernels' own source, `kernels/reduce.cu`, run on the CPU: built by the host's
//! C++ compiler with `tests/kernel-host/` (CUDA's few built-ins, and IEEE's f16 conversions
//! in place of the two inline PTX instructions), every kernel is launched over simulated grids
//! and must give host mode's results (`src/device/host/reduce.rs`) bit for bit.
//!
//! Why: on a GPU those kernels compute every CUDA-mode reduction, but CI has no GPU, and the
//! stand-in driver runs C twins of them (`tests/cuda-stub/kernels.c`). Without this test,
//! reduce.cu's indexing (vectors, heads and tails, byte paths), its numerics and the
//! descriptors of the direct path would first run on a GPU. The only difference in bits the
//! kernels allow, a float32/float64 NaN's payload, is the one difference accepted here.

use std::ffi::{c_void, CString};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use nccl::device::cuda::Desc;
use nccl::device::host::reduce::{self, ElemOp};
use nccl::types::{DataType, Scalar};

type Kernel = unsafe extern "C" fn(u64, u64, u64, u64);
type Launch = unsafe extern "C" fn(Kernel, u32, u32, u32, u64, u64, u64, u64);

/// reduce.cu built for the CPU (tests/kernel-host/launch.cpp), loaded once per test binary.
struct HostKernels {
    handle: usize,
    launch: Launch,
}

fn kernels() -> &'static HostKernels {
    static LIB: OnceLock<HostKernels> = OnceLock::new();
    LIB.get_or_init(|| {
        let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("kernel-host");
        std::fs::create_dir_all(&dir).expect("create the kernel-host folder");
        let lib = dir.join(format!("libreduce-host.{}.so", std::process::id()));
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
        // No FMA contraction and no fast-math: the kernels' __f*_rn operations are IEEE's.
        let out = Command::new(&cxx)
            .args(["-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror", "-Wno-unknown-pragmas"])
            .args(["-ffp-contract=off", "-fno-strict-aliasing", "-fPIC", "-shared", "-o"])
            .arg(&lib)
            .arg(repo.join("tests/kernel-host/launch.cpp"))
            .output()
            .unwrap_or_else(|e| panic!("running {cxx}: {e}"));
        assert!(out.status.success(), "building reduce.cu for the CPU failed:\n{}", String::from_utf8_lossy(&out.stderr));
        let path = CString::new(lib.to_str().expect("UTF-8 path")).expect("no NUL in the path");
        // SAFETY: `path` is a NUL-terminated string; the library has no initialisers beyond
        // the C++ runtime's.
        let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        assert!(!handle.is_null(), "dlopen {}", lib.display());
        let _ = std::fs::remove_file(&lib);
        let launch = symbol(handle, "nccl_rs_host_launch");
        // SAFETY: launch.cpp defines nccl_rs_host_launch with exactly the signature of `Launch`.
        let launch = unsafe { std::mem::transmute::<*mut c_void, Launch>(launch) };
        HostKernels { handle: handle as usize, launch }
    })
}

fn symbol(handle: *mut c_void, name: &str) -> *mut c_void {
    let c = CString::new(name).expect("no NUL in a symbol");
    // SAFETY: `handle` came from dlopen and is never closed; `c` is NUL-terminated.
    let p = unsafe { libc::dlsym(handle, c.as_ptr()) };
    assert!(!p.is_null(), "reduce.cu has no kernel {name}");
    p
}

/// Runs kernel `name` over `grid` = (blocks x, blocks y, threads per block) with its four
/// 64-bit parameters.
fn launch(name: &str, grid: (u32, u32, u32), p: [u64; 4]) {
    let k = kernels();
    let f = symbol(k.handle as *mut c_void, name);
    // SAFETY: every kernel of reduce.cu takes four 8-byte parameters (pointers or integers),
    // which is how `Kernel` passes them; the callers pass pointers into live buffers large
    // enough for what the kernel's parameters say.
    unsafe {
        let f = std::mem::transmute::<*mut c_void, Kernel>(f);
        (k.launch)(f, grid.0, grid.1, grid.2, p[0], p[1], p[2], p[3]);
    }
}

/// Grids the kernels must all agree under: one thread; fewer threads than elements, in odd
/// numbers; more blocks than the elements need.
const GRIDS: [(u32, u32, u32); 3] = [(1, 1, 1), (3, 1, 5), (9, 1, 64)];

/// xorshift64*: the inputs, the same in every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// A buffer whose data starts `offset` bytes past a 16-byte boundary, as the kernels' paths
/// (16-byte vectors, elements, bytes) depend on that.
struct Buf {
    mem: Vec<u8>,
    start: usize,
    len: usize,
}

impl Buf {
    fn new(data: &[u8], offset: usize) -> Buf {
        let mut mem = vec![0xA5u8; data.len() + offset + 32];
        let start = (16 - mem.as_ptr() as usize % 16) % 16 + offset;
        mem[start..start + data.len()].copy_from_slice(data);
        Buf { mem, start, len: data.len() }
    }

    fn ptr(&mut self) -> *mut u8 {
        self.mem[self.start..].as_mut_ptr()
    }

    fn addr(&mut self) -> u64 {
        self.ptr() as u64
    }

    fn data(&self) -> &[u8] {
        &self.mem[self.start..self.start + self.len]
    }

    /// The bytes around the data are as they were made.
    fn untouched_around(&self) -> bool {
        self.mem[..self.start].iter().chain(&self.mem[self.start + self.len..]).all(|&b| b == 0xA5)
    }
}

/// Inputs a and b of `n` elements each: every pair of codes for 1-byte types; for 2-byte
/// types every code against a random one, a neighbour (low bits changed) and its negation;
/// otherwise random bits, neighbours and negations (the sign bit is the top bit of every type).
fn inputs(dt: DataType, rng: &mut Rng) -> (Vec<u8>, Vec<u8>, usize) {
    let size = dt.size();
    match size {
        1 => {
            let a = (0..65536u32).map(|i| i as u8).collect();
            let b = (0..65536u32).map(|i| (i >> 8) as u8).collect();
            (a, b, 65536)
        }
        _ => {
            let n = if size == 2 { 3 * 65536 } else { 30000 };
            let mut a = Vec::with_capacity(n * size);
            let mut b = Vec::with_capacity(n * size);
            for i in 0..n {
                let x = if size == 2 { (i as u64) & 0xffff } else { rng.next() };
                let y = match i % 3 {
                    0 => rng.next(),
                    1 => x ^ (rng.next() & ((1u64 << (4 * size)) - 1)),
                    _ => x ^ (1u64 << (8 * size - 1)),
                };
                a.extend_from_slice(&x.to_le_bytes()[..size]);
                b.extend_from_slice(&y.to_le_bytes()[..size]);
            }
            (a, b, n)
        }
    }
}

/// `got` equals `want` element for element, a float32/float64 NaN matching any NaN.
fn same(dt: DataType, got: &[u8], want: &[u8], what: &dyn Fn(usize) -> String) {
    let size = dt.size();
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.chunks(size).zip(want.chunks(size)).enumerate() {
        let nan = |e: &[u8]| match dt {
            DataType::Float32 => f32::from_le_bytes(e.try_into().expect("4 bytes")).is_nan(),
            DataType::Float64 => f64::from_le_bytes(e.try_into().expect("8 bytes")).is_nan(),
            _ => false,
        };
        assert!(g == w || (nan(g) && nan(w)), "{}: element {i}: kernel {g:02x?}, host mode {w:02x?}", what(i));
    }
}

const OPS: [(ElemOp, &str); 4] = [(ElemOp::Sum, "sum"), (ElemOp::Prod, "prod"), (ElemOp::Max, "max"), (ElemOp::Min, "min")];

/// The layouts every kernel runs in: (dst, a, b) byte offsets from a 16-byte boundary, and
/// whether dst is a or b (in place). Same offsets: 16-byte vectors with element heads and
/// tails; different offsets: one element at a time; not element-aligned: bytes.
fn layouts(size: usize) -> Vec<([usize; 3], Option<usize>)> {
    let mut v = vec![([0, 0, 0], None), ([size % 16, size % 16, size % 16], None), ([0, size, 0], None)];
    v.extend([([0, 0, 0], Some(0)), ([size, 0, size], Some(1))]);
    if size > 1 {
        v.extend([([1, 1, 1], None), ([0, 0, 3], Some(0))]);
    }
    v
}

/// Counts that give a kernel nothing, less than a vector, and odd vectors with tails.
const SMALL: [usize; 5] = [0, 1, 3, 17, 260];

/// Runs `kernel` (dst, a, third, n) under every grid and layout and compares it with
/// `host(dst, a, b, n)`, on the whole input (one grid) and on each small count. `third` is
/// b's address for a reduction, else the kernel's scalar, scalar address or divisor (and b
/// only a place to write to).
fn check_kernel(
    dt: DataType,
    kernel: &str,
    third: Option<u64>,
    a: &[u8],
    b: &[u8],
    n: usize,
    host: &dyn Fn(*mut u8, *const u8, *const u8, usize),
) {
    let size = dt.size();
    let mut cases = vec![(n, ([0, 0, 0], None), (8, 1, 64))];
    for &m in &SMALL {
        for l in layouts(size) {
            for g in GRIDS {
                cases.push((m.min(n), l, g));
            }
        }
    }
    for (m, (offsets, in_place), grid) in cases {
        let bytes = m * size;
        let mut want = vec![0u8; bytes];
        // In place, the host computes into a copy of the input the kernel overwrites.
        let (mut ha, mut hb) = (a[..bytes].to_vec(), b[..bytes].to_vec());
        match in_place {
            None => host(want.as_mut_ptr(), ha.as_ptr(), hb.as_ptr(), m),
            Some(0) => {
                host(ha.as_mut_ptr(), ha.as_ptr(), hb.as_ptr(), m);
                want = ha;
            }
            Some(_) => {
                host(hb.as_mut_ptr(), ha.as_ptr(), hb.as_ptr(), m);
                want = hb;
            }
        }

        let mut kd = Buf::new(&vec![0u8; bytes], offsets[0]);
        let mut ka = Buf::new(&a[..bytes], offsets[1]);
        let mut kb = Buf::new(&b[..bytes], offsets[2]);
        let dst = match in_place {
            None => kd.addr(),
            Some(0) => ka.addr(),
            Some(_) => kb.addr(),
        };
        launch(kernel, grid, [dst, ka.addr(), third.unwrap_or(kb.addr()), m as u64]);
        let got = match in_place {
            None => kd.data(),
            Some(0) => ka.data(),
            Some(_) => kb.data(),
        };
        let what = |i: usize| {
            let at = |v: &[u8]| v[i * size..(i + 1) * size].to_vec();
            format!(
                "{kernel}, {m} elements, offsets {offsets:?}, dst in place of {in_place:?}, grid {grid:?}, a {:02x?} b {:02x?}",
                at(a),
                at(b)
            )
        };
        same(dt, got, &want, &what);
        let clean = kd.untouched_around() && ka.untouched_around() && kb.untouched_around();
        assert!(clean, "{kernel} wrote outside its buffers ({m} elements, offsets {offsets:?}, grid {grid:?})");
    }
}

#[test]
fn every_reduction_kernel_matches_host_mode() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for dt in DataType::ALL {
        let (a, b, n) = inputs(dt, &mut rng);
        for (op, name) in OPS {
            let kernel = format!("nccl_rs_reduce_{}_{name}", dt.name());
            // SAFETY: the three pointers are live buffers of `m` elements (check_kernel).
            let host = |d: *mut u8, x: *const u8, y: *const u8, m: usize| unsafe { reduce::reduce(dt, op, d, x, y, m) };
            check_kernel(dt, &kernel, None, &a, &b, n, &host);
        }
    }
}

#[test]
fn premul_and_divide_kernels_match_host_mode() {
    let mut rng = Rng(0x0123_4567_89ab_cdef);
    for dt in DataType::ALL {
        let (a, b, n) = inputs(dt, &mut rng);
        let size = dt.size();
        // Scalars: zero, elements of the inputs (values in every range, NaNs, infinities), random.
        let mut scalars = vec![[0u8; 8]];
        for i in [1usize, 7, 100, 1000, 5000] {
            let mut s = [0u8; 8];
            s[..size].copy_from_slice(&b[i * size..(i + 1) * size]);
            scalars.push(s);
        }
        let mut s = [0u8; 8];
        s[..size].copy_from_slice(&rng.bytes(size));
        scalars.push(s);
        for bytes in scalars {
            let scalar = Scalar { bytes };
            // SAFETY: live buffers of `m` elements (check_kernel).
            let host = |d: *mut u8, x: *const u8, _: *const u8, m: usize| unsafe { reduce::premul(dt, d, x, scalar, m) };
            let by_value = format!("nccl_rs_premul_{}", dt.name());
            check_kernel(dt, &by_value, Some(u64::from_le_bytes(bytes)), &a, &b, n, &host);
            // The same factor read from memory when the kernel runs, at an odd address.
            let at = format!("nccl_rs_premul_at_{}", dt.name());
            let mut cell = Buf::new(&bytes[..size], 3);
            check_kernel(dt, &at, Some(cell.addr()), &a, &b, n, &host);
        }
        let limits = [0u64, 1, 2, 3, 7, 100, 127, 128, 129, 255, 256, 65536, (1 << 31) - 1, 1 << 31, 1 << 32, (1 << 63) - 1, 1 << 63, u64::MAX];
        for divisor in limits {
            // SAFETY: live buffers of `m` elements (check_kernel).
            let host = |d: *mut u8, x: *const u8, _: *const u8, m: usize| unsafe { reduce::divide(dt, d, x, divisor, m) };
            check_kernel(dt, &format!("nccl_rs_divide_{}", dt.name()), Some(divisor), &a, &b, n.min(4096), &host);
        }
    }
}

/// The direct path's kernels read `Desc::words()` as reduce.cu lays a descriptor out: each
/// row of blocks does its own descriptor, rows past `count` do nothing, and a skipped
/// descriptor touches nothing.
#[test]
fn indirect_kernels_do_what_their_descriptors_say() {
    let mut rng = Rng(0xfeed_f00d_dead_beef);
    for dt in DataType::ALL {
        let size = dt.size();
        let n = 1000usize;
        let mut ins: Vec<Buf> = (0..8).map(|i| Buf::new(&rng.bytes(n * size), (i * size) % 16)).collect();
        let mut outs: Vec<Buf> = (0..6).map(|i| Buf::new(&rng.bytes(n * size), (i * size) % 16)).collect();
        let before: Vec<Vec<u8>> = outs.iter().map(|b| b.data().to_vec()).collect();
        let m = [n, n - 1, 7, n / 2, 0, n];
        let descs = [
            Desc::Reduce { dt, op: ElemOp::Sum, dst: outs[0].addr() as usize, a: ins[0].addr() as usize, b: ins[1].addr() as usize, n: m[0] },
            Desc::Reduce { dt, op: ElemOp::Prod, dst: outs[1].addr() as usize, a: ins[2].addr() as usize, b: ins[3].addr() as usize, n: m[1] },
            Desc::Reduce { dt, op: ElemOp::Max, dst: outs[2].addr() as usize, a: ins[4].addr() as usize, b: ins[5].addr() as usize, n: m[2] },
            Desc::Reduce { dt, op: ElemOp::Min, dst: outs[3].addr() as usize, a: ins[6].addr() as usize, b: ins[7].addr() as usize, n: m[3] },
            Desc::Skip,
            Desc::Divide { dt, dst: outs[5].addr() as usize, src: ins[0].addr() as usize, divisor: 3, n: m[5] },
        ];
        let mut table = Vec::new();
        for d in &descs {
            table.extend(d.words().iter().flat_map(|w| w.to_le_bytes()));
        }
        // A seventh descriptor beyond `count`: rows past it must not run it.
        let stray = Desc::Reduce { dt, op: ElemOp::Sum, dst: outs[4].addr() as usize, a: ins[0].addr() as usize, b: ins[1].addr() as usize, n };
        table.extend(stray.words().iter().flat_map(|w| w.to_le_bytes()));
        let mut table = Buf::new(&table, 0);
        launch(&format!("nccl_rs_indirect_{}", dt.name()), (3, 8, 32), [table.addr(), 0, descs.len() as u64, n as u64]);

        for (k, d) in descs.iter().enumerate() {
            let mut want = before[k].clone();
            // SAFETY: the buffers are live and hold n >= m[k] elements; `want` is a separate
            // vector of the same length.
            unsafe {
                match *d {
                    Desc::Reduce { op, a, b, n, .. } => reduce::reduce(dt, op, want.as_mut_ptr(), a as *const u8, b as *const u8, n),
                    Desc::Divide { src, divisor, n, .. } => reduce::divide(dt, want.as_mut_ptr(), src as *const u8, divisor, n),
                    _ => {}
                }
            }
            same(dt, outs[k].data(), &want, &|_| format!("nccl_rs_indirect_{} descriptor {k} ({d:?})", dt.name()));
            assert!(outs[k].untouched_around(), "descriptor {k} wrote outside its buffer");
        }
    }

    // Copies: odd sizes and addresses, a skipped one between, a stray row after `count`.
    let src = Buf::new(&rng.bytes(5000), 1);
    let mut dsts: Vec<Buf> = [0usize, 3, 8, 15].iter().map(|&o| Buf::new(&rng.bytes(5000), o)).collect();
    let before: Vec<Vec<u8>> = dsts.iter().map(|b| b.data().to_vec()).collect();
    let base = src.data().as_ptr() as usize;
    let copies = [
        (0usize, 5000usize),
        (1, 4093),
        (0, 0),
        (17, 33),
    ];
    let mut table = Vec::new();
    for (k, &(from, bytes)) in copies.iter().enumerate() {
        let d = if k == 2 { Desc::Skip } else { Desc::Copy { dst: dsts[k].addr() as usize, src: base + from, bytes } };
        table.extend(d.words().iter().flat_map(|w| w.to_le_bytes()));
    }
    let stray = Desc::Copy { dst: dsts[2].addr() as usize, src: base, bytes: 5000 };
    table.extend(stray.words().iter().flat_map(|w| w.to_le_bytes()));
    let mut table = Buf::new(&table, 0);
    launch("nccl_rs_indirect_copy", (2, 5, 16), [table.addr(), 0, copies.len() as u64, 5000]);
    for (k, &(from, bytes)) in copies.iter().enumerate() {
        let mut want = before[k].clone();
        if k != 2 {
            want[..bytes].copy_from_slice(&src.data()[from..from + bytes]);
        }
        assert_eq!(dsts[k].data(), &want[..], "copy descriptor {k} ({bytes} bytes from offset {from})");
        assert!(dsts[k].untouched_around(), "copy descriptor {k} wrote outside its buffer");
    }
}

/// The stream gate's kernel (`nccl_rs_wait_geq`) lets its stream go once the word has reached
/// the value, compared as the wrapping counter it is: here the word is already there, in
/// plain and wrapped cases, so each launch must return at once (a wrong comparison would spin;
/// the launch runs on a thread of its own, waited for with a deadline).
#[test]
fn the_gate_kernel_compares_as_a_wrapping_counter() {
    for (word, value) in [(5u32, 3u32), (7, 7), (1, 0xffff_ffff), (0x8000_0000, 0x7fff_ffff)] {
        let cell = Box::leak(Box::new(word)) as *mut u32 as u64;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            launch("nccl_rs_wait_geq", (1, 1, 32), [cell, 0, value as u64, 0]);
            let _ = tx.send(());
        });
        assert!(rx.recv_timeout(std::time::Duration::from_secs(10)).is_ok(),
                "nccl_rs_wait_geq still waits with word {word:#x} and value {value:#x}");
    }
}
