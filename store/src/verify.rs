//! `verify`: re-hash every chunk reachable from a step, a run or the whole store, and report
//! which steps, tensors and blobs each damaged object affects. In the local tier of one
//! machine of several, a node-committed step ([`crate::NodeCommit`]) is checked as far as the
//! tier holds it: its node commits, the manifests they pin and their chunks.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use futures::{StreamExt, TryStreamExt, stream};
use object_store::path::Path;
use serde::Serialize;
use tracing::instrument;

use crate::codec;
use crate::error::{ErrorKind, Result};
use crate::id::{ChunkId, PackId};
use crate::model::{
    BlobLoc, ChunkRef, CommitRecord, RankManifest, check_coverage, collect_tensors,
};
use crate::pack;
use crate::store::Store;

/// What to verify.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VerifyScope {
    /// One committed step.
    Step(String, u64),
    /// Every committed step of a run.
    Run(String),
    /// Every committed step of every run, and every chunk and pack object, referenced or not.
    Store,
}

/// A step, tensor or blob that a damaged object breaks.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct Affected {
    /// Run.
    pub run: String,
    /// Step.
    pub step: u64,
    /// `tensor NAME`, `blob NAME of rank R`, or `manifest` / `commit record`.
    pub item: String,
}

/// One damaged object.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Damage {
    /// The object key.
    pub object: String,
    /// What is wrong with it.
    pub problem: String,
    /// What it breaks (empty for an object no step references).
    pub affects: Vec<Affected>,
}

/// The result of a verify.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct VerifyReport {
    /// Steps whose manifests were checked.
    pub steps: u64,
    /// Objects read.
    pub objects: u64,
    /// Chunks decoded and hashed.
    pub chunks: u64,
    /// Raw bytes hashed.
    pub bytes: u64,
    /// What is damaged.
    pub damaged: Vec<Damage>,
    /// Temporary files interrupted writes left (local directory, whole-store verify only):
    /// not damage, nothing references them; `ckpt gc` deletes them after the grace period.
    pub temp_files: Vec<TempFileNote>,
}

/// A temporary file an interrupted write left (see [`crate::direct::temp_files`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TempFileNote {
    /// Its path below the store's root.
    pub file: String,
    /// Its size.
    pub bytes: u64,
    /// When it was last written, in milliseconds since the epoch.
    pub modified_ms: i64,
}

impl VerifyReport {
    /// Nothing damaged.
    pub fn is_clean(&self) -> bool {
        self.damaged.is_empty()
    }
}

/// Progress callback: raw bytes verified so far.
pub type Progress = Arc<dyn Fn(u64) + Send + Sync>;

#[derive(Default)]
struct Refs {
    /// chunk object or pack key -> chunks in it to check, with what each affects.
    by_object: BTreeMap<String, ObjectRefs>,
}

#[derive(Default)]
struct ObjectRefs {
    pack: Option<PackId>,
    chunks: HashMap<ChunkId, (ChunkRef, BTreeSet<Affected>)>,
}

impl Store {
    /// The raw bytes `verify` would hash in `scope` (for progress bars).
    pub async fn verify_size_hint(&self, scope: &VerifyScope) -> Result<u64> {
        let mut total = 0;
        for (run, step) in self.scope_steps(scope).await? {
            if let Ok((c, _)) = self.log().read_commit(&run, step).await {
                total += c.logical_bytes();
            }
        }
        Ok(total)
    }

    async fn scope_steps(&self, scope: &VerifyScope) -> Result<Vec<(String, u64)>> {
        Ok(match scope {
            VerifyScope::Step(r, s) => vec![(r.clone(), *s)],
            VerifyScope::Run(r) => self.run_steps(r).await?,
            VerifyScope::Store => {
                let mut v = Vec::new();
                for r in self.log().list_runs().await? {
                    v.extend(self.run_steps(&r).await?);
                }
                v
            }
        })
    }

    /// The steps of `run` that `verify` checks: committed, or (in the local tier of one
    /// machine of several) node-committed.
    async fn run_steps(&self, run: &str) -> Result<Vec<(String, u64)>> {
        let mut steps: BTreeSet<u64> = self.log().committed_steps(run).await?.into_iter().collect();
        steps.extend(self.log().node_committed_steps(run).await?);
        Ok(steps.into_iter().map(|s| (run.to_string(), s)).collect())
    }

