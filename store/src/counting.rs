//! [`CountingStore`]: an [`ObjectStore`] wrapper that counts requests the way an object store
//! bills and throttles them, for simulations at a scale this machine cannot run for real
//! (`ckpt-bench scale`, issue 17).
//!
//! Every request is counted by kind ([`ReqKind`]: put, conditional put, get, range get, head,
//! list page, delete, copy, multipart part) and by key prefix (the key up to its last `/`; a
//! listing counts against the prefix it lists), stamped with the simulated time it started,
//! and, with [`RateLimits`], refused beyond an S3-like per-prefix rate (3,500 writes and 5,500
//! reads per second by default) with a retryable `503 SlowDown` error that the
//! [`crate::RetryStore`] above retries. A listing costs one request per page of
//! [`SimConfig::list_page`] entries (1,000 on S3), whatever the backend below returns at once.
//!
//! Time: each request takes [`SimConfig::latency`] measured by `tokio::time`, so under a
//! runtime whose clock is paused (`tokio::runtime::Builder::start_paused`, feature
//! `test-util`) the simulation never sleeps: the clock jumps to the next request's end when
//! every task waits, concurrent requests overlap as they would, and rates per second are
//! rates of simulated seconds. [`SimClock`] gives the [`crate::Store`] the same time. With a
//! zero latency the wrapper only counts (over a real backend, to check the counts).
//!
//! Requests made inside [`acting`] are tagged with an actor (a rank), so a phase can ask how
//! many requests one rank made in sequence ([`Tally::depth`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use futures::stream::BoxStream;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMode, PutMultipartOptions, PutOptions, PutPayload, PutResult, RenameOptions,
    Result as OsResult,
};
use parking_lot::Mutex;
use serde::Serialize;

use crate::layer::{HookedUpload, UploadHooks, wrapper_display};

/// The kind of one request, as an object store bills it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ReqKind {
    /// A plain put (overwrite).
    Put,
    /// A conditional put (create-if-absent, update-if-unchanged).
    PutCreate,
    /// A whole-object get.
    Get,
    /// A range get (a packed chunk).
    RangeGet,
    /// A head.
    Head,
    /// One page of a listing.
    ListPage,
    /// A deleted key.
    Delete,
    /// A copy (a rename counts as a copy and a delete).
    Copy,
    /// A part of a multipart upload (its start and completion count as puts).
    Part,
}

impl ReqKind {
    /// Whether S3 counts it against the write rate (PUT, COPY, POST, DELETE).
    pub fn is_write(self) -> bool {
        matches!(
            self,
            ReqKind::Put | ReqKind::PutCreate | ReqKind::Delete | ReqKind::Copy | ReqKind::Part
        )
    }

    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            ReqKind::Put => "put",
            ReqKind::PutCreate => "put_create",
            ReqKind::Get => "get",
            ReqKind::RangeGet => "range_get",
            ReqKind::Head => "head",
            ReqKind::ListPage => "list_page",
            ReqKind::Delete => "delete",
            ReqKind::Copy => "copy",
            ReqKind::Part => "part",
        }
    }
}

/// Per-prefix request rates beyond which a request is refused with `503 SlowDown`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct RateLimits {
    /// Writes (put, copy, delete) per second per prefix.
    pub writes_per_s: u32,
    /// Reads (get, head, list) per second per prefix.
    pub reads_per_s: u32,
}

impl RateLimits {
    /// S3's documented limits: 3,500 writes and 5,500 reads per second per prefix.
    pub const S3: RateLimits = RateLimits {
        writes_per_s: 3500,
        reads_per_s: 5500,
    };
}

/// Settings of a [`CountingStore`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimConfig {
    /// Time every request takes (default 20 ms); zero: no waiting, only counting.
    pub latency: Duration,
    /// Refuse requests beyond these rates (default: S3's); `None`: never.
    pub limits: Option<RateLimits>,
    /// Entries per listing page (default 1,000, as S3).
    pub list_page: usize,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            latency: Duration::from_millis(20),
            limits: Some(RateLimits::S3),
            list_page: 1000,
        }
    }
}

impl SimConfig {
    /// Count only: no latency, no limits (over a real backend).
    pub fn count_only() -> Self {
        SimConfig {
            latency: Duration::ZERO,
            limits: None,
            list_page: 1000,
        }
    }
}

tokio::task_local! {
    static ACTOR: u32;
}

