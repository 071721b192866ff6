//! The supervision's processes as `/proc` shows them: its ranks and replica agents (found by
//! the run's marker in their environment), their state and resident memory, and the digest
//! the newest generation printed.

use super::TAG_ENV;
use crate::{env_of, find_processes};

/// A live rank process of the supervision.
#[derive(Debug, Clone, Copy)]
pub(super) struct RankProc {
    pub(super) pid: u32,
    pub(super) node: u32,
    pub(super) generation: u64,
}

/// The process state letter of `pid` (`R`, `S`, `T`, `Z`, ...), `None` when it is gone.
pub(super) fn state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command may hold spaces: the state follows the last ')'.
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// Processes carrying `tag`, not zombies.
pub(super) fn tagged(tag: &str) -> Vec<(u32, Vec<(String, String)>)> {
    find_processes(&[(TAG_ENV, tag)])
        .into_iter()
        .filter(|(pid, _)| state(*pid).is_some_and(|s| s != 'Z' && s != 'X'))
        .collect()
}

/// The running (not stopped) ranks of the supervision.
pub(super) fn ranks(tag: &str) -> Vec<RankProc> {
    tagged(tag)
        .into_iter()
        .filter_map(|(pid, env)| {
            env_of(&env, "CKPT_RANK")?;
            if state(pid) == Some('T') {
                return None;
            }
            Some(RankProc {
                pid,
                node: env_of(&env, "CKPT_NODE")?.parse().ok()?,
                generation: env_of(&env, "CKPT_GENERATION")?.parse().ok()?,
            })
        })
        .collect()
}

pub(super) fn cmdline(pid: u32) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .unwrap_or_default()
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).to_string())
        .collect()
}

/// The live replica agents of the supervision: (pid, node).
pub(super) fn agents(tag: &str) -> Vec<(u32, u32)> {
    tagged(tag)
        .into_iter()
        .filter_map(|(pid, _)| {
            let args = cmdline(pid);
            if !args.iter().any(|a| a == "replica-agent") {
                return None;
            }
            let at = args.iter().position(|a| a == "--node")?;
            Some((pid, args.get(at + 1)?.parse().ok()?))
        })
        .collect()
}

/// Resident memory of `pid`, KiB (0 when it is gone).
pub(super) fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}
