//! The frames on an agent connection: their encoding and the decoder an agent runs.

use bytes::Bytes;
use ckpt_store::{ChunkId, Error, ErrorKind, Hash, Result};
use tokio::io::{AsyncRead, AsyncReadExt};

use super::{net, proto};

/// The largest chunk a frame may carry: the largest chunk ckpt writes.
pub const MAX_CHUNK: u64 = ckpt_store::codec::MAX_CHUNK_LEN;

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
    /// `K`: chunks of the snapshot that its sender did not send because they are unchanged
    /// since its previous one, which the agent holds: the agent takes them from what it holds
    /// of the same node and rank.
    Held {
        /// Their ids.
        ids: Vec<ChunkId>,
    },
    /// `A`: the snapshot is abandoned.
    Abandon,
    /// `G`: a chunk is asked for.
    Get(ChunkId),
    /// `S`: the holdings are asked for.
    Holdings,
    /// `L`: the name of the agent's local socket is asked for (see `shm`).
    Local,
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
            Frame::End {
                ids: read_ids(r, n).await.map_err(e)?,
            }
        }
        b'K' => {
            let n = r.read_u32_le().await.map_err(e)? as usize;
            if n > MAX_HELD {
                return Err(proto(format!(
                    "held frame: {n} chunk ids, more than a snapshot may hold ({MAX_HELD})"
                )));
            }
            Frame::Held {
                ids: read_ids(r, n).await.map_err(e)?,
            }
        }
        b'A' => Frame::Abandon,
        b'G' => {
            let mut h = [0u8; 32];
            r.read_exact(&mut h).await.map_err(e)?;
            Frame::Get(ChunkId(Hash(h)))
        }
        b'S' => Frame::Holdings,
        b'L' => Frame::Local,
        other => return Err(proto(format!("unknown frame {other:#04x}"))),
    }))
}

/// `n` chunk ids (the list grows with what arrives: a count the stream does not back
/// allocates at most 2 KiB, then twice what did arrive).
async fn read_ids<R: AsyncRead + Unpin>(r: &mut R, n: usize) -> std::io::Result<Vec<ChunkId>> {
    let mut ids = Vec::with_capacity(n.min(64));
    for _ in 0..n {
        let mut h = [0u8; 32];
        r.read_exact(&mut h).await?;
        ids.push(ChunkId(Hash(h)));
    }
    Ok(ids)
}

/// The most ids a `K` frame may list (a snapshot of 16 TiB in 4 MiB chunks).
pub const MAX_HELD: usize = 1 << 22;

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

/// A `B` frame's fields.
pub(super) struct Begin {
    pub(super) node: u32,
    pub(super) rank: u32,
    pub(super) generation: u64,
    pub(super) step: u64,
}

impl Begin {
    pub(super) fn encode(&self) -> [u8; 25] {
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

/// The bytes of a `K` frame.
pub fn held_frame(ids: &[ChunkId]) -> Vec<u8> {
    let mut v = end_frame(ids);
    v[0] = b'K';
    v
}

/// The agent's answer to an `E` frame: `O`, the snapshot is kept whole; `P` and a count
/// (`u32`, read by the caller: [`Kept::Partial`]), kept without that many of the chunks its
/// `K` frame named, which the agent did not hold; a closed connection: it was refused (the
/// agent's log says why).
pub(super) fn expect_kept(got: std::io::Result<u8>, addr: &str) -> Result<Kept> {
    match got {
        Ok(b'O') => Ok(Kept::Whole),
        Ok(b'P') => Ok(Kept::Partial),
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

/// How an agent kept a snapshot ([`expect_kept`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kept {
    /// Every chunk.
    Whole,
    /// Without some of the chunks its `K` frame named (their count follows, a `u32`).
    Partial,
}
