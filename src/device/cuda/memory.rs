//! Memory the driver knows: device memory (`ncclMemAlloc` in CUDA mode), pinned host memory
//! mapped into the device (the flags the proxy and the GPU exchange), and what kind of memory a
//! user's pointer addresses.

use std::ffi::{c_uint, c_void};
use std::sync::atomic::AtomicU32;

use cudarc::driver::sys::{self, CUdeviceptr, CUmemorytype, CUpointer_attribute, CUresult};

use super::{check, driver};
use crate::error::{Error, Result};

/// Device memory of `size` bytes in the current context (`cuMemAlloc`).
pub fn alloc(size: usize) -> Result<*mut c_void> {
    driver("cuMemAlloc_v2", || {
        let mut p: CUdeviceptr = 0;
        // SAFETY: `p` is a valid out-pointer.
        check(format_args!("cuMemAlloc_v2({size} bytes)"), unsafe { sys::cuMemAlloc_v2(&mut p, size) })?;
        Ok(p as *mut c_void)
    })
}

/// Frees a block from [`alloc`]; NULL is a no-op. The driver rejects other pointers.
pub fn free(p: *mut c_void) -> Result<()> {
    if p.is_null() {
        return Ok(());
    }
    // SAFETY: the driver checks that `p` starts one of its allocations.
    driver("cuMemFree_v2", || check("cuMemFree_v2", unsafe { sys::cuMemFree_v2(p as CUdeviceptr) }))
}

/// What a pointer addresses, as the driver sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PtrKind {
    /// Memory of one device (allocated there, or a peer's mapped by CUDA IPC).
    Device { ordinal: i32 },
    /// Host memory pinned by the driver (`cuMemHostAlloc`, `cudaHostRegister`, ...).
    HostRegistered,
    /// Unified memory (`cuMemAllocManaged`).
    Managed,
    /// Plain host memory the driver does not know.
    Host,
}

impl PtrKind {
    /// Memory the device reaches in stream order, so the stream's earlier work may still be
    /// writing it: a call on it (or a PreMulSum scalar in it) runs in stream order.
    pub fn stream_ordered(self) -> bool {
        !matches!(self, PtrKind::Host)
    }

    /// Memory the device holds (device or managed memory): `cuMemcpyAsync` between it and
    /// pinned host memory returns at once. Between two host buffers, pinned or not, it is
    /// "fully synchronous with respect to the host" (CUDA: API synchronization behavior): on a
    /// stream that waits for something, the calling thread waits with it.
    pub fn on_device(self) -> bool {
        matches!(self, PtrKind::Device { .. } | PtrKind::Managed)
    }

    /// Whether `cuMemcpyAsync` between memory of this kind and of `other` returns before the
    /// stream runs it: neither is plain host memory, and one of them is on the device.
    pub fn copies_async_with(self, other: PtrKind) -> bool {
        self.stream_ordered() && other.stream_ordered() && (self.on_device() || other.on_device())
    }
}

/// Whether `addr` is host memory, pinned or not, as the driver sees it: memory a thread reads
/// and writes itself once the streams that use it have got there (a stream's copy between it
/// and other host memory would be the same memcpy after waiting for the stream: see
/// [`PtrKind::on_device`]); false if the driver cannot tell.
pub fn is_host_memory(addr: usize) -> bool {
    classify(addr).is_ok_and(|k| !k.on_device())
}

/// Whether `addr` is device memory (of any device), as the driver sees it; false if it cannot
/// tell.
pub fn is_device_memory(addr: usize) -> bool {
    matches!(classify(addr), Ok(PtrKind::Device { .. }))
}

/// Whether a kernel on the current device may write `len` bytes at `addr` by that address:
/// device memory, or pinned host memory mapped into the device at the same address (memory
/// `cuMemHostAlloc`ed under UVA; registered memory where the device uses the host pointer),
/// checked at both ends. False if the driver cannot tell.
pub fn device_reaches_as_is(addr: usize, len: usize) -> bool {
    let same = |a: usize| {
        driver("cuPointerGetAttribute", || {
            let mut device: CUdeviceptr = 0;
            // SAFETY: `device` is a valid out-pointer of the attribute's type.
            let r = unsafe {
                sys::cuPointerGetAttribute((&mut device as *mut CUdeviceptr).cast(),
                                           CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_POINTER, a as CUdeviceptr)
            };
            Ok(r == CUresult::CUDA_SUCCESS && device as usize == a)
        })
        .unwrap_or(false)
    };
    match classify(addr) {
        Ok(PtrKind::Device { .. }) => true,
        Ok(PtrKind::HostRegistered) => len > 0 && same(addr) && same(addr + (len - 1)),
        _ => false,
    }
}

