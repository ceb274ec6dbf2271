//! The benchmark tool end to end in host mode (tests/cuda_mode.rs runs it in CUDA mode):
//! every collective across processes, every datatype x reduction checked exactly, both table
//! formats, the JSON it writes and a plot of it, and the init mode. The tool prints timings;
//! nothing here asserts one.

use std::path::PathBuf;
use std::process::Command;

const DTYPES: [&str; 12] =
    ["int8", "uint8", "int32", "uint32", "int64", "uint64", "half", "float", "double", "bfloat16", "f8e4m3", "f8e5m2"];
const OPS: [&str; 6] = ["sum", "prod", "max", "min", "avg", "premulsum"];

/// Run the tool (host mode: no CUDA driver on the library path, no fixed root address);
/// its whole output, after checking that it exited 0.
fn perf(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_nccl-rs-perf"))
        .args(args)
        .env_remove("NCCL_COMM_ID")
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .expect("run nccl-rs-perf");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "nccl-rs-perf {args:?} failed:\n{text}");
    text
}

/// The rows of the table: lines that start with a size (nccl-tests format) or the
/// collective's name (baselines format).
fn rows<'a>(text: &'a str, first: &str) -> Vec<&'a str> {
    text.lines()
        .filter(|l| match first {
            "" => l.trim_start().starts_with(|c: char| c.is_ascii_digit()),
            name => l.starts_with(name),
        })
        .collect()
}

fn checked(text: &str, what: &str) {
    assert!(text.contains("Out of bounds values : 0 OK"), "{what}: wrong results:\n{text}");
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("nccl-rs-perf-test-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a scratch folder");
    dir
}

/// Two ranks of one process, 8 B to 4 KiB: every datatype with every reduction, all-reduce
/// exact (avg within rounding), each row naming them.
#[test]
fn every_datatype_and_reduction_is_checked() {
    for dt in DTYPES {
        for op in OPS {
            let text = perf(&["allreduce", "-t", "2", "-b", "8", "-e", "4K", "-f", "8", "-n", "1", "-w", "0", "-d", dt, "-o", op]);
            checked(&text, &format!("allreduce {dt} {op}"));
            let rows = rows(&text, "");
            assert_eq!(rows.len(), 4, "allreduce {dt} {op}: expected 4 sizes:\n{text}");
            assert!(rows.iter().all(|r| r.split_whitespace().nth(2) == Some(dt) && r.split_whitespace().nth(3) == Some(op)),
                    "allreduce {dt} {op}: rows name another datatype or reduction:\n{text}");
        }
    }
    // Avg on floats over rank counts that are not powers of two: 1/n rounds (as in NCCL, each
    // input is scaled by it before the sum), and the check allows for that and no more.
    for t in ["3", "7"] {
        for dt in ["half", "bfloat16", "float", "double"] {
            let text = perf(&["allreduce", "-t", t, "-b", "8", "-e", "64K", "-f", "8", "-n", "1", "-w", "0", "-d", dt, "-o", "avg"]);
            checked(&text, &format!("allreduce {dt} avg on {t} ranks"));
        }
    }
    for coll in ["reducescatter", "reduce"] {
        for dt in ["half", "int64", "f8e5m2"] {
            for op in OPS {
                let text = perf(&[coll, "-t", "3", "-b", "8", "-e", "4K", "-f", "8", "-n", "1", "-w", "0", "-d", dt, "-o", op, "-r", "1"]);
                checked(&text, &format!("{coll} {dt} {op}"));
            }
        }
    }
}

/// Every collective across 2 and 3 forked processes (3: not a power of two), 8 B to 64 KiB.
#[test]
fn every_collective_across_processes() {
    for np in ["2", "3"] {
        for coll in ["allreduce", "allgather", "reducescatter", "broadcast", "reduce", "alltoall", "sendrecv", "gather", "scatter"] {
            let text = perf(&[coll, "-np", np, "-b", "8", "-e", "64K", "-f", "16", "-n", "1", "-w", "0", "-r", "1"]);
            checked(&text, &format!("{coll} on {np} processes"));
            // On 3 ranks, 8 bytes of float split per rank is below one element: that size is left out.
            let want = if np == "2" { 4 } else { 3 };
            assert!(rows(&text, "").len() >= want, "{coll} on {np} processes: expected {want} sizes or more:\n{text}");
        }
    }
}

/// Nonblocking communicators (`--nonblocking 1`, and `NCCL_COMM_BLOCKING=0` without it): calls
/// return ncclInProgress and the tool waits by polling ncclCommGetAsyncError; every collective
/// checked, the time in the calls reported.
#[test]
fn nonblocking_communicators() {
    for coll in ["allreduce", "allgather", "reducescatter", "broadcast", "alltoall", "sendrecv"] {
        for layout in [["-np", "2"], ["-t", "3"]] {
            let text = perf(&[coll, layout[0], layout[1], "-b", "8", "-e", "64K", "-f", "16", "-n", "2", "-w", "1",
                              "--nonblocking", "1", "-r", "1"]);
            checked(&text, &format!("{coll} {layout:?} nonblocking"));
            assert!(text.contains("nonblocking communicators"), "{coll}: the header does not say nonblocking:\n{text}");
            assert!(text.contains("us per call (in the call"), "{coll}: no time in the calls:\n{text}");
        }
    }
    let out = Command::new(env!("CARGO_BIN_EXE_nccl-rs-perf"))
        .args(["allreduce", "-np", "2", "-b", "8", "-e", "4K", "-f", "8", "-n", "2", "-w", "1"])
        .env_remove("NCCL_COMM_ID")
        .env_remove("LD_LIBRARY_PATH")
        .env("NCCL_COMM_BLOCKING", "0")
        .output()
        .expect("run nccl-rs-perf");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "NCCL_COMM_BLOCKING=0 failed:\n{text}");
    checked(&text, "NCCL_COMM_BLOCKING=0");
}

