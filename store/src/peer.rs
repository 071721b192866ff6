//! Peer replicas: the newest snapshot of every rank held in host memory by a per-node agent,
//! with a copy at another node's agent, so that after a node is lost the survivors read its
//! shards from memory instead of the store.
//!
//! Three parts speak one small protocol over TCP (loopback for simulated nodes, the network
//! across machines):
//!
//! - **The agent** ([`serve`], run by `ckpt replica-agent`): one per node; it outlives the
//!   rank processes a supervisor stops and restarts. It keeps, per (node, rank), the chunks
//!   of the newest snapshot it was handed, forwards what its own ranks hand it to a buddy
//!   agent on another node, and answers requests for chunks by id.
//! - **The upload** ([`PeerUpload`], used by the save pipeline): while a rank persists a save,
//!   each chunk's raw bytes go to the node's agent as well (in order, through a bounded
//!   queue), and once the manifest is known, the chunk ids.
//! - **The source** ([`PeerSource`]): a [`ChunkSource`] for the read engine that asks the
//!   agents for a chunk before the store. The read engine checks every chunk it gets against
//!   its hash and reads the store for anything missing or damaged, so an agent can never make
//!   a restore wrong, only faster.
//!
//! Frames (integers little-endian): `B` node u32, rank u32, generation u64, step u64, then a
//! u16-prefixed buddy address (empty: do not forward) starts a snapshot; `C` seq u32, len u64,
//! bytes is one chunk; `E` n u32 then n ids of 32 bytes ends it (chunk `seq` has id `seq`);
//! `A` abandons it. `G` id asks for a chunk: the answer is `Y` len u64 bytes, or `N`. `S` asks
//! for the agent's holdings: three u64 (snapshots, chunks, bytes).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
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

/// The largest chunk a frame may carry (no allocation is driven by an untrusted length).
pub const MAX_CHUNK: u64 = 1 << 30;
/// The most chunks one snapshot may list.
const MAX_IDS: u32 = 1 << 24;

/// A rank's view of the agents: where to hand its snapshots, where they are copied, and
/// whom to ask on restore. A launched rank gets it from its driver's environment
/// (`ckpt_recovery::RankEnv::peer_link`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerLink {
    /// This node.
    pub node: u32,
    /// This node's agent (`host:port`).
    pub agent: String,
    /// The agent that keeps the copy (another node's), if any.
    pub buddy: Option<String>,
    /// Every live agent, this node's first: where a restore looks for chunks.
    pub peers: Vec<String>,
    /// How long a transfer to or from an agent may stall before the agent is given up (the
    /// persist or restore then goes on without it).
    pub timeout: Duration,
}

fn proto(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::Corrupt, msg)
}

fn net(what: &str, addr: &str, e: std::io::Error) -> Error {
    Error::io(what, &addr, e)
}

// ---------------------------------------------------------------------------------------
// The agent.

struct Snapshot {
    generation: u64,
    step: u64,
    chunks: HashMap<ChunkId, Bytes>,
}

/// What an agent holds, shared by its connections.
#[derive(Default)]
pub struct AgentState {
    snaps: Mutex<HashMap<(u32, u32), Snapshot>>,
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
    /// A new, empty agent.
    pub fn new() -> Arc<Self> {
        Arc::new(AgentState::default())
    }

    /// What it holds.
    pub fn holdings(&self) -> Holdings {
        let snaps = self.snaps.lock().expect("agent");
        let mut h = Holdings {
            snapshots: snaps.len() as u64,
            ..Holdings::default()
        };
        for s in snaps.values() {
            h.chunks += s.chunks.len() as u64;
            h.bytes += s.chunks.values().map(|b| b.len() as u64).sum::<u64>();
        }
        h
    }

    /// The chunk `id`, from any snapshot held.
    pub fn get(&self, id: &ChunkId) -> Option<Bytes> {
        let snaps = self.snaps.lock().expect("agent");
        snaps.values().find_map(|s| s.chunks.get(id).cloned())
    }

