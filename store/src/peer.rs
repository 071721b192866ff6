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
//! - **The source** ([`PeerSource`]): a [`ChunkSource`] for the read engine that asks the
//!   agents for a chunk before the store. The read engine checks every chunk it gets against
//!   its hash and reads the store for anything missing or damaged, so an agent can never make
//!   a restore wrong, only faster.
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

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::{TcpListener, TcpStream};
use tracing::{debug, info, warn};

use crate::error::{Error, ErrorKind, Result};
use crate::id::{ChunkId, Hash};
use crate::model::ChunkRef;
use crate::read::ChunkSource;

/// How long connecting to an agent may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long one chunk's transfer to or from an agent may stall before the agent is given up
/// (by default; [`PeerLink::timeout`], from `CKPT_PEER_TIMEOUT_MS` for a launched rank, sets it).
pub const IO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a client may take to answer the agent's challenge.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// The largest chunk a frame may carry: the largest chunk ckpt writes.
pub const MAX_CHUNK: u64 = crate::codec::MAX_CHUNK_LEN;
/// The environment variable that hands the job's [`PeerSecret`] (hex) to ranks and agents.
pub const SECRET_ENV: &str = "CKPT_PEER_SECRET";
/// The environment variable that sets an agent's memory limit (bytes; see
/// [`default_memory_limit`]).
pub const MEMORY_LIMIT_ENV: &str = "CKPT_PEER_MEMORY_LIMIT";

/// Protocol version sent in the agent's challenge.
const VERSION: u8 = 1;

// ---------------------------------------------------------------------------------------
// The secret and the handshake.

/// The job's shared secret: 32 random bytes. Its `Debug` never shows it; it is handed on only
/// through [`SECRET_ENV`] and never written to the store or a log.
#[derive(Clone, PartialEq, Eq)]
pub struct PeerSecret([u8; 32]);

impl std::fmt::Debug for PeerSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PeerSecret(..)")
    }
}

/// In hex (an etcd coordinator hands the secret to the other agents in the job's plan).
impl serde::Serialize for PeerSecret {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> serde::Deserialize<'de> for PeerSecret {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        PeerSecret::from_hex(&s).map_err(serde::de::Error::custom)
    }
}

impl PeerSecret {
    /// 32 bytes from the kernel's random source.
    pub fn generate() -> Result<PeerSecret> {
        use std::io::Read;
        let mut b = [0u8; 32];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut b))
            .map_err(|e| Error::io("reading random bytes from", &"/dev/urandom", e))?;
        Ok(PeerSecret(b))
    }

    /// A secret of these bytes (tests, and secrets kept elsewhere).
    pub fn from_bytes(b: [u8; 32]) -> PeerSecret {
        PeerSecret(b)
    }

    /// Parse 64 hex digits (the error never repeats the text: it may be a secret).
    pub fn from_hex(s: &str) -> Result<PeerSecret> {
        let s = s.trim();
        let bad = || {
            Error::invalid(format!(
                "{SECRET_ENV} must be 64 hex digits (32 bytes), got {} characters that are not",
                s.len()
            ))
        };
        if s.len() != 64 {
            return Err(bad());
        }
        let mut b = [0u8; 32];
        for (i, pair) in s.as_bytes().chunks_exact(2).enumerate() {
            let hex = std::str::from_utf8(pair).map_err(|_| bad())?;
            b[i] = u8::from_str_radix(hex, 16).map_err(|_| bad())?;
        }
        Ok(PeerSecret(b))
    }

    /// The hex form, for [`SECRET_ENV`].
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The secret in [`SECRET_ENV`]; `None` when unset or empty.
    pub fn from_env() -> Result<Option<PeerSecret>> {
        match std::env::var(SECRET_ENV) {
            Ok(s) if !s.trim().is_empty() => PeerSecret::from_hex(&s).map(Some),
            _ => Ok(None),
        }
    }

    fn mac(&self, ctx: &[u8], parts: &[&[u8]]) -> blake3::Hash {
        let mut h = blake3::Hasher::new_keyed(&self.0);
        h.update(ctx);
        for p in parts {
            h.update(p);
        }
        h.finalize()
    }
}

/// Who connects to an agent: a rank (hands its own node's snapshots, reads chunks) or another
/// agent (hands the copy of the node it keeps copies for).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// A rank, or any reader.
    Rank,
    /// A peer agent forwarding its node's snapshots.
    Agent,
}

impl Role {
    fn byte(self) -> u8 {
        match self {
            Role::Rank => b'R',
            Role::Agent => b'P',
        }
    }
}

const CLIENT_CTX: &[u8] = b"ckpt peer v1 client";
const AGENT_CTX: &[u8] = b"ckpt peer v1 agent";

/// The agent's challenge: `H`, the version, a nonce of 32 bytes.
fn challenge(nonce: &[u8; 32]) -> [u8; 34] {
    let mut m = [0u8; 34];
    m[0] = b'H';
    m[1] = VERSION;
    m[2..].copy_from_slice(nonce);
    m
}

/// A client's answer to `challenge`: role u8, its own nonce, the keyed hash of both.
fn answer(secret: &PeerSecret, role: Role, ch: &[u8; 34], mine: &[u8; 32]) -> Result<[u8; 65]> {
    if ch[0] != b'H' || ch[1] != VERSION {
        return Err(proto(format!(
            "the agent's greeting is {:#04x} version {}, not a ckpt replica agent of version {VERSION}",
            ch[0], ch[1]
        )));
    }
    let mac = secret.mac(CLIENT_CTX, &[&[role.byte()], &ch[2..], mine]);
    let mut m = [0u8; 65];
    m[0] = role.byte();
    m[1..33].copy_from_slice(mine);
    m[33..].copy_from_slice(mac.as_bytes());
    Ok(m)
}

/// The agent's proof (`K` and a keyed hash of both nonces), checked by the client.
fn agent_proof(secret: &PeerSecret, ch: &[u8; 34], client_nonce: &[u8]) -> [u8; 33] {
    let mut m = [0u8; 33];
    m[0] = b'K';
    m[1..].copy_from_slice(secret.mac(AGENT_CTX, &[&ch[2..], client_nonce]).as_bytes());
    m
}

fn check_proof(secret: &PeerSecret, ch: &[u8; 34], mine: &[u8; 32], got: &[u8; 33]) -> Result<()> {
    let want = agent_proof(secret, ch, mine);
    let ok = got[0] == b'K' && hash32(&want[1..]) == hash32(&got[1..]);
    if ok {
        Ok(())
    } else {
        Err(Error::new(
            ErrorKind::InvalidInput,
            "the replica agent did not prove the job's secret (another job's agent, or not an agent)",
        ))
    }
}

