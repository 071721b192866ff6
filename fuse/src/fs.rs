//! The filesystem model: an inode table over the store's runs and committed steps, with
//! `lookup`, `getattr`, `readdir`, `readlink`, `open` and `read` as plain async methods. No
//! kernel is involved here; [`crate::fuse`] adapts these methods to `fuser`, and tests call
//! them directly.
//!
//! ```text
//! /<run>/latest -> <step>                  the newest committed step
//! /<run>/<step>/COMMIT.json                the commit record, pretty, plus `fs_names`
//! /<run>/<step>/model.safetensors          every tensor consolidated
//! /<run>/<step>/tensors/<name>             one tensor, consolidated, row-major
//! /<run>/<step>/ranks/<r>/<name>           the boxes rank r holds of a tensor
//! /<run>/<step>/blobs/<r>/<name>           a blob saved by rank r
//! ```
//!
//! Steps appear only once committed, named by their decimal number. Runs and their step lists
//! are listed again after `list_ttl`, so `latest` follows a job that keeps saving; a committed
//! step never changes, so its files are opened once (its commit record read once, a rank's
//! manifest when `ranks/<r>` is first visited) and kept in a bounded table of open steps.
//! Inode numbers are handed out on first sight and never reused during a mount; `mtime` of a
//! step and everything in it is its commit time.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use ckpt_store::{ErrorKind, Store};
use parking_lot::Mutex;
use tokio::sync::{OnceCell, Semaphore};
use tracing::instrument;

use crate::step::{Content, StepState, commit_time};
use ckpt_store::cache::{CacheStats, ChunkCache};

/// The inode of the mount's root.
pub const ROOT_INO: u64 = 1;

/// Settings of the model.
#[derive(Debug, Clone)]
pub struct FsOptions {
    /// Bytes of decoded chunks to cache.
    pub cache_bytes: u64,
    /// How long a listing of runs or of a run's steps is reused (also the kernel's cache time
    /// for those directories and `latest`).
    pub list_ttl: Duration,
    /// How long the kernel may cache names and attributes inside a step (they never change).
    pub step_ttl: Duration,
    /// Read-ahead of a sequential reader starts at this many bytes beyond its read...
    pub readahead_min: u64,
    /// ...and doubles up to this (both bounded by a quarter of the cache).
    pub readahead_max: u64,
    /// Committed steps kept open at once (each holds its commit record).
    pub open_steps: usize,
}

impl Default for FsOptions {
    fn default() -> Self {
        FsOptions {
            cache_bytes: 1 << 30,
            list_ttl: Duration::from_secs(1),
            step_ttl: Duration::from_secs(300),
            readahead_min: 8 << 20,
            readahead_max: 64 << 20,
            open_steps: 64,
        }
    }
}

/// What went wrong, kept apart from errno values (the adapter maps them in one table).
#[derive(Debug, thiserror::Error)]
pub enum FsError {
    /// No such file or directory.
    #[error("{0}")]
    NotFound(String),
    /// A directory was expected.
    #[error("{0}")]
    NotDir(String),
    /// A file was expected, found a directory.
    #[error("{0}")]
    IsDir(String),
    /// Not a symbolic link.
    #[error("{0}")]
    NotSymlink(String),
    /// The mount is read-only.
    #[error("{0}")]
    ReadOnly(String),
    /// No such open file handle.
    #[error("{0}")]
    BadHandle(String),
    /// The store failed (damaged data, backend error, ...).
    #[error(transparent)]
    Store(#[from] ckpt_store::Error),
}

impl FsError {
    /// Whether this is worth a log line (lookups of missing names are routine).
    pub fn is_routine(&self) -> bool {
        match self {
            FsError::NotFound(_) => true,
            FsError::Store(e) => e.kind() == ErrorKind::NotFound,
            _ => false,
        }
    }
}

type FsResult<T> = std::result::Result<T, FsError>;

/// File types of the mount.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A directory.
    Dir,
    /// A regular, read-only file.
    File,
    /// A symbolic link (`latest`).
    Symlink,
}

