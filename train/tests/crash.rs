//! Crashes with real processes and real SIGKILL: a rank killed in the middle of a save never
//! leaves a half-written checkpoint visible; the previous one stays newest and restores.

mod common;
use common::*;

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::{Duration, Instant};

use ckpt_store::{ErrorKind, StepReader, VerifyScope};
use ckpt_trainer::runtime;

fn sigkill(pid: u32) {
    // SAFETY: plain libc call on a child we spawned.
    unsafe {
        libc::kill(pid as i32, libc::SIGKILL);
    }
}

#[test]
fn rank_killed_mid_save_leaves_previous_checkpoint_newest() {
    let dir = tempfile::tempdir().unwrap();
    let store_path = dir.path().join("store");
    let args = ["--layout", "dp=2", "--steps", "8", "--ckpt-every", "2"];
    // Rank 1 stops inside its second save (step 4), after its chunks and before its
    // manifest; the test kills it there from outside with SIGKILL.
    let mut r0 = cmd(&store_path, "crash", &args);
    r0.args(["--rank", "0"]);
    let mut r0 = r0.spawn().unwrap();
    let mut r1 = cmd(&store_path, "crash", &args);
    r1.args(["--rank", "1"])
        .env("CKPT_FAILPOINTS", "after_chunks=sleep(60000)@2")
        .stderr(Stdio::piped());
    let mut r1 = r1.spawn().unwrap();
    let err = BufReader::new(r1.stderr.take().unwrap());
    let t0 = Instant::now();
    for line in err.lines() {
        let line = line.unwrap();
        if line.contains("ckpt failpoint after_chunks: sleeping") {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "rank 1 never reached the failpoint"
        );
    }
    sigkill(r1.id());
    let st = r1.wait().unwrap();
    assert!(!st.success());
    // Rank 0 would wait for rank 1's manifest of step 4 forever: the job is dead; kill it too.
    std::thread::sleep(Duration::from_millis(300));
    sigkill(r0.id());
    r0.wait().unwrap();

    let store = ckpt_store::open(store_path.to_str().unwrap()).unwrap();
    runtime().block_on(async {
        assert_eq!(store.log().committed_steps("crash").await.unwrap(), vec![2]);
        let steps = store.log().list_steps("crash").await.unwrap();
        let s4 = steps
            .iter()
            .find(|s| s.step == 4)
            .expect("step 4 was started");
        assert!(!s4.committed);
        assert!(!s4.ranks.contains(&1), "the killed rank wrote no manifest");
        let e = StepReader::open(&store, "crash", 4).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotFound);
        // Committing it now is refused: rank 1 is missing.
        let e = store.log().commit_step("crash", 4).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Incomplete);
        // What is committed is intact.
        assert!(
            store
                .verify(&VerifyScope::Store, None)
                .await
                .unwrap()
                .is_clean()
        );
    });
    // Resuming (threads, a different layout) continues from step 2 and ends where an
    // uninterrupted run ends.
    let d = train(
        &store_path,
        "crash",
        &[
            "--layout",
            "tp=2",
            "--steps",
            "8",
            "--ckpt-every",
            "2",
            "--resume",
        ],
    );
    let base = train(
        &dir.path().join("base"),
        "b",
        &["--steps", "8", "--ckpt-every", "4"],
    );
    assert_eq!(d, base);
}

#[test]
fn committer_killed_before_commit() {
    // Every manifest is written, the committer dies before the commit record: the step is
    // not visible, and a later committer (any process) can still commit it.
    let dir = tempfile::tempdir().unwrap();
    let out = cmd(dir.path(), "kc", &["--steps", "2", "--ckpt-every", "2"])
        .env("CKPT_FAILPOINTS", "before_commit=kill")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let store = ckpt_store::open(dir.path().to_str().unwrap()).unwrap();
    runtime().block_on(async {
        assert!(store.log().committed_steps("kc").await.unwrap().is_empty());
        store.log().commit_step("kc", 2).await.unwrap();
        assert_eq!(store.log().latest_committed("kc").await.unwrap(), Some(2));
    });
}