fn hash32(b: &[u8]) -> blake3::Hash {
    blake3::Hash::from_bytes(<[u8; 32]>::try_from(b).expect("32 bytes"))
}

fn nonce() -> [u8; 32] {
    // A fresh random nonce; /dev/urandom does not fail on Linux, and a fallback that is
    // unique per process and call still never repeats a challenge.
    match PeerSecret::generate() {
        Ok(s) => s.0,
        Err(_) => {
            static N: AtomicU64 = AtomicU64::new(0);
            let t = crate::clock::system_now()
                .timestamp_nanos_opt()
                .unwrap_or_default();
            let n = N.fetch_add(1, Ordering::Relaxed);
            *blake3::hash(format!("{t} {} {n}", std::process::id()).as_bytes()).as_bytes()
        }
    }
}

/// The client side of the handshake over a tokio stream.
async fn client_handshake<S>(s: &mut S, secret: &PeerSecret, role: Role) -> Result<()>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let e = |e| net("authenticating to", "the replica agent", e);
    let mut ch = [0u8; 34];
    s.read_exact(&mut ch).await.map_err(e)?;
    let mine = nonce();
    s.write_all(&answer(secret, role, &ch, &mine)?)
        .await
        .map_err(e)?;
    s.flush().await.map_err(e)?;
    let mut got = [0u8; 33];
    s.read_exact(&mut got)
        .await
        .map_err(|err| proof_unread(err, e))?;
    check_proof(secret, &ch, &mine, &got)
}

/// Why the agent's proof could not be read: a connection the agent closed after our answer
/// means it refused the secret; anything else is `net`'s error.
fn proof_unread(err: std::io::Error, net: impl FnOnce(std::io::Error) -> Error) -> Error {
    if err.kind() == std::io::ErrorKind::UnexpectedEof {
        Error::new(
            ErrorKind::InvalidInput,
            "the replica agent refused this client: CKPT_PEER_SECRET is not the job's",
        )
    } else {
        net(err)
    }
}

/// The same over a blocking socket (the upload thread).
fn client_handshake_blocking(
    s: &mut std::net::TcpStream,
    secret: &PeerSecret,
    role: Role,
) -> Result<()> {
    use std::io::{Read, Write};
    let e = |e| net("authenticating to", "the replica agent", e);
    let mut ch = [0u8; 34];
    s.read_exact(&mut ch).map_err(e)?;
    let mine = nonce();
    s.write_all(&answer(secret, role, &ch, &mine)?).map_err(e)?;
    let mut got = [0u8; 33];
    s.read_exact(&mut got).map_err(|err| proof_unread(err, e))?;
    check_proof(secret, &ch, &mine, &got)
}

/// The agent side: challenge, check the answer; the client's role, or why it was refused.
async fn accept_handshake(s: &mut TcpStream, secret: Option<&PeerSecret>) -> Result<Role> {
    let Some(secret) = secret else {
        return Err(Error::invalid(
            "this agent has no job secret yet: it serves nobody",
        ));
    };
    let e = |e| net("authenticating", "a replica agent client", e);
    let ch = challenge(&nonce());
    s.write_all(&ch).await.map_err(e)?;
    let mut got = [0u8; 65];
    s.read_exact(&mut got).await.map_err(e)?;
    let role = match got[0] {
        b'R' => Role::Rank,
        b'P' => Role::Agent,
        other => return Err(proto(format!("unknown client role {other:#04x}"))),
    };
    let want = secret.mac(CLIENT_CTX, &[&got[..1], &ch[2..], &got[1..33]]);
    // blake3::Hash compares in constant time.
    if want != hash32(&got[33..]) {
        return Err(Error::invalid("the client does not know the job's secret"));
    }
    s.write_all(&agent_proof(secret, &ch, &got[1..33]))
        .await
        .map_err(e)?;
    Ok(role)
}

// ---------------------------------------------------------------------------------------
// Configuration.

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

/// What an agent knows of the job, from its own launch configuration and the job's plans
/// (never from a client's frame).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Membership {
    /// The job's current generation: snapshots of later generations are refused (`None`: not
    /// known yet; every authenticated client's generation is taken).
    pub generation: Option<u64>,
    /// Where copies of this node's snapshots go (`None`: nowhere).
    pub buddy: Option<String>,
    /// The nodes whose copies this agent keeps (`None`: any other node's).
    pub wards: Option<Vec<u32>>,
}

impl Membership {
    /// Node `node`'s view of generation `generation` with these live agents ((node, address),
    /// in node order): its buddy is the next live node's agent (wrapping around), its ward the
    /// previous one's node; alone, neither.
    pub fn of(node: u32, generation: u64, agents: &[(u32, String)]) -> Membership {
        let mut m = Membership {
            generation: Some(generation),
            buddy: None,
            wards: Some(Vec::new()),
        };
        if let Some(i) = agents.iter().position(|(n, _)| *n == node)
            && agents.len() > 1
        {
            let n = agents.len();
            m.buddy = Some(agents[(i + 1) % n].1.clone());
            m.wards = Some(vec![agents[(i + n - 1) % n].0]);
        }
        m
    }

    /// The line a supervisor writes to an agent's standard input when a generation starts:
    /// `members GEN NODE=ADDR,NODE=ADDR,...` (the live agents in node order).
    pub fn line(generation: u64, agents: &[(u32, String)]) -> String {
        let list: Vec<String> = agents.iter().map(|(n, a)| format!("{n}={a}")).collect();
        format!("members {generation} {}\n", list.join(","))
    }

    /// Parse a [`Membership::line`] for node `node`.
    pub fn parse_line(node: u32, line: &str) -> Result<Membership> {
        let bad = |why: &str| {
            Error::invalid(format!(
                "membership line {:?}: {why} (want `members GEN NODE=ADDR,...`)",
                line.trim()
            ))
        };
        let mut it = line.split_whitespace();
        if it.next() != Some("members") {
            return Err(bad("it does not start with `members`"));
        }
        let generation: u64 = it
            .next()
            .ok_or_else(|| bad("no generation"))?
            .parse()
            .map_err(|_| bad("the generation is not a number"))?;
        let mut agents = Vec::new();
        for item in it.next().unwrap_or("").split(',').filter(|s| !s.is_empty()) {
            let (n, a) = item
                .split_once('=')
                .ok_or_else(|| bad("an agent is not NODE=ADDR"))?;
            let n: u32 = n.parse().map_err(|_| bad("a node is not a number"))?;
            agents.push((n, a.to_string()));
        }
        if it.next().is_some() {
            return Err(bad("more than three fields"));
        }
        agents.sort();
        Ok(Membership::of(node, generation, &agents))
    }
}

