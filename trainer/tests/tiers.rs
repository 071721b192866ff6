//! A local tier under a remote store (issue 28), through `CheckpointManager`: saves commit to
//! the local tier and drain to the remote behind the training (only new chunks), `finish`
//! waits for the newest step to be remote-durable, retention runs per tier, a remote outage
//! leaves saves going on locally and the drain catches up, a manager started after a crash
//! finishes the drain, a restore reads the local tier first and a damaged local chunk from the
//! remote (with an event), a drain that falls behind skips older steps for the newest, and a
//! full tier fails one save (with an event), makes room and commits the next.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ckpt_recovery::records::{Event, read_records};
use ckpt_store::placement::TensorSpec;
use ckpt_store::testing::{det_bytes, faulty_store, local_store, tiny_config};
use ckpt_store::{DType, Layout, NdBox, RetryConfig, Store, StoreConfig};
use ckpt_trainer::save::runtime;
use ckpt_trainer::{
    AllGather, CheckpointManager, CheckpointerConfig, HostTensor, LocalTier, ManagerConfig,
};

const N: u64 = 64 << 10;

fn events(store: &Store, run: &str) -> Vec<Event> {
    runtime()
        .block_on(read_records::<Event>(store, run))
        .unwrap()
        .into_iter()
        .map(|l| l.record)
        .collect()
}

fn cfg(run: &str, local: &Store, keep_local: usize) -> ManagerConfig {
    let mut c = ManagerConfig::new(CheckpointerConfig::new(run, 0, Layout::SINGLE));
    c.every_steps = Some(1);
    c.final_on_sigterm = false;
    c.persist_governor = None;
    c.ckpt.commit_timeout = Duration::from_secs(120);
    c.local_tier = Some(LocalTier {
        store: local.clone(),
        keep_last: keep_local,
    });
    c
}

/// A manager with one tensor `w` of `N` bytes (a quarter changes each step: `touch`).
fn manager(remote: &Store, c: ManagerConfig) -> (CheckpointManager, HostTensor) {
    let mut m = CheckpointManager::new(remote.clone(), c).unwrap();
    let w = HostTensor::from_vec(det_bytes(1, N as usize));
    m.register(
        TensorSpec::first_stage("w", DType::U8, &[N]),
        NdBox::full(&[N]),
        Arc::new(w.clone()),
    )
    .unwrap();
    (m, w)
}

fn touch(w: &HostTensor, step: u64) {
    let mut g = w.write();
    let q = g.len() / 4;
    g[..q].copy_from_slice(&det_bytes(1000 + step, q));
}

fn committed(s: &Store, run: &str) -> Vec<u64> {
    runtime().block_on(s.log().committed_steps(run)).unwrap()
}

fn read_w(s: &Store, run: &str, step: u64) -> Vec<u8> {
    runtime()
        .block_on(async {
            ckpt_store::StepReader::open(s, run, step)
                .await?
                .read_tensor("w")
                .await
        })
        .unwrap()
}

