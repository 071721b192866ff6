//! [`ObjectStore`] wrappers: request metrics, and fault injection for tests.
//!
//! Each wrapper implements `ObjectStore` over an inner store, so they stack in any order:
//! `Store::new(Arc::new(MetricsStore::new(FaultyStore::new(DirectFs::new(..)?))), ..)`.

use std::fmt;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use futures::stream::BoxStream;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, GetResultPayload, ListResult, MultipartUpload, ObjectMeta,
    ObjectStore, PutMultipartOptions, PutOptions, PutPayload, PutResult, RenameOptions,
    Result as OsResult,
};

/// Metric names (one place, for logs and `--json` output).
pub mod names {
    /// Put requests (including multipart parts).
    pub const PUTS: &str = "store.puts";
    /// Bytes put.
    pub const PUT_BYTES: &str = "store.put_bytes";
    /// Get requests (whole and range).
    pub const GETS: &str = "store.gets";
    /// Bytes got.
    pub const GET_BYTES: &str = "store.get_bytes";
    /// Head requests.
    pub const HEADS: &str = "store.heads";
    /// List requests.
    pub const LISTS: &str = "store.lists";
    /// Deleted objects.
    pub const DELETES: &str = "store.deletes";
}

/// Counters of a [`MetricsStore`].
#[derive(Debug, Default)]
pub struct StoreMetrics {
    puts: AtomicU64,
    put_bytes: AtomicU64,
    gets: AtomicU64,
    get_bytes: AtomicU64,
    heads: AtomicU64,
    lists: AtomicU64,
    deletes: AtomicU64,
}

/// A copy of the counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct MetricsSnapshot {
    /// Put requests.
    pub puts: u64,
    /// Bytes put.
    pub put_bytes: u64,
    /// Get requests.
    pub gets: u64,
    /// Bytes got.
    pub get_bytes: u64,
    /// Head requests.
    pub heads: u64,
    /// List requests.
    pub lists: u64,
    /// Deletes.
    pub deletes: u64,
}

impl MetricsSnapshot {
    /// All requests.
    pub fn requests(&self) -> u64 {
        self.puts + self.gets + self.heads + self.lists + self.deletes
    }

    /// Counters as `(name, value)` pairs.
    pub fn pairs(&self) -> [(&'static str, u64); 7] {
        [
            (names::PUTS, self.puts),
            (names::PUT_BYTES, self.put_bytes),
            (names::GETS, self.gets),
            (names::GET_BYTES, self.get_bytes),
            (names::HEADS, self.heads),
            (names::LISTS, self.lists),
            (names::DELETES, self.deletes),
        ]
    }
}

impl std::ops::Sub for MetricsSnapshot {
    type Output = MetricsSnapshot;
    fn sub(self, o: MetricsSnapshot) -> MetricsSnapshot {
        MetricsSnapshot {
            puts: self.puts - o.puts,
            put_bytes: self.put_bytes - o.put_bytes,
            gets: self.gets - o.gets,
            get_bytes: self.get_bytes - o.get_bytes,
            heads: self.heads - o.heads,
            lists: self.lists - o.lists,
            deletes: self.deletes - o.deletes,
        }
    }
}

impl StoreMetrics {
    /// Read all counters.
    pub fn snapshot(&self) -> MetricsSnapshot {
        MetricsSnapshot {
            puts: self.puts.load(Ordering::Relaxed),
            put_bytes: self.put_bytes.load(Ordering::Relaxed),
            gets: self.gets.load(Ordering::Relaxed),
            get_bytes: self.get_bytes.load(Ordering::Relaxed),
            heads: self.heads.load(Ordering::Relaxed),
            lists: self.lists.load(Ordering::Relaxed),
            deletes: self.deletes.load(Ordering::Relaxed),
        }
    }
}

/// Counts requests and bytes of an inner store.
#[derive(Debug)]
pub struct MetricsStore<S> {
    inner: S,
    metrics: Arc<StoreMetrics>,
}

impl<S: ObjectStore> MetricsStore<S> {
    /// Wrap `inner`.
    pub fn new(inner: S) -> Self {
        MetricsStore {
            inner,
            metrics: Arc::default(),
        }
    }

    /// The shared counters.
    pub fn metrics(&self) -> Arc<StoreMetrics> {
        self.metrics.clone()
    }
}

impl<S: ObjectStore> fmt::Display for MetricsStore<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Metrics({})", self.inner)
    }
}

struct CountingUpload {
    inner: Box<dyn MultipartUpload>,
    metrics: Arc<StoreMetrics>,
}

