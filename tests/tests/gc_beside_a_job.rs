//! `ckpt gc` with a short grace, in loops beside a job that saves every step: the GC must honour
//! the live writer's lease and the step still committing, whatever the grace. A short grace
//! costs only a sweep's deferral: the job finishes bit-identical to an uninterrupted run,
//! every GC ends well, and every committed step verifies.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use ckpt_tests::{bin, digest_in};

const ARGS: &[&str] = &["--params", "40K", "--layout", "dp=2", "--seed", "3"];

fn train(store: &Path, run: &str, steps: u64, every: u64) -> Command {
    let mut c = Command::new(bin("ckpt-train", "ckpt-train"));
    c.arg("--store")
        .arg(store)
        .args(["--run", run, "--steps", &steps.to_string()])
        .args(["--ckpt-every", &every.to_string()])
        .args(ARGS)
        .args(["--step-time-ms", "10"])
        .env("CKPT_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

fn ckpt(store: &Path, args: &[&str]) -> Output {
    Command::new(bin("ckpt", "ckpt"))
        .arg("--store")
        .arg(store)
        .args(args)
        .env("CKPT_LOG", "warn")
        .output()
        .expect("ckpt runs")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn two_gc_loops_with_no_grace_beside_a_job_that_saves_every_step() {
    let dir = tempfile::tempdir().unwrap();
    let steps = 120;
    let out = train(&dir.path().join("ref"), "ref", steps, 1_000_000)
        .output()
        .expect("ckpt-train");
    assert!(out.status.success(), "{}", text(&out));
    let reference = digest_in(&String::from_utf8_lossy(&out.stdout)).expect("a digest");

    let store = dir.path().join("store");
    let mut job = train(&store, "r", steps, 1).spawn().expect("ckpt-train");
    // The loops start once the job has created its store.
    while !store.join("runs").exists() {
        assert!(job.try_wait().unwrap().is_none(), "the job ended at once");
        std::thread::sleep(Duration::from_millis(10));
    }
    let done = Arc::new(AtomicBool::new(false));
    let loops: Vec<_> = (0..2)
        .map(|_| {
            let (store, done) = (store.clone(), done.clone());
            std::thread::spawn(move || {
                let (mut runs, mut deferred) = (0u32, 0u32);
                while !done.load(Ordering::Relaxed) {
                    let out = ckpt(
                        &store,
                        &["gc", "--keep-last", "2", "--grace", "0s", "--force"],
                    );
                    let said = text(&out);
                    assert!(out.status.success(), "gc beside the job failed:\n{said}");
                    runs += 1;
                    deferred += u32::from(said.contains("sweep      deferred"));
                }
                (runs, deferred)
            })
        })
        .collect();
    let out = job.wait_with_output().expect("ckpt-train");
    done.store(true, Ordering::Relaxed);
    let counts: Vec<(u32, u32)> = loops.into_iter().map(|l| l.join().unwrap()).collect();
    eprintln!("gc runs and deferred sweeps per loop: {counts:?}");
    assert!(
        out.status.success(),
        "the job failed beside gc with no grace:\n{}",
        text(&out)
    );
    assert_eq!(
        digest_in(&String::from_utf8_lossy(&out.stdout)).as_deref(),
        Some(reference.as_str()),
        "the job's final state differs from an uninterrupted run's"
    );
    assert!(
        counts.iter().all(|&(runs, _)| runs >= 2),
        "each gc loop ran beside the job: {counts:?}"
    );

    // Every step retention kept verifies.
    let v = ckpt(&store, &["verify", "r"]);
    assert!(v.status.success(), "verify after the job:\n{}", text(&v));
    // With the job gone, its leases released and no save in flight, a gc told so (lease lapse
    // zero) sweeps, keeps the newest two steps, and leaves nothing for a second one to delete.
    let no_job = [
        "--json",
        "gc",
        "--keep-last",
        "2",
        "--grace",
        "0s",
        "--lease-lapse",
        "0s",
        "--force",
    ];
    let json = |o: &Output| -> serde_json::Value {
        assert!(o.status.success(), "{}", text(o));
        serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(o)))
    };
    let g = json(&ckpt(&store, &no_job));
    assert_eq!(g["sweep_deferred"], serde_json::Value::Null, "{g}");
    assert_eq!(
        g["steps_kept"],
        serde_json::json!([["r", 119], ["r", 120]]),
        "{g}"
    );
    let again = json(&ckpt(&store, &[&no_job[..], &["--dry-run"]].concat()));
    assert_eq!(again["objects_deleted"], 0, "{again}");
    assert_eq!(
        again["incomplete_deleted"],
        serde_json::json!([]),
        "{again}"
    );
    let v = ckpt(&store, &["verify"]);
    assert!(
        v.status.success(),
        "verify of the whole store:\n{}",
        text(&v)
    );
}
