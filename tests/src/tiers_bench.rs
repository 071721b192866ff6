//! `ckpt-bench tiers` (issue 28): a local tier under a slow remote store, against saving to
//! that store directly, with the machine's limits measured in the same run. Part of the
//! `ckpt-bench` binary (`#[path]` module): it uses the binary's helpers.
//!
//! The remote store is a directory behind a link of `--sink-mbps` MB/s for every put
//! (`FaultHandle::set_put_rate`: an object store behind a slow network); the local tier is a
//! local store (`O_DIRECT`) in `--dir`. The reference workload (2 ranks as threads, dp=2 with
//! ZeRO 1, `--params` parameters, 14 bytes each, half the layers frozen) saves:
//!
//! 1. **direct**: one checkpoint straight to the slow store: its time to durable;
//! 2. **tiered**: the same state to the local tier: time to local-durable (against the
//!    disk's `O_DIRECT` write of the stored bytes), the drain of the full step to the slow
//!    store (its throughput against the sink), then training steps and a second checkpoint
//!    while steps run, each step told to the managers (the persist governor paces the drain):
//!    its time to local-durable against the write of the bytes it wrote new, the drain of
//!    what changed (bytes sent over the stored bytes the local save wrote new) and the steps'
//!    slowdown while it drains (over steps with nothing running);
//! 3. **restore**: fresh ranks restore the newest step through the tiers (from the local
//!    tier): as threads of one process together (they share a chunk cache, so each chunk is
//!    read once, and hashed apart from its copy), against the `O_DIRECT` read of the stored
//!    bytes; then each rank alone, as a job's rank processes restore (the copy with the hash
//!    fused), against the read of the stored bytes each read: told that it is its machine's
//!    only rank process, and told that another one restores beside it (the replicated
//!    weights then go through the page cache for the other to find).
//!
//! 4. **machines**: each rank on a machine of its own (`node_ranks`), with its own tier and
//!    its own link of `--sink-mbps` to the remote store: each commits its rank in its tier
//!    (a node commit: local-durable), and drains it over its link; the drain that brings the
//!    last machine's part commits the step on the store. Time to each node commit, to the
//!    remote commit, and the drains' bytes and throughput against the links.
//!
//! The interval ratio is the direct time to durable over the tiered time to local-durable:
//! how much more often the job can checkpoint (local-durable) at the same stall.

use std::path::Path;
use std::time::{Duration, Instant};

use ckpt_store::{Layout, RetryConfig, Store, StoreConfig};
use ckpt_trainer::workload::RankState;
use ckpt_trainer::{
    CheckpointManager, CheckpointerConfig, LocalTier, ManagerConfig, SaveReport, SnapshotOverlap,
};
use serde_json::json;

use super::{
    bench_job, emit, fresh_ranks, gbps, median, odirect_read, odirect_write, step_time,
    touched_ranks,
};

const RUN: &str = "tiers";

/// What `ckpt-bench tiers` runs, beyond its size and sink.
#[derive(Debug, Clone, Copy, Default)]
pub struct TiersOptions {
    /// When each save's persist starts (`--snapshot-overlap auto|always|never`).
    pub overlap: SnapshotOverlap,
    /// Stop after the two saves and their drains (`--saves-only`): no restores, no machines.
    pub saves_only: bool,
}

/// The folders of `--dir` the bench writes (and deletes at its start and end).
const DIRS: [&str; 7] = [
    "tiers-scratch",
    "tiers-direct",
    "tiers-remote",
    "tiers-local",
    "tiers-machines-remote",
    "tiers-machines-local-0",
    "tiers-machines-local-1",
];

/// Delete the folders of `--dir` the bench writes.
fn remove_dirs(dir: &Path) {
    for d in DIRS {
        let _ = std::fs::remove_dir_all(dir.join(d));
    }
}