/// Run `f` with its requests tagged as made by `actor` (a rank).
pub async fn acting<F: Future>(actor: u32, f: F) -> F::Output {
    ACTOR.scope(actor, f).await
}

/// One request as counted.
#[derive(Debug, Clone)]
pub struct Request {
    /// Simulated microseconds since the store was made, when it started.
    pub t_us: u64,
    /// The actor that made it ([`acting`]), if any.
    pub actor: Option<u32>,
    /// Its kind.
    pub kind: ReqKind,
    /// Its prefix (the key up to its last `/`, or the listed prefix).
    pub prefix: Arc<str>,
    /// Bytes sent (puts) or received (gets).
    pub bytes: u64,
    /// Refused with `503 SlowDown`.
    pub throttled: bool,
}

#[derive(Debug, Default)]
struct Log {
    requests: Vec<Request>,
    windows: HashMap<(Arc<str>, u64), (u32, u32)>,
    names: HashSet<Arc<str>>,
}

/// The counts of a [`CountingStore`], shared by its clones.
#[derive(Debug)]
pub struct Counting {
    t0: tokio::time::Instant,
    cfg: SimConfig,
    log: Mutex<Log>,
    /// Gets (whole and ranged) in flight now, and the most that were at once.
    gets_now: AtomicUsize,
    gets_most: AtomicUsize,
}

/// A get in flight, counted from its start (before its latency) to its end.
struct GetInFlight<'a>(&'a Counting);

impl<'a> GetInFlight<'a> {
    fn start(c: &'a Counting) -> Self {
        let now = c.gets_now.fetch_add(1, Ordering::SeqCst) + 1;
        c.gets_most.fetch_max(now, Ordering::SeqCst);
        GetInFlight(c)
    }
}

impl Drop for GetInFlight<'_> {
    fn drop(&mut self) {
        self.0.gets_now.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Counting {
    fn now_us(&self) -> u64 {
        self.t0.elapsed().as_micros() as u64
    }

    /// Simulated time since the store was made.
    pub fn elapsed(&self) -> Duration {
        self.t0.elapsed()
    }

    /// A mark: requests counted so far (pass it to [`Counting::since`]).
    pub fn mark(&self) -> usize {
        self.log.lock().requests.len()
    }

    /// The most gets (whole and ranged, not heads) that were in flight at once since the last
    /// call; it starts again from those in flight now.
    pub fn take_most_gets_in_flight(&self) -> usize {
        self.gets_most
            .swap(self.gets_now.load(Ordering::SeqCst), Ordering::SeqCst)
    }

    /// Every request from `mark` on.
    pub fn requests_since(&self, mark: usize) -> Vec<Request> {
        self.log.lock().requests[mark..].to_vec()
    }

    /// The figures of the requests from `mark` on.
    pub fn since(&self, mark: usize) -> Tally {
        Tally::of(&self.log.lock().requests[mark..])
    }

    /// Count a request starting now; `Some(index)` of its record, and whether it is refused.
    fn admit(&self, kind: ReqKind, prefix: &str, bytes: u64) -> (usize, bool) {
        let t_us = self.now_us();
        let actor = ACTOR.try_with(|a| *a).ok();
        let mut log = self.log.lock();
        let prefix: Arc<str> = match log.names.get(prefix) {
            Some(p) => p.clone(),
            None => {
                let p: Arc<str> = prefix.into();
                log.names.insert(p.clone());
                p
            }
        };
        let w = log
            .windows
            .entry((prefix.clone(), t_us / 1_000_000))
            .or_default();
        let throttled = match self.cfg.limits {
            Some(l) if kind.is_write() => {
                w.0 += 1;
                w.0 > l.writes_per_s
            }
            Some(l) => {
                w.1 += 1;
                w.1 > l.reads_per_s
            }
            None => false,
        };
        log.requests.push(Request {
            t_us,
            actor,
            kind,
            prefix,
            bytes,
            throttled,
        });
        (log.requests.len() - 1, throttled)
    }

    fn add_bytes(&self, i: usize, n: u64) {
        if let Some(r) = self.log.lock().requests.get_mut(i) {
            r.bytes += n;
        }
    }
}

/// What a set of requests cost.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Tally {
    /// Requests, refused ones included.
    pub requests: u64,
    /// Requests by kind.
    pub by_kind: BTreeMap<&'static str, u64>,
    /// Bytes by kind.
    pub bytes_by_kind: BTreeMap<&'static str, u64>,
    /// Requests refused with `503 SlowDown`.
    pub throttled: u64,
    /// Distinct prefixes touched.
    pub prefixes: u64,
    /// The prefix with the most writes in one simulated second, and that count.
    pub hottest_write_prefix: Option<(String, u64)>,
    /// The prefix with the most reads in one simulated second, and that count.
    pub hottest_read_prefix: Option<(String, u64)>,
    /// Simulated milliseconds from the first request's start to the last one's.
    pub span_ms: f64,
}

