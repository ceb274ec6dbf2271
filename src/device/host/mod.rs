//! Host memory: the buffers of host mode, how they are named below the boundary (`Region`),
//! copied and reduced.
//!
//! Users hand NCCL raw pointers whose valid length is defined by each call's semantics. The C
//! boundary wraps them in [`UserPtr`] (an `unsafe` promise), the api layer turns them into
//! [`Region`]s of the lengths NCCL documents, and only this module dereferences regions.

pub mod fp8;
pub mod reduce;

use std::ffi::c_void;

use crate::error::{Error, Result};
use crate::types::{DataType, Scalar};
pub use reduce::ElemOp;

/// A pointer the user passed to an NCCL call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UserPtr(usize);

impl UserPtr {
    /// # Safety
    /// `p` must be a buffer argument of an NCCL call: valid (and writable, for outputs) for the
    /// bytes that call's documented semantics cover, until the operation completes.
    pub unsafe fn new<T>(p: *const T) -> UserPtr {
        UserPtr(p as usize)
    }
    pub fn is_null(self) -> bool {
        self.0 == 0
    }
    pub fn addr(self) -> usize {
        self.0
    }
}

/// `len` bytes at `addr`: user memory covered by a call's contract, or memory we own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    addr: usize,
    len: usize,
}

impl Region {
    /// The `len` bytes at `offset` from a user pointer. The api layer computes `offset`/`len`
    /// from NCCL's semantics for the call, which is what makes dereferencing them sound.
    pub fn user(p: UserPtr, offset: usize, len: usize) -> Region {
        Region { addr: p.0.wrapping_add(offset), len }
    }
    /// Memory the library owns (scratch); the owner keeps it alive while the region is in use.
    pub fn owned(buf: &mut [u8]) -> Region {
        Region { addr: buf.as_mut_ptr() as usize, len: buf.len() }
    }
    pub const EMPTY: Region = Region { addr: 0, len: 0 };
    /// `len` bytes at no address: where scratch could not be had. A plan holding one is
    /// refused before it runs (`plan::Builder::short`), so it is never read or written.
    pub const fn unbacked(len: usize) -> Region {
        Region { addr: 0, len }
    }
    pub fn addr(self) -> usize {
        self.addr
    }
    pub fn len(self) -> usize {
        self.len
    }
    pub fn is_empty(self) -> bool {
        self.len == 0
    }
    pub fn overlaps(self, other: Region) -> bool {
        self.len > 0 && other.len > 0 && self.addr < other.addr + other.len && other.addr < self.addr + self.len
    }
    /// Where this region starts in `outer`, if it lies wholly inside it (neither empty).
    pub fn offset_in(self, outer: Region) -> Option<usize> {
        let inside = self.len > 0 && outer.len > 0 && self.addr >= outer.addr
            && self.addr + self.len <= outer.addr + outer.len;
        inside.then(|| self.addr - outer.addr)
    }
    /// A sub-range; `off + len` must lie inside (checked: schedules are generated, not trusted).
    pub fn sub(self, off: usize, len: usize) -> Region {
        assert!(off.checked_add(len).is_some_and(|e| e <= self.len), "sub-region out of range");
        Region { addr: self.addr + off, len }
    }

    /// Read-only view for transports that send it.
    ///
    /// # Safety
    /// Nobody writes the region while the slice lives (the schedule orders writes after sends).
    pub unsafe fn as_slice<'a>(self) -> &'a [u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: per the caller's promise and the Region contract (valid for len bytes).
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }

    /// Writable view for transports that receive into it.
    ///
    /// # Safety
    /// Nobody else reads or writes the region while the slice lives (the schedule gives a
    /// receive's region to that receive alone until it completes).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice<'a>(self) -> &'a mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: per the caller's promise and the Region contract (valid for len bytes).
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len) }
    }
}

