//! Helpers: run the real `ckpt-train` binary, one process for all ranks or one per rank.

#![allow(dead_code)]

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};

pub const BIN: &str = env!("CARGO_BIN_EXE_ckpt-train");

pub fn cmd(store: &Path, run: &str, extra: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.arg("--store")
        .arg(store)
        .args(["--run", run, "--params", "60K", "--seed", "11"])
        .args(extra)
        .env("CKPT_LOG", "warn")
        .env_remove("CKPT_RANK")
        .env_remove("CKPT_FAILPOINTS")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

pub fn check(out: Output, what: &str) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{stderr}\n{stdout}",
        out.status
    );
    stdout
}

pub fn digest_of(stdout: &str) -> String {
    stdout
        .lines()
        .find_map(|l| l.strip_prefix("digest "))
        .unwrap_or_else(|| panic!("no digest in output:\n{stdout}"))
        .to_string()
}

/// All ranks as threads of one process.
pub fn train(store: &Path, run: &str, extra: &[&str]) -> String {
    let out = cmd(store, run, extra).output().expect("spawn ckpt-train");
    digest_of(&check(out, &format!("ckpt-train {extra:?}")))
}

/// One process per rank; returns rank 0's digest.
pub fn train_procs(store: &Path, run: &str, world: u32, extra: &[&str]) -> String {
    let children: Vec<(u32, Child)> = (0..world)
        .map(|r| {
            let mut c = cmd(store, run, extra);
            c.args(["--rank", &r.to_string()]);
            (r, c.spawn().expect("spawn ckpt-train"))
        })
        .collect();
    let mut digest = None;
    for (r, ch) in children {
        let out = ch.wait_with_output().expect("wait");
        let s = check(out, &format!("rank {r} of {extra:?}"));
        if r == 0 {
            digest = Some(digest_of(&s));
        }
    }
    digest.expect("rank 0")
}

pub fn metrics(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).expect("metrics line"))
        .collect()
}
