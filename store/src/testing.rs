//! Test helpers (feature `testing`): a real S3-compatible server on loopback, small store
//! settings that reach every boundary with kilobytes, deterministic data, and the conformance
//! suite that every backend runs.
#![allow(
    clippy::disallowed_methods,
    reason = "test helpers find the tools of the test machine in its environment"
)]

use std::net::TcpListener;
use std::path::{Path as FsPath, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::store::{Store, StoreConfig};

/// Settings that make kilobytes reach chunk, pack and in-flight boundaries.
pub fn tiny_config() -> StoreConfig {
    StoreConfig {
        chunk_size: 4096,
        pack_threshold: 1024,
        pack_target: 8192,
        inflight_bytes: 64 << 10,
        write_concurrency: 4,
        read_concurrency: 4,
        ..StoreConfig::default()
    }
}

/// A small seeded generator (splitmix64): a test's random cases replay from its seed.
#[derive(Debug, Clone)]
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next_u64() % n }
    }
}

/// Deterministic bytes: splitmix64 of (seed, index).
pub fn det_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + 8);
    let mut i = 0u64;
    while out.len() < len {
        let mut z = seed
            .wrapping_mul(0x9E3779B97F4A7C15)
            .wrapping_add(i.wrapping_mul(0xBF58476D1CE4E5B9));
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
        z ^= z >> 31;
        out.extend_from_slice(&z.to_le_bytes());
        i += 1;
    }
    out.truncate(len);
    out
}

/// A local-directory store in a temporary directory (kept alive by the returned guard).
pub fn local_store(cfg: StoreConfig) -> (Store, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = crate::url::open(dir.path().to_str().expect("utf-8 temp path"))
        .expect("open local store")
        .with_config(cfg)
        .expect("config");
    (store, dir)
}

/// An in-memory store.
pub fn memory_store(cfg: StoreConfig) -> Store {
    crate::url::open("memory://")
        .expect("memory store")
        .with_config(cfg)
        .expect("config")
}

/// A store over `inner` stacked as [`crate::open`] stacks it, with a [`crate::FaultyStore`]
/// below the retry layer: `Metrics(Retry(Faulty(inner)))`. The handle switches random faults
/// and outages on and off.
pub fn faulty_store<S: object_store::ObjectStore>(
    inner: S,
    prefix: &str,
    url: &str,
    cfg: StoreConfig,
    retry: crate::RetryConfig,
) -> (Store, crate::FaultHandle) {
    let faulty = crate::FaultyStore::new(inner);
    let handle = faulty.handle();
    let metrics = std::sync::Arc::new(crate::StoreMetrics::default());
    let retried = crate::RetryStore::new(faulty, retry, metrics.clone());
    let counted = crate::MetricsStore::sharing(retried, metrics.clone());
    let store = Store::new(
        std::sync::Arc::new(counted),
        object_store::path::Path::from(prefix),
        url,
    )
    .with_config(cfg)
    .expect("config")
    .with_metrics(metrics);
    (store, handle)
}

/// [`faulty_store`] over a local directory store in a temporary directory.
pub fn faulty_local_store(
    cfg: StoreConfig,
    retry: crate::RetryConfig,
) -> (Store, crate::FaultHandle, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temp dir");
    let fs = crate::DirectFs::new(dir.path()).expect("open local store");
    let root = fs.root().to_path_buf();
    let (store, h) = faulty_store(fs, "", &dir.path().display().to_string(), cfg, retry);
    (store.with_local_root(root), h, dir)
}

/// Where the `s3s-fs` binary is: `$CKPT_S3S_FS`, `PATH`, or `.ci-tools/bin` above the crate.
pub fn find_s3s_fs() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("CKPT_S3S_FS") {
        return Some(PathBuf::from(p)).filter(|p| p.is_file());
    }
    if let Some(c) = find_on_path("s3s-fs") {
        return Some(c);
    }
    let mut dir: Option<&FsPath> = Some(FsPath::new(env!("CARGO_MANIFEST_DIR")));
    while let Some(d) = dir {
        let c = d.join(".ci-tools/bin/s3s-fs");
        if c.is_file() {
            return Some(c);
        }
        dir = d.parent();
    }
    None
}

