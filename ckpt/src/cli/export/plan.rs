//! The plan of `ckpt export`, computed from the step's commit record and the flags alone, so
//! every process of a split export (`--part I/N`, on any machine) computes the same one: which
//! files there are, which tensors each holds (and so its exact header and size), which part
//! writes it, and how a file on disk is checked against it. Also the sizing of the write
//! pipeline under `--memory-budget`.

use std::io::Read;
use std::path::Path;

use ckpt_store::{CommitRecord, SafetensorsView};

use crate::cli::shared::fmt;
use crate::cli::shared::parse::selected;
use crate::cli::shared::values::{FloatDType, converted_dtype};
use crate::cli::{CliError, Result};

/// The file name of a single-file export, and of the shard index.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The index of a sharded export.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// `--part I/N`: this process writes the files of part `index` of `count` (0-based).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartSpec {
    /// Which part, `0..count`.
    pub index: usize,
    /// How many parts the export is split into.
    pub count: usize,
}

impl std::fmt::Display for PartSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

/// Parse `I/N` (clap value parser): `0 <= I < N`.
pub fn part_spec(s: &str) -> Result<PartSpec, String> {
    let bad = || {
        format!(
            "--part {s:?}: expected I/N, this process's part I (counted from 0) of N parts, \
             e.g. 0/4 .. 3/4"
        )
    };
    let (i, n) = s.trim().split_once('/').ok_or_else(bad)?;
    let index: usize = i.trim().parse().map_err(|_| bad())?;
    let count: usize = n.trim().parse().map_err(|_| bad())?;
    if count == 0 {
        return Err(format!(
            "--part {s}: the number of parts must be at least 1"
        ));
    }
    if index >= count {
        return Err(format!(
            "--part {s}: part index {index} is out of range: parts of {count} are numbered 0 to {}",
            count - 1
        ));
    }
    Ok(PartSpec { index, count })
}

/// Split names (in name order) into shards of at most `max` bytes; a tensor larger than `max`
/// gets a shard of its own.
pub fn shard_names(sizes: &[(String, u64)], max: Option<u64>) -> Vec<Vec<String>> {
    let Some(max) = max else {
        return vec![sizes.iter().map(|(n, _)| n.clone()).collect()];
    };
    let mut out: Vec<Vec<String>> = Vec::new();
    let mut cur: Vec<String> = Vec::new();
    let mut cur_len = 0u64;
    for (n, len) in sizes {
        if !cur.is_empty() && cur_len + len > max {
            out.push(std::mem::take(&mut cur));
            cur_len = 0;
        }
        cur.push(n.clone());
        cur_len += len;
    }
    if !cur.is_empty() || out.is_empty() {
        out.push(cur);
    }
    out
}

/// Which part writes each file: the largest files first, each to the part with the fewest
/// bytes so far (ties: the lower file index, the lower part), so parts get about equal bytes
/// and the answer depends on the sizes and `parts` only.
pub fn assign_parts(sizes: &[u64], parts: usize) -> Vec<usize> {
    let parts = parts.max(1);
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    order.sort_by(|&a, &b| sizes[b].cmp(&sizes[a]).then(a.cmp(&b)));
    let mut load = vec![0u64; parts];
    let mut out = vec![0usize; sizes.len()];
    for f in order {
        let p = (0..parts)
            .min_by_key(|&p| (load[p], p))
            .expect("at least one part");
        load[p] += sizes[f];
        out[f] = p;
    }
    out
}

/// One file of the plan.
#[derive(Debug, Clone)]
pub struct PlannedFile {
    /// Its name inside `--out`.
    pub name: String,
    /// Its bytes: header and tensors.
    pub view: SafetensorsView,
    /// The part that writes it.
    pub part: usize,
}

/// Every file of an export and who writes it.
#[derive(Debug, Clone)]
pub struct ExportPlan {
    /// The files, in name order.
    pub files: Vec<PlannedFile>,
    /// The number of parts the files are divided among.
    pub parts: usize,
    /// Bytes of tensor data (the index's `total_size`).
    pub tensor_bytes: u64,
    /// Tensors exported.
    pub tensors: usize,
}

