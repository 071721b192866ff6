//! The GPU path measured against the machine's own copy speed (feature `cuda`).
//!
//! ```text
//! cargo run --release -p ckpt-trainer --features cuda --example gpu_bench -- [--quick]
//! ```
//!
//! Prints one JSON object per line (docs/bench/gpu.md says what each means):
//!
//! 1. `d2h_memcpy_pinned` / `h2d_memcpy_pinned`: the baselines, synchronous `cuMemcpyDtoH` /
//!    `cuMemcpyHtoD` of the snapshot state in 1 GiB pieces into (from) one page-locked buffer;
//! 2. `snapshot`: the snapshot throughput of `Checkpointer::save` for `--snapshot-gib` of
//!    device tensors (random bytes), from `save` to the snapshot being complete, against the
//!    baseline (goal >= 0.9x);
//! 3. `stall`: what `save` costs a training loop holding `--stall-gib` of state: the time in
//!    `save` plus the wait for the snapshot before the optimizer step, with the forward and
//!    backward passes (a sleep of `--fwd-bwd-factor` x the state's D2H time) overlapped, and
//!    without; goal: the overlapped stall <= the D2H copy time of that state;
//! 4. `restore`: restore throughput of the snapshot state from the store onto fresh device
//!    tensors, checked on the device, against the H2D baseline.
//!
//! The store is in memory, so the figures are those of the GPU path, not of a disk.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ckpt_store::{DType, Layout, NdBox, StepReader, StoreConfig};
use ckpt_trainer::cuda::{DeviceTensor, Gpu};
use ckpt_trainer::{
    Checkpointer, CheckpointerConfig, RestoreTarget, SaveState, SaveTensor, restore_targets,
    runtime,
};
use clap::Parser;
use cudarc::driver::{result, sys};
use serde_json::json;

#[derive(Parser, Debug)]
#[command(about = "GPU snapshot, stall and restore benchmark")]
struct Args {
    /// GiB of device tensors for the snapshot and restore throughput.
    #[arg(long, default_value_t = 10)]
    snapshot_gib: usize,
    /// GiB of training state for the stall measurement.
    #[arg(long, default_value_t = 20)]
    stall_gib: usize,
    /// MiB per tensor.
    #[arg(long, default_value_t = 256)]
    tensor_mib: usize,
    /// The simulated forward and backward passes last this many times the state's D2H time.
    #[arg(long, default_value_t = 2.0)]
    fwd_bwd_factor: f64,
    /// Snapshot runs (the median is the figure).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Overlapped training steps measured for the stall.
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Bytes in flight during the restore.
    #[arg(long, default_value_t = 1 << 30)]
    restore_budget: usize,
    /// Small sizes (1 GiB and 2 GiB) for a smoke run.
    #[arg(long)]
    quick: bool,
    /// GPU ordinal.
    #[arg(long, default_value_t = 0)]
    gpu: usize,
}

fn emit(v: serde_json::Value) {
    println!("{v}");
}

fn gbps(bytes: u64, s: f64) -> f64 {
    if s > 0.0 { bytes as f64 / s / 1e9 } else { 0.0 }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() { 0.0 } else { v[v.len() / 2] }
}

/// A page-locked host buffer for the baselines.
struct Pinned {
    ptr: *mut u8,
    len: usize,
}

impl Pinned {
    fn new(gpu: &Gpu, len: usize) -> anyhow::Result<Pinned> {
        gpu.context().bind_to_thread()?;
        // SAFETY: a fresh page-locked allocation, freed in Drop.
        let ptr = unsafe { result::malloc_host(len, 0) }? as *mut u8;
        Ok(Pinned { ptr, len })
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated in new; the copies using it were synchronous.
        let _ = unsafe { result::free_host(self.ptr as *mut std::ffi::c_void) };
    }
}