/// Set (to anything but `0` or empty) where no test may be skipped: a test whose dependency on
/// the machine (below) is missing then fails instead. `.ci/run` and `scripts/test.sh` set it.
pub const REQUIRE_ALL: &str = "CKPT_TEST_REQUIRE_ALL";

/// Something a test needs from the machine beyond Rust.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// The S3-compatible test server `s3s-fs` ([`find_s3s_fs`]).
    S3Server,
    /// An `etcd` server binary (`CKPT_ETCD_BIN`, `PATH`, `/usr/bin/etcd`).
    Etcd,
    /// Kernel FUSE mounts: `/dev/fuse`, `fusermount3`, and root.
    Fuse,
    /// A Python with `safetensors` and `numpy` (`CKPT_PYTHON`, or `.ci-tools/venv`).
    Python,
    /// Mounting a size-limited tmpfs ([`Tmpfs`]): root with `CAP_SYS_ADMIN`.
    TmpfsMount,
}

/// What is missing for `need` on this machine, and how to get it; `None` when nothing is.
pub fn missing(need: Need) -> Option<String> {
    const INSTALL: &str = "scripts/install-test-deps.sh installs it";
    match need {
        Need::S3Server => find_s3s_fs().is_none().then(|| {
            format!("the S3 test server s3s-fs is not installed ({INSTALL}, or set CKPT_S3S_FS)")
        }),
        Need::Etcd => find_etcd().is_none().then(|| {
            format!("etcd is not installed (Debian package etcd-server; {INSTALL}, or set CKPT_ETCD_BIN)")
        }),
        Need::Fuse => {
            if !FsPath::new("/dev/fuse").exists() {
                Some("/dev/fuse does not exist (load the fuse module, or give the container the device)".into())
            } else if !on_path("fusermount3") {
                Some(format!("fusermount3 is not installed (Debian package fuse3; {INSTALL})"))
            } else if is_root() {
                None
            } else {
                Some("FUSE tests mount as root: run them as root".into())
            }
        }
        Need::Python => find_python().is_none().then(|| {
            format!("no Python with safetensors and numpy ({INSTALL} into .ci-tools/venv, or set CKPT_PYTHON)")
        }),
        Need::TmpfsMount => {
            if !is_root() {
                return Some("mounting a small tmpfs needs root: run the test as root".into());
            }
            // Try it: a container may refuse mounts even to root.
            let dir = match tempfile::tempdir() {
                Ok(d) => d,
                Err(e) => return Some(format!("no temporary directory to mount on: {e}")),
            };
            match Tmpfs::mount(dir.path(), 64 << 10) {
                Ok(_) => None,
                Err(e) => Some(format!(
                    "mounting a tmpfs failed ({e}): run as root with CAP_SYS_ADMIN"
                )),
            }
        }
    }
}

/// A size-limited tmpfs mounted on a directory: a real file system that fills up. Unmounted
/// (lazily, so an open file never keeps it) on drop.
pub struct Tmpfs {
    dir: PathBuf,
}

