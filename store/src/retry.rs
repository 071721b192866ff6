//! [`RetryStore`]: retries transient request failures of an inner [`ObjectStore`], with
//! exponential backoff and jitter, a per-request timeout and a bounded number of attempts.
//!
//! [`crate::open`] puts it under every store it opens (local directory, memory, S3, ...), below
//! the request counters, so `store.puts` counts requests as the store made them and
//! `store.retries` / `store.give_ups` what the retries cost. Object store clients that retry on
//! their own (`object_store`'s S3 client) keep doing so; this layer also covers the local
//! directory and memory stores and adds the per-request timeout.
//!
//! What is retried: backend errors that may pass (`Generic`, a join error, a timeout). Never:
//! not found, already exists / precondition failed (the answer of a conditional put),
//! not modified, bad paths, unsupported or unauthorised requests, and local errors that do not
//! pass by themselves (a full disk, permissions, a read-only file system). Damaged data is
//! found above this layer (hash checks) and is not retried either.
//!
//! A conditional put (create-if-absent, or update-if-unchanged) whose attempt timed out or
//! failed may still have taken effect; its retry then answers "already exists" (or
//! "precondition failed") about our own write. After such an attempt the layer reads the object
//! back: if it holds exactly the bytes being put, the put succeeded, otherwise the conflict
//! stands (someone else's object). Commit records, manifests and leases keep their semantics.
//!
//! Not retried: the body of a streaming get once it started, the parts of a multipart upload
//! (their client retries them; the upload's start is retried here).

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use futures::stream::BoxStream;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    ObjectStoreExt, PutMode, PutMultipartOptions, PutOptions, PutPayload, PutResult, RenameOptions,
    Result as OsResult,
};

use crate::error::{Error, Result};
use crate::layer::wrapper_display;
use crate::wrap::StoreMetrics;

/// Settings of a [`RetryStore`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryConfig {
    /// Attempts per request, the first included (default 6; 1 = no retries).
    pub attempts: u32,
    /// Backoff before the first retry (default 50 ms); doubles each retry.
    pub min_backoff: Duration,
    /// Longest backoff (default 5 s).
    pub max_backoff: Duration,
    /// A request that has not answered after this long is abandoned and retried
    /// (default 120 s: a 64 MiB part on a slow link still fits).
    pub request_timeout: Duration,
}

impl Default for RetryConfig {
    fn default() -> Self {
        RetryConfig {
            attempts: 6,
            min_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_secs(5),
            request_timeout: Duration::from_secs(120),
        }
    }
}

impl RetryConfig {
    /// Parse `attempts=6,min_ms=50,max_ms=5000,timeout_ms=120000` (every field optional, the
    /// rest default): the format of `CKPT_STORE_RETRY` (see [`crate::OpenOptions`]).
    pub fn parse(spec: &str) -> Result<Self> {
        let mut c = RetryConfig::default();
        let bad = |what: String| {
            Error::invalid(format!(
                "retry settings {spec:?}: {what} (expected e.g. \
                 attempts=6,min_ms=50,max_ms=5000,timeout_ms=120000)"
            ))
        };
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| bad(format!("{part:?} is not KEY=VALUE")))?;
            let n: u64 = v
                .trim()
                .parse()
                .map_err(|_| bad(format!("{k}: {v:?} is not a whole number")))?;
            match k.trim() {
                "attempts" => c.attempts = n as u32,
                "min_ms" => c.min_backoff = Duration::from_millis(n),
                "max_ms" => c.max_backoff = Duration::from_millis(n),
                "timeout_ms" => c.request_timeout = Duration::from_millis(n),
                other => return Err(bad(format!("unknown key {other:?}"))),
            }
        }
        c.validate()?;
        Ok(c)
    }

    /// Check the settings.
    pub fn validate(&self) -> Result<()> {
        if self.attempts == 0 {
            return Err(Error::invalid("retry attempts must be at least 1"));
        }
        if self.request_timeout.is_zero() {
            return Err(Error::invalid("the per-request timeout must be above 0"));
        }
        if self.min_backoff > self.max_backoff {
            return Err(Error::invalid(format!(
                "retry backoff: the first ({:?}) is longer than the longest ({:?})",
                self.min_backoff, self.max_backoff
            )));
        }
        Ok(())
    }

    /// The pause before retry `n` (1-based): `min * 2^(n-1)` capped at `max`, with "full
    /// jitter" in its upper half (a pause in `[d/2, d]`), so that writers that failed together
    /// do not come back together.
    fn backoff(&self, n: u32, jitter: f64) -> Duration {
        let d = self
            .min_backoff
            .saturating_mul(1u32 << (n.saturating_sub(1)).min(20))
            .min(self.max_backoff);
        d.mul_f64(0.5 + 0.5 * jitter.clamp(0.0, 1.0))
    }
}

