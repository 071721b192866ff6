//! [`check_coverage`]: whether a tensor's shards cover its shape exactly once, naming a region
//! missing or saved twice.

use super::{NdBox, ShardLoc};
use crate::error::{Error, Result};

/// Check that `shards` cover a tensor of `shape` exactly once.
///
/// The error names the tensor and a region that is missing or doubled (with the ranks that
/// both hold it).
pub fn check_coverage(name: &str, shape: &[u64], shards: &[ShardLoc]) -> Result<()> {
    for s in shards {
        if !s.bbox.within(shape) {
            return Err(Error::invalid(format!(
                "tensor {name:?}: rank {} holds box {} outside the shape {shape:?}",
                s.rank, s.bbox
            )));
        }
    }
    let shards: Vec<&ShardLoc> = shards.iter().filter(|s| !s.bbox.is_empty()).collect();
    let total = NdBox::full(shape).numel();
    if total == 0 {
        return Ok(());
    }
    // Coordinate compression: the boundaries of all shards cut the tensor into cells; each
    // cell is covered by the same set of shards everywhere inside it.
    let n = shape.len();
    let mut cuts: Vec<Vec<u64>> = (0..n).map(|d| vec![0, shape[d]]).collect();
    for s in &shards {
        for (d, c) in cuts.iter_mut().enumerate() {
            c.push(s.bbox.offsets[d]);
            c.push(s.bbox.offsets[d] + s.bbox.lengths[d]);
        }
    }
    for c in &mut cuts {
        c.sort_unstable();
        c.dedup();
    }
    let cells: u128 = cuts.iter().map(|c| (c.len() - 1) as u128).product();
    if cells > 4_000_000 {
        return coverage_by_volume(name, shape, &shards);
    }
    // Count coverage per cell.
    let dims: Vec<usize> = cuts.iter().map(|c| c.len() - 1).collect();
    let mut count = vec![0u32; cells as usize];
    let mut first = vec![u32::MAX; cells as usize];
    let mut doubled: Option<(usize, u32, u32)> = None;
    for s in &shards {
        let lo: Vec<usize> = (0..n)
            .map(|d| cuts[d].binary_search(&s.bbox.offsets[d]).unwrap_or(0))
            .collect();
        let hi: Vec<usize> = (0..n)
            .map(|d| {
                cuts[d]
                    .binary_search(&(s.bbox.offsets[d] + s.bbox.lengths[d]))
                    .unwrap_or(0)
            })
            .collect();
        for_each_cell(&lo, &hi, &dims, |cell| {
            count[cell] += 1;
            if first[cell] == u32::MAX {
                first[cell] = s.rank;
            } else if doubled.is_none() {
                doubled = Some((cell, first[cell], s.rank));
            }
        });
    }
    let cell_box = |cell: usize| {
        let mut rem = cell;
        let mut idx = vec![0usize; n];
        for d in (0..n).rev() {
            idx[d] = rem % dims[d];
            rem /= dims[d];
        }
        NdBox {
            offsets: (0..n).map(|d| cuts[d][idx[d]]).collect(),
            lengths: (0..n)
                .map(|d| cuts[d][idx[d] + 1] - cuts[d][idx[d]])
                .collect(),
        }
    };
    if let Some((cell, a, b)) = doubled {
        return Err(Error::invalid(format!(
            "tensor {name:?}: region {} is saved twice (by rank {a} and rank {b})",
            cell_box(cell)
        )));
    }
    if let Some(cell) = count.iter().position(|&c| c == 0) {
        return Err(Error::invalid(format!(
            "tensor {name:?}: region {} of shape {shape:?} is not saved by any rank",
            cell_box(cell)
        )));
    }
    Ok(())
}

fn for_each_cell(lo: &[usize], hi: &[usize], dims: &[usize], mut f: impl FnMut(usize)) {
    let n = lo.len();
    if n == 0 {
        f(0);
        return;
    }
    if (0..n).any(|d| lo[d] >= hi[d]) {
        return;
    }
    let mut idx = lo.to_vec();
    loop {
        let mut cell = 0usize;
        for d in 0..n {
            cell = cell * dims[d] + idx[d];
        }
        f(cell);
        let mut d = n;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < hi[d] {
                break;
            }
            idx[d] = lo[d];
        }
    }
}

