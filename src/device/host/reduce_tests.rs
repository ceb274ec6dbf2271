//! The reference is plain scalar code: integers in i128, floats in f64 (exact for every
//! input format) rounded by `round`, which is written from the formats' parameters rather
//! than from the conversions under test. Test data assumes a little-endian host.

use super::*;
use half::bf16;

const OPS: [ElemOp; 4] = [ElemOp::Sum, ElemOp::Prod, ElemOp::Max, ElemOp::Min];
const LENGTHS: [usize; 5] = [0, 1, 7, 33, 1000];

use crate::testing::Rng;

#[derive(Clone, Copy, Debug)]
enum Val {
    Int(i128),
    Float(f64),
}

/// An element (its bits in the low `dt.size()` bytes) as the reference sees it.
fn val(dt: DataType, b: u64) -> Val {
    let w = 128 - 8 * dt.size() as u32;
    match dt {
        DataType::Int8 | DataType::Int32 | DataType::Int64 => Val::Int((b as i128) << w >> w),
        DataType::Uint8 | DataType::Uint32 | DataType::Uint64 => Val::Int(b as i128),
        DataType::Float16 => Val::Float(f16::from_bits(b as u16).to_f64()),
        DataType::Bfloat16 => Val::Float(bf16::from_bits(b as u16).to_f64()),
        DataType::Float32 => Val::Float(f32::from_bits(b as u32).into()),
        DataType::Float64 => Val::Float(f64::from_bits(b)),
        // Checked against the formats' definition over all 256 codes in fp8's tests.
        DataType::Float8e4m3 => Val::Float(fp8::e4m3_to_f32(b as u8).into()),
        DataType::Float8e5m2 => Val::Float(fp8::e5m2_to_f32(b as u8).into()),
    }
}

/// The integer `v` wrapped to `dt`'s width and signedness.
fn wrap(dt: DataType, v: i128) -> Val {
    val(dt, (v as u128 & (u128::MAX >> (128 - 8 * dt.size()))) as u64)
}

/// `v` rounded to nearest-even in `dt`, overflowing to infinity (IEEE) or saturating
/// (fp8, as NCCL does, infinities included).
fn round(dt: DataType, v: f64) -> f64 {
    let (p, emin, max, saturate) = match dt {
        DataType::Float64 => return v,
        DataType::Float32 => return f64::from(v as f32),
        DataType::Float16 => (11, -14, 65504.0, false),
        DataType::Bfloat16 => (8, -126, bf16::MAX.to_f64(), false),
        DataType::Float8e4m3 => (4, -6, 448.0, true),
        _ => (3, -14, 57344.0, true),
    };
    let overflow = if saturate { max } else { f64::INFINITY }.copysign(v);
    if v.is_nan() || v == 0.0 {
        return v;
    }
    let exp = (((v.to_bits() >> 52) & 0x7ff) as i32 - 1023).max(emin);
    let ulp = 2f64.powi(exp - (p - 1));
    let r = (v / ulp).round_ties_even() * ulp;
    if r.abs() > max {
        overflow
    } else {
        r
    }
}

