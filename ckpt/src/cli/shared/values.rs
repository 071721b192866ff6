//! Element values: decoding every dtype to `f64`, converting floating-point tensors between
//! dtypes (`export --dtype`), and streaming statistics (`inspect --tensor`).

use ckpt_store::DType;
use half::{bf16, f16};
use serde::Serialize;

/// FP8 E4M3 (OCP "fn": no infinities, `S.1111.111` is NaN) to f32, exactly.
pub fn f8_e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let e = ((b >> 3) & 0x0f) as i32;
    let m = (b & 0x07) as f32;
    if e == 0x0f && (b & 0x07) == 0x07 {
        return f32::NAN;
    }
    if e == 0 {
        sign * (m / 8.0) * 2f32.powi(-6)
    } else {
        sign * (1.0 + m / 8.0) * 2f32.powi(e - 7)
    }
}

/// FP8 E5M2 to f32, exactly (it is the upper byte of an IEEE binary16).
pub fn f8_e5m2_to_f32(b: u8) -> f32 {
    f16::from_bits((b as u16) << 8).to_f32()
}

/// Decode little-endian elements of `dtype` to f64, appending to `out`. A trailing partial
/// element is ignored.
pub fn decode(dtype: DType, bytes: &[u8], out: &mut Vec<f64>) {
    macro_rules! each {
        ($n:expr, $f:expr) => {{
            out.reserve(bytes.len() / $n);
            for c in bytes.chunks_exact($n) {
                let a: [u8; $n] = c.try_into().expect("chunks_exact");
                #[allow(clippy::redundant_closure_call)]
                out.push($f(a));
            }
        }};
    }
    match dtype {
        DType::F64 => each!(8, f64::from_le_bytes),
        DType::F32 => each!(4, |a| f32::from_le_bytes(a) as f64),
        DType::F16 => each!(2, |a| f16::from_le_bytes(a).to_f64()),
        DType::Bf16 => each!(2, |a| bf16::from_le_bytes(a).to_f64()),
        DType::F8E4m3 => each!(1, |a: [u8; 1]| f8_e4m3_to_f32(a[0]) as f64),
        DType::F8E5m2 => each!(1, |a: [u8; 1]| f8_e5m2_to_f32(a[0]) as f64),
        DType::I64 => each!(8, |a| i64::from_le_bytes(a) as f64),
        DType::I32 => each!(4, |a| i32::from_le_bytes(a) as f64),
        DType::I16 => each!(2, |a| i16::from_le_bytes(a) as f64),
        DType::I8 => each!(1, |a| i8::from_le_bytes(a) as f64),
        DType::U64 => each!(8, |a| u64::from_le_bytes(a) as f64),
        DType::U32 => each!(4, |a| u32::from_le_bytes(a) as f64),
        DType::U16 => each!(2, |a| u16::from_le_bytes(a) as f64),
        DType::U8 => each!(1, |a: [u8; 1]| a[0] as f64),
        DType::Bool => each!(1, |a: [u8; 1]| (a[0] != 0) as u8 as f64),
        // `DType` is non-exhaustive upstream only in spirit; a new dtype decodes as bytes.
        #[allow(unreachable_patterns)]
        _ => each!(1, |a: [u8; 1]| a[0] as f64),
    }
}

/// The dtypes `export --dtype` converts floating-point tensors to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FloatDType {
    /// bfloat16.
    Bf16,
    /// IEEE binary16.
    F16,
    /// IEEE binary32.
    F32,
}

impl FloatDType {
    /// As a store dtype.
    pub fn dtype(self) -> DType {
        match self {
            FloatDType::Bf16 => DType::Bf16,
            FloatDType::F16 => DType::F16,
            FloatDType::F32 => DType::F32,
        }
    }
}

/// The dtype a tensor of `src` becomes under `--dtype to`: floating-point tensors convert,
/// integers and booleans keep theirs.
pub fn converted_dtype(src: DType, to: Option<FloatDType>) -> DType {
    match to {
        Some(t) if src.is_float() => t.dtype(),
        _ => src,
    }
}

