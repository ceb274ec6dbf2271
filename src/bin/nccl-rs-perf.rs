//! nccl-rs-perf: busbw against message size, with nccl-tests' flags and table.
//!
//! ```text
//! nccl-rs-perf allreduce -np 2 -b 8 -e 64M -f 2        # 2 local processes
//! nccl-rs-perf allgather -t 4 -b 1K -e 16M             # 4 ranks in one process
//! torchrun-style launch: RANK/WORLD_SIZE (or OMPI_COMM_WORLD_*, SLURM_*) + NCCL_COMM_ID
//! ```
//! It calls the library through its C API, exactly as an application does.

use std::ffi::c_void;
use std::process::{Command, ExitCode};
use std::ptr::null_mut;
use std::time::Instant;

use nccl::abi::coll::*;
use nccl::abi::comm::*;
use nccl::abi::group::*;
use nccl::abi::misc::*;
use nccl::abi::types::*;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Coll {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
    Reduce,
    AlltoAll,
    SendRecv,
    Gather,
    Scatter,
}

impl Coll {
    fn parse(s: &str) -> Option<Coll> {
        Some(match s.to_ascii_lowercase().replace(['_', '-'], "").as_str() {
            "allreduce" => Coll::AllReduce,
            "allgather" => Coll::AllGather,
            "reducescatter" => Coll::ReduceScatter,
            "broadcast" => Coll::Broadcast,
            "reduce" => Coll::Reduce,
            "alltoall" => Coll::AlltoAll,
            "sendrecv" => Coll::SendRecv,
            "gather" => Coll::Gather,
            "scatter" => Coll::Scatter,
            _ => return None,
        })
    }
    /// nccl-tests' bus bandwidth factor.
    fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Coll::AllReduce => 2.0 * (n - 1.0) / n,
            Coll::AllGather | Coll::ReduceScatter | Coll::AlltoAll | Coll::Gather | Coll::Scatter => (n - 1.0) / n,
            Coll::Broadcast | Coll::Reduce | Coll::SendRecv => 1.0,
        }
    }
    fn rooted(self) -> bool {
        matches!(self, Coll::Broadcast | Coll::Reduce | Coll::Gather | Coll::Scatter)
    }
    fn reduces(self) -> bool {
        matches!(self, Coll::AllReduce | Coll::Reduce | Coll::ReduceScatter)
    }
}

