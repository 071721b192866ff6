//! `ckpt-bench writers` (no store, no disk): the bytes each rank writes of the reference
//! model's state under a few layouts, with the writers of replicated tensors as the placement
//! picks them ([`ckpt_store::placement::place_all`]: largest first, each to the holder that
//! writes the fewest bytes so far) and as it picked them before (FNV-1a of the name modulo the
//! holders: [`by_name_hash`]). On a cluster each rank writes over its own
//! node's link, so the busiest rank's bytes over the mean is what a checkpoint's time to
//! durable pays.

use ckpt_store::placement::{
    TensorSpec, bytes_written, place_all, spread, stage_of, tp_box, zero_group,
};
use ckpt_store::{Layout, Result};
use ckpt_trainer::workload::ModelConfig;
use serde_json::{Value, json};

/// The bytes each rank wrote under the rule before: each replicated box to the holder
/// FNV-1a of its tensor's name picks; partitioned (ZeRO) boxes as `place_all` places them.
pub fn by_name_hash(layout: &Layout, specs: &[TensorSpec]) -> Result<Vec<u64>> {
    let placed = place_all(layout, specs)?;
    let mut out = vec![0u64; layout.world() as usize];
    for (rank, ps) in placed.iter().enumerate() {
        let c = layout.coords(rank as u32);
        for p in ps {
            let s = &specs[p.spec];
            let zero = zero_group(s, layout).is_some();
            let bytes = p.bbox.numel() * s.dtype.size() as u64;
            if zero {
                out[rank] += if p.replica_of.is_none() { bytes } else { 0 };
                continue;
            }
            debug_assert_eq!(stage_of(&s.placement.stage, layout.pp), c.pp);
            debug_assert_eq!(tp_box(s, c.tp, layout.tp)?, p.bbox);
            let tp_set: Vec<u32> = match s.placement.tp_dim {
                Some(_) => vec![c.tp],
                None => (0..layout.tp).collect(),
            };
            let w = spread(&s.name, layout.dp * tp_set.len() as u32);
            let writer = layout.rank(ckpt_store::model::Coords {
                dp: w / tp_set.len() as u32,
                tp: tp_set[(w % tp_set.len() as u32) as usize],
                pp: c.pp,
            });
            if writer == rank as u32 {
                out[rank] += bytes;
            }
        }
    }
    Ok(out)
}

/// One JSON line a layout: the busiest rank's bytes over the mean, before and now.
pub fn writers_bench(params: u64, layouts: &str) -> Vec<Value> {
    let mut rows = Vec::new();
    for l in layouts.split(';') {
        let layout: Layout = l.parse().unwrap_or_else(|e| panic!("layout {l:?}: {e}"));
        let model = ModelConfig::for_params(params, layout.world());
        let specs = model.specs();
        let now = bytes_written(&specs, &place_all(&layout, &specs).unwrap());
        let before = by_name_hash(&layout, &specs).unwrap();
        let total: u64 = now.iter().sum();
        assert_eq!(
            total,
            before.iter().sum::<u64>(),
            "{layout}: the same bytes in all"
        );
        let mean = total as f64 / layout.world() as f64;
        let over = |v: &[u64]| *v.iter().max().unwrap() as f64 / mean;
        rows.push(
            json!({"bench": "writers", "params": params, "layout": layout.to_string(),
            "tensors": specs.len(), "state_bytes": total,
            "by_name_hash_max_over_mean": over(&before), "balanced_max_over_mean": over(&now),
            "by_name_hash_bytes": before, "balanced_bytes": now}),
        );
    }
    rows
}