/// Convert little-endian elements of `src` to `dst` (round to nearest even; NaN stays NaN,
/// out-of-range values become infinities). Same dtype copies.
pub fn convert(src: DType, dst: DType, bytes: &[u8]) -> Vec<u8> {
    if src == dst {
        return bytes.to_vec();
    }
    let n = bytes.len() / src.size();
    let mut out = Vec::with_capacity(n * dst.size());
    // Exact widening paths first: they are the common case and need no f64 detour.
    match (src, dst) {
        (DType::Bf16, DType::F32) => {
            for c in bytes.chunks_exact(2) {
                out.extend_from_slice(&bf16::from_le_bytes([c[0], c[1]]).to_f32().to_le_bytes());
            }
            return out;
        }
        (DType::F16, DType::F32) => {
            for c in bytes.chunks_exact(2) {
                out.extend_from_slice(&f16::from_le_bytes([c[0], c[1]]).to_f32().to_le_bytes());
            }
            return out;
        }
        (DType::F32, DType::Bf16) => {
            for c in bytes.chunks_exact(4) {
                let v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                out.extend_from_slice(&bf16::from_f32(v).to_le_bytes());
            }
            return out;
        }
        (DType::F32, DType::F16) => {
            for c in bytes.chunks_exact(4) {
                let v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                out.extend_from_slice(&f16::from_f32(v).to_le_bytes());
            }
            return out;
        }
        _ => {}
    }
    let mut vals = Vec::with_capacity(n);
    decode(src, bytes, &mut vals);
    for v in vals {
        match dst {
            DType::F32 => out.extend_from_slice(&(v as f32).to_le_bytes()),
            DType::Bf16 => out.extend_from_slice(&bf16::from_f64(v).to_le_bytes()),
            DType::F16 => out.extend_from_slice(&f16::from_f64(v).to_le_bytes()),
            DType::F64 => out.extend_from_slice(&v.to_le_bytes()),
            other => unreachable!("conversion to {other} is not offered"),
        }
    }
    out
}

/// Statistics of a tensor's values. Mean and standard deviation are over the finite values.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Summary {
    /// Elements.
    pub count: u64,
    /// NaN elements.
    pub nan: u64,
    /// Infinite elements (+inf or -inf).
    pub inf: u64,
    /// Elements equal to zero.
    pub zeros: u64,
    /// Smallest finite value.
    pub min: Option<f64>,
    /// Largest finite value.
    pub max: Option<f64>,
    /// Mean of the finite values.
    pub mean: Option<f64>,
    /// Population standard deviation of the finite values.
    pub std: Option<f64>,
    #[serde(skip)]
    finite: u64,
    #[serde(skip)]
    m2: f64,
}

impl Summary {
    /// Add the values of a slab of elements (two passes over the slab, then a Chan merge, so
    /// the result is stable for billions of elements).
    pub fn add(&mut self, vals: &[f64]) {
        let mut s = Summary {
            count: vals.len() as u64,
            ..Summary::default()
        };
        let mut sum = 0.0f64;
        for &v in vals {
            if v.is_nan() {
                s.nan += 1;
            } else if v.is_infinite() {
                s.inf += 1;
            } else {
                if v == 0.0 {
                    s.zeros += 1;
                }
                s.finite += 1;
                sum += v;
                s.min = Some(s.min.map_or(v, |m| m.min(v)));
                s.max = Some(s.max.map_or(v, |m| m.max(v)));
            }
        }
        if s.finite > 0 {
            let mean = sum / s.finite as f64;
            let mut m2 = 0.0;
            for &v in vals.iter().filter(|v| v.is_finite()) {
                m2 += (v - mean) * (v - mean);
            }
            s.mean = Some(mean);
            s.m2 = m2;
        }
        self.merge(&s);
    }

