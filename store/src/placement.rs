//! Placement rules: which boxes of which tensors a rank holds under a layout.
//!
//! Every parallelism people train with is expressed as boxes of the global tensors:
//!
//! - **data parallel**: every data-parallel rank holds the same boxes; one of them writes
//!   them, the others record a replica. The writers balance the bytes: the replicated tensors
//!   of a pipeline stage, largest first (then by name), each go to the holder that writes the
//!   fewest bytes so far ([`replica_writers`]), so every rank of the stage computes the same
//!   writers from the same tensors, and no rank writes much more than another (a rank's bytes
//!   set its save's time on a node of its own);
//! - **tensor parallel**: a tensor with `tp_dim` is split along that dimension (column-parallel
//!   weights along the output dimension, row-parallel along the input one); the dimension must
//!   divide by `tp`; tensors without `tp_dim` are replicated across tensor-parallel ranks;
//! - **pipeline parallel**: a tensor belongs to a stage: the first (embeddings), the last
//!   (final norm, output layer) or the stage of its layer (layers split evenly, the first
//!   stages taking one more when they do not divide);
//! - **ZeRO**: tensors of a ZeRO group (optimizer state from stage 1, parameters from stage
//!   3) are flattened per (pipeline stage, tensor-parallel rank) in registration order, and the
//!   flat buffer is split across data-parallel ranks in ranges of `ceil(N / dp)` elements, the
//!   last range shorter or empty (DeepSpeed's uneven split). A flat range of a tensor is
//!   at most `2 * ndim - 1` boxes ([`flat_range_boxes`]).
//!
//! Placements are pure functions of (layout, rank, specs): the save, the resharding restore,
//! `ckpt plan` and the recovery planner all call the same code.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::error::{Error, Result};
use crate::model::{Layout, NdBox};
pub use crate::model::{Placement, Stage, TensorSpec, ZeroGroup};

/// A box a rank holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placed {
    /// Index into the specs.
    pub spec: usize,
    /// The box.
    pub bbox: NdBox,
    /// `None` if this rank writes the box; otherwise the rank that does.
    pub replica_of: Option<u32>,
}

/// The stage of a tensor under `pp` stages.
pub fn stage_of(stage: &Stage, pp: u32) -> u32 {
    match stage {
        Stage::First => 0,
        Stage::Last => pp - 1,
        Stage::Layer { index, of } => {
            let of = (*of).max(1);
            let index = (*index).min(of - 1);
            // `of` layers over `pp` stages, the first `of % pp` stages one layer more.
            let base = of / pp;
            let extra = of % pp;
            let big = (base + 1) * extra;
            if base == 0 {
                index.min(pp - 1)
            } else if index < big {
                index / (base + 1)
            } else {
                extra + (index - big) / base
            }
        }
    }
}

/// The tensor-parallel box of `spec` on tensor-parallel rank `tp_idx` of `tp`.
pub fn tp_box(spec: &TensorSpec, tp_idx: u32, tp: u32) -> Result<NdBox> {
    let mut b = NdBox::full(&spec.shape);
    if let Some(d) = spec.placement.tp_dim {
        if d >= spec.shape.len() {
            return Err(Error::invalid(format!(
                "tensor {:?}: tensor-parallel dimension {d} but the shape {:?} has {} dimensions",
                spec.name,
                spec.shape,
                spec.shape.len()
            )));
        }
        let n = spec.shape[d];
        if !n.is_multiple_of(tp as u64) {
            return Err(Error::invalid(format!(
                "tensor {:?}: dimension {d} of size {n} does not divide by tp={tp}; choose a tp that divides {n}",
                spec.name
            )));
        }
        let part = n / tp as u64;
        b.offsets[d] = part * tp_idx as u64;
        b.lengths[d] = part;
    }
    Ok(b)
}

/// The boxes (row-major order) that make up elements `lo..hi` of a row-major tensor of
/// `shape`; at most `2 * ndim - 1` of them.
pub fn flat_range_boxes(shape: &[u64], lo: u64, hi: u64) -> Vec<NdBox> {
    let mut out = Vec::new();
    flat_rec(shape, lo, hi, &mut Vec::new(), &mut out);
    out
}