/// The default memory limit of an agent: a quarter of the machine's memory (`MemTotal`), or
/// 4 GiB where that is unknown.
pub fn default_memory_limit() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(4 << 30, |kib| kib * 1024 / 4)
}

fn proto(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::Corrupt, msg)
}

fn net(what: &str, addr: &str, e: std::io::Error) -> Error {
    Error::io(what, &addr, e)
}

// ---------------------------------------------------------------------------------------
// Frames.

/// One frame sent to an agent, as decoded by [`read_frame`] (a chunk's bytes follow its
/// header and are read by [`read_chunk_body`], once the agent has room for them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// `B`: a snapshot starts.
    Begin {
        /// Node of the rank.
        node: u32,
        /// Rank.
        rank: u32,
        /// The rank's generation.
        generation: u64,
        /// Step.
        step: u64,
    },
    /// `C`: a chunk's header; `len` bytes follow.
    Chunk {
        /// Position in the snapshot.
        seq: u32,
        /// Its length (at most [`MAX_CHUNK`]).
        len: u64,
    },
    /// `E`: the snapshot ends with its chunks' ids.
    End {
        /// Chunk `seq`'s id is `ids[seq]`.
        ids: Vec<ChunkId>,
    },
    /// `A`: the snapshot is abandoned.
    Abandon,
    /// `G`: a chunk is asked for.
    Get(ChunkId),
    /// `S`: the holdings are asked for.
    Holdings,
}

/// Read the next frame from `r`: `Ok(None)` at a clean end of the stream (between frames), a
/// `Corrupt` error naming what is wrong for anything else. An `E` frame may list at most
/// `max_ids` ids (the chunks the snapshot it ends carried); a `C` frame at most [`MAX_CHUNK`]
/// bytes. Allocates no more than the bytes read justify.
pub async fn read_frame<R: AsyncRead + Unpin>(r: &mut R, max_ids: usize) -> Result<Option<Frame>> {
    let op = match r.read_u8().await {
        Ok(op) => op,
        Err(err) if err.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(err) => return Err(net("reading a frame", "agent connection", err)),
    };
    let e = move |err: std::io::Error| {
        if err.kind() == std::io::ErrorKind::UnexpectedEof {
            proto(format!("frame {:?} cut short", op as char))
        } else {
            net("reading a frame", "agent connection", err)
        }
    };
    Ok(Some(match op {
        b'B' => Frame::Begin {
            node: r.read_u32_le().await.map_err(e)?,
            rank: r.read_u32_le().await.map_err(e)?,
            generation: r.read_u64_le().await.map_err(e)?,
            step: r.read_u64_le().await.map_err(e)?,
        },
        b'C' => {
            let seq = r.read_u32_le().await.map_err(e)?;
            let len = r.read_u64_le().await.map_err(e)?;
            if len > MAX_CHUNK {
                return Err(proto(format!(
                    "chunk frame {seq}: {len} bytes, more than any chunk ckpt writes ({MAX_CHUNK})"
                )));
            }
            Frame::Chunk { seq, len }
        }
        b'E' => {
            let n = r.read_u32_le().await.map_err(e)? as usize;
            if n > max_ids {
                return Err(proto(format!(
                    "end frame: {n} chunk ids for a snapshot of {max_ids} chunks"
                )));
            }
            let mut ids = Vec::with_capacity(n.min(1024));
            for _ in 0..n {
                let mut h = [0u8; 32];
                r.read_exact(&mut h).await.map_err(e)?;
                ids.push(ChunkId(Hash(h)));
            }
            Frame::End { ids }
        }
        b'A' => Frame::Abandon,
        b'G' => {
            let mut h = [0u8; 32];
            r.read_exact(&mut h).await.map_err(e)?;
            Frame::Get(ChunkId(Hash(h)))
        }
        b'S' => Frame::Holdings,
        other => return Err(proto(format!("unknown frame {other:#04x}"))),
    }))
}

/// Read a chunk's `len` bytes (after its [`Frame::Chunk`] header). The buffer grows with what
/// arrives (doubling, to exactly `len`), so a length that the stream does not back allocates
/// at most twice what did arrive.
pub async fn read_chunk_body<R: AsyncRead + Unpin>(r: &mut R, len: u64) -> Result<Bytes> {
    if len > MAX_CHUNK {
        return Err(proto(format!("a chunk of {len} bytes")));
    }
    let len = len as usize;
    let mut buf: Vec<u8> = Vec::new();
    while buf.len() < len {
        let step = (len - buf.len()).min(buf.len().max(4096));
        buf.reserve_exact(step);
        let at = buf.len();
        buf.resize(at + step, 0);
        r.read_exact(&mut buf[at..]).await.map_err(|err| {
            if err.kind() == std::io::ErrorKind::UnexpectedEof {
                proto(format!("a chunk of {len} bytes cut short"))
            } else {
                net("reading a chunk", "agent connection", err)
            }
        })?;
    }
    Ok(Bytes::from(buf))
}

// ---------------------------------------------------------------------------------------
// The agent.

struct Snapshot {
    generation: u64,
    step: u64,
    bytes: u64,
    chunks: HashMap<ChunkId, Bytes>,
}

#[derive(Default)]
struct Held {
    snaps: HashMap<(u32, u32), Snapshot>,
    /// Bytes of the snapshots held.
    held: u64,
    /// Bytes of snapshots still arriving (reserved before each chunk is read).
    inflight: u64,
}

/// What an agent holds and knows, shared by its connections.
pub struct AgentState {
    node: u32,
    limit: u64,
    secret: RwLock<Option<PeerSecret>>,
    members: RwLock<Membership>,
    held: Mutex<Held>,
}

/// An agent's holdings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct Holdings {
    /// Snapshots (one per node and rank).
    pub snapshots: u64,
    /// Chunks.
    pub chunks: u64,
    /// Raw bytes.
    pub bytes: u64,
}

impl AgentState {
    /// A new, empty agent of node `node` that serves clients proving `secret` (nobody while it
    /// is `None`: see [`AgentState::set_secret`]) and holds at most `limit` bytes of snapshots
    /// (arriving ones included).
    pub fn new(node: u32, secret: Option<PeerSecret>, limit: u64) -> Arc<Self> {
        Arc::new(AgentState {
            node,
            limit,
            secret: RwLock::new(secret),
            members: RwLock::new(Membership::default()),
            held: Mutex::new(Held::default()),
        })
    }

    /// Set the job's secret (an etcd agent learns it from the job's plan).
    pub fn set_secret(&self, secret: PeerSecret) {
        *self.secret.write().expect("secret") = Some(secret);
    }

    /// Set what the agent knows of the job (its launch configuration, then each plan).
    pub fn set_membership(&self, m: Membership) {
        info!(
            node = self.node,
            generation = ?m.generation,
            buddy = ?m.buddy,
            wards = ?m.wards,
            "replica agent membership"
        );
        *self.members.write().expect("members") = m;
    }

