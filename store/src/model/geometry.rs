//! Box arithmetic: shapes, [`NdBox`] (an n-d box of a tensor) and [`copy_runs`] (the
//! contiguous byte runs of a region between two row-major boxes).

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The number of elements of a shape, or an error if it overflows.
pub fn numel(shape: &[u64]) -> Result<u64> {
    shape.iter().try_fold(1u64, |acc, &d| {
        acc.checked_mul(d)
            .ok_or_else(|| Error::invalid(format!("shape {shape:?} has too many elements")))
    })
}

/// An n-d box of a tensor: `offsets[d] .. offsets[d] + lengths[d]` in every dimension.
///
/// A 0-d box (no dimensions) holds one element, like a scalar tensor.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct NdBox {
    /// Start in each dimension.
    pub offsets: Vec<u64>,
    /// Extent in each dimension.
    pub lengths: Vec<u64>,
}

impl NdBox {
    /// A box from offsets and lengths.
    pub fn new(offsets: Vec<u64>, lengths: Vec<u64>) -> Result<Self> {
        if offsets.len() != lengths.len() {
            return Err(Error::invalid(format!(
                "box offsets {offsets:?} and lengths {lengths:?} have different ranks"
            )));
        }
        for (o, l) in offsets.iter().zip(&lengths) {
            if o.checked_add(*l).is_none() {
                return Err(Error::invalid(format!(
                    "box offsets {offsets:?} lengths {lengths:?} overflow"
                )));
            }
        }
        Ok(NdBox { offsets, lengths })
    }

    /// The whole of a tensor of `shape`.
    pub fn full(shape: &[u64]) -> Self {
        NdBox {
            offsets: vec![0; shape.len()],
            lengths: shape.to_vec(),
        }
    }

    /// Number of dimensions.
    pub fn ndim(&self) -> usize {
        self.lengths.len()
    }

    /// Number of elements (saturating; validated boxes never saturate).
    pub fn numel(&self) -> u64 {
        self.lengths
            .iter()
            .fold(1u64, |acc, &l| acc.saturating_mul(l))
    }

    /// No elements.
    pub fn is_empty(&self) -> bool {
        self.lengths.contains(&0)
    }

    /// Whether this box lies inside a tensor of `shape`.
    pub fn within(&self, shape: &[u64]) -> bool {
        self.ndim() == shape.len()
            && self.offsets.len() == shape.len()
            && self
                .offsets
                .iter()
                .zip(&self.lengths)
                .zip(shape)
                .all(|((o, l), s)| o.checked_add(*l).is_some_and(|e| e <= *s))
    }

    /// The common part of two boxes, `None` if they do not overlap (or differ in rank).
    pub fn intersect(&self, other: &NdBox) -> Option<NdBox> {
        if self.ndim() != other.ndim() {
            return None;
        }
        let mut offsets = Vec::with_capacity(self.ndim());
        let mut lengths = Vec::with_capacity(self.ndim());
        for d in 0..self.ndim() {
            let lo = self.offsets[d].max(other.offsets[d]);
            let hi = (self.offsets[d] + self.lengths[d]).min(other.offsets[d] + other.lengths[d]);
            if hi <= lo {
                return None;
            }
            offsets.push(lo);
            lengths.push(hi - lo);
        }
        Some(NdBox { offsets, lengths })
    }

    /// Whether `other` lies entirely inside this box.
    pub fn contains(&self, other: &NdBox) -> bool {
        self.ndim() == other.ndim()
            && (0..self.ndim()).all(|d| {
                other.offsets[d] >= self.offsets[d]
                    && other.offsets[d] + other.lengths[d] <= self.offsets[d] + self.lengths[d]
            })
    }
}

impl fmt::Display for NdBox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.ndim() == 0 {
            return f.write_str("[scalar]");
        }
        if self.offsets.len() != self.lengths.len() {
            // Only a damaged box read from the store: show it as it is.
            return write!(
                f,
                "[offsets {:?}, lengths {:?}]",
                self.offsets, self.lengths
            );
        }
        f.write_str("[")?;
        for (d, (o, l)) in self.offsets.iter().zip(&self.lengths).enumerate() {
            if d > 0 {
                f.write_str(", ")?;
            }
            match o.checked_add(*l) {
                Some(end) => write!(f, "{o}..{end}")?,
                None => write!(f, "{o}..{o}+{l}")?,
            }
        }
        f.write_str("]")
    }
}

/// The row-major bytes of `bbox` cut out of `whole`, the row-major bytes of a tensor of
/// `shape` with elements of `elem` bytes.
pub fn cut_box(whole: &[u8], shape: &[u64], bbox: &NdBox, elem: usize) -> Vec<u8> {
    let mut out = vec![0u8; bbox.numel() as usize * elem];
    copy_runs(&NdBox::full(shape), bbox, bbox, elem, |s, d, l| {
        let (s, d, l) = (s as usize, d as usize, l as usize);
        out[d..d + l].copy_from_slice(&whole[s..s + l]);
    });
    out
}

