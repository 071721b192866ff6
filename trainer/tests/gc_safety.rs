//! Deduplication and garbage collection: no committed step ever references an object GC
//! removed (FORMAT.md, "What GC may delete, and when").

use std::sync::Arc;
use std::time::Duration;

use ckpt_store::testing::{det_bytes, local_store, tiny_config};
use ckpt_store::{DType, FailAction, GcOptions, Layout, NdBox, VerifyScope};
use ckpt_trainer::{Checkpointer, CheckpointerConfig, HostTensor, SaveState, SaveTensor, runtime};

mod common;
use common::read;

/// A save whose commit fails, swept by `ckpt gc` once past the grace period, is never the base
/// of the next save: the next save (of the very bytes the failed one held) commits, verifies
/// clean and restores, and the step before still restores.
#[test]
fn a_failed_commit_is_never_the_next_saves_dedup_base() {
    let (store, _d) = local_store(tiny_config());
    let run = "failed-commit";
    let frozen = HostTensor::from_vec(det_bytes(1, 40_000));
    let w = HostTensor::from_vec(det_bytes(2, 40_000));
    let (a, b) = (det_bytes(2, 40_000), det_bytes(3, 40_000));
    let state = || SaveState {
        tensors: vec![
            SaveTensor::bytes("frozen", &frozen, frozen.read().len() as u64),
            SaveTensor::bytes("w", &w, w.read().len() as u64),
        ],
        blobs: vec![],
    };
    let ck = Checkpointer::new(
        store.clone(),
        CheckpointerConfig::new(run, 0, Layout::SINGLE),
    )
    .unwrap();
    let timeout = Duration::from_secs(30);
    ck.save(1, state())
        .unwrap()
        .wait_committed(timeout)
        .unwrap();

    // Step 2: persisted, but its commit fails.
    w.write().copy_from_slice(&b);
    store.failpoints().set("before_commit", FailAction::Error);
    let e = ck
        .save(2, state())
        .unwrap()
        .wait_committed(timeout)
        .unwrap_err();
    assert!(e.to_string().contains("before_commit"), "{e}");
    store.failpoints().clear();

    // Two hours later `ckpt gc` sweeps the abandoned step and the chunks only it held.
    let later = ckpt_store::clock::system_now() + chrono::Duration::hours(2);
    let opts = GcOptions {
        grace: Duration::from_secs(3600),
        ..Default::default()
    };
    let g = runtime().block_on(store.gc().run(&opts, later)).unwrap();
    assert_eq!(g.incomplete_deleted, vec![(run.to_string(), 2)], "{g:?}");
    assert!(g.objects_deleted >= 1, "{g:?}");

    // Step 3 holds step 2's bytes again.
    ck.save(3, state())
        .unwrap()
        .wait_committed(timeout)
        .unwrap();
    let v = runtime()
        .block_on(store.verify(&VerifyScope::Store, None))
        .unwrap();
    assert!(v.is_clean(), "{v:?}");
    assert_eq!(read(&store, run, 3, "w"), b);
    assert_eq!(read(&store, run, 3, "frozen"), det_bytes(1, 40_000));
    assert_eq!(read(&store, run, 1, "w"), a);
    assert_eq!(
        ck.dedup_base(),
        Some(1),
        "the failed step 2 is never the base"
    );
}

