//! A bounded, deterministic fuzz loop over every parser of bytes that arrive from outside:
//! unique ids, root hellos and replies, service messages, peer tables, split payloads and
//! message stamps. Each valid message is truncated, bit-flipped and replaced by noise; the
//! parsers must return an error or a value, never panic or allocate without bound.

use super::id::UniqueId;
use super::wire::{Reader, Writer};
use super::{root, service, PeerInfo};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// A variant of `valid`: truncated, corrupted in a few bytes, or pure noise.
    fn mutate(&mut self, valid: &[u8]) -> Vec<u8> {
        let mut m = valid.to_vec();
        match self.next() % 4 {
            0 => m.truncate((self.next() as usize) % (valid.len() + 1)),
            1 | 2 => {
                for _ in 0..1 + self.next() % 4 {
                    if !m.is_empty() {
                        let i = (self.next() as usize) % m.len();
                        m[i] ^= (self.next() as u8) | 1;
                    }
                }
            }
            _ => m = (0..self.next() % 300).map(|_| self.next() as u8).collect(),
        }
        m
    }
}

fn info() -> PeerInfo {
    PeerInfo {
        rank: 3,
        pid: 4242,
        cuda_dev: 0,
        host_hash: 77,
        pid_ns: 4026531836,
        shm_fs: 0x5eed_f00d,
        hostname: "host-a".into(),
        addr: "10.0.0.1:5555".parse().unwrap(),
        slice: 1 << 18,
        nsocks: 2,
        links: super::Links { p2p: true, shm: false, direct: true, direct_p2p: true, direct_min: 65536,
                             algo: Some(crate::algo::Algo::Tree), level: Some(super::topo::Level::Pxb) },
        gpu: super::topo::GpuPlace { bus: "0000:3b:00.0".into(), path: "pci0000:3a/0000:3b:00.0".into(), numa: 1,
                                     nvlink: vec!["0000:5e:00.0".into(), "0000:86:00.0".into()], nvswitch: true },
    }
}

const ITERS: usize = 20_000;

#[test]
fn peer_info_and_tables() {
    let mut w = Writer::default();
    w.u8(root::TABLE).u32(2);
    info().encode(&mut w);
    info().encode(&mut w);
    let mut rng = Rng(1);
    for _ in 0..ITERS {
        let m = rng.mutate(&w.buf);
        let mut r = Reader::new(&m);
        if r.u8().is_ok() {
            if let Ok(n) = r.u32() {
                // A hostile count must not make us loop or allocate: the reader runs dry first.
                for _ in 0..n.min(1 << 20) {
                    if PeerInfo::decode(&mut r).is_err() {
                        break;
                    }
                }
            }
        }
    }
}

#[test]
fn root_hello() {
    let magic = 0xabcdef;
    let mut w = Writer::default();
    w.u8(root::HELLO).u64(magic).u64(crate::SOURCE).u32(3).u32(8);
    info().encode(&mut w);
    assert!(matches!(root::parse_hello(&w.buf, magic), Some(root::Heard::Hello(3, 8, _))));
    assert!(root::parse_hello(&w.buf, magic + 1).is_none(), "the wrong magic is refused");
    // Another build's hello is known for one, its rank read, the rest left alone.
    let mut other = Writer::default();
    other.u8(root::HELLO).u64(magic).u64(crate::SOURCE ^ 1).u32(3).u32(8).u8(0xff);
    assert!(matches!(root::parse_hello(&other.buf, magic), Some(root::Heard::OtherBuild { rank: 3, source }) if source == crate::SOURCE ^ 1));
    let mut rng = Rng(2);
    for _ in 0..ITERS {
        let _ = root::parse_hello(&rng.mutate(&w.buf), magic);
    }
}

/// A rank's word that it cannot join: read back whole, refused under another magic, never a
/// panic on damaged bytes.
#[test]
fn root_cannot_join() {
    let magic = 0xabcdef;
    let mut w = Writer::default();
    w.u8(root::CANNOT_JOIN).u64(magic).u32(2).u32(3).str("no interface");
    assert_eq!(root::parse_cannot_join(&w.buf, magic), Some((2, 3, "no interface".to_string())));
    assert!(root::parse_cannot_join(&w.buf, magic + 1).is_none(), "the wrong magic is refused");
    assert!(root::parse_hello(&w.buf, magic).is_none(), "it is not a hello");
    let mut rng = Rng(3);
    for _ in 0..ITERS {
        let _ = root::parse_cannot_join(&rng.mutate(&w.buf), magic);
    }
}

#[test]
fn service_messages() {
    let magic = 0x1234;
    let mut w = Writer::default();
    w.u64(magic).u8(1).u32(5).u32(9).bytes(b"nccl-rs-0000-1-2-3");
    assert!(matches!(service::parse_hello(&w.buf, magic), Ok(Some((1, 5, 9, _)))));
    assert!(matches!(service::parse_hello(&w.buf, 7), Ok(None)));
    let mut rng = Rng(3);
    for _ in 0..ITERS {
        let _ = service::parse_hello(&rng.mutate(&w.buf), magic);
    }
}

#[test]
fn unique_ids() {
    let valid = UniqueId { magic: 99, root: "[fd00::1]:77".parse().unwrap(), rank0_hosts_root: false }.encode();
    let mut rng = Rng(4);
    for _ in 0..ITERS {
        let m = rng.mutate(&valid);
        let mut b = [0u8; super::id::ID_BYTES];
        let n = m.len().min(b.len());
        b[..n].copy_from_slice(&m[..n]);
        let _ = UniqueId::decode(&b);
    }
}

#[test]
fn stamps_describe_anything() {
    let mut rng = Rng(5);
    for _ in 0..ITERS {
        let mut s = [0u8; crate::transport::STAMP_BYTES];
        s.iter_mut().for_each(|b| *b = rng.next() as u8);
        assert!(!crate::plan::ops::describe_stamp(&s).is_empty());
    }
}

#[test]
fn split_payloads() {
    let valid = crate::api::split::encode(2, -5, Some(&info()));
    assert!(crate::api::split::decode(&valid).is_ok());
    let mut rng = Rng(6);
    for _ in 0..ITERS {
        let _ = crate::api::split::decode(&rng.mutate(&valid));
    }
}
