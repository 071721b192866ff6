//! The crash loop: one run, many rounds, each killing (SIGKILL) a process of it at a random
//! moment: a training process while it saves, commits or restores, or `ckpt gc` while it
//! deletes. After every round every committed step must verify clean, and at the end the run,
//! resumed once more, must finish bit-identical to an uninterrupted run.
//!
//! `CKPT_CRASHLOOP_ROUNDS` sets the number of rounds (10 by default, as in CI;
//! `scripts/crashloop.sh` runs 100) and `CKPT_CRASHLOOP_SEED` the seed (printed, so that a
//! failing schedule replays).

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use ckpt_store::testing::Rng;
use ckpt_tests::{bin, digest_in};

const PARAMS: &str = "40K";
const ARGS: &[&str] = &["--layout", "dp=2", "--seed", "3"];

/// `ckpt-train` to step `steps`, a checkpoint every `every` steps.
fn train(store: &Path, run: &str, steps: u64, every: u64, resume: bool, step_ms: u64) -> Command {
    let mut c = Command::new(bin("ckpt-train", "ckpt-train"));
    c.arg("--store")
        .arg(store)
        .args([
            "--run",
            run,
            "--params",
            PARAMS,
            "--steps",
            &steps.to_string(),
        ])
        .args(["--ckpt-every", &every.to_string()])
        .args(ARGS)
        .args(["--step-time-ms", &step_ms.to_string()])
        .env("CKPT_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if resume {
        c.arg("--resume");
    }
    c
}

fn ckpt(store: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(bin("ckpt", "ckpt"));
    c.arg("--store")
        .arg(store)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// Start `c`, SIGKILL it after `after` unless it ended first; its output.
fn kill_after(mut c: Command, after: Duration) -> (Output, bool) {
    let mut child = c.spawn().expect("spawn");
    let t0 = Instant::now();
    let mut killed = false;
    loop {
        if child.try_wait().expect("wait").is_some() {
            break;
        }
        if t0.elapsed() >= after {
            let _ = child.kill();
            killed = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    (child.wait_with_output().expect("output"), killed)
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Every committed step of `run` verifies clean (exit 0 of `ckpt verify RUN`).
fn verify_clean(store: &Path, run: &str, round: u32, what: &str, seed: u64) {
    let out = ckpt(store, &["verify", run]).output().expect("ckpt verify");
    assert!(
        out.status.success(),
        "round {round} ({what}, seed {seed}): verify found damage in a committed step:\n{}",
        text(&out)
    );
}

#[test]
#[allow(
    clippy::disallowed_methods,
    reason = "a test reads its knobs and tools from the environment"
)]
fn random_kills_never_break_a_committed_step() {
    let rounds: u32 = std::env::var("CKPT_CRASHLOOP_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let seed: u64 = std::env::var("CKPT_CRASHLOOP_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::from(ckpt_store::clock::system_now())
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    eprintln!("crash loop: {rounds} rounds, CKPT_CRASHLOOP_SEED={seed}");
    let mut rng = Rng(seed);
    // More steps than the rounds can train, so that every round finds work to kill.
    let steps = 20 * u64::from(rounds) + 40;
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");

    // What an uninterrupted run ends with.
    let out = train(&dir.path().join("ref"), "ref", steps, 1_000_000, false, 0)
        .output()
        .expect("ckpt-train");
    assert!(out.status.success(), "{}", text(&out));
    let reference = digest_in(&String::from_utf8_lossy(&out.stdout)).expect("a digest");

    let run = "loop";
    // A first committed step, so that every round has something to verify.
    let out = train(&store, run, 4, 2, false, 0)
        .output()
        .expect("ckpt-train");
    assert!(out.status.success(), "{}", text(&out));
    let mut kills = [0u32; 3];
    let mut ended = [0u32; 3];
    for round in 0..rounds {
        let what = match rng.below(10) {
            0..=5 => "train",
            6..=7 => "restore",
            _ => "gc",
        };
        let (out, killed) = match what {
            // Killed while training and saving (a checkpoint every 2 steps of >= 20 ms: a
            // save, a commit or a retention delete is in flight most of the time).
            "train" => kill_after(
                {
                    let mut c = train(&store, run, steps, 2, true, 20);
                    c.args(["--keep-last", "3"]);
                    c
                },
                Duration::from_millis(150 + rng.below(1500)),
            ),
            // Killed right after the start: while it restores the newest step.
            "restore" => kill_after(
                train(&store, run, steps, 2, true, 20),
                Duration::from_millis(rng.below(250)),
            ),
            // Killed while collecting: retention and a sweep of what killed saves left (no
            // save runs now, so a short grace is allowed).
            _ => kill_after(
                ckpt(
                    &store,
                    &["gc", "--keep-last", "2", "--grace", "1s", "--force"],
                ),
                // (It takes a few hundred milliseconds here, start-up included.)
                Duration::from_millis(rng.below(150)),
            ),
        };
        let kind = match what {
            "train" => 0,
            "restore" => 1,
            _ => 2,
        };
        eprintln!(
            "round {round}: {what} {}",
            if killed { "killed" } else { "ended" }
        );
        if killed {
            kills[kind] += 1;
        } else {
            ended[kind] += 1;
            // A process that ended on its own must have ended well.
            assert!(
                out.status.success(),
                "round {round} ({what}, seed {seed}) failed on its own:\n{}",
                text(&out)
            );
        }
        verify_clean(&store, run, round, what, seed);
        // The objects of a killed save age past the grace period of the next gc round.
        std::thread::sleep(Duration::from_millis(rng.below(1200)));
    }

    // Resumed once more, without interruption: it finishes bit-identical.
    let out = train(&store, run, steps, 2, true, 0)
        .output()
        .expect("ckpt-train");
    assert!(
        out.status.success(),
        "the final resume failed (seed {seed}):\n{}",
        text(&out)
    );
    let got = digest_in(&String::from_utf8_lossy(&out.stdout));
    verify_clean(&store, run, rounds, "final", seed);
    eprintln!(
        "crash loop: killed {} saving, {} restoring, {} collecting; ended on their own: {} \
         training, {} restoring, {} collecting",
        kills[0], kills[1], kills[2], ended[0], ended[1], ended[2]
    );
    assert_eq!(
        got.as_deref(),
        Some(reference.as_str()),
        "the run resumed after {rounds} rounds of kills (seed {seed}) did not end as an \
         uninterrupted run"
    );
}