fn flat_rec(shape: &[u64], lo: u64, hi: u64, prefix: &mut Vec<u64>, out: &mut Vec<NdBox>) {
    if lo >= hi {
        return;
    }
    let push = |prefix: &[u64], first: (u64, u64), rest: &[u64], out: &mut Vec<NdBox>| {
        let mut offsets: Vec<u64> = prefix.to_vec();
        let mut lengths: Vec<u64> = vec![1; prefix.len()];
        offsets.push(first.0);
        lengths.push(first.1);
        offsets.extend(std::iter::repeat_n(0, rest.len()));
        lengths.extend_from_slice(rest);
        out.push(NdBox { offsets, lengths });
    };
    if shape.is_empty() {
        out.push(NdBox {
            offsets: prefix.to_vec(),
            lengths: vec![1; prefix.len()],
        });
        return;
    }
    let inner: u64 = shape[1..].iter().product();
    if inner == 0 {
        return;
    }
    let r0 = lo / inner;
    let r_last = (hi - 1) / inner;
    if r0 == r_last {
        if lo.is_multiple_of(inner) && hi - lo == inner {
            push(prefix, (r0, 1), &shape[1..], out);
            return;
        }
        prefix.push(r0);
        flat_rec(&shape[1..], lo - r0 * inner, hi - r0 * inner, prefix, out);
        prefix.pop();
        return;
    }
    let mut start_full = r0;
    if !lo.is_multiple_of(inner) {
        prefix.push(r0);
        flat_rec(&shape[1..], lo % inner, inner, prefix, out);
        prefix.pop();
        start_full = r0 + 1;
    }
    let end_full = hi / inner;
    if end_full > start_full {
        push(
            prefix,
            (start_full, end_full - start_full),
            &shape[1..],
            out,
        );
    }
    if !hi.is_multiple_of(inner) {
        prefix.push(end_full);
        flat_rec(&shape[1..], 0, hi % inner, prefix, out);
        prefix.pop();
    }
}

/// The writer of each tensor of stage `pp` that is replicated over data parallelism (spec index
/// to rank), for the tensor-parallel coordinate `tp_idx` where a tensor is split by it: each
/// tensor, largest first (ties by name, then by index), goes to the holder that writes the
/// fewest bytes so far (the lowest data-parallel, then tensor-parallel, coordinate among
/// equals). A tensor split by tensor parallelism has a box on every tensor-parallel coordinate,
/// each written by one of the data-parallel ranks of that coordinate; one replicated across
/// tensor parallelism too is written by one rank of the stage. Every rank computes the whole
/// stage's assignment, so the ranks agree on it.
fn replica_writers(
    layout: &Layout,
    pp: u32,
    specs: &[TensorSpec],
    tp_idx: u32,
) -> Result<HashMap<usize, u32>> {
    let (dp, tp) = (layout.dp, layout.tp);
    let mut items: Vec<(u64, &str, usize)> = Vec::new();
    for (i, s) in specs.iter().enumerate() {
        if zero_group(s, layout).is_some() || stage_of(&s.placement.stage, layout.pp) != pp {
            continue;
        }
        let bytes = tp_box(s, 0, tp)?.numel() * s.dtype.size() as u64;
        items.push((bytes, &s.name, i));
    }
    items.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(b.1)).then(a.2.cmp(&b.2)));
    let mut loads = Loads::new(dp, tp);
    let rank = |d: u32, t: u32| layout.rank(crate::model::Coords { dp: d, tp: t, pp });
    let mut out = HashMap::with_capacity(items.len());
    for (bytes, _, i) in items {
        if specs[i].placement.tp_dim.is_some() {
            for t in 0..tp {
                let d = loads.least_on(t);
                loads.add(d, t, bytes);
                if t == tp_idx {
                    out.insert(i, rank(d, t));
                }
            }
        } else {
            let (d, t) = loads.least();
            loads.add(d, t, bytes);
            out.insert(i, rank(d, t));
        }
    }
    Ok(out)
}

/// Bytes each (dp, tp) coordinate of a stage writes so far, ordered over the whole stage and
/// per tensor-parallel coordinate: the first of each order is the least loaded.
struct Loads {
    tp: u32,
    load: Vec<u64>,
    all: BTreeSet<(u64, u32, u32)>,
    by_tp: Vec<BTreeSet<(u64, u32)>>,
}

