//! The agent: what it holds and knows, its server, the copy to its buddy.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use ckpt_store::{ChunkId, Error, Result};
use parking_lot::{Mutex, RwLock};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tracing::{debug, info, warn};

use super::auth::{Role, accept_handshake, connect};
use super::shm::{Arena, Listed, Place, send_export, socket_name};
use super::wire::{Begin, Frame, Kept, chunk_head, end_frame, expect_kept, held_frame, read_frame};
use super::{HANDSHAKE_TIMEOUT, IO_TIMEOUT, MEMORY_LIMIT_ENV, Membership, PeerSecret, net, proto};

struct Snapshot {
    generation: u64,
    step: u64,
    bytes: u64,
    chunks: HashMap<ChunkId, HeldChunk>,
}

/// A chunk held: its bytes and, when they are in shared memory, where (for a same-machine
/// client's mapping).
#[derive(Clone)]
struct HeldChunk {
    bytes: Bytes,
    place: Option<Place>,
}

#[derive(Default)]
struct Held {
    /// The newest snapshot of each (node, rank).
    snaps: HashMap<(u32, u32), Snapshot>,
    /// The one before it, while memory allows: a step's snapshot arrives before the step
    /// commits, and when that step never commits (a rank of the job dies during its save) the
    /// job resumes from the one before, which peers then still hold. Evicted first whenever
    /// an arriving snapshot needs the room.
    prev: HashMap<(u32, u32), Snapshot>,
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
    /// The abstract Unix socket a same-machine client maps the holdings through.
    local: RwLock<Option<String>>,
}

/// An agent's holdings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct Holdings {
    /// Snapshots: the newest of each node and rank, and the one before it while memory
    /// allows.
    pub snapshots: u64,
    /// Chunks.
    pub chunks: u64,
    /// Raw bytes.
    pub bytes: u64,
}