/// The slow remote store: a directory behind a link of `bytes_per_s` for every put.
fn slow_store(dir: &Path, bytes_per_s: u64) -> Store {
    std::fs::create_dir_all(dir).unwrap();
    let fs = ckpt_store::object_store::local::LocalFileSystem::new_with_prefix(dir).unwrap();
    let url = format!("file://{}", dir.display());
    let (store, faults) = ckpt_store::testing::faulty_store(
        fs,
        "",
        &url,
        StoreConfig::default(),
        RetryConfig::default(),
    );
    faults.set_put_rate(Some(bytes_per_s));
    store
}

fn managers(
    store: &Store,
    local: Option<&Store>,
    layout: Layout,
    ranks: &[RankState],
    overlap: SnapshotOverlap,
) -> Vec<CheckpointManager> {
    managers_on(store, local, layout, ranks, None, overlap)
}

/// [`managers`], told how many rank processes share their machine
/// ([`ManagerConfig::node_processes`]).
fn managers_on(
    store: &Store,
    local: Option<&Store>,
    layout: Layout,
    ranks: &[RankState],
    node_processes: Option<u32>,
    overlap: SnapshotOverlap,
) -> Vec<CheckpointManager> {
    ranks
        .iter()
        .map(|r| {
            let mut c = CheckpointerConfig::new(RUN, r.rank, layout);
            c.copy_threads = 1;
            c.commit_timeout = Duration::from_secs(1800);
            c.snapshot_overlap = overlap;
            let mut mc = ManagerConfig::new(c);
            mc.final_on_sigterm = false;
            // Saves are taken by `save_now`; `maybe_save` only tells the governor of steps.
            mc.every_steps = Some(u64::MAX);
            mc.local_tier = local.map(|l| LocalTier::new(l.clone()));
            mc.node_processes = node_processes;
            let mut m = CheckpointManager::new(store.clone(), mc).unwrap();
            r.register(&mut m).unwrap();
            let st = m.save_state().unwrap();
            m.checkpointer().prepare_staging(&st, true);
            m
        })
        .collect()
}

/// Rank `r` of `ranks` on a machine of its own: its tier `tiers[r]`, its link `links[r]` to the
/// remote store, and itself as its machine's committer (`node_ranks`).
fn machine_managers(
    links: &[Store],
    tiers: &[Store],
    layout: Layout,
    ranks: &[RankState],
) -> Vec<CheckpointManager> {
    ranks
        .iter()
        .map(|r| {
            let i = r.rank as usize;
            let mut c = CheckpointerConfig::new(RUN, r.rank, layout);
            c.copy_threads = 1;
            c.commit_timeout = Duration::from_secs(1800);
            c.committer = true;
            c.node_ranks = Some(vec![r.rank]);
            let mut mc = ManagerConfig::new(c);
            mc.final_on_sigterm = false;
            mc.every_steps = Some(u64::MAX);
            mc.local_tier = Some(LocalTier::new(tiers[i].clone()));
            mc.node_processes = Some(1);
            let mut m = CheckpointManager::new(links[i].clone(), mc).unwrap();
            r.register(&mut m).unwrap();
            let st = m.save_state().unwrap();
            m.checkpointer().prepare_staging(&st, true);
            m
        })
        .collect()
}

