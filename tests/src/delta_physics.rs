//! `ckpt-bench delta-physics`: what the bits of training state do between checkpoints, and
//! what the codecs make of it, without the save pipeline (issue 16 §1).
//!
//! For two states of the same run `k` steps apart, per kind of state (bf16 weights, fp32
//! master, Adam m, Adam v): the fraction of elements and of bits that changed, the fraction of
//! each byte plane's bytes that changed (the byte holding the exponent first), and the sizes
//! the codecs give over 4 MiB chunks of each tensor (as the store cuts them): the plain
//! encoding (zstd-1 over byte planes) and the delta (XOR against the older state, byte planes,
//! zstd-1), both over raw, and how often the writer's sampled estimate picks the smaller.
//!
//! The states come from the reference workload (`--params`, `--lr`) or from a directory of
//! safetensors files `step-NNNNNN.safetensors` (`--trajectory DIR`, written by
//! `python/examples/delta_trajectory.py`: a real model trained with AdamW).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use ckpt_store::StoreConfig;
use ckpt_store::codec::{self, CodecPolicy};
use ckpt_store::id::ChunkId;
use ckpt_store::model::{DType, NdBox, TensorSpec};
use ckpt_trainer::workload::{ModelConfig, RankState, TrainConfig};
use serde_json::json;

use super::emit;

/// One tensor of a state: name, kind, element size, bytes.
pub struct Tensor {
    pub name: String,
    pub kind: &'static str,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub data: Vec<u8>,
}

/// The kind of state a tensor holds, by the reference workload's names (which the trajectory
/// script uses too).
pub fn kind(name: &str) -> &'static str {
    if name.ends_with(".exp_avg_sq") {
        "adam_v_fp32"
    } else if name.ends_with(".exp_avg") {
        "adam_m_fp32"
    } else if name.ends_with(".master") {
        "master_fp32"
    } else {
        "weights_bf16"
    }
}

/// The state of every rank of the reference workload, as tensors (per rank, per parameter).
pub fn ref_state(ranks: &[RankState]) -> Vec<Tensor> {
    let mut out = Vec::new();
    for r in ranks {
        let specs = r.model.specs();
        for p in &r.params {
            for k in 0..4 {
                let s = &specs[p.param * 4 + k];
                out.push(Tensor {
                    name: format!("rank{}/{}", r.rank, s.name),
                    kind: kind(&s.name),
                    dtype: s.dtype,
                    shape: p.held.lengths.clone(),
                    data: p.tensors[k].read().clone(),
                });
            }
        }
    }
    out
}

/// The steps of the safetensors files in `dir` (`step-NNNNNN.safetensors`), in order.
pub fn trajectory_steps(dir: &Path) -> Vec<(u64, PathBuf)> {
    let mut v: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("trajectory {}: {e}", dir.display()))
        .filter_map(|e| {
            let p = e.ok()?.path();
            let n = p.file_name()?.to_str()?;
            let s = n.strip_prefix("step-")?.strip_suffix(".safetensors")?;
            Some((s.parse().ok()?, p))
        })
        .collect();
    v.sort();
    v
}

