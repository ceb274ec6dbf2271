//! `-c 1`: one checked call per size before the timed ones, for every datatype and reduction.
//!
//! Inputs are small integers chosen so that every partial result is exact in the datatype
//! whatever order the library reduces in (sums stay within the type's exact-integer range,
//! products are powers of two), so a correct library matches exactly. The one exception is
//! `avg` on floating types, whose final division rounds: it is compared within one unit in the
//! last place of the type.

use half::{bf16, f16};

use crate::ffi::{checked_step, regions, Rank};
use crate::opts::{Coll, Dtype, Opts, RedOp, PREMULSUM};

/// Write `v` (an integer the type holds exactly, or for avg any value) as element `i`.
fn put(dt: Dtype, b: &mut [u8], i: usize, v: f64) {
    let at = i * dt.size;
    let b = &mut b[at..at + dt.size];
    match dt.id {
        0 => b[0] = v as i8 as u8,
        1 => b[0] = v as u8,
        2 => b.copy_from_slice(&(v as i32).to_le_bytes()),
        3 => b.copy_from_slice(&(v as u32).to_le_bytes()),
        4 => b.copy_from_slice(&(v as i64).to_le_bytes()),
        5 => b.copy_from_slice(&(v as u64).to_le_bytes()),
        6 => b.copy_from_slice(&f16::from_f64(v).to_le_bytes()),
        7 => b.copy_from_slice(&(v as f32).to_le_bytes()),
        8 => b.copy_from_slice(&v.to_le_bytes()),
        9 => b.copy_from_slice(&bf16::from_f64(v).to_le_bytes()),
        _ => b[0] = fp8_encode(dt.id, v),
    }
}

fn get(dt: Dtype, b: &[u8], i: usize) -> f64 {
    let b = &b[i * dt.size..(i + 1) * dt.size];
    match dt.id {
        0 => b[0] as i8 as f64,
        1 => b[0] as f64,
        2 => i32::from_le_bytes(b.try_into().unwrap()) as f64,
        3 => u32::from_le_bytes(b.try_into().unwrap()) as f64,
        4 => i64::from_le_bytes(b.try_into().unwrap()) as f64,
        5 => u64::from_le_bytes(b.try_into().unwrap()) as f64,
        6 => f16::from_le_bytes([b[0], b[1]]).to_f64(),
        7 => f32::from_le_bytes(b.try_into().unwrap()) as f64,
        8 => f64::from_le_bytes(b.try_into().unwrap()),
        9 => bf16::from_le_bytes([b[0], b[1]]).to_f64(),
        _ => fp8_decode(dt.id, b[0]),
    }
}

/// (exponent bits, mantissa bits, bias) of ncclFloat8e4m3 (10) and ncclFloat8e5m2 (11).
fn fp8_format(id: i32) -> (u32, u32, i32) {
    if id == 10 { (4, 3, 7) } else { (5, 2, 15) }
}

fn fp8_decode(id: i32, b: u8) -> f64 {
    let (eb, mb, bias) = fp8_format(id);
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((b >> mb) & ((1 << eb) - 1)) as i32;
    let m = (b & ((1 << mb) - 1)) as f64 / (1u32 << mb) as f64;
    if e == 0 {
        sign * m * 2f64.powi(1 - bias)
    } else {
        sign * (1.0 + m) * 2f64.powi(e - bias)
    }
}

/// The fp8 byte nearest to `v` (values written here are exact; only avg results are not).
fn fp8_encode(id: i32, v: f64) -> u8 {
    let mut best = (f64::INFINITY, 0u8);
    for b in 0..=0x7eu8 {
        let d = (fp8_decode(id, b) - v.abs()).abs();
        if d < best.0 {
            best = (d, b);
        }
    }
    if v < 0.0 { best.1 | 0x80 } else { best.1 }
}

/// Mantissa bits of a floating type (None: an integer type).
fn mantissa_bits(dt: Dtype) -> Option<i32> {
    match dt.id {
        6 => Some(10),
        7 => Some(23),
        8 => Some(52),
        9 => Some(7),
        10 => Some(3),
        11 => Some(2),
        _ => None,
    }
}