/// What the plan depends on, besides the commit record.
#[derive(Debug, Clone, Default)]
pub struct PlanFlags<'a> {
    /// `--max-shard-size`.
    pub max_shard_size: Option<u64>,
    /// `--dtype`.
    pub dtype: Option<FloatDType>,
    /// `--include`.
    pub include: &'a [String],
    /// `--exclude`.
    pub exclude: &'a [String],
}

impl ExportPlan {
    /// The plan for `commit` under `flags`, divided among `parts`.
    pub fn new(commit: &CommitRecord, flags: &PlanFlags<'_>, parts: usize) -> Result<Self> {
        if flags.max_shard_size == Some(0) {
            return Err(CliError::usage("--max-shard-size must be larger than 0"));
        }
        // The record the views are built from: converted dtypes where --dtype asks.
        let mut target = commit.clone();
        for t in &mut target.tensors {
            t.dtype = converted_dtype(t.dtype, flags.dtype);
        }
        let sizes: Vec<(String, u64)> = target
            .tensors
            .iter()
            .filter(|t| selected(&t.name, flags.include, flags.exclude))
            .map(|t| (t.name.clone(), t.byte_len()))
            .collect();
        if sizes.is_empty() {
            return Err(CliError::usage(format!(
                "no tensor of {}@{} matches --include/--exclude ({} tensors in the step)",
                commit.run,
                commit.step,
                commit.tensors.len()
            )));
        }
        let groups = shard_names(&sizes, flags.max_shard_size);
        let n = groups.len();
        let views: Vec<SafetensorsView> = groups
            .iter()
            .map(|names| {
                SafetensorsView::new(&target, Some(names)).map_err(|e| {
                    CliError::error(format!(
                        "cannot export {}@{}: {}",
                        commit.run,
                        commit.step,
                        e.message()
                    ))
                    .hint("leave the tensor out with --exclude NAME")
                })
            })
            .collect::<Result<_>>()?;
        let lens: Vec<u64> = views.iter().map(SafetensorsView::len).collect();
        let owners = assign_parts(&lens, parts);
        let files = views
            .into_iter()
            .zip(owners)
            .enumerate()
            .map(|(i, (view, part))| PlannedFile {
                name: if n == 1 {
                    SINGLE_FILE.to_string()
                } else {
                    format!("model-{:05}-of-{n:05}.safetensors", i + 1)
                },
                view,
                part,
            })
            .collect();
        Ok(ExportPlan {
            files,
            parts: parts.max(1),
            tensor_bytes: sizes.iter().map(|(_, s)| s).sum(),
            tensors: sizes.len(),
        })
    }

    /// Whether the export is sharded (several files and an index).
    pub fn sharded(&self) -> bool {
        self.files.len() > 1
    }

    /// The files `part` writes.
    pub fn files_of(&self, part: usize) -> impl Iterator<Item = &PlannedFile> {
        self.files.iter().filter(move |f| f.part == part)
    }

    /// The index json of a sharded export.
    pub fn index_json(&self, run: &str, step: u64) -> Result<Vec<u8>> {
        let mut weight_map = serde_json::Map::new();
        let mut pairs: Vec<(&str, &str)> = self
            .files
            .iter()
            .flat_map(|f| {
                f.view
                    .entries()
                    .iter()
                    .map(move |e| (e.name.as_str(), f.name.as_str()))
            })
            .collect();
        pairs.sort();
        for (t, f) in pairs {
            weight_map.insert(t.to_string(), serde_json::Value::from(f));
        }
        let doc = serde_json::json!({
            "metadata": {
                "total_size": self.tensor_bytes,
                "format": "pt",
                "ckpt.run": run,
                "ckpt.step": step.to_string(),
            },
            "weight_map": weight_map,
        });
        let mut text = serde_json::to_vec_pretty(&doc)
            .map_err(|e| CliError::error(format!("index json: {e}")))?;
        text.push(b'\n');
        Ok(text)
    }
}

/// What is on disk at a planned file's name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OnDisk {
    /// Nothing.
    Missing,
    /// A regular file with the plan's size and header: a finished file of this export (files
    /// appear under their name only once complete).
    Matches,
    /// Something else: why it is not the planned file.
    Differs(String),
}

