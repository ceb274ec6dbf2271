//! The sweep: for every size, one checked call (`-c 1`), warmup, then timed iterations of
//! `barrier; t0; call; t1`; per iteration the slowest rank's time, and per size the median
//! over iterations, exactly as mpi_allreduce_bench.c and gloo_bench.py measure the baselines.
//! Printed as nccl-tests' table (or the baselines' one), and optionally written as JSON.

use std::time::Instant;

use nccl::abi::misc::ncclGetVersion;

use crate::ffi::{self, barrier, check, max_over_ranks, step, sum_over_ranks, Rank};
use crate::json::Json;
use crate::opts::{Opts, Table};
use crate::verify::validate;

/// One measured column group: out-of-place or in-place at one size.
struct Cell {
    median_us: f64,
    min_us: f64,
    max_us: f64,
    iters: usize,
    algbw: f64,
    busbw: f64,
    /// Wrong elements over all ranks; None: not checked.
    wrong: Option<u64>,
    /// Median time this process's thread spent in the calls (their return, not their work).
    call_us: f64,
}

struct Row {
    bytes: usize,
    count: usize,
    cells: Vec<Cell>,
}

fn median_sorted(t: &[f64]) -> f64 {
    let k = t.len();
    if k % 2 == 1 { t[k / 2] } else { 0.5 * (t[k / 2 - 1] + t[k / 2]) }
}

fn measure(o: &Opts, ranks: &mut [Rank], n: usize, count: usize, bytes: usize, in_place: bool) -> Result<Cell, String> {
    if o.graph == 0 {
        return measure_steps(o, ranks, n, count, bytes, in_place);
    }
    ffi::capture(o, ranks, n, count, in_place)?;
    let cell = measure_steps(o, ranks, n, count, bytes, in_place);
    ffi::release_graphs(ranks);
    cell
}

/// With `-G N` each step is N launches of the captured call: the times are per launch.
fn measure_steps(o: &Opts, ranks: &mut [Rank], n: usize, count: usize, bytes: usize, in_place: bool)
                 -> Result<Cell, String> {
    let per_step = o.graph.max(1) as f64;
    let wrong = if o.check {
        let local = validate(o, ranks, n, count, in_place)?;
        Some(sum_over_ranks(ranks, &local)?)
    } else {
        None
    };
    let (iters, warmup) = o.iters_at(bytes);
    for _ in 0..warmup {
        step(o, ranks, n, count, in_place)?;
    }
    let mut t = vec![0.0f64; iters];
    let mut calls = vec![0.0f64; iters];
    for (ti, ci) in t.iter_mut().zip(calls.iter_mut()) {
        barrier(ranks)?;
        let t0 = Instant::now();
        *ci = step(o, ranks, n, count, in_place)?;
        *ti = t0.elapsed().as_secs_f64() / per_step;
    }
    calls.sort_by(|a, b| a.total_cmp(b));
    let mut t = max_over_ranks(ranks, &t)?;
    t.sort_by(|a, b| a.total_cmp(b));
    let med = median_sorted(&t);
    let algbw = bytes as f64 / med / 1e9;
    Ok(Cell {
        median_us: med * 1e6,
        min_us: t[0] * 1e6,
        max_us: t[iters - 1] * 1e6,
        iters,
        algbw,
        busbw: algbw * o.coll.bus_factor(n),
        wrong,
        call_us: median_sorted(&calls) * 1e6,
    })
}

fn library_version() -> String {
    let mut v = 0i32;
    if check(ncclGetVersion(&mut v), "ncclGetVersion").is_err() {
        return "?".into();
    }
    format!("{}.{}.{}", v / 10000, v / 100 % 100, v % 100)
}