impl Tally {
    /// The figures of `reqs`.
    pub fn of(reqs: &[Request]) -> Tally {
        let mut t = Tally {
            requests: reqs.len() as u64,
            ..Tally::default()
        };
        let mut per_sec: HashMap<(&str, u64, bool), u64> = HashMap::new();
        let mut prefixes: HashSet<&str> = HashSet::new();
        for r in reqs {
            *t.by_kind.entry(r.kind.name()).or_default() += 1;
            *t.bytes_by_kind.entry(r.kind.name()).or_default() += r.bytes;
            t.throttled += r.throttled as u64;
            prefixes.insert(&r.prefix);
            *per_sec
                .entry((&r.prefix, r.t_us / 1_000_000, r.kind.is_write()))
                .or_default() += 1;
        }
        t.prefixes = prefixes.len() as u64;
        for ((p, _, write), n) in per_sec {
            let slot = if write {
                &mut t.hottest_write_prefix
            } else {
                &mut t.hottest_read_prefix
            };
            if slot
                .as_ref()
                .is_none_or(|(q, m)| n > *m || (n == *m && p < q.as_str()))
            {
                *slot = Some((p.to_string(), n));
            }
        }
        if let (Some(a), Some(b)) = (
            reqs.iter().map(|r| r.t_us).min(),
            reqs.iter().map(|r| r.t_us).max(),
        ) {
            t.span_ms = (b - a) as f64 / 1000.0;
        }
        t
    }

    /// Requests of `kind`.
    pub fn count(&self, kind: ReqKind) -> u64 {
        self.by_kind.get(kind.name()).copied().unwrap_or(0)
    }

    /// How many requests of `actor` among `reqs` ran one after another: the number of
    /// distinct simulated instants at which its requests started (requests in flight together
    /// start together under the paused clock).
    pub fn depth(reqs: &[Request], actor: u32) -> u64 {
        let mut ts: Vec<u64> = reqs
            .iter()
            .filter(|r| r.actor == Some(actor))
            .map(|r| r.t_us)
            .collect();
        ts.sort_unstable();
        ts.dedup();
        ts.len() as u64
    }
}

/// The prefix a key counts against: everything up to its last `/`.
pub fn prefix_of(key: &Path) -> &str {
    key.as_ref().rsplit_once('/').map_or("", |(p, _)| p)
}

/// Counts (and throttles, and delays) the requests made to an inner store; see the module docs.
#[derive(Debug)]
pub struct CountingStore<S> {
    inner: Arc<S>,
    state: Arc<Counting>,
}

impl<S: ObjectStore> CountingStore<S> {
    /// Wrap `inner`. Make it inside the runtime whose clock the simulation uses.
    pub fn new(inner: S, cfg: SimConfig) -> Self {
        CountingStore {
            inner: Arc::new(inner),
            state: Arc::new(Counting {
                t0: tokio::time::Instant::now(),
                cfg,
                log: Mutex::default(),
                gets_now: AtomicUsize::new(0),
                gets_most: AtomicUsize::new(0),
            }),
        }
    }

    /// The counts (shared).
    pub fn counting(&self) -> Arc<Counting> {
        self.state.clone()
    }

    /// Count a request, wait its latency, refuse it if throttled.
    async fn enter(&self, kind: ReqKind, prefix: &str, bytes: u64) -> OsResult<usize> {
        enter(&self.state, kind, prefix, bytes).await
    }
}

async fn enter(state: &Counting, kind: ReqKind, prefix: &str, bytes: u64) -> OsResult<usize> {
    let (i, throttled) = state.admit(kind, prefix, bytes);
    if !state.cfg.latency.is_zero() {
        tokio::time::sleep(state.cfg.latency).await;
    }
    if throttled {
        return Err(slow_down(kind, prefix));
    }
    Ok(i)
}

