//! Where bytes live and how they are copied and reduced. `host` works on ordinary host memory;
//! CUDA mode adds a `cuda` backend beside it. Everything here is `unsafe` inside and safe outside:
//! the raw addresses it receives were vouched for at the C boundary.

pub mod cuda;
pub mod host;
pub mod mode;
