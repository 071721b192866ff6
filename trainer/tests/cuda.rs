#![cfg(feature = "cuda")]
//! The GPU path (feature `cuda`).
//!
//! The no-GPU errors run anywhere (the planner's tests are unit tests of
//! `ckpt_trainer::peer_plan`, in the default build). Tests that need a GPU print `SKIPPED` and
//! pass without one; with `CKPT_REQUIRE_GPU=1` (as `scripts/gpu-check.sh` sets) a missing GPU
//! fails them instead, and `CKPT_REQUIRE_NCCL=1` does the same for NCCL.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ckpt_store::placement::{TensorSpec, ZeroGroup, tp_box};
use ckpt_store::testing::{det_bytes, local_store};
use ckpt_store::{DType, ErrorKind, Layout, NdBox, StepReader, Store, StoreConfig};
use ckpt_trainer::cuda::peer::{PeerExchange, PeerTensor, restore_with_peers};
use ckpt_trainer::cuda::{self, DeviceTensor, Gpu};
use ckpt_trainer::peer_plan::{Holding, Need, PeerCost, plan};
use ckpt_trainer::{
    CheckpointManager, CheckpointerConfig, ManagerConfig, PoolConfig, StagingPool, runtime,
};

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

#[allow(
    clippy::disallowed_methods,
    reason = "a test reads its knobs and tools from the environment"
)]
fn gpu(test: &str) -> Option<Arc<Gpu>> {
    match Gpu::open(0) {
        Ok(g) => Some(g),
        Err(e) => {
            if std::env::var_os("CKPT_REQUIRE_GPU").is_some() {
                panic!("{test}: CKPT_REQUIRE_GPU is set but no GPU can be used: {e}");
            }
            eprintln!("SKIPPED {test}: no GPU: {e}");
            None
        }
    }
}

#[allow(
    clippy::disallowed_methods,
    reason = "a test reads its knobs and tools from the environment"
)]
fn nccl(test: &str) -> bool {
    if cuda::nccl_present() {
        return true;
    }
    if std::env::var_os("CKPT_REQUIRE_NCCL").is_some() {
        panic!("{test}: CKPT_REQUIRE_NCCL is set but libnccl.so cannot be loaded");
    }
    eprintln!("SKIPPED {test}: libnccl.so cannot be loaded");
    false
}

/// Chunks of 64 KiB: tensors of a few hundred KiB span several chunks and slabs.
fn store() -> (Store, tempfile::TempDir) {
    local_store(StoreConfig {
        chunk_size: 64 << 10,
        pack_threshold: 16 << 10,
        pack_target: 128 << 10,
        inflight_bytes: 4 << 20,
        write_concurrency: 4,
        read_concurrency: 4,
        ..StoreConfig::default()
    })
}

fn spec(name: &str, dtype: DType, shape: &[u64], tp_dim: Option<usize>) -> TensorSpec {
    TensorSpec::first_stage(name, dtype, shape).with_tp(tp_dim)
}

fn manager(store: &Store, run: &str, layout: &str, rank: u32) -> CheckpointManager {
    let layout: Layout = layout.parse().unwrap();
    let mut c = ManagerConfig::new(CheckpointerConfig::new(run, rank, layout));
    c.final_on_sigterm = false;
    CheckpointManager::new(store.clone(), c).unwrap()
}

fn on_device(g: &Arc<Gpu>, bytes: &[u8]) -> DeviceTensor {
    let t = DeviceTensor::alloc(g, bytes.len()).unwrap();
    t.upload(0, bytes).unwrap();
    t
}

/// Compare on the device (a small kernel); if the kernels cannot be loaded, say so and compare
/// on the host (`device_compare_counts_differing_bytes` fails in that case).
fn same(a: &DeviceTensor, b: &DeviceTensor) -> bool {
    match a.count_diff(b) {
        Ok(n) => n == 0,
        Err(e) => {
            eprintln!("WARNING: no device compare ({e}); comparing on the host");
            a.download().unwrap() == b.download().unwrap()
        }
    }
}