    /// Keep `snap` as the newest of (node, rank) unless a newer one is held; a snapshot of a
    /// newer generation drops every snapshot of older ones (their layout is gone, and the new
    /// generation restored before it saved).
    fn insert(&self, node: u32, rank: u32, snap: Snapshot) {
        let mut snaps = self.snaps.lock().expect("agent");
        snaps.retain(|_, s| s.generation >= snap.generation);
        match snaps.get(&(node, rank)) {
            Some(old) if (old.generation, old.step) > (snap.generation, snap.step) => {}
            _ => {
                snaps.insert((node, rank), snap);
            }
        }
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
            if let Err(e) = connection(sock, state).await {
                debug!(%from, "agent connection ended: {e}");
            }
        });
    }
}

struct Incoming {
    node: u32,
    rank: u32,
    generation: u64,
    step: u64,
    buddy: String,
    chunks: Vec<(u32, Bytes)>,
}

async fn connection(sock: TcpStream, state: Arc<AgentState>) -> Result<()> {
    let (r, w) = sock.into_split();
    let mut r = BufReader::with_capacity(1 << 20, r);
    let mut w = BufWriter::new(w);
    let mut cur: Option<Incoming> = None;
    let e = |e: std::io::Error| net("reading a frame", "agent connection", e);
    loop {
        let op = match r.read_u8().await {
            Ok(op) => op,
            Err(err) if err.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(err) => return Err(e(err)),
        };
        match op {
            b'B' => {
                let node = r.read_u32_le().await.map_err(e)?;
                let rank = r.read_u32_le().await.map_err(e)?;
                let generation = r.read_u64_le().await.map_err(e)?;
                let step = r.read_u64_le().await.map_err(e)?;
                let n = r.read_u16_le().await.map_err(e)? as usize;
                let mut buddy = vec![0u8; n];
                r.read_exact(&mut buddy).await.map_err(e)?;
                let buddy = String::from_utf8(buddy).map_err(|_| proto("buddy address"))?;
                cur = Some(Incoming {
                    node,
                    rank,
                    generation,
                    step,
                    buddy,
                    chunks: Vec::new(),
                });
            }
            b'C' => {
                let seq = r.read_u32_le().await.map_err(e)?;
                let len = r.read_u64_le().await.map_err(e)?;
                if len > MAX_CHUNK {
                    return Err(proto(format!("a chunk of {len} bytes is absurd")));
                }
                let mut buf = vec![0u8; len as usize];
                r.read_exact(&mut buf).await.map_err(e)?;
                let Some(c) = cur.as_mut() else {
                    return Err(proto("a chunk outside a snapshot"));
                };
                c.chunks.push((seq, Bytes::from(buf)));
            }
            b'E' => {
                let n = r.read_u32_le().await.map_err(e)?;
                if n > MAX_IDS {
                    return Err(proto(format!("{n} chunk ids is absurd")));
                }
                let mut ids = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    let mut h = [0u8; 32];
                    r.read_exact(&mut h).await.map_err(e)?;
                    ids.push(ChunkId(Hash(h)));
                }
                let Some(c) = cur.take() else {
                    return Err(proto("a snapshot end without its start"));
                };
                finish(&state, c, ids);
            }
            b'A' => cur = None,
            b'G' => {
                let mut h = [0u8; 32];
                r.read_exact(&mut h).await.map_err(e)?;
                let we = |err| net("answering", "agent connection", err);
                match state.get(&ChunkId(Hash(h))) {
                    Some(b) => {
                        w.write_u8(b'Y').await.map_err(we)?;
                        w.write_u64_le(b.len() as u64).await.map_err(we)?;
                        w.write_all(&b).await.map_err(we)?;
                    }
                    None => w.write_u8(b'N').await.map_err(we)?,
                }
                w.flush().await.map_err(we)?;
            }
            b'S' => {
                let h = state.holdings();
                let we = |err| net("answering", "agent connection", err);
                for v in [h.snapshots, h.chunks, h.bytes] {
                    w.write_u64_le(v).await.map_err(we)?;
                }
                w.flush().await.map_err(we)?;
            }
            other => return Err(proto(format!("unknown frame {other:#04x}"))),
        }
    }
}