/// The largest total a sum may reach and stay exact in `dt`.
fn exact_limit(dt: Dtype) -> usize {
    match dt.id {
        0 => 127,
        1 => 255,
        6 => 2048,
        9 => 256,
        10 => 16,
        11 => 8,
        _ => 1 << 20,
    }
}

/// The inputs and expected results of one checked call.
struct Pattern {
    coll: Coll,
    op: RedOp,
    n: usize,
    /// Largest exact sum total.
    tmax: usize,
}

impl Pattern {
    fn reduces(&self) -> bool {
        self.coll.reduces()
    }
    /// Sum/avg: element i totals T(i) = i mod (tmax+1), spread over the ranks in near-equal parts.
    fn total(&self, i: usize) -> usize {
        i % (self.tmax + 1)
    }
    /// Rank r's input value at global element index i.
    fn val(&self, r: usize, i: usize) -> f64 {
        let n = self.n;
        if !self.reduces() {
            return ((r * 7 + i) % 8) as f64;
        }
        match self.op.id {
            0 | 4 | PREMULSUM => {
                let t = self.total(i);
                (t / n + usize::from((r + i) % n < t % n)) as f64
            }
            1 => if (r + i) % n < (i % 4).min(n) { 2.0 } else { 1.0 },
            _ => ((r * 3 + i) % 7) as f64,
        }
    }
    /// The reduction over all ranks at global element index i.
    fn reduced(&self, i: usize, dt: Dtype) -> f64 {
        let n = self.n;
        match self.op.id {
            0 | PREMULSUM => self.total(i) as f64,
            4 if mantissa_bits(dt).is_none() => (self.total(i) / n) as f64,
            4 => self.total(i) as f64 / n as f64,
            1 => 2f64.powi((i % 4).min(n) as i32),
            2 => (0..n).map(|r| self.val(r, i)).fold(f64::MIN, f64::max),
            _ => (0..n).map(|r| self.val(r, i)).fold(f64::MAX, f64::min),
        }
    }
    /// What rank `rank` should hold at output element k (None: not specified there).
    fn expected(&self, rank: usize, root: usize, c: usize, k: usize, dt: Dtype) -> Option<f64> {
        let n = self.n;
        match self.coll {
            Coll::AllReduce => Some(self.reduced(k, dt)),
            Coll::Reduce => (rank == root).then(|| self.reduced(k, dt)),
            Coll::ReduceScatter => Some(self.reduced(rank * c + k, dt)),
            Coll::Broadcast => Some(self.val(root, k)),
            Coll::AllGather => Some(self.val(k / c, k)),
            Coll::Gather => (rank == root).then(|| self.val(k / c, k)),
            Coll::Scatter => Some(self.val(root, rank * c + k)),
            Coll::AlltoAll => Some(self.val(k / c, rank * c + k % c)),
            Coll::SendRecv => Some(self.val((rank + n - 1) % n, k)),
        }
    }
    /// The global element index of rank r's input element j.
    fn input_index(&self, r: usize, c: usize, j: usize) -> usize {
        match self.coll {
            Coll::AllGather | Coll::Gather => r * c + j,
            _ => j,
        }
    }
}

/// Is `got` the right result (of `n` ranks' inputs)? Exact, except avg on floating types: as
/// in NCCL, every input is scaled by 1/n rounded to the type before the sum (fp8: the exact
/// sum divided once), so each of the n products and n-1 additions of the non-negative inputs
/// may round: within (n+2) units of 2^-m relative, far from a missing or doubled rank.
fn matches(dt: Dtype, got: f64, want: f64, op: RedOp, n: usize) -> bool {
    if got == want {
        return true;
    }
    match (op.id, mantissa_bits(dt)) {
        (4, Some(m)) => (got - want).abs() <= want.abs() * (n as f64 + 2.0) * 2f64.powi(-m) + 1e-30,
        _ => false,
    }
}

