//! nccl-rs-perf: busbw against message size, with nccl-tests' flags and table.
//!
//! ```text
//! nccl-rs-perf allreduce -np 2 -b 8 -e 64M -f 2        # 2 local processes
//! nccl-rs-perf allgather -t 4 -b 1K -e 16M             # 4 ranks in one process
//! nccl-rs-perf allreduce -np 2 --json ar.json          # the table, also as JSON
//! nccl-rs-perf --plot busbw.svg ar.json mpi.txt        # busbw against size, one line per file
//! nccl-rs-perf --init 8                                # communicator init/destroy time and memory
//! torchrun-style launch: RANK/WORLD_SIZE (or OMPI_COMM_WORLD_*, SLURM_*) + NCCL_COMM_ID
//! ```
//! It calls the library through its C API, exactly as an application does. Times are the
//! median over iterations of the slowest rank's time per iteration, as the Open MPI and Gloo
//! baselines in `../shared/scripts/baselines` measure them, so their tables compare directly.

#[path = "perf/bench.rs"]
mod bench;
#[path = "perf/ffi.rs"]
mod ffi;
#[path = "perf/init.rs"]
mod init;
#[path = "perf/json.rs"]
mod json;
#[path = "perf/opts.rs"]
mod opts;
#[path = "perf/plot.rs"]
mod plot;
#[path = "perf/verify.rs"]
mod verify;

use std::process::{Child, Command, ExitCode};
use std::time::{Duration, Instant};

use opts::{Mode, Opts};

/// Which process of the job this is, from our own launcher or a foreign one.
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

/// Pin this process to one CPU (`--bind 1`), as `mpirun --bind-to core` and gloo_bench's
/// `--bind 1` do: process p runs on the p-th allowed CPU, modulo their number.
pub fn bind_to_cpu(proc_index: usize) {
    // SAFETY: cpu_set_t is plain data; the calls only read and write the set we pass.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return;
        }
        let cpus: Vec<usize> = (0..libc::CPU_SETSIZE as usize).filter(|&c| libc::CPU_ISSET(c, &set)).collect();
        if cpus.is_empty() {
            return;
        }
        let mut one: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpus[proc_index % cpus.len()], &mut one);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &one);
    }
}

/// In a process this tool forked: go when the parent goes (killed by `timeout`, Ctrl-C), so
/// no rank is left spinning in a collective its peers will never join.
pub fn die_with_parent() {
    // SAFETY: prctl with PR_SET_PDEATHSIG takes a signal number; getppid has no arguments.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
        if libc::getppid() == 1 {
            std::process::exit(1); // the parent is already gone
        }
    }
}

/// A port for the job's root, free now, below the kernel's ephemeral range: a port the kernel
/// handed out (bind to port 0) may be handed to another process's outgoing connection between
/// this check and rank 0's bind, a port below that range only to a program that asks for it.
fn free_port() -> u16 {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next().and_then(|v| v.parse::<u16>().ok()))
        .unwrap_or(32768);
    let (first, span) = (10_000u16, low.saturating_sub(10_000).max(1) as usize);
    let seed = std::process::id() as usize * 7919;
    for k in 0..span.min(2000) {
        let port = first + ((seed + k * 104_729) % span) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).unwrap_or(29500)
}

