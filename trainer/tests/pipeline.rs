//! The save pipeline as a library: snapshot semantics, stages, back-pressure, the staging
//! bound, replicas, O(ranks) commits, and restore errors.

use std::sync::Arc;
use std::time::Duration;

use ckpt_store::placement::TensorSpec;
use ckpt_store::testing::{det_bytes, local_store, memory_store, tiny_config};
use ckpt_store::{DType, ErrorKind, Layout, NdBox, Store, StoreConfig};
use ckpt_trainer::{
    BackPressure, CheckpointManager, Checkpointer, CheckpointerConfig, HostTensor, ManagerConfig,
    SaveState, SaveTensor, SnapshotOverlap, Stage, runtime,
};

mod common;
use common::read;

fn spec(name: &str, shape: &[u64], tp_dim: Option<usize>) -> TensorSpec {
    TensorSpec::first_stage(name, DType::F32, shape).with_tp(tp_dim)
}

#[test]
fn a_mutation_after_save_never_reaches_the_checkpoint() {
    let (store, _d) = local_store(tiny_config());
    let n = 300_000u64; // ~74 chunks of 4 KiB
    let t = HostTensor::from_vec(det_bytes(1, n as usize));
    let before = t.read().clone();
    let ck = Checkpointer::new(
        store.clone(),
        CheckpointerConfig::new("mut", 0, Layout::SINGLE),
    )
    .unwrap();
    let h = ck
        .save(
            1,
            SaveState {
                tensors: vec![SaveTensor::bytes("t", &t, n)],
                blobs: vec![],
            },
        )
        .unwrap();
    // Mutate at once, without waiting for the snapshot: the write waits for the copy.
    t.write().fill(0xee);
    h.wait_committed(Duration::from_secs(30)).unwrap();
    assert_eq!(read(&store, "mut", 1, "t"), before);
    // The explicit protocol: wait for the snapshot, then mutate.
    let h2 = ck
        .save(
            2,
            SaveState {
                tensors: vec![SaveTensor::bytes("t", &t, n)],
                blobs: vec![],
            },
        )
        .unwrap();
    h2.wait_snapshot().unwrap();
    t.write().fill(0x11);
    h2.wait_committed(Duration::from_secs(30)).unwrap();
    assert_eq!(read(&store, "mut", 2, "t"), vec![0xee; n as usize]);
}

#[test]
fn stages_are_reported_in_order_with_figures() {
    let (store, _d) = local_store(tiny_config());
    let t = HostTensor::from_vec(det_bytes(2, 50_000));
    let ck = Checkpointer::new(
        store.clone(),
        CheckpointerConfig::new("st", 0, Layout::SINGLE),
    )
    .unwrap();
    let h = ck
        .save(
            7,
            SaveState {
                tensors: vec![SaveTensor::bytes("t", &t, 50_000)],
                blobs: vec![("b".into(), vec![1, 2, 3])],
            },
        )
        .unwrap();
    let s = h.wait_snapshot().unwrap();
    assert!(s.snapshot_s > 0.0);
    let p = h.wait_persisted().unwrap();
    assert!(
        p.persist_s >= s.snapshot_s && p.bytes_written > 50_000,
        "{p:?}"
    );
    let c = h.wait_committed(Duration::from_secs(30)).unwrap();
    assert_eq!(h.stage(), Stage::Committed);
    assert!(c.commit_s > 0.0, "{c:?}");
    assert_eq!(
        runtime()
            .block_on(store.log().latest_committed("st"))
            .unwrap(),
        Some(7)
    );
}