fn slow_down(kind: ReqKind, prefix: &str) -> object_store::Error {
    object_store::Error::Generic {
        store: "CountingStore",
        source: format!(
            "503 SlowDown: {} on prefix {prefix:?} beyond its rate limit (simulated)",
            kind.name()
        )
        .into(),
    }
}

wrapper_display!([S: ObjectStore] CountingStore<S>, "Counting");

/// Counts each part of a multipart upload, and its completion as a put, on the upload's prefix.
struct CountParts {
    state: Arc<Counting>,
    prefix: String,
}

#[async_trait]
impl UploadHooks for CountParts {
    fn part(&self, len: u64) -> OsResult<()> {
        let (_, throttled) = self.state.admit(ReqKind::Part, &self.prefix, len);
        if throttled {
            return Err(slow_down(ReqKind::Part, &self.prefix));
        }
        Ok(())
    }
    async fn complete(&self) -> OsResult<()> {
        enter(&self.state, ReqKind::Put, &self.prefix, 0).await?;
        Ok(())
    }
}

#[async_trait]
impl<S: ObjectStore> ObjectStore for CountingStore<S> {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> OsResult<PutResult> {
        let kind = match opts.mode {
            PutMode::Overwrite => ReqKind::Put,
            _ => ReqKind::PutCreate,
        };
        self.enter(kind, prefix_of(location), payload.content_length() as u64)
            .await?;
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> OsResult<Box<dyn MultipartUpload>> {
        self.enter(ReqKind::Put, prefix_of(location), 0).await?;
        let inner = self.inner.put_multipart_opts(location, opts).await?;
        Ok(Box::new(HookedUpload {
            inner,
            hooks: CountParts {
                state: self.state.clone(),
                prefix: prefix_of(location).to_string(),
            },
        }))
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> OsResult<GetResult> {
        let kind = if options.head {
            ReqKind::Head
        } else if options.range.is_some() {
            ReqKind::RangeGet
        } else {
            ReqKind::Get
        };
        let _flying = (kind != ReqKind::Head).then(|| GetInFlight::start(&self.state));
        let i = self.enter(kind, prefix_of(location), 0).await?;
        let r = self.inner.get_opts(location, options).await?;
        if kind != ReqKind::Head {
            self.state.add_bytes(i, r.range.end - r.range.start);
        }
        Ok(r)
    }

    async fn get_ranges(
        &self,
        location: &Path,
        ranges: &[std::ops::Range<u64>],
    ) -> OsResult<Vec<Bytes>> {
        let _flying = GetInFlight::start(&self.state);
        let mut first = None;
        for _ in ranges {
            let i = self
                .enter(ReqKind::RangeGet, prefix_of(location), 0)
                .await?;
            first.get_or_insert(i);
        }
        let r = self.inner.get_ranges(location, ranges).await?;
        if let Some(i) = first {
            self.state
                .add_bytes(i, r.iter().map(|b| b.len() as u64).sum());
        }
        Ok(r)
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, OsResult<Path>>,
    ) -> BoxStream<'static, OsResult<Path>> {
        // Each key counts (S3's batch delete takes 1,000 keys a request, but each key counts
        // against the prefix's write rate); no latency per key.
        let state = self.state.clone();
        let admitted = locations
            .map(move |p| {
                let p = p?;
                let (_, throttled) = state.admit(ReqKind::Delete, prefix_of(&p), 0);
                if throttled {
                    return Err(slow_down(ReqKind::Delete, prefix_of(&p)));
                }
                Ok(p)
            })
            .boxed();
        self.inner.delete_stream(admitted)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, OsResult<ObjectMeta>> {
        let inner = self.inner.list(prefix);
        let state = self.state.clone();
        let listed = prefix.map_or_else(String::new, |p| p.as_ref().to_string());
        futures::stream::once(async move {
            let items: Vec<OsResult<ObjectMeta>> = inner.collect().await;
            let pages = items.len().div_ceil(state.cfg.list_page.max(1)).max(1);
            for _ in 0..pages {
                if let Err(e) = enter(&state, ReqKind::ListPage, &listed, 0).await {
                    return vec![Err(e)];
                }
            }
            items
        })
        .flat_map(futures::stream::iter)
        .boxed()
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> OsResult<ListResult> {
        let listed = prefix.map_or_else(String::new, |p| p.as_ref().to_string());
        let r = self.inner.list_with_delimiter(prefix).await?;
        let n = r.objects.len() + r.common_prefixes.len();
        let pages = n.div_ceil(self.state.cfg.list_page.max(1)).max(1);
        for _ in 0..pages {
            self.enter(ReqKind::ListPage, &listed, 0).await?;
        }
        Ok(r)
    }

    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> OsResult<()> {
        self.enter(ReqKind::Copy, prefix_of(to), 0).await?;
        self.inner.copy_opts(from, to, options).await
    }

    async fn rename_opts(&self, from: &Path, to: &Path, options: RenameOptions) -> OsResult<()> {
        self.enter(ReqKind::Copy, prefix_of(to), 0).await?;
        self.enter(ReqKind::Delete, prefix_of(from), 0).await?;
        self.inner.rename_opts(from, to, options).await
    }
}

/// The [`crate::Clock`] of a simulation: `base` plus the `tokio::time` elapsed since the clock
/// was made, so a paused runtime's clock moves it.
#[derive(Debug, Clone)]
pub struct SimClock {
    base: chrono::DateTime<chrono::Utc>,
    t0: tokio::time::Instant,
}

impl SimClock {
    /// A clock standing at `base` now (make it inside the simulation's runtime).
    pub fn starting_at(base: chrono::DateTime<chrono::Utc>) -> Self {
        SimClock {
            base,
            t0: tokio::time::Instant::now(),
        }
    }
}

impl crate::clock::Clock for SimClock {
    fn now(&self) -> chrono::DateTime<chrono::Utc> {
        self.base + chrono::Duration::from_std(self.t0.elapsed()).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use object_store::ObjectStoreExt;
    use object_store::memory::InMemory;

    fn sim(limits: Option<RateLimits>) -> CountingStore<InMemory> {
        CountingStore::new(
            InMemory::new(),
            SimConfig {
                latency: Duration::from_millis(20),
                limits,
                list_page: 1000,
            },
        )
    }

    #[tokio::test(start_paused = true)]
    async fn requests_are_counted_by_kind_and_prefix() {
        let s = sim(None);
        let c = s.counting();
        s.put(&Path::from("a/b/x"), Bytes::from_static(b"hello").into())
            .await
            .unwrap();
        s.put_opts(
            &Path::from("a/b/y"),
            Bytes::from_static(b"w").into(),
            PutMode::Create.into(),
        )
        .await
        .unwrap();
        s.get(&Path::from("a/b/x"))
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
        s.get_range(&Path::from("a/b/x"), 1..3).await.unwrap();
        s.head(&Path::from("a/b/y")).await.unwrap();
        let t = c.since(0);
        assert_eq!(t.requests, 5);
        assert_eq!(t.count(ReqKind::Put), 1);
        assert_eq!(t.count(ReqKind::PutCreate), 1);
        assert_eq!(t.count(ReqKind::Get), 1);
        assert_eq!(t.count(ReqKind::RangeGet), 1);
        assert_eq!(t.count(ReqKind::Head), 1);
        assert_eq!(t.bytes_by_kind["get"], 5);
        assert_eq!(t.bytes_by_kind["range_get"], 2);
        assert_eq!(t.prefixes, 1);
        assert_eq!(t.hottest_write_prefix, Some(("a/b".into(), 2)));
        // Five requests one after another, 20 ms each, on the simulated clock.
        assert_eq!(c.elapsed(), Duration::from_millis(100));
    }

    #[tokio::test(start_paused = true)]
    async fn a_listing_costs_one_request_per_page_of_1000() {
        let s = sim(None);
        let c = s.counting();
        for i in 0..2500 {
            s.put(&Path::from(format!("p/k{i:05}")), Bytes::new().into())
                .await
                .unwrap();
        }
        let m = c.mark();
        let n = s.list(Some(&Path::from("p"))).count().await;
        assert_eq!(n, 2500);
        assert_eq!(c.since(m).count(ReqKind::ListPage), 3);
        let m = c.mark();
        let r = s.list_with_delimiter(Some(&Path::from("p"))).await.unwrap();
        assert_eq!(r.objects.len(), 2500);
        assert_eq!(c.since(m).count(ReqKind::ListPage), 3);
        let m = c.mark();
        let r = s.list_with_delimiter(Some(&Path::from("q"))).await.unwrap();
        assert!(r.objects.is_empty());
        assert_eq!(
            c.since(m).count(ReqKind::ListPage),
            1,
            "an empty page is a request"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn writes_beyond_the_prefix_rate_are_refused_as_slow_down_and_other_prefixes_are_not() {
        let s = Arc::new(sim(Some(RateLimits {
            writes_per_s: 10,
            reads_per_s: 5,
        })));
        let c = s.counting();
        // 15 concurrent puts into one prefix within one simulated second: 10 pass, 5 refused.
        let puts = (0..15).map(|i| {
            let s = s.clone();
            async move {
                s.put(&Path::from(format!("hot/k{i}")), Bytes::new().into())
                    .await
            }
        });
        let res = futures::future::join_all(puts).await;
        let refused: Vec<_> = res.iter().filter_map(|r| r.as_ref().err()).collect();
        assert_eq!(refused.len(), 5);
        for e in &refused {
            assert!(matches!(e, object_store::Error::Generic { .. }), "{e}");
            assert!(e.to_string().contains("503 SlowDown"), "{e}");
            assert!(e.to_string().contains("\"hot\""), "{e}");
            assert!(
                crate::retry::is_transient(e),
                "a SlowDown is retryable: {e}"
            );
        }
        // Another prefix has its own budget; reads have theirs.
        s.put(&Path::from("cold/k"), Bytes::new().into())
            .await
            .unwrap();
        s.head(&Path::from("hot/k0")).await.unwrap();
        let t = c.since(0);
        assert_eq!(t.throttled, 5);
        assert_eq!(t.hottest_write_prefix, Some(("hot".into(), 15)));
        // The next simulated second has a fresh budget.
        tokio::time::sleep(Duration::from_secs(1)).await;
        s.put(&Path::from("hot/again"), Bytes::new().into())
            .await
            .unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn concurrent_requests_overlap_and_the_depth_counts_them_once() {
        let s = Arc::new(sim(None));
        let c = s.counting();
        acting(7, async {
            let gets = (0..8).map(|i| {
                let s = s.clone();
                async move { s.head(&Path::from(format!("x/{i}"))).await }
            });
            let _ = futures::future::join_all(gets).await;
            let _ = s.head(&Path::from("x/last")).await;
        })
        .await;
        let _ = s.head(&Path::from("x/other")).await;
        let reqs = c.requests_since(0);
        assert_eq!(reqs.len(), 10);
        assert_eq!(Tally::depth(&reqs, 7), 2, "8 in parallel, then 1");
        assert_eq!(c.elapsed(), Duration::from_millis(60));
        let clock = SimClock::starting_at(chrono::DateTime::UNIX_EPOCH);
        tokio::time::sleep(Duration::from_secs(5)).await;
        use crate::clock::Clock as _;
        assert_eq!(clock.now().timestamp_millis(), 5000);
    }

    #[tokio::test(start_paused = true)]
    async fn deletes_count_per_key() {
        let s = sim(None);
        let c = s.counting();
        for i in 0..3 {
            s.put(&Path::from(format!("d/{i}")), Bytes::new().into())
                .await
                .unwrap();
        }
        let m = c.mark();
        let paths = futures::stream::iter((0..3).map(|i| Ok(Path::from(format!("d/{i}"))))).boxed();
        let n = s.delete_stream(paths).count().await;
        assert_eq!(n, 3);
        assert_eq!(c.since(m).count(ReqKind::Delete), 3);
    }

    const FOUR: crate::Layout = crate::Layout {
        dp: 4,
        tp: 1,
        pp: 1,
        zero: 0,
    };

    /// Rank `rank` of a 4-rank job saves one byte of a 4-byte tensor as `step` of `run`.
    async fn save_tiny(store: &crate::Store, run: &str, step: u64, rank: u32) {
        use crate::{DType, DedupIndex, NdBox, RankWrite, ShardDesc, ShardIn};
        let w = RankWrite::new(run, step, rank, FOUR);
        let shard = ShardIn {
            shard: ShardDesc::boxed(
                "w",
                DType::U8,
                vec![4],
                NdBox::new(vec![rank as u64], vec![1]).unwrap(),
            ),
            data: Some(Bytes::from(vec![rank as u8])),
        };
        store
            .write_rank(&w, vec![shard], vec![], &DedupIndex::new())
            .await
            .unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_polling_committer_reads_one_manifest_while_ranks_are_missing() {
        let cs = CountingStore::new(InMemory::new(), SimConfig::count_only());
        let c = cs.counting();
        let store = crate::Store::new(Arc::new(cs), Path::default(), "counted://");
        let write = |rank: u32| save_tiny(&store, "r", 1, rank);
        for r in 0..3 {
            write(r).await;
        }
        // Three of four manifests: each poll lists, reads one manifest and checks the fence.
        for _ in 0..3 {
            let m = c.mark();
            let e = store
                .log()
                .commit_step_as("r", 1, Some(0))
                .await
                .unwrap_err();
            assert_eq!(e.kind(), crate::ErrorKind::Incomplete, "{e}");
            assert!(e.to_string().contains("1 of 4 rank manifests"), "{e}");
            assert!(e.to_string().contains("(ranks 3)"), "{e}");
            let t = c.since(m);
            assert_eq!(t.count(ReqKind::Get), 1, "{t:?}");
            assert_eq!(t.requests, 3, "{t:?}");
        }
        write(3).await;
        let m = c.mark();
        store.log().commit_step_as("r", 1, Some(0)).await.unwrap();
        // Once all are there: each manifest once (plus the sample), the fence checks, COMMIT.
        let t = c.since(m);
        assert_eq!(t.count(ReqKind::Get), 5, "{t:?}");
        assert_eq!(t.count(ReqKind::PutCreate), 1, "{t:?}");
    }

    #[tokio::test]
    async fn listing_a_run_of_1000_committed_steps_takes_one_page_not_one_per_1000_manifests() {
        let cs = CountingStore::new(InMemory::new(), SimConfig::count_only());
        let c = cs.counting();
        let store = crate::Store::new(Arc::new(cs), Path::default(), "counted://");
        for step in 1..=1000 {
            for rank in 0..4 {
                save_tiny(&store, "long", step, rank).await;
            }
            if step < 1000 {
                store.log().commit_step("long", step).await.unwrap();
            }
        }
        let m = c.mark();
        let steps = store.log().list_steps_with_records("long").await.unwrap();
        let t = c.since(m);
        assert_eq!(steps.len(), 1000);
        assert!(steps[..999].iter().all(|(s, r)| s.committed
            && s.ranks == [0, 1, 2, 3]
            && matches!(r, Some(Ok(c)) if c.step == s.step)));
        // The step not committed: listed by its objects, with no record.
        let (last, record) = &steps[999];
        assert!(!last.committed && last.ranks == [0, 1, 2, 3] && record.is_none());
        assert_eq!(
            t.count(ReqKind::ListPage),
            2,
            "one page of steps, one of step 1000: {t:?}"
        );
        assert_eq!(t.count(ReqKind::Get), 1000, "{t:?}");
        // The whole listing, for comparison: a page per thousand objects.
        let m = c.mark();
        assert_eq!(store.log().list_steps("long").await.unwrap().len(), 1000);
        assert_eq!(c.since(m).count(ReqKind::ListPage), 5);
    }

    #[tokio::test]
    async fn writer_leases_spread_over_256_prefixes_and_gc_sees_every_one() {
        let cs = CountingStore::new(InMemory::new(), SimConfig::count_only());
        let c = cs.counting();
        let store = crate::Store::new(Arc::new(cs), Path::default(), "counted://");
        // 2,500 saves in flight (ranks starting a save at once), each with its lease.
        let m = c.mark();
        let mut leases = Vec::new();
        for rank in 0..2500 {
            let w = crate::lease::writer_id(rank, 1);
            leases.push(store.gc().lease_dedup_base("r", &w, &[]).await.unwrap());
        }
        let t = c.since(m);
        // The lease puts spread over 256 prefixes (S3 limits writes per prefix).
        let hottest = t.hottest_write_prefix.clone().unwrap();
        assert!(hottest.0.starts_with("locks/writers/"), "{hottest:?}");
        assert!(hottest.1 < 40, "{hottest:?}");
        // GC still sees every lease, and sweeps nothing while they are held.
        let now = store.now();
        let listing = store
            .gc()
            .list_locks(now, std::time::Duration::from_secs(3600))
            .await
            .unwrap();
        assert_eq!(listing.writers.len(), 2500);
        assert!(
            store
                .gc()
                .take_sweep_lock(now, std::time::Duration::from_secs(3600))
                .await
                .unwrap()
                .is_err()
        );
        for l in leases {
            store.gc().release_lease(l).await.unwrap();
        }
        let listing = store
            .gc()
            .list_locks(now, std::time::Duration::from_secs(3600))
            .await
            .unwrap();
        assert!(listing.writers.is_empty() && listing.sweeps.is_empty());
    }
}
