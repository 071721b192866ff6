//! The reference workload: a deterministic sharded training job whose state looks like a
//! transformer's (embeddings, per-layer attention and MLP matrices, norms, output layer; bf16
//! weights, fp32 master weights, fp32 Adam moments), laid out per rank by dp/tp/pp/ZeRO.
//!
//! The objective is real and element-wise, so every layout computes the same numbers: at each
//! step every parameter element gets a noisy target drawn from (seed, data position, tensor,
//! global index); the loss is the mean squared error to the fp32 master weight; Adam updates
//! every element; the bf16 weight is the rounded master. The state after step `s` is
//! bit-identical whatever the layout, and the loss is summed in fixed point (exactly,
//! independent of the order), so it is identical too.
//!
//! Each rank keeps in memory the full tensor-parallel, pipeline-stage shard of every state
//! tensor (data-parallel ranks update identical replicas, as after an all-reduce); what it
//! *saves* is what placement assigns to it: one writer per replicated box, and ZeRO partitions
//! of the optimizer state (stage 1-2) and of the weights too (stage 3). A restore fills the
//! whole in-memory shard, from whatever layout saved it.

use std::sync::Arc;

use ckpt_store::placement::{
    Placement, Stage, TensorSpec, ZeroGroup, place_rank, stage_of, tp_box,
};
use ckpt_store::{DType, Error, Layout, NdBox, Result, StepReader};
use serde::{Deserialize, Serialize};

use crate::manager::Stateful;
use crate::memory::HostTensor;

/// Fixed-point scale of per-element squared errors (exact, order-independent sums).
pub const LOSS_SCALE: f64 = (1u64 << 40) as f64;

/// Shape of the reference model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Vocabulary size (8 x d_model).
    pub vocab: u64,
    /// Model width (a multiple of 64, so tp of 1, 2, 4, 8, ... divides every split dimension).
    pub d_model: u64,
    /// MLP width (4 x d_model).
    pub ffn: u64,
    /// Transformer layers.
    pub layers: u32,
}

/// One parameter: name, shape, tensor-parallel dimension, stage, layer.
#[derive(Debug, Clone)]
pub struct Param {
    /// Name (`layers.3.attn.qkv.weight`).
    pub name: String,
    /// Shape.
    pub shape: Vec<u64>,
    /// Split dimension for tensor parallelism.
    pub tp_dim: Option<usize>,
    /// Pipeline stage.
    pub stage: Stage,
    /// Transformer layer, for freezing.
    pub layer: Option<u32>,
}

/// The four state tensors of every parameter.
pub const KINDS: [(&str, DType, &str, u8); 4] = [
    ("", DType::Bf16, "param", 3),
    (".master", DType::F32, "master", 1),
    (".exp_avg", DType::F32, "exp_avg", 1),
    (".exp_avg_sq", DType::F32, "exp_avg_sq", 1),
];

impl ModelConfig {
    /// The model with about `params` parameters over `layers` layers.
    pub fn for_params(params: u64, layers: u32) -> Self {
        let layers = layers.max(1);
        // params ~ 2 * vocab * d + layers * 12 * d^2 with vocab = 8 d.
        let per_d2 = 16.0 + 12.0 * layers as f64;
        let d = ((params as f64 / per_d2).sqrt() / 64.0).round().max(1.0) as u64 * 64;
        ModelConfig {
            vocab: 8 * d,
            d_model: d,
            ffn: 4 * d,
            layers,
        }
    }

    /// The parameters, in registration order.
    pub fn params(&self) -> Vec<Param> {
        let (d, f, v, l) = (self.d_model, self.ffn, self.vocab, self.layers);
        let mut p = vec![Param {
            name: "embed.weight".into(),
            shape: vec![v, d],
            tp_dim: Some(0),
            stage: Stage::First,
            layer: None,
        }];
        for i in 0..l {
            let st = Stage::Layer { index: i, of: l };
            let mk = |n: &str, shape: Vec<u64>, tp: Option<usize>| Param {
                name: format!("layers.{i}.{n}"),
                shape,
                tp_dim: tp,
                stage: st.clone(),
                layer: Some(i),
            };
            p.push(mk("ln1.weight", vec![d], None));
            p.push(mk("attn.qkv.weight", vec![3 * d, d], Some(0)));
            p.push(mk("attn.proj.weight", vec![d, d], Some(1)));
            p.push(mk("ln2.weight", vec![d], None));
            p.push(mk("mlp.up.weight", vec![f, d], Some(0)));
            p.push(mk("mlp.down.weight", vec![d, f], Some(1)));
        }
        p.push(Param {
            name: "final_norm.weight".into(),
            shape: vec![d],
            tp_dim: None,
            stage: Stage::Last,
            layer: None,
        });
        p.push(Param {
            name: "lm_head.weight".into(),
            shape: vec![v, d],
            tp_dim: Some(0),
            stage: Stage::Last,
            layer: None,
        });
        p
    }

