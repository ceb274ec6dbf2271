//! Failures, as the surviving ranks see them (`ffi-tests/faults.c` does the calls; see its
//! header for the parts and their environment): a rank SIGKILLed in the middle of an
//! allreduce loop (shared memory and sockets, blocking and nonblocking communicators), a link
//! cut between two hosts, `ncclCommAbort` from another thread, mismatched calls, and garbage,
//! closed and half-open connections on the bootstrap root while a real job initialises.
//!
//! Every job has a hard deadline (at most 45 s) and every C process an alarm of its own, so
//! nothing hangs: a library that never notices a failure fails the test with the last step
//! each process was in. Whatever happens, each test prints the codes, messages and times the
//! ranks saw. Bootstrap and sockets use loopback (`NCCL_SOCKET_IFNAME=lo`), or the test hosts
//! of `scripts/testhosts` for the link test.

mod common;

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use common::*;

/// The lines of the C programs worth quoting in a report.
fn key_lines(o: &Outcome) -> String {
    let keys = [
        "ERROR after",
        "ncclGetLastError",
        "ncclCommGetAsyncError ->",
        "ncclCommAbort",
        "ncclAllReduce returned",
        "TIMING",
        "FAIL ",
        "CRASH",
        "RESULT",
        " -> nccl",
        "new communicator",
        "faults.c:",
        "common.c:",
    ];
    let mut s = String::new();
    for (i, p) in o.procs.iter().enumerate() {
        for line in p.log.lines().filter(|l| keys.iter().any(|k| l.contains(k))) {
            s += &format!("  p{i}: {line}\n");
        }
    }
    s
}

fn secs(d: Option<Duration>) -> String {
    d.map_or("-".to_string(), |d| format!("{:.3} s", d.as_secs_f64()))
}

/// Prints the summary; panics with it and the whole report unless `ok`.
fn judge(name: &str, o: &Outcome, ok: bool, summary: String) {
    let text = format!("== {name}: {}\n{summary}{}", if ok { "PASS" } else { "FAIL" }, key_lines(o));
    if ok {
        println!("{text}");
    } else {
        panic!("{text}\n{}", o.report);
    }
}

// ---- a rank killed in the middle of an allreduce loop ------------------------------------

/// Two processes loop over 4 MiB allreduces; process 1 (rank 1) is SIGKILLed 50 ms after it
/// says the loop runs. Rank 0 must return ncclRemoteError naming rank 1 within 30 s, then
/// abort and exit 0 (the C program checks all of that and exits 1 otherwise).
fn kill_during_allreduce(name: &str, socket: bool, nonblocking: bool) {
    kill_one_of(name, 2, socket, nonblocking);
}

/// The same with `procs` processes: every survivor, whether or not it talks to rank 1
/// directly, must name rank 1 (the C program of each checks its own error).
fn kill_one_of(name: &str, procs: usize, socket: bool, nonblocking: bool) {
    kill_and_then(name, procs, socket, nonblocking, None);
}

/// `shrink`: the survivors then shrink the lost rank out with that flag ("default" or
/// "abort") and check an allreduce on the new communicator.
fn kill_and_then(name: &str, procs: usize, socket: bool, nonblocking: bool, shrink: Option<&str>) {
    let mut job = Job::new("faults")
        .procs(procs)
        .arg("--only")
        .arg("loop")
        .env("NCCL_SOCKET_IFNAME", "lo")
        .env("FAULTS_LOST_RANK", "1")
        .env("FAULTS_BOUND_S", "30")
        .env("FAULTS_MAX_S", "32")
        .kill(1, When::marker(1, "LOOPING").then_ms(50))
        .timeout_s(45);
    if socket {
        job = job.env("NCCL_SHM_DISABLE", "1");
    }
    if nonblocking {
        job = job.env("FAULTS_NONBLOCKING", "1");
    }
    if let Some(flag) = shrink {
        job = job.env("FAULTS_SHRINK", flag);
    }
    let o = job.run_outcome();
    let killed = o.fired[0];
    let survivor = &o.procs[0];
    let after_kill = match (killed, survivor.exited_at) {
        (Some(k), Some(e)) => Some(e.saturating_sub(k)),
        _ => None,
    };
    let within = after_kill.is_some_and(|d| d <= Duration::from_secs(35));
    let summary = format!(
        "  process 1 SIGKILLed at {}; survivor (rank 0) exited {} after the kill; {}\n",
        secs(killed),
        secs(after_kill),
        if o.procs[1].died_of_sigkill() { "victim died of SIGKILL" } else { "victim NOT killed by the job" },
    );
    judge(name, &o, o.ok() && killed.is_some() && within, summary);
}

#[test]
fn kill_rank_during_allreduce_shm() {
    kill_during_allreduce("kill_rank_during_allreduce_shm", false, false);
}

#[test]
fn kill_rank_during_allreduce_socket() {
    kill_during_allreduce("kill_rank_during_allreduce_socket", true, false);
}

#[test]
fn kill_rank_during_allreduce_nonblocking_shm() {
    kill_during_allreduce("kill_rank_during_allreduce_nonblocking_shm", false, true);
}

#[test]
fn kill_rank_during_allreduce_nonblocking_socket() {
    kill_during_allreduce("kill_rank_during_allreduce_nonblocking_socket", true, true);
}

#[test]
fn kill_rank_of_4_during_allreduce_every_survivor_names_it_shm() {
    kill_one_of("kill_rank_of_4_during_allreduce_every_survivor_names_it_shm", 4, false, false);
}

/// Host mode: the survivors of a killed rank shrink it out of the failed communicator (both
/// flags) and go on with exact results.
#[test]
fn kill_rank_of_3_then_survivors_shrink_and_go_on() {
    kill_and_then("kill_rank_of_3_then_survivors_shrink_and_go_on", 3, false, false, Some("default"));
}

#[test]
fn kill_rank_of_3_then_survivors_shrink_with_abort_flag_socket() {
    kill_and_then("kill_rank_of_3_then_survivors_shrink_with_abort_flag_socket", 3, true, false, Some("abort"));
}

/// The same on nonblocking communicators, as PyTorch's are: the shrink returns ncclInProgress
/// and its communicator, polled, becomes ready. (Only the test program lacked this.)
#[test]
fn kill_rank_of_4_then_survivors_shrink_nonblocking() {
    kill_and_then("kill_rank_of_4_then_survivors_shrink_nonblocking", 4, false, true, Some("abort"));
}

#[test]
fn kill_rank_of_4_during_allreduce_every_survivor_names_it_socket() {
    kill_one_of("kill_rank_of_4_during_allreduce_every_survivor_names_it_socket", 4, true, false);
}

/// A rank killed amid random calls (the soak of ffi-tests/collectives.c: every collective,
/// sends and receives, one-sided puts and signal waits, a nonblocking communicator beside a
/// blocking one), over shared memory and over sockets: every survivor's call fails, naming
/// the killed process's rank, within seconds. A random-kill hunt over seeds, layouts and kill
/// times found no hang in ~1,600 runs; this keeps two of them in the suite. To hunt with more:
/// `NCCL_TEST_KILL_SEEDS=1-100` (each seed its own layout, victim and time, as below).
#[test]
fn a_rank_killed_amid_random_calls_is_named_by_every_survivor() {
    match hunt_seeds("NCCL_TEST_KILL_SEEDS") {
        None => {
            kill_amid_random_calls(4, 3, 1, &[], 1, 400);
            kill_amid_random_calls(4, 3, 1, &[("NCCL_SHM_DISABLE", "1")], 1, 400);
        }
        Some(seeds) => {
            for seed in seeds {
                let (procs, local, env, victim, ms) = hunt_layout(seed);
                kill_amid_random_calls(seed, procs, local, env, victim, ms);
            }
        }
    }
}

/// The seeds `var` asks a hunt for ("1-100"), if it is set.
fn hunt_seeds(var: &str) -> Option<std::ops::RangeInclusive<u64>> {
    let v = std::env::var(var).ok()?;
    let (a, b) = v.split_once('-')?;
    Some(a.parse::<u64>().ok()?..=b.parse::<u64>().ok()?)
}