/// Part 4 (see the module docs): one checkpoint of `ranks`, each on a machine of its own.
fn machines(dir: &Path, layout: Layout, ranks: &[RankState], rate: u64, sink_mbps: f64) {
    let remote = dir.join("tiers-machines-remote");
    let links: Vec<Store> = ranks.iter().map(|_| slow_store(&remote, rate)).collect();
    let tiers: Vec<Store> = (0..ranks.len())
        .map(|i| {
            let d = dir.join(format!("tiers-machines-local-{i}"));
            ckpt_store::open_with(d.to_str().unwrap(), &super::open_options()).unwrap()
        })
        .collect();
    let mut mgrs = machine_managers(&links, &tiers, layout, ranks);
    let t = Instant::now();
    let hs: Vec<_> = mgrs.iter_mut().map(|m| m.save_now(1).unwrap()).collect();
    // Each machine's node commit in its tier (both run at once: each time is from the start).
    let mut node_committed = Vec::new();
    let mut written = Vec::new();
    for h in &hs {
        let r = h.wait_committed(Duration::from_secs(1800)).unwrap();
        node_committed.push(t.elapsed().as_secs_f64());
        written.push(r.bytes_written);
    }
    // The remote commit: made by the drain that brings the last machine's part.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let commit = links[0].keys().commit(RUN, 1);
    let mut drains: Vec<Vec<ckpt_recovery::records::DrainMetrics>> = vec![Vec::new(); mgrs.len()];
    let remote_durable = loop {
        for (m, d) in mgrs.iter_mut().zip(&mut drains) {
            d.extend(m.take_drain_figures());
        }
        if rt.block_on(links[0].objects().exists(&commit)).unwrap() {
            break t.elapsed().as_secs_f64();
        }
        assert!(
            t.elapsed() < Duration::from_secs(3600),
            "step 1 never committed on the store"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    for (m, d) in mgrs.iter_mut().zip(&mut drains) {
        m.finish().unwrap();
        d.extend(m.take_drain_figures());
    }
    let sent: Vec<u64> = drains
        .iter()
        .map(|d| d.iter().map(|f| f.bytes_sent).sum())
        .collect();
    let secs: Vec<f64> = drains
        .iter()
        .map(|d| d.iter().map(|f| f.seconds).sum())
        .collect();
    let of_link: Vec<f64> = sent
        .iter()
        .zip(&secs)
        .map(|(&b, &s)| gbps(b, s) / (sink_mbps / 1e3))
        .collect();
    let total: u64 = sent.iter().sum();
    let slowest_node = node_committed.iter().copied().fold(0.0, f64::max);
    emit(json!({"bench": "tiers_machines", "machines": mgrs.len(),
        "node_committed_s": node_committed, "stored_bytes": written,
        "remote_durable_s": remote_durable, "drain_bytes_sent": sent, "drain_s": secs,
        "drain_of_link": of_link, "links_gbps": sink_mbps / 1e3 * mgrs.len() as f64,
        "bytes_sent_over_one_link_s": total as f64 / (rate as f64),
        "remote_after_local_s": remote_durable - slowest_node}));
    drop(mgrs);
}

/// Wait until the file system of `dir` has written what it holds dirty and issued the
/// discards of what was deleted (`syncfs`): a save measured against the disk's limit then
/// has the disk to itself, as the limit had.
fn settle(dir: &Path) {
    use std::os::fd::AsRawFd;
    let d = std::fs::File::open(dir).unwrap();
    // SAFETY: syncfs on a descriptor `d` owns.
    let r = unsafe { libc::syncfs(d.as_raw_fd()) };
    assert_eq!(
        r,
        0,
        "syncfs {}: {}",
        dir.display(),
        std::io::Error::last_os_error()
    );
}

/// The counters of the block device that holds `dir` (`/proc/diskstats`): sectors written,
/// and milliseconds during which it had a request in flight (`io_ticks`). `None` where the
/// file system is on no device listed there (tmpfs, overlay).
fn disk_counters(dir: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let dev = std::fs::metadata(dir).ok()?.dev();
    let (major, minor) = (libc::major(dev).to_string(), libc::minor(dev).to_string());
    let text = std::fs::read_to_string("/proc/diskstats").ok()?;
    text.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        if f.len() < 13 || f[0] != major || f[1] != minor {
            return None;
        }
        Some((f[9].parse().ok()?, f[12].parse().ok()?))
    })
}

