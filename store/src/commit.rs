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

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt, stream};
use object_store::PutMode;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tracing::{info, instrument};

use crate::error::{Error, ErrorKind, Result};
use crate::id::StepId;
use crate::keys::{FENCE_SHARDS, StepObject, validate_run};
use crate::model::{
    BlobLoc, CommitRecord, PartRef, RankEntry, RankManifest, RecordPart, WHOLE_RECORD_FORMAT,
    WriteStats, check_coverage, collect_tensors,
};
use crate::store::Store;

/// A value the ranks of a generation agree on once ([`Store::agree_generation_interval`]):
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

impl Store {
    /// Write a rank's manifest with a conditional create. Writing the same bytes again is a
    /// no-op (a retried save); different bytes for the same rank and step are a conflict.
    #[instrument(skip_all, fields(run = %m.run, step = m.step, rank = m.rank))]
    pub async fn write_rank_manifest(&self, m: &RankManifest) -> Result<RankEntry> {
        validate_run(&m.run)?;
        let what = format!(
            "manifest of rank {} for step {} of run {}",
            m.rank, m.step, m.run
        );
        m.validate(&what)?;
        let path = self.keys().rank_manifest(&m.run, m.step, m.rank);
        let bytes = serde_json::to_vec(m)
            .map_err(|e| Error::internal(format!("serializing {what}: {e}")))?;
        let hash = crate::id::Hash::of(&bytes);
        let size = bytes.len() as u64;
        // A writer of a generation older than a started one must not add to the run.
        self.check_writer_fence(&m.run, m.generation, m.rank, "this writer")
            .await
            .map_err(|e| e.context(what.clone()))?;
        match self
            .put_object(&path, vec![bytes.clone().into()], PutMode::Create)
            .await
        {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::Conflict => {
                let existing = self.get_object(&path).await?;
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
    ///   a manifest it pinned changed (see [`Store::commit_step_as`]);
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
        let path = self.keys().rank_manifest(&m.run, m.step, m.rank);
        let commit = self.keys().commit(&m.run, m.step);
        self.join_generation_as(&m.run, m.generation, m.rank)
            .await
            .map_err(|e| e.context(what))?;
        let committed = || {
            Error::new(
                ErrorKind::Conflict,
                format!("{what}: step {} is already committed", m.step),
            )
        };
        if self.exists(&commit).await? {
            return Err(committed());
        }
        self.failpoints().hit("before_manifest_replace").await?;
        tracing::warn!(
            %path,
            old,
            new = m.generation,
            "replacing a manifest left by an older generation"
        );
        self.put_object(&path, vec![bytes.into()], PutMode::Overwrite)
            .await?;
        if self.exists(&commit).await? {
            let (c, _) = self.read_commit(&m.run, m.step).await?;
            let old_hash = crate::id::Hash::of(existing);
            if c.ranks
                .iter()
                .any(|e| e.rank == m.rank && e.hash == old_hash)
            {
                tracing::warn!(%path, "a committer of generation {old} committed meanwhile; putting its manifest back");
                self.put_object(&path, vec![existing.clone()], PutMode::Overwrite)
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
        let path = self.keys().rank_manifest(run, step, rank);
        match self.get_object(&path).await {
            Ok(b) => Ok((b, path)),
            Err(e) if e.kind() == ErrorKind::NotFound => {
                let legacy = self.keys().legacy_rank_manifest(run, step, rank);
                match self.get_object(&legacy).await {
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
    /// [`Store::get_manifest_bytes`]).
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

    /// Mark `generation` of `run` as started (fences committers of older generations).
    pub async fn start_generation(&self, run: &str, generation: u64) -> Result<()> {
        validate_run(run)?;
        let path = self.keys().generation_marker(run, generation);
        let body = serde_json::to_vec(
            &serde_json::json!({"generation": generation, "t_ms": self.now().timestamp_millis()}),
        )
        .map_err(|e| Error::internal(e.to_string()))?;
        match self
            .put_object(&path, vec![body.clone().into()], PutMode::Create)
            .await
        {
            Ok(()) => {
                // The writers' copies, one per fence shard (after the marker: a copy never
                // names a generation whose marker does not exist).
                let copies: Vec<_> = (0..FENCE_SHARDS)
                    .map(|shard| self.keys().fence(run, shard, generation))
                    .collect();
                futures::future::try_join_all(copies.iter().map(|path| {
                    self.put_object(path, vec![body.clone().into()], PutMode::Overwrite)
                }))
                .await
                .map_err(|e| {
                        e.context(format!(
                            "generation {generation} of run {run} is started, but its fence copies were not all written"
                        ))
                    })?;
                Ok(())
            }
            Err(e) if e.kind() == ErrorKind::Conflict => Err(Error::new(
                ErrorKind::Conflict,
                format!(
                    "generation {generation} of run {run} was already started by another supervisor"
                ),
            )),
            Err(e) => Err(e),
        }
    }

    /// Join `generation` of `run` as one of its writers: mark it started if no one has (a
    /// conflict means another rank or the supervisor marked it first), then check that no
    /// newer generation has started ([`ErrorKind::Fenced`] otherwise). Every writer does this
    /// before its first save, so whoever resumes a run fences every older writer of it.
    ///
    /// The marker is created only when the listing shows neither it nor a newer one: under a
    /// supervisor, which starts each generation before its ranks, a rank's join is one listing
    /// (thousands of ranks putting the same marker at once would pass S3's write rate for the
    /// prefix).
    pub async fn join_generation(&self, run: &str, generation: u64) -> Result<()> {
        match self.newest_generation(run).await? {
            Some(newer) if newer > generation => {
                return Err(fenced(run, newer, generation, "this writer"));
            }
            Some(g) if g == generation => return Ok(()),
            _ => {}
        }
        match self.start_generation(run, generation).await {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::Conflict => {}
            Err(e) => return Err(e),
        }
        self.check_generation(run, generation, "this writer").await
    }

    /// [`Store::join_generation`] by the writer of `rank`, through its fence shard
    /// ([`crate::Keys::fence`]): one listing of a prefix that a sixteenth of the ranks read,
    /// instead of `generations/` that every rank would. A shard showing a newer generation
    /// fences the writer; one showing this generation is enough to join (its marker exists:
    /// copies are written after the marker). Otherwise (a generation started by a build
    /// without fence shards, or whose starter died before writing them) the writer joins
    /// through the markers and adds this generation's copy to its shard.
    pub async fn join_generation_as(&self, run: &str, generation: u64, rank: u32) -> Result<()> {
        let seen = self.fence_shard(run, rank).await?;
        if let Some(&newer) = seen.iter().max()
            && newer > generation
        {
            return Err(fenced(run, newer, generation, "this writer"));
        }
        if seen.contains(&generation) {
            return Ok(());
        }
        self.join_generation(run, generation).await?;
        let body = serde_json::to_vec(
            &serde_json::json!({"generation": generation, "t_ms": self.now().timestamp_millis()}),
        )
        .map_err(|e| Error::internal(e.to_string()))?;
        self.put_object(
            &self.keys().fence(run, rank, generation),
            vec![body.into()],
            PutMode::Overwrite,
        )
        .await
    }

    /// The generations in the fence shard of `rank` (one listing).
    async fn fence_shard(&self, run: &str, rank: u32) -> Result<Vec<u64>> {
        validate_run(run)?;
        let dir = self.keys().fence_dir(run, rank);
        let metas = self.list_all(&dir).await?;
        Ok(metas
            .iter()
            .filter_map(|m| self.keys().parse_fence(&m.location))
            .collect())
    }

    /// The fence check of the writer of `rank` before it creates its manifest:
    /// [`ErrorKind::Fenced`] if its fence shard shows a generation newer than `generation`. One
    /// listing of the shard; when the shard does not show `generation` itself (a writer that did
    /// not join through it), the markers are listed too ([`Store::check_generation`]).
    ///
    /// The commit record is fenced by the markers themselves (the committer lists them before
    /// and after its create): a copy not yet written (its starter is writing them, or died
    /// first) lets a stale writer's manifest through, never its commit.
    pub async fn check_writer_fence(
        &self,
        run: &str,
        generation: u64,
        rank: u32,
        who: &str,
    ) -> Result<()> {
        let seen = self.fence_shard(run, rank).await?;
        if let Some(&newer) = seen.iter().max()
            && newer > generation
        {
            return Err(fenced(run, newer, generation, who));
        }
        if seen.contains(&generation) {
            return Ok(());
        }
        self.check_generation(run, generation, who).await
    }

    /// Claim a new generation of `run` for a job that resumes it by itself (no supervisor):
    /// the first number at least `at_least` and above every started generation whose marker
    /// this call creates. Two jobs claiming at once get different numbers (conditional
    /// create), so the later one fences the earlier.
    pub async fn claim_generation(&self, run: &str, at_least: u64) -> Result<u64> {
        let mut g = at_least.max(self.newest_generation(run).await?.map_or(0, |g| g + 1));
        loop {
            match self.start_generation(run, g).await {
                Ok(()) => return Ok(g),
                Err(e) if e.kind() == ErrorKind::Conflict => g += 1,
                Err(e) => return Err(e),
            }
        }
    }

    /// [`ErrorKind::Fenced`] ("fenced by generation N") if a generation newer than
    /// `generation` of `run` has started; `who` names the writer in the message.
    pub async fn check_generation(&self, run: &str, generation: u64, who: &str) -> Result<()> {
        match self.newest_generation(run).await? {
            Some(newer) if newer > generation => Err(fenced(run, newer, generation, who)),
            _ => Ok(()),
        }
    }

    /// The newest started generation of `run`, if any supervisor marked one.
    pub async fn newest_generation(&self, run: &str) -> Result<Option<u64>> {
        validate_run(run)?;
        let dir = self.keys().generations_dir(run);
        let metas = self.list_all(&dir).await?;
        Ok(metas
            .iter()
            .filter_map(|m| self.keys().parse_generation_marker(&m.location))
            .max())
    }

    /// When `generation` of `run` started: the `t_ms` its marker records (the store's clock of
    /// whoever created it), or `None` when it has no marker (or an old one without a time).
    pub async fn generation_started_ms(&self, run: &str, generation: u64) -> Result<Option<i64>> {
        validate_run(run)?;
        let path = self.keys().generation_marker(run, generation);
        match self.get_json::<serde_json::Value>(&path).await {
            Ok((v, _, _)) => Ok(v.get("t_ms").and_then(serde_json::Value::as_i64)),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The checkpoint interval of `generation` of `run`, agreed once: create its object
    /// ([`crate::keys::Keys::generation_interval`]) with `proposal` unless one exists, and
    /// return what the object holds (the proposal when this call created it, `true`; the
    /// first creator's otherwise, `false`). Every rank of a generation proposes what it
    /// derived and all use the answer, so they checkpoint the same steps even when they read
    /// the run's log at different moments; a writer of another generation writes another
    /// object. The store keeps the value as JSON and knows nothing of its fields: the type
    /// ([`Agreement`]) says whether a stored one can be used.
    pub async fn agree_generation_interval<T: Agreement>(
        &self,
        run: &str,
        generation: u64,
        proposal: &T,
    ) -> Result<(T, bool)> {
        validate_run(run)?;
        let path = self.keys().generation_interval(run, generation);
        match self.put_json(&path, proposal, PutMode::Create).await {
            Ok(_) => return Ok((proposal.clone(), true)),
            Err(e) if e.kind() == ErrorKind::Conflict => {}
            Err(e) => return Err(e),
        }
        let (agreed, _, _) = self.get_json::<T>(&path).await?;
        if let Err(why) = agreed.check(run, generation) {
            return Err(Error::corrupt(format!("{path}: {why}")));
        }
        Ok((agreed, false))
    }

    /// Read a step's commit record. `NotFound` if the step is not committed.
    pub async fn read_commit(&self, run: &str, step: u64) -> Result<(CommitRecord, StepId)> {
        self.read_commit_sized(run, step)
            .await
            .map(|(c, id, _)| (c, id))
    }

    /// [`Store::read_commit`], and the record's size in bytes (a split record's root and
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
                let path = self.keys().record_part(run, step, &r.hash());
                let bytes = self.get_object(&path).await.map_err(|e| match e.kind() {
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
        let path = self.keys().commit(run, step);
        let bytes = self.get_object(&path).await.map_err(|e| match e.kind() {
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

    /// Commit a step if every rank's manifest is present and coverage holds (see the module
    /// docs). A step with missing rank manifests gets [`ErrorKind::Incomplete`] naming them (wait
    /// and retry); shards that do not cover a tensor exactly once, or ranks that disagree on
    /// the layout, get [`ErrorKind::InvalidInput`] naming the tensor and region.
    pub async fn commit_step(&self, run: &str, step: u64) -> Result<CommitOutcome> {
        self.commit_step_as(run, step, None).await
    }

    /// [`Store::commit_step`] by a committer of `generation`: manifests of older generations
    /// (left by a dead attempt) count as missing, and manifests of a newer one mean this
    /// committer is stale ([`ErrorKind::Fenced`]).
    #[instrument(skip_all, fields(run, step, generation))]
    pub async fn commit_step_as(
        &self,
        run: &str,
        step: u64,
        generation: Option<u64>,
    ) -> Result<CommitOutcome> {
        validate_run(run)?;
        let dir = self.keys().step_dir(run, step);
        let metas = self.list_all(&dir).await?;
        // Each listed manifest at the key it was found at: this build's place, else (left by a
        // build before format 4) the old one.
        let mut ranks: BTreeMap<u32, object_store::path::Path> = BTreeMap::new();
        let mut has_commit = false;
        for m in &metas {
            match self.keys().parse_step_object(&m.location) {
                Some((_, _, StepObject::RankManifest(r)))
                    if !ranks.contains_key(&r)
                        || m.location == self.keys().rank_manifest(run, step, r) =>
                {
                    ranks.insert(r, m.location.clone());
                }
                Some((_, _, StepObject::RankManifest(_) | StepObject::RecordPart(_))) => {}
                Some((_, _, StepObject::Commit)) => has_commit = true,
                None => {}
            }
        }
        if has_commit {
            let (c, id) = self.read_commit(run, step).await?;
            return already_committed(c, id, generation);
        }
        if ranks.is_empty() {
            return Err(Error::incomplete(format!(
                "step {step} of run {run}: no rank has written its manifest yet"
            )));
        }
        // A committer polling while ranks still write learns the world size from one manifest
        // of its own generation, and while the listing lacks a rank of it, reads no other:
        // polls then cost a listing, one get and the fence check, not a get per manifest.
        if let Some(g) = generation
            && let Some(path) = ranks.values().next()
        {
            let (m, _, _) = self.get_json::<RankManifest>(path).await?;
            let world = m.layout.world();
            let unlisted: Vec<u32> = (0..world).filter(|r| !ranks.contains_key(r)).collect();
            if m.generation == g && !unlisted.is_empty() {
                self.check_generation(run, g, "this committer")
                    .await
                    .map_err(|e| e.context(format!("step {step} of run {run}")))?;
                let shown: Vec<String> = unlisted.iter().take(10).map(u32::to_string).collect();
                return Err(Error::incomplete(format!(
                    "step {step} of run {run}: {} of {world} rank manifests of generation {g} are missing (ranks {}{})",
                    unlisted.len(),
                    shown.join(", "),
                    if unlisted.len() > 10 { ", ..." } else { "" }
                )));
            }
        }
        // Read every manifest present (O(ranks) requests): a restarted job may have left
        // manifests of an older generation and another layout next to the current ones.
        let present: Vec<(RankManifest, RankEntry)> = stream::iter(ranks.clone())
            .map(|(r, path)| async move {
                let (m, hash, size) = self.get_json::<RankManifest>(&path).await?;
                m.validate(path.as_ref())?;
                Ok::<_, Error>((
                    m,
                    RankEntry {
                        rank: r,
                        hash,
                        size,
                    },
                ))
            })
            .buffered(32)
            .try_collect()
            .await?;
        let newest = present.iter().map(|(m, _)| m.generation).max().unwrap_or(0);
        let generation = generation.unwrap_or(newest);
        if let Some((newer, _)) = present.iter().find(|(m, _)| m.generation > generation) {
            return Err(Error::new(
                ErrorKind::Fenced,
                format!(
                    "step {step} of run {run}: rank {} saved it in generation {}, newer than this committer's {generation}; a stale committer must not commit",
                    newer.rank, newer.generation
                ),
            ));
        }
        let Some((first, _)) = present.iter().find(|(m, _)| m.generation == generation) else {
            return Err(Error::incomplete(format!(
                "step {step} of run {run}: no rank of generation {generation} has written its manifest yet"
            )));
        };
        let layout = first.layout;
        let first_rank = first.rank;
        let world = layout.world();
        let current: Vec<u32> = present
            .iter()
            .filter(|(m, _)| m.generation == generation)
            .map(|(m, _)| m.rank)
            .collect();
        let missing: Vec<u32> = (0..world).filter(|r| !current.contains(r)).collect();
        if !missing.is_empty() {
            let shown: Vec<String> = missing.iter().take(10).map(u32::to_string).collect();
            return Err(Error::incomplete(format!(
                "step {step} of run {run}: {} of {world} rank manifests of generation {generation} are missing (ranks {}{})",
                missing.len(),
                shown.join(", "),
                if missing.len() > 10 { ", ..." } else { "" }
            )));
        }
        if let Some(&extra) = current.iter().find(|&&r| r >= world) {
            return Err(Error::invalid(format!(
                "step {step} of run {run}: rank {extra} wrote a manifest but the layout {layout} has {world} ranks"
            )));
        }
        // Stale manifests of ranks beyond the current world are left for GC; they are not
        // part of this step.
        let manifests: Vec<(RankManifest, RankEntry)> = present
            .into_iter()
            .filter(|(m, _)| m.generation == generation && m.rank < world)
            .collect();
        let mut stats = WriteStats::default();
        let mut blobs = Vec::new();
        for (m, _) in &manifests {
            if m.layout != layout {
                return Err(Error::invalid(format!(
                    "step {step} of run {run}: rank {} saved with layout {}, rank {} with {layout} (same generation {generation})",
                    m.rank, m.layout, first_rank
                )));
            }
            if m.run != run || m.step != step {
                return Err(Error::corrupt(format!(
                    "the manifest of rank {} lives at step {step} of run {run} but names step {} of run {}",
                    m.rank, m.step, m.run
                )));
            }
            stats.add(&m.stats);
            blobs.extend(m.blobs.iter().map(|b| BlobLoc {
                rank: m.rank,
                name: b.name.clone(),
                len: b.len,
            }));
        }
        let ms: Vec<RankManifest> = manifests.iter().map(|(m, _)| m.clone()).collect();
        let tensors =
            collect_tensors(&ms).map_err(|e| e.context(format!("step {step} of run {run}")))?;
        for t in &tensors {
            check_coverage(&t.name, &t.shape, &t.shards)
                .map_err(|e| e.context(format!("step {step} of run {run}")))?;
        }
        let mut record = CommitRecord {
            checksum: None,
            format: WHOLE_RECORD_FORMAT,
            run: run.to_string(),
            step,
            layout,
            generation,
            // Derived from the manifests, not the clock: every committer of a step builds the
            // same bytes, so even a backend whose conditional create is not atomic ends with
            // one consistent record (see FORMAT.md).
            committed_ms: manifests
                .iter()
                .map(|(m, _)| m.created_ms)
                .max()
                .unwrap_or(0),
            ranks: manifests.into_iter().map(|(_, e)| e).collect(),
            tensors,
            blobs,
            stats,
            index: None,
        };
        self.failpoints().hit("before_commit").await?;
        // Epoch fencing: once a newer generation has started (a supervisor, an agent or a job
        // resumed by hand marked it), this one's committer is stale.
        let who = "this committer";
        self.check_generation(run, generation, who)
            .await
            .map_err(|e| e.context(format!("step {step} of run {run}")))?;
        let path = self.keys().commit(run, step);
        self.failpoints().hit("before_commit_create").await?;
        let mut bytes = record.seal()?;
        let part_bytes = self.config().record_part_bytes;
        if bytes.len() > part_bytes {
            // Format 5: the parts first, then the root that pins them (a crash between leaves
            // parts no record names, which GC deletes with the uncommitted step).
            let (mut root, parts) = record.split(part_bytes)?;
            let n = parts.len();
            stream::iter(parts)
                .map(|(hash, b)| {
                    let path = self.keys().record_part(run, step, &hash);
                    async move {
                        self.put_object(&path, vec![b.into()], PutMode::Overwrite)
                            .await
                    }
                })
                // One wave for up to 64 parts (4 MB of record), on as many prefixes.
                .buffer_unordered(64)
                .try_collect::<Vec<()>>()
                .await?;
            self.failpoints().hit("after_record_parts").await?;
            bytes = root.seal()?;
            info!(
                run,
                step,
                parts = n,
                root_bytes = bytes.len(),
                "commit record split"
            );
            record.format = root.format;
            record.checksum = root.checksum;
            record.index = root.index;
        }
        let hash = crate::id::Hash::of(&bytes);
        match self
            .put_object(&path, vec![bytes.into()], PutMode::Create)
            .await
        {
            Ok(()) => {
                info!(run, step, ranks = world, "committed");
                // A generation started between the check and the create (one request's
                // window) did not stop this commit, but it does stop this writer; and a writer
                // of it may have replaced a manifest this record pins (it found no record yet):
                // then no one could ever restore the record, so it is withdrawn.
                if let Err(e) = self.check_generation(run, generation, who).await {
                    if e.kind() == ErrorKind::Fenced && !self.pins_hold(&record).await? {
                        self.delete_all(vec![path.clone()]).await?;
                        return Err(e.context(format!(
                            "step {step} of run {run}: the commit record was withdrawn (a newer generation replaced a manifest it pinned)"
                        )));
                    }
                    return Err(e.context(format!(
                        "step {step} of run {run} was committed as a newer generation started"
                    )));
                }
                Ok(CommitOutcome::Committed(record, StepId(hash)))
            }
            Err(e) if e.kind() == ErrorKind::Conflict => {
                let (c, id) = self.read_commit(run, step).await?;
                already_committed(c, id, Some(generation))
            }
            Err(e) => Err(e),
        }
    }

    /// Commit a step once every rank's manifest is there, polling every `poll` until
    /// `timeout`. Errors other than "incomplete because a manifest is missing" end the wait.
    pub async fn wait_and_commit(
        &self,
        run: &str,
        step: u64,
        poll: Duration,
        timeout: Duration,
    ) -> Result<CommitOutcome> {
        self.wait_and_commit_as(run, step, None, poll, timeout)
            .await
    }

    /// [`Store::wait_and_commit`] by a committer of `generation` (see
    /// [`Store::commit_step_as`]).
    pub async fn wait_and_commit_as(
        &self,
        run: &str,
        step: u64,
        generation: Option<u64>,
        poll: Duration,
        timeout: Duration,
    ) -> Result<CommitOutcome> {
        let t0 = Instant::now();
        // Start polling fast (ranks of one job finish within milliseconds of each other on
        // one machine) and back off to `poll`.
        let mut pause = poll.min(Duration::from_millis(5));
        loop {
            match self.commit_step_as(run, step, generation).await {
                Ok(o) => return Ok(o),
                Err(e) if e.kind() == ErrorKind::Incomplete && t0.elapsed() < timeout => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(poll);
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// A step someone else committed: theirs, unless a committer of a newer `generation` finds a
/// record of an older one (its ranks' saves are not in it: not a success).
fn already_committed(
    c: CommitRecord,
    id: StepId,
    generation: Option<u64>,
) -> Result<CommitOutcome> {
    match generation {
        Some(g) if c.generation < g => Err(Error::new(
            ErrorKind::Conflict,
            format!(
                "step {} of run {} is already committed by generation {}, older than this committer's {g}",
                c.step, c.run, c.generation
            ),
        )),
        _ => Ok(CommitOutcome::AlreadyCommitted(c, id)),
    }
}

/// The error of a writer of `generation` once `newer` has started.
fn fenced(run: &str, newer: u64, generation: u64, who: &str) -> Error {
    Error::new(
        ErrorKind::Fenced,
        format!(
            "fenced by generation {newer}: generation {newer} has started in run {run}; {who} \
             (generation {generation}) is stale and must stop (no retry can succeed; the newer \
             job owns the run)"
        ),
    )
}