#[test]
fn back_pressure_wait_and_skip() {
    // A slow store (every put delayed) keeps the first save persisting.
    let fs = ckpt_store::FaultyStore::new(ckpt_store::object_store::memory::InMemory::new());
    let faults = fs.handle();
    faults.add(ckpt_store::Fault {
        op: ckpt_store::FaultOp::Put,
        key_contains: Some("chunks/".into()),
        nth: 0,
        action: ckpt_store::FaultAction::Delay(Duration::from_millis(30)),
    });
    let store = Store::new(Arc::new(fs), Default::default(), "faulty://")
        .with_config(tiny_config())
        .unwrap();
    let t = HostTensor::from_vec(det_bytes(3, 40_000));
    for (policy, skipped) in [(BackPressure::Skip, true), (BackPressure::Wait, false)] {
        let mut cfg = CheckpointerConfig::new(&format!("bp{}", skipped as u8), 0, Layout::SINGLE);
        cfg.back_pressure = policy;
        let ck = Checkpointer::new(store.clone(), cfg).unwrap();
        let h1 = ck
            .save(
                1,
                SaveState {
                    tensors: vec![SaveTensor::bytes("t", &t, 40_000)],
                    blobs: vec![],
                },
            )
            .unwrap();
        h1.wait_snapshot().unwrap();
        let h2 = ck
            .save(
                2,
                SaveState {
                    tensors: vec![SaveTensor::bytes("t", &t, 40_000)],
                    blobs: vec![],
                },
            )
            .unwrap();
        assert_eq!(h2.is_skipped(), skipped);
        if skipped {
            let e = h2.wait_persisted().unwrap_err();
            assert!(e.to_string().contains("still being persisted"), "{e}");
        } else {
            assert!(
                matches!(h1.stage(), Stage::Persisted | Stage::Committed),
                "wait policy waited"
            );
            h2.wait_committed(Duration::from_secs(30)).unwrap();
        }
        h1.wait_committed(Duration::from_secs(30)).unwrap();
    }
}

#[test]
fn staging_memory_stays_within_its_bound() {
    // 2 MiB of state through 256 KiB of staging: the snapshot waits for the persist.
    let (store, _d) = local_store(tiny_config());
    let n = 2 << 20;
    let t = HostTensor::from_vec(det_bytes(4, n));
    let mut cfg = CheckpointerConfig::new("bound", 0, Layout::SINGLE);
    cfg.staging_bytes = 256 << 10;
    let ck = Checkpointer::new(store.clone(), cfg).unwrap();
    let h = ck
        .save(
            1,
            SaveState {
                tensors: vec![SaveTensor::bytes("t", &t, n as u64)],
                blobs: vec![],
            },
        )
        .unwrap();
    h.wait_committed(Duration::from_secs(60)).unwrap();
    let st = ck.staging();
    assert!(
        st.peak_in_use <= 256 << 10 && st.allocated <= 256 << 10,
        "{st:?}"
    );
    assert_eq!(read(&store, "bound", 1, "t"), *t.read());
}

/// A source that copies slowly (the memory of a busy machine, or a device behind a slow link:
/// `dma`).
struct SlowSource {
    bytes: Arc<Vec<u8>>,
    dma: bool,
    /// The time each copy takes.
    delay: Duration,
}

struct SlowPin {
    bytes: Arc<Vec<u8>>,
    dma: bool,
    delay: Duration,
}

impl ckpt_trainer::MemorySource for SlowSource {
    fn len(&self) -> usize {
        self.bytes.len()
    }

    fn pin(&self) -> ckpt_store::Result<Box<dyn ckpt_trainer::PinnedSource>> {
        Ok(Box::new(SlowPin {
            bytes: self.bytes.clone(),
            dma: self.dma,
            delay: self.delay,
        }))
    }
}

impl ckpt_trainer::PinnedSource for SlowPin {
    fn copy_to(&self, offset: usize, dst: &mut [u8]) -> ckpt_store::Result<()> {
        std::thread::sleep(self.delay);
        dst.copy_from_slice(&self.bytes[offset..offset + dst.len()]);
        Ok(())
    }

    fn complete(self: Box<Self>) -> ckpt_store::Result<()> {
        Ok(())
    }

    fn copies_by_dma(&self) -> bool {
        self.dma
    }
}