impl Loads {
    fn new(dp: u32, tp: u32) -> Self {
        Loads {
            tp,
            load: vec![0; (dp * tp) as usize],
            all: (0..dp)
                .flat_map(|d| (0..tp).map(move |t| (0, d, t)))
                .collect(),
            by_tp: (0..tp).map(|_| (0..dp).map(|d| (0, d)).collect()).collect(),
        }
    }

    /// The least loaded (dp, tp) of the stage.
    fn least(&self) -> (u32, u32) {
        let &(_, d, t) = self.all.first().expect("a layout has a rank");
        (d, t)
    }

    /// The least loaded dp on tensor-parallel coordinate `t`.
    fn least_on(&self, t: u32) -> u32 {
        self.by_tp[t as usize]
            .first()
            .expect("a layout has a rank")
            .1
    }

    fn add(&mut self, d: u32, t: u32, bytes: u64) {
        let l = &mut self.load[(d * self.tp + t) as usize];
        self.all.remove(&(*l, d, t));
        self.by_tp[t as usize].remove(&(*l, d));
        *l += bytes;
        self.all.insert((*l, d, t));
        self.by_tp[t as usize].insert((*l, d));
    }
}

/// The ZeRO group of `spec` when `layout`'s ZeRO stage partitions it (its group's stage is at
/// or below the layout's), else `None`: the tensor is then held whole or split by tensor
/// parallelism, and replicated over data parallelism.
pub fn zero_group<'a>(spec: &'a TensorSpec, layout: &Layout) -> Option<&'a ZeroGroup> {
    spec.placement
        .zero
        .as_ref()
        .filter(|z| layout.zero >= z.from_stage && z.from_stage > 0)
}

/// FNV-1a of `name` modulo `n`: stable across builds and platforms. It picks the
/// tensor-parallel writer of a ZeRO group replicated across tensor parallelism (and picked the
/// writer of every replicated tensor before [`replica_writers`] balanced them).
pub fn spread(name: &str, n: u32) -> u32 {
    let mut h: u64 = 0xcbf29ce484222325;
    for b in name.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    (h % n as u64) as u32
}

/// Which boxes `rank` holds under `layout` (see the module docs), in spec order.
pub fn place_rank(layout: &Layout, rank: u32, specs: &[TensorSpec]) -> Result<Vec<Placed>> {
    layout.validate()?;
    if rank >= layout.world() {
        return Err(Error::invalid(format!(
            "rank {rank} is outside the layout {layout} ({} ranks)",
            layout.world()
        )));
    }
    let c = layout.coords(rank);
    let mut out: Vec<Placed> = Vec::new();
    // ZeRO groups on this (pp, tp): name -> members (spec index, local box).
    let mut groups: BTreeMap<(u32, &str), Vec<(usize, NdBox)>> = BTreeMap::new();
    let writers = replica_writers(layout, c.pp, specs, c.tp)?;
    let mut order: Vec<usize> = (0..specs.len()).collect();
    order.sort_by_key(|&i| (specs[i].placement.order, i));
    for &i in &order {
        let s = &specs[i];
        if stage_of(&s.placement.stage, layout.pp) != c.pp {
            continue;
        }
        let local = tp_box(s, c.tp, layout.tp)?;
        let zero = zero_group(s, layout);
        if let Some(z) = zero {
            let first = groups
                .keys()
                .find(|(_, g)| *g == z.group.as_str())
                .map(|k| k.0)
                .unwrap_or(s.placement.order);
            groups
                .entry((first, z.group.as_str()))
                .or_default()
                .push((i, local));
            continue;
        }
        // Replicated over dp (and over tp when not split): one writer, the bytes balanced.
        let writer = writers[&i];
        out.push(Placed {
            spec: i,
            bbox: local,
            replica_of: (writer != rank).then_some(writer),
        });
    }
    for ((_, gname), members) in groups {
        place_zero_group(layout, rank, specs, gname, members, &mut out);
    }
    Ok(out)
}

