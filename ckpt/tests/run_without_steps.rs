//! A run whose first checkpoint failed has logs and no step: `ckpt ls RUN` says it has no
//! committed step yet and why (the failed save's error from its events log), not that there
//! is no such run; a run that does not exist still gets the list of the runs there are.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use ckpt_recovery::records::{Event, read_records};
use ckpt_store::placement::TensorSpec;
use ckpt_store::{DType, FailAction, Layout, NdBox};
use ckpt_trainer::{
    CheckpointManager, CheckpointerConfig, HostTensor, ManagerConfig, Stage, runtime,
};
use common::local;

const N: u64 = 4096;

/// Train `run` saving every step while every save fails after writing its chunks (before any
/// rank manifest), until its events log holds the failure.
fn train_with_failing_saves(store: &ckpt_store::Store, run: &str) {
    let mut c = ManagerConfig::new(CheckpointerConfig::new(run, 0, Layout::SINGLE));
    c.final_on_sigterm = false;
    c.every_steps = Some(1);
    let mut m = CheckpointManager::new(store.clone(), c).unwrap();
    let spec = TensorSpec::first_stage("w", DType::U8, &[N]);
    let w = HostTensor::zeroed(N as usize);
    m.register(spec, NdBox::full(&[N]), Arc::new(w.clone()))
        .unwrap();
    store.failpoints().set("after_chunks", FailAction::Error);
    let logged = || {
        runtime()
            .block_on(read_records::<Event>(store, run))
            .unwrap()
            .into_iter()
            .any(|e| matches!(e.record, Event::CheckpointFailed(_)))
    };
    let start = Instant::now();
    let mut step = 0;
    while !logged() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no checkpoint_failed event after {step} steps"
        );
        step += 1;
        w.write()[0] = step as u8;
        if let Some(h) = m.maybe_save(step).unwrap() {
            // Wait for the save to fail: the next due checkpoint reports it.
            while !matches!(h.stage(), Stage::Failed(_)) {
                assert!(start.elapsed() < Duration::from_secs(60), "{:?}", h.stage());
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // The newest save failed as well: finishing says so.
    let _ = m.finish();
}

#[test]
fn a_run_whose_saves_failed_says_why_it_has_no_step() {
    let env = local();
    train_with_failing_saves(&env.store, "q");
    let steps = runtime().block_on(env.store.log().list_steps("q")).unwrap();
    assert!(steps.is_empty(), "no step object: {steps:?}");
    assert_eq!(
        runtime().block_on(env.store.log().list_runs()).unwrap(),
        ["q"],
        "the run is there, by its logs"
    );

    let r = env.ckpt(&["ls", "q"]).code(1);
    assert!(!r.err.contains("no run named"), "{}", r.err);
    assert!(
        r.err.contains("run q has no committed step yet")
            && r.err.contains("failed")
            && r.err.contains("failpoint after_chunks fired"),
        "{}",
        r.err
    );
    // Every command that looks the run's steps up says the same.
    for args in [
        &["inspect", "q@1"][..],
        &["verify", "q"],
        &["gc", "--run", "q"],
    ] {
        let r = env.ckpt(args).code(1);
        assert!(
            r.err.contains("run q has no committed step yet"),
            "ckpt {args:?}: {}",
            r.err
        );
    }

    // A run that does not exist: the runs there are.
    let r = env.ckpt(&["ls", "nosuch"]).code(1);
    assert!(
        r.err.contains("no run named nosuch (known runs: q)"),
        "{}",
        r.err
    );
}