    /// What the agent knows of the job.
    pub fn membership(&self) -> Membership {
        self.members.read().expect("members").clone()
    }

    /// The memory limit (bytes).
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// What it holds.
    pub fn holdings(&self) -> Holdings {
        let h = self.held.lock().expect("agent");
        Holdings {
            snapshots: h.snaps.len() as u64,
            chunks: h.snaps.values().map(|s| s.chunks.len() as u64).sum(),
            bytes: h.held,
        }
    }

    /// The chunk `id`, from any snapshot held.
    pub fn get(&self, id: &ChunkId) -> Option<Bytes> {
        let h = self.held.lock().expect("agent");
        h.snaps.values().find_map(|s| s.chunks.get(id).cloned())
    }

    /// May a client of `role` hand over a snapshot of (`node`, `generation`)? An agent keeps
    /// its own ranks' snapshots and those of the nodes it keeps copies for, of generations up
    /// to the job's current one.
    fn admit(&self, role: Role, node: u32, generation: u64) -> Result<()> {
        let m = self.members.read().expect("members");
        if let Some(g) = m.generation
            && generation > g
        {
            return Err(Error::invalid(format!(
                "a snapshot of generation {generation} is refused: the job is at generation {g}"
            )));
        }
        let ok = match role {
            Role::Rank => node == self.node,
            Role::Agent => node != self.node && m.wards.as_ref().is_none_or(|w| w.contains(&node)),
        };
        if !ok {
            return Err(Error::invalid(format!(
                "a snapshot of node {node} from {} is refused: the agent of node {} keeps its own \
                 ranks' snapshots and copies of nodes {:?} only",
                match role {
                    Role::Rank => "a rank",
                    Role::Agent => "a peer agent",
                },
                self.node,
                m.wards
            )));
        }
        Ok(())
    }

    /// Reserve room for `n` more bytes of an arriving snapshot, within the memory limit.
    fn reserve(&self, n: u64) -> Result<()> {
        let mut h = self.held.lock().expect("agent");
        if h.held + h.inflight + n > self.limit {
            return Err(Error::invalid(format!(
                "memory limit: a chunk of {n} bytes is refused ({} bytes held, {} arriving, \
                 limit {}; --memory-limit or {MEMORY_LIMIT_ENV} raise it)",
                h.held, h.inflight, self.limit
            )));
        }
        h.inflight += n;
        Ok(())
    }

    fn release(&self, n: u64) {
        let mut h = self.held.lock().expect("agent");
        h.inflight = h.inflight.saturating_sub(n);
    }

    /// Keep `snap` (whose `reserved` bytes were reserved) as the newest of (node, rank) unless
    /// a newer one is held; a snapshot of a newer generation drops every snapshot of older ones
    /// (their layout is gone, and the new generation restored before it saved).
    fn insert(&self, node: u32, rank: u32, snap: Snapshot, reserved: u64) {
        let mut h = self.held.lock().expect("agent");
        h.inflight = h.inflight.saturating_sub(reserved);
        let mut dropped = 0;
        h.snaps.retain(|_, s| {
            let keep = s.generation >= snap.generation;
            if !keep {
                dropped += s.bytes;
            }
            keep
        });
        h.held -= dropped;
        match h.snaps.get(&(node, rank)) {
            Some(old) if (old.generation, old.step) > (snap.generation, snap.step) => {}
            _ => {
                h.held += snap.bytes;
                if let Some(old) = h.snaps.insert((node, rank), snap) {
                    h.held -= old.bytes;
                }
            }
        }
    }

    fn secret(&self) -> Option<PeerSecret> {
        self.secret.read().expect("secret").clone()
    }
}

/// Serve agent connections on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, state: Arc<AgentState>) -> Result<()> {
    loop {
        let (sock, from) = listener
            .accept()
            .await
            .map_err(|e| net("accepting a connection", "agent", e))?;
        let _ = sock.set_nodelay(true);
        let state = state.clone();
        tokio::spawn(async move {
            if let Err(e) = connection(sock, state, from).await {
                debug!(%from, "agent connection ended: {e}");
            }
        });
    }
}

/// A snapshot arriving on a connection; what it reserved goes back if it never ends.
struct Incoming {
    node: u32,
    rank: u32,
    generation: u64,
    step: u64,
    /// Forward to the buddy (it came from one of this node's ranks).
    forward: bool,
    chunks: Vec<(u32, Bytes)>,
    reserved: u64,
    state: Arc<AgentState>,
}

impl Drop for Incoming {
    fn drop(&mut self) {
        if self.reserved > 0 {
            self.state.release(self.reserved);
        }
    }
}

async fn connection(
    mut sock: TcpStream,
    state: Arc<AgentState>,
    from: std::net::SocketAddr,
) -> Result<()> {
    let secret = state.secret();
    let role = match tokio::time::timeout(
        HANDSHAKE_TIMEOUT,
        accept_handshake(&mut sock, secret.as_ref()),
    )
    .await
    {
        Ok(Ok(role)) => role,
        Ok(Err(e)) => {
            warn!(%from, "replica agent: connection refused: {e}");
            return Ok(());
        }
        Err(_) => {
            warn!(%from, "replica agent: connection refused: no answer to the challenge in time");
            return Ok(());
        }
    };
    let (r, w) = sock.into_split();
    let mut r = BufReader::with_capacity(1 << 20, r);
    let mut w = BufWriter::new(w);
    let mut cur: Option<Incoming> = None;
    let refused = |e: Error| {
        warn!(%from, "replica agent: {e}");
        e
    };
    loop {
        let max_ids = cur.as_ref().map_or(0, |c| c.chunks.len());
        let Some(frame) = read_frame(&mut r, max_ids).await? else {
            return Ok(());
        };
        match frame {
            Frame::Begin {
                node,
                rank,
                generation,
                step,
            } => {
                state.admit(role, node, generation).map_err(refused)?;
                cur = Some(Incoming {
                    node,
                    rank,
                    generation,
                    step,
                    forward: role == Role::Rank,
                    chunks: Vec::new(),
                    reserved: 0,
                    state: state.clone(),
                });
            }
            Frame::Chunk { seq, len } => {
                let Some(c) = cur.as_mut() else {
                    return Err(proto("a chunk outside a snapshot"));
                };
                state.reserve(len).map_err(|e| {
                    warn!(%from, node = c.node, rank = c.rank, step = c.step, "replica agent: {e}");
                    e
                })?;
                c.reserved += len;
                let data = read_chunk_body(&mut r, len).await?;
                c.chunks.push((seq, data));
            }
            Frame::End { ids } => {
                let Some(c) = cur.take() else {
                    return Err(proto("a snapshot end without its start"));
                };
                finish(&state, c, ids);
                let we = |err| net("answering", "agent connection", err);
                w.write_u8(b'O').await.map_err(we)?;
                w.flush().await.map_err(we)?;
            }
            Frame::Abandon => cur = None,
            Frame::Get(id) => {
                let we = |err| net("answering", "agent connection", err);
                match state.get(&id) {
                    Some(b) => {
                        w.write_u8(b'Y').await.map_err(we)?;
                        w.write_u64_le(b.len() as u64).await.map_err(we)?;
                        w.write_all(&b).await.map_err(we)?;
                    }
                    None => w.write_u8(b'N').await.map_err(we)?,
                }
                w.flush().await.map_err(we)?;
            }
            Frame::Holdings => {
                let h = state.holdings();
                let we = |err| net("answering", "agent connection", err);
                for v in [h.snapshots, h.chunks, h.bytes] {
                    w.write_u64_le(v).await.map_err(we)?;
                }
                w.flush().await.map_err(we)?;
            }
        }
    }
}

