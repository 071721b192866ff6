//! [`Objects`]: the part of a [`Store`](super::Store) every other part stands on: the object
//! store, the key layout, the settings, the clock, and plain objects (writes, multipart above
//! the threshold; whole and ranged reads; existence; JSON documents; listings; deletes), each
//! error naming the object and the operation.

use bytes::Bytes;
use futures::stream::{self, StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{
    ListResult, ObjectMeta, ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload,
    UpdateVersion,
};
use serde::{Deserialize, Serialize};

use std::sync::Arc;

use super::StoreConfig;
use crate::clock::Clock;
use crate::error::{Error, Result};
use crate::failpoint::Failpoints;
use crate::id::Hash;
use crate::keys::Keys;
use crate::wrap::StoreMetrics;

/// The object store under a [`Store`](super::Store) with its key layout and settings, and the
/// plain-object operations the other parts build on. Cheap to clone (shared pointers).
#[derive(Debug, Clone)]
pub struct Objects {
    pub(crate) inner: Arc<dyn ObjectStore>,
    pub(crate) keys: Keys,
    pub(crate) cfg: Arc<StoreConfig>,
    pub(crate) url: Arc<str>,
    pub(crate) failpoints: Failpoints,
    pub(crate) metrics: Option<Arc<StoreMetrics>>,
    pub(crate) local_root: Option<Arc<std::path::Path>>,
    pub(crate) clock: Arc<dyn Clock>,
}

impl Objects {
    pub(super) fn new(inner: Arc<dyn ObjectStore>, keys: Keys, url: String) -> Self {
        Objects {
            inner,
            keys,
            cfg: Arc::new(StoreConfig::default()),
            url: url.into(),
            failpoints: Default::default(),
            metrics: None,
            local_root: None,
            clock: Arc::new(crate::clock::SystemClock),
        }
    }

    /// The key layout.
    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    /// The settings.
    pub fn config(&self) -> &StoreConfig {
        &self.cfg
    }

    /// The URL the store was opened from.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The failpoints of the store.
    pub fn failpoints(&self) -> &Failpoints {
        &self.failpoints
    }

    /// The underlying object store.
    pub fn object_store(&self) -> &Arc<dyn ObjectStore> {
        &self.inner
    }

    /// Now, by the store's clock.
    pub fn now(&self) -> chrono::DateTime<chrono::Utc> {
        self.clock.now()
    }

    /// Temporary files that interrupted writes left in a local store (none elsewhere: object
    /// stores publish an object whole or not at all).
    pub async fn temp_files(&self) -> Result<Vec<crate::direct::TempFile>> {
        let Some(root) = self.local_root.clone() else {
            return Ok(Vec::new());
        };
        tokio::task::spawn_blocking(move || {
            crate::direct::temp_files(&root)
                .map_err(|e| Error::io("looking for temporary files in", &root.display(), e))
        })
        .await
        .map_err(|e| Error::internal(format!("listing temporary files: {e}")))?
    }

    /// Delete objects (missing ones are fine).
    pub async fn delete_all(&self, paths: Vec<Path>) -> Result<()> {
        let input = stream::iter(paths.into_iter().map(Ok)).boxed();
        let mut s = self.inner.delete_stream(input);
        while let Some(r) = s.next().await {
            match r {
                Ok(_) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(Error::backend("deleting", &"objects", e)),
            }
        }
        Ok(())
    }

    /// Write an object from pieces; multipart when it is larger than the threshold.
    pub async fn put_object(&self, path: &Path, parts: Vec<Bytes>, mode: PutMode) -> Result<()> {
        let len: usize = parts.iter().map(Bytes::len).sum();
        if len > self.cfg.multipart_threshold && matches!(mode, PutMode::Overwrite) {
            return self.put_multipart(path, parts).await;
        }
        let payload: PutPayload = parts.into_iter().collect();
        self.inner
            .put_opts(path, payload, PutOptions::from(mode))
            .await
            .map_err(|e| self.write_error("writing", path, e))?;
        Ok(())
    }

    /// An error of a write to `path`; a full file system says which one.
    fn write_error(&self, op: &str, path: &Path, e: object_store::Error) -> Error {
        let e = Error::backend(op, path, e);
        match &self.local_root {
            Some(root) => e.no_space_at(root.display()),
            None => e.no_space_at(&self.url),
        }
    }

    async fn put_multipart(&self, path: &Path, parts: Vec<Bytes>) -> Result<()> {
        let mut up = self
            .inner
            .put_multipart(path)
            .await
            .map_err(|e| self.write_error("starting multipart upload of", path, e))?;
        let part = self.cfg.multipart_part;
        let mut pending = Vec::new();
        let mut cur: Vec<Bytes> = Vec::new();
        let mut cur_len = 0usize;
        for mut b in parts {
            while !b.is_empty() {
                let take = (part - cur_len).min(b.len());
                cur.push(b.split_to(take));
                cur_len += take;
                if cur_len == part {
                    pending.push(up.put_part(std::mem::take(&mut cur).into_iter().collect()));
                    cur_len = 0;
                }
            }
        }
        if cur_len > 0 {
            pending.push(up.put_part(cur.into_iter().collect()));
        }
        let res = stream::iter(pending)
            .buffer_unordered(4)
            .try_collect::<Vec<_>>()
            .await;
        if let Err(e) = res {
            let _ = up.abort().await;
            return Err(self.write_error("uploading a part of", path, e));
        }
        if let Err(e) = up.complete().await {
            let _ = up.abort().await;
            return Err(self.write_error("completing multipart upload of", path, e));
        }
        Ok(())
    }

    /// Read a whole object.
    pub async fn get_object(&self, path: &Path) -> Result<Bytes> {
        let r = self
            .inner
            .get(path)
            .await
            .map_err(|e| Error::backend("reading", path, e))?;
        r.bytes()
            .await
            .map_err(|e| Error::backend("reading", path, e))
    }

    /// Read an object and its version, for a conditional update of it
    /// (`PutMode::Update`; stores that give no entity tag give `e_tag: None`).
    pub async fn get_versioned(&self, path: &Path) -> Result<(Bytes, UpdateVersion)> {
        let r = self
            .inner
            .get(path)
            .await
            .map_err(|e| Error::backend("reading", path, e))?;
        let v = UpdateVersion {
            e_tag: r.meta.e_tag.clone(),
            version: r.meta.version.clone(),
        };
        let b = r
            .bytes()
            .await
            .map_err(|e| Error::backend("reading", path, e))?;
        Ok((b, v))
    }

    /// Read a byte range of an object.
    pub async fn get_range(&self, path: &Path, range: std::ops::Range<u64>) -> Result<Bytes> {
        let Some(want) = range.end.checked_sub(range.start) else {
            return Err(Error::invalid(format!(
                "{path}: byte range {}..{} ends before it starts",
                range.start, range.end
            )));
        };
        let b = self
            .inner
            .get_range(path, range.clone())
            .await
            .map_err(|e| Error::backend("reading", path, e))?;
        if b.len() as u64 != want {
            return Err(Error::corrupt(format!(
                "{path}: bytes {}..{} asked, {} returned (the object is truncated)",
                range.start,
                range.end,
                b.len()
            )));
        }
        Ok(b)
    }

    /// An object's size, or `None` when it does not exist.
    pub async fn object_size(&self, path: &Path) -> Result<Option<u64>> {
        match self.inner.head(path).await {
            Ok(m) => Ok(Some(m.size)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(Error::backend("checking", path, e)),
        }
    }

    /// Whether an object exists.
    pub async fn exists(&self, path: &Path) -> Result<bool> {
        match self.inner.head(path).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(Error::backend("checking", path, e)),
        }
    }

    /// Write a JSON document with `mode` (manifests, commit records).
    pub async fn put_json<T: Serialize>(&self, path: &Path, v: &T, mode: PutMode) -> Result<Hash> {
        let bytes = serde_json::to_vec(v)
            .map_err(|e| Error::internal(format!("serializing {path}: {e}")))?;
        let h = Hash::of(&bytes);
        self.put_object(path, vec![Bytes::from(bytes)], mode)
            .await?;
        Ok(h)
    }

    /// Read and parse a JSON document; returns it with the blake3 of its bytes.
    pub async fn get_json<T: for<'de> Deserialize<'de>>(
        &self,
        path: &Path,
    ) -> Result<(T, Hash, u64)> {
        let b = self.get_object(path).await?;
        let v = serde_json::from_slice(&b).map_err(|e| {
            Error::corrupt(format!(
                "{path}: not a valid {} ({e}; {} bytes, truncated or garbage?)",
                std::any::type_name::<T>()
                    .rsplit("::")
                    .next()
                    .unwrap_or("document"),
                b.len()
            ))
        })?;
        Ok((v, Hash::of(&b), b.len() as u64))
    }

    /// Every object below `dir` (one listing, all its pages); an error names the listing.
    pub(crate) async fn list_all(&self, dir: &Path) -> Result<Vec<ObjectMeta>> {
        self.inner
            .list(Some(dir))
            .try_collect()
            .await
            .map_err(|e| Error::backend("listing", dir, e))
    }

    /// The objects directly below `dir` and its sub-folders (one listing with a delimiter); an
    /// error names the listing.
    pub(crate) async fn list_level(&self, dir: &Path) -> Result<ListResult> {
        self.inner
            .list_with_delimiter(Some(dir))
            .await
            .map_err(|e| Error::backend("listing", dir, e))
    }
}
