//! Unchanged tensors cost nothing: a shard whose source version is what it was at the last
//! committed save references that save's chunks, without a copy or a hash; a write through
//! the API always bumps the version; an uncommitted or dropped step, another box or another
//! source is never reused; GC keeps what reused references need; restores stay bit-exact.

use std::sync::Arc;
use std::time::Duration;

use ckpt_store::placement::{Placement, Stage as PStage};
use ckpt_store::testing::{det_bytes, local_store, tiny_config};
use ckpt_store::{DType, FailAction, GcOptions, Layout, NdBox, Store, VerifyScope};
use ckpt_trainer::{
    Checkpointer, CheckpointerConfig, HostTensor, HostView, MemorySink, MemorySource, SaveReport,
    SaveState, SaveTensor, runtime,
};

mod common;
use common::read;

const T: Duration = Duration::from_secs(30);

fn state(ts: &[(&str, &HostTensor)]) -> SaveState {
    SaveState {
        tensors: ts
            .iter()
            .map(|(n, t)| SaveTensor::bytes(n, t, t.read().len() as u64))
            .collect(),
        blobs: vec![],
    }
}

/// The checkpointer of the one rank of `run`.
fn single_rank(store: &Store, run: &str) -> Checkpointer {
    Checkpointer::new(
        store.clone(),
        CheckpointerConfig::new(run, 0, Layout::SINGLE),
    )
    .unwrap()
}

fn save(ck: &Checkpointer, step: u64, s: SaveState) -> SaveReport {
    ck.save(step, s).unwrap().wait_committed(T).unwrap()
}

fn verify_clean(store: &Store) {
    let v = runtime()
        .block_on(store.verify(&VerifyScope::Store, None))
        .unwrap();
    assert!(v.is_clean(), "{v:?}");
}

/// A frozen tensor is taken unchanged from the second save on (neither copied nor hashed:
/// `bytes_reused`); a save where nothing changed copies nothing; every step restores
/// bit-exactly and the store verifies clean.
#[test]
fn unchanged_tensors_are_reused_and_every_step_restores_exactly() {
    let (store, _d) = local_store(tiny_config());
    let run = "reuse";
    let (n_w, n_f) = (30_000usize, 90_000usize);
    let w = HostTensor::from_vec(det_bytes(1, n_w));
    let frozen = HostTensor::from_vec(det_bytes(2, n_f));
    let ck = single_rank(&store, run);
    let mut want = Vec::new();
    for step in 1..=6u64 {
        if step > 1 && step != 4 {
            w.write().copy_from_slice(&det_bytes(10 + step, n_w));
        }
        want.push((step, w.read().clone()));
        let r = save(&ck, step, state(&[("w", &w), ("frozen", &frozen)]));
        match step {
            1 => assert_eq!(
                (r.bytes - r.bytes_reused, r.bytes_reused),
                ((n_w + n_f) as u64, 0),
                "{r:?}"
            ),
            // Nothing written since step 3: nothing copied.
            4 => assert_eq!(
                (r.bytes - r.bytes_reused, r.bytes_reused),
                (0, (n_w + n_f) as u64),
                "{r:?}"
            ),
            _ => assert_eq!(
                (r.bytes - r.bytes_reused, r.bytes_reused),
                (n_w as u64, n_f as u64),
                "{r:?}"
            ),
        }
        if step > 1 {
            assert!(r.bytes_skipped >= n_f as u64, "{r:?}");
        }
    }
    for (step, w_bytes) in &want {
        assert_eq!(&read(&store, run, *step, "w"), w_bytes, "step {step}");
        assert_eq!(read(&store, run, *step, "frozen"), det_bytes(2, n_f));
    }
    verify_clean(&store);
}