/// This rank's part of the ZeRO group `gname` (`members`: each tensor's spec index and its
/// box on this rank's tp coordinate, in order): the group's elements as one flat range split
/// evenly over dp, cut back into boxes of each tensor.
fn place_zero_group(
    layout: &Layout,
    rank: u32,
    specs: &[TensorSpec],
    gname: &str,
    members: Vec<(usize, NdBox)>,
    out: &mut Vec<Placed>,
) {
    let c = layout.coords(rank);
    let total: u64 = members.iter().map(|(_, b)| b.numel()).sum();
    let part = total.div_ceil(layout.dp as u64);
    let lo = (part * c.dp as u64).min(total);
    let hi = (part * (c.dp as u64 + 1)).min(total);
    // Tensors replicated across tp keep one writer per data-parallel partition.
    let mut at = 0u64;
    for (i, local) in members {
        let n = local.numel();
        let (a, b) = (lo.max(at), hi.min(at + n));
        if a < b {
            let s = &specs[i];
            let replica_of = if s.placement.tp_dim.is_none() && layout.tp > 1 {
                let wtp = spread(gname, layout.tp);
                let writer = layout.rank(crate::model::Coords {
                    dp: c.dp,
                    tp: wtp,
                    pp: c.pp,
                });
                (writer != rank).then_some(writer)
            } else {
                None
            };
            for bx in flat_range_boxes(&local.lengths, a - at, b - at) {
                let offsets = bx
                    .offsets
                    .iter()
                    .zip(&local.offsets)
                    .map(|(o, l)| o + l)
                    .collect();
                out.push(Placed {
                    spec: i,
                    bbox: NdBox {
                        offsets,
                        lengths: bx.lengths,
                    },
                    replica_of,
                });
            }
        }
        at += n;
    }
}

/// The bytes each rank writes under placements `placed` (of every rank, as [`place_all`] gives
/// them) of `specs`: the boxes it does not hold as a replica.
pub fn bytes_written(specs: &[TensorSpec], placed: &[Vec<Placed>]) -> Vec<u64> {
    placed
        .iter()
        .map(|ps| {
            ps.iter()
                .filter(|p| p.replica_of.is_none())
                .map(|p| p.bbox.numel() * specs[p.spec].dtype.size() as u64)
                .sum()
        })
        .collect()
}

/// Placements of every rank; also checks that the specs can be placed at all.
pub fn place_all(layout: &Layout, specs: &[TensorSpec]) -> Result<Vec<Vec<Placed>>> {
    (0..layout.world())
        .map(|r| place_rank(layout, r, specs))
        .collect()
}

/// One box a restoring rank reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wanted {
    /// The tensor.
    pub name: String,
    /// The region of it.
    pub bbox: NdBox,
    /// The tensor was saved without a placement, so it is read whole.
    pub unplaced: bool,
}