impl Tmpfs {
    /// Mount a tmpfs of `bytes` bytes (rounded up to pages by the kernel) on `dir`.
    pub fn mount(dir: &FsPath, bytes: u64) -> std::io::Result<Tmpfs> {
        use std::ffi::CString;
        use std::os::unix::ffi::OsStrExt as _;
        let target = CString::new(dir.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
        let opts =
            CString::new(format!("size={bytes},mode=0755")).map_err(std::io::Error::other)?;
        // SAFETY: every pointer is a NUL-terminated string that outlives the call.
        let rc = unsafe {
            libc::mount(
                c"tmpfs".as_ptr(),
                target.as_ptr(),
                c"tmpfs".as_ptr(),
                0,
                opts.as_ptr().cast(),
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Tmpfs {
            dir: dir.to_path_buf(),
        })
    }

    /// Where it is mounted.
    pub fn path(&self) -> &FsPath {
        &self.dir
    }

    /// Bytes an unprivileged write could still take (`statvfs`'s `f_bavail`).
    pub fn free_bytes(&self) -> u64 {
        free_bytes(&self.dir)
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        use std::os::unix::ffi::OsStrExt as _;
        if let Ok(p) = std::ffi::CString::new(self.dir.as_os_str().as_bytes()) {
            // SAFETY: `p` is a NUL-terminated path that outlives the call.
            unsafe { libc::umount2(p.as_ptr(), libc::MNT_DETACH) };
        }
    }
}

/// Free bytes for unprivileged writes on the file system holding `path` (0 on error).
pub fn free_bytes(path: &FsPath) -> u64 {
    use std::os::unix::ffi::OsStrExt as _;
    let Ok(p) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return 0;
    };
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: `p` is NUL-terminated and `st` is a valid place for the result.
    if unsafe { libc::statvfs(p.as_ptr(), st.as_mut_ptr()) } != 0 {
        return 0;
    }
    // SAFETY: statvfs succeeded, so it filled `st`.
    let st = unsafe { st.assume_init() };
    st.f_bavail.saturating_mul(st.f_frsize)
}

/// Whether a test named `test` can run here: `false` after one line on stderr saying what is
/// missing and how to get it (the test then returns early, a skip); a panic instead where
/// [`REQUIRE_ALL`] is set, so that CI never skips.
pub fn available(need: Need, test: &str) -> bool {
    match missing(need) {
        None => true,
        Some(why) => {
            skip(test, &why);
            false
        }
    }
}

/// Report that `test` is skipped because of `why`: one line on stderr, or a panic where
/// [`REQUIRE_ALL`] is set.
pub fn skip(test: &str, why: &str) {
    let required = std::env::var(REQUIRE_ALL).is_ok_and(|v| !v.is_empty() && v != "0");
    assert!(
        !required,
        "{test}: {why} ({REQUIRE_ALL} is set: nothing may be skipped)"
    );
    // Straight to the file descriptor: the test harness captures `eprintln!`, and a skip
    // must be seen.
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
}

/// Return from the calling test, with one line saying why, when `need` is missing here (see
/// [`available`]).
#[macro_export]
macro_rules! require {
    ($need:expr) => {
        if !$crate::testing::available($need, module_path!()) {
            return;
        }
    };
    ($need:expr, $test:expr) => {
        if !$crate::testing::available($need, $test) {
            return;
        }
    };
}

/// Path of the binary `name` of the workspace package `package` in `profile_dir` (the
/// running test's `target/<profile>`), built with `cargo build` (with `features`) when it is
/// missing or older than any source or manifest of the workspace's library crates: a test
/// never runs a stale binary, and never rebuilds one the test build just made.
pub fn workspace_bin(
    profile_dir: &FsPath,
    name: &str,
    package: &str,
    features: &[&str],
) -> PathBuf {
    static BUILD: parking_lot::Mutex<()> = parking_lot::Mutex::new(());
    let p = profile_dir.join(name);
    let _g = BUILD.lock();
    let built = std::fs::metadata(&p).and_then(|m| m.modified()).ok();
    let root = FsPath::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root");
    if built.is_none_or(|b| newest_source(root).is_some_and(|s| s > b)) {
        let mut c = Command::new(env!("CARGO"));
        c.args(["build", "-p", package, "--bin", name]);
        if !features.is_empty() {
            c.args(["--features", &features.join(",")]);
        }
        if profile_dir.file_name().is_some_and(|d| d == "release") {
            c.arg("--release");
        }
        let st = c.status().expect("cargo build");
        assert!(st.success(), "building {name} failed");
    }
    p
}

/// The newest modification time of the library crates' sources and manifests below the
/// workspace `root` (the crates a binary can be built from; the tests crate is not one).
fn newest_source(root: &FsPath) -> Option<std::time::SystemTime> {
    fn walk(dir: &FsPath, newest: &mut Option<std::time::SystemTime>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            match e.file_type() {
                Ok(t) if t.is_dir() => walk(&e.path(), newest),
                Ok(t) if t.is_file() => {
                    if let Ok(m) = e.metadata().and_then(|m| m.modified()) {
                        *newest = (*newest).max(Some(m));
                    }
                }
                _ => {}
            }
        }
    }
    let mut newest = None;
    let mut files = vec![root.join("Cargo.toml"), root.join("Cargo.lock")];
    for krate in ["store", "trainer", "train", "recovery", "fuse", "ckpt"] {
        walk(&root.join(krate).join("src"), &mut newest);
        files.push(root.join(krate).join("Cargo.toml"));
    }
    for f in files {
        if let Ok(m) = std::fs::metadata(f).and_then(|m| m.modified()) {
            newest = newest.max(Some(m));
        }
    }
    newest
}