/// Columns `c0 .. c0 + w` of a row-major `[rows, cols]` matrix of `elem`-byte elements.
fn columns(full: &[u8], rows: usize, cols: usize, elem: usize, c0: usize, w: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(rows * w * elem);
    for r in 0..rows {
        let a = (r * cols + c0) * elem;
        out.extend_from_slice(&full[a..a + w * elem]);
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Without a GPU (run everywhere)
// ---------------------------------------------------------------------------------------------

#[test]
fn without_a_driver_opening_a_gpu_is_a_clear_error_not_a_panic() {
    let r = std::panic::catch_unwind(|| (Gpu::open(0), Gpu::count(), PeerExchange::unique_id()));
    let (open, count, id) = r.expect("no panic");
    if cuda::driver_present() {
        // A driver: an ordinal no machine has is still an error, not a panic.
        let e = Gpu::open(1 << 20).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NoDevice, "{e}");
        eprintln!("a CUDA driver is present ({} devices)", count.unwrap());
        drop(open);
    } else {
        let e = open.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NoDevice);
        assert!(e.to_string().contains("no CUDA driver was found"), "{e}");
        assert!(count.unwrap_err().to_string().contains("no CUDA driver"));
    }
    if !cuda::nccl_present() {
        let e = id.unwrap_err();
        assert!(e.to_string().contains("libnccl.so"), "{e}");
    }
}

fn fast_link() -> PeerCost {
    PeerCost {
        link_bytes_per_s: 100e9,
        store_bytes_per_s: 1e9,
        setup_s: 0.0,
    }
}

// ---------------------------------------------------------------------------------------------
// On a GPU
// ---------------------------------------------------------------------------------------------

#[test]
fn device_compare_counts_differing_bytes() {
    let Some(g) = gpu("device_compare_counts_differing_bytes") else {
        return;
    };
    let n = 3 << 20;
    let a = on_device(&g, &det_bytes(1, n));
    let b = on_device(&g, &det_bytes(1, n));
    assert_eq!(a.count_diff(&b).expect("the PTX kernels load and run"), 0);
    let mut other = det_bytes(1, n);
    other[0] ^= 1;
    other[n / 2] ^= 0x80;
    other[n - 1] ^= 0xff;
    b.upload(0, &other).unwrap();
    assert_eq!(a.count_diff(&b).unwrap(), 3);
    b.fill(7).unwrap();
    assert!(a.count_diff(&b).unwrap() > (n as u64) * 9 / 10);
    // The busy kernel holds the stream for about as long as asked.
    let t0 = Instant::now();
    g.busy(a.stream(), Duration::from_millis(100)).unwrap();
    assert!(
        t0.elapsed() < Duration::from_millis(50),
        "a launch is asynchronous"
    );
    a.download().unwrap();
    assert!(
        t0.elapsed() >= Duration::from_millis(95),
        "{:?}",
        t0.elapsed()
    );
}

#[test]
fn staging_slabs_are_page_locked_once_a_gpu_is_open() {
    let Some(g) = gpu("staging_slabs_are_page_locked_once_a_gpu_is_open") else {
        return;
    };
    let pool = StagingPool::new(
        PoolConfig {
            capacity: 2 << 20,
            slab: 1 << 20,
        },
        true,
    );
    let mut s = pool.acquire();
    assert!(g.is_page_locked(s.bytes_mut().as_ptr()).unwrap());
    let v = vec![0u8; 1 << 20];
    assert!(!g.is_page_locked(v.as_ptr()).unwrap());
}

#[test]
fn device_tensors_of_every_dtype_round_trip_through_the_store() {
    let Some(g) = gpu("device_tensors_of_every_dtype_round_trip_through_the_store") else {
        return;
    };
    let (store, _dir) = store();
    let mut m = manager(&store, "rt", "dp=1", 0);
    let mut tensors = Vec::new();
    for (i, dt) in DType::ALL.iter().enumerate() {
        // Odd shapes; the f32 one spans many chunks.
        let shape: Vec<u64> = if *dt == DType::F32 {
            vec![257, 1031]
        } else {
            vec![37 + i as u64, 129]
        };
        let name = format!("t.{}", dt.name());
        let n = shape.iter().product::<u64>() as usize * dt.size();
        let bytes = det_bytes(100 + i as u64, n);
        let t = on_device(&g, &bytes);
        m.register(
            spec(&name, *dt, &shape, None),
            NdBox::full(&shape),
            Arc::new(t.clone()),
        )
        .unwrap();
        tensors.push((name, *dt, shape, t, bytes));
    }
    // A scalar too.
    let scalar = on_device(&g, &[1, 2, 3, 4, 5, 6, 7, 8]);
    m.register(
        spec("scalar", DType::F64, &[], None),
        NdBox::full(&[]),
        Arc::new(scalar.clone()),
    )
    .unwrap();
    let h = m.save_now(1).unwrap();
    let rep = h.wait_committed(Duration::from_secs(60)).unwrap();
    assert!(rep.snapshot_s > 0.0 && rep.bytes > 1 << 20, "{rep:?}");

    let mut m2 = manager(&store, "rt", "dp=1", 0);
    let mut fresh = Vec::new();
    for (name, dt, shape, t, _) in &tensors {
        let f = DeviceTensor::alloc(&g, t.len()).unwrap();
        m2.register(
            spec(name, *dt, shape, None),
            NdBox::full(shape),
            Arc::new(f.clone()),
        )
        .unwrap();
        fresh.push(f);
    }
    let fs = DeviceTensor::alloc(&g, 8).unwrap();
    m2.register(
        spec("scalar", DType::F64, &[], None),
        NdBox::full(&[]),
        Arc::new(fs.clone()),
    )
    .unwrap();
    m2.restore(1).unwrap();
    for ((name, _, _, t, bytes), f) in tensors.iter().zip(&fresh) {
        assert!(
            same(f, t),
            "{name} differs on the device after the round trip"
        );
        assert_eq!(&f.download().unwrap(), bytes, "{name}");
    }
    assert!(same(&fs, &scalar));
}