/// The library's mode and where the buffers live.
fn buffers(o: &Opts) -> String {
    let mode = nccl::device::mode::current().name();
    let place = match (o.device, o.vmm, o.private) {
        (false, ..) => "host",
        (true, false, _) => "device",
        (true, true, false) => "device (virtual memory API, 20 MiB allocations)",
        (true, true, true) => "device (virtual memory API, 20 MiB allocations peers cannot map)",
    };
    let comms = if o.nonblocking { ", nonblocking communicators" } else { "" };
    match o.graph {
        0 => format!("{mode} mode, {place} buffers{comms}"),
        g => format!("{mode} mode, {place} buffers{comms}, each call captured into a CUDA graph launched {g} time(s) per iteration"),
    }
}

fn redop_name(o: &Opts) -> &'static str {
    if o.coll.reduces() { o.op.name } else { "none" }
}

fn root_of(o: &Opts) -> i32 {
    if o.coll.rooted() { o.root } else { -1 }
}

fn iters_text(o: &Opts) -> String {
    match o.min_iters {
        None => format!("warmup iters: {} iters: {}", o.warmup, o.iters),
        Some(m) => format!("warmup iters: {} iters: {} (sizes over 1 MiB: max({m}, {}*1MiB/size), warmup likewise, min 2)",
                           o.warmup, o.iters, o.iters),
    }
}

const TIMING: &str = "time = median over iterations of the max-over-ranks per-iteration time (barrier; t0; call; t1), \
as mpi_allreduce_bench; GB = 1e9 B";