/// Attributes of an inode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attr {
    /// Inode number.
    pub ino: u64,
    /// Type.
    pub kind: Kind,
    /// Exact size in bytes (files and links; 0 for directories).
    pub size: u64,
    /// Commit time for a step and its contents.
    pub mtime: SystemTime,
    /// How long the kernel may cache this.
    pub ttl: Duration,
}

/// One directory entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntry {
    /// Inode number.
    pub ino: u64,
    /// Type.
    pub kind: Kind,
    /// File name.
    pub name: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Item {
    CommitJson,
    Model,
    TensorsDir,
    Tensor(u32),
    RanksDir,
    RankDir(u32),
    RankTensor(u32, u32),
    BlobsDir,
    BlobRankDir(u32),
    Blob(u32, u32),
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Node {
    Root,
    Run(Arc<str>),
    Latest(Arc<str>),
    Step(Arc<str>, u64),
    In(Arc<str>, u64, Item),
}

#[derive(Default)]
struct Inodes {
    nodes: Vec<Node>,
    by_node: HashMap<Node, u64>,
}

struct Timed<T> {
    at: Instant,
    v: Arc<T>,
}

struct RunListing {
    steps: Vec<u64>,
    mtime: SystemTime,
}

type StepCell = Arc<OnceCell<Arc<StepState>>>;

#[derive(Default)]
struct Steps {
    /// (run, step) -> the step once opened, and when it was last used.
    map: HashMap<(Arc<str>, u64), (StepCell, u64)>,
    tick: u64,
}

/// Where a sequential reader is and how far ahead its chunks were fetched.
#[derive(Debug, Default)]
struct Seq {
    next: u64,
    ahead_to: u64,
    window: u64,
}

enum Handle {
    File {
        ino: u64,
        seq: Mutex<Seq>,
    },
    Dir {
        entries: Arc<Vec<DirEntry>>,
        attrs: OnceCell<Arc<Vec<Attr>>>,
    },
}

/// The filesystem model over one store.
pub struct CkptFs {
    store: Store,
    opts: FsOptions,
    cache: Arc<ChunkCache>,
    inodes: Mutex<Inodes>,
    runs: Mutex<Option<Timed<Vec<String>>>>,
    run_listings: Mutex<HashMap<Arc<str>, Timed<RunListing>>>,
    steps: Mutex<Steps>,
    handles: Mutex<HashMap<u64, Arc<Handle>>>,
    next_fh: AtomicU64,
    prefetchers: Arc<Semaphore>,
    started: SystemTime,
}

impl std::fmt::Debug for CkptFs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CkptFs({})", self.store.url())
    }
}

fn not_dir(what: impl std::fmt::Display) -> FsError {
    FsError::NotDir(format!("{what} is not a directory"))
}

impl CkptFs {
    /// A model over `store`.
    pub fn new(store: Store, opts: FsOptions) -> Self {
        let mut inodes = Inodes::default();
        inodes.nodes.push(Node::Root);
        inodes.by_node.insert(Node::Root, ROOT_INO);
        CkptFs {
            cache: ChunkCache::new(opts.cache_bytes),
            store,
            opts,
            inodes: Mutex::new(inodes),
            runs: Mutex::default(),
            run_listings: Mutex::default(),
            steps: Mutex::default(),
            handles: Mutex::default(),
            next_fh: AtomicU64::new(1),
            prefetchers: Arc::new(Semaphore::new(4)),
            started: SystemTime::from(ckpt_store::clock::system_now()),
        }
    }

    /// The store served.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The settings.
    pub fn options(&self) -> &FsOptions {
        &self.opts
    }

    /// What the chunk cache did so far.
    pub fn cache_stats(&self) -> CacheStats {
        self.cache.stats()
    }

    fn intern(&self, n: Node) -> u64 {
        let mut g = self.inodes.lock();
        if let Some(&i) = g.by_node.get(&n) {
            return i;
        }
        g.nodes.push(n.clone());
        let ino = g.nodes.len() as u64;
        g.by_node.insert(n, ino);
        ino
    }

