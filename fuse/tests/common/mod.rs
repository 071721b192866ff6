//! Checkpoints for the FUSE tests: a 4-rank save with tensor parallelism and ZeRO, hostile
//! names, damage, and what every file of the mount must hold.
#![allow(dead_code)]

pub use ckpt_store::model::cut_box as cut;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;
use ckpt_store::object_store::path::Path as ObjPath;
use ckpt_store::placement::{Placed, Placement, Stage, TensorSpec, ZeroGroup, place_rank};
use ckpt_store::testing::{det_bytes, tiny_config};
use ckpt_store::{
    BlobIn, ChunkRef, DType, DedupIndex, DirectFs, Layout, MetricsStore, NdBox, ObjectStoreExt,
    RankWrite, SafetensorsView, ShardDesc, ShardIn, StepReader, Store, StoreMetrics,
};

/// A store in a temporary directory, with request counters.
pub struct TestStore {
    pub store: Store,
    pub metrics: Arc<StoreMetrics>,
    pub dir: tempfile::TempDir,
}

pub fn test_store() -> TestStore {
    let dir = tempfile::tempdir().unwrap();
    let fs = DirectFs::new(dir.path()).unwrap();
    let m = MetricsStore::new(fs);
    let metrics = m.metrics();
    let store = Store::new(Arc::new(m), ObjPath::from(""), dir.path().to_str().unwrap())
        .with_config(tiny_config())
        .unwrap();
    TestStore {
        store,
        metrics,
        dir,
    }
}

/// One tensor's expected global value.
#[derive(Debug, Clone)]
pub struct Tensor {
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub bytes: Vec<u8>,
}

/// What a saved step must show.
#[derive(Debug, Clone, Default)]
pub struct Expected {
    pub tensors: BTreeMap<String, Tensor>,
    /// (rank, blob name) -> bytes
    pub blobs: BTreeMap<(u32, String), Vec<u8>>,
    /// rank -> tensor name -> boxes in save order (written and replicas)
    pub rank_boxes: BTreeMap<u32, BTreeMap<String, Vec<NdBox>>>,
}

impl Expected {
    /// Row-major bytes of the boxes rank `r` holds of `name`, back to back.
    pub fn rank_file(&self, r: u32, name: &str) -> Vec<u8> {
        let t = &self.tensors[name];
        let mut out = Vec::new();
        for b in &self.rank_boxes[&r][name] {
            out.extend_from_slice(&cut(&t.bytes, &t.shape, b, t.dtype.size()));
        }
        out
    }
}

fn spec(
    name: &str,
    dtype: DType,
    shape: &[u64],
    tp_dim: Option<usize>,
    zero: bool,
    order: u32,
) -> TensorSpec {
    TensorSpec {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
        placement: Placement {
            order,
            tp_dim,
            stage: Stage::Layer { index: 0, of: 1 },
            zero: zero.then(|| ZeroGroup {
                group: "exp_avg".into(),
                from_stage: 1,
            }),
        },
    }
}

/// The model of the sharded checkpoint: tensor-parallel rows and columns, replicated norms
/// and a scalar, odd shapes and dtypes, and a ZeRO-1 optimizer group.
pub fn specs() -> Vec<TensorSpec> {
    vec![
        spec("embed.weight", DType::Bf16, &[64, 48], Some(0), false, 0),
        spec(
            "layers.0.attn.qkv.weight",
            DType::F32,
            &[48, 40],
            Some(0),
            false,
            1,
        ),
        spec(
            "layers.0.attn.proj.weight",
            DType::F32,
            &[40, 48],
            Some(1),
            false,
            2,
        ),
        spec("layers.0.norm.weight", DType::F32, &[48], None, false, 3),
        spec(
            "layers.0.mlp.gate",
            DType::F16,
            &[30, 10],
            Some(1),
            false,
            4,
        ),
        spec("step", DType::I64, &[], None, false, 5),
        spec("mask", DType::U8, &[77], None, false, 6),
        spec("exp_avg.embed", DType::F32, &[128, 48], Some(0), true, 7),
        spec("exp_avg.qkv", DType::F32, &[48, 40], Some(0), true, 8),
        spec("exp_avg.norm", DType::F32, &[47], None, true, 9),
    ]
}

