//! Reading chunks back ([`Chunks`]' read half): fetching, decoding and verifying chunks
//! (deltas through their chain of bases; the objects of a reference are
//! [`Keys::chain_objects`](crate::Keys::chain_objects)).

use bytes::Bytes;
use futures::stream::{self, Stream, StreamExt};

use super::Chunks;
use crate::codec::{self, Codec};
use crate::error::{Error, ErrorKind, Result};
use crate::id::ChunkId;
use crate::model::ChunkRef;

impl Chunks {
    /// The plain bytes of a delta base for a write: from the writer's cache of what it wrote
    /// last (`delta_cache_bytes`), else read back (and verified) through its chain.
    pub(super) async fn delta_base_plain(&self, r: &ChunkRef) -> Result<Bytes> {
        self.delta_cache
            .get_or_fetch(r.id, || self.get_chunk(r))
            .await
    }

    /// Fetch the objects of a delta chunk's chain (at most `MAX_DELTA_CHAIN + 1`, in
    /// parallel), not decoded. An error names the chunk, the base chunk at fault and (where
    /// the manifest says) the base's step.
    async fn get_delta_objects(&self, r: &ChunkRef) -> Result<StoredChunk> {
        r.check_chain().map_err(Error::corrupt)?;
        let chain: Vec<ChunkId> = std::iter::once(r.id)
            .chain(r.bases.iter().copied())
            .collect();
        let paths = self.objects.keys.chain_objects(r);
        let top = r.location();
        let name = |i: usize| -> String {
            if i == 0 {
                top.clone()
            } else {
                format!(
                    "{top}: its base {} ({} of the chain{})",
                    chain[i],
                    i,
                    if i == 1 {
                        r.base_step
                            .map(|s| format!(", saved at step {s}"))
                            .unwrap_or_default()
                    } else {
                        String::new()
                    }
                )
            }
        };
        let objs = futures::future::try_join_all(paths.iter().enumerate().map(|(i, p)| {
            let name = name(i);
            async move {
                self.objects.get_object(p).await.map_err(|e| {
                    if e.kind() == ErrorKind::NotFound {
                        Error::corrupt(format!("{name} is missing from the store ({p})"))
                    } else {
                        e.context(name)
                    }
                })
            }
        }))
        .await?;
        let names: Vec<String> = (0..chain.len()).map(name).collect();
        Ok(StoredChunk {
            objs,
            chain,
            names,
            len: r.len as usize,
        })
    }

    /// Fetch the stored bytes of a chunk object (not decoded).
    pub async fn get_chunk_object(&self, r: &ChunkRef) -> Result<Bytes> {
        let path = self.objects.keys.object_of(r);
        let b = match &r.pack {
            Some(_) => {
                let end = r.offset.checked_add(r.stored as u64).ok_or_else(|| {
                    Error::corrupt(format!(
                        "chunk {}: offset {} + {} stored bytes overflows",
                        r.location(),
                        r.offset,
                        r.stored
                    ))
                })?;
                self.objects.get_range(&path, r.offset..end).await?
            }
            None => self.objects.get_object(&path).await?,
        };
        Ok(b)
    }

    /// Fetch, decode and verify one chunk (a delta with its chain of bases): the one place
    /// every reader (restore, export, the mount, diff, verify) decodes chunks from the store
    /// into buffers of their own (a restore decodes into its destination:
    /// [`StoredChunk::decode_into`]).
    pub async fn get_chunk(&self, r: &ChunkRef) -> Result<Bytes> {
        let stored = self.get_stored(r).await?;
        tokio::task::spawn_blocking(move || stored.decode()).await?
    }

    /// The stored objects of a chunk (its own; a delta's whole chain), fetched and not yet
    /// decoded or checked.
    pub async fn get_stored(&self, r: &ChunkRef) -> Result<StoredChunk> {
        if r.is_delta() || r.codec == Codec::Delta {
            return self.get_delta_objects(r).await;
        }
        let obj = self.get_stored_chunk(r).await?;
        Ok(StoredChunk {
            objs: vec![obj],
            chain: vec![r.id],
            names: vec![r.location()],
            len: r.len as usize,
        })
    }

    /// The stored object of a chunk; a missing one is damage (a manifest names it).
    async fn get_stored_chunk(&self, r: &ChunkRef) -> Result<Bytes> {
        self.get_chunk_object(r).await.map_err(|e| {
            if e.kind() == ErrorKind::NotFound {
                Error::corrupt(format!("{} is missing from the store ({e})", r.location()))
            } else {
                e
            }
        })
    }

    /// Fetch many chunks in parallel (bounded by `read_concurrency`); yields `(index, bytes)`
    /// as they arrive.
    pub fn get_chunks(
        &self,
        refs: Vec<ChunkRef>,
    ) -> impl Stream<Item = Result<(usize, Bytes)>> + Send + use<> {
        let store = self.clone();
        let n = self.objects.cfg.read_concurrency;
        stream::iter(refs.into_iter().enumerate())
            .map(move |(i, r)| {
                let store = store.clone();
                async move { store.get_chunk(&r).await.map(|b| (i, b)) }
            })
            .buffer_unordered(n)
    }

    /// Whether the store holds the chunk object of `id` (one HEAD request). Packed chunks are
    /// found through manifests, not this.
    pub async fn has_chunk_object(&self, id: &ChunkId) -> Result<bool> {
        self.objects.exists(&self.objects.keys.chunk(id)).await
    }
}

/// A chunk's stored objects as fetched, not yet decoded or checked ([`Chunks::get_stored`]):
/// its own and, for a delta, each base's of its chain.
#[derive(Debug, Clone)]
pub struct StoredChunk {
    objs: Vec<Bytes>,
    chain: Vec<ChunkId>,
    names: Vec<String>,
    len: usize,
}

impl StoredChunk {
    /// The chunk's plain length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the chunk is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The payload of a chunk stored raw in one object, its header and length checked but
    /// **not its hash** (see [`codec::raw_payload`]); `None` for any other chunk.
    pub fn raw_unchecked(&self) -> Result<Option<Bytes>> {
        match self.objs.as_slice() {
            [obj] => codec::raw_payload(obj, self.len as u64, &self.names[0]),
            _ => Ok(None),
        }
    }

    /// Decode the chunk into a buffer of its own and check it against its id (a raw chunk:
    /// a slice of its object, no copy).
    pub fn decode(self) -> Result<Bytes> {
        match self.objs.as_slice() {
            [obj] => {
                codec::decode_bytes(obj.clone(), &self.chain[0], self.len as u64, &self.names[0])
            }
            _ => {
                let objs: Vec<&[u8]> = self.objs.iter().map(AsRef::as_ref).collect();
                codec::decode_chain(&objs, &self.chain, self.len as u64, &self.names)
                    .map(Bytes::from)
            }
        }
    }

    /// Decode the chunk straight into `out` (exactly its plain length), each block hashed as
    /// it is written, and check it against its id ([`codec::decode_into`]). On an error `out`
    /// holds nothing of use.
    pub fn decode_into(&self, out: &mut [u8]) -> Result<()> {
        if out.len() != self.len {
            return Err(Error::internal(format!(
                "a destination of {} bytes for chunk {} of {} bytes",
                out.len(),
                self.names[0],
                self.len
            )));
        }
        let objs: Vec<&[u8]> = self.objs.iter().map(AsRef::as_ref).collect();
        codec::decode_into(&objs, &self.chain, &self.names, out)
    }
}
