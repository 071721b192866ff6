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
use tracing::warn;

use super::auth::{Role, connect};
use super::{IO_TIMEOUT, PeerSecret};

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