#[test]
fn a_snapshot_a_little_larger_than_its_pool_copies_before_the_persist_starts() {
    // 64 chunks through a pool of 60: the copy has the cores to itself until it must wait for
    // staging, so the pool fills up (all but less than a batch) before any chunk is persisted.
    // Were the persist started with the copy, it would drain each chunk as it came (the copy is
    // slow here) and the pool would never hold more than a few batches.
    let store = memory_store(tiny_config());
    let chunk = tiny_config().chunk_size;
    let n = 64 * chunk;
    let src = SlowSource {
        bytes: Arc::new(det_bytes(9, n)),
        dma: false,
        delay: Duration::from_millis(3),
    };
    let want = src.bytes.as_ref().clone();
    let mut cfg = CheckpointerConfig::new("fill", 0, Layout::SINGLE);
    cfg.staging_bytes = 60 * chunk;
    cfg.copy_threads = 2;
    let ck = Checkpointer::new(store.clone(), cfg).unwrap();
    let mut t = SaveTensor::bytes("t", &HostTensor::from_vec(vec![0; n]), n as u64);
    t.source = Some(Arc::new(src));
    let h = ck
        .save(
            1,
            SaveState {
                tensors: vec![t],
                blobs: vec![],
            },
        )
        .unwrap();
    let r = h.wait_committed(Duration::from_secs(60)).unwrap();
    let batch = 2 * 4 * chunk;
    assert!(
        r.staging_peak + batch > 60 * chunk,
        "the pool peaked at {} of {} bytes: the persist drained it while the copy went on",
        r.staging_peak,
        60 * chunk
    );
    assert!(r.staging_peak <= 60 * chunk, "{}", r.staging_peak);
    assert_eq!(read(&store, "fill", 1, "t"), want);
}

#[test]
fn the_persist_takes_each_chunk_as_it_lands_when_the_snapshot_overlaps_it() {
    // 64 slow chunks (about 0.3 s of copying) into a pool that holds them all. A persist that
    // starts after the copy (a host source under `Auto`, or `Never`) finds the whole snapshot
    // in the pool; one that starts with it (`Always`, or `Auto` for a source copied by DMA,
    // as a device tensor is) writes each chunk as it lands, so the pool never holds more than
    // a few batches, unless the persist governor's rate limit holds it back: an overlapping
    // persist is paced while the copy runs (the loop goes on beside a DMA), here to a quarter
    // of the state a second, and the limit is lifted once the copy is done.
    let chunk = tiny_config().chunk_size;
    let n = 64 * chunk;
    let batch = 2 * 4 * chunk;
    let paced = Some(n as u64 / 4);
    for (overlap, dma, limit, drains) in [
        (SnapshotOverlap::Never, true, None, false),
        (SnapshotOverlap::Auto, false, None, false),
        (SnapshotOverlap::Auto, true, None, true),
        (SnapshotOverlap::Always, false, None, true),
        (SnapshotOverlap::Auto, true, paced, false),
    ] {
        let store = memory_store(tiny_config());
        let src = SlowSource {
            bytes: Arc::new(det_bytes(11, n)),
            dma,
            delay: Duration::from_millis(10),
        };
        let want = src.bytes.as_ref().clone();
        let mut cfg = CheckpointerConfig::new("overlap", 0, Layout::SINGLE);
        cfg.staging_bytes = n;
        cfg.copy_threads = 2;
        cfg.snapshot_overlap = overlap;
        let ck = Checkpointer::new(store.clone(), cfg).unwrap();
        ck.persist_rate().set(limit);
        let mut t = SaveTensor::bytes("t", &HostTensor::from_vec(vec![0; n]), n as u64);
        t.source = Some(Arc::new(src));
        let state = SaveState {
            tensors: vec![t],
            blobs: vec![],
        };
        let h = ck.save(1, state).unwrap();
        h.wait_snapshot().unwrap();
        ck.persist_rate().set(None);
        let r = h.wait_committed(Duration::from_secs(60)).unwrap();
        let case = format!("{overlap:?}, dma {dma}, limit {limit:?}");
        assert_eq!(r.overlapped, drains || limit.is_some(), "{case}");
        if drains {
            assert!(
                r.staging_peak <= n / 2,
                "{case}: the pool peaked at {} of {n} bytes: the persist waited for the copy",
                r.staging_peak
            );
        } else if limit.is_some() {
            assert!(
                r.staging_peak >= 3 * n / 4,
                "{case}: the pool peaked at {} of {n} bytes: the persist ran unpaced",
                r.staging_peak
            );
        } else {
            assert!(
                r.staging_peak + batch > n,
                "{case}: the pool peaked at {} of {n} bytes: the persist drained it during the copy",
                r.staging_peak
            );
        }
        assert_eq!(read(&store, "overlap", 1, "t"), want, "{case}");
    }
}

