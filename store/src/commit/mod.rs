//! The commit protocol: rank manifests and the commit record, both created with
//! `PutMode::Create`; a step is complete when, and only when, its commit record exists.
//!
//! 1. Every rank writes its chunks, then `runs/<run>/steps/<step>/ranks/<2 hex>/rank-<r>.manifest`
//!    (`steps/<step>/rank-<r>.manifest` before commit record format 4; still read).
//! 2. One committer lists the step (1 request per 1000 ranks), reads every rank manifest
//!    (1 request per rank), checks that they agree on the layout and that the shards of every
//!    tensor cover its shape exactly once, and creates `COMMIT`. A second committer's create
//!    fails with "already exists" and it returns the winner's record: harmless.
//!    A record larger than [`crate::StoreConfig::record_part_bytes`] is split (format 5): the
//!    committer first puts its parts (`steps/<step>/index/<2 hex>/<blake3>.part`, the same
//!    bytes from every committer), then creates `COMMIT` as a root that pins them by hash.
//!
//! Total cost: O(ranks) requests, never O(ranks^2).
//!
//! | file | owns |
//! |---|---|
//! | `mod.rs` | rank manifests (written, replaced, read) and commit records read back |
//! | `generation.rs` | generation markers, joining, the writers' fence, [`Agreement`]s |
//! | `step.rs` | committing a step, phase by phase, and waiting to commit |
//! | `catalog.rs` | listing runs and steps, committed or not |
//! | `drains.rs` | drain markers: a local tier's steps not yet drained |
//! | `node.rs` | node commits: a node's ranks of a step, local-durable in its tier |
//!
//! All of it is one type, [`CommitLog`], a part of the [`Store`](crate::Store) handle
//! (`store.log()`).

pub mod catalog;
mod drains;
mod generation;
pub mod node;
mod step;

use futures::{StreamExt, TryStreamExt, stream};
use object_store::PutMode;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tracing::instrument;

use crate::error::{Error, ErrorKind, Result};
use crate::id::StepId;
use crate::keys::validate_run;
use crate::model::{CommitRecord, PartRef, RankEntry, RankManifest, RecordPart};
use crate::store::Objects;

/// A value the ranks of a generation agree on once ([`CommitLog::agree_generation_interval`]):
/// stored as JSON, its type defined by its writers (the checkpoint interval is
/// `ckpt_recovery::records::CheckpointInterval`), which say whether a stored one can be used.
pub trait Agreement: Serialize + DeserializeOwned + Clone {
    /// `Ok` when a value read back for `generation` of `run` can be used; otherwise why not,
    /// in words (the store reports it as damaged data, naming the object).
    fn check(&self, run: &str, generation: u64) -> std::result::Result<(), String>;
}

/// How a commit ended.
#[derive(Debug, Clone)]
pub enum CommitOutcome {
    /// This call created the commit record.
    Committed(CommitRecord, StepId),
    /// Someone else committed the step first; this is their record.
    AlreadyCommitted(CommitRecord, StepId),
}

impl CommitOutcome {
    /// The record, whoever wrote it.
    pub fn record(&self) -> &CommitRecord {
        match self {
            CommitOutcome::Committed(r, _) | CommitOutcome::AlreadyCommitted(r, _) => r,
        }
    }
    /// The step id.
    pub fn id(&self) -> StepId {
        match self {
            CommitOutcome::Committed(_, i) | CommitOutcome::AlreadyCommitted(_, i) => *i,
        }
    }
}

/// The commit log of a store: rank manifests, commit records, generations and the writers'
/// fence, listings of runs and steps, drain markers. Cheap to clone.
#[derive(Debug, Clone)]
pub struct CommitLog {
    objects: Objects,
}

impl CommitLog {
    pub(crate) fn new(objects: Objects) -> Self {
        CommitLog { objects }
    }

    /// The plain objects below.
    pub fn objects(&self) -> &Objects {
        &self.objects
    }

    /// Write a rank's manifest with a conditional create. Writing the same bytes again is a
    /// no-op (a retried save); different bytes for the same rank and step are a conflict.
    #[instrument(skip_all, fields(run = %m.run, step = m.step, rank = m.rank))]
    pub async fn write_rank_manifest(&self, m: &RankManifest) -> Result<RankEntry> {
        self.write_rank_manifest_fenced(m, m.generation).await
    }