/// NaN-ignoring, -0 < +0; two NaNs give NaN.
fn ref_max(x: f64, y: f64) -> f64 {
    match (x.is_nan(), y.is_nan()) {
        (true, _) => y,
        (_, true) => x,
        _ if x == y => f64::from_bits(x.to_bits() & y.to_bits()),
        _ => x.max(y),
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Reduce(ElemOp),
    Premul(u64),
    Divide(u64),
}

fn expected(dt: DataType, kind: Kind, x: Val, y: Val) -> Val {
    let (op, y) = match kind {
        Kind::Reduce(op) => (op, y),
        Kind::Premul(s) => (ElemOp::Prod, val(dt, s)),
        Kind::Divide(d) => {
            let d = d.max(1);
            return match x {
                Val::Int(x) => Val::Int(x / i128::from(d)),
                Val::Float(x) if dt == DataType::Float64 => Val::Float(x / d as f64),
                Val::Float(x) => Val::Float(round(dt, x / f64::from(d as f32))),
            };
        }
    };
    match (x, y) {
        (Val::Int(x), Val::Int(y)) => wrap(
            dt,
            match op {
                ElemOp::Sum => x + y,
                ElemOp::Prod => x.wrapping_mul(y),
                ElemOp::Max => x.max(y),
                ElemOp::Min => x.min(y),
            },
        ),
        (Val::Float(x), Val::Float(y)) => Val::Float(round(
            dt,
            match op {
                ElemOp::Sum => x + y,
                ElemOp::Prod => x * y,
                ElemOp::Max => ref_max(x, y),
                ElemOp::Min => -ref_max(-x, -y),
            },
        )),
        _ => unreachable!(),
    }
}

/// The bits a NaN result must have, where the module promises canonical NaNs.
fn canonical_nan(dt: DataType, kind: Kind) -> Option<u64> {
    let min_max = matches!(kind, Kind::Reduce(ElemOp::Max | ElemOp::Min));
    match dt {
        DataType::Float16 | DataType::Bfloat16 => Some(0x7fff),
        DataType::Float8e4m3 | DataType::Float8e5m2 => Some(u64::from(fp8::NAN)),
        DataType::Float32 if min_max => Some(0x7fff_ffff),
        DataType::Float64 if min_max => Some(0x7fff_ffff_ffff_ffff),
        _ => None,
    }
}

/// `got` is `want` down to the sign of zero; a NaN has the canonical bits if promised.
fn check(dt: DataType, kind: Kind, got: u64, want: Val, what: &dyn Fn() -> String) {
    match (val(dt, got), want) {
        (Val::Int(g), Val::Int(w)) => assert_eq!(g, w, "{}", what()),
        (Val::Float(g), Val::Float(w)) if w.is_nan() => {
            assert!(g.is_nan(), "{}: got {g}, want NaN", what());
            let nan = canonical_nan(dt, kind);
            assert!(nan.is_none_or(|nan| nan == got), "{}: NaN {got:#x} not canonical", what());
        }
        (Val::Float(g), Val::Float(w)) => {
            let same = g == w && g.is_sign_negative() == w.is_sign_negative();
            assert!(same, "{}: got {g:e}, want {w:e}", what());
        }
        _ => unreachable!(),
    }
}

/// Edge values per type, as bits: zeros, ±1, extremes, subnormals, infinities, NaNs.
#[rustfmt::skip]
fn specials(dt: DataType) -> &'static [u64] {
    match dt {
        DataType::Int8 | DataType::Uint8 => &[0, 1, 0x7f, 0x80, 0xff],
        DataType::Int32 | DataType::Uint32 => &[0, 1, 0x7fff_ffff, 0x8000_0000, 0xffff_ffff],
        DataType::Int64 | DataType::Uint64 => &[0, 1, i64::MAX as u64, 1 << 63, u64::MAX],
        DataType::Float16 => &[0, 0x8000, 1, 0x3ff, 0x400, 0x7bff, 0xfbff, 0x7c00, 0xfc00, 0x7e00, 0x7c01, 0xffff,
            0x3c00, 0xbc00],
        DataType::Bfloat16 => &[0, 0x8000, 1, 0x7f, 0x80, 0x7f7f, 0xff7f, 0x7f80, 0xff80, 0x7fc0, 0x7f81, 0xffff,
            0x3f80, 0xbf80],
        DataType::Float32 => &[0, 1 << 31, 1, 0x7f_ffff, 0x80_0000, 0x7f7f_ffff, 0xff7f_ffff, 0x7f80_0000,
            0xff80_0000, 0x7fc0_0000, 0x7f80_0001, 0xffff_ffff, 0x3f80_0000, 0xbf80_0000],
        DataType::Float64 => &[0, 1 << 63, 1, 0x7fe0_0000_0000_0000, 0x7ff0_0000_0000_0000, 0xfff0_0000_0000_0000,
            0x7ff8_0000_0000_0000, 0x7ff0_0000_0000_0001, u64::MAX, 0x3ff0_0000_0000_0000, 0xbff0_0000_0000_0000],
        DataType::Float8e4m3 => &[0, 0x80, 1, 7, 8, 0x7e, 0xfe, 0x7f, 0xff, 0x38, 0xb8],
        DataType::Float8e5m2 => &[0, 0x80, 1, 3, 4, 0x7b, 0xfb, 0x7c, 0xfc, 0x7d, 0x7e, 0x7f, 0xff, 0x3c, 0xbc],
    }
}