#[test]
fn saves_commit_locally_drain_only_new_chunks_and_retention_runs_per_tier() {
    let (local, _l) = local_store(tiny_config());
    let (remote, _r) = local_store(tiny_config());
    let run = "tier";
    let mut c = cfg(run, &local, 2);
    c.keep_last = Some(3);
    let (mut m, w) = manager(&remote, c);
    let mut saved = Vec::new();
    for step in 1..=6u64 {
        touch(&w, step);
        let h = m.maybe_save(step).unwrap().expect("due");
        // Committed in the local tier: local-durable.
        h.wait_committed(Duration::from_secs(60)).unwrap();
        assert!(committed(&local, run).contains(&step));
        saved.push(w.read().clone());
    }
    m.finish().unwrap();
    // The newest step is remote-durable once `finish` returns.
    assert_eq!(read_w(&remote, run, 6), saved[5]);
    // Retention: 3 on the remote (of the steps drained: one that waited while another
    // drained may have been skipped for a newer one, so at least the first and the newest
    // reached it), 2 locally.
    let rem = committed(&remote, run);
    assert!(
        (2..=3).contains(&rem.len()) && rem.last() == Some(&6),
        "{rem:?}"
    );
    let figs = m.take_drain_figures();
    let drained: Vec<u64> = figs.iter().map(|f| f.step).collect();
    if drained.len() >= 3 {
        assert_eq!(rem.len(), 3, "{rem:?}, drained {drained:?}");
    }
    assert_eq!(committed(&local, run), vec![5, 6]);
    // Only new chunks moved: the unchanged three quarters of `w` were sent once.
    let first = figs.iter().find(|f| f.step == 1).map(|f| f.bytes_sent);
    let later: Vec<&ckpt_recovery::records::DrainMetrics> =
        figs.iter().filter(|f| f.step > 1).collect();
    assert!(!later.is_empty(), "{figs:?}");
    if let Some(first) = first {
        for f in &later {
            assert!(
                f.bytes_sent * 2 < first && f.bytes_present > 0,
                "step {}: sent {} of {first}: {figs:?}",
                f.step,
                f.bytes_sent
            );
        }
    }
    // A fresh manager restores from the local tier.
    let (mut m2, w2) = manager(&remote, cfg(run, &local, 2));
    assert_eq!(m2.restore_latest().unwrap(), Some(6));
    assert_eq!(*w2.read(), saved[5]);
    let r = events(&remote, run)
        .into_iter()
        .filter_map(|e| match e {
            Event::Restore(r) => Some(r),
            _ => None,
        })
        .next_back()
        .unwrap();
    assert_eq!(r.tier, "local");
    assert!(r.bytes_from_local > 0 && r.bytes_from_store == 0, "{r:?}");
}

#[test]
fn a_remote_outage_leaves_saves_going_on_locally_and_the_drain_catches_up() {
    let (local, _l) = local_store(tiny_config());
    let (remote, faults) = faulty_store(
        ckpt_store::object_store::memory::InMemory::new(),
        "",
        "memory://remote",
        tiny_config(),
        quick_retry(),
    );
    let run = "outage";
    let (mut m, w) = manager(&remote, cfg(run, &local, 50));
    for step in 1..=30u64 {
        touch(&w, step);
        if step == 5 {
            faults.set_outage(true);
        }
        if step == 20 {
            faults.set_outage(false);
        }
        let h = m.maybe_save(step).unwrap().expect("due");
        // Local saves never wait for the remote.
        h.wait_committed(Duration::from_secs(30)).unwrap();
        std::thread::sleep(Duration::from_millis(30));
    }
    m.finish().unwrap();
    assert_eq!(
        committed(&local, run).len(),
        30,
        "every save committed locally"
    );
    assert!(
        committed(&remote, run).contains(&30),
        "caught up: {:?}",
        committed(&remote, run)
    );
    let ev = events(&remote, run);
    assert!(
        ev.iter().any(|e| matches!(e, Event::DrainFailed(_))),
        "no drain_failed event"
    );
    assert!(faults.random_stats().outage > 0);
    assert!(
        runtime()
            .block_on(local.log().pending_drains(run))
            .unwrap()
            .is_empty()
    );
}

#[test]
fn a_manager_started_after_a_crash_finishes_the_drain() {
    let (local, _l) = local_store(tiny_config());
    let (remote, faults) = faulty_store(
        ckpt_store::object_store::memory::InMemory::new(),
        "",
        "memory://remote",
        tiny_config(),
        RetryConfig {
            attempts: 1,
            min_backoff: Duration::from_millis(5),
            max_backoff: Duration::from_millis(5),
            request_timeout: Duration::from_millis(200),
        },
    );
    let run = "crash";
    faults.set_outage(true);
    {
        let (mut m, w) = manager(&remote, cfg(run, &local, 2));
        touch(&w, 1);
        let h = m.maybe_save(1).unwrap().unwrap();
        h.wait_committed(Duration::from_secs(30)).unwrap();
        // No finish: the process "dies" with step 1 local only.
    }
    faults.set_outage(false);
    assert!(committed(&remote, run).is_empty());
    // The next job on this node: its drainer finds step 1 local only and drains it.
    let (mut m, _w) = manager(&remote, cfg(run, &local, 2));
    let t0 = Instant::now();
    while !committed(&remote, run).contains(&1) {
        assert!(t0.elapsed() < Duration::from_secs(60), "not drained");
        std::thread::sleep(Duration::from_millis(20));
    }
    m.finish().unwrap();
}