    fn node(&self, ino: u64) -> FsResult<Node> {
        let g = self.inodes.lock();
        ino.checked_sub(1)
            .and_then(|i| g.nodes.get(i as usize))
            .cloned()
            .ok_or_else(|| FsError::NotFound(format!("no inode {ino} in this mount")))
    }

    async fn list_runs(&self) -> FsResult<Arc<Vec<String>>> {
        if let Some(t) = &*self.runs.lock()
            && t.at.elapsed() < self.opts.list_ttl
        {
            return Ok(t.v.clone());
        }
        let runs = Arc::new(self.store.log().list_runs().await?);
        *self.runs.lock() = Some(Timed {
            at: Instant::now(),
            v: runs.clone(),
        });
        Ok(runs)
    }

    async fn run_listing(&self, run: &Arc<str>) -> FsResult<Arc<RunListing>> {
        if let Some(t) = self.run_listings.lock().get(run)
            && t.at.elapsed() < self.opts.list_ttl
        {
            return Ok(t.v.clone());
        }
        let steps = self.store.log().list_steps(run).await?;
        let committed: Vec<_> = steps.iter().filter(|s| s.committed).collect();
        let mtime = committed
            .iter()
            .map(|s| SystemTime::from(s.last_modified))
            .max()
            .unwrap_or(self.started);
        let l = Arc::new(RunListing {
            steps: committed.iter().map(|s| s.step).collect(),
            mtime,
        });
        self.run_listings.lock().insert(
            run.clone(),
            Timed {
                at: Instant::now(),
                v: l.clone(),
            },
        );
        Ok(l)
    }

    async fn step(&self, run: &Arc<str>, step: u64) -> FsResult<Arc<StepState>> {
        let cell = {
            let mut g = self.steps.lock();
            g.tick += 1;
            let tick = g.tick;
            let key = (run.clone(), step);
            let cell = match g.map.get_mut(&key) {
                Some((c, t)) => {
                    *t = tick;
                    c.clone()
                }
                None => {
                    let c = Arc::new(OnceCell::new());
                    g.map.insert(key.clone(), (c.clone(), tick));
                    c
                }
            };
            while g.map.len() > self.opts.open_steps.max(1) {
                let oldest = g
                    .map
                    .iter()
                    .filter(|(k, _)| **k != key)
                    .min_by_key(|(_, (_, t))| *t)
                    .map(|(k, _)| k.clone());
                match oldest {
                    Some(k) => g.map.remove(&k),
                    None => break,
                };
            }
            cell
        };
        let s = cell
            .get_or_try_init(|| async {
                StepState::open(&self.store, run, step).await.map(Arc::new)
            })
            .await
            .map_err(|e| {
                if e.kind() == ErrorKind::NotFound {
                    FsError::NotFound(format!("step {step} of run {run} is not committed"))
                } else {
                    FsError::Store(e)
                }
            })?;
        Ok(s.clone())
    }

    fn dir_attr(&self, ino: u64, mtime: SystemTime, ttl: Duration) -> Attr {
        Attr {
            ino,
            kind: Kind::Dir,
            size: 0,
            mtime,
            ttl,
        }
    }

    /// The attributes of an inode.
    #[instrument(level = "trace", skip(self))]
    pub async fn getattr(&self, ino: u64) -> FsResult<Attr> {
        let node = self.node(ino)?;
        self.attr_of(ino, &node).await
    }