    /// Number of parameters.
    pub fn param_count(&self) -> u64 {
        self.params()
            .iter()
            .map(|p| p.shape.iter().product::<u64>())
            .sum()
    }

    /// Bytes of the whole state (bf16 weights + three fp32 tensors per parameter).
    pub fn state_bytes(&self) -> u64 {
        self.param_count() * 14
    }

    /// Every state tensor's spec; index `4 * p + k` is kind `k` of parameter `p`.
    pub fn specs(&self) -> Vec<TensorSpec> {
        let mut out = Vec::new();
        for (pi, p) in self.params().iter().enumerate() {
            for (k, (suffix, dtype, group, from)) in KINDS.iter().enumerate() {
                out.push(TensorSpec {
                    name: format!("{}{suffix}", p.name),
                    dtype: *dtype,
                    shape: p.shape.clone(),
                    placement: Placement {
                        order: (pi * 4 + k) as u32,
                        tp_dim: p.tp_dim,
                        stage: p.stage.clone(),
                        zero: Some(ZeroGroup {
                            group: (*group).into(),
                            from_stage: *from,
                        }),
                    },
                });
            }
        }
        out
    }
}

/// Hyperparameters and the seed.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TrainConfig {
    /// Seed of every random draw.
    pub seed: u64,
    /// Adam learning rate.
    pub lr: f32,
    /// Fraction of the layers frozen (not updated), as in fine-tuning.
    pub frozen: f64,
}

/// Global training progress, saved as a blob by rank 0 and restored by every rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Progress {
    /// Optimizer steps done.
    pub step: u64,
    /// The next data batch to read (equals `step` unless batches were skipped).
    pub data_pos: u64,
    /// The seed the run started with.
    pub seed: u64,
}

impl Stateful for Progress {
    fn state_dict(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("progress serializes")
    }
    fn load_state_dict(&mut self, bytes: &[u8]) -> Result<()> {
        *self = serde_json::from_slice(bytes)
            .map_err(|e| Error::corrupt(format!("training progress blob: {e}")))?;
        Ok(())
    }
}

#[inline]
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
    z ^ (z >> 31)
}

#[inline]
fn unit(h: u64) -> f32 {
    ((h >> 40) as f32) * (1.0 / (1u64 << 24) as f32) - 0.5
}

/// A stable id for a parameter name (FNV-1a).
pub fn tensor_key(name: &str) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for b in name.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

/// Round an f32 to bf16 bits (round to nearest even; NaN stays NaN).
#[inline]
pub fn to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    let round = 0x7fff + ((b >> 16) & 1);
    (b.wrapping_add(round) >> 16) as u16
}

/// The initial master weight of element `g` of tensor `key`.
#[inline]
pub fn init_weight(seed: u64, key: u64, g: u64) -> f32 {
    unit(mix(seed.wrapping_mul(0x9E3779B97F4A7C15)
        ^ key
        ^ g.wrapping_mul(0xD6E8FEB86659FD93)))
        * 0.04
}

/// The target of element `g` of tensor `key` for data batch `batch` (times `scale`).
#[inline]
pub fn target(seed: u64, key: u64, g: u64, batch: u64) -> f32 {
    let h1 = mix(seed ^ key.rotate_left(17) ^ g.wrapping_mul(0x9E3779B97F4A7C15));
    let h2 = mix(h1 ^ batch.wrapping_mul(0xC2B2AE3D27D4EB4F).wrapping_add(1));
    unit(h1) * 0.1 + unit(h2) * 0.02
}

