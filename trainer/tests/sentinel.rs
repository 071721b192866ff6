//! The sentinel (issue 29) through `CheckpointManager`: data-parallel replicas compared by
//! hash at the commit (a flipped bit in one rank's copy is named, with its node; under
//! `stop` the committer's next call fails), and trainable state that stops changing (a save
//! path that keeps handing over a stale buffer) reported at the second checkpoint.

use std::sync::Arc;
use std::time::Duration;

use ckpt_recovery::records::{Event, read_records};
use ckpt_store::placement::TensorSpec;
use ckpt_store::testing::{det_bytes, local_store};
use ckpt_store::{DType, ErrorKind, Layout, MismatchPolicy, NdBox, SdcCheck, Store, StoreConfig};
use ckpt_trainer::save::runtime;
use ckpt_trainer::{CheckpointManager, CheckpointerConfig, HostTensor, ManagerConfig};

fn events(store: &Store, run: &str) -> Vec<Event> {
    runtime()
        .block_on(read_records::<Event>(store, run))
        .unwrap()
        .into_iter()
        .map(|l| l.record)
        .collect()
}

fn config(run: &str, rank: u32, world: u32) -> ManagerConfig {
    let layout = Layout::new(world, 1, 1, 0).unwrap();
    let mut ck = CheckpointerConfig::new(run, rank, layout);
    ck.node = Some(100 + rank);
    let mut cfg = ManagerConfig::new(ck);
    cfg.every_steps = Some(1);
    cfg.final_on_sigterm = false;
    cfg.persist_governor = None;
    cfg
}

fn small_chunks() -> StoreConfig {
    StoreConfig {
        chunk_size: 1 << 10,
        pack_threshold: 256,
        ..StoreConfig::default()
    }
}

#[test]
fn a_flipped_bit_in_one_of_three_replicas_is_named_and_stop_fails_the_next_call() {
    let (store, _d) = local_store(small_chunks());
    let run = "sdc";
    let w = det_bytes(7, 16 << 10); // [4096] f32, replicated over dp=3
    std::thread::scope(|s| {
        for rank in 0..3u32 {
            let (store, w) = (&store, &w);
            s.spawn(move || {
                let mut cfg = config(run, rank, 3);
                cfg.ckpt.sdc_check = SdcCheck::Full;
                cfg.on_replica_mismatch = MismatchPolicy::Stop;
                let mut m = CheckpointManager::new(store.clone(), cfg).unwrap();
                let mine = HostTensor::from_vec(w.clone());
                if rank == 2 {
                    // Silent corruption: one bit of rank 2's copy, in chunk 9.
                    mine.write()[9 * 1024 + 5] ^= 0x10;
                }
                let spec = TensorSpec::first_stage("w", DType::F32, &[4096]);
                m.register(spec, NdBox::full(&[4096]), Arc::new(mine))
                    .unwrap();
                let h = m.maybe_save(1).unwrap().expect("due");
                if rank == 0 {
                    let r = h.wait_committed(Duration::from_secs(60)).unwrap();
                    let rep = r.replicas.expect("the committer compared the replicas");
                    assert_eq!(rep.chunks_compared, 2 * 16, "two replicas of 16 chunks");
                    assert_eq!(rep.mismatched_chunks, 1, "{rep:?}");
                    assert_eq!(rep.mismatches[0].chunk, 9);
                    assert_eq!(rep.suspects(), vec![2]);
                    // Policy stop: the next call fails, naming the step and the suspect.
                    let e = m.maybe_save(2).unwrap_err();
                    assert_eq!(e.kind(), ErrorKind::Corrupt);
                    let msg = e.to_string();
                    assert!(
                        msg.contains("step 1") && msg.contains("rank 2 (node 102)"),
                        "{msg}"
                    );
                } else {
                    let r = h.wait_persisted().unwrap();
                    assert_eq!(
                        r.bytes_checked,
                        if r.bytes_written > 0 { 0 } else { 16 << 10 }
                    );
                }
            });
        }
    });
    let found: Vec<_> = events(&store, run)
        .into_iter()
        .filter_map(|e| match e {
            Event::ReplicaMismatch(m) => Some(m),
            _ => None,
        })
        .collect();
    assert_eq!(
        found.len(),
        1,
        "one replica_mismatch event, by the committer"
    );
    let m = &found[0];
    assert_eq!((m.step, m.rank, m.policy.as_str()), (1, 0, "stop"));
    assert_eq!(
        (m.suspects.clone(), m.suspect_nodes.clone()),
        (vec![2], vec![102])
    );
    assert_eq!(m.mismatches[0].tensor, "w");
    // The step is committed with the mismatch in its record.
    let (rec, _) = runtime().block_on(store.log().read_commit(run, 1)).unwrap();
    assert!(rec.replicas.unwrap().mismatched());
}