/// Whether an error of the inner store may pass if the request is made again.
pub fn is_transient(e: &object_store::Error) -> bool {
    use object_store::Error as E;
    match e {
        E::NotFound { .. }
        | E::AlreadyExists { .. }
        | E::Precondition { .. }
        | E::NotModified { .. }
        | E::InvalidPath { .. }
        | E::NotSupported { .. }
        | E::NotImplemented { .. }
        | E::PermissionDenied { .. }
        | E::Unauthenticated { .. }
        | E::UnknownConfigurationKey { .. } => false,
        E::Generic { store, .. } if *store == AMBIGUOUS => false,
        E::Generic { source, .. } => !permanent_io(source.as_ref()),
        _ => true,
    }
}

/// A local error somewhere in the chain that does not pass by itself (a full disk, no
/// permission, a read-only file system, a path that is not a directory).
fn permanent_io(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(e) = cur {
        if let Some(io) = e.downcast_ref::<std::io::Error>()
            && let Some(code) = io.raw_os_error()
        {
            return matches!(
                code,
                libc::ENOSPC
                    | libc::EDQUOT
                    | libc::EACCES
                    | libc::EPERM
                    | libc::EROFS
                    | libc::ENOTDIR
                    | libc::EISDIR
                    | libc::ENAMETOOLONG
                    | libc::ELOOP
                    | libc::EFBIG
            );
        }
        cur = e.source();
    }
    false
}

/// Retries transient failures of an inner store (see the module docs).
#[derive(Debug)]
pub struct RetryStore<S> {
    inner: Arc<S>,
    cfg: RetryConfig,
    metrics: Arc<StoreMetrics>,
}

wrapper_display!([S: ObjectStore] RetryStore<S>, "Retry");

/// The outcome of one attempt.
enum Attempt<T> {
    Done(T),
    /// Failed for good with this error (not transient).
    Final(object_store::Error),
    /// Failed with a transient error or timed out.
    Again(object_store::Error),
}

impl<S: ObjectStore> RetryStore<S> {
    /// Wrap `inner`, counting retries into `metrics` (share them with the
    /// [`crate::MetricsStore`] above: [`crate::MetricsStore::sharing`]).
    pub fn new(inner: S, cfg: RetryConfig, metrics: Arc<StoreMetrics>) -> Self {
        RetryStore {
            inner: Arc::new(inner),
            cfg,
            metrics,
        }
    }

    /// The settings.
    pub fn config(&self) -> &RetryConfig {
        &self.cfg
    }

    async fn attempt<T, Fut>(&self, what: &str, key: &Path, fut: Fut) -> Attempt<T>
    where
        Fut: Future<Output = OsResult<T>>,
    {
        match tokio::time::timeout(self.cfg.request_timeout, fut).await {
            Ok(Ok(x)) => Attempt::Done(x),
            Ok(Err(e)) if is_transient(&e) => Attempt::Again(e),
            Ok(Err(e)) => Attempt::Final(e),
            Err(_) => Attempt::Again(object_store::Error::Generic {
                store: "RetryStore",
                source: format!(
                    "{what} {key}: no answer within {:?} (per-request timeout)",
                    self.cfg.request_timeout
                )
                .into(),
            }),
        }
    }

