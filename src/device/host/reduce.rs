//! Element-wise arithmetic of host mode, for all 12 datatypes: `dst = a op b` (the reduction
//! step of every collective), the PreMulSum pre-multiplication and the ncclAvg post-division.
//! This module owns the numerics (rounding, NaN, saturation); it knows nothing of ranks,
//! chunks or transports, and never allocates.
//!
//! The results are those of NVIDIA NCCL's device code (src/device/reduce_kernel.h):
//! - Integers wrap (C unsigned / two's-complement arithmetic); max/min compare as the type does.
//! - Float16, Bfloat16 and fp8 are widened exactly to f32, operated on, and rounded once to
//!   nearest-even. NCCL computes f16/bf16 natively (`__hadd`, `__hmul`: one rounding of the
//!   exact result) and fp8 in half; for one `+`, `*` or `/` a detour through a format of at
//!   least 2p+2 bits rounds to the same value, so the bits agree.
//! - fp8 saturates: NCCL converts back with `__NV_SATFINITE`, so both formats clamp to ±max
//!   finite and an e5m2 infinity becomes ±57344 (see `fp8`).
//! - Max/Min on floats ignore a NaN operand (CUDA's `fmaxf` / `__hmax`), order -0 below +0
//!   (as `__hmax` does), and give the canonical NaN when both are NaN. The result is then the
//!   same bits whichever operand comes first, so every rank computes identical bits whatever
//!   order the data arrives in.
//! - NaN results of f16, bf16 and fp8 are canonical (0x7FFF, 0x7FFF, 0x7F), as CUDA produces
//!   them. f32/f64 Sum and Prod leave NaN results to the CPU (a quiet NaN carrying an input's
//!   payload; x op y and y op x differ only when both are NaNs with different payloads):
//!   canonicalising would cost 20-40% of the in-cache speed of the commonest reduction, and a
//!   NaN sum's payload means nothing to any consumer we know.
//!
//! Speed: the loops run over slices of `[u8; size]` (alignment 1), so one loop serves aligned
//! and unaligned user buffers and LLVM vectorises it either way (measured: as fast as typed
//! slices when aligned; 3-4x faster than `read_unaligned` loops, which LLVM leaves scalar when
//! `dst == a`). bf16 and fp8 convert with branch-free bit arithmetic inside those loops; f16
//! converts with F16C 8 values an instruction and bf16 with shifts and masks, 16 values at a
//! time in registers (`lanes`; `half`'s conversions and per-value loops where the CPU has no
//! AVX2). Everything is compiled twice, for the baseline target and for AVX2 (with F16C),
//! chosen at run time.

#![deny(unsafe_op_in_unsafe_fn)]

use core::{ptr, slice};

use half::f16;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};

use super::fp8;
use crate::types::{DataType, Scalar};

/// Expands one arm per datatype with the element type bound to a local alias: `$I` for the six
/// integer types, `$F` for f32/f64, `$N` for the formats computed through f32.
#[rustfmt::skip]
macro_rules! dispatch {
    ($dt:expr, int $I:ident => $int:expr, float $F:ident => $float:expr,
     narrow $N:ident => $narrow:expr) => {
        match $dt {
            DataType::Int8 => { type $I = i8; $int }
            DataType::Uint8 => { type $I = u8; $int }
            DataType::Int32 => { type $I = i32; $int }
            DataType::Uint32 => { type $I = u32; $int }
            DataType::Int64 => { type $I = i64; $int }
            DataType::Uint64 => { type $I = u64; $int }
            DataType::Float32 => { type $F = f32; $float }
            DataType::Float64 => { type $F = f64; $float }
            DataType::Float16 => { type $N = F16; $narrow }
            DataType::Bfloat16 => { type $N = Bf16; $narrow }
            DataType::Float8e4m3 => { type $N = E4m3; $narrow }
            DataType::Float8e5m2 => { type $N = E5m2; $narrow }
        }
    };
}

/// The element operators the collectives apply between two inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ElemOp {
    Sum,
    Prod,
    Max,
    Min,
}