/// `len` zeroed bytes of host memory the library owns, for a copy of a user's buffer or a
/// peer's message: a size the system cannot hold is refused (`what` names it), not aborted on.
/// Zeroed by the allocator (fresh pages for a large one), not by a pass over the buffer.
pub fn zeroed(len: usize, what: &dyn Fn() -> String) -> crate::error::Result<Vec<u8>> {
    if len == 0 {
        return Ok(Vec::new());
    }
    let refused = || crate::error::Error::system(format!("no memory for {} ({len} bytes)", what()));
    let layout = std::alloc::Layout::array::<u8>(len).map_err(|_| refused())?;
    // SAFETY: the layout's size is not zero (checked above).
    let p = unsafe { std::alloc::alloc_zeroed(layout) };
    if p.is_null() {
        return Err(refused());
    }
    // SAFETY: p comes from the global allocator with the layout of [u8; len] (Vec<u8>'s for
    // capacity len), and all len bytes are initialised (zeroed).
    Ok(unsafe { Vec::from_raw_parts(p, len, len) })
}

/// Grows `v` to at least `len` bytes (zeros appended), or says it cannot (as [`zeroed`]).
pub fn grow(v: &mut Vec<u8>, len: usize, what: &dyn Fn() -> String) -> crate::error::Result<()> {
    if v.len() < len {
        v.try_reserve_exact(len - v.len())
            .map_err(|_| crate::error::Error::system(format!("no memory for {} ({len} bytes)", what())))?;
        v.resize(len, 0);
    }
    Ok(())
}

/// dst <- src (same length; the two may overlap); large copies write around the cache.
pub fn copy(dst: Region, src: Region) {
    debug_assert_eq!(dst.len, src.len);
    let n = dst.len.min(src.len);
    if n >= STREAM_MIN && dst.addr != src.addr && !dst.overlaps(src) && stream_copy(dst.addr, src.addr, n) {
        return;
    }
    copy_to_read(dst, src);
}

/// dst <- src, for a copy read again at once (scratch a send goes from): ordinary stores at
/// any size, so the reads that follow find it in the cache. (With [`copy`]'s non-temporal
/// stores, an in-place exchange of 256 KiB between two processes took 69-79 µs, its send
/// reading the copy back from memory; with these, 45 µs.)
pub fn copy_to_read(dst: Region, src: Region) {
    debug_assert_eq!(dst.len, src.len);
    let n = dst.len.min(src.len);
    if n == 0 || dst.addr == src.addr {
        return;
    }
    // SAFETY: both regions are valid for n bytes (Region contract); `copy` is memmove.
    unsafe { std::ptr::copy(src.addr as *const u8, dst.addr as *mut u8, n) };
}

/// Copies at least this large write around the cache (non-temporal stores): the data is not
/// read again soon, and a write that does not first read each line in (as ordinary stores
/// do) moves a third fewer bytes through memory. glibc's memcpy only does so above a
/// threshold of a large fraction of the last-level cache, far above the slices we copy.
const STREAM_MIN: usize = 256 << 10;

/// dst <- src with AVX2 non-temporal stores, if the CPU has AVX2; false (nothing done) if not.
fn stream_copy(dst: usize, src: usize, n: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 is present (checked); the caller guarantees dst and src are valid
            // for n bytes and do not overlap.
            unsafe { stream_copy_avx2(dst as *mut u8, src as *const u8, n) };
            return true;
        }
    }
    let _ = (dst, src, n);
    false
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
/// # Safety
/// AVX2 must be available; `dst` and `src` valid for `n` bytes and disjoint.
unsafe fn stream_copy_avx2(dst: *mut u8, src: *const u8, n: usize) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256, _mm_sfence};
    // Head: ordinary copy up to a 32-byte aligned destination.
    let head = (32 - (dst as usize & 31)) & 31;
    // SAFETY (whole function): every access stays within [0, n) of both buffers.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, head);
        let mut i = head;
        while i + 128 <= n {
            let a = _mm256_loadu_si256(src.add(i) as *const __m256i);
            let b = _mm256_loadu_si256(src.add(i + 32) as *const __m256i);
            let c = _mm256_loadu_si256(src.add(i + 64) as *const __m256i);
            let d = _mm256_loadu_si256(src.add(i + 96) as *const __m256i);
            _mm256_stream_si256(dst.add(i) as *mut __m256i, a);
            _mm256_stream_si256(dst.add(i + 32) as *mut __m256i, b);
            _mm256_stream_si256(dst.add(i + 64) as *mut __m256i, c);
            _mm256_stream_si256(dst.add(i + 96) as *mut __m256i, d);
            i += 128;
        }
        std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), n - i);
        // Non-temporal stores are weakly ordered: fence before anyone is told the data is there.
        _mm_sfence();
    }
}