#[test]
fn a_save_right_after_start_up_is_bit_exact_while_staging_fills_in_the_background() {
    // 8 MiB of state in 4 KiB chunks: 2049 slabs for the background to touch, so the first
    // save starts while it is still filling and takes the slabs already made.
    let (store, _d) = local_store(tiny_config());
    let n = 8 << 20;
    let t = HostTensor::from_vec(det_bytes(7, n));
    let mut cfg = CheckpointerConfig::new("early", 0, Layout::SINGLE);
    cfg.staging_bytes = n + tiny_config().chunk_size;
    assert!(cfg.background_prefault, "on by default");
    let ck = Checkpointer::new(store.clone(), cfg).unwrap();
    let state = || SaveState {
        tensors: vec![SaveTensor::bytes("t", &t, n as u64)],
        blobs: vec![],
    };
    let h = ck.save(1, state()).unwrap();
    h.wait_snapshot().unwrap();
    t.write().fill(0x5a);
    h.wait_committed(Duration::from_secs(60)).unwrap();
    assert_eq!(read(&store, "early", 1, "t"), det_bytes(7, n));
    let h = ck.save(2, state()).unwrap();
    h.wait_committed(Duration::from_secs(60)).unwrap();
    assert_eq!(read(&store, "early", 2, "t"), vec![0x5a; n]);
    // The fill ends at the bound, the books right: nothing in use, never over the bound.
    let bound = n + tiny_config().chunk_size;
    let t0 = std::time::Instant::now();
    while ck.staging().allocated < bound && t0.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let st = ck.staging();
    assert_eq!(
        (st.allocated, st.in_use, st.capacity),
        (bound, 0, bound),
        "{st:?}"
    );
    assert!(st.peak_in_use <= bound, "{st:?}");
}

#[test]
fn replicas_cost_nothing_and_commit_costs_o_ranks_requests() {
    // 32 data-parallel ranks holding the same two tensors: placement picks one writer per
    // tensor, the others record replicas. Count store requests.
    let store = memory_store(tiny_config());
    let layout: Layout = "dp=32".parse().unwrap();
    let rep = spec("rep", &[64, 16], None);
    let mut rows = spec("rows", &[32, 256], Some(0));
    rows.placement.order = 1;
    let full = det_bytes(5, 64 * 16 * 4);
    let before = metrics(&store);
    let mut handles = Vec::new();
    for r in 0..32u32 {
        let mut mc = ManagerConfig::new(CheckpointerConfig::new("wide", r, layout));
        mc.final_on_sigterm = false;
        let mut m = CheckpointManager::new(store.clone(), mc).unwrap();
        m.register(
            rep.clone(),
            NdBox::full(&[64, 16]),
            Arc::new(HostTensor::from_vec(full.clone())),
        )
        .unwrap();
        m.register(
            rows.clone(),
            NdBox::full(&[32, 256]),
            Arc::new(HostTensor::from_vec(det_bytes(6, 32 * 256 * 4))),
        )
        .unwrap();
        handles.push((m.save_now(1).unwrap(), m));
    }
    for (h, _) in &handles {
        h.wait_persisted().unwrap();
    }
    handles[0]
        .0
        .wait_committed(Duration::from_secs(60))
        .unwrap();
    let used = metrics(&store) - before;
    let c = runtime()
        .block_on(store.log().read_commit("wide", 1))
        .unwrap()
        .0;
    assert_eq!(
        c.tensor("rep").unwrap().shards.len(),
        1,
        "one writer for a replicated tensor"
    );
    assert_eq!(
        c.stats.logical_bytes,
        (64 * 16 + 32 * 256) * 4,
        "replicas were not written"
    );
    // Per rank: one manifest put, one manifest read by the committer, a few polls, the
    // generation join (a list, the marker) and the writer lease (put, list, delete); chunk
    // puts are for the two writers only. O(ranks), far below 32^2 = 1024.
    assert!(used.requests() < 32 * 12, "{used:?}");
}

