//! The two 8-bit float formats NCCL reduces (`ncclFloat8e4m3`, `ncclFloat8e5m2`, the OCP FP8
//! formats as NVIDIA's `cuda_fp8.h` implements them): exact decoding to f32 and correctly
//! rounded encoding from f32, with the saturation NCCL's kernels apply. Pure bit arithmetic, no
//! tables and no branches, so the loops in `reduce` that call these vectorise.
//!
//! - E4M3: bias 7, 3 mantissa bits, no infinities, S.1111.111 is NaN, max finite ±448.
//! - E5M2: bias 15, 2 mantissa bits, IEEE-like: S.11111.00 is ±inf, S.11111.{01,10,11} NaN,
//!   max finite ±57344.
//!
//! Encoding rounds to nearest, ties to even, and saturates: every finite value beyond the max
//! and every infinity becomes ±max finite. NCCL (src/device/reduce_kernel.h, sm_90) computes
//! fp8 in half and converts back through the `__nv_fp8_e4m3(__half)` / `__nv_fp8_e5m2(__half)`
//! constructors, which use `__NV_SATFINITE` for both formats; so on NCCL an e5m2 reduction never
//! yields an infinity, and neither does ours. Every NaN encodes as 0x7F, the code
//! `cvt.rn.satfinite` produces from CUDA's canonical half NaN.
//!
//! Nothing here depends on the FPU's handling of subnormal f32 (flush-to-zero modes a host
//! application may have set): fp8 subnormals are built and rounded from normal f32 values.

/// The NaN code both formats produce.
pub const NAN: u8 = 0x7f;

/// What distinguishes the two formats.
#[derive(Clone, Copy)]
struct Format {
    /// Explicit mantissa bits.
    mant: u32,
    /// Exponent bias.
    bias: u32,
    /// Largest finite magnitude.
    max: f32,
    /// Magnitude code (sign bit clear) of infinity; above 0x7f where the format has none.
    inf: u32,
    /// Smallest magnitude code that is a NaN.
    first_nan: u32,
}

const E4M3: Format = Format { mant: 3, bias: 7, max: 448.0, inf: 0x100, first_nan: 0x7f };
const E5M2: Format = Format { mant: 2, bias: 15, max: 57344.0, inf: 0x7c, first_nan: 0x7d };

/// The exact value of an E4M3 code; NaN for 0x7F and 0xFF.
#[inline]
pub fn e4m3_to_f32(code: u8) -> f32 {
    decode(code, E4M3)
}

/// The exact value of an E5M2 code; ±inf for 0x7C/0xFC, NaN for the other all-ones exponents.
#[inline]
pub fn e5m2_to_f32(code: u8) -> f32 {
    decode(code, E5M2)
}

/// `v` rounded to E4M3 (nearest, ties to even), saturated to ±448; NaN gives 0x7F.
#[inline]
pub fn f32_to_e4m3(v: f32) -> u8 {
    encode(v, E4M3)
}

/// `v` rounded to E5M2 (nearest, ties to even), saturated to ±57344 (infinities included, as
/// NCCL's `__NV_SATFINITE` conversion does); NaN gives 0x7F.
#[inline]
pub fn f32_to_e5m2(v: f32) -> u8 {
    encode(v, E5M2)
}

/// 2^e as f32, for -126 <= e <= 127.
#[inline(always)]
fn pow2(e: i32) -> f32 {
    f32::from_bits(((e + 127) as u32) << 23)
}

#[inline(always)]
fn decode(code: u8, f: Format) -> f32 {
    let m = u32::from(code & 0x7f);
    // Normal: move exponent and mantissa into f32's fields and rebias the exponent.
    let normal = f32::from_bits((m + ((127 - f.bias) << f.mant)) << (23 - f.mant));
    // Subnormal (exponent field 0): mantissa times the smallest subnormal, exact in f32.
    let subnormal = m as f32 * pow2(1 - f.bias as i32 - f.mant as i32);
    let mag = if m < (1 << f.mant) { subnormal } else { normal };
    let mag = if m == f.inf { f32::INFINITY } else { mag };
    let mag = if m >= f.first_nan { f32::NAN } else { mag };
    if code & 0x80 != 0 {
        -mag
    } else {
        mag
    }
}