#[test]
fn a_mutation_after_the_snapshot_never_reaches_the_checkpoint() {
    let Some(g) = gpu("a_mutation_after_the_snapshot_never_reaches_the_checkpoint") else {
        return;
    };
    let (store, _dir) = store();
    let n = 6 << 20;
    let t = DeviceTensor::alloc(&g, n).unwrap();
    t.fill(0x11).unwrap();
    let mut m = manager(&store, "mut", "dp=1", 0);
    m.register(
        spec("w", DType::U8, &[n as u64], None),
        NdBox::full(&[n as u64]),
        Arc::new(t.clone()),
    )
    .unwrap();
    g.synchronize().unwrap();

    // Work the loop queued before `save` and the host never waited for: the GPU is busy, then
    // the tensor is written (0x22). The snapshot must hold that write.
    let busy = Duration::from_millis(400);
    let delayed = match g.busy(t.stream(), busy) {
        Ok(()) => true,
        Err(e) => {
            eprintln!("WARNING: no busy kernel ({e}); the pending write is not delayed");
            false
        }
    };
    t.fill(0x22).unwrap();
    let t0 = Instant::now();
    let h = m.save_now(1).unwrap();
    let save_returned = t0.elapsed();
    // Forward and backward would run here; then the optimizer step, after the snapshot.
    h.wait_snapshot().unwrap();
    let snapshot = t0.elapsed();
    t.fill(0x33).unwrap();
    h.wait_committed(Duration::from_secs(60)).unwrap();
    if delayed {
        assert!(
            save_returned < Duration::from_millis(200),
            "save waited for the GPU: {save_returned:?}"
        );
        assert!(
            snapshot >= Duration::from_millis(300),
            "the snapshot did not wait for the queued write: {snapshot:?}"
        );
    }
    // The mutation is in the next save, not in this one.
    m.save_now(2)
        .unwrap()
        .wait_committed(Duration::from_secs(60))
        .unwrap();
    for (step, byte) in [(1, 0x22u8), (2, 0x33)] {
        let f = DeviceTensor::alloc(&g, n).unwrap();
        let mut m2 = manager(&store, "mut", "dp=1", 0);
        m2.register(
            spec("w", DType::U8, &[n as u64], None),
            NdBox::full(&[n as u64]),
            Arc::new(f.clone()),
        )
        .unwrap();
        m2.restore(step).unwrap();
        let want = DeviceTensor::alloc(&g, n).unwrap();
        want.fill(byte).unwrap();
        assert!(same(&f, &want), "step {step} should hold {byte:#x}");
    }
}

fn zero_spec(name: &str, dtype: DType, shape: &[u64]) -> TensorSpec {
    let mut s = spec(name, dtype, shape, Some(1));
    s.placement.zero = Some(ZeroGroup {
        group: "exp_avg".into(),
        from_stage: 1,
    });
    s
}

