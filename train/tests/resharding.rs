//! Save under one layout, resume under another: the final state is bit-identical to an
//! uninterrupted run's (the digest of the consolidated state), with all ranks as threads and
//! with one process per rank.

mod common;
use common::*;

/// Train 8 steps uninterrupted under `a`; then 4 steps under `a` and the rest under `b`.
fn reshard(a: &str, b: &str, procs: bool) {
    let dir = tempfile::tempdir().unwrap();
    let base = train(
        dir.path(),
        "base",
        &["--layout", "dp=1", "--steps", "8", "--ckpt-every", "4"],
    );
    let wa = a.parse::<ckpt_store::Layout>().unwrap().world();
    let wb = b.parse::<ckpt_store::Layout>().unwrap().world();
    let first = ["--layout", a, "--steps", "4", "--ckpt-every", "2"];
    let second = [
        "--layout",
        b,
        "--steps",
        "8",
        "--ckpt-every",
        "2",
        "--resume",
    ];
    let d = if procs {
        train_procs(dir.path(), "r", wa, &first);
        train_procs(dir.path(), "r", wb, &second)
    } else {
        train(dir.path(), "r", &first);
        train(dir.path(), "r", &second)
    };
    assert_eq!(
        d, base,
        "{a} -> {b} (processes: {procs}) diverged from the uninterrupted run"
    );
}

#[test]
fn world_size_up_and_down() {
    reshard("dp=2", "dp=4", false);
    reshard("dp=4,tp=2", "dp=1", false);
}

#[test]
fn tensor_parallel_2_to_1_and_1_to_2() {
    reshard("tp=2", "tp=1", false);
    reshard("tp=1,dp=2", "tp=2", false);
}

#[test]
fn pipeline_2_to_1() {
    reshard("pp=2,tp=2", "pp=1", false);
}

#[test]
fn zero_1_to_zero_3_uneven() {
    // dp=3 and dp=5 do not divide the flat groups: uneven partitions on both sides.
    reshard("dp=3,zero=1", "dp=5,zero=3", false);
}

#[test]
fn dp4_to_dp3() {
    reshard("dp=4", "dp=3", false);
}

#[test]
fn separate_processes_per_rank() {
    reshard("dp=2,tp=2,zero=1", "dp=3,zero=3", true);
    reshard("pp=2", "tp=2", true);
}