    /// [`CommitLog::write_rank_manifest`] by a writer of generation `fence` (at least the
    /// manifest's): a drain of a local tier copying a step an earlier generation of the job
    /// saved (see [`CommitLog::commit_step_fenced`]).
    pub async fn write_rank_manifest_fenced(
        &self,
        m: &RankManifest,
        fence: u64,
    ) -> Result<RankEntry> {
        validate_run(&m.run)?;
        let what = format!(
            "manifest of rank {} for step {} of run {}",
            m.rank, m.step, m.run
        );
        m.validate(&what)?;
        let path = self.objects.keys().rank_manifest(&m.run, m.step, m.rank);
        let bytes = serde_json::to_vec(m)
            .map_err(|e| Error::internal(format!("serializing {what}: {e}")))?;
        let hash = crate::id::Hash::of(&bytes);
        let size = bytes.len() as u64;
        // A writer of a generation older than a started one must not add to the run.
        self.check_writer_fence(&m.run, fence.max(m.generation), m.rank, "this writer")
            .await
            .map_err(|e| e.context(what.clone()))?;
        match self
            .objects
            .put_object(&path, vec![bytes.clone().into()], PutMode::Create)
            .await
        {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::Conflict => {
                let existing = self.objects.get_object(&path).await?;
                if crate::id::Hash::of(&existing) != hash {
                    let old_gen = serde_json::from_slice::<RankManifest>(&existing)
                        .map(|o| o.generation)
                        .ok();
                    match old_gen {
                        // Left by a dead attempt of an older generation (the step never
                        // committed, or this would not be saved again): replace it.
                        Some(g) if g < m.generation => {
                            self.replace_older_manifest(m, &what, &existing, g, bytes)
                                .await?;
                        }
                        Some(g) if g > m.generation => {
                            return Err(Error::new(
                                ErrorKind::Fenced,
                                format!(
                                    "{what}: generation {g} has already saved this rank; this writer (generation {}) is stale and must stop",
                                    m.generation
                                ),
                            ));
                        }
                        _ => {
                            return Err(Error::new(
                                ErrorKind::Conflict,
                                format!(
                                    "{what}: {path} already exists with other content from the same generation {} \
                                     (two writers for one rank, or a restart that kept its generation: \
                                     restart with a higher --generation; the supervisor does this for you)",
                                    m.generation
                                ),
                            ));
                        }
                    }
                }
            }
            Err(e) => return Err(e),
        }
        Ok(RankEntry {
            rank: m.rank,
            hash,
            size,
        })
    }

    /// Replace `existing`, a manifest of the older generation `old` of an uncommitted step,
    /// with `bytes` (the manifest `m` of a newer generation).
    ///
    /// The check "not committed" and the overwrite are two requests, and a committer of
    /// generation `old` may create the commit record in between, pinned to the bytes this
    /// replaces. Two rules keep any record from pinning bytes that are gone:
    /// - this writer's generation is started (its marker exists) before the check, so such a
    ///   committer finds it when it checks again after its create, and withdraws its record if
    ///   a manifest it pinned changed (see [`CommitLog::commit_step_as`]);
    /// - after the overwrite this writer looks for the record again: one pinned to the
    ///   replaced bytes gets them back, and the write is refused ("already committed").
    async fn replace_older_manifest(
        &self,
        m: &RankManifest,
        what: &str,
        existing: &bytes::Bytes,
        old: u64,
        bytes: Vec<u8>,
    ) -> Result<()> {
        let path = self.objects.keys().rank_manifest(&m.run, m.step, m.rank);
        let commit = self.objects.keys().commit(&m.run, m.step);
        self.join_generation_as(&m.run, m.generation, m.rank)
            .await
            .map_err(|e| e.context(what))?;
        let committed = || {
            Error::new(
                ErrorKind::Conflict,
                format!("{what}: step {} is already committed", m.step),
            )
        };
        if self.objects.exists(&commit).await? {
            return Err(committed());
        }
        self.objects
            .failpoints()
            .hit("before_manifest_replace")
            .await?;
        tracing::warn!(
            %path,
            old,
            new = m.generation,
            "replacing a manifest left by an older generation"
        );
        self.objects
            .put_object(&path, vec![bytes.into()], PutMode::Overwrite)
            .await?;
        if self.objects.exists(&commit).await? {
            let (c, _) = self.read_commit(&m.run, m.step).await?;
            let old_hash = crate::id::Hash::of(existing);
            if c.ranks
                .iter()
                .any(|e| e.rank == m.rank && e.hash == old_hash)
            {
                tracing::warn!(%path, "a committer of generation {old} committed meanwhile; putting its manifest back");
                self.objects
                    .put_object(&path, vec![existing.clone()], PutMode::Overwrite)
                    .await?;
                return Err(committed().context(format!(
                    "generation {old} committed it while generation {} replaced this manifest",
                    m.generation
                )));
            }
        }
        Ok(())
    }

    /// Whether every manifest `record` pins still has the pinned bytes.
    async fn pins_hold(&self, record: &CommitRecord) -> Result<bool> {
        for e in &record.ranks {
            match self
                .get_manifest_bytes(&record.run, record.step, e.rank)
                .await
            {
                Ok((b, _)) if crate::id::Hash::of(&b) == e.hash => {}
                Ok(_) => return Ok(false),
                Err(x) if x.kind() == ErrorKind::NotFound => return Ok(false),
                Err(x) => return Err(x),
            }
        }
        Ok(true)
    }

