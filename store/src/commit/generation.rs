//! Generations of a run: markers that start one (fencing writers and committers of older
//! ones), joining, the writers' fence, and what the ranks of a generation agree on.

use object_store::PutMode;

use super::Agreement;
use super::CommitLog;
use crate::error::{Error, ErrorKind, Result};
use crate::keys::{FENCE_SHARDS, validate_run};

impl CommitLog {
    /// Mark `generation` of `run` as started (fences committers of older generations).
    pub async fn start_generation(&self, run: &str, generation: u64) -> Result<()> {
        validate_run(run)?;
        let path = self.objects.keys().generation_marker(run, generation);
        let body = serde_json::to_vec(
            &serde_json::json!({"generation": generation, "t_ms": self.objects.now().timestamp_millis()}),
        )
        .map_err(|e| Error::internal(e.to_string()))?;
        match self
            .objects
            .put_object(&path, vec![body.clone().into()], PutMode::Create)
            .await
        {
            Ok(()) => {
                // The writers' copies, one per fence shard (after the marker: a copy never
                // names a generation whose marker does not exist).
                let copies: Vec<_> = (0..FENCE_SHARDS)
                    .map(|shard| self.objects.keys().fence(run, shard, generation))
                    .collect();
                futures::future::try_join_all(copies.iter().map(|path| {
                    self.objects.put_object(path, vec![body.clone().into()], PutMode::Overwrite)
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

    /// [`CommitLog::join_generation`] by the writer of `rank`, through its fence shard
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
            &serde_json::json!({"generation": generation, "t_ms": self.objects.now().timestamp_millis()}),
        )
        .map_err(|e| Error::internal(e.to_string()))?;
        self.objects
            .put_object(
                &self.objects.keys().fence(run, rank, generation),
                vec![body.into()],
                PutMode::Overwrite,
            )
            .await
    }

    /// The generations in the fence shard of `rank` (one listing).
    async fn fence_shard(&self, run: &str, rank: u32) -> Result<Vec<u64>> {
        validate_run(run)?;
        let dir = self.objects.keys().fence_dir(run, rank);
        let metas = self.objects.list_all(&dir).await?;
        Ok(metas
            .iter()
            .filter_map(|m| self.objects.keys().parse_fence(&m.location))
            .collect())
    }

    /// The fence check of the writer of `rank` before it creates its manifest:
    /// [`ErrorKind::Fenced`] if its fence shard shows a generation newer than `generation`. One
    /// listing of the shard; when the shard does not show `generation` itself (a writer that did
    /// not join through it), the markers are listed too ([`CommitLog::check_generation`]).
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
        let dir = self.objects.keys().generations_dir(run);
        let metas = self.objects.list_all(&dir).await?;
        Ok(metas
            .iter()
            .filter_map(|m| self.objects.keys().parse_generation_marker(&m.location))
            .max())
    }

    /// When `generation` of `run` started: the `t_ms` its marker records (the store's clock of
    /// whoever created it), or `None` when it has no marker (or an old one without a time).
    pub async fn generation_started_ms(&self, run: &str, generation: u64) -> Result<Option<i64>> {
        validate_run(run)?;
        let path = self.objects.keys().generation_marker(run, generation);
        match self.objects.get_json::<serde_json::Value>(&path).await {
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
        let path = self.objects.keys().generation_interval(run, generation);
        match self
            .objects
            .put_json(&path, proposal, PutMode::Create)
            .await
        {
            Ok(_) => return Ok((proposal.clone(), true)),
            Err(e) if e.kind() == ErrorKind::Conflict => {}
            Err(e) => return Err(e),
        }
        let (agreed, _, _) = self.objects.get_json::<T>(&path).await?;
        if let Err(why) = agreed.check(run, generation) {
            return Err(Error::corrupt(format!("{path}: {why}")));
        }
        Ok((agreed, false))
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
