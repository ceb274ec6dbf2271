//! CUDA mode end to end: `ffi-tests/cuda.c` (device buffers, the caller's streams) against the
//! stand-in driver of `tests/cuda-stub`, on 1-4 ranks as processes and as ranks of one
//! process, every rank on the one stub device (ranks sharing a GPU, as nccl-rs allows).
//! `scripts/device-check.sh` runs the same program against a real GPU.

mod common;

use common::{cuda_stub_dir, skip_netns, Hosts, Job, Outcome, When};

/// Against the stub; with `NCCL_TEST_REAL_DRIVER=1` (scripts/device-check.sh on a GPU
/// machine), against the machine's own driver.
fn cuda_job() -> Job {
    let job = Job::new("cuda").timeout_s(180);
    if std::env::var_os("NCCL_TEST_REAL_DRIVER").is_some() {
        // On a GPU a job takes seconds: one that hangs fails after 40 s, with its stacks where
        // asked (NCCL_TEST_STACKS_AT_DEADLINE), and the next test still runs in the step.
        job.timeout_s(40)
    } else {
        job.lib_path(cuda_stub_dir())
    }
}

/// Tests of what only the stand-in can do (refuse modules or waits, model hardware queues)
/// say so and pass against a real driver (scripts/device-check.sh runs this file there).
fn stand_in_only(test: &str) -> bool {
    let real = std::env::var_os("NCCL_TEST_REAL_DRIVER").is_some();
    if real {
        println!("{test}: skipped against the real driver (it needs the stand-in's fault switches)");
    }
    !real
}

#[test]
fn cuda_mode_1_rank() {
    cuda_job().run();
}

#[test]
fn cuda_mode_2_processes() {
    cuda_job().procs(2).run();
}

#[test]
fn cuda_mode_4_processes() {
    cuda_job().procs(4).arg("--quick").run();
}

/// CUDA mode under a storm of signals to handlers without SA_RESTART (see
/// `ffi::calls_go_on_through_a_storm_of_signals`): the stream worker's and the library's other
/// threads take them too; every part (--quick) completes, exact, on 2 processes and on 2 ranks
/// of one process, direct and staged (NCCL_P2P_DISABLE).
#[test]
fn cuda_mode_through_a_storm_of_signals() {
    for job in [cuda_job().procs(2), cuda_job().local(2), cuda_job().procs(2).env("NCCL_P2P_DISABLE", "1")] {
        job.arg("--quick").env("NCCL_TEST_SIGNAL_STORM_US", "200").run();
    }
}

/// Every line of a rank's shows that rank in `[...]`, whichever of its threads wrote it (the
/// stream worker's, too): the log lines that do not.
fn lines_showing_another_rank(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|l| {
            let Some((head, msg)) = l.split_once(" NCCL ").and_then(|(h, m)| Some((h, m.split_once(' ')?.1))) else {
                return false;
            };
            let rank = msg.strip_prefix("rank ").and_then(|m| m.split_once(':')).map(|(r, _)| r);
            rank.is_some_and(|r| r.parse::<u32>().is_ok() && !head.contains(&format!(" [{r}]")))
        })
        .collect()
}

/// Runs `job` with INFO logs of the P2P subsystem and checks which path the collectives took:
/// the direct one (peers' device buffers read through CUDA IPC) or staging; and that each
/// line names the rank it shows in `[...]`.
fn run_expecting_direct(job: Job, direct: bool) {
    let o = job.env("NCCL_DEBUG", "INFO").env("NCCL_DEBUG_SUBSYS", "P2P").run_outcome();
    assert!(o.ok(), "{}", o.report);
    for (i, p) in o.procs.iter().enumerate() {
        let took = p.log.contains("are read directly");
        assert_eq!(took, direct, "process {i}: direct path taken = {took}, expected {direct}:\n{}", p.log);
        let other = lines_showing_another_rank(&p.log);
        assert!(other.is_empty(), "process {i}: lines that show another rank in [...]: {other:#?}");
    }
}

/// The direct path with its kernels queued on the caller's stream at call time (the default),
/// and issued by the worker on its own stream (NCCL_RS_DIRECT_ON_STREAM=0): the same results,
/// as processes and as ranks of one process.
#[test]
fn cuda_mode_2_processes_read_each_other_directly() {
    for (on_stream, by) in [("1", "on the caller's stream"), ("0", "on the stream worker's stream")] {
        for job in [cuda_job().procs(2), cuda_job().local(2)] {
            let o = job.arg("--only").arg("Collectives").env("NCCL_RS_DIRECT_ON_STREAM", on_stream)
                .env("NCCL_DEBUG", "INFO").env("NCCL_DEBUG_SUBSYS", "P2P").run_outcome();
            assert!(o.ok(), "NCCL_RS_DIRECT_ON_STREAM={on_stream}: {}", o.report);
            for (i, p) in o.procs.iter().enumerate() {
                assert!(p.log.contains("are read directly") && p.log.contains(by),
                        "process {i}: expected the direct path {by}:\n{}", p.log);
            }
        }
    }
}

/// Every datatype x reduction (AllReduce, ReduceScatter, Reduce) on the direct path, as
/// processes and as ranks of one process: the device kernels' results, exact (avg on floats
/// within rounding). fp16 Avg, whose inputs are scaled by 1/n before the sum, reads copies of
/// them scaled at call time (the only operations of the part that copy anything), and with
/// NCCL_RS_INPLACE_SCRATCH=0 is staged. In the stand-in the kernels run as its host copies of
/// them.
#[test]
fn cuda_mode_direct_reductions_every_datatype_and_op() {
    for (job, scratch) in [(cuda_job().procs(2), "67108864"), (cuda_job().local(3), "67108864"), (cuda_job().procs(2), "0")] {
        let o = job.arg("--only").arg("Reductions").env("NCCL_RS_INPLACE_SCRATCH", scratch).env("NCCL_DEBUG", "INFO")
            .env("NCCL_DEBUG_SUBSYS", "P2P").run_outcome();
        assert!(o.ok(), "NCCL_RS_INPLACE_SCRATCH={scratch}: {}", o.report);
        for (i, p) in o.procs.iter().enumerate() {
            assert!(p.log.contains("are read directly"), "process {i}: expected the direct path:\n{}", p.log);
            assert_eq!(p.log.contains("are copied on the caller's stream into"), scratch != "0",
                       "NCCL_RS_INPLACE_SCRATCH={scratch}, process {i}: fp16 avg's scaled copies:\n{}", p.log);
        }
    }
}

/// One GPU per process, as most jobs run (the stand-in with two devices, process p on device
/// p): every part passes, each communicator reports its process's device, and the processes
/// read each other's buffers directly (peer access between the devices).
#[test]
fn cuda_mode_2_processes_on_2_devices() {
    // The device machine has one GPU; its second device is the stand-in's.
    if !stand_in_only("cuda_mode_2_processes_on_2_devices") {
        return;
    }
    let job = cuda_job().procs(2).env("NCCL_RS_STUB_DEVICES", "2").proc_env(0, "NCCL_TEST_CUDA_DEVICE", "0")
        .proc_env(1, "NCCL_TEST_CUDA_DEVICE", "1").env("NCCL_DEBUG", "INFO").env("NCCL_DEBUG_SUBSYS", "P2P");
    let o = job.run_outcome();
    assert!(o.ok(), "{}", o.report);
    for (i, p) in o.procs.iter().enumerate() {
        assert!(p.log.contains("are read directly"), "process {i}: expected the direct path:\n{}", p.log);
    }
}

/// One thread drives a communicator per device (ncclCommInitAll over the stand-in's devices,
/// as nccl-tests -g N; part Devices): all-reduces large and small, exact, the caller's
/// context current again after each group (one call switches between the devices'
/// contexts: `KeepCurrent` must track which is current). The ranks read each other's
/// buffers directly once peer access between their devices is enabled (the stand-in stops a
/// kernel that reads another device's memory without it); where the devices have none
/// (NCCL_RS_STUB_NO_PEER_ACCESS=1) they stage, and say so.
#[test]
fn cuda_mode_one_thread_several_devices() {
    if !stand_in_only("cuda_mode_one_thread_several_devices") {
        return;
    }
    for (n, peer_access) in [("2", true), ("3", true), ("2", false)] {
        let o = cuda_job().local(n.parse().unwrap_or(2)).env("NCCL_RS_STUB_DEVICES", n).arg("--only").arg("Devices")
            .env("NCCL_RS_STUB_NO_PEER_ACCESS", if peer_access { "0" } else { "1" })
            .env("NCCL_RS_STUB_REPORT_WORKER_CALLS", "1")
            .env("NCCL_DEBUG", "INFO").env("NCCL_DEBUG_SUBSYS", "P2P").run_outcome();
        assert!(o.ok(), "{n} devices, peer access {peer_access}: {}", o.report);
        let log = &o.procs[0].log;
        assert_eq!(log.contains("are read directly"), peer_access, "{n} devices, peer access {peer_access}:\n{log}");
        assert_eq!(log.contains("without peer access from device"), !peer_access,
                   "{n} devices, peer access {peer_access}: the staging not said:\n{log}");
        // (Without peer access, the first operation, in which the ranks learn that they never
        // can, is staged on the worker's stream: README, CUDA mode's known limits.)
        assert!(!peer_access || !log.contains("from the stream worker"), "{n} devices: the worker made device calls:\n{log}");
    }
}

/// A call given a stream of another device than its communicator's is refused at the call
/// (ncclInvalidArgument, naming both devices), in a group too, which then runs nothing; the
/// communicators keep working (part WrongStream).
#[test]
fn cuda_mode_a_stream_of_another_device_is_refused() {
    if !stand_in_only("cuda_mode_a_stream_of_another_device_is_refused") {
        return;
    }
    let o = cuda_job().local(2).env("NCCL_RS_STUB_DEVICES", "2").arg("--only").arg("WrongStream")
        .env("NCCL_DEBUG", "WARN").run_outcome();
    assert!(o.ok(), "{}", o.report);
    let log = &o.procs[0].log;
    assert!(log.contains("NCCL WARN") && log.contains("device 1") && log.contains("device 0"),
            "the refusal is not at WARN naming both devices:\n{log}");
}

/// Buffers of another device than the communicator's: read and written where they are, with
/// peer access enabled at the call (nothing else of the job would), staged and direct; where
/// the devices have no peer access, refused at the call on every rank rather than left to a
/// kernel that faults (part ForeignBuffer). Two processes, and two ranks of one process.
#[test]
fn cuda_mode_buffers_of_another_device() {
    if !stand_in_only("cuda_mode_buffers_of_another_device") {
        return;
    }
    for (procs, local) in [(2, 1), (1, 2)] {
        for peer in [true, false] {
            let o = cuda_job().procs(procs).local(local).env("NCCL_RS_STUB_DEVICES", "2")
                .env("NCCL_RS_STUB_NO_PEER_ACCESS", if peer { "0" } else { "1" })
                .env("CUDA_TEST_PEER_ACCESS", if peer { "1" } else { "0" })
                .arg("--only").arg("ForeignBuffer").run_outcome();
            assert!(o.ok(), "{procs} x {local}, peer access {peer}: {}", o.report);
        }
    }
}

/// ncclCommInitAll without a device list and more ranks than devices: the ranks beyond them
/// run calls on host buffers, whatever stream they are given (part Beyond).
#[test]
fn cuda_mode_init_all_beyond_the_devices() {
    if !stand_in_only("cuda_mode_init_all_beyond_the_devices") {
        return;
    }
    let o = cuda_job().arg("--only").arg("Beyond").run_outcome();
    assert!(o.ok(), "{}", o.report);
}

/// NCCL_P2P_LEVEL against the PCI distance of the ranks' GPUs, read from sysfs (a tree of
/// our own here, NCCL_RS_TOPO_SYSFS, with the stand-in's two devices below two root ports of
/// one root: PHB apart, on one NUMA node). PIX stages everything between them (and says why),
/// PHB and SYS go direct, a level set on one process only holds for both (no hang, both
/// stage), and NVL keeps the direct path between ranks of one GPU. Exact every time.
#[test]
fn cuda_mode_p2p_level_follows_pci_distance() {
    if !stand_in_only("cuda_mode_p2p_level_follows_pci_distance") {
        return;
    }
    let root = std::env::temp_dir().join(format!("nccl-rs-sysfs-{}", std::process::id()));
    let gpus = [("0000:04:00.0", "pci0000:00/0000:00:01.0/0000:04:00.0"), ("0000:09:00.0", "pci0000:00/0000:00:02.0/0000:09:00.0")];
    for (bus, path) in gpus {
        let dev = root.join("devices").join(path);
        std::fs::create_dir_all(&dev).expect("a temporary directory");
        std::fs::write(dev.join("numa_node"), "0\n").expect("a file");
        std::fs::create_dir_all(root.join("bus/pci/devices")).expect("a temporary directory");
        let _ = std::os::unix::fs::symlink(&dev, root.join("bus/pci/devices").join(bus));
    }
    let sysfs = root.to_string_lossy().into_owned();
    let two_gpus = |levels: [&str; 2]| {
        let mut job = cuda_job().procs(2).arg("--quick").env("NCCL_RS_STUB_DEVICES", "2")
            .env("NCCL_RS_STUB_PCI_BUS_IDS", "0000:04:00.0,0000:09:00.0").env("NCCL_RS_TOPO_SYSFS", &sysfs)
            .env("NCCL_DEBUG", "INFO").env("NCCL_DEBUG_SUBSYS", "P2P")
            .env("CUDA_TEST_PEER_ACCESS", if levels.iter().any(|l| *l == "PIX" || *l == "1") { "0" } else { "1" });
        for (p, level) in levels.iter().enumerate() {
            job = job.proc_env(p, "NCCL_TEST_CUDA_DEVICE", &p.to_string());
            if !level.is_empty() {
                job = job.proc_env(p, "NCCL_P2P_LEVEL", level);
            }
        }
        job.run_outcome()
    };
    for (levels, direct) in [(["PIX", "PIX"], false), (["PHB", "PHB"], true), (["", "SYS"], true), (["1", ""], false)] {
        let o = two_gpus(levels);
        assert!(o.ok(), "NCCL_P2P_LEVEL {levels:?}: {}", o.report);
        for (i, p) in o.procs.iter().enumerate() {
            let place = format!("CUDA device {i}: PCI {} ({}), NUMA node 0", gpus[i].0, gpus[i].1);
            assert!(p.log.contains(&place), "process {i}: its GPU's place not read or not said ({place}):\n{}", p.log);
            assert_eq!(p.log.contains("are read directly"), direct, "NCCL_P2P_LEVEL {levels:?}, process {i}:\n{}", p.log);
            if !direct {
                assert!(p.log.contains("is PHB from this rank's") && p.log.contains("their buffers are staged"),
                        "NCCL_P2P_LEVEL {levels:?}, process {i}: the reason not said:\n{}", p.log);
            }
        }
    }
    let o = cuda_job().procs(2).arg("--quick").env("NCCL_P2P_LEVEL", "NVL").env("NCCL_RS_TOPO_SYSFS", &sysfs)
        .env("NCCL_DEBUG", "INFO").env("NCCL_DEBUG_SUBSYS", "P2P").run_outcome();
    let _ = std::fs::remove_dir_all(&root);
    assert!(o.ok(), "NVL, one GPU: {}", o.report);
    assert!(o.procs.iter().all(|p| p.log.contains("are read directly")), "NVL, one GPU: not direct:\n{}", o.report);
}

