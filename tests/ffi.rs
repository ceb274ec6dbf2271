//! The library as its users see it: the C programs in `ffi-tests/`, compiled against our
//! `include/nccl.h` and against NVIDIA's `nccl.h`, linked with `-lnccl` against the cdylib
//! cargo built, and run as several processes (and several ranks per process).
//!
//! Also: the exported symbols are exactly NVIDIA's, the library loads with `dlopen` and
//! under Python's `ctypes` on a machine without `libcuda.so.1` or `libibverbs.so.1`, and
//! `ffi-tests/abi_layout.sh` (when present) passes.
//!
//! Environment:
//! - `NCCL_REFERENCE_DIR`: NVIDIA's header and symbol list (default: the output of
//!   `../shared/scripts/nccl-reference.sh`).
//! - `NCCL_FFI_LIB`: test another `libnccl.so` instead of the one cargo built (for example
//!   NVIDIA's, on a machine with a GPU).
//! - `CC`: the C compiler (default `cc`).
//!
//! Environment contract of the C programs (see `ffi-tests/common.h`): `NCCL_TEST_NPROCS`,
//! `NCCL_TEST_PROC`, `NCCL_TEST_LOCAL`, `NCCL_TEST_ID_FILE`.

use std::collections::{BTreeSet, HashMap};
use std::fs::{self, File};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);
/// After one process fails, the others are likely waiting for it: this long, then killed.
const GRACE_AFTER_FAILURE: Duration = Duration::from_secs(10);
const POLL: Duration = Duration::from_millis(20);
const LOG_TAIL: usize = 12_000;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn symbols_file() -> PathBuf {
    repo().join("../shared/reference/nccl-2.32.3-exported-symbols.txt")
}

// ---- setup: the library, the headers, the compiled programs --------------------------------

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Header {
    /// Our `include/nccl.h`.
    Ours,
    /// NVIDIA's `nccl.h` (with the CUDA stubs of the reference folder).
    Nvidia,
}

struct Setup {
    /// The library under test (what `libnccl.so.2` in `lib_dir` points to).
    lib: PathBuf,
    /// Holds `libnccl.so.2` and `libnccl.so`, symlinks to `lib`.
    lib_dir: PathBuf,
    bin_dir: PathBuf,
    reference: Result<PathBuf, String>,
    /// (program, header) -> executable, or why it could not be built.
    programs: HashMap<(String, Header), Result<PathBuf, String>>,
}

fn setup() -> &'static Setup {
    static SETUP: OnceLock<Result<Setup, String>> = OnceLock::new();
    match SETUP.get_or_init(build_setup) {
        Ok(s) => s,
        Err(e) => panic!("{e}"),
    }
}