    /// Verify `scope` (see the module docs). Damage is reported, not returned as an error;
    /// an error means verification itself could not run (the store is unreachable).
    #[instrument(skip_all, fields(scope = ?scope))]
    pub async fn verify(
        &self,
        scope: &VerifyScope,
        progress: Option<Progress>,
    ) -> Result<VerifyReport> {
        let mut report = VerifyReport::default();
        let mut refs = Refs::default();
        let steps = self.scope_steps(scope).await?;
        if let VerifyScope::Step(run, step) = scope
            && !self
                .objects()
                .exists(&self.keys().commit(run, *step))
                .await?
            && self.log().node_commit_keys(run, *step).await?.is_empty()
        {
            return Err(crate::Error::not_found(format!(
                "step {step} of run {run} is not committed"
            )));
        }
        for (run, step) in &steps {
            self.verify_step(run, *step, &mut report, &mut refs).await;
        }
        if *scope == VerifyScope::Store {
            self.unreferenced_objects(&mut report, &mut refs).await?;
        }
        let (objects, bytes, chunks, damaged) = self.check_objects(refs, progress).await?;
        report.objects += objects;
        report.bytes += bytes;
        report.chunks += chunks;
        report.damaged.extend(damaged);
        report.damaged.sort_by(|a, b| a.object.cmp(&b.object));
        Ok(report)
    }

    /// One committed step: its record and manifests read back (what cannot be is damage),
    /// every chunk they reference noted in `refs`, the record compared with the manifests.
    async fn verify_step(&self, run: &str, step: u64, report: &mut VerifyReport, refs: &mut Refs) {
        report.steps += 1;
        let commit_key = self.keys().commit(run, step);
        let commit = match self.log().read_commit(run, step).await {
            Ok((c, _)) => c,
            Err(e) if e.kind() == ErrorKind::NotFound => {
                match self.log().node_commit_keys(run, step).await {
                    Ok(keys) if !keys.is_empty() => {
                        self.verify_node_step(run, step, keys, report, refs).await;
                    }
                    _ => damage(report, &commit_key, &e, run, step, "commit record"),
                }
                return;
            }
            Err(e) => {
                damage(report, &commit_key, &e, run, step, "commit record");
                return;
            }
        };
        let mut manifests = Vec::with_capacity(commit.ranks.len());
        for entry in &commit.ranks {
            let key = self.keys().rank_manifest(run, step, entry.rank);
            let m = match self
                .log()
                .read_rank_manifest(run, step, entry.rank, Some(entry))
                .await
            {
                Ok(m) => m,
                Err(e) => {
                    damage(
                        report,
                        &key,
                        &e,
                        run,
                        step,
                        &format!("manifest of rank {}", entry.rank),
                    );
                    continue;
                }
            };
            refs.add_manifest(self, run, step, &m);
            manifests.push(m);
        }
        if manifests.len() == commit.ranks.len() {
            for (item, problem) in compare_with_manifests(&commit, &manifests) {
                report.damaged.push(Damage {
                    object: commit_key.to_string(),
                    problem,
                    affects: vec![Affected {
                        run: run.to_string(),
                        step,
                        item,
                    }],
                });
            }
        }
    }

    /// A step node-committed in this tier (one machine of several, [`crate::NodeCommit`]):
    /// each node commit read back, the manifests it pins (by hash), their chunks noted.
    async fn verify_node_step(
        &self,
        run: &str,
        step: u64,
        keys: Vec<Path>,
        report: &mut VerifyReport,
        refs: &mut Refs,
    ) {
        for key in keys {
            let c = match self.objects().get_json::<crate::NodeCommit>(&key).await {
                Ok((c, _, _)) => c,
                Err(e) => {
                    damage(report, &key, &e, run, step, "node commit");
                    continue;
                }
            };
            for entry in &c.ranks {
                match self
                    .log()
                    .read_rank_manifest(run, step, entry.rank, Some(entry))
                    .await
                {
                    Ok(m) => refs.add_manifest(self, run, step, &m),
                    Err(e) => damage(
                        report,
                        &self.keys().rank_manifest(run, step, entry.rank),
                        &e,
                        run,
                        step,
                        &format!("manifest of rank {}", entry.rank),
                    ),
                }
            }
        }
    }