/// dst[i] = a[i] op b[i] for i < n elements of `dt`.
///
/// # Safety
/// Each pointer is valid (readable; `dst` writable) for `n` elements of `dt`. `dst` may be
/// exactly equal to `a` and/or `b` (in place) but must not otherwise overlap them; `a` and `b`
/// may overlap each other freely. Pointers need not be aligned. With `n == 0` nothing is
/// touched and the pointers may be anything, NULL included.
pub unsafe fn reduce(dt: DataType, op: ElemOp, dst: *mut u8, a: *const u8, b: *const u8, n: usize) {
    if n == 0 {
        return;
    }
    with_best_simd(
        #[inline(always)]
        // SAFETY: in every arm, our caller's contract is exactly the one map2 and Narrow::map2 need.
        || unsafe {
            dispatch!(dt,
                int I => match op {
                    ElemOp::Sum => map2(dst, a, b, n, I::wrapping_add),
                    ElemOp::Prod => map2(dst, a, b, n, I::wrapping_mul),
                    ElemOp::Max => map2(dst, a, b, n, I::max),
                    ElemOp::Min => map2(dst, a, b, n, I::min),
                },
                float F => match op {
                    ElemOp::Sum => map2(dst, a, b, n, |x: F, y: F| x + y),
                    ElemOp::Prod => map2(dst, a, b, n, |x: F, y: F| x * y),
                    ElemOp::Max => map2(dst, a, b, n, F::fmax),
                    ElemOp::Min => map2(dst, a, b, n, F::fmin),
                },
                narrow N => match op {
                    ElemOp::Sum => N::map2(dst, a, b, n, |x, y| x + y),
                    ElemOp::Prod => N::map2(dst, a, b, n, |x, y| x * y),
                    ElemOp::Max => N::map2(dst, a, b, n, f32::fmax),
                    ElemOp::Min => N::map2(dst, a, b, n, f32::fmin),
                }
            )
        },
    )
}

/// dst[i] = src[i] * scalar (PreMulSum's local pre-multiplication), `scalar` read as one
/// element of `dt`. Integers wrap; floats round once, as `reduce`'s Prod.
///
/// # Safety
/// `src` and `dst` are valid for `n` elements of `dt`; `dst` equals `src` or does not overlap
/// it. Pointers need not be aligned; with `n == 0` they may be anything.
pub unsafe fn premul(dt: DataType, dst: *mut u8, src: *const u8, scalar: Scalar, n: usize) {
    if n == 0 {
        return;
    }
    with_best_simd(
        #[inline(always)]
        // SAFETY: in every arm, our caller's contract is exactly the one map1 and Narrow::map1 need.
        || unsafe {
            dispatch!(dt,
                int I => {
                    let s = I::from_scalar(scalar);
                    map1(dst, src, n, |x: I| x.wrapping_mul(s))
                },
                float F => {
                    let s = F::from_scalar(scalar);
                    map1(dst, src, n, |x: F| x * s)
                },
                narrow N => {
                    let s = N::widen(<N as Narrow>::Bits::from_scalar(scalar));
                    N::map1(dst, src, n, |x| x * s)
                }
            )
        },
    )
}

/// dst[i] = a[i] * scalar + b[i]: PreMulSum's sum of a rank's own input, scaled as it is read,
/// and what arrived. The same bits as `premul` of `a` and then `reduce`'s Sum (the product is
/// rounded to the type before the sum, as NCCL scales each input on load): both run here, a
/// block at a time through a buffer that stays in L1, so a scaled copy of the whole input is
/// never written and read again.
///
/// # Safety
/// As `reduce`: each pointer valid for `n` elements of `dt`, `dst` equal to `a` or `b` or
/// disjoint from both.
pub unsafe fn scaled_sum(dt: DataType, dst: *mut u8, a: *const u8, scalar: Scalar, b: *const u8, n: usize) {
    const BLOCK: usize = 4096;
    let mut tmp = core::mem::MaybeUninit::<[u8; BLOCK]>::uninit();
    let t = tmp.as_mut_ptr().cast::<u8>();
    let (es, per) = (dt.size(), BLOCK / dt.size());
    let mut i = 0;
    while i < n {
        let k = per.min(n - i);
        // SAFETY: block [i, i+k) of each pointer is inside the caller's n elements; `t` holds k
        // elements, is written by `premul` before `reduce` reads it, and overlaps nothing else.
        // dst's block is written after a's same block was read (dst == a in place).
        unsafe {
            premul(dt, t, a.add(i * es), scalar, k);
            reduce(dt, ElemOp::Sum, dst.add(i * es), t, b.add(i * es), k);
        }
        i += k;
    }
}

/// dst[i] = src[i] / divisor (ncclAvg's finishing step after a sum).
///
/// Integers: truncating division, as C's `/` on that type (NCCL's FuncSumPostDiv); a divisor
/// larger than the type's range is honoured (the quotient is then 0, or -1 for the type's
/// minimum). Floats: computed in f32 (f64 for Float64) and rounded once. A divisor of 0, which
/// NCCL never passes (it divides by the rank count), is taken as 1 for every type.
///
/// The planner averages Float16 as NCCL does, with `premul` by [`avg_scalar`] before the
/// sum; this division is the other types' Avg (see `plan::ops::scaling`), and the direct
/// path's (see `transport::ipc`).
///
/// # Safety
/// As `premul`.
pub unsafe fn divide(dt: DataType, dst: *mut u8, src: *const u8, divisor: u64, n: usize) {
    if n == 0 {
        return;
    }
    let divisor = divisor.max(1);
    with_best_simd(
        #[inline(always)]
        // SAFETY: in every arm, our caller's contract is exactly the one map1 and Narrow::map1 need.
        || unsafe {
            dispatch!(dt,
                int I => match I::try_from(divisor) {
                    Ok(d) => map1(dst, src, n, |x: I| x / d),
                    // |x| < divisor, except the signed minimum when divisor is its magnitude.
                    Err(_) => map1(dst, src, n, |x: I| (i128::from(x) / i128::from(divisor)) as I),
                },
                float F => {
                    let d = divisor as F;
                    map1(dst, src, n, |x: F| x / d)
                },
                narrow N => {
                    let d = divisor as f32;
                    N::map1(dst, src, n, |x| x / d)
                }
            )
        },
    )
}

