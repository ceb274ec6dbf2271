//! nccl-rs: a drop-in replacement for NVIDIA's NCCL (`libnccl.so.2`).
//!
//! Layers, top to bottom (arrows point down only): `abi` (the C boundary) → `api` (argument
//! checks and semantics) → `comm`, `group`, `plan`, `algo` → `proxy` (progress engine) →
//! `transport`, `device`. `bootstrap` brings ranks together; `params` and `debug` serve all.
//! See ARCHITECTURE.md in the shared folder for the decisions behind this shape.

#[macro_use]
pub mod error;
#[macro_use]
pub mod debug;
pub mod params;
pub mod types;

pub mod abi;
pub mod algo;
pub mod api;
pub mod bootstrap;
pub mod comm;
pub mod device;
pub mod group;
pub mod plan;
pub mod proxy;
pub mod streamed;
pub mod transport;

pub use error::{Code, Error, Result};

/// The NCCL API we are compatible with (2.32.3).
pub const NCCL_MAJOR: i32 = 2;
pub const NCCL_MINOR: i32 = 32;
pub const NCCL_PATCH: i32 = 3;
pub const NCCL_VERSION_CODE: i32 = NCCL_MAJOR * 10000 + NCCL_MINOR * 100 + NCCL_PATCH;

/// The source this library is built from (build.rs): ranks of one job must all have the same.
pub const SOURCE: u64 = match u64::from_str_radix(env!("NCCL_RS_SOURCE"), 16) {
    Ok(v) => v,
    Err(_) => panic!("build.rs sets NCCL_RS_SOURCE to 16 hex digits"),
};

/// Helpers shared by unit tests.
#[cfg(test)]
pub(crate) mod testing {
    /// splitmix64: deterministic test data without a dependency.
    pub struct Rng(pub u64);

    impl Rng {
        pub fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let z = (self.0 ^ (self.0 >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            let z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }

        /// A value in `0..n` (n > 0).
        pub fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }
}