    /// The whole store's scope: temporary files, and the chunk and pack objects no step
    /// references (their structure is checked too).
    async fn unreferenced_objects(&self, report: &mut VerifyReport, refs: &mut Refs) -> Result<()> {
        report.temp_files = self
            .objects()
            .temp_files()
            .await?
            .into_iter()
            .map(|t| TempFileNote {
                file: t.key,
                bytes: t.bytes,
                modified_ms: t.modified.timestamp_millis(),
            })
            .collect();
        for dir in [self.keys().chunks_dir(), self.keys().packs_dir()] {
            let metas = self.objects().list_all(&dir).await?;
            for m in metas {
                let key = m.location.to_string();
                if let Some(p) = self.keys().parse_pack(&m.location) {
                    refs.by_object.entry(key).or_default().pack = Some(p);
                } else if let Some((c, _)) = self.keys().parse_delta_chunk(&m.location) {
                    // A delta no manifest references: its structure is checked (its
                    // chain is not known).
                    refs.by_object
                        .entry(key)
                        .or_default()
                        .chunks
                        .entry(c)
                        .or_insert_with(|| {
                            let r = ChunkRef::plain(c, 0, m.size as u32, codec::Codec::Delta);
                            (r, BTreeSet::new())
                        });
                } else if let Some(c) = self.keys().parse_chunk(&m.location) {
                    refs.by_object
                        .entry(key)
                        .or_default()
                        .chunks
                        .entry(c)
                        .or_insert_with(|| {
                            (
                                ChunkRef {
                                    id: c,
                                    len: 0,
                                    stored: m.size as u32,
                                    codec: codec::Codec::Raw,
                                    pack: None,
                                    offset: 0,
                                    bases: Vec::new(),
                                    base_step: None,
                                },
                                BTreeSet::new(),
                            )
                        });
                }
            }
        }
        Ok(())
    }

    /// Check every object of `refs` (hashes, codecs, packs), `read_concurrency` at a time,
    /// telling `progress` the bytes done: (objects read, raw bytes hashed, chunks hashed,
    /// damage).
    async fn check_objects(
        &self,
        refs: Refs,
        progress: Option<Progress>,
    ) -> Result<(u64, u64, u64, Vec<Damage>)> {
        let done = Arc::new(AtomicU64::new(0));
        let n = self.config().read_concurrency;
        let results: Vec<(u64, u64, u64, Vec<Damage>)> = stream::iter(refs.by_object)
            .map(|(key, objrefs)| {
                let store = self.clone();
                let done = done.clone();
                let progress = progress.clone();
                async move {
                    let r = store.verify_object(&key, objrefs).await;
                    let bytes = r.1;
                    let total = done.fetch_add(bytes, Ordering::Relaxed) + bytes;
                    if let Some(p) = &progress {
                        p(total);
                    }
                    Ok::<_, crate::Error>(r)
                }
            })
            .buffer_unordered(n)
            .try_collect()
            .await?;
        let mut sum = (0, 0, 0, Vec::new());
        for (objects, bytes, chunks, d) in results {
            sum.0 += objects;
            sum.1 += bytes;
            sum.2 += chunks;
            sum.3.extend(d);
        }
        Ok(sum)
    }

    /// Check one object; returns (objects read, raw bytes hashed, chunks hashed, damage).
    async fn verify_object(&self, key: &str, o: ObjectRefs) -> (u64, u64, u64, Vec<Damage>) {
        let path = Path::from(key);
        let mut damaged = Vec::new();
        let all_affected = |o: &ObjectRefs| -> Vec<Affected> {
            let mut s: BTreeSet<Affected> = BTreeSet::new();
            for (_, a) in o.chunks.values() {
                s.extend(a.iter().cloned());
            }
            s.into_iter().collect()
        };
        let obj = match self.objects().get_object(&path).await {
            Ok(b) => b,
            Err(e) => {
                let problem = if e.kind() == ErrorKind::NotFound {
                    "missing".to_string()
                } else {
                    e.to_string()
                };
                damaged.push(Damage {
                    object: key.to_string(),
                    problem,
                    affects: all_affected(&o),
                });
                return (1, 0, 0, damaged);
            }
        };
        let store_key = key.to_string();
        let chunks: Vec<(ChunkRef, BTreeSet<Affected>)> = o.chunks.values().cloned().collect();
        if o.pack.is_none() && chunks.iter().any(|(c, _)| c.is_delta()) {
            let (bytes, n, d) = self.verify_deltas(&store_key, &chunks).await;
            damaged.extend(d);
            return (1, bytes, n, damaged);
        }
        let pack_id = o.pack;
        let res =
            tokio::task::spawn_blocking(move || check_object(&obj, &chunks, pack_id, &store_key))
                .await;
        match res {
            Ok((bytes, n, d)) => {
                damaged.extend(d);
                (1, bytes, n, damaged)
            }
            Err(e) => {
                damaged.push(Damage {
                    object: key.to_string(),
                    problem: format!("verification crashed: {e}"),
                    affects: all_affected(&o),
                });
                (1, 0, 0, damaged)
            }
        }
    }