#[test]
fn a_damaged_local_chunk_is_read_from_the_remote_and_an_event_says_so() {
    let (local, ldir) = local_store(tiny_config());
    let (remote, _r) = local_store(tiny_config());
    let run = "damaged";
    let (mut m, w) = manager(&remote, cfg(run, &local, 2));
    touch(&w, 1);
    m.maybe_save(1).unwrap().unwrap();
    m.finish().unwrap();
    let want = w.read().clone();
    // Damage one chunk object of the local tier.
    let refs = runtime()
        .block_on(local.log().step_chunk_refs(run, 1))
        .unwrap();
    let file = ldir.path().join(local.keys().object_of(&refs[0]).as_ref());
    let mut b = std::fs::read(&file).unwrap();
    let n = b.len();
    b[n - 3] ^= 0x55;
    std::fs::write(&file, b).unwrap();
    let (mut m2, w2) = manager(&remote, cfg(run, &local, 2));
    assert_eq!(m2.restore_latest().unwrap(), Some(1));
    assert_eq!(*w2.read(), want, "restored bit-exact from the remote");
    let d: Vec<_> = events(&remote, run)
        .into_iter()
        .filter_map(|e| match e {
            Event::LocalTierDamaged(d) => Some(d),
            _ => None,
        })
        .collect();
    assert_eq!(d.len(), 1, "{d:?}");
    assert_eq!((d[0].step, d[0].chunks), (1, 1));
}

#[test]
fn a_drain_that_falls_behind_skips_older_steps_for_the_newest() {
    let (local, _l) = local_store(tiny_config());
    // A slow remote: every chunk put delayed.
    let fs = ckpt_store::FaultyStore::new(ckpt_store::object_store::memory::InMemory::new());
    fs.handle().add(ckpt_store::Fault {
        op: ckpt_store::FaultOp::Put,
        key_contains: Some("chunks/".into()),
        nth: 0,
        action: ckpt_store::FaultAction::Delay(Duration::from_millis(250)),
    });
    let remote = Store::new(Arc::new(fs), Default::default(), "slow://")
        .with_config(StoreConfig {
            pack_threshold: 0,
            ..tiny_config()
        })
        .unwrap();
    let run = "behind";
    let (mut m, w) = manager(&remote, cfg(run, &local, 100));
    for step in 1..=12u64 {
        touch(&w, step);
        let h = m.maybe_save(step).unwrap().unwrap();
        h.wait_committed(Duration::from_secs(30)).unwrap();
    }
    m.finish().unwrap();
    let rem = committed(&remote, run);
    assert!(rem.contains(&12), "the newest step drained: {rem:?}");
    assert!(rem.len() < 12, "nothing was skipped: {rem:?}");
    let skipped: Vec<u64> = events(&remote, run)
        .into_iter()
        .filter_map(|e| match e {
            Event::DrainSkipped(s) => Some(s.step),
            _ => None,
        })
        .collect();
    assert!(!skipped.is_empty());
    for s in &skipped {
        assert!(!rem.contains(s), "skipped step {s} is on the remote");
    }
    let figs = m.take_drain_figures();
    assert!(figs.iter().any(|f| !f.skipped.is_empty()), "{figs:?}");
}

