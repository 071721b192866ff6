//! `ckpt-bench`: the benchmarks behind BENCHMARKS.md, each figure next to the machine's limit
//! measured in the same run (memcpy, O_DIRECT disk, blake3, zstd). Prints JSON lines.
//!
//! ```text
//! ckpt-bench limits --dir DIR --gib 2          memcpy, blake3, O_DIRECT, io_uring, backends
//! ckpt-bench store  --dir DIR --gib 2          save throughput, codecs, dedup, memory
//! ckpt-bench train  --dir DIR --params 150M    stall, time to commit, restore, RSS, slowdown
//! ckpt-bench recovery --dir DIR --params 20M   detection, restart, restore from store or peers
//! ckpt-bench peers  --dir DIR --params 100M    restore from peer replicas vs. the store
//! ckpt-bench faults --dir DIR --mib 64         saves/restores with 5 % of requests failing; an outage
//! ckpt-bench governor --dir DIR --params 150M [--budgets 0.05,0.1,0.25,off] [--every 6] [--saves 3]
//!                                              the persist governor: slowdown vs. time to durable
//! ckpt-bench goodput --dir DIR --minutes 20 --mtbf 60   goodput under random failures, per policy
//! ckpt-bench restore --dir DIR --gib 2 [--tensors 64] [--values random|normal]
//!                   [--codec adaptive|planes|delta] [--chain 1] [--rounds 2]
//!                   [--modes manager,reader] [--caches cold,hot] [--budget-mib 256]
//!                                              restore in fresh processes vs. the O_DIRECT read
//! ckpt-bench delta  --dir DIR --params 20M     delta chunks: stored size per kind, save/restore time
//!                   [--intervals 1,10,100] [--saves 3] [--sinks local,slow] [--slow-mbps 200] [--restores 3]
//!                   [--modes raw,planes,delta,delta-readback,adaptive+delta]
//! ckpt-bench sentinel --dir DIR --params 20M [--rounds 3]
//!                                              the sentinel's cost (off, sample, full) and detection
//! ckpt-bench tiers --dir DIR --params 100M [--sink-mbps 100] [--snapshot-overlap auto|always|never]
//!                  [--saves-only]
//!                                              a local tier under a slow store vs saving to it directly
//! ```

use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use ckpt_recovery::peer::PeerLink;
use ckpt_store::direct::AlignedBuf;
use ckpt_store::{
    BlobIn, CodecPolicy, DType, DedupIndex, Layout, NdBox, RankWrite, ShardDesc, ShardIn, Store,
    StoreConfig,
};
use ckpt_tests::restore_bench::status_kib;
use ckpt_trainer::workload::{ModelConfig, RankState, TrainConfig};
use ckpt_trainer::{CheckpointManager, CheckpointerConfig, HostTensor, ManagerConfig, runtime};
use serde_json::{Value, json};

/// The store's request layers as the environment sets them (`CKPT_STORE_RETRY`,
/// `CKPT_FAULTS`): read here, at the binary's edge, and handed to the library.
#[allow(
    clippy::disallowed_methods,
    reason = "a binary reads its settings from the environment"
)]
fn open_options() -> ckpt_store::OpenOptions {
    let var = |k| std::env::var(k).ok();
    ckpt_store::OpenOptions::from_values(
        var(ckpt_store::url::RETRY_ENV).as_deref(),
        var(ckpt_store::url::FAULTS_ENV).as_deref(),
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

#[path = "../governor.rs"]
mod governor;
#[path = "../versions.rs"]
mod versions;

#[path = "../delta_bench.rs"]
mod delta_bench;

#[path = "../delta_physics.rs"]
mod delta_physics;

#[path = "../sentinel_bench.rs"]
mod sentinel_bench;
#[path = "../tiers_bench.rs"]
mod tiers_bench;

fn emit(v: Value) {
    println!("{v}");
}

fn gbps(bytes: u64, s: f64) -> f64 {
    bytes as f64 / s / 1e9
}

fn arg(args: &[String], name: &str, default: &str) -> String {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| default.to_string())
}

// ----- limits ------------------------------------------------------------------------------

fn memcpy_warm(bytes: usize, threads: usize) -> f64 {
    let src = vec![7u8; bytes];
    let mut dst = vec![1u8; bytes];
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        let per = bytes.div_ceil(threads);
        std::thread::scope(|s| {
            for (d, c) in dst.chunks_mut(per).zip(src.chunks(per)) {
                s.spawn(move || d.copy_from_slice(c));
            }
        });
        best = best.min(t.elapsed().as_secs_f64());
    }
    std::hint::black_box(&dst);
    gbps(bytes as u64, best)
}

fn blake3_raw(data: &[u8], threads: usize) -> f64 {
    hash_rate(data, threads, |c| {
        std::hint::black_box(blake3::hash(c));
    })
}

/// The rate of `hash` over `data` in 4 MiB chunks on `threads` threads (best of three).
fn hash_rate(data: &[u8], threads: usize, hash: fn(&[u8])) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        let per = (4 << 20) as usize;
        let chunks: Vec<&[u8]> = data.chunks(per).collect();
        let n = chunks.len().div_ceil(threads);
        std::thread::scope(|s| {
            for part in chunks.chunks(n) {
                s.spawn(move || {
                    for c in part {
                        hash(c);
                    }
                });
            }
        });
        best = best.min(t.elapsed().as_secs_f64());
    }
    gbps(data.len() as u64, best)
}