    /// The chunks of a delta object: through the one decode place, which names the base chunk
    /// (and its step) at fault. (Raw bytes hashed, chunks hashed, damage.)
    async fn verify_deltas(
        &self,
        store_key: &str,
        chunks: &[(ChunkRef, BTreeSet<Affected>)],
    ) -> (u64, u64, Vec<Damage>) {
        let mut damaged = Vec::new();
        // A delta decodes only with its chain: through the one decode place, which names
        // the base chunk (and its step) at fault.
        let (mut bytes, mut n) = (0, 0);
        for (c, aff) in chunks {
            match self.chunks().get_chunk(c).await {
                Ok(b) => {
                    bytes += b.len() as u64;
                    n += 1;
                }
                Err(e) => damaged.push(Damage {
                    object: store_key.to_string(),
                    problem: format!(
                        "chunk {}: {}",
                        c.id.short(),
                        strip_prefix(&e.to_string(), store_key)
                    ),
                    affects: aff.iter().cloned().collect(),
                }),
            }
        }
        (bytes, n, damaged)
    }
}

/// What checking one object found: raw bytes and chunks hashed, and the damage.
struct Tally<'a> {
    key: &'a str,
    bytes: u64,
    n: u64,
    damaged: Vec<Damage>,
}

impl Tally<'_> {
    /// Check one chunk's stored bytes `slice`; damage affects `aff`.
    fn check(&mut self, slice: &[u8], c: &ChunkRef, known_len: bool, aff: Vec<Affected>) {
        match check_chunk(slice, c, known_len, self.key) {
            Ok(len) => {
                self.bytes += len;
                self.n += 1;
            }
            Err(problem) => self.damage(problem, aff),
        }
    }

    fn damage(&mut self, problem: String, affects: Vec<Affected>) {
        self.damaged.push(Damage {
            object: self.key.to_string(),
            problem,
            affects,
        });
    }
}

/// Check the bytes `obj` of a chunk object or pack (`pack_id`) against the chunks that
/// reference it, and a pack's other entries and hash. (Raw bytes hashed, chunks hashed,
/// damage.)
fn check_object(
    obj: &[u8],
    chunks: &[(ChunkRef, BTreeSet<Affected>)],
    pack_id: Option<PackId>,
    store_key: &str,
) -> (u64, u64, Vec<Damage>) {
    let mut t = Tally {
        key: store_key,
        bytes: 0,
        n: 0,
        damaged: Vec::new(),
    };
    let is_pack = pack_id.is_some() || chunks.iter().any(|(c, _)| c.pack.is_some());
    if is_pack {
        check_pack(&mut t, obj, chunks, pack_id);
    } else {
        for (c, aff) in chunks {
            t.check(obj, c, !aff.is_empty(), aff.iter().cloned().collect());
        }
    }
    // Damage outside every chunk (the pack's header or index) breaks no tensor, but
    // the object is not what it claims to be.
    if let Some(pid) = pack_id {
        let actual = PackId::of(obj);
        if actual != pid && t.damaged.is_empty() {
            t.damage(
                format!(
                    "pack hash is {} but should be {} (header or index damaged; its chunks are intact)",
                    actual.short(),
                    pid.short()
                ),
                Vec::new(),
            );
        }
    }
    (t.bytes, t.n, t.damaged)
}

/// Check the chunks of pack `obj` that manifests reference, then any other entry of its
/// index.
fn check_pack(
    t: &mut Tally,
    obj: &[u8],
    chunks: &[(ChunkRef, BTreeSet<Affected>)],
    pack_id: Option<PackId>,
) {
    let entries = pack::parse_pack(obj, &t.key);
    let mut seen = BTreeSet::new();
    for (c, aff) in chunks {
        seen.insert(c.id);
        let end = c.offset.saturating_add(c.stored as u64);
        match obj.get(c.offset as usize..end as usize) {
            Some(s) => t.check(s, c, true, aff.iter().cloned().collect()),
            None => t.damage(
                format!(
                    "chunk {} at {}..{} lies past the end ({} bytes; truncated)",
                    c.id.short(),
                    c.offset,
                    end,
                    obj.len()
                ),
                aff.iter().cloned().collect(),
            ),
        }
    }
    match entries {
        Ok(es) => {
            for e in es.iter().filter(|e| !seen.contains(&e.id)) {
                let c = ChunkRef {
                    id: e.id,
                    len: e.raw,
                    stored: e.stored,
                    codec: codec::Codec::Raw,
                    pack: pack_id,
                    offset: e.offset,
                    bases: Vec::new(),
                    base_step: None,
                };
                let s = &obj[e.offset as usize..(e.offset + e.stored as u64) as usize];
                t.check(s, &c, true, Vec::new());
            }
        }
        Err(e) if pack_id.is_some() && chunks.is_empty() => {
            let problem = strip_prefix(&e.to_string(), t.key);
            t.damage(problem, Vec::new());
        }
        Err(_) => {}
    }
}