/// Fork `-np` copies of ourselves as the processes of one job, joined through NCCL_COMM_ID.
fn fork_ranks(o: &Opts, args: &[String]) -> ExitCode {
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("nccl-rs-perf: cannot find own executable: {e}");
            return ExitCode::from(2);
        }
    };
    let comm_id = std::env::var("NCCL_COMM_ID").unwrap_or_else(|_| format!("127.0.0.1:{}", free_port()));
    let children: Vec<_> = (0..o.np)
        .map(|p| {
            let mut c = Command::new(&exe);
            c.args(args).env("NCCL_RS_PERF_PROC", p.to_string()).env("NCCL_RS_PERF_NPROCS", o.np.to_string())
                .env("NCCL_COMM_ID", &comm_id);
            if o.hosts > 0 {
                c.env("NCCL_HOSTID", format!("nccl-rs-perf-host-{}", p * o.hosts / o.np));
            }
            c.spawn()
        })
        .collect();
    let mut running = Vec::with_capacity(children.len());
    let mut ok = true;
    for (p, c) in children.into_iter().enumerate() {
        match c {
            Ok(c) => running.push((p, c)),
            Err(e) => {
                eprintln!("nccl-rs-perf: cannot start process {p}: {e}");
                ok = false;
            }
        }
    }
    if !ok {
        // The others would wait at init for the missing process as long as NCCL waits.
        end_now(&mut running, "a process could not start");
        return ExitCode::FAILURE;
    }
    if wait_all(running) { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}

/// How long the other processes of a job get, once one has failed, to end with the error the
/// library gives them (a peer lost mid-operation is seen at once) before they are killed: one
/// that failed before joining leaves the others waiting at init as long as NCCL would.
const GRACE_AFTER_FAILURE: Duration = Duration::from_secs(10);

/// Waits for the job's processes, naming each that fails as it does (one killed by a signal,
/// or one that exits before its library could say anything, says nothing itself). Whether all
/// succeeded.
fn wait_all(mut running: Vec<(usize, Child)>) -> bool {
    let mut failed: Option<(usize, Instant)> = None;
    while !running.is_empty() {
        let mut i = 0;
        while i < running.len() {
            let (p, child) = &mut running[i];
            let status = match child.try_wait() {
                Ok(None) => {
                    i += 1;
                    continue;
                }
                Ok(Some(s)) => s,
                Err(e) => {
                    eprintln!("nccl-rs-perf: process {p}: {e}");
                    let _ = child.kill();
                    let _ = child.wait();
                    failed.get_or_insert((*p, Instant::now()));
                    running.swap_remove(i);
                    continue;
                }
            };
            if !status.success() {
                eprintln!("nccl-rs-perf: process {p} {}", describe(status));
                failed.get_or_insert((*p, Instant::now()));
            }
            running.swap_remove(i);
        }
        if let Some((p, at)) = failed {
            if at.elapsed() >= GRACE_AFTER_FAILURE && !running.is_empty() {
                end_now(&mut running, &format!("process {p} failed {} s ago", GRACE_AFTER_FAILURE.as_secs()));
                return false;
            }
        }
        if !running.is_empty() {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    failed.is_none()
}

/// "exited with status 3", "was killed by signal 9".
fn describe(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(sig)) => format!("was killed by signal {sig}"),
        (None, None) => format!("ended: {status}"),
    }
}

/// Kills the processes still running, saying why.
fn end_now(running: &mut Vec<(usize, Child)>, why: &str) {
    for (p, mut child) in running.drain(..) {
        eprintln!("nccl-rs-perf: stopping process {p}: {why}");
        let _ = child.kill();
        let _ = child.wait();
    }
}

fn main() -> ExitCode {
    // `nccl-rs-perf ... | head`: end quietly on a closed pipe, as C tools do, instead of
    // panicking in println!.
    // SAFETY: restoring the default disposition of SIGPIPE before any thread starts.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!("{}", opts::USAGE);
        return ExitCode::SUCCESS;
    }
    let o = match opts::parse_args(&args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let result = match &o.mode {
        Mode::Plot { out, inputs } => plot::run(out, inputs),
        Mode::Init { nranks } => init::run(&o, *nranks),
        Mode::Bench => {
            if let Some((proc_index, nprocs)) = launch_env() {
                if std::env::var_os("NCCL_RS_PERF_PROC").is_some() {
                    die_with_parent();
                }
                bench::run(&o, proc_index, nprocs)
            } else if o.np == 1 {
                bench::run(&o, 0, 1)
            } else {
                return fork_ranks(&o, &args);
            }
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nccl-rs-perf: {e}");
            ExitCode::FAILURE
        }
    }
}
