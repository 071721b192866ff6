//! Drain markers: the log's record, in a local tier, of the steps that are local-durable and
//! not yet drained to the remote store ([`crate::tier`]).

use object_store::PutMode;
use object_store::path::Path;

use super::CommitLog;
use crate::error::{ErrorKind, Result};
use crate::keys::validate_run;
use crate::tier::DrainMarker;

impl CommitLog {
    /// The key of `step`'s drain marker (see the module docs).
    fn drain_marker_key(&self, run: &str, step: u64) -> Path {
        self.objects.keys().drain_marker(run, step)
    }

    /// Write (or update) a drain marker in this (local) tier.
    pub async fn put_drain_marker(&self, m: &DrainMarker) -> Result<()> {
        validate_run(&m.run)?;
        let path = self.drain_marker_key(&m.run, m.step);
        self.objects
            .put_json(&path, m, PutMode::Overwrite)
            .await
            .map(|_| ())
    }

    /// Delete `step`'s drain marker (the step is remote-durable, or gone).
    pub async fn delete_drain_marker(&self, run: &str, step: u64) -> Result<()> {
        validate_run(run)?;
        self.objects
            .delete_all(vec![self.drain_marker_key(run, step)])
            .await
    }

    /// The drain markers of `run` in this (local) tier: steps local-durable whose drain has
    /// not finished, by step.
    pub async fn pending_drains(&self, run: &str) -> Result<Vec<DrainMarker>> {
        validate_run(run)?;
        let dir = self.objects.keys().drain_dir(run);
        let metas = self.objects.list_all(&dir).await?;
        let mut out = Vec::new();
        for m in metas {
            if self
                .objects
                .keys()
                .parse_drain_marker(&m.location)
                .is_none()
            {
                continue;
            }
            match self.objects.get_json::<DrainMarker>(&m.location).await {
                Ok((d, _, _)) => out.push(d),
                // Deleted since the listing: that drain finished.
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                Err(e) => return Err(e.context("reading a drain marker")),
            }
        }
        out.sort_by_key(|d| d.step);
        Ok(out)
    }
}