/// A new, empty file at `path` (any old one removed) opened for `O_DIRECT` writes.
fn odirect_create(path: &Path) -> std::fs::File {
    let _ = std::fs::remove_file(path);
    OpenOptions::new()
        .create(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .unwrap()
}

/// At most this many distinct bytes are the source of a write limit (beyond it they repeat).
const UNIQUE_SOURCE: usize = 1 << 30;

/// `len` bytes (at most [`UNIQUE_SOURCE`]) of random-looking content at an aligned address:
/// the source of a write limit. A checkpoint writes bytes that differ and that no cache holds;
/// this disk writes one 4 MiB buffer over and over up to 1.57x (median 1.24x) as fast as as
/// many distinct bytes (BENCHMARKS.md, "The write limit, measured with the bytes a save
/// writes"), so a limit written from one buffer would hold the save to a rate no save can have.
fn unique_source(len: usize) -> AlignedBuf {
    let len = len.clamp(1, UNIQUE_SOURCE);
    let mut buf = AlignedBuf::zeroed(len);
    blake3::Hasher::new()
        .update(b"ckpt-bench write limit")
        .finalize_xof()
        .fill(buf.full_mut());
    buf
}

/// O_DIRECT sequential write of `bytes` into one file with `qd` threads of `bs` requests, each
/// request from its own place of a [`unique_source`].
fn odirect_write(path: &Path, bytes: usize, qd: usize, bs: usize) -> f64 {
    let src = unique_source(bytes.max(bs));
    odirect_write_from(path, bytes, qd, bs, &src)
}

/// [`odirect_write`] from `src`, its blocks taken in turn (a source of one block writes the
/// same bytes every time).
fn odirect_write_from(path: &Path, bytes: usize, qd: usize, bs: usize, src: &AlignedBuf) -> f64 {
    let f = odirect_create(path);
    f.set_len(bytes as u64).unwrap();
    let blocks = (src.capacity() / bs).max(1);
    let t = Instant::now();
    let n = bytes / bs;
    std::thread::scope(|s| {
        for k in 0..qd {
            let f = &f;
            s.spawn(move || {
                let mut i = k;
                while i < n {
                    let at = (i % blocks) * bs;
                    f.write_all_at(&src[at..at + bs], (i * bs) as u64).unwrap();
                    i += qd;
                }
            });
        }
    });
    f.sync_data().unwrap();
    gbps((n * bs) as u64, t.elapsed().as_secs_f64())
}

/// GB/s of an `O_DIRECT` read of the file `path`, `qd` requests of `bs` bytes in flight.
fn odirect_read(path: &Path, qd: usize, bs: usize) -> f64 {
    let read = std::fs::metadata(path).unwrap().len() / bs as u64 * bs as u64;
    gbps(
        read,
        ckpt_tests::restore_bench::odirect_read_file(path, qd, bs),
    )
}

/// io_uring O_DIRECT writes, `qd` in flight, one file.
fn io_uring_write(path: &Path, bytes: usize, qd: usize, bs: usize) -> f64 {
    use io_uring::{IoUring, opcode, types};
    use std::os::fd::AsRawFd;
    let f = odirect_create(path);
    let mut ring = IoUring::new(qd as u32 * 2).unwrap();
    let src = unique_source(bytes.max(bs));
    let blocks = (src.capacity() / bs).max(1);
    let n = bytes / bs;
    let t = Instant::now();
    let (mut next, mut done, mut inflight) = (0usize, 0usize, 0usize);
    while done < n {
        while inflight < qd && next < n {
            let at = (next % blocks) * bs;
            let b = &src[at..at + bs];
            let e = opcode::Write::new(types::Fd(f.as_raw_fd()), b.as_ptr(), bs as u32)
                .offset((next * bs) as u64)
                .build()
                .user_data(next as u64);
            // SAFETY: the source outlives the request (we wait for every completion below).
            unsafe { ring.submission().push(&e).unwrap() };
            next += 1;
            inflight += 1;
        }
        ring.submit_and_wait(1).unwrap();
        for c in ring.completion() {
            assert!(c.result() >= 0, "io_uring write failed: {}", c.result());
            done += 1;
            inflight -= 1;
        }
    }
    f.sync_data().unwrap();
    gbps((n * bs) as u64, t.elapsed().as_secs_f64())
}

/// `count` objects of `size` bytes through an ObjectStore with 8 puts in flight, each object
/// its own bytes (a [`unique_source`]).
fn backend_puts(store: Arc<dyn ckpt_store::ObjectStore>, count: usize, size: usize) -> f64 {
    let src = Bytes::from_owner(unique_source(count * size));
    backend_puts_of(store, count, |i| vec![object_of(&src, i, size, 0)])
}

/// Puts of chunk objects as a save writes them: a 16-byte header, then the payload where the
/// staging pool puts it (16 bytes past an aligned address), so `DirectFs` writes it uncopied.
fn chunk_puts(store: Arc<dyn ckpt_store::ObjectStore>, count: usize, size: usize) -> f64 {
    let lead = ckpt_trainer::staging::LEAD;
    // Aligned + `lead` for every object: each starts `lead` past a multiple of its size.
    let src = Bytes::from_owner(unique_source(count * size + lead));
    let header = Bytes::from(vec![0u8; ckpt_store::codec::HEADER_LEN]);
    backend_puts_of(store, count, |i| {
        vec![header.clone(), object_of(&src, i, size, lead)]
    })
}

/// The `i`th object of `size` bytes of `src` (`lead` bytes past its place), the source's
/// objects taken in turn.
fn object_of(src: &Bytes, i: usize, size: usize, lead: usize) -> Bytes {
    let at = i % ((src.len() - lead) / size).max(1) * size + lead;
    src.slice(at..at + size)
}

fn backend_puts_of(
    store: Arc<dyn ckpt_store::ObjectStore>,
    count: usize,
    parts: impl Fn(usize) -> Vec<Bytes>,
) -> f64 {
    use ckpt_store::ObjectStoreExt;
    let size: usize = parts(0).iter().map(Bytes::len).sum();
    let t = Instant::now();
    runtime().block_on(async {
        use futures::StreamExt;
        futures::stream::iter(0..count)
            .map(|i| {
                let s = store.clone();
                let d: ckpt_store::object_store::PutPayload = parts(i).into_iter().collect();
                async move {
                    s.put(
                        &ckpt_store::object_store::path::Path::from(format!("b/{i:06}")),
                        d,
                    )
                    .await
                    .unwrap();
                }
            })
            .buffer_unordered(8)
            .collect::<Vec<_>>()
            .await;
    });
    gbps((count * size) as u64, t.elapsed().as_secs_f64())
}

fn limits(dir: &Path, gib: f64) -> Value {
    let bytes = ((gib * (1u64 << 30) as f64) as usize) / (8 << 20) * (8 << 20);
    std::fs::create_dir_all(dir).unwrap();
    let f = dir.join("limits.bin");
    let data = ckpt_store::testing::det_bytes(1, 1 << 30);
    let mut zeros = data.clone();
    zeros.fill(0);
    let chunk_id = |c: &[u8]| {
        std::hint::black_box(ckpt_store::ChunkId::of(c));
    };
    let v = json!({
        "bench": "limits", "bytes": bytes,
        "memcpy_warm_1t_gbps": memcpy_warm(1 << 30, 1),
        "memcpy_warm_2t_gbps": memcpy_warm(1 << 30, 2),
        "blake3_1t_gbps": blake3_raw(&data, 1),
        "blake3_2t_gbps": blake3_raw(&data, 2),
        // A chunk's id (`ChunkId::of`) of distinct bytes, and of zeros (whose hash is
        // remembered by length: one read of memory).
        "chunk_id_1t_gbps": hash_rate(&data, 1, chunk_id),
        "chunk_id_zeros_1t_gbps": hash_rate(&zeros, 1, chunk_id),
        "odirect_write_qd8_4m_gbps": odirect_write(&f, bytes, 8, 4 << 20),
        "odirect_read_qd8_4m_gbps": odirect_read(&f, 8, 4 << 20),
        "odirect_write_qd1_4m_gbps": odirect_write(&f, bytes, 1, 4 << 20),
        // The same write from one 4 MiB buffer (what these limits were before 2026-12-06).
        "odirect_write_qd8_4m_one_buffer_gbps": odirect_write_from(&f, bytes, 8, 4 << 20, &unique_source(4 << 20)),
    });
    let _ = std::fs::remove_file(&f);
    v
}

fn backends(dir: &Path, gib: f64) -> Value {
    let size = 4 << 20;
    let count = ((gib * (1u64 << 30) as f64) as usize) / size;
    let lfs = dir.join("lfs");
    let dfs = dir.join("dfs");
    for d in [&lfs, &dfs] {
        let _ = std::fs::remove_dir_all(d);
        std::fs::create_dir_all(d).unwrap();
    }
    let f = dir.join("uring.bin");
    let v = json!({
        "bench": "backends", "objects": count, "object_bytes": size,
        "object_store_local_fsync_gbps": backend_puts(Arc::new(ckpt_store::object_store::local::LocalFileSystem::new_with_prefix(&lfs).unwrap().with_fsync(true)), count, size),
        "object_store_local_nofsync_gbps": backend_puts(Arc::new(ckpt_store::object_store::local::LocalFileSystem::new_with_prefix(&lfs).unwrap()), count, size),
        "directfs_gbps": backend_puts(Arc::new(ckpt_store::DirectFs::new(&dfs).unwrap()), count, size),
        "directfs_16mib_gbps": backend_puts(Arc::new(ckpt_store::DirectFs::new(dir.join("dfs16")).unwrap()), count / 4, size * 4),
        "directfs_chunks_gbps": chunk_puts(Arc::new(ckpt_store::DirectFs::new(dir.join("dfsc")).unwrap()), count, size),
        "io_uring_one_file_qd8_gbps": io_uring_write(&f, count * size, 8, size),
        "threads_one_file_qd8_gbps": odirect_write(&f, count * size, 8, size),
    });
    let _ = std::fs::remove_dir_all(&lfs);
    let _ = std::fs::remove_dir_all(&dfs);
    let _ = std::fs::remove_dir_all(dir.join("dfs16"));
    let _ = std::fs::remove_dir_all(dir.join("dfsc"));
    let _ = std::fs::remove_file(&f);
    v
}

// ----- store -------------------------------------------------------------------------------

/// A training state's bytes: bf16 weights N(0, 0.02), and fp32 master, exp_avg, exp_avg_sq.
struct Synth {
    parts: Vec<(String, DType, Bytes)>,
}

fn synth(total: usize) -> Synth {
    let params = total / 14;
    let mut s = 0x1234_5678_9abc_def0u64;
    let mut normal = move || {
        let mut u = [0f64; 2];
        for x in &mut u {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            *x = ((s >> 11) as f64 / (1u64 << 53) as f64).max(1e-300);
        }
        (-2.0 * u[0].ln()).sqrt() * (2.0 * std::f64::consts::PI * u[1]).cos()
    };
    let mut w = Vec::with_capacity(params * 2);
    let mut master = Vec::with_capacity(params * 4);
    let mut m = Vec::with_capacity(params * 4);
    let mut v = Vec::with_capacity(params * 4);
    for _ in 0..params {
        let x = (normal() * 0.02) as f32;
        master.extend_from_slice(&x.to_le_bytes());
        w.extend_from_slice(&ckpt_trainer::workload::to_bf16(x).to_le_bytes());
        let g = (normal() * 1e-3) as f32;
        m.extend_from_slice(&g.to_le_bytes());
        v.extend_from_slice(&(g * g * 0.9 + 1e-9).to_le_bytes());
    }
    Synth {
        parts: vec![
            ("weights.bf16".into(), DType::Bf16, Bytes::from(w)),
            ("master.f32".into(), DType::F32, Bytes::from(master)),
            ("exp_avg.f32".into(), DType::F32, Bytes::from(m)),
            ("exp_avg_sq.f32".into(), DType::F32, Bytes::from(v)),
        ],
    }
}

fn codec_table(s: &Synth) -> Vec<Value> {
    let mut out = Vec::new();
    for (name, dt, data) in &s.parts {
        let sample = Bytes::copy_from_slice(&data[..data.len().min(64 << 20)]);
        let chunks: Vec<Bytes> = (0..sample.len())
            .step_by(4 << 20)
            .map(|i| sample.slice(i..(i + (4 << 20)).min(sample.len())))
            .collect();
        for (label, elem, policy) in [
            ("planes zstd-1", dt.size(), CodecPolicy::FAST),
            (
                "planes zstd-3",
                dt.size(),
                CodecPolicy::Compress {
                    level: 3,
                    min_saving_permille: 20,
                },
            ),
            ("plain zstd-1", 1, CodecPolicy::FAST),
        ] {
            let t = Instant::now();
            let enc: Vec<_> = chunks
                .iter()
                .map(|c| ckpt_store::codec::encode(c, elem, policy))
                .collect();
            let ct = t.elapsed().as_secs_f64();
            let stored: usize = enc.iter().map(|e| e.len()).sum();
            let objs: Vec<Bytes> = enc.iter().map(|e| e.to_bytes()).collect();
            let t = Instant::now();
            for (o, c) in objs.iter().zip(&chunks) {
                let id = ckpt_store::ChunkId::of(c);
                std::hint::black_box(
                    ckpt_store::codec::decode(o, &id, c.len() as u64, &"bench").unwrap(),
                );
            }
            let dt_s = t.elapsed().as_secs_f64();
            out.push(json!({
                "bench": "codec", "data": name, "codec": label,
                "ratio": stored as f64 / sample.len() as f64,
                "compress_mbps": sample.len() as f64 / ct / 1e6,
                "decode_and_verify_mbps": sample.len() as f64 / dt_s / 1e6,
            }));
        }
    }
    out
}

/// Save the synthetic state as 4 ranks (each a quarter of every tensor) and time it.
fn save4(
    store: &Store,
    run: &str,
    step: u64,
    s: &Synth,
    indexes: &[Arc<DedupIndex>],
    commit: bool,
) -> (f64, u64, u64) {
    let layout = Layout::new(4, 1, 1, 0).unwrap();
    let t = Instant::now();
    let res: Vec<_> = runtime().block_on(async {
        let mut hs = Vec::new();
        for rank in 0..4u32 {
            let mut shards = Vec::new();
            for (name, dt, data) in &s.parts {
                let n = (data.len() / dt.size()) as u64;
                let part = n / 4;
                let lo = part * rank as u64;
                let hi = if rank == 3 { n } else { lo + part };
                // A slice of the state, as a snapshot in staging would be: no copy.
                let b = data.slice((lo as usize) * dt.size()..(hi as usize) * dt.size());
                shards.push(ShardIn {
                    shard: ShardDesc::boxed(
                        name.clone(),
                        *dt,
                        vec![n],
                        NdBox::new(vec![lo], vec![hi - lo]).unwrap(),
                    ),
                    data: Some(b),
                });
            }
            let store = store.clone();
            let idx = indexes[rank as usize].clone();
            let w = RankWrite::new(run, step, rank, layout);
            hs.push(tokio::spawn(async move {
                store
                    .write_rank(
                        &w,
                        shards,
                        vec![BlobIn {
                            name: "rng".into(),
                            data: Bytes::from_static(b"rng"),
                        }],
                        &idx,
                    )
                    .await
                    .unwrap()
            }));
        }
        let mut out = Vec::new();
        for h in hs {
            out.push(h.await.unwrap());
        }
        if commit {
            store.log().commit_step(run, step).await.unwrap();
        }
        out
    });
    let secs = t.elapsed().as_secs_f64();
    let written: u64 = res.iter().map(|r| r.2.bytes_written).sum();
    let logical: u64 = res.iter().map(|r| r.0.stats.logical_bytes).sum();
    (secs, written, logical)
}

fn rss_peak_kib() -> u64 {
    status_kib("VmHWM:")
}

fn rss_now_kib() -> u64 {
    status_kib("VmRSS:")
}

fn reset_peak() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

#[allow(
    clippy::disallowed_methods,
    reason = "a binary reads its settings from the environment"
)]
fn store_bench(dir: &Path, gib: f64) {
    let total = (gib * (1u64 << 30) as f64) as usize;
    let s = synth(total);
    let bytes: usize = s.parts.iter().map(|p| p.2.len()).sum();
    if std::env::var("CKPT_BENCH_VARIANTS").is_err() {
        for v in codec_table(&s) {
            emit(v);
        }
    }
    let disk_w = odirect_write(
        &dir.join("limit.bin"),
        bytes / (8 << 20) * (8 << 20),
        8,
        4 << 20,
    );
    let _ = std::fs::remove_file(dir.join("limit.bin"));
    let variants: Vec<(&str, CodecPolicy, bool, usize, usize)> =
        match std::env::var("CKPT_BENCH_VARIANTS").as_deref() {
            Ok("io") => vec![
                ("raw 4MiB x8", CodecPolicy::Raw, false, 4 << 20, 8),
                ("raw 8MiB x8", CodecPolicy::Raw, false, 8 << 20, 8),
                ("raw 4MiB x16", CodecPolicy::Raw, false, 4 << 20, 16),
                ("raw 16MiB x8", CodecPolicy::Raw, false, 16 << 20, 8),
            ],
            _ => vec![
                ("adaptive (default)", CodecPolicy::FAST, true, 4 << 20, 8),
                ("raw", CodecPolicy::Raw, false, 4 << 20, 8),
                ("always zstd-1 planes", CodecPolicy::FAST, false, 4 << 20, 8),
            ],
        };
    for (label, policy, adaptive, chunk, writers) in variants {
        let d = dir.join(format!("store-{}", label.replace(' ', "_")));
        let _ = std::fs::remove_dir_all(&d);
        let cfg = StoreConfig {
            codec: policy,
            adaptive_codec: adaptive,
            chunk_size: chunk,
            write_concurrency: writers,
            inflight_bytes: (256 << 20).max(chunk * writers * 2 + (16 << 20)),
            ..StoreConfig::default()
        };
        let store = ckpt_store::open_with(d.to_str().unwrap(), &open_options())
            .unwrap()
            .with_config(cfg.clone())
            .unwrap();
        let idx: Vec<Arc<DedupIndex>> = (0..4).map(|_| Arc::new(DedupIndex::new())).collect();
        reset_peak();
        let base = rss_now_kib();
        let (t1, w1, logical) = save4(&store, "b", 1, &s, &idx, true);
        let peak = rss_peak_kib().saturating_sub(base);
        let (t2, w2, _) = save4(&store, "b", 2, &s, &idx, true);
        emit(json!({
            "bench": "save", "codec": label, "bytes": logical, "seconds": t1,
            "gbps": gbps(logical, t1), "disk_odirect_write_gbps": disk_w,
            "ratio_to_disk": gbps(logical, t1) / disk_w,
            "stored_ratio": w1 as f64 / logical as f64,
            "second_save_seconds": t2, "second_save_bytes_written": w2,
            "second_over_first": t2 / t1,
            "extra_rss_mib": peak / 1024, "inflight_budget_mib": cfg.inflight_bytes >> 20,
        }));
        let _ = std::fs::remove_dir_all(&d);
    }
    // Hashing inside the pipeline: a store that discards writes, no compression.
    let null = Store::new(Arc::new(NullStore), Default::default(), "null://")
        .with_config(StoreConfig {
            codec: CodecPolicy::Raw,
            adaptive_codec: false,
            ..StoreConfig::default()
        })
        .unwrap();
    let idx: Vec<Arc<DedupIndex>> = (0..4).map(|_| Arc::new(DedupIndex::new())).collect();
    let (t, _, logical) = save4(&null, "n", 1, &s, &idx, false);
    let all: Vec<u8> = s
        .parts
        .iter()
        .flat_map(|p| p.2.iter().copied())
        .take(1 << 30)
        .collect();
    let raw2 = blake3_raw(&all, 2);
    emit(json!({
        "bench": "pipeline_hash", "bytes": logical, "pipeline_gbps": gbps(logical, t),
        "blake3_raw_2t_gbps": raw2, "ratio": gbps(logical, t) / raw2,
        "note": "write_rank into a store that discards writes: copy-free slicing, hashing on the blocking pool, raw codec",
    }));
}