/// The etcd binary: `CKPT_ETCD_BIN`, else `etcd` on `PATH`, else `/usr/bin/etcd`.
pub fn find_etcd() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("CKPT_ETCD_BIN") {
        return Some(PathBuf::from(p)).filter(|p| p.is_file());
    }
    find_on_path("etcd").or_else(|| Some(PathBuf::from("/usr/bin/etcd")).filter(|p| p.is_file()))
}

/// The Python with safetensors and numpy: `CKPT_PYTHON`, else `.ci-tools/venv/bin/python`
/// above this crate.
pub fn find_python() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("CKPT_PYTHON") {
        return Some(PathBuf::from(p)).filter(|p| p.is_file());
    }
    let mut dir: Option<&FsPath> = Some(FsPath::new(env!("CARGO_MANIFEST_DIR")));
    while let Some(d) = dir {
        let c = d.join(".ci-tools/venv/bin/python");
        if c.is_file() {
            return Some(c);
        }
        dir = d.parent();
    }
    None
}

fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

fn on_path(name: &str) -> bool {
    find_on_path(name).is_some()
}

fn is_root() -> bool {
    // The owner of this process's /proc entry is its effective user.
    use std::os::unix::fs::MetadataExt as _;
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// A real S3-compatible server (`s3s-fs`, which checks SigV4 signatures) on a free loopback
/// port, serving one bucket from a temporary directory. Killed on drop.
pub struct S3Server {
    child: Child,
    /// `http://127.0.0.1:PORT`
    pub endpoint: String,
    /// The bucket.
    pub bucket: String,
    /// The directory holding the bucket (objects are plain files below it).
    pub root: tempfile::TempDir,
}

/// Access key the test server accepts.
pub const S3_KEY: &str = "ckpt-test";
/// Secret key the test server accepts.
pub const S3_SECRET: &str = "ckpt-test-secret";

impl S3Server {
    /// Start the server. Panics with what to install when the binary is missing: a test
    /// checks [`available`]`(Need::S3Server, ..)` first to skip instead.
    pub fn start() -> S3Server {
        let bin = find_s3s_fs().unwrap_or_else(|| {
            panic!(
                "s3s-fs not found: the S3 conformance tests need a real S3-compatible server. \
                 Install it with `scripts/install-test-deps.sh` (cargo install s3s-fs@0.14.1 \
                 --features binary --locked --root .ci-tools) or set CKPT_S3S_FS"
            )
        });
        let mut last = String::new();
        for _ in 0..5 {
            let root = tempfile::tempdir().expect("temp dir");
            let bucket = "ckpt".to_string();
            std::fs::create_dir(root.path().join(&bucket)).expect("bucket dir");
            let port = free_port();
            let child = Command::new(&bin)
                .args(["--host", "127.0.0.1", "--port", &port.to_string()])
                .args(["--access-key", S3_KEY, "--secret-key", S3_SECRET])
                .arg(root.path())
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()));
            let mut s = S3Server {
                child,
                endpoint: format!("http://127.0.0.1:{port}"),
                bucket,
                root,
            };
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_secs(10) {
                if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                    return s;
                }
                if let Ok(Some(status)) = s.child.try_wait() {
                    let mut err = String::new();
                    if let Some(mut e) = s.child.stderr.take() {
                        use std::io::Read;
                        let _ = e.read_to_string(&mut err);
                    }
                    last = format!("s3s-fs exited with {status}: {err}");
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            if last.is_empty() {
                last = "s3s-fs did not listen within 10 s".into();
            }
        }
        panic!("could not start the S3 test server: {last}");
    }

    /// The object store client for the bucket.
    #[cfg(feature = "s3")]
    pub fn object_store(
        &self,
    ) -> std::sync::Arc<crate::wrap::MetricsStore<object_store::aws::AmazonS3>> {
        std::sync::Arc::new(crate::wrap::MetricsStore::new(self.client()))
    }

    /// The bare S3 client for the bucket.
    #[cfg(feature = "s3")]
    pub fn client(&self) -> object_store::aws::AmazonS3 {
        object_store::aws::AmazonS3Builder::new()
            .with_endpoint(&self.endpoint)
            .with_bucket_name(&self.bucket)
            .with_allow_http(true)
            .with_virtual_hosted_style_request(false)
            .with_region("us-east-1")
            .with_access_key_id(S3_KEY)
            .with_secret_access_key(S3_SECRET)
            .build()
            .expect("S3 client")
    }

    /// A [`Store`] on the bucket below `prefix`.
    #[cfg(feature = "s3")]
    pub fn store(&self, prefix: &str, cfg: StoreConfig) -> Store {
        let os = self.object_store();
        let metrics = os.metrics();
        Store::new(
            os,
            object_store::path::Path::from(prefix),
            format!("s3://{}/{prefix}", self.bucket),
        )
        .with_config(cfg)
        .expect("config")
        .with_metrics(metrics)
    }

    /// Environment variables that make `ckpt_store::open("s3://BUCKET/...")` reach this server.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ENDPOINT_URL", self.endpoint.clone()),
            ("AWS_ACCESS_KEY_ID", S3_KEY.into()),
            ("AWS_SECRET_ACCESS_KEY", S3_SECRET.into()),
            ("AWS_REGION", "us-east-1".into()),
            ("AWS_ALLOW_HTTP", "true".into()),
        ]
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind(("127.0.0.1", 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// A clock for object ages that tests move by hand, so "older than the grace period" takes no
/// waiting (see [`ClockStore`]).
pub use crate::clock::ManualClock as TestClock;

/// An [`object_store::ObjectStore`] over any backend (memory, a local directory, S3) whose
/// objects carry modification times from a [`TestClock`]: every object written through it is
/// stamped with the clock's time, and listings and heads report that stamp. Everything else
/// (the bytes, conditional creates, deletes, listing order) is the backend's own. GC given
/// `now = clock.now()` then sees exactly the ages the test set.
#[derive(Debug)]
pub struct ClockStore {
    inner: std::sync::Arc<dyn object_store::ObjectStore>,
    clock: TestClock,
    stamps: std::sync::Arc<
        parking_lot::Mutex<
            std::collections::HashMap<object_store::path::Path, chrono::DateTime<chrono::Utc>>,
        >,
    >,
}

impl ClockStore {
    /// `store` with its object ages taken from `clock` (same backend, prefix and settings; its
    /// own failpoints).
    pub fn wrap(store: &Store, clock: &TestClock) -> Store {
        let os = ClockStore {
            inner: store.object_store().clone(),
            clock: clock.clone(),
            stamps: Default::default(),
        };
        Store::new(
            std::sync::Arc::new(os),
            store.keys().prefix().clone(),
            store.url(),
        )
        .with_config(store.config().clone())
        .expect("config")
        .with_clock(std::sync::Arc::new(clock.clone()))
    }

    fn stamp(&self, p: &object_store::path::Path) -> Option<chrono::DateTime<chrono::Utc>> {
        self.stamps.lock().insert(p.clone(), self.clock.now())
    }

    fn unstamp(&self, p: &object_store::path::Path, before: Option<chrono::DateTime<chrono::Utc>>) {
        let mut g = self.stamps.lock();
        match before {
            Some(t) => g.insert(p.clone(), t),
            None => g.remove(p),
        };
    }

    fn restamp(
        stamps: &parking_lot::Mutex<
            std::collections::HashMap<object_store::path::Path, chrono::DateTime<chrono::Utc>>,
        >,
        mut m: object_store::ObjectMeta,
    ) -> object_store::ObjectMeta {
        if let Some(t) = stamps.lock().get(&m.location) {
            m.last_modified = *t;
        }
        m
    }
}

crate::layer::wrapper_display!([] ClockStore, "Clock");

crate::layer::object_store_wrapper! {
    impl [] for ClockStore;
    pass [get_ranges];

    async fn put_opts(
        &self,
        location: &object_store::path::Path,
        payload: object_store::PutPayload,
        opts: object_store::PutOptions,
    ) -> object_store::Result<object_store::PutResult> {
        // Stamped before the write, so no listing ever sees the backend's own time.
        let before = self.stamp(location);
        let r = self.inner.put_opts(location, payload, opts).await;
        if r.is_err() {
            self.unstamp(location, before);
        }
        r
    }

    async fn put_multipart_opts(
        &self,
        location: &object_store::path::Path,
        opts: object_store::PutMultipartOptions,
    ) -> object_store::Result<Box<dyn object_store::MultipartUpload>> {
        // Stamped when the upload starts (a little older than the finished object).
        let before = self.stamp(location);
        let r = self.inner.put_multipart_opts(location, opts).await;
        if r.is_err() {
            self.unstamp(location, before);
        }
        r
    }

    async fn get_opts(
        &self,
        location: &object_store::path::Path,
        options: object_store::GetOptions,
    ) -> object_store::Result<object_store::GetResult> {
        let mut r = self.inner.get_opts(location, options).await?;
        r.meta = Self::restamp(&self.stamps, r.meta);
        Ok(r)
    }

    fn delete_stream(
        &self,
        locations: futures::stream::BoxStream<
            'static,
            object_store::Result<object_store::path::Path>,
        >,
    ) -> futures::stream::BoxStream<'static, object_store::Result<object_store::path::Path>> {
        use futures::StreamExt;
        let stamps = self.stamps.clone();
        self.inner
            .delete_stream(locations)
            .inspect(move |r| {
                if let Ok(p) = r {
                    stamps.lock().remove(p);
                }
            })
            .boxed()
    }

    fn list(
        &self,
        prefix: Option<&object_store::path::Path>,
    ) -> futures::stream::BoxStream<'static, object_store::Result<object_store::ObjectMeta>> {
        use futures::StreamExt;
        let stamps = self.stamps.clone();
        self.inner
            .list(prefix)
            .map(move |r| r.map(|m| Self::restamp(&stamps, m)))
            .boxed()
    }

    async fn list_with_delimiter(
        &self,
        prefix: Option<&object_store::path::Path>,
    ) -> object_store::Result<object_store::ListResult> {
        let mut r = self.inner.list_with_delimiter(prefix).await?;
        r.objects = r
            .objects
            .into_iter()
            .map(|m| Self::restamp(&self.stamps, m))
            .collect();
        Ok(r)
    }

    async fn copy_opts(
        &self,
        from: &object_store::path::Path,
        to: &object_store::path::Path,
        options: object_store::CopyOptions,
    ) -> object_store::Result<()> {
        let before = self.stamp(to);
        let r = self.inner.copy_opts(from, to, options).await;
        if r.is_err() {
            self.unstamp(to, before);
        }
        r
    }

    async fn rename_opts(
        &self,
        from: &object_store::path::Path,
        to: &object_store::path::Path,
        options: object_store::RenameOptions,
    ) -> object_store::Result<()> {
        let before = self.stamp(to);
        let r = self.inner.rename_opts(from, to, options).await;
        match &r {
            Ok(()) => {
                self.stamps.lock().remove(from);
            }
            Err(_) => self.unstamp(to, before),
        }
        r
    }
}

