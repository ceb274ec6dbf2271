//! The one decision between CUDA mode and host mode, made once per process.
//!
//! CUDA is loaded at run time through cudarc's dynamic loading. cudarc panics when
//! `libcuda.so.1` is missing or lacks a symbol, so every probe runs inside `catch_unwind`: a
//! missing or broken driver selects host mode and never aborts the caller.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// No usable CUDA driver: buffers are host memory, streams are ignored.
    Host,
    /// The driver loaded and `cuInit` succeeded with at least one device.
    Cuda { devices: i32 },
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Host => "host",
            Mode::Cuda { .. } => "cuda",
        }
    }
}

pub fn current() -> Mode {
    static MODE: OnceLock<Mode> = OnceLock::new();
    *MODE.get_or_init(probe)
}

/// CUDA mode: a driver with at least one device.
pub fn is_cuda() -> bool {
    matches!(current(), Mode::Cuda { .. })
}

fn probe() -> Mode {
    let result = catch_unwind(AssertUnwindSafe(|| {
        use cudarc::driver::sys;
        // SAFETY: is_culib_present only attempts dlopen of the driver library and drops it.
        if !unsafe { sys::is_culib_present() } {
            return Mode::Host;
        }
        // SAFETY: cuInit(0) and cuDeviceGetCount are callable at any time once the driver loaded;
        // a missing symbol panics inside cudarc, which catch_unwind turns into host mode.
        let init = unsafe { sys::cuInit(0) };
        if init != sys::CUresult::CUDA_SUCCESS {
            // Not silent: a program that passes device memory would otherwise crash in host
            // mode. 34 (CUDA_ERROR_STUB_LIBRARY) is the CUDA toolkit's stub libcuda.so found
            // before the driver's.
            crate::warn!("nccl-rs: a CUDA driver library loaded but cuInit failed ({}): host mode, device buffers \
                          cannot be used{}", super::cuda::result_name(init),
                         if init as u32 == 34 { " (a stub libcuda.so of the CUDA toolkit is on the library path \
                                                  before the driver's)" } else { "" });
            return Mode::Host;
        }
        let mut count = 0;
        // SAFETY: `count` is a valid out-pointer for the duration of the call.
        let r = unsafe { sys::cuDeviceGetCount(&mut count) };
        if r != sys::CUresult::CUDA_SUCCESS || count <= 0 {
            return Mode::Host;
        }
        Mode::Cuda { devices: count }
    }));
    let mode = result.unwrap_or(Mode::Host);
    crate::info!(INIT, "nccl-rs: {} mode", mode.name());
    mode
}

#[cfg(test)]
mod tests {
    #[test]
    fn probe_never_panics_and_is_stable() {
        let a = super::current();
        let b = super::current();
        assert_eq!(a, b);
    }
}