    /// The bytes of one rank's manifest and the key they came from: at its place
    /// ([`crate::Keys::rank_manifest`]), or where builds before commit record format 4 put it
    /// ([`crate::Keys::legacy_rank_manifest`]; one more request for such a step).
    /// `NotFound` names both keys. The one way every reader finds a manifest.
    pub async fn get_manifest_bytes(
        &self,
        run: &str,
        step: u64,
        rank: u32,
    ) -> Result<(bytes::Bytes, object_store::path::Path)> {
        let path = self.objects.keys().rank_manifest(run, step, rank);
        match self.objects.get_object(&path).await {
            Ok(b) => Ok((b, path)),
            Err(e) if e.kind() == ErrorKind::NotFound => {
                let legacy = self.objects.keys().legacy_rank_manifest(run, step, rank);
                match self.objects.get_object(&legacy).await {
                    Ok(b) => Ok((b, legacy)),
                    Err(e) if e.kind() == ErrorKind::NotFound => Err(Error::not_found(format!(
                        "the manifest of rank {rank} for step {step} of run {run} is missing ({path}, or {legacy} as written before format 4)"
                    ))),
                    Err(e) => Err(e),
                }
            }
            Err(e) => Err(e),
        }
    }

    /// One rank's manifest parsed (not checked), its hash and size, wherever it is (see
    /// [`CommitLog::get_manifest_bytes`]).
    pub async fn get_rank_manifest(
        &self,
        run: &str,
        step: u64,
        rank: u32,
    ) -> Result<(RankManifest, crate::id::Hash, u64)> {
        let (bytes, path) = self.get_manifest_bytes(run, step, rank).await?;
        let m = serde_json::from_slice::<RankManifest>(&bytes).map_err(|e| {
            Error::corrupt(format!(
                "{path}: not a valid RankManifest ({e}; {} bytes, truncated or garbage?)",
                bytes.len()
            ))
        })?;
        Ok((m, crate::id::Hash::of(&bytes), bytes.len() as u64))
    }

    /// Read and check one rank's manifest; `expect` (from the commit record) pins its hash.
    pub async fn read_rank_manifest(
        &self,
        run: &str,
        step: u64,
        rank: u32,
        expect: Option<&RankEntry>,
    ) -> Result<RankManifest> {
        let (bytes, path) = self
            .get_manifest_bytes(run, step, rank)
            .await
            .map_err(|e| {
                if e.kind() == ErrorKind::NotFound {
                    Error::corrupt(e.to_string())
                } else {
                    e
                }
            })?;
        let hash = crate::id::Hash::of(&bytes);
        let m = serde_json::from_slice::<RankManifest>(&bytes).map_err(|e| {
            Error::corrupt(format!(
                "{path}: not a valid RankManifest ({e}; {} bytes, truncated or garbage?)",
                bytes.len()
            ))
        })?;
        if let Some(x) = expect
            && x.hash != hash
        {
            return Err(Error::corrupt(format!(
                "{path}: content hash {} differs from the commit record's {} (the manifest was damaged or replaced)",
                hash.short(),
                x.hash.short()
            )));
        }
        let what = path.to_string();
        m.validate(&what)?;
        if m.run != run || m.step != step || m.rank != rank {
            return Err(Error::corrupt(format!(
                "{path}: says run {} step {} rank {}, but lives at run {run} step {step} rank {rank}",
                m.run, m.step, m.rank
            )));
        }
        Ok(m)
    }

    /// Read a step's commit record. `NotFound` if the step is not committed.
    pub async fn read_commit(&self, run: &str, step: u64) -> Result<(CommitRecord, StepId)> {
        self.read_commit_sized(run, step)
            .await
            .map(|(c, id, _)| (c, id))
    }

    /// [`CommitLog::read_commit`], and the record's size in bytes (a split record's root and
    /// parts together).
    pub(crate) async fn read_commit_sized(
        &self,
        run: &str,
        step: u64,
    ) -> Result<(CommitRecord, StepId, u64)> {
        self.read_commit_with(run, step, |_| true).await
    }

    /// Read a step's commit record for a reader of the tensors `names` only: a record written
    /// whole is read whole; of a split one (format 5), the root and the parts that hold those
    /// tensors, which pin the rank manifests of their shards. The record returned lists those
    /// parts' tensors and rank entries (others in it are absent, not missing). Unknown names
    /// are not an error here: they are absent from the record.
    pub async fn read_commit_for(
        &self,
        run: &str,
        step: u64,
        names: &std::collections::BTreeSet<String>,
    ) -> Result<(CommitRecord, StepId)> {
        let wanted = |r: &PartRef| match r {
            PartRef::Tensors { first, last, .. } if first <= last => {
                names.range::<String, _>(first..=last).next().is_some()
            }
            _ => false,
        };
        let (c, id, _) = self.read_commit_with(run, step, wanted).await?;
        Ok((c, id))
    }

