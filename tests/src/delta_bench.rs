//! `ckpt-bench delta`: what delta chunks (issue 16) store per kind of state, and what they cost
//! in save and restore time, at several checkpoint intervals, on the local disk and on a slow
//! sink, next to the machine's limits measured in the same run.
//!
//! Every run trains the reference workload (bf16 weights, fp32 master weights, fp32 Adam
//! moments; `dp=1,tp=2,pp=2`, ranks as threads) from the same seed, so every mode sees the
//! same states. A save's stored size counts the objects it wrote (chunks it took unchanged
//! cost nothing), over the raw bytes of what it saved, per kind of state.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
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

use ckpt_trainer::{CheckpointManager, CheckpointerConfig, HostTensor, ManagerConfig};

use super::delta_physics::{kind, read_safetensors, trajectory_steps, whole_spec};
use super::{
    bench_job, checkpoint, emit, gbps, managers, odirect_read, odirect_write, step_time,
    timed_restore, touched_ranks,
};

/// The chain length the delta modes use (a whole chunk at least every 9 saves).
const DELTA_CHAIN: usize = 8;

/// The settings of one mode (each names every setting it depends on: the defaults move).
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
            delta_chain: DELTA_CHAIN,
            delta_cache_bytes: state + state / 4,
            ..base
        },
        "delta-readback" => StoreConfig {
            adaptive_codec: false,
            delta_chain: DELTA_CHAIN,
            ..base
        },
        "adaptive" => StoreConfig {
            delta_chain: 0,
            ..base
        },
        "adaptive+delta" => StoreConfig {
            delta_chain: DELTA_CHAIN,
            delta_cache_bytes: state + state / 4,
            ..base
        },
        other => {
            panic!(
                "unknown mode {other:?} (raw, planes, delta, delta-readback, adaptive, adaptive+delta)"
            )
        }
    }
}