/// One element's bits: a special value, random bits, or (floats) a random value of
/// magnitude near 1 so that sums and products actually round.
fn random_elem(dt: DataType, rng: &mut Rng) -> u64 {
    let r = rng.next();
    let (width, mant_bits, bias) = match dt {
        DataType::Float16 => (16, 10, 15),
        DataType::Float64 => (64, 52, 1023),
        DataType::Float8e4m3 => (8, 3, 7),
        DataType::Float8e5m2 => (8, 2, 15),
        _ => (32, 23, 127), // f32, and bf16 as an f32's top half
    };
    match r % 4 {
        0 => specials(dt)[(r >> 8) as usize % specials(dt).len()],
        1 if dt.is_float() => {
            let exp = (bias + (r >> 60) % 5 - 2) << mant_bits;
            let v = (r >> 59 & 1) << (width - 1) | exp | (r >> 8) & ((1 << mant_bits) - 1);
            v >> (width - 8 * dt.size())
        }
        _ => r >> (64 - 8 * dt.size()),
    }
}

fn random_elems(dt: DataType, n: usize, rng: &mut Rng) -> Vec<u64> {
    (0..n).map(|_| random_elem(dt, rng)).collect()
}

const GUARD: u8 = 0x5a;

/// Elements at `offset` bytes past an 8-byte boundary, between guard bytes.
struct Buf {
    bytes: Vec<u8>,
    start: usize,
    size: usize,
}

impl Buf {
    fn new(dt: DataType, elems: &[u64], offset: usize) -> Buf {
        let size = dt.size();
        let mut bytes = vec![GUARD; elems.len() * size + 32];
        // The Vec never grows, so its address and this alignment stay put.
        let start = (8 - bytes.as_ptr() as usize % 8) % 8 + offset;
        for (chunk, e) in bytes[start..].chunks_mut(size).zip(elems) {
            chunk.copy_from_slice(&e.to_le_bytes()[..size]);
        }
        Buf { bytes, start, size }
    }
    fn ptr(&mut self) -> *mut u8 {
        self.bytes[self.start..].as_mut_ptr()
    }
    fn elems(&self, n: usize) -> Vec<u64> {
        self.bytes[self.start..][..n * self.size].chunks(self.size).map(bits).collect()
    }
    fn guards_intact(&self, n: usize) -> bool {
        let end = self.start + n * self.size;
        self.bytes[..self.start].iter().chain(&self.bytes[end..]).all(|&b| b == GUARD)
    }
}

fn bits(e: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    b[..e.len()].copy_from_slice(e);
    u64::from_le_bytes(b)
}

fn apply(dt: DataType, kind: Kind, dst: *mut u8, a: *const u8, b: *const u8, n: usize) {
    // SAFETY: callers pass buffers of n elements, dst equal to or disjoint from a and b.
    unsafe {
        match kind {
            Kind::Reduce(op) => reduce(dt, op, dst, a, b, n),
            Kind::Premul(s) => premul(dt, dst, a, scalar_from_bytes(dt, &s.to_le_bytes()).unwrap(), n),
            Kind::Divide(d) => divide(dt, dst, a, d, n),
        }
    }
}