/// ncclAvg's factor on the types NCCL averages by scaling every input before the sum (a
/// PreMulSum): `1/nranks` rounded to the type as NCCL rounds it (through f32 for the 16-bit
/// types). None for the types it sums and then divides: the integers (NCCL's SumPostDiv) and,
/// here, fp8, whose `1/nranks` would be off by up to 6%.
pub fn avg_scalar(dt: DataType, nranks: usize) -> Option<Scalar> {
    let r = 1.0 / nranks.max(1) as f64;
    let mut scalar = Scalar { bytes: [0; 8] };
    match dt {
        DataType::Float64 => scalar.bytes = r.to_le_bytes(),
        DataType::Float32 => scalar.bytes[..4].copy_from_slice(&(r as f32).to_le_bytes()),
        DataType::Float16 => scalar.bytes[..2].copy_from_slice(&f16::from_f32(r as f32).to_bits().to_le_bytes()),
        DataType::Bfloat16 => scalar.bytes[..2].copy_from_slice(&f32_to_bf16(r as f32).to_le_bytes()),
        _ => return None,
    }
    Some(scalar)
}

/// Build a Scalar (8 bytes, little-endian, the datatype's own encoding, unused bytes zero) from
/// the first `dt.size()` bytes of `bytes`; None if `bytes` is shorter than that.
pub fn scalar_from_bytes(dt: DataType, bytes: &[u8]) -> Option<Scalar> {
    let src = bytes.get(..dt.size())?;
    let mut scalar = Scalar { bytes: [0; 8] };
    for (d, s) in scalar.bytes.iter_mut().zip(src) {
        *d = *s;
    }
    Some(scalar)
}

/// Runs `kernels` compiled for AVX2 (and F16C, which every CPU with AVX2 has, for the f16
/// conversions to inline) when the CPU has it, else for the build's baseline (SSE2 on
/// x86-64). The kernels are plain loops that LLVM vectorises; AVX2 doubles their width and adds
/// blends. Measured on 128 KiB buffers (in cache, where a pipelined allreduce's chunks are):
/// f32 sum 127 -> 150 GB/s, f32 max 26 -> 50, bf16 sum 23 -> 33, e4m3 sum 1.8 -> 3.1.
/// `kernels` must be `#[inline(always)]`, or it is compiled once, for the baseline.
#[inline(always)]
fn with_best_simd(kernels: impl FnOnce()) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c") {
        #[target_feature(enable = "avx2,f16c")]
        fn avx2(kernels: impl FnOnce()) {
            kernels()
        }
        // SAFETY: the CPU has AVX2 and F16C.
        return unsafe { avx2(kernels) };
    }
    kernels()
}

/// A type the kernels load and store directly, as native-endian bytes.
trait Elem: Copy {
    /// `[u8; size_of::<Self>()]`: alignment 1, so any address holds one.
    type Bytes: Copy;
    fn load(bytes: Self::Bytes) -> Self;
    fn store(self) -> Self::Bytes;
    /// The value a Scalar holds for this type (its first bytes, little-endian).
    fn from_scalar(s: Scalar) -> Self;
}

macro_rules! impl_elem {
    ($($t:ty),*) => {$(
        impl Elem for $t {
            type Bytes = [u8; size_of::<$t>()];
            #[inline(always)]
            fn load(bytes: Self::Bytes) -> Self {
                <$t>::from_ne_bytes(bytes)
            }
            #[inline(always)]
            fn store(self) -> Self::Bytes {
                self.to_ne_bytes()
            }
            fn from_scalar(s: Scalar) -> Self {
                let mut b = [0u8; size_of::<$t>()];
                for (d, s) in b.iter_mut().zip(s.bytes) {
                    *d = s;
                }
                <$t>::from_le_bytes(b)
            }
        }
    )*};
}
impl_elem!(i8, u8, i32, u32, i64, u64, u16, f32, f64);

/// Max and min as this module defines them for floats (see the module doc).
trait FloatMinMax {
    fn fmax(self, other: Self) -> Self;
    fn fmin(self, other: Self) -> Self;
}