fn print_header(o: &Opts, n: usize, nprocs: usize) {
    let step = if o.incr > 0 { format!("{}(bytes)", o.incr) } else { format!("{}(factor)", o.factor) };
    let extra: Vec<String> = o.extra.iter().map(|s| s.to_string()).collect();
    println!("# nccl-rs-perf {}: nccl-rs {} ({}), nranks {n} ({nprocs} process(es) x {} rank(s)), {} {}, root {}, bind {}",
             o.coll.name(), library_version(), buffers(o), o.threads, o.dtype.name, redop_name(o), root_of(o), o.bind as u8);
    println!("# minBytes {} maxBytes {} step: {step} extra: [{}] {} validation: {}",
             o.min, o.max, extra.join(","), iters_text(o), o.check as u8);
    println!("# {TIMING}");
    match o.table {
        Table::NcclTests => {
            println!("#");
            println!("# {:>62}{:>33}", "out-of-place", "in-place");
            println!("# {:>10} {:>12} {:>8} {:>6} {:>6}   {:>9} {:>7} {:>7} {:>6}   {:>9} {:>7} {:>7} {:>6}",
                     "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong");
            println!("# {:>10} {:>12} {:>8} {:>6} {:>6}   {:>9} {:>7} {:>7} {:>6}   {:>9} {:>7} {:>7} {:>6}",
                     "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "");
        }
        Table::Baselines => {
            println!("# busbw factors: allreduce 2(n-1)/n, allgather/reducescatter (n-1)/n, bcast 1; {} only",
                     if o.in_place { "in-place" } else { "out-of-place" });
            println!("{:<14} {:>12} {:>12} {:>6} {:>5} {:>12} {:>10} {:>10} {:>12} {:>12} {:>7} {:>8}", "op", "size(B)",
                     "count", "type", "redop", "time(us)", "algbw", "busbw", "min(us)", "max(us)", "iters", "#wrong");
        }
    }
}

fn print_row(o: &Opts, r: &Row) {
    match o.table {
        Table::NcclTests => {
            let cells: Vec<String> = r.cells.iter().map(|c| {
                let w = c.wrong.map_or("N/A".to_string(), |w| w.to_string());
                format!("{:>9.2} {:>7.2} {:>7.2} {:>6}", c.median_us, c.algbw, c.busbw, w)
            }).collect();
            println!("  {:>10} {:>12} {:>8} {:>6} {:>6}   {}", r.bytes, r.count, o.dtype.name, redop_name(o), root_of(o),
                     cells.join("   "));
        }
        Table::Baselines => {
            let c = &r.cells[0];
            println!("{:<14} {:>12} {:>12} {:>6} {:>5} {:>12.2} {:>10.3} {:>10.3} {:>12.2} {:>12.2} {:>7} {:>8}",
                     o.coll.name(), r.bytes, r.count, o.dtype.name, redop_name(o), c.median_us, c.algbw, c.busbw,
                     c.min_us, c.max_us, c.iters, c.wrong.map_or(-1, |w| w as i64));
        }
    }
}

/// Run the whole sweep as process `proc_index` of `nprocs`; the first prints and writes JSON.
pub fn run(o: &Opts, proc_index: usize, nprocs: usize) -> Result<(), String> {
    if o.bind {
        crate::bind_to_cpu(proc_index);
    }
    let n = nprocs * o.threads;
    let es = o.dtype.size;
    let sizes = o.sizes();
    let cmax = o.coll.count_arg(*sizes.last().unwrap_or(&0), es, n);
    let (imax, omax) = o.coll.elems(cmax, n);
    let mut ranks = ffi::init_ranks(o, proc_index, nprocs, imax * es, omax * es)?;
    let lead = proc_index == 0;
    if lead {
        print_header(o, n, nprocs);
    }
    let modes: &[bool] = match (&o.table, o.in_place) {
        (Table::Baselines, false) => &[false],
        (Table::Baselines, true) => &[true],
        (Table::NcclTests, _) => &[false, true],
    };
    let mut rows = Vec::new();
    for &size in &sizes {
        let count = o.coll.count_arg(size, es, n);
        if count == 0 {
            continue; // as the baselines: a size smaller than one element per rank is skipped
        }
        let (nin, nout) = o.coll.elems(count, n);
        let bytes = nin.max(nout) * es;
        let cells = modes.iter().map(|&ip| measure(o, &mut ranks, n, count, bytes, ip)).collect::<Result<Vec<_>, _>>()?;
        let row = Row { bytes, count: bytes / es, cells };
        if lead {
            print_row(o, &row);
        }
        rows.push(row);
    }
    let wrong: u64 = rows.iter().flat_map(|r| &r.cells).filter_map(|c| c.wrong).sum();
    let cells: Vec<&Cell> = rows.iter().flat_map(|r| &r.cells).collect();
    let avg_busbw = cells.iter().map(|c| c.busbw).sum::<f64>() / cells.len().max(1) as f64;
    if lead {
        println!("# Out of bounds values : {} {}", wrong, if wrong == 0 { "OK" } else { "FAILED" });
        println!("# Avg bus bandwidth    : {avg_busbw:.4}");
        println!("#");
        if o.device || o.nonblocking {
            // With device buffers (or on nonblocking communicators) a call only queues its
            // work; this is what it costs the calling thread (process 0's, median), next to the
            // time the work takes.
            for r in &rows {
                let per: Vec<String> = r.cells.iter().map(|c| format!("{:.2}", c.call_us)).collect();
                println!("# {:>12} bytes: {} us per call (in the call; {})", r.bytes, per.join(" / "),
                         if per.len() > 1 { "out-of-place / in-place" } else { "as measured" });
            }
            // The yardstick: a plain copy on the device, after the sweep (the other ranks
            // idle), at each size.
            for r in rows.iter().filter(|_| o.device) {
                if let Some(gbps) = ffi::copy_gbps(&ranks[0], r.bytes)? {
                    println!("# {:>12} bytes: device-to-device copy {gbps:.2} GB/s (cuMemcpyAsync, bytes / time)", r.bytes);
                }
            }
        }
        if let Some(path) = &o.json {
            let doc = to_json(o, n, nprocs, &rows, avg_busbw, wrong);
            std::fs::write(path, doc.pretty()).map_err(|e| format!("cannot write {path}: {e}"))?;
        }
    }
    ffi::destroy(ranks)?;
    if wrong > 0 {
        return Err(format!("{wrong} wrong values ({} {} {})", o.coll.name(), o.dtype.name, redop_name(o)));
    }
    Ok(())
}

/// `v` to 6 significant digits: the measurement holds no more, and the JSON stays readable.
fn sig6(v: f64) -> Json {
    Json::Num(format!("{v:.5e}").parse().unwrap_or(v))
}

fn cell_json(c: &Cell) -> Json {
    Json::obj(vec![
        ("time_us", sig6(c.median_us)),
        ("min_us", sig6(c.min_us)),
        ("max_us", sig6(c.max_us)),
        ("iters", Json::Num(c.iters as f64)),
        ("algbw", sig6(c.algbw)),
        ("busbw", sig6(c.busbw)),
        ("wrong", c.wrong.map_or(Json::Null, |w| Json::Num(w as f64))),
    ])
}

fn to_json(o: &Opts, n: usize, nprocs: usize, rows: &[Row], avg_busbw: f64, wrong: u64) -> Json {
    let label = o.label.clone().unwrap_or_else(|| format!("nccl-rs {} n={n}", o.coll.name()));
    let rows = rows.iter().map(|r| {
        let mut pairs = vec![
            ("size", Json::Num(r.bytes as f64)),
            ("count", Json::Num(r.count as f64)),
            ("type", Json::str(o.dtype.name)),
            ("redop", Json::str(redop_name(o))),
            ("root", Json::Num(root_of(o) as f64)),
        ];
        match (&o.table, o.in_place) {
            (Table::Baselines, true) => pairs.push(("in_place", cell_json(&r.cells[0]))),
            _ => {
                pairs.push(("out_of_place", cell_json(&r.cells[0])));
                if let Some(c) = r.cells.get(1) {
                    pairs.push(("in_place", cell_json(c)));
                }
            }
        }
        Json::obj(pairs)
    }).collect();
    Json::obj(vec![
        ("tool", Json::str("nccl-rs-perf")),
        ("library", Json::str(&format!("nccl-rs {} ({})", library_version(), buffers(o)))),
        ("label", Json::Str(label)),
        ("collective", Json::str(o.coll.name())),
        ("nranks", Json::Num(n as f64)),
        ("nprocs", Json::Num(nprocs as f64)),
        ("ranks_per_process", Json::Num(o.threads as f64)),
        ("dtype", Json::str(o.dtype.name)),
        ("op", Json::str(redop_name(o))),
        ("root", Json::Num(root_of(o) as f64)),
        ("timing", Json::str(TIMING)),
        ("iters", Json::Num(o.iters as f64)),
        ("min_iters", o.min_iters.map_or(Json::Null, |m| Json::Num(m as f64))),
        ("warmup", Json::Num(o.warmup as f64)),
        ("bind", Json::Bool(o.bind)),
        ("check", Json::Bool(o.check)),
        ("date", Json::Str(utc_now())),
        ("host", Json::Str(host_line())),
        ("rows", Json::Arr(rows)),
        ("avg_busbw", sig6(avg_busbw)),
        ("wrong", Json::Num(wrong as f64)),
    ])
}

/// Now as ISO 8601 UTC, from the system clock (days to civil date: Howard Hinnant's algorithm).
pub fn utc_now() -> String {
    utc(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0) as i64)
}

fn utc(s: i64) -> String {
    let (days, rem) = (s.div_euclid(86400), s.rem_euclid(86400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem / 60 % 60, rem % 60)
}

/// Host name, CPU count and model, and the load average: what a reader needs to judge noise.
pub fn host_line() -> String {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let model = read("/proc/cpuinfo").lines().find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1)).unwrap_or("").trim().to_string();
    // SAFETY: sysconf only reads a system value. (Not available_parallelism: --bind narrows it.)
    let cpus = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    let load: Vec<String> = read("/proc/loadavg").split_whitespace().take(3).map(String::from).collect();
    format!("{}; {cpus} cpus; {model}; load {}", read("/proc/sys/kernel/hostname").trim(), load.join(" "))
}

#[cfg(test)]
mod tests {
    #[test]
    fn utc_dates_are_civil() {
        assert_eq!(super::utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(super::utc(1_709_210_096), "2024-02-29T12:34:56Z");
        assert_eq!(super::utc(951_825_600), "2000-02-29T12:00:00Z");
    }

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(super::median_sorted(&[1.0, 2.0, 3.0]), 2.0);
        assert_eq!(super::median_sorted(&[1.0, 2.0, 3.0, 10.0]), 2.5);
    }
}