    /// Combine with another part's statistics.
    pub fn merge(&mut self, o: &Summary) {
        self.count += o.count;
        self.nan += o.nan;
        self.inf += o.inf;
        self.zeros += o.zeros;
        self.min = match (self.min, o.min) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        self.max = match (self.max, o.max) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        let (na, nb) = (self.finite as f64, o.finite as f64);
        match (self.mean, o.mean) {
            (Some(ma), Some(mb)) => {
                let n = na + nb;
                let d = mb - ma;
                self.mean = Some(ma + d * nb / n);
                self.m2 += o.m2 + d * d * na * nb / n;
            }
            (None, Some(mb)) => {
                self.mean = Some(mb);
                self.m2 = o.m2;
            }
            _ => {}
        }
        self.finite += o.finite;
        self.std = (self.finite > 0).then(|| (self.m2 / self.finite as f64).sqrt());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_decodes_exactly() {
        assert_eq!(f8_e4m3_to_f32(0x00), 0.0);
        assert_eq!(f8_e4m3_to_f32(0x38), 1.0); // e=7, m=0
        assert_eq!(f8_e4m3_to_f32(0x7e), 448.0); // largest finite
        assert_eq!(f8_e4m3_to_f32(0x01), 2f32.powi(-9)); // smallest subnormal
        assert_eq!(f8_e4m3_to_f32(0xb8), -1.0);
        assert!(f8_e4m3_to_f32(0x7f).is_nan());
        assert_eq!(f8_e5m2_to_f32(0x3c), 1.0);
        assert_eq!(f8_e5m2_to_f32(0x7b), 57344.0);
        assert!(f8_e5m2_to_f32(0x7c).is_infinite());
    }

    #[test]
    fn conversions_round_trip_where_exact() {
        let vals = [0.0f32, 1.0, -2.5, 65504.0, f32::INFINITY, 1e-3];
        let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let b = convert(DType::F32, DType::Bf16, &bytes);
        assert_eq!(b.len(), 12);
        let back = convert(DType::Bf16, DType::F32, &b);
        let mut got = Vec::new();
        decode(DType::F32, &back, &mut got);
        assert_eq!(&got[..5], &[0.0, 1.0, -2.5, 65536.0, f64::INFINITY]);
        assert!((got[5] - 1e-3).abs() < 1e-5);
        let nan = convert(DType::F32, DType::F16, &f32::NAN.to_le_bytes());
        assert!(f16::from_le_bytes([nan[0], nan[1]]).is_nan());
        let f64b = convert(DType::F64, DType::F32, &1.5f64.to_le_bytes());
        assert_eq!(f32::from_le_bytes(f64b.try_into().unwrap()), 1.5);
        assert_eq!(
            converted_dtype(DType::I64, Some(FloatDType::Bf16)),
            DType::I64
        );
        assert_eq!(
            converted_dtype(DType::F64, Some(FloatDType::Bf16)),
            DType::Bf16
        );
    }

    #[test]
    fn summary_merges_like_one_pass() {
        let vals: Vec<f64> = (0..1000).map(|i| ((i * 37) % 101) as f64 - 50.0).collect();
        let mut one = Summary::default();
        one.add(&vals);
        let mut parts = Summary::default();
        for c in vals.chunks(77) {
            parts.add(c);
        }
        let mean = vals.iter().sum::<f64>() / 1000.0;
        let var = vals.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / 1000.0;
        for s in [&one, &parts] {
            assert_eq!(s.count, 1000);
            assert!((s.mean.unwrap() - mean).abs() < 1e-9);
            assert!((s.std.unwrap() - var.sqrt()).abs() < 1e-9);
            assert_eq!(s.min, Some(-50.0));
            assert_eq!(s.max, Some(50.0));
        }
        let mut odd = Summary::default();
        odd.add(&[f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 0.0, 2.0]);
        assert_eq!((odd.nan, odd.inf, odd.zeros), (1, 2, 1));
        assert_eq!(odd.mean, Some(1.0));
        let mut all_nan = Summary::default();
        all_nan.add(&[f64::NAN]);
        assert_eq!(all_nan.mean, None);
        assert_eq!(all_nan.std, None);
    }
}