macro_rules! impl_float_min_max {
    ($t:ty, $canonical_nan:expr) => {
        impl FloatMinMax for $t {
            // Written as selects, not branches, so the loops vectorise.
            #[inline(always)]
            fn fmax(self, other: $t) -> $t {
                let (x, y) = (self, other);
                let r = if x > y { x } else { y };
                // Equal: the same bits, or ±0, where AND of the bits prefers +0.
                let r = if x == y { <$t>::from_bits(x.to_bits() & y.to_bits()) } else { r };
                ignore_nan(x, y, r, <$t>::from_bits($canonical_nan))
            }
            #[inline(always)]
            fn fmin(self, other: $t) -> $t {
                let (x, y) = (self, other);
                let r = if x < y { x } else { y };
                // Equal: the same bits, or ±0, where OR of the bits prefers -0.
                let r = if x == y { <$t>::from_bits(x.to_bits() | y.to_bits()) } else { r };
                ignore_nan(x, y, r, <$t>::from_bits($canonical_nan))
            }
        }
    };
}
// CUDA's canonical NaNs: all payload bits set.
impl_float_min_max!(f32, 0x7fff_ffff);
impl_float_min_max!(f64, 0x7fff_ffff_ffff_ffff);

/// `r` when neither operand is NaN, the other operand when one is, `nan` when both are.
#[inline(always)]
#[allow(clippy::eq_op)]
fn ignore_nan<T: PartialEq + Copy>(x: T, y: T, r: T, nan: T) -> T {
    let (x_nan, y_nan) = (x != x, y != y);
    let r = if y_nan { x } else { r };
    let r = if x_nan { y } else { r };
    if x_nan & y_nan {
        nan
    } else {
        r
    }
}

/// `dst[i] = f(a[i], b[i])` for i < n, on slices of `T::Bytes`. The aliasing cases get their
/// own loops because a `&mut` slice must not alias a shared one.
///
/// # Safety
/// As `reduce`, with `n` elements of `T`.
#[inline(always)]
unsafe fn map2<T: Elem>(dst: *mut u8, a: *const u8, b: *const u8, n: usize, f: impl Fn(T, T) -> T) {
    let f = |x: T::Bytes, y: T::Bytes| f(T::load(x), T::load(y)).store();
    let (pd, pa, pb) = (dst.cast::<T::Bytes>(), a.cast::<T::Bytes>(), b.cast::<T::Bytes>());
    // SAFETY: T::Bytes is a byte array, so every address is aligned for it and every bit pattern
    // is a value. The caller makes each pointer valid for n elements and lets dst overlap a or b
    // only by being equal to it, so in each case the one `&mut` slice aliases no shared slice.
    unsafe {
        if dst.cast_const() == a && a == b {
            for z in slice::from_raw_parts_mut(pd, n) {
                *z = f(*z, *z);
            }
        } else if dst.cast_const() == a {
            let (d, b) = (slice::from_raw_parts_mut(pd, n), slice::from_raw_parts(pb, n));
            for (z, y) in d.iter_mut().zip(b) {
                *z = f(*z, *y);
            }
        } else if dst.cast_const() == b {
            let (d, a) = (slice::from_raw_parts_mut(pd, n), slice::from_raw_parts(pa, n));
            for (z, x) in d.iter_mut().zip(a) {
                *z = f(*x, *z);
            }
        } else {
            let d = slice::from_raw_parts_mut(pd, n);
            let (a, b) = (slice::from_raw_parts(pa, n), slice::from_raw_parts(pb, n));
            for ((z, x), y) in d.iter_mut().zip(a).zip(b) {
                *z = f(*x, *y);
            }
        }
    }
}

/// `dst[i] = f(src[i])` for i < n, on slices of `T::Bytes`.
///
/// # Safety
/// As `premul`, with `n` elements of `T`.
#[inline(always)]
unsafe fn map1<T: Elem>(dst: *mut u8, src: *const u8, n: usize, f: impl Fn(T) -> T) {
    let f = |x: T::Bytes| f(T::load(x)).store();
    let (pd, ps) = (dst.cast::<T::Bytes>(), src.cast::<T::Bytes>());
    // SAFETY: as in map2: byte arrays, valid for n elements, and the `&mut` slice aliases no
    // shared one (dst either equals src, handled by the first loop, or is disjoint from it).
    unsafe {
        if dst.cast_const() == src {
            for z in slice::from_raw_parts_mut(pd, n) {
                *z = f(*z);
            }
        } else {
            let (d, s) = (slice::from_raw_parts_mut(pd, n), slice::from_raw_parts(ps, n));
            for (z, x) in d.iter_mut().zip(s) {
                *z = f(*x);
            }
        }
    }
}

/// A float format computed through f32: widened exactly, rounded back once.
trait Narrow {
    /// The format's bits as stored.
    type Bits: Elem;
    /// The exact value.
    fn widen(bits: Self::Bits) -> f32;
    /// Rounded to nearest-even (saturated for fp8); every NaN gives the canonical NaN.
    fn narrow(v: f32) -> Self::Bits;

