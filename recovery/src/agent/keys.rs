//! The key layout under an agent prefix and the values stored there (JSON). Nothing else
//! builds or parses these keys; the layout is described in the [module docs](super).

use ckpt_store::Layout;
use serde::{Deserialize, Serialize};

use crate::coordinator::{Assignment, ExitStatus};

/// The keys of one job under its prefix.
#[derive(Debug, Clone)]
pub struct Keys {
    prefix: String,
}

/// A key of the layout, parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Key {
    /// `job`: the job's settings, written once by the first agent.
    Job,
    /// `nodes/<node>`: a live agent (under its lease).
    Node(u32),
    /// `leader`: the coordinator's node (under its lease).
    Leader,
    /// `plan`: the current generation's plan.
    Plan,
    /// `plans/<gen>`: every generation's plan, each written once.
    Plans(u64),
    /// `signals/<gen>`: ranks of a generation to stop.
    Signals(u64),
    /// `beats/<node>`: a node's latest heartbeats (under its lease).
    Beats(u32),
    /// `exits/<gen>/<rank>`: how a rank ended.
    Exit(u64, u32),
    /// `drained/<gen>/<node>`: with a local tier per machine, a node drained its ranks of
    /// generation `gen`'s newest step after the generation was stopped ([`DrainedMsg`]).
    Drained(u64, u32),
    /// `done`: the job is over.
    Done,
}

impl Keys {
    /// Keys under `prefix` (a trailing `/` is ignored).
    pub fn new(prefix: &str) -> Self {
        Keys {
            prefix: prefix.trim_end_matches('/').to_string(),
        }
    }

    /// The prefix every key starts with, ending in `/` (what agents watch).
    pub fn root(&self) -> String {
        format!("{}/", self.prefix)
    }

    /// The prefix as given, without the trailing `/`.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The key of `k`.
    pub fn key(&self, k: Key) -> String {
        let p = &self.prefix;
        match k {
            Key::Job => format!("{p}/job"),
            Key::Node(n) => format!("{p}/nodes/{n}"),
            Key::Leader => format!("{p}/leader"),
            Key::Plan => format!("{p}/plan"),
            Key::Plans(g) => format!("{p}/plans/{g}"),
            Key::Signals(g) => format!("{p}/signals/{g}"),
            Key::Beats(n) => format!("{p}/beats/{n}"),
            Key::Exit(g, r) => format!("{p}/exits/{g}/{r}"),
            Key::Drained(g, n) => format!("{p}/drained/{g}/{n}"),
            Key::Done => format!("{p}/done"),
        }
    }

    /// The key a stored key names, or `None` for anything else under (or outside) the
    /// prefix.
    pub fn parse(&self, key: &[u8]) -> Option<Key> {
        let key = std::str::from_utf8(key).ok()?;
        let rest = key.strip_prefix(&self.prefix)?.strip_prefix('/')?;
        let parts: Vec<&str> = rest.split('/').collect();
        fn num<T: std::str::FromStr>(s: &str) -> Option<T> {
            // Canonical decimal only, so every number has one key.
            if s.is_empty() || (s.len() > 1 && s.starts_with('0')) {
                return None;
            }
            s.parse().ok()
        }
        Some(match parts.as_slice() {
            ["job"] => Key::Job,
            ["nodes", n] => Key::Node(num(n)?),
            ["leader"] => Key::Leader,
            ["plan"] => Key::Plan,
            ["plans", g] => Key::Plans(num(g)?),
            ["signals", g] => Key::Signals(num(g)?),
            ["beats", n] => Key::Beats(num(n)?),
            ["exits", g, r] => Key::Exit(num(g)?, num(r)?),
            ["drained", g, n] => Key::Drained(num(g)?, num(n)?),
            ["done"] => Key::Done,
            _ => return None,
        })
    }
}

/// `drained/<gen>/<node>`: what a node's drain of a stopped generation did (the coordinator
/// chooses the step to resume from once every live node of the generation said).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrainedMsg {
    /// The steps drained, newest first: those the node committed in its tier in that
    /// generation and the store lacked, until one was committed there.
    pub steps: Vec<u64>,
    /// The step this node's drain committed on the store (its ranks landed last), if any.
    pub committed: Option<u64>,
    /// Why the drain failed or was cut short, if it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// `job`: settings every agent of the job must share (checked when an agent joins).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobMsg {
    /// Run name.
    pub run: String,
    /// Nodes that run ranks at the start.
    pub nodes: u32,
    /// Ranks per node.
    pub ranks_per_node: u32,
    /// Spare nodes.
    pub spares: u32,
    /// The layout to start with.
    pub layout: String,
}

impl JobMsg {
    /// The settings as `ckpt agent` flags.
    pub fn flags(&self) -> String {
        format!(
            "--run {} --nodes {} --ranks-per-node {} --spares {} --layout {}",
            self.run, self.nodes, self.ranks_per_node, self.spares, self.layout
        )
    }
}