/// Seconds to copy every tensor through `buf` with synchronous `cuMemcpyDtoH` (or `HtoD`), in
/// pieces of the buffer's size.
fn memcpy_all(gpu: &Gpu, ts: &[DeviceTensor], buf: &Pinned, to_host: bool) -> anyhow::Result<f64> {
    gpu.context().bind_to_thread()?;
    gpu.synchronize()?;
    let t0 = Instant::now();
    for t in ts {
        let mut off = 0;
        while off < t.len() {
            let n = buf.len.min(t.len() - off);
            let d = t.device_ptr() + off as u64;
            // SAFETY: both ranges are live allocations of at least n bytes.
            unsafe {
                if to_host {
                    sys::cuMemcpyDtoH_v2(buf.ptr as *mut std::ffi::c_void, d, n).result()?;
                } else {
                    sys::cuMemcpyHtoD_v2(d, buf.ptr as *const std::ffi::c_void, n).result()?;
                }
            }
            off += n;
        }
    }
    Ok(t0.elapsed().as_secs_f64())
}

/// Bytes that look random to the codec and differ in every 4 MiB chunk of every tensor.
fn random_tensor(gpu: &Arc<Gpu>, base: &mut [u8], seed: u64) -> anyhow::Result<DeviceTensor> {
    for (i, c) in base.chunks_mut(4 << 20).enumerate() {
        c[..8].copy_from_slice(&(seed << 32 | i as u64).to_le_bytes());
    }
    let t = DeviceTensor::alloc(gpu, base.len())?;
    t.upload(0, base)?;
    Ok(t)
}

fn fill_random(buf: &mut [u8], seed: u64) {
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
    let per = buf.len().div_ceil(threads).next_multiple_of(8);
    std::thread::scope(|s| {
        for (k, part) in buf.chunks_mut(per).enumerate() {
            s.spawn(move || {
                let mut x = seed ^ (k as u64 + 1).wrapping_mul(0x9e3779b97f4a7c15);
                for w in part.chunks_mut(8) {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let b = x.to_le_bytes();
                    w.copy_from_slice(&b[..w.len()]);
                }
            });
        }
    });
}

fn state(ts: &[DeviceTensor], prefix: &str) -> SaveState {
    SaveState {
        tensors: ts
            .iter()
            .enumerate()
            .map(|(i, t)| SaveTensor {
                name: format!("{prefix}.{i:04}"),
                dtype: DType::U8,
                shape: vec![t.len() as u64],
                bbox: NdBox::full(&[t.len() as u64]),
                placement: None,
                source: Some(Arc::new(t.clone())),
                replica_of: None,
            })
            .collect(),
        blobs: vec![],
    }
}

fn main() {
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .try_init();
    let mut a = Args::parse();
    if a.quick {
        a.snapshot_gib = 1;
        a.stall_gib = 2;
        a.tensor_mib = 64;
    }
    if let Err(e) = run(&a) {
        emit(json!({"bench": "gpu", "error": format!("{e:#}")}));
        std::process::exit(1);
    }
}