    /// `dst[i] = f(a[i], b[i])` computed in f32.
    ///
    /// # Safety
    /// As `reduce`, with `n` elements of the format.
    #[inline(always)]
    unsafe fn map2(dst: *mut u8, a: *const u8, b: *const u8, n: usize, f: impl Fn(f32, f32) -> f32) {
        // SAFETY: our caller's contract.
        unsafe { Self::map2_each(dst, a, b, n, f) }
    }

    /// `dst[i] = f(src[i])` computed in f32.
    ///
    /// # Safety
    /// As `premul`, with `n` elements of the format.
    #[inline(always)]
    unsafe fn map1(dst: *mut u8, src: *const u8, n: usize, f: impl Fn(f32) -> f32) {
        // SAFETY: our caller's contract.
        unsafe { Self::map1_each(dst, src, n, f) }
    }

    /// `map2` a value at a time through `widen` and `narrow`.
    ///
    /// # Safety
    /// As `map2`.
    #[inline(always)]
    unsafe fn map2_each(dst: *mut u8, a: *const u8, b: *const u8, n: usize, f: impl Fn(f32, f32) -> f32) {
        let f = |x, y| Self::narrow(f(Self::widen(x), Self::widen(y)));
        // SAFETY: our caller's contract.
        unsafe { map2::<Self::Bits>(dst, a, b, n, f) }
    }

    /// `map1` a value at a time through `widen` and `narrow`.
    ///
    /// # Safety
    /// As `map1`.
    #[inline(always)]
    unsafe fn map1_each(dst: *mut u8, src: *const u8, n: usize, f: impl Fn(f32) -> f32) {
        // SAFETY: our caller's contract.
        unsafe { map1::<Self::Bits>(dst, src, n, |x| Self::narrow(f(Self::widen(x)))) }
    }
}

/// IEEE binary16, converted by the `half` crate a block at a time (F16C where the CPU has it).
struct F16;
/// bfloat16: the top half of an f32.
struct Bf16;
/// OCP FP8 E4M3, see `fp8`.
struct E4m3;
/// OCP FP8 E5M2, see `fp8`.
struct E5m2;

const F16_NAN: u16 = 0x7fff;
const BF16_NAN: u16 = 0x7fff;

impl Narrow for Bf16 {
    type Bits = u16;
    #[inline(always)]
    fn widen(bits: u16) -> f32 {
        f32::from_bits(u32::from(bits) << 16)
    }
    #[inline(always)]
    fn narrow(v: f32) -> u16 {
        f32_to_bf16(v)
    }

    // With AVX2, 16 values at a time in registers (`lanes`); the rest a value at a time.
    #[inline(always)]
    unsafe fn map2(dst: *mut u8, a: *const u8, b: *const u8, n: usize, f: impl Fn(f32, f32) -> f32) {
        // SAFETY: our caller's contract.
        unsafe { map2_by_lanes::<Self>(dst, a, b, n, f) }
    }

    #[inline(always)]
    unsafe fn map1(dst: *mut u8, src: *const u8, n: usize, f: impl Fn(f32) -> f32) {
        // SAFETY: our caller's contract.
        unsafe { map1_by_lanes::<Self>(dst, src, n, f) }
    }
}

/// Round to nearest, ties to even; NaN gives the canonical NaN. Branch-free (unlike
/// `half::bf16::from_f32`) so the loops vectorise; the tests check it against `half`.
#[inline(always)]
fn f32_to_bf16(v: f32) -> u16 {
    let u = v.to_bits();
    // A carry out of the mantissa is the correct next binade, or infinity.
    let rounded = (u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16) as u16;
    if v.is_nan() {
        BF16_NAN
    } else {
        rounded
    }
}

impl Narrow for E4m3 {
    type Bits = u8;
    #[inline(always)]
    fn widen(bits: u8) -> f32 {
        fp8::e4m3_to_f32(bits)
    }
    #[inline(always)]
    fn narrow(v: f32) -> u8 {
        fp8::f32_to_e4m3(v)
    }
}

impl Narrow for E5m2 {
    type Bits = u8;
    #[inline(always)]
    fn widen(bits: u8) -> f32 {
        fp8::e5m2_to_f32(bits)
    }
    #[inline(always)]
    fn narrow(v: f32) -> u8 {
        fp8::f32_to_e5m2(v)
    }
}

/// Elements per f16 block (1 KiB per f32 array on the stack).
const BLOCK: usize = 256;

impl Narrow for F16 {
    type Bits = u16;
    fn widen(bits: u16) -> f32 {
        f16::from_bits(bits).to_f32()
    }
    fn narrow(v: f32) -> u16 {
        if v.is_nan() {
            F16_NAN
        } else {
            f16::from_f32(v).to_bits()
        }
    }