fn metrics(store: &Store) -> ckpt_store::MetricsSnapshot {
    store.metrics().expect("opened with counters").snapshot()
}

#[test]
fn a_damaged_chunk_fails_the_restore_naming_step_tensor_and_chunk() {
    // One manager alive in the process, a local store: raw chunks are hashed while they are
    // copied into the tensor (issue 27). A byte flipped in one chunk object must still fail
    // the restore, naming the step, the tensor and the chunk, and an intact copy restores.
    let (store, dir) = local_store(tiny_config());
    let data = det_bytes(4, 64 << 10);
    {
        // Saved, and the manager gone before the restores.
        let mut c = ManagerConfig::new(CheckpointerConfig::new("dmg", 0, Layout::SINGLE));
        c.final_on_sigterm = false;
        let mut m = CheckpointManager::new(store.clone(), c).unwrap();
        m.register(
            spec("w", &[16 << 10], None),
            NdBox::full(&[16 << 10]),
            Arc::new(HostTensor::from_vec(data.clone())),
        )
        .unwrap();
        m.save_now(1)
            .unwrap()
            .wait_committed(Duration::from_secs(30))
            .unwrap();
        m.finish().unwrap();
    }
    let restore = || {
        let mut c = ManagerConfig::new(CheckpointerConfig::new("dmg", 0, Layout::SINGLE));
        c.final_on_sigterm = false;
        let mut m = CheckpointManager::new(store.clone(), c).unwrap();
        let t = HostTensor::zeroed(data.len());
        m.register(
            spec("w", &[16 << 10], None),
            NdBox::full(&[16 << 10]),
            Arc::new(t.clone()),
        )
        .unwrap();
        m.restore(1).map(|()| t.read().clone())
    };
    assert_eq!(restore().unwrap(), data);
    // Flip a byte in the middle of one chunk object's payload.
    let mut objects = Vec::new();
    let mut stack = vec![dir.path().join("chunks")];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                objects.push(p);
            }
        }
    }
    objects.sort();
    let victim = &objects[objects.len() / 2];
    let mut b = std::fs::read(victim).unwrap();
    let mid = b.len() - 100;
    b[mid] ^= 0x01;
    std::fs::write(victim, &b).unwrap();
    let e = restore().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    let msg = e.to_string();
    let id = victim.file_name().unwrap().to_str().unwrap();
    assert!(
        msg.contains("step 1")
            && msg.contains("\"w\"")
            && msg.contains(id)
            && msg.contains("damaged"),
        "{msg}"
    );
}

#[test]
fn restore_errors_name_the_problem() {
    let (store, _d) = local_store(tiny_config());
    let mut m = CheckpointManager::new(store.clone(), {
        let mut c = ManagerConfig::new(CheckpointerConfig::new("err", 0, Layout::SINGLE));
        c.final_on_sigterm = false;
        c
    })
    .unwrap();
    m.register(
        spec("w", &[8, 4], Some(0)),
        NdBox::full(&[8, 4]),
        Arc::new(HostTensor::zeroed(128)),
    )
    .unwrap();
    m.save_now(1)
        .unwrap()
        .wait_committed(Duration::from_secs(30))
        .unwrap();

    let mk = |s: TensorSpec, held: NdBox, bytes: usize, layout: &str, rank: u32| {
        let mut c = ManagerConfig::new(CheckpointerConfig::new(
            "err",
            rank,
            layout.parse().unwrap(),
        ));
        c.final_on_sigterm = false;
        let mut m = CheckpointManager::new(store.clone(), c).unwrap();
        m.register(s, held, Arc::new(HostTensor::zeroed(bytes)))
            .unwrap();
        m
    };
    let e = mk(
        spec("nope", &[8, 4], None),
        NdBox::full(&[8, 4]),
        128,
        "dp=1",
        0,
    )
    .restore(1)
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound);
    assert!(e.to_string().contains("\"nope\""), "{e}");
    let e = mk(
        spec("w", &[4, 8], None),
        NdBox::full(&[4, 8]),
        128,
        "dp=1",
        0,
    )
    .restore(1)
    .unwrap_err();
    assert!(
        e.to_string().contains("[8, 4]") && e.to_string().contains("[4, 8]"),
        "{e}"
    );
    // tp=3 does not divide dimension 0 (8): the save refuses, naming tensor and dimension.
    let mut m3 = mk(
        spec("w", &[8, 4], Some(0)),
        NdBox::full(&[8, 4]),
        128,
        "tp=3",
        0,
    );
    let e = m3.save_now(2).unwrap_err();
    assert!(
        e.to_string().contains("\"w\"") && e.to_string().contains("does not divide by tp=3"),
        "{e}"
    );
    let _ = StoreConfig::default();
}