/// Every way to change a host tensor's bytes through the API bumps its version, so the next
/// save copies it and restores the new bytes: `write`, a restore's `write_at` into the tensor
/// or into a view of it.
#[test]
fn a_write_through_the_api_always_reaches_the_next_save() {
    let (store, _d) = local_store(tiny_config());
    let run = "bump";
    let n = 20_000usize;
    let t = HostTensor::from_vec(det_bytes(3, n));
    let ck = single_rank(&store, run);
    save(&ck, 1, state(&[("t", &t)]));
    let v0 = MemorySource::version(&t).unwrap();
    assert_eq!(MemorySource::version(&t), Some(v0), "reading does not bump");
    let _ = t.read()[0];
    assert_eq!(MemorySource::version(&t), Some(v0));

    // 1. `write`, even one that changes a single byte.
    t.write()[7] ^= 0xff;
    assert_ne!(MemorySource::version(&t), Some(v0));
    let r = save(&ck, 2, state(&[("t", &t)]));
    assert_eq!(
        (r.bytes - r.bytes_reused, r.bytes_reused),
        (n as u64, 0),
        "{r:?}"
    );
    assert_eq!(read(&store, run, 2, "t"), *t.read());
    assert_ne!(read(&store, run, 2, "t"), det_bytes(3, n));

    // 2. A restore into the tensor (a sink write).
    MemorySink::write_at(&t, 100, &[1, 2, 3]).unwrap();
    let r = save(&ck, 3, state(&[("t", &t)]));
    assert_eq!(r.bytes_reused, 0, "{r:?}");
    assert_eq!(&read(&store, run, 3, "t")[100..103], &[1, 2, 3]);

    // 3. A restore into a view of it.
    let view = HostView::new(
        t.clone(),
        NdBox::full(&[n as u64]),
        NdBox::new(vec![5000], vec![10]).unwrap(),
        1,
    )
    .unwrap();
    view.write_at(0, &[9; 10]).unwrap();
    let r = save(&ck, 4, state(&[("t", &t)]));
    assert_eq!(r.bytes_reused, 0, "{r:?}");
    assert_eq!(&read(&store, run, 4, "t")[5000..5010], &[9; 10]);

    // Unchanged since step 4: reused, same bytes.
    let r = save(&ck, 5, state(&[("t", &t)]));
    assert_eq!(
        (r.bytes - r.bytes_reused, r.bytes_reused),
        (0, n as u64),
        "{r:?}"
    );
    assert_eq!(read(&store, run, 5, "t"), read(&store, run, 4, "t"));
}

/// A save whose commit failed is never reused from, even for a tensor unchanged since it: the
/// next save copies that tensor again (and reuses only what is unchanged since the committed
/// step before), also after GC swept the failed step's chunks.
#[test]
fn a_failed_or_uncommitted_save_is_never_reused() {
    let (store, _d) = local_store(tiny_config());
    let run = "uncommitted";
    let n = 40_000usize;
    let w = HostTensor::from_vec(det_bytes(1, n));
    let frozen = HostTensor::from_vec(det_bytes(2, n));
    let ck = single_rank(&store, run);
    save(&ck, 1, state(&[("w", &w), ("frozen", &frozen)]));
    w.write().copy_from_slice(&det_bytes(5, n));
    store.failpoints().set("before_commit", FailAction::Error);
    ck.save(2, state(&[("w", &w), ("frozen", &frozen)]))
        .unwrap()
        .wait_committed(T)
        .unwrap_err();
    store.failpoints().clear();
    let later = ckpt_store::clock::system_now() + chrono::Duration::hours(2);
    let g = runtime()
        .block_on(store.gc().run(&GcOptions::default(), later))
        .unwrap();
    assert_eq!(g.incomplete_deleted, vec![(run.to_string(), 2)], "{g:?}");
    // `w` has the version step 2 saved, but step 2 is not committed: copied again.
    let r = save(&ck, 3, state(&[("w", &w), ("frozen", &frozen)]));
    assert_eq!(
        (r.bytes - r.bytes_reused, r.bytes_reused),
        (n as u64, n as u64),
        "{r:?}"
    );
    assert_eq!(read(&store, run, 3, "w"), det_bytes(5, n));
    assert_eq!(read(&store, run, 3, "frozen"), det_bytes(2, n));
    verify_clean(&store);

    // A save not yet committed (another rank commits; here nobody does) is not reused either.
    let ck2 = Checkpointer::new(store.clone(), {
        let mut c = CheckpointerConfig::new("nocommit", 0, Layout::SINGLE);
        c.committer = false;
        c
    })
    .unwrap();
    ck2.save(1, state(&[("frozen", &frozen)]))
        .unwrap()
        .wait_persisted()
        .unwrap();
    let h = ck2.save(2, state(&[("frozen", &frozen)])).unwrap();
    assert_eq!(h.wait_persisted().unwrap().bytes_reused, 0);
}