impl fmt::Debug for CountingUpload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("CountingUpload")
    }
}

#[async_trait]
impl MultipartUpload for CountingUpload {
    fn put_part(&mut self, data: PutPayload) -> object_store::UploadPart {
        self.metrics.puts.fetch_add(1, Ordering::Relaxed);
        self.metrics
            .put_bytes
            .fetch_add(data.content_length() as u64, Ordering::Relaxed);
        self.inner.put_part(data)
    }
    async fn complete(&mut self) -> OsResult<PutResult> {
        self.inner.complete().await
    }
    async fn abort(&mut self) -> OsResult<()> {
        self.inner.abort().await
    }
}

#[async_trait]
impl<S: ObjectStore> ObjectStore for MetricsStore<S> {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> OsResult<PutResult> {
        self.metrics.puts.fetch_add(1, Ordering::Relaxed);
        self.metrics
            .put_bytes
            .fetch_add(payload.content_length() as u64, Ordering::Relaxed);
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> OsResult<Box<dyn MultipartUpload>> {
        let inner = self.inner.put_multipart_opts(location, opts).await?;
        Ok(Box::new(CountingUpload {
            inner,
            metrics: self.metrics.clone(),
        }))
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> OsResult<GetResult> {
        if options.head {
            self.metrics.heads.fetch_add(1, Ordering::Relaxed);
        } else {
            self.metrics.gets.fetch_add(1, Ordering::Relaxed);
        }
        let r = self.inner.get_opts(location, options).await?;
        self.metrics
            .get_bytes
            .fetch_add(r.range.end - r.range.start, Ordering::Relaxed);
        Ok(r)
    }

    async fn get_ranges(
        &self,
        location: &Path,
        ranges: &[std::ops::Range<u64>],
    ) -> OsResult<Vec<Bytes>> {
        self.metrics.gets.fetch_add(1, Ordering::Relaxed);
        let r = self.inner.get_ranges(location, ranges).await?;
        let n: usize = r.iter().map(Bytes::len).sum();
        self.metrics
            .get_bytes
            .fetch_add(n as u64, Ordering::Relaxed);
        Ok(r)
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, OsResult<Path>>,
    ) -> BoxStream<'static, OsResult<Path>> {
        let m = self.metrics.clone();
        self.inner
            .delete_stream(locations)
            .inspect(move |r| {
                if r.is_ok() {
                    m.deletes.fetch_add(1, Ordering::Relaxed);
                }
            })
            .boxed()
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, OsResult<ObjectMeta>> {
        self.metrics.lists.fetch_add(1, Ordering::Relaxed);
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> OsResult<ListResult> {
        self.metrics.lists.fetch_add(1, Ordering::Relaxed);
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> OsResult<()> {
        self.inner.copy_opts(from, to, options).await
    }

    async fn rename_opts(&self, from: &Path, to: &Path, options: RenameOptions) -> OsResult<()> {
        self.inner.rename_opts(from, to, options).await
    }
}

/// Which requests a fault applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultOp {
    /// `put_opts` and multipart uploads.
    Put,
    /// `get_opts` without `head`, and `get_ranges`.
    Get,
    /// Every request.
    Any,
}

/// What a fault does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FaultAction {
    /// The request fails with a backend error.
    Fail,
    /// The request waits first.
    Delay(Duration),
    /// A get returns the bytes with the byte at this offset of the result flipped.
    Corrupt(usize),
    /// A get returns only this many bytes.
    Truncate(usize),
}

/// One rule: the `nth` matching request (1-based; 0 = every one) gets `action`.
#[derive(Debug, Clone)]
pub struct Fault {
    /// Which requests.
    pub op: FaultOp,
    /// Only keys containing this.
    pub key_contains: Option<String>,
    /// Which matching request (1-based), or 0 for all.
    pub nth: u64,
    /// What happens.
    pub action: FaultAction,
}

#[derive(Debug)]
struct RuleState {
    fault: Fault,
    seen: u64,
    fired: u64,
}

/// Injects failures, delays and damage into an inner store, by rule.
#[derive(Debug)]
pub struct FaultyStore<S> {
    inner: S,
    rules: Arc<Mutex<Vec<RuleState>>>,
}

impl<S: ObjectStore> fmt::Display for FaultyStore<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Faulty({})", self.inner)
    }
}

/// A handle to add and inspect the rules of a [`FaultyStore`] after it was moved into a store.
#[derive(Debug, Clone)]
pub struct FaultHandle(Arc<Mutex<Vec<RuleState>>>);