/// `attrs` of `addr` in one `cuPointerGetAttributes` call: its result, and each value in a
/// zeroed 8-byte slot (every attribute asked for fits), read back from the low bytes
/// (little-endian) whatever width the driver writes, a boolean's included.
pub(super) fn pointer_attributes<const N: usize>(addr: usize, mut attrs: [CUpointer_attribute; N])
                                                  -> (CUresult, [u64; N]) {
    let mut slots = [0u64; N];
    let mut data = slots.each_mut().map(|s| (s as *mut u64).cast::<c_void>());
    // SAFETY: N attributes and N valid out-pointers of 8 bytes each.
    let r = unsafe { sys::cuPointerGetAttributes(N as c_uint, attrs.as_mut_ptr(), data.as_mut_ptr(), addr as CUdeviceptr) };
    (r, slots)
}

/// Classifies `addr` with one `cuPointerGetAttributes` call.
pub fn classify(addr: usize) -> Result<PtrKind> {
    driver("cuPointerGetAttributes", || {
        let (r, slots) = pointer_attributes(addr, [
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_MANAGED,
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        ]);
        // The driver answers memory it does not know with memory type 0 (the plural call) or
        // CUDA_ERROR_INVALID_VALUE (the singular one, and some drivers for the plural too).
        if r == CUresult::CUDA_ERROR_INVALID_VALUE {
            return Ok(PtrKind::Host);
        }
        check("cuPointerGetAttributes", r)?;
        let [memory_type, managed, ordinal] = slots;
        let memory_type = memory_type as u32;
        Ok(if managed != 0 || memory_type == CUmemorytype::CU_MEMORYTYPE_UNIFIED as u32 {
            PtrKind::Managed
        } else if memory_type == CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
            PtrKind::Device { ordinal: ordinal as u32 as i32 }
        } else if memory_type == CUmemorytype::CU_MEMORYTYPE_HOST as u32 {
            PtrKind::HostRegistered
        } else {
            PtrKind::Host
        })
    })
}

/// The allocation that contains device address `addr`: (start, size), as
/// `cuMemGetAddressRange` reports it (an IPC handle must name the start).
pub fn allocation_of(addr: usize) -> Result<(usize, usize)> {
    driver("cuMemGetAddressRange_v2", || {
        let (mut base, mut size): (CUdeviceptr, usize) = (0, 0);
        // SAFETY: valid out-pointers; the driver checks the address.
        check(format_args!("cuMemGetAddressRange({addr:#x})"), unsafe {
            sys::cuMemGetAddressRange_v2(&mut base, &mut size, addr as CUdeviceptr)
        })?;
        Ok((base as usize, size))
    })
}

/// The driver's process-wide unique id of the allocation that contains `addr`
/// (`CU_POINTER_ATTRIBUTE_BUFFER_ID`: another allocation at the same address has another).
pub fn buffer_id(addr: usize) -> Result<u64> {
    driver("cuPointerGetAttributes", || {
        let (r, [id]) = pointer_attributes(addr, [CUpointer_attribute::CU_POINTER_ATTRIBUTE_BUFFER_ID]);
        check(format_args!("cuPointerGetAttributes({addr:#x}: buffer id)"), r)?;
        // (Memory the driver does not know gets 0 from the plural call.)
        match id {
            0 => Err(Error::internal(format!("no allocation known at {addr:#x}"))),
            id => Ok(id),
        }
    })
}

/// Pinned host memory mapped into every device's address space (`cuMemHostAlloc` with
/// DEVICEMAP | PORTABLE), zeroed. The host reaches it through [`MappedHost::word`], the device
/// (copies, stream memory operations) through [`MappedHost::device_addr`]. Freed on drop.
pub struct MappedHost {
    host: *mut u8,
    device: CUdeviceptr,
    len: usize,
}