/// dst <- src bytes received from a transport.
pub fn copy_in(dst: Region, src: &[u8]) {
    let n = dst.len.min(src.len());
    if n == 0 {
        return;
    }
    // SAFETY: dst valid for n bytes (Region contract); src is a live slice that cannot alias
    // user memory handed to us as writable.
    unsafe { std::ptr::copy(src.as_ptr(), dst.addr as *mut u8, n) };
}

/// dst[i] <- acc[i] op incoming[i]; `acc` may be `dst` itself.
pub fn reduce_in(dt: DataType, op: ElemOp, dst: Region, acc: Region, incoming: &[u8]) {
    let n = dst.len.min(acc.len).min(incoming.len()) / dt.size();
    // SAFETY: regions valid for their lengths; incoming is a live slice; dst equals acc or does
    // not overlap it (schedules only reduce in place or between disjoint buffers).
    unsafe { reduce::reduce(dt, op, dst.addr as *mut u8, acc.addr as *const u8, incoming.as_ptr(), n) };
}

/// dst[i] <- acc[i] * scalar + incoming[i] (PreMulSum: `acc` is the rank's own input, scaled
/// as it is read; see `reduce::scaled_sum`); `acc` may be `dst` itself.
pub fn reduce_in_scaled(dt: DataType, dst: Region, acc: Region, scalar: Scalar, incoming: &[u8]) {
    let n = dst.len.min(acc.len).min(incoming.len()) / dt.size();
    // SAFETY: as in reduce_in.
    unsafe { reduce::scaled_sum(dt, dst.addr as *mut u8, acc.addr as *const u8, scalar, incoming.as_ptr(), n) };
}

/// dst[i] <- a[i] op b[i] between local regions.
pub fn reduce_local(dt: DataType, op: ElemOp, dst: Region, a: Region, b: Region) {
    let n = dst.len.min(a.len).min(b.len) / dt.size();
    // SAFETY: as in reduce_in; all three are valid regions.
    unsafe { reduce::reduce(dt, op, dst.addr as *mut u8, a.addr as *const u8, b.addr as *const u8, n) };
}

/// dst[i] <- src[i] * scalar.
pub fn premul(dt: DataType, dst: Region, src: Region, scalar: Scalar) {
    let n = dst.len.min(src.len) / dt.size();
    // SAFETY: both valid regions; dst equals src or is disjoint from it.
    unsafe { reduce::premul(dt, dst.addr as *mut u8, src.addr as *const u8, scalar, n) };
}

pub use reduce::avg_scalar;

/// Regions (a group's receive buffers, say), to tell whether another one overlaps any of them
/// in O(log n): a group of all-to-all sends and receives holds two per peer.
pub struct RegionSet {
    /// Sorted by start, each with the furthest end of it and those before it.
    starts: Vec<(usize, usize)>,
}

impl RegionSet {
    pub fn new(regions: impl Iterator<Item = Region>) -> RegionSet {
        let mut starts: Vec<(usize, usize)> = regions.filter(|r| !r.is_empty()).map(|r| (r.addr, r.addr + r.len)).collect();
        starts.sort_unstable();
        let mut furthest = 0;
        for r in &mut starts {
            furthest = furthest.max(r.1);
            r.1 = furthest;
        }
        RegionSet { starts }
    }

    pub fn overlaps(&self, r: Region) -> bool {
        // The regions starting before `r` ends; one of them reaches into it if the furthest does.
        let before = self.starts.partition_point(|&(start, _)| start < r.addr + r.len);
        !r.is_empty() && before > 0 && self.starts[before - 1].1 > r.addr
    }
}


/// dst[i] <- dst[i] / divisor (ncclAvg's last step).
pub fn divide(dt: DataType, dst: Region, divisor: u64) {
    let n = dst.len / dt.size();
    // SAFETY: dst valid; in place is allowed by `divide`'s contract.
    unsafe { reduce::divide(dt, dst.addr as *mut u8, dst.addr as *const u8, divisor, n) };
}

/// Read one element of `dt` from user memory (a PreMulSum scalar).
pub fn read_scalar(dt: DataType, p: UserPtr) -> Result<Scalar> {
    if p.is_null() {
        return Err(Error::invalid_arg("scalar is NULL"));
    }
    let mut bytes = [0u8; 8];
    // SAFETY: the scalar argument points to one element of `dt` (NCCL's contract).
    unsafe { std::ptr::copy_nonoverlapping(p.0 as *const u8, bytes.as_mut_ptr(), dt.size()) };
    reduce::scalar_from_bytes(dt, &bytes).ok_or_else(|| Error::internal("scalar conversion"))
}

