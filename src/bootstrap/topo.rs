//! Where a rank's GPU sits in the host's PCI tree, and how far apart two GPUs are, in the
//! path types `NCCL_P2P_LEVEL` names: the direct path between ranks of one host (CUDA mode)
//! is taken only up to the level it sets (`PeerInfo::direct_with`).
//!
//! Each rank reads its own GPU's place from sysfs (the device's path under `/sys/devices`
//! and its NUMA node) and publishes it with its other facts at init; every rank then computes
//! the same distance for a pair from the same two published places, so both ends always
//! choose alike. Two GPUs joined by an active NVLink, or both linked to NVSwitches, are `NVL`
//! apart whatever their PCI paths (NVML says which, `device::cuda::nvml`, and each rank
//! publishes what its GPU's links reach); where NVML cannot say, they are as far apart as
//! their PCI paths say.

/// How far apart two GPUs are (and the levels of `NCCL_P2P_LEVEL`), nearest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// The same GPU. As a level: never direct.
    Loc = 0,
    /// NVLink (as a level only: see the module's notes).
    Nvl = 1,
    /// Below one PCI switch.
    Pix = 2,
    /// Through several PCI switches, not through the CPU.
    Pxb = 3,
    /// Through the CPU's PCI host bridge(s), on one NUMA node.
    Phb = 4,
    /// Across NUMA nodes (or unknown).
    Sys = 5,
}

impl Level {
    const ALL: [Level; 6] = [Level::Loc, Level::Nvl, Level::Pix, Level::Pxb, Level::Phb, Level::Sys];

    pub fn name(self) -> &'static str {
        match self {
            Level::Loc => "LOC",
            Level::Nvl => "NVL",
            Level::Pix => "PIX",
            Level::Pxb => "PXB",
            Level::Phb => "PHB",
            Level::Sys => "SYS",
        }
    }

    /// `NCCL_P2P_LEVEL` as NCCL reads it: a path type's name, or a legacy integer (0 LOC,
    /// 1 PIX, 2 PXB, 3 PHB, 4 and above SYS; NVL has no number). None: not a level.
    pub fn parse(v: &str) -> Option<Level> {
        let v = v.trim();
        if let Some(n) = crate::params::parse_int(v) {
            return Some(match n {
                i64::MIN..=0 => Level::Loc,
                1 => Level::Pix,
                2 => Level::Pxb,
                3 => Level::Phb,
                _ => Level::Sys,
            });
        }
        Level::ALL.into_iter().find(|l| l.name().eq_ignore_ascii_case(v))
    }

    /// On the wire: the level, or 255 for none set.
    pub fn encode(level: Option<Level>) -> u8 {
        level.map_or(u8::MAX, |l| l as u8)
    }

    pub fn decode(v: u8) -> Option<Level> {
        Level::ALL.into_iter().find(|l| *l as u8 == v)
    }
}

/// Where a GPU sits: its device's path below `/sys/devices` (`pci0000:3a/0000:3a:00.0/...`,
/// the PCI root first, then each bridge, the GPU last) and its NUMA node; empty and -1 where
/// unknown (host mode, no sysfs).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GpuPlace {
    /// Its PCI bus id, lower case (`0000:3b:00.0`; empty if unknown): the same GPU even where
    /// sysfs says nothing.
    pub bus: String,
    pub path: String,
    pub numa: i32,
    /// The GPUs its active NVLinks reach (their bus ids), and whether some reach an NVSwitch.
    pub nvlink: Vec<String>,
    pub nvswitch: bool,
}

impl GpuPlace {
    /// The place of the GPU with PCI bus id `bus` (as `cuDeviceGetPCIBusId` gives it) in the
    /// sysfs at `root` (`/sys`; `NCCL_RS_TOPO_SYSFS` for tests).
    pub fn of_bus_id(root: &str, bus: &str) -> GpuPlace {
        let bus = bus.trim().to_ascii_lowercase();
        let link = format!("{root}/bus/pci/devices/{bus}");
        let devices = format!("{root}/devices/");
        let path = std::fs::canonicalize(&link).ok().and_then(|p| {
            let p = p.to_string_lossy().into_owned();
            // (The root itself may be a link: compare with its own canonical form.)
            let devices = std::fs::canonicalize(&devices).map(|d| format!("{}/", d.to_string_lossy())).unwrap_or(devices);
            p.strip_prefix(&devices).map(str::to_owned)
        });
        let numa = std::fs::read_to_string(format!("{link}/numa_node")).ok().and_then(|s| s.trim().parse().ok());
        GpuPlace { bus, path: path.unwrap_or_default(), numa: numa.unwrap_or(-1), nvlink: Vec::new(), nvswitch: false }
    }