/// NVLink (NVML's answers, from its stand-in: NCCL_RS_STUB_NVLINKS) outranks the PCI path:
/// under NCCL_P2P_LEVEL=NVL (or PIX) two GPUs PHB apart on PCI go direct when an active
/// NVLink joins them (listed by either end) or both reach NVSwitches (named by NVML, or by the
/// remote's PCI class where NVML cannot say), and stage when their links reach other GPUs.
/// Every rank says what its GPU's links reach. Exact every time.
#[test]
fn cuda_mode_p2p_level_nvl_follows_nvlinks() {
    if !stand_in_only("cuda_mode_p2p_level_nvl_follows_nvlinks") {
        return;
    }
    let root = std::env::temp_dir().join(format!("nccl-rs-sysfs-nvl-{}", std::process::id()));
    let gpus = [("0000:04:00.0", "pci0000:00/0000:00:01.0/0000:04:00.0"), ("0000:09:00.0", "pci0000:00/0000:00:02.0/0000:09:00.0"),
                ("0000:90:00.0", "pci0000:00/0000:00:03.0/0000:90:00.0")];
    for (bus, path) in gpus {
        let dev = root.join("devices").join(path);
        std::fs::create_dir_all(&dev).expect("a temporary directory");
        std::fs::write(dev.join("numa_node"), "0\n").expect("a file");
        // The third is the NVSwitch: a PCI bridge of class "other".
        std::fs::write(dev.join("class"), if bus.ends_with("90:00.0") { "0x068000\n" } else { "0x030200\n" }).expect("a file");
        std::fs::create_dir_all(root.join("bus/pci/devices")).expect("a temporary directory");
        let _ = std::os::unix::fs::symlink(&dev, root.join("bus/pci/devices").join(bus));
    }
    let sysfs = root.to_string_lossy().into_owned();
    // (what, NCCL_P2P_LEVEL, NVML's stand-in's settings, direct, what each process says of its links)
    type Case<'a> = (&'a str, &'a str, &'a [(&'a str, &'a str)], bool, [&'a str; 2]);
    let cases: [Case; 6] = [
        ("NVLink between them", "NVL", &[("NCCL_RS_STUB_NVLINKS", "0000:04:00.0>0000:09:00.0;0000:09:00.0>0000:04:00.0")], true,
         ["1 active NVLink(s) to 0000:09:00.0", "1 active NVLink(s) to 0000:04:00.0"]),
        ("listed by one end only", "NVL", &[("NCCL_RS_STUB_NVLINKS", "00000000:04:00.0>00000000:09:00.0")], true,
         ["1 active NVLink(s) to 0000:09:00.0", "no active NVLink"]),
        ("both on NVSwitches", "NVL", &[("NCCL_RS_STUB_NVLINKS", "0000:04:00.0>switch;0000:04:00.0>switch;0000:09:00.0>switch")], true,
         ["2 active NVLink(s) to no GPU, and NVSwitch", "1 active NVLink(s) to no GPU, and NVSwitch"]),
        ("switches by PCI class", "NVL", &[("NCCL_RS_STUB_NVLINKS", "0000:04:00.0>switch;0000:09:00.0>switch"),
                                           ("NCCL_RS_STUB_NVML_NO_TYPE", "1")], true,
         ["to no GPU, and NVSwitch", "to no GPU, and NVSwitch"]),
        ("NVLinks to other GPUs", "NVL", &[("NCCL_RS_STUB_NVLINKS", "0000:04:00.0>0000:0b:00.0;0000:09:00.0>0000:0c:00.0")], false,
         ["1 active NVLink(s) to 0000:0b:00.0", "1 active NVLink(s) to 0000:0c:00.0"]),
        ("NVLink under PIX", "PIX", &[("NCCL_RS_STUB_NVLINKS", "0000:04:00.0>0000:09:00.0")], true,
         ["1 active NVLink(s) to 0000:09:00.0", "no active NVLink"]),
    ];
    for (what, level, env, direct, said) in cases {
        let mut job = cuda_job().procs(2).arg("--quick").env("NCCL_RS_STUB_DEVICES", "2")
            .env("NCCL_RS_STUB_PCI_BUS_IDS", "0000:04:00.0,0000:09:00.0").env("NCCL_RS_TOPO_SYSFS", &sysfs)
            .env("NCCL_P2P_LEVEL", level).env("NCCL_DEBUG", "INFO").env("NCCL_DEBUG_SUBSYS", "P2P")
            .env("CUDA_TEST_PEER_ACCESS", if direct { "1" } else { "0" });
        for (k, v) in env {
            job = job.env(k, v);
        }
        for p in 0..2 {
            job = job.proc_env(p, "NCCL_TEST_CUDA_DEVICE", &p.to_string());
        }
        let o = job.run_outcome();
        assert!(o.ok(), "{what}: {}", o.report);
        for (i, p) in o.procs.iter().enumerate() {
            assert!(p.log.contains(said[i]), "{what}, process {i}: its NVLinks not read or not said ({}):\n{}", said[i], p.log);
            assert_eq!(p.log.contains("are read directly"), direct, "{what}, process {i}:\n{}", p.log);
            if !direct {
                assert!(p.log.contains("is PHB from this rank's"), "{what}, process {i}: the reason not said:\n{}", p.log);
            }
        }
    }
    // Without NVML (the stand-in's, unset: "not loaded") a rank says so and goes by PCI.
    let o = cuda_job().procs(2).arg("--quick").env("NCCL_RS_STUB_DEVICES", "2")
        .env("NCCL_RS_STUB_PCI_BUS_IDS", "0000:04:00.0,0000:09:00.0").env("NCCL_RS_TOPO_SYSFS", &sysfs)
        .env("NCCL_P2P_LEVEL", "NVL").env("NCCL_DEBUG", "INFO").env("NCCL_DEBUG_SUBSYS", "P2P")
        .env("CUDA_TEST_PEER_ACCESS", "0").proc_env(0, "NCCL_TEST_CUDA_DEVICE", "0").proc_env(1, "NCCL_TEST_CUDA_DEVICE", "1")
        .run_outcome();
    let _ = std::fs::remove_dir_all(&root);
    assert!(o.ok(), "no NVML: {}", o.report);
    for p in &o.procs {
        assert!(p.log.contains("NVLinks unknown (nvmlInit_v2 failed"), "no NVML: not said:\n{}", p.log);
        assert!(!p.log.contains("are read directly"), "no NVML: direct:\n{}", p.log);
    }
}

/// One rank declines the direct path for one operation (its output is pinned memory, and
/// NCCL_RS_INPLACE_SCRATCH=0: no device copy of it) while its peers offer device buffers:
/// every rank stages that one, exact, and goes direct again on the next; nobody concludes
/// that some rank can never go direct. With the device copy (the default) that rank's
/// all-reduce runs on a copy of its output, and every rank goes direct from the first.
#[test]
fn cuda_mode_one_rank_declines_one_operation() {
    for (procs, local) in [(3, 1), (1, 2)] {
        for (scratch, first) in [("0", "from AllReduce #1 ("), ("67108864", "from AllReduce #0 (")] {
            let o = cuda_job().procs(procs).local(local).arg("--only").arg("DeclineOne").env("NCCL_RS_INPLACE_SCRATCH", scratch)
                .env("NCCL_DEBUG", "INFO").env("NCCL_DEBUG_SUBSYS", "P2P").run_outcome();
            assert!(o.ok(), "NCCL_RS_INPLACE_SCRATCH={scratch}: {}", o.report);
            for (i, p) in o.procs.iter().enumerate() {
                // The declined one is AllReduce #0.
                assert!(p.log.contains("are read directly") && p.log.contains(first) && !p.log.contains("can never"),
                        "NCCL_RS_INPLACE_SCRATCH={scratch}, process {i}: expected the direct path {first}, and no \
                         'can never':\n{}", p.log);
            }
        }
    }
}

/// NCCL_RS_DIRECT_MIN moves the size from which collectives go direct: from 1 byte every
/// collective on device memory reads the peers directly, down to single elements (ranks
/// with nothing to reduce included), exact; from 1 GiB none does.
#[test]
fn cuda_mode_direct_min() {
    for (min, direct) in [("1", true), ("1073741824", false)] {
        let o = cuda_job().procs(2).arg("--only").arg("Collectives").env("NCCL_RS_DIRECT_MIN", min)
            .env("NCCL_DEBUG", "INFO").env("NCCL_DEBUG_SUBSYS", "P2P").run_outcome();
        assert!(o.ok(), "NCCL_RS_DIRECT_MIN={min}: {}", o.report);
        for (i, p) in o.procs.iter().enumerate() {
            assert_eq!(p.log.contains("are read directly"), direct, "NCCL_RS_DIRECT_MIN={min}, process {i}:\n{}", p.log);
        }
        if direct {
            // The first collective of part Collectives is its smallest (count 1).
            assert!(o.procs[0].log.contains("from AllReduce #0 (count 1,"), "{}", o.procs[0].log);
        }
    }
}

/// Sends and receives between ranks of a host read the sender's buffer directly (by default),
/// whichever way each end groups its calls (part P2PPairings), from device buffers, or from a
/// device copy of pinned ones (part Mixed; with NCCL_RS_INPLACE_SCRATCH=0 its pinned-to-device
/// send is sent as bytes, and its all-reduce to a pinned output is staged, not run on a copy),
/// also under PyTorch's pattern (part Torch: its large all-reduces take the direct path in
/// any case); as processes and as ranks of one process. With NCCL_RS_DIRECT_P2P=0 they are
/// staged, with the same results.
#[test]
fn cuda_mode_direct_sends_and_receives() {
    for part in ["P2P", "P2PPairings", "Mixed", "Torch"] {
        run_expecting_direct(cuda_job().procs(2).arg("--only").arg(part), true);
    }
    run_expecting_direct(cuda_job().procs(2).env("NCCL_RS_INPLACE_SCRATCH", "0").arg("--only").arg("Mixed"), false);
    // The stream worker staging what it sends (no caller's stream does when calls wait on the
    // host): its in-place round too.
    run_expecting_direct(cuda_job().procs(2).env("NCCL_RS_HOST_WAIT", "1").arg("--only").arg("P2P"), true);
    let off = cuda_job().procs(2).env("NCCL_RS_DIRECT_P2P", "0");
    for (job, direct) in [(cuda_job().procs(2), true), (cuda_job().local(2), true), (off, false)] {
        let o = job.arg("--only").arg("P2PPairings").env("NCCL_DEBUG", "INFO").env("NCCL_DEBUG_SUBSYS", "P2P").run_outcome();
        assert!(o.ok(), "{}", o.report);
        for (i, p) in o.procs.iter().enumerate() {
            assert_eq!(p.log.contains("read directly (CUDA IPC / same process), from point-to-point calls"), direct,
                       "process {i}:\n{}", p.log);
        }
    }
}

/// A receive whose bytes came while its caller's stream has yet to copy them needs nothing
/// more from the sender, which may finish and destroy its communicator meanwhile: with
/// process 0's copies slowed down (the stand-in's NCCL_RS_STUB_COPY_DELAY_MS), process 1
/// ends part P2P first, and rank 0's last receive (in place, its bytes sent with
/// NCCL_RS_INPLACE_SCRATCH=0) still lands. Before, rank 0 took the sender's closed connection
/// for a failure of that receive.
#[test]
fn cuda_mode_sender_may_leave_before_the_copy_runs() {
    if !stand_in_only("cuda_mode_sender_may_leave_before_the_copy_runs") {
        return;
    }
    let o = cuda_job().procs(2).arg("--only").arg("P2P").proc_env(0, "NCCL_RS_STUB_COPY_DELAY_MS", "200")
        .env("NCCL_RS_INPLACE_SCRATCH", "0").env("NCCL_DEBUG", "WARN").run_outcome();
    assert!(o.ok(), "{}", o.report);
}

/// The device scratch as a test asks for it: "0" off, "65536+" blocks of 64 KiB growing as
/// needed (the default most), any other size both the block and the most.
fn scratch_env(job: Job, scratch: &str) -> Job {
    match scratch.strip_suffix('+') {
        Some(block) => job.env("NCCL_RS_INPLACE_SCRATCH", block),
        None => job.env("NCCL_RS_INPLACE_SCRATCH", scratch).env("NCCL_RS_INPLACE_SCRATCH_MAX", scratch),
    }
}

/// In-place exchanges (part P2P's last round: ncclSend and ncclRecv of one buffer in a
/// group) and in-place all-to-alls (part InPlace: the only one of its collectives that needs
/// it) are copied on the caller's stream into device memory of the communicator's, which
/// peers read directly; with NCCL_RS_INPLACE_SCRATCH=0 (or too small: then said at WARN)
/// such sends send their bytes and such all-to-alls are staged. Exact either way, as processes and as ranks of one
/// process.
#[test]
fn cuda_mode_in_place_inputs_are_read_from_a_device_copy() {
    let line = "are copied on the caller's stream into";
    for part in ["P2P", "InPlace"] {
        // "65536+": blocks of 64 KiB, which grow to an operation's size; "65536": 64 KiB in all.
        for (job, scratch) in [(cuda_job().procs(2), "67108864"), (cuda_job().local(2), "67108864"),
                               (cuda_job().procs(2), "0"), (cuda_job().procs(2), "65536"), (cuda_job().procs(2), "65536+")] {
            let o = scratch_env(job, scratch).arg("--only").arg(part).env("NCCL_DEBUG", "INFO")
                .env("NCCL_DEBUG_SUBSYS", "P2P").run_outcome();
            assert!(o.ok(), "part {part}, NCCL_RS_INPLACE_SCRATCH={scratch}: {}", o.report);
            for (i, p) in o.procs.iter().enumerate() {
                // 64 KiB in all holds none of these inputs: nothing is allocated, and the first
                // says so at WARN.
                let (copied, warned) = (p.log.contains(line), p.log.contains("more than NCCL_RS_INPLACE_SCRATCH_MAX"));
                assert!(copied == (scratch != "0" && scratch != "65536") && warned == (scratch == "65536"),
                        "part {part}, NCCL_RS_INPLACE_SCRATCH={scratch}, process {i}: copied {copied}, warned {warned}:\n{}",
                        p.log);
            }
        }
        // One rank copies its input, its peer does not: exact all the same (the all-to-all is
        // staged, by the agreement; the sends of one go direct, of the other as bytes).
        let o = cuda_job().procs(2).arg("--only").arg(part).proc_env(1, "NCCL_RS_INPLACE_SCRATCH", "0").run_outcome();
        assert!(o.ok(), "part {part}, NCCL_RS_INPLACE_SCRATCH=0 on process 1: {}", o.report);
    }
}

/// Collectives on device memory peers cannot read (CUDA_TEST_VMM=private: allocations of the
/// virtual memory API without a shareable handle, as a stream-ordered allocator's pools) go
/// direct all the same: each caller's stream copies its input into device memory of the
/// communicator's, which peers read, and an all-reduce runs in place on that copy, copied out
/// after (part Collectives: every kind out of place, small and large; InPlace: in place).
/// With NCCL_RS_INPLACE_SCRATCH=0 they are staged, and the first says why. Exact either way,
/// on 2 processes and on 4 ranks in 2 processes; also in host-wait mode (the copies out once
/// the batch is done) and with the direct path's work on the worker's stream.
#[test]
fn cuda_mode_collectives_on_memory_peers_cannot_read_go_direct_from_copies() {
    let staged = "is staged through host memory, as are later ones like it";
    let on = "67108864";
    for part in ["Collectives", "InPlace"] {
        for (job, scratch) in [(cuda_job().procs(2), on), (cuda_job().procs(2).local(2), on), (cuda_job().procs(2), "0"),
                               (cuda_job().procs(2).env("NCCL_RS_HOST_WAIT", "1"), on),
                               (cuda_job().procs(2).env("NCCL_RS_DIRECT_ON_STREAM", "0"), on),
                               (cuda_job().procs(2), "65536"), (cuda_job().procs(2), "65536+")] {
            let o = scratch_env(job, scratch).env("CUDA_TEST_VMM", "private").arg("--only").arg(part)
                .env("NCCL_DEBUG", "INFO").env("NCCL_DEBUG_SUBSYS", "P2P").run_outcome();
            assert!(o.ok(), "part {part}, NCCL_RS_INPLACE_SCRATCH={scratch}: {}", o.report);
            for (i, p) in o.procs.iter().enumerate() {
                let (direct, said) = (p.log.contains("are read directly"), p.log.contains(staged));
                // 64 KiB in all holds none of the direct-path sizes (from 100000 floats): each
                // is staged, and the first says at WARN that the scratch is too small. Blocks
                // of 64 KiB grow to each operation's size.
                let fits = scratch == on || scratch == "65536+";
                let warned = p.log.contains("more than NCCL_RS_INPLACE_SCRATCH_MAX (65536 bytes)");
                assert!(direct == fits && said != fits && warned == (scratch == "65536"),
                        "part {part}, NCCL_RS_INPLACE_SCRATCH={scratch}, process {i}: direct {direct}, staged {said}, \
                         warned {warned}:\n{}", p.log);
            }
        }
    }
}

/// PreMulSum goes direct: each caller's stream scales a copy of its input, which peers read
/// (part PreMul: all-reduce out of place and in place, reduce-scatter, reduce), by a
/// host-immediate scalar or by one in device or pinned memory that the stream writes just
/// before the call (copied next to the input, read by the kernel), also mixed across ranks.
/// With NCCL_RS_INPLACE_SCRATCH=0 all are staged; with it 0 on process 1 only, that rank
/// declines each and every rank stages it, from its input as the user left it (not the scaled
/// copy), reading a scalar in memory then. Exact in every case, as processes and as ranks of
/// one process, and on device memory peers cannot map (CUDA_TEST_VMM=private: an all-reduce
/// runs in place on its scaled copy, copied out).
#[test]
fn cuda_mode_premulsum_goes_direct_from_scaled_copies() {
    let on = "67108864";
    for (procs, local, scratch, vmm) in [(2, 1, on, "0"), (3, 1, on, "0"), (1, 2, on, "0"), (2, 1, "0", "0"),
                                         (2, 1, on, "private"), (2, 1, "declining", "0")] {
        let mut job = cuda_job().procs(procs).local(local).arg("--only").arg("PreMul").env("NCCL_DEBUG", "INFO")
            .env("NCCL_DEBUG_SUBSYS", "P2P");
        job = match scratch {
            "declining" => job.proc_env(1, "NCCL_RS_INPLACE_SCRATCH", "0"),
            _ => job.env("NCCL_RS_INPLACE_SCRATCH", scratch),
        };
        if vmm != "0" {
            job = job.env("CUDA_TEST_VMM", vmm);
        }
        let o = job.run_outcome();
        let what = format!("{procs}x{local} ranks, NCCL_RS_INPLACE_SCRATCH={scratch}, CUDA_TEST_VMM={vmm}");
        assert!(o.ok(), "{what}: {}", o.report);
        for (i, p) in o.procs.iter().enumerate() {
            let (direct, staged) = (p.log.contains("are read directly"), p.log.contains("is staged through host memory"));
            assert!(direct == (scratch == on) && staged == (scratch != on), "{what}, process {i}: direct {direct}, \
                     staged {staged}:\n{}", p.log);
        }
    }
}

/// Operations the host issues ahead of the device, each holding a carve of the device scratch
/// until its result is copied out, do not run out of room (part Ahead: six all-reduces of 2
/// MiB of pinned memory behind held streams): with blocks of 8 MiB, more are allocated and
/// every one goes direct; when the blocks may not grow (NCCL_RS_INPLACE_SCRATCH_MAX of one
/// block) the later ones are staged, on every rank alike. Exact either way.
#[test]
fn cuda_mode_operations_issued_ahead_find_room_in_the_scratch() {
    for (most, grows) in [("268435456", true), ("8388608", false)] {
        for job in [cuda_job().procs(2), cuda_job().local(2)] {
            let o = job.arg("--only").arg("Ahead").env("NCCL_RS_INPLACE_SCRATCH", "8388608")
                .env("NCCL_RS_INPLACE_SCRATCH_MAX", most).env("NCCL_DEBUG", "INFO").env("NCCL_DEBUG_SUBSYS", "P2P")
                .run_outcome();
            assert!(o.ok(), "NCCL_RS_INPLACE_SCRATCH_MAX={most}: {}", o.report);
            for (i, p) in o.procs.iter().enumerate() {
                let staged = p.log.contains("is staged through host memory");
                assert_eq!(staged, !grows, "NCCL_RS_INPLACE_SCRATCH_MAX={most}, process {i}:\n{}", p.log);
            }
        }
    }
}

/// A group that fails in a later communicator's part drops the parts already prepared:
/// the device copies one of them had made give their scratch back (part DroppedGroup: else
/// the scratch ring fills behind that carve, and later all-reduces through it are staged).
#[test]
fn cuda_mode_a_dropped_group_gives_its_scratch_back() {
    let o = cuda_job().arg("--only").arg("DroppedGroup").env("NCCL_DEBUG", "INFO").env("NCCL_DEBUG_SUBSYS", "P2P")
        .run_outcome();
    assert!(o.ok(), "{}", o.report);
    let log = &o.procs[0].log;
    assert!(log.contains("are copied on the caller's stream into") && !log.contains("is staged through host memory"),
            "expected every all-reduce to go direct through the scratch:\n{log}");
}

/// Communicators created, used on every path that allocates memory of its own (direct, its
/// device copies of inputs, the pinned pool, pinned sends) and destroyed leave nothing
/// behind: part Leaks compares the stand-in's count of live allocations after each of three
/// rounds; as processes and as ranks of one process.
#[test]
fn cuda_mode_destroyed_communicators_leave_no_memory() {
    if !stand_in_only("cuda_mode_destroyed_communicators_leave_no_memory") {
        return;
    }
    for job in [cuda_job().procs(2), cuda_job().local(2)] {
        let o = job.arg("--only").arg("Leaks").run_outcome();
        assert!(o.ok(), "{}", o.report);
        for (i, p) in o.procs.iter().enumerate() {
            assert!(p.log.contains("leaks: after round 2"), "process {i}: part Leaks did not run:\n{}", p.log);
        }
    }
}

/// Ranks set up differently still agree on every path, since a pair (or the communicator)
/// takes what all its ranks' settings allow: NCCL_P2P_DISABLE=1, NCCL_RS_DIRECT_P2P=0 or a
/// larger NCCL_RS_DIRECT_MIN on process 1 only. Every result is exact, and the point-to-point
/// messages of part P2P (280 KB) go direct only where both ranks allow it (before, one end
/// waited for a record the other never sent, or the two issued different exchanges).
#[test]
fn cuda_mode_ranks_set_up_differently_agree() {
    let p2p_line = "read directly (CUDA IPC / same process), from point-to-point calls";
    for (k, v, p2p_direct) in [("NCCL_P2P_DISABLE", "1", false), ("NCCL_RS_DIRECT_P2P", "0", false),
                               ("NCCL_RS_DIRECT_MIN", "1000000", false), ("NCCL_RS_DIRECT_MIN", "1000", true)] {
        for part in ["P2P", "Collectives"] {
            let o = cuda_job().procs(2).arg("--only").arg(part).proc_env(1, k, v).env("NCCL_DEBUG", "INFO")
                .env("NCCL_DEBUG_SUBSYS", "P2P").timeout_s(60).run_outcome();
            assert!(o.ok(), "part {part}, {k}={v} on process 1:\n{}", o.report);
            for (i, p) in o.procs.iter().enumerate() {
                let (took, expected) = match part {
                    "P2P" => (p.log.contains(p2p_line), p2p_direct),
                    _ => (p.log.contains("are read directly"), k != "NCCL_P2P_DISABLE"),
                };
                assert_eq!(took, expected, "part {part}, {k}={v} on process 1, process {i}: direct = {took}:\n{}", p.log);
            }
        }
    }
}

/// Three processes: two group a large all-reduce with a send/receive between them, the third
/// issues the all-reduce alone; all must take the same path for it. Then with the send and
/// receive issued before the all-reduce in the group: their steps on the stream still come
/// after the all-reduce's (before, the stream waited at the receive's gate while the worker
/// waited for the all-reduce: a hang, found by part Soak).
#[test]
fn cuda_mode_3_processes_group_mix() {
    cuda_job().procs(3).arg("--only").arg("GroupMix").run();
}

/// With the direct path off (NCCL_P2P_DISABLE=1, NCCL_P2P_LEVEL=LOC) every operation is staged
/// through host memory and the host transports, and the results are the same.
#[test]
fn cuda_mode_2_processes_staged() {
    run_expecting_direct(cuda_job().procs(2).env("NCCL_P2P_DISABLE", "1").arg("--quick"), false);
}

#[test]
fn cuda_mode_3_processes_staged_over_sockets() {
    let job = cuda_job().procs(3).env("NCCL_P2P_LEVEL", "LOC").env("NCCL_SHM_DISABLE", "1").arg("--quick");
    run_expecting_direct(job, false);
}

/// PyTorch's way (ffi-tests/cuda.c, part Torch): nonblocking communicators, a split with one
/// rank left out, a watchdog thread, a separate NCCL stream ordered by events.
#[test]
fn cuda_mode_3_processes_torch_like() {
    cuda_job().procs(3).arg("--only").arg("Torch").run();
}

/// Host-wait mode (a call returns once its operation is done), asked for or taken because
/// CUDA_DEVICE_MAX_CONNECTIONS is low (Megatron-LM's 1): every part passes, as processes and
/// as ranks of one process (whose group must be submitted whole before anyone waits). On
/// nonblocking communicators (part HostWaitNonblocking, also on 3 processes, 2 of 2 ranks)
/// calls return ncclInProgress at once instead, even while a peer has yet to make them, and
/// ncclCommAbort ends one a peer never makes.
#[test]
fn cuda_mode_host_wait() {
    for job in [cuda_job().procs(3), cuda_job().procs(2).local(2)] {
        job.env("NCCL_RS_HOST_WAIT", "1").arg("--only").arg("HostWaitNonblocking").run();
    }
    for (k, v) in [("NCCL_RS_HOST_WAIT", "1"), ("CUDA_DEVICE_MAX_CONNECTIONS", "1")] {
        for job in [cuda_job().procs(2).arg("--quick"), cuda_job().local(2).arg("--quick")] {
            let o = job.env(k, v).env("NCCL_DEBUG", "INFO").env("NCCL_DEBUG_SUBSYS", "INIT").run_outcome();
            assert!(o.ok(), "{k}={v}: {}", o.report);
            for p in &o.procs {
                assert!(p.log.contains("wait on the host until done"), "{k}={v}: host-wait mode not taken:\n{}", p.log);
            }
        }
    }
    // Said off, it stays off whatever CUDA_DEVICE_MAX_CONNECTIONS says.
    let o = cuda_job().procs(2).arg("--quick").env("CUDA_DEVICE_MAX_CONNECTIONS", "1").env("NCCL_RS_HOST_WAIT", "0")
        .env("NCCL_DEBUG", "INFO").env("NCCL_DEBUG_SUBSYS", "INIT").run_outcome();
    assert!(o.ok(), "{}", o.report);
    assert!(o.procs.iter().all(|p| !p.log.contains("wait on the host until done")), "{}", o.report);
}

/// Callers' streams held by the polling kernel instead of cuStreamWaitValue32
/// (NCCL_RS_STREAM_GATE=kernel): every part passes, gated streams included.
#[test]
fn cuda_mode_stream_gate_kernel() {
    for job in [cuda_job().procs(2), cuda_job().local(2).arg("--quick")] {
        let o = job.env("NCCL_RS_STREAM_GATE", "kernel").env("NCCL_DEBUG", "INFO").env("NCCL_DEBUG_SUBSYS", "INIT")
            .run_outcome();
        assert!(o.ok(), "{}", o.report);
        for p in &o.procs {
            assert!(p.log.contains("wait for operations with a polling kernel"), "the kernel gate was not taken:\n{}", p.log);
        }
    }
}

/// A rank whose driver refuses the reduction kernels stages every operation, and its peers,
/// which have them, stage with it: the ranks agree on the path, results are exact.
#[test]
fn cuda_mode_a_rank_without_kernels() {
    if !stand_in_only("cuda_mode_a_rank_without_kernels") {
        return;
    }
    let o = cuda_job().procs(2).proc_env(1, "NCCL_RS_STUB_NO_MODULES", "1").arg("--only").arg("Collectives")
        .env("NCCL_DEBUG", "INFO").env("NCCL_DEBUG_SUBSYS", "P2P").run_outcome();
    assert!(o.ok(), "{}", o.report);
    assert!(o.procs[1].log.contains("reduction kernels did not load"), "process 1 had its kernels:\n{}", o.procs[1].log);
    for (i, p) in o.procs.iter().enumerate() {
        assert!(!p.log.contains("are read directly"), "process {i} took the direct path:\n{}", p.log);
        // Agreed once, in the first eligible collective: the rest are staged without asking.
        assert_eq!(p.log.matches("can never read its peers' device buffers").count(), 1, "process {i}:\n{}", p.log);
    }
}

/// NCCL_CHECK_POINTERS=1 refuses what NCCL's check refuses (plain host memory, another
/// device's memory: ncclInvalidArgument, with the reason in ncclGetLastError), and lets the
/// communicator's device memory through. The stand-in has two devices here.
#[test]
fn cuda_mode_check_pointers_refuses_what_nccl_refuses() {
    let o = cuda_job().procs(2).env("NCCL_CHECK_POINTERS", "1").env("NCCL_RS_STUB_DEVICES", "2")
        .arg("--only").arg("CheckPointers").run_outcome();
    assert!(o.ok(), "{}", o.report);
    let stand_in = std::env::var_os("NCCL_TEST_REAL_DRIVER").is_none();
    for (i, p) in o.procs.iter().enumerate() {
        assert!(!stand_in || !p.log.contains("one device, no check"), "process {i} saw one device:\n{}", p.log);
    }
}

/// A rank's sends to itself in a group (an all-to-all as PyTorch issues one), with their
/// receives, are device copies queued on the caller's stream, not staged through host memory:
/// exact (part P2P's all-to-all checks every value), and said at TRACE.
#[test]
fn cuda_mode_sends_to_self_are_copies_on_the_stream() {
    let o = cuda_job().procs(2).arg("--only").arg("P2P").env("NCCL_DEBUG", "TRACE").env("NCCL_DEBUG_SUBSYS", "P2P")
        .run_outcome();
    assert!(o.ok(), "{}", o.report);
    for (i, p) in o.procs.iter().enumerate() {
        assert!(p.log.contains("send(s) to itself copied on the caller's stream"), "process {i}:\n{}", p.log);
    }
}

/// Ranks on two hosts (one NCCL_HOSTID each, the processes of this machine): every part of
/// the CUDA-mode program runs with the pair's data staged through host memory and a TCP
/// connection (the network transport), never read directly, and exact. (Parts PeerPointers
/// and RmaErrors expect the peers of one host: peer pointers, puts past a window refused at
/// the call; `rma.c` checks what other hosts get, NULL and the target's error.)
#[test]
fn cuda_mode_ranks_on_two_hosts_stage_through_sockets() {
    let o = cuda_job().procs(2).proc_env(0, "NCCL_HOSTID", "host-a").proc_env(1, "NCCL_HOSTID", "host-b")
        .env("CUDA_TEST_SKIP", "PeerPointers,RmaErrors").env("NCCL_DEBUG", "INFO").env("NCCL_DEBUG_SUBSYS", "INIT,P2P")
        .run_outcome();
    assert!(o.ok(), "{}", o.report);
    for (i, p) in o.procs.iter().enumerate() {
        let peer = 1 - i;
        assert!(p.log.contains(&format!("rank {i} -> rank {peer} via Socket")), "process {i}: not over TCP:\n{}", p.log);
        assert!(!p.log.contains("are read directly"), "process {i} read a peer on another host directly:\n{}", p.log);
    }
}

/// Part Soak: a seeded random sequence of calls (every collective, sends and receives around
/// the ring, in place or not, some two to a group, on two streams per rank ordered by events,
/// counts from 1 element to 1 MiB; reductions on every integer type with every op, avg and
/// PreMulSum included, the other calls on every type), issued back to back with nothing synchronised between
/// them, every buffer of every rank compared with a host model of all ranks after every 12
/// calls (ffi-tests/cuda.c says more). As 2 processes, 2 processes of 2 ranks (ranks of one
/// process too), 3 processes with buffers of the virtual memory API, 3 processes staging
/// everything (NCCL_P2P_DISABLE=1), 3 processes in host-wait mode, and 3 processes capturing
/// steps into CUDA graphs (NCCL_RS_GRAPH_CAPTURE=1) launched once or twice, and 2 processes
/// of 2 ranks on a device that lags the host (NCCL_RS_STUB_OP_DELAY_US); a different seed
/// each. Puts into windows over the buffers are among the calls. (To hunt with more:
/// `NCCL_TEST_SOAK_SEEDS=1-50`, each job with each seed; `CUDA_TEST_SOAK_EVERY=1` compares
/// after every call, to name the one that went wrong.)
#[test]
fn cuda_mode_random_call_sequences_match_a_host_model() {
    let jobs = [("1 rank", 7), ("2 processes", 1), ("2 processes x 2 ranks", 2), ("3 processes, virtual memory API", 3),
                ("3 processes, staged", 4), ("3 processes, host-wait", 15), ("3 processes, graphs", 6),
                ("2 processes x 2 ranks, lagging device", 8)];
    let hunt = std::env::var("NCCL_TEST_SOAK_SEEDS").ok().and_then(|v| {
        let (a, b) = v.split_once('-')?;
        Some(a.parse::<u32>().ok()?..=b.parse::<u32>().ok()?)
    });
    for (what, seed) in jobs {
        for seed in hunt.clone().unwrap_or(seed..=seed) {
            let job = match what {
                // (Every collective a copy or the scaling kernel on the caller's stream: `streamed::alone`.)
                "1 rank" => cuda_job(),
                "2 processes" => cuda_job().procs(2),
                "2 processes x 2 ranks" => cuda_job().procs(2).local(2),
                "3 processes, virtual memory API" => cuda_job().procs(3).env("CUDA_TEST_VMM", "1"),
                // (Seed 15's puts found a group's waits skipped: with the bug back, 3 runs of this job in 4 fail.)
                "3 processes, host-wait" => cuda_job().procs(3).env("NCCL_RS_HOST_WAIT", "1").env("CUDA_TEST_SOAK_STEPS", "400"),
                // Steps on one stream captured into CUDA graphs and launched once or twice.
                "3 processes, graphs" => cuda_job().procs(3).env("CUDA_TEST_SOAK_GRAPH", "1").env("NCCL_RS_GRAPH_CAPTURE", "1"),
                // Each stream operation of the stand-in waits 0-500 µs first: the device far behind the
                // host, as a GPU's is, and each stream at its own pace.
                "2 processes x 2 ranks, lagging device" => {
                    let lagging = cuda_job().procs(2).local(2).env("NCCL_RS_STUB_OP_DELAY_US", "500");
                    lagging.env("CUDA_TEST_SOAK_STEPS", "200")
                }
                _ => cuda_job().procs(3).env("NCCL_P2P_DISABLE", "1"),
            };
            let o = job.arg("--only").arg("Soak").env("CUDA_TEST_SEED", &seed.to_string()).run_outcome();
            assert!(o.ok(), "{what} (CUDA_TEST_SEED={seed}): {}", o.report);
            for (i, p) in o.procs.iter().enumerate() {
                assert!(p.log.contains("calls checked against the model"), "{what}, process {i}: the soak did not run \
                                                                          whole:\n{}", p.log);
            }
        }
    }
}

/// Part Soak with a rank 1.2 s late at one step in six (CUDA_TEST_SOAK_STALL=1; see the host
/// version, `ffi::random_calls_with_a_late_rank_are_never_taken_for_mismatched`): the ranks
/// waiting on it ask what it and the ranks it waits on run, on the direct path and staged;
/// nothing they find may fail a valid call, and every result stays exact. Before, seed 4 staged
/// failed every time: a rank behind on a finished broadcast taken for a mismatch failed an
/// all-reduce, and its stream went on past it ("1 wrong bytes").
#[test]
fn cuda_mode_random_calls_with_a_late_rank_are_never_taken_for_mismatched() {
    for (procs, seed, staged) in [(3, 4, "1"), (3, 4, "0")] {
        let o = cuda_job().procs(procs).env("NCCL_P2P_DISABLE", staged).arg("--only").arg("Soak")
            .env("CUDA_TEST_SEED", &seed.to_string()).env("CUDA_TEST_SOAK_STEPS", "40").env("CUDA_TEST_SOAK_STALL", "1")
            .run_outcome();
        assert!(o.ok(), "CUDA_TEST_SEED={seed}, NCCL_P2P_DISABLE={staged}: {}", o.report);
        assert!(o.procs.iter().any(|p| p.log.contains("is late by 1.2 s")), "no rank was late:\n{}", o.report);
        for (i, p) in o.procs.iter().enumerate() {
            assert!(p.log.contains("calls checked against the model"), "process {i}: the soak did not run whole:\n{}", p.log);
        }
    }
}

/// Three processes, two on one host and one on another: a rank's sends and receives with its
/// host's peer go direct while those with the other host's go through TCP, in the same
/// batches (rings: a rank sends to one kind of peer and receives from the other). The worker
/// runs the latter on one thread kept for them, started once, not one per call; exact.
#[test]
fn cuda_mode_direct_and_cross_host_sends_in_one_batch() {
    let o = cuda_job().procs(3).proc_env(0, "NCCL_HOSTID", "host-a").proc_env(1, "NCCL_HOSTID", "host-a")
        .proc_env(2, "NCCL_HOSTID", "host-b").arg("--only").arg("P2P").env("NCCL_DEBUG", "INFO")
        .env("NCCL_DEBUG_SUBSYS", "INIT,P2P").run_outcome();
    assert!(o.ok(), "{}", o.report);
    for (i, p) in o.procs.iter().enumerate().take(2) {
        assert!(p.log.contains(&format!("rank {i} -> rank 2 via Socket")), "process {i}: not over TCP:\n{}", p.log);
        let kept = p.log.matches("run beside direct ones, on a thread kept for them").count();
        assert_eq!(kept, 1, "process {i}: staging threads started {kept} times:\n{}", p.log);
    }
}

/// A driver whose compiler refuses the PTX's sm_70 target (as CUDA 13's toolkit compilers
/// dropped Volta) loads the same kernels compiled for the newest target the GPU runs (the
/// stand-in's is 9.0), and collectives go direct as usual; one that refuses that target too
/// stages, and its warning carries what the compiler logged.
#[test]
fn cuda_mode_kernels_load_when_the_jit_refuses_sm_70() {
    if !stand_in_only("cuda_mode_kernels_load_when_the_jit_refuses_sm_70") {
        return;
    }
    let o = cuda_job().procs(2).env("NCCL_RS_STUB_PTX_TARGET_MIN", "75").arg("--only").arg("Collectives")
        .env("NCCL_DEBUG", "INFO").env("NCCL_DEBUG_SUBSYS", "INIT,P2P").run_outcome();
    assert!(o.ok(), "{}", o.report);
    for (i, p) in o.procs.iter().enumerate() {
        assert!(p.log.contains("they did for sm_90 (this GPU: compute capability 9.0)"), "process {i}:\n{}", p.log);
        assert!(p.log.contains("are read directly"), "process {i} staged:\n{}", p.log);
        assert!(!p.log.contains("reduction kernels did not load ("), "process {i}:\n{}", p.log);
    }
    let o = cuda_job().procs(2).proc_env(1, "NCCL_RS_STUB_PTX_TARGET_MIN", "100").arg("--only").arg("Collectives")
        .env("NCCL_DEBUG", "WARN").run_outcome();
    assert!(o.ok(), "{}", o.report);
    assert!(o.procs[1].log.contains("Value 'sm_70' is not defined for option 'gpu-name'; for sm_90: \
                                     cuModuleLoadDataEx(kernels/reduce.ptx): CUDA_ERROR_INVALID_PTX: ptxas fatal"),
            "process 1's warning does not carry the compiler's log:\n{}", o.procs[1].log);
}

/// While callers' streams may be waiting for it, the stream worker needs no device call for
/// operations that go direct or that the callers' streams stage (stream starts are signalled
/// through the board, direct kernels are queued by the caller): the stand-in reports any call
/// made from a worker thread (NCCL_RS_STUB_REPORT_WORKER_CALLS); for collectives and for sends
/// and receives. With the direct path on the worker's stream (NCCL_RS_DIRECT_ON_STREAM=0) it
/// does report them: the check can fail. Part Mixed without the device scratch: buffers in
/// pinned host memory (a send's bytes, an all-reduce's output) the worker uses where they are.
#[test]
fn cuda_mode_worker_makes_no_device_calls() {
    if !stand_in_only("cuda_mode_worker_makes_no_device_calls") {
        return;
    }
    let runs = [("Collectives", "67108864", "1", true), ("Collectives", "67108864", "0", false),
                ("P2P", "67108864", "1", true), ("P2P", "67108864", "0", false), ("Mixed", "0", "1", true)];
    for (part, scratch, on_stream, quiet) in runs {
        let o = cuda_job().procs(2).arg("--only").arg(part).env("NCCL_RS_STUB_REPORT_WORKER_CALLS", "1")
            .env("NCCL_RS_DIRECT_ON_STREAM", on_stream).env("NCCL_DEBUG", "INFO").env("NCCL_DEBUG_SUBSYS", "P2P")
            .env("NCCL_RS_INPLACE_SCRATCH", scratch).run_outcome();
        assert!(o.ok(), "{}", o.report);
        for (i, p) in o.procs.iter().enumerate() {
            let direct = part != "Mixed"; // (its sends and receives, in host memory or not)
            assert!(!direct || p.log.contains("are read directly"), "part {part}, process {i}: not direct:\n{}", p.log);
            let calls: Vec<&str> = p.log.lines().filter(|l| l.contains("from the stream worker")).collect();
            assert_eq!(calls.is_empty(), quiet, "part {part}, NCCL_RS_DIRECT_ON_STREAM={on_stream}, process {i}: {:?}",
                       &calls[..calls.len().min(5)]);
        }
    }
}

/// What one call costs its caller's thread in driver calls, once warm (the stand-in counts
/// each thread's calls; part Calls): 2 processes, all-reduces below and above the direct path's
/// threshold, a send/receive pair each way. The ceilings are what it takes now — the caller's
/// context and capture mode kept once per call (nested scopes free, no `cuCtxSetCurrent` to a
/// context already current), an allocation's CUDA IPC handle asked once per buffer id; before
/// those, 19, 41, 19 and 32 calls. On a GPU each costs from tens of nanoseconds (thread state)
/// to microseconds (stream work, IPC handles).
#[test]
fn cuda_mode_calls_make_few_driver_calls() {
    if !stand_in_only("cuda_mode_calls_make_few_driver_calls") {
        return;
    }
    let o = cuda_job().procs(2).arg("--only").arg("Calls").run_outcome();
    assert!(o.ok(), "{}", o.report);
    let ceilings = [("all-reduce of 1000 floats", 12), ("all-reduce of 300000 floats", 17),
                    ("send/receive of 1000 floats", 12), ("send/receive of 300000 floats", 14)];
    for (i, p) in o.procs.iter().enumerate() {
        for (what, most) in ceilings {
            let used: u64 = p.log.lines().find_map(|l| l.split(&format!("calls: {what}: ")).nth(1))
                .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
                .unwrap_or_else(|| panic!("process {i}: no count for {what}:\n{}", p.log));
            assert!(used <= most, "process {i}: {what} made {used} driver calls on the calling thread (at most {most} \
                                   expected); run part Calls with CUDA_TEST_TRACE_CALLS=1 to see them:\n{}", p.log);
        }
    }
}

/// NCCL_RS_POOL_MAX bounds the pinned staging pool: with everything staged (NCCL_P2P_DISABLE=1)
/// and the pool at its floor (4 MiB), the full run's largest all-to-all no longer fits and the
/// worker stages it on its own stream (the stand-in reports its device calls); results stay
/// exact. By default (64 MiB) the pool grows instead and the worker makes no device call in
/// the whole run.
#[test]
fn cuda_mode_pool_max() {
    if !stand_in_only("cuda_mode_pool_max") {
        return;
    }
    for (max, worker_calls) in [("4194304", true), ("", false)] {
        let mut job = cuda_job().procs(2).env("NCCL_RS_STUB_REPORT_WORKER_CALLS", "1").env("NCCL_P2P_DISABLE", "1")
            .env("NCCL_DEBUG", "INFO").env("NCCL_DEBUG_SUBSYS", "P2P");
        if !max.is_empty() {
            job = job.env("NCCL_RS_POOL_MAX", max);
        }
        let o = job.run_outcome();
        assert!(o.ok(), "NCCL_RS_POOL_MAX={max}: {}", o.report);
        for (i, p) in o.procs.iter().enumerate() {
            assert_eq!(p.log.contains("from the stream worker"), worker_calls, "NCCL_RS_POOL_MAX={max}, process {i}");
            assert_eq!(p.log.contains("pool grown"), !worker_calls, "NCCL_RS_POOL_MAX={max}, process {i}");
        }
    }
}

/// 600 direct all-reduces queued behind a held stream, more than a communicator's 512 slots:
/// the rest run on the worker's stream, in issue order with the others; exact results (each
/// call's input is uploaded into the same buffer just before it). As processes and as ranks
/// of one process.
#[test]
fn cuda_mode_backlog_past_the_slots() {
    for job in [cuda_job().procs(2), cuda_job().local(2)] {
        let o = job.arg("--only").arg("Backlog").env("NCCL_DEBUG", "INFO").env("NCCL_DEBUG_SUBSYS", "P2P").run_outcome();
        assert!(o.ok(), "{}", o.report);
        for (i, p) in o.procs.iter().enumerate() {
            assert!(p.log.contains("no free slot"), "process {i} never ran out of slots:\n{}", p.log);
            assert!(p.log.contains("on the caller's stream"), "process {i}:\n{}", p.log);
        }
    }
}

/// A rank whose driver cannot map its peer's device memory (GPUs without peer access: the
/// stand-in's NCCL_RS_STUB_NO_PEER_ACCESS) makes every rank stage, from the first eligible
/// collective on, without trying again; results exact.
#[test]
fn cuda_mode_no_peer_access() {
    if !stand_in_only("cuda_mode_no_peer_access") {
        return;
    }
    let o = cuda_job().procs(2).proc_env(1, "NCCL_RS_STUB_NO_PEER_ACCESS", "1").arg("--only").arg("Collectives")
        .env("NCCL_DEBUG", "INFO").env("NCCL_DEBUG_SUBSYS", "P2P").run_outcome();
    assert!(o.ok(), "{}", o.report);
    assert_eq!(o.procs[1].log.matches("cannot map rank 0's buffers").count(), 1, "{}", o.procs[1].log);
    assert!(o.procs[1].log.contains("CUDA_ERROR_PEER_ACCESS_UNSUPPORTED"), "{}", o.procs[1].log);
    for (i, p) in o.procs.iter().enumerate() {
        assert!(!p.log.contains("are read directly"), "process {i} took the direct path:\n{}", p.log);
        assert_eq!(p.log.matches("can never read its peers' device buffers").count(), 1, "process {i}:\n{}", p.log);
    }
}

/// NCCL_RS_PEER_MAPS=0: peers' allocations (CUDA IPC and the virtual memory API) are mapped
/// for each operation and closed after it, never held past it; results exact, still direct.
#[test]
fn cuda_mode_peer_mappings_closed_after_each_operation() {
    for vmm in ["0", "1"] {
        let job = cuda_job().procs(2).arg("--only").arg("Collectives").env("NCCL_RS_PEER_MAPS", "0");
        let job = if vmm == "1" { job.env("CUDA_TEST_VMM", "1") } else { job };
        let o = job.env("NCCL_DEBUG", "TRACE").env("NCCL_DEBUG_SUBSYS", "P2P").run_outcome();
        assert!(o.ok(), "CUDA_TEST_VMM={vmm}: {}", o.report);
        for (i, p) in o.procs.iter().enumerate() {
            assert_eq!(p.log.matches("are read directly").count(), 1, "CUDA_TEST_VMM={vmm}, process {i}:\n{}", p.log);
            // Every operation's mappings are closed before the next maps anything, the last's too.
            let (mut open, mut maps) = (false, 0);
            for line in p.log.lines() {
                if line.contains("bytes of pid") {
                    (open, maps) = (true, maps + 1);
                } else if line.contains("closed the peer mappings of the operation") {
                    assert!(open, "closed with nothing mapped, process {i}:\n{}", p.log);
                    open = false;
                }
            }
            assert!(maps >= 10 && !open, "CUDA_TEST_VMM={vmm}, process {i}: {maps} mapped, open {open}:\n{}", p.log);
            assert!(!p.log.contains("a new one is there"), "nothing left to replace, process {i}:\n{}", p.log);
        }
    }
}

/// A driver whose `cuIpcCloseMemHandle` and `cuMemUnmap` wait for the device to go idle (the
/// stand-in's NCCL_RS_STUB_FREE_SYNCS; CUDA says frees "may" synchronize): the stream worker
/// closes no peer mapping itself, since a caller's stream may be waiting for that very worker
/// (the process's closing thread does it, `cuda::OffThread`). Operations that map and close
/// every time (NCCL_RS_PEER_MAPS=0), over CUDA IPC and the virtual memory API, then finish
/// exact, and so does ncclCommSuspend. Before, the stand-in aborted such a run after 20 s in
/// the worker's first close.
#[test]
fn cuda_mode_peer_mappings_close_off_the_worker() {
    let runs = [("Collectives", "IPC"), ("Collectives", "VMM"), ("P2P", "IPC"), ("Suspend", "IPC")];
    for (part, kind) in runs {
        let job = cuda_job().procs(2).arg("--only").arg(part).env("NCCL_RS_STUB_FREE_SYNCS", "1")
            .env("NCCL_RS_STUB_REPORT_WORKER_CALLS", "1").env("CUDA_TEST_VMM", if kind == "VMM" { "1" } else { "0" });
        let job = if part == "Suspend" { job } else { job.env("NCCL_RS_PEER_MAPS", "0") };
        let o = job.env("NCCL_DEBUG", "TRACE").env("NCCL_DEBUG_SUBSYS", "P2P").run_outcome();
        assert!(o.ok(), "part {part} over {kind}: {}", o.report);
        for (i, p) in o.procs.iter().enumerate() {
            let closes = p.log.lines().filter(|l| l.contains("closed the peer mappings of the operation")).count();
            assert!(part == "Suspend" || closes >= 5, "part {part} over {kind}, process {i}: {closes} closes:\n{}", p.log);
            let by_worker: Vec<&str> = p.log.lines()
                .filter(|l| l.contains("from the stream worker") && (l.contains("Close") || l.contains("Unmap"))).collect();
            assert!(by_worker.is_empty(), "part {part} over {kind}, process {i}: {:?}", &by_worker[..by_worker.len().min(5)]);
        }
    }
}

/// ncclCommSuspend(NCCL_SUSPEND_MEM) closes the peer mappings the direct path keeps, which
/// hold the peers' device memory alive after they free it (CUDA IPC, and allocations of the
/// virtual memory API; processes of 2 ranks each too): ncclCommMemStats counts that memory as
/// suspendable, the stand-in's count of open peer memory falls to 0, a call while suspended is
/// refused, and after ncclCommResume the direct path maps anew, exact. Staged (no peer access
/// asked for), nothing is mapped and suspending still works. The device scratch an all-reduce
/// into pinned memory ran through counts as suspendable too, and is freed. Against the real
/// driver the program reports how much device memory came back.
#[test]
fn cuda_mode_suspend_releases_peer_memory() {
    let jobs = [("IPC", cuda_job().procs(2)), ("VMM", cuda_job().procs(2).env("CUDA_TEST_VMM", "1")),
                ("2 processes of 2 ranks", cuda_job().procs(2).local(2)),
                ("staged", cuda_job().procs(2).env("NCCL_P2P_DISABLE", "1"))];
    for (what, job) in jobs {
        let o = job.arg("--only").arg("Suspend").env("NCCL_DEBUG", "INFO").env("NCCL_DEBUG_SUBSYS", "INIT").run_outcome();
        assert!(o.ok(), "{what}: {}", o.report);
        for (i, p) in o.procs.iter().enumerate() {
            let closed = p.log.lines().filter(|l| l.contains("ncclCommSuspend: closed")).count();
            assert!(closed >= 1, "{what}, process {i}: the worker did not release its memory:\n{}", p.log);
            // Its all-reduce into pinned memory ran on a copy in the device scratch, freed too.
            let freed = p.log.contains("ncclCommSuspend: freed");
            assert_eq!(freed, what != "staged", "{what}, process {i}: device scratch freed {freed}:\n{}", p.log);
            if what != "staged" && std::env::var_os("NCCL_TEST_REAL_DRIVER").is_none() {
                assert!(p.log.contains("suspend: ") && p.log.contains(", 0 after"), "{what}, process {i}:\n{}", p.log);
            }
            println!("{what}, process {i}: {}", p.log.lines().filter(|l| l.contains("suspend: ")).collect::<Vec<_>>().join(" | "));
        }
    }
}

/// A rank whose CUDA stream has not reached a call (held by earlier work) is named as such:
/// the rank waiting on it says it issued the call but its stream has not reached it (not that
/// it never made the call), and the held rank says so of itself; released, both are exact.
#[test]
fn cuda_mode_a_stream_behind_its_call_is_named() {
    let mut job = cuda_job().procs(2).env("NCCL_DEBUG", "WARN");
    let dir = job.dir();
    let release = dir.join("release");
    let (held_log, file) = (dir.join("proc1.log"), release.clone());
    let job = job.env("CUDA_TEST_STREAM_HELD", release.to_str().expect("a path")).on(
        When::marker(0, "waits for its CUDA stream"),
        move || {
            // The held rank's own line too (after 10 s), then release its stream.
            let until = std::time::Instant::now() + std::time::Duration::from_secs(40);
            while !std::fs::read_to_string(&held_log).unwrap_or_default().contains("its CUDA stream has not reached")
                && std::time::Instant::now() < until
            {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            std::fs::write(&file, b"go").expect("the release file");
            "released process 1's stream".to_string()
        },
    );
    let o = job.run_outcome();
    assert!(o.ok(), "{}", o.report);
    let (waiting, held) = (&o.procs[0].log, &o.procs[1].log);
    assert!(waiting.contains("for rank 1") && waiting.contains("which issued AllReduce #1 (count 1024, float, sum) and \
                              waits for its CUDA stream to get through it"), "rank 0:\n{waiting}");
    assert!(!waiting.contains("has not issued that call"), "rank 0 blamed a missing call:\n{waiting}");
    assert!(held.contains("rank 1: AllReduce #1 (count 1024, float, sum): its CUDA stream has not reached the call in 10"),
            "rank 1:\n{held}");
}

/// A driver that cannot capture stream memory operations or host functions, or cannot create
/// user objects: the captured call fails with ncclUnhandledCudaError naming the driver call,
/// alike on every rank; what the capture still gives launches without a hang and leaves the
/// user's buffer alone; the communicators stay usable (part GraphRefused).
#[test]
fn cuda_mode_graph_capture_refused_by_the_driver() {
    if !stand_in_only("cuda_mode_graph_capture_refused_by_the_driver") {
        return;
    }
    for (refuses, call) in [("memops", "cuStreamWriteValue32_v2"), ("hostfunc", "cuLaunchHostFunc"),
                            ("userobject", "cuUserObjectCreate")] {
        for job in [cuda_job().procs(2), cuda_job().local(2)] {
            let o = job.arg("--only").arg("GraphRefused").env("NCCL_RS_GRAPH_CAPTURE", "1")
                .env("NCCL_RS_STUB_CAPTURE_REFUSES", refuses).env("CUDA_TEST_EXPECT_CALL", call).run_outcome();
            assert!(o.ok(), "{refuses}: {}", o.report);
        }
    }
}

/// A direct send whose receiver has not issued the receive names that rank at WARN, after about
/// a second as collectives do, with the call it waits in; released, the bytes arrive exact.
#[test]
fn cuda_mode_a_rank_late_for_a_direct_send_is_named() {
    let job = cuda_job().procs(2).env("NCCL_DEBUG", "WARN");
    let o = released_on_marker(job, "CUDA_TEST_P2P_LATE", 0, "which has not issued that call");
    assert!(o.ok(), "{}", o.report);
    let waiting = &o.procs[0].log;
    let line = waiting.lines().find(|l| l.contains("NCCL WARN") && l.contains("which has not issued that call"));
    assert!(line.is_some_and(|l| l.contains("Send #0 (count 70000, float, peer 1)") && l.contains("for rank 1")),
            "rank 0:\n{waiting}");
}

/// A rank that destroyed its communicator after init, before making the matching call, while
/// its process goes on: the direct receive waiting for it fails with ncclRemoteError saying so
/// and its stream goes on (before: held for ever, a WARN every 10 s naming nothing but the
/// call). The staged path's first connection: `faults::rank_that_destroyed_its_communicator_*`.
#[test]
fn cuda_mode_a_rank_that_destroyed_its_communicator_is_named() {
    cuda_job().procs(2).env("CUDA_TEST_CLOSED_EARLY", "1").timeout_s(60).run();
}

/// A graph launch that waits for a rank which has not launched its graph yet names that rank
/// and says so (not that its stream is behind, nor that the call is missing); released, both
/// launches are exact.
#[test]
fn cuda_mode_a_rank_behind_its_graph_launch_is_named() {
    let job = cuda_job().procs(2).env("NCCL_DEBUG", "WARN").env("NCCL_RS_GRAPH_CAPTURE", "1");
    let o = released_on_marker(job, "CUDA_TEST_GRAPH_HELD", 0, "has not got to that launch");
    assert!(o.ok(), "{}", o.report);
    let waiting = &o.procs[0].log;
    assert!(waiting.contains("AllReduce #0 (CUDA graph launch 2)") && waiting.contains("for rank 1")
            && waiting.contains("which has not got to that launch of its CUDA graph"), "rank 0:\n{waiting}");
}

/// While the application captures a graph on another stream in global mode (torch.cuda.graph's
/// default), collectives outside the capture run, exact, and the capture survives: neither
/// nccl-rs's calls nor its threads make the calls such a capture forbids (the stand-in enforces
/// CUDA's rules). Processes, whose workers map each other's buffers; ranks of one process;
/// host-wait mode, where the worker waits on events; and processes without peer access, whose
/// puts into each other's windows (made during the capture too) the target's own thread
/// copies in, which a global capture elsewhere once refused ("a put from rank 1: cuMemcpyAsync:
/// CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", found by the soak with graphs).
#[test]
fn cuda_mode_collectives_beside_a_graph_capture() {
    let jobs = [cuda_job().procs(2), cuda_job().local(2), cuda_job().procs(2).env("NCCL_RS_HOST_WAIT", "1"),
                cuda_job().procs(2).env("NCCL_P2P_DISABLE", "1")];
    for job in jobs {
        let o = job.arg("--only").arg("CaptureElsewhere").run_outcome();
        assert!(o.ok(), "{}", o.report);
        for (i, p) in o.procs.iter().enumerate() {
            assert!(!p.log.contains("during a graph capture"), "process {i} made a call the capture forbids:\n{}", p.log);
        }
    }
}

/// With NCCL_RS_GRAPH_CAPTURE=1, collectives and sends/receives issued on capturing streams
/// are recorded into the graphs: each of three launches, with new inputs and device scalars,
/// behind a held stream and ahead of an ordinary all-reduce issued after it on the same stream,
/// gives exact results (part Graph); what a graph cannot hold is refused with a message; a graph
/// launched after its communicator was destroyed lets its stream go on, with a warning; no
/// driver call is made from a host node or a user object's destructor. One rank, processes,
/// ranks of one process.
///
/// (Ranks of one process in one graph with one hardware queue are left out: a launch's wait
/// for one rank's operations can hold the queue ahead of the other rank's host node.)
#[test]
fn cuda_mode_graph_capture() {
    // Also in host-wait mode, and with one hardware queue for every stream (Megatron-LM's
    // CUDA_DEVICE_MAX_CONNECTIONS=1, modelled by the stand-in): a launch waits on the device
    // for host work only.
    let one_queue = |job: Job| job.env("NCCL_RS_STUB_CONNECTIONS", "1").env("CUDA_DEVICE_MAX_CONNECTIONS", "1");
    let jobs = [cuda_job(), cuda_job().procs(2), cuda_job().local(2), cuda_job().procs(3),
                cuda_job().procs(2).env("NCCL_RS_HOST_WAIT", "1"), one_queue(cuda_job().procs(2))];
    for job in jobs {
        let o = job.arg("--only").arg("Graph").env("NCCL_RS_GRAPH_CAPTURE", "1").env("NCCL_DEBUG", "WARN").run_outcome();
        assert!(o.ok(), "{}", o.report);
        for (i, p) in o.procs.iter().enumerate() {
            assert!(p.log.contains("after its communicator was destroyed"),
                    "process {i}: no warning for the graph launched after its communicator:\n{}", p.log);
            // The stand-in refuses, and says so, any driver call from a host node or a user
            // object's destructor (CUDA forbids them there).
            assert!(!p.log.contains("from a host function"), "process {i} called the driver from a graph:\n{}", p.log);
        }
    }
}

/// A device buffer with a pageable receive buffer is staged, exact, by one rank and by ranks of
/// one process (which publish buffers by address, and must still leave host memory out).
#[test]
fn cuda_mode_pageable_output_is_staged() {
    for job in [cuda_job(), cuda_job().local(2), cuda_job().procs(2)] {
        run_expecting_direct(job.arg("--only").arg("Pageable"), false);
    }
}

/// Device buffers of the virtual memory API, placed as PyTorch's expandable segments place
/// them (CUDA_TEST_VMM=1: 2 MiB allocations mapped side by side, buffers inside and across
/// them, all unmapped and replaced at the same addresses whenever a part has freed its
/// buffers): CUDA IPC cannot share them, their allocations' descriptors can, and every part
/// runs on them with the collectives read directly, exact. Ranks of one process read them by
/// address.
#[test]
fn cuda_mode_vmm_buffers_go_direct() {
    run_expecting_direct(cuda_job().procs(2).env("CUDA_TEST_VMM", "1"), true);
    run_expecting_direct(cuda_job().local(2).env("CUDA_TEST_VMM", "1").arg("--quick"), true);
}

/// Processes that refuse ptrace access to each other (as under Yama's ptrace_scope=1, the
/// default of Ubuntu hosts and so of their containers) still pass the descriptors of
/// virtual-memory allocations (over a Unix socket, not pidfd_getfd): the direct path.
#[test]
fn cuda_mode_vmm_buffers_go_direct_without_ptrace() {
    let job = cuda_job().procs(2).env("CUDA_TEST_VMM", "1").env("CUDA_TEST_NO_PTRACE", "1").arg("--only")
        .arg("Collectives");
    run_expecting_direct(job, true);
}

/// Ranks of one host in network namespaces of their own (containers of one NCCL_HOSTID, say):
/// the Unix socket that passes the descriptors does not reach across namespaces, so
/// collectives on virtual-memory allocations are staged, exact, and a warning says why.
#[test]
fn cuda_mode_vmm_across_network_namespaces_is_staged() {
    if skip_netns() {
        return;
    }
    let hosts = Hosts::up("vmm", 2, &[]);
    let mut job = cuda_job().procs(2).env("CUDA_TEST_VMM", "1").env("NCCL_HOSTID", "one-box").arg("--only")
        .arg("Collectives");
    for p in 0..2 {
        job = job.wrap(p, &hosts.wrapper(p)).proc_env(p, "NCCL_SOCKET_IFNAME", &hosts.ifname(p));
    }
    let o = job.env("NCCL_DEBUG", "INFO").env("NCCL_DEBUG_SUBSYS", "P2P").run_outcome();
    assert!(o.ok(), "{}", o.report);
    for (i, p) in o.procs.iter().enumerate() {
        assert!(!p.log.contains("are read directly"), "process {i} took the direct path:\n{}", p.log);
        assert_eq!(p.log.matches("collectives on it are staged").count(), 1, "said once, process {i}:\n{}", p.log);
        assert!(p.log.contains("Connection refused") && p.log.contains("must share a network namespace"),
                "process {i}:\n{}", p.log);
    }
}

/// 300 all-reduces, each on freshly allocated device memory, read directly: 270 kept
/// allocated (peers' mappings past the number kept are evicted), then freed after each call
/// (mappings replaced when an address is reused); results exact.
#[test]
fn cuda_mode_buffer_churn() {
    let o = cuda_job().procs(2).arg("--only").arg("Churn").env("NCCL_DEBUG", "TRACE").env("NCCL_DEBUG_SUBSYS", "P2P")
        .run_outcome();
    assert!(o.ok(), "{}", o.report);
    for (i, p) in o.procs.iter().enumerate() {
        assert!(p.log.contains("are read directly"), "process {i} did not take the direct path:\n{}", p.log);
        // 270 live allocations of the peer: more than a worker keeps mapped.
        assert!(p.log.contains("closed the least recently used"), "process {i} never evicted a mapping:\n{}", p.log);
        println!("process {i}: {} mappings replaced at a reused address",
                 p.log.matches("a new one is there").count());
    }
}

/// One hardware queue for all streams (the stand-in's model of CUDA_DEVICE_MAX_CONNECTIONS=1,
/// NCCL_RS_STUB_CONNECTIONS=1):
/// - host-wait mode, which that setting selects, passes every part;
/// - with host-wait off and every operation staged (NCCL_P2P_DISABLE=1), the callers' streams
///   stage them through the pinned pool at call time and the worker issues no device work:
///   every part passes, with both gates (the pool grows for the largest all-to-all);
/// - with host-wait off and the direct path, its kernels queued on the callers' streams at call
///   time (the default), every part passes too, with both gates, one-sided puts written
///   directly by the callers' streams included; staged ones only with the kernel gate (with
///   the memop gate the target's copy into its window hangs behind a wait of its stream for
///   that put, if the wait comes first);
/// - but with the direct path's device work on the worker's stream (NCCL_RS_DIRECT_ON_STREAM=0),
///   a caller's stream waiting for the worker holds up the worker's own copies queued behind
///   it, and the job never finishes.
#[test]
fn cuda_mode_one_hardware_queue() {
    if !stand_in_only("cuda_mode_one_hardware_queue") {
        return;
    }
    let one_queue = |job: Job| job.env("NCCL_RS_STUB_CONNECTIONS", "1").env("CUDA_DEVICE_MAX_CONNECTIONS", "1");
    for job in [cuda_job().procs(2).arg("--quick"), cuda_job().local(2).arg("--quick")] {
        let o = one_queue(job).run_outcome();
        assert!(o.ok(), "host-wait mode with one hardware queue: {}", o.report);
    }
    // With the memop gate, staged one-sided puts are left out below: the target's copy into
    // the window is device work of a host thread, which on a GPU can sit behind the target
    // stream's wait for that put (README, CUDA mode's limits; the stand-in copies from pageable
    // memory at once, so it does not show it). The kernel gate stalls no queue, so they are in;
    // puts written directly are in with both.
    let staged_rma = |gate: &str| if gate == "memop" { "Rma,RmaPageable" } else { "" };
    for gate in ["memop", "kernel"] {
        for (job, full) in [(cuda_job().procs(2), true), (cuda_job().local(2).arg("--quick"), false)] {
            let o = one_queue(job).env("NCCL_RS_HOST_WAIT", "0").env("NCCL_P2P_DISABLE", "1")
                .env("CUDA_TEST_SKIP", staged_rma(gate))
                .env("NCCL_RS_STREAM_GATE", gate).env("NCCL_DEBUG", "INFO").env("NCCL_DEBUG_SUBSYS", "P2P").run_outcome();
            assert!(o.ok(), "{gate} gate, one hardware queue, staged by the callers' streams: {}", o.report);
            for p in &o.procs {
                assert!(p.log.contains("callers' streams stage operations"), "caller staging not used:\n{}", p.log);
                // The full run's largest all-to-all (2 x 1.2 MB each way) needs more than 4 MiB.
                assert!(!full || p.log.contains("pool grown"), "the pool did not grow:\n{}", p.log);
            }
        }
    }
    // (Part Soak is left out with the direct path: its reduce into pinned memory on the root
    // is the operation in which the ranks learn that such reduces never go direct, which the
    // others then stage on the worker's stream: a known limit, README.)
    for gate in ["memop", "kernel"] {
        for job in [cuda_job().procs(2), cuda_job().local(2).arg("--quick")] {
            let skip = if gate == "memop" { "RmaPageable,Soak" } else { "Soak" };
            let o = one_queue(job).env("NCCL_RS_HOST_WAIT", "0").env("NCCL_RS_STREAM_GATE", gate)
                .env("CUDA_TEST_SKIP", skip).env("NCCL_DEBUG", "INFO").env("NCCL_DEBUG_SUBSYS", "P2P").run_outcome();
            assert!(o.ok(), "{gate} gate, one hardware queue, direct on the callers' streams: {}", o.report);
            for p in &o.procs {
                assert!(p.log.contains("on the caller's stream"), "the direct path did not run on the caller's stream:\n{}",
                        p.log);
            }
        }
    }
    let o = one_queue(cuda_job().procs(2).arg("--only").arg("Collectives")).env("NCCL_RS_HOST_WAIT", "0")
        .env("NCCL_RS_DIRECT_ON_STREAM", "0").timeout_s(6).run_outcome();
    assert!(o.timed_out && o.procs.iter().all(|p| p.killed_at_deadline),
            "one hardware queue, direct path on the worker's stream: did not hang as the model says it must:\n{}", o.report);
}

/// One-sided puts between ranks of one host go directly: the caller's stream copies into the
/// target's window (mapped through CUDA IPC, or by address in one process), then the signal
/// follows; with NCCL_P2P_DISABLE=1 they are staged through host memory. Exact either way,
/// from device, pageable and pinned sources (a staged put from pinned memory behind a held
/// stream hung when the stream copied it into the pinned staging: the stand-in makes a copy
/// between two host buffers wait for the stream, as CUDA does).
#[test]
fn cuda_mode_rma_puts_on_one_host_go_directly() {
    for (disable, direct) in [("0", true), ("1", false)] {
        for job in [cuda_job().procs(2), cuda_job().procs(2).local(2)] {
            let o = job.arg("--only").arg("Rma").env("NCCL_P2P_DISABLE", disable).env("NCCL_DEBUG", "INFO")
                .env("NCCL_DEBUG_SUBSYS", "P2P").run_outcome();
            assert!(o.ok(), "{}", o.report);
            for p in &o.procs {
                assert_eq!(p.log.contains("are written directly by the caller's stream"), direct,
                           "NCCL_P2P_DISABLE={disable}: puts went {} directly:\n{}", if direct { "not" } else { "" }, p.log);
            }
        }
    }
    for disable in ["0", "1"] {
        cuda_job().procs(2).local(2).arg("--only").arg("RmaPageable").env("NCCL_P2P_DISABLE", disable).run();
    }
}

/// One-sided operations in stream order (`ffi-tests/cuda.c`'s Rma parts run in every default
/// run above): a stream that waits for signals of a rank that destroys its communicator and
/// exits without sending them is let go, and the communicator's asynchronous error names it.
#[test]
fn cuda_mode_rma_stream_waits_for_a_rank_that_leaves() {
    cuda_job().procs(2).arg("--only").arg("RmaGone").timeout_s(60).run();
}

/// A communicator that fails in a one-sided operation on a stream (rank 0 out of file
/// descriptors when its signal needs a connection) lets go its stream's wait for signals and
/// publishes the failure, so the peer's stream waiting for its signal is let go too, with an
/// error naming it (part RmaFailed; before, both streams waited for ever).
#[test]
fn cuda_mode_rma_stream_waits_end_when_a_communicator_fails() {
    cuda_job().procs(2).arg("--only").arg("RmaFailed").timeout_s(60).run();
}

/// A sender of one-sided operations that cannot be started (its pinned staging cannot be
/// allocated) fails the call with `ncclUnhandledCudaError` naming the allocation; the next calls
/// start it and are stream-ordered as ever (part RmaNoSender). Before, the calls fell back to
/// running on the calling thread, which waited for a stream the program held until the calls
/// returned: every rank waited for ever.
#[test]
fn cuda_mode_rma_sender_that_cannot_start_fails_the_call() {
    if !stand_in_only("cuda_mode_rma_sender_that_cannot_start_fails_the_call") {
        return;
    }
    // (The first allocation of the staging's size fails in each rank: one per process.)
    for (job, fails) in [(cuda_job().procs(2), "1:4194304"), (cuda_job().local(2), "2:4194304")] {
        job.arg("--quick").arg("--only").arg("RmaNoSender").env("NCCL_RS_STUB_HOST_ALLOC_FAILS", fails).timeout_s(60).run();
    }
}

/// A stream that waits for a signal that has not come is named at WARN after 10 s, as a wait
/// on the host is (no host thread waits for it): rank 0 says which signal from which rank
/// (part RmaLate); then rank 1 sends it and rank 0's stream goes on.
#[test]
fn cuda_mode_rma_a_late_signal_is_named() {
    let job = cuda_job().procs(2).env("NCCL_DEBUG", "WARN").arg("--only").arg("RmaLate");
    let o = released_on_marker(job, "CUDA_TEST_RMA_LATE", 0, "in ncclWaitSignal for signals");
    assert!(o.ok(), "{}", o.report);
    let waiting = &o.procs[0].log;
    assert!(waiting.contains("rank 0: a stream has waited 10 s or more in ncclWaitSignal for signals from rank 1 \
                              (signal 0, context 0), 0 of 1 have come"), "rank 0:\n{waiting}");
}

/// One-sided operations to one peer wait only for their own streams: rank 0 signals rank 1 on
/// a stream it holds and rank 2 on another; rank 2 gets its signal while the first stream is
/// held, then rank 0 lets it go and rank 1 gets its own (part RmaStreams). A sender that took
/// every call in order would keep rank 2 waiting until rank 0 gave up.
#[test]
fn cuda_mode_rma_a_held_stream_holds_up_no_other_peer() {
    let job = cuda_job().procs(3).arg("--only").arg("RmaStreams");
    let o = released_on_marker(job, "CUDA_TEST_RMA_RELEASE", 2, "ARRIVED");
    assert!(o.ok(), "{}", o.report);
    assert!(o.procs[1].log.contains("ARRIVED"), "rank 1 never got its signal:\n{}", o.procs[1].log);
}

/// A put into the window of a rank whose process is stopped (SIGSTOP) waits for that rank to
/// say where the window is: rank 0 names it at WARN, its process stopped, about a second in
/// (before: nothing, for up to NCCL_PEER_TIMEOUT_S, 30 s, while its stream waited). Sent
/// SIGCONT on that line, rank 1 answers and the put lands, exact (part RmaStopped).
#[test]
fn cuda_mode_rma_a_put_to_a_stopped_process_names_it() {
    let o = cuda_job().procs(2).arg("--only").arg("RmaStopped").env("NCCL_DEBUG", "WARN")
        .signal(1, "CONT", When::marker(0, "its process is stopped"))
        .run_outcome();
    assert!(o.ok(), "{}", o.report);
    let named = o.procs[0].log.lines().any(|l| {
        l.contains("NCCL WARN") && l.contains("a put waited") && l.contains("rank 1 (") && l.contains("its window #")
            && l.contains("its process is stopped")
    });
    assert!(named, "rank 0 did not name rank 1's stopped process:\n{}", o.report);
}

/// A rank waits on a rank of its host whose call waits for its CUDA stream, held by a
/// stream-ordered ncclWaitSignal for a signal of a third rank, whose process is stopped. The
/// waiting rank names the stopped one as what holds that stream (before: only that rank 1
/// waits for its stream), and rank 1 says that its stream waits for a stopped process (before:
/// nothing for 10 s). Sent SIGCONT once both have said so, rank 2 signals and the values
/// arrive, exact (part HeldBySignal).
#[test]
fn cuda_mode_a_stream_held_by_signals_of_a_stopped_process_names_it() {
    let o = cuda_job().procs(3).arg("--only").arg("HeldBySignal").env("NCCL_DEBUG", "WARN")
        .signal(2, "CONT", When::marker(0, "waits in ncclWaitSignal for signals from rank 2").and(1, "a stream has waited"))
        .run_outcome();
    assert!(o.ok(), "{}", o.report);
    let named = o.procs[0].log.lines().any(|l| {
        l.contains("NCCL WARN") && l.contains("for rank 1 (") && l.contains("waits for its CUDA stream")
            && l.contains("ncclWaitSignal for signals from rank 2 (") && l.contains("its process is stopped")
    });
    assert!(named, "rank 0 did not name rank 2 as what holds rank 1's stream:\n{}", o.report);
    let said = o.procs[1].log.lines().any(|l| {
        l.contains("NCCL WARN") && l.contains("a stream has waited") && l.contains("from rank 2 (")
            && l.contains("its process is stopped")
    });
    assert!(said, "rank 1 did not say its stream waits for a stopped process:\n{}", o.report);
}

/// Run `job` with `var` naming a file of its directory, which the harness writes once process
/// `proc` has said `marker`.
fn released_on_marker(mut job: Job, var: &str, proc: usize, marker: &'static str) -> Outcome {
    let release = job.dir().join("release");
    let file = release.clone();
    job.env(var, release.to_str().expect("a path"))
        .on(When::marker(proc, marker), move || {
            std::fs::write(&file, b"go").expect("the release file");
            format!("wrote {}", file.display())
        })
        .run_outcome()
}

/// A driver that reports stream memory operations but refuses the wait when it is asked for
/// (the stand-in's NCCL_RS_STUB_WAIT_VALUE_REFUSED): the call waits on the host instead, and
/// what the caller's stream staged is copied out once the operation is done. Exact results.
#[test]
fn cuda_mode_wait_refused_at_call_time() {
    if !stand_in_only("cuda_mode_wait_refused_at_call_time") {
        return;
    }
    for job in [cuda_job().procs(2).arg("--quick"), cuda_job().local(2).arg("--quick")] {
        let o = job.env("NCCL_RS_STUB_WAIT_VALUE_REFUSED", "1").env("NCCL_P2P_DISABLE", "1").env("NCCL_RS_HOST_WAIT", "0")
            .env("NCCL_DEBUG", "INFO").env("NCCL_DEBUG_SUBSYS", "P2P").run_outcome();
        assert!(o.ok(), "{}", o.report);
        assert!(o.procs.iter().all(|p| p.log.contains("callers' streams stage operations")), "{}", o.report);
    }
}

/// With caller staging off (NCCL_RS_CALLER_STAGING=0) the worker stages every operation on
/// its own stream, as before the pool existed: the same results.
#[test]
fn cuda_mode_worker_staging() {
    for job in [cuda_job().procs(2).arg("--quick"), cuda_job().local(2).arg("--quick")] {
        let o = job.env("NCCL_RS_CALLER_STAGING", "0").env("NCCL_DEBUG", "INFO").env("NCCL_DEBUG_SUBSYS", "P2P")
            .run_outcome();
        assert!(o.ok(), "{}", o.report);
        assert!(o.procs.iter().all(|p| !p.log.contains("callers' streams stage")), "{}", o.report);
    }
}

#[test]
fn cuda_mode_2_ranks_in_one_process() {
    cuda_job().local(2).run();
}

#[test]
fn cuda_mode_2_processes_of_2_ranks() {
    cuda_job().procs(2).local(2).arg("--quick").run();
}

/// A one-rank communicator's collectives are copies (or PreMulSum's scaling kernel) queued on
/// the caller's stream: exact, and no stream worker is started for them (nor any wait).
#[test]
fn cuda_mode_one_rank_collectives_are_copies_on_the_stream() {
    let perf = std::env::var("NCCL_RS_PERF").unwrap_or_else(|_| env!("CARGO_BIN_EXE_nccl-rs-perf").to_string());
    for (op, reduction) in [("allreduce", "sum"), ("allgather", "sum"), ("reducescatter", "premulsum"), ("alltoall", "sum")] {
        let mut cmd = std::process::Command::new(&perf);
        cmd.args([op, "-np", "1", "--device", "1", "-b", "8", "-e", "1M", "-f", "32", "-n", "2", "-w", "1", "-o", reduction]);
        if std::env::var_os("NCCL_TEST_REAL_DRIVER").is_none() {
            cmd.env("LD_LIBRARY_PATH", cuda_stub_dir());
        }
        let out = cmd.env_remove("NCCL_COMM_ID").env("NCCL_DEBUG", "INFO").output().expect("run nccl-rs-perf");
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "{op} failed:\n{text}");
        assert!(text.contains("Out of bounds values : 0 OK"), "{op}: wrong results:\n{text}");
        assert!(!text.contains("stream worker started"), "{op}: a one-rank communicator started its worker:\n{text}");
    }
}

/// The benchmark tool with device buffers (`--device 1`; `--device 2`: of the virtual memory
/// API, as PyTorch's expandable segments place them; `--device 3`: such memory peers cannot
/// map; `-G 2`: calls captured into CUDA graphs, with NCCL_RS_GRAPH_CAPTURE=1; `-o premulsum`):
/// every size checked exactly, as processes and as ranks of one process sharing the device.
/// Its sendrecv in place sends from and receives into one buffer. And on nonblocking
/// communicators (`--nonblocking 1`), host-wait mode too.
#[test]
fn perf_tool_runs_and_checks_device_buffers() {
    // NCCL_RS_PERF: the binary beside this test when both were copied to another machine.
    let perf = std::env::var("NCCL_RS_PERF").unwrap_or_else(|_| env!("CARGO_BIN_EXE_nccl-rs-perf").to_string());
    // The last two: calls captured into CUDA graphs (nccl-tests' -G), each launched twice an
    // iteration, once for the check.
    let sum = "sum";
    let runs = [("allreduce", ["-np", "2"], "1", "0", sum), ("allgather", ["-t", "2"], "1", "0", sum),
                ("reducescatter", ["-np", "2"], "1", "0", sum), ("allreduce", ["-np", "2"], "2", "0", sum),
                ("allreduce", ["-np", "2"], "1", "2", sum), ("reducescatter", ["-t", "2"], "2", "2", sum),
                ("sendrecv", ["-np", "2"], "1", "0", sum), ("sendrecv", ["-t", "2"], "2", "0", sum),
                ("allreduce", ["-np", "2"], "3", "0", sum), ("allgather", ["-np", "2"], "3", "0", sum),
                ("reducescatter", ["-np", "2"], "1", "0", "premulsum"), ("allreduce", ["-np", "2"], "3", "0", "premulsum")];
    for (op, layout, device, graph, reduction) in runs {
        let mut cmd = std::process::Command::new(&perf);
        cmd.arg(op).args(layout).args(["--device", device, "-b", "8", "-e", "1M", "-f", "32", "-n", "2", "-w", "1", "-d", "bfloat16"]);
        cmd.args(["-o", reduction]);
        cmd.args(["-G", graph]).env("NCCL_RS_GRAPH_CAPTURE", "1");
        if std::env::var_os("NCCL_TEST_REAL_DRIVER").is_none() {
            cmd.env("LD_LIBRARY_PATH", cuda_stub_dir());
        }
        let out = cmd.env_remove("NCCL_COMM_ID").output().expect("run nccl-rs-perf");
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "{op} {layout:?} failed:\n{text}");
        let place = match (device, graph) {
            ("2", _) => "device (virtual memory API, 20 MiB allocations)",
            ("3", _) => "device (virtual memory API, 20 MiB allocations peers cannot map)",
            (_, "0") => "device buffers)",
            _ => "device buffers, each call captured into a CUDA graph launched 2 time(s)",
        };
        assert!(text.contains(&format!("(cuda mode, {place}")), "{op}: not in CUDA mode with {place}:\n{text}");
        assert!(text.contains("Out of bounds values : 0 OK"), "{op}: wrong results:\n{text}");
        assert_eq!(text.lines().filter(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit())).count(), 4,
                   "{op}: expected 4 sizes (8 B to 256 KiB):\n{text}");
        // And, per size, the time the calling thread spent in the calls.
        assert_eq!(text.lines().filter(|l| l.starts_with('#') && l.contains("us per call (in the call")).count(), 4,
                   "{op}: expected the time in the call for 4 sizes:\n{text}");
        // And the device's own copy bandwidth at each size, measured beside them.
        assert_eq!(text.lines().filter(|l| l.starts_with('#') && l.contains("device-to-device copy")).count(), 4,
                   "{op}: expected the device copy bandwidth for 4 sizes:\n{text}");
    }
    // `--hosts 2`: of 3 processes, the first two on one host, the third on another (sockets).
    let mut cmd = std::process::Command::new(&perf);
    cmd.args(["sendrecv", "-np", "3", "--hosts", "2", "--device", "1", "-b", "8", "-e", "1M", "-f", "32", "-n", "2"]);
    if std::env::var_os("NCCL_TEST_REAL_DRIVER").is_none() {
        cmd.env("LD_LIBRARY_PATH", cuda_stub_dir());
    }
    let out = cmd.env_remove("NCCL_COMM_ID").env("NCCL_DEBUG", "INFO").env("NCCL_DEBUG_SUBSYS", "INIT").output()
        .expect("run nccl-rs-perf");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("Out of bounds values : 0 OK"), "--hosts 2:\n{text}");
    for (from, to, via) in [(0, 1, "Shm"), (1, 2, "Socket"), (2, 0, "Socket")] {
        assert!(text.contains(&format!("rank {from} -> rank {to} via {via}")), "--hosts 2: {from} -> {to}:\n{text}");
    }
    // `--nonblocking 1`: nonblocking communicators, as streams order them and in host-wait mode,
    // where every call answers ncclInProgress until its operation is done.
    for host_wait in ["0", "1"] {
        let mut cmd = std::process::Command::new(&perf);
        cmd.args(["allreduce", "-np", "2", "--device", "1", "--nonblocking", "1", "-b", "8", "-e", "1M", "-f", "32", "-n", "2"]);
        if std::env::var_os("NCCL_TEST_REAL_DRIVER").is_none() {
            cmd.env("LD_LIBRARY_PATH", cuda_stub_dir());
        }
        let out = cmd.env_remove("NCCL_COMM_ID").env("NCCL_RS_HOST_WAIT", host_wait).output().expect("run nccl-rs-perf");
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success() && text.contains("Out of bounds values : 0 OK"), "--nonblocking 1, host-wait {host_wait}:\n{text}");
        assert!(text.contains("device buffers, nonblocking communicators"), "--nonblocking 1: not said:\n{text}");
    }
}

