//! [`ObjectStore`] wrappers: request metrics, and fault injection for tests.
//!
//! Each wrapper implements `ObjectStore` over an inner store, so they stack in any order:
//! `Store::new(Arc::new(MetricsStore::new(FaultyStore::new(DirectFs::new(..)?))), ..)`.

use std::sync::Arc;
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
use parking_lot::Mutex;

use crate::layer::{HookedUpload, UploadHooks, object_store_wrapper, wrapper_display};

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
    /// Requests the retry layer ([`crate::RetryStore`]) tried again after a transient error.
    pub const RETRIES: &str = "store.retries";
    /// Requests the retry layer gave up on (attempts or time exhausted).
    pub const GIVE_UPS: &str = "store.give_ups";
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
    pub(crate) retries: AtomicU64,
    pub(crate) give_ups: AtomicU64,
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
    /// Attempts repeated by the retry layer after a transient error.
    pub retries: u64,
    /// Requests the retry layer gave up on.
    pub give_ups: u64,
}

impl MetricsSnapshot {
    /// All requests.
    pub fn requests(&self) -> u64 {
        self.puts + self.gets + self.heads + self.lists + self.deletes
    }

    /// Counters as `(name, value)` pairs.
    pub fn pairs(&self) -> [(&'static str, u64); 9] {
        [
            (names::PUTS, self.puts),
            (names::PUT_BYTES, self.put_bytes),
            (names::GETS, self.gets),
            (names::GET_BYTES, self.get_bytes),
            (names::HEADS, self.heads),
            (names::LISTS, self.lists),
            (names::DELETES, self.deletes),
            (names::RETRIES, self.retries),
            (names::GIVE_UPS, self.give_ups),
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
            retries: self.retries - o.retries,
            give_ups: self.give_ups - o.give_ups,
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
            retries: self.retries.load(Ordering::Relaxed),
            give_ups: self.give_ups.load(Ordering::Relaxed),
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
        Self::sharing(inner, Arc::default())
    }

    /// Wrap `inner`, counting into `metrics` (shared with a [`crate::RetryStore`] below, which
    /// adds its retries there).
    pub fn sharing(inner: S, metrics: Arc<StoreMetrics>) -> Self {
        MetricsStore { inner, metrics }
    }

    /// The shared counters.
    pub fn metrics(&self) -> Arc<StoreMetrics> {
        self.metrics.clone()
    }
}

wrapper_display!([S: ObjectStore] MetricsStore<S>, "Metrics");

/// Counts each part of a multipart upload as a put.
struct CountParts(Arc<StoreMetrics>);

impl UploadHooks for CountParts {
    fn part(&self, len: u64) -> OsResult<()> {
        self.0.puts.fetch_add(1, Ordering::Relaxed);
        self.0.put_bytes.fetch_add(len, Ordering::Relaxed);
        Ok(())
    }
}

object_store_wrapper! {
    impl [S: ObjectStore] for MetricsStore<S>;
    pass [copy_opts, rename_opts];

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
        Ok(Box::new(HookedUpload {
            inner,
            hooks: CountParts(self.metrics.clone()),
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

/// Faults at random: each request (of every kind: put, get, head, list, delete, copy, rename)
/// fails with probability `rate`, drawn from a seeded generator, as an error, a timeout or a
/// slow request (weights `mix`). A timed-out put is carried out first and then hangs (its
/// answer is lost), which is what makes retrying a conditional put ambiguous.
#[derive(Debug, Clone, PartialEq)]
pub struct RandomFaults {
    /// Fraction of requests that get a fault (0..=1).
    pub rate: f64,
    /// Seed of the generator.
    pub seed: u64,
    /// Relative weights of (error, timeout, slow).
    pub mix: [u32; 3],
    /// How long a timed-out request hangs (longer than the retry layer waits).
    pub hang: Duration,
    /// How long a slow request waits before it runs.
    pub slow: Duration,
    /// An outage at a time after the faults were set: (start, length); every request fails
    /// during it.
    pub outage: Option<(Duration, Duration)>,
}

impl RandomFaults {
    /// `rate` of requests fail (errors 2 : timeouts 1 : slow 1), hanging an hour, slow 200 ms.
    pub fn new(rate: f64, seed: u64) -> Self {
        RandomFaults {
            rate,
            seed,
            mix: [2, 1, 1],
            hang: Duration::from_secs(3600),
            slow: Duration::from_millis(200),
            outage: None,
        }
    }

    /// Parse `rate=0.05,seed=7,mix=2:1:1,hang_ms=3600000,slow_ms=200,outage_s=10+5` (every
    /// field optional; `outage_s=START+LENGTH` in seconds after the store opened). The format
    /// of `CKPT_FAULTS` (see [`crate::OpenOptions`]).
    pub fn parse(spec: &str) -> crate::Result<Self> {
        let mut f = RandomFaults::new(0.0, 0);
        let bad = |what: &str| {
            crate::Error::invalid(format!(
                "fault spec {spec:?}: {what} (expected e.g. rate=0.05,seed=7,mix=2:1:1,\
                 hang_ms=60000,slow_ms=200,outage_s=10+5)"
            ))
        };
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| bad(&format!("{part:?} is not KEY=VALUE")))?;
            let num = |v: &str| -> crate::Result<f64> {
                v.trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|x| x.is_finite() && *x >= 0.0)
                    .ok_or_else(|| bad(&format!("{k}: {v:?} is not a number >= 0")))
            };
            match k.trim() {
                "rate" => {
                    f.rate = num(v)?;
                    if f.rate > 1.0 {
                        return Err(bad(&format!("rate {v} is above 1")));
                    }
                }
                "seed" => f.seed = num(v)? as u64,
                "mix" => {
                    let w: Vec<_> = v.split(':').map(num).collect::<crate::Result<_>>()?;
                    if w.len() != 3 || w.iter().all(|x| *x == 0.0) {
                        return Err(bad("mix needs three weights error:timeout:slow, not all 0"));
                    }
                    f.mix = [w[0] as u32, w[1] as u32, w[2] as u32];
                }
                "hang_ms" => f.hang = Duration::from_millis(num(v)? as u64),
                "slow_ms" => f.slow = Duration::from_millis(num(v)? as u64),
                "outage_s" => {
                    let (a, b) = v
                        .split_once('+')
                        .ok_or_else(|| bad("outage_s needs START+LENGTH"))?;
                    f.outage = Some((
                        Duration::from_secs_f64(num(a)?),
                        Duration::from_secs_f64(num(b)?),
                    ));
                }
                other => return Err(bad(&format!("unknown key {other:?}"))),
            }
        }
        Ok(f)
    }
}

/// What random faults did so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct RandomFaultStats {
    /// Requests seen while random faults or the outage were on.
    pub requests: u64,
    /// Requests failed with an error.
    pub errors: u64,
    /// Requests made to hang.
    pub timeouts: u64,
    /// Requests slowed down.
    pub slow: u64,
    /// Requests failed by the outage.
    pub outage: u64,
}

#[derive(Debug, Default)]
struct RandomState {
    cfg: Option<(RandomFaults, std::time::Instant)>,
    rng: u64,
    outage: bool,
    stats: RandomFaultStats,
    /// A sink of this many bytes a second for put payloads (a slow link to an object store):
    /// each put waits until the link has carried the payloads before it.
    put_rate: Option<u64>,
    /// When the link is free again.
    link_free: Option<std::time::Instant>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chance {
    None,
    Error,
    Timeout(Duration),
    Slow(Duration),
    Outage,
}

impl RandomState {
    fn draw(&mut self) -> Chance {
        let Some((cfg, since)) = &self.cfg else {
            if self.outage {
                self.stats.requests += 1;
                self.stats.outage += 1;
                return Chance::Outage;
            }
            return Chance::None;
        };
        self.stats.requests += 1;
        let in_window = cfg.outage.is_some_and(|(start, len)| {
            let t = since.elapsed();
            t >= start && t < start + len
        });
        if self.outage || in_window {
            self.stats.outage += 1;
            return Chance::Outage;
        }
        // splitmix64
        self.rng = self.rng.wrapping_add(0x9E3779B97F4A7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
        z ^= z >> 31;
        let u = (z >> 11) as f64 / (1u64 << 53) as f64;
        if u >= cfg.rate || cfg.rate == 0.0 {
            return Chance::None;
        }
        let total: u64 = cfg.mix.iter().map(|w| *w as u64).sum::<u64>().max(1);
        let pick = ((u / cfg.rate) * total as f64) as u64;
        if pick < cfg.mix[0] as u64 {
            self.stats.errors += 1;
            Chance::Error
        } else if pick < (cfg.mix[0] + cfg.mix[1]) as u64 {
            self.stats.timeouts += 1;
            Chance::Timeout(cfg.hang)
        } else {
            self.stats.slow += 1;
            Chance::Slow(cfg.slow)
        }
    }
}

/// Injects failures, delays and damage into an inner store, by rule or at random.
#[derive(Debug)]
pub struct FaultyStore<S> {
    inner: S,
    rules: Arc<Mutex<Vec<RuleState>>>,
    random: Arc<Mutex<RandomState>>,
}

wrapper_display!([S: ObjectStore] FaultyStore<S>, "Faulty");

/// A handle to add and inspect the rules of a [`FaultyStore`] after it was moved into a store.
#[derive(Debug, Clone)]
pub struct FaultHandle {
    rules: Arc<Mutex<Vec<RuleState>>>,
    random: Arc<Mutex<RandomState>>,
}

impl FaultHandle {
    /// Add a rule.
    pub fn add(&self, fault: Fault) {
        self.rules.lock().push(RuleState {
            fault,
            seen: 0,
            fired: 0,
        });
    }
    /// Remove every rule, turn random faults and the outage off.
    pub fn clear(&self) {
        self.rules.lock().clear();
        let mut r = self.random.lock();
        r.cfg = None;
        r.outage = false;
    }
    /// How many times rules fired in total.
    pub fn fired(&self) -> u64 {
        self.rules.lock().iter().map(|r| r.fired).sum()
    }
    /// Fail requests at random as `faults` says (`None`: stop), restarting the generator from
    /// its seed.
    pub fn set_random(&self, faults: Option<RandomFaults>) {
        let mut r = self.random.lock();
        r.rng = faults.as_ref().map_or(0, |f| f.seed);
        r.cfg = faults.map(|f| (f, std::time::Instant::now()));
    }
    /// Carry put payloads at `bytes_per_s` at most, one link for every put (`None`: as fast as
    /// the inner store): an object store behind a slow network, for measurements.
    pub fn set_put_rate(&self, bytes_per_s: Option<u64>) {
        let mut r = self.random.lock();
        r.put_rate = bytes_per_s.filter(|&b| b > 0);
        r.link_free = None;
    }
    /// Turn the outage on (every request fails at once) or off.
    pub fn set_outage(&self, on: bool) {
        self.random.lock().outage = on;
    }
    /// What random faults and the outage did so far.
    pub fn random_stats(&self) -> RandomFaultStats {
        self.random.lock().stats
    }
}

impl<S: ObjectStore> FaultyStore<S> {
    /// Wrap `inner` with no rules.
    pub fn new(inner: S) -> Self {
        FaultyStore {
            inner,
            rules: Arc::default(),
            random: Arc::default(),
        }
    }

    /// A handle to the rules.
    pub fn handle(&self) -> FaultHandle {
        FaultHandle {
            rules: self.rules.clone(),
            random: self.random.clone(),
        }
    }

    fn actions(&self, op: FaultOp, key: &Path) -> Vec<FaultAction> {
        let mut rules = self.rules.lock();
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

    /// The random fault of one request: errors and slowness happen here; a timeout hangs here
    /// unless `hang_after` (a write: it is carried out first, see [`FaultyStore::after`]).
    async fn chance(&self, what: &str, key: &Path, hang_after: bool) -> OsResult<Chance> {
        let c = self.random.lock().draw();
        match c {
            Chance::Error => Err(object_store::Error::Generic {
                store: "FaultyStore",
                source: format!("injected random failure on {what} {key}").into(),
            }),
            Chance::Outage => Err(object_store::Error::Generic {
                store: "FaultyStore",
                source: format!("injected outage: {what} {key} refused").into(),
            }),
            Chance::Slow(d) => {
                tokio::time::sleep(d).await;
                Ok(c)
            }
            Chance::Timeout(d) if !hang_after => {
                tokio::time::sleep(d).await;
                Ok(Chance::None)
            }
            _ => Ok(c),
        }
    }

    /// Wait for the slow link to carry `bytes` (see [`FaultHandle::set_put_rate`]).
    async fn carry(&self, bytes: usize) {
        let until = {
            let mut r = self.random.lock();
            let Some(rate) = r.put_rate else {
                return;
            };
            let now = std::time::Instant::now();
            let start = r.link_free.map_or(now, |f| f.max(now));
            let end = start + Duration::from_secs_f64(bytes as f64 / rate as f64);
            r.link_free = Some(end);
            end
        };
        tokio::time::sleep_until(until.into()).await;
    }

    /// After a write that drew a timeout: hang (the answer is lost), then answer.
    async fn after<T>(c: Chance, r: OsResult<T>) -> OsResult<T> {
        if let Chance::Timeout(d) = c {
            tokio::time::sleep(d).await;
        }
        r
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
        let c = self.chance("put", location, true).await?;
        self.carry(payload.content_length()).await;
        let r = self.inner.put_opts(location, payload, opts).await;
        Self::after(c, r).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> OsResult<Box<dyn MultipartUpload>> {
        self.pre(FaultOp::Put, location).await?;
        self.chance("multipart put", location, false).await?;
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> OsResult<GetResult> {
        let op = if options.head {
            FaultOp::Any
        } else {
            FaultOp::Get
        };
        let acts = self.pre(op, location).await?;
        self.chance(if options.head { "head" } else { "get" }, location, false)
            .await?;
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
        self.chance("get", location, false).await?;
        let r = self.inner.get_ranges(location, ranges).await?;
        Ok(r.into_iter()
            .map(|b| Bytes::from(damage(b.to_vec(), &acts)))
            .collect())
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, OsResult<Path>>,
    ) -> BoxStream<'static, OsResult<Path>> {
        let random = self.random.clone();
        // Every delete draws; a drawn fault fails that location (after deleting it, for a
        // timeout: the answer is lost).
        self.inner
            .delete_stream(locations)
            .then(move |r| {
                let c = random.lock().draw();
                async move {
                    let p = r?;
                    match c {
                        Chance::Error | Chance::Outage => Err(object_store::Error::Generic {
                            store: "FaultyStore",
                            source: format!("injected failure on delete {p}").into(),
                        }),
                        Chance::Slow(d) => {
                            tokio::time::sleep(d).await;
                            Ok(p)
                        }
                        Chance::Timeout(d) => {
                            tokio::time::sleep(d).await;
                            Ok(p)
                        }
                        Chance::None => Ok(p),
                    }
                }
            })
            .boxed()
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, OsResult<ObjectMeta>> {
        let c = self.random.lock().draw();
        let what = prefix.map_or_else(String::new, |p| p.to_string());
        match c {
            Chance::None => self.inner.list(prefix),
            Chance::Error | Chance::Outage => futures::stream::once(async move {
                Err(object_store::Error::Generic {
                    store: "FaultyStore",
                    source: format!("injected failure on list {what}").into(),
                })
            })
            .boxed(),
            Chance::Slow(d) | Chance::Timeout(d) => {
                let inner = self.inner.list(prefix);
                futures::stream::once(tokio::time::sleep(d))
                    .map(|()| None)
                    .chain(inner.map(Some))
                    .filter_map(futures::future::ready)
                    .boxed()
            }
        }
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> OsResult<ListResult> {
        let key = prefix.cloned().unwrap_or_default();
        self.chance("list", &key, false).await?;
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> OsResult<()> {
        let c = self.chance("copy", to, true).await?;
        let r = self.inner.copy_opts(from, to, options).await;
        Self::after(c, r).await
    }

    async fn rename_opts(&self, from: &Path, to: &Path, options: RenameOptions) -> OsResult<()> {
        let c = self.chance("rename", to, true).await?;
        let r = self.inner.rename_opts(from, to, options).await;
        Self::after(c, r).await
    }
}
