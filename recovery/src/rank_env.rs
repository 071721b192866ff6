//! The rank environment: the contract between a driver (the local supervisor or an etcd
//! agent) and each rank it launches, as one typed struct.
//!
//! The driver writes it with [`RankEnv::to_env`]; the rank reads it once with
//! [`RankEnv::from_env`] and hands the parts to the pieces that need them (the heartbeat
//! client, the peer link, the manager's config). The variable names are the constants below;
//! no other library code reads them. Alongside ckpt's own variables the driver sets the
//! torchrun ones (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT`), so `torch.distributed.init_process_group()` works in a launched rank.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use ckpt_store::{Error, Result, SdcCheck};

use crate::peer::{PeerLink, PeerSecret};

/// Store URL.
pub const STORE: &str = "CKPT_STORE";
/// Run name.
pub const RUN: &str = "CKPT_RUN";
/// This rank.
pub const RANK: &str = "CKPT_RANK";
/// Ranks in the job.
pub const WORLD_SIZE: &str = "CKPT_WORLD_SIZE";
/// The layout, as `dp=..,tp=..,pp=..[,zero=..]`.
pub const LAYOUT: &str = "CKPT_LAYOUT";
/// The generation the rank belongs to (it fences older writers).
pub const GENERATION: &str = "CKPT_GENERATION";
/// `true`: resume from the store.
pub const RESUME: &str = "CKPT_RESUME";
/// The step to restore, exactly (absent: the newest committed).
pub const RESUME_STEP: &str = "CKPT_RESUME_STEP";
/// The node the rank runs on.
pub const NODE: &str = "CKPT_NODE";
/// The rank's index on its node.
pub const LOCAL_RANK: &str = "CKPT_LOCAL_RANK";
/// `0`: the driver stops ranks with SIGTERM after a failure, when no commit is possible, so
/// they take no final checkpoint.
pub const FINAL_ON_SIGTERM: &str = "CKPT_FINAL_ON_SIGTERM";
/// The process id of the driver that launched the rank: a rank whose driver is gone ends.
pub const SUPERVISOR_PID: &str = "CKPT_SUPERVISOR_PID";
/// The driver's heartbeat socket.
pub const HEARTBEAT: &str = "CKPT_HEARTBEAT";
/// The heartbeat interval in milliseconds.
pub const HEARTBEAT_MS: &str = "CKPT_HEARTBEAT_MS";
/// This node's replica agent (`host:port`).
pub const PEER_AGENT: &str = "CKPT_PEER_AGENT";
/// The job's replica secret, hex: every connection to an agent proves it.
pub const PEER_SECRET: &str = crate::peer::SECRET_ENV;
/// Every live agent, comma-separated, this node's first.
pub const PEERS: &str = "CKPT_PEERS";
/// How long a peer transfer may stall, in milliseconds.
pub const PEER_TIMEOUT_MS: &str = "CKPT_PEER_TIMEOUT_MS";
/// The directory the ranks of this node share while they restore
/// ([`ckpt_store::NodeCache`]): each chunk is read from the store once per node.
pub const NODE_CACHE: &str = "CKPT_NODE_CACHE";
/// How much of its replicas a rank hashes for the sentinel (`full`, `off`, `sample=F`;
/// absent: the rank's own default).
pub const SDC_CHECK: &str = "CKPT_SDC_CHECK";
/// The node's local tier (a directory or URL): saves commit there first and drain to
/// `CKPT_STORE` behind the training (issue 28).
pub const LOCAL_TIER: &str = "CKPT_LOCAL_TIER";
/// In a job of several machines with a local tier: the ranks of this node, comma-separated,
/// which share its tier (the node's first rank commits them there; the drains commit the
/// step on the store).
pub const LOCAL_TIER_RANKS: &str = "CKPT_LOCAL_TIER_RANKS";

