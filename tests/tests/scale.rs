//! The request-counting simulation at 64 ranks (issue 17.1): the goal properties that hold
//! today, asserted so that a regression fails. `ckpt-bench scale --ranks 4096` prints the
//! same figures at full scale.

use ckpt_tests::scale::{ScaleConfig, simulate_in_memory};
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
fn sixty_four_ranks_commit_list_and_find_the_newest_step_within_their_request_budgets() {
    let ranks = 64u64;
    let mut cfg = ScaleConfig::new(ranks as u32);
    cfg.restore_ranks = 8;
    let lines = simulate_in_memory(&cfg, &mut |_| {}).expect("simulation");

    for name in ["save_full", "save_incremental"] {
        let save = phase(&lines, name);
        let t = &save["tally"];
        let c = &save["commit"];
        // The committer reads each manifest once (plus listings, the generation checks, the
        // create, and the polls under way when the last manifest landed: a listing, one
        // manifest and a fence check each): O(ranks), never every manifest again per poll.
        let after = c["committer_requests_after_manifests"].as_u64().unwrap();
        assert!(
            after <= ranks + 12,
            "{name}: committer made {after} requests: {c}"
        );
        // After the manifests, the commit's sequence is O(1) beyond reading the manifests
        // (32 at a time).
        let without = c["critical_path_without_manifest_reads"].as_u64().unwrap();
        assert!(without <= 6, "{name}: commit critical path {without}: {c}");
        // No per-chunk HEAD for deduplication: at most one head per rank (its base's COMMIT).
        assert!(kind(t, "head") <= ranks, "{name}: {t}");
        // Chunks and packs: one pack per rank at this size, never one object per shard.
        let objects = save["objects_written"].as_u64().unwrap();
        assert!(objects <= 2 * ranks, "{name}: {objects} objects written");
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
    assert_eq!(restore["tally"]["throttled"], 0, "{restore}");

    let gc = phase(&lines, "gc");
    assert_eq!(gc["steps_deleted"], 1, "{gc}");
}