/// An ObjectStore that accepts and discards every write (for the pipeline-hashing figure).
#[derive(Debug)]
struct NullStore;

impl std::fmt::Display for NullStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NullStore")
    }
}

#[async_trait::async_trait]
impl ckpt_store::ObjectStore for NullStore {
    async fn put_opts(
        &self,
        _: &ckpt_store::object_store::path::Path,
        _: ckpt_store::object_store::PutPayload,
        _: ckpt_store::object_store::PutOptions,
    ) -> ckpt_store::object_store::Result<ckpt_store::object_store::PutResult> {
        Ok(ckpt_store::object_store::PutResult {
            e_tag: None,
            version: None,
            extensions: Default::default(),
        })
    }
    async fn put_multipart_opts(
        &self,
        _: &ckpt_store::object_store::path::Path,
        _: ckpt_store::object_store::PutMultipartOptions,
    ) -> ckpt_store::object_store::Result<Box<dyn ckpt_store::object_store::MultipartUpload>> {
        Err(ckpt_store::object_store::Error::NotImplemented {
            operation: "multipart".into(),
            implementer: "NullStore".into(),
        })
    }
    async fn get_opts(
        &self,
        p: &ckpt_store::object_store::path::Path,
        _: ckpt_store::object_store::GetOptions,
    ) -> ckpt_store::object_store::Result<ckpt_store::object_store::GetResult> {
        // Manifests are re-read by the committer: keep nothing, so commits are skipped.
        Err(ckpt_store::object_store::Error::NotFound {
            path: p.to_string(),
            source: "null store".into(),
        })
    }
    fn delete_stream(
        &self,
        s: futures::stream::BoxStream<
            'static,
            ckpt_store::object_store::Result<ckpt_store::object_store::path::Path>,
        >,
    ) -> futures::stream::BoxStream<
        'static,
        ckpt_store::object_store::Result<ckpt_store::object_store::path::Path>,
    > {
        s
    }
    fn list(
        &self,
        _: Option<&ckpt_store::object_store::path::Path>,
    ) -> futures::stream::BoxStream<
        'static,
        ckpt_store::object_store::Result<ckpt_store::object_store::ObjectMeta>,
    > {
        use futures::StreamExt;
        futures::stream::empty().boxed()
    }
    async fn list_with_delimiter(
        &self,
        _: Option<&ckpt_store::object_store::path::Path>,
    ) -> ckpt_store::object_store::Result<ckpt_store::object_store::ListResult> {
        Ok(ckpt_store::object_store::ListResult {
            common_prefixes: vec![],
            objects: vec![],
            extensions: Default::default(),
        })
    }
    async fn copy_opts(
        &self,
        _: &ckpt_store::object_store::path::Path,
        _: &ckpt_store::object_store::path::Path,
        _: ckpt_store::object_store::CopyOptions,
    ) -> ckpt_store::object_store::Result<()> {
        Ok(())
    }
}

