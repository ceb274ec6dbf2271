//! `--init N`: how long a communicator of N processes takes to create and destroy, and what
//! memory it costs.
//!
//! The parent forks N processes and drives them over their stdin/stdout. Per repeat, rank 0
//! calls `ncclGetUniqueId` (as an application's rank 0 does; the bootstrap root then runs in
//! its process), the parent hands the id to every rank at once, and each rank times
//! `ncclCommInitRank`, then the first 8-byte `ncclAllReduce` (where a library that connects
//! lazily pays for its connections), then `ncclCommDestroy`. A repeat's time is the slowest
//! rank's; the table shows median, min and max over repeats. Process start and library load
//! are not counted: every rank is started and waiting before the first repeat.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::ptr::null_mut;
use std::time::Instant;

use nccl::abi::coll::ncclAllReduce;
use nccl::abi::comm::*;
use nccl::abi::misc::ncclGetUniqueId;
use nccl::abi::types::*;

use crate::ffi::check;
use crate::opts::Opts;

const CHILD_ENV: &str = "NCCL_RS_PERF_INIT_RANK";
const STAT_NAMES: [&str; 4] = ["GpuMemSuspend", "GpuMemSuspended", "GpuMemPersist", "GpuMemTotal"];

pub fn run(o: &Opts, nranks: usize) -> Result<(), String> {
    match std::env::var(CHILD_ENV).ok().and_then(|v| v.parse::<usize>().ok()) {
        Some(rank) => child(o, rank, nranks),
        None => parent(o, nranks),
    }
}

/// (VmRSS, VmHWM) of this process in KiB.
fn vm_kib() -> (i64, i64) {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| s.lines().find(|l| l.starts_with(name))
        .and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse().ok()).unwrap_or(-1);
    (field("VmRSS:"), field("VmHWM:"))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Result<ncclUniqueId, String> {
    let mut id = ncclUniqueId { internal: [0; 128] };
    if s.len() != 256 {
        return Err(format!("bad unique id from the parent: {} hex digits", s.len()));
    }
    for (i, c) in id.internal.iter_mut().enumerate() {
        *c = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|_| "bad unique id hex".to_string())? as _;
    }
    Ok(id)
}

/// One repeat on one rank; the reply line the parent parses.
fn measure(rank: usize, nranks: usize, id: ncclUniqueId) -> Result<String, String> {
    let (rss0, hwm0) = vm_kib();
    let mut comm: ncclComm_t = null_mut();
    let t = Instant::now();
    check(ncclCommInitRank(&mut comm, nranks as i32, id, rank as i32), "ncclCommInitRank")?;
    let init = t.elapsed().as_secs_f64();
    let (rss1, hwm1) = vm_kib();
    let mut buf = [1.0f32; 2];
    let p = buf.as_mut_ptr() as *mut std::ffi::c_void;
    let t = Instant::now();
    check(ncclAllReduce(p, p, 2, ncclDataType_t(7), ncclRedOp_t(0), comm, null_mut()), "first ncclAllReduce")?;
    let first = t.elapsed().as_secs_f64();
    if buf != [nranks as f32; 2] {
        return Err(format!("rank {rank}: first allreduce gave {buf:?}, expected {nranks}"));
    }
    let (rss2, hwm2) = vm_kib();
    // After the first call: connections are made on first use, so now they exist.
    let stats: Vec<String> = (0..4).map(|s| {
        let mut v = 0u64;
        let r = ncclCommMemStats(comm, ncclCommMemStat_t(s), &mut v);
        if r.0 == 0 { v.to_string() } else { "-1".to_string() }
    }).collect();
    let t = Instant::now();
    check(ncclCommDestroy(comm), "ncclCommDestroy")?;
    let destroy = t.elapsed().as_secs_f64();
    let (rss3, _) = vm_kib();
    Ok(format!("res {init} {first} {destroy} {rss0} {rss1} {rss2} {rss3} {hwm0} {hwm1} {hwm2} {}", stats.join(" ")))
}

fn child(o: &Opts, rank: usize, nranks: usize) -> Result<(), String> {
    crate::die_with_parent();
    if o.bind {
        crate::bind_to_cpu(rank);
    }
    let stdin = std::io::stdin();
    let mut out = std::io::stdout().lock();
    let say = |out: &mut std::io::StdoutLock, s: &str| writeln!(out, "{s}").and_then(|_| out.flush()).map_err(|e| e.to_string());
    say(&mut out, "ready")?;
    for line in stdin.lock().lines() {
        let line = line.map_err(|e| e.to_string())?;
        let mut words = line.split_whitespace();
        match words.next() {
            Some("id") => {
                let mut id = ncclUniqueId { internal: [0; 128] };
                check(ncclGetUniqueId(&mut id), "ncclGetUniqueId")?;
                say(&mut out, &format!("id {}", hex(&id.internal.map(|c| c as u8))))?;
            }
            Some("go") => {
                let id = unhex(words.next().unwrap_or(""))?;
                say(&mut out, &measure(rank, nranks, id)?)?;
            }
            _ => break,
        }
    }
    Ok(())
}

struct Proc {
    child: Child,
    to: ChildStdin,
    from: BufReader<ChildStdout>,
}

