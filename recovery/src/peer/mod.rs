//! Peer replicas: the newest snapshot of every rank held in host memory by a per-node agent,
//! with a copy at another node's agent, so that after a node is lost the survivors read its
//! shards from memory instead of the store.
//!
//! Three parts speak one small protocol over TCP (loopback for simulated nodes, the network
//! across machines):
//!
//! - **The agent** ([`serve`], run by `ckpt replica-agent`): one per node; it outlives the
//!   rank processes a supervisor stops and restarts. It keeps, per (node, rank), the chunks
//!   of the newest snapshot it was handed, forwards what its own ranks hand it to its buddy
//!   (the next live node's agent, from its [`Membership`]), and answers requests for chunks
//!   by id.
//! - **The upload** ([`PeerUpload`], used by the save pipeline): while a rank persists a save,
//!   each chunk's raw bytes go to the node's agent as well (in order, through a bounded
//!   queue), and once the manifest is known, the chunk ids.
//! - **The source** ([`PeerSource`]): a [`ChunkSource`](ckpt_store::ChunkSource) for the
//!   store's read engine that asks the agents for a chunk before the store. The read engine
//!   checks every chunk it gets against its hash and reads the store for anything missing or
//!   damaged, so an agent can never make a restore wrong, only faster.
//!
//! **Trust.** Every connection starts with a challenge on the job's [`PeerSecret`] (32 random
//! bytes made by the supervisor or the etcd coordinator, handed to agents and ranks in
//! `CKPT_PEER_SECRET`): the agent sends a nonce, the client answers with a blake3 keyed hash
//! of it and its own nonce, the agent proves the secret back. Nothing is read, allocated or
//! changed for a client before that. This is authentication, not encryption: the bytes of
//! snapshots cross the network in the clear (TLS is not used; the agents are meant for a
//! job's private network). Where a copy goes (the buddy), which nodes' snapshots an agent
//! keeps, and the newest generation it accepts come from the agent's own [`Membership`]
//! (its launch configuration and the job's plans), never from a frame.
//!
//! Wire format (integers little-endian; see FORMAT.md "Peer replica protocol"): the
//! handshake, then frames: `B` node u32, rank u32, generation u64, step u64 starts a
//! snapshot; `C` seq u32, len u64, bytes is one chunk; `E` n u32 then n ids of 32 bytes ends
//! it (chunk `seq` has id `seq`) and is answered `O` once the snapshot is kept; `A` abandons
//! it. `G` id asks for a chunk: the answer is `Y`
//! len u64 bytes, or `N`. `S` asks for the agent's holdings: three u64 (snapshots, chunks,
//! bytes).
//!
//! The files, one subject each: `auth` (the secret and the handshake), `wire` (frames),
//! `membership` (what an agent knows of the job), `agent` (the agent's state and server),
//! `upload` (a rank's snapshot on its way to its agent), `source` (the chunk source a restore
//! asks).

use std::time::Duration;

use ckpt_store::{Error, ErrorKind};

mod agent;
mod auth;
mod membership;
mod shm;
mod source;
mod upload;
mod wire;

#[cfg(test)]
mod tests;

pub use agent::{AgentState, Holdings, default_memory_limit, holdings, serve};
pub use auth::{PeerSecret, Role};
pub use membership::Membership;
pub use shm::set_mapping;
pub use source::PeerSource;
pub use upload::{Handed, PeerUpload};
pub use wire::{
    Frame, MAX_CHUNK, MAX_HELD, begin_frame, chunk_head, end_frame, held_frame, read_chunk_body,
    read_frame,
};

/// How long connecting to an agent may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long one chunk's transfer to or from an agent may stall before the agent is given up
/// (by default; [`PeerLink::timeout`], from `CKPT_PEER_TIMEOUT_MS` for a launched rank, sets it).
pub const IO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a client may take to answer the agent's challenge.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// The environment variable that hands the job's [`PeerSecret`] (hex) to ranks and agents.
pub const SECRET_ENV: &str = "CKPT_PEER_SECRET";
/// The environment variable that sets an agent's memory limit (bytes; see
/// [`default_memory_limit`]).
pub const MEMORY_LIMIT_ENV: &str = "CKPT_PEER_MEMORY_LIMIT";

/// A rank's view of the agents: where to hand its snapshots and whom to ask on restore. A
/// launched rank gets it from its driver's environment (`ckpt_recovery::RankEnv::peer_link`).
/// Where the copy goes is the agent's business (its [`Membership`]), not the rank's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerLink {
    /// This node.
    pub node: u32,
    /// This node's agent (`host:port`).
    pub agent: String,
    /// Every live agent, this node's first: where a restore looks for chunks.
    pub peers: Vec<String>,
    /// How long a transfer to or from an agent may stall before the agent is given up (the
    /// persist or restore then goes on without it).
    pub timeout: Duration,
    /// The job's secret, proven to every agent.
    pub secret: PeerSecret,
}

/// A protocol violation (`Corrupt`).
fn proto(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::Corrupt, msg)
}

/// A network failure (`Io`) doing `what` with `addr`.
fn net(what: &str, addr: &str, e: std::io::Error) -> Error {
    Error::io(what, &addr, e)
}