/// One checkpoint of every rank: (stall, time to committed in the store saves go to, stored
/// bytes written new by all ranks). `disk`: a directory on the disk the save writes to; its
/// device's counters say how busy the disk was over the save and what it wrote (everything
/// this machine wrote to it meanwhile, the save's objects among them).
fn save(mgrs: &mut [CheckpointManager], step: u64, disk: &Path) -> (f64, f64, u64) {
    let cpu = ckpt_tests::restore_bench::cpu_seconds();
    let before = disk_counters(disk);
    let t = Instant::now();
    let hs: Vec<_> = mgrs.iter_mut().map(|m| m.save_now(step).unwrap()).collect();
    for h in &hs {
        h.wait_snapshot().unwrap();
    }
    let stall = t.elapsed().as_secs_f64();
    let reports: Vec<SaveReport> = hs.iter().map(|h| h.wait_persisted().unwrap()).collect();
    let committed = hs[0].wait_committed(Duration::from_secs(1800)).unwrap();
    let durable = t.elapsed().as_secs_f64();
    let after = disk_counters(disk);
    // The disk over the save: the share of the time it had a request in flight, and its
    // write rate (GB/s).
    let (disk_busy, disk_gbps) = match (before, after) {
        (Some((w0, b0)), Some((w1, b1))) => (
            json!((b1 - b0) as f64 / 1e3 / durable),
            json!(gbps((w1 - w0) * 512, durable)),
        ),
        _ => (json!(null), json!(null)),
    };
    // How busy the machine's cores were, by this process (the ranks, and what else runs in it).
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let cpu_busy = (ckpt_tests::restore_bench::cpu_seconds() - cpu) / (durable * cores);
    let written = reports.iter().map(|r| r.bytes_written).sum();
    emit(json!({"bench": "tiers_save_phases", "step": step,
        "snapshot_s": reports.iter().map(|r| r.snapshot_s).collect::<Vec<_>>(),
        "persist_s": reports.iter().map(|r| r.persist_s).collect::<Vec<_>>(),
        "stored_bytes": reports.iter().map(|r| r.bytes_written).collect::<Vec<_>>(),
        "snapshot_bytes": reports.iter().map(|r| r.bytes - r.bytes_reused).collect::<Vec<_>>(),
        "checked_bytes": reports.iter().map(|r| r.bytes_checked).collect::<Vec<_>>(),
        "commit_s": committed.commit_s, "durable_s": durable, "cpu_busy": cpu_busy,
        "disk_busy": disk_busy, "disk_write_gbps": disk_gbps}));
    (stall, durable, written)
}

/// One training step of every rank, each manager told first (the persist governor paces the
/// drain by the steps' times).
fn governed_step(mgrs: &mut [CheckpointManager], ranks: &[RankState], s: u64) -> f64 {
    for m in mgrs.iter_mut() {
        assert!(m.maybe_save(s).unwrap().is_none());
    }
    step_time(ranks, s)
}

