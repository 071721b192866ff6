//! `ckpt-bench delta`: what delta chunks (issue 16) store per kind of state, and what they cost
//! in save and restore time, at several checkpoint intervals, on the local disk and on a slow
//! sink, next to the machine's limits measured in the same run.
//!
//! Every run trains the reference workload (bf16 weights, fp32 master weights, fp32 Adam
//! moments; `dp=1,tp=2,pp=2`, ranks as threads) from the same seed, so every mode sees the
//! same states. A save's stored size counts the objects it wrote (chunks it took unchanged
//! cost nothing), over the raw bytes of what it saved, per kind of state.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ckpt_store::object_store::path::Path as ObjPath;
use ckpt_store::object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, Result as OsResult,
};
use ckpt_store::{
    ChunkId, CodecPolicy, DirectFs, Layout, MetricsStore, ObjectStore, StepReader, Store,
    StoreConfig,
};
use futures::stream::BoxStream;
use serde_json::json;

use super::{
    bench_job, checkpoint, emit, gbps, managers, odirect_read, odirect_write, step_time,
    timed_restore, touched_ranks,
};

/// The settings of one mode.
fn mode_config(mode: &str, state: u64) -> StoreConfig {
    let base = StoreConfig::default();
    match mode {
        "raw" => StoreConfig {
            codec: CodecPolicy::Raw,
            adaptive_codec: false,
            delta_chain: 0,
            ..base
        },
        "planes" => StoreConfig {
            adaptive_codec: false,
            delta_chain: 0,
            ..base
        },
        "delta" => StoreConfig {
            adaptive_codec: false,
            delta_cache_bytes: state + state / 4,
            ..base
        },
        "delta-readback" => StoreConfig {
            adaptive_codec: false,
            ..base
        },
        "adaptive+delta" => StoreConfig {
            delta_cache_bytes: state + state / 4,
            ..base
        },
        other => {
            panic!("unknown mode {other:?} (raw, planes, delta, delta-readback, adaptive+delta)")
        }
    }
}

/// The kind of state a tensor holds, by the reference workload's names.
fn kind(name: &str) -> &'static str {
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

/// Per kind: (raw bytes saved, bytes of the objects this step wrote), and the chunks of the
/// step (for the next one).
async fn stored_by_kind(
    store: &Store,
    run: &str,
    step: u64,
    before: &HashSet<ChunkId>,
) -> (BTreeMap<&'static str, (u64, u64)>, HashSet<ChunkId>) {
    let r = StepReader::open(store, run, step).await.unwrap();
    let mut out: BTreeMap<&'static str, (u64, u64)> = BTreeMap::new();
    let mut ids = HashSet::new();
    for e in &r.commit().ranks {
        let m = r.manifest(e.rank).await.unwrap();
        for t in m.tensors.iter().filter(|t| t.replica_of.is_none()) {
            let k = out.entry(kind(&t.name)).or_default();
            k.0 += t.byte_len();
            for c in &t.chunks {
                if ids.insert(c.id) && !before.contains(&c.id) {
                    k.1 += c.stored as u64;
                }
            }
        }
    }
    (out, ids)
}

/// An object store that takes writes at most `rate` bytes a second, all requests together (a
/// slow sink: a network link, a remote bucket); reads and everything else go straight through.
#[derive(Debug)]
pub struct Throttled {
    inner: Arc<dyn ObjectStore>,
    rate: f64,
    next: Mutex<Instant>,
}

impl Throttled {
    /// `inner`, written at most `rate` bytes a second.
    pub fn new(inner: Arc<dyn ObjectStore>, rate: f64) -> Self {
        Throttled {
            inner,
            rate,
            next: Mutex::new(Instant::now()),
        }
    }

    async fn pace(&self, bytes: usize) {
        let until = {
            let mut next = self.next.lock().unwrap();
            let start = (*next).max(Instant::now());
            *next = start + Duration::from_secs_f64(bytes as f64 / self.rate);
            *next
        };
        tokio::time::sleep_until(until.into()).await;
    }
}

impl std::fmt::Display for Throttled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Throttled({} B/s, {})", self.rate, self.inner)
    }
}

#[async_trait::async_trait]
impl ObjectStore for Throttled {
    async fn put_opts(
        &self,
        p: &ObjPath,
        payload: PutPayload,
        opts: PutOptions,
    ) -> OsResult<PutResult> {
        self.pace(payload.content_length()).await;
        self.inner.put_opts(p, payload, opts).await
    }
    async fn put_multipart_opts(
        &self,
        p: &ObjPath,
        opts: PutMultipartOptions,
    ) -> OsResult<Box<dyn MultipartUpload>> {
        self.inner.put_multipart_opts(p, opts).await
    }
    async fn get_opts(&self, p: &ObjPath, opts: GetOptions) -> OsResult<GetResult> {
        self.inner.get_opts(p, opts).await
    }
    fn delete_stream(
        &self,
        s: BoxStream<'static, OsResult<ObjPath>>,
    ) -> BoxStream<'static, OsResult<ObjPath>> {
        self.inner.delete_stream(s)
    }
    fn list(&self, prefix: Option<&ObjPath>) -> BoxStream<'static, OsResult<ObjectMeta>> {
        self.inner.list(prefix)
    }
    async fn list_with_delimiter(&self, prefix: Option<&ObjPath>) -> OsResult<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }
    async fn copy_opts(&self, from: &ObjPath, to: &ObjPath, opts: CopyOptions) -> OsResult<()> {
        self.inner.copy_opts(from, to, opts).await
    }
}

