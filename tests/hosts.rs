//! Several hosts on one machine: the C programs of `ffi-tests/` run in the network
//! namespaces `scripts/testhosts` makes (one bridge, host `i` at 10.77.0.(10+i) and
//! fd77::(10+i) on `veth<i>`), each process with `NCCL_HOSTID` naming its host and
//! `NCCL_SOCKET_IFNAME` its interface, so ranks of one host share memory and ranks of
//! different hosts really talk TCP across interfaces. The unique id travels through a file
//! in a shared temporary folder; the root address inside it is host 0's interface address.
//!
//! Needs root and iproute2 (`NCCL_TEST_SKIP_NETNS=1` skips these tests, saying so), except the
//! three `transports_on_one_machine` tests and `shm_disabled_on_one_process_only`: host
//! identity and `NCCL_SHM_DISABLE` without namespaces.

mod common;

use common::*;

/// Runs `job`'s process `p` on host `host_of[p]` of `hosts`.
fn placed(mut job: Job, hosts: &Hosts, host_of: &[usize]) -> Job {
    for (p, &h) in host_of.iter().enumerate() {
        job = job.on_host(p, hosts, h);
    }
    job
}

/// Every "rank A -> rank B via KIND" line the library logged (NCCL_DEBUG_SUBSYS=INIT).
fn connections(o: &Outcome) -> Vec<(usize, usize, String)> {
    let mut out = Vec::new();
    for (_, line) in o.lines_with(" via ") {
        let Some(at) = line.find("rank ") else { continue };
        let words: Vec<&str> = line[at..].split_whitespace().collect();
        if let ["rank", a, "->", "rank", b, "via", kind, ..] = words.as_slice() {
            if let (Ok(a), Ok(b)) = (a.parse(), b.parse()) {
                out.push((a, b, kind.to_string()));
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

/// Ranks of one host connect through shared memory, ranks of different hosts through
/// sockets; `want` says which kinds must appear at all. One rank per process.
fn check_transports(o: &Outcome, host_of: &[usize], want: &[&str]) {
    let conns = connections(o);
    let mut wrong = Vec::new();
    for (a, b, kind) in &conns {
        let expected = if host_of[*a] == host_of[*b] { "Shm" } else { "Socket" };
        if kind != expected {
            wrong.push(format!("rank {a} -> rank {b} via {kind} (expected {expected})"));
        }
    }
    let listed: Vec<String> = conns.iter().map(|(a, b, k)| format!("{a}->{b} {k}")).collect();
    println!("connections: {}", listed.join(", "));
    assert!(wrong.is_empty(), "wrong transports: {wrong:?}\n{}", o.report);
    for kind in want {
        assert!(
            conns.iter().any(|(_, _, k)| k == kind),
            "no connection via {kind} among {listed:?}\n{}",
            o.report
        );
    }
}

fn expect_ok(o: &Outcome) {
    assert!(o.ok(), "{}", o.report);
    println!("{}", o.report.lines().next().unwrap_or_default());
    for (i, p) in o.procs.iter().enumerate() {
        for line in p.log.lines().filter(|l| l.contains("RESULT") || l.contains("total ")) {
            println!("  p{i}: {line}");
        }
    }
}

/// 2 hosts x 2 ranks: shared memory inside a host, sockets between hosts, exact results.
#[test]
fn two_hosts_x_two_ranks_collectives() {
    if skip_netns() {
        return;
    }
    let hosts = Hosts::up("a", 2, &[]);
    let host_of = [0, 0, 1, 1];
    let job = Job::new("collectives")
        .procs(4)
        .arg("--quick")
        .env("NCCL_DEBUG", "INFO")
        .env("NCCL_DEBUG_SUBSYS", "INIT")
        .timeout_s(90);
    let o = placed(job, &hosts, &host_of).run_outcome();
    expect_ok(&o);
    check_transports(&o, &host_of, &["Shm", "Socket"]);
}

/// The transports a job of 4 processes on this machine (no namespaces) chooses: `host_of`
/// gives each process a host through NCCL_HOSTID, or None to leave the default (hostname and
/// boot id, the same for all of them).
fn transports_on_one_machine(host_of: Option<&[usize]>, env: &[(&str, &str)], want: &[&str]) {
    let mut job = Job::new("collectives")
        .procs(4)
        .arg("--quick")
        .arg("--only")
        .arg("AllReduce")
        .env("NCCL_DEBUG", "INFO")
        .env("NCCL_DEBUG_SUBSYS", "INIT");
    for (k, v) in env {
        job = job.env(k, v);
    }
    if let Some(hosts) = host_of {
        for (p, h) in hosts.iter().enumerate() {
            job = job.proc_env(p, "NCCL_HOSTID", &format!("testhost-{h}"));
        }
    }
    let o = job.run_outcome();
    expect_ok(&o);
    let same = [0, 0, 0, 0];
    let conns = connections(&o);
    assert!(!conns.is_empty(), "no connection logged\n{}", o.report);
    if env.iter().any(|(k, v)| *k == "NCCL_SHM_DISABLE" && *v == "1") {
        let listed: Vec<String> = conns.iter().map(|(a, b, k)| format!("{a}->{b} {k}")).collect();
        assert!(conns.iter().all(|(_, _, k)| k == "Socket"), "NCCL_SHM_DISABLE=1, yet: {listed:?}\n{}", o.report);
    } else {
        check_transports(&o, host_of.unwrap_or(&same), want);
    }
}

/// NCCL_SHM_DISABLE on one process only: both ends of each of its pairs take sockets (a pair
/// takes what both ranks' settings allow), the other pairs shared memory, and the job passes
/// (before, that process's peers waited on shared memory it never opened).
#[test]
fn shm_disabled_on_one_process_only() {
    let o = Job::new("collectives").procs(3).arg("--quick").arg("--only").arg("AllReduce")
        .env("NCCL_DEBUG", "INFO").env("NCCL_DEBUG_SUBSYS", "INIT").proc_env(2, "NCCL_SHM_DISABLE", "1")
        .timeout_s(60).run_outcome();
    expect_ok(&o);
    let conns = connections(&o);
    assert!(!conns.is_empty(), "no connection logged\n{}", o.report);
    let wrong: Vec<String> = conns.iter()
        .filter(|(a, b, kind)| kind != if *a == 2 || *b == 2 { "Socket" } else { "Shm" })
        .map(|(a, b, kind)| format!("rank {a} -> rank {b} via {kind}"))
        .collect();
    assert!(wrong.is_empty(), "{wrong:?}\n{}", o.report);
}

/// Without NCCL_HOSTID, processes of one machine are one host: shared memory between all.
#[test]
fn one_machine_is_one_host_by_default() {
    transports_on_one_machine(None, &[], &["Shm"]);
}

/// NCCL_HOSTID alone (no namespaces) splits one machine into hosts: sockets between them.
#[test]
fn host_ids_split_one_machine_into_hosts() {
    transports_on_one_machine(Some(&[0, 0, 1, 1]), &[("NCCL_SOCKET_IFNAME", "lo")], &["Shm", "Socket"]);
}

/// NCCL_SHM_DISABLE=1: sockets even inside a host.
#[test]
fn shm_disable_uses_sockets_inside_a_host() {
    transports_on_one_machine(None, &[("NCCL_SHM_DISABLE", "1"), ("NCCL_SOCKET_IFNAME", "lo")], &["Socket"]);
}

/// Containers of one machine that share its name and network, so its host identity, but not
/// its pids or its /dev/shm: processes 0 and 1 each run in a pid namespace of their own (both
/// are pid 1 there), process 2 with a /dev/shm of its own, processes 3 and 4 plainly. Only 3
/// and 4 share memory; every other pair takes sockets, and results are exact. Before, 0 and 1
/// were taken for one process (same host, same pid) and each waited for ever for the other's
/// in-process ring; 2 and a plain process failed: "the sending rank removed its ring".
#[test]
fn containers_of_one_machine_share_memory_only_where_they_can() {
    if skip_netns() {
        return;
    }
    let own_pids = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"];
    let own_shm = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                   "mount -t tmpfs -o size=64m tmpfs /dev/shm && exec \"$@\"", "sh"];
    let o = Job::new("collectives").procs(5).arg("--quick").arg("--only").arg("AlltoAll")
        .env("NCCL_DEBUG", "INFO").env("NCCL_DEBUG_SUBSYS", "INIT")
        .wrap(0, &own_pids).wrap(1, &own_pids).wrap(2, &own_shm)
        .timeout_s(90).run_outcome();
    expect_ok(&o);
    let conns = connections(&o);
    let listed: Vec<String> = conns.iter().map(|(a, b, k)| format!("{a}->{b} {k}")).collect();
    assert_eq!(conns.len(), 20, "every ordered pair connects once: {listed:?}\n{}", o.report);
    let wrong: Vec<&String> = conns.iter().zip(&listed)
        .filter(|((a, b, kind), _)| kind != if *a >= 3 && *b >= 3 { "Shm" } else { "Socket" })
        .map(|(_, l)| l)
        .collect();
    assert!(wrong.is_empty(), "wrong transports: {wrong:?}\n{}", o.report);
}

/// 4 hosts x 1 rank: every connection crosses an interface; collectives and p2p.
#[test]
fn four_hosts_collectives_and_p2p() {
    if skip_netns() {
        return;
    }
    let hosts = Hosts::up("b", 4, &[]);
    let host_of = [0, 1, 2, 3];
    for program in ["collectives", "p2p"] {
        let mut job = Job::new(program)
            .procs(4)
            .env("NCCL_DEBUG", "INFO")
            .env("NCCL_DEBUG_SUBSYS", "INIT")
            .timeout_s(90);
        if program == "collectives" {
            job = job.arg("--quick");
        }
        let o = placed(job, &hosts, &host_of).run_outcome();
        expect_ok(&o);
        check_transports(&o, &host_of, &["Socket"]);
    }
}

/// Links limited to 200 Mbit/s (tbf): the allreduces still give exact results.
#[test]
fn two_hosts_rate_limited_allreduce() {
    if skip_netns() {
        return;
    }
    let hosts = Hosts::up("r", 2, &["--rate", "200mbit"]);
    let qdisc = hosts.exec(0, &["tc", "qdisc", "show", "dev", &hosts.ifname(0)]);
    let qdisc = String::from_utf8_lossy(&qdisc.stdout).into_owned();
    assert!(qdisc.contains("tbf"), "no tbf qdisc on host 0: {qdisc}");
    println!("host 0: {}", qdisc.trim());
    let job = Job::new("collectives")
        .procs(2)
        .arg("--quick")
        .arg("--only")
        .arg("AllReduce")
        .timeout_s(60);
    let o = placed(job, &hosts, &[0, 1]).run_outcome();
    expect_ok(&o);
}

/// 2 hosts x 1 rank over IPv6 (NCCL_SOCKET_FAMILY=AF_INET6): the root listens on an IPv6
/// address and the collectives give exact results.
#[test]
fn two_hosts_ipv6() {
    if skip_netns() {
        return;
    }
    let hosts = Hosts::up("v6", 2, &[]);
    let job = Job::new("collectives")
        .procs(2)
        .arg("--quick")
        .env("NCCL_SOCKET_FAMILY", "AF_INET6")
        .env("NCCL_DEBUG", "INFO")
        .env("NCCL_DEBUG_SUBSYS", "INIT,BOOTSTRAP")
        .timeout_s(60);
    let o = placed(job, &hosts, &[0, 1]).run_outcome();
    expect_ok(&o);
    let root: Vec<&str> = o.lines_with("root listening on").map(|(_, l)| l).collect();
    println!("root: {root:?}");
    assert!(
        root.iter().any(|l| l.contains("listening on [")),
        "the root does not listen on an IPv6 address: {root:?}\n{}",
        o.report
    );
    check_transports(&o, &[0, 1], &["Socket"]);
}

/// A host with no network interface up, loopback included (a new network namespace, whose lo
/// starts down): `ncclGetUniqueId` fails at once with ncclSystemError, saying so and how to
/// bring lo up. Before, the id was made on 127.0.0.1, where listening works, and the init
/// then failed with "Network is unreachable" under a guess at a stale unique id.
#[test]
fn a_host_with_no_interface_up_says_so() {
    if skip_netns() {
        return;
    }
    let o = Job::new("collectives").arg("--quick").wrap(0, &["unshare", "--net"]).timeout_s(30).run_outcome();
    assert!(!o.ok(), "ran with no interface up:\n{}", o.report);
    let said = "ncclGetUniqueId(id) -> 2 unhandled system error";
    assert!(o.procs[0].log.contains(said), "not failed at the id with ncclSystemError:\n{}", o.report);
    assert!(o.procs[0].log.contains("no network interface of this host is up, loopback included")
            && o.procs[0].log.contains("ip link set lo up"), "{}", o.report);
}