/// Wait until rank 0's drainer reported the drain of `step`; its figures.
fn drained(m: &mut CheckpointManager, step: u64) -> ckpt_recovery::records::DrainMetrics {
    let t = Instant::now();
    loop {
        if let Some(f) = m.take_drain_figures().into_iter().find(|f| f.step == step) {
            return f;
        }
        assert!(
            t.elapsed() < Duration::from_secs(3600),
            "step {step} never drained"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `ckpt-bench tiers --dir DIR --params P --sink-mbps M`.
pub fn tiers_bench(dir: &Path, params: u64, sink_mbps: f64, opts: TiersOptions) {
    let overlap = opts.overlap;
    let layout = Layout::new(2, 1, 1, 1).unwrap();
    let rate = (sink_mbps * 1e6) as u64;
    // What an interrupted run left.
    remove_dirs(dir);
    // The disk's limits, in the same run, on a quiet disk.
    settle(dir);
    let limit = dir.join("tiers-limit.bin");
    let write_gbps = odirect_write(&limit, 1 << 30, 8, 4 << 20);
    let read_gbps = odirect_read(&limit, 8, 4 << 20);
    // The time the disk's O_DIRECT write of `bytes` takes at the limit of this run.
    let write_limit_s = |bytes: u64| bytes as f64 / (write_gbps * 1e9);
    let _ = std::fs::remove_file(&limit);

    // 1. Direct to the slow store.
    // Half the layers frozen (as in fine-tuning): the second checkpoint changes half the state.
    let (model, train, _, _, _) = bench_job(dir, "tiers-scratch", params, layout, 7);
    let train = ckpt_trainer::workload::TrainConfig {
        frozen: 0.5,
        ..train
    };
    let ranks = fresh_ranks(model, train, layout);
    let state: u64 = ranks.iter().map(|r| r.held_bytes()).sum();
    let direct = slow_store(&dir.join("tiers-direct"), rate);
    let mut mgrs = managers(&direct, None, layout, &ranks, overlap);
    step_time(&ranks, 1);
    let (direct_stall, direct_durable, direct_written) = save(&mut mgrs, 1, dir);
    drop(mgrs);
    emit(
        json!({"bench": "tiers_direct", "state_bytes": state, "stall_s": direct_stall,
        "durable_s": direct_durable, "stored_bytes": direct_written,
        "sink_gbps": sink_mbps / 1e3, "of_sink": gbps(direct_written, direct_durable) / (sink_mbps / 1e3)}),
    );

    // 2. Tiered: the local tier under another slow store of the same speed. The direct save
    // left its objects in the page cache (the slow store is a buffered directory on this
    // disk); they go to the disk first, as a remote store's bytes would never share it.
    settle(dir);
    let remote = slow_store(&dir.join("tiers-remote"), rate);
    let local_dir = dir.join("tiers-local");
    let _ = std::fs::remove_dir_all(&local_dir);
    let local = ckpt_store::open_with(local_dir.to_str().unwrap(), &super::open_options()).unwrap();
    let mut mgrs = managers(&remote, Some(&local), layout, &ranks, overlap);
    let (stall, local_durable, written) = save(&mut mgrs, 1, dir);
    let first = drained(&mut mgrs[0], 1);
    let local_limit_s = write_limit_s(written);
    emit(
        json!({"bench": "tiers_first", "stall_s": stall, "local_durable_s": local_durable,
        "stored_bytes": written, "disk_odirect_write_gbps": write_gbps,
        "local_durable_x_write_limit": local_durable / local_limit_s,
        "drain_s": first.seconds, "drain_bytes_sent": first.bytes_sent,
        "drain_gbps": gbps(first.bytes_sent, first.seconds),
        "drain_of_sink": gbps(first.bytes_sent, first.seconds) / (sink_mbps / 1e3),
        "remote_durable_s": local_durable + first.lag_s,
        "interval_ratio": direct_durable / local_durable}),
    );

    // Training steps, then the next checkpoint while steps run: what drains, and what the
    // steps pay while it does. The governor paces a drain only once it has the baseline of
    // a job's steps with nothing running (`MIN_BASELINE` clean intervals: the first step's
    // interval starts at its own `maybe_save`, so one step more).
    let quiet: Vec<f64> = (0..=ckpt_trainer::governor::MIN_BASELINE as u64 + 1)
        .map(|i| governed_step(&mut mgrs, &ranks, 10 + i))
        .collect();
    let (stall2, local_durable2, written2) = save(&mut mgrs, 2, dir);
    let t = Instant::now();
    let mut busy = Vec::new();
    let mut s = 20;
    let second = loop {
        busy.push(governed_step(&mut mgrs, &ranks, s));
        s += 1;
        if let Some(f) = mgrs[0]
            .take_drain_figures()
            .into_iter()
            .find(|f| f.step == 2)
        {
            break f;
        }
        assert!(
            t.elapsed() < Duration::from_secs(3600),
            "step 2 never drained"
        );
    };
    let after: Vec<f64> = (0..3)
        .map(|i| governed_step(&mut mgrs, &ranks, 1000 + i))
        .collect();
    for m in &mut mgrs {
        m.finish().unwrap();
    }
    let quiet_s = median(quiet.into_iter().chain(after).collect());
    // What the governor did: every `persist_rate` event of the tiered run (the saves' persists
    // and the drains; in these runs, rank 0's are the drain of step 2).
    let logged = |kind: &str| -> Vec<serde_json::Value> {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(ckpt_store::logs::read_log(
            &remote,
            RUN,
            ckpt_store::logs::EVENTS,
        ))
        .unwrap_or_default()
        .into_iter()
        .filter(|r| r["kind"] == kind)
        .collect()
    };
    let rates: Vec<serde_json::Value> = logged("persist_rate")
        .into_iter()
        .map(|r| json!({"rank": r["rank"], "to_bps": r["to_bps"], "slowdown": r["slowdown"]}))
        .collect();
    emit(json!({"bench": "tiers_incremental", "stall_s": stall2,
        "local_durable_s": local_durable2, "stored_bytes_new": written2,
        // The second save, as every save after a job's first: the tier holds the step before.
        "local_durable_x_write_limit": local_durable2 / write_limit_s(written2),
        "drain_s": second.seconds, "drain_bytes_sent": second.bytes_sent,
        "drain_bytes_present": second.bytes_present,
        "sent_over_changed": second.bytes_sent as f64 / written2.max(1) as f64,
        "steps_while_draining": busy.len(), "step_s_quiet": quiet_s,
        "step_s_draining": median(busy.clone()),
        "slowdown": median(busy) / quiet_s, "rate_changes": rates}));
    drop(mgrs);
    if opts.saves_only {
        remove_dirs(dir);
        return;
    }

    // 3. A restart after a process crash: fresh ranks restore through the tiers. As threads
    // of one process they share a chunk cache, and no other process reads what they read
    // (`node_processes` 1, as `ckpt-train` sets it for ranks as threads).
    let fresh = touched_ranks(model, train, layout);
    let mut mgrs = managers_on(&remote, Some(&local), layout, &fresh, Some(1), overlap);
    let t = Instant::now();
    std::thread::scope(|sc| {
        for m in mgrs.iter_mut() {
            sc.spawn(move || assert_eq!(m.restore_latest().unwrap(), Some(2)));
        }
    });
    let restore_s = t.elapsed().as_secs_f64();
    let read_limit_s = written as f64 / (read_gbps * 1e9);
    emit(
        json!({"bench": "tiers_restore", "ranks": "threads of one process, together",
        "node_processes": 1,
        "restore_s": restore_s, "stored_bytes": written,
        "disk_odirect_read_gbps": read_gbps, "restore_x_read_limit": restore_s / read_limit_s,
        "page_cache": "none of it: the tier writes with O_DIRECT"}),
    );
    drop(mgrs);

    // 3b. As a job runs its ranks (`ckpt resume`, torchrun: a process each), each rank
    // restores alone, one after the other, against the read of the stored bytes it read
    // (its restore record's `bytes_from_local`; the replicated weights are read by both),
    // each from a cold page cache where the bench may drop it (root). Twice: told that it is
    // its machine's only rank process (`node_processes` 1: everything around the page
    // cache), and told that another rank process of the machine restores too (2: the
    // replicated weights through the page cache, for the other to find there; here no other
    // comes, so this is what the sharing costs a rank alone).
    for node_processes in [1, 2] {
        let before = logged("restore").len();
        let mut alone = Vec::new();
        let mut cold = true;
        for r in 0..ranks.len() {
            let fresh = touched_ranks(model, train, layout);
            let mut m = managers_on(
                &remote,
                Some(&local),
                layout,
                &fresh[r..=r],
                Some(node_processes),
                overlap,
            );
            cold &= ckpt_tests::restore_bench::drop_caches();
            let t = Instant::now();
            assert_eq!(m[0].restore_latest().unwrap(), Some(2));
            alone.push(t.elapsed().as_secs_f64());
            drop(m);
        }
        let records = logged("restore");
        let read: Vec<u64> = records[before..]
            .iter()
            .map(|r| r["bytes_from_local"].as_u64().unwrap_or(0))
            .collect();
        let from_local = records[before..].iter().all(|r| r["tier"] == "local");
        let alone_s: f64 = alone.iter().sum();
        let read_bytes: u64 = read.iter().sum();
        let alone_limit_s = read_bytes as f64 / (read_gbps * 1e9);
        emit(
            json!({"bench": "tiers_restore", "ranks": "a rank per process, one after the other",
            "node_processes": node_processes,
            "restore_s": alone, "restore_total_s": alone_s, "stored_bytes_read": read,
            "all_from_local": from_local, "disk_odirect_read_gbps": read_gbps,
            "page_cache_dropped": cold,
            "restore_x_read_limit": alone_s / alone_limit_s}),
        );
    }

    // 4. Each rank on a machine of its own, with its own tier and its own link.
    machines(
        dir,
        layout,
        &touched_ranks(model, train, layout),
        rate,
        sink_mbps,
    );
    remove_dirs(dir);
}