#[test]
fn resharded_restores_onto_other_layouts_on_the_device() {
    let Some(g) = gpu("resharded_restores_onto_other_layouts_on_the_device") else {
        return;
    };
    let (store, _dir) = store();
    let (rows, cols) = (301usize, 96usize);
    let dtypes = [DType::F32, DType::Bf16, DType::U8];
    let full: Vec<Vec<u8>> = dtypes
        .iter()
        .enumerate()
        .map(|(i, d)| det_bytes(7 + i as u64, rows * cols * d.size()))
        .collect();
    let shape = [rows as u64, cols as u64];
    let specs: Vec<TensorSpec> = dtypes
        .iter()
        .map(|d| zero_spec(&format!("m.{}", d.name()), *d, &shape))
        .collect();

    // 1. Saved by tp=2: each rank holds its column half.
    let mut ms: Vec<CheckpointManager> = (0..2).map(|r| manager(&store, "a", "tp=2", r)).collect();
    for (r, m) in ms.iter_mut().enumerate() {
        for (s, bytes) in specs.iter().zip(&full) {
            let held = tp_box(s, r as u32, 2).unwrap();
            let e = s.dtype.size();
            let part = columns(bytes, rows, cols, e, r * cols / 2, cols / 2);
            m.register(s.clone(), held, Arc::new(on_device(&g, &part)))
                .unwrap();
        }
    }
    let hs: Vec<_> = ms.iter_mut().map(|m| m.save_now(1).unwrap()).collect();
    for h in &hs {
        h.wait_persisted().unwrap();
    }
    hs[0].wait_committed(Duration::from_secs(60)).unwrap();

    // Restored by one rank holding everything.
    let mut one = manager(&store, "a", "dp=1", 0);
    let mut got = Vec::new();
    for s in &specs {
        let t = DeviceTensor::alloc(&g, rows * cols * s.dtype.size()).unwrap();
        one.register(s.clone(), NdBox::full(&shape), Arc::new(t.clone()))
            .unwrap();
        got.push(t);
    }
    one.restore(1).unwrap();
    for ((s, t), bytes) in specs.iter().zip(&got).zip(&full) {
        assert!(same(t, &on_device(&g, bytes)), "tp=2 -> dp=1: {}", s.name);
    }

    // 2. Saved by dp=4 with ZeRO-1: each rank holds the whole tensors and saves its range of
    //    their flat concatenation (3 x 28896 elements in ranges of 21672: partial rows, so
    //    strided device-to-host copies of sub-boxes).
    let mut ms: Vec<CheckpointManager> = (0..4)
        .map(|r| manager(&store, "b", "dp=4,zero=1", r))
        .collect();
    for m in ms.iter_mut() {
        for (s, t) in specs.iter().zip(&got) {
            m.register(s.clone(), NdBox::full(&shape), Arc::new(t.clone()))
                .unwrap();
        }
    }
    let hs: Vec<_> = ms.iter_mut().map(|m| m.save_now(5).unwrap()).collect();
    for h in &hs {
        h.wait_persisted().unwrap();
    }
    hs[0].wait_committed(Duration::from_secs(60)).unwrap();
    let commit = runtime()
        .block_on(store.log().read_commit("b", 5))
        .unwrap()
        .0;
    assert!(
        commit.tensor(&specs[0].name).unwrap().shards.len() >= 2,
        "the first tensor is cut across ranks"
    );

    // Restored by tp=2: column halves on two ranks.
    for r in 0..2u32 {
        let mut m = manager(&store, "b", "tp=2", r);
        let mut halves = Vec::new();
        for s in &specs {
            let held = tp_box(s, r, 2).unwrap();
            let t = DeviceTensor::alloc(&g, held.numel() as usize * s.dtype.size()).unwrap();
            m.register(s.clone(), held, Arc::new(t.clone())).unwrap();
            halves.push(t);
        }
        m.restore(5).unwrap();
        for ((s, t), bytes) in specs.iter().zip(&halves).zip(&full) {
            let e = s.dtype.size();
            let want = columns(bytes, rows, cols, e, r as usize * cols / 2, cols / 2);
            assert!(
                same(t, &on_device(&g, &want)),
                "dp=4,zero=1 -> tp=2 rank {r}: {}",
                s.name
            );
        }
    }
}

/// Device memory owned outside ckpt (as a framework's tensor is): a plain `cuMemAlloc`.
struct Foreign {
    g: Arc<Gpu>,
    ptr: u64,
}

impl Foreign {
    fn new(g: &Arc<Gpu>, len: usize) -> Foreign {
        g.context().bind_to_thread().unwrap();
        // SAFETY: freed in Drop.
        let ptr = unsafe { cudarc::driver::result::malloc_sync(len) }.unwrap();
        Foreign { g: g.clone(), ptr }
    }
}

