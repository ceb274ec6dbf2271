//! Device memory of the virtual memory API (`cuMemCreate` + `cuMemMap`: PyTorch's expandable
//! segments, NVIDIA's `ncclMemAlloc`) shared with other processes of the host. CUDA IPC
//! handles do not cover it, and one buffer may span several physical allocations mapped side
//! by side (PyTorch maps every 20 MiB on its own; `cuMemGetAddressRange` names one of them).
//!
//! An owner describes the allocations behind a buffer ([`segments`]: where each is mapped, its
//! size, its buffer ID — which the driver never gives twice in a process — and its device), a
//! cheap query made at every call. A peer that has not mapped them yet asks the owner for
//! their POSIX file descriptors (how is the transports' business); the owner exports one only
//! then ([`export`]), after checking that the allocation is still the one described, and does
//! not keep it: an open descriptor would keep the memory alive after its user freed it. The
//! peer maps the allocations again side by side ([`VmmMapping`]).

use std::ffi::c_void;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use cudarc::driver::sys::{self, CUdeviceptr, CUmemGenericAllocationHandle, CUpointer_attribute, CUresult};

use super::{check, driver};
use crate::error::{Error, Result};

/// More allocations than this behind one buffer are not shared (the operation is staged).
pub const MAX_SEGMENTS: usize = 256;

/// One physical allocation behind a buffer, as its owner describes it: where it is mapped in
/// the owner's process, its size, its buffer ID and its device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Segment {
    pub addr: u64,
    pub size: u64,
    pub id: u64,
    pub device: i32,
}

impl Segment {
    /// The same allocation at the same place.
    pub fn same_memory(&self, other: &Segment) -> bool {
        (self.addr, self.size, self.id) == (other.addr, other.size, other.id)
    }
}

/// The buffer ID, device and shareable handle types of the allocation mapped at `addr`.
fn attributes(addr: usize) -> Result<(u64, i32, u32)> {
    driver("cuPointerGetAttributes", || {
        let (r, slots) = super::memory::pointer_attributes(addr, [
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_BUFFER_ID,
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES,
        ]);
        check("cuPointerGetAttributes(BUFFER_ID, DEVICE_ORDINAL, ALLOWED_HANDLE_TYPES)", r)?;
        let [id, device, types] = slots;
        Ok((id, device as u32 as i32, types as u32))
    })
}

/// The allocations that hold `[addr, addr + len)`, in address order. An error where some of
/// the memory is not of the virtual memory API, was created without the POSIX descriptor
/// handle type, or spans more than [`MAX_SEGMENTS`] allocations.
pub fn segments(addr: usize, len: usize) -> Result<Vec<Segment>> {
    let end = addr.checked_add(len).ok_or_else(|| Error::internal("buffer past the address space"))?;
    let posix = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.0;
    let mut out = Vec::new();
    let mut at = addr;
    while at < end {
        if out.len() == MAX_SEGMENTS {
            return Err(Error::system(format!("a buffer of {len} bytes spans more than {MAX_SEGMENTS} allocations")));
        }
        let (base, size) = super::allocation_of(at)?;
        if size == 0 || base.saturating_add(size) <= at {
            return Err(Error::internal(format!("cuMemGetAddressRange({at:#x}): {base:#x}+{size}")));
        }
        let (id, device, types) = attributes(base)?;
        if types & posix == 0 {
            return Err(Error::system(format!("the allocation at {base:#x} cannot be exported as a descriptor")));
        }
        out.push(Segment { addr: base as u64, size: size as u64, id, device });
        at = base + size;
    }
    Ok(out)
}