/// Runs `kind` on `ea` (and `eb`) with every aliasing the contract allows, aligned and
/// not; checks every element against the reference, the inputs of out-of-place runs, and
/// the guard bytes.
fn run(dt: DataType, kind: Kind, ea: &[u64], eb: &[u64]) {
    let n = ea.len();
    // dst: 0 a separate buffer, 1 = a, 2 = b, 3 = a with b = a too.
    let aliases: &[usize] = if let Kind::Reduce(_) = kind { &[0, 1, 2, 3] } else { &[0, 1] };
    for &alias in aliases {
        for offset in [0, 1] {
            let eb = if alias == 3 { ea } else { eb };
            let (mut a, mut b) = (Buf::new(dt, ea, offset), Buf::new(dt, eb, offset));
            let mut d = Buf::new(dt, &vec![0; n], offset);
            let (pa, pb, pd) = (a.ptr(), b.ptr(), d.ptr());
            let (dst, src_b) = [(pd, pb), (pa, pb), (pb, pb), (pa, pa)][alias];
            apply(dt, kind, dst, pa, src_b, n);
            let out = [&d, &a, &b, &a][alias].elems(n);
            for i in 0..n {
                let (x, y) = (val(dt, ea[i]), val(dt, eb[i]));
                let what = || format!("{dt:?} {kind:?} n={n} alias={alias} offset={offset} [{i}]: {x:?}, {y:?}");
                check(dt, kind, out[i], expected(dt, kind, x, y), &what);
            }
            assert!(a.guards_intact(n) && b.guards_intact(n) && d.guards_intact(n), "{dt:?} {kind:?} n={n}");
            if alias == 0 {
                assert!(a.elems(n) == ea && b.elems(n) == eb, "{dt:?} {kind:?}: an input was modified");
            }
        }
    }
}

#[test]
fn reduce_matches_reference_for_every_type_op_length_and_aliasing() {
    let mut rng = Rng(1);
    for dt in DataType::ALL {
        for op in OPS {
            for n in LENGTHS {
                run(dt, Kind::Reduce(op), &random_elems(dt, n, &mut rng), &random_elems(dt, n, &mut rng));
            }
        }
    }
}

#[test]
fn premul_and_divide_match_reference() {
    let mut rng = Rng(2);
    for dt in DataType::ALL {
        let scalars: Vec<u64> = specials(dt).iter().copied().chain(random_elems(dt, 4, &mut rng)).collect();
        let divisors = [1, 2, 3, 7, 8, 1000, 1 << 31, 1 << 40, 1 << 63, u64::MAX, 0];
        let kinds = scalars.into_iter().map(Kind::Premul).chain(divisors.into_iter().map(Kind::Divide));
        for kind in kinds {
            for n in LENGTHS {
                // Specials too: the signed minimum divided by its magnitude is -1, the one
                // quotient of a too-large divisor that is not 0.
                let elems: Vec<u64> =
                    random_elems(dt, n, &mut rng).into_iter().chain(specials(dt).to_vec()).collect();
                run(dt, kind, &elems, &elems);
            }
        }
    }
}