/// `<target>/<profile>/deps/ffi-<hash>` is this test. `cargo test` builds the cdylib as
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

    let mut jobs = Vec::new();
    for name in c_programs()? {
        for header in [Header::Ours, Header::Nvidia] {
            jobs.push((name.clone(), header));
        }
    }
    let programs = std::thread::scope(|s| {
        let handles: Vec<_> = jobs
            .into_iter()
            .map(|(name, header)| {
                let (lib_dir, bin_dir, reference) = (&lib_dir, &bin_dir, &reference);
                s.spawn(move || {
                    let built = compile(&name, header, lib_dir, bin_dir, reference);
                    ((name, header), built)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("compile thread panicked"))
            .collect()
    });
    Ok(Setup {
        lib,
        lib_dir,
        bin_dir,
        reference,
        programs,
    })
}

/// The `ffi-tests/*.c` test programs: a `main` and `common.h`; `common.c` is linked into each.
fn c_programs() -> Result<Vec<String>, String> {
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

fn cc() -> String {
    std::env::var("CC").unwrap_or_else(|_| "cc".to_string())
}

/// `cc -std=c11 -Wall -Wextra -Werror`, to a temporary name renamed into place.
fn compile(
    name: &str,
    header: Header,
    lib_dir: &Path,
    bin_dir: &Path,
    reference: &Result<PathBuf, String>,
) -> Result<PathBuf, String> {
    let includes = include_flags(header, reference)?;
    let suffix = match header {
        Header::Ours => "ours",
        Header::Nvidia => "nvidia",
    };
    let out = bin_dir.join(format!("{name}-{suffix}"));
    let tmp = bin_dir.join(format!(".{name}-{suffix}.{}", std::process::id()));
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
    cmd.arg(format!("-L{}", lib_dir.display()));
    cmd.args(["-lnccl", "-lpthread", "-lm"]);
    cmd.arg(format!("-Wl,-rpath,{}", lib_dir.display()));
    let result = cmd.output().map_err(|e| format!("running {}: {e}", cc()))?;
    if !result.status.success() {
        return Err(format!(
            "compiling {name}.c against {header:?} header failed:\n{:?}\n{}",
            cmd,
            String::from_utf8_lossy(&result.stderr)
        ));
    }
    fs::rename(&tmp, &out).map_err(|e| format!("rename {}: {e}", out.display()))?;
    Ok(out)
}

fn program(name: &str, header: Header) -> PathBuf {
    match setup().programs.get(&(name.to_string(), header)) {
        Some(Ok(path)) => path.clone(),
        Some(Err(e)) => panic!("{e}"),
        None => panic!("no C program ffi-tests/{name}.c"),
    }
}

// ---- running a program as several processes ----------------------------------------------

/// Limits how many ranks run at once, so parallel tests do not starve each other of CPUs
/// (and so the leak test can run alone).
struct Slots {
    free: Mutex<usize>,
    cv: Condvar,
    capacity: usize,
}

impl Slots {
    fn get() -> &'static Slots {
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

    fn acquire(&'static self, want: usize) -> SlotGuard {
        let n = want.clamp(1, self.capacity);
        let mut free = self.free.lock().unwrap();
        while *free < n {
            free = self.cv.wait(free).unwrap();
        }
        *free -= n;
        SlotGuard { slots: self, n }
    }
}

struct SlotGuard {
    slots: &'static Slots,
    n: usize,
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        *self.slots.free.lock().unwrap() += self.n;
        self.slots.cv.notify_all();
    }
}

/// One run of a C program: `procs` processes with `local` ranks each.
struct Job {
    program: &'static str,
    header: Header,
    procs: usize,
    local: usize,
    args: Vec<String>,
    env: Vec<(String, String)>,
    timeout: Duration,
    exclusive: bool,
}

impl Job {
    fn new(program: &'static str) -> Job {
        Job {
            program,
            header: Header::Ours,
            procs: 1,
            local: 1,
            args: Vec::new(),
            env: Vec::new(),
            timeout: DEFAULT_TIMEOUT,
            exclusive: false,
        }
    }
    fn procs(mut self, n: usize) -> Job {
        self.procs = n;
        self
    }
    fn local(mut self, n: usize) -> Job {
        self.local = n;
        self
    }
    fn header(mut self, h: Header) -> Job {
        self.header = h;
        self
    }
    fn arg(mut self, a: &str) -> Job {
        self.args.push(a.to_string());
        self
    }
    fn env(mut self, k: &str, v: &str) -> Job {
        self.env.push((k.to_string(), v.to_string()));
        self
    }
    fn timeout_s(mut self, s: u64) -> Job {
        self.timeout = Duration::from_secs(s);
        self
    }
    /// Runs with no other job at the same time (for measurements of the whole machine).
    fn exclusive(mut self) -> Job {
        self.exclusive = true;
        self
    }

    /// Runs every process to completion (or the deadline) and asserts they all exit 0.
    fn run(self) {
        let bin = program(self.program, self.header);
        let slots = Slots::get();
        let _slots = slots.acquire(if self.exclusive {
            slots.capacity
        } else {
            self.procs * self.local
        });
        let dir = fresh_dir(self.program);
        let mut procs: Vec<Proc> = (0..self.procs).map(|p| self.spawn(&bin, &dir, p)).collect();
        let timed_out = wait_all(&mut procs, self.timeout);
        let ok = !timed_out && procs.iter().all(|p| p.status.is_some_and(|s| s.success()));
        let report = self.report(&procs, &dir, timed_out);
        if ok {
            println!("{report}");
            let _ = fs::remove_dir_all(&dir);
        } else {
            panic!("{report}");
        }
    }

    fn spawn(&self, bin: &Path, dir: &Path, index: usize) -> Proc {
        let log_path = dir.join(format!("proc{index}.log"));
        let log = File::create(&log_path).expect("creating a log file");
        let mut cmd = Command::new(bin);
        cmd.args(&self.args)
            .env_remove("NCCL_COMM_ID")
            .env("NCCL_TEST_NPROCS", self.procs.to_string())
            .env("NCCL_TEST_PROC", index.to_string())
            .env("NCCL_TEST_LOCAL", self.local.to_string())
            .env("NCCL_TEST_ID_FILE", dir.join("unique-id"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("dup log"))
            .stderr(log);
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {}: {e}", bin.display()));
        Proc {
            child,
            status: None,
            log: log_path,
            killed: false,
        }
    }

    fn report(&self, procs: &[Proc], dir: &Path, timed_out: bool) -> String {
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
        for (i, p) in procs.iter().enumerate() {
            let status = match (p.status, p.killed) {
                (_, true) => "killed by the harness".to_string(),
                (Some(st), _) => describe_status(st),
                (None, _) => "still running".to_string(),
            };
            s += &format!("---- process {i}: {status}\n{}\n", tail(&p.log, LOG_TAIL));
        }
        s
    }
}

struct Proc {
    child: Child,
    status: Option<ExitStatus>,
    log: PathBuf,
    killed: bool,
}

/// Polls every process until all exit, the deadline passes, or one failed and the others
/// did not finish within GRACE_AFTER_FAILURE; kills what is left. Returns whether the
/// deadline passed.
fn wait_all(procs: &mut [Proc], timeout: Duration) -> bool {
    let start = Instant::now();
    let mut failed_at: Option<Instant> = None;
    loop {
        for p in procs.iter_mut().filter(|p| p.status.is_none()) {
            if let Ok(Some(st)) = p.child.try_wait() {
                p.status = Some(st);
                if !st.success() && failed_at.is_none() {
                    failed_at = Some(Instant::now());
                }
            }
        }
        if procs.iter().all(|p| p.status.is_some()) {
            return false;
        }
        let expired = start.elapsed() > timeout;
        let grace_over = failed_at.is_some_and(|t| t.elapsed() > GRACE_AFTER_FAILURE);
        if expired || grace_over {
            for p in procs.iter_mut().filter(|p| p.status.is_none()) {
                let _ = p.child.kill();
                p.status = p.child.wait().ok();
                p.killed = true;
            }
            return expired;
        }
        std::thread::sleep(POLL);
    }
}

fn describe_status(st: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (st.code(), st.signal()) {
        (Some(0), _) => "exit 0".to_string(),
        (Some(c), _) => format!("exit {c}"),
        (None, Some(sig)) => format!("killed by signal {sig}"),
        _ => format!("{st:?}"),
    }
}

fn tail(path: &Path, max: usize) -> String {
    let mut text = String::new();
    if let Ok(mut f) = File::open(path) {
        let mut bytes = Vec::new();
        let _ = f.read_to_end(&mut bytes);
        text = String::from_utf8_lossy(&bytes).into_owned();
    }
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
fn fresh_dir(program: &str) -> PathBuf {
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

fn free_tcp_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("binding a port");
    listener.local_addr().expect("local_addr").port()
}

fn run_command(cmd: &mut Command) -> Output {
    cmd.output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"))
}

fn assert_success(what: &str, out: &Output) {
    assert!(
        out.status.success(),
        "{what}: {}\n--- stdout\n{}\n--- stderr\n{}",
        describe_status(out.status),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

// ---- the programs ----------------------------------------------------------------------------

#[test]
fn programs_compile_against_both_headers() {
    let failures: Vec<&String> = setup()
        .programs
        .values()
        .filter_map(|r| r.as_ref().err())
        .collect();
    assert!(
        failures.is_empty(),
        "{}",
        failures
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join("\n\n")
    );
}

#[test]
fn collectives_1_process() {
    Job::new("collectives").run();
}

#[test]
fn collectives_2_processes_every_call_form() {
    Job::new("collectives").procs(2).arg("--full").run();
}

#[test]
fn collectives_3_processes() {
    Job::new("collectives").procs(3).run();
}

#[test]
fn collectives_4_processes() {
    Job::new("collectives").procs(4).run();
}

#[test]
fn collectives_8_processes_quick() {
    Job::new("collectives").procs(8).arg("--quick").run();
}

#[test]
fn collectives_2_local_ranks() {
    Job::new("collectives").local(2).run();
}

#[test]
fn collectives_4_local_ranks() {
    Job::new("collectives").local(4).run();
}

#[test]
fn collectives_2_processes_x_2_local_ranks() {
    Job::new("collectives").procs(2).local(2).run();
}

/// NCCL_ALGO forces either algorithm; both must give the exact results (3 ranks: not a
/// power of two, so recursive doubling folds a rank in and out).
#[test]
fn collectives_3_processes_ring_forced() {
    Job::new("collectives").procs(3).arg("--quick").env("NCCL_ALGO", "Ring").run();
}

#[test]
fn collectives_3_processes_tree_forced() {
    Job::new("collectives").procs(3).arg("--quick").env("NCCL_ALGO", "Tree").run();
}

/// 64 ranks on one machine: 16 processes of 4 ranks each.
#[test]
fn allreduce_64_ranks_16_processes_x_4() {
    Job::new("collectives").procs(16).local(4).arg("--quick").arg("--only").arg("AllReduce").timeout_s(240).run();
}

#[test]
fn collectives_2_processes_nvidia_header() {
    Job::new("collectives")
        .procs(2)
        .header(Header::Nvidia)
        .run();
}

#[test]
fn collectives_2_processes_socket_transport() {
    Job::new("collectives")
        .procs(2)
        .env("NCCL_SHM_DISABLE", "1")
        .run();
}

#[test]
fn collectives_2_processes_nccl_comm_id() {
    let addr = format!("127.0.0.1:{}", free_tcp_port());
    Job::new("collectives")
        .procs(2)
        .arg("--quick")
        .env("NCCL_COMM_ID", &addr)
        .run();
}

#[test]
fn p2p_2_processes() {
    Job::new("p2p").procs(2).run();
}

#[test]
fn p2p_3_processes() {
    Job::new("p2p").procs(3).run();
}

#[test]
fn p2p_4_processes() {
    Job::new("p2p").procs(4).run();
}

#[test]
fn p2p_4_local_ranks() {
    Job::new("p2p").local(4).run();
}

#[test]
fn lifecycle_1_process() {
    Job::new("lifecycle").timeout_s(180).run();
}

#[test]
fn lifecycle_2_processes() {
    Job::new("lifecycle").procs(2).timeout_s(180).run();
}

#[test]
fn lifecycle_4_processes() {
    Job::new("lifecycle").procs(4).timeout_s(180).run();
}

#[test]
fn lifecycle_2_processes_nvidia_header() {
    Job::new("lifecycle")
        .procs(2)
        .header(Header::Nvidia)
        .timeout_s(180)
        .run();
}

#[test]
fn leaks_2_processes() {
    Job::new("leaks").procs(2).exclusive().timeout_s(300).run();
}

#[test]
fn errors_1_process() {
    Job::new("errors").run();
}

#[test]
fn errors_1_process_nvidia_header() {
    Job::new("errors").header(Header::Nvidia).run();
}

// ---- the shared object itself ----------------------------------------------------------------

/// `nm -D --defined-only` lists exactly NVIDIA's function names (T or W). Symbols of other
/// types are printed, not counted.
#[test]
fn exported_symbols_match_nccl() {
    let lib = &setup().lib;
    let out = run_command(Command::new("nm").args(["-D", "--defined-only"]).arg(lib));
    assert_success("nm", &out);
    let mut functions = BTreeSet::new();
    let mut others = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (kind, name) = match fields.as_slice() {
            [_, kind, name] | [kind, name] => (*kind, name.split('@').next().unwrap_or(name)),
            _ => continue,
        };
        if kind == "T" || kind == "W" {
            functions.insert(name.to_string());
        } else {
            others.push(format!("{kind} {name}"));
        }
    }
    if !others.is_empty() {
        println!("non-function symbols (ignored): {}", others.join(", "));
    }
    let reference = fs::read_to_string(symbols_file())
        .unwrap_or_else(|e| panic!("{}: {e}", symbols_file().display()));
    let expected: BTreeSet<String> = reference
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(String::from)
        .collect();
    let missing: Vec<_> = expected.difference(&functions).collect();
    let extra: Vec<_> = functions.difference(&expected).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "{}: {} missing: {missing:?}\n{} extra: {extra:?}",
        lib.display(),
        missing.len(),
        extra.len()
    );
}

/// Checks of struct layouts and constants against NVIDIA's header, written separately.
#[test]
fn abi_layout_script() {
    let script = repo().join("ffi-tests/abi_layout.sh");
    if !script.is_file() {
        println!("{} does not exist yet: nothing to run", script.display());
        return;
    }
    let s = setup();
    let mut cmd = Command::new("bash");
    cmd.arg(&script)
        .current_dir(repo())
        .env("NCCL_FFI_LIB", &s.lib)
        .env("NCCL_FFI_LIB_DIR", &s.lib_dir);
    if let Ok(r) = &s.reference {
        cmd.env("NCCL_REFERENCE_DIR", r);
    }
    assert_success("ffi-tests/abi_layout.sh", &run_command(&mut cmd));
}

/// What `import torch` does: load the library with RTLD_NOW, on a machine with neither
/// libcuda.so.1 nor libibverbs.so.1.
#[test]
fn python_ctypes_loads_library() {
    let s = setup();
    let code = "import ctypes; l = ctypes.CDLL('libnccl.so.2'); v = ctypes.c_int(); \
                r = l.ncclGetVersion(ctypes.byref(v)); \
                assert r == 0 and v.value == 23203, (r, v.value); print('version', v.value)";
    let mut cmd = Command::new("python3");
    cmd.args(["-c", code])
        .env("LD_PRELOAD", s.lib_dir.join("libnccl.so.2"));
    match cmd.output() {
        Ok(out) => assert_success("python3 ctypes with LD_PRELOAD", &out),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            println!("python3 not found: skipped")
        }
        Err(e) => panic!("running python3: {e}"),
    }
}

const DLOPEN_CHECK: &str = r#"
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
typedef int (*get_version_t)(int*);
int main(int argc, char** argv) {
  void* h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
  if (!h) { printf("dlopen: %s\n", dlerror()); return 1; }
  void* sym = dlsym(h, "ncclGetVersion");
  if (!sym) { printf("no ncclGetVersion\n"); return 1; }
  get_version_t fn;
  memcpy(&fn, &sym, sizeof fn);
  int v = -1, r = fn(&v);
  printf("ncclGetVersion -> %d, version %d\n", r, v);
  if (r != 0 || v != 23203) return 1;
  FILE* f = argc > 1 ? fopen(argv[1], "r") : NULL;
  if (!f) { printf("cannot read the symbol list\n"); return 1; }
  char name[256];
  int missing = 0, total = 0;
  while (fscanf(f, "%255s", name) == 1) {
    total++;
    if (!dlsym(h, name)) { printf("dlsym(%s) failed\n", name); missing++; }
  }
  fclose(f);
  printf("%d of %d symbols resolved\n", total - missing, total);
  return missing != 0;
}
"#;

/// dlopen("libnccl.so.2", RTLD_NOW) through LD_LIBRARY_PATH, then dlsym of every export.
#[test]
fn dlopen_without_cuda_or_verbs() {
    let s = setup();
    let src = s.bin_dir.join("dlopen_check.c");
    let exe = s
        .bin_dir
        .join(format!("dlopen_check.{}", std::process::id()));
    fs::write(&src, DLOPEN_CHECK).expect("writing dlopen_check.c");
    let mut compile = Command::new(cc());
    compile
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1", "-o"])
        .arg(&exe)
        .arg(&src)
        .arg("-ldl");
    assert_success("compiling dlopen_check.c", &run_command(&mut compile));
    let out = run_command(
        Command::new(&exe)
            .arg(symbols_file())
            .env("LD_LIBRARY_PATH", &s.lib_dir),
    );
    let _ = fs::remove_file(&exe);
    assert_success("dlopen check", &out);
    println!("{}", String::from_utf8_lossy(&out.stdout));
}