/// Fallback for shard sets too fragmented for the cell grid: volumes must add up and no two
/// shards may overlap (sweep over the first dimension).
fn coverage_by_volume(name: &str, shape: &[u64], shards: &[&ShardLoc]) -> Result<()> {
    let mut sorted: Vec<&ShardLoc> = shards.to_vec();
    sorted.sort_by_key(|s| s.bbox.offsets[0]);
    let mut active: Vec<&ShardLoc> = Vec::new();
    for s in &sorted {
        active.retain(|a| a.bbox.offsets[0] + a.bbox.lengths[0] > s.bbox.offsets[0]);
        for a in &active {
            if let Some(i) = a.bbox.intersect(&s.bbox) {
                return Err(Error::invalid(format!(
                    "tensor {name:?}: region {i} is saved twice (by rank {} and rank {})",
                    a.rank, s.rank
                )));
            }
        }
        active.push(s);
    }
    let sum: u128 = shards.iter().map(|s| s.bbox.numel() as u128).sum();
    let total = NdBox::full(shape).numel() as u128;
    if sum != total {
        return Err(Error::invalid(format!(
            "tensor {name:?}: shards hold {sum} of {total} elements of shape {shape:?}; part is not saved by any rank"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(o: &[u64], l: &[u64]) -> NdBox {
        NdBox::new(o.to_vec(), l.to_vec()).unwrap()
    }

    fn loc(rank: u32, o: &[u64], l: &[u64]) -> ShardLoc {
        ShardLoc {
            rank,
            bbox: b(o, l),
        }
    }

    #[test]
    fn coverage_exact_gap_and_overlap() {
        let shape = [4, 6];
        // tp column split x dp row split.
        let ok = vec![
            loc(0, &[0, 0], &[2, 3]),
            loc(1, &[0, 3], &[2, 3]),
            loc(2, &[2, 0], &[2, 3]),
            loc(3, &[2, 3], &[2, 3]),
        ];
        check_coverage("w", &shape, &ok).unwrap();

        let gap = &ok[..3];
        let e = check_coverage("w", &shape, gap).unwrap_err().to_string();
        assert!(
            e.contains("\"w\"") && e.contains("[2..4, 3..6]") && e.contains("not saved"),
            "{e}"
        );

        let mut dup = ok.clone();
        dup.push(loc(7, &[1, 1], &[1, 1]));
        let e = check_coverage("w", &shape, &dup).unwrap_err().to_string();
        assert!(
            e.contains("[1..2, 1..2]") && e.contains("rank 0") && e.contains("rank 7"),
            "{e}"
        );

        let out = vec![loc(0, &[0, 0], &[5, 6])];
        assert!(
            check_coverage("w", &shape, &out)
                .unwrap_err()
                .to_string()
                .contains("outside")
        );
    }

    #[test]
    fn coverage_scalar_and_empty() {
        check_coverage("s", &[], &[loc(0, &[], &[])]).unwrap();
        assert!(check_coverage("s", &[], &[]).is_err());
        check_coverage("e", &[0, 3], &[]).unwrap();
    }

    #[test]
    fn coverage_fallback_for_fragmented_sets() {
        // 3000 x 3000 single-element shards along a diagonal band would make 9M cells.
        let n = 2100u64;
        let mut shards: Vec<ShardLoc> = (0..n).map(|i| loc(i as u32, &[i, 0], &[1, n])).collect();
        shards.push(loc(9999, &[0, 0], &[1, 1])); // forces many column cuts
        for i in 1..n {
            shards[i as usize] = loc(i as u32, &[i, 0], &[1, n]);
        }
        let cols: Vec<ShardLoc> = (0..n).map(|j| loc(j as u32, &[0, j], &[1, 1])).collect();
        let mut all: Vec<ShardLoc> = shards[1..n as usize].to_vec();
        all.extend(cols);
        check_coverage("big", &[n, n], &all).unwrap();
        all.pop();
        assert!(check_coverage("big", &[n, n], &all).is_err());
    }
}