#[test]
fn ranks_of_one_process_share_chunks_while_they_reshard() {
    // Saved with tp=2 splitting the columns; restored with tp=4. Each new rank needs a quarter
    // of every row, so both new ranks over one old shard need every chunk of it: without the
    // shared cache the store would serve each chunk twice.
    let store = memory_store(tiny_config());
    let (rows, cols) = (64u64, 256u64);
    let full = det_bytes(9, (rows * cols * 4) as usize);
    let col = |r: u64, parts: u64| {
        NdBox::new(vec![0, r * cols / parts], vec![rows, cols / parts]).unwrap()
    };
    let slice = |b: &NdBox| -> Vec<u8> {
        let (c0, n) = (b.offsets[1] as usize, b.lengths[1] as usize);
        (0..rows as usize)
            .flat_map(|i| {
                let at = (i * cols as usize + c0) * 4;
                full[at..at + n * 4].to_vec()
            })
            .collect()
    };
    let w = spec("w", &[rows, cols], Some(1));
    let manager = |rank: u32, layout: &str| {
        let mut c = ManagerConfig::new(CheckpointerConfig::new(
            "share",
            rank,
            layout.parse().unwrap(),
        ));
        c.final_on_sigterm = false;
        CheckpointManager::new(store.clone(), c).unwrap()
    };
    let mut saved = Vec::new();
    for r in 0..2u32 {
        let mut m = manager(r, "tp=2");
        let b = col(r as u64, 2);
        m.register(
            w.clone(),
            b.clone(),
            Arc::new(HostTensor::from_vec(slice(&b))),
        )
        .unwrap();
        saved.push((m.save_now(1).unwrap(), m));
    }
    for (h, _) in &saved {
        h.wait_persisted().unwrap();
    }
    saved[0].0.wait_committed(Duration::from_secs(60)).unwrap();
    let stored = runtime()
        .block_on(store.log().read_commit("share", 1))
        .unwrap()
        .0
        .stats
        .logical_bytes;

    // Restore the four new ranks one after another, holding the process's cache meanwhile
    // (ranks running as threads hold it by overlapping).
    let keep = ckpt_trainer::manager::shared_restore_cache(64 << 20);
    let before = metrics(&store);
    for r in 0..4u32 {
        let b = col(r as u64, 4);
        let t = Arc::new(HostTensor::zeroed(slice(&b).len()));
        let mut m = manager(r, "tp=4");
        m.register(w.clone(), b.clone(), t.clone()).unwrap();
        m.restore(1).unwrap();
        assert_eq!(*t.read(), slice(&b), "rank {r} restored other bytes");
    }
    let read = (metrics(&store) - before).get_bytes;
    let (hits, misses) = keep.counts();
    assert!(
        read <= stored + stored / 4,
        "read {read} bytes for {stored} stored: chunks were fetched once per rank"
    );
    assert!(
        hits > 0,
        "no chunk was shared ({hits} hits, {misses} misses)"
    );
}