/// Another name's, shape's or source's shard (a view of the same memory included) is never
/// reused, though the bytes and the
/// version counter are the same. (Under another layout the boxes differ, and a new layout's
/// checkpointers start with nothing to reuse.)
#[test]
fn another_name_shape_or_source_is_never_reused() {
    let (store, _d) = local_store(tiny_config());
    let run = "boxes";
    let n = 16_000u64;
    let t = HostTensor::from_vec(det_bytes(4, n as usize));
    let ck = single_rank(&store, run);
    let whole = |name: &str, shape: Vec<u64>, t: &HostTensor| SaveTensor {
        name: name.into(),
        dtype: DType::U8,
        bbox: NdBox::full(&shape),
        shape,
        placement: None,
        source: Some(Arc::new(t.clone())),
        replica_of: None,
    };
    let one = |tensor: SaveTensor| SaveState {
        tensors: vec![tensor],
        blobs: vec![],
    };
    save(&ck, 1, one(whole("t", vec![n], &t)));
    // Same memory, same bytes, another shape.
    let r = save(&ck, 2, one(whole("t", vec![2, n / 2], &t)));
    assert_eq!(r.bytes_reused, 0, "{r:?}");
    // The same box of the same memory through a view: another source (a view's version
    // names its boxes), then the view again: reused.
    let all = NdBox::full(&[2, n / 2]);
    let view = || SaveTensor {
        name: "t".into(),
        dtype: DType::U8,
        shape: vec![2, n / 2],
        bbox: all.clone(),
        placement: None,
        source: Some(Arc::new(
            HostView::new(t.clone(), all.clone(), all.clone(), 1).unwrap(),
        )),
        replica_of: None,
    };
    let r = save(&ck, 3, one(view()));
    assert_eq!(r.bytes_reused, 0, "{r:?}");
    let r = save(&ck, 4, one(view()));
    assert_eq!(r.bytes_reused, n, "{r:?}");
    // A fresh tensor with the same bytes and no writes either: another source.
    let fresh = HostTensor::from_vec(det_bytes(4, n as usize));
    save(&ck, 5, one(whole("t", vec![n], &t)));
    let r = save(&ck, 6, one(whole("t", vec![n], &fresh)));
    assert_eq!(r.bytes_reused, 0, "{r:?}");
    // Another name.
    let r = save(&ck, 7, one(whole("u", vec![n], &fresh)));
    assert_eq!(r.bytes_reused, 0, "{r:?}");
    // The control: the same shard again is reused.
    let r = save(&ck, 8, one(whole("u", vec![n], &fresh)));
    assert_eq!(r.bytes_reused, n, "{r:?}");
    assert_eq!(read(&store, run, 8, "u"), det_bytes(4, n as usize));
}

/// Retention drops the step whose chunks later saves reference, and a sweep runs: the later
/// steps still restore exactly (their manifests hold the references). A step dropped before a
/// save is not reused from: that save copies.
#[test]
fn gc_of_the_step_reused_from_keeps_what_later_steps_reference() {
    let (store, _d) = local_store(tiny_config());
    let run = "gc-reuse";
    let n = 50_000usize;
    let w = HostTensor::from_vec(det_bytes(1, n));
    let frozen = HostTensor::from_vec(det_bytes(2, n));
    let ck = single_rank(&store, run);
    let gc = |keep: usize| {
        let later = ckpt_store::clock::system_now() + chrono::Duration::hours(2);
        let opts = GcOptions {
            keep_last: Some(keep),
            ..Default::default()
        };
        runtime().block_on(store.gc().run(&opts, later)).unwrap()
    };
    save(&ck, 1, state(&[("w", &w), ("frozen", &frozen)]));
    w.write().fill(1);
    let r = save(&ck, 2, state(&[("w", &w), ("frozen", &frozen)]));
    assert_eq!(r.bytes_reused, n as u64, "{r:?}");
    let g = gc(1);
    assert!(g.objects_deleted >= 1, "step 1's own chunks go: {g:?}");
    assert_eq!(read(&store, run, 2, "frozen"), det_bytes(2, n));
    assert_eq!(read(&store, run, 2, "w"), vec![1; n]);
    verify_clean(&store);
    // Step 3 reuses from step 2 what step 2 reused from the dropped step 1.
    w.write().fill(2);
    let r = save(&ck, 3, state(&[("w", &w), ("frozen", &frozen)]));
    assert_eq!(r.bytes_reused, n as u64, "{r:?}");
    gc(1);
    assert_eq!(read(&store, run, 3, "frozen"), det_bytes(2, n));
    verify_clean(&store);

    // Step 3 is deleted before the next save (its commit record and, swept, its chunks): the
    // save finds it gone and copies everything.
    runtime()
        .block_on(store.gc().delete_step(run, 3, true))
        .unwrap();
    gc(1);
    let r = save(&ck, 4, state(&[("w", &w), ("frozen", &frozen)]));
    assert_eq!(
        (r.bytes - r.bytes_reused, r.bytes_reused),
        (2 * n as u64, 0),
        "{r:?}"
    );
    assert_eq!(read(&store, run, 4, "frozen"), det_bytes(2, n));
    assert_eq!(read(&store, run, 4, "w"), vec![2; n]);
    verify_clean(&store);
}

