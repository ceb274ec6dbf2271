//! API semantics: argument validation, configs, and what each call does, in safe Rust.

pub mod coll;
pub mod config;
pub mod init;
pub mod mem;
pub mod rma;
pub mod split;
