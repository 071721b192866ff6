//! `ckpt stats RUN`: per committed step, how much of the state changed since the step
//! before, per tensor group and per kind of state, so a stuck layer or optimizer shows (the
//! sentinel's `state_unchanged` events say the same as training goes; this reads it back
//! from the store for any run, any time).
//!
//! A chunk counts as changed when no chunk of the same tensor in the step before has its id
//! (its blake3): unchanged bytes keep their ids, so this reads manifests only, never data.
//! A tensor group is the first `--depth` components of a name (`layers.3` of
//! `layers.3.attn.qkv.weight.master` at depth 2; a leading `model.` or `optim.state.` is not
//! counted); a kind is the last component (`weight`, `master`, `exp_avg`, ...).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Write;

use ckpt_store::{ChunkId, RankManifest, Store, validate_run};
use futures::{StreamExt, TryStreamExt, stream};
use serde::Serialize;

use super::shared::fmt::{self, Align, Table};
use super::{CliError, Report, Result, Ui};

/// Arguments of `ckpt stats`.
#[derive(Debug, Clone, clap::Args)]
pub struct StatsArgs {
    /// The run.
    pub run: String,
    /// Name components that make a tensor group (`layers.3` at 2).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    pub depth: u32,
    /// A group whose changed share is at most this (percent) is listed as unchanged.
    #[arg(long, default_value_t = 0.0)]
    pub below: f64,
}

/// Bytes of a group or kind at a step, and how many of them changed since the step before.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Change {
    /// Bytes (raw).
    pub bytes: u64,
    /// Of them, in chunks the step before did not have for the same tensor.
    pub changed_bytes: u64,
}

impl Change {
    fn add(&mut self, o: &Change) {
        self.bytes += o.bytes;
        self.changed_bytes += o.changed_bytes;
    }

    /// Changed share, percent.
    pub fn percent(&self) -> f64 {
        if self.bytes == 0 {
            0.0
        } else {
            100.0 * self.changed_bytes as f64 / self.bytes as f64
        }
    }
}

/// One committed step.
#[derive(Debug, Clone, Serialize)]
pub struct StepStats {
    /// Step.
    pub step: u64,
    /// The step it is compared with (`None`: the first).
    pub since: Option<u64>,
    /// Every tensor.
    pub total: Change,
    /// Per tensor group.
    pub groups: BTreeMap<String, Change>,
    /// Per kind of state.
    pub kinds: BTreeMap<String, Change>,
    /// The layout differs from the step before's (chunks are cut anew: counted changed).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub relaid: bool,
    /// The sentinel's record: chunks whose replicas disagreed at the commit.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replica_mismatches: Option<u64>,
}

/// What `ckpt stats` prints.
#[derive(Debug, Clone, Serialize)]
pub struct StatsReport {
    /// The run.
    pub run: String,
    /// The grouping depth.
    pub depth: u32,
    /// The threshold of an unchanged group, percent.
    pub below: f64,
    /// Committed steps, ascending.
    pub steps: Vec<StepStats>,
}

/// The group of `name` at `depth`.
pub fn group_of(name: &str, depth: u32) -> String {
    let mut parts: Vec<&str> = name.split('.').collect();
    for prefix in [["optim", "state"].as_slice(), ["model"].as_slice()] {
        if parts.len() > prefix.len() && parts.starts_with(prefix) {
            parts.drain(..prefix.len());
        }
    }
    let n = (depth as usize).min(parts.len().saturating_sub(1)).max(1);
    parts[..n.min(parts.len())].join(".")
}

/// The kind of `name`: its last component.
pub fn kind_of(name: &str) -> String {
    name.rsplit('.').next().unwrap_or(name).to_string()
}

type Chunks = HashMap<String, Vec<(ChunkId, u64)>>;

/// Every tensor's chunks (id, raw length) of one step's manifests.
fn chunks_of(manifests: &[RankManifest]) -> Chunks {
    let mut out: Chunks = HashMap::new();
    for m in manifests {
        for t in m.tensors.iter().filter(|t| t.replica_of.is_none()) {
            out.entry(t.name.clone())
                .or_default()
                .extend(t.chunks.iter().map(|c| (c.id, u64::from(c.len))));
        }
    }
    out
}