impl Held {
    /// Every snapshot held, the newest of each rank and those before them.
    fn all(&self) -> impl Iterator<Item = &Snapshot> {
        self.snaps.values().chain(self.prev.values())
    }
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
            local: RwLock::new(None),
        })
    }

    /// Set the job's secret (an etcd agent learns it from the job's plan).
    pub fn set_secret(&self, secret: PeerSecret) {
        *self.secret.write() = Some(secret);
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
        *self.members.write() = m;
    }

    /// What the agent knows of the job.
    pub fn membership(&self) -> Membership {
        self.members.read().clone()
    }

    /// The name of the abstract Unix socket same-machine clients map the holdings through.
    pub fn local_socket(&self) -> Option<String> {
        self.local.read().clone()
    }

    /// The memory limit (bytes).
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// What it holds.
    pub fn holdings(&self) -> Holdings {
        let h = self.held.lock();
        Holdings {
            snapshots: h.all().count() as u64,
            chunks: h.all().map(|s| s.chunks.len() as u64).sum(),
            bytes: h.held,
        }
    }

    /// The steps held of (`node`, `rank`), newest first.
    pub fn steps_of(&self, node: u32, rank: u32) -> Vec<u64> {
        let h = self.held.lock();
        [h.snaps.get(&(node, rank)), h.prev.get(&(node, rank))]
            .into_iter()
            .flatten()
            .map(|s| s.step)
            .collect()
    }

    /// The chunks of `ids` held (in any snapshot: content addressing makes them the same
    /// bytes), and how many of them are not.
    fn take_held(&self, ids: &[ChunkId]) -> (Vec<(ChunkId, HeldChunk)>, u32) {
        let h = self.held.lock();
        let mut found = Vec::with_capacity(ids.len());
        let mut missing = 0u32;
        for id in ids {
            match h.all().find_map(|s| s.chunks.get(id)) {
                Some(c) => found.push((*id, c.clone())),
                None => missing += 1,
            }
        }
        (found, missing)
    }

    /// The chunk `id`, from any snapshot held.
    pub fn get(&self, id: &ChunkId) -> Option<Bytes> {
        let h = self.held.lock();
        h.all()
            .find_map(|s| s.chunks.get(id).map(|c| c.bytes.clone()))
    }

    /// Every chunk held in shared memory and where it lies (what `X` exports).
    fn shared_chunks(&self) -> Vec<Listed> {
        let h = self.held.lock();
        h.all()
            .flat_map(|s| s.chunks.iter())
            .filter_map(|(id, c)| {
                c.place.clone().map(|place| Listed {
                    id: *id,
                    place,
                    len: c.bytes.len(),
                })
            })
            .collect()
    }

    /// May a client of `role` hand over a snapshot of (`node`, `generation`)? An agent keeps
    /// its own ranks' snapshots and those of the nodes it keeps copies for, of generations up
    /// to the job's current one.
    fn admit(&self, role: Role, node: u32, generation: u64) -> Result<()> {
        let m = self.members.read();
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

    /// Reserve room for `n` more bytes of an arriving snapshot, within the memory limit,
    /// evicting snapshots older than a rank's newest (the oldest first) to make it.
    fn reserve(&self, n: u64) -> Result<()> {
        let mut h = self.held.lock();
        while h.held + h.inflight + n > self.limit {
            let Some(key) = h
                .prev
                .iter()
                .min_by_key(|(_, s)| (s.generation, s.step))
                .map(|(k, _)| *k)
            else {
                break;
            };
            let gone = h.prev.remove(&key).expect("found above");
            h.held -= gone.bytes;
            debug!(
                node = key.0,
                rank = key.1,
                step = gone.step,
                "older snapshot evicted for room"
            );
        }
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
        let mut h = self.held.lock();
        h.inflight = h.inflight.saturating_sub(n);
    }

    /// Keep `snap` (whose `reserved` bytes were reserved) as the newest of (node, rank) unless
    /// a newer one is held, the newest it replaces as the one before it (one of the same step
    /// it replaces outright); a snapshot of a
    /// newer generation drops every snapshot of older ones (their layout is gone, and the new
    /// generation restored before it saved).
    fn insert(&self, node: u32, rank: u32, snap: Snapshot, reserved: u64) {
        let mut h = self.held.lock();
        h.inflight = h.inflight.saturating_sub(reserved);
        let mut dropped = 0;
        let mut older = |_: &(u32, u32), s: &mut Snapshot| {
            let keep = s.generation >= snap.generation;
            if !keep {
                dropped += s.bytes;
            }
            keep
        };
        h.snaps.retain(&mut older);
        h.prev.retain(&mut older);
        h.held -= dropped;
        let key = (node, rank);
        let at = |s: &Snapshot| (s.generation, s.step);
        match h.snaps.get(&key) {
            // Arrived late: a newer one is held already.
            Some(newest) if at(newest) > at(&snap) => {}
            // The same snapshot again (a buddy's copy in full after one without chunks it
            // lacked): it replaces the one held.
            Some(newest) if at(newest) == at(&snap) => {
                h.held += snap.bytes;
                if let Some(old) = h.snaps.insert(key, snap) {
                    h.held -= old.bytes;
                }
            }
            _ => {
                h.held += snap.bytes;
                if let Some(newest) = h.snaps.insert(key, snap)
                    && let Some(gone) = h.prev.insert(key, newest)
                {
                    h.held -= gone.bytes;
                }
            }
        }
    }

    fn secret(&self) -> Option<PeerSecret> {
        self.secret.read().clone()
    }
}