// SAFETY: the memory is owned by this value and only reached through atomics or the driver.
unsafe impl Send for MappedHost {}
// SAFETY: as for Send.
unsafe impl Sync for MappedHost {}

/// Device memory the library owns (`cuMemAlloc`), freed when dropped.
pub struct DeviceMem {
    ptr: *mut c_void,
    len: usize,
}

// SAFETY: a device address; every access to the memory is ordered by streams and the
// owner's locks, not by the thread holding this value.
unsafe impl Send for DeviceMem {}

impl DeviceMem {
    /// `len` (> 0) bytes in the current context.
    pub fn new(len: usize) -> Result<DeviceMem> {
        if len == 0 {
            return Err(Error::internal("device memory of 0 bytes"));
        }
        Ok(DeviceMem { ptr: alloc(len)?, len })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `len` bytes at `offset` of the memory (inside it: checked by `Region::sub`). It must
    /// not be used after `self` is dropped.
    pub fn region(&self, offset: usize, len: usize) -> crate::device::host::Region {
        // SAFETY: `self.len` bytes at `ptr` belong to this allocation while `self` lives;
        // regions of device memory are only passed to the driver and kernels.
        let whole = crate::device::host::Region::user(unsafe { crate::device::host::UserPtr::new(self.ptr) }, 0, self.len);
        whole.sub(offset, len)
    }
}

impl Drop for DeviceMem {
    fn drop(&mut self) {
        // A failure cannot be reported from drop.
        let _ = free(self.ptr);
    }
}

impl MappedHost {
    /// `len` (> 0) bytes, allocated in the current context.
    pub fn new(len: usize) -> Result<MappedHost> {
        if len == 0 {
            return Err(Error::internal("mapped host memory of 0 bytes"));
        }
        driver("cuMemHostAlloc", || {
            let mut host: *mut c_void = std::ptr::null_mut();
            let flags = (sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE) as c_uint;
            // SAFETY: `host` is a valid out-pointer.
            check(format_args!("cuMemHostAlloc({len} bytes)"), unsafe { sys::cuMemHostAlloc(&mut host, len, flags) })?;
            // SAFETY: the driver returned `len` writable bytes at `host`.
            unsafe { std::ptr::write_bytes(host.cast::<u8>(), 0, len) };
            let mut device: CUdeviceptr = 0;
            // SAFETY: `device` is a valid out-pointer; `host` is mapped memory (flags 0 is required).
            let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0) };
            if let Err(e) = check("cuMemHostGetDevicePointer_v2", r) {
                // SAFETY: `host` came from cuMemHostAlloc and is not used again.
                unsafe { sys::cuMemFreeHost(host) };
                return Err(e);
            }
            Ok(MappedHost { host: host.cast(), device, len })
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The host address of the memory.
    pub fn host_ptr(&self) -> *mut u8 {
        self.host
    }

    /// The address devices use for the memory (equal to the host address under UVA).
    pub fn device_addr(&self) -> usize {
        self.device as usize
    }

    /// The whole memory as a region (its host address, which devices may use too under UVA).
    /// The region must not be used after `self` is dropped.
    pub fn region(&self) -> crate::device::host::Region {
        // SAFETY: `len` bytes at `host` belong to this allocation while `self` lives.
        crate::device::host::Region::user(unsafe { crate::device::host::UserPtr::new(self.host) }, 0, self.len)
    }

    /// The `index`-th 32-bit word, shared with the device (panics if out of range).
    pub fn word(&self, index: usize) -> &AtomicU32 {
        assert!(index < self.len / 4, "word {index} outside {} bytes", self.len);
        // SAFETY: in range (checked), 4-aligned (the allocation is page-aligned), valid while
        // `self` lives; every host access goes through atomics.
        unsafe { &*self.host.add(4 * index).cast::<AtomicU32>() }
    }
}

impl Drop for MappedHost {
    fn drop(&mut self) {
        // SAFETY: `host` came from cuMemHostAlloc; the caller keeps streams that use it alive
        // no longer than this value. A failure cannot be reported from drop.
        let _ = driver("cuMemFreeHost", || check("cuMemFreeHost", unsafe { sys::cuMemFreeHost(self.host.cast()) }));
    }
}