/// Two ranks (tensor parallel, each holding a half as a view of its own memory) save a run of
/// steps in which one tensor never changes; the whole tensors read back (a resharded restore:
/// one reader of both ranks' shards) bit-exactly at every step.
#[test]
fn a_resharded_restore_after_reused_saves_is_bit_exact() {
    let (store, _d) = local_store(tiny_config());
    let run = "reshard";
    let layout = Layout::new(1, 2, 1, 0).unwrap();
    let (rows, cols) = (8u64, 3000u64);
    let placement = Placement {
        order: 0,
        tp_dim: Some(0),
        stage: PStage::First,
        zero: None,
    };
    let full_w = det_bytes(7, (rows * cols * 4) as usize);
    let full_f = det_bytes(8, (rows * cols * 4) as usize);
    let half = |r: u32| NdBox::new(vec![r as u64 * rows / 2, 0], vec![rows / 2, cols]).unwrap();
    let part = |full: &[u8], r: u32| {
        let n = (rows / 2 * cols * 4) as usize;
        full[r as usize * n..(r as usize + 1) * n].to_vec()
    };
    let ranks: Vec<(Checkpointer, HostTensor, HostTensor)> = (0..2)
        .map(|r| {
            let ck =
                Checkpointer::new(store.clone(), CheckpointerConfig::new(run, r, layout)).unwrap();
            (
                ck,
                HostTensor::from_vec(part(&full_w, r)),
                HostTensor::from_vec(part(&full_f, r)),
            )
        })
        .collect();
    let shard = |name: &str, t: &HostTensor, r: u32| SaveTensor {
        name: name.into(),
        dtype: DType::F32,
        shape: vec![rows, cols],
        bbox: half(r),
        placement: Some(placement.clone()),
        source: Some(Arc::new(t.clone())),
        replica_of: None,
    };
    let mut want_w = Vec::new();
    for step in 1..=4u64 {
        for (r, (_, w, _)) in ranks.iter().enumerate() {
            let mut g = w.write();
            for x in g.iter_mut().step_by(97) {
                *x = x.wrapping_add(step as u8 + r as u8);
            }
        }
        let mut full = Vec::new();
        for (_, w, _) in &ranks {
            full.extend_from_slice(&w.read());
        }
        want_w.push(full);
        let handles: Vec<_> = ranks
            .iter()
            .enumerate()
            .map(|(r, (ck, w, f))| {
                let r = r as u32;
                ck.save(
                    step,
                    SaveState {
                        tensors: vec![shard("w", w, r), shard("frozen", f, r)],
                        blobs: vec![],
                    },
                )
                .unwrap()
            })
            .collect();
        for (r, h) in handles.iter().enumerate() {
            let rep = h.wait_committed(T).unwrap();
            if step > 1 {
                assert_eq!(rep.bytes_reused, rows / 2 * cols * 4, "rank {r}: {rep:?}");
            }
        }
    }
    for step in 1..=4u64 {
        assert_eq!(read(&store, run, step, "w"), want_w[step as usize - 1]);
        assert_eq!(read(&store, run, step, "frozen"), full_f, "step {step}");
    }
    verify_clean(&store);
}

/// The reference workload writes only what it trains: with half of its layers frozen, every
/// save after the first reuses exactly the frozen parameters' state (weights, master copy,
/// both moments), and the step restores to the bytes in memory.
#[test]
fn the_workload_bumps_only_what_it_trains() {
    use ckpt_trainer::workload::{ModelConfig, RankState, TrainConfig};
    use ckpt_trainer::{CheckpointManager, ManagerConfig};
    let (store, _d) = local_store(tiny_config());
    let run = "workload";
    let model = ModelConfig::for_params(60_000, 8);
    let train = TrainConfig {
        seed: 1,
        lr: 1e-3,
        frozen: 0.5,
    };
    let rank = RankState::new(model, train, Layout::SINGLE, 0).unwrap();
    let mut m = CheckpointManager::new(
        store.clone(),
        ManagerConfig::new(CheckpointerConfig::new(run, 0, Layout::SINGLE)),
    )
    .unwrap();
    rank.register(&mut m).unwrap();
    let frozen: u64 = rank
        .params
        .iter()
        .filter(|p| p.frozen)
        .map(|p| p.held.numel() * 14)
        .sum();
    assert!(frozen > 0 && frozen < rank.held_bytes());
    for step in 1..=3u64 {
        rank.update(step, step, 1.0);
        let r = m.save_now(step).unwrap().wait_committed(T).unwrap();
        let want = if step == 1 { 0 } else { frozen };
        assert_eq!(r.bytes_reused, want, "step {step}: {r:?}");
    }
    let specs = model.specs();
    for p in &rank.params {
        for k in 0..4 {
            let name = &specs[p.param * 4 + k].name;
            assert_eq!(
                read(&store, run, 3, name),
                *p.tensors[k].read(),
                "{name} (frozen: {})",
                p.frozen
            );
        }
    }
}

