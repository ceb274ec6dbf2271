//! Communicator configuration, from `ncclConfig_t` of any header version.

use crate::error::{Error, Result};
use crate::params;

/// NCCL_CONFIG_UNDEF_INT.
pub const UNDEF: i32 = i32::MIN;
pub const API_MAGIC: u32 = 0xcafe_beef;
/// The smallest config any header version passes: size, magic, version.
pub const HEADER_BYTES: usize = 16;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// false: calls may return ncclInProgress and finish in the background.
    pub blocking: bool,
    pub name: Option<String>,
    pub split_share: bool,
    /// One-sided operations: contexts (`numRmaCtx`) and signals per peer (`numRmaSig`).
    pub rma_contexts: u32,
    pub rma_signals: u32,
}

impl Default for Config {
    fn default() -> Config {
        Config { blocking: default_blocking(), name: None, split_share: false, rma_contexts: 1, rma_signals: 1 }
    }
}

/// The most contexts or signals a communicator may ask for (NCCL allocates per rank and per
/// signal; a larger value is almost certainly an uninitialised field).
const RMA_MAX: i32 = 1 << 16;

fn rma_count(name: &str, v: i32) -> Result<u32> {
    match v {
        UNDEF => Ok(1),
        0..=RMA_MAX => Ok(v as u32),
        _ => Err(Error::invalid_arg(format!("config.{name} = {v}: must be between 0 and {RMA_MAX}"))),
    }
}

fn default_blocking() -> bool {
    params::raw("NCCL_COMM_BLOCKING").and_then(|v| params::parse_int(&v)) != Some(0)
}

fn flag(name: &str, v: i32, default: bool) -> Result<bool> {
    match v {
        UNDEF => Ok(default),
        0 => Ok(false),
        1 => Ok(true),
        _ => Err(Error::invalid_arg(format!("config.{name} = {v}: must be 0 or 1"))),
    }
}

impl Config {
    /// From the fields of a user's config (UNDEF where the user, or an older header, left it).
    pub fn resolve(blocking: i32, name: Option<String>, split_share: i32) -> Result<Config> {
        Ok(Config {
            blocking: flag("blocking", blocking, default_blocking())?,
            name,
            split_share: flag("splitShare", split_share, false)?,
            rma_contexts: 1,
            rma_signals: 1,
        })
    }

    /// With `numRmaCtx` and `numRmaSig` (UNDEF: one of each, NCCL's default).
    pub fn with_rma(mut self, contexts: i32, signals: i32) -> Result<Config> {
        self.rma_contexts = rma_count("numRmaCtx", contexts)?;
        self.rma_signals = rma_count("numRmaSig", signals)?;
        Ok(self)
    }
}

/// Every NCCL config struct starts with size, magic and version: refuse one that was not made
/// with its initializer macro.
pub fn check_header(what: &str, size: usize, magic: u32) -> Result<()> {
    if magic != API_MAGIC {
        return Err(Error::invalid_arg(format!(
            "{what} has magic {magic:#x}, not {API_MAGIC:#x}: initialise it with its NCCL_*_INITIALIZER macro"
        )));
    }
    if size < HEADER_BYTES {
        return Err(Error::invalid_arg(format!("{what} size {size} is smaller than its header")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_and_headers() {
        assert!(Config::resolve(1, None, UNDEF).unwrap().blocking);
        assert!(!Config::resolve(0, None, UNDEF).unwrap().blocking);
        assert!(Config::resolve(7, None, UNDEF).is_err());
        let c = Config::resolve(1, None, UNDEF).unwrap();
        let rma = c.clone().with_rma(UNDEF, 4).unwrap();
        assert_eq!((rma.rma_contexts, rma.rma_signals), (1, 4));
        assert!(c.clone().with_rma(-1, UNDEF).is_err());
        assert!(c.with_rma(UNDEF, RMA_MAX + 1).is_err());
        assert!(check_header("ncclConfig_t", 120, API_MAGIC).is_ok());
        assert!(check_header("ncclConfig_t", 120, 0).is_err());
        assert!(check_header("ncclConfig_t", 8, API_MAGIC).is_err());
    }
}