    /// For logs: its bus id, or "?".
    pub fn bus_id(&self) -> &str {
        if self.bus.is_empty() { "?" } else { &self.bus }
    }
}

/// How far apart the GPUs at `a` and `b` are; None where that is unknown (either's place in
/// the PCI tree, unless they are one GPU).
pub fn distance(a: &GpuPlace, b: &GpuPlace) -> Option<Level> {
    if !a.bus.is_empty() && a.bus == b.bus {
        return Some(Level::Loc);
    }
    if (a.nvswitch && b.nvswitch) || (!b.bus.is_empty() && a.nvlink.contains(&b.bus))
        || (!a.bus.is_empty() && b.nvlink.contains(&a.bus)) {
        return Some(Level::Nvl);
    }
    if a.path.is_empty() || b.path.is_empty() {
        return None;
    }
    let (pa, pb): (Vec<&str>, Vec<&str>) = (a.path.split('/').collect(), b.path.split('/').collect());
    if pa.first() != pb.first() {
        // Different PCI roots: through the CPU, on one NUMA node or across.
        let one_node = a.numa >= 0 && a.numa == b.numa;
        return Some(if one_node { Level::Phb } else { Level::Sys });
    }
    // Below one root: the bridges both paths share (the root excluded), then how many
    // bridges each GPU is below the last shared one.
    let shared = pa.iter().zip(&pb).skip(1).take_while(|(x, y)| x == y).count();
    if shared == 0 {
        // Only the root (host bridge) in common: through the CPU.
        return Some(Level::Phb);
    }
    // A PCI switch is an upstream port with a downstream port per device below it: GPUs
    // directly below the same switch are one bridge below the shared upstream port.
    let below = |p: &[&str]| p.len().saturating_sub(1 + shared + 1);
    Some(if below(&pa) <= 1 && below(&pb) <= 1 { Level::Pix } else { Level::Pxb })
}

