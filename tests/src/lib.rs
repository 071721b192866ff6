//! Helpers for cross-crate scenarios: the workspace's binaries, processes found by their
//! environment, signals.

pub mod dcp_model;
pub mod goodput;
pub mod restore_bench;
pub mod scale;
pub mod writers_bench;

use std::path::PathBuf;
use std::process::Command;

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

/// Path to a binary of the workspace, built when missing or older than any source of the
/// library crates it is built from (`cargo test -p ckpt-tests` alone builds neither other
/// packages' binaries nor their changes): a test never runs a stale binary.
pub fn bin(name: &str, package: &str) -> PathBuf {
    let features: &[&str] = if package == "ckpt" && cfg!(feature = "etcd") {
        &["etcd"]
    } else {
        &[]
    };
    ckpt_store::testing::workspace_bin(&target_dir(), name, package, features)
}

/// The final state digest of an uninterrupted `ckpt-train` run of `steps` steps of a model of
/// `params` parameters (seed 5), saved under `dir/ref`: what a recovered job must end with.
pub fn reference_digest(dir: &std::path::Path, steps: u64, params: &str) -> String {
    let out = Command::new(bin("ckpt-train", "ckpt-train"))
        .arg("--store")
        .arg(dir.join("ref"))
        .args(["--run", "ref", "--steps", &steps.to_string()])
        .args(["--ckpt-every", "1000", "--params", params, "--seed", "5"])
        .env("CKPT_LOG", "warn")
        .output()
        .expect("ckpt-train runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    digest_in(&String::from_utf8_lossy(&out.stdout)).expect("a digest line")
}

/// Run the local supervisor (`ckpt resume`'s engine) on a thread of its own with its own
/// runtime; join the handle for its report.
pub fn spawn_supervisor(
    opts: ckpt_recovery::SupervisorOptions,
) -> std::thread::JoinHandle<ckpt_recovery::Report> {
    std::thread::spawn(move || {
        tokio::runtime::Runtime::new()
            .expect("a runtime")
            .block_on(ckpt_recovery::run(opts))
            .expect("the supervisor ran")
    })
}

/// The local supervisor's options for the end-to-end recovery tests: `cmd` under `layout` on
/// `topo`, rank logs in `logs`, and detection settings that fail a rank in seconds (a 2 s
/// heartbeat timeout, 20 s to hang, 60 s to start, 2 s stop grace, 100 ms backoff, 6
/// restarts).
pub fn supervised(
    store: &std::path::Path,
    run: &str,
    topo: ckpt_recovery::Topology,
    layout: &str,
    cmd: Vec<String>,
    logs: PathBuf,
) -> ckpt_recovery::SupervisorOptions {
    use std::time::Duration;
    let mut cfg = ckpt_recovery::Config::new(topo, layout.parse().expect("a layout"));
    cfg.max_restarts = 6;
    cfg.heartbeat_timeout = Duration::from_secs(2);
    cfg.hang_timeout = Duration::from_secs(20);
    cfg.startup_timeout = Duration::from_secs(60);
    cfg.stop_grace = Duration::from_secs(2);
    cfg.backoff = Duration::from_millis(100);
    ckpt_recovery::SupervisorOptions {
        job: ckpt_recovery::JobOptions {
            store_url: store.to_string_lossy().to_string(),
            run: run.into(),
            config: cfg,
            command: cmd,
            logs_dir: Some(logs),
            heartbeat_interval: Duration::from_millis(100),
            open: Default::default(),
            sdc_check: None,
            local_tier: None,
        },
        replica_agent: None,
        repair_after: None,
    }
}

/// The command that starts one node's replica agent: `ckpt replica-agent`.
pub fn replica_agent_command() -> Vec<String> {
    vec![
        bin("ckpt", "ckpt").to_string_lossy().to_string(),
        "replica-agent".into(),
    ]
}

/// [`replica_agent_command`] logging at info without colour codes, so that a test can see in
/// its log each snapshot it takes ([`agent_held`]).
pub fn logging_agent_command() -> Vec<String> {
    let mut cmd: Vec<String> = vec![
        "sh".into(),
        "-c".into(),
        r#"RUST_LOG=info NO_COLOR=1 exec "$0" "$@""#.into(),
    ];
    cmd.extend(replica_agent_command());
    cmd
}

/// Whether an agent's log (at info) says it holds the snapshot of `step` of rank `rank` of
/// node `node`: its own rank's, or its buddy's copy.
pub fn agent_held(log: &str, node: u32, rank: u32, step: u64) -> bool {
    let want = [
        format!("node={node}"),
        format!("rank={rank}"),
        format!("step={step}"),
    ];
    log.lines().any(|l| {
        l.contains("snapshot held")
            && want
                .iter()
                .all(|w| l.split_whitespace().any(|field| field == w))
    })
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

/// The digest printed by rank 0 of the newest generation that printed one
/// (`rank-0.gen-G.out` in the folder of a driver's rank logs).
pub fn final_digest(logs: &std::path::Path) -> Option<String> {
    newest_digest([logs.to_path_buf()])
}

/// [`final_digest`] over several folders (each node's rank logs).
pub fn newest_digest(dirs: impl IntoIterator<Item = PathBuf>) -> Option<String> {
    let mut best: Option<(u64, String)> = None;
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if let Some(g) = name
                .strip_prefix("rank-0.gen-")
                .and_then(|s| s.strip_suffix(".out"))
                .and_then(|g| g.parse::<u64>().ok())
                && let Some(d) = digest_in(&std::fs::read_to_string(e.path()).unwrap_or_default())
                && best.as_ref().is_none_or(|(bg, _)| g > *bg)
            {
                best = Some((g, d));
            }
        }
    }
    best.map(|b| b.1)
}