/// A hunt's layout for `seed`: processes, ranks each, environment, the process to kill or stop,
/// and when (ms after its communicators are ready).
fn hunt_layout(seed: u64) -> (usize, usize, &'static [(&'static str, &'static str)], usize, u64) {
    let (procs, local, env): (usize, usize, &[(&str, &str)]) = match seed % 4 {
        0 => (3, 1, &[]),
        1 => (2, 2, &[]),
        2 => (4, 1, &[("NCCL_SHM_DISABLE", "1")]),
        _ => (3, 2, &[("NCCL_BUFFSIZE", "65536")]),
    };
    (procs, local, env, (seed as usize * 7) % procs, 100 + seed * 7919 % 2900)
}

/// The soak with `seed` as `procs` x `local` ranks, process `victim` SIGKILLed `ms` after its
/// communicators are ready; every other process must end (not at the deadline) and its error
/// name a rank of the victim.
fn kill_amid_random_calls(seed: u64, procs: usize, local: usize, env: &[(&str, &str)], victim: usize, ms: u64) {
    let mut job = Job::new("collectives").procs(procs).local(local).arg("--only").arg("Soak")
        .env("NCCL_TEST_SEED", &seed.to_string()).env("NCCL_TEST_SOAK_STEPS", "1000000")
        .kill(victim, When::marker(victim, "communicators ready").then_ms(ms)).timeout_s(60);
    for (k, v) in env {
        job = job.env(k, v);
    }
    let o = job.run_outcome();
    let victims: Vec<String> = (victim * local..(victim + 1) * local).map(|r| format!("rank {r} (")).collect();
    let named = |p: usize| o.procs[p].log.lines().any(|l| l.contains(" -> ") && victims.iter().any(|v| l.contains(v)));
    let ended = |p: usize| o.procs[p].status.is_some() && !o.procs[p].killed_at_deadline;
    let survivors: Vec<usize> = (0..procs).filter(|&p| p != victim).collect();
    let ok = !o.timed_out && o.procs[victim].died_of_sigkill() && survivors.iter().all(|&p| ended(p) && named(p));
    let name = format!("a_rank_killed_amid_random_calls_is_named_by_every_survivor (seed {seed}, {procs}x{local} {env:?})");
    let ended_at: Vec<String> = survivors.iter().map(|&p| secs(o.procs[p].exited_at)).collect();
    let summary = format!("  process {victim} SIGKILLed at {}; survivors ended at {}\n", secs(o.fired[0]), ended_at.join(", "));
    judge(&name, &o, ok, summary);
}

/// A process stopped (SIGSTOP) amid the soak's random calls (every collective, sends and
/// receives, puts and signal waits, a nonblocking communicator beside a blocking one) for 3 s,
/// then resumed (SIGCONT): another process names it at WARN as stopped, and every call of
/// every process then completes, exact. A stop hunt over seeds and layouts (host and CUDA
/// mode) found ranks never named when stopped for less than 10 s, and three ways a resumed
/// rank made a peer call a correct program a mismatch; this keeps one layout in the suite.
/// To hunt with more: `NCCL_TEST_STOP_SEEDS=1-100`.
#[test]
fn a_rank_stopped_amid_random_calls_is_named_and_the_job_completes() {
    match hunt_seeds("NCCL_TEST_STOP_SEEDS") {
        None => stop_amid_random_calls(4, 3, 1, &[], 1, 300),
        Some(seeds) => {
            for seed in seeds {
                let (procs, local, env, victim, ms) = hunt_layout(seed);
                stop_amid_random_calls(seed, procs, local, env, victim, ms);
            }
        }
    }
}

/// The soak with `seed` as `procs` x `local` ranks, process `victim` stopped `ms` after its
/// communicators are ready and resumed 3 s later; every process must exit 0 and another name
/// the victim's process as stopped.
fn stop_amid_random_calls(seed: u64, procs: usize, local: usize, env: &[(&str, &str)], victim: usize, ms: u64) {
    let ready = || When::marker(victim, "communicators ready");
    let mut job = Job::new("collectives").procs(procs).local(local).arg("--only").arg("Soak")
        .env("NCCL_TEST_SEED", &seed.to_string()).env("NCCL_TEST_SOAK_STEPS", "2000").env("NCCL_DEBUG", "WARN")
        .signal(victim, "STOP", ready().then_ms(ms)).signal(victim, "CONT", ready().then_ms(ms + 3000)).timeout_s(90);
    for (k, v) in env {
        job = job.env(k, v);
    }
    let o = job.run_outcome();
    let victims: Vec<String> = (victim * local..(victim + 1) * local).map(|r| format!("rank {r} (")).collect();
    let named = (0..procs).filter(|&p| p != victim).any(|p| o.procs[p].log.lines().any(|l| {
        l.contains("NCCL WARN") && l.contains("its process is stopped") && victims.iter().any(|v| l.contains(v))
    }));
    let name = format!("a_rank_stopped_amid_random_calls_is_named_and_the_job_completes (seed {seed}, {procs}x{local} \
                        {env:?})");
    let summary = format!("  process {victim} stopped at {}, resumed at {}\n", secs(o.fired[0]), secs(o.fired[1]));
    judge(&name, &o, o.ok() && named, summary);
}

/// A rank that exits after init, before any collective connected it: the survivor's first
/// all-reduce (whose wait for that connection has no limit by default) fails with
/// ncclRemoteError naming it within seconds, over shared memory and over sockets.
#[test]
fn rank_gone_before_its_first_connection_is_named() {
    for socket in [false, true] {
        let mut job = Job::new("faults").procs(2).arg("--only").arg("gone-early").env("NCCL_SOCKET_IFNAME", "lo").timeout_s(45);
        if socket {
            job = job.env("NCCL_SHM_DISABLE", "1");
        }
        let o = job.run_outcome();
        judge(&format!("rank_gone_before_its_first_connection_is_named (socket {socket})"), &o, o.ok(), String::new());
    }
}

/// The process that made a job's id (its root runs there) has used every file descriptor it
/// may when the job's ranks join: their init fails within seconds pointing at the root, and
/// that process's log names the limit (before: the root retried for ever, the ranks waited in
/// init with no end).
#[test]
fn a_root_out_of_file_descriptors_fails_the_job_naming_the_limit() {
    let o = Job::new("faults").procs(3).arg("--only").arg("fd-starved").env("NCCL_DEBUG", "WARN").timeout_s(60)
        .run_outcome();
    let named = o.lines_with("open-file limit").any(|(p, l)| p == 0 && l.contains("the root"));
    judge("a_root_out_of_file_descriptors_fails_the_job_naming_the_limit", &o, o.ok() && named,
          format!("  process 0 named the open-file limit in the root's failure: {named}\n"));
}

/// A member whose ncclCommSplit or ncclCommShrink fails before it sends its part of the
/// exchange (rank 2 cannot start a thread) tells the others, whose calls fail within seconds
/// with ncclRemoteError naming it and why; blocking and nonblocking. Before, the others waited
/// for its part with no end (found by running the CUDA program under `ulimit -u`).
#[test]
fn a_member_whose_split_cannot_start_fails_the_others() {
    for (case, nonblocking) in [("split", "0"), ("shrink", "0"), ("split", "1"), ("shrink", "1")] {
        Job::new("faults").procs(3).arg("--only").arg("no-threads").env("FAULTS_CASE", case)
            .env("FAULTS_NONBLOCKING", nonblocking).env("NCCL_DEBUG", "WARN").timeout_s(60).run();
    }
}

/// A rank that fails before it can join (here: NCCL_SOCKET_IFNAME names no interface of its
/// host, so it has no address to listen on) tells the root, and every other rank's init fails
/// at once with ncclRemoteError saying which rank could not join and why (before: they waited
/// for it with no end, NCCL_INIT_TIMEOUT_S unset, as NCCL's do).
/// With two of four ranks unable to join, the others are told as soon as both have said so
/// (not after the root's 10 s wait for ranks still on their way).
#[test]
fn a_rank_that_cannot_join_fails_the_others_init_naming_it() {
    for bad in [&[2][..], &[2, 3][..]] {
        let mut job = Job::new("faults").procs(2 + bad.len()).arg("--only").arg("hello").env("NCCL_DEBUG", "WARN")
            .timeout_s(60);
        for &p in bad {
            job = job.proc_env(p, "NCCL_SOCKET_IFNAME", "nccl-rs-no-such-if");
        }
        let o = job.run_outcome();
        let told = |p: usize| o.procs[p].log.lines().any(|l| {
            l.contains("ncclCommInitRank") && l.contains("could not join the job") && l.contains("NCCL_SOCKET_IFNAME")
                && l.contains("remote process exited or there was a network error")
        });
        let ended = o.procs.iter().all(|p| !p.killed_at_deadline && p.exited_at.is_some_and(|t| t < Duration::from_secs(8)));
        judge(&format!("a_rank_that_cannot_join_fails_the_others_init_naming_it (ranks {bad:?} cannot)"), &o,
              !o.timed_out && ended && told(0) && told(1),
              format!("  all ended within 8 s: {ended}; rank 0 told: {}; rank 1 told: {}\n", told(0), told(1)));
    }
}