#[test]
fn replicas_that_agree_raise_nothing_and_off_hashes_nothing() {
    let (store, _d) = local_store(small_chunks());
    let w = det_bytes(8, 16 << 10);
    for (run, check) in [("agree", SdcCheck::Full), ("off", SdcCheck::Off)] {
        std::thread::scope(|s| {
            for rank in 0..2u32 {
                let (store, w) = (&store, &w);
                s.spawn(move || {
                    let mut cfg = config(run, rank, 2);
                    cfg.ckpt.sdc_check = check;
                    cfg.on_replica_mismatch = MismatchPolicy::Stop;
                    let mut m = CheckpointManager::new(store.clone(), cfg).unwrap();
                    let spec = TensorSpec::first_stage("w", DType::F32, &[4096]);
                    let t = HostTensor::from_vec(w.clone());
                    m.register(spec, NdBox::full(&[4096]), Arc::new(t)).unwrap();
                    for step in 1..=2 {
                        let h = m.maybe_save(step).unwrap().expect("due");
                        if rank == 0 {
                            h.wait_committed(Duration::from_secs(60)).unwrap();
                        } else {
                            h.wait_persisted().unwrap();
                        }
                    }
                    m.finish().unwrap();
                });
            }
        });
        let (rec, _) = runtime().block_on(store.log().read_commit(run, 2)).unwrap();
        match check {
            SdcCheck::Off => assert_eq!(rec.replicas, None),
            _ => {
                let r = rec.replicas.unwrap();
                assert_eq!((r.chunks_compared, r.mismatched_chunks), (16, 0));
            }
        }
        assert!(
            !events(&store, run)
                .iter()
                .any(|e| matches!(e, Event::ReplicaMismatch(_))),
            "{run}"
        );
    }
}

#[test]
fn a_save_path_handing_over_a_stale_buffer_is_reported_at_the_second_checkpoint() {
    // The test double of NeMo-RL issue 3312: the loop trains `live`, but what it hands the
    // manager for `stale` is a buffer filled once (its version even moves: it is written
    // with the same bytes every step). `moving` is handed over live; `frozen` does not train.
    let (store, _d) = local_store(small_chunks());
    let run = "stale";
    let mut cfg = config(run, 0, 1);
    cfg.every_steps = Some(10);
    let mut m = CheckpointManager::new(store.clone(), cfg).unwrap();
    let stale = HostTensor::from_vec(det_bytes(1, 4096));
    let moving = HostTensor::from_vec(det_bytes(2, 4096));
    let frozen = HostTensor::from_vec(det_bytes(3, 4096));
    for (name, t) in [("stale", &stale), ("moving", &moving), ("frozen", &frozen)] {
        let spec = TensorSpec::first_stage(name, DType::F32, &[1024]);
        m.register(spec, NdBox::full(&[1024]), Arc::new(t.clone()))
            .unwrap();
    }
    m.set_trainable("stale", true).unwrap();
    m.set_trainable("moving", true).unwrap();
    assert!(m.set_trainable("nope", true).is_err());
    let unchanged = |store: &Store| -> Vec<ckpt_recovery::records::StateUnchanged> {
        events(store, run)
            .into_iter()
            .filter_map(|e| match e {
                Event::StateUnchanged(u) => Some(u),
                _ => None,
            })
            .collect()
    };
    for step in 1..=30u64 {
        // A training step: `moving` changes; the stale buffer is rewritten as it was.
        moving.write()[(step as usize * 8) % 4096] ^= 1;
        let same = stale.read().clone();
        *stale.write() = same;
        // The sentinel looks at the saves that ended at every call.
        if let Some(h) = m.maybe_save(step).unwrap() {
            h.wait_committed(Duration::from_secs(60)).unwrap();
        }
        let u = unchanged(&store);
        match step {
            ..=20 => assert!(u.is_empty(), "reported at step {step}: {u:?}"),
            _ => {
                assert_eq!(u.len(), 1, "reported once, at the second checkpoint: {u:?}");
                assert_eq!(u[0].step, 20);
                assert_eq!(u[0].steps, vec![10, 20]);
                assert_eq!(u[0].tensors, vec!["stale".to_string()]);
                assert_eq!((u[0].trainable, u[0].all), (2, false));
            }
        }
    }
    m.finish().unwrap();
}

#[test]
fn every_trainable_tensor_unchanged_is_an_error_level_record() {
    let (store, _d) = local_store(small_chunks());
    let run = "all-stale";
    let mut m = CheckpointManager::new(store.clone(), config(run, 0, 1)).unwrap();
    let t = HostTensor::from_vec(det_bytes(4, 4096));
    m.register(
        TensorSpec::first_stage("w", DType::F32, &[1024]),
        NdBox::full(&[1024]),
        Arc::new(t),
    )
    .unwrap();
    m.set_trainable("w", true).unwrap();
    for step in [5u64, 10] {
        m.maybe_save(step)
            .unwrap()
            .unwrap()
            .wait_committed(Duration::from_secs(60))
            .unwrap();
    }
    m.finish().unwrap();
    let u: Vec<_> = events(&store, run)
        .into_iter()
        .filter_map(|e| match e {
            Event::StateUnchanged(u) => Some(u),
            _ => None,
        })
        .collect();
    assert_eq!(u.len(), 1, "{u:?}");
    assert!(
        u[0].all && u[0].detail.contains("every trainable tensor"),
        "{u:?}"
    );
}