/// Save `specs` with `layout` as `run`/`step` (committed if `commit`), values from `seed`.
pub async fn save(
    store: &Store,
    run: &str,
    step: u64,
    layout: Layout,
    specs: &[TensorSpec],
    seed: u64,
    commit: bool,
) -> Expected {
    let mut exp = Expected::default();
    for (i, s) in specs.iter().enumerate() {
        let n = NdBox::full(&s.shape).numel() as usize * s.dtype.size();
        exp.tensors.insert(
            s.name.clone(),
            Tensor {
                dtype: s.dtype,
                shape: s.shape.clone(),
                bytes: det_bytes(seed * 1000 + i as u64, n),
            },
        );
    }
    let mut tasks = Vec::new();
    for rank in 0..layout.world() {
        let placed: Vec<Placed> = place_rank(&layout, rank, specs).unwrap();
        let mut shards = Vec::new();
        for p in &placed {
            let s = &specs[p.spec];
            let t = &exp.tensors[&s.name];
            exp.rank_boxes
                .entry(rank)
                .or_default()
                .entry(s.name.clone())
                .or_default()
                .push(p.bbox.clone());
            shards.push(ShardIn {
                shard: ShardDesc::placed(s, p.bbox.clone(), p.replica_of),
                data: p
                    .replica_of
                    .is_none()
                    .then(|| Bytes::from(cut(&t.bytes, &t.shape, &p.bbox, s.dtype.size()))),
            });
        }
        let blobs = vec![
            (
                "rng_state".to_string(),
                det_bytes(seed * 77 + rank as u64, 100),
            ),
            (
                "dataloader.json".to_string(),
                format!("{{\"rank\": {rank}, \"step\": {step}}}").into_bytes(),
            ),
            (
                "big".to_string(),
                det_bytes(seed * 91 + rank as u64, 10_000),
            ),
        ];
        for (n, b) in &blobs {
            exp.blobs.insert((rank, n.clone()), b.clone());
        }
        let blobs = blobs
            .into_iter()
            .map(|(name, data)| BlobIn {
                name,
                data: Bytes::from(data),
            })
            .collect();
        let w = RankWrite::new(run, step, rank, layout);
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            store
                .write_rank(&w, shards, blobs, &DedupIndex::new())
                .await
                .unwrap();
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    if commit {
        store.log().commit_step(run, step).await.unwrap();
    }
    exp
}

pub fn layout() -> Layout {
    Layout::new(2, 2, 1, 1).unwrap()
}

/// Run `train`: steps 1 and 2 committed, step 3 saved by every rank but not committed.
pub async fn sharded_run(store: &Store) -> (Expected, Expected) {
    let e1 = save(store, "train", 1, layout(), &specs(), 1, true).await;
    let e2 = save(store, "train", 2, layout(), &specs(), 2, true).await;
    save(store, "train", 3, layout(), &specs(), 3, false).await;
    (e1, e2)
}

/// Tensor names that try to leave their directory or break tools.
pub fn hostile_names() -> Vec<String> {
    let long = "L".repeat(300);
    vec![
        "../../../../etc/passwd".into(),
        "/absolute".into(),
        "a/b/c".into(),
        ".".into(),
        "..".into(),
        "new\nline".into(),
        "esc\u{1b}[31mred".into(),
        "percent%2Fslash".into(),
        "ok.name".into(),
        long.clone(),
        // Literally what `long` maps to: must not shadow it.
        ckpt_fuse::names::escape(&long),
    ]
}

/// Run `evil`, step 1: hostile tensor and blob names, one rank.
pub async fn hostile_run(store: &Store) -> Expected {
    let mut exp = Expected::default();
    let mut shards = Vec::new();
    for (i, n) in hostile_names().iter().enumerate() {
        let shape = vec![100 + i as u64];
        let bytes = det_bytes(900 + i as u64, shape[0] as usize * 4);
        exp.rank_boxes
            .entry(0)
            .or_default()
            .insert(n.clone(), vec![NdBox::full(&shape)]);
        shards.push(ShardIn {
            shard: ShardDesc::boxed(n.clone(), DType::F32, shape.clone(), NdBox::full(&shape)),
            data: Some(Bytes::from(bytes.clone())),
        });
        exp.tensors.insert(
            n.clone(),
            Tensor {
                dtype: DType::F32,
                shape,
                bytes,
            },
        );
    }
    let mut blobs = Vec::new();
    for (i, n) in ["../rng", "..", "a/b", "x\ty"].iter().enumerate() {
        let b = det_bytes(950 + i as u64, 50 + i);
        exp.blobs.insert((0, n.to_string()), b.clone());
        blobs.push(BlobIn {
            name: n.to_string(),
            data: Bytes::from(b),
        });
    }
    let w = RankWrite::new("evil", 1, 0, Layout::SINGLE);
    store
        .write_rank(&w, shards, blobs, &DedupIndex::new())
        .await
        .unwrap();
    store.log().commit_step("evil", 1).await.unwrap();
    exp
}

/// The bytes `ckpt export` writes for a step: the whole `SafetensorsView`.
pub async fn export_bytes(store: &Store, run: &str, step: u64) -> Vec<u8> {
    let reader = StepReader::open(store, run, step).await.unwrap();
    let view = SafetensorsView::new(reader.commit(), None).unwrap();
    let mut out = vec![0u8; view.len() as usize];
    let (n, _) = view.read_at(&reader, 0, &mut out).await.unwrap();
    assert_eq!(n, out.len());
    out
}

/// A damaged chunk and the byte ranges of files that depend on it.
#[derive(Debug, Clone)]
pub struct Damage {
    pub chunk: ChunkRef,
    pub object: String,
    pub tensor: String,
    /// Byte range of `tensors/<tensor>` the chunk holds.
    pub tensor_range: std::ops::Range<u64>,
    /// Byte range of `model.safetensors` the chunk holds.
    pub model_range: std::ops::Range<u64>,
}

/// Flip a byte in the payload of chunk `k` of the shard of a row-split tensor (rows
/// contiguous in the tensor, so the chunk is one byte range of the tensor file).
pub async fn damage_chunk(store: &Store, run: &str, step: u64, tensor: &str, k: usize) -> Damage {
    let reader = StepReader::open(store, run, step).await.unwrap();
    let entry = reader.commit().tensor(tensor).unwrap().clone();
    let shard = &entry.shards[0];
    let row_bytes: u64 = entry.shape[1..].iter().product::<u64>() * entry.dtype.size() as u64;
    assert_eq!(
        shard.bbox.lengths[1..],
        entry.shape[1..],
        "row split expected"
    );
    let m = reader.manifest(shard.rank).await.unwrap();
    let ts = m.written_shard(tensor, &shard.bbox).unwrap();
    let chunk = ts.chunks[k].clone();
    assert!(chunk.pack.is_none(), "pick a chunk stored on its own");
    let start: u64 = ts.chunks[..k].iter().map(|c| c.len as u64).sum();
    let base = shard.bbox.offsets[0] * row_bytes;
    let tensor_range = base + start..base + start + chunk.len as u64;
    let view = SafetensorsView::new(reader.commit(), None).unwrap();
    let e = view.entries().iter().find(|e| e.name == tensor).unwrap();
    let model_range = e.start + tensor_range.start..e.start + tensor_range.end;
    let key = store.keys().object_of(&chunk);
    let mut obj = store.objects().get_object(&key).await.unwrap().to_vec();
    let last = obj.len() - 1;
    obj[last] ^= 0x5a;
    store
        .object_store()
        .put(&key, Bytes::from(obj).into())
        .await
        .unwrap();
    Damage {
        chunk,
        object: key.to_string(),
        tensor: tensor.into(),
        tensor_range,
        model_range,
    }
}

/// A deterministic generator for random offsets (splitmix64).
pub use ckpt_store::testing::Rng;

/// The Python with `safetensors` and `numpy`: `$CKPT_PYTHON`, else the repository's venv.
pub fn python() -> PathBuf {
    ckpt_store::testing::find_python().expect("the test checks Need::Python first")
}