/// A failed save reports the kind of the error where it failed, not a retryable backend
/// fault: a stale writer is fenced, a step whose other ranks never came is incomplete.
#[test]
fn a_failed_save_keeps_the_kind_of_its_error() {
    let (store, _d) = local_store(tiny_config());
    let t = HostTensor::from_vec(det_bytes(3, 20_000));
    let state = || SaveState {
        tensors: vec![SaveTensor::bytes("t", &t, 20_000)],
        blobs: vec![],
    };
    let mut newer = CheckpointerConfig::new("kind", 0, Layout::SINGLE);
    newer.generation = 2;
    let ck = Checkpointer::new(store.clone(), newer).unwrap();
    ck.save(5, state())
        .unwrap()
        .wait_committed(Duration::from_secs(30))
        .unwrap();
    // A writer of an older generation saving the same step is fenced, and says so.
    let mut older = CheckpointerConfig::new("kind", 0, Layout::SINGLE);
    older.generation = 1;
    let stale = Checkpointer::new(store.clone(), older).unwrap();
    // A save call of a writer that has not joined its generation yet is refused at once...
    let e = stale.save(5, state()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Fenced, "{e}");
    // ... and one whose fence shows only while it persists fails with the same kind.
    let mut older = CheckpointerConfig::new("kind", 0, Layout::SINGLE);
    older.generation = 1;
    let stale = Checkpointer::new(store.clone(), older).unwrap();
    stale.assume_joined();
    let h = stale.save(5, state()).unwrap();
    let e = h.wait_committed(Duration::from_secs(30)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Fenced, "{e}");
    let Stage::Failed(f) = h.stage() else {
        panic!("a failed stage expected, got {:?}", h.stage())
    };
    assert_eq!(f.kind, ErrorKind::Fenced, "{f}");
    // The committer of a two-rank step whose other rank never writes: incomplete, within
    // the commit timeout.
    let mut lonely = CheckpointerConfig::new("kind2", 0, "dp=2".parse().expect("a layout"));
    lonely.commit_timeout = Duration::from_millis(300);
    let ck = Checkpointer::new(store.clone(), lonely).unwrap();
    let h = ck.save(1, state()).unwrap();
    let e = h.wait_committed(Duration::from_secs(30)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Incomplete, "{e}");
}

/// A manager of `c` with `t` registered as one whole tensor of bytes, `"t"`.
fn one_tensor_manager(store: &Store, c: ManagerConfig, t: &HostTensor) -> CheckpointManager {
    let n = t.read().len() as u64;
    let mut m = CheckpointManager::new(store.clone(), c).unwrap();
    m.register(
        TensorSpec::first_stage("t", DType::U8, &[n]),
        NdBox::full(&[n]),
        Arc::new(t.clone()),
    )
    .unwrap();
    m
}

#[test]
fn finish_frees_the_staging_copy_and_a_save_after_it_allocates_again() {
    // A manager done saving keeps no copy of the state: a process that goes on to restore
    // into new tensors (or to evaluate) holds the state once, as after DCP's `async_save`.
    let (store, _d) = local_store(tiny_config());
    let n = 1 << 20;
    let t = HostTensor::from_vec(det_bytes(3, n));
    let mut c = ManagerConfig::new(CheckpointerConfig::new("release", 0, Layout::SINGLE));
    c.final_on_sigterm = false;
    c.ckpt.staging_bytes = n;
    let mut m = one_tensor_manager(&store, c, &t);
    m.save_now(1).unwrap();
    let before = m.checkpointer().staging();
    assert!(before.allocated >= n, "{before:?}");
    m.finish().unwrap();
    let after = m.checkpointer().staging();
    assert_eq!((after.allocated, after.in_use), (0, 0), "{after:?}");
    // A save after finish still works, bit-exact.
    t.write().fill(0x33);
    m.save_now(2).unwrap();
    m.finish().unwrap();
    assert_eq!(read(&store, "release", 2, "t"), vec![0x33; n]);
    assert_eq!(m.checkpointer().staging().allocated, 0);
}