/// NCCL's number for a PCI bus id (what its logs print as `busId`): the id's hex digits run
/// together, so "0000:57:00.0" is 0x57000; 0 where there is none.
pub fn bus_id_number(bus: &str) -> u64 {
    bus.chars().filter_map(|c| c.to_digit(16)).fold(0u64, |n, d| n.wrapping_shl(4) | u64::from(d))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids_number_as_nccl_prints_them() {
        assert_eq!(format!("{:x}", bus_id_number("0000:57:00.0")), "57000");
        assert_eq!(format!("{:x}", bus_id_number("0001:3B:00.1")), "13b001");
        assert_eq!(bus_id_number(""), 0);
    }

    fn at(path: &str, numa: i32) -> GpuPlace {
        GpuPlace { bus: path.rsplit('/').next().unwrap_or_default().into(), path: path.into(), numa, ..GpuPlace::default() }
    }

    #[test]
    fn levels_parse_as_nccl_reads_them() {
        assert_eq!(Level::parse("loc"), Some(Level::Loc));
        assert_eq!(Level::parse(" NVL "), Some(Level::Nvl));
        assert_eq!(Level::parse("PHB"), Some(Level::Phb));
        assert_eq!(Level::parse("0"), Some(Level::Loc));
        assert_eq!(Level::parse("1"), Some(Level::Pix));
        assert_eq!(Level::parse("3"), Some(Level::Phb));
        assert_eq!(Level::parse("7"), Some(Level::Sys));
        assert_eq!(Level::parse("NVLINK"), None);
        for l in [None, Some(Level::Loc), Some(Level::Nvl), Some(Level::Sys)] {
            assert_eq!(Level::decode(Level::encode(l)), l);
        }
    }

    #[test]
    fn distances_follow_the_pci_tree() {
        // Root pci0000:00 with a switch (upstream 02:00.0, downstream 03:00.0 and 03:01.0)
        // below root port 00:01.0, a second switch below 03:01.0, and a second root port.
        let sw_a = at("pci0000:00/0000:00:01.0/0000:02:00.0/0000:03:00.0/0000:04:00.0", 0);
        let sw_b = at("pci0000:00/0000:00:01.0/0000:02:00.0/0000:03:01.0/0000:05:00.0", 0);
        let deeper = at("pci0000:00/0000:00:01.0/0000:02:00.0/0000:03:01.0/0000:06:00.0/0000:07:00.0/0000:08:00.0", 0);
        let other_port = at("pci0000:00/0000:00:02.0/0000:09:00.0", 0);
        let other_root = at("pci0000:80/0000:80:01.0/0000:81:00.0", 0);
        let other_node = at("pci0000:c0/0000:c0:01.0/0000:c1:00.0", 1);
        assert_eq!(distance(&sw_a, &sw_a), Some(Level::Loc));
        assert_eq!(distance(&sw_a, &sw_b), Some(Level::Pix));
        assert_eq!(distance(&sw_a, &deeper), Some(Level::Pxb));
        assert_eq!(distance(&deeper, &sw_a), Some(Level::Pxb));
        assert_eq!(distance(&sw_a, &other_port), Some(Level::Phb));
        assert_eq!(distance(&sw_a, &other_root), Some(Level::Phb));
        assert_eq!(distance(&sw_a, &other_node), Some(Level::Sys));
        assert_eq!(distance(&at("pci0000:80/x", -1), &at("pci0000:00/y", -1)), Some(Level::Sys), "NUMA unknown");
        assert_eq!(distance(&sw_a, &GpuPlace::default()), None);
        // One GPU, whatever sysfs says.
        let bus_only = GpuPlace { bus: "0000:04:00.0".into(), ..GpuPlace::default() };
        assert_eq!(distance(&bus_only, &sw_a), Some(Level::Loc));
        assert_eq!(distance(&bus_only, &sw_b), None);
    }

    /// NVLink outranks the PCI path, from either end's list (each rank lists what its own
    /// GPU's links reach), or both GPUs on NVSwitches; one GPU is still LOC.
    #[test]
    fn nvlinks_make_gpus_nvl_apart() {
        let linked = |g: &GpuPlace, to: &[&GpuPlace], switch: bool| GpuPlace {
            nvlink: to.iter().map(|t| t.bus.clone()).collect(),
            nvswitch: switch,
            ..g.clone()
        };
        let a = at("pci0000:00/0000:00:01.0/0000:04:00.0", 0);
        let b = at("pci0000:c0/0000:c0:01.0/0000:c1:00.0", 1);
        let c = at("pci0000:80/0000:80:01.0/0000:81:00.0", 1);
        assert_eq!(distance(&a, &b), Some(Level::Sys));
        let a_to_b = linked(&a, &[&b], false);
        assert_eq!(distance(&a_to_b, &b), Some(Level::Nvl));
        assert_eq!(distance(&b, &a_to_b), Some(Level::Nvl), "alike from both ends");
        assert_eq!(distance(&a_to_b, &c), Some(Level::Sys), "c is not linked");
        let (sa, sc) = (linked(&a, &[], true), linked(&c, &[], true));
        assert_eq!(distance(&sa, &sc), Some(Level::Nvl), "both on NVSwitches");
        assert_eq!(distance(&sa, &b), Some(Level::Sys), "only one on a switch");
        assert_eq!(distance(&sa, &linked(&a, &[], true)), Some(Level::Loc));
        assert!(Level::Nvl <= Level::Pix, "an NVLink pair is direct wherever a PIX one is");
    }

    /// A sysfs laid out as Linux lays it out (devices under `devices/`, links to them under
    /// `bus/pci/devices/`, a `numa_node` file each).
    #[test]
    fn places_are_read_from_sysfs() {
        let root = std::env::temp_dir().join(format!("nccl-rs-topo-{}", std::process::id()));
        let dev = root.join("devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0");
        std::fs::create_dir_all(&dev).expect("a temporary directory");
        std::fs::write(dev.join("numa_node"), "1\n").expect("a file");
        std::fs::create_dir_all(root.join("bus/pci/devices")).expect("a temporary directory");
        let _ = std::os::unix::fs::symlink(&dev, root.join("bus/pci/devices/0000:3b:00.0"));
        let root_s = root.to_string_lossy().into_owned();
        let place = GpuPlace::of_bus_id(&root_s, "0000:3B:00.0");
        let gone = GpuPlace::of_bus_id(&root_s, "0000:5e:00.0");
        let _ = std::fs::remove_dir_all(&root);
        assert_eq!(place, at("pci0000:3a/0000:3a:00.0/0000:3b:00.0", 1));
        assert_eq!(gone, GpuPlace { bus: "0000:5e:00.0".into(), numa: -1, ..GpuPlace::default() });
    }
}
