//! `ckpt-bench restore` (issue 27): how fast a process that only restores gets its state back,
//! against the disk's `O_DIRECT` read of the same stored bytes, measured in the same run.
//!
//! The state is `--tensors` fp32 tensors of `--gib` GiB in all, saved once by a
//! `CheckpointManager` (`--values random`: incompressible bytes, stored raw; `normal`: fp32
//! values of a normal distribution, which the codec stores as byte planes). With `--codec
//! delta` it is saved `--chain` more times after the first, each after an update of every
//! value (a training step's relative change of about 1e-4), as a delta on the save before:
//! the loads then restore the newest step, every chunk a chain of `--chain` deltas on a whole
//! chunk, and the read they pair with is of every object of those chains. Then, `--rounds`
//! times, each load runs in a fresh process (its own peak RSS), on a cold page cache (dropped
//! first, as root) and a hot one (the load right after it), paired with the `O_DIRECT` read of
//! every stored object the step references, and a warm memcpy of the state:
//!
//! - `manager`: `CheckpointManager::restore` of the newest step into the registered tensors
//!   (what `ckpt-train --resume` and the Python manager run);
//! - `reader`: `StepReader::read_into` of each whole tensor in turn, one at a time (what
//!   `ckpt.dcp.StorageReader` runs for a DCP plan item);
//! - `targets`: the same walk, each tensor a call of `ckpt_trainer::restore_targets` (the
//!   manager's engine, what Python's `Reader.read_many` runs) with one target.
//!
//! Each child checks what it restored against the saved digests (outside the timing) and
//! prints one JSON line; the parent prints one line a load with the ratios.

use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ckpt_store::direct::AlignedBuf;
use ckpt_store::placement::{Placement, Stage};
use ckpt_store::{DType, Layout, NdBox, StepReader, Store, TensorSpec};
use ckpt_trainer::{CheckpointManager, CheckpointerConfig, HostTensor, ManagerConfig, runtime};
use serde_json::{Value, json};

const RUN: &str = "restore";

/// What the parent asks for.
pub struct Options {
    /// Folder of the store and the scratch files.
    pub dir: PathBuf,
    /// State size, GiB.
    pub gib: f64,
    /// Number of tensors.
    pub tensors: usize,
    /// `random` or `normal`.
    pub values: String,
    /// How the save stores chunks: `adaptive` (the default governor: raw where compressing is
    /// slower than the disk), `planes` (byte planes, compressed where it pays, always) or
    /// `delta` (planes, and `chain` more saves as deltas on the one before).
    pub codec: String,
    /// With `codec` `delta`: the saves after the first (the length of every chunk's chain).
    pub chain: usize,
    /// Loads of each kind.
    pub rounds: usize,
    /// `manager`, `reader`.
    pub modes: Vec<String>,
    /// `cold`, `hot`.
    pub caches: Vec<String>,
    /// The manager's restore budget (bytes in flight), MiB.
    pub budget_mib: usize,
}

fn spec(i: usize, n: u64) -> TensorSpec {
    TensorSpec {
        name: format!("layer{i:03}.weight"),
        dtype: DType::F32,
        shape: vec![n],
        placement: Placement {
            order: i as u32,
            tp_dim: None,
            stage: Stage::First,
            zero: None,
        },
    }
}

fn elements(o_gib: f64, tensors: usize) -> u64 {
    ((o_gib * (1u64 << 30) as f64) as u64 / 4 / tensors as u64).max(1)
}

/// One training step's change of fp32 values `v` (seed `seed`): every value moved by a random
/// relative amount of at most 1e-4 (an optimizer step on weights of this scale: the sign, the
/// exponent and the high mantissa bits mostly stay, the low bytes change).
fn update(v: &mut [u8], seed: u64) {
    let noise = ckpt_store::testing::det_bytes(seed, v.len() / 2);
    for (x, r) in v.chunks_exact_mut(4).zip(noise.chunks_exact(2)) {
        let f = f32::from_le_bytes(x.try_into().unwrap());
        let u = (u16::from_le_bytes(r.try_into().unwrap()) as f32 / 32767.5) - 1.0;
        x.copy_from_slice(&(f * (1.0 + 1e-4 * u)).to_le_bytes());
    }
}