/// The fused PreMulSum step gives the bits of the steps it fuses (a scaled copy, then a sum),
/// for every type, special values and scalars included, across its block boundaries, in place
/// (the output over the own input) and not, aligned and not.
#[test]
fn scaled_sum_is_premul_then_sum_bit_for_bit() {
    let mut rng = Rng(3);
    for dt in DataType::ALL {
        let scalars: Vec<u64> = specials(dt).iter().copied().chain(random_elems(dt, 3, &mut rng)).collect();
        for s in scalars {
            let scalar = scalar_from_bytes(dt, &s.to_le_bytes()).unwrap();
            for n in [0, 1, 33, 4096 / dt.size() + 3, 9000] {
                let ea: Vec<u64> = random_elems(dt, n, &mut rng).into_iter().chain(specials(dt).to_vec()).take(n).collect();
                let eb: Vec<u64> = specials(dt).iter().copied().chain(random_elems(dt, n, &mut rng)).take(n).collect();
                let (mut b, mut t) = (Buf::new(dt, &eb, 0), Buf::new(dt, &ea, 0));
                // SAFETY: buffers of n elements, each step's dst equal to its first input.
                unsafe {
                    premul(dt, t.ptr(), t.ptr(), scalar, n);
                    reduce(dt, ElemOp::Sum, t.ptr(), t.ptr(), b.ptr(), n);
                }
                let want = t.elems(n);
                for (offset, in_place) in [(0, false), (1, false), (0, true), (1, true)] {
                    let (mut a, mut d) = (Buf::new(dt, &ea, offset), Buf::new(dt, &vec![0; n], offset));
                    let mut b = Buf::new(dt, &eb, offset);
                    let dst = if in_place { a.ptr() } else { d.ptr() };
                    // SAFETY: as above; dst is a or disjoint from both inputs.
                    unsafe { scaled_sum(dt, dst, a.ptr(), scalar, b.ptr(), n) };
                    let got = if in_place { a.elems(n) } else { d.elems(n) };
                    let what = format!("{dt:?} scalar {s:#x} n={n} offset={offset} in place {in_place}");
                    assert!(got == want, "{what}");
                    assert!(a.guards_intact(n) && b.guards_intact(n) && d.guards_intact(n), "{what}");
                    assert!(b.elems(n) == eb, "{what}: what arrived was modified");
                    if !in_place {
                        assert!(a.elems(n) == ea, "{what}: the input was modified");
                    }
                }
            }
        }
    }
}

/// `x kind y` for one element, through the public functions.
fn one(dt: DataType, kind: Kind, x: u64, y: u64) -> u64 {
    let (mut out, xb, yb) = ([0u8; 8], x.to_le_bytes(), y.to_le_bytes());
    apply(dt, kind, out.as_mut_ptr(), xb.as_ptr(), yb.as_ptr(), 1);
    bits(&out[..dt.size()])
}