impl Drop for Foreign {
    fn drop(&mut self) {
        self.g.synchronize().unwrap();
        // SAFETY: allocated in new; the device is idle.
        unsafe { cudarc::driver::result::free_sync(self.ptr) }.unwrap();
    }
}

#[test]
fn raw_device_pointers_are_checked_and_round_trip() {
    let Some(g) = gpu("raw_device_pointers_are_checked_and_round_trip") else {
        return;
    };
    let n = 1 << 20;
    let mem = Foreign::new(&g, n);
    let dst_mem = Foreign::new(&g, n);
    let bytes = det_bytes(9, n);
    // SAFETY: `mem` outlives the raw tensors (dropped at the end of the test).
    let raw = unsafe { DeviceTensor::from_raw(&g, mem.ptr, n, None) }.unwrap();
    raw.upload(0, &bytes).unwrap();
    assert_eq!(raw.download().unwrap(), bytes);
    // Past the end of the allocation (whatever it was rounded up to).
    // SAFETY: the call fails before using the memory.
    let e = unsafe { DeviceTensor::from_raw(&g, mem.ptr + 4096, 64 << 20, None) }.unwrap_err();
    assert!(e.to_string().contains("past the end"), "{e}");
    let host = vec![0u8; 4096];
    // SAFETY: a host pointer: the check refuses it.
    let e = unsafe { DeviceTensor::from_raw(&g, host.as_ptr() as u64, 4096, None) }.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");

    let (store, _dir) = store();
    let mut m = manager(&store, "raw", "dp=1", 0);
    m.register(
        spec("w", DType::F32, &[512, 512], None),
        NdBox::full(&[512, 512]),
        Arc::new(raw.clone()),
    )
    .unwrap();
    m.save_now(1)
        .unwrap()
        .wait_committed(Duration::from_secs(60))
        .unwrap();
    // SAFETY: `dst_mem` outlives the raw tensor.
    let raw_dst = unsafe { DeviceTensor::from_raw(&g, dst_mem.ptr, n, None) }.unwrap();
    let mut m2 = manager(&store, "raw", "dp=1", 0);
    m2.register(
        spec("w", DType::F32, &[512, 512], None),
        NdBox::full(&[512, 512]),
        Arc::new(raw_dst.clone()),
    )
    .unwrap();
    m2.restore(1).unwrap();
    assert!(same(&raw_dst, &raw));
    drop((m, m2, raw, raw_dst));
}

/// A survivor holding rows 0..48 of a [64, 40] f32 tensor in device memory; the rank needs
/// columns 8..32 of all rows: rows 0..48 come from the survivor, the rest from the store.
fn peer_case(
    g: &Arc<Gpu>,
    ex: &PeerExchange,
    test: &str,
) -> (ckpt_trainer::cuda::peer::PeerRestoreStats, bool) {
    let (store, _dir) = store();
    let shape = [64u64, 40];
    let full = det_bytes(21, 64 * 40 * 4);
    let s = spec("w", DType::F32, &shape, None);
    let mut m = manager(&store, test, "dp=1", 0);
    m.register(
        s.clone(),
        NdBox::full(&shape),
        Arc::new(on_device(g, &full)),
    )
    .unwrap();
    m.save_now(3)
        .unwrap()
        .wait_committed(Duration::from_secs(60))
        .unwrap();

    let rows_held = NdBox::new(vec![0, 0], vec![48, 40]).unwrap();
    let survivor = on_device(g, &full[..48 * 40 * 4]);
    let want_box = NdBox::new(vec![0, 8], vec![64, 24]).unwrap();
    let dest = DeviceTensor::alloc(g, 64 * 24 * 4).unwrap();
    let p = plan(
        3,
        &[Need {
            rank: 0,
            tensor: "w".into(),
            bbox: want_box.clone(),
            elem: 4,
        }],
        &[Holding {
            rank: 0,
            tensor: "w".into(),
            bbox: rows_held.clone(),
            elem: 4,
            step: 3,
        }],
        &fast_link(),
    );
    assert!(p.use_peers && p.store_reads.len() == 1, "{p:?}");
    let pt = |held: &NdBox, memory: &DeviceTensor| PeerTensor {
        name: "w".into(),
        dtype: DType::F32,
        shape: shape.to_vec(),
        held: held.clone(),
        memory: memory.clone(),
    };
    let reader = runtime()
        .block_on(StepReader::open(&store, test, 3))
        .unwrap();
    let stats = restore_with_peers(
        &reader,
        Some(ex),
        &p,
        0,
        &[pt(&rows_held, &survivor)],
        &[pt(&want_box, &dest)],
        1 << 20,
    )
    .unwrap();
    let want = columns(&full, 64, 40, 4, 8, 24);
    (stats, same(&dest, &on_device(g, &want)))
}