impl Proc {
    fn send(&mut self, s: &str) -> Result<(), String> {
        writeln!(self.to, "{s}").and_then(|_| self.to.flush()).map_err(|e| format!("rank stopped: {e}"))
    }
    fn recv(&mut self, want: &str) -> Result<Vec<f64>, String> {
        let mut line = String::new();
        self.from.read_line(&mut line).map_err(|e| e.to_string())?;
        let mut w = line.split_whitespace();
        if w.next() != Some(want) {
            return Err(format!("a rank exited or answered '{}' instead of '{want}' (see its messages above)", line.trim()));
        }
        Ok(w.filter_map(|x| x.parse().ok()).collect())
    }
}

fn spawn(o: &Opts, nranks: usize) -> Result<Vec<Proc>, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find own executable: {e}"))?;
    let mut procs = Vec::with_capacity(nranks);
    for r in 0..nranks {
        let mut child = Command::new(&exe)
            .args(["--init", &nranks.to_string(), "--bind", if o.bind { "1" } else { "0" }])
            .env(CHILD_ENV, r.to_string())
            .env_remove("NCCL_COMM_ID") // rank 0's ncclGetUniqueId starts the root, as in an application
            .stdin(Stdio::piped()).stdout(Stdio::piped())
            .spawn().map_err(|e| format!("cannot start rank {r}: {e}"))?;
        let to = child.stdin.take().unwrap();
        let from = BufReader::new(child.stdout.take().unwrap());
        procs.push(Proc { child, to, from });
    }
    Ok(procs)
}

/// (median, min, max) of a sample.
fn stats(v: &[f64]) -> (f64, f64, f64) {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let k = s.len();
    let med = if k % 2 == 1 { s[k / 2] } else { 0.5 * (s[k / 2 - 1] + s[k / 2]) };
    (med, s[0], s[k - 1])
}

/// Every repeat's reply from every rank: res[repeat][rank] = the numbers of `measure`.
fn drive(procs: &mut [Proc], repeats: usize) -> Result<Vec<Vec<Vec<f64>>>, String> {
    for p in procs.iter_mut() {
        p.recv("ready")?;
    }
    let mut res = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        procs[0].send("id")?;
        let mut line = String::new();
        procs[0].from.read_line(&mut line).map_err(|e| e.to_string())?;
        let id = line.strip_prefix("id ").ok_or_else(|| format!("rank 0 answered '{}' instead of an id", line.trim()))?;
        let go = format!("go {}", id.trim());
        for p in procs.iter_mut() {
            p.send(&go)?;
        }
        res.push(procs.iter_mut().map(|p| p.recv("res")).collect::<Result<Vec<_>, _>>()?);
    }
    Ok(res)
}

fn parent(o: &Opts, nranks: usize) -> Result<(), String> {
    let mut procs = spawn(o, nranks)?;
    let result = drive(&mut procs, o.repeats);
    for p in procs.iter_mut() {
        let _ = p.send("exit");
    }
    for mut p in procs {
        if result.is_err() {
            let _ = p.child.kill();
        }
        let _ = p.child.wait();
    }
    report(o, nranks, &result?);
    Ok(())
}

fn report(o: &Opts, nranks: usize, res: &[Vec<Vec<f64>>]) {
    println!("# nccl-rs-perf init: {nranks} ranks ({nranks} processes x 1 rank), {} repeats, bind {}; {}",
             res.len(), o.bind as u8, crate::bench::host_line());
    println!("# init = ncclCommInitRank (id from ncclGetUniqueId on rank 0); first = the first 8-byte ncclAllReduce");
    println!("# after it; destroy = ncclCommDestroy. Per repeat the slowest rank's time; ms over repeats.");
    println!("{:<6} {:>6} {:<8} {:>10} {:>10} {:>10}", "#", "ranks", "what", "median", "min", "max");
    for (col, what) in ["init", "first", "destroy"].iter().enumerate() {
        let per_repeat: Vec<f64> = res.iter().map(|r| r.iter().map(|x| x[col]).fold(0.0, f64::max) * 1e3).collect();
        let (med, min, max) = stats(&per_repeat);
        println!("{:<6} {:>6} {:<8} {:>10.3} {:>10.3} {:>10.3}", "init", nranks, what, med, min, max);
    }
    // Memory columns: 3 rss0, 4 rss1, 5 rss2, 6 rss3, 7 hwm0, 8 hwm1, 9 hwm2 (KiB); 10.. MemStats.
    let growth = |rep: &Vec<Vec<f64>>, a: usize, b: usize| stats(&rep.iter().map(|x| x[b] - x[a]).collect::<Vec<_>>()).0;
    let (first, last) = (&res[0], &res[res.len() - 1]);
    println!("# memory per communicator, KiB, median over ranks (first repeat | last repeat):");
    println!("#   VmRSS growth across init {:>8.0} | {:<8.0} after the first call {:>8.0} | {:<8.0} left after destroy {:>6.0} | {:.0}",
             growth(first, 3, 4), growth(last, 3, 4), growth(first, 3, 5), growth(last, 3, 5), growth(first, 3, 6), growth(last, 3, 6));
    println!("#   VmHWM growth across init {:>8.0} | {:<8.0} after the first call {:>8.0} | {:.0}",
             growth(first, 7, 8), growth(last, 7, 8), growth(first, 7, 9), growth(last, 7, 9));
    let ms: Vec<String> = STAT_NAMES.iter().enumerate()
        .map(|(i, name)| format!("{name} {}", first[0].get(10 + i).map_or("?".into(), |v| format!("{v:.0}")))).collect();
    println!("#   ncclCommMemStats (rank 0, after the first all-reduce): {} (bytes; GpuMemSuspended is 0/1)", ms.join(", "));
}