#[test]
#[rustfmt::skip]
fn known_results() {
    use DataType::*;
    use ElemOp::*;
    let (sum, prod, max, min) = (Kind::Reduce(Sum), Kind::Reduce(Prod), Kind::Reduce(Max), Kind::Reduce(Min));
    let m = |v: i64| v as u64;
    let cases = [
        // Integers wrap.
        (Int8, sum, 0x7f, 1, 0x80), (Int8, prod, 0x80, 0xff, 0x80), (Uint8, sum, 0xff, 1, 0),
        (Uint8, prod, 16, 16, 0), (Int32, sum, 0x7fff_ffff, 1, 0x8000_0000),
        (Uint32, prod, 0x1_0001, 0x1_0001, 0x2_0001), (Int64, sum, m(i64::MAX), 1, m(i64::MIN)),
        (Int64, prod, m(i64::MIN), m(-1), m(i64::MIN)), (Uint64, sum, u64::MAX, 2, 1),
        (Uint64, prod, 1 << 63, 2, 0), (Int8, max, 0x80, 0x7f, 0x7f),
        (Int64, min, m(-5), 3, m(-5)), (Uint32, max, 0xffff_ffff, 1, 0xffff_ffff),
        (Int8, Kind::Divide(2), 0xfd, 0, 0xff), (Int32, Kind::Divide(1 << 31), 0x8000_0000, 0, 0xffff_ffff),
        // Ties round to even: 2048+1 -> 2048, 2050+1 -> 2052; bf16 256+1, 258+1;
        // e4m3 16+1, 18+1; e5m2 16+2, 20+2; e5m2 1.5*1.5 = 2.25 -> 2.
        (Float16, sum, 0x6800, 0x3c00, 0x6800), (Float16, sum, 0x6801, 0x3c00, 0x6802),
        (Float16, sum, 0x6800, 0x3c01, 0x6801), (Bfloat16, sum, 0x4380, 0x3f80, 0x4380),
        (Bfloat16, sum, 0x4381, 0x3f80, 0x4382), (Float8e4m3, sum, 0x58, 0x38, 0x58),
        (Float8e4m3, sum, 0x59, 0x38, 0x5a), (Float8e5m2, sum, 0x4c, 0x40, 0x4c),
        (Float8e5m2, sum, 0x4d, 0x40, 0x4e), (Float8e5m2, prod, 0x3e, 0x3e, 0x40),
        // Subnormals: min + min; min/2 ties to (signed) zero, 3*min/2 to 2*min.
        (Float16, sum, 1, 1, 2), (Bfloat16, sum, 0x8001, 0x8002, 0x8003), (Float8e4m3, sum, 1, 1, 2),
        (Float8e5m2, sum, 1, 2, 3), (Float32, sum, 1, 1, 2), (Float16, Kind::Divide(2), 0x8001, 0, 0x8000),
        (Bfloat16, Kind::Divide(2), 3, 0, 2), (Float8e4m3, Kind::Divide(2), 1, 0, 0),
        (Float8e5m2, Kind::Divide(2), 0x83, 0, 0x82),
        // Overflow: IEEE formats to infinity, fp8 saturates (e5m2 infinities too: NCCL's
        // SATFINITE); NaN results canonical.
        (Float16, sum, 0x7bff, 0x7bff, 0x7c00), (Float16, sum, 0x7c00, 0xfc00, 0x7fff),
        (Float16, prod, 0x7e05, 0x3c00, 0x7fff), (Bfloat16, sum, 0x7f7f, 0x7f7f, 0x7f80),
        (Bfloat16, prod, 0x7f81, 0x3f80, 0x7fff), (Float8e4m3, sum, 0x7e, 0x7e, 0x7e),
        (Float8e4m3, prod, 0xfe, 0x7e, 0xfe), (Float8e4m3, sum, 0xff, 0x38, 0x7f),
        (Float8e5m2, sum, 0x7b, 0x7b, 0x7b), (Float8e5m2, sum, 0x7c, 0x3c, 0x7b),
        (Float8e5m2, max, 0xfc, 0xfc, 0xfb), (Float8e5m2, min, 0xfc, 0x3c, 0xfb),
        (Float8e5m2, sum, 0x7c, 0xfc, 0x7f), (Float32, sum, 0x7f7f_ffff, 0x7f7f_ffff, 0x7f80_0000),
        // Max/min ignore one NaN, give the canonical NaN for two, and order -0 < +0.
        (Float32, max, 0x7fc0_0001, 0x3f80_0000, 0x3f80_0000),
        (Float32, min, 0x3f80_0000, 0xffc0_0002, 0x3f80_0000),
        (Float32, max, 0x7fc0_0001, 0xffc0_0002, 0x7fff_ffff),
        (Float32, min, 0xffc0_0002, 0x7fc0_0001, 0x7fff_ffff),
        (Float64, max, 0x7ff8_0000_0000_0001, 0xfff0_0000_0000_0002, 0x7fff_ffff_ffff_ffff),
        (Float64, min, 1 << 63, 0, 1 << 63), (Float64, max, 1 << 63, 0, 0),
        (Float32, max, 0, 1 << 31, 0), (Float32, min, 0, 1 << 31, 1 << 31),
        (Float16, max, 0x7e01, 0x3c00, 0x3c00), (Float16, min, 0x7e01, 0xfc02, 0x7fff),
        (Float16, min, 0x8000, 0, 0x8000), (Bfloat16, max, 0xff82, 0xbf80, 0xbf80),
        (Bfloat16, max, 0x7fc1, 0xff82, 0x7fff), (Bfloat16, max, 0x8000, 0, 0),
    ];
    for (dt, kind, x, y, want) in cases {
        assert_eq!(one(dt, kind, x, y), want, "{dt:?} {kind:?} {x:#x} {y:#x}");
    }
    // f32/f64 Sum/Prod NaNs are the CPU's, but NaN they are.
    assert!(f64::from_bits(one(Float64, sum, 0x7ff0_0000_0000_0000, 0xfff0_0000_0000_0000)).is_nan());
}