/// A process whose soft limit on open files is too low for its ranks (8 in one process, a
/// soft limit of 40) gets it raised to the hard limit when it runs out, and says so at INFO;
/// the collectives pass.
#[test]
fn a_soft_open_file_limit_too_low_is_raised() {
    let hard = std::fs::read_to_string("/proc/self/limits").ok().and_then(|l| {
        l.lines().find(|x| x.starts_with("Max open files")).and_then(|x| x.split_whitespace().nth(4).map(String::from))
    });
    if hard.as_deref().is_some_and(|h| h.parse::<u64>().is_ok_and(|h| h < 4096)) {
        eprintln!("skipped: the hard open-file limit here is {hard:?}, too low to raise to");
        return;
    }
    let o = Job::new("collectives").local(8).arg("--quick").env("NCCL_TEST_NOFILE", "40")
        .env("NCCL_DEBUG", "INFO").env("NCCL_DEBUG_SUBSYS", "INIT").timeout_s(120).run_outcome();
    let raised = o.lines_with("raised it to the hard limit").count();
    judge("a_soft_open_file_limit_too_low_is_raised", &o, o.ok() && raised > 0,
          format!("  INFO lines saying the limit was raised: {raised}\n"));
}

/// A rank that destroys its communicator after init, before any call connected it, while its
/// process goes on: the survivor's first receive from it, or wait for its signal, fails with
/// ncclRemoteError naming it and what it did, within seconds, over shared memory, sockets and
/// the ring between ranks of one process (before: a wait with no end, as the process was still
/// there).
#[test]
fn rank_that_destroyed_its_communicator_before_connecting_is_named() {
    // (hosts: the two processes say they are on two hosts, NCCL_HOSTID: a peer of another host
    // is found closed by its host refusing the connection, not after NCCL_PEER_TIMEOUT_S, 30 s.)
    let cases = [(2, 1, "shm", "recv"), (2, 1, "sockets", "recv"), (1, 2, "", "recv"), (2, 1, "shm", "signal"),
                 (1, 2, "", "signal"), (2, 1, "hosts", "recv"), (2, 1, "hosts", "signal")];
    for (procs, local, link, case) in cases {
        let mut job = Job::new("faults").procs(procs).local(local).arg("--only").arg("closed-early")
            .env("FAULTS_CASE", case).env("NCCL_SOCKET_IFNAME", "lo").timeout_s(45);
        match link {
            "sockets" => job = job.env("NCCL_SHM_DISABLE", "1"),
            "hosts" => job = job.proc_env(0, "NCCL_HOSTID", "host-a").proc_env(1, "NCCL_HOSTID", "host-b"),
            _ => {}
        }
        let o = job.run_outcome();
        judge(&format!("rank_that_destroyed_its_communicator_before_connecting_is_named ({procs}x{local}, {link}, {case})"),
              &o, o.ok(), String::new());
    }
}

/// A small send completes before its receiver has connected, and the sender destroys its
/// communicator: the receive, made only then, still gets the data (before: the sender's
/// destroy removed the shared-memory ring that held it, and the receive failed with "shm:
/// open ...: No such file"), over shared memory, sockets and the ring between ranks of one
/// process. A receiver that never receives leaves no ring file behind in /dev/shm.
#[test]
fn a_send_completed_before_its_receiver_connected_outlives_the_senders_communicator() {
    let cases = [(2, 1, "shm", "receive"), (2, 1, "sockets", "receive"), (1, 2, "", "receive"), (2, 1, "shm", "never")];
    for (procs, local, link, case) in cases {
        let mut job = Job::new("faults").procs(procs).local(local).arg("--only").arg("sent-early")
            .env("FAULTS_CASE", case).env("NCCL_SOCKET_IFNAME", "lo").timeout_s(45);
        if link == "sockets" {
            job = job.env("NCCL_SHM_DISABLE", "1");
        }
        let o = job.run_outcome();
        judge(&format!("a_send_completed_before_its_receiver_connected ({procs}x{local}, {link}, {case})"),
              &o, o.ok(), String::new());
    }
}

/// Runs part `part` of faults.c as `procs` processes at WARN; the late rank it holds back is
/// let go (the flag "go") once process `proc` has said `marker`. Every call must succeed.
fn late_rank_let_go(name: &str, part: &str, procs: usize, proc: usize, marker: &str) {
    let mut job = Job::new("faults").procs(procs).arg("--only").arg(part).env("NCCL_DEBUG", "WARN").timeout_s(60);
    let go = job.dir().join("unique-id.flag-go");
    let o = job
        .on(When::marker(proc, marker), move || {
            std::fs::write(&go, b"go").map_or_else(|e| format!("go: {e}"), |_| "go".to_string())
        })
        .run_outcome();
    judge(name, &o, o.ok(), String::new());
}

/// Sends and receives of different pairs are not ordered: rank 0's send to rank 1 waits
/// while rank 1 first receives from a late rank 2. Rank 0 says at WARN that rank 1 is in a
/// receive from rank 2, and on that line rank 2 is let go; every call succeeds, exact
/// (before: rank 0 took rank 1's other receive for a mismatch and failed).
#[test]
fn a_rank_receiving_from_a_late_third_rank_is_not_a_mismatch() {
    late_rank_let_go("a_rank_receiving_from_a_late_third_rank_is_not_a_mismatch", "p2p-order", 3, 0,
                     "it is in a receive of 40 bytes from rank 2");
}

/// A collective held up by a rank that has not issued it: every rank waiting names that
/// rank at WARN, those that wait on it directly and those that wait on ranks it holds up (they
/// ask those ranks, whose status answers carry whom they wait for; before, only the late
/// rank's direct peers said anything). 4 processes; rank 3 is let go once ranks 0 to 2 have
/// each said so, then the all-reduce completes, exact.
#[test]
fn every_rank_names_the_rank_holding_up_a_collective() {
    let o = held_up(4);
    judge("every_rank_names_the_rank_holding_up_a_collective", &o.0, o.1, o.2);
}

/// The same along long chains of ranks that each wait on the next: 24 processes, rank 23 late.
/// Each rank names it within 8 s of waiting: a rank asks along what the ranks it reaches say
/// they reached, not only its peer. Before, the news went back one rank per look (2 s): the
/// ranks furthest along the chains named it 13 s in.
#[test]
fn a_long_chain_of_ranks_names_the_rank_holding_it_up_within_seconds() {
    let (o, all, warned) = held_up(24);
    // "... waited 3.1 s in AllReduce #0 ...": the first line of each rank naming rank 23.
    let slow = named_late(&o, 0..23, 8.0, |l| l.contains("rank 23 ("));
    judge("a_long_chain_of_ranks_names_the_rank_holding_it_up_within_seconds", &o, all && slow.is_empty(),
          format!("  named late or not at all: {slow:?}\n{warned}"));
}

/// `faults --only held-up` on `procs` processes: the last is let go once every other has named
/// it, then all complete. The outcome, whether it went so (and every rank named the last), and
/// the WARN lines.
fn held_up(procs: usize) -> (Outcome, bool, String) {
    let late = procs - 1;
    let job = Job::new("faults").procs(procs).arg("--only").arg("held-up").env("NCCL_DEBUG", "WARN").timeout_s(60);
    let o = go_once_all_said(job, (0..late).map(|p| (p, format!("rank {late} ("))).collect());
    // Each names the late rank, itself or as the rank holding its peer up.
    let names_late = |log: &str| log.lines().any(|l| {
        l.contains("NCCL WARN") && l.contains("which has not issued that call")
            && (l.contains(&format!("in AllReduce #0 (count 1048576, int32, sum) for rank {late} ("))
                || l.contains(&format!("which runs that call too and is held up by rank {late} (")))
    });
    let all = o.ok() && (0..late).all(|p| names_late(&o.procs[p].log));
    let warned = warn_lines(&o);
    (o, all, warned)
}