/// The values of tensor `i`: random bits, or fp32 draws of a normal distribution (what weights
/// look like: the exponent bytes compress, the mantissa bytes do not).
fn values(kind: &str, i: usize, n: u64) -> Vec<u8> {
    let raw = ckpt_store::testing::det_bytes(1000 + i as u64, n as usize * 4);
    if kind == "random" {
        return raw;
    }
    let mut out = Vec::with_capacity(raw.len());
    for w in raw.chunks_exact(8) {
        // Two uniforms of 32 bits into one normal draw (Box-Muller), scaled like weights.
        let u1 = (u32::from_le_bytes(w[..4].try_into().unwrap()) as f64 + 1.0) / 4294967297.0;
        let u2 = u32::from_le_bytes(w[4..].try_into().unwrap()) as f64 / 4294967296.0;
        let r = (-2.0 * u1.ln()).sqrt() * 0.02;
        let (s, c) = (std::f64::consts::TAU * u2).sin_cos();
        out.extend_from_slice(&((r * c) as f32).to_le_bytes());
        out.extend_from_slice(&((r * s) as f32).to_le_bytes());
    }
    out.truncate(n as usize * 4);
    out
}

fn open(dir: &Path) -> Store {
    ckpt_store::open(dir.join("store").to_str().expect("a UTF-8 path")).expect("the bench store")
}

fn manager(store: &Store, tensors: &[HostTensor], n: u64, budget_mib: usize) -> CheckpointManager {
    let mut c = ManagerConfig::new(CheckpointerConfig::new(RUN, 0, Layout::SINGLE));
    c.final_on_sigterm = false;
    c.restore_budget = budget_mib << 20;
    let mut m = CheckpointManager::new(store.clone(), c).expect("a manager");
    for (i, t) in tensors.iter().enumerate() {
        m.register(spec(i, n), NdBox::full(&[n]), Arc::new(t.clone()))
            .expect("register");
    }
    m
}

fn digest(tensors: &[HostTensor]) -> String {
    let mut h = blake3::Hasher::new();
    for t in tensors {
        h.update(&t.read());
    }
    h.finalize().to_hex().to_string()
}

/// The step the loads restore (written by [`save`]).
fn saved_step(dir: &Path) -> u64 {
    std::fs::read_to_string(dir.join("restore.step"))
        .expect("the step file")
        .trim()
        .parse()
        .expect("a step")
}

/// Save the state into a new store under `o.dir` (step 1, then with `--codec delta` steps 2
/// to `chain + 1`, each after an update); the digest of the newest step saved.
pub fn save(o: &Options) -> String {
    let _ = std::fs::remove_dir_all(o.dir.join("store"));
    let n = elements(o.gib, o.tensors);
    let mut store = open(&o.dir);
    // The deltas saved after the first save: every chunk's chain.
    let chain = match o.codec.as_str() {
        "adaptive" | "planes" => 0,
        "delta" => o.chain.max(1),
        other => panic!("no codec {other:?} (adaptive, planes, delta)"),
    };
    if o.codec != "adaptive" {
        let mut cfg = store.config().clone();
        cfg.adaptive_codec = false;
        cfg.codec = ckpt_store::CodecPolicy::MAX;
        cfg.delta_chain = chain;
        if chain > 0 {
            // Every chunk's plain bytes kept as the next save's base (not read back).
            let state = n * 4 * o.tensors as u64;
            cfg.delta_cache_bytes = state + state / 4;
        }
        store = store.with_config(cfg).expect("the bench store's settings");
    }
    let saves = 1 + chain;
    let tensors: Vec<HostTensor> = (0..o.tensors)
        .map(|i| HostTensor::from_vec(values(&o.values, i, n)))
        .collect();
    let mut m = manager(&store, &tensors, n, o.budget_mib);
    for step in 1..=saves as u64 {
        if step > 1 {
            for (i, t) in tensors.iter().enumerate() {
                update(&mut t.write(), step * 1000 + i as u64);
            }
        }
        let h = m.save_now(step).expect("save");
        h.wait_committed(Duration::from_secs(600))
            .expect("committed");
    }
    m.finish().expect("finish");
    let d = digest(&tensors);
    std::fs::write(o.dir.join("restore.digest"), &d).expect("the digest file");
    std::fs::write(o.dir.join("restore.step"), saves.to_string()).expect("the step file");
    d
}