/// Read a safetensors file (8-byte little-endian header length, JSON header, data).
pub fn read_safetensors(path: &Path) -> Vec<Tensor> {
    let buf = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let n = u64::from_le_bytes(buf[..8].try_into().unwrap()) as usize;
    let head: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&buf[8..8 + n])
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let body = &buf[8 + n..];
    let mut out = Vec::new();
    for (name, v) in head {
        if name == "__metadata__" {
            continue;
        }
        let dtype = match v["dtype"].as_str().unwrap() {
            "BF16" => DType::Bf16,
            "F32" => DType::F32,
            "F16" => DType::F16,
            other => panic!(
                "{}: tensor {name}: dtype {other} not handled",
                path.display()
            ),
        };
        let shape: Vec<u64> = v["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        let off = v["data_offsets"].as_array().unwrap();
        let (a, b) = (
            off[0].as_u64().unwrap() as usize,
            off[1].as_u64().unwrap() as usize,
        );
        out.push(Tensor {
            kind: kind(&name),
            name,
            dtype,
            shape,
            data: body[a..b].to_vec(),
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// A spec for a tensor held whole by one rank.
pub fn whole_spec(t: &Tensor, order: u32) -> (TensorSpec, NdBox) {
    let shape = if t.shape.is_empty() {
        vec![1]
    } else {
        t.shape.clone()
    };
    (
        TensorSpec::first_stage(t.name.clone(), t.dtype, &shape).with_order(order),
        NdBox::full(&shape),
    )
}

#[derive(Default)]
struct Acc {
    elems: u64,
    elems_changed: u64,
    bits: u64,
    bits_changed: u64,
    /// Per byte plane (0 = the lowest byte of the element).
    plane_bytes_changed: [u64; 8],
    raw: u64,
    plain: u64,
    delta: u64,
    /// min(plain, delta) chunk by chunk, and what the sampled estimate picked.
    best: u64,
    estimated_pick: u64,
    chunks: u64,
    estimate_right: u64,
}

/// Compare state `b` with the older state `a` (the same tensors), per kind, over the chunks
/// the store cuts each tensor into under `chunks` ([`StoreConfig::chunk_spans`]).
fn compare(a: &[Tensor], b: &[Tensor], chunks: &StoreConfig) -> BTreeMap<&'static str, Acc> {
    let policy = CodecPolicy::FAST;
    let level = match policy {
        CodecPolicy::Compress { level, .. } => level,
        CodecPolicy::Raw => 1,
    };
    let mut work: Vec<(&'static str, usize, &[u8], &[u8])> = Vec::new();
    for (ta, tb) in a.iter().zip(b) {
        assert_eq!(ta.name, tb.name, "the two states hold different tensors");
        let e = ta.dtype.size();
        assert_eq!(ta.data.len(), tb.data.len(), "{}: sizes differ", ta.name);
        for r in chunks.chunk_spans(ta.data.len() as u64) {
            let r = r.start as usize..r.end as usize;
            work.push((tb.kind, e, &ta.data[r.clone()], &tb.data[r]));
        }
    }
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let per = work.len().div_ceil(threads).max(1);
    let parts: Vec<BTreeMap<&'static str, Acc>> = std::thread::scope(|s| {
        let hs: Vec<_> = work
            .chunks(per)
            .map(|w| {
                s.spawn(move || {
                    let mut m: BTreeMap<&'static str, Acc> = BTreeMap::new();
                    for &(k, e, x, y) in w {
                        let acc = m.entry(k).or_default();
                        for (ex, ey) in x.chunks_exact(e).zip(y.chunks_exact(e)) {
                            acc.elems += 1;
                            let mut any = false;
                            for p in 0..e {
                                let d = ex[p] ^ ey[p];
                                if d != 0 {
                                    any = true;
                                    acc.plane_bytes_changed[p] += 1;
                                    acc.bits_changed += d.count_ones() as u64;
                                }
                            }
                            acc.elems_changed += any as u64;
                            acc.bits += 8 * e as u64;
                        }
                        acc.raw += y.len() as u64;
                        let yb = Bytes::copy_from_slice(y);
                        let plain = codec::encode(&yb, e, policy).len() as u64;
                        let base = ChunkId::of(x);
                        let delta = codec::encode_delta(y, x, &base, e, level).len() as u64;
                        acc.plain += plain;
                        acc.delta += delta;
                        acc.best += plain.min(delta);
                        let est = codec::estimate_delta(y, x, e, level);
                        let pick_delta = est.pays();
                        acc.estimated_pick += if pick_delta { delta } else { plain };
                        acc.chunks += 1;
                        let right = (delta * 10 <= plain * 9) == pick_delta;
                        acc.estimate_right += right as u64;
                    }
                    m
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut out: BTreeMap<&'static str, Acc> = BTreeMap::new();
    for m in parts {
        for (k, a) in m {
            let o = out.entry(k).or_default();
            o.elems += a.elems;
            o.elems_changed += a.elems_changed;
            o.bits += a.bits;
            o.bits_changed += a.bits_changed;
            for p in 0..8 {
                o.plane_bytes_changed[p] += a.plane_bytes_changed[p];
            }
            o.raw += a.raw;
            o.plain += a.plain;
            o.delta += a.delta;
            o.best += a.best;
            o.estimated_pick += a.estimated_pick;
            o.chunks += a.chunks;
            o.estimate_right += a.estimate_right;
        }
    }
    out
}

fn report(
    source: &str,
    from: u64,
    to: u64,
    by: BTreeMap<&'static str, Acc>,
    elem: &dyn Fn(&str) -> usize,
) {
    let (mut raw, mut plain, mut delta, mut best, mut picked) = (0, 0, 0, 0, 0);
    for (k, a) in &by {
        let e = elem(k);
        let planes: Vec<f64> = (0..e)
            .rev()
            .map(|p| a.plane_bytes_changed[p] as f64 / a.elems.max(1) as f64)
            .collect();
        raw += a.raw;
        plain += a.plain;
        delta += a.delta;
        best += a.best;
        picked += a.estimated_pick;
        emit(json!({
            "bench": "delta_physics", "source": source, "from_step": from, "to_step": to,
            "interval": to - from, "kind": k,
            "elems_changed": a.elems_changed as f64 / a.elems.max(1) as f64,
            "bits_changed": a.bits_changed as f64 / a.bits.max(1) as f64,
            "bytes_changed_by_plane_high_first": planes,
            "plain_ratio": a.plain as f64 / a.raw.max(1) as f64,
            "delta_ratio": a.delta as f64 / a.raw.max(1) as f64,
            "best_ratio": a.best as f64 / a.raw.max(1) as f64,
            "estimate_pick_ratio": a.estimated_pick as f64 / a.raw.max(1) as f64,
            "estimate_right": a.estimate_right as f64 / a.chunks.max(1) as f64,
            "raw_bytes": a.raw,
        }));
    }
    emit(json!({
        "bench": "delta_physics", "source": source, "from_step": from, "to_step": to,
        "interval": to - from, "kind": "all",
        "plain_ratio": plain as f64 / raw.max(1) as f64,
        "delta_ratio": delta as f64 / raw.max(1) as f64,
        "best_ratio": best as f64 / raw.max(1) as f64,
        "estimate_pick_ratio": picked as f64 / raw.max(1) as f64,
        "raw_bytes": raw,
    }));
}

fn elem_of(kind: &str) -> usize {
    if kind == "weights_bf16" { 2 } else { 4 }
}

/// The reference workload: warm up `warm` steps, then compare the state at `warm` with the
/// states `intervals` steps later.
pub fn physics_reference(params: u64, lr: f32, warm: u64, intervals: &[u64]) {
    let layout: ckpt_store::Layout = "dp=1,tp=2,pp=2".parse().unwrap();
    let model = ModelConfig::for_params(params, layout.world());
    let train = TrainConfig {
        seed: 5,
        lr,
        frozen: 0.0,
    };
    let ranks: Vec<RankState> = (0..layout.world())
        .map(|r| RankState::new(model, train, layout, r).unwrap())
        .collect();
    let mut step = 0;
    let advance = |to: u64, step: &mut u64| {
        for s in *step + 1..=to {
            std::thread::scope(|sc| {
                for r in &ranks {
                    sc.spawn(move || r.update(s, s, 1.0));
                }
            });
        }
        *step = to;
    };
    advance(warm, &mut step);
    let base = ref_state(&ranks);
    let source = format!("reference lr={lr}");
    let mut ivs = intervals.to_vec();
    ivs.sort();
    for k in ivs {
        advance(warm + k, &mut step);
        let now = ref_state(&ranks);
        report(
            &source,
            warm,
            warm + k,
            compare(&base, &now, &StoreConfig::default()),
            &elem_of,
        );
    }
}

/// A trajectory directory: compare the first file with each later one.
pub fn physics_trajectory(dir: &Path) {
    let steps = trajectory_steps(dir);
    assert!(
        steps.len() >= 2,
        "{}: fewer than two step files",
        dir.display()
    );
    let base = read_safetensors(&steps[0].1);
    for (s, p) in &steps[1..] {
        let now = read_safetensors(p);
        report(
            "trajectory",
            steps[0].0,
            *s,
            compare(&base, &now, &StoreConfig::default()),
            &elem_of,
        );
    }
}