/// Of processes `procs`, those whose first WARN line that `names` the culprit says it waited
/// `limit` s or more ("... waited 3.1 s in ..."), or that have none: "rank P: its wait".
fn named_late(o: &Outcome, procs: std::ops::Range<usize>, limit: f64, names: impl Fn(&str) -> bool) -> Vec<String> {
    let waited = |log: &str| log.lines().find(|l| l.contains("NCCL WARN") && names(l)).and_then(waited_secs);
    procs.filter_map(|p| match waited(&o.procs[p].log) {
        Some(s) if s < limit => None,
        s => Some(format!("rank {p}: {s:?} s")),
    }).collect()
}

/// Run `job`, setting its flag "go" once each of `said` (a process, a marker) has printed its
/// marker.
fn go_once_all_said(mut job: Job, said: Vec<(usize, String)>) -> Outcome {
    let go = job.dir().join("unique-id.flag-go");
    let (count, all) = (Arc::new(AtomicUsize::new(0)), said.len());
    for (proc, marker) in said {
        let (go, count) = (go.clone(), count.clone());
        job = job.on(When::marker(proc, &marker), move || {
            if count.fetch_add(1, Ordering::AcqRel) + 1 < all {
                return "said".to_string();
            }
            std::fs::write(&go, b"go").map_or_else(|e| format!("go: {e}"), |_| "go".to_string())
        });
    }
    job.run_outcome()
}

/// Every process's WARN lines, indented, for a report.
fn warn_lines(o: &Outcome) -> String {
    o.procs.iter().flat_map(|p| p.log.lines().filter(|l| l.contains("NCCL WARN"))).map(|l| format!("  {l}\n")).collect()
}

/// A pipeline's forward pass of 6 stages (processes) whose first is late: each stage receives
/// from the one before, which is in its own receive. Every stage names rank 0 as what holds it
/// up (rank 1 directly; the others through the note of the rank before them), then rank 0 is
/// let go and every stage's data is exact. Before, each named only the rank before it, which
/// "waits on that rank", and the job timed out.
#[test]
fn every_stage_of_a_pipeline_names_the_late_first_stage() {
    let (o, all, warned) = pipeline_late(6);
    judge("every_stage_of_a_pipeline_names_the_late_first_stage", &o, all, warned);
}

/// `faults --only pipeline-late` on `procs` processes: rank 0 is let go once every other stage
/// has named it, then all complete. The outcome, whether it went so (and every stage named
/// rank 0), and the WARN lines.
fn pipeline_late(procs: usize) -> (Outcome, bool, String) {
    let job = Job::new("faults").procs(procs).arg("--only").arg("pipeline-late").env("NCCL_DEBUG", "WARN").timeout_s(60);
    let marker = |p: usize| if p == 1 { "for rank 0 (" } else { "held up by rank 0 (" }.to_string();
    let o = go_once_all_said(job, (1..procs).map(|p| (p, marker(p))).collect());
    let names_first = |log: &str| log.lines().any(|l| {
        l.contains("NCCL WARN") && (l.contains("for rank 0 (") || l.contains("held up by rank 0 ("))
            && l.contains("which has not issued that call")
    });
    let all = o.ok() && (1..procs).all(|p| names_first(&o.procs[p].log));
    let warned = warn_lines(&o);
    (o, all, warned)
}

/// The same along a pipeline of 24 stages: each stage names rank 0 within 6 s of waiting. A
/// stage asks along the notes of the stages before it (each the furthest it reached), not only
/// its neighbour's; before, the news went back a few stages per look: of 32 stages, the last
/// named rank 0 after 13 s (3 s now).
#[test]
fn a_long_pipeline_names_its_late_first_stage_within_seconds() {
    let (o, all, warned) = pipeline_late(24);
    let slow = named_late(&o, 1..24, 6.0, |l| l.contains("for rank 0 (") || l.contains("held up by rank 0 ("));
    judge("a_long_pipeline_names_its_late_first_stage_within_seconds", &o, all && slow.is_empty(),
          format!("  named late or not at all: {slow:?}\n{warned}"));
}

/// A peer in a call on another communicator that a third rank holds up: rank 0, receiving
/// from rank 1, which all-reduces first with a late rank 2 on a communicator of their own,
/// names rank 2 as what holds rank 1 up there, without the different-orders hint (the
/// other communicator's note of what holds it up comes with the peer's answer). Rank 2 is
/// let go on that line; then every call succeeds, exact.
#[test]
fn a_peer_held_up_on_another_communicator_is_named_with_what_holds_it() {
    let mut job = Job::new("faults").procs(3).arg("--only").arg("held-elsewhere").env("NCCL_DEBUG", "WARN")
        .timeout_s(60);
    let (recv, go) = (job.dir().join("unique-id.flag-recv"), job.dir().join("unique-id.flag-go"));
    let flag = |path: PathBuf| move || std::fs::write(&path, b"go").map_or_else(|e| format!("flag: {e}"), |_| "set".into());
    let o = job
        .on(When::marker(1, "which has not issued that call"), flag(recv))
        .on(When::marker(0, "held up there by rank 1 ("), flag(go))
        .run_outcome();
    let line = o.procs[0].log.lines().find(|l| l.contains("NCCL WARN") && l.contains("held up there by")).unwrap_or("");
    let named = line.contains("for rank 1 (") && line.contains("its process is in AllReduce #0")
        && line.contains("which has not issued that call") && !line.contains("different orders");
    judge("a_peer_held_up_on_another_communicator_is_named_with_what_holds_it", &o, o.ok() && named,
          format!("  {line}\n"));
}

/// A rank in ncclWaitSignal, waiting for a sender whose process is stopped: a peer waiting
/// on it says it is in ncclWaitSignal waiting for that sender's signal (before: that it had not
/// issued the call), and it says, about 2 s in, that the sender's process is stopped (before:
/// only after 10 s, without why). Rank 2 is resumed once both are said; every call completes.
#[test]
fn a_rank_waiting_for_signals_and_its_stopped_sender_are_named() {
    let mut job = Job::new("faults").procs(3).arg("--only").arg("signal-wait").env("NCCL_DEBUG", "WARN").timeout_s(60);
    let pid_file = job.dir().join("unique-id.flag-pid");
    let said = Arc::new(AtomicUsize::new(0));
    for (proc, marker) in [(0, "it is in ncclWaitSignal, waiting for 0 of 1 signal(s) from rank 2"),
                           (1, "for signals from rank 2 (")] {
        let (pid_file, said) = (pid_file.clone(), said.clone());
        job = job.on(When::marker(proc, marker), move || {
            if said.fetch_add(1, Ordering::AcqRel) + 1 < 2 {
                return "said".to_string();
            }
            let pid = std::fs::read_to_string(&pid_file).unwrap_or_default();
            let sent = std::process::Command::new("kill").args(["-CONT", pid.trim()]).status();
            format!("SIGCONT to pid {} ({sent:?})", pid.trim())
        });
    }
    let o = job.run_outcome();
    let line = |p: usize, what: &str| o.procs[p].log.lines().find(|l| l.contains("NCCL WARN") && l.contains(what))
        .unwrap_or("").to_string();
    let (waiting, stopped) = (line(0, "ncclWaitSignal"), line(1, "its process is stopped"));
    let ok = o.ok() && waiting.contains("for rank 1 (") && stopped.contains("for signals from rank 2 (")
        && waited_secs(&stopped).is_some_and(|s| s < SILENT_AFTER_S);
    judge("a_rank_waiting_for_signals_and_its_stopped_sender_are_named", &o, ok, format!("  {waiting}\n  {stopped}\n"));
}

/// The same with rank 2's process on another host than rank 1's (`NCCL_HOSTID`: process 1 on
/// one, processes 0 and 2 on the other): rank 1, in ncclWaitSignal, asks rank 0 how rank 2's
/// process is and names it stopped, as rank 0 sees it, within seconds (before: after 10 s, as
/// a sender that does not answer). SIGCONT on that line; then every call completes, exact.
#[test]
fn a_stopped_sender_of_another_host_is_named_by_the_rank_waiting_for_its_signals() {
    let (o, line) = stopped_on_another_host("signal-wait", ["faults-host-b", "faults-host-a", "faults-host-b"], 1);
    let named = line.contains("for signals from rank 2 (") && line.contains("as rank 0, of its host, sees it")
        && waited_secs(&line).is_some_and(|s| s < SILENT_AFTER_S);
    judge("a_stopped_sender_of_another_host_is_named_by_the_rank_waiting_for_its_signals", &o, o.ok() && named,
          format!("  {line}\n"));
}