/// `nodes/<node>`: a live agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeMsg {
    /// Node id.
    pub node: u32,
    /// Address other machines reach this one at (`MASTER_ADDR` when it runs rank 0).
    pub addr: String,
    /// A free port on this machine (`MASTER_PORT` when it runs rank 0).
    pub port: u16,
    /// The agent's process id.
    pub pid: u32,
    /// Where this node's replica agent listens (`host:port`), with peer replicas on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica: Option<String>,
}

/// `plan` and `plans/<gen>`: what a generation runs, where.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlanMsg {
    /// Generation (the store's numbering: generation markers and commit fencing use it).
    pub generation: u64,
    /// Layout.
    pub layout: String,
    /// Rank -> node.
    pub assignments: Vec<Assignment>,
    /// The step the ranks restore, exactly (`CKPT_RESUME_STEP`); `None`: no usable checkpoint.
    pub resume_from: Option<u64>,
    /// `MASTER_ADDR` for every rank: the address of rank 0's node.
    pub master_addr: String,
    /// `MASTER_PORT`.
    pub master_port: u16,
    /// The coordinator's node.
    pub leader: u32,
    /// Nodes excluded so far.
    pub excluded: Vec<u32>,
    /// Restarts so far.
    pub restarts: u32,
    /// With peer replicas, the job's replica secret, made by the first coordinator (agents
    /// whose environment has `CKPT_PEER_SECRET` use that instead). Kept in etcd only: never in
    /// the store or a log line (its `Debug` hides it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer_secret: Option<crate::peer::PeerSecret>,
}

impl PlanMsg {
    /// The layout, parsed.
    pub fn layout(&self) -> ckpt_store::Result<Layout> {
        self.layout.parse()
    }
}

/// `signals/<gen>`: stop these ranks of the generation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SignalMsg {
    /// Ranks.
    pub ranks: Vec<u32>,
    /// SIGKILL instead of SIGTERM.
    pub kill: bool,
    /// Nodes excluded so far (a coordinator taking over reads them).
    pub excluded: Vec<u32>,
}

/// One rank's partial loss sums for a step, relayed from its heartbeat.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Partial {
    /// Rank.
    pub rank: u32,
    /// Step.
    pub step: u64,
    /// What the rank's workload reported of the step (opaque to the agents).
    pub workload: crate::heartbeat::Workload,
}

/// `beats/<node>`: the heartbeats a node's ranks sent since the last relay.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BeatsMsg {
    /// Generation.
    pub generation: u64,
    /// (rank, last step completed) of each rank that beat.
    pub steps: Vec<(u32, u64)>,
    /// The ranks that beat while starting (alive, no step to report yet).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub starting: Vec<u32>,
    /// Partial loss sums of the steps completed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub partials: Vec<Partial>,
    /// The node's ranks whose processes are stopped now (every other rank of the node runs).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stopped: Vec<u32>,
}

/// `exits/<gen>/<rank>`: how a rank ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitMsg {
    /// Exit code or signal.
    pub status: ExitStatus,
}

/// `done`: the job is over.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DoneMsg {
    /// Whether it completed.
    pub ok: bool,
    /// Why it ended.
    pub reason: String,
    /// The last generation.
    pub generation: Option<u64>,
    /// The last layout.
    pub layout: String,
    /// Restarts made.
    pub restarts: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_parses_back_and_nothing_else_does() {
        let k = Keys::new("/ckpt/run-1/");
        for key in [
            Key::Job,
            Key::Node(3),
            Key::Leader,
            Key::Plan,
            Key::Plans(12),
            Key::Signals(0),
            Key::Beats(0),
            Key::Exit(7, 15),
            Key::Done,
        ] {
            let s = k.key(key);
            assert!(s.starts_with("/ckpt/run-1/"), "{s}");
            assert_eq!(k.parse(s.as_bytes()), Some(key), "{s}");
        }
        for other in [
            "/ckpt/run-1",
            "/ckpt/run-10/plan",
            "/ckpt/run-1/nodes/",
            "/ckpt/run-1/nodes/01",
            "/ckpt/run-1/nodes/x",
            "/ckpt/run-1/exits/3",
            "/ckpt/run-1/plan/x",
            "/other/plan",
        ] {
            assert_eq!(k.parse(other.as_bytes()), None, "{other}");
        }
        assert_eq!(k.root(), "/ckpt/run-1/");
    }

    #[test]
    fn values_round_trip_as_json() {
        let p = PlanMsg {
            generation: 4,
            layout: "dp=2,tp=1,pp=1".into(),
            assignments: vec![Assignment {
                rank: 0,
                node: 1,
                local_rank: 0,
            }],
            resume_from: Some(8),
            master_addr: "10.0.0.1".into(),
            master_port: 29500,
            leader: 0,
            excluded: vec![2],
            restarts: 1,
            peer_secret: Some(crate::peer::PeerSecret::from_bytes([9; 32])),
        };
        let back: PlanMsg = serde_json::from_slice(&serde_json::to_vec(&p).unwrap()).unwrap();
        assert_eq!(back, p);
        assert_eq!(back.layout().unwrap().dp, 2);
        let e = ExitMsg {
            status: ExitStatus::Signal(9),
        };
        let back: ExitMsg = serde_json::from_slice(&serde_json::to_vec(&e).unwrap()).unwrap();
        assert_eq!(back, e);
    }
}
