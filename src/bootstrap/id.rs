//! The 128-byte unique id: a random magic that every connection of the job must prove, and
//! the address of the root that brings the ranks together.
//!
//! Layout (little-endian): `[0..8]` magic, `[8]` format mark `b'R'`, `[9]` flags (bit 0: rank 0
//! hosts the root, as with `NCCL_COMM_ID`), `[10..12]` port, `[12]` IP version (4 or 6),
//! `[16..32]` address, `[32..36]` IPv6 scope id. The rest is zero.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6};

use crate::error::{Error, Result};

pub const ID_BYTES: usize = 128;
const MARK: u8 = b'R';
const FLAG_RANK0_ROOT: u8 = 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UniqueId {
    pub magic: u64,
    pub root: SocketAddr,
    /// The root is not running yet: rank 0 starts it at init (`NCCL_COMM_ID`).
    pub rank0_hosts_root: bool,
}

impl UniqueId {
    pub fn encode(&self) -> [u8; ID_BYTES] {
        let mut b = [0u8; ID_BYTES];
        b[0..8].copy_from_slice(&self.magic.to_le_bytes());
        b[8] = MARK;
        b[9] = if self.rank0_hosts_root { FLAG_RANK0_ROOT } else { 0 };
        b[10..12].copy_from_slice(&self.root.port().to_le_bytes());
        match self.root {
            SocketAddr::V4(a) => {
                b[12] = 4;
                b[16..20].copy_from_slice(&a.ip().octets());
            }
            SocketAddr::V6(a) => {
                b[12] = 6;
                b[16..32].copy_from_slice(&a.ip().octets());
                b[32..36].copy_from_slice(&a.scope_id().to_le_bytes());
            }
        }
        b
    }

    pub fn decode(b: &[u8; ID_BYTES]) -> Result<UniqueId> {
        let bad = || Error::invalid_arg("the unique id was not produced by ncclGetUniqueId (or was corrupted in transit)");
        if b[8] != MARK {
            return Err(bad());
        }
        let mut m = [0u8; 8];
        m.copy_from_slice(&b[0..8]);
        let magic = u64::from_le_bytes(m);
        let port = u16::from_le_bytes([b[10], b[11]]);
        let ip = match b[12] {
            4 => IpAddr::V4(Ipv4Addr::new(b[16], b[17], b[18], b[19])),
            6 => {
                let mut o = [0u8; 16];
                o.copy_from_slice(&b[16..32]);
                IpAddr::V6(Ipv6Addr::from(o))
            }
            _ => return Err(bad()),
        };
        let root = match ip {
            IpAddr::V6(v6) => {
                let scope = u32::from_le_bytes([b[32], b[33], b[34], b[35]]);
                SocketAddr::V6(SocketAddrV6::new(v6, port, 0, scope))
            }
            v4 => SocketAddr::new(v4, port),
        };
        if magic == 0 || port == 0 {
            return Err(bad());
        }
        Ok(UniqueId { magic, root, rank0_hosts_root: b[9] & FLAG_RANK0_ROOT != 0 })
    }
}

/// Parse `NCCL_COMM_ID`: `host:port`, `[v6]:port`, or a name that resolves.
pub fn parse_comm_id(v: &str) -> Result<SocketAddr> {
    use std::net::ToSocketAddrs;
    let bad = |why: &str| Error::invalid_arg(format!("NCCL_COMM_ID='{v}' {why}: expected host:port or [ipv6]:port"));
    let addr = match v.parse::<SocketAddr>() {
        Ok(a) => a,
        Err(_) => match scoped_v6(v) {
            Some(scoped) => SocketAddr::V6(scoped.map_err(|why| bad(&why))?),
            None => v
                .to_socket_addrs()
                .map_err(|_| bad("does not resolve"))?
                .next()
                .ok_or_else(|| bad("does not resolve"))?,
        },
    };
    // (Port 0 made an id whose init then failed as "not produced by ncclGetUniqueId".)
    ensure!(addr.port() != 0, bad("names port 0, where no root can be found (each rank would listen on a port of its own)"));
    Ok(addr)
}