/// `faults --only part` on 3 processes with `NCCL_HOSTID`s `hosts`, process 2 stopping itself
/// and resumed once process `waiter` says its process is stopped: the outcome, and that line
/// of `waiter`'s (empty if none).
fn stopped_on_another_host(part: &str, hosts: [&str; 3], waiter: usize) -> (Outcome, String) {
    let mut job = Job::new("faults").procs(3).arg("--only").arg(part).env("NCCL_DEBUG", "WARN").timeout_s(60);
    for (proc, host) in hosts.into_iter().enumerate() {
        job = job.proc_env(proc, "NCCL_HOSTID", host);
    }
    let o = job.signal(2, "CONT", When::marker(waiter, "its process is stopped")).run_outcome();
    let line = o.procs[waiter].log.lines().find(|l| l.contains("NCCL WARN") && l.contains("its process is stopped"))
        .unwrap_or("").to_string();
    (o, line)
}

/// The benchmark in a mount namespace of its own whose /dev/shm is a tmpfs mounted with
/// `options` (`size=4k`; needs root, as the network-namespace tests: `NCCL_TEST_SKIP_NETNS=1`):
/// its exit status and output.
fn perf_with_dev_shm(options: &str, env: &[(&str, &str)], args: &[&str]) -> (std::process::ExitStatus, String) {
    let perf = env!("CARGO_BIN_EXE_nccl-rs-perf");
    let script = format!("mount -t tmpfs -o {options} tmpfs /dev/shm && exec \"$0\" \"$@\"");
    let out = std::process::Command::new("unshare")
        .args(["-m", "sh", "-c", &script, perf])
        .args(args)
        .envs(env.iter().copied())
        .env("NCCL_DEBUG", "WARN")
        .env_remove("NCCL_COMM_ID")
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .expect("run unshare");
    (out.status, format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// A /dev/shm with room for the header page of one ring of the six that three ranks'
/// all-to-all needs (a container's is 64 MB by default): the pairs that find none connect by
/// socket instead, said once at WARN with what to do, and every result is exact.
#[test]
fn a_dev_shm_without_room_for_a_ring_falls_back_to_sockets() {
    if skip_netns() {
        return;
    }
    let (status, text) = perf_with_dev_shm("size=4k", &[], &["alltoall", "-np", "3", "-b", "24", "-e", "48", "-n", "3"]);
    assert!(status.success(), "the all-to-all over a small /dev/shm failed:\n{text}");
    assert!(text.contains("Out of bounds values : 0 OK"), "wrong results:\n{text}");
    assert!(text.contains("/dev/shm has no room for a ring") && text.contains("sockets instead"),
            "no WARN says the pairs took sockets, and why:\n{text}");
}

/// A read-only /dev/shm (a sandbox's): the processes of the host talk TCP, said once at WARN,
/// and every result is exact. Before, the first collective failed: "shm: create
/// /dev/shm/...: Read-only file system".
#[test]
fn a_read_only_dev_shm_is_left_for_sockets() {
    if skip_netns() {
        return;
    }
    let (status, text) = perf_with_dev_shm("size=1m,ro", &[], &["allreduce", "-np", "3", "-b", "8", "-e", "1M", "-f", "16", "-n", "3"]);
    assert!(status.success(), "the all-reduce beside a read-only /dev/shm failed:\n{text}");
    assert!(text.contains("Out of bounds values : 0 OK"), "wrong results:\n{text}");
    assert!(text.contains("/dev/shm cannot hold shared-memory rings (Read-only file system"),
            "no WARN says why the processes talk TCP:\n{text}");
}

/// A ring whose messages outgrow the room /dev/shm has left (16 KiB; copies through the ring,
/// NCCL_CMA_DISABLE=1): the call fails with ncclSystemError saying /dev/shm is too small and
/// what to do. Before: the rank writing past the room died of SIGBUS, saying nothing.
#[test]
fn a_dev_shm_too_small_for_the_messages_is_an_error_not_sigbus() {
    if skip_netns() {
        return;
    }
    let (status, text) = perf_with_dev_shm("size=16k", &[("NCCL_CMA_DISABLE", "1")],
                                                 &["allreduce", "-np", "2", "-b", "4M", "-e", "4M", "-n", "3"]);
    assert!(!status.success(), "a 4 MB all-reduce through a 16 KiB /dev/shm succeeded:\n{text}");
    assert!(!text.contains("killed by signal"), "a rank died of a signal:\n{text}");
    assert!(text.contains("(ncclResult 2)") && text.contains("no room for") && text.contains("--shm-size"),
            "no ncclSystemError says /dev/shm is too small and what to do:\n{text}");
}

/// A rank whose process is stopped (SIGSTOP) while its peer waits on it, before the two are
/// connected (the wait for a first connection) and after (the progress engine): the waiting
/// rank says at WARN, once a status request has gone unanswered (about 2 s in; it was 12 s,
/// and a rank stopped for less was named, once resumed, as one that had not issued the call),
/// that rank 1 does not answer and that its process is stopped (before: nothing, for ever);
/// sent SIGCONT then, both all-reduces complete, exact.
#[test]
fn a_stopped_peer_process_is_named() {
    for case in ["cold", "warm"] {
        let mut job = Job::new("faults").procs(2).arg("--only").arg("stopped").env("FAULTS_CASE", case)
            .env("NCCL_DEBUG", "WARN").timeout_s(60);
        let pid_file = job.dir().join("unique-id.flag-pid");
        let o = job
            .on(When::marker(0, "its process is stopped"), move || {
                let pid = std::fs::read_to_string(&pid_file).unwrap_or_default();
                let sent = std::process::Command::new("kill").args(["-CONT", pid.trim()]).status();
                format!("SIGCONT to pid {} ({sent:?})", pid.trim())
            })
            .run_outcome();
        // Named before the 10 s after which a peer that merely does not answer is.
        let named = o.procs[0].log.lines().any(|l| {
            l.contains("NCCL WARN") && l.contains("for rank 1") && l.contains("which has not answered")
                && l.contains("its process is stopped")
                && waited_secs(l).is_some_and(|s| s < SILENT_AFTER_S)
        });
        judge(&format!("a_stopped_peer_process_is_named ({case})"), &o, o.ok() && named, String::new());
    }
}

/// The same with the stopped process on another host (NCCL_HOSTID: process 0 on one, 1 and 2
/// on the other): rank 0, receiving from the stopped rank 2, cannot see its process, and asks
/// rank 1, of rank 2's host, how it is. It must say that rank 2's process is stopped, as rank 1
/// sees it, before the 10 s after which a peer that merely does not answer is named (before:
/// only then, and only that its host did not answer). SIGCONT then; the data is exact.
#[test]
fn a_stopped_process_of_another_host_is_named_as_a_rank_there_sees_it() {
    let (o, line) = stopped_on_another_host("stopped-remote", ["faults-host-a", "faults-host-b", "faults-host-b"], 0);
    let named = line.contains("for rank 2 (") && line.contains("as rank 1, of its host, sees it")
        && waited_secs(&line).is_some_and(|s| s < SILENT_AFTER_S);
    judge("a_stopped_process_of_another_host_is_named_as_a_rank_there_sees_it", &o, o.ok() && named,
          format!("  {line}\n"));
}

/// The seconds a WARN line says its rank "waited".
fn waited_secs(line: &str) -> Option<f64> {
    line.split_once(" waited ")?.1.split_once(" s ")?.0.parse().ok()
}

/// `SILENT_AFTER` of `src/comm`, in seconds: a peer that does not answer status requests (and
/// whose process is not stopped) is named after this long.
const SILENT_AFTER_S: f64 = 10.0;

/// A survivor that failed and exited is not a culprit: rank 1 exits while rank 2 is stopped;
/// rank 0 fails naming rank 1, tells the others so, and ends; once its process is gone rank 2
/// is sent SIGCONT and fails too, finding ranks 0 and 1 gone. It must name rank 1 first and
/// rank 0 as gone after failing itself (the C program checks its own error). Before, both
/// were named alike, in rank order, the bystander first.
///
/// Over sockets rank 0 has no receive from rank 1 before rank 2's part, and its send to it
/// waits on that: it learns rank 1 is gone from the socket's end, seen while it waits.
/// And with a send and a receive in place of the all-reduce (FAULTS_CASE=p2p): rank 0's send
/// to rank 1 is all written before it waits on rank 2; over sockets only the reset it draws
/// says rank 1 never read it.
#[test]
fn a_survivor_gone_after_failing_is_not_named_the_culprit() {
    for case in ["allreduce", "p2p"] {
        for socket in [false, true] {
            survivor_gone_after_failing(case, socket);
        }
    }
}

fn survivor_gone_after_failing(case: &str, socket: bool) {
    let mut job = Job::new("faults").procs(3).arg("--only").arg("culprit").env("FAULTS_CASE", case).timeout_s(60);
    if socket {
        job = job.env("NCCL_SHM_DISABLE", "1");
    }
    let (pid0, pid2) = (job.dir().join("unique-id.flag-pid-0"), job.dir().join("unique-id.flag-pid-2"));
    let o = job
        .on(When::marker(0, "ENDING"), move || {
            let read = |f: &std::path::Path| std::fs::read_to_string(f).unwrap_or_default().trim().to_string();
            let (p0, p2) = (read(&pid0), read(&pid2));
            // Process 0 is gone once a zombie (this harness reaps it after this returns).
            let deadline = std::time::Instant::now() + Duration::from_secs(20);
            let gone = || std::fs::read_to_string(format!("/proc/{p0}/stat"))
                .map_or(true, |s| s.rsplit(')').next().is_some_and(|rest| rest.trim_start().starts_with('Z')));
            while !gone() && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            let sent = std::process::Command::new("kill").args(["-CONT", &p2]).status();
            format!("process 0 (pid {p0}) gone: {}; SIGCONT to pid {p2} ({sent:?})", gone())
        })
        .run_outcome();
    let name = format!("a_survivor_gone_after_failing_is_not_named_the_culprit ({case}, {})",
                       if socket { "sockets" } else { "shm" });
    judge(&name, &o, o.ok(), String::new());
}

/// Two ranks that call two communicators in different orders wait for each other for ever:
/// each must say at WARN that the other has not issued its call and name the call the other's
/// process is in instead (the other communicator's all-reduce, with its id). Before: only
/// "which has not issued that call". Then both abort.
#[test]
fn ranks_calling_communicators_in_different_orders_are_told_so() {
    let mut job = Job::new("faults").procs(2).arg("--only").arg("crossed").env("NCCL_DEBUG", "WARN").timeout_s(50);
    for p in 0..2 {
        let release = job.dir().join(format!("unique-id.flag-release-{p}"));
        job = job.on(When::marker(p, "its process is in AllReduce"), move || {
            std::fs::write(&release, b"go").map_or_else(|e| format!("release: {e}"), |_| format!("released {p}"))
        });
    }
    let o = job.run_outcome();
    let named = |p: usize, other: usize| {
        o.procs[p].log.lines().any(|l| {
            l.contains("NCCL WARN") && l.contains(&format!("for rank {other} ")) && l.contains("its process is in AllReduce #0")
                && l.contains(&format!("as rank {other} of 2")) && l.contains("different orders")
        })
    };
    let ok = o.ok() && named(0, 1) && named(1, 0);
    judge("ranks_calling_communicators_in_different_orders_are_told_so", &o, ok, String::new());
}

// ---- ncclCommAbort from another thread ------------------------------------------------

/// Rank 0 blocks in an allreduce rank 1 never joins; a second thread aborts after 1 s; the
/// call must return within 1 s of the abort, and a new communicator (new id) must work.
fn abort_from_thread(name: &str, socket: bool) {
    let mut job = Job::new("faults")
        .procs(2)
        .arg("--only")
        .arg("abort")
        .env("NCCL_SOCKET_IFNAME", "lo")
        .timeout_s(45);
    if socket {
        job = job.env("NCCL_SHM_DISABLE", "1");
    }
    let o = job.run_outcome();
    judge(name, &o, o.ok(), String::new());
}

#[test]
fn abort_from_another_thread_unblocks_allreduce_shm() {
    abort_from_thread("abort_from_another_thread_unblocks_allreduce_shm", false);
}

#[test]
fn abort_from_another_thread_unblocks_allreduce_socket() {
    abort_from_thread("abort_from_another_thread_unblocks_allreduce_socket", true);
}

/// A nonblocking communicator waiting in init for a rank that never comes: ncclCommAbort
/// returns within 1 s, and a new communicator works afterwards.
#[test]
fn abort_during_nonblocking_init() {
    let o = Job::new("faults")
        .arg("--only")
        .arg("abort-init")
        .env("NCCL_SOCKET_IFNAME", "lo")
        .timeout_s(30)
        .run_outcome();
    judge("abort_during_nonblocking_init", &o, o.ok(), String::new());
}

// ---- a link cut between two hosts -------------------------------------------------------

/// Two hosts of one rank each loop over allreduces; host 1's interface goes down. With
/// NCCL_PEER_TIMEOUT_S=10 both ranks must fail (naming the other rank) within 25 s.
#[test]
fn link_down_between_two_hosts() {
    if skip_netns() {
        return;
    }
    let hosts = Hosts::up("link", 2, &[]);
    let mut cut = hosts.link_command(1, false);
    let o = Job::new("faults")
        .procs(2)
        .arg("--only")
        .arg("loop")
        .env("NCCL_PEER_TIMEOUT_S", "10")
        .env("FAULTS_BOUND_S", "25")
        .env("FAULTS_MAX_S", "28")
        .on_host(0, &hosts, 0)
        .on_host(1, &hosts, 1)
        .proc_env(0, "FAULTS_LOST_RANK", "1")
        .proc_env(1, "FAULTS_LOST_RANK", "0")
        .on(When::marker(0, "LOOPING").then_ms(50), move || match cut.output() {
            Ok(out) if out.status.success() => "link of host 1 set down".to_string(),
            Ok(out) => format!("link down FAILED: {}", String::from_utf8_lossy(&out.stderr)),
            Err(e) => format!("link down FAILED: {e}"),
        })
        .timeout_s(45)
        .run_outcome();
    let cut_at = o.fired[0];
    let after: Vec<Option<Duration>> = o
        .procs
        .iter()
        .map(|p| match (cut_at, p.exited_at) {
            (Some(c), Some(e)) => Some(e.saturating_sub(c)),
            _ => None,
        })
        .collect();
    let within = after.iter().all(|d| d.is_some_and(|d| d <= Duration::from_secs(27)));
    let summary = format!(
        "  link cut at {}; rank 0 exited {} after it, rank 1 {} after it\n",
        secs(cut_at),
        secs(after[0]),
        secs(after[1])
    );
    judge("link_down_between_two_hosts", &o, o.ok() && cut_at.is_some() && within, summary);
}

// ---- mismatched calls ------------------------------------------------------------------

/// Rank 0 and rank 1 make different calls: both must return an error (ncclInvalidUsage)
/// whose text names both calls; nothing hangs.
fn mismatch(case: &str) {
    mismatch_of(case, 2);
}

/// With `procs` ranks, only rank 1 making the other call: every rank gets ncclInvalidUsage
/// naming both calls, rank 2 (which matches rank 0) included.
fn mismatch_of(case: &str, procs: usize) {
    let o = Job::new("faults")
        .procs(procs)
        .arg("--only")
        .arg("mismatch")
        .env("NCCL_SOCKET_IFNAME", "lo")
        .env("FAULTS_CASE", case)
        .timeout_s(30)
        .run_outcome();
    judge(&format!("mismatch_{case} on {procs} ranks"), &o, o.ok(), String::new());
}

/// The same over TCP (NCCL_SHM_DISABLE=1), where a receive of its own size reads the bytes
/// straight from the socket into its buffer once the message's stamp is accepted: a call of
/// another collective, count, datatype or root is still named on both ranks.
#[test]
fn mismatch_over_sockets() {
    for case in ["coll", "count", "dtype", "root"] {
        let o = Job::new("faults").procs(2).arg("--only").arg("mismatch").env("NCCL_SOCKET_IFNAME", "lo")
            .env("NCCL_SHM_DISABLE", "1").env("FAULTS_CASE", case).timeout_s(30).run_outcome();
        judge(&format!("mismatch_{case} over sockets"), &o, o.ok(), String::new());
    }
}

#[test]
fn mismatch_collective_3_ranks() {
    mismatch_of("coll", 3);
}

#[test]
fn mismatch_count_3_ranks() {
    mismatch_of("count", 3);
}

#[test]
fn mismatch_reduce_root_3_ranks() {
    mismatch_of("reduce_root", 3);
}

#[test]
fn mismatch_op_4_ranks() {
    mismatch_of("op", 4);
}

/// AllReduce(1024, float, sum) against AllGather(2048, float).
#[test]
fn mismatch_collective() {
    mismatch("coll");
}

/// AllReduce of 1024 against 2048 floats.
#[test]
fn mismatch_count() {
    mismatch("count");
}

/// AllReduce of float against int32.
#[test]
fn mismatch_datatype() {
    mismatch("dtype");
}

/// AllReduce sum against max.
#[test]
fn mismatch_op() {
    mismatch("op");
}

/// Broadcast from root 0 against root 1.
#[test]
fn mismatch_root() {
    mismatch("root");
}

/// Two ranks that both think they are Reduce's root both wait to receive: the watchdog asks
/// the peer what it runs and turns the would-be hang into an error naming both calls.
#[test]
fn mismatch_reduce_root() {
    mismatch("reduce_root");
}

#[test]
fn mismatch_gather_root() {
    mismatch("gather_root");
}

/// Each rank sends to the other outside a group and receives nothing (the classic way to
/// deadlock with NCCL), or each only receives: both get ncclInvalidUsage saying each sends to
/// (receives from) the other and what to do, instead of waiting for ever.
#[test]
fn mismatch_both_send() {
    mismatch("both_send");
}

#[test]
fn mismatch_both_recv() {
    mismatch("both_recv");
}

/// Round 3 ranks, each sends 16 MiB to the next outside a group (round 4, each receives from
/// the next): every rank gets ncclInvalidUsage naming the cycle and what to do (NCCL hangs).
#[test]
fn mismatch_cycle_send_3_ranks() {
    mismatch_of("cycle_send", 3);
}

#[test]
fn mismatch_cycle_recv_4_ranks() {
    mismatch_of("cycle_recv", 4);
}

/// A ring of sends that a late rank 0 unwinds (it receives first, once rank 1 has said at WARN
/// that rank 2 waits in a send to rank 3): a chain, not a cycle, so every call succeeds, exact.
#[test]
fn a_ring_of_sends_a_late_rank_unwinds_is_not_a_cycle() {
    late_rank_let_go("a_ring_of_sends_a_late_rank_unwinds_is_not_a_cycle", "ring-late", 4, 1,
                     "it is in a send of 16777216 bytes to rank 3");
}

/// Rank 1's group has received rank 2's 16 MiB and waits to send to a late rank 0; rank 2 now
/// receives from rank 1. Rank 1 shows only its send as running, so rank 2 sees no crossed
/// receives (before: rank 2's valid receive failed, "each receives from the other"); it names
/// the send at WARN, rank 0 is let go on that line, and every call succeeds, exact.
#[test]
fn a_receive_done_in_a_group_waiting_on_a_late_rank_is_not_crossed() {
    late_rank_let_go("a_receive_done_in_a_group_waiting_on_a_late_rank_is_not_crossed", "p2p-done", 3, 2,
                     "it is in a send of 16777216 bytes to rank 0");
}

/// Rank 0's group has finished its all-reduce and waits to send to a late rank 2; rank 1, past
/// the all-reduce, waits to receive from rank 0. Rank 0 no longer shows the finished
/// all-reduce, so rank 1 sees no mismatch (before: its valid receive failed, "rank 0 issued
/// AllReduce #0 where rank 1 issued a receive"); it names the send at WARN, rank 2 is let go on
/// that line, and every call succeeds, exact.
#[test]
fn a_collective_done_in_a_group_waiting_on_a_late_rank_is_not_a_mismatch() {
    late_rank_let_go("a_collective_done_in_a_group_waiting_on_a_late_rank_is_not_a_mismatch", "coll-done", 3, 1,
                     "it is in a send of 16777216 bytes to rank 2");
}

/// Three ranks group an all-reduce with a send and a receive (a ring shift); rank 0 is late.
/// Rank 1, waiting on rank 2 for its receive, finds rank 2 in the all-reduce both issued: behind,
/// not a mismatch (before: the valid group failed, "rank 2 issued AllReduce #1 where rank 1
/// issued a receive of 4 bytes"). Rank 0 is let go once rank 1 has said it waits for it, and
/// every call succeeds, exact.
#[test]
fn a_peer_in_a_collective_both_issued_is_not_a_mismatch() {
    late_rank_let_go("a_peer_in_a_collective_both_issued_is_not_a_mismatch", "group-late", 3, 1,
                     "which has not issued that call");
}

/// A send of 1024 floats received as 512: the receiver names both sizes (a send and its
/// receive carry the same stamp, so the message must say which side is which).
#[test]
fn mismatch_p2p_size() {
    mismatch("p2p_size");
}

// ---- hostile input on the bootstrap root --------------------------------------------------

#[derive(Default, Debug)]
struct AttackStats {
    rounds: u64,
    refused: u64,
    garbage_sent: u64,
    closed_at_once: u64,
    half_open: u64,
    partial_frames: u64,
    /// The most silent connections held open at once.
    peak_idle: usize,
}

struct Attack {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<AttackStats>,
}

impl Attack {
    /// Until stopped: every 10 ms, connect to the root (once `target` knows it) and send
    /// garbage, connect and close at once, and, while fewer than `keep_idle` silent
    /// connections are open, connect `burst` times and send nothing and connect once and
    /// send half a frame. Silent connections stay open until the attack stops, as a peer
    /// that vanished or a port scanner that never closes would leave them.
    fn start(
        target: impl Fn() -> Option<SocketAddr> + Send + 'static,
        keep_idle: usize,
        burst: usize,
    ) -> Attack {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut stats = AttackStats::default();
            let mut idle: Vec<TcpStream> = Vec::new();
            let mut seed = 0x9e37_79b9_7f4a_7c15u64;
            let mut cached = None;
            while !flag.load(Ordering::Relaxed) {
                if cached.is_none() {
                    cached = target();
                }
                let Some(addr) = cached else {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                };
                stats.rounds += 1;
                let connect = || TcpStream::connect_timeout(&addr, Duration::from_millis(200));
                match connect() {
                    Ok(mut s) => {
                        let _ = s.set_write_timeout(Some(Duration::from_millis(200)));
                        let _ = s.write_all(&garbage(stats.rounds, &mut seed));
                        stats.garbage_sent += 1;
                    }
                    Err(_) => {
                        stats.refused += 1;
                        std::thread::sleep(Duration::from_millis(10));
                        continue;
                    }
                }
                if connect().is_ok() {
                    stats.closed_at_once += 1;
                }
                for _ in 0..burst {
                    if idle.len() >= keep_idle {
                        break;
                    }
                    if let Ok(s) = connect() {
                        idle.push(s);
                        stats.half_open += 1;
                    }
                }
                if idle.len() < keep_idle {
                    if let Ok(mut s) = connect() {
                        // A frame that announces 1000 bytes and delivers 10.
                        let mut half = 1000u32.to_le_bytes().to_vec();
                        half.extend_from_slice(&[1u8; 10]);
                        let _ = s.write_all(&half);
                        idle.push(s);
                        stats.partial_frames += 1;
                    }
                }
                stats.peak_idle = stats.peak_idle.max(idle.len());
                std::thread::sleep(Duration::from_millis(10));
            }
            stats
        });
        Attack { stop, thread }
    }

    fn stop(self) -> AttackStats {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().expect("attack thread panicked")
    }
}