/// Per kind: (raw bytes saved, bytes of the objects this step wrote); the chunks of the step
/// (for the next one); and (chunks written that had a delta base, chunks stored as deltas):
/// a chunk has a base where it is not packed.
async fn stored_by_kind(
    store: &Store,
    run: &str,
    step: u64,
    before: &HashSet<ChunkId>,
) -> (
    BTreeMap<&'static str, (u64, u64)>,
    HashSet<ChunkId>,
    (u64, u64),
) {
    let r = StepReader::open(store, run, step).await.unwrap();
    let mut out: BTreeMap<&'static str, (u64, u64)> = BTreeMap::new();
    let mut ids = HashSet::new();
    let mut deltas = (0, 0);
    for e in &r.commit().ranks {
        let m = r.manifest(e.rank).await.unwrap();
        for t in m.tensors.iter().filter(|t| t.replica_of.is_none()) {
            let k = out.entry(kind(&t.name)).or_default();
            k.0 += t.byte_len();
            for c in &t.chunks {
                if ids.insert(c.id) && !before.contains(&c.id) {
                    k.1 += c.stored as u64;
                    if c.pack.is_none() && t.dtype.is_float() {
                        deltas.0 += 1;
                        deltas.1 += u64::from(c.is_delta());
                    }
                }
            }
        }
    }
    (out, ids, deltas)
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

/// Where the saved states come from.
pub enum Source {
    /// The reference workload at `params` parameters, trained at learning rate `lr`.
    Reference { params: u64, lr: f32 },
    /// Safetensors files `step-NNNNNN.safetensors` of a real training run (one rank).
    Trajectory(PathBuf),
}

/// Managers over a store for the job's ranks: the saving ones (`false`), or fresh ones to
/// restore into (`true`).
type ManagersFor = Box<dyn Fn(&Store, bool) -> Vec<CheckpointManager>>;

/// One benchmark job: the managers that save, and how to move the state to a step.
struct Job {
    state: u64,
    params: u64,
    layout: Layout,
    local: Store,
    mgrs_for: ManagersFor,
    advance: Box<dyn FnMut(u64)>,
    /// Bytes a restore fills.
    needed: u64,
}

fn reference_job(dir: &Path, params: u64, lr: f32) -> Job {
    let layout: Layout = "dp=1,tp=2,pp=2".parse().unwrap();
    let (model, mut train, mut ranks, state, local) =
        bench_job(dir, "delta-store", params, layout, 5);
    train.lr = lr;
    for r in &mut ranks {
        r.train.lr = lr;
    }
    let ranks = Arc::new(ranks);
    let r2 = ranks.clone();
    let mut at = 0;
    Job {
        state,
        params: model.param_count(),
        layout,
        local,
        mgrs_for: Box::new(move |store, fresh| {
            if fresh {
                let f = touched_ranks(model, train, layout);
                managers(store, "d", layout, &f, false, 1)
            } else {
                managers(store, "d", layout, &r2, true, 0)
            }
        }),
        advance: Box::new(move |to| {
            for s in at + 1..=to {
                step_time(&ranks, s);
            }
            at = to;
        }),
        needed: state,
    }
}

fn trajectory_job(dir: &Path, traj: &Path) -> Job {
    let layout: Layout = "dp=1".parse().unwrap();
    let steps = trajectory_steps(traj);
    let first = read_safetensors(&steps.first().expect("no step files").1);
    let specs: Vec<_> = first
        .iter()
        .enumerate()
        .map(|(i, t)| whole_spec(t, i as u32))
        .collect();
    let tensors: Vec<HostTensor> = first
        .into_iter()
        .map(|t| HostTensor::from_vec(t.data))
        .collect();
    let state: u64 = tensors.iter().map(|t| t.read().len() as u64).sum();
    let params: u64 = specs
        .iter()
        .filter(|(s, _)| kind(&s.name) == "master_fp32")
        .map(|(s, _)| s.shape.iter().product::<u64>())
        .sum();
    let d = dir.join("delta-store");
    let _ = std::fs::remove_dir_all(&d);
    let local = ckpt_store::open_with(d.to_str().unwrap(), &super::open_options()).unwrap();
    let specs = Arc::new(specs);
    let (s2, t2) = (specs.clone(), tensors.clone());
    let sizes: Vec<usize> = tensors.iter().map(|t| t.read().len()).collect();
    let by_step: BTreeMap<u64, PathBuf> = steps.into_iter().collect();
    Job {
        state,
        params,
        layout,
        local,
        mgrs_for: Box::new(move |store, fresh| {
            let mut c = CheckpointerConfig::new("d", 0, layout);
            c.copy_threads = 2;
            c.generation = u64::from(fresh);
            let mut mc = ManagerConfig::new(c);
            mc.final_on_sigterm = false;
            let mut m = CheckpointManager::new(store.clone(), mc).unwrap();
            for (i, (spec, bx)) in s2.iter().enumerate() {
                // A restore fills touched memory, as a restarted job's would be.
                let mem = if fresh {
                    HostTensor::from_vec(vec![1u8; sizes[i]])
                } else {
                    t2[i].clone()
                };
                m.register(spec.clone(), bx.clone(), Arc::new(mem)).unwrap();
            }
            if !fresh {
                let st = m.save_state().unwrap();
                m.checkpointer().prepare_staging(&st, true);
            }
            vec![m]
        }),
        advance: Box::new(move |to| {
            let p = by_step
                .get(&to)
                .unwrap_or_else(|| panic!("the trajectory has no step {to}"));
            for (t, new) in tensors.iter().zip(read_safetensors(p)) {
                t.write().copy_from_slice(&new.data);
            }
        }),
        needed: state,
    }
}

/// The benchmark (see the module docs): one JSON line per (interval, sink, mode), then the
/// limits. The steps saved are `first`, `first + interval`, ... (`saves` of them; the first
/// is not measured: it has no base).
#[allow(clippy::too_many_arguments)]
pub fn delta_bench(
    dir: &Path,
    source: &Source,
    first: u64,
    saves: u64,
    intervals: &[u64],
    sinks: &[String],
    modes: &[String],
    slow_rate: f64,
    restores: usize,
) {
    let limit = dir.join("limit.bin");
    let mut limits = None;
    let source_name = match source {
        Source::Reference { lr, .. } => format!("reference lr={lr}"),
        Source::Trajectory(p) => format!("trajectory {}", p.display()),
    };
    for &interval in intervals {
        for sink in sinks {
            for mode in modes {
                let mut job = match source {
                    Source::Reference { params, lr } => reference_job(dir, *params, *lr),
                    Source::Trajectory(p) => trajectory_job(dir, p),
                };
                let state = job.state;
                let (disk_w, _) = *limits.get_or_insert_with(|| {
                    let n = (state as usize).max(256 << 20) / (8 << 20) * (8 << 20);
                    let w = odirect_write(&limit, n, 8, 4 << 20);
                    (w, odirect_read(&limit, 8, 4 << 20))
                });
                let cfg = mode_config(mode, state);
                let store = match sink.as_str() {
                    "local" => job.local.clone().with_config(cfg).unwrap(),
                    "slow" => slow_store(&dir.join("delta-slow"), slow_rate)
                        .with_config(cfg)
                        .unwrap(),
                    other => panic!("unknown sink {other:?} (local, slow)"),
                };
                let mut mgrs = (job.mgrs_for)(&store, false);
                let rt = ckpt_trainer::runtime();
                let mut before: HashSet<ChunkId> = HashSet::new();
                let mut totals: BTreeMap<&'static str, (u64, u64)> = BTreeMap::new();
                let mut commit_s = Vec::new();
                let (mut tried, mut kept) = (0, 0);
                let mut step = 0;
                for k in 0..saves {
                    step = if k == 0 { first } else { step + interval };
                    (job.advance)(step);
                    let (_, committed) = checkpoint(&mut mgrs, step);
                    let (by, ids, (t, s)) = rt.block_on(stored_by_kind(&store, "d", step, &before));
                    before = ids;
                    if k > 0 {
                        commit_s.push(committed);
                        tried += t;
                        kept += s;
                        for (kd, (raw, stored)) in by {
                            let t = totals.entry(kd).or_default();
                            t.0 += raw;
                            t.1 += stored;
                        }
                    }
                }
                drop(mgrs);
                // Restores of the newest step into fresh memory, each right after a read of
                // the disk's limit, so that each ratio compares two figures measured within a
                // second of each other on this shared machine; the median pair is reported.
                let mut pairs: Vec<(f64, f64, ckpt_store::MetricsSnapshot, f64)> = (0..restores
                    .max(1))
                    .map(|_| {
                        let r = odirect_read(&limit, 8, 4 << 20);
                        let mut mg = (job.mgrs_for)(&store, true);
                        let cpu = ckpt_tests::restore_bench::cpu_seconds();
                        let (s, used) = timed_restore(&store, &mut mg, step);
                        (s, r, used, ckpt_tests::restore_bench::cpu_seconds() - cpu)
                    })
                    .collect();
                let needed = job.needed;
                pairs.sort_by(|a, b| {
                    (a.0 / (needed as f64 / a.1)).total_cmp(&(b.0 / (needed as f64 / b.1)))
                });
                let restore_all: Vec<f64> = pairs.iter().map(|p| p.0).collect();
                let (restore_s, disk_r, used, restore_cpu) = pairs.swap_remove(pairs.len() / 2);
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
                    "bench": "delta", "source": source_name, "sink": sink, "mode": mode,
                    "interval": interval, "first_step": first,
                    "saves_measured": saves.saturating_sub(1), "state_bytes": state,
                    "params": job.params, "layout": job.layout.to_string(),
                    "stored_ratio_by_kind": ratios,
                    "stored_ratio": stored as f64 / raw.max(1) as f64,
                    "delta_chunks_kept": kept, "delta_chunks_possible": tried,
                    "commit_s_mean": commit_mean, "commit_s": commit_s,
                    "sink_write_gbps": sink_w,
                    "commit_over_sink_write_of_state": commit_mean / (state as f64 / sink_w / 1e9),
                    "restore_s": restore_s, "restore_s_all": restore_all,
                    "restore_cpu_s": restore_cpu,
                    "restore_bytes_read": used.get_bytes,
                    "restore_gets": used.gets,
                    "disk_odirect_read_gbps": disk_r,
                    "restore_over_read_limit": restore_s / (needed as f64 / disk_r / 1e9),
                    "restore_over_reading_what_it_read":
                        restore_s / (used.get_bytes as f64 / disk_r / 1e9),
                    "restore_gbps": gbps(needed, restore_s),
                }));
                drop(store);
                drop(job);
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