/// torchrun's names for the same facts.
pub mod torchrun {
    /// Global rank.
    pub const RANK: &str = "RANK";
    /// World size.
    pub const WORLD_SIZE: &str = "WORLD_SIZE";
    /// Rank on the node.
    pub const LOCAL_RANK: &str = "LOCAL_RANK";
    /// Ranks per node.
    pub const LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";
    /// The rendezvous host.
    pub const MASTER_ADDR: &str = "MASTER_ADDR";
    /// The rendezvous port.
    pub const MASTER_PORT: &str = "MASTER_PORT";
}

/// Every variable a driver sets or clears, for drivers that must clear stale ones.
pub const ALL: [&str; 21] = [
    STORE,
    RUN,
    RANK,
    WORLD_SIZE,
    LAYOUT,
    GENERATION,
    RESUME,
    RESUME_STEP,
    NODE,
    LOCAL_RANK,
    FINAL_ON_SIGTERM,
    SUPERVISOR_PID,
    HEARTBEAT,
    HEARTBEAT_MS,
    PEER_AGENT,
    PEER_SECRET,
    PEERS,
    NODE_CACHE,
    SDC_CHECK,
    LOCAL_TIER,
    LOCAL_TIER_RANKS,
];

/// Where and how often a rank beats.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeartbeatEnv {
    /// The driver's socket.
    pub socket: PathBuf,
    /// Between steps, beat this often.
    pub interval: Duration,
}

/// The replica agents a rank uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerEnv {
    /// This node's agent.
    pub agent: String,
    /// Every live agent, this node's first.
    pub peers: Vec<String>,
    /// How long a transfer may stall (`None`: the default).
    pub timeout: Option<Duration>,
    /// The job's secret.
    pub secret: PeerSecret,
}

/// What a driver hands a launched rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankEnv {
    /// Store URL.
    pub store: String,
    /// Run name.
    pub run: String,
    /// This rank.
    pub rank: u32,
    /// Ranks in the job.
    pub world_size: u32,
    /// The layout string.
    pub layout: String,
    /// The generation.
    pub generation: u64,
    /// Resume from the store.
    pub resume: bool,
    /// The step to restore, exactly.
    pub resume_step: Option<u64>,
    /// The node.
    pub node: u32,
    /// Rank on the node.
    pub local_rank: u32,
    /// Ranks per node.
    pub local_world_size: u32,
    /// Take a final checkpoint on SIGTERM.
    pub final_on_sigterm: bool,
    /// The launching driver's process id.
    pub supervisor_pid: u32,
    /// Heartbeats.
    pub heartbeat: HeartbeatEnv,
    /// Replica agents, when the job keeps peer replicas.
    pub peer: Option<PeerEnv>,
    /// The torchrun rendezvous: host and port.
    pub master: (String, u16),
    /// The node's shared restore cache, if the driver gives the node one.
    pub node_cache: Option<PathBuf>,
    /// How much of its replicas the rank hashes for the sentinel, if the driver says.
    pub sdc_check: Option<SdcCheck>,
    /// The node's local tier, if the job has one.
    pub local_tier: Option<String>,
    /// The ranks sharing this node's local tier, when the job has several machines.
    pub local_tier_ranks: Option<Vec<u32>>,
}