/// Calls `f(global_index_of_row_start, local_element_offset, row_len)` for every row of `bbox`
/// of a tensor of `shape` (rows along the last dimension).
pub fn for_rows(shape: &[u64], bbox: &NdBox, mut f: impl FnMut(u64, usize, usize)) {
    let n = shape.len();
    if bbox.is_empty() {
        return;
    }
    if n == 0 {
        f(0, 0, 1);
        return;
    }
    let mut strides = vec![1u64; n];
    for d in (0..n - 1).rev() {
        strides[d] = strides[d + 1] * shape[d + 1];
    }
    let row = bbox.lengths[n - 1] as usize;
    let rows: u64 = bbox.lengths[..n - 1].iter().product();
    let mut idx = vec![0u64; n - 1];
    for r in 0..rows {
        let g: u64 = (0..n - 1)
            .map(|d| (bbox.offsets[d] + idx[d]) * strides[d])
            .sum::<u64>()
            + bbox.offsets[n - 1];
        f(g, r as usize * row, row);
        for d in (0..n - 1).rev() {
            idx[d] += 1;
            if idx[d] < bbox.lengths[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// One parameter's tensors on a rank.
#[derive(Debug, Clone)]
pub struct ParamState {
    /// Parameter index.
    pub param: usize,
    /// Name.
    pub name: String,
    /// Global shape.
    pub shape: Vec<u64>,
    /// The box held (the tensor-parallel shard).
    pub held: NdBox,
    /// bf16 weight, fp32 master, exp_avg, exp_avg_sq.
    pub tensors: [HostTensor; 4],
    /// Boxes of the master weight this rank writes: its elements count toward the loss.
    pub owned: Vec<NdBox>,
    /// Frozen (not updated).
    pub frozen: bool,
    key: u64,
}

/// Loss and gradient-norm partial sums of one step on one rank (fixed point, exact).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Partial {
    /// Sum of squared errors x [`LOSS_SCALE`].
    pub sse: u128,
    /// Sum of squared gradients x [`LOSS_SCALE`].
    pub gsq: u128,
    /// Elements counted.
    pub n: u64,
    /// Any NaN or infinity seen.
    pub nonfinite: bool,
}

impl Partial {
    /// Add another rank's sums.
    pub fn add(&mut self, o: &Partial) {
        self.sse += o.sse;
        self.gsq += o.gsq;
        self.n += o.n;
        self.nonfinite |= o.nonfinite;
    }
    /// Mean squared error.
    pub fn loss(&self) -> f64 {
        if self.nonfinite {
            return f64::NAN;
        }
        self.sse as f64 / LOSS_SCALE / self.n.max(1) as f64
    }
    /// Gradient norm.
    pub fn grad_norm(&self) -> f64 {
        if self.nonfinite {
            return f64::NAN;
        }
        (self.gsq as f64 / LOSS_SCALE).sqrt()
    }
}

fn fixed(x: f64) -> (u128, bool) {
    if !x.is_finite() {
        return (0, true);
    }
    ((x * LOSS_SCALE).round() as u128, false)
}

/// Everything one rank holds.
#[derive(Debug)]
pub struct RankState {
    /// The model.
    pub model: ModelConfig,
    /// Hyperparameters.
    pub train: TrainConfig,
    /// Layout.
    pub layout: Layout,
    /// Rank.
    pub rank: u32,
    /// Parameters held.
    pub params: Vec<ParamState>,
}

impl RankState {
    /// Build and initialize rank `rank`'s state for `layout`.
    pub fn new(model: ModelConfig, train: TrainConfig, layout: Layout, rank: u32) -> Result<Self> {
        let state = Self::zeroed(model, train, layout, rank)?;
        state.init();
        Ok(state)
    }

    /// Rank `rank`'s state for `layout` with every tensor zeroed, for a rank whose restore
    /// fills every tensor next: the initial weights are not computed to be overwritten.
    /// [`RankState::init`] writes them when there is nothing to restore.
    pub fn zeroed(
        model: ModelConfig,
        train: TrainConfig,
        layout: Layout,
        rank: u32,
    ) -> Result<Self> {
        let c = layout.coords(rank);
        let specs = model.specs();
        let placed = place_rank(&layout, rank, &specs)?;
        let frozen_layers = (train.frozen.clamp(0.0, 1.0) * model.layers as f64).round() as u32;
        let mut params = Vec::new();
        for (pi, p) in model.params().iter().enumerate() {
            if stage_of(&p.stage, layout.pp) != c.pp {
                continue;
            }
            let master_spec = &specs[pi * 4 + 1];
            let held = tp_box(master_spec, c.tp, layout.tp)?;
            let n = held.numel() as usize;
            let owned = placed
                .iter()
                .filter(|x| x.spec == pi * 4 + 1 && x.replica_of.is_none())
                .map(|x| x.bbox.clone())
                .collect();
            params.push(ParamState {
                param: pi,
                name: p.name.clone(),
                shape: p.shape.clone(),
                held,
                tensors: [
                    HostTensor::zeroed(n * 2),
                    HostTensor::zeroed(n * 4),
                    HostTensor::zeroed(n * 4),
                    HostTensor::zeroed(n * 4),
                ],
                owned,
                frozen: p.layer.is_some_and(|l| l < frozen_layers),
                key: tensor_key(&p.name),
            });
        }
        Ok(RankState {
            model,
            train,
            layout,
            rank,
            params,
        })
    }

    /// Write the initial state: the weights of `train.seed` (master fp32 and its bf16 copy),
    /// zero moments.
    pub fn init(&self) {
        for p in &self.params {
            let mut w = p.tensors[0].write();
            let mut m32 = p.tensors[1].write();
            for_rows(&p.shape, &p.held, |g, at, len| {
                for i in 0..len {
                    let x = init_weight(self.train.seed, p.key, g + i as u64);
                    m32[(at + i) * 4..(at + i) * 4 + 4].copy_from_slice(&x.to_le_bytes());
                    w[(at + i) * 2..(at + i) * 2 + 2].copy_from_slice(&to_bf16(x).to_le_bytes());
                }
            });
            for k in 2..4 {
                p.tensors[k].write().fill(0);
            }
        }
    }

    /// Bytes this rank holds.
    pub fn held_bytes(&self) -> u64 {
        self.params.iter().map(|p| p.held.numel() * 14).sum()
    }

    /// Register every state tensor with a checkpoint manager; the tensors of a parameter that
    /// is not frozen are trainable (the sentinel watches them for stale state).
    pub fn register(&self, mgr: &mut crate::CheckpointManager) -> Result<()> {
        let specs = self.model.specs();
        for p in &self.params {
            for k in 0..4 {
                let spec = specs[p.param * 4 + k].clone();
                let name = spec.name.clone();
                mgr.register(spec, p.held.clone(), Arc::new(p.tensors[k].clone()))?;
                mgr.set_trainable(&name, !p.frozen)?;
            }
        }
        Ok(())
    }

    /// Silent data corruption, for tests of the sentinel: flip bit 20 (inside bf16's mantissa)
    /// of the first held element of the first parameter's master weight, and its bf16 copy
    /// with it, so the difference lives on in this rank's replicas through later updates.
    /// What was flipped, or `None` when the rank holds no element.
    pub fn flip_bit(&self) -> Option<String> {
        let p = self.params.iter().find(|p| p.held.numel() > 0)?;
        let mut master = p.tensors[1].write();
        let mut w = p.tensors[0].write();
        let x = f32::from_le_bytes(master[0..4].try_into().expect("4")).to_bits() ^ (1 << 20);
        let x = f32::from_bits(x);
        master[0..4].copy_from_slice(&x.to_le_bytes());
        w[0..2].copy_from_slice(&to_bf16(x).to_le_bytes());
        Some(format!(
            "bit 20 of the first held element of {}.master (and its bf16 copy {})",
            p.name, p.name
        ))
    }

    /// The loss (before the update) of the elements this rank owns, for `batch`.
    pub fn partial_loss(&self, batch: u64, target_scale: f32) -> Partial {
        let mut part = Partial::default();
        for p in &self.params {
            let master = p.tensors[1].read();
            for bx in &p.owned {
                // Offsets of the owned box inside the held box.
                let local = NdBox {
                    offsets: bx
                        .offsets
                        .iter()
                        .zip(&p.held.offsets)
                        .map(|(a, b)| a - b)
                        .collect(),
                    lengths: bx.lengths.clone(),
                };
                let mut at_local = Vec::new();
                for_rows(&p.held.lengths, &local, |li, _, len| {
                    at_local.push((li as usize, len))
                });
                let mut k = 0;
                for_rows(&p.shape, bx, |g, _, len| {
                    let (li, _) = at_local[k];
                    k += 1;
                    for i in 0..len {
                        let off = (li + i) * 4;
                        let w =
                            f32::from_le_bytes(master[off..off + 4].try_into().expect("4 bytes"));
                        let t = target(self.train.seed, p.key, g + i as u64, batch) * target_scale;
                        let e = (w - t) as f64;
                        // Each term in fixed point: the sum is exact in any order.
                        let (v, bad) = fixed(e * e);
                        part.sse += v;
                        part.nonfinite |= bad;
                        part.n += 1;
                    }
                });
            }
        }
        // Gradients are 2 e, so their squares sum to 4 x the squared errors.
        part.gsq = part.sse * 4;
        part
    }

    /// One Adam step on every held element with the targets of `batch`; `step` is the
    /// optimizer step number (from 1).
    pub fn update(&self, step: u64, batch: u64, target_scale: f32) {
        let (b1, b2, eps) = (0.9f32, 0.999f32, 1e-8f32);
        let lr = self.train.lr;
        let c1 = 1.0 - b1.powi(step.min(i32::MAX as u64) as i32);
        let c2 = 1.0 - b2.powi(step.min(i32::MAX as u64) as i32);
        for p in &self.params {
            if p.frozen {
                continue;
            }
            let mut w = p.tensors[0].write();
            let mut master = p.tensors[1].write();
            let mut m = p.tensors[2].write();
            let mut v = p.tensors[3].write();
            for_rows(&p.shape, &p.held, |g, at, len| {
                for i in 0..len {
                    let j = at + i;
                    let o = j * 4;
                    let x = f32::from_le_bytes(master[o..o + 4].try_into().expect("4"));
                    let t = target(self.train.seed, p.key, g + i as u64, batch) * target_scale;
                    let grad = 2.0 * (x - t);
                    let mm = b1 * f32::from_le_bytes(m[o..o + 4].try_into().expect("4"))
                        + (1.0 - b1) * grad;
                    let vv = b2 * f32::from_le_bytes(v[o..o + 4].try_into().expect("4"))
                        + (1.0 - b2) * grad * grad;
                    let nx = x - lr * (mm / c1) / ((vv / c2).sqrt() + eps);
                    m[o..o + 4].copy_from_slice(&mm.to_le_bytes());
                    v[o..o + 4].copy_from_slice(&vv.to_le_bytes());
                    master[o..o + 4].copy_from_slice(&nx.to_le_bytes());
                    w[j * 2..j * 2 + 2].copy_from_slice(&to_bf16(nx).to_le_bytes());
                }
            });
        }
    }
}

/// blake3 over every tensor of a committed step in name order (name, dtype, shape, bytes):
/// two runs with equal digests ended in bit-identical states.
pub async fn step_digest(reader: &StepReader) -> Result<String> {
    let mut h = blake3::Hasher::new();
    for t in &reader.commit().tensors {
        h.update(t.name.as_bytes());
        h.update(&[0]);
        h.update(t.dtype.name().as_bytes());
        for d in &t.shape {
            h.update(&d.to_le_bytes());
        }
        let bytes = reader.read_tensor(&t.name).await?;
        h.update(&bytes);
    }
    Ok(h.finalize().to_hex().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_sizes() {
        let m = ModelConfig::for_params(16_000_000, 4);
        assert_eq!(m.d_model % 64, 0);
        let n = m.param_count() as f64;
        assert!((n / 16e6 - 1.0).abs() < 0.3, "{n}");
        assert_eq!(m.specs().len(), m.params().len() * 4);
    }

    #[test]
    fn bf16_rounding() {
        assert_eq!(to_bf16(1.0), 0x3f80);
        assert_eq!(to_bf16(-2.0), 0xc000);
        // 1 + 2^-8 is halfway between bf16 1.0 and 1.0078125: ties to even (1.0).
        assert_eq!(to_bf16(1.0 + 1.0 / 256.0), 0x3f80);
        assert!(f32::from_bits((to_bf16(f32::NAN) as u32) << 16).is_nan());
    }

    /// Every layout computes the same loss, exactly (the state is compared through the store by
    /// the digest tests).
    #[test]
    fn layouts_compute_identical_state_and_loss() {
        let model = ModelConfig::for_params(40_000, 2);
        let train = TrainConfig {
            seed: 7,
            lr: 1e-2,
            frozen: 0.0,
        };
        let run = |layout: &str| {
            let l: Layout = layout.parse().unwrap();
            let ranks: Vec<RankState> = (0..l.world())
                .map(|r| RankState::new(model, train, l, r).unwrap())
                .collect();
            let mut losses = Vec::new();
            for s in 1..=3u64 {
                let mut tot = Partial::default();
                for r in &ranks {
                    tot.add(&r.partial_loss(s, 1.0));
                    r.update(s, s, 1.0);
                }
                losses.push(tot.sse);
            }
            losses
        };
        let l1 = run("dp=1");
        let l2 = run("dp=2,tp=2,pp=2,zero=1");
        let l3 = run("tp=2,zero=3,dp=3");
        assert_eq!(l1, l2);
        assert_eq!(l1, l3);
        assert!(l1[0] > l1[2], "loss decreases: {l1:?}");
    }
}
