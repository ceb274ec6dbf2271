//! Group calls.

use super::types::*;
use crate::error::Error;

export! {
    fn ncclGroupStart() {
        crate::group::start()
    }
    fn ncclGroupEnd() {
        crate::group::end()
    }
    fn ncclGroupSimulateEnd(simInfo: *mut ncclSimInfo_t) {
        // NCCL closes the group before looking at simInfo.
        let seconds = crate::group::simulate_end()?;
        ensure!(!simInfo.is_null(), Error::invalid_arg("simInfo is NULL"));
        // SAFETY: non-NULL simInfo points to at least the size/magic/version header.
        let (size, magic) = unsafe { ((*simInfo).size, (*simInfo).magic) };
        ensure!(magic == NCCL_SIM_INFO_MAGIC, Error::invalid_arg(format!(
            "simInfo magic 0x{magic:x} is not NCCL_SIM_INFO_INITIALIZER's; initialise it with NCCL_SIM_INFO_INITIALIZER")));
        ensure!(size >= std::mem::size_of::<ncclSimInfo_t>(), Error::invalid_arg(format!("simInfo size {size} is too small")));
        // SAFETY: size checked to cover estimatedTime.
        unsafe { (*simInfo).estimatedTime = seconds };
        Ok(())
    }
}