/// Cases each property test of a decoder runs: `PROPTEST_CASES` when set (`scripts/fuzz.sh`
/// sets 100,000), else `default` (a few thousand: what CI runs).
pub fn proptest_cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(default)
}

/// A global allocator that remembers, per thread, the largest single allocation asked for, so
/// that a decoder's test can check it never allocates more than its input justifies. Install
/// it in a test binary with `#[global_allocator] static A: BiggestAlloc = BiggestAlloc;` and
/// measure with [`biggest_alloc`].
pub struct BiggestAlloc;

thread_local! {
    static BIGGEST: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

fn note_alloc(n: usize) {
    let _ = BIGGEST.try_with(|b| {
        if n > b.get() {
            b.set(n);
        }
    });
}

// SAFETY: every call is forwarded unchanged to the system allocator; the thread-local counter
// is const-initialised and never allocates.
unsafe impl std::alloc::GlobalAlloc for BiggestAlloc {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        note_alloc(layout.size());
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract.
        unsafe { std::alloc::System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        note_alloc(layout.size());
        // SAFETY: as for `alloc`.
        unsafe { std::alloc::System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new: usize) -> *mut u8 {
        note_alloc(new);
        // SAFETY: the caller upholds `GlobalAlloc::realloc`'s contract.
        unsafe { std::alloc::System.realloc(ptr, layout, new) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        // SAFETY: the caller upholds `GlobalAlloc::dealloc`'s contract.
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }
}

/// Run `f` and return what it returned with the largest single allocation it made on this
/// thread (only meaningful where [`BiggestAlloc`] is the global allocator).
pub fn biggest_alloc<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let before = BIGGEST.with(|b| b.replace(0));
    let out = f();
    let got = BIGGEST.with(|b| b.replace(before.max(b.get())));
    (out, got)
}

/// Building blocks of the decoders' property tests (`store/tests/hostile.rs`,
/// `ckpt/tests/fuzz.rs`; `scripts/fuzz.sh` runs them): byte-level mutations of valid inputs.
pub mod fuzz {
    use proptest::prelude::*;

    /// A change to stored bytes: flip bits, overwrite a little-endian field, or cut the object.
    #[derive(Debug, Clone)]
    pub enum Mutation {
        /// XOR the byte at (index modulo length).
        Xor(usize, u8),
        /// Overwrite 4 bytes (little-endian) at (index modulo length).
        Put32(usize, u32),
        /// Overwrite 8 bytes (little-endian) at (index modulo length).
        Put64(usize, u64),
        /// Cut at (index modulo length).
        Truncate(usize),
    }

    /// A [`Mutation`] drawn with weights that favour bit flips and hostile field values.
    pub fn mutation() -> impl Strategy<Value = Mutation> {
        prop_oneof![
            4 => (any::<usize>(), 1..=255u8).prop_map(|(i, x)| Mutation::Xor(i, x)),
            2 => (any::<usize>(), prop_oneof![any::<u32>(), 0..70_000u32]).prop_map(|(i, v)| Mutation::Put32(i, v)),
            2 => (any::<usize>(), prop_oneof![any::<u64>(), 0..70_000u64]).prop_map(|(i, v)| Mutation::Put64(i, v)),
            1 => any::<usize>().prop_map(Mutation::Truncate),
        ]
    }

    /// Apply `muts` in order (an empty object stays empty).
    pub fn apply(obj: &mut Vec<u8>, muts: &[Mutation]) {
        for m in muts {
            if obj.is_empty() {
                return;
            }
            let n = obj.len();
            match *m {
                Mutation::Xor(i, x) => obj[i % n] ^= x,
                Mutation::Put32(i, v) => {
                    let b = v.to_le_bytes();
                    let i = i % n;
                    let k = b.len().min(n - i);
                    obj[i..i + k].copy_from_slice(&b[..k]);
                }
                Mutation::Put64(i, v) => {
                    let b = v.to_le_bytes();
                    let i = i % n;
                    let k = b.len().min(n - i);
                    obj[i..i + k].copy_from_slice(&b[..k]);
                }
                Mutation::Truncate(i) => obj.truncate(i % n),
            }
        }
    }
}