// ----- train -------------------------------------------------------------------------------

fn managers(
    store: &Store,
    run: &str,
    layout: Layout,
    ranks: &[RankState],
    prefault: bool,
    generation: u64,
) -> Vec<CheckpointManager> {
    managers_with(store, run, layout, ranks, prefault, generation, &|_| None)
}

/// [`managers`] with a peer-replica link per rank.
fn managers_with(
    store: &Store,
    run: &str,
    layout: Layout,
    ranks: &[RankState],
    prefault: bool,
    generation: u64,
    link: &dyn Fn(u32) -> Option<PeerLink>,
) -> Vec<CheckpointManager> {
    ranks
        .iter()
        .map(|r| {
            // Staging sized automatically to one snapshot, allocated and touched up front
            // when `prefault` (as a long-running job would, outside its first save).
            let mut c = CheckpointerConfig::new(run, r.rank, layout);
            c.generation = generation;
            c.peer = link(r.rank);
            c.copy_threads = 2;
            let mut mc = ManagerConfig::new(c);
            mc.final_on_sigterm = false;
            let mut m = CheckpointManager::new(store.clone(), mc).unwrap();
            r.register(&mut m).unwrap();
            if prefault {
                let st = m.save_state().unwrap();
                m.checkpointer().prepare_staging(&st, true);
            }
            m
        })
        .collect()
}

/// One checkpoint of every rank: (stall = save() until every snapshot is taken, time until
/// committed).
fn checkpoint(mgrs: &mut [CheckpointManager], step: u64) -> (f64, f64) {
    let t = Instant::now();
    let hs: Vec<_> = mgrs.iter_mut().map(|m| m.save_now(step).unwrap()).collect();
    for h in &hs {
        h.wait_snapshot().unwrap();
    }
    let stall = t.elapsed().as_secs_f64();
    for h in &hs {
        h.wait_persisted().unwrap();
    }
    hs[0].wait_committed(Duration::from_secs(600)).unwrap();
    (stall, t.elapsed().as_secs_f64())
}

/// The reference workload's ranks under `layout` (a model of `params` parameters split over
/// `world` ranks), their total state, and an empty local store at `dir/name`.
fn bench_job(
    dir: &Path,
    name: &str,
    params: u64,
    layout: Layout,
    seed: u64,
) -> (ModelConfig, TrainConfig, Vec<RankState>, u64, Store) {
    let model = ModelConfig::for_params(params, layout.world());
    let train = TrainConfig {
        seed,
        lr: 1e-3,
        frozen: 0.0,
    };
    let ranks = fresh_ranks(model, train, layout);
    let state: u64 = ranks.iter().map(|r| r.held_bytes()).sum();
    let d = dir.join(name);
    let _ = std::fs::remove_dir_all(&d);
    let store = ckpt_store::open_with(d.to_str().unwrap(), &open_options()).unwrap();
    (model, train, ranks, state, store)
}

/// New ranks of `layout`, as a restarted process has them before it restores: model and
/// optimizer built, their memory touched (one optimizer step, as initialization would).
fn touched_ranks(model: ModelConfig, train: TrainConfig, layout: Layout) -> Vec<RankState> {
    let ranks = fresh_ranks(model, train, layout);
    std::thread::scope(|sc| {
        for r in &ranks {
            sc.spawn(move || r.update(1, 1, 1.0));
        }
    });
    ranks
}

/// Every manager restores `step` at once (ranks as threads): seconds, and the store's
/// requests and bytes meanwhile.
fn timed_restore(
    store: &Store,
    mgrs: &mut [CheckpointManager],
    step: u64,
) -> (f64, ckpt_store::MetricsSnapshot) {
    let before = store.metrics().unwrap().snapshot();
    let t = Instant::now();
    std::thread::scope(|s| {
        for m in mgrs.iter_mut() {
            s.spawn(move || m.restore(step).unwrap());
        }
    });
    let secs = t.elapsed().as_secs_f64();
    (secs, store.metrics().unwrap().snapshot() - before)
}

fn fresh_ranks(model: ModelConfig, train: TrainConfig, layout: Layout) -> Vec<RankState> {
    (0..layout.world())
        .map(|r| RankState::new(model, train, layout, r).unwrap())
        .collect()
}