#[derive(Clone, Debug)]
struct Opts {
    coll: Coll,
    np: usize,
    threads: usize,
    min: usize,
    max: usize,
    factor: usize,
    incr: usize,
    iters: usize,
    warmup: usize,
    check: bool,
    dtype: (i32, &'static str, usize),
    op: (i32, &'static str),
    root: i32,
}

fn parse_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (num, mul) = match s.chars().last()? {
        'K' | 'k' => (&s[..s.len() - 1], 1usize << 10),
        'M' | 'm' => (&s[..s.len() - 1], 1 << 20),
        'G' | 'g' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>().ok().map(|v| v * mul)
}

fn dtype(s: &str) -> Option<(i32, &'static str, usize)> {
    Some(match s {
        "int8" | "char" => (0, "int8", 1),
        "uint8" => (1, "uint8", 1),
        "int32" | "int" => (2, "int32", 4),
        "uint32" => (3, "uint32", 4),
        "int64" => (4, "int64", 8),
        "uint64" => (5, "uint64", 8),
        "half" | "float16" => (6, "half", 2),
        "float" | "float32" => (7, "float", 4),
        "double" | "float64" => (8, "double", 8),
        "bfloat16" => (9, "bfloat16", 2),
        _ => return None,
    })
}

fn redop(s: &str) -> Option<(i32, &'static str)> {
    Some(match s {
        "sum" => (0, "sum"),
        "prod" => (1, "prod"),
        "max" => (2, "max"),
        "min" => (3, "min"),
        "avg" => (4, "avg"),
        _ => return None,
    })
}

const USAGE: &str = "usage: nccl-rs-perf [allreduce|allgather|reducescatter|broadcast|reduce|alltoall|sendrecv|gather|scatter]
  -np N   processes (forked here)      -t N   ranks per process (ncclCommInitAll)
  -b SIZE minimum bytes (8)            -e SIZE maximum bytes (32M)
  -f F    multiply size by F (2)       -i N   add N bytes instead of multiplying
  -n N    timed iterations (20)        -w N   warmup iterations (5)
  -c 0|1  check results (1)            -d T   datatype (float)
  -o OP   sum|prod|max|min|avg (sum)   -r R   root (0)
  -z 0|1  accepted for nccl-tests compatibility (host mode always blocks)";

fn parse_args(args: &[String]) -> Result<Opts, String> {
    let mut o = Opts {
        coll: Coll::AllReduce,
        np: 1,
        threads: 1,
        min: 8,
        max: 32 << 20,
        factor: 2,
        incr: 0,
        iters: 20,
        warmup: 5,
        check: true,
        dtype: (7, "float", 4),
        op: (0, "sum"),
        root: 0,
    };
    let mut i = 0;
    while i < args.len() {
        let a = args[i].as_str();
        if let Some(c) = Coll::parse(a) {
            o.coll = c;
            i += 1;
            continue;
        }
        let v = args.get(i + 1).ok_or_else(|| format!("{a} needs a value\n{USAGE}"))?;
        let bad = || format!("bad value '{v}' for {a}\n{USAGE}");
        let num = || v.parse::<usize>().map_err(|_| bad());
        match a {
            "-np" => o.np = num()?.max(1),
            "-t" => o.threads = num()?.max(1),
            "-g" => {}
            "-b" => o.min = parse_size(v).ok_or_else(bad)?,
            "-e" => o.max = parse_size(v).ok_or_else(bad)?,
            "-f" => o.factor = num()?.max(1),
            "-i" => o.incr = parse_size(v).ok_or_else(bad)?,
            "-n" => o.iters = num()?.max(1),
            "-w" => o.warmup = num()?,
            "-c" => o.check = num()? != 0,
            "-d" => o.dtype = dtype(v).ok_or_else(bad)?,
            "-o" => o.op = redop(v).ok_or_else(bad)?,
            "-r" => o.root = v.parse().map_err(|_| bad())?,
            "-z" => {}
            _ => return Err(format!("unknown option {a}\n{USAGE}")),
        }
        i += 2;
    }
    if o.min > o.max {
        return Err(format!("-b {} is larger than -e {}", o.min, o.max));
    }
    Ok(o)
}

/// Which rank set this process is, from our own launcher or a foreign one.
fn launch_env() -> Option<(usize, usize)> {
    let get = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<usize>().ok());
    for (r, n) in [("NCCL_RS_PERF_PROC", "NCCL_RS_PERF_NPROCS"), ("RANK", "WORLD_SIZE"),
                   ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")] {
        if let (Some(r), Some(n)) = (get(r), get(n)) {
            return Some((r, n));
        }
    }
    None
}

fn check(r: ncclResult_t, what: &str) {
    if r.0 != 0 {
        let msg = unsafe_cstr(ncclGetLastError(null_mut()));
        eprintln!("nccl-rs-perf: {what} failed ({}): {msg}", r.0);
        std::process::exit(2);
    }
}

fn unsafe_cstr(p: *const std::ffi::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: the library returns NUL-terminated strings that live until the next error.
    unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

struct Rank {
    comm: ncclComm_t,
    rank: usize,
    send: Vec<u8>,
    recv: Vec<u8>,
}

/// Counts for one size: (count argument, send bytes, recv bytes), as nccl-tests sizes them.
fn shape(c: Coll, bytes: usize, es: usize, n: usize) -> (usize, usize, usize) {
    let count = bytes / es;
    match c {
        Coll::AllReduce | Coll::Broadcast | Coll::Reduce | Coll::SendRecv => (count, count * es, count * es),
        Coll::AllGather | Coll::Gather => (count / n, count / n * es, count / n * n * es),
        Coll::ReduceScatter | Coll::Scatter => (count / n, count / n * n * es, count / n * es),
        Coll::AlltoAll => (count / n, count / n * n * es, count / n * n * es),
    }
}

fn issue(o: &Opts, r: &mut Rank, n: usize, count: usize, in_place: bool) -> ncclResult_t {
    let dt = ncclDataType_t(o.dtype.0);
    let op = ncclRedOp_t(o.op.0);
    let rp = r.recv.as_mut_ptr() as *mut c_void;
    let es = o.dtype.2;
    let sp: *const c_void = if in_place {
        match o.coll {
            Coll::AllGather => r.recv[r.rank * count * es..].as_ptr() as *const c_void,
            Coll::Gather => r.recv[r.rank * count * es..].as_ptr() as *const c_void,
            _ => rp,
        }
    } else {
        r.send.as_ptr() as *const c_void
    };
    let rp = match (in_place, o.coll) {
        (true, Coll::ReduceScatter) => r.send[r.rank * count * es..].as_mut_ptr() as *mut c_void,
        (true, Coll::Scatter) => r.send[r.rank * count * es..].as_mut_ptr() as *mut c_void,
        _ => rp,
    };
    let sp = if in_place && matches!(o.coll, Coll::ReduceScatter | Coll::Scatter) { r.send.as_ptr() as *const c_void } else { sp };
    let s = null_mut();
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

/// Run one iteration on every local rank (in a group when there are several).
fn step(o: &Opts, ranks: &mut [Rank], n: usize, count: usize, in_place: bool) {
    let grouped = ranks.len() > 1;
    if grouped {
        check(ncclGroupStart(), "ncclGroupStart");
    }
    for r in ranks.iter_mut() {
        check(issue(o, r, n, count, in_place), "collective");
    }
    if grouped {
        check(ncclGroupEnd(), "ncclGroupEnd");
    }
}

/// Fill inputs with small integers whose reductions are exact in every type, run once, and
/// count wrong output elements (float32 only is checked exactly; others by sum of ranks).
fn validate(o: &Opts, ranks: &mut [Rank], n: usize, count: usize, in_place: bool) -> u64 {
    if o.dtype.0 != 7 || (o.coll.reduces() && o.op.0 != 0) {
        return 0; // the checker covers float32 sums and data movement; ffi-tests cover the rest
    }
    let val = |rank: usize, i: usize| ((rank + i) % 5) as f32;
    let (_, sbytes, rbytes) = match o.coll {
        Coll::SendRecv | Coll::Broadcast | Coll::Reduce | Coll::AllReduce => (count, count * 4, count * 4),
        Coll::AllGather | Coll::Gather => (count, count * 4, count * n * 4),
        Coll::ReduceScatter | Coll::Scatter => (count, count * n * 4, count * 4),
        Coll::AlltoAll => (count, count * n * 4, count * n * 4),
    };
    for r in ranks.iter_mut() {
        let rank = r.rank;
        for (i, c) in r.send[..sbytes].chunks_exact_mut(4).enumerate() {
            c.copy_from_slice(&val(rank, i).to_le_bytes());
        }
        r.recv.iter_mut().for_each(|b| *b = 0);
        if in_place {
            let (sl, rl) = (sbytes, rbytes);
            match o.coll {
                Coll::AllGather => { let k = count * 4; let s = r.send[..k].to_vec(); r.recv[rank * k..(rank + 1) * k].copy_from_slice(&s); }
                Coll::Gather => { let k = count * 4; let s = r.send[..k].to_vec(); r.recv[rank * k..(rank + 1) * k].copy_from_slice(&s); }
                Coll::ReduceScatter | Coll::Scatter => {}
                _ if sl == rl => { let s = r.send[..sl].to_vec(); r.recv[..rl].copy_from_slice(&s); }
                _ => {}
            }
        }
    }
    step(o, ranks, n, count, in_place);
    let mut wrong = 0u64;
    for r in ranks.iter() {
        let rank = r.rank;
        let root = o.root as usize;
        let out: Vec<f32> = match (in_place, o.coll) {
            (true, Coll::ReduceScatter) => r.send[rank * count * 4..(rank + 1) * count * 4].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            (true, Coll::Scatter) => r.send[rank * count * 4..(rank + 1) * count * 4].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            _ => r.recv[..rbytes].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        };
        for (i, &got) in out.iter().enumerate() {
            let want = match o.coll {
                Coll::AllReduce => Some((0..n).map(|q| val(q, i)).sum::<f32>()),
                Coll::Reduce => (rank == root).then(|| (0..n).map(|q| val(q, i)).sum::<f32>()),
                Coll::Broadcast => Some(val(root, i)),
                Coll::AllGather => Some(val(i / count.max(1), i % count.max(1))),
                Coll::Gather => (rank == root).then(|| val(i / count.max(1), i % count.max(1))),
                Coll::ReduceScatter => Some((0..n).map(|q| val(q, rank * count + i)).sum::<f32>()),
                Coll::Scatter => Some(val(root, rank * count + i)),
                Coll::AlltoAll => Some(val(i / count.max(1), rank * count + i % count.max(1))),
                Coll::SendRecv => Some(val((rank + n - 1) % n, i)),
            };
            if let Some(w) = want {
                if got != w {
                    wrong += 1;
                }
            }
        }
    }
    wrong
}

/// Max over all ranks of a local value (an allreduce through the library itself).
fn global_max(ranks: &mut [Rank], v: f64) -> f64 {
    let mut bufs: Vec<f64> = vec![v; ranks.len()];
    let grouped = ranks.len() > 1;
    if grouped {
        check(ncclGroupStart(), "ncclGroupStart");
    }
    for (r, b) in ranks.iter().zip(bufs.iter_mut()) {
        let p = b as *mut f64 as *mut c_void;
        check(ncclAllReduce(p, p, 1, ncclDataType_t(8), ncclRedOp_t(2), r.comm, null_mut()), "max");
    }
    if grouped {
        check(ncclGroupEnd(), "ncclGroupEnd");
    }
    bufs[0]
}

fn global_sum_u64(ranks: &mut [Rank], v: u64) -> u64 {
    let mut bufs: Vec<u64> = vec![0; ranks.len()];
    bufs[0] = v;
    let grouped = ranks.len() > 1;
    if grouped {
        check(ncclGroupStart(), "ncclGroupStart");
    }
    for (r, b) in ranks.iter().zip(bufs.iter_mut()) {
        let p = b as *mut u64 as *mut c_void;
        check(ncclAllReduce(p, p, 1, ncclDataType_t(5), ncclRedOp_t(0), r.comm, null_mut()), "sum");
    }
    if grouped {
        check(ncclGroupEnd(), "ncclGroupEnd");
    }
    bufs[0]
}

fn run_ranks(o: &Opts, proc_index: usize, nprocs: usize) -> u64 {
    let local = o.threads;
    let n = nprocs * local;
    let mut comms: Vec<ncclComm_t> = vec![null_mut(); local];
    if nprocs == 1 {
        check(ncclCommInitAll(comms.as_mut_ptr(), local as i32, std::ptr::null()), "ncclCommInitAll");
    } else {
        let mut id = ncclUniqueId { internal: [0; 128] };
        check(ncclGetUniqueId(&mut id), "ncclGetUniqueId (NCCL_COMM_ID must be set for several processes)");
        check(ncclGroupStart(), "ncclGroupStart");
        for (l, c) in comms.iter_mut().enumerate() {
            check(ncclCommInitRank(c, n as i32, id, (proc_index * local + l) as i32), "ncclCommInitRank");
        }
        check(ncclGroupEnd(), "ncclGroupEnd");
    }
    let es = o.dtype.2;
    let (_, smax, rmax) = shape(o.coll, o.max, es, n);
    let mut ranks: Vec<Rank> = comms.iter().enumerate().map(|(l, &comm)| Rank {
        comm, rank: proc_index * local + l, send: vec![1u8; smax.max(es)], recv: vec![0u8; rmax.max(es)] }).collect();
    let lead = proc_index == 0;
    if lead {
        println!("# nccl-rs-perf {:?}: nranks {n} ({nprocs} process(es) x {local} rank(s)), minBytes {} maxBytes {} step: {} warmup iters: {} iters: {} validation: {}",
                 o.coll, o.min, o.max, if o.incr > 0 { format!("{}(bytes)", o.incr) } else { format!("{}(factor)", o.factor) },
                 o.warmup, o.iters, o.check as u8);
        println!("#");
        println!("# {:>10} {:>12} {:>8} {:>6} {:>6}   {:>9} {:>7} {:>7} {:>6}   {:>9} {:>7} {:>7} {:>6}",
                 "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong");
        println!("# {:>10} {:>12} {:>8} {:>6} {:>6}   {:>9} {:>7} {:>7} {:>6}   {:>9} {:>7} {:>7} {:>6}",
                 "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "");
    }
    let mut total_wrong = 0u64;
    let mut bus_sum = 0.0;
    let mut rows = 0;
    let mut size = o.min;
    loop {
        let (count, _, _) = shape(o.coll, size, es, n);
        let mut cells = Vec::new();
        for in_place in [false, true] {
            let wrong = if o.check { validate(o, &mut ranks, n, count, in_place) } else { 0 };
            for _ in 0..o.warmup {
                step(o, &mut ranks, n, count, in_place);
            }
            let t0 = Instant::now();
            for _ in 0..o.iters {
                step(o, &mut ranks, n, count, in_place);
            }
            let us = t0.elapsed().as_secs_f64() * 1e6 / o.iters as f64;
            let us = global_max(&mut ranks, us);
            let wrong = global_sum_u64(&mut ranks, wrong);
            total_wrong += wrong;
            let bytes = shape(o.coll, size, es, n).2.max(shape(o.coll, size, es, n).1) as f64;
            let bytes = if o.coll == Coll::ReduceScatter || o.coll == Coll::Scatter { shape(o.coll, size, es, n).1 as f64 } else { bytes };
            let algbw = bytes / us / 1e3;
            let busbw = algbw * o.coll.bus_factor(n);
            bus_sum += busbw;
            cells.push(format!("{:>9.2} {:>7.2} {:>7.2} {:>6}", us, algbw, busbw, wrong));
        }
        rows += 2;
        if lead {
            let root = if o.coll.rooted() { o.root } else { -1 };
            let redop = if o.coll.reduces() { o.op.1 } else { "none" };
            println!("  {:>10} {:>12} {:>8} {:>6} {:>6}   {}   {}", shape(o.coll, size, es, n).0 * es * match o.coll {
                Coll::AllGather | Coll::Gather | Coll::ReduceScatter | Coll::Scatter | Coll::AlltoAll => n, _ => 1 },
                count, o.dtype.1, redop, root, cells[0], cells[1]);
        }
        let next = if o.incr > 0 { size + o.incr } else { size * o.factor };
        if next > o.max || next == size {
            break;
        }
        size = next;
    }
    if lead {
        println!("# Out of bounds values : {} {}", total_wrong, if total_wrong == 0 { "OK" } else { "FAILED" });
        println!("# Avg bus bandwidth    : {:.4}", bus_sum / rows.max(1) as f64);
        println!("#");
    }
    for c in comms {
        check(ncclCommDestroy(c), "ncclCommDestroy");
    }
    total_wrong
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).unwrap_or(29500)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let o = match parse_args(&args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    if let Some((proc_index, nprocs)) = launch_env() {
        let wrong = run_ranks(&o, proc_index, nprocs);
        return if wrong == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE };
    }
    if o.np == 1 {
        let wrong = run_ranks(&o, 0, 1);
        return if wrong == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE };
    }
    // Fork -np copies of ourselves as ranks, joined through NCCL_COMM_ID.
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("cannot find own executable: {e}");
            return ExitCode::from(2);
        }
    };
    let comm_id = std::env::var("NCCL_COMM_ID").unwrap_or_else(|_| format!("127.0.0.1:{}", free_port()));
    let children: Vec<_> = (0..o.np)
        .map(|p| Command::new(&exe).args(&args).env("NCCL_RS_PERF_PROC", p.to_string())
             .env("NCCL_RS_PERF_NPROCS", o.np.to_string()).env("NCCL_COMM_ID", &comm_id).spawn())
        .collect();
    let mut ok = true;
    for c in children {
        match c.and_then(|mut c| c.wait()) {
            Ok(s) if s.success() => {}
            _ => ok = false,
        }
    }
    if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}