#[test]
fn across_machines_with_their_own_tiers_the_drain_that_commits_names_the_flipped_replica() {
    // Three machines, each rank with its own local tier (`node_ranks`): no node commit compares
    // replicas (each holds one rank); the remote commit, made by the last node's drain, does,
    // and that rank's manager reports the mismatch.
    let (store, _d) = local_store(small_chunks());
    let tiers: Vec<_> = (0..3).map(|_| local_store(small_chunks())).collect();
    let run = "sdc-tiers";
    let w = det_bytes(9, 16 << 10);
    std::thread::scope(|s| {
        for rank in 0..3u32 {
            let (store, w, tier) = (&store, &w, tiers[rank as usize].0.clone());
            s.spawn(move || {
                let mut cfg = config(run, rank, 3);
                cfg.ckpt.sdc_check = SdcCheck::Full;
                cfg.ckpt.committer = true;
                cfg.ckpt.node_ranks = Some(vec![rank]);
                cfg.local_tier = Some(ckpt_trainer::LocalTier::new(tier));
                let mut m = CheckpointManager::new(store.clone(), cfg).unwrap();
                let mine = HostTensor::from_vec(w.clone());
                if rank == 1 {
                    mine.write()[3 * 1024 + 7] ^= 0x01;
                }
                let spec = TensorSpec::first_stage("w", DType::F32, &[4096]);
                m.register(spec, NdBox::full(&[4096]), Arc::new(mine))
                    .unwrap();
                m.maybe_save(1).unwrap().expect("due");
                m.finish().unwrap();
            });
        }
    });
    let (rec, _) = runtime().block_on(store.log().read_commit(run, 1)).unwrap();
    let rep = rec
        .replicas
        .expect("the remote commit compared the replicas");
    assert_eq!(
        (rep.mismatched_chunks, rep.suspects()),
        (1, vec![1]),
        "{rep:?}"
    );
    for (t, _) in &tiers {
        assert!(
            runtime()
                .block_on(t.log().committed_steps(run))
                .unwrap()
                .is_empty()
        );
    }
    let found: Vec<_> = events(&store, run)
        .into_iter()
        .filter_map(|e| match e {
            Event::ReplicaMismatch(m) => Some(m),
            _ => None,
        })
        .collect();
    assert_eq!(found.len(), 1, "one replica_mismatch event: {found:?}");
    let m = &found[0];
    assert_eq!(m.step, 1);
    assert_eq!(
        (m.suspects.clone(), m.suspect_nodes.clone()),
        (vec![1], vec![101])
    );
    assert_eq!(m.mismatches[0].tensor, "w");
}

#[test]
fn staging_prepared_before_the_first_save_holds_the_replicas_the_sentinel_samples() {
    // Two data-parallel ranks, each writing one tensor and holding a replica of the other's,
    // hashed on a sample that rotates with the step. A pool sized and touched beforehand
    // must hold every save's copy: a slab allocated during a snapshot is memory touched
    // while the training loop waits (the tiered bench's first save lost 27-41 ms to it).
    let (store, _d) = local_store(small_chunks());
    let layout = Layout::new(2, 1, 1, 0).unwrap();
    let n = 64 << 10; // 64 chunks of 1 KiB a tensor
    let data = [det_bytes(11, n), det_bytes(12, n)];
    std::thread::scope(|s| {
        for rank in 0..2u32 {
            let (store, data) = (&store, &data);
            s.spawn(move || {
                let mut ck = CheckpointerConfig::new("staged", rank, layout);
                ck.sdc_check = SdcCheck::Sample(0.25);
                ck.copy_threads = 1;
                let c = ckpt_trainer::Checkpointer::new(store.clone(), ck).unwrap();
                let tensors: Vec<Arc<HostTensor>> = data
                    .iter()
                    .map(|d| Arc::new(HostTensor::from_vec(d.clone())))
                    .collect();
                let state = || ckpt_trainer::SaveState {
                    tensors: (0..2u32)
                        .map(|w| ckpt_trainer::SaveTensor {
                            name: format!("t{w}"),
                            dtype: DType::U8,
                            shape: vec![n as u64],
                            bbox: NdBox::full(&[n as u64]),
                            placement: None,
                            source: Some(tensors[w as usize].clone()),
                            replica_of: (w != rank).then_some(w),
                        })
                        .collect(),
                    blobs: vec![],
                };
                c.prepare_staging(&state(), true);
                let prepared = c.staging().allocated;
                for step in 1..=6 {
                    let h = c.save(step, state()).unwrap();
                    h.wait_committed(Duration::from_secs(60)).unwrap();
                    let st = c.staging();
                    assert_eq!(
                        st.allocated,
                        prepared,
                        "rank {rank} step {step}: the snapshot allocated staging \
                         ({} bytes hashed of its replica): {st:?}",
                        h.report().bytes_checked
                    );
                }
            });
        }
    });
}