    /// Run `f` until it succeeds, fails for good, or the attempts run out. `ambiguous` is told
    /// whether an earlier attempt failed in a way that may have taken effect.
    async fn run<T, F, Fut>(&self, what: &str, key: &Path, mut f: F) -> OsResult<T>
    where
        F: FnMut(bool) -> Fut,
        Fut: Future<Output = OsResult<T>>,
    {
        let t0 = Instant::now();
        let mut failed_before = false;
        let mut n = 1;
        loop {
            let e = match self.attempt(what, key, f(failed_before)).await {
                Attempt::Done(x) => return Ok(x),
                Attempt::Final(e) => return Err(e),
                Attempt::Again(e) => e,
            };
            failed_before = true;
            if n >= self.cfg.attempts {
                self.metrics.give_ups.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%key, attempts = n, "store request failed, giving up: {e}");
                return Err(object_store::Error::Generic {
                    store: "RetryStore",
                    source: format!(
                        "{what} {key}: gave up after {n} attempts in {:.1} s; last error: {}",
                        t0.elapsed().as_secs_f64(),
                        first_line(&e)
                    )
                    .into(),
                });
            }
            let pause = self.cfg.backoff(n, jitter());
            tracing::debug!(%key, attempt = n, ?pause, "store request failed, retrying: {e}");
            self.metrics.retries.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(pause).await;
            n += 1;
        }
    }

    /// Whether the object at `location` holds exactly `payload` (after a conditional put's
    /// retry was refused: was the refusing object our own earlier attempt?). `Some(meta)` if so.
    async fn holds(&self, location: &Path, payload: &PutPayload) -> OsResult<Option<ObjectMeta>> {
        let r = self
            .run("get", location, |_| async {
                let r = self.inner.get_opts(location, GetOptions::default()).await?;
                let meta = r.meta.clone();
                Ok((meta, r.bytes().await?))
            })
            .await;
        let (meta, got) = match r {
            Ok(x) => x,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(e),
        };
        let want: Bytes = payload.clone().into();
        Ok((got == want).then_some(meta))
    }
}

fn first_line(e: &object_store::Error) -> String {
    e.to_string().lines().next().unwrap_or("").to_string()
}