/// A new POSIX descriptor of the allocation `seg` describes, if it is still mapped there (its
/// place, size and buffer ID unchanged). The caller owns it.
pub fn export(seg: &Segment) -> Result<OwnedFd> {
    let gone = || Error::system(format!("the allocation at {:#x} is no longer the one published", seg.addr));
    let still = || -> Result<bool> {
        let range = super::allocation_of(seg.addr as usize)?;
        Ok(range == (seg.addr as usize, seg.size as usize) && attributes(seg.addr as usize)?.0 == seg.id)
    };
    if !still()? {
        return Err(gone());
    }
    let fd = driver("cuMemExportToShareableHandle", || {
        let mut h: CUmemGenericAllocationHandle = 0;
        // SAFETY: `h` is a valid out-pointer; the driver checks that the address is mapped memory.
        check("cuMemRetainAllocationHandle", unsafe {
            sys::cuMemRetainAllocationHandle(&mut h, seg.addr as usize as *mut c_void)
        })?;
        let mut fd: i32 = -1;
        let ty = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        // SAFETY: a POSIX handle is an int, written to `fd`; `h` is the handle just retained.
        let r = unsafe { sys::cuMemExportToShareableHandle((&mut fd as *mut i32).cast::<c_void>(), h, ty, 0) };
        // SAFETY: releases the reference cuMemRetainAllocationHandle took; the mapping keeps its own.
        let released = unsafe { sys::cuMemRelease(h) };
        check("cuMemExportToShareableHandle", r)?;
        if fd < 0 {
            return Err(Error::system("cuMemExportToShareableHandle gave no descriptor"));
        }
        // SAFETY: the driver just opened `fd` for us; nothing else owns it.
        let owned = crate::abi::stdio::lifted(unsafe { OwnedFd::from_raw_fd(fd) });
        check("cuMemRelease", released)?;
        Ok(owned)
    })?;
    // Unmapped and mapped again meanwhile (only if its user freed a buffer in use): refused.
    if still()? { Ok(fd) } else { Err(gone()) }
}

/// A reservation of device addresses and the allocations mapped into it, one after the other;
/// unmapped and freed on drop.
struct Reservation {
    addr: CUdeviceptr,
    size: usize,
    /// Offset and size of each mapping made in the reservation.
    mapped: Vec<(usize, usize)>,
}

impl Reservation {
    /// `size` bytes of addresses, aligned to `align` (the allocations' granularity).
    fn new(size: usize, align: usize, maps: usize) -> Result<Reservation> {
        let mut addr: CUdeviceptr = 0;
        // SAFETY: `addr` is a valid out-pointer; the driver checks size and alignment.
        check(format_args!("cuMemAddressReserve({size} bytes)"), unsafe {
            sys::cuMemAddressReserve(&mut addr, size, align.max(1), 0, 0)
        })?;
        Ok(Reservation { addr, size, mapped: Vec::with_capacity(maps) })
    }

    /// Maps allocation `h` of `len` bytes after those mapped so far; `h` is released either way
    /// (a mapping holds its own reference).
    fn map_next(&mut self, h: CUmemGenericAllocationHandle, len: usize) -> Result<()> {
        let off = self.mapped.last().map_or(0, |&(o, l)| o + l);
        let fits = off.checked_add(len).is_some_and(|end| end <= self.size);
        let r = match fits {
            // SAFETY: maps the allocation at its place inside our reservation (checked: it fits).
            true => unsafe { sys::cuMemMap(self.addr + off as u64, len, 0, h, 0) },
            false => CUresult::CUDA_ERROR_INVALID_VALUE,
        };
        // SAFETY: releases the reference the caller's handle holds; the mapping, if made, has its own.
        unsafe { sys::cuMemRelease(h) };
        check(format_args!("cuMemMap({len} bytes)"), r)?;
        self.mapped.push((off, len));
        Ok(())
    }

    /// Makes the whole reservation readable and writable by `device`.
    fn allow(&self, device: i32) -> Result<()> {
        let access = sys::CUmemAccessDesc {
            location: location(device),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the whole reservation is mapped; one access descriptor.
        check("cuMemSetAccess", unsafe { sys::cuMemSetAccess(self.addr, self.size, &access, 1) })
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        // A failure cannot be reported from drop.
        let _ = driver("cuMemUnmap", || {
            for &(off, len) in &self.mapped {
                // SAFETY: a mapping this value made, no longer used once it is dropped.
                let _ = unsafe { sys::cuMemUnmap(self.addr + off as u64, len) };
            }
            // SAFETY: the reservation this value made, now unmapped.
            check("cuMemAddressFree", unsafe { sys::cuMemAddressFree(self.addr, self.size) })
        });
    }
}

fn location(device: i32) -> sys::CUmemLocation {
    sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: device }
}

/// Device memory of `device`, exportable as POSIX descriptors.
fn allocation_prop(device: i32) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        location: location(device),
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 { compressionType: 0, gpuDirectRDMACapable: 0, usage: 0,
                                                                 reserved: [0; 4] },
    }
}

/// The granularity allocations of `prop` are sized and mapped in.
fn granularity(prop: &sys::CUmemAllocationProp) -> Result<usize> {
    let mut gran = 0usize;
    let minimum = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
    // SAFETY: valid out-pointer and property struct.
    check("cuMemGetAllocationGranularity", unsafe { sys::cuMemGetAllocationGranularity(&mut gran, prop, minimum) })?;
    Ok(gran.max(1))
}