    // With F16C, 16 values at a time in registers (`lanes`); the rest as below.
    #[inline(always)]
    unsafe fn map2(dst: *mut u8, a: *const u8, b: *const u8, n: usize, f: impl Fn(f32, f32) -> f32) {
        // SAFETY: our caller's contract.
        unsafe { map2_by_lanes::<Self>(dst, a, b, n, f) }
    }

    #[inline(always)]
    unsafe fn map1(dst: *mut u8, src: *const u8, n: usize, f: impl Fn(f32) -> f32) {
        // SAFETY: our caller's contract.
        unsafe { map1_by_lanes::<Self>(dst, src, n, f) }
    }

    // Through `half`'s slice conversions a block at a time (per value, `half` checks for F16C
    // on every call and converts one value).
    #[inline(always)]
    unsafe fn map2_each(dst: *mut u8, a: *const u8, b: *const u8, n: usize, f: impl Fn(f32, f32) -> f32) {
        let op = |x: &mut [f32], y: &[f32]| x.iter_mut().zip(y).for_each(|(p, q)| *p = f(*p, *q));
        // SAFETY: our caller's contract.
        unsafe { f16_blocks(dst, a, Some(b), n, op) }
    }

    #[inline(always)]
    unsafe fn map1_each(dst: *mut u8, src: *const u8, n: usize, f: impl Fn(f32) -> f32) {
        // SAFETY: our caller's contract.
        unsafe { f16_blocks(dst, src, None, n, |x, _| x.iter_mut().for_each(|p| *p = f(*p))) }
    }
}

/// `op(a block, b block)` for f16 values through f32 arrays, the result stored to `dst`.
///
/// # Safety
/// As `reduce` (`b` given) or `premul` (`b` None), with `n` f16 elements.
unsafe fn f16_blocks(dst: *mut u8, a: *const u8, b: Option<*const u8>, n: usize, op: impl Fn(&mut [f32], &[f32])) {
    let (mut xs, mut ys) = ([0f32; BLOCK], [0f32; BLOCK]);
    let mut start = 0;
    while start < n {
        let len = BLOCK.min(n - start);
        let (x, y) = (&mut xs[..len], &mut ys[..len]);
        // SAFETY: the caller makes a, b and dst valid for n >= start + len elements. Each block
        // is read completely before it is written, so dst may equal a or b.
        unsafe {
            f16_load(a.add(2 * start), x);
            if let Some(b) = b {
                f16_load(b.add(2 * start), y);
            }
            op(x, y);
            f16_store(x, dst.add(2 * start));
        }
        start += len;
    }
}

/// `out[i]` = the f16 stored at `src + 2 * i`, exactly.
///
/// # Safety
/// `src` is readable for `out.len() <= BLOCK` f16 values, at any alignment.
unsafe fn f16_load(src: *const u8, out: &mut [f32]) {
    let mut bits = [0u16; BLOCK];
    let bits = &mut bits[..out.len()];
    // SAFETY: the caller's contract; `bits` is a local array, so the two cannot overlap.
    unsafe { ptr::copy_nonoverlapping(src, bits.as_mut_ptr().cast::<u8>(), 2 * bits.len()) };
    bits.reinterpret_cast::<f16>().convert_to_f32_slice(out);
}

/// Stores `v` rounded to f16 at `dst` (NaNs as the canonical NaN); may change `v`.
///
/// # Safety
/// `dst` is writable for `v.len() <= BLOCK` f16 values, at any alignment.
unsafe fn f16_store(v: &mut [f32], dst: *mut u8) {
    // f32's all-ones NaN converts to f16's all-ones NaN (payload truncated, still quiet).
    for x in v.iter_mut() {
        *x = if x.is_nan() { f32::from_bits(0x7fff_ffff) } else { *x };
    }
    let mut bits = [0u16; BLOCK];
    let bits = &mut bits[..v.len()];
    bits.reinterpret_cast_mut::<f16>().convert_from_f32_slice(v);
    // SAFETY: the caller's contract; `bits` is a local array, so the two cannot overlap.
    unsafe { ptr::copy_nonoverlapping(bits.as_ptr().cast::<u8>(), dst, 2 * bits.len()) };
}

#[cfg(target_arch = "x86_64")]
use lanes::Lanes;
/// The formats `lanes` computes (none of its code on other CPUs).
#[cfg(not(target_arch = "x86_64"))]
trait Lanes {}
#[cfg(not(target_arch = "x86_64"))]
impl Lanes for F16 {}
#[cfg(not(target_arch = "x86_64"))]
impl Lanes for Bf16 {}