/// Compare the file at `path` with `want`: its size and its header bytes (which name every
/// tensor with its dtype, shape and offsets, and the run and step).
pub fn check_file(path: &Path, want: &SafetensorsView) -> OnDisk {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return OnDisk::Missing,
        Err(e) => return OnDisk::Differs(format!("cannot stat it: {e}")),
    };
    if !meta.file_type().is_file() {
        return OnDisk::Differs("it is not a regular file".into());
    }
    let header = want.header();
    let mut got = vec![0u8; header.len()];
    let read = std::fs::File::open(path).and_then(|mut f| f.read_exact(&mut got));
    if let Err(e) = read {
        if e.kind() != std::io::ErrorKind::UnexpectedEof {
            return OnDisk::Differs(format!("cannot read it: {e}"));
        }
        return OnDisk::Differs(format!(
            "it has {} bytes, shorter than the planned header of {} bytes",
            meta.len(),
            header.len()
        ));
    }
    if got != header {
        return OnDisk::Differs(
            "its safetensors header differs from the plan's (other tensors, dtypes, run or step)"
                .into(),
        );
    }
    if meta.len() != want.len() {
        return OnDisk::Differs(format!(
            "it has {} bytes, the plan {}",
            meta.len(),
            want.len()
        ));
    }
    OnDisk::Matches
}

/// Default `--memory-budget`.
pub const DEFAULT_BUDGET: u64 = 256 << 20;
/// The largest block read or written at once.
const MAX_BLOCK: u64 = 16 << 20;
/// The most blocks in flight.
const MAX_DEPTH: usize = 8;
/// `O_DIRECT` alignment.
pub const ALIGN: u64 = 4096;

/// How the write pipeline of one process uses its memory budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Pipeline {
    /// Bytes read per block (a multiple of the chunk size where it holds one).
    pub block: u64,
    /// Blocks in flight (being read, or waiting for the writer).
    pub depth: usize,
    /// Chunk fetches in flight per block.
    pub fetch: usize,
    /// The `O_DIRECT` staging buffer.
    pub stage: u64,
    /// The largest chunk (raw bytes) it was sized for.
    pub chunk: u64,
}

impl Pipeline {
    /// The bytes the pipeline may hold at once: blocks (twice when converting: source and
    /// result), chunks being fetched (stored and decoded) and the staging buffer.
    pub fn bytes(&self, chunk: u64, converting: bool) -> u64 {
        let per_block = self.block * if converting { 2 } else { 1 } + self.fetch as u64 * 2 * chunk;
        self.depth as u64 * per_block + self.stage
    }