/// Two ranks (`Checkpointer`s of one job) save 50 steps while GC with keep_last = 1 runs in a
/// loop; each save races the commit of the step before, tensors come back to earlier contents,
/// every fifth commit fails (failpoint), and after some of those the job pauses for longer than
/// the grace period. Object ages come from a test clock (`ClockStore`) over a real local
/// directory. Every commit that succeeded reads back exactly while it is the newest, and at the
/// end the store verifies clean.
#[test]
fn gc_racing_checkpointers_never_breaks_a_commit() {
    use ckpt_store::testing::{ClockStore, TestClock};
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};

    let (local, _d) = local_store(tiny_config());
    let clock = TestClock::starting_now();
    let store = ClockStore::wrap(&local, &clock);
    let run = "race";
    let layout = Layout::new(2, 1, 1, 0).unwrap();
    let tick = Duration::from_secs(600);
    let grace = Duration::from_secs(3600);
    let opts = GcOptions {
        keep_last: Some(1),
        grace,
        ..Default::default()
    };
    let stop = Arc::new(AtomicBool::new(false));
    let passes = Arc::new(AtomicU64::new(0));
    let gc = {
        let (store, clock, stop, passes, opts) = (
            store.clone(),
            clock.clone(),
            stop.clone(),
            passes.clone(),
            opts.clone(),
        );
        std::thread::spawn(move || {
            let mut swept = 0;
            while !stop.load(SeqCst) {
                swept += runtime()
                    .block_on(store.gc().run(&opts, clock.now()))
                    .expect("gc")
                    .objects_deleted;
                passes.fetch_add(1, SeqCst);
            }
            swept
        })
    };
    let version = |k: u64, t: u64| match t {
        0 => 0,
        1 => k % 2,
        _ => k / 2,
    };
    let half = |t: u64, r: u32, v: u64| det_bytes(t * 1000 + u64::from(r) * 100 + v, 4096);
    let tensors: Vec<Vec<HostTensor>> = (0..2u32)
        .map(|_| {
            (0..3)
                .map(|_| HostTensor::from_vec(vec![0; 4096]))
                .collect()
        })
        .collect();
    let cks: Vec<Checkpointer> = (0..2u32)
        .map(|r| {
            let mut cfg = CheckpointerConfig::new(run, r, layout);
            cfg.commit_timeout = Duration::from_secs(30);
            Checkpointer::new(store.clone(), cfg).unwrap()
        })
        .collect();
    let state = |r: u32| SaveState {
        tensors: (0..3u64)
            .map(|t| SaveTensor {
                name: format!("t{t}"),
                dtype: DType::U8,
                shape: vec![8192],
                bbox: NdBox::new(vec![u64::from(r) * 4096], vec![4096]).unwrap(),
                placement: None,
                source: Some(Arc::new(tensors[r as usize][t as usize].clone())),
                replica_of: None,
            })
            .collect(),
        blobs: vec![],
    };
    let check = |step: u64| {
        for t in 0..3u64 {
            let want = [half(t, 0, version(step, t)), half(t, 1, version(step, t))].concat();
            assert_eq!(
                read(&store, run, step, &format!("t{t}")),
                want,
                "step {step} t{t}"
            );
        }
    };
    let mut pending: Option<ckpt_trainer::SaveHandle> = None;
    let mut committed = 0;
    let settle = |h: ckpt_trainer::SaveHandle, committed: &mut u32| {
        let s = h.step();
        match h.wait_committed(Duration::from_secs(60)) {
            Ok(_) => {
                // Read it before the next commit lets retention drop it.
                check(s);
                *committed += 1;
            }
            Err(e) => assert!(s % 5 == 3, "step {s}: {e}"),
        }
    };
    for k in 1..=50u64 {
        clock.advance(tick);
        if k % 15 == 9 {
            if let Some(h) = pending.take() {
                settle(h, &mut committed);
            }
            clock.advance(grace * 2);
            let p = passes.load(SeqCst);
            while passes.load(SeqCst) < p + 2 {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        for (r, ts) in tensors.iter().enumerate() {
            for (t, x) in ts.iter().enumerate() {
                x.write()
                    .copy_from_slice(&half(t as u64, r as u32, version(k, t as u64)));
            }
        }
        // Both ranks save step k; rank 1's persist races rank 0's commit of step k - 1.
        let h1 = cks[1].save(k, state(1)).unwrap();
        if let Some(h) = pending.take() {
            settle(h, &mut committed);
        }
        if k % 5 == 3 {
            store.failpoints().set("before_commit", FailAction::Error);
        }
        let h0 = cks[0].save(k, state(0)).unwrap();
        h1.wait_persisted().unwrap();
        h0.wait_persisted().unwrap();
        if k % 5 == 3 {
            settle(h0, &mut committed);
            store.failpoints().clear();
        } else {
            pending = Some(h0);
        }
    }
    if let Some(h) = pending.take() {
        settle(h, &mut committed);
    }
    stop.store(true, SeqCst);
    let swept = gc.join().unwrap();
    assert_eq!(committed, 40);
    assert!(swept > 0, "GC swept nothing: the race was not exercised");
    clock.advance(grace * 2);
    runtime()
        .block_on(store.gc().run(&opts, clock.now()))
        .unwrap();
    let v = runtime()
        .block_on(store.verify(&VerifyScope::Store, None))
        .unwrap();
    assert!(v.is_clean(), "{v:?}");
    assert_eq!(
        runtime()
            .block_on(store.log().committed_steps(run))
            .unwrap(),
        vec![50]
    );
    check(50);
}