/// `Narrow::map2` of a 16-bit format `lanes` computes: the first `n / 16 * 16` values by
/// `lanes` where the CPU can run it, the rest (all of them elsewhere) by `map2_each`.
///
/// # Safety
/// As `reduce`, with `n` values of the format.
#[inline(always)]
unsafe fn map2_by_lanes<N: Narrow + Lanes>(dst: *mut u8, a: *const u8, b: *const u8, n: usize, f: impl Fn(f32, f32) -> f32) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: our caller's contract, on a CPU that has what it needs.
    let done = if lanes::available() { unsafe { lanes::map2::<N>(dst, a, b, n, &f) } } else { 0 };
    #[cfg(not(target_arch = "x86_64"))]
    let done = 0;
    // SAFETY: our caller's contract, for the values from `done` on (2 bytes each).
    unsafe { N::map2_each(dst.add(2 * done), a.add(2 * done), b.add(2 * done), n - done, f) }
}

/// `Narrow::map1` of a 16-bit format `lanes` computes, as `map2_by_lanes`.
///
/// # Safety
/// As `premul`, with `n` values of the format.
#[inline(always)]
unsafe fn map1_by_lanes<N: Narrow + Lanes>(dst: *mut u8, src: *const u8, n: usize, f: impl Fn(f32) -> f32) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: our caller's contract, on a CPU that has what it needs.
    let done = if lanes::available() { unsafe { lanes::map1::<N>(dst, src, n, &f) } } else { 0 };
    #[cfg(not(target_arch = "x86_64"))]
    let done = 0;
    // SAFETY: our caller's contract, for the values from `done` on (2 bytes each).
    unsafe { N::map1_each(dst.add(2 * done), src.add(2 * done), n - done, f) }
}

/// f16 and bf16 arithmetic with AVX2 and F16C, 16 values at a time, widened, operated on as
/// f32 and rounded back in registers.
/// - f16: 8 values an instruction each way (F16C). Through `half`'s slice conversions, functions
///   of its own that our kernels cannot inline, block by block through f32 arrays, f16 sums ran
///   at 4 GB/s in cache.
/// - bf16, the top half of its f32: of 32 loaded bytes, the even values widen by a shift and the
///   odd ones by a mask, and both round back (as `f32_to_bf16`) and merge by a shift, a mask and
///   an or, without a shuffle. LLVM's vectorisation of the per-value loop widened and narrowed
///   with shuffles, all on one port: 18-26 GB/s for a sum in cache.
///
/// (See the `throughput` test.)
#[cfg(target_arch = "x86_64")]
mod lanes {
    use std::arch::x86_64::{__m128i, __m256, __m256i, _mm256_add_epi32, _mm256_and_si256, _mm256_blendv_ps,
                            _mm256_castps_si256, _mm256_castsi256_ps, _mm256_cmp_ps, _mm256_cvtph_ps,
                            _mm256_cvtps_ph, _mm256_loadu_si256, _mm256_or_si256, _mm256_set1_epi32,
                            _mm256_slli_epi32, _mm256_srli_epi32, _mm256_storeu_si256, _mm_loadu_si128,
                            _mm_storeu_si128, _CMP_UNORD_Q, _MM_FROUND_TO_NEAREST_INT};