fn check_chunk(
    slice: &[u8],
    c: &ChunkRef,
    known_len: bool,
    key: &str,
) -> std::result::Result<u64, String> {
    if !known_len && matches!(codec::delta_base(slice, &key), Ok(Some(_))) {
        return codec::check_delta_structure(slice, &key).map_err(|e| {
            format!(
                "chunk {}: {}",
                c.id.short(),
                strip_prefix(&e.to_string(), key)
            )
        });
    }
    let r = if known_len {
        codec::decode(slice, &c.id, c.len as u64, &key)
    } else {
        codec::decode_verify(slice, &c.id, &key)
    };
    r.map(|raw| raw.len() as u64).map_err(|e| {
        format!(
            "chunk {}: {}",
            c.id.short(),
            strip_prefix(&e.to_string(), key)
        )
    })
}

fn strip_prefix(msg: &str, key: &str) -> String {
    msg.strip_prefix(key)
        .and_then(|m| m.strip_prefix(": "))
        .unwrap_or(msg)
        .to_string()
}

fn damage(
    report: &mut VerifyReport,
    key: &Path,
    e: &crate::Error,
    run: &str,
    step: u64,
    item: &str,
) {
    report.damaged.push(Damage {
        object: key.to_string(),
        problem: e.to_string(),
        affects: vec![Affected {
            run: run.to_string(),
            step,
            item: item.to_string(),
        }],
    });
}

impl Refs {
    /// Every chunk manifest `m` of `step` references, each with the tensor or blob it holds.
    fn add_manifest(&mut self, store: &Store, run: &str, step: u64, m: &RankManifest) {
        let items = (m
            .tensors
            .iter()
            .map(|t| (format!("tensor {}", t.name), &t.chunks)))
        .chain(
            m.blobs
                .iter()
                .map(|b| (format!("blob {} of rank {}", b.name, m.rank), &b.chunks)),
        );
        for (item, chunks) in items {
            for c in chunks {
                let affected = Affected {
                    run: run.to_string(),
                    step,
                    item: item.clone(),
                };
                self.add(store, c, affected);
            }
        }
    }

    /// `c` and, for a delta, every base of its chain: a damaged base breaks `a` too.
    fn add(&mut self, store: &Store, c: &ChunkRef, a: Affected) {
        let mut base = c.base_ref();
        let mut level = 1;
        while let Some(b) = base {
            let item = format!(
                "{} (through the delta chain of chunk {}, base {level})",
                a.item,
                c.id.short()
            );
            self.add_one(store, &b, Affected { item, ..a.clone() });
            base = b.base_ref();
            level += 1;
        }
        self.add_one(store, c, a);
    }

    fn add_one(&mut self, store: &Store, c: &ChunkRef, a: Affected) {
        let key = store.keys().object_of(c).to_string();
        let o = self.by_object.entry(key).or_default();
        if let Some(p) = c.pack {
            o.pack = Some(p);
        }
        o.chunks
            .entry(c.id)
            .or_insert_with(|| (c.clone(), BTreeSet::new()))
            .1
            .insert(a);
    }
}