/// One training step of every rank (ranks as threads): forward/backward (reads), optimizer
/// (writes). Seconds.
fn step_time(ranks: &[RankState], s: u64) -> f64 {
    let t = Instant::now();
    std::thread::scope(|sc| {
        for r in ranks {
            sc.spawn(move || {
                std::hint::black_box(r.partial_loss(s, 1.0));
                r.update(s, s, 1.0);
            });
        }
    });
    t.elapsed().as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The first save of a job against its steady saves, with its staging filled in the
/// background from the first step the managers are told of (`background`: the manager's
/// default, `CheckpointerConfig::background_prefault`) or not: the first save's stall over the steady
/// stall, and the training steps before the first save (their time is what the background
/// fill may slow). One mode per process, so both start from the same fresh memory.
fn startup_bench(dir: &Path, params: u64, background: bool, steps: u64) {
    let layout: Layout = "dp=1,tp=2,pp=2".parse().unwrap();
    let (model, _, ranks, state, store) = bench_job(dir, "startup-store", params, layout, 3);
    // The ranks' own memory touched first, as initialization would.
    step_time(&ranks, 1);
    step_time(&ranks, 2);
    // As `managers` makes them, with the background fill on or off.
    let mut mgrs: Vec<CheckpointManager> = ranks
        .iter()
        .map(|r| {
            let mut c = CheckpointerConfig::new("s", r.rank, layout);
            c.copy_threads = 2;
            c.background_prefault = background;
            let mut mc = ManagerConfig::new(c);
            mc.final_on_sigterm = false;
            // An interval (its first checkpoint long after these steps): a manager that
            // can never save keeps no staging.
            mc.every_steps = Some(1 << 20);
            let mut m = CheckpointManager::new(store.clone(), mc).unwrap();
            r.register(&mut m).unwrap();
            m
        })
        .collect();
    let t0 = Instant::now();
    // Each step is told to the managers, as a training loop does (no checkpoint is due):
    // the first call sizes each rank's staging and fills it in the background.
    let times: Vec<f64> = (3..3 + steps)
        .map(|s| {
            for m in &mut mgrs {
                assert!(m.maybe_save(s).unwrap().is_none(), "no checkpoint is due");
            }
            step_time(&ranks, s)
        })
        .collect();
    let staged: usize = mgrs
        .iter()
        .map(|m| m.checkpointer().staging().allocated)
        .sum();
    let until_save = t0.elapsed().as_secs_f64();
    let s = 3 + steps;
    let (stall1, _) = checkpoint(&mut mgrs, s);
    step_time(&ranks, s + 1);
    let (stall2, _) = checkpoint(&mut mgrs, s + 2);
    step_time(&ranks, s + 3);
    let (stall3, _) = checkpoint(&mut mgrs, s + 4);
    let steady = (stall2 + stall3) / 2.0;
    let capacity: usize = mgrs
        .iter()
        .map(|m| m.checkpointer().staging().capacity)
        .sum();
    emit(json!({
        "bench": "startup", "background_prefault": background, "state_bytes": state,
        "params": model.param_count(), "layout": layout.to_string(),
        "steps_before_first_save": steps, "step_median_s": median(times.clone()),
        "step_mean_s": times.iter().sum::<f64>() / times.len().max(1) as f64,
        "step_times_s": times, "start_to_first_save_s": until_save,
        "staging_filled_at_first_save": staged as f64 / capacity.max(1) as f64,
        "stall_first_s": stall1, "stall_steady_s": steady,
        "stall_first_over_steady": stall1 / steady,
    }));
}

fn train_bench(dir: &Path, params: u64) {
    let layout: Layout = "dp=1,tp=2,pp=2".parse().unwrap();
    let (model, train, ranks, state, store) = bench_job(dir, "train-store", params, layout, 3);
    let memcpy = memcpy_warm(state as usize, 1);
    let memcpy2 = memcpy_warm(state as usize, 2);
    let disk_w = odirect_write(
        &dir.join("limit.bin"),
        state as usize / (8 << 20) * (8 << 20),
        8,
        4 << 20,
    );
    // (The read limit is measured again right before each restore: the disk is shared.)
    let mut mgrs = managers(&store, "t", layout, &ranks, false, 0);
    // Steps: forward/backward (reads), optimizer (writes); checkpoints at steps 1, 2, 3.
    let base_step = step_time(&ranks, 1);
    let (stall1, commit1) = checkpoint(&mut mgrs, 1);
    // The first save of a job that prefaulted its staging at start.
    let mut pre = managers(&store, "t-pre", layout, &ranks, true, 0);
    let (stall1_pre, _) = checkpoint(&mut pre, 1);
    drop(pre);
    step_time(&ranks, 2);
    // Memory of steady-state saves beyond the state itself: staging (allocated by the first
    // save) plus what persisting holds.
    let rss0 = rss_now_kib();
    reset_peak();
    let staging0: usize = mgrs
        .iter()
        .map(|m| m.checkpointer().staging().allocated)
        .sum();
    let (stall2, commit2) = checkpoint(&mut mgrs, 2);
    step_time(&ranks, 3);
    let (stall3, commit3) = checkpoint(&mut mgrs, 3);
    let steady_extra = rss_peak_kib().saturating_sub(rss0) * 1024;
    // Overlapped: save, then the next step right away (its reads overlap the copy; its
    // optimizer writes wait only for tensors not yet copied). Stall = extra time of that step.
    let quiet = step_time(&ranks, 4);
    let t = Instant::now();
    let hs: Vec<_> = mgrs.iter_mut().map(|m| m.save_now(4).unwrap()).collect();
    let call = t.elapsed().as_secs_f64();
    let overlapped_step = step_time(&ranks, 5);
    let overlap_stall = call + (overlapped_step - quiet).max(0.0);
    for h in &hs {
        h.wait_persisted().unwrap();
    }
    hs[0].wait_committed(Duration::from_secs(600)).unwrap();
    // Training slowed by a background persist: step times while a persist is in flight.
    let hs: Vec<_> = mgrs.iter_mut().map(|m| m.save_now(6).unwrap()).collect();
    for h in &hs {
        h.wait_snapshot().unwrap();
    }
    let during = step_time(&ranks, 7);
    let persisting = hs
        .iter()
        .any(|h| matches!(h.stage(), ckpt_trainer::Stage::Snapshotted));
    for h in &hs {
        h.wait_persisted().unwrap();
    }
    hs[0].wait_committed(Duration::from_secs(600)).unwrap();
    let after = step_time(&ranks, 8);
    let staging: usize = mgrs
        .iter()
        .map(|m| m.checkpointer().staging().capacity)
        .sum();
    emit(json!({
        "bench": "train_save", "state_bytes": state, "params": model.param_count(), "layout": layout.to_string(),
        "memcpy_warm_1t_gbps": memcpy, "memcpy_warm_2t_gbps": memcpy2, "memcpy_state_s": state as f64 / memcpy / 1e9,
        "stall_first_s": stall1, "stall_first_prefaulted_s": stall1_pre, "stall_steady_s": (stall2 + stall3) / 2.0,
        "stall_first_over_memcpy": stall1 / (state as f64 / memcpy / 1e9),
        "stall_steady_over_memcpy": (stall2 + stall3) / 2.0 / (state as f64 / memcpy / 1e9),
        "stall_overlapped_s": overlap_stall, "step_s": quiet,
        "committed_first_s": commit1, "committed_steady_s": (commit2 + commit3) / 2.0,
        "disk_odirect_write_gbps": disk_w, "disk_write_state_s": state as f64 / disk_w / 1e9,
        "committed_over_disk": (commit2 + commit3) / 2.0 / (state as f64 / disk_w / 1e9),
        "step_during_persist_s": during, "step_after_s": after, "persist_in_flight": persisting,
        "slowdown": during / after.min(base_step),
        "staging_bytes": staging, "staging_over_state": staging as f64 / state as f64,
        "steady_save_rss_growth_bytes": steady_extra, "staging_allocated_before_bytes": staging0,
        "rss_over_state_plus_staging": (state as f64 + staging0 as f64 + steady_extra as f64) / (state as f64 + staging as f64),
    }));
    drop(mgrs);
    // Restore, same layout and another (tp=4), into fresh states.
    for (label, l) in [
        ("same layout", layout),
        (
            "tp=2,pp=2 -> dp=2,tp=2 (zero=1)",
            "dp=2,tp=2,pp=1,zero=1".parse().unwrap(),
        ),
        ("tp=2,pp=2 -> tp=4", "tp=4".parse().unwrap()),
    ] {
        let fresh = touched_ranks(model, train, l);
        let needed: u64 = fresh.iter().map(|r| r.held_bytes()).sum();
        let mut mg = managers(&store, "t", l, &fresh, false, 1);
        let disk_r = odirect_read(&dir.join("limit.bin"), 8, 4 << 20);
        let (secs, used) = timed_restore(&store, &mut mg, 6);
        emit(json!({
            "bench": "restore", "layout": label, "bytes_needed": needed, "seconds": secs,
            "gbps": gbps(needed, secs), "bytes_read": used.get_bytes,
            "read_over_needed": used.get_bytes as f64 / needed as f64,
            "disk_odirect_read_gbps": disk_r, "over_disk_read": secs / (needed as f64 / disk_r / 1e9),
            "over_disk_read_of_bytes_read": secs / (used.get_bytes as f64 / disk_r / 1e9),
        }));
    }
    let _ = std::fs::remove_file(dir.join("limit.bin"));
    let _ = std::fs::remove_dir_all(dir.join("train-store"));
}

/// Recovery timings: `ckpt-train` under the supervisor on 4 nodes, one rank killed (SIGKILL)
/// or stopped (SIGSTOP) after the second checkpoint; the recovery log gives detection,
/// decision, restart and the first step after it.
fn recovery_bench(dir: &Path, params: &str, how: &str, read_gbps: f64) {
    use ckpt_recovery::{Config, JobOptions, SupervisorOptions, Topology};
    let train = ckpt_tests::bin("ckpt-train", "ckpt-train");
    let store = dir.join(format!("recovery-{how}"));
    let _ = std::fs::remove_dir_all(&store);
    let logs = dir.join(format!("recovery-{how}-logs"));
    let _ = std::fs::remove_dir_all(&logs);
    let run = format!("bench{how}");
    let mut cfg = Config::new(
        Topology {
            nodes: 4,
            ranks_per_node: 1,
            spares: 0,
        },
        "dp=2,tp=2".parse().unwrap(),
    );
    cfg.heartbeat_timeout = Duration::from_secs(2);
    cfg.stop_grace = Duration::from_secs(2);
    cfg.backoff = Duration::from_millis(100);
    let opts = SupervisorOptions {
        job: JobOptions {
            store_url: store.to_string_lossy().to_string(),
            run: run.clone(),
            config: cfg,
            command: vec![
                train.to_string_lossy().to_string(),
                "--params".into(),
                params.into(),
                "--steps".into(),
                "30".into(),
                "--ckpt-every".into(),
                "5".into(),
                "--step-time-ms".into(),
                "200".into(),
                "--zero".into(),
                "1".into(),
            ],
            logs_dir: Some(logs.clone()),
            heartbeat_interval: Duration::from_millis(100),
            open: open_options(),
            sdc_check: None,
            local_tier: None,
        },
        replica_agent: how
            .ends_with("peers")
            .then(ckpt_tests::replica_agent_command),
        repair_after: None,
    };
    let t0 = Instant::now();
    let sup = ckpt_tests::spawn_supervisor(opts);
    let st = ckpt_store::open(store.to_str().unwrap()).unwrap();
    // After the second committed checkpoint, hit rank 1.
    let victim = loop {
        let committed = runtime()
            .block_on(st.log().committed_steps(&run))
            .unwrap_or_default();
        let live = ckpt_tests::find_processes(&[("CKPT_RUN", run.as_str()), ("CKPT_RANK", "1")]);
        if committed.len() >= 2 && !live.is_empty() {
            std::thread::sleep(Duration::from_millis(300));
            break live[0].0;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(600),
            "the job did not reach two checkpoints"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let hit_at = t0.elapsed();
    ckpt_tests::signal(
        victim,
        if how == "hang" {
            libc::SIGSTOP
        } else {
            libc::SIGKILL
        },
    );
    let report = sup.join().unwrap();
    let rec = |k: &str| {
        report
            .records
            .iter()
            .find(|r| r["kind"] == k)
            .cloned()
            .unwrap_or_default()
    };
    let ms = |v: &Value| v["at_ms"].as_f64().unwrap_or(f64::NAN) / 1000.0;
    let (f, r) = (rec("failure"), rec("recovery"));
    let started = report
        .records
        .iter()
        .filter(|x| x["kind"] == "started")
        .nth(1)
        .cloned()
        .unwrap_or_default();
    let resumed = rec("resumed");
    // Restore seconds from the restarted ranks' logs ("restored ... seconds=...").
    let mut restore_s: f64 = 0.0;
    for e in std::fs::read_dir(&logs).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if name.ends_with(".err") && name.contains("gen-1") {
            let text = std::fs::read_to_string(e.path()).unwrap_or_default();
            for l in text.lines().filter(|l| l.contains("restored")) {
                if let Some(v) = l
                    .split("seconds")
                    .nth(1)
                    .and_then(|x| {
                        x.trim_start_matches(|c: char| !c.is_ascii_digit())
                            .split(|c: char| !c.is_ascii_digit() && c != '.')
                            .next()
                    })
                    .and_then(|x| x.parse::<f64>().ok())
                {
                    restore_s = restore_s.max(v);
                }
            }
        }
    }
    // Where the restarted ranks' bytes came from (their `restore` events).
    let events = runtime()
        .block_on(ckpt_store::logs::read_log(
            &st,
            &run,
            ckpt_store::logs::EVENTS,
        ))
        .unwrap_or_default();
    let restores: Vec<&Value> = events
        .iter()
        .filter(|e| e["kind"] == "restore" && e["generation"].as_u64() > Some(0))
        .collect();
    let sum = |k: &str| restores.iter().filter_map(|e| e[k].as_u64()).sum::<u64>();
    let slowest = restores
        .iter()
        .filter_map(|e| e["seconds"].as_f64())
        .fold(0.0, f64::max);
    let hit = hit_at.as_secs_f64() - 0.0;
    // The goal after detection: 1.2x the cold read of the largest rank's state, + 2 s.
    let rank_bytes = restores
        .iter()
        .filter_map(|e| e["bytes"].as_u64())
        .max()
        .unwrap_or(0);
    let goal_after_detection = 1.2 * rank_bytes as f64 / (read_gbps * 1e9) + 2.0;
    emit(json!({
        "odirect_read_gbps": read_gbps, "goal_after_detection_s": goal_after_detection,
        "bench": "recovery", "how": how, "params": params, "ok": report.ok,
        "detection_s": ms(&f) - hit, "detection_reported_s": f["detection_s"],
        "decision_s": ms(&r) - ms(&f), "backoff_s": r["backoff_s"],
        "start_to_first_step_s": ms(&resumed) - ms(&started), "restore_s": restore_s,
        "failure_to_first_step_s": ms(&resumed) - ms(&f), "steps_lost": r["steps_lost"],
        "failure_to_restored_s": resumed["restored_s"],
        "layout_after": r["layout"], "restore_plan": r["plan"],
        "restore_event_s": slowest, "restored_bytes": sum("bytes"),
        "bytes_from_peers": sum("bytes_from_peers"), "bytes_from_store": sum("bytes_from_store"),
    }));
    let _ = std::fs::remove_dir_all(&store);
}

/// Restore from peer replicas vs. from the store, in isolation: 2 ranks (tp=2), one replica
/// agent process per rank's node; a save hands every chunk to the agents (each keeps a copy of
/// the other's); node 1's agent is then killed and the whole state restored into fresh,
/// touched memory twice: from the store only, and from the surviving agent (node 0's own
/// shards and node 1's through the buddy copy).
fn peers_bench(dir: &Path, params: u64) {
    use std::io::BufRead;
    let layout: Layout = "tp=2".parse().unwrap();
    let (model, train, ranks, state, store) = bench_job(dir, "peers-store", params, layout, 4);
    let secret = ckpt_recovery::PeerSecret::generate().unwrap();
    let mut agents = Vec::new();
    for node in 0..2 {
        let mut c = std::process::Command::new(ckpt_tests::bin("ckpt", "ckpt"))
            .args([
                "replica-agent",
                "--listen",
                "127.0.0.1:0",
                "--watch-stdin",
                "--node",
            ])
            .arg(node.to_string())
            .env(ckpt_recovery::peer::SECRET_ENV, secret.to_hex())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(c.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line.trim().strip_prefix("listening ").unwrap().to_string();
        agents.push((c, addr));
    }
    let addrs: Vec<String> = agents.iter().map(|a| a.1.clone()).collect();
    // Each agent's buddy is the other (the membership a supervisor would send).
    let members: Vec<(u32, String)> = addrs
        .iter()
        .cloned()
        .enumerate()
        .map(|(n, a)| (n as u32, a))
        .collect();
    for (c, _) in &mut agents {
        use std::io::Write;
        let line = ckpt_recovery::peer::Membership::line(1, &members);
        c.stdin
            .as_mut()
            .unwrap()
            .write_all(line.as_bytes())
            .unwrap();
    }
    let link = |r: u32| {
        Some(PeerLink {
            node: r,
            agent: addrs[r as usize].clone(),
            peers: vec![addrs[0].clone()],
            timeout: ckpt_recovery::peer::IO_TIMEOUT,
            secret: secret.clone(),
        })
    };
    let mut mgrs = managers_with(&store, "p", layout, &ranks, true, 0, &link);
    let (_, committed) = checkpoint(&mut mgrs, 1);
    drop(mgrs);
    // Both agents hold both ranks' snapshots once the buddy copies land.
    let t = Instant::now();
    loop {
        let held: Vec<u64> = addrs
            .iter()
            .map(|a| {
                runtime()
                    .block_on(ckpt_recovery::peer::holdings(a, &secret))
                    .unwrap()
                    .bytes
            })
            .collect();
        if held.iter().all(|&b| b >= state) || t.elapsed() > Duration::from_secs(60) {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // Node 1 is lost with its agent.
    let (mut lost, _) = agents.remove(1);
    lost.kill().unwrap();
    lost.wait().unwrap();
    let limit = dir.join("peers-limit.bin");
    odirect_write(&limit, state as usize / (8 << 20) * (8 << 20), 8, 4 << 20);
    let mut out =
        json!({"bench": "peer_restore", "state_bytes": state, "save_committed_s": committed});
    // The peers twice: mapping the surviving agent's memory (it is on this machine), and
    // through its socket, as a rank on another machine would read it.
    for (label, peers) in [("store", false), ("peers", true), ("peers_socket", true)] {
        ckpt_recovery::peer::set_mapping(label != "peers_socket");
        let fresh = touched_ranks(model, train, layout);
        let none = |_| None;
        let mut mg = if peers {
            managers_with(&store, "p", layout, &fresh, false, 1, &link)
        } else {
            managers_with(&store, "p", layout, &fresh, false, 1, &none)
        };
        let disk_r = odirect_read(&limit, 8, 4 << 20);
        let (secs, used) = timed_restore(&store, &mut mg, 1);
        out[format!("{label}_restore_s")] = json!(secs);
        out[format!("{label}_gbps")] = json!(gbps(state, secs));
        out[format!("{label}_store_bytes_read")] = json!(used.get_bytes);
        out[format!("{label}_disk_read_gbps")] = json!(disk_r);
    }
    let s = |k: &str| out[k].as_f64().unwrap();
    let (mapped, socket) = (
        s("store_restore_s") / s("peers_restore_s"),
        s("store_restore_s") / s("peers_socket_restore_s"),
    );
    out["peers_speedup"] = json!(mapped);
    out["peers_socket_speedup"] = json!(socket);
    emit(out);
    for (mut c, _) in agents {
        let _ = c.kill();
        let _ = c.wait();
    }
    let _ = std::fs::remove_file(&limit);
    let _ = std::fs::remove_dir_all(dir.join("peers-store"));
}

// ----- faults ------------------------------------------------------------------------------

/// A manager over `store` holding `tensors` tensors of `mib / tensors` MiB each, saving every
/// step.
fn fault_manager(store: &Store, run: &str, mib: usize) -> (CheckpointManager, Vec<HostTensor>) {
    let mut c = ManagerConfig::new(CheckpointerConfig::new(run, 0, Layout::SINGLE));
    c.final_on_sigterm = false;
    c.every_steps = Some(1);
    let mut m = CheckpointManager::new(store.clone(), c).unwrap();
    let n = (mib << 20) / 4;
    let ts: Vec<HostTensor> = (0..4).map(|_| HostTensor::zeroed(n)).collect();
    for (i, t) in ts.iter().enumerate() {
        let spec = ckpt_store::TensorSpec {
            name: format!("t{i}"),
            dtype: DType::U8,
            shape: vec![n as u64],
            placement: ckpt_store::placement::Placement {
                order: 0,
                tp_dim: None,
                stage: ckpt_store::placement::Stage::First,
                zero: None,
            },
        };
        m.register(spec, NdBox::full(&[n as u64]), Arc::new(t.clone()))
            .unwrap();
    }
    (m, ts)
}

/// One step's update: one tensor of four changes (the others dedup).
fn fault_update(step: u64, ts: &[HostTensor]) {
    let t = &ts[step as usize % ts.len()];
    let len = t.read().len();
    t.write()
        .copy_from_slice(&ckpt_store::testing::det_bytes(step, len));
}

/// Saves and restores over a store failing 5 % of requests at random (errors, timeouts,
/// slow), then an outage: one JSON line per scenario.
fn faults_bench(dir: &Path, mib: usize) {
    use ckpt_store::{RandomFaults, RetryConfig};
    let retry = RetryConfig {
        request_timeout: Duration::from_secs(2),
        ..RetryConfig::default()
    };
    for backend in ["local", "memory"] {
        let url = match backend {
            "local" => {
                let p = dir.join("faults-store");
                let _ = std::fs::remove_dir_all(&p);
                p.display().to_string()
            }
            _ => "memory://".to_string(),
        };
        let faults = RandomFaults {
            hang: Duration::from_secs(3600),
            ..RandomFaults::new(0.05, 42)
        };
        let store = ckpt_store::open_with(
            &url,
            &ckpt_store::OpenOptions {
                retry: retry.clone(),
                faults: Some(faults),
            },
        )
        .unwrap();
        let t0 = Instant::now();
        let (mut m, ts) = fault_manager(&store, "faults", mib);
        let steps = 20u64;
        let mut saved = std::collections::BTreeMap::new();
        let mut hs = Vec::new();
        for step in 1..=steps {
            fault_update(step, &ts);
            if let Some(h) = m.maybe_save(step).unwrap() {
                saved.insert(
                    step,
                    ts.iter().map(|t| t.read().clone()).collect::<Vec<_>>(),
                );
                hs.push(h);
            }
        }
        let _ = m.finish();
        let committed = hs
            .iter()
            .filter(|h| h.wait_committed(Duration::from_secs(60)).is_ok())
            .count();
        let save_s = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let mut restored_ok = 0;
        let restores = 5u64;
        for step in steps - restores + 1..=steps {
            let (mut r, rts) = fault_manager(&store, "faults", mib);
            if r.restore(step).is_ok()
                && rts
                    .iter()
                    .zip(&saved[&step])
                    .all(|(t, want)| *t.read() == *want)
            {
                restored_ok += 1;
            }
        }
        let restore_s = t1.elapsed().as_secs_f64();
        let v = runtime()
            .block_on(store.verify(&ckpt_store::VerifyScope::Run("faults".into()), None))
            .map(|r| r.damaged.is_empty());
        let mt = store.metrics().unwrap().snapshot();
        emit(json!({
            "bench": "faults", "backend": backend, "fail_rate": 0.05, "mib": mib,
            "saves": steps, "saves_committed": committed,
            "restores": restores, "restores_bit_identical": restored_ok,
            "verify_clean": v.unwrap_or(false),
            "requests": mt.requests(), "retries": mt.retries, "give_ups": mt.give_ups,
            "save_wall_s": save_s, "restore_wall_s": restore_s,
        }));
        if backend == "local" {
            let _ = std::fs::remove_dir_all(&url);
        }
    }
    // An outage of 10 s starting 2 s in, steps of 100 ms saving every step.
    let outage = RandomFaults {
        outage: Some((Duration::from_secs(2), Duration::from_secs(10))),
        ..RandomFaults::new(0.0, 1)
    };
    let store = ckpt_store::open_with(
        "memory://",
        &ckpt_store::OpenOptions {
            retry,
            faults: Some(outage),
        },
    )
    .unwrap();
    let (mut m, ts) = fault_manager(&store, "outage", mib.min(16));
    let t0 = Instant::now();
    let mut trained = 0;
    let mut hs = Vec::new();
    let mut stall_max = 0f64;
    for step in 1..=160u64 {
        fault_update(step, &ts);
        let t = Instant::now();
        if let Some(h) = m.maybe_save(step).unwrap() {
            hs.push((h, t0.elapsed()));
        }
        stall_max = stall_max.max(t.elapsed().as_secs_f64());
        trained += 1;
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = m.finish();
    let end = Duration::from_secs(12);
    let first_after = hs
        .iter()
        .filter(|(h, at)| *at >= end && h.stage() == ckpt_trainer::Stage::Committed)
        .map(|(_, at)| (*at - end).as_secs_f64())
        .fold(f64::INFINITY, f64::min);
    let committed = runtime()
        .block_on(store.log().committed_steps("outage"))
        .unwrap();
    let h = m.store_health();
    let mt = store.metrics().unwrap().snapshot();
    emit(json!({
        "bench": "outage", "outage_s": 10.0, "steps_trained": trained,
        "wall_s": t0.elapsed().as_secs_f64(), "max_save_call_s": stall_max,
        "checkpoints_committed": committed.len(), "saves_failed": h.failed,
        "checkpoints_skipped": h.skipped, "resumed": h.resumed,
        "first_commit_after_outage_s": first_after,
        "retries": mt.retries, "give_ups": mt.give_ups,
    }));
}

/// `ckpt-bench goodput` (see `ckpt_tests::goodput`): the baseline and the policies, one JSON
/// line each; the exit code is 1 when a run missed a goal that is not a timing (the final
/// digest, every failure detected and recovered, no committed step lost, no leftovers).
fn goodput_bench(dir: &Path, args: &[String]) -> i32 {
    use ckpt_tests::goodput::{Options, Policy, run, steps_for};
    let num = |name: &str, default: &str| -> f64 {
        arg(args, name, default)
            .parse()
            .unwrap_or_else(|_| panic!("{name} takes a number"))
    };
    let seed: u64 = match args.iter().any(|a| a == "--seed") {
        true => num("--seed", "0") as u64,
        false => ckpt_store::clock::system_now().timestamp_micros() as u64 % 1_000_000,
    };
    let step_ms = num("--step-ms", "100") as u64;
    let steps = match args.iter().any(|a| a == "--steps") {
        true => num("--steps", "0") as u64,
        false => steps_for(num("--minutes", "20"), step_ms),
    };
    let mtbf = Duration::from_secs_f64(num("--mtbf", "60"));
    let mut o = Options::new(&dir.join("goodput"), steps, step_ms, mtbf, seed);
    o.params = arg(args, "--params", "1M");
    o.repair = Duration::from_secs_f64(num("--repair", &mtbf.as_secs_f64().to_string()));
    o.every = num("--every", "50") as u64;
    o.layout = arg(args, "--layout", "dp=1");
    o.keep_last = match arg(args, "--keep-last", "8").as_str() {
        "all" => None,
        k => Some(
            k.parse()
                .expect("--keep-last takes a number of steps or `all`"),
        ),
    };
    o.gc_every = match arg(args, "--gc-every", "60").as_str() {
        "off" => None,
        s => Some(Duration::from_secs_f64(
            s.parse().expect("--gc-every takes seconds or `off`"),
        )),
    };
    if args.iter().any(|a| a == "--policies") {
        o.policies = arg(args, "--policies", "a,b,c")
            .split(',')
            .map(|p| Policy::parse(p.trim()).unwrap_or_else(|e| panic!("{e}")))
            .collect();
    }
    eprintln!(
        "goodput: seed {seed} (replay with --seed {seed}), {steps} steps of {step_ms} ms, a failure every {} s on average, nodes back after {} s",
        mtbf.as_secs_f64(),
        o.repair.as_secs_f64()
    );
    let mut bad = false;
    match run(&o, |r| {
        emit(r.json(seed));
        bad |= !(r.ok
            && r.digest_equal
            && r.all_recovered()
            && r.committed_lost.is_empty()
            && r.leftover.is_empty());
    }) {
        Ok(_) => i32::from(bad),
        Err(e) => {
            eprintln!("goodput: {e}");
            1
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let dir = PathBuf::from(arg(&args, "--dir", "bench-out"));
    std::fs::create_dir_all(&dir).unwrap();
    match args.get(1).map(String::as_str) {
        Some("limits") => {
            let gib: f64 = arg(&args, "--gib", "2").parse().unwrap();
            emit(limits(&dir, gib));
            emit(backends(&dir, gib.min(1.0)));
        }
        Some("store") => store_bench(&dir, arg(&args, "--gib", "2").parse().unwrap()),
        Some("train") => train_bench(
            &dir,
            ckpt_train::parse_count(&arg(&args, "--params", "150M")).unwrap(),
        ),
        Some("startup") => startup_bench(
            &dir,
            ckpt_train::parse_count(&arg(&args, "--params", "150M")).unwrap(),
            !args.iter().any(|a| a == "--no-background-prefault"),
            arg(&args, "--steps", "10").parse().unwrap(),
        ),
        Some("recovery") => {
            let p = arg(&args, "--params", "20M");
            // The disk's cold read limit in the same run, for the goal (detection + 1.2x the
            // cold read of a rank's state + 2 s).
            let limit = dir.join("recovery-limit.bin");
            odirect_write(&limit, 1 << 30, 8, 4 << 20);
            let read_gbps = odirect_read(&limit, 8, 4 << 20);
            let _ = std::fs::remove_file(&limit);
            emit(json!({"bench": "recovery_limits", "odirect_read_gbps": read_gbps}));
            recovery_bench(&dir, &p, "crash", read_gbps);
            recovery_bench(&dir, &p, "hang", read_gbps);
            recovery_bench(&dir, &p, "crash-peers", read_gbps);
        }
        Some("peers") => peers_bench(
            &dir,
            ckpt_train::parse_count(&arg(&args, "--params", "100M")).unwrap(),
        ),
        Some("goodput") => std::process::exit(goodput_bench(&dir, &args)),
        Some("delta") => {
            let list = |name: &str, default: &str| -> Vec<String> {
                arg(&args, name, default)
                    .split(',')
                    .map(str::to_string)
                    .collect()
            };
            let intervals: Vec<u64> = list("--intervals", "1,10,100")
                .iter()
                .map(|s| s.parse().unwrap())
                .collect();
            let traj = arg(&args, "--trajectory", "");
            let source = if traj.is_empty() {
                delta_bench::Source::Reference {
                    params: ckpt_train::parse_count(&arg(&args, "--params", "20M")).unwrap(),
                    lr: arg(&args, "--lr", "1e-3").parse().unwrap(),
                }
            } else {
                delta_bench::Source::Trajectory(PathBuf::from(traj))
            };
            let first = match &source {
                delta_bench::Source::Trajectory(p) => delta_physics::trajectory_steps(p)
                    .first()
                    .map_or(1, |s| s.0),
                delta_bench::Source::Reference { .. } => 1,
            };
            delta_bench::delta_bench(
                &dir,
                &source,
                arg(&args, "--first", &first.to_string()).parse().unwrap(),
                arg(&args, "--saves", "3").parse().unwrap(),
                &intervals,
                &list("--sinks", "local,slow"),
                &list("--modes", "raw,planes,delta,adaptive+delta"),
                arg(&args, "--slow-mbps", "200").parse::<f64>().unwrap() * 1e6,
                arg(&args, "--restores", "3").parse().unwrap(),
            )
        }
        Some("delta-physics") => {
            let traj = arg(&args, "--trajectory", "");
            if traj.is_empty() {
                let intervals: Vec<u64> = arg(&args, "--intervals", "1,10,100")
                    .split(',')
                    .map(|s| s.parse().unwrap())
                    .collect();
                delta_physics::physics_reference(
                    ckpt_train::parse_count(&arg(&args, "--params", "20M")).unwrap(),
                    arg(&args, "--lr", "1e-3").parse().unwrap(),
                    arg(&args, "--warm", "50").parse().unwrap(),
                    &intervals,
                )
            } else {
                delta_physics::physics_trajectory(Path::new(&traj))
            }
        }
        Some("restore") => {
            let list = |name: &str, default: &str| -> Vec<String> {
                arg(&args, name, default)
                    .split(',')
                    .map(str::to_string)
                    .collect()
            };
            ckpt_tests::restore_bench::run(
                &ckpt_tests::restore_bench::Options {
                    dir: dir.clone(),
                    gib: arg(&args, "--gib", "2").parse().unwrap(),
                    tensors: arg(&args, "--tensors", "64").parse().unwrap(),
                    values: arg(&args, "--values", "random"),
                    codec: arg(&args, "--codec", "adaptive"),
                    chain: arg(&args, "--chain", "1").parse().unwrap(),
                    rounds: arg(&args, "--rounds", "2").parse().unwrap(),
                    modes: list("--modes", "manager,reader"),
                    caches: list("--caches", "cold,hot"),
                    budget_mib: arg(&args, "--budget-mib", "256").parse().unwrap(),
                },
                &emit,
            )
        }
        Some("read-limit") => emit(ckpt_tests::restore_bench::read_limit_of_dir(&dir)),
        Some("restore-child") => emit(ckpt_tests::restore_bench::child(
            &dir,
            &arg(&args, "--mode", "manager"),
            arg(&args, "--gib", "2").parse().unwrap(),
            arg(&args, "--tensors", "64").parse().unwrap(),
            arg(&args, "--budget-mib", "256").parse().unwrap(),
        )),
        Some("faults") => faults_bench(&dir, arg(&args, "--mib", "64").parse().unwrap()),
        Some("scale") => std::process::exit(ckpt_tests::scale::cli(&args)),
        Some("dcp-model") => std::process::exit(ckpt_tests::dcp_model::cli(&args)),
        Some("governor") => governor::governor_bench(
            &dir,
            ckpt_train::parse_count(&arg(&args, "--params", "150M")).unwrap(),
            &arg(&args, "--budgets", "0.05,0.1,0.25,off"),
            arg(&args, "--every", "6").parse().unwrap(),
            arg(&args, "--saves", "3").parse().unwrap(),
        ),
        Some("sentinel") => sentinel_bench::sentinel_bench(
            &dir,
            ckpt_train::parse_count(&arg(&args, "--params", "20M")).unwrap(),
            arg(&args, "--rounds", "5").parse().unwrap(),
        ),
        Some("writers") => {
            for row in ckpt_tests::writers_bench::writers_bench(
                ckpt_train::parse_count(&arg(&args, "--params", "150M")).unwrap(),
                &arg(
                    &args,
                    "--layouts",
                    "dp=2;dp=4;dp=8;dp=2,tp=2;dp=4,tp=2;dp=2,tp=2,pp=2;dp=4,zero=1",
                ),
            ) {
                emit(row);
            }
        }
        Some("tiers") => tiers_bench::tiers_bench(
            &dir,
            ckpt_train::parse_count(&arg(&args, "--params", "100M")).unwrap(),
            arg(&args, "--sink-mbps", "100").parse().unwrap(),
            tiers_bench::TiersOptions {
                overlap: arg(&args, "--snapshot-overlap", "auto").parse().unwrap(),
                saves_only: args.iter().any(|a| a == "--saves-only"),
            },
        ),
        Some("versions") => versions::versions_bench(
            &dir,
            ckpt_train::parse_count(&arg(&args, "--params", "150M")).unwrap(),
        ),
        _ => {
            eprintln!(
                "usage: ckpt-bench limits|store|train|startup|recovery|peers|faults|goodput|scale|versions|governor|delta|restore|sentinel|tiers|writers --dir DIR [--gib N] [--params N] [--mib N] [--steps N] [--no-background-prefault] [--budgets 0.05,0.1,off] [--every N] [--saves N]\n       \
                 ckpt-bench goodput --dir DIR [--minutes M | --steps N] [--mtbf S] [--seed X] [--step-ms MS] [--params P] [--repair S] [--every K] [--keep-last N|all] [--gc-every S|off] [--policies a,b,c,d]"
            );
            std::process::exit(2);
        }
    }
}
