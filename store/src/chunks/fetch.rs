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

    /// Fetch and decode a delta chunk: every object of its chain (at most `MAX_DELTA_CHAIN +
    /// 1`, fetched in parallel), decoded base-first, each level hash-checked. An error names
    /// the chunk, the base chunk at fault and (where the manifest says) the base's step.
    async fn get_delta_chunk(&self, r: &ChunkRef) -> Result<Bytes> {
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
        let len = r.len as u64;
        let out = tokio::task::spawn_blocking(move || {
            let objs: Vec<&[u8]> = objs.iter().map(|o| o.as_ref()).collect();
            codec::decode_chain(&objs, &chain, len, &names)
        })
        .await??;
        Ok(Bytes::from(out))
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
    /// every reader (restore, export, the mount, diff, verify) decodes chunks from the store.
    pub async fn get_chunk(&self, r: &ChunkRef) -> Result<Bytes> {
        if r.is_delta() || r.codec == Codec::Delta {
            return self.get_delta_chunk(r).await;
        }
        let obj = self.get_stored_chunk(r).await?;
        let r = r.clone();
        let what = r.location();
        tokio::task::spawn_blocking(move || codec::decode_bytes(obj, &r.id, r.len as u64, &what))
            .await?
    }

    /// The stored object of a chunk; a missing one is damage (a manifest names it).
    async fn get_stored_chunk(&self, r: &ChunkRef) -> Result<Bytes> {
        self.get_chunk_object(r).await.map_err(|e| {
            if e.kind() == ErrorKind::NotFound {
                Error::corrupt(format!(
                    "chunk {} is missing from the store ({e})",
                    r.location()
                ))
            } else {
                e
            }
        })
    }

    /// The payload of a chunk stored raw, its header checked but **not its hash** (the caller
    /// hashes it as it copies it out, and refuses it with [`codec::check_id_of`]); `None` for
    /// a chunk stored any other way (read it with [`Chunks::get_chunk`]). A chunk whose
    /// reference says raw but whose object is encoded is read and checked whole, here.
    pub async fn get_raw_unchecked(&self, r: &ChunkRef) -> Result<Option<Bytes>> {
        if r.is_delta() || r.codec != Codec::Raw {
            return Ok(None);
        }
        let obj = self.get_stored_chunk(r).await?;
        let what = r.location();
        codec::raw_payload(&obj, r.len as u64, &what)
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