/// Another process's allocations mapped side by side into this one, readable and writable by
/// one device; unmapped on drop.
pub struct VmmMapping {
    r: Reservation,
}

// SAFETY: the mapping is a device address range owned by this value; the driver is thread-safe.
unsafe impl Send for VmmMapping {}
// SAFETY: as for Send.
unsafe impl Sync for VmmMapping {}

impl VmmMapping {
    /// Maps another process's `segments` (one buffer's allocations, in address order) for
    /// `device` of this process, in the current context, receiving each one's descriptor from
    /// `fd_of` just before it is imported. Only a refused access (devices without peer access)
    /// is a CUDA error: anything else — a descriptor not received, addresses or memory short —
    /// may pass, and is a system error.
    pub fn import(segments: &[Segment], device: i32, fd_of: &mut dyn FnMut(&Segment) -> Result<OwnedFd>)
                  -> Result<VmmMapping> {
        let size = segments.iter().try_fold(0usize, |a, s| a.checked_add(s.size as usize))
            .ok_or_else(|| Error::internal("peer allocations past the address space"))?;
        let passing = |e: Error| Error::system(e.msg);
        driver("cuMemMap", || {
            let gran = granularity(&allocation_prop(device))?;
            // From here on, drop undoes what was done.
            let mut r = Reservation::new(size, gran, segments.len()).map_err(passing)?;
            for s in segments {
                let fd = fd_of(s).map_err(passing)?;
                let mut h: CUmemGenericAllocationHandle = 0;
                let ty = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
                let os = fd.as_raw_fd() as isize as *mut c_void;
                // SAFETY: `h` is a valid out-pointer; a POSIX handle is passed as the descriptor's value.
                let imported = unsafe { sys::cuMemImportFromShareableHandle(&mut h, os, ty) };
                drop(fd);
                check("cuMemImportFromShareableHandle", imported).map_err(passing)?;
                r.map_next(h, s.size as usize).map_err(passing)?;
            }
            r.allow(device)?;
            Ok(VmmMapping { r })
        })
    }

    /// Where the first allocation starts in this process.
    pub fn addr(&self) -> usize {
        self.r.addr as usize
    }

    pub fn size(&self) -> usize {
        self.r.size
    }
}

/// Device memory of the virtual memory API as PyTorch's expandable segments allocate it:
/// allocations of `chunk` bytes (a multiple of the granularity), each its own `cuMemCreate`
/// (exportable as a POSIX descriptor, as PyTorch's are, unless told otherwise), mapped side by
/// side for the current context's device (benchmarks and tests; nccl-rs's own memory comes
/// from `alloc`). Freed on drop.
pub struct VmmAllocation {
    r: Reservation,
}

// SAFETY: device memory owned by this value; the driver is thread-safe.
unsafe impl Send for VmmAllocation {}

impl VmmAllocation {
    /// At least `bytes`, in allocations of `chunk` bytes rounded up to the granularity.
    pub fn new(bytes: usize, chunk: usize, exportable: bool) -> Result<VmmAllocation> {
        let device = super::current_device()?.ok_or_else(|| Error::internal("no current CUDA context"))?;
        driver("cuMemCreate", || {
            let mut prop = allocation_prop(device);
            if !exportable {
                prop.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
            }
            let gran = granularity(&prop)?;
            let chunk = chunk.max(1).div_ceil(gran) * gran;
            let size = bytes.max(1).div_ceil(chunk) * chunk;
            // From here on, drop undoes what was done.
            let mut r = Reservation::new(size, gran, size / chunk)?;
            for _ in 0..size / chunk {
                let mut h: CUmemGenericAllocationHandle = 0;
                // SAFETY: `h` is a valid out-pointer; `prop` describes device memory.
                check(format_args!("cuMemCreate({chunk} bytes)"), unsafe { sys::cuMemCreate(&mut h, chunk, &prop, 0) })?;
                r.map_next(h, chunk)?;
            }
            r.allow(device)?;
            Ok(VmmAllocation { r })
        })
    }

    /// Where the memory starts.
    pub fn ptr(&self) -> *mut c_void {
        self.r.addr as usize as *mut c_void
    }

    pub fn size(&self) -> usize {
        self.r.size
    }
}