/// With a replica agent, an unchanged tensor is still taken as it is (no copy, no hash), and
/// its chunks are named to the agent rather than sent: the agent holds every chunk of every
/// step's manifest all the same. An agent that restarted (it holds nothing) says how many it
/// lacks, and the next save copies and sends every tensor.
#[test]
fn a_replica_agent_is_named_the_unchanged_tensors_and_holds_every_step_whole() {
    use ckpt_recovery::peer::{AgentState, PeerLink, PeerSecret, serve};
    let secret = PeerSecret::from_bytes([9; 32]);
    let start_agent = |at: &str| {
        let l = runtime()
            .block_on(tokio::net::TcpListener::bind(at))
            .unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let st = AgentState::new(0, Some(secret.clone()), u64::MAX);
        let task = runtime().spawn(serve(l, st.clone()));
        (addr, st, task)
    };
    let (store, _d) = local_store(tiny_config());
    let run = "reuse-peers";
    let (n_w, n_f) = (30_000usize, 90_000usize);
    let w = HostTensor::from_vec(det_bytes(1, n_w));
    let frozen = HostTensor::from_vec(det_bytes(2, n_f));
    let checkpointer = |agent: &str| {
        let mut cfg = CheckpointerConfig::new(run, 0, Layout::SINGLE);
        cfg.peer = Some(PeerLink {
            node: 0,
            agent: agent.to_string(),
            peers: vec![agent.to_string()],
            timeout: T,
            secret: secret.clone(),
        });
        Checkpointer::new(store.clone(), cfg).unwrap()
    };
    // Every chunk of `step`'s manifest is held by `st`, as the newest snapshot of rank 0.
    let held_whole = |st: &AgentState, step: u64| {
        let (m, _, _) = runtime()
            .block_on(store.log().get_rank_manifest(run, step, 0))
            .unwrap();
        for t in &m.tensors {
            for c in &t.chunks {
                assert!(
                    st.get(&c.id).is_some(),
                    "step {step}: {} chunk not held",
                    t.name
                );
            }
        }
        assert_eq!(st.steps_of(0, 0).first(), Some(&step));
    };
    let (addr, st, task) = start_agent("127.0.0.1:0");
    let ck = checkpointer(&addr);
    for step in 1..=3u64 {
        w.write().copy_from_slice(&det_bytes(10 + step, n_w));
        let r = save(&ck, step, state(&[("w", &w), ("frozen", &frozen)]));
        let reused = if step == 1 { 0 } else { n_f as u64 };
        assert_eq!(r.bytes_reused, reused, "step {step}: {r:?}");
        held_whole(&st, step);
    }
    // The agent restarts (same address, nothing held): the next save names the unchanged
    // tensor to an agent that lacks it. Its copy of that step is partial (the store has the
    // step whole); the save after copies and sends everything, and the one after that names
    // the tensor again.
    task.abort();
    let _ = runtime().block_on(task);
    let (_, st, _task) = start_agent(&addr);
    let mut reused = Vec::new();
    for step in 4..=6u64 {
        w.write().copy_from_slice(&det_bytes(10 + step, n_w));
        let r = save(&ck, step, state(&[("w", &w), ("frozen", &frozen)]));
        reused.push((step, r.bytes_reused));
        if step > 4 {
            held_whole(&st, step);
        }
    }
    let n_f = n_f as u64;
    assert_eq!(reused, vec![(4, n_f), (5, 0), (6, n_f)]);
    for step in 1..=6u64 {
        assert_eq!(
            read(&store, run, step, "frozen"),
            det_bytes(2, n_f as usize)
        );
    }
}