/// Five kinds of garbage in turn: random bytes, a huge length, a hello with a wrong magic,
/// an empty frame, a length just under the 16 MiB frame limit followed by nothing.
fn garbage(round: u64, seed: &mut u64) -> Vec<u8> {
    let mut random = |n: usize| -> Vec<u8> {
        (0..n)
            .map(|_| {
                *seed ^= *seed << 13;
                *seed ^= *seed >> 7;
                *seed ^= *seed << 17;
                *seed as u8
            })
            .collect()
    };
    match round % 5 {
        0 => random(64),
        1 => vec![0xff; 8],
        2 => {
            let mut body = vec![1u8];
            body.extend_from_slice(&0x0123_4567_89ab_cdefu64.to_le_bytes());
            body.extend_from_slice(&random(40));
            let mut f = (body.len() as u32).to_le_bytes().to_vec();
            f.extend_from_slice(&body);
            f
        }
        3 => vec![0, 0, 0, 0],
        _ => ((16u32 << 20) - 1).to_le_bytes().to_vec(),
    }
}

/// The root's address inside a unique id: [10..12] port (little-endian), [12] IP version,
/// [16..20] IPv4 address.
fn root_of_id_file(path: &Path) -> Option<SocketAddr> {
    let b = std::fs::read(path).ok()?;
    if b.len() < 128 || b[12] != 4 {
        return None;
    }
    let port = u16::from_le_bytes([b[10], b[11]]);
    Some(SocketAddr::new(IpAddr::V4(Ipv4Addr::new(b[16], b[17], b[18], b[19])), port))
}