    /// Whether the CPU can run these.
    #[inline(always)]
    pub(super) fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c")
    }

    /// A 16-bit float format, 16 values at a time as two groups of 8 f32 (which value goes in
    /// which group is the format's business: `store` puts them back where `load` took them).
    /// Only called from `map2` and `map1` below, into which they inline, intrinsics and all.
    pub(super) trait Lanes {
        /// Values i..i+16 at `p`, exactly.
        ///
        /// # Safety
        /// `p` readable for 32 bytes from `2 * i`, at any alignment; AVX2 and F16C.
        unsafe fn load(p: *const u8, i: usize) -> ([f32; 8], [f32; 8]);
        /// Both groups rounded to nearest-even (every NaN the format's canonical 0x7FFF) at
        /// values i..i+16 of `p`.
        ///
        /// # Safety
        /// `p` writable for 32 bytes from `2 * i`, at any alignment; AVX2 and F16C.
        unsafe fn store(g: ([f32; 8], [f32; 8]), p: *mut u8, i: usize);
    }

    /// `r`, but the f32 whose bits are `nan` where `v` is a NaN.
    ///
    /// # Safety
    /// AVX2.
    #[inline(always)]
    unsafe fn nan_as(r: __m256, v: __m256, nan: i32) -> __m256 {
        // SAFETY: register operations on the caller's CPU.
        unsafe { _mm256_blendv_ps(r, _mm256_castsi256_ps(_mm256_set1_epi32(nan)), _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v)) }
    }

    /// __m256 and [f32; 8] are the same 32 bytes.
    #[inline(always)]
    fn vals(v: __m256) -> [f32; 8] {
        // SAFETY: both are 8 f32, every bit pattern valid.
        unsafe { core::mem::transmute::<__m256, [f32; 8]>(v) }
    }
    #[inline(always)]
    fn vec(z: [f32; 8]) -> __m256 {
        // SAFETY: as in `vals`.
        unsafe { core::mem::transmute::<[f32; 8], __m256>(z) }
    }

    impl Lanes for super::F16 {
        #[inline(always)]
        unsafe fn load(p: *const u8, i: usize) -> ([f32; 8], [f32; 8]) {
            // SAFETY: the caller's contract; unaligned loads of 8 values each.
            unsafe {
                let lo = _mm256_cvtph_ps(_mm_loadu_si128(p.add(2 * i).cast::<__m128i>()));
                let hi = _mm256_cvtph_ps(_mm_loadu_si128(p.add(2 * (i + 8)).cast::<__m128i>()));
                (vals(lo), vals(hi))
            }
        }
        #[inline(always)]
        unsafe fn store(g: ([f32; 8], [f32; 8]), p: *mut u8, i: usize) {
            // SAFETY: the caller's contract; unaligned stores of 8 values each.
            unsafe {
                for (k, z) in [(0, g.0), (8, g.1)] {
                    // f32's all-ones NaN converts to f16's 0x7FFF.
                    let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(nan_as(vec(z), vec(z), 0x7fff_ffff));
                    _mm_storeu_si128(p.add(2 * (i + k)).cast::<__m128i>(), h);
                }
            }
        }
    }

    /// The high half of each 32-bit lane.
    const HIGH: i32 = 0xffff_0000_u32 as i32;

    impl Lanes for super::Bf16 {
        /// (The even values, the odd ones: x86 is little-endian, so lane k holds value 2k in its
        /// low half and 2k+1 in its high half.)
        #[inline(always)]
        unsafe fn load(p: *const u8, i: usize) -> ([f32; 8], [f32; 8]) {
            // SAFETY: the caller's contract; an unaligned load.
            unsafe {
                let x = _mm256_loadu_si256(p.add(2 * i).cast::<__m256i>());
                let (even, odd) = (_mm256_slli_epi32::<16>(x), _mm256_and_si256(x, _mm256_set1_epi32(HIGH)));
                (vals(_mm256_castsi256_ps(even)), vals(_mm256_castsi256_ps(odd)))
            }
        }
        #[inline(always)]
        unsafe fn store(g: ([f32; 8], [f32; 8]), p: *mut u8, i: usize) {
            // SAFETY: the caller's contract; an unaligned store.
            unsafe {
                let e = _mm256_srli_epi32::<16>(bf16_round(g.0));
                let o = _mm256_and_si256(bf16_round(g.1), _mm256_set1_epi32(HIGH));
                _mm256_storeu_si256(p.add(2 * i).cast::<__m256i>(), _mm256_or_si256(e, o));
            }
        }
    }

    /// Each of `z` rounded to bf16 (as `f32_to_bf16`: add 0x7FFF plus the lowest kept bit; a
    /// NaN the canonical one) in the high half of its lane, the low half left over. (A function,
    /// not a closure: a closure's intrinsics were left as calls, bf16 sums 0.6 GB/s.)
    ///
    /// # Safety
    /// AVX2.
    #[inline(always)]
    unsafe fn bf16_round(z: [f32; 8]) -> __m256i {
        // SAFETY: register operations on the caller's CPU.
        unsafe {
            let u = _mm256_castps_si256(vec(z));
            let odd = _mm256_and_si256(_mm256_srli_epi32::<16>(u), _mm256_set1_epi32(1));
            let r = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
            _mm256_castps_si256(nan_as(_mm256_castsi256_ps(r), vec(z), i32::from(super::BF16_NAN) << 16))
        }
    }

    /// As `Narrow::map2` for the first `n / 16 * 16` values; returns how many it did.
    ///
    /// # Safety
    /// As `reduce`, with `n` values, on a CPU with AVX2 and F16C ([`available`]).
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn map2<L: Lanes>(dst: *mut u8, a: *const u8, b: *const u8, n: usize,
                                        f: impl Fn(f32, f32) -> f32) -> usize {
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: values i..i+16 are in the caller's n; both inputs are read before dst is
            // written, so dst may equal either.
            unsafe {
                let (x, y) = (L::load(a, i), L::load(b, i));
                let z = |x: [f32; 8], y: [f32; 8]| core::array::from_fn(|j| f(x[j], y[j]));
                L::store((z(x.0, y.0), z(x.1, y.1)), dst, i);
            }
            i += 16;
        }
        i
    }

    /// As `Narrow::map1` for the first `n / 16 * 16` values; returns how many it did.
    ///
    /// # Safety
    /// As `premul`, with `n` values, on a CPU with AVX2 and F16C ([`available`]).
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn map1<L: Lanes>(dst: *mut u8, src: *const u8, n: usize, f: impl Fn(f32) -> f32) -> usize {
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: as in map2.
            unsafe {
                let x = L::load(src, i);
                let z = |x: [f32; 8]| core::array::from_fn(|j| f(x[j]));
                L::store((z(x.0), z(x.1)), dst, i);
            }
            i += 16;
        }
        i
    }
}

#[cfg(test)]
#[path = "reduce_tests.rs"]
mod tests;