/// A snapshot arrived whole: keep it and, when it is one of this node's, forward it to the
/// buddy the agent's membership names.
fn finish(state: &Arc<AgentState>, mut c: Incoming, ids: Vec<ChunkId>) {
    let mut chunks = HashMap::with_capacity(c.chunks.len());
    let mut ordered = Vec::with_capacity(c.chunks.len());
    for (seq, b) in std::mem::take(&mut c.chunks) {
        if let Some(id) = ids.get(seq as usize) {
            chunks.insert(*id, b.clone());
            ordered.push((seq, b));
        }
    }
    let bytes: u64 = chunks.values().map(|b| b.len() as u64).sum();
    info!(
        node = c.node,
        rank = c.rank,
        step = c.step,
        chunks = chunks.len(),
        bytes,
        "snapshot held"
    );
    let reserved = std::mem::take(&mut c.reserved);
    state.insert(
        c.node,
        c.rank,
        Snapshot {
            generation: c.generation,
            step: c.step,
            bytes,
            chunks,
        },
        reserved,
    );
    let buddy = match (c.forward, state.membership().buddy, state.secret()) {
        (true, Some(b), Some(s)) => (b, s),
        _ => return,
    };
    let head = Begin {
        node: c.node,
        rank: c.rank,
        generation: c.generation,
        step: c.step,
    };
    tokio::spawn(async move {
        let (addr, secret) = buddy;
        let fwd = forward(&addr, &secret, &head, &ordered, &ids);
        // A buddy that stops reading must not pin old snapshots here for ever.
        let limit = IO_TIMEOUT + Duration::from_secs(ordered.len() as u64);
        let res = tokio::time::timeout(limit, fwd)
            .await
            .unwrap_or_else(|_| Err(Error::internal("the buddy agent stopped taking the copy")));
        if let Err(e) = res {
            warn!(buddy = %addr, rank = head.rank, step = head.step, "copy to the buddy agent failed: {e}");
        }
    });
}

struct Begin {
    node: u32,
    rank: u32,
    generation: u64,
    step: u64,
}

impl Begin {
    fn encode(&self) -> [u8; 25] {
        let mut v = [0u8; 25];
        v[0] = b'B';
        v[1..5].copy_from_slice(&self.node.to_le_bytes());
        v[5..9].copy_from_slice(&self.rank.to_le_bytes());
        v[9..17].copy_from_slice(&self.generation.to_le_bytes());
        v[17..25].copy_from_slice(&self.step.to_le_bytes());
        v
    }
}

/// The bytes of a `B` frame (for tests and tools that speak the protocol).
pub fn begin_frame(node: u32, rank: u32, generation: u64, step: u64) -> Vec<u8> {
    Begin {
        node,
        rank,
        generation,
        step,
    }
    .encode()
    .to_vec()
}

/// The header of a `C` frame; `len` bytes follow it.
pub fn chunk_head(seq: u32, len: usize) -> [u8; 13] {
    let mut h = [0u8; 13];
    h[0] = b'C';
    h[1..5].copy_from_slice(&seq.to_le_bytes());
    h[5..13].copy_from_slice(&(len as u64).to_le_bytes());
    h
}

/// The bytes of an `E` frame.
pub fn end_frame(ids: &[ChunkId]) -> Vec<u8> {
    let mut v = Vec::with_capacity(5 + 32 * ids.len());
    v.push(b'E');
    v.extend_from_slice(&(ids.len() as u32).to_le_bytes());
    for id in ids {
        v.extend_from_slice(&id.0.0);
    }
    v
}

/// Connect to the agent at `addr` and prove the secret.
async fn connect(addr: &str, secret: &PeerSecret, role: Role) -> Result<TcpStream> {
    let mut s = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr))
        .await
        .map_err(|_| {
            net(
                "connecting to the agent",
                addr,
                std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out"),
            )
        })?
        .map_err(|e| net("connecting to the agent", addr, e))?;
    let _ = s.set_nodelay(true);
    tokio::time::timeout(HANDSHAKE_TIMEOUT, client_handshake(&mut s, secret, role))
        .await
        .map_err(|_| {
            Error::internal(format!("the agent at {addr} did not authenticate in time"))
        })??;
    Ok(s)
}

async fn forward(
    addr: &str,
    secret: &PeerSecret,
    head: &Begin,
    chunks: &[(u32, Bytes)],
    ids: &[ChunkId],
) -> Result<()> {
    let s = connect(addr, secret, Role::Agent).await?;
    let mut w = BufWriter::with_capacity(1 << 20, s);
    let e = |e| net("copying a snapshot to", addr, e);
    w.write_all(&head.encode()).await.map_err(e)?;
    for (seq, b) in chunks {
        w.write_all(&chunk_head(*seq, b.len())).await.map_err(e)?;
        w.write_all(b).await.map_err(e)?;
    }
    w.write_all(&end_frame(ids)).await.map_err(e)?;
    w.flush().await.map_err(e)?;
    let mut s = w.into_inner();
    expect_kept(s.read_u8().await, addr)?;
    s.shutdown().await.map_err(e)?;
    Ok(())
}

/// The agent's answer to an `E` frame: `O`, the snapshot is kept; a closed connection: it
/// was refused (the agent's log says why).
fn expect_kept(got: std::io::Result<u8>, addr: &str) -> Result<()> {
    match got {
        Ok(b'O') => Ok(()),
        Ok(other) => Err(proto(format!(
            "the replica agent at {addr} answered {other:#04x} to a snapshot's end"
        ))),
        Err(e) => Err(Error::new(
            ErrorKind::InvalidInput,
            format!(
                "the replica agent at {addr} refused the snapshot ({e}); its log says why \
                 (memory limit, generation or node)"
            ),
        )),
    }
}

