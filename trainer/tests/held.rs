//! Tensors registered with their own boxes (`CheckpointManager::register_held`, what the
//! Python manager uses for PyTorch's DTensors) and registered only when a checkpoint is due
//! (`maybe_save_with`): two ranks save uneven row shards and a replica written once; one rank
//! restores the whole tensors bit-exact; `prepare` runs only on due steps.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use ckpt_store::placement::TensorSpec;
use ckpt_store::testing::{det_bytes, local_store};
use ckpt_store::{DType, Layout, NdBox, Store, StoreConfig};
use ckpt_trainer::{CheckpointManager, CheckpointerConfig, HostTensor, ManagerConfig};

fn spec(name: &str, shape: &[u64]) -> TensorSpec {
    TensorSpec::first_stage(name, DType::F32, shape)
}

fn manager(store: &Store, rank: u32, world: u32) -> CheckpointManager {
    let layout = Layout::new(world, 1, 1, 0).unwrap();
    let mut cfg = ManagerConfig::new(CheckpointerConfig::new("held", rank, layout));
    cfg.every_steps = Some(2);
    cfg.final_on_sigterm = false;
    CheckpointManager::new(store.clone(), cfg).unwrap()
}

/// Rows `lo..hi` of a row-major `[rows, 4]` f32 tensor.
fn rows(all: &[u8], lo: usize, hi: usize) -> Vec<u8> {
    all[lo * 16..hi * 16].to_vec()
}

#[test]
fn held_boxes_save_as_registered_and_restore_onto_another_world() {
    let (store, _d) = local_store(StoreConfig {
        chunk_size: 64,
        ..StoreConfig::default()
    });
    let t = det_bytes(1, 5 * 16); // [5, 4] f32
    let r = det_bytes(2, 6 * 4); // [6] f32, replicated
    let prepared = Arc::new(AtomicU32::new(0));
    std::thread::scope(|s| {
        for rank in 0..2u32 {
            let (store, t, r, prepared) = (&store, &t, &r, prepared.clone());
            s.spawn(move || {
                let mut m = manager(store, rank, 2);
                // Uneven row shards (3 + 2 rows), as torch chunks a Shard(0) of 5 rows.
                let (lo, hi) = if rank == 0 { (0, 3) } else { (3, 5) };
                let shard = HostTensor::from_vec(rows(t, lo, hi));
                let replica = HostTensor::from_vec(r.clone());
                let prepare = |m: &mut CheckpointManager| {
                    prepared.fetch_add(1, Ordering::SeqCst);
                    m.clear_tensors();
                    let held = NdBox::new(vec![lo as u64, 0], vec![(hi - lo) as u64, 4])?;
                    m.register_held(spec("t", &[5, 4]), held, Arc::new(shard.clone()), None)?;
                    let writer = if rank == 0 { None } else { Some(0) };
                    m.register_held(
                        spec("r", &[6]),
                        NdBox::full(&[6]),
                        Arc::new(replica.clone()),
                        writer,
                    )?;
                    Ok(())
                };
                assert!(m.maybe_save_with(1, prepare).unwrap().is_none());
                let h = m
                    .maybe_save_with(2, prepare)
                    .unwrap()
                    .expect("step 2 is due");
                assert_eq!(m.registered(), 2);
                if rank == 0 {
                    h.wait_committed(Duration::from_secs(60)).unwrap();
                } else {
                    h.wait_persisted().unwrap();
                }
                m.finish().unwrap();
                // A replica of itself, or of a rank outside the world, is refused.
                let bad = m.register_held(
                    spec("x", &[6]),
                    NdBox::full(&[6]),
                    Arc::new(replica.clone()),
                    Some(rank),
                );
                assert!(bad.unwrap_err().to_string().contains("replica"));
            });
        }
    });
    // Only step 2 was due, on each rank.
    assert_eq!(prepared.load(Ordering::SeqCst), 2);
    // One rank, whole tensors.
    let mut m = manager(&store, 0, 1);
    let whole_t = HostTensor::zeroed(t.len());
    let whole_r = HostTensor::zeroed(r.len());
    m.register_held(
        spec("t", &[5, 4]),
        NdBox::full(&[5, 4]),
        Arc::new(whole_t.clone()),
        None,
    )
    .unwrap();
    m.register_held(
        spec("r", &[6]),
        NdBox::full(&[6]),
        Arc::new(whole_r.clone()),
        None,
    )
    .unwrap();
    assert_eq!(m.restore_latest().unwrap(), Some(2));
    assert_eq!(*whole_t.read(), t);
    assert_eq!(*whole_r.read(), r);
    // Columns 1..3 of every row, onto a box no rank saved.
    m.clear_tensors();
    let cols = HostTensor::zeroed(5 * 2 * 4);
    m.register_held(
        spec("t", &[5, 4]),
        NdBox::new(vec![0, 1], vec![5, 2]).unwrap(),
        Arc::new(cols.clone()),
        None,
    )
    .unwrap();
    m.restore(2).unwrap();
    let want: Vec<u8> = (0..5)
        .flat_map(|row| t[row * 16 + 4..row * 16 + 12].to_vec())
        .collect();
    assert_eq!(*cols.read(), want);
}

