//! A store that fails sometimes: with 5 % of requests failing at random (errors, timeouts,
//! slow requests) below the retry layer, saves, commits, restores, GC and verify complete over
//! the memory store, a local directory and a real S3 server; what gives up says so and leaves
//! every committed step intact; an outage (every request failing for a while) costs
//! checkpoints, never training, and checkpointing resumes when the store is back.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use ckpt_store::logs::{EVENTS, read_log};
use ckpt_store::placement::TensorSpec;
use ckpt_store::testing::{
    Need, S3Server, available, det_bytes, faulty_local_store, faulty_store, tiny_config,
};
use ckpt_store::{
    DType, FaultHandle, GcOptions, Layout, NdBox, RandomFaults, RetryConfig, Store, VerifyScope,
};
use ckpt_trainer::{
    CheckpointManager, CheckpointerConfig, HostTensor, ManagerConfig, Stage, events, runtime,
};

const N: usize = 96 << 10;

fn spec(name: &str) -> TensorSpec {
    TensorSpec::first_stage(name, DType::U8, &[N as u64])
}

/// Short enough that a hung request costs a test little; a hang outlasts it.
fn retry() -> RetryConfig {
    RetryConfig {
        attempts: 6,
        min_backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(200),
        request_timeout: Duration::from_millis(400),
    }
}

fn five_percent(seed: u64) -> RandomFaults {
    RandomFaults {
        slow: Duration::from_millis(30),
        hang: Duration::from_secs(3600),
        ..RandomFaults::new(0.05, seed)
    }
}

fn manager(store: &Store, run: &str) -> (CheckpointManager, HostTensor, HostTensor) {
    let mut c = ManagerConfig::new(CheckpointerConfig::new(run, 0, Layout::SINGLE));
    c.final_on_sigterm = false;
    c.every_steps = Some(1);
    c.keep_last = Some(3);
    let mut m = CheckpointManager::new(store.clone(), c).unwrap();
    let (a, b) = (HostTensor::zeroed(N), HostTensor::zeroed(N));
    m.register(spec("a"), NdBox::full(&[N as u64]), Arc::new(a.clone()))
        .unwrap();
    m.register(spec("b"), NdBox::full(&[N as u64]), Arc::new(b.clone()))
        .unwrap();
    (m, a, b)
}

/// One training step's update: `a` changes everywhere, `b` in one quarter (the rest dedups).
fn update(step: u64, a: &HostTensor, b: &HostTensor) {
    a.write().copy_from_slice(&det_bytes(step, N));
    let q = (step as usize % 4) * (N / 4);
    b.write()[q..q + N / 4].copy_from_slice(&det_bytes(1000 + step, N / 4));
}

/// Restore `step` into fresh memory and return its two tensors.
fn restore(store: &Store, run: &str, step: u64) -> (Vec<u8>, Vec<u8>) {
    let (mut m, a, b) = manager(store, run);
    m.restore(step)
        .unwrap_or_else(|e| panic!("restore step {step}: {e}"));
    (a.read().clone(), b.read().clone())
}

fn verify_clean(store: &Store, run: &str) -> u64 {
    let r = runtime()
        .block_on(store.verify(&VerifyScope::Run(run.into()), None))
        .unwrap();
    assert!(r.damaged.is_empty(), "damage: {:?}", r.damaged);
    r.steps
}

/// Train 8 steps saving every step over a store failing 5 % of requests: every save commits,
/// every kept step restores bit-identically, GC and verify complete, and retries were needed.
fn survive_five_percent(store: Store, faults: FaultHandle) {
    let run = "flaky";
    faults.set_random(Some(five_percent(7)));
    let (mut m, a, b) = manager(&store, run);
    let mut saved = BTreeMap::new();
    let mut handles = Vec::new();
    for step in 1..=8u64 {
        update(step, &a, &b);
        if let Some(h) = m.maybe_save(step).unwrap() {
            saved.insert(step, (a.read().clone(), b.read().clone()));
            handles.push(h);
        }
    }
    m.finish().unwrap();
    for h in &handles {
        h.wait_committed(Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("step {} did not commit through retries: {e}", h.step()));
    }
    assert_eq!(saved.len(), 8);
    assert_eq!(m.store_health().failed, 0, "{:?}", m.store_health());

    // GC under faults: keep the newest 2, sweep what nothing references.
    let gc = runtime()
        .block_on(store.gc().run(
            &GcOptions {
                keep_last: Some(2),
                grace: Duration::ZERO,
                ..GcOptions::default()
            },
            ckpt_store::clock::system_now(),
        ))
        .unwrap();
    assert!(!gc.steps_deleted.is_empty(), "{gc:?}");
    let kept = runtime()
        .block_on(store.log().committed_steps(run))
        .unwrap();
    assert_eq!(kept, vec![7, 8]);
    // Restores and verify under faults.
    for step in &kept {
        assert!(
            restore(&store, run, *step) == saved[step],
            "step {step} restored different bytes"
        );
    }
    assert_eq!(verify_clean(&store, run), 2);

    let st = faults.random_stats();
    let metrics = store.metrics().unwrap().snapshot();
    eprintln!("faults {st:?}, store {metrics:?}");
    assert!(
        st.errors > 0 && st.timeouts > 0 && st.slow > 0,
        "every kind of fault happened: {st:?}"
    );
    assert!(metrics.retries > 0 && metrics.give_ups == 0, "{metrics:?}");

    // Without faults, the same steps still verify and restore.
    faults.clear();
    assert_eq!(verify_clean(&store, run), 2);
    assert!(restore(&store, run, 8) == saved[&8]);
}