/// Ask the agent at `addr` what it holds.
pub async fn holdings(addr: &str, secret: &PeerSecret) -> Result<Holdings> {
    let mut s = connect(addr, secret, Role::Rank).await?;
    let e = |e| net("asking the agent", addr, e);
    s.write_u8(b'S').await.map_err(e)?;
    Ok(Holdings {
        snapshots: s.read_u64_le().await.map_err(e)?,
        chunks: s.read_u64_le().await.map_err(e)?,
        bytes: s.read_u64_le().await.map_err(e)?,
    })
}

// ---------------------------------------------------------------------------------------
// The upload, from a rank.

enum Msg {
    Chunk(u32, Bytes),
    End(Vec<ChunkId>),
}

/// One snapshot on its way to the node's agent: a thread writes what [`PeerUpload::chunk`]
/// queues (a bounded queue: a slow agent slows the persist, never grows memory); dropping the
/// upload without [`PeerUpload::finish`] abandons it. A failure to reach the agent is a
/// warning: replicas are an optimization and the store has everything.
pub struct PeerUpload {
    tx: tokio::sync::Mutex<Option<tokio::sync::mpsc::Sender<Msg>>>,
    done: tokio::sync::Mutex<Option<tokio::sync::oneshot::Receiver<Result<u64>>>>,
    seq: AtomicU64,
}

impl PeerUpload {
    /// Start handing snapshot `step` of `rank` (generation `generation`) to `link`'s agent;
    /// at most `queue` chunks wait.
    pub fn start(link: &PeerLink, generation: u64, rank: u32, step: u64, queue: usize) -> Self {
        let (tx, rx) = tokio::sync::mpsc::channel::<Msg>(queue.max(1));
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        let head = Begin {
            node: link.node,
            rank,
            generation,
            step,
        };
        let addr = link.agent.clone();
        let timeout = link.timeout;
        let secret = link.secret.clone();
        let started = std::thread::Builder::new()
            .name(format!("ckpt-peer-{rank}"))
            .spawn(move || {
                let _ = done_tx.send(upload(&addr, &secret, head, rx, timeout));
            });
        if let Err(e) = started {
            warn!("peer replica: the upload thread did not start: {e}");
        }
        PeerUpload {
            tx: tokio::sync::Mutex::new(Some(tx)),
            done: tokio::sync::Mutex::new(Some(done_rx)),
            seq: AtomicU64::new(0),
        }
    }

    /// Queue the next chunk (waits while the queue is full).
    pub async fn chunk(&self, data: Bytes) {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed) as u32;
        let mut tx = self.tx.lock().await;
        if let Some(t) = tx.as_ref()
            && t.send(Msg::Chunk(seq, data)).await.is_err()
        {
            *tx = None; // the writer gave up; its error comes from finish
        }
    }

    /// End the snapshot with the ids of the chunks queued, in order; returns the bytes the
    /// agent took.
    pub async fn finish(&self, ids: Vec<ChunkId>) -> Result<u64> {
        let tx = self.tx.lock().await.take();
        let queued = self.seq.load(Ordering::Relaxed);
        if ids.len() as u64 != queued {
            return Err(Error::internal(format!(
                "peer replica: {queued} chunks were queued but the manifest lists {}",
                ids.len()
            )));
        }
        if let Some(tx) = tx {
            let _ = tx.send(Msg::End(ids)).await;
        }
        let done = self.done.lock().await.take();
        match done {
            Some(rx) => rx
                .await
                .unwrap_or_else(|_| Err(Error::internal("the peer upload thread died"))),
            None => Err(Error::internal("the snapshot was already ended")),
        }
    }
}

fn upload(
    addr: &str,
    secret: &PeerSecret,
    head: Begin,
    mut rx: tokio::sync::mpsc::Receiver<Msg>,
    timeout: Duration,
) -> Result<u64> {
    use std::io::Write;
    use std::net::ToSocketAddrs;
    let to = addr
        .to_socket_addrs()
        .map_err(|e| net("resolving the replica agent", addr, e))?
        .next()
        .ok_or_else(|| {
            Error::invalid(format!(
                "replica agent address {addr:?} resolves to nothing"
            ))
        })?;
    let mut s = std::net::TcpStream::connect_timeout(&to, CONNECT_TIMEOUT)
        .map_err(|e| net("connecting to the replica agent", addr, e))?;
    // A stopped or wedged agent must not hold up the persist: a write that cannot go on for
    // this long ends the upload, and the persist goes on without a replica.
    s.set_write_timeout(Some(timeout))
        .and_then(|()| s.set_read_timeout(Some(timeout)))
        .map_err(|e| net("setting a timeout for", addr, e))?;
    let _ = s.set_nodelay(true);
    client_handshake_blocking(&mut s, secret, Role::Rank)?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, s);
    // An agent that refuses a snapshot closes the connection at once, possibly while chunks
    // are still on their way: a write that finds it closed is that refusal, not a network
    // fault.
    let e = |err: std::io::Error| match err.kind() {
        std::io::ErrorKind::BrokenPipe
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::ConnectionAborted => {
            expect_kept(Err(err), addr).expect_err("a closed connection is a refusal")
        }
        _ => net("handing a snapshot to the replica agent", addr, err),
    };
    w.write_all(&head.encode()).map_err(e)?;
    let mut bytes = 0u64;
    while let Some(m) = rx.blocking_recv() {
        match m {
            Msg::Chunk(seq, b) => {
                w.write_all(&chunk_head(seq, b.len())).map_err(e)?;
                w.write_all(&b).map_err(e)?;
                bytes += b.len() as u64;
            }
            Msg::End(ids) => {
                use std::io::Read;
                w.write_all(&end_frame(&ids)).map_err(e)?;
                w.flush().map_err(e)?;
                let mut ok = [0u8; 1];
                let got = w.get_mut().read_exact(&mut ok).map(|()| ok[0]);
                expect_kept(got, addr)?;
                return Ok(bytes);
            }
        }
    }
    let _ = w.write_all(b"A");
    let _ = w.flush();
    Err(Error::internal("the snapshot was abandoned"))
}

// ---------------------------------------------------------------------------------------
// The source, for a restore.

struct Peer {
    addr: String,
    idle: tokio::sync::Mutex<Vec<TcpStream>>,
    dead: AtomicBool,
}

/// A [`ChunkSource`] asking the agents in order (this node's first) for each chunk.
pub struct PeerSource {
    peers: Vec<Peer>,
    secret: PeerSecret,
    served: AtomicU64,
    bufs: Arc<Mutex<Vec<Vec<u8>>>>,
    timeout: Duration,
}