/// The baselines' table (one row per size, the collective's name first), pinned processes.
#[test]
fn baselines_table_and_binding() {
    let text = perf(&["allreduce", "-np", "2", "-b", "8", "-e", "64K", "-f", "16", "-n", "1", "-w", "0", "--table", "baselines",
                      "--bind", "1", "-x", "3K"]);
    checked(&text, "baselines table");
    let rows = rows(&text, "allreduce ");
    assert_eq!(rows.len(), 5, "expected 4 sizes and the extra 3K:\n{text}");
    assert!(rows.iter().any(|r| r.split_whitespace().nth(1) == Some("3072")), "no row for -x 3K:\n{text}");
    assert!(text.contains("bind 1"), "the binding is not reported:\n{text}");
}

/// --json writes the table with its metadata; --plot draws one line from it.
#[test]
fn json_and_plot() {
    let dir = scratch("json");
    let json = dir.join("allgather.json");
    let text = perf(&["allgather", "-np", "2", "-b", "8", "-e", "64K", "-f", "16", "-n", "1", "-w", "0", "--json",
                      json.to_str().expect("a path")]);
    checked(&text, "allgather with --json");
    let j = std::fs::read_to_string(&json).expect("the JSON file");
    for field in ["\"tool\": \"nccl-rs-perf\"", "\"collective\": \"allgather\"", "\"nranks\": 2", "\"dtype\": \"float\"",
                  "\"check\": true", "\"timing\": "] {
        assert!(j.contains(field), "{field} missing from the JSON:\n{j}");
    }
    assert_eq!(j.matches("\"size\":").count(), 4, "expected 4 rows in the JSON:\n{j}");
    assert!(j.matches("\"wrong\": 0").count() >= 8 && !j.split("\"wrong\": ").skip(1)
                .any(|t| !t.starts_with('0')), "expected out-of-place and in-place rows, none wrong:\n{j}");
    let svg = dir.join("plot.svg");
    let said = perf(&["--plot", svg.to_str().expect("a path"), json.to_str().expect("a path")]);
    let drawn = std::fs::read_to_string(&svg).expect("the SVG file");
    assert!(drawn.starts_with("<svg") || drawn.contains("<svg "), "not an SVG:\n{drawn}");
    assert_eq!(drawn.matches("<polyline").count(), 1, "expected one line:\n{said}\n{drawn}");
    assert!(drawn.contains("allgather"), "the line is not labelled:\n{drawn}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// --init: init, first call and destroy times over the repeats, memory growth, MemStats.
#[test]
fn init_mode() {
    let text = perf(&["--init", "2", "--repeat", "2"]);
    for what in ["init", "first", "destroy"] {
        assert!(text.lines().any(|l| l.split_whitespace().collect::<Vec<_>>()[..].starts_with(&["init", "2", what])),
                "no '{what}' row:\n{text}");
    }
    assert!(text.contains("VmRSS growth") && text.contains("ncclCommMemStats"), "no memory report:\n{text}");
}

/// A process of the job that ends before it joins, saying nothing itself (here: exit status 3
/// before `main`, from a preloaded constructor): the tool names it, and stops the others, which
/// would otherwise wait for it at init as long as NCCL waits.
#[test]
fn a_process_that_exits_early_is_named_and_the_others_stopped() {
    let dir = scratch("early-exit");
    let (src, lib) = (dir.join("leave.c"), dir.join("leave.so"));
    std::fs::write(&src, concat!(
        "#include <stdlib.h>\n#include <string.h>\n#include <unistd.h>\n",
        "__attribute__((constructor)) static void leave(void) {\n",
        "    const char *p = getenv(\"NCCL_RS_PERF_PROC\");\n",
        "    if (p && strcmp(p, \"1\") == 0) _exit(3);\n",
        "}\n")).expect("write the preload's source");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let built = Command::new(&cc).args(["-shared", "-fPIC", "-o"]).arg(&lib).arg(&src).status().expect("run cc");
    assert!(built.success(), "{cc} could not build the preload");

    let mut child = Command::new(env!("CARGO_BIN_EXE_nccl-rs-perf"))
        .args(["allreduce", "-np", "2", "-b", "8", "-e", "8", "-n", "1", "-w", "0"])
        .env_remove("NCCL_COMM_ID").env_remove("LD_LIBRARY_PATH").env_remove("NCCL_INIT_TIMEOUT_S")
        .env("LD_PRELOAD", &lib)
        .stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped())
        .spawn().expect("run nccl-rs-perf");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while child.try_wait().expect("poll nccl-rs-perf").is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("nccl-rs-perf still runs 120 s after one of its processes exited");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let out = child.wait_with_output().expect("collect nccl-rs-perf's output");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "nccl-rs-perf succeeded without its process 1:\n{text}");
    assert!(text.contains("nccl-rs-perf: process 1 exited with status 3"), "process 1 not named:\n{text}");
    assert!(text.contains("nccl-rs-perf: stopping process 0: process 1 failed"), "process 0 not stopped:\n{text}");
    let _ = std::fs::remove_dir_all(&dir);
}