/// A snapshot arrived whole: keep it and forward it to the buddy.
fn finish(state: &Arc<AgentState>, c: Incoming, ids: Vec<ChunkId>) {
    let mut chunks = HashMap::with_capacity(c.chunks.len());
    let mut ordered = Vec::with_capacity(c.chunks.len());
    for (seq, b) in c.chunks {
        if let Some(id) = ids.get(seq as usize) {
            chunks.insert(*id, b.clone());
            ordered.push((seq, b));
        }
    }
    let bytes: u64 = ordered.iter().map(|(_, b)| b.len() as u64).sum();
    info!(
        node = c.node,
        rank = c.rank,
        step = c.step,
        chunks = chunks.len(),
        bytes,
        "snapshot held"
    );
    state.insert(
        c.node,
        c.rank,
        Snapshot {
            generation: c.generation,
            step: c.step,
            chunks,
        },
    );
    if c.buddy.is_empty() {
        return;
    }
    tokio::spawn(async move {
        let head = Begin {
            node: c.node,
            rank: c.rank,
            generation: c.generation,
            step: c.step,
            buddy: String::new(),
        };
        let fwd = forward(&c.buddy, &head, &ordered, &ids);
        // A buddy that stops reading must not pin old snapshots here for ever.
        let limit = IO_TIMEOUT + Duration::from_secs(ordered.len() as u64);
        let res = tokio::time::timeout(limit, fwd)
            .await
            .unwrap_or_else(|_| Err(Error::internal("the buddy agent stopped taking the copy")));
        if let Err(e) = res {
            warn!(buddy = %c.buddy, rank = c.rank, step = c.step, "copy to the buddy agent failed: {e}");
        }
    });
}

struct Begin {
    node: u32,
    rank: u32,
    generation: u64,
    step: u64,
    buddy: String,
}

impl Begin {
    fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(27 + self.buddy.len());
        v.push(b'B');
        v.extend_from_slice(&self.node.to_le_bytes());
        v.extend_from_slice(&self.rank.to_le_bytes());
        v.extend_from_slice(&self.generation.to_le_bytes());
        v.extend_from_slice(&self.step.to_le_bytes());
        v.extend_from_slice(&(self.buddy.len() as u16).to_le_bytes());
        v.extend_from_slice(self.buddy.as_bytes());
        v
    }
}

fn chunk_head(seq: u32, len: usize) -> [u8; 13] {
    let mut h = [0u8; 13];
    h[0] = b'C';
    h[1..5].copy_from_slice(&seq.to_le_bytes());
    h[5..13].copy_from_slice(&(len as u64).to_le_bytes());
    h
}

fn end_frame(ids: &[ChunkId]) -> Vec<u8> {
    let mut v = Vec::with_capacity(5 + 32 * ids.len());
    v.push(b'E');
    v.extend_from_slice(&(ids.len() as u32).to_le_bytes());
    for id in ids {
        v.extend_from_slice(&id.0.0);
    }
    v
}

async fn forward(addr: &str, head: &Begin, chunks: &[(u32, Bytes)], ids: &[ChunkId]) -> Result<()> {
    let s = TcpStream::connect(addr)
        .await
        .map_err(|e| net("connecting to the buddy agent", addr, e))?;
    let _ = s.set_nodelay(true);
    let mut w = BufWriter::with_capacity(1 << 20, s);
    let e = |e| net("copying a snapshot to", addr, e);
    w.write_all(&head.encode()).await.map_err(e)?;
    for (seq, b) in chunks {
        w.write_all(&chunk_head(*seq, b.len())).await.map_err(e)?;
        w.write_all(b).await.map_err(e)?;
    }
    w.write_all(&end_frame(ids)).await.map_err(e)?;
    w.flush().await.map_err(e)?;
    w.into_inner().shutdown().await.map_err(e)?;
    Ok(())
}