/// Receive buffers kept for reuse (memory touched before fills faster than new memory); why
/// this is not `direct`'s aligned pool: see `direct::READ_BUFS`.
const KEEP_BUFS: usize = 16;

/// The owner of a received chunk's `Bytes`: its buffer goes back to the source's pool.
struct Pooled(Vec<u8>, Arc<Mutex<Vec<Vec<u8>>>>);

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        let mut pool = self.1.lock().expect("buffers");
        if pool.len() < KEEP_BUFS {
            pool.push(std::mem::take(&mut self.0));
        }
    }
}

impl std::fmt::Debug for PeerSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let addrs: Vec<&str> = self.peers.iter().map(|p| p.addr.as_str()).collect();
        write!(f, "PeerSource({addrs:?})")
    }
}

impl PeerSource {
    /// A source over the agents at `addrs` of the job whose secret is `secret`, giving an
    /// agent up after [`IO_TIMEOUT`] without progress.
    pub fn new(addrs: &[String], secret: &PeerSecret) -> Arc<Self> {
        Self::with_timeout(addrs, secret, IO_TIMEOUT)
    }

    /// The same with another timeout.
    pub fn with_timeout(addrs: &[String], secret: &PeerSecret, timeout: Duration) -> Arc<Self> {
        Arc::new(PeerSource {
            secret: secret.clone(),
            peers: addrs
                .iter()
                .map(|a| Peer {
                    addr: a.clone(),
                    idle: tokio::sync::Mutex::new(Vec::new()),
                    dead: AtomicBool::new(false),
                })
                .collect(),
            served: AtomicU64::new(0),
            bufs: Arc::default(),
            timeout,
        })
    }

    /// Raw bytes the agents served so far.
    pub fn served_bytes(&self) -> u64 {
        self.served.load(Ordering::Relaxed)
    }

    async fn ask(&self, p: &Peer, id: &ChunkId, len: u64) -> std::io::Result<Option<Bytes>> {
        let conn = p.idle.lock().await.pop();
        let mut s = match conn {
            Some(s) => s,
            None => connect(&p.addr, &self.secret, Role::Rank)
                .await
                .map_err(|e| std::io::Error::other(e.to_string()))?,
        };
        let mut req = [0u8; 33];
        req[0] = b'G';
        req[1..].copy_from_slice(&id.0.0);
        s.write_all(&req).await?;
        let out = match s.read_u8().await? {
            b'Y' => {
                let n = s.read_u64_le().await?;
                if n != len {
                    return Err(std::io::Error::other(format!(
                        "the agent sent {n} bytes for a chunk of {len}"
                    )));
                }
                let mut buf = self.bufs.lock().expect("buffers").pop().unwrap_or_default();
                buf.resize(n as usize, 0);
                s.read_exact(&mut buf).await?;
                Some(Bytes::from_owner(Pooled(buf, self.bufs.clone())))
            }
            b'N' => None,
            other => return Err(std::io::Error::other(format!("answer {other:#04x}"))),
        };
        p.idle.lock().await.push(s);
        Ok(out)
    }
}

