//! `ckpt-bench dcp-model`: what PyTorch Distributed Checkpoint's layout would cost for the same
//! state and world as `ckpt-bench scale` (issue 17), worked out from its format rather than run.
//!
//! DCP (`torch.distributed.checkpoint`, `FileSystemWriter` and the S3/fsspec writers built on
//! it) saves one checkpoint as a directory: every rank writes its items into its own file
//! (`__<rank>_<thread>.distcp`, one thread by default), then the coordinator gathers every
//! rank's write results and writes `.metadata`, a pickled `Metadata` that lists every chunk of
//! every tensor (offsets and sizes) and where each is stored (file, offset, length). Replicated
//! items are written by one rank (`dedup_save_plans`). On load every rank reads `.metadata`
//! whole, plans, then reads each item it needs (a ranged read per item).
//!
//! The model counts, for the layout and tensor list of [`crate::scale`]: items written (the
//! shards no other rank writes), files, the `.metadata` entries and, with `--items FILE`, the
//! items themselves as JSON lines for `scripts/dcp-metadata-size.py`, which builds DCP's own
//! `Metadata` objects from them and pickles them to get the exact size of `.metadata`.

use std::io::Write;

use ckpt_store::Layout;
use ckpt_store::placement::place_rank;
use serde_json::json;

use crate::scale::{default_layout, llama_specs};

/// The model's figures for one world.
#[derive(Debug, Clone, Default)]
pub struct DcpCounts {
    /// World size.
    pub ranks: u32,
    /// Tensors in the state dict.
    pub tensors: usize,
    /// Items written (shards not written by another rank).
    pub items_written: u64,
    /// Ranks that write at least one item: one `.distcp` file each.
    pub files: u64,
    /// The most items one rank writes.
    pub items_per_rank_max: u64,
    /// Items one restoring rank of the same layout reads (the mean over ranks; replicas
    /// included: it reads them from the file of the rank that wrote them).
    pub items_read_per_rank: f64,
    /// Items read by all ranks of a restore of the whole world.
    pub items_read_total: u64,
}

/// Counts DCP's items for `ranks` ranks of `layout` (default: the scale bench's) over a
/// Llama-like state of `layers` layers; writes every item to `items` as a JSON line
/// (`{"fqn","offsets","sizes","rank","dtype"}`) when given.
pub fn count(
    ranks: u32,
    layout: Option<Layout>,
    layers: u32,
    mut items: Option<&mut dyn Write>,
) -> ckpt_store::Result<DcpCounts> {
    let layout = layout.unwrap_or_else(|| default_layout(ranks));
    let specs = llama_specs(layers);
    let mut c = DcpCounts {
        ranks,
        tensors: specs.len(),
        ..Default::default()
    };
    for rank in 0..layout.world() {
        let placed = place_rank(&layout, rank, &specs)?;
        let mut written = 0u64;
        for p in &placed {
            c.items_read_total += 1;
            if p.replica_of.is_some() {
                continue;
            }
            written += 1;
            if let Some(w) = items.as_deref_mut() {
                let s = &specs[p.spec];
                let line = json!({
                    "fqn": s.name, "offsets": p.bbox.offsets, "sizes": p.bbox.lengths,
                    "shape": s.shape, "rank": rank, "dtype": s.dtype.name(),
                });
                writeln!(w, "{line}")
                    .map_err(|e| ckpt_store::Error::io("writing", &"the items file", e))?;
            }
        }
        c.items_written += written;
        c.files += u64::from(written > 0);
        c.items_per_rank_max = c.items_per_rank_max.max(written);
    }
    c.items_read_per_rank = c.items_read_total as f64 / f64::from(layout.world().max(1));
    Ok(c)
}

/// The JSON line of `ckpt-bench dcp-model`: the counts and the requests they imply on S3 in
/// the terms of `ckpt-bench scale` (requests by kind, the hottest prefix, the commit's
/// critical path, metadata a restoring rank reads).
pub fn json(c: &DcpCounts, metadata_bytes: Option<u64>) -> serde_json::Value {
    json!({
        "bench": "dcp-model",
        "ranks": c.ranks,
        "tensors": c.tensors,
        "items_written": c.items_written,
        "files": c.files,
        "items_per_rank_max": c.items_per_rank_max,
        "metadata_entries": c.items_written,
        "metadata_bytes": metadata_bytes,
        // A save: one PUT per file (more for a multipart upload of a large file, as for any
        // object), then `.metadata`; every key under the checkpoint's one prefix.
        "save_puts": c.files + 1,
        "save_hottest_prefix_writes": c.files + 1,
        // The commit: the coordinator gathers every rank's write results (a collective carrying
        // all metadata entries to one rank), builds and writes `.metadata` alone.
        "commit_critical_path": "gather(all entries to rank 0) + 1 PUT of metadata_bytes",
        // A restore of the same layout: every rank GETs `.metadata` whole, then one ranged GET
        // per item it needs, all under the checkpoint's one prefix.
        "restore_gets_per_rank": 1.0 + c.items_read_per_rank,
        "restore_hottest_prefix_reads": u64::from(c.ranks) + c.items_read_total,
        "restore_metadata_bytes_per_rank": metadata_bytes,
        // Finding the newest complete step: list the step directories, HEAD `.metadata`.
        "latest_requests": 2,
        // Deduplication: none (every save writes every byte; no HEADs).
        "incremental_save_puts": c.files + 1,
    })
}

/// `ckpt-bench dcp-model --ranks N [--layers L] [--items FILE] [--metadata-bytes B]`.
pub fn cli(args: &[String]) -> i32 {
    let arg = |k: &str| {
        args.iter()
            .position(|a| a == k)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let ranks: u32 = arg("--ranks").and_then(|v| v.parse().ok()).unwrap_or(4096);
    let layers: u32 = arg("--layers").and_then(|v| v.parse().ok()).unwrap_or(80);
    let metadata_bytes: Option<u64> = arg("--metadata-bytes").and_then(|v| v.parse().ok());
    let mut file = match arg("--items").map(std::fs::File::create).transpose() {
        Ok(f) => f.map(std::io::BufWriter::new),
        Err(e) => {
            eprintln!("dcp-model: the items file: {e}");
            return 2;
        }
    };
    let out = count(
        ranks,
        None,
        layers,
        file.as_mut().map(|f| f as &mut dyn Write),
    );
    if let Some(mut f) = file
        && let Err(e) = f.flush()
    {
        eprintln!("dcp-model: the items file: {e}");
        return 1;
    }
    match out {
        Ok(c) => {
            println!("{}", json(&c, metadata_bytes));
            0
        }
        Err(e) => {
            eprintln!("dcp-model: {e}");
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_shard_is_written_once_and_read_by_each_rank_that_holds_it() {
        let layout = Layout {
            dp: 2,
            tp: 2,
            pp: 2,
            zero: 1,
        };
        let c = count(8, Some(layout), 4, None).expect("count");
        // dp = 2 replicates the bf16 weights: half of their shards are replicas.
        assert!(c.items_written < c.items_read_total, "{c:?}");
        assert_eq!(
            c.files, 8,
            "every rank writes something under ZeRO-1: {c:?}"
        );
        assert_eq!(c.items_read_per_rank * 8.0, c.items_read_total as f64);
        let mut lines = Vec::new();
        count(8, Some(layout), 4, Some(&mut lines)).expect("count");
        assert_eq!(
            String::from_utf8(lines).expect("utf-8").lines().count() as u64,
            c.items_written
        );
    }
}