/// The local tier on a real, small file system (a 6 MiB tmpfs, room for about two steps) that fills up: the save that
/// does not fit fails with an event naming the full file system, training goes on, the tier
/// makes room (it keeps only its newest step; the remote holds the others) and the next save
/// commits and drains.
#[test]
fn a_full_local_tier_fails_one_save_makes_room_and_the_next_save_commits_and_drains() {
    const TEST: &str =
        "tiers::a_full_local_tier_fails_one_save_makes_room_and_the_next_save_commits_and_drains";
    if !ckpt_store::testing::available(ckpt_store::testing::Need::TmpfsMount, TEST) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let fs = ckpt_store::testing::Tmpfs::mount(dir.path(), 6 << 20).expect("mount a tmpfs");
    let tier_dir = fs.path().join("tier");
    let local = ckpt_store::open(tier_dir.to_str().unwrap())
        .unwrap()
        .with_config(tiny_config())
        .unwrap();
    let (remote, _r) = local_store(tiny_config());
    let run = "full";
    let mut m = CheckpointManager::new(remote.clone(), cfg(run, &local, 3)).unwrap();
    const MIB: u64 = 1 << 20;
    let w = HostTensor::from_vec(det_bytes(1, MIB as usize));
    m.register(
        TensorSpec::first_stage("w", DType::U8, &[MIB]),
        NdBox::full(&[MIB]),
        Arc::new(w.clone()),
    )
    .unwrap();
    let (mut failed, mut after) = (Vec::new(), None);
    for step in 1..=12u64 {
        // Every byte changes: each step needs 1 MiB more in the tier.
        w.write()
            .copy_from_slice(&det_bytes(100 + step, MIB as usize));
        let Some(h) = m.maybe_save(step).unwrap() else {
            continue;
        };
        match h.wait_committed(Duration::from_secs(60)) {
            Ok(_) if !failed.is_empty() => {
                after = Some((step, w.read().clone()));
                break;
            }
            Ok(_) => {}
            Err(e) => {
                assert_eq!(e.kind(), ckpt_store::ErrorKind::NoSpace, "step {step}: {e}");
                failed.push(step);
            }
        }
    }
    assert!(!failed.is_empty(), "the tier never filled up");
    let (last, want) = after.expect("no save committed after the tier filled up");
    m.finish().unwrap();
    // The step after the failure is local- and remote-durable, bit for bit.
    assert_eq!(read_w(&remote, run, last), want);
    assert_eq!(read_w(&local, run, last), want);
    let failures: Vec<_> = events(&remote, run)
        .into_iter()
        .filter_map(|e| match e {
            Event::CheckpointFailed(f) => Some(f),
            _ => None,
        })
        .collect();
    assert_eq!(
        failures.iter().map(|f| f.step).collect::<Vec<_>>(),
        failed,
        "{failures:?}"
    );
    let real = std::fs::canonicalize(&tier_dir).unwrap();
    assert!(
        failures[0].error.contains("no space left")
            && failures[0].error.contains(&real.display().to_string()),
        "the event must name the full file system: {}",
        failures[0].error
    );
    assert_eq!(m.store_health().failed, failed.len() as u64);
    assert!(
        !m.store_health().down,
        "a full disk is not a store that is down"
    );
}

#[test]
fn one_node_of_several_dedups_each_save_against_its_last_node_commit() {
    // A node's ranks commit in its own tier (`node_ranks`): the tier holds no commit record of
    // the step (the drains make it on the store), so the node commit is what makes a step the
    // base of the next save. Without it every save rewrote every chunk into the tier.
    let (local, _l) = local_store(tiny_config());
    let (remote, _r) = local_store(tiny_config());
    let run = "node-dedup";
    let mut c = cfg(run, &local, 2);
    c.ckpt.committer = true;
    c.ckpt.node_ranks = Some(vec![0]);
    let (mut m, w) = manager(&remote, c);
    let mut reports = Vec::new();
    for step in 1..=4u64 {
        touch(&w, step);
        let h = m.maybe_save(step).unwrap().expect("due");
        reports.push(h.wait_committed(Duration::from_secs(60)).unwrap());
        // Node-committed in the tier, no commit record there.
        assert!(
            !runtime()
                .block_on(local.log().node_commit_keys(run, step))
                .unwrap()
                .is_empty()
        );
        assert!(committed(&local, run).is_empty());
    }
    let last = w.read().clone();
    m.finish().unwrap();
    let first = reports[0].bytes_written;
    assert!(first >= N, "{:?}", reports[0]);
    for r in &reports[1..] {
        // A quarter of `w` changed: the other three quarters are skipped.
        assert!(
            r.bytes_written * 2 < first && r.bytes_skipped >= N / 2,
            "step {}: wrote {} of {first}, skipped {}",
            r.step,
            r.bytes_written,
            r.bytes_skipped
        );
    }
    // The drains committed the newest step on the store, whole.
    assert_eq!(committed(&remote, run).last(), Some(&4));
    assert_eq!(read_w(&remote, run, 4), last);
}