/// A rank is SIGKILLed while both loop over all-reduces on device memory: the survivor's
/// stream is released, its communicator reports ncclRemoteError naming rank 1 well within the
/// bound, and ncclCommAbort returns (ffi-tests/cuda.c checks all of it).
#[test]
fn cuda_mode_peer_killed_during_stream_operations() {
    peer_killed(cuda_job().env("CUDA_TEST_FAULT", "1"));
}

/// The same with sends and receives between the two (read directly): the survivor's wait for
/// the dead rank's record or answer ends with ncclRemoteError naming it.
#[test]
fn cuda_mode_peer_killed_during_direct_sends_and_receives() {
    peer_killed(cuda_job().env("CUDA_TEST_FAULT", "p2p"));
}

/// The same with the all-reduces launched as a captured CUDA graph (NCCL_RS_GRAPH_CAPTURE=1):
/// the survivor's launch is released with the peer's loss as the communicator's error, and a
/// launch after ncclCommAbort goes straight through.
#[test]
fn cuda_mode_peer_killed_during_graph_launches() {
    peer_killed(cuda_job().env("CUDA_TEST_FAULT", "graph").env("NCCL_RS_GRAPH_CAPTURE", "1"));
}

/// A peer killed mid-stream in a job of 3 processes: the survivors get the error, shrink the
/// failed communicator to the two of them (NCCL_SHRINK_ABORT) and run direct all-reduces on
/// device memory there, exact (what fault-tolerant training does instead of restarting).
#[test]
fn cuda_mode_survivors_shrink_and_go_on() {
    let job = cuda_job().procs(3).env("CUDA_TEST_FAULT", "shrink").env("NCCL_DEBUG", "INFO").env("NCCL_DEBUG_SUBSYS", "P2P");
    let o = with_process_1_killed(job, 90);
    for i in [0, 2] {
        let p = &o.procs[i];
        assert!(p.exited_0() && p.log.contains("SHRUNK"), "survivor {i} did not pass:\n{}", o.report);
        assert!(p.log.contains("of the 2 ranks of this host are read directly"),
                "survivor {i}: the shrunk communicator staged:\n{}", p.log);
    }
}