/// Ask the agent at `addr` what it holds.
pub async fn holdings(addr: &str) -> Result<Holdings> {
    let mut s = TcpStream::connect(addr)
        .await
        .map_err(|e| net("connecting to the agent", addr, e))?;
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
            buddy: link.buddy.clone().unwrap_or_default(),
        };
        let addr = link.agent.clone();
        let timeout = link.timeout;
        let started = std::thread::Builder::new()
            .name(format!("ckpt-peer-{rank}"))
            .spawn(move || {
                let _ = done_tx.send(upload(&addr, head, rx, timeout));
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
    let s = std::net::TcpStream::connect_timeout(&to, CONNECT_TIMEOUT)
        .map_err(|e| net("connecting to the replica agent", addr, e))?;
    // A stopped or wedged agent must not hold up the persist: a write that cannot go on for
    // this long ends the upload, and the persist goes on without a replica.
    s.set_write_timeout(Some(timeout))
        .map_err(|e| net("setting a timeout for", addr, e))?;
    let _ = s.set_nodelay(true);
    let mut w = std::io::BufWriter::with_capacity(1 << 20, s);
    let e = |e| net("handing a snapshot to the replica agent", addr, e);
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
                w.write_all(&end_frame(&ids)).map_err(e)?;
                w.flush().map_err(e)?;
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
    served: AtomicU64,
    bufs: Arc<Mutex<Vec<Vec<u8>>>>,
    timeout: Duration,
}

/// Receive buffers kept for reuse (memory touched before fills faster than new memory).
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
    /// A source over the agents at `addrs`, giving an agent up after [`IO_TIMEOUT`] without
    /// progress.
    pub fn new(addrs: &[String]) -> Arc<Self> {
        Self::with_timeout(addrs, IO_TIMEOUT)
    }

    /// The same with another timeout.
    pub fn with_timeout(addrs: &[String], timeout: Duration) -> Arc<Self> {
        Arc::new(PeerSource {
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
            None => {
                let s = tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(&p.addr))
                    .await
                    .map_err(|_| std::io::Error::other("connect timed out"))??;
                s.set_nodelay(true)?;
                s
            }
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

    async fn agent() -> (String, Arc<AgentState>) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let st = AgentState::new();
        tokio::spawn(serve(l, st.clone()));
        (addr, st)
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
        let (a, sa) = agent().await;
        let (b, sb) = agent().await;
        let link = PeerLink {
            node: 0,
            agent: a.clone(),
            buddy: Some(b.clone()),
            peers: vec![a.clone(), b.clone()],
            timeout: IO_TIMEOUT,
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
        assert_eq!(holdings(&b).await.unwrap(), sb.holdings());

        // Served by id from the buddy alone (the node's agent is gone), nothing for others.
        let src = PeerSource::new(&["127.0.0.1:1".to_string(), b.clone()]);
        for d in &data {
            assert_eq!(src.fetch(&chunk(d)).await.unwrap(), Bytes::from(d.clone()));
        }
        assert!(src.fetch(&chunk(b"not there")).await.is_none());
        assert_eq!(src.served_bytes(), sent);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_abandoned_snapshot_is_not_kept_and_newer_generations_replace_older() {
        let (a, sa) = agent().await;
        let link = PeerLink {
            node: 1,
            agent: a.clone(),
            buddy: None,
            peers: vec![a.clone()],
            timeout: IO_TIMEOUT,
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
            buddy: None,
            peers: vec![addr.clone()],
            timeout: t,
        };
        let t0 = std::time::Instant::now();
        let up = PeerUpload::start(&link, 0, 0, 1, 2);
        let big = Bytes::from(vec![7u8; 4 << 20]);
        for _ in 0..16 {
            up.chunk(big.clone()).await; // 64 MiB: far past the socket buffers
        }
        assert!(up.finish(vec![ChunkId::of(&big); 16]).await.is_err());
        let src = PeerSource::with_timeout(&[addr], t);
        assert!(src.fetch(&chunk(&big)).await.is_none());
        assert!(
            src.fetch(&chunk(&big)).await.is_none(),
            "given up, not asked again"
        );
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    }

    #[tokio::test]
    async fn hostile_frames_end_the_connection_without_allocating() {
        let (a, sa) = agent().await;
        let mut s = TcpStream::connect(&a).await.unwrap();
        s.write_all(&chunk_head(0, 0)).await.unwrap(); // a chunk outside a snapshot
        let mut s2 = TcpStream::connect(&a).await.unwrap();
        let mut f = Begin {
            node: 0,
            rank: 0,
            generation: 0,
            step: 0,
            buddy: String::new(),
        }
        .encode();
        f.extend_from_slice(&chunk_head(0, 0)[..5]);
        f.extend_from_slice(&u64::MAX.to_le_bytes());
        s2.write_all(&f).await.unwrap();
        let mut one = [0u8; 1];
        assert_eq!(s.read(&mut one).await.unwrap(), 0, "closed");
        assert_eq!(s2.read(&mut one).await.unwrap(), 0, "closed");
        assert_eq!(sa.holdings(), Holdings::default());
    }
}
