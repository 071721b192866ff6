//! A rank's snapshot on its way to its node's agent.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use ckpt_store::{ChunkId, Error, Result};
use tracing::warn;

use super::auth::{Role, client_handshake_blocking};
use super::wire::{Begin, Kept, chunk_head, end_frame, expect_kept, held_frame};
use super::{CONNECT_TIMEOUT, PeerLink, PeerSecret, net};

enum Msg {
    Chunk(u32, Bytes),
    End(Vec<ChunkId>, Vec<ChunkId>),
}

/// What the agent took of a snapshot ([`PeerUpload::finish`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Handed {
    /// Bytes sent.
    pub bytes: u64,
    /// Chunks named unchanged that the agent did not hold: its copy lacks them, and the next
    /// snapshot should send every chunk.
    pub missing: u32,
}

/// One snapshot on its way to the node's agent: a thread writes what [`PeerUpload::chunk`]
/// queues (a bounded queue: a slow agent slows the persist, never grows memory); dropping the
/// upload without [`PeerUpload::finish`] abandons it. A failure to reach the agent is a
/// warning: replicas are an optimization and the store has everything.
pub struct PeerUpload {
    tx: tokio::sync::Mutex<Option<tokio::sync::mpsc::Sender<Msg>>>,
    done: tokio::sync::Mutex<Option<tokio::sync::oneshot::Receiver<Result<Handed>>>>,
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

    /// End the snapshot with the ids of the chunks queued, in order, and those of its chunks
    /// not queued because they are unchanged since the snapshot before, which the agent holds
    /// (`held`: the agent takes them from its holdings, no bytes sent).
    pub async fn finish(&self, ids: Vec<ChunkId>, held: Vec<ChunkId>) -> Result<Handed> {
        let tx = self.tx.lock().await.take();
        let queued = self.seq.load(Ordering::Relaxed);
        if ids.len() as u64 != queued {
            return Err(Error::internal(format!(
                "peer replica: {queued} chunks were queued but the manifest lists {}",
                ids.len()
            )));
        }
        if let Some(tx) = tx {
            let _ = tx.send(Msg::End(ids, held)).await;
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
) -> Result<Handed> {
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
            Msg::End(ids, held) => {
                use std::io::Read;
                if !held.is_empty() {
                    w.write_all(&held_frame(&held)).map_err(e)?;
                }
                w.write_all(&end_frame(&ids)).map_err(e)?;
                w.flush().map_err(e)?;
                let mut ok = [0u8; 1];
                let got = w.get_mut().read_exact(&mut ok).map(|()| ok[0]);
                let mut missing = 0;
                if expect_kept(got, addr)? == Kept::Partial {
                    let mut n = [0u8; 4];
                    w.get_mut().read_exact(&mut n).map_err(e)?;
                    missing = u32::from_le_bytes(n);
                }
                return Ok(Handed { bytes, missing });
            }
        }
    }
    let _ = w.write_all(b"A");
    let _ = w.flush();
    Err(Error::internal("the snapshot was abandoned"))
}