fn run(a: &Args) -> anyhow::Result<()> {
    let wall = Instant::now();
    let gpu = Gpu::open(a.gpu)?;
    emit(json!({
        "bench": "gpu", "metric": "device", "ordinal": a.gpu, "name": gpu.name()?,
        "snapshot_gib": a.snapshot_gib, "stall_gib": a.stall_gib, "tensor_mib": a.tensor_mib,
        "cpus": std::thread::available_parallelism().map_or(0, |n| n.get()),
    }));
    let tensor = a.tensor_mib << 20;
    let n_snap = (a.snapshot_gib << 30) / tensor;
    let n_stall = ((a.stall_gib << 30) / tensor).max(n_snap);

    // Device state: random tensors for the snapshot, zero tensors make up the rest of the
    // stall state (their chunks dedup, so the persist stays cheap).
    let t0 = Instant::now();
    let mut base = vec![0u8; tensor];
    fill_random(&mut base, 42);
    let mut snap = Vec::with_capacity(n_snap);
    for i in 0..n_snap {
        snap.push(random_tensor(&gpu, &mut base, i as u64)?);
    }
    let mut stall_state = snap.clone();
    for _ in n_snap..n_stall {
        stall_state.push(DeviceTensor::alloc(&gpu, tensor)?);
    }
    drop(base);
    gpu.synchronize()?;
    emit(json!({"bench": "gpu", "metric": "setup_device_state",
        "bytes": (n_stall * tensor) as u64, "seconds": t0.elapsed().as_secs_f64()}));

    // Baselines.
    let pinned = Pinned::new(&gpu, 1 << 30)?;
    memcpy_all(&gpu, &snap[..1.min(snap.len())], &pinned, true)?; // warm up
    let snap_bytes = (n_snap * tensor) as u64;
    let d2h_s = memcpy_all(&gpu, &snap, &pinned, true)?;
    let d2h_gbps = gbps(snap_bytes, d2h_s);
    emit(
        json!({"bench": "gpu", "metric": "d2h_memcpy_pinned", "bytes": snap_bytes,
        "seconds": d2h_s, "gbps": d2h_gbps}),
    );
    let h2d_s = memcpy_all(&gpu, &snap, &pinned, false)?;
    // The H2D baseline wrote the pinned buffer's bytes over the tensors: restore them.
    {
        let mut base = vec![0u8; tensor];
        fill_random(&mut base, 42);
        for (i, t) in snap.iter().enumerate() {
            for (k, c) in base.chunks_mut(4 << 20).enumerate() {
                c[..8].copy_from_slice(&((i as u64) << 32 | k as u64).to_le_bytes());
            }
            t.upload(0, &base)?;
        }
    }
    let h2d_gbps = gbps(snap_bytes, h2d_s);
    emit(
        json!({"bench": "gpu", "metric": "h2d_memcpy_pinned", "bytes": snap_bytes,
        "seconds": h2d_s, "gbps": h2d_gbps}),
    );

    // One checkpointer, staging for the whole stall state (page-locked once, up front: the
    // GPU was opened first, so its slab hook applies).
    let store = ckpt_store::url::open("memory://")?.with_config(StoreConfig::default())?;
    let mut cfg = CheckpointerConfig::new("bench", 0, Layout::SINGLE);
    cfg.staging_bytes = n_stall * tensor + (256 << 20);
    cfg.prefault = true;
    let t0 = Instant::now();
    let ck = Checkpointer::new(store.clone(), cfg)?;
    emit(
        json!({"bench": "gpu", "metric": "staging_setup", "bytes": ck.staging().allocated,
        "seconds": t0.elapsed().as_secs_f64(), "note": "allocated, touched and page-locked once"}),
    );

    // Snapshot throughput.
    let mut rates = Vec::new();
    for run in 1..=a.runs.max(1) {
        let h = ck.save(run as u64, state(&snap, "snap"))?;
        let r = h.wait_snapshot()?;
        let c = h.wait_committed(Duration::from_secs(600))?;
        let g = gbps(r.bytes, r.snapshot_s);
        rates.push(g);
        emit(
            json!({"bench": "gpu", "metric": "snapshot", "run": run, "bytes": r.bytes,
            "snapshot_s": r.snapshot_s, "gbps": g, "vs_memcpy": g / d2h_gbps,
            "persist_s": c.persist_s, "bytes_written": c.bytes_written}),
        );
    }
    let med = median(rates);
    emit(
        json!({"bench": "gpu", "metric": "snapshot_summary", "median_gbps": med,
        "memcpy_gbps": d2h_gbps, "vs_memcpy": med / d2h_gbps, "goal": ">= 0.9",
        "met": med / d2h_gbps >= 0.9}),
    );

    // The stall of a training loop.
    let stall_bytes = (n_stall * tensor) as u64;
    let state_d2h_s = memcpy_all(&gpu, &stall_state, &pinned, true)?;
    emit(
        json!({"bench": "gpu", "metric": "stall_d2h_memcpy", "bytes": stall_bytes,
        "seconds": state_d2h_s, "gbps": gbps(stall_bytes, state_d2h_s)}),
    );
    let fwd_bwd = Duration::from_secs_f64(state_d2h_s * a.fwd_bwd_factor);
    let mut step = 100u64;
    let mut worst = 0f64;
    for (overlap, n) in [(false, 1), (true, a.steps.max(1))] {
        for _ in 0..n {
            step += 1;
            let t0 = Instant::now();
            let h = ck.save(step, state(&stall_state, "state"))?;
            let in_save = t0.elapsed().as_secs_f64();
            if overlap {
                std::thread::sleep(fwd_bwd); // forward and backward
            }
            let t1 = Instant::now();
            let r = h.wait_snapshot()?; // before the optimizer step
            let wait = t1.elapsed().as_secs_f64();
            let stall = in_save + wait;
            if overlap {
                worst = worst.max(stall);
            }
            emit(
                json!({"bench": "gpu", "metric": "stall", "overlap": overlap, "step": step,
                "state_bytes": stall_bytes, "fwd_bwd_s": if overlap { fwd_bwd.as_secs_f64() } else { 0.0 },
                "in_save_s": in_save, "wait_snapshot_s": wait, "stall_s": stall,
                "snapshot_s": r.snapshot_s, "d2h_s": state_d2h_s}),
            );
            h.wait_committed(Duration::from_secs(600))?;
        }
    }
    emit(
        json!({"bench": "gpu", "metric": "stall_summary", "state_bytes": stall_bytes,
        "max_overlapped_stall_s": worst, "d2h_s": state_d2h_s, "goal": "stall <= d2h_s",
        "met": worst <= state_d2h_s}),
    );
    drop(stall_state);

    // Restore throughput: step 1 (random bytes) onto fresh device tensors.
    let reader = runtime().block_on(StepReader::open(&store, "bench", 1))?;
    let fresh: Vec<DeviceTensor> = (0..n_snap)
        .map(|_| DeviceTensor::alloc(&gpu, tensor))
        .collect::<Result<_, _>>()?;
    gpu.synchronize()?;
    let targets: Vec<RestoreTarget> = fresh
        .iter()
        .enumerate()
        .map(|(i, t)| RestoreTarget {
            name: format!("snap.{i:04}"),
            dtype: DType::U8,
            shape: vec![t.len() as u64],
            bbox: NdBox::full(&[t.len() as u64]),
            sink: Arc::new(t.clone()),
        })
        .collect();
    let t0 = Instant::now();
    let st = runtime().block_on(restore_targets(&reader, &targets, a.restore_budget))?;
    let rs = t0.elapsed().as_secs_f64();
    // Checked on the device; without the compare kernel, on the host (slower, same answer).
    let mut verified = true;
    let mut checked_on = "device";
    for (f, o) in fresh.iter().zip(&snap) {
        verified &= match f.count_diff(o) {
            Ok(n) => n == 0,
            Err(e) => {
                checked_on = "host";
                eprintln!("no device compare ({e}); comparing on the host");
                f.download()? == o.download()?
            }
        };
    }
    let g = gbps(st.bytes_copied, rs);
    emit(
        json!({"bench": "gpu", "metric": "restore", "bytes": st.bytes_copied,
        "seconds": rs, "gbps": g, "h2d_gbps": h2d_gbps, "vs_h2d": g / h2d_gbps,
        "budget": a.restore_budget, "verified": verified, "checked_on": checked_on}),
    );
    emit(json!({"bench": "gpu", "metric": "done", "wall_s": wall.elapsed().as_secs_f64()}));
    if !verified {
        anyhow::bail!("restored tensors differ from the saved ones");
    }
    Ok(())
}