#[test]
fn float_results_commute_bitwise() {
    // fp8: all 65536 pairs, every op, also against the reference.
    let xs: Vec<u64> = (0..=0xffffu64).map(|i| i & 0xff).collect();
    let ys: Vec<u64> = (0..=0xffffu64).map(|i| i >> 8).collect();
    for dt in [DataType::Float8e4m3, DataType::Float8e5m2] {
        let (mut x, mut y) = (Buf::new(dt, &xs, 0), Buf::new(dt, &ys, 1));
        for op in OPS {
            let (mut xy, mut yx) = (Buf::new(dt, &xs, 0), Buf::new(dt, &xs, 0));
            apply(dt, Kind::Reduce(op), xy.ptr(), x.ptr(), y.ptr(), xs.len());
            apply(dt, Kind::Reduce(op), yx.ptr(), y.ptr(), x.ptr(), xs.len());
            let got = xy.elems(xs.len());
            assert!(got == yx.elems(xs.len()), "{dt:?} {op:?} does not commute");
            for (i, g) in got.into_iter().enumerate() {
                let want = expected(dt, Kind::Reduce(op), val(dt, xs[i]), val(dt, ys[i]));
                check(dt, Kind::Reduce(op), g, want, &|| format!("{dt:?} {op:?} {:#x} {:#x}", xs[i], ys[i]));
            }
        }
    }
    // Wider formats: random pairs, NaNs with different payloads included.
    let mut rng = Rng(4);
    for dt in [DataType::Float16, DataType::Bfloat16, DataType::Float32, DataType::Float64] {
        for op in [ElemOp::Max, ElemOp::Min] {
            for _ in 0..2000 {
                let (x, y) = (random_elem(dt, &mut rng), random_elem(dt, &mut rng));
                let (xy, yx) = (one(dt, Kind::Reduce(op), x, y), one(dt, Kind::Reduce(op), y, x));
                assert_eq!(xy, yx, "{dt:?} {op:?} {x:#x} {y:#x}");
            }
        }
    }
}

#[test]
fn bf16_rounding_matches_half() {
    for hi in 0..=0xffffu32 {
        for lo in [0u32, 1, 0x7fff, 0x8000, 0x8001, 0xffff] {
            let v = f32::from_bits(hi << 16 | lo);
            let want = if v.is_nan() { BF16_NAN } else { bf16::from_f32(v).to_bits() };
            assert_eq!(f32_to_bf16(v), want, "{:#010x}", v.to_bits());
        }
    }
}

#[test]
fn scalar_from_bytes_copies_the_element_and_rejects_short_input() {
    let bytes = [1, 2, 3, 4, 5, 6, 7, 8, 9];
    for dt in DataType::ALL {
        let want: Vec<u8> = (0..8).map(|i| if i < dt.size() { bytes[i] } else { 0 }).collect();
        assert_eq!(scalar_from_bytes(dt, &bytes).unwrap().bytes[..], want[..], "{dt:?}");
        assert_eq!(scalar_from_bytes(dt, &bytes[..dt.size() - 1]), None, "{dt:?}");
    }
    assert_eq!(scalar_from_bytes(DataType::Int8, &[]), None);
    assert_eq!(f32::from_scalar(scalar_from_bytes(DataType::Float32, &1.5f32.to_le_bytes()).unwrap()), 1.5);
}

#[test]
fn zero_elements_touch_nothing() {
    let null = ptr::null_mut::<u8>();
    for dt in DataType::ALL {
        for kind in OPS.map(Kind::Reduce).into_iter().chain([Kind::Premul(0), Kind::Divide(3)]) {
            // n == 0: the contract allows any pointer, NULL included.
            apply(dt, kind, null, null, null, 0);
        }
    }
    let mut b = Buf::new(DataType::Float64, &[], 1);
    let p = b.ptr();
    apply(DataType::Float64, Kind::Reduce(ElemOp::Sum), p, p, p, 0);
    assert!(b.guards_intact(0));
}

