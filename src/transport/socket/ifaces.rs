//! Which network interfaces and addresses to use, as NCCL chooses them: `NCCL_SOCKET_IFNAME`
//! (comma-separated prefixes, `^` to exclude, `=` for exact names) and `NCCL_SOCKET_FAMILY`.
//! Without a setting: every interface that is up except loopback and docker bridges, and
//! loopback only when nothing else exists.

use std::ffi::CStr;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::params;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Iface {
    pub name: String,
    pub addr: IpAddr,
    /// IPv6 scope (link-local addresses need it to connect).
    pub scope_id: u32,
}

/// A parsed `NCCL_SOCKET_IFNAME`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IfFilter {
    exclude: bool,
    exact: bool,
    names: Vec<String>,
}

impl IfFilter {
    pub fn parse(spec: &str) -> IfFilter {
        let mut s = spec.trim();
        let exclude = s.starts_with('^');
        if exclude {
            s = &s[1..];
        }
        let exact = s.starts_with('=');
        if exact {
            s = &s[1..];
        }
        let names = s.split(',').map(|n| n.trim().to_string()).filter(|n| !n.is_empty()).collect();
        IfFilter { exclude, exact, names }
    }

    pub fn matches(&self, name: &str) -> bool {
        let hit = self.names.iter().any(|n| if self.exact { name == n } else { name.starts_with(n.as_str()) });
        hit != self.exclude
    }
}

/// Every address of every interface that is up: (name, address, scope). getifaddrs opens a
/// netlink socket: out of descriptors, the soft limit is raised as for any socket (an empty
/// list there read as "no interface is up": found by a test at an open-file limit of 40).
fn all_addresses() -> std::io::Result<Vec<Iface>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    crate::transport::fds::with_room(|| {
        // SAFETY: getifaddrs fills `head` with a list we free with freeifaddrs below.
        match unsafe { libc::getifaddrs(&mut head) } {
            0 => Ok(()),
            _ => Err(std::io::Error::last_os_error()),
        }
    })?;
    let mut out = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: cur is a node of the list getifaddrs returned and we have not freed it.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_flags & libc::IFF_UP as u32 == 0 {
            continue;
        }
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        let name = unsafe { CStr::from_ptr(ifa.ifa_name) }.to_string_lossy().into_owned();
        // SAFETY: ifa_addr is non-NULL; sa_family says which sockaddr type it really is.
        let family = unsafe { (*ifa.ifa_addr).sa_family } as i32;
        if family == libc::AF_INET {
            // SAFETY: family AF_INET means ifa_addr points to a sockaddr_in.
            let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
            let ip = Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
            out.push(Iface { name, addr: IpAddr::V4(ip), scope_id: 0 });
        } else if family == libc::AF_INET6 {
            // SAFETY: family AF_INET6 means ifa_addr points to a sockaddr_in6.
            let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
            let ip = Ipv6Addr::from(sin6.sin6_addr.s6_addr);
            out.push(Iface { name, addr: IpAddr::V6(ip), scope_id: sin6.sin6_scope_id });
        }
    }
    // SAFETY: head came from getifaddrs and is freed exactly once.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

fn family_ok(addr: &IpAddr, family: Option<&str>) -> bool {
    match family {
        Some("AF_INET") => addr.is_ipv4(),
        Some("AF_INET6") => addr.is_ipv6(),
        _ => true,
    }
}

/// Choose interfaces from a list, NCCL's way (pure, for tests).
pub fn choose(all: &[Iface], ifname: Option<&str>, family: Option<&str>) -> Vec<Iface> {
    let ok = |i: &&Iface| family_ok(&i.addr, family);
    let filter = IfFilter::parse(ifname.unwrap_or("^docker,lo"));
    let mut picked: Vec<Iface> = all.iter().filter(ok).filter(|i| filter.matches(&i.name)).cloned().collect();
    // Prefer IPv4, and avoid IPv6 link-local addresses unless nothing else exists (the
    // address is used without its scope, which only this host knows): also among the
    // addresses of interfaces NCCL_SOCKET_IFNAME names.
    picked.sort_by_key(|i| match i.addr {
        IpAddr::V4(_) => 0,
        IpAddr::V6(v6) if (v6.segments()[0] & 0xffc0) == 0xfe80 => 2,
        IpAddr::V6(_) => 1,
    });
    if picked.is_empty() && ifname.is_none() {
        picked = all.iter().filter(ok).filter(|i| i.name.starts_with("lo")).cloned().collect();
    }
    picked
}

