//! Gives the shared library NCCL's SONAME, so programs linked against it record `libnccl.so.2`
//! exactly as they would with NVIDIA's library, and names the source it is built from
//! (`NCCL_RS_SOURCE`: a hash of the package version and every file under `src/`), which ranks
//! compare when they join a job: ranks of different builds would misread each other's
//! messages, so the root refuses the job instead (as NVIDIA's library refuses mismatched
//! versions). The hash is FNV-1a, the same on every machine and compiler, so builds of one
//! source on different hosts agree.
use std::path::{Path, PathBuf};

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnccl.so.2");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src");
    let mut files = Vec::new();
    collect(Path::new("src"), &mut files);
    files.sort();
    let mut h = Fnv::default();
    h.add(env!("CARGO_PKG_VERSION").as_bytes());
    for f in &files {
        // Paths with '/' whatever the host, then the length and the bytes.
        let name = f.to_string_lossy().replace('\\', "/");
        let bytes = std::fs::read(f).unwrap_or_default();
        h.add(name.as_bytes());
        h.add(&(bytes.len() as u64).to_le_bytes());
        h.add(&bytes);
    }
    println!("cargo:rustc-env=NCCL_RS_SOURCE={:016x}", h.0);
}

fn collect(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            collect(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    fn add(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}