/// Blocks of `ncclMemAlloc` in host mode that are not freed yet: address -> layout. A pointer
/// not in it (never allocated here, or freed already) is refused, never handed to the
/// allocator.
/// A forked child keeps them (its copies of the blocks are its own to free).
static HOST_BLOCKS: crate::abi::fork::PerForkMutex<Option<std::collections::HashMap<usize, std::alloc::Layout>>> =
    crate::abi::fork::PerFork::new(crate::abi::fork::inherit);

/// `ncclMemAlloc` in host mode: page-aligned, zeroed host memory.
pub fn alloc(size: usize) -> Result<*mut c_void> {
    const ALIGN: usize = 4096;
    let layout = std::alloc::Layout::from_size_align(size.max(1), ALIGN)
        .map_err(|_| Error::invalid_arg(format!("size {size} too large")))?;
    // SAFETY: layout has non-zero size.
    let p = unsafe { std::alloc::alloc_zeroed(layout) };
    if p.is_null() {
        return Err(Error::system(format!("ncclMemAlloc: out of host memory allocating {size} bytes")));
    }
    HOST_BLOCKS.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert_with(Default::default).insert(p as usize, layout);
    Ok(p.cast())
}

/// `ncclMemFree` of a block from [`alloc`]; NULL is a no-op, anything else is refused.
pub fn free(p: *mut c_void) -> Result<()> {
    if p.is_null() {
        return Ok(());
    }
    let layout = HOST_BLOCKS.lock().unwrap_or_else(|e| e.into_inner()).as_mut().and_then(|m| m.remove(&(p as usize)))
        .ok_or_else(|| Error::invalid_arg(format!("{p:p} was not returned by ncclMemAlloc, or was freed already")))?;
    // SAFETY: p was returned by alloc with this layout and is freed once (just taken out of the table).
    unsafe { std::alloc::dealloc(p.cast(), layout) };
    Ok(())
}

#[cfg(test)]
mod copy_tests {
    use super::*;

    /// A region overlaps the set if it shares a byte with any member, however the members lie
    /// (nested, out of order, touching); empty regions overlap nothing.
    #[test]
    fn region_sets_tell_overlaps() {
        let mut buf = vec![0u8; 100];
        let all = Region::owned(&mut buf);
        let set = RegionSet::new([all.sub(60, 10), all.sub(10, 40), all.sub(20, 5), all.sub(0, 0)].into_iter());
        for (off, len, want) in [(0, 10, false), (0, 11, true), (49, 1, true), (50, 10, false), (55, 6, true),
                                 (69, 5, true), (70, 30, false), (30, 0, false)] {
            assert_eq!(set.overlaps(all.sub(off, len)), want, "{off}+{len}");
        }
        assert!(!RegionSet::new(std::iter::empty()).overlaps(all));
    }

    /// Large copies take the non-temporal path: every alignment of both ends and lengths that
    /// are not multiples of its 128-byte step land exactly, and nothing outside is touched; and
    /// so do copies made to be read (`copy_to_read`, ordinary stores).
    #[test]
    fn large_copies_are_exact_at_every_alignment() {
        let n = STREAM_MIN + 4096;
        let src: Vec<u8> = (0..n + 64).map(|i| (i * 7 + i / 251) as u8).collect();
        for (so, doff, len) in [(0, 0, STREAM_MIN), (1, 3, STREAM_MIN + 1), (31, 17, STREAM_MIN + 127), (8, 40, n)] {
            let mut s = src.clone();
            for to_read in [false, true] {
                let mut dst = vec![0xeeu8; n + 128];
                let (d, from) = (Region::owned(&mut dst[doff..doff + len]), Region::owned(&mut s[so..so + len]));
                if to_read { copy_to_read(d, from) } else { copy(d, from) }
                assert!(dst[doff..doff + len] == src[so..so + len], "src+{so} -> dst+{doff}, {len} bytes ({to_read})");
                assert!(dst[..doff].iter().chain(&dst[doff + len..]).all(|&b| b == 0xee), "wrote outside the region");
            }
        }
    }
}
