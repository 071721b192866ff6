//! Helpers for cross-crate scenarios: the workspace's binaries, processes found by their
//! environment, signals.

use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;

/// The workspace's target directory for the running profile (`target/debug`).
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("executable path");
    // Tests live in target/<profile>/deps/, binaries in target/<profile>/.
    let dir = exe.parent().expect("a parent directory");
    if dir.file_name().is_some_and(|n| n == "deps") {
        dir.parent().expect("target/<profile>").to_path_buf()
    } else {
        dir.to_path_buf()
    }
}

static BUILD: Mutex<()> = Mutex::new(());

/// Path to a binary of the workspace, built if missing (`cargo test -p ckpt-tests` alone
/// does not build other packages' binaries).
pub fn bin(name: &str, package: &str) -> PathBuf {
    let p = target_dir().join(name);
    let _g = BUILD.lock().unwrap_or_else(|e| e.into_inner());
    if !p.is_file() {
        let profile = target_dir()
            .file_name()
            .map(|s| s.to_string_lossy().to_string())
            .unwrap_or_default();
        let mut c = Command::new(env!("CARGO"));
        c.args(["build", "-p", package, "--bin", name]);
        if profile == "release" {
            c.arg("--release");
        }
        let st = c.status().expect("cargo build");
        assert!(st.success(), "building {name} failed");
    }
    p
}

/// Processes whose environment has `key=value` for every pair, as (pid, environment).
pub fn find_processes(want: &[(&str, &str)]) -> Vec<(u32, Vec<(String, String)>)> {
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(env) = std::fs::read(e.path().join("environ")) else {
            continue;
        };
        let vars: Vec<(String, String)> = env
            .split(|&b| b == 0)
            .filter_map(|kv| {
                let s = String::from_utf8_lossy(kv);
                s.split_once('=')
                    .map(|(k, v)| (k.to_string(), v.to_string()))
            })
            .collect();
        let ok = want
            .iter()
            .all(|(k, v)| vars.iter().any(|(a, b)| a == k && b == v));
        if ok {
            out.push((pid, vars));
        }
    }
    out
}

/// The value of `key` in an environment from [`find_processes`].
pub fn env_of<'a>(vars: &'a [(String, String)], key: &str) -> Option<&'a str> {
    vars.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
}

/// Send `sig` to `pid`.
pub fn signal(pid: u32, sig: i32) {
    // SAFETY: a plain libc call.
    unsafe {
        libc::kill(pid as i32, sig);
    }
}

/// The digest line of a `ckpt-train` output.
pub fn digest_in(text: &str) -> Option<String> {
    text.lines()
        .find_map(|l| l.strip_prefix("digest "))
        .map(str::to_string)
}
