//! The harness shared by the test files that run the C programs of `ffi-tests/`
//! (`tests/ffi.rs`, `tests/hosts.rs`, `tests/faults.rs`): finding the library cargo built,
//! compiling the programs against our `include/nccl.h` or NVIDIA's `nccl.h`, and running a
//! program as several processes with a deadline ([`Job`]).
//!
//! A [`Job`] can also run each process under a wrapper command (`ip netns exec NAME`, see
//! [`Hosts`]) with environment of its own, start a process late, and act while the job runs:
//! kill a chosen process with SIGKILL, or run a closure (take a link down), when a process
//! prints a marker line or after a delay ([`When`]). [`Job::run_outcome`] hands back what
//! happened (exit statuses, times, logs) for the test to judge; [`Job::run`] asserts that
//! every process exited 0 (and that the processes the job killed died of SIGKILL).
//!
//! Environment:
//! - `NCCL_REFERENCE_DIR`: NVIDIA's header and symbol list (default: the output of
//!   `../shared/scripts/nccl-reference.sh`).
//! - `NCCL_FFI_LIB`: test another `libnccl.so` instead of the one cargo built (for example
//!   NVIDIA's, on a machine with a GPU).
//! - `CC`: the C compiler (default `cc`).
//! - `NCCL_TEST_REPO`: the source tree, when the test binary runs on another machine than the
//!   one that built it (scripts/device-check.sh).
//! - `NCCL_TEST_SKIP_NETNS=1`: tests that need network namespaces (root, iproute2) pass
//!   without running, saying so, instead of failing.
//!
//! Environment contract of the C programs (see `ffi-tests/common.h`): `NCCL_TEST_NPROCS`,
//! `NCCL_TEST_PROC`, `NCCL_TEST_LOCAL`, `NCCL_TEST_ID_FILE`.

// Each test file uses a different part of this module.
#![allow(dead_code)]

use std::collections::HashMap;
use std::ffi::OsString;
use std::fs::{self, File};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);
/// After one process fails, the others are likely waiting for it: this long, then killed.
pub const GRACE_AFTER_FAILURE: Duration = Duration::from_secs(10);
const POLL: Duration = Duration::from_millis(20);
const LOG_TAIL: usize = 12_000;

/// The source tree: where cargo built from, or `NCCL_TEST_REPO` (a test binary copied to
/// another machine, as scripts/device-check.sh does, runs against the tree there).
pub fn repo() -> &'static Path {
    static REPO: OnceLock<PathBuf> = OnceLock::new();
    REPO.get_or_init(|| match std::env::var_os("NCCL_TEST_REPO") {
        Some(r) => PathBuf::from(r),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")),
    })
}

pub fn symbols_file() -> PathBuf {
    repo().join("../shared/reference/nccl-2.32.3-exported-symbols.txt")
}

// ---- setup: the library, the headers, the compiled programs --------------------------------

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Header {
    /// Our `include/nccl.h`.
    Ours,
    /// NVIDIA's `nccl.h` (with the CUDA stubs of the reference folder).
    Nvidia,
}

type Built = Result<PathBuf, String>;
/// One program against one header.
type ProgramKey = (String, Header);

pub struct Setup {
    /// The library under test (what `libnccl.so.2` in `lib_dir` points to).
    pub lib: PathBuf,
    /// Holds `libnccl.so.2` and `libnccl.so`, symlinks to `lib`.
    pub lib_dir: PathBuf,
    pub bin_dir: PathBuf,
    pub reference: Result<PathBuf, String>,
    /// (program, header) -> executable, or why it could not be built. Compiled on first
    /// use, once per test binary, so a test file pays only for the programs it runs.
    programs: Mutex<HashMap<ProgramKey, Arc<OnceLock<Built>>>>,
}

pub fn setup() -> &'static Setup {
    static SETUP: OnceLock<Result<Setup, String>> = OnceLock::new();
    match SETUP.get_or_init(build_setup) {
        Ok(s) => s,
        Err(e) => panic!("{e}"),
    }
}

/// `<target>/<profile>/deps/<test>-<hash>` is this test. `cargo test` builds the cdylib as
/// `deps/libnccl.so` and does not copy it up to `<target>/<profile>/libnccl.so` (which
/// `cargo build` writes, and which may be older): prefer the one in `deps/`.
fn find_library() -> Result<(PathBuf, PathBuf), String> {
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    let deps = exe.parent().ok_or("test executable has no parent")?;
    let profile_dir = deps.parent().ok_or("deps folder has no parent")?;
    let profile = profile_dir
        .file_name()
        .unwrap_or_default()
        .to_string_lossy()
        .into_owned();
    let target = profile_dir.parent().ok_or("profile folder has no parent")?;
    let ffi_dir = target.join("ffi").join(&profile);
    if let Some(lib) = std::env::var_os("NCCL_FFI_LIB") {
        // A folder of its own, so a concurrent normal run keeps testing cargo's library.
        let external = target.join("ffi").join(format!("{profile}-external"));
        return Ok((PathBuf::from(lib), external));
    }
    for candidate in [deps.join("libnccl.so"), profile_dir.join("libnccl.so")] {
        if candidate.is_file() {
            return Ok((candidate, ffi_dir));
        }
    }
    Err(format!(
        "no libnccl.so in {} or {}: cargo did not build the cdylib for this test run",
        profile_dir.display(),
        deps.display()
    ))
}