/// A number in [0, 1) that differs between calls and processes.
fn jitter() -> f64 {
    use std::sync::atomic::AtomicU64;
    static STATE: AtomicU64 = AtomicU64::new(0);
    let seed = STATE.fetch_add(0x9E3779B97F4A7C15, Ordering::Relaxed)
        ^ (std::process::id() as u64).rotate_left(32)
        ^ crate::clock::system_now().timestamp_subsec_nanos() as u64;
    let mut z = seed.wrapping_add(0x9E3779B97F4A7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

#[async_trait]
impl<S: ObjectStore> ObjectStore for RetryStore<S> {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> OsResult<PutResult> {
        let conditional = !matches!(opts.mode, PutMode::Overwrite);
        let r = self
            .run("put", location, |failed_before| {
                let (payload, opts) = (payload.clone(), opts.clone());
                async move {
                    match self.inner.put_opts(location, payload, opts).await {
                        Err(
                            e @ (object_store::Error::AlreadyExists { .. }
                            | object_store::Error::Precondition { .. }),
                        ) if conditional && failed_before => Err(AmbiguousConflict(e).into()),
                        r => r,
                    }
                }
            })
            .await;
        match r {
            Err(object_store::Error::Generic { store, source })
                if store == AMBIGUOUS && source.is::<AmbiguousConflict>() =>
            {
                let conflict = *source
                    .downcast::<AmbiguousConflict>()
                    .expect("checked type");
                match self.holds(location, &payload).await? {
                    Some(meta) => {
                        tracing::debug!(
                            %location,
                            "a conditional put was retried after an attempt that took effect"
                        );
                        Ok(PutResult {
                            e_tag: meta.e_tag,
                            version: meta.version,
                            extensions: Default::default(),
                        })
                    }
                    None => Err(conflict.0),
                }
            }
            r => r,
        }
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> OsResult<Box<dyn MultipartUpload>> {
        self.run("multipart put", location, |_| {
            self.inner.put_multipart_opts(location, opts.clone())
        })
        .await
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> OsResult<GetResult> {
        let what = if options.head { "head" } else { "get" };
        self.run(what, location, |_| {
            self.inner.get_opts(location, options.clone())
        })
        .await
    }

    async fn get_ranges(
        &self,
        location: &Path,
        ranges: &[std::ops::Range<u64>],
    ) -> OsResult<Vec<Bytes>> {
        self.run("get", location, |_| self.inner.get_ranges(location, ranges))
            .await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, OsResult<Path>>,
    ) -> BoxStream<'static, OsResult<Path>> {
        // One retried delete per location, a few at a time. A delete that finds nothing (its
        // earlier attempt took effect) is a success.
        let me = RetryStore {
            inner: self.inner.clone(),
            cfg: self.cfg.clone(),
            metrics: self.metrics.clone(),
        };
        let me = Arc::new(me);
        locations
            .map(move |p| {
                let me = me.clone();
                async move {
                    let p = p?;
                    let r = me
                        .run("delete", &p, |failed_before| {
                            let one = futures::stream::once(futures::future::ready(Ok(p.clone())));
                            let mut s = me.inner.delete_stream(one.boxed());
                            async move {
                                match s.next().await {
                                    Some(Err(object_store::Error::NotFound { .. }))
                                        if failed_before =>
                                    {
                                        Ok(())
                                    }
                                    Some(Err(e)) => Err(e),
                                    _ => Ok(()),
                                }
                            }
                        })
                        .await;
                    r.map(|()| p)
                }
            })
            .buffered(8)
            .boxed()
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, OsResult<ObjectMeta>> {
        // A listing that fails part way is started again; what was already returned is not
        // returned twice (local listings come in no fixed order, so no offset can resume them).
        let inner = self.inner.clone();
        let cfg = self.cfg.clone();
        let metrics = self.metrics.clone();
        let prefix = prefix.cloned();
        struct State<S> {
            inner: Arc<S>,
            cfg: RetryConfig,
            metrics: Arc<StoreMetrics>,
            prefix: Option<Path>,
            stream: Option<BoxStream<'static, OsResult<ObjectMeta>>>,
            seen: std::collections::HashSet<Path>,
            attempt: u32,
            t0: Instant,
            done: bool,
        }
        let st = State {
            inner,
            cfg,
            metrics,
            prefix,
            stream: None,
            seen: Default::default(),
            attempt: 1,
            t0: Instant::now(),
            done: false,
        };
        futures::stream::unfold(st, |mut st| async move {
            if st.done {
                return None;
            }
            loop {
                let s = st
                    .stream
                    .get_or_insert_with(|| st.inner.list(st.prefix.as_ref()));
                let e = match tokio::time::timeout(st.cfg.request_timeout, s.next()).await {
                    Ok(None) => return None,
                    Ok(Some(Ok(m))) => {
                        if st.seen.insert(m.location.clone()) {
                            return Some((Ok(m), st));
                        }
                        continue;
                    }
                    Ok(Some(Err(e))) if !is_transient(&e) => {
                        st.done = true;
                        return Some((Err(e), st));
                    }
                    Ok(Some(Err(e))) => e,
                    Err(_) => object_store::Error::Generic {
                        store: "RetryStore",
                        source: format!(
                            "list {}: no answer within {:?} (per-request timeout)",
                            st.prefix.as_ref().map_or("", |p| p.as_ref()),
                            st.cfg.request_timeout
                        )
                        .into(),
                    },
                };
                st.stream = None;
                if st.attempt >= st.cfg.attempts {
                    st.metrics.give_ups.fetch_add(1, Ordering::Relaxed);
                    st.done = true;
                    let err = object_store::Error::Generic {
                        store: "RetryStore",
                        source: format!(
                            "list {}: gave up after {} attempts in {:.1} s; last error: {}",
                            st.prefix.as_ref().map_or("", |p| p.as_ref()),
                            st.attempt,
                            st.t0.elapsed().as_secs_f64(),
                            first_line(&e)
                        )
                        .into(),
                    };
                    return Some((Err(err), st));
                }
                st.metrics.retries.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(st.cfg.backoff(st.attempt, jitter())).await;
                st.attempt += 1;
            }
        })
        .boxed()
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> OsResult<ListResult> {
        let key = prefix.cloned().unwrap_or_default();
        self.run("list", &key, |_| self.inner.list_with_delimiter(prefix))
            .await
    }

    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> OsResult<()> {
        self.run("copy", to, |_| {
            self.inner.copy_opts(from, to, options.clone())
        })
        .await
    }

    async fn rename_opts(&self, from: &Path, to: &Path, options: RenameOptions) -> OsResult<()> {
        self.run("rename", to, |failed_before| {
            let options = options.clone();
            async move {
                match self.inner.rename_opts(from, to, options).await {
                    // The earlier attempt moved it.
                    Err(object_store::Error::NotFound { .. })
                        if failed_before && self.inner.head(to).await.is_ok() =>
                    {
                        Ok(())
                    }
                    r => r,
                }
            }
        })
        .await
    }
}

const AMBIGUOUS: &str = "RetryStore(conflict after a failed attempt)";

/// A conditional put refused on a retry: maybe by our own earlier attempt. Carried through the
/// retry loop as a final error, checked by reading the object back.
#[derive(Debug)]
struct AmbiguousConflict(object_store::Error);

impl fmt::Display for AmbiguousConflict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for AmbiguousConflict {}

impl From<AmbiguousConflict> for object_store::Error {
    fn from(e: AmbiguousConflict) -> Self {
        object_store::Error::Generic {
            store: AMBIGUOUS,
            source: Box::new(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wrap::{Fault, FaultAction, FaultOp, FaultyStore, RandomFaults};
    use object_store::memory::InMemory;

    fn fast() -> RetryConfig {
        RetryConfig {
            attempts: 3,
            min_backoff: Duration::from_millis(5),
            max_backoff: Duration::from_millis(20),
            request_timeout: Duration::from_millis(300),
        }
    }

    fn stack(cfg: RetryConfig) -> (RetryStore<FaultyStore<InMemory>>, crate::FaultHandle) {
        let f = FaultyStore::new(InMemory::new());
        let h = f.handle();
        (RetryStore::new(f, cfg, Arc::default()), h)
    }

    fn fail(op: FaultOp, nth: u64) -> Fault {
        Fault {
            op,
            key_contains: None,
            nth,
            action: FaultAction::Fail,
        }
    }

    fn create() -> PutOptions {
        PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn transient_failures_are_retried_and_counted() {
        let (s, h) = stack(fast());
        h.add(fail(FaultOp::Put, 1));
        h.add(fail(FaultOp::Get, 1));
        let p = Path::from("a");
        s.put(&p, Bytes::from_static(b"x").into()).await.unwrap();
        assert_eq!(s.get(&p).await.unwrap().bytes().await.unwrap(), "x");
        let m = s.metrics.snapshot();
        assert_eq!((m.retries, m.give_ups), (2, 0));
    }

    #[tokio::test]
    async fn giving_up_names_the_attempts_and_the_last_error() {
        let (s, h) = stack(fast());
        h.add(fail(FaultOp::Put, 0));
        let e = s
            .put(&Path::from("k/x"), Bytes::from_static(b"x").into())
            .await
            .unwrap_err();
        let msg = Error::backend("writing", &"k/x", e).to_string();
        assert!(
            msg.contains("gave up after 3 attempts") && msg.contains("injected failure on k/x"),
            "{msg}"
        );
        assert_eq!(s.metrics.snapshot().give_ups, 1);
    }

    #[tokio::test]
    async fn answers_are_not_retried() {
        let (s, _h) = stack(fast());
        let e = s.get(&Path::from("missing")).await.unwrap_err();
        assert!(matches!(e, object_store::Error::NotFound { .. }), "{e}");
        let p = Path::from("once");
        s.put_opts(&p, Bytes::from_static(b"mine").into(), create())
            .await
            .unwrap();
        let e = s
            .put_opts(&p, Bytes::from_static(b"mine").into(), create())
            .await
            .unwrap_err();
        assert!(
            matches!(e, object_store::Error::AlreadyExists { .. }),
            "a first-attempt conflict is a conflict, even with equal bytes: {e}"
        );
        assert_eq!(s.metrics.snapshot().retries, 0);
        // A full disk does not pass by itself.
        let full = object_store::Error::Generic {
            store: "DirectFs",
            source: Box::new(std::io::Error::from_raw_os_error(libc::ENOSPC)),
        };
        assert!(!is_transient(&full));
    }

    /// A create whose first attempt took effect but whose answer was lost (a timeout): the
    /// retry meets our own object and reports success, not a conflict.
    #[tokio::test]
    async fn a_retried_create_that_had_succeeded_is_a_success() {
        let (s, h) = stack(fast());
        h.set_random(Some(RandomFaults {
            mix: [0, 1, 0],
            ..RandomFaults::new(1.0, 1)
        }));
        let p = Path::from("commit");
        let put = s.put_opts(&p, Bytes::from_static(b"record").into(), create());
        let clear = async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            h.set_random(None);
        };
        let (r, ()) = tokio::join!(put, clear);
        r.unwrap();
        assert!(h.random_stats().timeouts >= 1);
        assert!(s.metrics.snapshot().retries >= 1);
    }

    /// Someone else's object behind a retried create stays a conflict.
    #[tokio::test]
    async fn a_retried_create_meeting_another_object_is_a_conflict() {
        let (s, h) = stack(fast());
        let p = Path::from("lease");
        s.put_opts(&p, Bytes::from_static(b"theirs").into(), create())
            .await
            .unwrap();
        h.add(fail(FaultOp::Put, 1));
        let e = s
            .put_opts(&p, Bytes::from_static(b"mine").into(), create())
            .await
            .unwrap_err();
        assert!(
            matches!(e, object_store::Error::AlreadyExists { .. }),
            "{e}"
        );
        assert_eq!(
            s.get(&p).await.unwrap().bytes().await.unwrap(),
            "theirs".as_bytes()
        );
    }

    #[tokio::test]
    async fn listings_and_deletes_are_retried_without_duplicates() {
        let (s, h) = stack(RetryConfig {
            attempts: 30,
            ..fast()
        });
        for i in 0..20 {
            s.put(
                &Path::from(format!("d/{i}")),
                Bytes::from_static(b"x").into(),
            )
            .await
            .unwrap();
        }
        h.set_random(Some(RandomFaults {
            mix: [1, 0, 0],
            ..RandomFaults::new(0.3, 9)
        }));
        let mut keys: Vec<_> = s
            .list(Some(&Path::from("d")))
            .map(|m| m.unwrap().location)
            .collect()
            .await;
        keys.sort();
        keys.dedup();
        assert_eq!(keys.len(), 20);
        let gone: Vec<_> = s
            .delete_stream(futures::stream::iter(keys.into_iter().map(Ok)).boxed())
            .collect()
            .await;
        assert!(gone.iter().all(|r| r.is_ok()), "{gone:?}");
        h.set_random(None);
        assert_eq!(s.list(None).count().await, 0);
        assert!(h.random_stats().errors > 0);
    }

    #[test]
    fn settings_parse_and_backoff_grows_to_its_cap() {
        let c = RetryConfig::parse("attempts=4, timeout_ms=1000").unwrap();
        assert_eq!((c.attempts, c.request_timeout), (4, Duration::from_secs(1)));
        for bad in ["attempts=0", "nope=1", "attempts", "min_ms=10,max_ms=5"] {
            assert!(RetryConfig::parse(bad).is_err(), "{bad}");
        }
        let c = RetryConfig::default();
        assert_eq!(c.backoff(1, 1.0), Duration::from_millis(50));
        assert_eq!(c.backoff(3, 1.0), Duration::from_millis(200));
        assert_eq!(c.backoff(30, 1.0), Duration::from_secs(5));
        assert_eq!(c.backoff(1, 0.0), Duration::from_millis(25));
        let f = RandomFaults::parse("rate=0.05,seed=3,mix=1:0:0,outage_s=1+2").unwrap();
        assert_eq!(f.rate, 0.05);
        assert_eq!(f.mix, [1, 0, 0]);
        assert_eq!(
            f.outage,
            Some((Duration::from_secs(1), Duration::from_secs(2)))
        );
        assert!(RandomFaults::parse("rate=2").is_err());
        assert!(RandomFaults::parse("bogus=1").is_err());
    }
}