impl RankEnv {
    /// The variables to set, in a fixed order; [`RankEnv::unset`] lists the ones to clear.
    pub fn to_env(&self) -> Vec<(&'static str, OsString)> {
        let s = |v: &dyn ToString| OsString::from(v.to_string());
        let mut out = vec![
            (STORE, s(&self.store)),
            (RUN, s(&self.run)),
            (RANK, s(&self.rank)),
            (WORLD_SIZE, s(&self.world_size)),
            (LAYOUT, s(&self.layout)),
            (GENERATION, s(&self.generation)),
            (RESUME, s(&self.resume)),
            (NODE, s(&self.node)),
            (LOCAL_RANK, s(&self.local_rank)),
            (FINAL_ON_SIGTERM, s(&u8::from(self.final_on_sigterm))),
            (SUPERVISOR_PID, s(&self.supervisor_pid)),
            (HEARTBEAT, self.heartbeat.socket.clone().into_os_string()),
            (HEARTBEAT_MS, s(&self.heartbeat.interval.as_millis())),
            (torchrun::RANK, s(&self.rank)),
            (torchrun::WORLD_SIZE, s(&self.world_size)),
            (torchrun::LOCAL_RANK, s(&self.local_rank)),
            (torchrun::LOCAL_WORLD_SIZE, s(&self.local_world_size)),
            (torchrun::MASTER_ADDR, s(&self.master.0)),
            (torchrun::MASTER_PORT, s(&self.master.1)),
        ];
        if let Some(step) = self.resume_step {
            out.push((RESUME_STEP, s(&step)));
        }
        if let Some(d) = &self.node_cache {
            out.push((NODE_CACHE, d.clone().into_os_string()));
        }
        if let Some(c) = &self.sdc_check {
            out.push((SDC_CHECK, s(c)));
        }
        if let Some(t) = &self.local_tier {
            out.push((LOCAL_TIER, s(t)));
        }
        if let Some(r) = &self.local_tier_ranks {
            let list: Vec<String> = r.iter().map(u32::to_string).collect();
            out.push((LOCAL_TIER_RANKS, s(&list.join(","))));
        }
        if let Some(p) = &self.peer {
            out.push((PEER_AGENT, s(&p.agent)));
            out.push((PEER_SECRET, s(&p.secret.to_hex())));
            out.push((PEERS, s(&p.peers.join(","))));
            if let Some(t) = p.timeout {
                out.push((PEER_TIMEOUT_MS, s(&t.as_millis())));
            }
        }
        out
    }