/// Serve agent connections on `listener` until the task is dropped; and, on an abstract Unix
/// socket, same-machine clients that map the holdings (see `shm`).
pub async fn serve(listener: TcpListener, state: Arc<AgentState>) -> Result<()> {
    let _local = serve_local(&state);
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
    chunks: Vec<(u32, Bytes, Option<Place>)>,
    /// Chunks its `K` frames named that the agent holds (shared, not copied).
    held: Vec<(ChunkId, HeldChunk)>,
    /// Chunks its `K` frames named that the agent does not hold.
    missing: u32,
    /// Where its chunks' bytes go.
    arena: Arena,
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
                    held: Vec::new(),
                    missing: 0,
                    arena: Arena::default(),
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
                let (data, place) = c.arena.read_chunk(&mut r, len).await?;
                c.chunks.push((seq, data, place));
            }
            Frame::Held { ids } => {
                let Some(c) = cur.as_mut() else {
                    return Err(proto("held chunks outside a snapshot"));
                };
                let (found, missing) = state.take_held(&ids);
                // Counted like arriving chunks: the snapshot holds them too (the bytes are
                // shared with the snapshot they came from, so this errs on the safe side).
                let len: u64 = found.iter().map(|(_, h)| h.bytes.len() as u64).sum();
                state.reserve(len).map_err(|e| {
                    warn!(%from, node = c.node, rank = c.rank, step = c.step, "replica agent: {e}");
                    e
                })?;
                c.reserved += len;
                c.held.extend(found);
                c.missing += missing;
            }
            Frame::End { ids } => {
                let Some(c) = cur.take() else {
                    return Err(proto("a snapshot end without its start"));
                };
                let missing = finish(&state, c, ids);
                let we = |err| net("answering", "agent connection", err);
                if missing == 0 {
                    w.write_u8(b'O').await.map_err(we)?;
                } else {
                    w.write_u8(b'P').await.map_err(we)?;
                    w.write_u32_le(missing).await.map_err(we)?;
                }
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
            Frame::Local => {
                let name = state.local.read().clone().unwrap_or_default();
                let we = |err| net("answering", "agent connection", err);
                w.write_u8(name.len() as u8).await.map_err(we)?;
                w.write_all(name.as_bytes()).await.map_err(we)?;
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
/// buddy the agent's membership names. Returns how many of the chunks its `K` frames named
/// the agent did not hold (the snapshot is kept without them).
fn finish(state: &Arc<AgentState>, mut c: Incoming, ids: Vec<ChunkId>) -> u32 {
    let mut chunks = HashMap::with_capacity(c.chunks.len() + c.held.len());
    let mut ordered = Vec::with_capacity(c.chunks.len());
    for (seq, b, place) in std::mem::take(&mut c.chunks) {
        if let Some(id) = ids.get(seq as usize) {
            chunks.insert(
                *id,
                HeldChunk {
                    bytes: b.clone(),
                    place,
                },
            );
            ordered.push((seq, b));
        }
    }
    let held = std::mem::take(&mut c.held);
    let kept: Vec<(ChunkId, Bytes)> = held.iter().map(|(id, h)| (*id, h.bytes.clone())).collect();
    for (id, h) in held {
        chunks.entry(id).or_insert(h);
    }
    let missing = c.missing;
    let bytes: u64 = chunks.values().map(|c| c.bytes.len() as u64).sum();
    info!(
        node = c.node,
        rank = c.rank,
        step = c.step,
        chunks = chunks.len(),
        bytes,
        unchanged = kept.len(),
        "snapshot held"
    );
    if missing > 0 {
        warn!(
            node = c.node,
            rank = c.rank,
            step = c.step,
            missing,
            "snapshot held without chunks its rank named unchanged that this agent does not hold"
        );
    }
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
        _ => return missing,
    };
    let head = Begin {
        node: c.node,
        rank: c.rank,
        generation: c.generation,
        step: c.step,
    };
    tokio::spawn(async move {
        let (addr, secret) = buddy;
        let copy = BuddyCopy {
            head: &head,
            chunks: &ordered,
            ids: &ids,
            kept: &kept,
        };
        // A buddy that stops reading must not pin old snapshots here for ever.
        let limit = IO_TIMEOUT + Duration::from_secs((ordered.len() + kept.len()) as u64);
        let res = tokio::time::timeout(limit, forward(&addr, &secret, copy))
            .await
            .unwrap_or_else(|_| Err(Error::internal("the buddy agent stopped taking the copy")));
        if let Err(e) = res {
            warn!(buddy = %addr, rank = head.rank, step = head.step, "copy to the buddy agent failed: {e}");
        }
    });
    missing
}

/// A snapshot as it goes to the buddy: the chunks that arrived (with their `seq`), the ids
/// of their `E` frame, and the chunks taken unchanged from what this agent held.
#[derive(Clone, Copy)]
struct BuddyCopy<'a> {
    head: &'a Begin,
    chunks: &'a [(u32, Bytes)],
    ids: &'a [ChunkId],
    kept: &'a [(ChunkId, Bytes)],
}

/// Copy a snapshot to the buddy at `addr`: the chunks taken unchanged named in a `K` frame
/// (the buddy holds them from the copy before), and sent again in full when the buddy
/// answers that it does not hold some of them (it restarted, or missed the copy before).
async fn forward(addr: &str, secret: &PeerSecret, copy: BuddyCopy<'_>) -> Result<()> {
    if send_copy(addr, secret, copy, false).await? == Kept::Partial {
        debug!(buddy = %addr, rank = copy.head.rank, step = copy.head.step,
            "the buddy lacked unchanged chunks: copying the snapshot in full");
        send_copy(addr, secret, copy, true).await?;
    }
    Ok(())
}

