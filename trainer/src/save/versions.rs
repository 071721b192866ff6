//! Which shards a save may take unchanged: the versions and chunks of this checkpointer's
//! last saves ([`VersionBook`]). A shard whose source reports the version it had at the last
//! *committed* save references that save's chunks, without a copy into staging or a hash.
//!
//! Safety (FORMAT.md, "What GC may delete, and when"): a save reuses only the chunks of a step
//! it found committed when `save` was called, and the persist checks them again under its
//! writer lease (they must be in the dedup base's chunks, or that step's commit must still
//! exist) before its manifest references them; a step whose commit failed or is not seen yet
//! is never a source of reuse.

use std::collections::HashMap;
use std::sync::Arc;

use ckpt_store::{ChunkRef, DType, NdBox};

use crate::memory::SourceVersion;

/// A shard's identity across saves: a shard under another name, type, shape or box is another
/// shard (a reshard never reuses).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct ShardKey {
    name: String,
    dtype: DType,
    shape: Vec<u64>,
    bbox: NdBox,
}

impl ShardKey {
    pub fn new(name: &str, dtype: DType, shape: &[u64], bbox: &NdBox) -> Self {
        ShardKey {
            name: name.to_string(),
            dtype,
            shape: shape.to_vec(),
            bbox: bbox.clone(),
        }
    }
}

/// The version each shard of one saved step had, and the chunks its manifest references.
#[derive(Debug, Default)]
pub(super) struct StepVersions {
    pub step: u64,
    pub shards: HashMap<ShardKey, (SourceVersion, Vec<ChunkRef>)>,
}

impl StepVersions {
    /// The chunks of `key` if its version then was `now`.
    pub fn unchanged(&self, key: &ShardKey, now: SourceVersion) -> Option<&[ChunkRef]> {
        match self.shards.get(key) {
            Some((v, refs)) if *v == now => Some(refs),
            _ => None,
        }
    }
}

/// The newest committed step's versions, and the last persisted step's until its commit is
/// seen (as [`ckpt_store::DedupBase`] does for chunks).
#[derive(Debug, Default)]
pub(super) struct VersionBook {
    committed: Option<Arc<StepVersions>>,
    pending: Option<Arc<StepVersions>>,
}

impl VersionBook {
    /// This rank's manifest of `v.step` is written; whether it commits is not known yet.
    pub fn persisted(&mut self, v: StepVersions) {
        self.pending = Some(Arc::new(v));
    }

    /// The step persisted last, whose commit is not seen yet.
    pub fn pending_step(&self) -> Option<u64> {
        self.pending.as_ref().map(|p| p.step)
    }

    /// The committed step reuse would come from.
    pub fn committed_step(&self) -> Option<u64> {
        self.committed.as_ref().map(|p| p.step)
    }

    /// The pending step's commit is seen: it becomes the source of reuse.
    pub fn commit_seen(&mut self) {
        if let Some(p) = self.pending.take() {
            self.committed = Some(p);
        }
    }

    /// The committed step is gone (retention or GC dropped it): reuse nothing from it.
    pub fn committed_gone(&mut self) {
        self.committed = None;
    }

    /// Forget everything: the next save copies every shard.
    pub fn clear(&mut self) {
        *self = VersionBook::default();
    }

    /// The step a save may reuse from now.
    pub fn base(&self) -> Option<Arc<StepVersions>> {
        self.committed.clone()
    }
}
