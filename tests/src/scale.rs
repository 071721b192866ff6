//! `ckpt-bench scale`: the store's save, commit, `latest`, `ls`, restore and GC code paths
//! for N ranks of a Llama-70B-like layout, counted by a [`CountingStore`] (issue 17.1).
//!
//! Every rank runs as a task of one process, on a tokio runtime whose clock is paused: each
//! request takes the simulated latency, concurrent requests overlap, S3's per-prefix rates are
//! enforced per simulated second (a refused request is retried by the [`RetryStore`] above, as
//! `open()` stacks it), and nothing sleeps for real. The data is scaled down to a few hundred
//! bytes per shard: the counts matter, not the bytes. A rank does what
//! `ckpt_trainer::Checkpointer` does in the store, in the same order (join its generation,
//! take a writer lease and pick its dedup base, write chunks and packs, write its manifest,
//! release the lease; rank 0 then waits for the other manifests and commits); a restoring
//! rank places its tensors by the job's specs, opens the step for those tensors only (the commit
//! record's parts that hold them, format 5) and reads them through the read engine.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use ckpt_store::ObjectStoreExt;
use ckpt_store::counting::{Counting, CountingStore, ReqKind, Request, SimClock, SimConfig, Tally};
use ckpt_store::object_store::ObjectStore;
use ckpt_store::object_store::path::Path;
use ckpt_store::placement::place_rank;
use ckpt_store::{
    BlobIn, DType, DedupBase, GcOptions, Layout, NdBox, Placement, RankWrite, RetryConfig,
    RetryStore, ShardDesc, ShardIn, Stage, StepReader, Store, StoreConfig, TensorSpec, ZeroGroup,
};
use serde_json::{Value, json};

/// What to simulate.
#[derive(Debug, Clone)]
pub struct ScaleConfig {
    /// World size.
    pub ranks: u32,
    /// The layout (default: [`default_layout`]).
    pub layout: Option<Layout>,
    /// Transformer layers (80 for Llama-70B).
    pub layers: u32,
    /// Restore this many ranks, spread over the world (all when at least the world).
    pub restore_ranks: u32,
    /// Simulated request latency.
    pub latency: Duration,
    /// Enforce S3's per-prefix rates.
    pub limits: bool,
}

impl ScaleConfig {
    /// Defaults for `ranks`.
    pub fn new(ranks: u32) -> Self {
        ScaleConfig {
            ranks,
            layout: None,
            layers: 80,
            restore_ranks: 64,
            latency: Duration::from_millis(20),
            limits: true,
        }
    }
}

/// tp = 8 (fewer when the world is smaller), pp the largest power of two up to 16 not above
/// the square root of what is left, dp the rest; ZeRO-1.
pub fn default_layout(ranks: u32) -> Layout {
    let tp = [8, 4, 2, 1]
        .into_iter()
        .find(|t| ranks.is_multiple_of(*t))
        .unwrap_or(1);
    let rest = ranks / tp;
    let mut pp = 1;
    while pp * 2 <= 16 && (pp * 2) * (pp * 2) <= rest && rest.is_multiple_of(pp * 2) {
        pp *= 2;
    }
    Layout {
        dp: rest / pp,
        tp,
        pp,
        zero: 1,
    }
}