#[test]
fn a_manager_fills_its_staging_ahead_of_its_first_save() {
    // The automatic bound is known once the state is registered: the first step sizes the
    // pool and fills it in the background, so the first save copies into touched memory.
    let (store, _d) = local_store(tiny_config());
    let n = 4 << 20;
    let t = HostTensor::from_vec(det_bytes(9, n));
    let mut c = ManagerConfig::new(CheckpointerConfig::new("ahead", 0, Layout::SINGLE));
    c.final_on_sigterm = false;
    c.every_steps = Some(10);
    assert_eq!(c.ckpt.staging_bytes, 0, "an automatic bound by default");
    let mut m = one_tensor_manager(&store, c, &t);
    assert_eq!(
        m.checkpointer().staging().allocated,
        0,
        "nothing before a step"
    );
    assert!(m.maybe_save(1).unwrap().is_none(), "not due");
    let t0 = std::time::Instant::now();
    while m.checkpointer().staging().allocated < n && t0.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let ahead = m.checkpointer().staging();
    assert!(ahead.allocated >= n && ahead.in_use == 0, "{ahead:?}");
    let h = m.maybe_save(10).unwrap().expect("due");
    h.wait_committed(Duration::from_secs(60)).unwrap();
    assert_eq!(read(&store, "ahead", 10, "t"), det_bytes(9, n));
    assert_eq!(
        m.checkpointer().staging().allocated,
        ahead.allocated,
        "the first save took only slabs filled ahead"
    );
    // A manager that can never save (no interval, no final checkpoint: a job that only
    // restores) keeps no copy of the state.
    let mut c = ManagerConfig::new(CheckpointerConfig::new("reader", 0, Layout::SINGLE));
    c.final_on_sigterm = false;
    let mut r = one_tensor_manager(&store, c, &t);
    assert!(r.maybe_save(1).unwrap().is_none());
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(r.checkpointer().staging().allocated, 0);
}

#[test]
fn a_loop_that_hands_its_state_over_at_each_save_fills_staging_ahead_once() {
    // A PyTorch loop registers its state only in `prepare` (the state dict of the step):
    // after a step without a checkpoint, `stage_ahead_with` asks for it once, sizes the pool
    // and fills it, so the first save copies into touched memory there too.
    let (store, _d) = local_store(tiny_config());
    let n = 4 << 20;
    let t = HostTensor::from_vec(det_bytes(11, n));
    let hand = |m: &mut CheckpointManager| {
        m.register(
            TensorSpec::first_stage("t", DType::U8, &[n as u64]),
            NdBox::full(&[n as u64]),
            Arc::new(t.clone()),
        )
    };
    let mut c = ManagerConfig::new(CheckpointerConfig::new("handed", 0, Layout::SINGLE));
    c.final_on_sigterm = false;
    c.every_steps = Some(10);
    let mut m = CheckpointManager::new(store.clone(), c).unwrap();
    assert!(m.maybe_save_with(1, hand).unwrap().is_none(), "not due");
    assert_eq!(
        m.checkpointer().staging().allocated,
        0,
        "nothing registered yet"
    );
    assert!(m.stage_ahead_with(hand).unwrap(), "asked for the state");
    m.clear_tensors();
    let t0 = std::time::Instant::now();
    while m.checkpointer().staging().allocated < n && t0.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let ahead = m.checkpointer().staging();
    assert!(ahead.allocated >= n && ahead.in_use == 0, "{ahead:?}");
    let mut asked = false;
    let again = m
        .stage_ahead_with(|_| {
            asked = true;
            Ok(())
        })
        .unwrap();
    assert!(!again && !asked, "once a manager");
    let h = m.maybe_save_with(10, hand).unwrap().expect("due");
    h.wait_committed(Duration::from_secs(60)).unwrap();
    m.clear_tensors();
    assert_eq!(read(&store, "handed", 10, "t"), det_bytes(11, n));
    assert_eq!(m.checkpointer().staging().allocated, ahead.allocated);

    // A state that fails to hand over fails the call, once: not every step after it.
    let mut c = ManagerConfig::new(CheckpointerConfig::new("failing", 0, Layout::SINGLE));
    c.every_steps = Some(10);
    let mut f = CheckpointManager::new(store.clone(), c).unwrap();
    let err = f
        .stage_ahead_with(|_| Err(ckpt_store::Error::invalid("no state yet")))
        .unwrap_err();
    assert!(err.to_string().contains("no state yet"), "{err}");
    assert!(!f.stage_ahead_with(hand).unwrap(), "not asked again");
    assert_eq!(f.checkpointer().staging().allocated, 0);
}
