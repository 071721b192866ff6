//! The persist governor end to end: a persist paced by a rate takes at least its bytes over
//! the rate and still commits bit-exact data; a wait for it runs it at full speed; a manager
//! whose steps slow while a persist runs lowers the rate (and says so in `persist_rate`
//! events), raises it again when they do not, and reports each persist; `off` never limits.
//! Speed goals are measured in BENCHMARKS.md ("Issue 16.4"), not asserted here.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ckpt_recovery::records::{Event, read_records};
use ckpt_store::placement::TensorSpec;
use ckpt_store::testing::{det_bytes, local_store};
use ckpt_store::{DType, Layout, NdBox, Store, StoreConfig};
use ckpt_trainer::{
    CheckpointManager, Checkpointer, CheckpointerConfig, GovernorConfig, HostTensor, ManagerConfig,
    SaveHandle, SaveState, SaveTensor, Stage, runtime,
};

mod common;
use common::read;

const MIB: u64 = 1 << 20;
/// The managers' state.
const STATE: u64 = 32 * MIB;

fn config(chunk: usize) -> StoreConfig {
    StoreConfig {
        chunk_size: chunk,
        ..StoreConfig::default()
    }
}

/// Wait for `h` to commit by watching its stage (a `wait_*` call would lift the limit).
fn watch_commit(h: &SaveHandle, within: Duration) {
    let t0 = Instant::now();
    loop {
        match h.stage() {
            Stage::Committed => return,
            Stage::Failed(e) => panic!("step {} failed: {e}", h.step()),
            Stage::Skipped(why) => panic!("step {} skipped: {why}", h.step()),
            _ if t0.elapsed() > within => panic!("step {} not committed in {within:?}", h.step()),
            _ => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

#[test]
fn a_throttled_persist_obeys_its_rate_and_commits_bit_exact() {
    let chunk = 256 << 10;
    let (store, _d) = local_store(config(chunk));
    let n = 8 * MIB;
    let data = det_bytes(16, n as usize);
    let t = HostTensor::from_vec(data.clone());
    let ck = Checkpointer::new(
        store.clone(),
        CheckpointerConfig::new("paced", 0, Layout::SINGLE),
    )
    .unwrap();
    let rate = 4 * MIB;
    ck.persist_rate().set(Some(rate));
    let released0 = ck.persist_rate().released();
    let h = ck
        .save(
            1,
            SaveState {
                tensors: vec![SaveTensor::bytes("t", &t, n)],
                blobs: vec![],
            },
        )
        .unwrap();
    watch_commit(&h, Duration::from_secs(120));
    let r = h.report();
    // 32 chunks of 256 KiB at 4 MiB/s: the first goes at once, each later one 1/16 s after.
    let floor_s = (n - chunk as u64) as f64 / rate as f64;
    let paced_s = r.persist_s - r.snapshot_s;
    assert!(
        paced_s >= 0.9 * floor_s,
        "a persist of {n} bytes at {rate} bytes/s took {paced_s:.2} s, less than {floor_s:.2} s: {r:?}"
    );
    assert!(ck.persist_rate().released() - released0 >= n);
    assert_eq!(read(&store, "paced", 1, "t"), data, "bit-exact");
    assert_eq!(ck.persist_rate().get(), Some(rate), "the limit stays set");
}

#[test]
fn waiting_for_a_throttled_persist_runs_it_at_full_speed() {
    let chunk = 256 << 10;
    let (store, _d) = local_store(config(chunk));
    let n = 8 * MIB;
    let data = det_bytes(17, n as usize);
    let t = HostTensor::from_vec(data.clone());
    let ck = Checkpointer::new(
        store.clone(),
        CheckpointerConfig::new("waited", 0, Layout::SINGLE),
    )
    .unwrap();
    // At 256 KiB/s this persist would take 31 s.
    ck.persist_rate().set(Some(256 << 10));
    let t0 = Instant::now();
    let h = ck
        .save(
            1,
            SaveState {
                tensors: vec![SaveTensor::bytes("t", &t, n)],
                blobs: vec![],
            },
        )
        .unwrap();
    // Let it start paced (its snapshot taken), then wait for it: the wait lifts the limit.
    std::thread::sleep(Duration::from_millis(500));
    h.wait_snapshot().unwrap();
    assert!(matches!(h.stage(), Stage::Snapshotted), "{:?}", h.stage());
    h.wait_committed(Duration::from_secs(120)).unwrap();
    let took = t0.elapsed();
    assert!(
        took < Duration::from_secs(15),
        "waiting for the persist did not lift its limit: {took:?}"
    );
    assert_eq!(read(&store, "waited", 1, "t"), data, "bit-exact");
    assert_eq!(
        (ck.persist_rate().get(), ck.persist_rate().limit()),
        (Some(256 << 10), Some(256 << 10)),
        "the limit applies again after the wait"
    );
}

fn spec(name: &str, n: u64) -> TensorSpec {
    TensorSpec::first_stage(name, DType::U8, &[n])
}

fn manager(
    store: &Store,
    run: &str,
    gov: Option<GovernorConfig>,
) -> (CheckpointManager, HostTensor) {
    let n = STATE;
    let t = HostTensor::from_vec(det_bytes(18, n as usize));
    let mut mc = ManagerConfig::new(CheckpointerConfig::new(run, 0, Layout::SINGLE));
    mc.every_steps = Some(20);
    mc.final_on_sigterm = false;
    mc.persist_governor = gov;
    let mut m = CheckpointManager::new(store.clone(), mc).unwrap();
    m.register(spec("t", n), NdBox::full(&[n]), Arc::new(t.clone()))
        .unwrap();
    (m, t)
}

/// Steps `steps` of a loop whose steps take `base` alone and `base x slow` while a persist of
/// `m` is in flight (a synthetic slowdown the governor must see), each writing the state (a
/// write bumps its version: every save copies and persists all of it).
fn train(
    m: &mut CheckpointManager,
    t: &HostTensor,
    steps: std::ops::RangeInclusive<u64>,
    slow: f64,
) {
    let base = Duration::from_millis(20);
    for step in steps {
        let persisting = m
            .checkpointer()
            .last()
            .is_some_and(|h| matches!(h.stage(), Stage::Snapshotting | Stage::Snapshotted));
        std::thread::sleep(if persisting { base.mul_f64(slow) } else { base });
        t.write()[..4096].fill(step as u8);
        m.maybe_save(step).unwrap();
    }
}

fn rate_events(store: &Store, run: &str) -> Vec<ckpt_recovery::records::PersistRate> {
    runtime()
        .block_on(read_records::<Event>(store, run))
        .unwrap()
        .into_iter()
        .filter_map(|e| match e.record {
            Event::PersistRate(r) => Some(r),
            _ => None,
        })
        .collect()
}

#[test]
fn the_governor_lowers_the_rate_when_steps_slow_and_raises_it_when_not() {
    let (store, _d) = local_store(config(1 << 20));
    // A wide budget: the machine's own noise (other processes, the persist's CPU beside the
    // loop's writes) must not decide the test, the synthetic slowdown must.
    let gov = GovernorConfig {
        budget: 0.5,
        min_rate: 4 * MIB,
        decide_every: Duration::from_millis(50),
    };
    let (mut m, t) = manager(&store, "gov", Some(gov));
    // Three times as slow beside a persist: over budget, the rate goes down (to the floor in
    // the end); saves at 20, 40, 60.
    train(&mut m, &t, 1..=60, 3.0);
    let lowered = rate_events(&store, "gov");
    assert!(
        lowered.iter().any(|e| e.reason == "over_budget"
            && e.slowdown > 1.5
            && e.budget == 0.5
            && e.to_bps.is_some_and(|b| b >= 4 * MIB)),
        "{lowered:?}"
    );
    let low = m.persist_rate().expect("a limit is set");
    assert!(low >= 4 * MIB, "the floor holds: {low}");
    // Every persist of a save is summed up, the first one with its slowdown.
    let figures = m.take_persist_figures();
    assert!(figures.len() >= 2, "{figures:?}");
    assert_eq!(figures[0].step, 20);
    assert!(figures[0].slowdown.is_some_and(|s| s > 1.5), "{figures:?}");
    assert!(
        figures
            .iter()
            .all(|f| f.durable_s > 0.0 && f.bytes == STATE)
    );
    assert!(figures.iter().any(|f| f.rate_bps.is_some()), "{figures:?}");
    // Steps no slower beside a persist: the rate goes up again, up to no limit at all.
    train(&mut m, &t, 61..=200, 1.0);
    m.finish().unwrap();
    let events = rate_events(&store, "gov");
    assert!(
        events.iter().any(|e| e.reason == "under_budget"),
        "{events:?}"
    );
    let raised = m.persist_rate();
    assert!(raised.is_none_or(|r| r > low), "{low} -> {raised:?}");
    // The last save (200) is committed bit-exact, at full speed by `finish`.
    assert_eq!(read(&store, "gov", 200, "t"), *t.read());
}

#[test]
fn a_governor_turned_off_never_limits() {
    let (store, _d) = local_store(config(1 << 20));
    let (mut m, t) = manager(&store, "off", None);
    train(&mut m, &t, 1..=60, 3.0);
    m.finish().unwrap();
    assert_eq!(m.persist_rate(), None);
    assert!(m.take_persist_figures().is_empty());
    assert!(rate_events(&store, "off").is_empty());
    assert_eq!(read(&store, "off", 60, "t"), *t.read());
}
