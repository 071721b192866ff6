//! The chunk source a restore asks before the store.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use ckpt_store::{ChunkId, ChunkRef, ChunkSource};
use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tracing::{debug, warn};

use super::auth::{Role, connect};
use super::shm::{LocalView, import, mapping};
use super::{IO_TIMEOUT, PeerSecret};

struct Peer {
    addr: String,
    idle: tokio::sync::Mutex<Vec<TcpStream>>,
    dead: AtomicBool,
    /// What this process mapped of the agent's memory, once asked (`None`: the agent is on
    /// another machine, or mapping is off or failed: chunks come through the socket).
    local: tokio::sync::OnceCell<Option<LocalView>>,
}

/// A [`ChunkSource`] asking the agents in order (this node's first) for each chunk.
pub struct PeerSource {
    peers: Vec<Peer>,
    secret: PeerSecret,
    served: AtomicU64,
    mapped: AtomicU64,
    /// The chunks served out of a mapping (for [`ChunkSource::refused`] to take back).
    mapped_ids: Mutex<std::collections::HashSet<ChunkId>>,
    /// Map same-machine agents' memory (see `shm`).
    map: AtomicBool,
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
        let mut pool = self.1.lock();
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
                    local: tokio::sync::OnceCell::new(),
                })
                .collect(),
            served: AtomicU64::new(0),
            mapped: AtomicU64::new(0),
            mapped_ids: Mutex::default(),
            map: AtomicBool::new(mapping()),
            bufs: Arc::default(),
            timeout,
        })
    }

    /// Raw bytes the agents served so far.
    pub fn served_bytes(&self) -> u64 {
        self.served.load(Ordering::Relaxed)
    }

    /// Of those, the bytes read straight out of a same-machine agent's memory (mapped, not
    /// through its socket).
    pub fn mapped_bytes(&self) -> u64 {
        self.mapped.load(Ordering::Relaxed)
    }

    /// Map the memory of agents on this machine (on by default: see `set_mapping`), or
    /// take every chunk through their sockets, as across machines.
    pub fn map_same_machine(&self, on: bool) {
        self.map.store(on, Ordering::Relaxed);
    }

    /// What this process mapped of `p`'s memory, mapping it on first use.
    async fn local<'a>(&self, p: &'a Peer) -> Option<&'a LocalView> {
        if !self.map.load(Ordering::Relaxed) {
            return None;
        }
        p.local
            .get_or_init(|| async {
                let mapped = tokio::time::timeout(self.timeout, self.map(p)).await;
                match mapped.unwrap_or_else(|_| Err(std::io::Error::other("no answer in time"))) {
                    Ok(v) => {
                        if let Some(v) = &v {
                            debug!(agent = %p.addr, chunks = v.len(), "mapped the memory of a replica agent on this machine");
                        }
                        v
                    }
                    // The agent is down or wedged: the socket path finds out and says so.
                    Err(e) if e.kind() != std::io::ErrorKind::InvalidData => {
                        debug!(agent = %p.addr, "not mapping the replica agent's memory: {e}");
                        None
                    }
                    Err(e) => {
                        warn!(agent = %p.addr, "reading the replica agent through its socket: mapping its memory failed: {e}");
                        None
                    }
                }
            })
            .await
            .as_ref()
    }

    /// Ask `p` for its local socket and map its holdings through it.
    async fn map(&self, p: &Peer) -> std::io::Result<Option<LocalView>> {
        let mut s = self.conn(p).await?;
        s.write_u8(b'L').await?;
        let n = s.read_u8().await? as usize;
        let mut name = vec![0u8; n];
        s.read_exact(&mut name).await?;
        p.idle.lock().await.push(s);
        if n == 0 {
            return Ok(None);
        }
        let name = String::from_utf8(name).map_err(std::io::Error::other)?;
        let (secret, timeout) = (self.secret.clone(), self.timeout);
        tokio::task::spawn_blocking(move || import(&name, &secret, timeout))
            .await?
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()))
    }

    /// An idle connection to `p`, or a new one.
    async fn conn(&self, p: &Peer) -> std::io::Result<TcpStream> {
        let conn = p.idle.lock().await.pop();
        match conn {
            Some(s) => Ok(s),
            None => connect(&p.addr, &self.secret, Role::Rank)
                .await
                .map_err(|e| std::io::Error::other(e.to_string())),
        }
    }

    async fn ask(&self, p: &Peer, id: &ChunkId, len: u64) -> std::io::Result<Option<Bytes>> {
        let mut s = self.conn(p).await?;
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
                let mut buf = self.bufs.lock().pop().unwrap_or_default();
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
            if let Some(b) = self
                .local(p)
                .await
                .and_then(|v| v.get(&r.id, r.len as usize))
            {
                self.served.fetch_add(b.len() as u64, Ordering::Relaxed);
                self.mapped.fetch_add(b.len() as u64, Ordering::Relaxed);
                self.mapped_ids.lock().insert(r.id);
                return Some(b);
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

    fn refused(&self, r: &ChunkRef) {
        warn!(chunk = %r.id, "a replica agent's copy of a chunk failed its hash: read from the store");
        let back = |n: &AtomicU64| {
            let _ = n.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                Some(v.saturating_sub(u64::from(r.len)))
            });
        };
        back(&self.served);
        if self.mapped_ids.lock().remove(&r.id) {
            back(&self.mapped);
        }
    }
}