    /// The optional variables this environment leaves out: a driver clears them, so that a
    /// value inherited from its own environment never reaches the rank.
    pub fn unset(&self) -> Vec<&'static str> {
        let mut out = Vec::new();
        if self.resume_step.is_none() {
            out.push(RESUME_STEP);
        }
        if self.node_cache.is_none() {
            out.push(NODE_CACHE);
        }
        if self.sdc_check.is_none() {
            out.push(SDC_CHECK);
        }
        if self.local_tier.is_none() {
            out.push(LOCAL_TIER);
        }
        if self.local_tier_ranks.is_none() {
            out.push(LOCAL_TIER_RANKS);
        }
        match &self.peer {
            None => out.extend([PEER_AGENT, PEER_SECRET, PEERS, PEER_TIMEOUT_MS]),
            Some(p) if p.timeout.is_none() => out.push(PEER_TIMEOUT_MS),
            Some(_) => {}
        }
        out
    }

    /// This process's rank environment: `None` when no driver launched it (no
    /// `CKPT_SUPERVISOR_PID`); an error naming the variable when one is missing or malformed.
    #[allow(
        clippy::disallowed_methods,
        reason = "the rank environment is the one library edge that reads the environment"
    )]
    pub fn from_env() -> Result<Option<RankEnv>> {
        Self::from_vars(|k| std::env::var_os(k))
    }

    /// [`RankEnv::from_env`] over any lookup (tests).
    pub fn from_vars(get: impl Fn(&str) -> Option<OsString>) -> Result<Option<RankEnv>> {
        if get(SUPERVISOR_PID).is_none() {
            return Ok(None);
        }
        let text = |k: &str| -> Result<String> {
            let v = get(k).ok_or_else(|| {
                Error::invalid(format!(
                    "{k} is not set, though {SUPERVISOR_PID} says a driver launched this rank"
                ))
            })?;
            v.into_string()
                .map_err(|_| Error::invalid(format!("{k} is not valid UTF-8")))
        };
        fn num<T: std::str::FromStr>(k: &str, v: String) -> Result<T> {
            v.parse()
                .map_err(|_| Error::invalid(format!("{k}={v:?} is not a number")))
        }
        let opt = |k: &str| -> Result<Option<String>> {
            match get(k) {
                None => Ok(None),
                Some(_) => text(k).map(Some),
            }
        };
        let peer = match opt(PEER_AGENT)?.filter(|a| !a.is_empty()) {
            None => None,
            Some(agent) => {
                let mut peers: Vec<String> = opt(PEERS)?
                    .unwrap_or_default()
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(str::to_string)
                    .collect();
                if !peers.contains(&agent) {
                    peers.insert(0, agent.clone());
                }
                let secret = PeerSecret::from_hex(&opt(PEER_SECRET)?.ok_or_else(|| {
                    Error::invalid(format!("{PEER_AGENT} is set but {PEER_SECRET} is not"))
                })?)?;
                Some(PeerEnv {
                    secret,
                    timeout: opt(PEER_TIMEOUT_MS)?
                        .map(|v| num(PEER_TIMEOUT_MS, v).map(Duration::from_millis))
                        .transpose()?,
                    agent,
                    peers,
                })
            }
        };
        let resume = match text(RESUME)?.as_str() {
            "true" | "1" => true,
            "false" | "0" => false,
            v => {
                return Err(Error::invalid(format!(
                    "{RESUME}={v:?} is not true or false"
                )));
            }
        };
        Ok(Some(RankEnv {
            store: text(STORE)?,
            run: text(RUN)?,
            rank: num(RANK, text(RANK)?)?,
            world_size: num(WORLD_SIZE, text(WORLD_SIZE)?)?,
            layout: text(LAYOUT)?,
            generation: num(GENERATION, text(GENERATION)?)?,
            resume,
            resume_step: opt(RESUME_STEP)?.map(|v| num(RESUME_STEP, v)).transpose()?,
            node: num(NODE, text(NODE)?)?,
            local_rank: num(LOCAL_RANK, text(LOCAL_RANK)?)?,
            local_world_size: num(
                torchrun::LOCAL_WORLD_SIZE,
                text(torchrun::LOCAL_WORLD_SIZE)?,
            )?,
            final_on_sigterm: text(FINAL_ON_SIGTERM)? != "0",
            supervisor_pid: num(SUPERVISOR_PID, text(SUPERVISOR_PID)?)?,
            heartbeat: HeartbeatEnv {
                socket: PathBuf::from(
                    get(HEARTBEAT)
                        .ok_or_else(|| Error::invalid(format!("{HEARTBEAT} is not set")))?,
                ),
                interval: Duration::from_millis(num(HEARTBEAT_MS, text(HEARTBEAT_MS)?)?),
            },
            peer,
            master: (
                text(torchrun::MASTER_ADDR)?,
                num(torchrun::MASTER_PORT, text(torchrun::MASTER_PORT)?)?,
            ),
            node_cache: get(NODE_CACHE).filter(|v| !v.is_empty()).map(PathBuf::from),
            sdc_check: opt(SDC_CHECK)?
                .filter(|v| !v.is_empty())
                .map(|v| {
                    v.parse::<SdcCheck>()
                        .map_err(|e| Error::invalid(format!("{SDC_CHECK}: {e}")))
                })
                .transpose()?,
            local_tier: opt(LOCAL_TIER)?.filter(|v| !v.is_empty()),
            local_tier_ranks: opt(LOCAL_TIER_RANKS)?
                .filter(|v| !v.is_empty())
                .map(|v| {
                    v.split(',')
                        .map(|r| num(LOCAL_TIER_RANKS, r.trim().to_string()))
                        .collect::<Result<Vec<u32>>>()
                })
                .transpose()?,
        }))
    }

    /// The rank's view of the replica agents, if the job keeps peer replicas.
    pub fn peer_link(&self) -> Option<PeerLink> {
        let p = self.peer.as_ref()?;
        Some(PeerLink {
            node: self.node,
            agent: p.agent.clone(),
            peers: p.peers.clone(),
            timeout: p.timeout.unwrap_or(crate::peer::IO_TIMEOUT),
            secret: p.secret.clone(),
        })
    }
}