/// Per-step change figures of `args.run`.
pub async fn stats(store: &Store, args: &StatsArgs, ui: &Ui) -> Result<StatsReport> {
    validate_run(&args.run).map_err(|e| CliError::usage(e.to_string()))?;
    let steps = store.log().committed_steps(&args.run).await?;
    if steps.is_empty() {
        return Err(super::shared::no_such_run(store, &args.run).await);
    }
    let pb = ui.items(steps.len() as u64, format!("reading {}", args.run));
    let run = args.run.as_str();
    let read: Vec<(u64, ckpt_store::CommitRecord, Vec<RankManifest>)> = stream::iter(steps)
        .map(|step| {
            let pb = pb.clone();
            async move {
                let (c, _) = store.log().read_commit(run, step).await?;
                let ms: Vec<RankManifest> = stream::iter(c.ranks.clone())
                    .map(|e| async move {
                        store
                            .log()
                            .read_rank_manifest(run, step, e.rank, Some(&e))
                            .await
                    })
                    .buffer_unordered(16)
                    .try_collect()
                    .await?;
                pb.inc(1);
                Ok::<_, CliError>((step, c, ms))
            }
        })
        .buffered(4)
        .try_collect()
        .await?;
    pb.finish_and_clear();
    let mut out = Vec::with_capacity(read.len());
    let mut prev: Option<(u64, ckpt_store::Layout, HashMap<String, HashSet<ChunkId>>)> = None;
    for (step, c, ms) in read {
        let chunks = chunks_of(&ms);
        let mut s = StepStats {
            step,
            since: prev.as_ref().map(|p| p.0),
            total: Change::default(),
            groups: BTreeMap::new(),
            kinds: BTreeMap::new(),
            relaid: prev.as_ref().is_some_and(|p| p.1 != c.layout),
            replica_mismatches: c.replicas.as_ref().map(|r| r.mismatched_chunks),
        };
        for (name, list) in &chunks {
            let before = prev.as_ref().and_then(|p| p.2.get(name));
            let mut ch = Change::default();
            for (id, len) in list {
                ch.bytes += len;
                if before.is_none_or(|b| !b.contains(id)) {
                    ch.changed_bytes += len;
                }
            }
            s.total.add(&ch);
            s.groups
                .entry(group_of(name, args.depth))
                .or_default()
                .add(&ch);
            s.kinds.entry(kind_of(name)).or_default().add(&ch);
        }
        let ids = chunks
            .into_iter()
            .map(|(n, l)| (n, l.into_iter().map(|(id, _)| id).collect()))
            .collect();
        prev = Some((step, c.layout, ids));
        out.push(s);
    }
    Ok(StatsReport {
        run: args.run.clone(),
        depth: args.depth,
        below: args.below,
        steps: out,
    })
}

impl Report for StatsReport {
    fn print(&self, w: &mut dyn Write) -> std::io::Result<()> {
        let groups: HashSet<&String> = self.steps.iter().flat_map(|s| s.groups.keys()).collect();
        writeln!(
            w,
            "run {}: {} committed steps, {} tensor groups (the first {} name components); a chunk \
             changed when the step before had no chunk of the tensor with its id",
            self.run,
            self.steps.len(),
            groups.len(),
            self.depth
        )?;
        let mut t = Table::new(&[
            ("STEP", Align::Right),
            ("SINCE", Align::Right),
            ("CHANGED", Align::Right),
            ("OF", Align::Right),
            ("UNCHANGED GROUPS", Align::Left),
        ]);
        for s in &self.steps {
            let Some(since) = s.since else {
                t.row(vec![
                    s.step.to_string(),
                    "-".into(),
                    "-".into(),
                    fmt::bytes(s.total.bytes),
                    "(the first step)".into(),
                ]);
                continue;
            };
            let stuck: Vec<String> = s
                .groups
                .iter()
                .filter(|(_, c)| c.bytes > 0 && c.percent() <= self.below)
                .map(|(g, c)| format!("{g} ({:.1}%)", c.percent()))
                .collect();
            let mut note = if stuck.is_empty() {
                "-".to_string()
            } else {
                stuck.join(", ")
            };
            if s.relaid {
                note = format!("{note} [layout changed]");
            }
            if let Some(n) = s.replica_mismatches.filter(|n| *n > 0) {
                note = format!("{note} [replicas disagree: {n} chunk(s)]");
            }
            t.row(vec![
                s.step.to_string(),
                since.to_string(),
                format!("{:.1}%", s.total.percent()),
                fmt::bytes(s.total.bytes),
                note,
            ]);
        }
        write!(w, "{}", t.render())?;
        // The kinds as columns: a stuck optimizer shows as a column of zeros.
        let kinds: Vec<String> = {
            let mut k: Vec<String> = self
                .steps
                .iter()
                .flat_map(|s| s.kinds.keys().cloned())
                .collect::<HashSet<_>>()
                .into_iter()
                .collect();
            k.sort();
            k
        };
        if kinds.is_empty() || self.steps.len() < 2 {
            return Ok(());
        }
        writeln!(w)?;
        writeln!(w, "changed per kind of state (the last name component):")?;
        let mut cols = vec![("STEP".to_string(), Align::Right)];
        cols.extend(kinds.iter().map(|k| (k.to_uppercase(), Align::Right)));
        let cols: Vec<(&str, Align)> = cols.iter().map(|(n, a)| (n.as_str(), *a)).collect();
        let mut t = Table::new(&cols);
        for s in self.steps.iter().filter(|s| s.since.is_some()) {
            let mut row = vec![s.step.to_string()];
            row.extend(kinds.iter().map(|k| {
                s.kinds
                    .get(k)
                    .map_or("-".into(), |c| format!("{:.1}%", c.percent()))
            }));
            t.row(row);
        }
        write!(w, "{}", t.render())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_and_kinds_of_names() {
        assert_eq!(group_of("layers.3.attn.qkv.weight.master", 2), "layers.3");
        assert_eq!(group_of("model.layers.3.mlp.weight", 2), "layers.3");
        assert_eq!(
            group_of("optim.state.model.layers.0.weight.exp_avg", 2),
            "layers.0"
        );
        assert_eq!(group_of("embed.weight", 2), "embed");
        assert_eq!(group_of("bias", 2), "bias");
        assert_eq!(group_of("layers.3.attn.qkv.weight", 1), "layers");
        assert_eq!(kind_of("layers.3.attn.qkv.weight.exp_avg_sq"), "exp_avg_sq");
        assert_eq!(kind_of("w"), "w");
    }
}