/// The store under `dir` and rank 0's manifest of the newest step saved.
fn newest_manifest(dir: &Path) -> (Store, Arc<ckpt_store::RankManifest>) {
    let store = open(dir);
    let m = runtime().block_on(async {
        let r = StepReader::open(&store, RUN, saved_step(dir))
            .await
            .expect("the step");
        r.manifest(0).await.expect("rank 0's manifest")
    });
    (store, m)
}

/// How many delta levels each chunk of the newest step saved has (0: stored whole).
pub fn chain_lengths(dir: &Path) -> Vec<usize> {
    let (_, m) = newest_manifest(dir);
    m.chunk_refs().map(|c| c.bases.len()).collect()
}

/// The stored objects the newest step's chunks are read from (each once: the chunks' own and
/// their delta bases'), and their bytes.
fn stored_objects(dir: &Path) -> (Vec<PathBuf>, u64) {
    let (store, m) = newest_manifest(dir);
    let root = dir.join("store");
    let mut seen = std::collections::BTreeSet::new();
    for c in m.chunk_refs() {
        for o in store.keys().chain_objects(c) {
            seen.insert(o.to_string());
        }
    }
    let paths: Vec<PathBuf> = seen.into_iter().map(|k| root.join(k)).collect();
    let bytes = paths
        .iter()
        .map(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0))
        .sum();
    (paths, bytes)
}

/// Seconds to read `paths` with `O_DIRECT`, `qd` files in flight, 8 MiB requests.
fn odirect_read_files(paths: &[PathBuf], qd: usize) -> f64 {
    let whole: Vec<(PathBuf, u64, u64)> = paths
        .iter()
        .map(|p| {
            let len = std::fs::metadata(p).expect("a stored object").len();
            (p.clone(), 0, len)
        })
        .collect();
    odirect_read_ranges(&whole, qd)
}

/// Seconds to read the file `path` with `O_DIRECT`, `qd` requests of `bs` bytes in flight (its
/// whole requests: a tail shorter than `bs` is not read).
pub fn odirect_read_file(path: &Path, qd: usize, bs: usize) -> f64 {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .expect("the limit file");
    let n = f.metadata().unwrap().len() as usize / bs;
    let t = Instant::now();
    std::thread::scope(|s| {
        for k in 0..qd {
            let f = &f;
            s.spawn(move || {
                let mut buf = AlignedBuf::zeroed(bs);
                let mut i = k;
                while i < n {
                    f.read_exact_at(buf.full_mut(), (i * bs) as u64).unwrap();
                    i += qd;
                }
            });
        }
    });
    t.elapsed().as_secs_f64()
}

/// The disk's `O_DIRECT` read limit for `stored` bytes: the fastest of reading the step's
/// objects (8 and 16 in flight) and one file of the same size (8 requests of 4 MiB in
/// flight), scaled to `stored` bytes. (Seconds, and each way's seconds.)
fn read_limit(paths: &[PathBuf], big: &Path, stored: u64) -> (f64, Value) {
    let files16 = odirect_read_files(paths, 16);
    let files8 = odirect_read_files(paths, 8);
    let big_len = std::fs::metadata(big).map(|m| m.len()).unwrap_or(1);
    let one = odirect_read_file(big, 8, 4 << 20) * stored as f64 / big_len as f64;
    (
        files16.min(files8).min(one),
        json!({"objects_qd16_s": files16, "objects_qd8_s": files8, "one_file_qd8_s": one}),
    )
}

/// `ckpt-bench read-limit`: every file under `dir` read with `O_DIRECT`, the fastest of 8
/// and 16 files in flight (a file read in 8 MiB requests, one after another), as a JSON line
/// (the limit the Python benchmarks pair their loads with).
pub fn read_limit_of_dir(dir: &Path) -> Value {
    fn walk(d: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, out);
            } else {
                out.push(p);
            }
        }
    }
    let mut paths = Vec::new();
    walk(dir, &mut paths);
    let bytes: u64 = paths
        .iter()
        .map(|p| std::fs::metadata(p).map_or(0, |m| m.len()))
        .sum();
    // A large file is split into 64 MiB ranges so one file does not read at a depth of one.
    let ranges = split_ranges(&paths, 64 << 20);
    let a = odirect_read_ranges(&ranges, 8);
    let b = odirect_read_ranges(&ranges, 16);
    json!({"bench": "read-limit", "bytes": bytes, "files": paths.len(), "secs": a.min(b),
           "qd8_s": a, "qd16_s": b})
}