/// Replaces `link` with a symlink to `target`, atomically (concurrent runs may race).
fn symlink_atomic(target: &Path, link: &Path) -> Result<(), String> {
    let tmp = link.with_extension(format!("tmp{}", std::process::id()));
    let _ = fs::remove_file(&tmp);
    std::os::unix::fs::symlink(target, &tmp)
        .map_err(|e| format!("symlink {}: {e}", tmp.display()))?;
    fs::rename(&tmp, link).map_err(|e| format!("rename to {}: {e}", link.display()))
}

fn reference_dir() -> Result<PathBuf, String> {
    if let Some(dir) = std::env::var_os("NCCL_REFERENCE_DIR") {
        return Ok(PathBuf::from(dir));
    }
    let script = repo().join("../shared/scripts/nccl-reference.sh");
    let out = Command::new("bash")
        .arg(&script)
        .output()
        .map_err(|e| format!("running {}: {e}", script.display()))?;
    if !out.status.success() {
        return Err(format!(
            "{} failed: {}",
            script.display(),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

fn build_setup() -> Result<Setup, String> {
    let (lib, ffi_dir) = find_library()?;
    let lib = fs::canonicalize(&lib).map_err(|e| format!("{}: {e}", lib.display()))?;
    let lib_dir = ffi_dir.join("lib");
    let bin_dir = ffi_dir.join("bin");
    for dir in [&lib_dir, &bin_dir] {
        fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    }
    // The library's SONAME is libnccl.so.2; -lnccl looks for libnccl.so.
    symlink_atomic(&lib, &lib_dir.join("libnccl.so.2"))?;
    symlink_atomic(&lib, &lib_dir.join("libnccl.so"))?;
    let reference = reference_dir();
    Ok(Setup {
        lib,
        lib_dir,
        bin_dir,
        reference,
        programs: Mutex::new(HashMap::new()),
    })
}

impl Setup {
    /// The executable of `ffi-tests/<name>.c` (and `ffi-tests/<name>/*.c`) built against
    /// `header`, compiled now if this test binary has not compiled it yet (concurrent callers
    /// wait for one compilation).
    pub fn program(&self, name: &str, header: Header) -> Built {
        let cell = self
            .programs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry((name.to_string(), header))
            .or_default()
            .clone();
        cell.get_or_init(|| compile(name, header, &self.lib_dir, &self.bin_dir, &self.reference))
            .clone()
    }

    /// Every program of `ffi-tests/` against both headers, compiled in parallel:
    /// ((program, header), result), sorted.
    pub fn all_programs(&self) -> Result<Vec<(ProgramKey, Built)>, String> {
        let mut jobs = Vec::new();
        for name in c_programs()? {
            for header in [Header::Ours, Header::Nvidia] {
                jobs.push((name.clone(), header));
            }
        }
        Ok(std::thread::scope(|s| {
            let handles: Vec<_> = jobs
                .into_iter()
                .map(|(name, header)| {
                    s.spawn(move || {
                        let built = self.program(&name, header);
                        ((name, header), built)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("compile thread panicked"))
                .collect()
        }))
    }
}

/// The `.c` files of folder `dir` (none if there is no such folder), in name order.
fn program_parts(dir: &Path) -> Vec<PathBuf> {
    let mut parts: Vec<PathBuf> = fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.extension().is_some_and(|x| x == "c")).collect())
        .unwrap_or_default();
    parts.sort();
    parts
}

/// The `ffi-tests/*.c` test programs: a `main` and `common.h`; `common.c` is linked into each,
/// and so are the `.c` files of a folder of the program's name (`ffi-tests/cuda/`), if any.
pub fn c_programs() -> Result<Vec<String>, String> {
    let mut names = Vec::new();
    let dir = repo().join("ffi-tests");
    for entry in fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))? {
        let path = entry.map_err(|e| e.to_string())?.path();
        if path.extension().is_some_and(|e| e == "c") {
            let text = fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            // Other tools live here too (abi_layout.c, driven by abi_layout.sh).
            if text.contains("int main(") && text.contains("#include \"common.h\"") {
                names.push(path.file_stem().unwrap().to_string_lossy().into_owned());
            }
        }
    }
    names.sort();
    Ok(names)
}

fn include_flags(
    header: Header,
    reference: &Result<PathBuf, String>,
) -> Result<Vec<PathBuf>, String> {
    match header {
        Header::Ours => {
            let inc = repo().join("include");
            if !inc.join("nccl.h").is_file() {
                return Err(format!("{} does not exist", inc.join("nccl.h").display()));
            }
            Ok(vec![inc])
        }
        Header::Nvidia => {
            let r = reference
                .as_ref()
                .map_err(|e| format!("NVIDIA's header unavailable: {e}"))?;
            Ok(vec![r.join("include"), r.join("cuda-stub")])
        }
    }
}

pub fn cc() -> String {
    std::env::var("CC").unwrap_or_else(|_| "cc".to_string())
}

/// `cc -std=c11 -Wall -Wextra -Werror`, to a temporary name renamed into place (several
/// test binaries may compile the same program at once).
fn compile(
    name: &str,
    header: Header,
    lib_dir: &Path,
    bin_dir: &Path,
    reference: &Result<PathBuf, String>,
) -> Result<PathBuf, String> {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let includes = include_flags(header, reference)?;
    let suffix = match header {
        Header::Ours => "ours",
        Header::Nvidia => "nvidia",
    };
    let out = bin_dir.join(format!("{name}-{suffix}"));
    let tmp = bin_dir.join(format!(
        ".{name}-{suffix}.{}.{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let mut cmd = Command::new(cc());
    cmd.args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1", "-g"]);
    for inc in &includes {
        cmd.arg("-I").arg(inc);
    }
    let dir = repo().join("ffi-tests");
    cmd.arg("-o")
        .arg(&tmp)
        .arg(dir.join(format!("{name}.c")))
        .arg(dir.join("common.c"));
    // A program too long for one file keeps its other parts in a folder of its name.
    cmd.args(program_parts(&dir.join(name)));
    cmd.arg(format!("-L{}", lib_dir.display()));
    cmd.args(["-lnccl", "-lpthread", "-lm"]);
    cmd.arg(format!("-Wl,-rpath,{}", lib_dir.display()));
    let result = cmd.output().map_err(|e| format!("running {}: {e}", cc()))?;
    if !result.status.success() {
        let _ = fs::remove_file(&tmp);
        return Err(format!(
            "compiling {name}.c against {header:?} header failed:\n{:?}\n{}",
            cmd,
            String::from_utf8_lossy(&result.stderr)
        ));
    }
    fs::rename(&tmp, &out).map_err(|e| format!("rename {}: {e}", out.display()))?;
    Ok(out)
}

pub fn program(name: &str, header: Header) -> PathBuf {
    match setup().program(name, header) {
        Ok(path) => path,
        Err(e) => panic!("{e}"),
    }
}

// ---- running a program as several processes ----------------------------------------------

/// Limits how many ranks run at once, so parallel tests do not starve each other of CPUs
/// (and so the leak test can run alone).
pub struct Slots {
    free: Mutex<usize>,
    cv: Condvar,
    pub capacity: usize,
}

impl Slots {
    pub fn get() -> &'static Slots {
        static SLOTS: OnceLock<Slots> = OnceLock::new();
        SLOTS.get_or_init(|| {
            let cpus = std::thread::available_parallelism().map_or(8, |n| n.get());
            let capacity = cpus.max(8);
            Slots {
                free: Mutex::new(capacity),
                cv: Condvar::new(),
                capacity,
            }
        })
    }

    pub fn acquire(&'static self, want: usize) -> SlotGuard {
        let n = want.clamp(1, self.capacity);
        let mut free = self.free.lock().unwrap();
        while *free < n {
            free = self.cv.wait(free).unwrap();
        }
        *free -= n;
        SlotGuard { slots: self, n }
    }
}

pub struct SlotGuard {
    slots: &'static Slots,
    n: usize,
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        *self.slots.free.lock().unwrap() += self.n;
        self.slots.cv.notify_all();
    }
}

/// When a [`Job`] acts: once `marker` (if any) has appeared in a process's output, and each of
/// `also` in theirs, and then `delay` later (measured from the start of the job when there is
/// no marker).
#[derive(Clone, Debug)]
pub struct When {
    marker: Option<(usize, String)>,
    also: Vec<(usize, String)>,
    delay: Duration,
}

impl When {
    /// As soon as process `proc` prints a line containing `text`.
    pub fn marker(proc: usize, text: &str) -> When {
        When {
            marker: Some((proc, text.to_string())),
            also: Vec::new(),
            delay: Duration::ZERO,
        }
    }
    /// And once process `proc` has printed a line containing `text` too (in either order).
    pub fn and(mut self, proc: usize, text: &str) -> When {
        self.also.push((proc, text.to_string()));
        self
    }
    /// `ms` after the job started.
    pub fn after_ms(ms: u64) -> When {
        When {
            marker: None,
            also: Vec::new(),
            delay: Duration::from_millis(ms),
        }
    }
    /// `ms` after the marker was seen.
    pub fn then_ms(mut self, ms: u64) -> When {
        self.delay = Duration::from_millis(ms);
        self
    }
}

/// What a [`Job`] does when a [`When`] is met.
pub enum Action {
    /// SIGKILL this process.
    Kill(usize),
    /// Send this process the signal named (`kill -STOP`: "STOP").
    Signal(usize, &'static str),
    /// Run this (on the harness's thread: keep it short); it returns what it did, for the report.
    Call(Box<dyn FnMut() -> String + Send>),
}

struct Trigger {
    when: When,
    action: Action,
    /// When the marker was seen (then the delay runs from here).
    armed_at: Option<Instant>,
}

/// Per-process settings that differ from the job's.
#[derive(Clone, Default)]
struct PerProc {
    /// Run `wrapper... program args...` (for example `ip netns exec NAME`): the wrapper
    /// must exec the program, so the process the harness watches and kills is the program.
    wrapper: Vec<OsString>,
    env: Vec<(String, String)>,
    start_delay: Duration,
}

/// One run of a C program: `procs` processes with `local` ranks each.
pub struct Job {
    pub program: &'static str,
    pub header: Header,
    pub procs: usize,
    pub local: usize,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub timeout: Duration,
    pub exclusive: bool,
    per_proc: Vec<PerProc>,
    triggers: Vec<Trigger>,
    dir: Option<PathBuf>,
    /// Searched after the library under test (e.g. the stand-in libcuda).
    lib_paths: Vec<PathBuf>,
}

impl Job {
    pub fn new(program: &'static str) -> Job {
        Job {
            program,
            header: Header::Ours,
            procs: 1,
            local: 1,
            args: Vec::new(),
            env: Vec::new(),
            timeout: DEFAULT_TIMEOUT,
            exclusive: false,
            per_proc: Vec::new(),
            triggers: Vec::new(),
            dir: None,
            lib_paths: Vec::new(),
        }
    }
    /// Let the processes' dynamic linker find libraries in `dir` (after the library under test).
    pub fn lib_path(mut self, dir: &Path) -> Job {
        self.lib_paths.push(dir.to_path_buf());
        self
    }
    pub fn procs(mut self, n: usize) -> Job {
        self.procs = n;
        self
    }
    pub fn local(mut self, n: usize) -> Job {
        self.local = n;
        self
    }
    pub fn header(mut self, h: Header) -> Job {
        self.header = h;
        self
    }
    pub fn arg(mut self, a: &str) -> Job {
        self.args.push(a.to_string());
        self
    }
    pub fn env(mut self, k: &str, v: &str) -> Job {
        self.env.push((k.to_string(), v.to_string()));
        self
    }
    pub fn timeout_s(mut self, s: u64) -> Job {
        self.timeout = Duration::from_secs(s);
        self
    }
    /// Runs with no other job at the same time (for measurements of the whole machine).
    pub fn exclusive(mut self) -> Job {
        self.exclusive = true;
        self
    }

    fn per_proc_mut(&mut self, proc: usize) -> &mut PerProc {
        if self.per_proc.len() <= proc {
            self.per_proc.resize(proc + 1, PerProc::default());
        }
        &mut self.per_proc[proc]
    }

    /// Process `proc` runs as `wrapper... program args...`.
    pub fn wrap<S: AsRef<std::ffi::OsStr>>(mut self, proc: usize, wrapper: &[S]) -> Job {
        self.per_proc_mut(proc).wrapper = wrapper.iter().map(|s| s.as_ref().to_os_string()).collect();
        self
    }
    /// An environment variable for process `proc` only (wins over the job's).
    pub fn proc_env(mut self, proc: usize, k: &str, v: &str) -> Job {
        self.per_proc_mut(proc).env.push((k.to_string(), v.to_string()));
        self
    }
    /// Process `proc` starts `ms` after the others.
    pub fn delay_start_ms(mut self, proc: usize, ms: u64) -> Job {
        self.per_proc_mut(proc).start_delay = Duration::from_millis(ms);
        self
    }
    /// Process `proc` runs on host `host` of `hosts`: inside its namespace, with
    /// `NCCL_HOSTID` naming the host and `NCCL_SOCKET_IFNAME` its interface.
    pub fn on_host(self, proc: usize, hosts: &Hosts, host: usize) -> Job {
        let id = format!("{}{host}", hosts.prefix);
        self.wrap(proc, &hosts.wrapper(host))
            .proc_env(proc, "NCCL_HOSTID", &id)
            .proc_env(proc, "NCCL_SOCKET_IFNAME", &hosts.ifname(host))
    }
    /// SIGKILL process `victim` when `when` is met. [`Job::run`] then expects it to die of
    /// SIGKILL (and every other process to exit 0).
    pub fn kill(mut self, victim: usize, when: When) -> Job {
        self.triggers.push(Trigger {
            when,
            action: Action::Kill(victim),
            armed_at: None,
        });
        self
    }
    /// Send process `proc` the signal named `sig` ("STOP", "CONT") when `when` is met.
    pub fn signal(mut self, proc: usize, sig: &'static str, when: When) -> Job {
        self.triggers.push(Trigger {
            when,
            action: Action::Signal(proc, sig),
            armed_at: None,
        });
        self
    }
    /// Run `f` when `when` is met.
    pub fn on(mut self, when: When, f: impl FnMut() -> String + Send + 'static) -> Job {
        self.triggers.push(Trigger {
            when,
            action: Action::Call(Box::new(f)),
            armed_at: None,
        });
        self
    }

    /// The folder of this run (unique-id files, logs); created on first use. The programs
    /// publish their unique id in `<dir>/unique-id` (see `ffi-tests/common.h`).
    pub fn dir(&mut self) -> PathBuf {
        let program = self.program;
        self.dir.get_or_insert_with(|| fresh_dir(program)).clone()
    }

    /// Runs every process to completion (or the deadline) and asserts they all exit 0
    /// (processes the job kills must die of SIGKILL instead).
    pub fn run(self) {
        let outcome = self.run_outcome();
        if outcome.ok() {
            println!("{}", outcome.report);
        } else {
            panic!("{}", outcome.report);
        }
    }

    /// Runs every process to completion (or the deadline) and says what happened; judging
    /// it is the caller's job (the logs stay in `Outcome::dir`).
    pub fn run_outcome(mut self) -> Outcome {
        let bin = program(self.program, self.header);
        let slots = Slots::get();
        let _slots = slots.acquire(if self.exclusive {
            slots.capacity
        } else {
            self.procs * self.local
        });
        let dir = self.dir();
        let start = Instant::now();
        let mut procs: Vec<Proc> = (0..self.procs)
            .map(|p| Proc {
                child: None,
                start_at: self.per_proc.get(p).map_or(Duration::ZERO, |pp| pp.start_delay),
                status: None,
                log: dir.join(format!("proc{p}.log")),
                seen: String::new(),
                read_to: 0,
                killed_at_deadline: false,
                killed_by_job: None,
                exited_at: None,
            })
            .collect();
        let mut fired: Vec<(String, Option<Duration>)> = self
            .triggers
            .iter()
            .map(|t| (describe_trigger(t), None))
            .collect();
        let timed_out = self.wait_all(&bin, &dir, &mut procs, &mut fired, start);
        let report = self.report(&procs, &fired, &dir, timed_out);
        Outcome {
            procs: procs
                .into_iter()
                .map(|p| ProcOutcome {
                    status: p.status,
                    killed_at_deadline: p.killed_at_deadline,
                    killed_by_job: p.killed_by_job,
                    exited_at: p.exited_at,
                    log: read_all(&p.log),
                })
                .collect(),
            fired: fired.into_iter().map(|(_, t)| t).collect(),
            timed_out,
            report,
            dir,
        }
    }

    fn spawn(&self, bin: &Path, dir: &Path, index: usize, log_path: &Path) -> Child {
        let log = File::create(log_path).expect("creating a log file");
        let pp = self.per_proc.get(index).cloned().unwrap_or_default();
        let mut cmd = match pp.wrapper.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(bin);
                c
            }
            None => Command::new(bin),
        };
        // cargo test puts its target folders on LD_LIBRARY_PATH, which the dynamic linker
        // searches before the program's RUNPATH: put the library under test first, so a stray
        // libnccl.so.2 elsewhere in the target folder can never be the one that runs.
        let lib_dir = setup().lib_dir.clone();
        let mut ld_path = std::ffi::OsString::from(lib_dir.as_os_str());
        for extra in &self.lib_paths {
            ld_path.push(":");
            ld_path.push(extra.as_os_str());
        }
        if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
            ld_path.push(":");
            ld_path.push(old);
        }
        cmd.args(&self.args)
            .env("LD_LIBRARY_PATH", ld_path)
            .env_remove("NCCL_COMM_ID")
            .env("NCCL_TEST_NPROCS", self.procs.to_string())
            .env("NCCL_TEST_PROC", index.to_string())
            .env("NCCL_TEST_LOCAL", self.local.to_string())
            .env("NCCL_TEST_ID_FILE", dir.join("unique-id"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("dup log"))
            .stderr(log);
        for (k, v) in self.env.iter().chain(pp.env.iter()) {
            cmd.env(k, v);
        }
        cmd.spawn()
            .unwrap_or_else(|e| panic!("spawning {:?}: {e}", cmd))
    }

    /// Starts the processes (late ones when their time comes), fires the triggers, and polls
    /// until all exit, the deadline passes, or one failed and the others did not finish
    /// within GRACE_AFTER_FAILURE; kills what is left. Returns whether the deadline passed.
    fn wait_all(
        &mut self,
        bin: &Path,
        dir: &Path,
        procs: &mut [Proc],
        fired: &mut [(String, Option<Duration>)],
        start: Instant,
    ) -> bool {
        let mut failed_at: Option<Instant> = None;
        loop {
            let now = start.elapsed();
            for (i, p) in procs.iter_mut().enumerate() {
                if p.child.is_none() && now >= p.start_at {
                    p.child = Some(self.spawn(bin, dir, i, &p.log));
                }
            }
            for p in procs.iter_mut() {
                if p.status.is_some() {
                    continue;
                }
                let Some(child) = p.child.as_mut() else { continue };
                if let Ok(Some(st)) = child.try_wait() {
                    p.status = Some(st);
                    p.exited_at = Some(start.elapsed());
                    if !st.success() && p.killed_by_job.is_none() && failed_at.is_none() {
                        failed_at = Some(Instant::now());
                    }
                }
            }
            self.fire_triggers(procs, fired, start);
            if procs.iter().all(|p| p.status.is_some()) {
                return false;
            }
            let expired = start.elapsed() > self.timeout;
            let grace_over = failed_at.is_some_and(|t| t.elapsed() > GRACE_AFTER_FAILURE);
            if expired || grace_over {
                if expired && std::env::var_os("NCCL_TEST_STACKS_AT_DEADLINE").is_some() {
                    procs.iter().filter(|p| p.status.is_none()).for_each(write_stacks);
                }
                for p in procs.iter_mut().filter(|p| p.status.is_none()) {
                    if let Some(child) = p.child.as_mut() {
                        let _ = child.kill();
                        p.status = child.wait().ok();
                    }
                    p.killed_at_deadline = true;
                }
                return expired;
            }
            std::thread::sleep(POLL);
        }
    }

    fn fire_triggers(
        &mut self,
        procs: &mut [Proc],
        fired: &mut [(String, Option<Duration>)],
        start: Instant,
    ) {
        for (t, slot) in self.triggers.iter_mut().zip(fired.iter_mut()) {
            if slot.1.is_some() {
                continue;
            }
            if t.armed_at.is_none() {
                match &t.when.marker {
                    None => t.armed_at = Some(start),
                    Some(first) => {
                        let mut seen = |(proc, text): &(usize, String)| {
                            procs.get_mut(*proc).is_some_and(|p| p.output_contains(text))
                        };
                        if seen(first) && t.when.also.iter().all(seen) {
                            t.armed_at = Some(Instant::now());
                        }
                    }
                }
            }
            let Some(armed) = t.armed_at else { continue };
            if armed.elapsed() < t.when.delay {
                continue;
            }
            let at = start.elapsed();
            match &mut t.action {
                Action::Kill(victim) => {
                    if let Some(p) = procs.get_mut(*victim) {
                        if p.status.is_none() {
                            if let Some(child) = p.child.as_mut() {
                                let _ = child.kill();
                                p.killed_by_job = Some(at);
                            }
                        }
                    }
                }
                Action::Signal(proc, sig) => {
                    let pid = procs.get(*proc).and_then(|p| p.status.is_none().then_some(p.child.as_ref()?.id()));
                    let sent = pid.map(|pid| Command::new("kill").arg(format!("-{sig}")).arg(pid.to_string()).status());
                    slot.0 = format!("{}: SIG{sig} to process {proc} ({sent:?})", slot.0);
                }
                Action::Call(f) => {
                    let what = f();
                    slot.0 = format!("{}: {what}", slot.0);
                }
            }
            slot.1 = Some(at);
        }
    }

    fn report(
        &self,
        procs: &[Proc],
        fired: &[(String, Option<Duration>)],
        dir: &Path,
        timed_out: bool,
    ) -> String {
        let mut s = format!(
            "{} ({:?} header): {} process(es) x {} rank(s), args {:?}, env {:?}{}\n(logs in {})\n",
            self.program,
            self.header,
            self.procs,
            self.local,
            self.args,
            self.env,
            if timed_out {
                format!(" -- DEADLINE of {:?} PASSED", self.timeout)
            } else {
                String::new()
            },
            dir.display()
        );
        for (what, at) in fired {
            match at {
                Some(t) => s += &format!("---- at {:.3} s: {what}\n", t.as_secs_f64()),
                None => s += &format!("---- never happened: {what}\n"),
            }
        }
        for (i, p) in procs.iter().enumerate() {
            let pp = self.per_proc.get(i).cloned().unwrap_or_default();
            let mut extra = String::new();
            if !pp.wrapper.is_empty() {
                extra += &format!(" under {:?}", pp.wrapper);
            }
            if !pp.env.is_empty() {
                extra += &format!(" env {:?}", pp.env);
            }
            if !pp.start_delay.is_zero() {
                extra += &format!(" started {:?} late", pp.start_delay);
            }
            s += &format!(
                "---- process {i}{extra}: {}\n{}\n",
                p.describe(),
                tail(&p.log, LOG_TAIL)
            );
        }
        s
    }
}

fn describe_trigger(t: &Trigger) -> String {
    let also: String = t.when.also.iter().map(|(p, text)| format!(" and process {p} printed {text:?}")).collect();
    let when = match (&t.when.marker, t.when.delay.is_zero()) {
        (Some((p, text)), true) => format!("when process {p} printed {text:?}{also}"),
        (Some((p, text)), false) => {
            format!("{:?} after process {p} printed {text:?}", t.when.delay)
        }
        (None, _) => format!("{:?} after the start", t.when.delay),
    };
    match &t.action {
        Action::Kill(v) => format!("SIGKILL process {v} {when}"),
        Action::Signal(p, sig) => format!("SIG{sig} process {p} {when}"),
        Action::Call(_) => format!("action {when}"),
    }
}

/// `NCCL_TEST_STACKS_AT_DEADLINE=1` (scripts/device-check.sh): where a process that is still
/// running at its job's deadline is, appended to its log before it is killed: every thread's
/// stack (gdb, or cuda-gdb where only that is installed, as on the GPU machine's image) or the
/// kernel's view of each thread.
fn write_stacks(p: &Proc) {
    let Some(pid) = p.child.as_ref().map(Child::id) else { return };
    let backtrace = |gdb: &str, limit: &str| {
        let out = Command::new("timeout")
            .args([limit, gdb, "-p", &pid.to_string(), "-batch", "-ex", "thread apply all bt 12"])
            .stdin(Stdio::null())
            .output();
        match out {
            Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter(|l| l.starts_with("Thread") || l.starts_with('#'))
                .take(300)
                .map(|l| format!("{l}\n"))
                .collect(),
            _ => String::new(),
        }
    };
    let mut text = backtrace("gdb", "8");
    if text.is_empty() {
        text = backtrace("cuda-gdb", "12");
    }
    if text.is_empty() {
        let tasks = fs::read_dir(format!("/proc/{pid}/task")).map(|d| d.flatten().collect::<Vec<_>>()).unwrap_or_default();
        for t in tasks {
            let read = |f: &str| fs::read_to_string(t.path().join(f)).unwrap_or_default().trim().to_string();
            text += &format!("{} wchan={}\n", read("comm"), read("wchan"));
        }
    }
    if let Ok(mut log) = fs::OpenOptions::new().append(true).open(&p.log) {
        use std::io::Write;
        let _ = write!(log, "---- where process {pid} was at the deadline:\n{text}");
    }
}

struct Proc {
    child: Option<Child>,
    start_at: Duration,
    status: Option<ExitStatus>,
    log: PathBuf,
    /// Output read so far (for markers).
    seen: String,
    read_to: u64,
    killed_at_deadline: bool,
    killed_by_job: Option<Duration>,
    exited_at: Option<Duration>,
}

impl Proc {
    /// Reads what the process wrote since the last call; true if `text` is in the output.
    fn output_contains(&mut self, text: &str) -> bool {
        if let Ok(mut f) = File::open(&self.log) {
            let mut bytes = Vec::new();
            if f.seek(SeekFrom::Start(self.read_to)).is_ok() && f.read_to_end(&mut bytes).is_ok() {
                self.read_to += bytes.len() as u64;
                self.seen += &String::from_utf8_lossy(&bytes);
            }
        }
        self.seen.contains(text)
    }

    fn describe(&self) -> String {
        let exit = match self.exited_at {
            Some(t) => format!(" at {:.3} s", t.as_secs_f64()),
            None => String::new(),
        };
        match (self.status, self.killed_at_deadline, self.killed_by_job) {
            (_, true, _) => "killed by the harness (deadline or grace period)".to_string(),
            (Some(st), _, Some(t)) => format!(
                "SIGKILLed by the job at {:.3} s: {}{exit}",
                t.as_secs_f64(),
                describe_status(st)
            ),
            (Some(st), _, None) => format!("{}{exit}", describe_status(st)),
            (None, _, _) if self.child.is_none() => "never started".to_string(),
            (None, _, _) => "still running".to_string(),
        }
    }
}

/// What happened to one process of a [`Job`].
pub struct ProcOutcome {
    pub status: Option<ExitStatus>,
    /// The harness killed it because the job's deadline (or the grace period after another
    /// process failed) passed.
    pub killed_at_deadline: bool,
    /// When the job SIGKILLed it on purpose (from the start of the job).
    pub killed_by_job: Option<Duration>,
    /// When it exited (from the start of the job).
    pub exited_at: Option<Duration>,
    /// Everything it printed (stdout and stderr together).
    pub log: String,
}

impl ProcOutcome {
    pub fn exited_0(&self) -> bool {
        !self.killed_at_deadline && self.status.is_some_and(|s| s.success())
    }
    pub fn died_of_sigkill(&self) -> bool {
        use std::os::unix::process::ExitStatusExt;
        self.status.and_then(|s| s.signal()) == Some(libc_sigkill())
    }
}

const fn libc_sigkill() -> i32 {
    9
}

pub struct Outcome {
    pub procs: Vec<ProcOutcome>,
    /// When each trigger fired (in the order they were added), from the start of the job.
    pub fired: Vec<Option<Duration>>,
    pub timed_out: bool,
    /// Everything, readable: the job, the triggers, each process's status and log tail.
    pub report: String,
    pub dir: PathBuf,
}

impl Outcome {
    /// No deadline passed, processes killed by the job died of SIGKILL, all others exited 0.
    pub fn ok(&self) -> bool {
        !self.timed_out
            && self.procs.iter().all(|p| {
                if p.killed_by_job.is_some() {
                    p.died_of_sigkill() && !p.killed_at_deadline
                } else {
                    p.exited_0()
                }
            })
    }
    /// Every line of every process's output containing `needle`.
    pub fn lines_with<'a>(&'a self, needle: &'a str) -> impl Iterator<Item = (usize, &'a str)> + 'a {
        self.procs
            .iter()
            .enumerate()
            .flat_map(move |(i, p)| p.log.lines().filter(move |l| l.contains(needle)).map(move |l| (i, l)))
    }
}