#[test]
fn five_percent_failures_memory() {
    let (store, faults) = faulty_store(
        ckpt_store::object_store::memory::InMemory::new(),
        "",
        "memory://",
        tiny_config(),
        retry(),
    );
    survive_five_percent(store, faults);
}

#[test]
fn five_percent_failures_local_directory() {
    let (store, faults, _dir) = faulty_local_store(tiny_config(), retry());
    survive_five_percent(store, faults);
}

#[test]
fn five_percent_failures_s3() {
    if !available(Need::S3Server, "five_percent_failures_s3") {
        return;
    }
    let server = S3Server::start();
    let (store, faults) = faulty_store(
        server.client(),
        "flaky",
        "s3://ckpt/flaky",
        tiny_config(),
        retry(),
    );
    survive_five_percent(store, faults);
}

/// A store failing half the requests with two attempts each: saves give up and say so; the
/// steps committed before stay intact, and saves succeed again once the faults are gone.
#[test]
fn giving_up_says_so_and_keeps_committed_steps() {
    let retry = RetryConfig {
        attempts: 2,
        ..retry()
    };
    let (store, faults) = faulty_store(
        ckpt_store::object_store::memory::InMemory::new(),
        "",
        "memory://",
        tiny_config(),
        retry,
    );
    let run = "giveup";
    let (mut m, a, b) = manager(&store, run);
    update(1, &a, &b);
    let before = (a.read().clone(), b.read().clone());
    m.save_now(1)
        .unwrap()
        .wait_committed(Duration::from_secs(30))
        .unwrap();
    faults.set_random(Some(RandomFaults {
        mix: [1, 0, 0],
        ..RandomFaults::new(0.5, 3)
    }));
    let mut failures = Vec::new();
    for step in 2..=4 {
        update(step, &a, &b);
        match m.save_now(step) {
            Ok(h) => {
                if let Err(e) = h.wait_committed(Duration::from_secs(30)) {
                    failures.push(e)
                }
            }
            Err(e) => failures.push(e),
        }
    }
    assert!(
        !failures.is_empty(),
        "half the requests failing broke no save"
    );
    for e in &failures {
        assert!(
            e.to_string().contains("gave up after 2 attempts"),
            "the error says the store gave up: {e}"
        );
    }
    assert!(store.metrics().unwrap().snapshot().give_ups > 0);
    faults.clear();
    assert!(verify_clean(&store, run) >= 1);
    assert!(restore(&store, run, 1) == before);
    update(5, &a, &b);
    let after = (a.read().clone(), b.read().clone());
    m.save_now(5)
        .unwrap()
        .wait_committed(Duration::from_secs(30))
        .unwrap();
    assert!(restore(&store, run, 5) == after);
}

/// An outage: every request fails for a while. Training goes on, due checkpoints are skipped
/// with warning events, and checkpoints resume when the store is back; nothing committed is
/// damaged and the steps saved after the outage restore bit-identically.
#[test]
fn outage_skips_checkpoints_and_resumes() {
    let retry = RetryConfig {
        attempts: 4,
        min_backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(50),
        request_timeout: Duration::from_millis(400),
    };
    let (store, faults) = faulty_store(
        ckpt_store::object_store::memory::InMemory::new(),
        "",
        "memory://",
        tiny_config(),
        retry,
    );
    let run = "outage";
    let (mut m, a, b) = manager(&store, run);
    let mut saved = BTreeMap::new();
    let mut handles = Vec::new();
    let mut trained = 0;
    for step in 1..=40u64 {
        update(step, &a, &b);
        if step == 6 {
            faults.set_outage(true);
        }
        if step == 20 {
            faults.set_outage(false);
        }
        if let Some(h) = m.maybe_save(step).unwrap() {
            saved.insert(step, (a.read().clone(), b.read().clone()));
            handles.push(h);
        }
        trained += 1;
        std::thread::sleep(Duration::from_millis(40));
    }
    m.finish().unwrap();
    assert_eq!(trained, 40, "training went on");
    let health = m.store_health();
    assert!(
        health.failed >= 1 && health.skipped >= 1 && health.resumed >= 1 && !health.down,
        "{health:?}"
    );
    assert!(faults.random_stats().outage > 0);
    let committed = runtime()
        .block_on(store.log().committed_steps(run))
        .unwrap();
    let after: Vec<u64> = committed.iter().copied().filter(|s| *s > 20).collect();
    assert!(
        after.len() >= 3,
        "checkpoints resumed after the outage: {committed:?}"
    );
    assert!(
        !committed.iter().any(|s| (7..20).contains(s)),
        "nothing was committed during the outage: {committed:?}"
    );
    for h in handles.iter().filter(|h| h.step() < 6 || h.step() > 21) {
        assert_eq!(h.stage(), Stage::Committed, "step {}", h.step());
    }
    verify_clean(&store, run);
    for step in &after {
        assert!(
            restore(&store, run, *step) == saved[step],
            "step {step} restored different bytes"
        );
    }
    // The events log tells what happened, in order.
    let log = runtime().block_on(read_log(&store, run, EVENTS)).unwrap();
    let kinds: Vec<&str> = log.iter().filter_map(|r| r["kind"].as_str()).collect();
    let first = |k: &str| kinds.iter().position(|x| *x == k);
    let (f, s, r) = (
        first(events::CHECKPOINT_FAILED),
        first(events::CHECKPOINT_SKIPPED),
        first(events::CHECKPOINTS_RESUMED),
    );
    assert!(
        f.is_some() && s.is_some() && r.is_some() && f < r && s < r,
        "events: {kinds:?}"
    );
    let failed = &log[f.unwrap()];
    assert!(
        failed["error"]
            .as_str()
            .unwrap()
            .contains("gave up after 4 attempts"),
        "{failed}"
    );
}
