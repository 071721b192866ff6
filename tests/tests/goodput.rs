//! The goodput soak, short (issue 19 §3): the reference workload under the real `ckpt resume`
//! (4 nodes, 2 spares, repaired nodes back), a failure-free baseline and every policy (the
//! tiered one included: a local tier drained to the store behind) with a
//! failure about every 15 s (ranks killed and hung, nodes lost, the newest step damaged). Each
//! policy must end bit-identical to an uninterrupted run, with every injected failure detected
//! (its record in the recovery log) and recovered from, no committed step lost, every step
//! left committed intact, and no process of the run left behind. Goodput is printed, not
//! asserted (BENCHMARKS.md measures it).

use std::time::Duration;

use ckpt_tests::goodput::{Options, Policy, run};

#[test]
#[allow(
    clippy::disallowed_methods,
    reason = "a test reads its knobs from the environment"
)]
fn every_injected_failure_is_detected_and_recovered_and_the_state_is_bit_identical() {
    let seed: u64 = std::env::var("CKPT_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| ckpt_store::clock::system_now().timestamp_micros() as u64 % 1_000_000);
    eprintln!("goodput seed {seed} (replay with CKPT_TEST_SEED={seed})");
    let mut dir = tempfile::tempdir().unwrap();
    if std::env::var_os("CKPT_TEST_KEEP").is_some() {
        eprintln!("keeping {}", dir.path().display());
        dir.disable_cleanup(true);
    }
    // About 30 s failure-free: 300 steps of 100 ms.
    let mut o = Options::new(dir.path(), 300, 100, Duration::from_secs(15), seed);
    o.params = "200K".into();
    o.every = 20;
    o.auto_max = 40;
    o.repair = Duration::from_secs(5);
    // Gaps of at most 25 s, so every policy's run of 30 s or more sees a failure.
    o.max_gap = Some(Duration::from_secs(25));
    o.policies = Policy::ALL.to_vec();
    o.plot = false;
    o.timeout = Duration::from_secs(240);
    let results = run(&o, |r| eprintln!("{}", r.json(seed))).expect("the soak ran");
    assert_eq!(results.len(), Policy::ALL.len());
    for r in &results {
        let what = format!(
            "policy {} (seed {seed}; logs in {})",
            r.policy.name(),
            r.dir.display()
        );
        if !(r.ok && r.digest_equal && r.injections.iter().all(|i| i.detected && i.recovered)) {
            // The temporary folder goes with the test: what CI shows is what is printed.
            print_logs(&r.dir);
        }
        assert!(r.ok, "{what}: the job did not complete: {}", r.reason);
        assert!(
            r.digest_equal,
            "{what}: final digest {:?} differs from the uninterrupted run's",
            r.digest
        );
        for i in &r.injections {
            assert!(i.detected, "{what}: not detected: {i:?}");
            assert!(i.recovered, "{what}: not recovered from: {i:?}");
        }
        assert!(
            r.committed_lost.is_empty(),
            "{what}: committed steps lost: {:?}",
            r.committed_lost
        );
        assert!(r.verify_clean, "{what}: a committed step does not verify");
        assert!(
            r.leftover.is_empty(),
            "{what}: processes left: {:?}",
            r.leftover
        );
        if r.policy == Policy::Baseline {
            assert!(r.injections.is_empty());
            assert_eq!(r.restarts, 0, "{what}: the failure-free run restarted");
        } else {
            // A failure every ~15 s over a run of 30 s or more: at least one landed (the
            // schedule is the same for every policy).
            assert!(!r.injections.is_empty(), "{what}: no failure injected");
            assert!(r.restarts >= 1, "{what}");
            if r.policy == Policy::Tiered {
                tiered_restores_read_the_tier_first(r, &what);
            }
            if matches!(r.policy, Policy::StoreFixed | Policy::Tiered) {
                assert_eq!(
                    r.bytes_from_peers, 0,
                    "{what}: no agents, yet bytes from peers"
                );
            }
        }
    }
}

/// Restores read the local tier first, the store only for what the tier lacks. A restore of a
/// step whose local copy a damaged disk lost an object of may read everything from the store
/// (a small state's step can be one pack object); that it read the lost chunks there, and said
/// so, is its injection's detection (a `local_tier_damaged` event of the step). Any other
/// restore that read stored bytes at all (a failure before the first checkpoint restores
/// nothing) read some from the tier.
fn tiered_restores_read_the_tier_first(r: &ckpt_tests::goodput::PolicyResult, what: &str) {
    let damaged: Vec<u64> = r.injections.iter().filter_map(|i| i.damaged_step).collect();
    for rec in &r.restores {
        let b = |k: &str| rec[k].as_u64().unwrap_or(0);
        let step = rec["step"]
            .as_u64()
            .expect("a restore record names its step");
        if !damaged.contains(&step) && b("bytes_from_store") + b("bytes_from_local") > 0 {
            assert!(
                b("bytes_from_local") > 0,
                "{what}: the restore of step {step} (intact on the local tier) read {} B from \
                 the store and nothing from the tier: {rec}",
                b("bytes_from_store")
            );
        }
    }
}

/// The last lines of a failed policy's logs: the supervisor's, and the newest generations'
/// ranks' and every agent's.
fn print_logs(dir: &std::path::Path) {
    fn tail(path: &std::path::Path, n: usize) {
        let Ok(text) = std::fs::read_to_string(path) else {
            return;
        };
        let lines: Vec<&str> = text.lines().collect();
        eprintln!(
            "----- {} (last {n} of {} lines)",
            path.display(),
            lines.len()
        );
        for l in &lines[lines.len().saturating_sub(n)..] {
            eprintln!("{l}");
        }
    }
    tail(&dir.join("resume.err"), 80);
    let mut logs: Vec<_> = std::fs::read_dir(dir.join("logs"))
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    logs.sort_by_key(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok());
    let (agents, ranks): (Vec<_>, Vec<_>) = logs.into_iter().partition(|p| {
        p.file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("agent"))
    });
    for p in ranks.iter().rev().take(6) {
        tail(p, 25);
    }
    for p in &agents {
        tail(p, 15);
    }
}