    async fn attr_of(&self, ino: u64, node: &Node) -> FsResult<Attr> {
        let ttl = self.opts.list_ttl;
        match node {
            Node::Root => Ok(self.dir_attr(ino, self.started, ttl)),
            Node::Run(run) => {
                let l = self.run_listing(run).await?;
                Ok(self.dir_attr(ino, l.mtime, ttl))
            }
            Node::Latest(run) => {
                let l = self.run_listing(run).await?;
                let step = l
                    .steps
                    .last()
                    .ok_or_else(|| FsError::NotFound(format!("run {run} has no committed step")))?;
                Ok(Attr {
                    ino,
                    kind: Kind::Symlink,
                    size: step.to_string().len() as u64,
                    mtime: l.mtime,
                    ttl,
                })
            }
            Node::Step(run, step) => {
                let s = self.step(run, *step).await?;
                Ok(self.dir_attr(ino, s.mtime, self.opts.step_ttl))
            }
            Node::In(run, step, item) => {
                let s = self.step(run, *step).await?;
                let file = |size| Attr {
                    ino,
                    kind: Kind::File,
                    size,
                    mtime: s.mtime,
                    ttl: self.opts.step_ttl,
                };
                match item {
                    Item::TensorsDir
                    | Item::RanksDir
                    | Item::RankDir(_)
                    | Item::BlobsDir
                    | Item::BlobRankDir(_) => Ok(self.dir_attr(ino, s.mtime, self.opts.step_ttl)),
                    _ => {
                        let c = self.content(&s, *item).await?;
                        Ok(file(s.len(&c)))
                    }
                }
            }
        }
    }

    async fn content(&self, s: &StepState, item: Item) -> FsResult<Content> {
        Ok(match item {
            Item::CommitJson => Content::Literal(s.commit_json.clone()),
            Item::Model => Content::Model,
            Item::Tensor(t) => Content::Tensor(t as usize),
            Item::RankTensor(r, t) => {
                let f = s.rank_files(r).await?;
                let (_, boxes, _) = f.get(t as usize).ok_or_else(|| {
                    FsError::NotFound(format!(
                        "{}: rank {r} holds no part of tensor {:?}",
                        s.what(),
                        s.commit().tensors[t as usize].name
                    ))
                })?;
                Content::RankTensor {
                    tensor: t as usize,
                    boxes: boxes.clone(),
                }
            }
            Item::Blob(_, b) => Content::Blob(b as usize),
            _ => {
                return Err(FsError::IsDir(format!(
                    "{}: {item:?} is a directory",
                    s.what()
                )));
            }
        })
    }

    /// Look `name` up in directory `parent`.
    #[instrument(level = "trace", skip(self))]
    pub async fn lookup(&self, parent: u64, name: &OsStr) -> FsResult<Attr> {
        let pnode = self.node(parent)?;
        let missing =
            || FsError::NotFound(format!("{} has no entry {name:?}", self.describe(&pnode)));
        let Some(name) = name.to_str() else {
            return Err(missing());
        };
        let child = match &pnode {
            Node::Root => {
                let runs = self.list_runs().await?;
                let run = runs
                    .iter()
                    .find(|r| r.as_str() == name)
                    .ok_or_else(missing)?;
                Node::Run(Arc::from(run.as_str()))
            }
            Node::Run(run) => {
                if name == "latest" {
                    Node::Latest(run.clone())
                } else {
                    let step: u64 = name.parse().map_err(|_| missing())?;
                    if step.to_string() != name {
                        return Err(missing());
                    }
                    Node::Step(run.clone(), step)
                }
            }
            Node::Latest(_) => return Err(not_dir(self.describe(&pnode))),
            Node::Step(run, step) => {
                let item = match name {
                    "COMMIT.json" => Item::CommitJson,
                    "model.safetensors" => {
                        let s = self.step(run, *step).await?;
                        if s.view.is_none() {
                            return Err(missing());
                        }
                        Item::Model
                    }
                    "tensors" => Item::TensorsDir,
                    "ranks" => Item::RanksDir,
                    "blobs" => Item::BlobsDir,
                    _ => return Err(missing()),
                };
                Node::In(run.clone(), *step, item)
            }
            Node::In(run, step, item) => {
                let s = self.step(run, *step).await?;
                let item = match item {
                    Item::TensorsDir => {
                        Item::Tensor(s.tensors.index(name).ok_or_else(missing)? as u32)
                    }
                    Item::RanksDir => {
                        let r: u32 = name.parse().map_err(|_| missing())?;
                        if r.to_string() != name || s.ranks.binary_search(&r).is_err() {
                            return Err(missing());
                        }
                        Item::RankDir(r)
                    }
                    Item::RankDir(r) => {
                        let t = s.tensors.index(name).ok_or_else(missing)?;
                        let f = s.rank_files(*r).await?;
                        if f.get(t).is_none() {
                            return Err(missing());
                        }
                        Item::RankTensor(*r, t as u32)
                    }
                    Item::BlobsDir => {
                        let r: u32 = name.parse().map_err(|_| missing())?;
                        if r.to_string() != name || !s.blob_ranks.contains_key(&r) {
                            return Err(missing());
                        }
                        Item::BlobRankDir(r)
                    }
                    Item::BlobRankDir(r) => {
                        let rb = s.blob_ranks.get(r).ok_or_else(missing)?;
                        let k = rb.names.index(name).ok_or_else(missing)?;
                        Item::Blob(*r, rb.blobs[k] as u32)
                    }
                    _ => return Err(not_dir(self.describe(&pnode))),
                };
                Node::In(run.clone(), *step, item)
            }
        };
        let ino = self.intern(child.clone());
        match self.attr_of(ino, &child).await {
            Err(FsError::Store(e)) if e.kind() == ErrorKind::NotFound => Err(missing()),
            r => r,
        }
    }