/// Calls `f(src_byte, dst_byte, len)` for every contiguous run of `region`, where `src` and
/// `dst` are boxes stored row-major and `region` lies inside both.
///
/// Trailing dimensions that `region` spans fully in both boxes are merged into one run, so a
/// row split copies whole rows and an identical layout copies one run.
pub fn copy_runs(
    src: &NdBox,
    dst: &NdBox,
    region: &NdBox,
    elem: usize,
    mut f: impl FnMut(u64, u64, u64),
) {
    debug_assert!(src.contains(region) && dst.contains(region));
    let n = region.ndim();
    if region.is_empty() {
        return;
    }
    if n == 0 {
        f(0, 0, elem as u64);
        return;
    }
    let elem = elem as u64;
    // Row-major strides in bytes.
    let strides = |b: &NdBox| {
        let mut s = vec![0u64; n];
        let mut acc = elem;
        for d in (0..n).rev() {
            s[d] = acc;
            acc *= b.lengths[d];
        }
        s
    };
    let ss = strides(src);
    let ds = strides(dst);
    // The run covers dims j..n: every dim after j is spanned fully in src, dst and region.
    let mut j = n - 1;
    while j > 0 && region.lengths[j] == src.lengths[j] && region.lengths[j] == dst.lengths[j] {
        j -= 1;
    }
    let run = region.lengths[j..].iter().product::<u64>() * elem;
    let base_src: u64 = (0..n)
        .map(|d| (region.offsets[d] - src.offsets[d]) * ss[d])
        .sum();
    let base_dst: u64 = (0..n)
        .map(|d| (region.offsets[d] - dst.offsets[d]) * ds[d])
        .sum();
    // Odometer over dims 0..j.
    let mut idx = vec![0u64; j];
    loop {
        let so: u64 = base_src + (0..j).map(|d| idx[d] * ss[d]).sum::<u64>();
        let dof: u64 = base_dst + (0..j).map(|d| idx[d] * ds[d]).sum::<u64>();
        f(so, dof, run);
        let mut d = j;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < region.lengths[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(o: &[u64], l: &[u64]) -> NdBox {
        NdBox::new(o.to_vec(), l.to_vec()).unwrap()
    }

    #[test]
    fn intersection() {
        let a = b(&[0, 0], &[4, 4]);
        let c = b(&[2, 3], &[4, 4]);
        assert_eq!(a.intersect(&c), Some(b(&[2, 3], &[2, 1])));
        assert_eq!(a.intersect(&b(&[4, 0], &[1, 1])), None);
        assert_eq!(
            NdBox::full(&[]).intersect(&NdBox::full(&[])),
            Some(NdBox::full(&[]))
        );
        assert_eq!(NdBox::full(&[]).numel(), 1);
        assert!(b(&[0], &[0]).is_empty());
    }

    #[test]
    fn copy_runs_merges_full_trailing_dims() {
        let src = b(&[0, 0], &[4, 8]);
        let mut runs = vec![];
        copy_runs(&src, &src, &src, 2, |s, d, l| runs.push((s, d, l)));
        assert_eq!(runs, vec![(0, 0, 64)]);
        // Column half: one run per row.
        let dst = b(&[0, 4], &[4, 4]);
        let mut runs = vec![];
        copy_runs(&src, &dst, &dst, 1, |s, d, l| runs.push((s, d, l)));
        assert_eq!(runs, vec![(4, 0, 4), (12, 4, 4), (20, 8, 4), (28, 12, 4)]);
    }

    #[test]
    fn copy_runs_matches_elementwise_reference() {
        // 3-d src/dst boxes, region = intersection; compare with per-element copy.
        let src = b(&[1, 0, 2], &[3, 4, 5]);
        let dst = b(&[0, 1, 0], &[3, 3, 6]);
        let region = src.intersect(&dst).unwrap();
        let elem = 2usize;
        let sbytes: Vec<u8> = (0..src.numel() as usize * elem).map(|i| i as u8).collect();
        let mut fast = vec![0u8; dst.numel() as usize * elem];
        copy_runs(&src, &dst, &region, elem, |s, d, l| {
            let (s, d, l) = (s as usize, d as usize, l as usize);
            fast[d..d + l].copy_from_slice(&sbytes[s..s + l]);
        });
        let mut slow = vec![0u8; fast.len()];
        for i in 0..region.lengths[0] {
            for j in 0..region.lengths[1] {
                for k in 0..region.lengths[2] {
                    let g = [
                        region.offsets[0] + i,
                        region.offsets[1] + j,
                        region.offsets[2] + k,
                    ];
                    let so = (((g[0] - src.offsets[0]) * src.lengths[1] + (g[1] - src.offsets[1]))
                        * src.lengths[2]
                        + (g[2] - src.offsets[2])) as usize
                        * elem;
                    let dof = (((g[0] - dst.offsets[0]) * dst.lengths[1] + (g[1] - dst.offsets[1]))
                        * dst.lengths[2]
                        + (g[2] - dst.offsets[2])) as usize
                        * elem;
                    slow[dof..dof + elem].copy_from_slice(&sbytes[so..so + elem]);
                }
            }
        }
        assert_eq!(fast, slow);
    }
}