/// A 4-rank init and allreduce while the root is attacked; ranks 1-3 start 1 s late, so the
/// attack is under way before they arrive. The job must succeed. `keep_idle` silent
/// connections stay open (opened `burst` per round).
fn hostile(name: &str, comm_id: bool, keep_idle: usize, burst: usize) {
    let mut job = Job::new("faults")
        .procs(4)
        .arg("--only")
        .arg("hello")
        .env("NCCL_SOCKET_IFNAME", "lo")
        .delay_start_ms(1, 1000)
        .delay_start_ms(2, 1000)
        .delay_start_ms(3, 1000)
        .timeout_s(40);
    let attack = if comm_id {
        let addr: SocketAddr = format!("127.0.0.1:{}", free_tcp_port()).parse().unwrap();
        job = job.env("NCCL_COMM_ID", &addr.to_string());
        Attack::start(move || Some(addr), keep_idle, burst)
    } else {
        let id_file: PathBuf = job.dir().join("unique-id");
        Attack::start(move || root_of_id_file(&id_file), keep_idle, burst)
    };
    let o = job.run_outcome();
    let stats = attack.stop();
    let reached = stats.garbage_sent > 0;
    let summary = format!("  attack: {stats:?}\n");
    judge(name, &o, o.ok() && reached, summary);
}