/// Node `rank` of a job of two machines, each with its own tier (`node_ranks`), over `remote`.
fn node_manager(
    remote: &Store,
    local: &Store,
    run: &str,
    rank: u32,
    tweak: impl FnOnce(&mut ManagerConfig),
) -> (CheckpointManager, HostTensor) {
    let layout = Layout::new(2, 1, 1, 0).unwrap();
    let mut c = ManagerConfig::new(CheckpointerConfig::new(run, rank, layout));
    c.every_steps = Some(1);
    c.final_on_sigterm = false;
    c.persist_governor = None;
    c.ckpt.commit_timeout = Duration::from_secs(60);
    c.ckpt.committer = true;
    c.ckpt.node_ranks = Some(vec![rank]);
    c.local_tier = Some(LocalTier::new(local.clone()));
    tweak(&mut c);
    manager(remote, c)
}

/// Poll `m`'s drainer until `done` holds (30 s at most).
fn until(ms: &mut [&mut CheckpointManager], what: &str, mut done: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !done() {
        assert!(t0.elapsed() < Duration::from_secs(30), "timed out: {what}");
        for m in ms.iter_mut() {
            m.take_drain_figures();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn machines_whose_drains_took_different_steps_follow_each_other_so_the_store_gets_whole_steps() {
    // Two machines with their own tiers, one store. Machine 1 cannot reach the store while
    // machine 0 drains steps 2 and 3; then machine 0 cannot while both save step 4. Machine 1,
    // back, has only its newest step waiting (4: it skipped 2 and 3) and machine 0 only its
    // part of 3 on the store. Each draining its own newest, no step would be whole until
    // machine 0 is back; machine 1 follows machine 0 instead: it drains its part of step 3
    // first, and step 3 commits while machine 0 is still away.
    let (_shared, (remote0, f0), (remote1, f1), check) = two_machine_remote();
    let (t0, _t0) = local_store(tiny_config());
    let (t1, _t1) = local_store(tiny_config());
    let run = "follow";
    let (mut m0, w0) = node_manager(&remote0, &t0, run, 0, |_| {});
    let (mut m1, w1) = node_manager(&remote1, &t1, run, 1, |_| {});
    let save = |m: &mut CheckpointManager, w: &HostTensor, step: u64| {
        touch(w, step);
        let h = m.maybe_save(step).unwrap().expect("due");
        h.wait_committed(Duration::from_secs(30)).unwrap();
    };
    let on_store = |step: u64, rank: u32| {
        runtime()
            .block_on(check.log().list_steps(run))
            .unwrap()
            .iter()
            .any(|s| s.step == step && s.ranks.contains(&rank))
    };
    save(&mut m0, &w0, 1);
    save(&mut m1, &w1, 1);
    until(&mut [&mut m0, &mut m1], "step 1 committed", || {
        committed(&check, run) == vec![1]
    });
    f1.set_outage(true);
    for step in 2..=3 {
        save(&mut m0, &w0, step);
        save(&mut m1, &w1, step);
    }
    until(
        &mut [&mut m0, &mut m1],
        "machine 0's part of step 3",
        || on_store(3, 0),
    );
    // Machine 0's drain of step 3 ends (its commit finds rank 1 missing).
    let mut figs = Vec::new();
    until(&mut [], "machine 0's drain of step 3 ended", || {
        figs.extend(m0.take_drain_figures());
        figs.iter().any(|f| f.step == 3)
    });
    f0.set_outage(true);
    save(&mut m0, &w0, 4);
    save(&mut m1, &w1, 4);
    f1.set_outage(false);
    until(
        &mut [&mut m0, &mut m1],
        "step 3 committed by machine 1's drain",
        || committed(&check, run).contains(&3),
    );
    assert!(!on_store(4, 0));
    f0.set_outage(false);
    until(&mut [&mut m0, &mut m1], "step 4 committed", || {
        committed(&check, run).contains(&4)
    });
    let last = (w0.read().clone(), w1.read().clone());
    m0.finish().unwrap();
    m1.finish().unwrap();
    assert_eq!(committed(&check, run), vec![1, 3, 4]);
    assert_eq!(read_w(&check, run, 4), last.0);
    // No drain marker is left to keep a step from retention.
    for t in [&t0, &t1] {
        assert!(
            runtime()
                .block_on(t.log().pending_drains(run))
                .unwrap()
                .is_empty()
        );
    }
}

#[test]
fn one_machine_of_two_finishes_once_the_step_is_committed_on_the_store_not_when_its_part_is() {
    let (remote, _r) = local_store(tiny_config());
    let (t0, _t0) = local_store(tiny_config());
    let (t1, _t1) = local_store(tiny_config());
    let run = "finish";
    let (mut m0, w0) = node_manager(&remote, &t0, run, 0, |c| {
        c.ckpt.commit_timeout = Duration::from_secs(2);
    });
    let (mut m1, w1) = node_manager(&remote, &t1, run, 1, |_| {});
    touch(&w0, 1);
    m0.maybe_save(1).unwrap().expect("due");
    // Machine 1 has not saved: machine 0's part is on the store, the step is not.
    let e = m0.finish().unwrap_err();
    assert_eq!(e.kind(), ckpt_store::ErrorKind::Incomplete, "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("step 1 of run finish") && msg.contains("another machine's ranks"),
        "{msg}"
    );
    assert!(committed(&remote, run).is_empty());
    touch(&w1, 1);
    m1.maybe_save(1).unwrap().expect("due");
    // Machine 1's drain lands the last ranks: its finish returns once the step commits.
    m1.finish().unwrap();
    assert_eq!(committed(&remote, run), vec![1]);
    m0.finish().unwrap();
}

#[test]
fn a_machine_restarted_in_a_newer_generation_clears_the_drain_markers_a_killed_drain_left() {
    // A marker keeps its step from the tier's retention while the step drains; a drain killed
    // (or failed for good) on one machine of several left its marker, which nothing finished.
    let (remote, _r) = local_store(tiny_config());
    let (t0, _t0) = local_store(tiny_config());
    let run = "markers";
    let marker = |step: u64, generation: u64| ckpt_store::DrainMarker {
        run: run.into(),
        step,
        generation,
        remote: remote.url().to_string(),
        bytes_total: 100,
        bytes_done: 10,
        started_ms: 0,
        updated_ms: 0,
    };
    let rt = runtime();
    rt.block_on(t0.log().put_drain_marker(&marker(3, 1)))
        .unwrap();
    rt.block_on(t0.log().put_drain_marker(&marker(5, 2)))
        .unwrap();
    // The same generation's (a drain of this job in flight elsewhere) stays.
    let (mut m0, _w) = node_manager(&remote, &t0, run, 0, |c| c.ckpt.generation = 2);
    until(
        &mut [&mut m0],
        "the older generation's marker deleted",
        || {
            rt.block_on(t0.log().pending_drains(run))
                .unwrap()
                .iter()
                .map(|d| d.step)
                .collect::<Vec<_>>()
                == vec![5]
        },
    );
}

/// A job of two machines killed after both committed step 2 in their own tiers while the store
/// was down (step 1 is on the store; machine 0 also has step 3, machine 1 not): the shared
/// store's objects, the tiers, and each machine's weights at step 2.
struct KilledTwoMachineJob {
    shared: Objects,
    tiers: [(Store, tempfile::TempDir); 2],
    at_1: [Vec<u8>; 2],
    at_2: [Vec<u8>; 2],
}

/// Retries that give up within a second: a store in an outage fails fast.
fn quick_retry() -> RetryConfig {
    RetryConfig {
        attempts: 2,
        min_backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(20),
        request_timeout: Duration::from_millis(300),
    }
}

/// The remote store's objects, shared by the views of it.
type Objects = Arc<dyn ckpt_store::object_store::ObjectStore>;

/// A view of the remote store, with its own fault switch.
type View = (Store, ckpt_store::FaultHandle);

/// A view of the remote store's objects `shared`, with its own fault switch.
fn remote_view(shared: &Objects) -> View {
    faulty_store(
        shared.clone(),
        "",
        "memory://remote",
        tiny_config(),
        quick_retry(),
    )
}

/// A remote store for two machines: its objects, each machine's view of them (with its own
/// fault switch), and a view that checks what is there.
fn two_machine_remote() -> (Objects, View, View, Store) {
    let shared: Objects = Arc::new(ckpt_store::object_store::memory::InMemory::new());
    let (a, b, (check, _)) = (
        remote_view(&shared),
        remote_view(&shared),
        remote_view(&shared),
    );
    (shared, a, b, check)
}

fn killed_two_machine_job(run: &str) -> KilledTwoMachineJob {
    let (shared, (remote0, f0), (remote1, f1), check) = two_machine_remote();
    let tiers = [local_store(tiny_config()), local_store(tiny_config())];
    let (mut m0, w0) = node_manager(&remote0, &tiers[0].0, run, 0, |_| {});
    let (mut m1, w1) = node_manager(&remote1, &tiers[1].0, run, 1, |_| {});
    let save = |m: &mut CheckpointManager, w: &HostTensor, step: u64| {
        touch(w, step);
        let h = m.maybe_save(step).unwrap().expect("due");
        h.wait_committed(Duration::from_secs(30)).unwrap();
        w.read().clone()
    };
    let at_1 = [save(&mut m0, &w0, 1), save(&mut m1, &w1, 1)];
    until(&mut [&mut m0, &mut m1], "step 1 committed", || {
        committed(&check, run) == vec![1]
    });
    f0.set_outage(true);
    f1.set_outage(true);
    let at_2 = [save(&mut m0, &w0, 2), save(&mut m1, &w1, 2)];
    save(&mut m0, &w0, 3);
    // Killed: nothing more is drained (the drainers stop with their managers).
    drop((m0, m1));
    assert_eq!(committed(&check, run), vec![1]);
    KilledTwoMachineJob {
        shared,
        tiers,
        at_1,
        at_2,
    }
}

/// Every rank of the restarted job calls `restore_latest` at once (ranks as threads of this
/// process, one a machine), with the in-process all-gather or without one: each rank's step
/// and restored weights.
fn restart(job: &KilledTwoMachineJob, run: &str, gather: bool) -> Vec<(Option<u64>, Vec<u8>)> {
    restart_with(job, run, gather)
        .into_iter()
        .map(|r| r.unwrap())
        .collect()
}

/// [`restart`], each rank's `restore_latest` result kept.
fn restart_with(
    job: &KilledTwoMachineJob,
    run: &str,
    gather: bool,
) -> Vec<ckpt_store::Result<(Option<u64>, Vec<u8>)>> {
    let all = AllGather::in_process(2, Duration::from_secs(60));
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..2u32)
            .map(|rank| {
                let all = all[rank as usize].clone();
                let (remote, _) = remote_view(&job.shared);
                let tier = job.tiers[rank as usize].0.clone();
                s.spawn(move || {
                    let (mut m, w) = node_manager(&remote, &tier, run, rank, |c| {
                        c.all_gather = gather.then_some(all);
                    });
                    // Other bytes than any step's, so the restore must write every one.
                    w.write().fill(0);
                    let step = m.restore_latest()?;
                    let got = w.read().clone();
                    Ok((step, got))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn machines_without_a_driver_agree_on_the_newest_step_every_tier_holds_and_drain_it_first() {
    let run = "agree";
    let job = killed_two_machine_job(run);
    let (check, _) = remote_view(&job.shared);
    // Without the all-gather a machine cannot know the other holds step 2: the store's newest.
    let got = restart(&job, run, false);
    for (rank, (step, w)) in got.iter().enumerate() {
        assert_eq!(*step, Some(1), "rank {rank}");
        assert_eq!(w, &job.at_1[rank], "rank {rank} restored step 1 bit-exact");
    }
    assert_eq!(committed(&check, run), vec![1]);
    // With it: step 2 (step 3 is on machine 0's tier only), drained to the store first.
    let got = restart(&job, run, true);
    for (rank, (step, w)) in got.iter().enumerate() {
        assert_eq!(*step, Some(2), "rank {rank}");
        assert_eq!(w, &job.at_2[rank], "rank {rank} restored step 2 bit-exact");
    }
    assert_eq!(committed(&check, run), vec![1, 2]);
    // The step commits on the store only with both machines' rank manifests.
    assert_eq!(read_w(&check, run, 2), job.at_2[0]);
}

#[test]
fn a_step_whose_drain_fails_on_one_machine_is_not_agreed_and_every_rank_resumes_from_the_store() {
    let run = "agree-damaged";
    let job = killed_two_machine_job(run);
    let (check, _) = remote_view(&job.shared);
    // Damage a chunk of step 2 that the store does not hold, on the machine whose rank wrote
    // the tensor (the replicas' writer): that machine's drain fails, the other's does not.
    let rt = runtime();
    let (tier, dir, chunk) = job
        .tiers
        .iter()
        .find_map(|(tier, dir)| {
            let commits = rt.block_on(tier.log().read_node_commits(run, 2)).unwrap();
            let manifests = rt
                .block_on(tier.log().node_commit_manifests(&commits[0]))
                .unwrap();
            let chunk = manifests.iter().flat_map(|m| m.chunk_refs()).find(|c| {
                !rt.block_on(check.objects().exists(&check.keys().object_of(c)))
                    .unwrap()
            })?;
            Some((tier, dir, chunk.clone()))
        })
        .expect("step 2 has a chunk the store lacks");
    let file = dir.path().join(tier.keys().object_of(&chunk).as_ref());
    let mut b = std::fs::read(&file).unwrap();
    let n = b.len();
    b[n - 3] ^= 0x55;
    std::fs::write(&file, b).unwrap();
    let got = restart(&job, run, true);
    for (rank, (step, w)) in got.iter().enumerate() {
        assert_eq!(*step, Some(1), "rank {rank}");
        assert_eq!(w, &job.at_1[rank], "rank {rank} restored step 1 bit-exact");
    }
    assert_eq!(committed(&check, run), vec![1]);
}

#[test]
fn a_rank_fenced_before_the_agreement_fails_every_rank_rather_than_leaving_them_waiting() {
    let run = "agree-fenced";
    let job = killed_two_machine_job(run);
    // A newer job started on machine 1: its rank of this generation is fenced when it joins.
    runtime()
        .block_on(job.tiers[1].0.log().join_generation_as(run, 7, 1))
        .unwrap();
    let t = Instant::now();
    let got = restart_with(&job, run, true);
    assert!(
        t.elapsed() < Duration::from_secs(30),
        "the ranks waited for the fenced one: {:?}",
        t.elapsed()
    );
    for (rank, r) in got.iter().enumerate() {
        let e = r.as_ref().expect_err("every rank fails");
        assert_eq!(e.kind(), ckpt_store::ErrorKind::Fenced, "rank {rank}: {e}");
        assert!(e.to_string().contains("rank 1"), "rank {rank}: {e}");
    }
}