/// Send `sig` to every process of the process group `pgid` (a whole simulated machine: an
/// agent started in its own group, and its ranks).
pub fn signal_group(pgid: u32, sig: i32) {
    // SAFETY: a plain libc call.
    unsafe {
        libc::kill(-(pgid as i32), sig);
    }
}

/// A free TCP port on the loopback interface.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind(("127.0.0.1", 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// A real etcd server on free loopback ports, in its own data directory; stopped (SIGTERM)
/// when dropped.
pub struct Etcd {
    /// Client URL (`http://127.0.0.1:PORT`).
    pub url: String,
    child: std::process::Child,
    /// Data directory and server log (`etcd.log`).
    pub dir: tempfile::TempDir,
}

/// The etcd binary (see [`ckpt_store::testing::find_etcd`]). Panics when there is none: a
/// test checks `require!(Need::Etcd)` first.
pub fn etcd_binary() -> PathBuf {
    ckpt_store::testing::find_etcd().expect(
        "etcd is not installed: run scripts/install-test-deps.sh (Debian package etcd-server), \
         or set CKPT_ETCD_BIN",
    )
}

impl Etcd {
    /// Start a single-member cluster and wait until it reports healthy.
    pub fn start() -> Etcd {
        let bin = etcd_binary();
        let dir = tempfile::tempdir().expect("a temporary directory");
        for attempt in 0..5 {
            let (client, peer) = (free_port(), free_port());
            let url = format!("http://127.0.0.1:{client}");
            let peer_url = format!("http://127.0.0.1:{peer}");
            let log = std::fs::File::create(dir.path().join("etcd.log")).expect("etcd log");
            let mut child = Command::new(&bin)
                .args(["--name", "t", "--data-dir"])
                .arg(dir.path().join(format!("data-{attempt}")))
                .args([
                    "--listen-client-urls",
                    &url,
                    "--advertise-client-urls",
                    &url,
                ])
                .args(["--listen-peer-urls", &peer_url])
                .args(["--initial-advertise-peer-urls", &peer_url])
                .args(["--initial-cluster", &format!("t={peer_url}")])
                .stdout(log.try_clone().expect("etcd log"))
                .stderr(log)
                .spawn()
                .unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()));
            let t0 = std::time::Instant::now();
            while t0.elapsed() < std::time::Duration::from_secs(20) {
                if let Ok(Some(_)) = child.try_wait() {
                    break; // a port was taken after all: try others
                }
                if etcd_healthy(client) {
                    return Etcd { url, child, dir };
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        let log = std::fs::read_to_string(dir.path().join("etcd.log")).unwrap_or_default();
        panic!("etcd did not become healthy; its log:\n{log}");
    }
}

fn etcd_healthy(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(std::time::Duration::from_secs(1)));
    if s.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut body = String::new();
    let _ = s.read_to_string(&mut body);
    body.contains("\"health\":\"true\"")
}

impl Drop for Etcd {
    fn drop(&mut self) {
        signal(self.child.id(), libc::SIGTERM);
        let _ = self.child.wait();
    }
}