/// A store at `dir` whose writes go at most `rate` bytes a second.
fn slow_store(dir: &Path, rate: f64) -> Store {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).unwrap();
    let fs: Arc<dyn ObjectStore> = Arc::new(DirectFs::new(dir).unwrap());
    let ms = MetricsStore::new(Throttled::new(fs, rate));
    let m = ms.metrics();
    Store::new(
        Arc::new(ms),
        ObjPath::default(),
        format!("slow:{}", dir.display()),
    )
    .with_metrics(m)
    .with_local_root(dir)
}

/// The benchmark (see the module docs): one JSON line per (interval, sink, mode), then the
/// limits.
pub fn delta_bench(
    dir: &Path,
    params: u64,
    saves: u64,
    intervals: &[u64],
    sinks: &[String],
    modes: &[String],
    slow_rate: f64,
) {
    let layout: Layout = "dp=1,tp=2,pp=2".parse().unwrap();
    let limit = dir.join("limit.bin");
    let mut limits = None;
    for &interval in intervals {
        for sink in sinks {
            for mode in modes {
                let (model, train, ranks, state, local) =
                    bench_job(dir, "delta-store", params, layout, 5);
                let (disk_w, disk_r) = *limits.get_or_insert_with(|| {
                    let n = (state as usize).max(256 << 20) / (8 << 20) * (8 << 20);
                    let w = odirect_write(&limit, n, 8, 4 << 20);
                    (w, odirect_read(&limit, 8, 4 << 20))
                });
                let cfg = mode_config(mode, state);
                let store = match sink.as_str() {
                    "local" => local.with_config(cfg).unwrap(),
                    "slow" => slow_store(&dir.join("delta-slow"), slow_rate)
                        .with_config(cfg)
                        .unwrap(),
                    other => panic!("unknown sink {other:?} (local, slow)"),
                };
                let mut mgrs = managers(&store, "d", layout, &ranks, true, 0);
                let rt = ckpt_trainer::runtime();
                let mut before: HashSet<ChunkId> = HashSet::new();
                let mut totals: BTreeMap<&'static str, (u64, u64)> = BTreeMap::new();
                let mut commit_s = Vec::new();
                let mut step = 0;
                for k in 0..saves {
                    let next = if k == 0 { 1 } else { step + interval };
                    for s in step + 1..=next {
                        step_time(&ranks, s);
                    }
                    step = next;
                    let (_, committed) = checkpoint(&mut mgrs, step);
                    let (by, ids) = rt.block_on(stored_by_kind(&store, "d", step, &before));
                    before = ids;
                    if k > 0 {
                        commit_s.push(committed);
                        for (kd, (raw, stored)) in by {
                            let t = totals.entry(kd).or_default();
                            t.0 += raw;
                            t.1 += stored;
                        }
                    }
                }
                drop(mgrs);
                let fresh = touched_ranks(model, train, layout);
                let needed: u64 = fresh.iter().map(|r| r.held_bytes()).sum();
                let mut mg = managers(&store, "d", layout, &fresh, false, 1);
                let (restore_s, used) = timed_restore(&store, &mut mg, step);
                drop(mg);
                let (raw, stored) = totals.values().fold((0, 0), |a, (r, s)| (a.0 + r, a.1 + s));
                let ratios: serde_json::Map<String, serde_json::Value> = totals
                    .iter()
                    .map(|(k, (r, s))| (k.to_string(), json!(*s as f64 / (*r).max(1) as f64)))
                    .collect();
                let commit_mean = commit_s.iter().sum::<f64>() / commit_s.len().max(1) as f64;
                let sink_w = if sink == "slow" {
                    slow_rate / 1e9
                } else {
                    disk_w
                };
                emit(json!({
                    "bench": "delta", "sink": sink, "mode": mode, "interval": interval,
                    "saves_measured": saves.saturating_sub(1), "state_bytes": state,
                    "params": model.param_count(), "layout": layout.to_string(),
                    "stored_ratio_by_kind": ratios,
                    "stored_ratio": stored as f64 / raw.max(1) as f64,
                    "commit_s_mean": commit_mean,
                    "sink_write_gbps": sink_w,
                    "commit_over_sink_write_of_state": commit_mean / (state as f64 / sink_w / 1e9),
                    "restore_s": restore_s, "restore_bytes_read": used.get_bytes,
                    "restore_gets": used.gets,
                    "disk_odirect_read_gbps": disk_r,
                    "restore_over_read_limit": restore_s / (needed as f64 / disk_r / 1e9),
                    "restore_gbps": gbps(needed, restore_s),
                }));
                drop(store);
                let _ = std::fs::remove_dir_all(dir.join("delta-store"));
                let _ = std::fs::remove_dir_all(dir.join("delta-slow"));
            }
        }
    }
    if let Some((w, r)) = limits {
        emit(
            json!({"bench": "delta_limits", "disk_odirect_write_gbps": w,
                    "disk_odirect_read_gbps": r, "slow_sink_gbps": slow_rate / 1e9}),
        );
    }
    let _ = std::fs::remove_file(limit);
}