/// The index of the interface named `name` (an IPv6 scope such as `%eth0`), if it exists.
pub fn index_of(name: &str) -> Option<u32> {
    let c = std::ffi::CString::new(name).ok()?;
    // SAFETY: c is a NUL-terminated string that outlives the call; if_nametoindex only reads it.
    match unsafe { libc::if_nametoindex(c.as_ptr()) } {
        0 => None,
        i => Some(i),
    }
}

/// This host's interfaces with their addresses, for a message ("lo 127.0.0.1, eth0 10.0.0.2").
pub fn describe_all() -> String {
    let all = match all_addresses() {
        Ok(all) => all,
        Err(e) => return format!("this host's interfaces cannot be listed: {e}"),
    };
    if all.is_empty() {
        return "this host has none up".into();
    }
    let named: Vec<String> = all.iter().map(|i| format!("{} {}", i.name, i.addr)).collect();
    format!("this host has {}", named.join(", "))
}

/// The interfaces this process uses for bootstrap and sockets, best first (Err: this host's
/// interfaces could not be listed).
pub fn interfaces() -> std::io::Result<Vec<Iface>> {
    let ifname = params::raw("NCCL_SOCKET_IFNAME");
    let family = params::raw("NCCL_SOCKET_FAMILY");
    Ok(choose(&all_addresses()?, ifname.as_deref(), family.as_deref()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4(name: &str, a: [u8; 4]) -> Iface {
        Iface { name: name.into(), addr: IpAddr::V4(Ipv4Addr::from(a)), scope_id: 0 }
    }

    #[test]
    fn filter_syntax() {
        assert!(IfFilter::parse("eth,ib").matches("eth0"));
        assert!(!IfFilter::parse("eth,ib").matches("lo"));
        assert!(IfFilter::parse("^eth").matches("ib0"));
        assert!(!IfFilter::parse("^eth").matches("eth1"));
        assert!(IfFilter::parse("=eth0").matches("eth0"));
        assert!(!IfFilter::parse("=eth0").matches("eth01"));
        assert!(!IfFilter::parse("^=eth0").matches("eth0"));
        assert!(IfFilter::parse("^=eth0").matches("eth01"));
    }

    #[test]
    fn default_skips_loopback_and_docker_unless_alone() {
        let all = vec![v4("lo", [127, 0, 0, 1]), v4("docker0", [172, 17, 0, 1]), v4("eth0", [10, 0, 0, 2])];
        let c = choose(&all, None, None);
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].name, "eth0");
        let only_lo = vec![v4("lo", [127, 0, 0, 1])];
        assert_eq!(choose(&only_lo, None, None)[0].name, "lo");
        assert_eq!(choose(&all, Some("lo"), None)[0].name, "lo");
        // No IPv6 address anywhere: nothing, not an IPv4 one.
        assert!(choose(&all, None, Some("AF_INET6")).is_empty());
        assert!(choose(&all, Some("wlan"), None).is_empty());
    }

    #[test]
    fn link_local_ipv6_comes_last_also_on_named_interfaces() {
        let v6 = |name: &str, a: &str| Iface { name: name.into(), addr: IpAddr::V6(a.parse().expect("an address")), scope_id: 2 };
        let all = vec![v6("eth0", "fe80::1"), v6("eth0", "2001:db8::7"), v6("ib0", "fe80::2"), v4("eth0", [10, 0, 0, 2])];
        for ifname in [None, Some("eth0")] {
            let c = choose(&all, ifname, Some("AF_INET6"));
            assert_eq!(c[0].addr, "2001:db8::7".parse::<IpAddr>().expect("an address"), "NCCL_SOCKET_IFNAME={ifname:?}: {c:?}");
            let c = choose(&all, ifname, None);
            assert_eq!(c[0].addr, IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2)), "NCCL_SOCKET_IFNAME={ifname:?}: {c:?}");
        }
        // Only link-local left: used, as NCCL would.
        assert_eq!(choose(&all, Some("ib"), None).len(), 1);
    }

    #[test]
    fn this_machine_has_some_interface() {
        assert!(interfaces().is_ok_and(|l| !l.is_empty()));
    }
}