#[test]
fn a_local_re_layout_copies_on_the_device_and_reads_the_rest_from_the_store() {
    let Some(g) = gpu("a_local_re_layout_copies_on_the_device_and_reads_the_rest_from_the_store")
    else {
        return;
    };
    let ex = PeerExchange::local(&g).unwrap();
    let (stats, ok) = peer_case(&g, &ex, "local");
    assert!(ok);
    assert_eq!(stats.peers.bytes_local, 48 * 24 * 4, "{stats:?}");
    assert_eq!(stats.store.bytes_copied, 16 * 24 * 4, "{stats:?}");
}

#[test]
fn nccl_sends_a_region_on_one_gpu() {
    let Some(g) = gpu("nccl_sends_a_region_on_one_gpu") else {
        return;
    };
    if !nccl("nccl_sends_a_region_on_one_gpu") {
        return;
    }
    let id = PeerExchange::unique_id().unwrap();
    let mut ex = PeerExchange::new(&g, 0, 1, &id).unwrap();
    ex.local_via_nccl = true;
    let (stats, ok) = peer_case(&g, &ex, "nccl1");
    assert!(ok);
    assert_eq!(stats.peers.bytes_sent, 48 * 24 * 4, "{stats:?}");
    assert_eq!(stats.peers.bytes_received, 48 * 24 * 4, "{stats:?}");
}

#[test]
fn nccl_sends_regions_between_two_gpus() {
    let Some(_g) = gpu("nccl_sends_regions_between_two_gpus") else {
        return;
    };
    if Gpu::count().unwrap() < 2 {
        eprintln!("SKIPPED nccl_sends_regions_between_two_gpus: one GPU");
        return;
    }
    if !nccl("nccl_sends_regions_between_two_gpus") {
        return;
    }
    // Rank 0 survived with the whole [128, 64] tensor; under the new layout rank 0 keeps the
    // top half and rank 1 (a fresh GPU) needs the bottom half.
    let shape = [128u64, 64];
    let full = det_bytes(33, 128 * 64 * 2);
    let top = NdBox::new(vec![0, 0], vec![64, 64]).unwrap();
    let bottom = NdBox::new(vec![64, 0], vec![64, 64]).unwrap();
    let p = plan(
        9,
        &[
            Need {
                rank: 0,
                tensor: "w".into(),
                bbox: top.clone(),
                elem: 2,
            },
            Need {
                rank: 1,
                tensor: "w".into(),
                bbox: bottom.clone(),
                elem: 2,
            },
        ],
        &[Holding {
            rank: 0,
            tensor: "w".into(),
            bbox: NdBox::full(&shape),
            elem: 2,
            step: 9,
        }],
        &fast_link(),
    );
    assert!(p.use_peers && p.store_reads.is_empty(), "{p:?}");
    let id = PeerExchange::unique_id().unwrap();
    let handles: Vec<_> = (0..2u32)
        .map(|r| {
            let (p, full, top, bottom) = (p.clone(), full.clone(), top.clone(), bottom.clone());
            std::thread::spawn(move || {
                let g = Gpu::open(r as usize).unwrap();
                let ex = PeerExchange::new(&g, r, 2, &id).unwrap();
                let pt = |held: &NdBox, memory: DeviceTensor| PeerTensor {
                    name: "w".into(),
                    dtype: DType::Bf16,
                    shape: shape.to_vec(),
                    held: held.clone(),
                    memory,
                };
                let sources = if r == 0 {
                    vec![pt(&NdBox::full(&shape), on_device(&g, &full))]
                } else {
                    vec![]
                };
                let mine = if r == 0 { &top } else { &bottom };
                let dest = DeviceTensor::alloc(&g, 64 * 64 * 2).unwrap();
                let st = ex.execute(&p, &sources, &[pt(mine, dest.clone())]).unwrap();
                let half = if r == 0 {
                    &full[..64 * 64 * 2]
                } else {
                    &full[64 * 64 * 2..]
                };
                (st, dest.download().unwrap() == half)
            })
        })
        .collect();
    for (r, h) in handles.into_iter().enumerate() {
        let (st, ok) = h.join().unwrap();
        assert!(ok, "rank {r}: {st:?}");
    }
}