    /// The pipeline for `budget` bytes when the chunks read are at most `chunk` bytes and the
    /// store allows `read_concurrency` fetches: as many fetches in flight as the store allows
    /// (then as many blocks) as fit; an error when not even one block and one chunk fit.
    pub fn for_budget(
        budget: u64,
        chunk: u64,
        read_concurrency: usize,
        converting: bool,
    ) -> Result<Self, String> {
        let chunk = chunk.max(1);
        let stage = (budget / 8 / ALIGN * ALIGN).clamp(ALIGN, MAX_BLOCK);
        let avail = budget.saturating_sub(stage);
        // A block holds whole chunks, so a chunk is never split between two blocks (and
        // fetched twice) where the tensor was saved as one shard.
        let mut block = (avail / 6).min(MAX_BLOCK);
        block = if block >= chunk {
            block / chunk * chunk
        } else {
            chunk.min(MAX_BLOCK)
        };
        let rc = read_concurrency.max(1);
        let mut best: Option<Pipeline> = None;
        let score = |p: &Pipeline| ((p.depth * p.fetch).min(rc), p.depth);
        loop {
            for depth in 1..=MAX_DEPTH {
                for fetch in 1..=rc {
                    let p = Pipeline {
                        block,
                        depth,
                        fetch,
                        stage,
                        chunk,
                    };
                    if p.bytes(chunk, converting) <= budget
                        && best.as_ref().is_none_or(|b| score(&p) > score(b))
                    {
                        best = Some(p);
                    }
                }
            }
            if best.is_some() || block <= ALIGN {
                break;
            }
            // Not even one block of whole chunks fits: smaller blocks, each fetch still holds
            // a whole chunk.
            block = (block / 2 / ALIGN * ALIGN).max(ALIGN);
        }
        best.ok_or_else(|| {
            let min = Pipeline {
                block: ALIGN,
                depth: 1,
                fetch: 1,
                stage: ALIGN,
                chunk,
            }
            .bytes(chunk, converting);
            format!(
                "--memory-budget {} is too small for this step's chunks of {}: it must hold a \
                 chunk as stored and decoded and a block being written, at least {}",
                fmt::bytes(budget),
                fmt::bytes(chunk),
                fmt::bytes(min.div_ceil(1 << 20) << 20)
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_fill_greedily_and_big_tensors_stand_alone() {
        let s = |v: &[(&str, u64)]| -> Vec<(String, u64)> {
            v.iter().map(|(n, l)| (n.to_string(), *l)).collect()
        };
        let sizes = s(&[("a", 40), ("b", 40), ("c", 30), ("d", 200), ("e", 10)]);
        assert_eq!(
            shard_names(&sizes, Some(100)),
            vec![vec!["a", "b"], vec!["c"], vec!["d"], vec!["e"]]
        );
        assert_eq!(shard_names(&sizes, None).len(), 1);
        assert_eq!(shard_names(&sizes, Some(1000)).len(), 1);
    }

    #[test]
    fn parts_get_balanced_bytes_and_every_file_once() {
        // Largest first to the lightest part: 200 -> 0, 90 -> 1, 80 -> 2, 70 -> 2 (150),
        // 60 -> 1 (150), 10 -> 1 (ties go to the lower part: 1 and 2 both at 150).
        let sizes = [60, 200, 10, 90, 80, 70];
        assert_eq!(assign_parts(&sizes, 3), vec![1, 0, 1, 1, 2, 2]);
        assert_eq!(assign_parts(&sizes, 1), vec![0; 6]);
        // More parts than files: one file each, the rest idle.
        assert_eq!(assign_parts(&[5, 5], 4), vec![0, 1]);
        // Deterministic: the same answer every time, whatever the part.
        assert_eq!(assign_parts(&sizes, 3), assign_parts(&sizes, 3));
    }

    #[test]
    fn part_specs_parse_and_bad_ones_say_why() {
        assert_eq!(part_spec("2/4"), Ok(PartSpec { index: 2, count: 4 }));
        assert_eq!(part_spec(" 0 / 1 "), Ok(PartSpec { index: 0, count: 1 }));
        let e = part_spec("4/4").unwrap_err();
        assert!(e.contains("out of range") && e.contains("0 to 3"), "{e}");
        assert!(part_spec("0/0").unwrap_err().contains("at least 1"));
        for bad in ["1", "a/2", "1/b", "-1/2", ""] {
            assert!(
                part_spec(bad).unwrap_err().contains("expected I/N"),
                "{bad}"
            );
        }
    }

    #[test]
    fn the_pipeline_fits_the_budget_and_blocks_hold_whole_chunks() {
        let mib = 1u64 << 20;
        for budget in [
            12 * mib,
            16 * mib,
            32 * mib,
            64 * mib,
            256 * mib,
            4096 * mib,
        ] {
            for conv in [false, true] {
                for rc in [1, 8, 16] {
                    let p = Pipeline::for_budget(budget, 4 * mib, rc, conv).unwrap();
                    assert!(p.bytes(4 * mib, conv) <= budget, "{budget} {p:?}");
                    assert!(p.block <= MAX_BLOCK && p.depth <= MAX_DEPTH && p.fetch <= rc);
                    if budget >= 32 * mib {
                        assert_eq!(p.block % (4 * mib), 0, "{budget} {p:?}");
                    }
                }
            }
        }
        let p = Pipeline::for_budget(DEFAULT_BUDGET, 4 * mib, 8, false).unwrap();
        assert!(p.depth >= 4 && p.depth * p.fetch >= 8, "{p:?}");
        assert_eq!(p.block, MAX_BLOCK);
        let e = Pipeline::for_budget(4 * mib, 4 * mib, 8, false).unwrap_err();
        assert!(e.contains("too small") && e.contains("at least"), "{e}");
    }
}