#[inline(always)]
fn encode(v: f32, f: Format) -> u8 {
    let sign = ((v.to_bits() >> 24) & 0x80) as u8;
    // Saturate first: for both formats every magnitude above max rounds to max or to a code
    // that SATFINITE replaces by max. (`min` ignores a NaN `v`; it is handled last.)
    let a = v.abs().min(f.max);
    // Subnormal range: adding 2^(24 - bias - mant) leaves the f32 ulp equal to the fp8
    // subnormal spacing, so the FPU's own round-to-nearest-even does the rounding; the count of
    // spacings is the code, and a carry to 1 << mant is exactly the smallest normal's code.
    let magic = pow2(24 - f.bias as i32 - f.mant as i32);
    let subnormal = (a + magic).to_bits().wrapping_sub(magic.to_bits());
    // Normal range: round the 23-bit mantissa to `mant` bits, ties to even; a carry into the
    // exponent is the correct next binade. Then rebias.
    let shift = 23 - f.mant;
    let u = a.to_bits();
    let rounded = u + ((1 << (shift - 1)) - 1) + ((u >> shift) & 1);
    let normal = (rounded >> shift).wrapping_sub((127 - f.bias) << f.mant);
    let code = if a < pow2(1 - f.bias as i32) { subnormal } else { normal };
    if v.is_nan() {
        NAN
    } else {
        sign | code as u8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of a code from its definition, independently of `decode`'s bit tricks.
    fn reference_value(code: u8, f: Format) -> f64 {
        let m = u32::from(code & 0x7f);
        let (e, frac) = (m >> f.mant, m & ((1 << f.mant) - 1));
        let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
        if m >= f.first_nan {
            return f64::NAN;
        }
        if m == f.inf {
            return sign * f64::INFINITY;
        }
        let scale = 2f64.powi(f.mant as i32);
        let mag = if e == 0 {
            frac as f64 / scale * 2f64.powi(1 - f.bias as i32)
        } else {
            (1.0 + frac as f64 / scale) * 2f64.powi(e as i32 - f.bias as i32)
        };
        sign * mag
    }

    /// Nearest representable value by exhaustive search over `values` (the reference values
    /// of codes 0..0x7f), ties to the even code, saturated.
    fn reference_encode(v: f32, values: &[f64]) -> u8 {
        if v.is_nan() {
            return NAN;
        }
        let sign = if v.is_sign_negative() { 0x80 } else { 0 };
        let max = values.iter().copied().filter(|x| x.is_finite()).fold(0.0, f64::max);
        let a = f64::from(v.abs()).min(max);
        let mut best = 0usize;
        for (c, val) in values.iter().enumerate().filter(|(_, x)| x.is_finite()) {
            let (d, db) = ((val - a).abs(), (values[best] - a).abs());
            if d < db || (d == db && c % 2 == 0) {
                best = c;
            }
        }
        sign | best as u8
    }

    /// Each format with its decoder and encoder.
    type Codec = (Format, fn(u8) -> f32, fn(f32) -> u8);

    fn formats() -> [Codec; 2] {
        [(E4M3, e4m3_to_f32, f32_to_e4m3), (E5M2, e5m2_to_f32, f32_to_e5m2)]
    }

    #[test]
    fn decode_matches_definition_for_all_256_codes() {
        for (f, dec, _) in formats() {
            for c in 0..=255u8 {
                let (got, want) = (dec(c), reference_value(c, f));
                if want.is_nan() {
                    assert!(got.is_nan(), "code {c:#04x}");
                } else {
                    assert_eq!(f64::from(got), want, "code {c:#04x}");
                    assert_eq!(got.is_sign_negative(), c & 0x80 != 0, "sign of code {c:#04x}");
                }
            }
        }
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e5m2_to_f32(0x7b), 57344.0);
        assert_eq!(e5m2_to_f32(0xfc), f32::NEG_INFINITY);
        assert_eq!(e5m2_to_f32(0x01), 2f32.powi(-16));
    }

    #[test]
    fn round_trip_all_256_codes() {
        for (f, dec, enc) in formats() {
            for c in 0..=255u8 {
                let m = u32::from(c & 0x7f);
                let want = if m >= f.first_nan {
                    NAN
                } else if m == f.inf {
                    (c & 0x80) | 0x7b // saturated, as NCCL's SATFINITE does
                } else {
                    c
                };
                assert_eq!(enc(dec(c)), want, "code {c:#04x}");
            }
        }
    }

    #[test]
    fn midpoints_round_to_even_and_neighbours_to_nearest() {
        for (f, dec, enc) in formats() {
            for c in 0..0x7eu8 {
                if u32::from(c + 1) >= f.first_nan || u32::from(c + 1) == f.inf {
                    break;
                }
                let (lo, hi) = (dec(c), dec(c + 1));
                // Exact in f32: fp8 values have at most 4 significant bits.
                let mid = (lo + hi) / 2.0;
                let even = if c % 2 == 0 { c } else { c + 1 };
                for s in [0u8, 0x80] {
                    let neg = |x: f32| if s == 0 { x } else { -x };
                    assert_eq!(enc(neg(mid)), s | even, "midpoint of {c:#04x}");
                    assert_eq!(enc(neg(mid.next_down())), s | c, "below midpoint of {c:#04x}");
                    assert_eq!(enc(neg(mid.next_up())), s | (c + 1), "above midpoint of {c:#04x}");
                }
            }
        }
    }

    #[test]
    fn saturation_nan_and_signed_zero() {
        assert_eq!(f32_to_e4m3(449.0), 0x7e);
        assert_eq!(f32_to_e4m3(464.0), 0x7e);
        assert_eq!(f32_to_e4m3(1e30), 0x7e);
        assert_eq!(f32_to_e4m3(f32::NEG_INFINITY), 0xfe);
        assert_eq!(f32_to_e5m2(61440.0), 0x7b);
        assert_eq!(f32_to_e5m2(f32::INFINITY), 0x7b);
        assert_eq!(f32_to_e5m2(-f32::INFINITY), 0xfb);
        for enc in [f32_to_e4m3, f32_to_e5m2] {
            assert_eq!(enc(f32::NAN), NAN);
            assert_eq!(enc(-f32::NAN), NAN);
            assert_eq!(enc(f32::from_bits(0x7f80_0001)), NAN);
            assert_eq!(enc(0.0), 0x00);
            assert_eq!(enc(-0.0), 0x80);
            assert_eq!(enc(-1e-30), 0x80);
            assert_eq!(enc(f32::from_bits(1)), 0x00);
        }
        // Half the smallest subnormal ties to zero (even); a hair above rounds up.
        assert_eq!(f32_to_e4m3(2f32.powi(-10)), 0x00);
        assert_eq!(f32_to_e4m3(2f32.powi(-10).next_up()), 0x01);
        assert_eq!(f32_to_e5m2(2f32.powi(-17)), 0x00);
        assert_eq!(f32_to_e5m2(-3.0 * 2f32.powi(-17)), 0x82);
    }

    #[test]
    fn encode_matches_nearest_search_on_f32_samples() {
        // Every f32 sign/exponent/top-7-mantissa pattern with a few low-bit tails, restricted to
        // the range where the formats differ from plain zero or saturation.
        for (f, _, enc) in formats() {
            let values: Vec<f64> = (0..0x7fu8).map(|c| reference_value(c, f)).collect();
            for hi in 0..=0xffffu32 {
                for lo in [0u32, 1, 0x7fff, 0x8000, 0xffff] {
                    let v = f32::from_bits(hi << 16 | lo);
                    let a = v.abs();
                    if !(a > 2f32.powi(-20) && a < 2f32.powi(17)) {
                        continue;
                    }
                    assert_eq!(enc(v), reference_encode(v, &values), "{v:e} ({:#010x})", v.to_bits());
                }
            }
        }
    }
}