    /// The path of a node, for messages (`train/2/ranks/1`; files by index in the step).
    fn describe(&self, n: &Node) -> String {
        match n {
            Node::Root => "the mount's root".into(),
            Node::Run(r) => r.to_string(),
            Node::Latest(r) => format!("{r}/latest"),
            Node::Step(r, s) => format!("{r}/{s}"),
            Node::In(r, s, i) => {
                let rel = match i {
                    Item::CommitJson => "COMMIT.json".to_string(),
                    Item::Model => "model.safetensors".to_string(),
                    Item::TensorsDir => "tensors".to_string(),
                    Item::Tensor(t) => format!("tensors/(tensor #{t})"),
                    Item::RanksDir => "ranks".to_string(),
                    Item::RankDir(k) => format!("ranks/{k}"),
                    Item::RankTensor(k, t) => format!("ranks/{k}/(tensor #{t})"),
                    Item::BlobsDir => "blobs".to_string(),
                    Item::BlobRankDir(k) => format!("blobs/{k}"),
                    Item::Blob(k, b) => format!("blobs/{k}/(blob #{b})"),
                };
                format!("{r}/{s}/{rel}")
            }
        }
    }

    /// The entries of directory `ino`, `.` and `..` first. (Over 100 lines on purpose: one
    /// arm per kind of directory of the mount, each a few lines, read as the layout's table.)
    #[instrument(level = "trace", skip(self))]
    pub async fn readdir(&self, ino: u64) -> FsResult<Vec<DirEntry>> {
        let node = self.node(ino)?;
        let parent = match &node {
            Node::Root => ROOT_INO,
            Node::Run(_) => ROOT_INO,
            Node::Step(run, _) => self.intern(Node::Run(run.clone())),
            Node::In(run, step, item) => {
                let up = match item {
                    Item::TensorsDir | Item::RanksDir | Item::BlobsDir => {
                        Node::Step(run.clone(), *step)
                    }
                    Item::RankDir(_) => Node::In(run.clone(), *step, Item::RanksDir),
                    Item::BlobRankDir(_) => Node::In(run.clone(), *step, Item::BlobsDir),
                    _ => return Err(not_dir(self.describe(&node))),
                };
                self.intern(up)
            }
            Node::Latest(_) => return Err(not_dir(self.describe(&node))),
        };
        let mut out = vec![
            DirEntry {
                ino,
                kind: Kind::Dir,
                name: ".".into(),
            },
            DirEntry {
                ino: parent,
                kind: Kind::Dir,
                name: "..".into(),
            },
        ];
        let mut push = |n: Node, kind: Kind, name: String| {
            out.push(DirEntry {
                ino: self.intern(n),
                kind,
                name,
            })
        };
        match &node {
            Node::Root => {
                for r in self.list_runs().await?.iter() {
                    push(Node::Run(Arc::from(r.as_str())), Kind::Dir, r.clone());
                }
            }
            Node::Run(run) => {
                let l = self.run_listing(run).await?;
                if !l.steps.is_empty() {
                    push(Node::Latest(run.clone()), Kind::Symlink, "latest".into());
                }
                for s in &l.steps {
                    push(Node::Step(run.clone(), *s), Kind::Dir, s.to_string());
                }
            }
            Node::Step(run, step) => {
                let s = self.step(run, *step).await?;
                let at = |i| Node::In(run.clone(), *step, i);
                push(at(Item::CommitJson), Kind::File, "COMMIT.json".into());
                if s.view.is_some() {
                    push(at(Item::Model), Kind::File, "model.safetensors".into());
                }
                push(at(Item::TensorsDir), Kind::Dir, "tensors".into());
                push(at(Item::RanksDir), Kind::Dir, "ranks".into());
                push(at(Item::BlobsDir), Kind::Dir, "blobs".into());
            }
            Node::In(run, step, item) => {
                let s = self.step(run, *step).await?;
                let at = |i| Node::In(run.clone(), *step, i);
                match item {
                    Item::TensorsDir => {
                        for i in 0..s.tensors.len() {
                            push(
                                at(Item::Tensor(i as u32)),
                                Kind::File,
                                s.tensors.file(i).into(),
                            );
                        }
                    }
                    Item::RanksDir => {
                        for r in &s.ranks {
                            push(at(Item::RankDir(*r)), Kind::Dir, r.to_string());
                        }
                    }
                    Item::RankDir(r) => {
                        let f = s.rank_files(*r).await?;
                        for (t, _, _) in &f.tensors {
                            push(
                                at(Item::RankTensor(*r, *t as u32)),
                                Kind::File,
                                s.tensors.file(*t).into(),
                            );
                        }
                    }
                    Item::BlobsDir => {
                        for r in s.blob_ranks.keys() {
                            push(at(Item::BlobRankDir(*r)), Kind::Dir, r.to_string());
                        }
                    }
                    Item::BlobRankDir(r) => {
                        if let Some(rb) = s.blob_ranks.get(r) {
                            for (k, &b) in rb.blobs.iter().enumerate() {
                                push(
                                    at(Item::Blob(*r, b as u32)),
                                    Kind::File,
                                    rb.names.file(k).into(),
                                );
                            }
                        }
                    }
                    _ => return Err(not_dir(self.describe(&node))),
                }
            }
            Node::Latest(_) => unreachable!("handled above"),
        }
        Ok(out)
    }