/// A Llama-70B-like state: embeddings, `layers` x 9 tensors (two norms, q, k, v with 8 of 64
/// heads, o, gate, up, down), final norm, output projection; each with bf16 weights and fp32
/// master, exp_avg, exp_avg_sq (ZeRO groups), scaled down to a 64-wide model.
pub fn llama_specs(layers: u32) -> Vec<TensorSpec> {
    let (d, kv, ffn, vocab) = (64u64, 8u64, 224u64, 256u64);
    let mut params: Vec<(String, Vec<u64>, Option<usize>, Stage)> = vec![(
        "embed_tokens.weight".into(),
        vec![vocab, d],
        Some(0),
        Stage::First,
    )];
    for i in 0..layers {
        let st = Stage::Layer {
            index: i,
            of: layers,
        };
        let p = |n: &str| format!("layers.{i}.{n}");
        params.extend([
            (p("input_layernorm.weight"), vec![d], None, st.clone()),
            (
                p("self_attn.q_proj.weight"),
                vec![d, d],
                Some(0),
                st.clone(),
            ),
            (
                p("self_attn.k_proj.weight"),
                vec![kv, d],
                Some(0),
                st.clone(),
            ),
            (
                p("self_attn.v_proj.weight"),
                vec![kv, d],
                Some(0),
                st.clone(),
            ),
            (
                p("self_attn.o_proj.weight"),
                vec![d, d],
                Some(1),
                st.clone(),
            ),
            (
                p("post_attention_layernorm.weight"),
                vec![d],
                None,
                st.clone(),
            ),
            (p("mlp.gate_proj.weight"), vec![ffn, d], Some(0), st.clone()),
            (p("mlp.up_proj.weight"), vec![ffn, d], Some(0), st.clone()),
            (p("mlp.down_proj.weight"), vec![d, ffn], Some(1), st.clone()),
        ]);
    }
    params.push(("norm.weight".into(), vec![d], None, Stage::Last));
    params.push((
        "lm_head.weight".into(),
        vec![vocab, d],
        Some(0),
        Stage::Last,
    ));
    let kinds: [(&str, DType, &str, u8); 4] = [
        ("", DType::Bf16, "param", 3),
        (".master", DType::F32, "master", 1),
        (".exp_avg", DType::F32, "exp_avg", 1),
        (".exp_avg_sq", DType::F32, "exp_avg_sq", 1),
    ];
    let mut out = Vec::new();
    for (pi, (name, shape, tp_dim, stage)) in params.into_iter().enumerate() {
        for (k, (suffix, dtype, group, from)) in kinds.iter().enumerate() {
            out.push(TensorSpec {
                name: format!("{name}{suffix}"),
                dtype: *dtype,
                shape: shape.clone(),
                placement: Placement {
                    order: (pi * 4 + k) as u32,
                    tp_dim,
                    stage: stage.clone(),
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

fn fill(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn name_key(s: &str) -> u64 {
    u64::from_le_bytes(
        blake3::hash(s.as_bytes()).as_bytes()[..8]
            .try_into()
            .expect("8"),
    )
}

/// What `rank` saves at `step`: its placed shards (weights change every step, so an
/// incremental save writes again what training changed; the frozen first half of the layers
/// and every replica do not).
fn rank_state(
    layout: &Layout,
    rank: u32,
    specs: &[TensorSpec],
    step: u64,
) -> ckpt_store::Result<(Vec<ShardIn>, Vec<BlobIn>)> {
    let frozen = |name: &str| {
        name.strip_prefix("layers.")
            .and_then(|r| r.split('.').next())
            .and_then(|i| i.parse::<u32>().ok())
            .is_some_and(|i| i % 2 == 0)
    };
    let mut shards = Vec::new();
    for p in place_rank(layout, rank, specs)? {
        let s = &specs[p.spec];
        let len = (p.bbox.numel() * s.dtype.size() as u64) as usize;
        let data = p.replica_of.is_none().then(|| {
            let version = if frozen(&s.name) { 0 } else { step };
            let seed = name_key(&s.name) ^ p.bbox.offsets.iter().fold(version, |a, o| a * 31 + o);
            ckpt_store::bytes::Bytes::from(fill(seed, len))
        });
        shards.push(ShardIn {
            shard: ShardDesc::placed(s, p.bbox, p.replica_of),
            data,
        });
    }
    let mut blobs = vec![BlobIn {
        name: "rank/rng".into(),
        data: fill(rank as u64 ^ step << 32, 16).into(),
    }];
    if rank == 0 {
        blobs.push(BlobIn {
            name: "global/progress".into(),
            data: format!("{{\"step\":{step}}}").into_bytes().into(),
        });
    }
    Ok((shards, blobs))
}

/// The simulation's store: `Store(Retry(Counting(backend)))` on the simulated clock.
pub fn counted_store(
    backend: Arc<dyn ObjectStore>,
    prefix: &str,
    sim: SimConfig,
) -> (Store, Arc<Counting>) {
    let counting = CountingStore::new(backend, sim);
    let c = counting.counting();
    let retry = RetryStore::new(
        counting,
        RetryConfig {
            attempts: 12,
            ..RetryConfig::default()
        },
        Arc::default(),
    );
    let cfg = StoreConfig {
        cpu_threads: 1,
        ..StoreConfig::default()
    };
    let store = Store::new(Arc::new(retry), Path::from(prefix), "sim://")
        .with_config(cfg)
        .expect("store settings")
        .with_clock(Arc::new(SimClock::starting_at(
            ckpt_store::clock::system_now(),
        )));
    (store, c)
}

/// Run the whole simulation on `store`, printing one JSON line per phase through `out`.
pub async fn simulate(
    store: &Store,
    counting: &Arc<Counting>,
    cfg: &ScaleConfig,
    out: &mut dyn FnMut(Value),
) -> ckpt_store::Result<Vec<Value>> {
    let layout = cfg.layout.unwrap_or_else(|| default_layout(cfg.ranks));
    if layout.world() != cfg.ranks {
        return Err(ckpt_store::Error::invalid(format!(
            "layout {layout} has {} ranks, not {}",
            layout.world(),
            cfg.ranks
        )));
    }
    let specs = Arc::new(llama_specs(cfg.layers));
    let run = "scale";
    let n = cfg.ranks;
    let bases: Arc<Vec<Mutex<DedupBase>>> =
        Arc::new((0..n).map(|_| Mutex::new(DedupBase::new())).collect());
    let mut lines = Vec::new();
    let mut emit = |v: Value, lines: &mut Vec<Value>| {
        out(v.clone());
        lines.push(v);
    };
    let common = json!({"ranks": n, "layout": layout.to_string(), "tensors": specs.len(),
                        "latency_ms": cfg.latency.as_secs_f64() * 1e3, "limits": cfg.limits});

    // The launcher (the supervisor, or the etcd coordinator) starts the generation before it
    // starts the ranks.
    store.log().start_generation(run, 0).await?;
    for step in [1u64, 2] {
        let m0 = counting.mark();
        let t0 = counting.elapsed();
        let manifest_done: Arc<Mutex<Duration>> = Arc::default();
        let meta: Arc<Mutex<(u64, u64)>> = Arc::default(); // (manifest bytes, packs+chunks)
        let mut tasks = tokio::task::JoinSet::new();
        for rank in 0..n {
            let (store, specs, bases) = (store.clone(), specs.clone(), bases.clone());
            let (counting, manifest_done, meta) =
                (counting.clone(), manifest_done.clone(), meta.clone());
            tasks.spawn(ckpt_store::counting::acting(rank, async move {
                let (shards, blobs) = rank_state(&layout, rank, &specs, step)?;
                // A rank joins its generation once, before its first save (as the trainer's
                // checkpointer does).
                if step == 1 {
                    store.log().join_generation_as(run, 0, rank).await?;
                }
                let writer = ckpt_store::writer_id(rank, 0);
                let candidates = bases[rank as usize].lock().expect("base").candidates();
                let lease = store
                    .gc()
                    .lease_dedup_base(run, &writer, &candidates)
                    .await?;
                let index = bases[rank as usize]
                    .lock()
                    .expect("base")
                    .pinned(lease.base());
                let w = RankWrite::new(run, step, rank, layout);
                let res = store.write_rank(&w, shards, blobs, &index).await;
                store.gc().release_lease(lease).await?;
                let (manifest, entry, stats) = res?;
                {
                    let mut t = manifest_done.lock().expect("time");
                    *t = (*t).max(counting.elapsed());
                    let mut m = meta.lock().expect("meta");
                    m.0 += entry.size;
                    m.1 += stats.objects_written;
                }
                let refs = manifest
                    .tensors
                    .iter()
                    .flat_map(|t| t.chunks.iter().cloned())
                    .collect();
                bases[rank as usize]
                    .lock()
                    .expect("base")
                    .persisted(step, refs);
                if rank == 0 {
                    let o = store
                        .log()
                        .wait_and_commit_as(
                            run,
                            step,
                            Some(0),
                            Duration::from_millis(50),
                            Duration::from_secs(600),
                        )
                        .await?;
                    return Ok::<_, ckpt_store::Error>(Some(o));
                }
                Ok(None)
            }));
        }
        let mut outcome = None;
        while let Some(r) = tasks.join_next().await {
            if let Some(o) = r.map_err(|e| ckpt_store::Error::internal(e.to_string()))?? {
                outcome = Some(o);
            }
        }
        let outcome = outcome.expect("rank 0 commits");
        let reqs = counting.requests_since(m0);
        let tally = Tally::of(&reqs);
        let t_manifests = *manifest_done.lock().expect("time");
        let after: Vec<Request> = reqs
            .iter()
            .filter(|r| r.t_us as u128 >= t_manifests.as_micros())
            .cloned()
            .collect();
        let committer: Vec<&Request> = after.iter().filter(|r| r.actor == Some(0)).collect();
        let committer_gets: u64 = committer
            .iter()
            .filter(|r| r.kind == ReqKind::Get)
            .map(|r| r.bytes)
            .sum();
        // The record as stored (after this phase's counts; one head).
        let record = store
            .object_store()
            .head(&store.keys().commit(run, step))
            .await
            .map_err(|e| ckpt_store::Error::backend("head", &"COMMIT", e))?
            .size as usize;
        // A split record (format 5): its parts, beside the root.
        let (parts, parts_bytes) = outcome.record().index.as_ref().map_or((0, 0), |i| {
            (i.parts.len(), i.parts.iter().map(|p| p.size()).sum::<u64>())
        });
        if outcome.record().step != step {
            return Err(ckpt_store::Error::internal(
                "the commit answered another step",
            ));
        }
        let (manifest_bytes, objects) = *meta.lock().expect("meta");
        let depth_all = Tally::depth(&after, 0);
        let depth_no_manifest_reads = {
            let v: Vec<Request> = after
                .iter()
                .filter(|r| !(r.kind == ReqKind::Get && r.prefix.contains("/steps/")))
                .cloned()
                .collect();
            Tally::depth(&v, 0)
        };
        let packs = reqs
            .iter()
            .filter(|r| r.prefix.starts_with("packs/") || r.prefix.contains("/packs/"))
            .count();
        let chunks = reqs
            .iter()
            .filter(|r| r.prefix.starts_with("chunks/") || r.prefix.contains("/chunks/"))
            .count();
        let per_rank_protocol = reqs
            .iter()
            .filter(|r| {
                r.prefix.contains("locks")
                    || r.prefix.contains("/generations")
                    || r.prefix.contains("/fences")
            })
            .count();
        let commit = json!({
            "committer_requests_after_manifests": committer.len(),
            "critical_path_requests": depth_all,
            "critical_path_without_manifest_reads": depth_no_manifest_reads,
            "record_bytes": record + parts_bytes as usize,
            "record_root_bytes": record,
            "record_parts": parts,
            "committer_holds_bytes": committer_gets as usize + record,
            "sim_s_after_manifests": (counting.elapsed() - t_manifests).as_secs_f64(),
        });
        emit(
            json!({"phase": if step == 1 { "save_full" } else { "save_incremental" },
                   "step": step, "common": common, "tally": tally,
                   "objects_written": objects, "chunk_or_pack_requests": packs + chunks,
                   "lease_and_generation_requests": per_rank_protocol,
                   "metadata_bytes": {"manifests": manifest_bytes, "commit_record": record},
                   "sim_s": (counting.elapsed() - t0).as_secs_f64(),
                   "commit": commit}),
            &mut lines,
        );
    }

    // The newest committed step.
    let m = counting.mark();
    let latest = store.log().latest_committed(run).await?;
    let t = counting.since(m);
    emit(
        json!({"phase": "latest", "found": latest, "tally": t}),
        &mut lines,
    );

    // `ckpt ls RUN --quick`: the step listing with each committed step's record.
    let m = counting.mark();
    let steps = store.log().list_steps_with_records(run).await?;
    let t = counting.since(m);
    let pages = t.count(ReqKind::ListPage);
    emit(
        json!({"phase": "ls", "steps": steps.len(), "list_pages": pages,
               "list_pages_per_step": pages as f64 / steps.len().max(1) as f64,
               "tally": t}),
        &mut lines,
    );

    // Restore the newest step on the same layout, a sample of ranks at once.
    let k = cfg.restore_ranks.clamp(1, n);
    let sample: Vec<u32> = (0..k)
        .map(|i| (i as u64 * n as u64 / k as u64) as u32)
        .collect();
    let m = counting.mark();
    let step = latest.unwrap_or(2);
    // Joined in this task: the read engine's futures are not `Send` enough to spawn.
    let mut restores = Vec::new();
    for &rank in &sample {
        let (store, specs) = (store.clone(), specs.clone());
        restores.push(ckpt_store::counting::acting(rank, async move {
            // What a restoring rank does: place its own tensors by the job's specs, and read
            // the commit record's parts of those only (format 5), then their manifests.
            let wanted: Vec<(String, NdBox)> = place_rank(&layout, rank, &specs)?
                .into_iter()
                .map(|p| (specs[p.spec].name.clone(), p.bbox))
                .collect();
            let reader =
                StepReader::open_tensors(&store, run, step, wanted.iter().map(|w| w.0.clone()))
                    .await?;
            let mut bytes = 0u64;
            for (name, bbox) in &wanted {
                bytes += reader.read(name, bbox).await?.len() as u64;
            }
            Ok::<_, ckpt_store::Error>(bytes)
        }));
    }
    let mut restored = 0u64;
    for r in futures::future::join_all(restores).await {
        restored += r?;
    }
    let reqs = counting.requests_since(m);
    let t = Tally::of(&reqs);
    let meta_per_rank: Vec<u64> = sample
        .iter()
        .map(|&r| {
            reqs.iter()
                .filter(|q| q.actor == Some(r) && q.prefix.contains("/steps/"))
                .map(|q| q.bytes)
                .sum()
        })
        .collect();
    // Of which the commit record (its root, and the parts of a split one): everything under
    // the step but the manifests.
    let record_per_rank: Vec<u64> = sample
        .iter()
        .map(|&r| {
            reqs.iter()
                .filter(|q| {
                    q.actor == Some(r)
                        && q.prefix.contains("/steps/")
                        && !q.prefix.contains("/ranks")
                })
                .map(|q| q.bytes)
                .sum()
        })
        .collect();
    let manifests_per_rank: Vec<usize> = sample
        .iter()
        .map(|&r| {
            reqs.iter()
                .filter(|q| {
                    q.actor == Some(r) && q.prefix.contains("/steps/") && q.kind == ReqKind::Get
                })
                .count()
                .saturating_sub(1)
        })
        .collect();
    emit(
        json!({"phase": "restore", "step": step, "ranks_restored": k, "bytes": restored,
               "metadata_bytes_per_rank_max": meta_per_rank.iter().max(),
               "metadata_bytes_per_rank_mean": meta_per_rank.iter().sum::<u64>() / k as u64,
               "record_bytes_per_rank_max": record_per_rank.iter().max(),
               "manifests_read_per_rank_max": manifests_per_rank.iter().max(),
               "requests_per_rank": t.requests as f64 / k as f64,
               "tally": t}),
        &mut lines,
    );

    // GC: keep the newest step, sweep what only step 1 referenced.
    let m = counting.mark();
    let opts = GcOptions {
        keep_last: Some(1),
        ..GcOptions::default()
    };
    let later = ckpt_store::clock::system_now() + chrono::Duration::hours(2);
    let report = store.gc().run(&opts, later).await?;
    let t = counting.since(m);
    emit(
        json!({"phase": "gc", "steps_deleted": report.steps_deleted.len(),
               "objects_deleted": report.objects_deleted, "objects_kept": report.objects_kept,
               "sweep_deferred": report.sweep_deferred, "tally": t}),
        &mut lines,
    );
    Ok(lines)
}

/// Run [`simulate`] over an in-memory store on a paused clock (nothing sleeps).
pub fn simulate_in_memory(
    cfg: &ScaleConfig,
    out: &mut dyn FnMut(Value),
) -> ckpt_store::Result<Vec<Value>> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .map_err(|e| ckpt_store::Error::internal(format!("runtime: {e}")))?;
    rt.block_on(async {
        let sim = SimConfig {
            latency: cfg.latency,
            limits: cfg.limits.then_some(ckpt_store::counting::RateLimits::S3),
            list_page: 1000,
        };
        let (store, counting) = counted_store(
            Arc::new(ckpt_store::object_store::memory::InMemory::new()),
            "",
            sim,
        );
        simulate(&store, &counting, cfg, out).await
    })
}

/// Run the simulation over the real S3 server (`s3s-fs` on loopback), counting only (no
/// simulated latency or limits, real time): the counts to hold against the in-memory run's.
pub fn simulate_on_s3(
    cfg: &ScaleConfig,
    out: &mut dyn FnMut(Value),
) -> ckpt_store::Result<Vec<Value>> {
    let server = ckpt_store::testing::S3Server::start();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| ckpt_store::Error::internal(format!("runtime: {e}")))?;
    rt.block_on(async {
        let (store, counting) =
            counted_store(Arc::new(server.client()), "scale", SimConfig::count_only());
        simulate(&store, &counting, cfg, out).await
    })
}

/// `ckpt-bench scale --ranks N [--restore-ranks K] [--layers L] [--latency-ms MS]
/// [--no-limits] [--s3]`: one JSON line per phase on standard output.
pub fn cli(args: &[String]) -> i32 {
    let get = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let num = |flag: &str, default: u64| -> u64 {
        get(flag).map_or(default, |v| {
            v.parse().unwrap_or_else(|_| {
                eprintln!("ckpt-bench scale: {flag} {v:?} is not a whole number");
                std::process::exit(2)
            })
        })
    };
    let mut cfg = ScaleConfig::new(num("--ranks", 256) as u32);
    cfg.restore_ranks = num("--restore-ranks", 64) as u32;
    cfg.layers = num("--layers", 80) as u32;
    cfg.latency = Duration::from_millis(num("--latency-ms", 20));
    cfg.limits = !args.iter().any(|a| a == "--no-limits");
    let mut print = |v: Value| println!("{v}");
    let r = if args.iter().any(|a| a == "--s3") {
        simulate_on_s3(&cfg, &mut print)
    } else {
        simulate_in_memory(&cfg, &mut print)
    };
    match r {
        Ok(_) => 0,
        Err(e) => {
            eprintln!("ckpt-bench scale: {e}");
            1
        }
    }
}