    /// The root of a step's record, filled with the parts `wanted` picks (a split record), and
    /// the size of what was read.
    async fn read_commit_with(
        &self,
        run: &str,
        step: u64,
        wanted: impl Fn(&PartRef) -> bool,
    ) -> Result<(CommitRecord, StepId, u64)> {
        let (mut c, id, mut size) = self.read_commit_root(run, step).await?;
        if let Some(index) = c.index.clone() {
            let picked: Vec<&PartRef> = index.parts.iter().filter(|r| wanted(r)).collect();
            size += picked.iter().map(|r| r.size()).sum::<u64>();
            let mut read = self
                .read_record_parts(&c, picked.into_iter())
                .await?
                .into_iter();
            let parts = index
                .parts
                .iter()
                .map(|r| if wanted(r) { read.next() } else { None })
                .collect();
            c.fill(parts, &format!("step {step} of run {run}: commit record"))?;
        }
        Ok((c, id, size))
    }

    /// The rank entry of `rank` in split record `c` (format 5), from the ranks part that holds
    /// it; `None` if no part lists the rank.
    pub(crate) async fn read_rank_entry(
        &self,
        c: &CommitRecord,
        rank: u32,
    ) -> Result<Option<RankEntry>> {
        let Some(index) = &c.index else {
            return Ok(None);
        };
        let part = index.parts.iter().find(
            |r| matches!(r, PartRef::Ranks { first, last, .. } if (*first..=*last).contains(&rank)),
        );
        let Some(part) = part else {
            return Ok(None);
        };
        let p = self.read_record_parts(c, std::iter::once(part)).await?;
        Ok(p.into_iter().flat_map(|p| p.ranks).find(|e| e.rank == rank))
    }

    /// Read parts of split record `c`, in the order given, each checked against the hash and
    /// size the root pins.
    async fn read_record_parts<'a>(
        &self,
        c: &CommitRecord,
        refs: impl Iterator<Item = &'a PartRef>,
    ) -> Result<Vec<RecordPart>> {
        let (run, step) = (c.run.as_str(), c.step);
        stream::iter(refs.cloned())
            .map(|r| async move {
                let path = self.objects.keys().record_part(run, step, &r.hash());
                let bytes = self.objects.get_object(&path).await.map_err(|e| match e.kind() {
                    ErrorKind::NotFound => Error::not_found(format!(
                        "step {step} of run {run}: part {path} of its commit record is missing"
                    )),
                    _ => e,
                })?;
                if crate::id::Hash::of(&bytes) != r.hash() || bytes.len() as u64 != r.size() {
                    return Err(Error::corrupt(format!(
                        "step {step} of run {run}: part {path} of its commit record is damaged (its {} bytes do not match the hash the record pins); do not use this step",
                        bytes.len()
                    )));
                }
                serde_json::from_slice::<RecordPart>(&bytes).map_err(|e| {
                    Error::corrupt(format!(
                        "step {step} of run {run}: part {path} of its commit record is not a record part ({e})"
                    ))
                })
            })
            .buffered(16)
            .try_collect()
            .await
    }

    /// The root of a step's commit record as stored, its id, and its size: for a record
    /// written whole (formats 1-4), the whole record; for a split one (format 5), the step's
    /// summary and the index of its parts, with no rank entries, tensors or blobs.
    pub async fn read_commit_root(
        &self,
        run: &str,
        step: u64,
    ) -> Result<(CommitRecord, StepId, u64)> {
        validate_run(run)?;
        let path = self.objects.keys().commit(run, step);
        let bytes = self
            .objects
            .get_object(&path)
            .await
            .map_err(|e| match e.kind() {
                ErrorKind::NotFound => Error::not_found(format!(
                    "step {step} of run {run} is not committed (no {path})"
                )),
                _ => e,
            })?;
        let hash = crate::id::Hash::of(&bytes);
        let what = format!("step {step} of run {run}: commit record {path}");
        let c = CommitRecord::from_bytes(&bytes, &what)?;
        if c.run != run || c.step != step {
            return Err(Error::corrupt(format!(
                "{path}: says run {} step {}, but lives at run {run} step {step}",
                c.run, c.step
            )));
        }
        if c.index.is_some() && !(c.ranks.is_empty() && c.tensors.is_empty() && c.blobs.is_empty())
        {
            return Err(Error::corrupt(format!(
                "{what}: a split record's root lists rank manifests, tensors or blobs itself (damaged)"
            )));
        }
        Ok((c, StepId(hash), bytes.len() as u64))
    }
}