    /// The target of a symbolic link (`latest` → the newest committed step).
    pub async fn readlink(&self, ino: u64) -> FsResult<String> {
        match self.node(ino)? {
            Node::Latest(run) => {
                let l = self.run_listing(&run).await?;
                l.steps
                    .last()
                    .map(|s| s.to_string())
                    .ok_or_else(|| FsError::NotFound(format!("run {run} has no committed step")))
            }
            n => Err(FsError::NotSymlink(format!(
                "{} is not a symbolic link",
                self.describe(&n)
            ))),
        }
    }

    /// Open a file for reading; returns a handle for [`CkptFs::read`] and [`CkptFs::release`].
    pub async fn open(&self, ino: u64, write: bool) -> FsResult<u64> {
        let attr = self.getattr(ino).await?;
        if write {
            return Err(FsError::ReadOnly(
                "the checkpoint mount is read-only".into(),
            ));
        }
        if attr.kind == Kind::Dir {
            return Err(FsError::IsDir(format!("inode {ino} is a directory")));
        }
        Ok(self.add_handle(Handle::File {
            ino,
            seq: Mutex::default(),
        }))
    }

    /// Open a directory: its entries are listed once and served from the handle, so a long
    /// listing read in several calls stays consistent.
    pub async fn opendir(&self, ino: u64) -> FsResult<u64> {
        let entries = Arc::new(self.readdir(ino).await?);
        Ok(self.add_handle(Handle::Dir {
            entries,
            attrs: OnceCell::new(),
        }))
    }