/// Throughput, printed: `cargo test --release -- --ignored --nocapture throughput`.
#[test]
#[ignore]
fn throughput() {
    let n = 1 << 15; // 128 KiB of f32 per buffer: in cache, as a pipelined chunk is
    use DataType::*;
    let cases = [Float32, Float64, Int32, Int8, Float16, Bfloat16, Float8e4m3].map(|dt| (dt, ElemOp::Sum));
    for (dt, op) in [(Float32, ElemOp::Max)].into_iter().chain(cases) {
        for offset in [0, 1] {
            let (mut a, mut b) = (Buf::new(dt, &vec![0; n], offset), Buf::new(dt, &vec![0; n], 0));
            let (pa, pb, bytes) = (a.ptr(), b.ptr(), n * dt.size());
            let reps = (1 << 28) / bytes;
            let t = std::time::Instant::now();
            for _ in 0..reps {
                apply(dt, Kind::Reduce(op), pa, pa, pb, n);
            }
            // Bytes moved: read a, read b, write a.
            let gbs = (3 * bytes * reps) as f64 / t.elapsed().as_secs_f64() / 1e9;
            println!("{dt:?} {op:?} offset {offset}: {gbs:.1} GB/s");
            assert!(a.elems(n).iter().all(|&x| x == 0), "0 op 0 must stay 0");
        }
    }
    // PreMulSum's two ways: a scaled copy then a sum, against the fused step (same bytes moved
    // counted: read a, read b, write a).
    for dt in [Float32, Float16, Bfloat16] {
        let (mut a, mut b, mut c) = (Buf::new(dt, &vec![0; n], 0), Buf::new(dt, &vec![0; n], 0), Buf::new(dt, &vec![0; n], 0));
        let (pa, pb, pc, bytes) = (a.ptr(), b.ptr(), c.ptr(), n * dt.size());
        let scalar = avg_scalar(dt, 2).unwrap();
        let reps = (1 << 28) / bytes;
        let t = std::time::Instant::now();
        for _ in 0..reps {
            // SAFETY: three buffers of n elements.
            unsafe {
                premul(dt, pc, pa, scalar, n);
                reduce(dt, ElemOp::Sum, pa, pc, pb, n);
            }
        }
        let two = (3 * bytes * reps) as f64 / t.elapsed().as_secs_f64() / 1e9;
        let t = std::time::Instant::now();
        for _ in 0..reps {
            // SAFETY: as above, dst equal to a.
            unsafe { scaled_sum(dt, pa, pa, scalar, pb, n) };
        }
        let fused = (3 * bytes * reps) as f64 / t.elapsed().as_secs_f64() / 1e9;
        println!("{dt:?} premul then sum: {two:.1} GB/s, scaled_sum: {fused:.1} GB/s");
    }
}

#[test]
fn avg_scalar_is_the_reciprocal_nccl_uses() {
    let bits = |dt, n| avg_scalar(dt, n).map(|s| u64::from_le_bytes(s.bytes));
    // 1/3 through f32: fp16 0.33325195 (0x3555), bf16 0.333984375 (0x3eab).
    assert_eq!(bits(DataType::Float16, 3), Some(0x3555));
    assert_eq!(bits(DataType::Bfloat16, 3), Some(0x3eab));
    assert_eq!(bits(DataType::Float32, 3), Some(u64::from((1.0f32 / 3.0).to_bits())));
    assert_eq!(bits(DataType::Float64, 3), Some((1.0f64 / 3.0).to_bits()));
    assert_eq!(bits(DataType::Float16, 4), Some(0x3400));
    assert_eq!(bits(DataType::Float32, 1), Some(u64::from(1.0f32.to_bits())));
    // Summed, then divided.
    for dt in [DataType::Int8, DataType::Uint8, DataType::Int32, DataType::Uint32, DataType::Int64,
               DataType::Uint64, DataType::Float8e4m3, DataType::Float8e5m2] {
        assert_eq!(bits(dt, 3), None, "{dt:?}");
    }
}