/// A rank alive but stuck (it never issues the call): the two others, whose all-reduce waits
/// for it on their streams, shrink it away with NCCL_SHRINK_ABORT, which aborts that
/// all-reduce as NCCL documents (their streams get past it), and go on with direct
/// all-reduces behind it on the same streams, exact.
#[test]
fn cuda_mode_shrink_abort_releases_a_stuck_call() {
    let mut job = cuda_job().procs(3).env("NCCL_DEBUG", "INFO").env("NCCL_DEBUG_SUBSYS", "P2P").timeout_s(90);
    let dir = job.dir();
    let (release, other) = (dir.join("release"), dir.join("proc1.log"));
    let job = job.env("CUDA_TEST_SHRINK_STUCK", release.to_str().expect("a path")).on(When::marker(0, "SHRUNK"), move || {
        let until = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while !std::fs::read_to_string(&other).unwrap_or_default().contains("SHRUNK") && std::time::Instant::now() < until {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        std::fs::write(&release, b"go").expect("the release file");
        "released process 2".to_string()
    });
    let o = job.run_outcome();
    assert!(o.ok(), "{}", o.report);
    for i in [0, 1] {
        assert!(o.procs[i].log.contains("of the 2 ranks of this host are read directly"),
                "process {i}: the shrunk communicator staged:\n{}", o.procs[i].log);
    }
}

/// Runs `job` (CUDA_TEST_FAULT set) with process 1 killed once it loops, as it must be.
fn with_process_1_killed(job: Job, timeout_s: u64) -> Outcome {
    let o = job.env("CUDA_FAULT_BOUND_S", "20").kill(1, When::marker(1, "LOOPING").then_ms(50)).timeout_s(timeout_s)
        .run_outcome();
    assert!(o.fired[0].is_some(), "process 1 was never killed:\n{}", o.report);
    assert!(o.procs[1].died_of_sigkill(), "process 1 did not die of SIGKILL:\n{}", o.report);
    o
}

fn peer_killed(job: Job) {
    let o = with_process_1_killed(job.procs(2), 60);
    assert!(o.procs[0].exited_0(), "the survivor did not pass:\n{}", o.report);
    println!("{}", o.report);
}

/// A buffer the driver cannot classify (pointer queries refused, as after a sticky error)
/// fails the call with ncclUnhandledCudaError and a message, never a host read of device
/// memory; the next call works (ffi-tests/cuda.c checks it).
#[test]
fn cuda_mode_unclassifiable_buffer_fails_the_call() {
    if !stand_in_only("cuda_mode_unclassifiable_buffer_fails_the_call") {
        return;
    }
    let o = cuda_job().env("CUDA_TEST_POINTER_FAILS", "1").timeout_s(60).run_outcome();
    assert!(o.ok(), "{}", o.report);
}

/// Ranks issuing all-reduces of different counts on device memory (direct-path sizes), or a
/// send and a receive of different sizes, get ncclInvalidUsage naming the calls, never each
/// other's data read as the same call. Two ranks that each send to the other before
/// receiving, outside a group, get an error saying so (before: both streams waited for ever),
/// on the direct path and staged.
#[test]
fn cuda_mode_mismatched_calls_are_reported() {
    for (case, direct) in [("1", "1"), ("small", "1"), ("p2p", "1"), ("both_send", "1"), ("both_send", "0")] {
        let o = cuda_job().procs(2).env("CUDA_TEST_MISMATCH", case).env("NCCL_RS_DIRECT_P2P", direct).timeout_s(60)
            .run_outcome();
        assert!(o.ok(), "{}", o.report);
        if case == "both_send" {
            assert!(o.procs.iter().any(|p| p.log.contains("each sends to the other")),
                    "no rank said that each sends to the other (NCCL_RS_DIRECT_P2P={direct}):\n{}", o.report);
        }
        println!("{}", o.report);
    }
    // Round three ranks, each sending to the next: one names the cycle.
    for direct in ["1", "0"] {
        let o = cuda_job().procs(3).env("CUDA_TEST_MISMATCH", "cycle_send").env("NCCL_RS_DIRECT_P2P", direct).timeout_s(60)
            .run_outcome();
        assert!(o.ok(), "{}", o.report);
        assert!(o.procs.iter().any(|p| p.log.contains("wait on each other in a cycle")),
                "no rank named the cycle (NCCL_RS_DIRECT_P2P={direct}):\n{}", o.report);
    }
}

/// Process 1's reduction kernels fail to launch in a direct all-reduce (queued at call time on
/// the caller's stream, or by the worker on its own), and it stays alive: both ranks get an
/// error within the bound (process 0's names rank 1's failure), none waits for the other, and
/// the streams get past the call.
#[test]
fn cuda_mode_kernel_failure_is_reported_to_peers() {
    if !stand_in_only("cuda_mode_kernel_failure_is_reported_to_peers") {
        return;
    }
    // (Host-wait mode: the calls themselves return the failure, on both ranks.)
    for (on_stream, host_wait) in [("1", "0"), ("0", "0"), ("1", "1")] {
        let o = cuda_job().procs(2).env("CUDA_TEST_LAUNCH_FAIL", "1").proc_env(1, "NCCL_RS_STUB_LAUNCH_FAILS", "1")
            .env("NCCL_RS_DIRECT_ON_STREAM", on_stream).env("NCCL_RS_HOST_WAIT", host_wait).timeout_s(60).run_outcome();
        assert!(o.ok(), "NCCL_RS_DIRECT_ON_STREAM={on_stream}, NCCL_RS_HOST_WAIT={host_wait}: {}", o.report);
        println!("{}", o.report);
    }
}

/// ncclCommAbort returns while the call's stream is held before the call (the operation
/// never starts), and the stream gets past the aborted operation once let go: a staged
/// all-reduce, and a direct one whose kernels wait on the stream behind the held point; and
/// an in-place all-to-all, whose input copy into the communicator's scratch (`streamed::
/// scratch`) runs only after the abort: the scratch must outlive it (freed, the stand-in's
/// copy crashed the process).
#[test]
fn cuda_mode_abort_with_the_stream_held() {
    for count in ["1", "100000"] {
        cuda_job().env("CUDA_TEST_ABORT_HELD", count).timeout_s(60).run();
    }
    for job in [cuda_job(), cuda_job().procs(2), cuda_job().local(2)] {
        job.env("CUDA_TEST_ABORT_HELD", "100000").env("CUDA_TEST_ABORT_HELD_ALLTOALL", "1").timeout_s(60).run();
    }
}