/// Fill inputs, run the call once, and count wrong output elements of this process's ranks.
pub fn validate(o: &Opts, ranks: &mut [Rank], n: usize, count: usize, in_place: bool) -> Result<Vec<u64>, String> {
    let dt = o.dtype;
    let es = dt.size;
    let p = Pattern { coll: o.coll, op: o.op, n, tmax: exact_limit(dt).min(4 * n) };
    let (nin, nout) = o.coll.elems(count, n);
    let root = o.root.max(0) as usize;
    for r in ranks.iter_mut() {
        let rank = r.rank;
        let ((sin, soff), (rin, _)) = regions(o.coll, rank, count, es, in_place);
        // Sentinels everywhere the output may land, then the input over them where it shares.
        let sentinel = 0x5au8;
        r.recv.bytes_mut().fill(sentinel);
        if in_place && !rin {
            r.send.bytes_mut().fill(sentinel);
        }
        let input = if sin { r.recv.bytes_mut() } else { r.send.bytes_mut() };
        for j in 0..nin {
            put(dt, &mut input[soff..], j, p.val(rank, p.input_index(rank, count, j)));
        }
    }
    for r in ranks.iter() {
        r.upload()?;
    }
    checked_step(o, ranks, n, count, in_place)?;
    for r in ranks.iter() {
        r.download()?;
    }
    let mut wrong = Vec::with_capacity(ranks.len());
    for r in ranks.iter() {
        let ((_, _), (rin, roff)) = regions(o.coll, r.rank, count, es, in_place);
        let out = if rin { r.recv.bytes() } else { r.send.bytes() };
        let out = &out[roff..];
        let mut bad = 0u64;
        for k in 0..nout {
            if let Some(want) = p.expected(r.rank, root, count, k, dt) {
                if !matches(dt, get(dt, out, k), want, o.op, n) {
                    bad += 1;
                }
            }
        }
        wrong.push(bad);
    }
    Ok(wrong)
}

#[cfg(test)]
mod tests {
    use super::*;

    const E4M3: Dtype = Dtype { id: 10, name: "f8e4m3", size: 1 };
    const E5M2: Dtype = Dtype { id: 11, name: "f8e5m2", size: 1 };

    #[test]
    fn fp8_round_trips_the_values_the_checker_writes() {
        for dt in [E4M3, E5M2] {
            for v in 0..=exact_limit(dt) {
                let mut b = [0u8];
                put(dt, &mut b, 0, v as f64);
                assert_eq!(get(dt, &b, 0), v as f64, "{} {v}", dt.name);
            }
        }
        assert_eq!(fp8_decode(10, 0x7e), 448.0);
        assert_eq!(fp8_decode(11, 0x7b), 57344.0);
    }

    #[test]
    fn sums_stay_within_the_exact_range() {
        for n in [1, 2, 3, 8, 64] {
            for dt in [E4M3, E5M2, Dtype { id: 0, name: "int8", size: 1 }] {
                let p = Pattern { coll: Coll::AllReduce, op: RedOp { id: 0, name: "sum" }, n,
                                  tmax: exact_limit(dt).min(4 * n) };
                for i in 0..100 {
                    let s: f64 = (0..n).map(|r| p.val(r, i)).sum();
                    assert_eq!(s, p.reduced(i, dt));
                    assert!(s <= exact_limit(dt) as f64);
                }
            }
        }
    }

    #[test]
    fn products_and_extrema_match_their_closed_forms() {
        for n in [1, 2, 5] {
            let dt = Dtype { id: 7, name: "float", size: 4 };
            for (id, name) in [(1, "prod"), (2, "max"), (3, "min")] {
                let p = Pattern { coll: Coll::AllReduce, op: RedOp { id, name }, n, tmax: 4 * n };
                for i in 0..50 {
                    let vals: Vec<f64> = (0..n).map(|r| p.val(r, i)).collect();
                    let want = match id {
                        1 => vals.iter().product(),
                        2 => vals.iter().cloned().fold(f64::MIN, f64::max),
                        _ => vals.iter().cloned().fold(f64::MAX, f64::min),
                    };
                    assert_eq!(want, p.reduced(i, dt));
                }
            }
        }
    }
}