fn split_ranges(paths: &[PathBuf], piece: u64) -> Vec<(PathBuf, u64, u64)> {
    let mut out = Vec::new();
    for p in paths {
        let len = std::fs::metadata(p).map_or(0, |m| m.len());
        let mut at = 0;
        while at < len {
            out.push((p.clone(), at, (at + piece).min(len)));
            at += piece;
        }
    }
    out
}

/// Seconds to read `ranges` of files with `O_DIRECT`, `qd` ranges in flight, 8 MiB requests.
fn odirect_read_ranges(ranges: &[(PathBuf, u64, u64)], qd: usize) -> f64 {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let t = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..qd {
            s.spawn(|| {
                let mut buf = AlignedBuf::zeroed(8 << 20);
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some((p, a, b)) = ranges.get(i) else {
                        break;
                    };
                    let f = std::fs::OpenOptions::new()
                        .read(true)
                        .custom_flags(libc::O_DIRECT)
                        .open(p)
                        .expect("a stored file");
                    let mut at = *a;
                    while at < *b {
                        let want = ((b - at) as usize).next_multiple_of(4096).min(8 << 20);
                        let n = f.read_at(&mut buf.full_mut()[..want], at).expect("read");
                        if n == 0 {
                            break;
                        }
                        at += n as u64;
                    }
                }
            });
        }
    });
    t.elapsed().as_secs_f64()
}

/// CPU seconds this process has used (user and system, every thread).
pub fn cpu_seconds() -> f64 {
    // SAFETY: getrusage writes the struct it is given and nothing else.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut ru);
        ru
    };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Drop the page cache (root only): `false` where it cannot.
pub fn drop_caches() -> bool {
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok()
}

/// A `kB` field of `/proc/self/status` (0 when absent).
pub fn status_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

fn memcpy_secs(bytes: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![2u8; bytes];
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        dst.copy_from_slice(&src);
        std::hint::black_box(&dst);
        best = best.min(t.elapsed().as_secs_f64());
    }
    best
}