    /// The entries listed when directory handle `fh` was opened.
    pub fn dir_entries(&self, fh: u64) -> FsResult<Arc<Vec<DirEntry>>> {
        match self.handles.lock().get(&fh).map(|h| &**h) {
            Some(Handle::Dir { entries, .. }) => Ok(entries.clone()),
            _ => Err(FsError::BadHandle(format!("no open directory handle {fh}"))),
        }
    }

    /// The entries of directory handle `fh` with their attributes (for `readdirplus`, which
    /// saves `ls -l` a lookup per entry). Inside a step the attributes are exact and cached
    /// like a lookup's. Runs (in the root) and steps (in a run) get stand-ins that expire at
    /// once, so listing a run does not open every step's commit record: a `stat` of one asks
    /// again.
    pub async fn dir_entries_plus(
        &self,
        fh: u64,
    ) -> FsResult<(Arc<Vec<DirEntry>>, Arc<Vec<Attr>>)> {
        let h = self.handles.lock().get(&fh).cloned();
        let Some(Handle::Dir { entries, attrs }) = h.as_deref() else {
            return Err(FsError::BadHandle(format!("no open directory handle {fh}")));
        };
        let attrs = attrs
            .get_or_try_init(|| async {
                let mut out = Vec::with_capacity(entries.len());
                for e in entries.iter() {
                    let node = self.node(e.ino)?;
                    let a = match (&node, e.name.as_str()) {
                        (_, "." | "..") | (Node::Root | Node::Run(_) | Node::Step(..), _) => {
                            self.stand_in(e)
                        }
                        _ => self.attr_of(e.ino, &node).await?,
                    };
                    out.push(a);
                }
                Ok::<_, FsError>(Arc::new(out))
            })
            .await?
            .clone();
        Ok((entries.clone(), attrs))
    }

    fn stand_in(&self, e: &DirEntry) -> Attr {
        Attr {
            ino: e.ino,
            kind: e.kind,
            size: 0,
            mtime: self.started,
            ttl: Duration::ZERO,
        }
    }

    fn add_handle(&self, h: Handle) -> u64 {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        self.handles.lock().insert(fh, Arc::new(h));
        fh
    }

    /// Forget a handle.
    pub fn release(&self, fh: u64) {
        self.handles.lock().remove(&fh);
    }

    /// Open handles (files and directories).
    pub fn open_handles(&self) -> usize {
        self.handles.lock().len()
    }

    /// Read up to `size` bytes at `offset` of file `ino` (fewer at the end of the file).
    /// With a handle from [`CkptFs::open`], sequential reads fetch ahead into the cache.
    #[instrument(level = "trace", skip(self))]
    pub async fn read(
        &self,
        ino: u64,
        fh: Option<u64>,
        offset: u64,
        size: u32,
    ) -> FsResult<Vec<u8>> {
        let (s, item) = match self.node(ino)? {
            Node::In(run, step, item) => (self.step(&run, step).await?, item),
            n => {
                return Err(FsError::IsDir(format!(
                    "{} is not a file",
                    self.describe(&n)
                )));
            }
        };
        let content = self.content(&s, item).await?;
        let flen = s.len(&content);
        if offset >= flen || size == 0 {
            return Ok(Vec::new());
        }
        let n = (size as u64).min(flen - offset);
        if let Some(fh) = fh {
            let h = self.handles.lock().get(&fh).cloned();
            match h.as_deref() {
                Some(Handle::File { ino: hi, seq }) if *hi == ino => {
                    let ahead = self.advance(&mut seq.lock(), offset, n, flen);
                    if let Some((a, b)) = ahead {
                        self.spawn_prefetch(&s, &content, a, b);
                    }
                }
                _ => {
                    return Err(FsError::BadHandle(format!(
                        "no open file handle {fh} for inode {ino}"
                    )));
                }
            }
        }
        let plan = s.plan(&content, offset, n as usize).await?;
        let conc = self.store.config().read_concurrency;
        Ok(s.execute(&self.store, &self.cache, plan, conc).await?)
    }