async fn send_copy(
    addr: &str,
    secret: &PeerSecret,
    copy: BuddyCopy<'_>,
    full: bool,
) -> Result<Kept> {
    let s = connect(addr, secret, Role::Agent).await?;
    let mut w = BufWriter::with_capacity(1 << 20, s);
    let e = |e| net("copying a snapshot to", addr, e);
    w.write_all(&copy.head.encode()).await.map_err(e)?;
    for (seq, b) in copy.chunks {
        w.write_all(&chunk_head(*seq, b.len())).await.map_err(e)?;
        w.write_all(b).await.map_err(e)?;
    }
    let mut ids = copy.ids.to_vec();
    if full {
        // The unchanged chunks as chunks of their own, after the others.
        for (id, b) in copy.kept {
            w.write_all(&chunk_head(ids.len() as u32, b.len()))
                .await
                .map_err(e)?;
            w.write_all(b).await.map_err(e)?;
            ids.push(*id);
        }
    } else if !copy.kept.is_empty() {
        let held: Vec<ChunkId> = copy.kept.iter().map(|(id, _)| *id).collect();
        w.write_all(&held_frame(&held)).await.map_err(e)?;
    }
    w.write_all(&end_frame(&ids)).await.map_err(e)?;
    w.flush().await.map_err(e)?;
    let mut s = w.into_inner();
    let kept = expect_kept(s.read_u8().await, addr)?;
    if kept == Kept::Partial {
        s.read_u32_le().await.map_err(e)?;
    }
    s.shutdown().await.map_err(e)?;
    Ok(kept)
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

/// The task serving same-machine clients on an abstract Unix socket (aborted when dropped);
/// `None` where no such socket can be made (the holdings are then served by TCP only).
fn serve_local(state: &Arc<AgentState>) -> Option<AbortOnDrop> {
    use std::os::linux::net::SocketAddrExt;
    let name = socket_name();
    let bound = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
        .and_then(|a| std::os::unix::net::UnixListener::bind_addr(&a))
        .and_then(|l| {
            l.set_nonblocking(true)?;
            UnixListener::from_std(l)
        });
    let listener = match bound {
        Ok(l) => l,
        Err(e) => {
            debug!("no local socket for same-machine clients ({e}): they use TCP");
            return None;
        }
    };
    *state.local.write() = Some(name);
    let state = state.clone();
    Some(AbortOnDrop(tokio::spawn(async move {
        while let Ok((sock, _)) = listener.accept().await {
            let state = state.clone();
            tokio::spawn(async move {
                if let Err(e) = local_connection(sock, state).await {
                    debug!("local agent connection ended: {e}");
                }
            });
        }
    })))
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A same-machine client: the handshake, then `X`, answered with the export.
async fn local_connection(mut sock: UnixStream, state: Arc<AgentState>) -> Result<()> {
    let secret = state.secret();
    let role = tokio::time::timeout(
        HANDSHAKE_TIMEOUT,
        accept_handshake(&mut sock, secret.as_ref()),
    )
    .await
    .map_err(|_| Error::invalid("no answer to the challenge in time"))??;
    if role != Role::Rank {
        return Err(Error::invalid("only a rank maps an agent's memory"));
    }
    let e = |err| net("exporting to", "a local client", err);
    let mut op = [0u8];
    tokio::time::timeout(IO_TIMEOUT, sock.read_exact(&mut op))
        .await
        .map_err(|_| Error::invalid("no request in time"))?
        .map_err(e)?;
    if op[0] != b'X' {
        return Err(proto(format!("unknown local request {:#04x}", op[0])));
    }
    let mut s = sock.into_std().map_err(e)?;
    s.set_nonblocking(false).map_err(e)?;
    s.set_write_timeout(Some(IO_TIMEOUT)).map_err(e)?;
    let chunks = state.shared_chunks();
    tokio::task::spawn_blocking(move || send_export(&mut s, &chunks))
        .await
        .map_err(|j| Error::internal(format!("the export task: {j}")))?
        .map_err(e)
}