/// Run the child in a fresh process (`ckpt-bench restore-child`): its JSON line.
pub fn spawn_child(exe: &Path, o: &Options, mode: &str) -> Value {
    let out = std::process::Command::new(exe)
        .args(["restore-child", "--dir"])
        .arg(&o.dir)
        .args(["--mode", mode, "--gib", &o.gib.to_string()])
        .args(["--tensors", &o.tensors.to_string()])
        .args(["--budget-mib", &o.budget_mib.to_string()])
        .output()
        .expect("the child");
    assert!(
        out.status.success(),
        "restore child failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("the child's line")
}

/// The child: one load in this fresh process, one JSON line.
pub fn child(dir: &Path, mode: &str, gib: f64, tensors: usize, budget_mib: usize) -> Value {
    let n = elements(gib, tensors);
    let store = open(dir);
    // The model's memory, allocated and touched as a restarted trainer has it.
    let ts: Vec<HostTensor> = (0..tensors)
        .map(|_| HostTensor::from_vec(vec![0xA5u8; n as usize * 4]))
        .collect();
    let step = saved_step(dir);
    let base_kib = status_kib("VmRSS:");
    let cpu = cpu_seconds();
    let t = Instant::now();
    let stats = match mode {
        "manager" => {
            let mut m = manager(&store, &ts, n, budget_mib);
            let made = t.elapsed().as_secs_f64();
            m.restore(step).expect("restore");
            json!({"manager_made_s": made})
        }
        "reader" => runtime().block_on(async {
            let r = StepReader::open(&store, RUN, step).await.expect("the step");
            let mut st = ckpt_store::ReadStats::default();
            for (i, t) in ts.iter().enumerate() {
                // The tensor's memory, out of its lock for the read.
                let mut buf = std::mem::take(&mut *t.write());
                let s = r
                    .read_into(&spec(i, n).name, &NdBox::full(&[n]), &mut buf)
                    .await
                    .expect("read");
                *t.write() = buf;
                st.add(&s);
            }
            json!({"chunks": st.chunks, "stored_bytes": st.stored_bytes})
        }),
        "targets" => runtime().block_on(async {
            let r = StepReader::open(&store, RUN, step).await.expect("the step");
            let mut st = ckpt_store::ReadStats::default();
            for (i, t) in ts.iter().enumerate() {
                let target = ckpt_trainer::RestoreTarget {
                    name: spec(i, n).name,
                    dtype: DType::F32,
                    shape: vec![n],
                    bbox: NdBox::full(&[n]),
                    sink: Arc::new(t.clone()),
                };
                let s = ckpt_trainer::restore_targets(&r, &[target], budget_mib << 20)
                    .await
                    .expect("read");
                st.add(&s);
            }
            json!({"chunks": st.chunks, "stored_bytes": st.stored_bytes})
        }),
        other => panic!("no restore mode {other:?}"),
    };
    let secs = t.elapsed().as_secs_f64();
    let cpu_s = cpu_seconds() - cpu;
    let peak = status_kib("VmHWM:");
    let want = std::fs::read_to_string(dir.join("restore.digest")).expect("the digest file");
    json!({
        "secs": secs,
        "cpu_s": cpu_s,
        "peak_rss_kib": peak,
        "state_kib": n * 4 * tensors as u64 / 1024,
        "budget_kib": budget_mib << 10,
        "rss_before_kib": base_kib,
        "bit_exact": digest(&ts) == want,
        "stats": stats,
    })
}

/// The parent: save, then every load kind in fresh processes; prints a line a load.
pub fn run(o: &Options, emit: &dyn Fn(Value)) {
    let t = Instant::now();
    save(o);
    let saved_s = t.elapsed().as_secs_f64();
    let (paths, stored) = stored_objects(&o.dir);
    let state = elements(o.gib, o.tensors) * 4 * o.tensors as u64;
    emit(json!({
        "bench": "restore-setup", "state_bytes": state, "stored_bytes": stored,
        "objects": paths.len(), "values": o.values, "codec": o.codec, "save_s": saved_s,
        "step": saved_step(&o.dir), "chain": saved_step(&o.dir) - 1,
    }));
    // One file of the state's size, for the sequential read limit.
    let big = o.dir.join("restore-limit.bin");
    {
        let f = std::fs::File::create(&big).expect("the limit file");
        let piece = ckpt_store::testing::det_bytes(7, 64 << 20);
        let mut at = 0u64;
        while at < stored {
            f.write_all_at(&piece, at).expect("writing the limit file");
            at += piece.len() as u64;
        }
        f.sync_all().expect("sync");
    }
    let exe = std::env::current_exe().expect("the bench's own path");
    for round in 0..o.rounds {
        for mode in &o.modes {
            for cache in &o.caches {
                let cold = cache == "cold";
                if cache == "cached" {
                    // The objects in the page cache (read buffered by someone else).
                    for p in &paths {
                        let _ = std::fs::read(p);
                    }
                }
                if cold && !drop_caches() {
                    emit(
                        json!({"bench": "restore", "skipped": "cold: cannot drop the page cache (not root)"}),
                    );
                    continue;
                }
                let mut v = spawn_child(&exe, o, mode);
                // The limit, paired: the same objects read with O_DIRECT (which reads the disk
                // whatever the page cache holds, and leaves it as it was).
                let (lim, ways) = read_limit(&paths, &big, stored);
                let mc = memcpy_secs(state as usize);
                let secs = v["secs"].as_f64().unwrap();
                v["bench"] = json!("restore");
                v["round"] = json!(round);
                v["mode"] = json!(mode);
                v["cache"] = json!(cache);
                v["odirect_read_s"] = json!(lim);
                v["odirect_ways"] = ways;
                v["odirect_gbps"] = json!(stored as f64 / lim / 1e9);
                v["restore_gbps"] = json!(state as f64 / secs / 1e9);
                v["x_odirect_read"] = json!(secs / lim);
                v["memcpy_s"] = json!(mc);
                v["x_memcpy"] = json!(secs / mc);
                emit(v);
            }
        }
    }
}
