//! The request-counting simulation at 256 ranks (issue 17.1): the goal properties, asserted so
//! that a regression fails, and the counts checked against the real S3 server on loopback.
//! `ckpt-bench scale --ranks 4096` prints the same figures at full scale.

use ckpt_tests::scale::{ScaleConfig, simulate_in_memory, simulate_on_s3};
use serde_json::Value;

fn phase<'a>(lines: &'a [Value], name: &str) -> &'a Value {
    lines
        .iter()
        .find(|l| l["phase"] == name)
        .unwrap_or_else(|| panic!("no {name} phase in {lines:?}"))
}

fn kind(tally: &Value, k: &str) -> u64 {
    tally["by_kind"][k].as_u64().unwrap_or(0)
}

#[test]
fn two_hundred_fifty_six_ranks_commit_list_and_find_the_newest_step_within_their_request_budgets() {
    let ranks = 256u64;
    let mut cfg = ScaleConfig::new(ranks as u32);
    cfg.restore_ranks = 8;
    let lines = simulate_in_memory(&cfg, &mut |_| {}).expect("simulation");

    for name in ["save_full", "save_incremental"] {
        let save = phase(&lines, name);
        let t = &save["tally"];
        let c = &save["commit"];
        // The committer reads each manifest once (plus listings, the generation checks, the
        // create, the parts of the split record, and the polls under way when the last
        // manifest landed: a listing, one manifest and a fence check each): O(ranks), never
        // every manifest again per poll.
        let parts = c["record_parts"].as_u64().unwrap();
        let after = c["committer_requests_after_manifests"].as_u64().unwrap();
        assert!(
            after <= ranks + parts + 12,
            "{name}: committer made {after} requests: {c}"
        );
        // After the manifests, the commit's sequence is O(1) beyond reading the manifests
        // (32 at a time): the record's parts go in one wave (64 at a time), then the root.
        let without = c["critical_path_without_manifest_reads"].as_u64().unwrap();
        assert!(without <= 7, "{name}: commit critical path {without}: {c}");
        // No per-chunk HEAD for deduplication: at most one head per rank (its base's COMMIT).
        assert!(kind(t, "head") <= ranks, "{name}: {t}");
        // Chunks and packs: one pack per rank at this size, never one object per shard.
        let objects = save["objects_written"].as_u64().unwrap();
        assert!(objects <= 2 * ranks, "{name}: {objects} objects written");
        // The writer-lease and generation protocol: a handful of requests a rank (lease put,
        // one page of sweep locks, lease delete, the generation checks), whatever the world.
        let protocol = save["lease_and_generation_requests"].as_u64().unwrap();
        assert!(
            protocol <= 6 * ranks + 8,
            "{name}: {protocol} protocol requests"
        );
        // No prefix is hot: the ranks' writes (lease, chunks and packs, manifest) spread over
        // 256 prefixes and their fence checks over 16, so the busiest prefix's second here,
        // 16 times over (what 4,096 ranks would make of requests made once a rank), stays
        // under S3's per-prefix rates. One prefix per step for the manifests (256 writes in
        // one second here), or every rank listing `generations/` twice, would not. (A writer
        // lists `locks/` with a delimiter: one page a rank whatever the world; a listing of
        // all of `locks/` would be one page here but five a rank at 4,096, which this
        // extrapolation would not see; BENCHMARKS.md.)
        let scale = 4096 / ranks;
        let writes = t["hottest_write_prefix"][1].as_u64().unwrap();
        let reads = t["hottest_read_prefix"][1].as_u64().unwrap();
        assert!(
            writes * scale <= 3500,
            "{name}: hottest write prefix {}: {t}",
            t["hottest_write_prefix"]
        );
        assert!(
            reads * scale <= 5500,
            "{name}: hottest read prefix {}: {t}",
            t["hottest_read_prefix"]
        );
        // Nothing hit the S3 rate limits at this size.
        assert_eq!(t["throttled"], 0, "{name}: {t}");
    }

    let latest = phase(&lines, "latest");
    assert_eq!(latest["found"], 2);
    assert!(
        latest["tally"]["requests"].as_u64().unwrap() <= 2,
        "{latest}"
    );

    let ls = phase(&lines, "ls");
    assert!(ls["list_pages"].as_u64().unwrap() <= 1, "{ls}");

    let restore = phase(&lines, "restore");
    assert!(restore["bytes"].as_u64().unwrap() > 0);
    // The commit record is split (format 5), and a restoring rank reads its root and the parts
    // of its own tensors (a quarter of them here: pp 4), not the whole record, which grows
    // with the world.
    let c = &phase(&lines, "save_incremental")["commit"];
    assert!(c["record_parts"].as_u64().unwrap() > 1, "{c}");
    let whole = c["record_bytes"].as_u64().unwrap();
    let read = restore["record_bytes_per_rank_max"].as_u64().unwrap();
    assert!(
        read > 0 && read * 2 < whole,
        "a restoring rank read {read} bytes of a {whole}-byte record: {restore}"
    );
    assert_eq!(restore["tally"]["throttled"], 0, "{restore}");

    let gc = phase(&lines, "gc");
    assert_eq!(gc["steps_deleted"], 1, "{gc}");
}

/// The simulation's counts are the real client's: the same code over the S3 server on
/// loopback (counted above the S3 client, real time) makes the same requests as over the
/// in-memory store, phase by phase; only the committer's number of polls may differ (it polls
/// until the last manifest lands, which depends on timing).
#[test]
fn the_counts_over_the_real_s3_server_equal_the_simulations() {
    ckpt_store::require!(ckpt_store::testing::Need::S3Server);
    let mut cfg = ScaleConfig::new(256);
    cfg.restore_ranks = 16;
    cfg.limits = false;
    cfg.latency = std::time::Duration::ZERO;
    let sim = simulate_in_memory(&cfg, &mut |_| {}).expect("in-memory simulation");
    let s3 = simulate_on_s3(&cfg, &mut |_| {}).expect("simulation over S3");
    for name in ["latest", "ls", "restore", "gc"] {
        assert_eq!(
            phase(&sim, name)["tally"]["by_kind"],
            phase(&s3, name)["tally"]["by_kind"],
            "{name}: in memory vs. S3"
        );
    }
    for name in ["save_full", "save_incremental"] {
        let (a, b) = (&phase(&sim, name)["tally"], &phase(&s3, name)["tally"]);
        // Every write is the same; reads differ only by the committer's polls.
        for k in ["put", "put_create", "delete", "multipart_part"] {
            assert_eq!(a["by_kind"][k], b["by_kind"][k], "{name} {k}: {a} vs. {b}");
        }
        for k in ["get", "list_page", "head"] {
            let (x, y) = (kind(a, k), kind(b, k));
            assert!(
                x.abs_diff(y) <= 64,
                "{name} {k}: {x} in memory vs. {y} over S3"
            );
        }
    }
}