impl FaultHandle {
    /// Add a rule.
    pub fn add(&self, fault: Fault) {
        self.0.lock().expect("fault rules").push(RuleState {
            fault,
            seen: 0,
            fired: 0,
        });
    }
    /// Remove every rule.
    pub fn clear(&self) {
        self.0.lock().expect("fault rules").clear();
    }
    /// How many times rules fired in total.
    pub fn fired(&self) -> u64 {
        self.0
            .lock()
            .expect("fault rules")
            .iter()
            .map(|r| r.fired)
            .sum()
    }
}

impl<S: ObjectStore> FaultyStore<S> {
    /// Wrap `inner` with no rules.
    pub fn new(inner: S) -> Self {
        FaultyStore {
            inner,
            rules: Arc::default(),
        }
    }

    /// A handle to the rules.
    pub fn handle(&self) -> FaultHandle {
        FaultHandle(self.rules.clone())
    }

    fn actions(&self, op: FaultOp, key: &Path) -> Vec<FaultAction> {
        let mut rules = self.rules.lock().expect("fault rules");
        let mut out = Vec::new();
        for r in rules.iter_mut() {
            let op_ok = r.fault.op == FaultOp::Any || r.fault.op == op;
            let key_ok = r
                .fault
                .key_contains
                .as_deref()
                .is_none_or(|k| key.as_ref().contains(k));
            if op_ok && key_ok {
                r.seen += 1;
                if r.fault.nth == 0 || r.fault.nth == r.seen {
                    r.fired += 1;
                    out.push(r.fault.action.clone());
                }
            }
        }
        out
    }

    async fn pre(&self, op: FaultOp, key: &Path) -> OsResult<Vec<FaultAction>> {
        let acts = self.actions(op, key);
        for a in &acts {
            match a {
                FaultAction::Fail => {
                    return Err(object_store::Error::Generic {
                        store: "FaultyStore",
                        source: format!("injected failure on {key}").into(),
                    });
                }
                FaultAction::Delay(d) => tokio::time::sleep(*d).await,
                _ => {}
            }
        }
        Ok(acts)
    }
}

fn damage(mut b: Vec<u8>, acts: &[FaultAction]) -> Vec<u8> {
    for a in acts {
        match a {
            FaultAction::Corrupt(off) if !b.is_empty() => {
                let i = (*off).min(b.len() - 1);
                b[i] ^= 0x5a;
            }
            FaultAction::Truncate(n) => b.truncate(*n),
            _ => {}
        }
    }
    b
}

#[async_trait]
impl<S: ObjectStore> ObjectStore for FaultyStore<S> {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> OsResult<PutResult> {
        self.pre(FaultOp::Put, location).await?;
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> OsResult<Box<dyn MultipartUpload>> {
        self.pre(FaultOp::Put, location).await?;
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> OsResult<GetResult> {
        let op = if options.head {
            FaultOp::Any
        } else {
            FaultOp::Get
        };
        let acts = self.pre(op, location).await?;
        let r = self.inner.get_opts(location, options).await?;
        if !acts
            .iter()
            .any(|a| matches!(a, FaultAction::Corrupt(_) | FaultAction::Truncate(_)))
        {
            return Ok(r);
        }
        let meta = r.meta.clone();
        let range = r.range.clone();
        let attributes = r.attributes.clone();
        let bytes = r.bytes().await?;
        let b = Bytes::from(damage(bytes.to_vec(), &acts));
        Ok(GetResult {
            payload: GetResultPayload::Stream(futures::stream::once(async move { Ok(b) }).boxed()),
            meta,
            range,
            attributes,
            extensions: Default::default(),
        })
    }

    async fn get_ranges(
        &self,
        location: &Path,
        ranges: &[std::ops::Range<u64>],
    ) -> OsResult<Vec<Bytes>> {
        let acts = self.pre(FaultOp::Get, location).await?;
        let r = self.inner.get_ranges(location, ranges).await?;
        Ok(r.into_iter()
            .map(|b| Bytes::from(damage(b.to_vec(), &acts)))
            .collect())
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, OsResult<Path>>,
    ) -> BoxStream<'static, OsResult<Path>> {
        self.inner.delete_stream(locations)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, OsResult<ObjectMeta>> {
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> OsResult<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> OsResult<()> {
        self.inner.copy_opts(from, to, options).await
    }

    async fn rename_opts(&self, from: &Path, to: &Path, options: RenameOptions) -> OsResult<()> {
        self.inner.rename_opts(from, to, options).await
    }
}