#[async_trait]
impl ChunkSource for PeerSource {
    async fn fetch(&self, r: &ChunkRef) -> Option<Bytes> {
        for p in &self.peers {
            if p.dead.load(Ordering::Relaxed) {
                continue;
            }
            let asked = tokio::time::timeout(self.timeout, self.ask(p, &r.id, r.len as u64)).await;
            match asked.unwrap_or_else(|_| Err(std::io::Error::other("no answer in time"))) {
                Ok(Some(b)) => {
                    self.served.fetch_add(b.len() as u64, Ordering::Relaxed);
                    return Some(b);
                }
                Ok(None) => {}
                Err(e) => {
                    warn!(agent = %p.addr, "replica agent unreachable, not asked again: {e}");
                    p.dead.store(true, Ordering::Relaxed);
                }
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret() -> PeerSecret {
        PeerSecret::from_bytes([7; 32])
    }

    async fn agent_of(node: u32) -> (String, Arc<AgentState>) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let st = AgentState::new(node, Some(secret()), u64::MAX);
        tokio::spawn(serve(l, st.clone()));
        (addr, st)
    }

    async fn agent() -> (String, Arc<AgentState>) {
        agent_of(0).await
    }

    fn chunk(data: &[u8]) -> ChunkRef {
        ChunkRef {
            id: ChunkId::of(data),
            len: data.len() as u32,
            stored: data.len() as u32,
            codec: crate::codec::Codec::Raw,
            pack: None,
            offset: 0,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_snapshot_reaches_the_agent_and_its_buddy_and_is_served_by_id() {
        let (a, sa) = agent_of(0).await;
        let (b, sb) = agent_of(1).await;
        let agents = [(0, a.clone()), (1, b.clone())];
        sa.set_membership(Membership::of(0, 1, &agents));
        sb.set_membership(Membership::of(1, 1, &agents));
        let link = PeerLink {
            node: 0,
            agent: a.clone(),
            peers: vec![a.clone(), b.clone()],
            timeout: IO_TIMEOUT,
            secret: secret(),
        };
        let data: Vec<Vec<u8>> = (0..5u8).map(|i| vec![i; 1000 + i as usize]).collect();
        let ids: Vec<ChunkId> = data.iter().map(|d| ChunkId::of(d)).collect();
        let up = PeerUpload::start(&link, 1, 3, 7, 2);
        for d in &data {
            up.chunk(Bytes::from(d.clone())).await;
        }
        let sent = up.finish(ids).await.unwrap();
        assert_eq!(sent, data.iter().map(|d| d.len() as u64).sum::<u64>());
        // The buddy's copy arrives asynchronously.
        for _ in 0..200 {
            if sb.holdings().chunks == 5 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(sa.holdings().chunks, 5);
        assert_eq!(sb.holdings(), sa.holdings());
        assert_eq!(holdings(&b, &secret()).await.unwrap(), sb.holdings());

        // Served by id from the buddy alone (the node's agent is gone), nothing for others.
        let src = PeerSource::new(&["127.0.0.1:1".to_string(), b.clone()], &secret());
        for d in &data {
            assert_eq!(src.fetch(&chunk(d)).await.unwrap(), Bytes::from(d.clone()));
        }
        assert!(src.fetch(&chunk(b"not there")).await.is_none());
        assert_eq!(src.served_bytes(), sent);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_abandoned_snapshot_is_not_kept_and_newer_generations_replace_older() {
        let (a, sa) = agent_of(1).await;
        let link = PeerLink {
            node: 1,
            agent: a.clone(),
            peers: vec![a.clone()],
            timeout: IO_TIMEOUT,
            secret: secret(),
        };
        let up = PeerUpload::start(&link, 1, 0, 1, 4);
        up.chunk(Bytes::from_static(b"half")).await;
        drop(up);
        let up = PeerUpload::start(&link, 1, 0, 2, 4);
        up.chunk(Bytes::from_static(b"old generation")).await;
        up.finish(vec![ChunkId::of(b"old generation")])
            .await
            .unwrap();
        let up = PeerUpload::start(&link, 2, 5, 3, 4);
        up.chunk(Bytes::from_static(b"new generation")).await;
        up.finish(vec![ChunkId::of(b"new generation")])
            .await
            .unwrap();
        // A wrong count is refused and nothing of it is kept.
        let up = PeerUpload::start(&link, 2, 5, 4, 4);
        up.chunk(Bytes::from_static(b"x")).await;
        assert!(up.finish(vec![]).await.is_err());
        drop(up);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(sa.get(&ChunkId::of(b"half")).is_none());
        assert!(sa.get(&ChunkId::of(b"old generation")).is_none());
        assert!(sa.get(&ChunkId::of(b"new generation")).is_some());
        assert_eq!(sa.holdings().snapshots, 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_wedged_agent_holds_up_neither_a_persist_nor_a_restore() {
        // Accepts connections, never reads or answers (a SIGSTOPped agent looks like this).
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let held = Arc::new(Mutex::new(Vec::new()));
        let h2 = held.clone();
        tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                h2.lock().unwrap().push(s);
            }
        });
        let t = Duration::from_millis(300);
        let link = PeerLink {
            node: 0,
            agent: addr.clone(),
            peers: vec![addr.clone()],
            timeout: t,
            secret: secret(),
        };
        let t0 = std::time::Instant::now();
        let up = PeerUpload::start(&link, 0, 0, 1, 2);
        let big = Bytes::from(vec![7u8; 4 << 20]);
        for _ in 0..16 {
            up.chunk(big.clone()).await; // 64 MiB: far past the socket buffers
        }
        assert!(up.finish(vec![ChunkId::of(&big); 16]).await.is_err());
        let src = PeerSource::with_timeout(&[addr], &secret(), t);
        assert!(src.fetch(&chunk(&big)).await.is_none());
        assert!(
            src.fetch(&chunk(&big)).await.is_none(),
            "given up, not asked again"
        );
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    }

    /// An authenticated connection, as a rank.
    async fn authed(addr: &str) -> TcpStream {
        connect(addr, &secret(), Role::Rank).await.unwrap()
    }

    #[tokio::test]
    async fn hostile_frames_end_the_connection_without_allocating() {
        let (a, sa) = agent().await;
        let mut s = authed(&a).await;
        s.write_all(&chunk_head(0, 0)).await.unwrap(); // a chunk outside a snapshot
        let mut s2 = authed(&a).await;
        let mut f = begin_frame(0, 0, 0, 0);
        f.extend_from_slice(&chunk_head(0, 0)[..5]);
        f.extend_from_slice(&u64::MAX.to_le_bytes());
        s2.write_all(&f).await.unwrap();
        let mut one = [0u8; 1];
        assert_eq!(s.read(&mut one).await.unwrap(), 0, "closed");
        assert_eq!(s2.read(&mut one).await.unwrap(), 0, "closed");
        assert_eq!(sa.holdings(), Holdings::default());
    }

    #[tokio::test]
    async fn the_memory_limit_and_the_membership_bound_what_an_agent_takes() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let a = l.local_addr().unwrap().to_string();
        let st = AgentState::new(2, Some(secret()), 10_000);
        tokio::spawn(serve(l, st.clone()));
        st.set_membership(Membership::parse_line(2, "members 5 1=x:1,2=y:2,3=z:3").unwrap());
        assert_eq!(st.membership().buddy.as_deref(), Some("z:3"));
        assert_eq!(st.membership().wards, Some(vec![1]));
        let link = PeerLink {
            node: 2,
            agent: a.clone(),
            peers: vec![a.clone()],
            timeout: IO_TIMEOUT,
            secret: secret(),
        };
        let send = |generation, step, data: Vec<u8>| {
            let link = link.clone();
            async move {
                let up = PeerUpload::start(&link, generation, 0, step, 4);
                let id = ChunkId::of(&data);
                up.chunk(Bytes::from(data)).await;
                up.finish(vec![id]).await
            }
        };
        // Beyond the limit: refused, nothing kept, nothing left reserved.
        assert!(send(5, 1, vec![1; 20_000]).await.is_err());
        assert_eq!(st.holdings(), Holdings::default());
        // A generation later than the job's: refused (it would evict everything).
        assert!(send(6, 1, vec![2; 100]).await.is_err());
        send(5, 2, vec![3; 6_000]).await.unwrap();
        assert_eq!(st.holdings().bytes, 6_000);
        // The next snapshot of the same rank needs room next to the one it replaces.
        assert!(send(5, 3, vec![4; 6_000]).await.is_err());
        send(5, 3, vec![4; 3_000]).await.unwrap();
        assert_eq!(st.holdings().bytes, 3_000);
        // A rank of another node cannot park its snapshot here.
        let mut other = link.clone();
        other.node = 7;
        let up = PeerUpload::start(&other, 5, 0, 9, 4);
        up.chunk(Bytes::from_static(b"x")).await;
        assert!(up.finish(vec![ChunkId::of(b"x")]).await.is_err());
        assert_eq!(st.holdings().snapshots, 1);
        assert!(Membership::parse_line(0, "members x").is_err());
        assert!(Membership::parse_line(0, "hello 1 0=a").is_err());
    }

    #[tokio::test]
    async fn a_client_without_the_secret_is_refused_and_an_impostor_agent_is_noticed() {
        let (a, _) = agent().await;
        let wrong = PeerSecret::from_bytes([8; 32]);
        let e = connect(&a, &wrong, Role::Rank).await.unwrap_err();
        assert!(e.to_string().contains("CKPT_PEER_SECRET"), "{e}");
        assert!(holdings(&a, &wrong).await.is_err());
        // A client knowing the secret notices an agent that does not.
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let b = l.local_addr().unwrap().to_string();
        let st = AgentState::new(0, Some(wrong), u64::MAX);
        tokio::spawn(serve(l, st));
        assert!(connect(&b, &secret(), Role::Rank).await.is_err());
        // Secrets: hex round trip, no text in errors or Debug.
        let s = PeerSecret::generate().unwrap();
        assert_eq!(PeerSecret::from_hex(&s.to_hex()).unwrap(), s);
        assert!(!format!("{s:?}").contains(&s.to_hex()[..8]));
        let bad = "zz".repeat(32);
        let e = PeerSecret::from_hex(&bad).unwrap_err();
        assert!(!e.to_string().contains("zz"), "{e}");
    }
}