#[test]
fn hostile_connections_to_root_from_unique_id() {
    hostile("hostile_connections_to_root_from_unique_id", false, 32, 1);
}

#[test]
fn hostile_connections_to_root_nccl_comm_id() {
    hostile("hostile_connections_to_root_nccl_comm_id", true, 32, 1);
}

/// A flood: 400 silent connections held open while the ranks arrive. A root may cap how
/// many connections it waits on, but a rank that says hello at once must still get in.
#[test]
fn hostile_flood_of_half_open_connections() {
    hostile("hostile_flood_of_half_open_connections", false, 400, 40);
}

/// An IPv6 link-local address of this host with its interface ("fe80::1%eth0"), from
/// /proc/net/if_inet6 (address, index, prefix, scope 0x20 = link, flags, name).
fn link_local_address() -> Option<String> {
    let table = std::fs::read_to_string("/proc/net/if_inet6").ok()?;
    table.lines().find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 6 || f[3] != "20" || f[0].len() != 32 {
            return None;
        }
        let groups: Vec<u16> = (0..8).filter_map(|g| u16::from_str_radix(&f[0][g * 4..g * 4 + 4], 16).ok()).collect();
        let ip = std::net::Ipv6Addr::from(<[u16; 8]>::try_from(groups).ok()?);
        Some(format!("{ip}%{}", f[5]))
    })
}

/// NCCL_COMM_ID with a scoped IPv6 address, `[fe80::…%eth0]:port`, as NVIDIA's takes it: the
/// job runs over it. Before: "does not resolve". (A host without a link-local address runs
/// it over `[::1%lo]`, which goes through the same scoped parsing.)
#[test]
fn nccl_comm_id_takes_a_scoped_ipv6_address() {
    let host = link_local_address().unwrap_or_else(|| "::1%lo".into());
    let addr = format!("[{host}]:{}", free_tcp_port());
    let o = Job::new("faults").procs(2).arg("--only").arg("hello").env("NCCL_COMM_ID", &addr)
        .env("NCCL_DEBUG", "WARN").timeout_s(30).run_outcome();
    judge("nccl_comm_id_takes_a_scoped_ipv6_address", &o, o.ok(), format!("  NCCL_COMM_ID={addr}\n"));
}

// ---- NCCL_COMM_ID's port held by another program -------------------------------------------

/// Another program listens at NCCL_COMM_ID's address and never answers (held by this test).
fn foreign_listener() -> (std::net::TcpListener, String) {
    // (A port found free may be taken by a test running beside this one before it is bound
    // again: another is tried. The clean-clone run of the suite failed once on it.)
    for _ in 0..50 {
        let addr = format!("127.0.0.1:{}", free_tcp_port());
        if let Ok(l) = std::net::TcpListener::bind(&addr) {
            return (l, addr);
        }
    }
    panic!("no port could be bound for the foreign listener");
}

/// ncclCommInitAll of 3 ranks while another program holds NCCL_COMM_ID's port: rank 0 cannot
/// host the root, and ranks 1 and 2, which reached the other program instead, stop too
/// instead of waiting for an answer forever (they did: the call hung). The call returns rank
/// 0's error, and the others say why they stopped.
#[test]
fn init_all_stops_every_rank_when_rank_0_cannot_host_the_root() {
    let (_held, addr) = foreign_listener();
    let o = Job::new("faults").local(3).arg("--only").arg("hello").env("NCCL_COMM_ID", &addr)
        .env("NCCL_DEBUG", "WARN").timeout_s(30).run_outcome();
    let p = &o.procs[0];
    let ok = !o.timed_out && !p.killed_at_deadline && !p.exited_0()
        && p.log.contains("ncclCommInitAll") && p.log.contains("cannot host the root")
        && p.log.contains("rank 1 of 3: init stopped: rank 0 of the same call failed")
        && p.log.contains("rank 2 of 3: init stopped: rank 0 of the same call failed");
    judge("init_all_stops_every_rank_when_rank_0_cannot_host_the_root", &o, ok, String::new());
}

/// A rank whose NCCL_COMM_ID address is another program's that answers (a web server, a
/// proxy: "HTTP/1.1 400 ..." to anything) fails at once with ncclSystemError saying another
/// program answers there, with its first bytes. Before: "lost the connection to the root ...:
/// frame of 1347703880 bytes exceeds the limit (the root runs in the process that called
/// ncclGetUniqueId: that process ended, ...)", found by a probe whose address a proxy answered.
#[test]
fn a_talking_program_at_nccl_comm_id_is_named() {
    use std::io::Write;
    let (held, addr) = foreign_listener();
    held.set_nonblocking(true).expect("a nonblocking listener");
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop = done.clone();
    let talker = std::thread::spawn(move || {
        // Answers every connection until the job is over (the listener goes with the thread).
        while !stop.load(std::sync::atomic::Ordering::Acquire) {
            match held.accept() {
                Ok((mut s, _)) => {
                    let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n");
                }
                Err(_) => std::thread::sleep(std::time::Duration::from_millis(5)),
            }
        }
    });
    let o = Job::new("faults").procs(2).arg("--only").arg("hello").env("NCCL_COMM_ID", &addr)
        .env("NCCL_DEBUG", "WARN").env("NCCL_INIT_TIMEOUT_S", "20").timeout_s(60).run_outcome();
    let said = format!("the root's address {addr} answers, but not as a root of nccl-rs");
    let ok = !o.timed_out && o.procs.iter().all(|p| !p.exited_0() && !p.killed_at_deadline)
        && o.procs[1].log.contains(&said) && o.procs[1].log.contains("its first bytes \"HTTP\"")
        && o.procs[1].log.contains("unhandled system error") && o.procs[0].log.contains("cannot host the root");
    done.store(true, std::sync::atomic::Ordering::Release);
    let _ = talker.join();
    judge("a_talking_program_at_nccl_comm_id_is_named", &o, ok, String::new());
}

/// A rank whose NCCL_COMM_ID address is another program's, which accepts and says nothing,
/// says so at WARN (a root of ours answers within half of NCCL_INIT_TIMEOUT_S, at most 10 s)
/// and fails at NCCL_INIT_TIMEOUT_S naming the silence.
#[test]
fn a_silent_program_at_nccl_comm_id_is_named() {
    let (_held, addr) = foreign_listener();
    let o = Job::new("faults").procs(2).arg("--only").arg("hello").env("NCCL_COMM_ID", &addr)
        .env("NCCL_DEBUG", "WARN").env("NCCL_INIT_TIMEOUT_S", "4").timeout_s(30).run_outcome();
    let silent = format!("the root at {addr} has said nothing in 3 s");
    let ok = !o.timed_out && o.procs.iter().all(|p| !p.exited_0() && !p.killed_at_deadline)
        && o.procs[1].log.contains(&silent) && o.procs[1].log.contains("no answer from the root within 6 s")
        && o.procs[0].log.contains("cannot host the root");
    judge("a_silent_program_at_nccl_comm_id_is_named", &o, ok, String::new());
}