/// The job's replica secret in [`PEER_SECRET`] of this process's environment, for a replica
/// agent's launcher (`ckpt agent`, `ckpt replica-agent`); `None` when unset or empty.
#[allow(
    clippy::disallowed_methods,
    reason = "the rank environment is the one library edge that reads the environment"
)]
pub fn peer_secret_from_env() -> Result<Option<PeerSecret>> {
    match std::env::var(PEER_SECRET) {
        Ok(s) if !s.trim().is_empty() => PeerSecret::from_hex(&s).map(Some),
        _ => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn sample() -> RankEnv {
        RankEnv {
            store: "/tmp/store".into(),
            run: "demo".into(),
            rank: 3,
            world_size: 4,
            layout: "dp=2,tp=2,pp=1".into(),
            generation: 7,
            resume: true,
            resume_step: Some(40),
            node: 1,
            local_rank: 1,
            local_world_size: 2,
            final_on_sigterm: false,
            supervisor_pid: 1234,
            heartbeat: HeartbeatEnv {
                socket: "/tmp/hb.sock".into(),
                interval: Duration::from_millis(250),
            },
            peer: Some(PeerEnv {
                agent: "127.0.0.1:5001".into(),
                secret: PeerSecret::from_bytes([7; 32]),
                peers: vec!["127.0.0.1:5001".into(), "127.0.0.1:5002".into()],
                timeout: None,
            }),
            master: ("127.0.0.1".into(), 29500),
            node_cache: Some("/dev/shm/ckpt-node-1".into()),
            sdc_check: Some(SdcCheck::Sample(0.25)),
            local_tier: Some("/nvme/ckpt".into()),
            local_tier_ranks: Some(vec![2, 3]),
        }
    }

    fn vars(e: &RankEnv) -> HashMap<String, OsString> {
        e.to_env()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect()
    }

    #[test]
    fn written_and_read_back_equal() {
        let e = sample();
        let m = vars(&e);
        assert_eq!(RankEnv::from_vars(|k| m.get(k).cloned()).unwrap(), Some(e));
        let mut e = sample();
        e.peer = None;
        e.resume_step = None;
        e.final_on_sigterm = true;
        e.node_cache = None;
        e.sdc_check = None;
        e.local_tier = None;
        e.local_tier_ranks = None;
        let m = vars(&e);
        assert!(!m.contains_key(PEER_AGENT) && !m.contains_key(RESUME_STEP));
        assert!(!m.contains_key(NODE_CACHE) && e.unset().contains(&NODE_CACHE));
        assert!(e.unset().contains(&PEER_AGENT) && e.unset().contains(&PEER_SECRET));
        assert!(e.unset().contains(&RESUME_STEP));
        assert!(!m.contains_key(LOCAL_TIER_RANKS) && e.unset().contains(&LOCAL_TIER_RANKS));
        assert_eq!(RankEnv::from_vars(|k| m.get(k).cloned()).unwrap(), Some(e));
    }

    #[test]
    fn not_launched_is_none_and_bad_values_are_named() {
        assert_eq!(RankEnv::from_vars(|_| None).unwrap(), None);
        let mut m = vars(&sample());
        m.insert(GENERATION.into(), "seven".into());
        let e = RankEnv::from_vars(|k| m.get(k).cloned()).unwrap_err();
        assert!(e.to_string().contains("CKPT_GENERATION"), "{e}");
        let mut m = vars(&sample());
        m.remove(RUN);
        let e = RankEnv::from_vars(|k| m.get(k).cloned()).unwrap_err();
        assert!(e.to_string().contains("CKPT_RUN"), "{e}");
        let mut m = vars(&sample());
        m.insert(SDC_CHECK.into(), "most".into());
        let e = RankEnv::from_vars(|k| m.get(k).cloned()).unwrap_err();
        assert!(e.to_string().contains("CKPT_SDC_CHECK"), "{e}");
    }

    #[test]
    fn the_peer_link_carries_the_node_and_the_agents() {
        let l = sample().peer_link().unwrap();
        assert_eq!(l.node, 1);
        assert_eq!(l.secret, PeerSecret::from_bytes([7; 32]));
        assert_eq!(l.peers.len(), 2);
    }
}