/// The run's folder goes with the outcome, unless the test is failing: then its logs stay
/// for whoever reads the failure (the report names the folder).
impl Drop for Outcome {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

pub fn describe_status(st: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (st.code(), st.signal()) {
        (Some(0), _) => "exit 0".to_string(),
        (Some(c), _) => format!("exit {c}"),
        (None, Some(sig)) => format!("killed by signal {sig}"),
        _ => format!("{st:?}"),
    }
}

fn read_all(path: &Path) -> String {
    let mut bytes = Vec::new();
    if let Ok(mut f) = File::open(path) {
        let _ = f.read_to_end(&mut bytes);
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

pub fn tail(path: &Path, max: usize) -> String {
    let mut text = read_all(path);
    if text.len() > max {
        let mut cut = text.len() - max;
        while !text.is_char_boundary(cut) {
            cut += 1;
        }
        text = format!("[... {cut} bytes cut ...]\n{}", &text[cut..]);
    }
    text
}

/// A new, empty folder for one run (the unique-id files and the logs).
pub fn fresh_dir(program: &str) -> PathBuf {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    loop {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("nccl-ffi-{program}-{}-{n}", std::process::id()));
        match fs::create_dir(&dir) {
            Ok(()) => return dir,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => panic!("creating {}: {e}", dir.display()),
        }
    }
}

/// A port that is free now and that the kernel will not hand to some other connection as
/// its local port meanwhile: below the ephemeral range (a job that hosts its root on it for
/// many communicators in a row, NCCL_COMM_ID, would otherwise find it taken now and then).
pub fn free_tcp_port() -> u16 {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let low = fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next().and_then(|v| v.parse::<u16>().ok()))
        .unwrap_or(32768);
    let (first, span) = (10_000u16, low.saturating_sub(10_000).max(1) as usize);
    let seed = std::process::id() as usize * 7919;
    for _ in 0..span.min(2000) {
        let k = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = first + ((seed + k * 104_729) % span) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("binding a port");
    listener.local_addr().expect("local_addr").port()
}

pub fn run_command(cmd: &mut Command) -> Output {
    cmd.output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"))
}

pub fn assert_success(what: &str, out: &Output) {
    assert!(
        out.status.success(),
        "{what}: {}\n--- stdout\n{}\n--- stderr\n{}",
        describe_status(out.status),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

// ---- test hosts: network namespaces (scripts/testhosts) --------------------------------------

/// `NCCL_TEST_SKIP_NETNS=1`: the caller should return at once (after saying so).
pub fn skip_netns() -> bool {
    let skip = std::env::var("NCCL_TEST_SKIP_NETNS").is_ok_and(|v| v == "1");
    if skip {
        println!("NCCL_TEST_SKIP_NETNS=1: test hosts (network namespaces) not made; nothing run");
    }
    skip
}

/// N test hosts made by `scripts/testhosts up`: namespaces `<prefix>0..N-1` joined by a
/// bridge, host `i` at 10.77.0.(10+i) and fd77::(10+i) on interface `veth<i>`. Removed
/// (`scripts/testhosts down`) when dropped, also when the test panics.
pub struct Hosts {
    pub prefix: String,
    pub n: usize,
}

impl Hosts {
    /// Makes `n` hosts; `extra` goes to `testhosts up` (`--rate 200mbit`, `--delay 5ms`).
    /// The prefix names this process and `tag`, so parallel tests never share hosts.
    pub fn up(tag: &str, n: usize, extra: &[&str]) -> Hosts {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        static SWEPT: OnceLock<()> = OnceLock::new();
        SWEPT.get_or_init(remove_orphaned_hosts);
        let prefix = format!(
            "{HOSTS_PREFIX}{}-{}{tag}-",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        // From here on, Drop removes whatever part of it `up` made.
        let hosts = Hosts { prefix, n };
        let out = run_command(
            Command::new("bash")
                .arg(testhosts_script())
                .args(["up", &hosts.prefix, &n.to_string()])
                .args(extra),
        );
        assert_success(
            &format!(
                "scripts/testhosts up {} {n} {extra:?} (needs root and iproute2; \
                 NCCL_TEST_SKIP_NETNS=1 skips these tests)",
                hosts.prefix
            ),
            &out,
        );
        let said = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
        if !said.trim().is_empty() {
            println!("testhosts up: {}", said.trim());
        }
        hosts
    }
    pub fn namespace(&self, i: usize) -> String {
        format!("{}{i}", self.prefix)
    }
    /// The interface of host `i` inside its namespace.
    pub fn ifname(&self, i: usize) -> String {
        format!("veth{i}")
    }
    pub fn addr4(&self, i: usize) -> String {
        format!("10.77.0.{}", 10 + i)
    }
    pub fn addr6(&self, i: usize) -> String {
        format!("fd77::{}", 10 + i)
    }
    /// The command prefix that runs a program on host `i`.
    pub fn wrapper(&self, i: usize) -> Vec<String> {
        vec!["ip".into(), "netns".into(), "exec".into(), self.namespace(i)]
    }
    /// `scripts/testhosts link PREFIX i up|down`, as a command (for [`Job::on`]).
    pub fn link_command(&self, i: usize, up: bool) -> Command {
        let mut c = Command::new("bash");
        c.arg(testhosts_script())
            .args(["link", &self.prefix, &i.to_string(), if up { "up" } else { "down" }]);
        c
    }
    /// Runs `cmd...` on host `i` (`scripts/testhosts exec`).
    pub fn exec(&self, i: usize, cmd: &[&str]) -> Output {
        run_command(
            Command::new("bash")
                .arg(testhosts_script())
                .args(["exec", &self.prefix, &i.to_string()])
                .args(cmd),
        )
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        let out = Command::new("bash")
            .arg(testhosts_script())
            .args(["down", &self.prefix])
            .output();
        match out {
            Ok(o) if o.status.success() => {}
            Ok(o) => eprintln!(
                "scripts/testhosts down {} failed: {}",
                self.prefix,
                String::from_utf8_lossy(&o.stderr)
            ),
            Err(e) => eprintln!("scripts/testhosts down {}: {e}", self.prefix),
        }
    }
}

/// Every test-host namespace is named `ncclt<pid of the test process>-...`.
const HOSTS_PREFIX: &str = "ncclt";

/// Removes the hosts of test processes that no longer exist (killed before their Drop ran).
fn remove_orphaned_hosts() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else { return };
    let mut prefixes: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter_map(|name| {
            let pid: u32 = name.strip_prefix(HOSTS_PREFIX)?.split('-').next()?.parse().ok()?;
            let alive = Path::new(&format!("/proc/{pid}")).exists();
            // `<prefix><digits>` or `<prefix>br`: the prefix ends at the last '-'.
            let end = name.rfind('-')?;
            (!alive).then(|| name[..=end].to_string())
        })
        .collect();
    prefixes.sort();
    prefixes.dedup();
    for prefix in prefixes {
        println!("removing test hosts {prefix}* left by a test process that no longer exists");
        let _ = Command::new("bash")
            .arg(testhosts_script())
            .args(["down", &prefix])
            .output();
    }
}

pub fn testhosts_script() -> PathBuf {
    repo().join("scripts/testhosts")
}

/// `<target>/cuda-stub`, holding the stand-in driver (tests/cuda-stub) as `libcuda.so.1` and
/// `libcuda.so`, built once per test binary run.
pub fn cuda_stub_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let repo = repo();
        // Beside cargo's target folder, or in the tree's own when the binary runs elsewhere.
        let dir = match std::env::var_os("NCCL_TEST_REPO") {
            Some(r) => PathBuf::from(r).join("target").join("cuda-stub"),
            None => Path::new(env!("CARGO_TARGET_TMPDIR")).parent().expect("target dir").join("cuda-stub"),
        };
        fs::create_dir_all(&dir).expect("create the stub's folder");
        let mut sources: Vec<PathBuf> = fs::read_dir(repo.join("tests/cuda-stub"))
            .expect("tests/cuda-stub")
            .map(|e| e.expect("dir entry").path())
            .filter(|p| p.extension().is_some_and(|e| e == "c"))
            .collect();
        sources.sort();
        // Built under a unique name and renamed: concurrent test runs never see half a file.
        let tmp = dir.join(format!("libcuda.so.1.{}", std::process::id()));
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
        let out = Command::new(&cc)
            .args(["-Wall", "-Wextra", "-Werror", "-O2", "-pthread", "-shared", "-fPIC", "-fvisibility=hidden", "-o"])
            .arg(&tmp)
            .args(&sources)
            .output()
            .unwrap_or_else(|e| panic!("running {cc}: {e}"));
        assert!(out.status.success(), "building the stub libcuda failed:\n{}", String::from_utf8_lossy(&out.stderr));
        fs::rename(&tmp, dir.join("libcuda.so.1")).expect("rename the stub");
        let link = dir.join("libcuda.so");
        if fs::symlink_metadata(&link).is_err() {
            let _ = std::os::unix::fs::symlink("libcuda.so.1", &link);
        }
        // NVML's stand-in beside it (tests/cuda-stub/nvml: NVLink answers for the tests that ask).
        let tmp = dir.join(format!("libnvidia-ml.so.1.{}", std::process::id()));
        let out = Command::new(&cc)
            .args(["-Wall", "-Wextra", "-Werror", "-O2", "-shared", "-fPIC", "-fvisibility=hidden", "-o"])
            .arg(&tmp)
            .arg(repo.join("tests/cuda-stub/nvml/libnvidia-ml.c"))
            .output()
            .unwrap_or_else(|e| panic!("running {cc}: {e}"));
        assert!(out.status.success(), "building the stub NVML failed:\n{}", String::from_utf8_lossy(&out.stderr));
        fs::rename(&tmp, dir.join("libnvidia-ml.so.1")).expect("rename the stub");
        dir
    })
}