/// `[v6%scope]:port`, as NVIDIA's (through getaddrinfo) takes it: a link-local address names
/// the interface it is reached through, by name (`%eth0`) or index (`%2`). None: not of that
/// shape (the standard parser takes the rest); Err: of that shape but wrong.
fn scoped_v6(v: &str) -> Option<std::result::Result<SocketAddrV6, String>> {
    let (inner, port) = v.strip_prefix('[')?.rsplit_once("]:")?;
    let (ip, scope) = inner.split_once('%')?;
    Some((|| {
        let ip: Ipv6Addr = ip.parse().map_err(|_| format!("has '{ip}', which is no IPv6 address"))?;
        let port: u16 = port.parse().map_err(|_| format!("has '{port}', which is no port"))?;
        let scope = match scope.parse::<u32>() {
            Ok(index) => index,
            Err(_) => crate::transport::socket::ifaces::index_of(scope)
                .ok_or_else(|| format!("names scope '{scope}', which is no interface of this host"))?,
        };
        Ok(SocketAddrV6::new(ip, port, 0, scope))
    })())
}

/// A magic every rank derives identically from the same `NCCL_COMM_ID` (FNV-1a).
pub fn magic_of(text: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h | 1
}

/// 64 random bits from the OS-seeded hasher keys, the clock and the pid.
pub fn random_u64() -> u64 {
    use std::collections::hash_map::RandomState;
    use std::hash::{BuildHasher, Hasher};
    let mut h = RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0));
    h.write_u32(std::process::id());
    h.finish() | 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_v4_and_v6() {
        for root in ["10.1.2.3:5000", "[fd00::2]:6000"] {
            let id = UniqueId { magic: 0x1234, root: root.parse().unwrap(), rank0_hosts_root: true };
            assert_eq!(UniqueId::decode(&id.encode()).unwrap(), id);
        }
    }

    #[test]
    fn rejects_foreign_ids() {
        assert!(UniqueId::decode(&[0u8; ID_BYTES]).is_err());
        let mut b = UniqueId { magic: 9, root: "1.2.3.4:5".parse().unwrap(), rank0_hosts_root: false }.encode();
        b[12] = 9;
        assert!(UniqueId::decode(&b).is_err());
    }

    #[test]
    fn comm_id_parsing() {
        assert_eq!(parse_comm_id("127.0.0.1:1234").unwrap().port(), 1234);
        assert_eq!(parse_comm_id("[::1]:99").unwrap().port(), 99);
        assert!(parse_comm_id("nonsense").is_err());
        assert!(parse_comm_id("127.0.0.1:0").unwrap_err().msg.contains("names port 0"));
        assert!(parse_comm_id("localhost:0").is_err());
        // A link-local address with its interface, by name or index (NVIDIA's takes both).
        let SocketAddr::V6(lo) = parse_comm_id("[fe80::1%lo]:7000").unwrap() else { panic!("not v6") };
        assert_eq!((lo.port(), lo.scope_id()), (7000, crate::transport::socket::ifaces::index_of("lo").unwrap()));
        assert_ne!(lo.scope_id(), 0);
        let SocketAddr::V6(two) = parse_comm_id("[fe80::1%2]:7001").unwrap() else { panic!("not v6") };
        assert_eq!((two.scope_id(), two.ip().segments()[0]), (2, 0xfe80));
        assert!(parse_comm_id("[fe80::1%nosuchif0]:7000").unwrap_err().msg.contains("no interface of this host"));
        assert!(parse_comm_id("[fe80::zz%lo]:7000").unwrap_err().msg.contains("no IPv6 address"));
        assert!(parse_comm_id("[fe80::1%lo]:0").unwrap_err().msg.contains("names port 0"));
        assert_eq!(magic_of("a:1"), magic_of("a:1"));
        assert_ne!(magic_of("a:1"), magic_of("a:2"));
        assert_ne!(random_u64(), random_u64());
    }
}