/// Rebuild what the commit record says (ranks, tensor table, coverage, blobs) from the rank
/// manifests it pins and list every disagreement as (affected item, problem). A record that
/// passes its checksum can still disagree (a format 1 record has none, or a writer bug).
fn compare_with_manifests(c: &CommitRecord, ms: &[RankManifest]) -> Vec<(String, String)> {
    const RECORD: &str = "commit record";
    let mut out = Vec::new();
    let world = c.layout.world();
    let ranks: Vec<u32> = c.ranks.iter().map(|e| e.rank).collect();
    if ranks != (0..world).collect::<Vec<_>>() {
        out.push((
            RECORD.to_string(),
            format!(
                "the record lists the manifests of ranks {ranks:?}, but its layout {} has ranks 0..{world}",
                c.layout
            ),
        ));
    }
    for m in ms {
        if m.layout != c.layout || m.generation != c.generation {
            out.push((
                format!("manifest of rank {}", m.rank),
                format!(
                    "rank {}'s manifest says layout {} generation {}, the commit record layout {} generation {}",
                    m.rank, m.layout, m.generation, c.layout, c.generation
                ),
            ));
        }
    }
    let rebuilt = match collect_tensors(ms) {
        Ok(t) => t,
        Err(e) => {
            out.push((
                RECORD.to_string(),
                format!("the rank manifests disagree: {}", e.message()),
            ));
            return out;
        }
    };
    compare_tensors(c, &rebuilt, &mut out);
    compare_blobs(c, ms, &mut out);
    out
}

/// The record's tensors against the ones `rebuilt` from the manifests: each listed in both,
/// with the same type, shape, shards and placement, and covered exactly once.
fn compare_tensors(
    c: &CommitRecord,
    rebuilt: &[crate::model::TensorEntry],
    out: &mut Vec<(String, String)>,
) {
    let mut theirs: std::collections::BTreeMap<&str, &crate::model::TensorEntry> =
        c.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    for t in rebuilt {
        let item = format!("tensor {}", t.name);
        if let Err(e) = check_coverage(&t.name, &t.shape, &t.shards) {
            out.push((item.clone(), format!("the rank manifests: {}", e.message())));
        }
        let Some(r) = theirs.remove(t.name.as_str()) else {
            out.push((
                item,
                "the rank manifests hold it, the commit record does not list it".to_string(),
            ));
            continue;
        };
        if (r.dtype, &r.shape) != (t.dtype, &t.shape) {
            out.push((
                item,
                format!(
                    "the commit record says {} {:?}, the rank manifests {} {:?}",
                    r.dtype, r.shape, t.dtype, t.shape
                ),
            ));
            continue;
        }
        let key =
            |s: &crate::model::ShardLoc| (s.rank, s.bbox.offsets.clone(), s.bbox.lengths.clone());
        let mut a: Vec<_> = r.shards.iter().map(key).collect();
        let mut b: Vec<_> = t.shards.iter().map(key).collect();
        a.sort();
        b.sort();
        if a != b {
            out.push((
                item,
                format!(
                    "the commit record places its shards {}, the rank manifests {}",
                    shards_text(&r.shards),
                    shards_text(&t.shards)
                ),
            ));
        } else if r.placement != t.placement {
            out.push((
                item,
                "the commit record's placement differs from the rank manifests'".to_string(),
            ));
        }
    }
    for name in theirs.keys() {
        out.push((
            format!("tensor {name}"),
            "the commit record lists it, no rank manifest holds it".to_string(),
        ));
    }
}

/// The record's blobs against the manifests': the same names, ranks and sizes.
fn compare_blobs(c: &CommitRecord, ms: &[RankManifest], out: &mut Vec<(String, String)>) {
    let mut blobs: Vec<BlobLoc> = ms
        .iter()
        .flat_map(|m| {
            m.blobs.iter().map(|b| BlobLoc {
                rank: m.rank,
                name: b.name.clone(),
                len: b.len,
            })
        })
        .collect();
    let mut listed = c.blobs.clone();
    let order = |b: &BlobLoc| (b.rank, b.name.clone(), b.len);
    blobs.sort_by_key(order);
    listed.sort_by_key(order);
    for b in &listed {
        if !blobs.contains(b) {
            out.push((
                format!("blob {} of rank {}", b.name, b.rank),
                format!(
                    "the commit record lists it with {} bytes, rank {}'s manifest does not hold it so",
                    b.len, b.rank
                ),
            ));
        }
    }
    for b in &blobs {
        if !listed.contains(b) {
            out.push((
                format!("blob {} of rank {}", b.name, b.rank),
                format!(
                    "rank {}'s manifest holds it ({} bytes), the commit record does not list it so",
                    b.rank, b.len
                ),
            ));
        }
    }
}

fn shards_text(s: &[crate::model::ShardLoc]) -> String {
    let parts: Vec<String> = s
        .iter()
        .take(8)
        .map(|s| format!("rank {} {}", s.rank, s.bbox))
        .collect();
    let more = if s.len() > 8 { ", ..." } else { "" };
    format!("[{}{more}]", parts.join(", "))
}