/// What `rank` of `layout` reads to restore a step whose commit record lists `tensors`: its
/// boxes by the placement rules ([`place_rank`]) applied to the placements the writer
/// recorded, then every tensor saved without a placement (imported, or saved by a writer that
/// did not record one) whole, as replicated. `ckpt plan`, the recovery driver's plan and
/// resharding restores all ask this one function.
pub fn restore_boxes(
    tensors: &[crate::model::TensorEntry],
    layout: &Layout,
    rank: u32,
) -> Result<Vec<Wanted>> {
    let specs: Vec<TensorSpec> = tensors.iter().filter_map(|t| t.spec()).collect();
    let mut out: Vec<Wanted> = place_rank(layout, rank, &specs)?
        .into_iter()
        .map(|p| Wanted {
            name: specs[p.spec].name.clone(),
            bbox: p.bbox,
            unplaced: false,
        })
        .collect();
    out.extend(
        tensors
            .iter()
            .filter(|t| t.placement.is_none())
            .map(|t| Wanted {
                name: t.name.clone(),
                bbox: NdBox::full(&t.shape),
                unplaced: true,
            }),
    );
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{DType, ShardLoc, check_coverage};

    fn spec(
        name: &str,
        shape: &[u64],
        tp_dim: Option<usize>,
        stage: Stage,
        zero: Option<(&str, u8)>,
        order: u32,
    ) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            dtype: DType::F32,
            shape: shape.to_vec(),
            placement: Placement {
                order,
                tp_dim,
                stage,
                zero: zero.map(|(g, s)| ZeroGroup {
                    group: g.into(),
                    from_stage: s,
                }),
            },
        }
    }

    fn model() -> Vec<TensorSpec> {
        let mut v = vec![spec("emb", &[12, 6], Some(0), Stage::First, None, 0)];
        for l in 0..3u32 {
            v.push(spec(
                &format!("l{l}.qkv"),
                &[6, 6],
                Some(0),
                Stage::Layer { index: l, of: 3 },
                None,
                1 + 4 * l,
            ));
            v.push(spec(
                &format!("l{l}.proj"),
                &[6, 6],
                Some(1),
                Stage::Layer { index: l, of: 3 },
                None,
                2 + 4 * l,
            ));
            v.push(spec(
                &format!("l{l}.norm"),
                &[6],
                None,
                Stage::Layer { index: l, of: 3 },
                None,
                3 + 4 * l,
            ));
            v.push(spec(
                &format!("l{l}.m"),
                &[6, 6],
                Some(0),
                Stage::Layer { index: l, of: 3 },
                Some(("exp_avg", 1)),
                4 + 4 * l,
            ));
        }
        v.push(spec(
            "final.norm",
            &[6],
            None,
            Stage::Last,
            Some(("exp_avg", 1)),
            20,
        ));
        v
    }

    /// Every layout must cover every tensor exactly once with written boxes, and every
    /// replica must point at a writer holding the same box.
    fn check_layout(layout: &str) {
        let l: Layout = layout.parse().unwrap();
        let specs = model();
        let all = place_all(&l, &specs).unwrap();
        for (i, s) in specs.iter().enumerate() {
            let shards: Vec<ShardLoc> = all
                .iter()
                .enumerate()
                .flat_map(|(r, ps)| {
                    ps.iter()
                        .filter(|p| p.spec == i && p.replica_of.is_none())
                        .map(move |p| ShardLoc {
                            rank: r as u32,
                            bbox: p.bbox.clone(),
                        })
                })
                .collect();
            check_coverage(&s.name, &s.shape, &shards).unwrap_or_else(|e| panic!("{layout}: {e}"));
            for ps in &all {
                for p in ps.iter().filter(|p| p.spec == i) {
                    if let Some(w) = p.replica_of {
                        assert!(
                            all[w as usize]
                                .iter()
                                .any(|q| q.spec == i && q.bbox == p.bbox && q.replica_of.is_none()),
                            "{layout}: {} replica without writer",
                            s.name
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn layouts_cover_every_tensor_exactly_once() {
        for l in [
            "dp=1",
            "dp=4",
            "dp=3",
            "tp=2",
            "tp=3",
            "pp=2",
            "pp=3",
            "dp=2,tp=2",
            "dp=2,tp=2,pp=2",
            "dp=3,zero=1",
            "dp=4,tp=2,zero=1",
            "dp=5,pp=2,zero=3",
            "dp=7,tp=3,pp=3,zero=2",
        ] {
            check_layout(l);
        }
    }

    #[test]
    fn placement_table() {
        let specs = model();
        let l: Layout = "dp=2,tp=2,pp=1".parse().unwrap();
        // Rank 1 = dp 0, tp 1: second half of emb rows, columns 3..6 of l0.proj.
        let p = place_rank(&l, 1, &specs).unwrap();
        let get = |name: &str| p.iter().find(|x| specs[x.spec].name == name).unwrap();
        assert_eq!(get("emb").bbox, NdBox::new(vec![6, 0], vec![6, 6]).unwrap());
        assert_eq!(
            get("l0.proj").bbox,
            NdBox::new(vec![0, 3], vec![6, 3]).unwrap()
        );
        assert_eq!(get("l0.norm").bbox, NdBox::full(&[6]));
        // Pipeline: 3 layers over 2 stages -> layers 0,1 on stage 0, layer 2 on stage 1.
        assert_eq!(stage_of(&Stage::Layer { index: 1, of: 3 }, 2), 0);
        assert_eq!(stage_of(&Stage::Layer { index: 2, of: 3 }, 2), 1);
        assert_eq!(stage_of(&Stage::Layer { index: 0, of: 2 }, 4), 0);
        assert_eq!(stage_of(&Stage::Layer { index: 1, of: 2 }, 4), 1);
        assert_eq!(stage_of(&Stage::Last, 4), 3);
        // A tp that does not divide is refused with the tensor named.
        let e = place_rank(&"tp=5".parse().unwrap(), 0, &specs)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("\"emb\"") && e.contains("does not divide by tp=5"),
            "{e}"
        );
    }

    /// The bytes each rank writes, under `layout`.
    fn written(l: &Layout, specs: &[TensorSpec]) -> Vec<u64> {
        bytes_written(specs, &place_all(l, specs).unwrap())
    }

    /// Replicated tensors of many sizes: no rank writes more than another by more than the
    /// largest tensor (greedy's bound), whatever the order they were registered in, and the
    /// writers do not depend on that order.
    #[test]
    fn replica_writers_balance_the_bytes() {
        let mut rng = crate::testing::Rng(7);
        let specs: Vec<TensorSpec> = (0..60)
            .map(|i| {
                let rows = 1 + rng.below(400);
                let mut s = TensorSpec::first_stage(format!("t{i}"), DType::F32, &[rows, 8]);
                s.placement.tp_dim = (i % 3 == 0).then_some(1);
                s
            })
            .collect();
        for l in ["dp=2", "dp=3", "dp=8", "dp=2,tp=2", "dp=3,tp=2"] {
            let l: Layout = l.parse().unwrap();
            let bytes = written(&l, &specs);
            let largest = specs
                .iter()
                .map(|s| s.shape.iter().product::<u64>() * 4)
                .max()
                .unwrap();
            let (lo, hi) = (*bytes.iter().min().unwrap(), *bytes.iter().max().unwrap());
            assert!(hi - lo <= largest, "{l}: {bytes:?}, largest {largest}");
            let before = place_all(&l, &specs).unwrap();
            let mut shuffled = specs.clone();
            shuffled.reverse();
            let after = place_all(&l, &shuffled).unwrap();
            for (r, (a, b)) in before.iter().zip(&after).enumerate() {
                let writes = |ps: &[Placed], sp: &[TensorSpec]| {
                    let mut v: Vec<(String, Option<u32>)> = ps
                        .iter()
                        .map(|p| (sp[p.spec].name.clone(), p.replica_of))
                        .collect();
                    v.sort();
                    v
                };
                assert_eq!(writes(a, &specs), writes(b, &shuffled), "{l}: rank {r}");
            }
        }
        // Every rank writes about a dp-th of the bytes (the tensors are many and small).
        let bytes = written(&"dp=4".parse().unwrap(), &specs);
        let total: u64 = bytes.iter().sum();
        for b in &bytes {
            assert!(*b * 4 <= total * 11 / 10, "{bytes:?}");
        }
    }

    #[test]
    fn zero_uneven_partitions() {
        // Group exp_avg on stage 0 with tp=1: l0.m, l1.m, l2.m (36 each) + final.norm (6) = 114
        // elements over dp=4: ranges of 29, the last 27.
        let specs = model();
        let l: Layout = "dp=4,zero=1".parse().unwrap();
        let sizes: Vec<u64> = (0..4)
            .map(|r| {
                place_rank(&l, r, &specs)
                    .unwrap()
                    .iter()
                    .filter(|p| specs[p.spec].placement.zero.is_some())
                    .map(|p| p.bbox.numel())
                    .sum()
            })
            .collect();
        assert_eq!(sizes, vec![29, 29, 29, 27]);
        // dp larger than the group: trailing ranks hold nothing of it.
        let l: Layout = "dp=200,zero=1".parse().unwrap();
        let r199 = place_rank(&l, 199, &specs).unwrap();
        assert!(r199.iter().all(|p| specs[p.spec].placement.zero.is_none()));
    }

    #[test]
    fn flat_ranges_decompose_in_order() {
        let shape = [3u64, 4, 5];
        let n = 60;
        for lo in 0..n {
            for hi in lo..=n {
                let boxes = flat_range_boxes(&shape, lo, hi);
                assert!(boxes.len() <= 5);
                let mut flat = Vec::new();
                for b in &boxes {
                    for i in 0..b.lengths[0] {
                        for j in 0..b.lengths[1] {
                            for k in 0..b.lengths[2] {
                                flat.push(
                                    (b.offsets[0] + i) * 20
                                        + (b.offsets[1] + j) * 5
                                        + b.offsets[2]
                                        + k,
                                );
                            }
                        }
                    }
                }
                assert_eq!(flat, (lo..hi).collect::<Vec<_>>(), "{lo}..{hi}");
            }
        }
        assert_eq!(flat_range_boxes(&[], 0, 1), vec![NdBox::full(&[])]);
    }
}