    /// Track a handle's position; returns a byte range to fetch ahead when the reader is
    /// sequential and has not been fetched that far.
    fn advance(&self, q: &mut Seq, offset: u64, n: u64, flen: u64) -> Option<(u64, u64)> {
        let cap = self.opts.cache_bytes / 4;
        let min = self.opts.readahead_min.min(cap);
        let max = self.opts.readahead_max.min(cap).max(min);
        // The kernel sends read-ahead requests of one reader concurrently, so they may arrive
        // a little out of order: "sequential" is "near where the last read ended".
        let near = 2 << 20;
        let sequential = (offset == 0 && q.next == 0) || offset.abs_diff(q.next) <= near;
        let end = offset + n;
        if !sequential {
            *q = Seq {
                next: end,
                ..Seq::default()
            };
            return None;
        }
        q.next = q.next.max(end);
        q.window = if q.window == 0 {
            min
        } else {
            (q.window * 2).min(max)
        };
        if q.window == 0 {
            return None;
        }
        let target = (end + q.window).min(flen);
        let from = q.ahead_to.max(end);
        // Fetch again once the reader has used half of what was fetched ahead.
        if from >= target || q.ahead_to >= end + q.window / 2 {
            return None;
        }
        q.ahead_to = target;
        Some((from, target))
    }

    fn spawn_prefetch(&self, s: &Arc<StepState>, content: &Content, a: u64, b: u64) {
        let Ok(permit) = self.prefetchers.clone().try_acquire_owned() else {
            return;
        };
        let (s, content) = (s.clone(), content.clone());
        let (store, cache) = (self.store.clone(), self.cache.clone());
        let n = self.store.config().read_concurrency;
        tokio::spawn(async move {
            let _permit = permit;
            match s.plan(&content, a, (b - a) as usize).await {
                Ok(plan) => s.prefetch(&store, &cache, plan, n).await,
                Err(e) => tracing::debug!(error = %e, "read-ahead plan failed"),
            }
        });
    }

    /// Walk `path` (relative to the root, `/`-separated) with [`CkptFs::lookup`].
    pub async fn resolve(&self, path: &str) -> FsResult<Attr> {
        let mut attr = self.getattr(ROOT_INO).await?;
        for part in path.split('/').filter(|p| !p.is_empty()) {
            attr = self.lookup(attr.ino, OsStr::new(part)).await?;
        }
        Ok(attr)
    }

    /// The whole content of the file at `path` (tests and tools).
    pub async fn read_path(&self, path: &str) -> FsResult<Vec<u8>> {
        let a = self.resolve(path).await?;
        if a.kind == Kind::Dir {
            return Err(FsError::IsDir(format!("{path} is a directory")));
        }
        let mut out = Vec::with_capacity(a.size as usize);
        while (out.len() as u64) < a.size {
            let chunk = self
                .read(
                    a.ino,
                    None,
                    out.len() as u64,
                    (a.size - out.len() as u64).min(1 << 24) as u32,
                )
                .await?;
            if chunk.is_empty() {
                break;
            }
            out.extend_from_slice(&chunk);
        }
        Ok(out)
    }

    /// The names in directory `path`, without `.` and `..`.
    pub async fn list_path(&self, path: &str) -> FsResult<Vec<DirEntry>> {
        let a = self.resolve(path).await?;
        let mut v = self.readdir(a.ino).await?;
        v.drain(..2);
        Ok(v)
    }

    /// The time a step was committed, as its files show it.
    pub fn commit_time(ms: i64) -> SystemTime {
        commit_time(ms)
    }
}