/// Per-rank state for the split-record test.
struct Rng(Vec<u8>);

impl ckpt_trainer::Stateful for Rng {
    fn state_dict(&self) -> Vec<u8> {
        self.0.clone()
    }
    fn load_state_dict(&mut self, bytes: &[u8]) -> ckpt_store::Result<()> {
        self.0 = bytes.to_vec();
        Ok(())
    }
}

/// A commit record split into parts (format 5, here at 512 bytes a part; 64 KiB by default):
/// a restoring rank reads the parts of its own tensors only (every other tensors part deleted
/// before it restores) and restores bit-exact onto the same layout, with its per-rank state
/// (its manifest found through the record's ranks parts), and onto another world.
#[test]
fn a_rank_restores_from_the_parts_of_a_split_record_that_hold_its_tensors() {
    let (store, _d) = local_store(StoreConfig {
        chunk_size: 64,
        record_part_bytes: 512,
        ..StoreConfig::default()
    });
    let names: Vec<String> = (0..16).map(|i| format!("layer{i:02}.w")).collect();
    let data: Vec<Vec<u8>> = (0..16).map(|i| det_bytes(100 + i, 4 * 16)).collect(); // [4, 4] f32
    std::thread::scope(|s| {
        for rank in 0..4u32 {
            let (store, names, data) = (&store, &names, &data);
            s.spawn(move || {
                let mut m = manager(store, rank, 4);
                let row = rank as usize;
                for (n, d) in names.iter().zip(data) {
                    let held = NdBox::new(vec![row as u64, 0], vec![1, 4]).unwrap();
                    let t = HostTensor::from_vec(rows(d, row, row + 1));
                    m.register_held(spec(n, &[4, 4]), held, Arc::new(t), None)
                        .unwrap();
                }
                let rng = Arc::new(parking_lot::Mutex::new(Rng(vec![rank as u8; 8])));
                m.register_stateful("rng", ckpt_trainer::Scope::PerRank, rng)
                    .unwrap();
                let h = m.maybe_save(2).unwrap().expect("step 2 is due");
                if rank == 0 {
                    h.wait_committed(Duration::from_secs(60)).unwrap();
                } else {
                    h.wait_persisted().unwrap();
                }
                m.finish().unwrap();
            });
        }
    });
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (root, _, _) = rt
        .block_on(store.log().read_commit_root("held", 2))
        .unwrap();
    let index = root.index.expect("the record is split");
    // Rank 3 of the same layout restores layers 12..16: delete every tensors part that holds
    // none of them.
    let mine = &names[12..];
    let mut deleted = 0;
    for p in &index.parts {
        if let ckpt_store::PartRef::Tensors { first, last, .. } = p
            && !mine.iter().any(|n| first <= n && n <= last)
        {
            let key = store.keys().record_part("held", 2, &p.hash());
            rt.block_on(store.objects().delete_all(vec![key])).unwrap();
            deleted += 1;
        }
    }
    assert!(deleted >= 2, "{index:?}");
    let mut m = manager(&store, 3, 4);
    let mut got = Vec::new();
    for (n, d) in mine.iter().zip(&data[12..]) {
        let t = HostTensor::zeroed(16);
        let held = NdBox::new(vec![3, 0], vec![1, 4]).unwrap();
        m.register_held(spec(n, &[4, 4]), held, Arc::new(t.clone()), None)
            .unwrap();
        got.push((t, rows(d, 3, 4)));
    }
    let rng = Arc::new(parking_lot::Mutex::new(Rng(Vec::new())));
    m.register_stateful("rng", ckpt_trainer::Scope::PerRank, rng.clone())
        .unwrap();
    m.restore(2).unwrap();
    for (t, want) in &got {
        assert_eq!(*t.read(), *want);
    }
    assert_eq!(rng.lock().0, vec![3u8; 8], "rank 3's own state");
    // Onto one rank, whole tensors (layers 12..16 only, as the parts left allow).
    let mut m = manager(&store, 0, 1);
    let mut got = Vec::new();
    for (n, d) in mine.iter().zip(&data[12..]) {
        let t = HostTensor::zeroed(d.len());
        m.register_held(
            spec(n, &[4, 4]),
            NdBox::full(&[4, 4]),
            Arc::new(t.clone()),
            None,
        )
        .unwrap();
        got.push((t, d.clone()));
    }
    m.restore(2).unwrap();
    for (t, want) in &got {
        assert_eq!(*t.read(), *want);
    }
    // A rank whose tensors' parts are gone cannot restore: the error names the missing part.
    let mut m = manager(&store, 0, 4);
    let t = HostTensor::zeroed(16);
    let held = NdBox::new(vec![0, 0], vec![1, 4]).unwrap();
    m.register_held(spec(&names[0], &[4, 4]), held, Arc::new(t), None)
        .unwrap();
    let e = m.restore(2).unwrap_err();
    assert!(e.to_string().contains("/index/"), "{e}");
}
