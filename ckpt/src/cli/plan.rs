//! `ckpt plan RUN@STEP --layout dp=3,tp=2,pp=1 [--zero N]`: what each rank of another layout
//! would read to restore the step, from which objects, and how many bytes, without reading
//! any data (only manifests).
//!
//! Each new rank's boxes come from [`ckpt_store::placement::restore_boxes`] (the placement
//! rules applied to the placements the writer recorded in the commit record; the recovery
//! driver plans with the same function); every box is planned with [`StepReader::plan`]. A tensor saved without
//! placement (imported, or saved by a writer that did not record it) is treated as
//! replicated: every new rank reads it whole.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::io::Write;

use ckpt_store::placement::{Wanted, restore_boxes};
use ckpt_store::{ChunkId, Layout, NdBox, StepReader, Store};
use serde::Serialize;

use super::shared::fmt::{self, Align, Table};
use super::shared::parse::{CkptRef, ckpt_ref};
use super::{CliError, Report, Result, Ui};

/// Arguments of `ckpt plan`.
#[derive(Debug, Clone, clap::Args)]
pub struct PlanArgs {
    /// The checkpoint: RUN@STEP, RUN@latest or RUN.
    #[arg(value_parser = ckpt_ref)]
    pub ckpt: CkptRef,
    /// The new layout: dp=N,tp=N,pp=N[,zero=N] (missing degrees are 1).
    #[arg(long, value_name = "LAYOUT")]
    pub layout: String,
    /// ZeRO stage of the new layout (overrides zero= in --layout).
    #[arg(long, value_name = "N")]
    pub zero: Option<u8>,
    /// List this rank's reads: tensors, boxes, chunks and the objects holding them.
    #[arg(long, value_name = "R")]
    pub rank: Option<u32>,
}

/// One chunk a read fetches.
#[derive(Debug, Clone, Serialize)]
pub struct ChunkRead {
    /// Chunk id (blake3 hex).
    pub chunk: String,
    /// The object that holds it (a chunk object, or a pack).
    pub object: String,
    /// The saving rank whose manifest lists it.
    pub from_rank: u32,
    /// Raw bytes.
    pub raw_bytes: u64,
    /// Stored bytes (what crosses the wire).
    pub stored_bytes: u64,
    /// Bytes of it the read uses.
    pub used_bytes: u64,
}

/// One box of one tensor a rank needs.
#[derive(Debug, Clone, Serialize)]
pub struct TensorRead {
    /// Tensor.
    pub tensor: String,
    /// The box.
    #[serde(rename = "box")]
    pub bbox: NdBox,
    /// Bytes of the box.
    pub bytes: u64,
    /// Whether the tensor has no recorded placement (read whole, as if replicated).
    pub unplaced: bool,
    /// Chunks fetched.
    pub chunks: Vec<ChunkRead>,
}

/// What one new rank reads.
#[derive(Debug, Clone, Serialize)]
pub struct RankPlan {
    /// New rank.
    pub rank: u32,
    /// Data-parallel index.
    pub dp: u32,
    /// Tensor-parallel index.
    pub tp: u32,
    /// Pipeline stage.
    pub pp: u32,
    /// Boxes it needs.
    pub boxes: usize,
    /// Bytes of those boxes.
    pub bytes_needed: u64,
    /// Distinct chunks fetched.
    pub chunks: usize,
    /// Raw bytes of those chunks.
    pub raw_bytes: u64,
    /// Stored bytes of those chunks.
    pub stored_bytes: u64,
    /// Distinct objects touched.
    pub objects: usize,
    /// The reads, box by box.
    pub reads: Vec<TensorRead>,
}

/// Totals over all new ranks.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PlanTotals {
    /// Bytes every rank needs, summed.
    pub bytes_needed: u64,
    /// Raw bytes fetched, summed over ranks.
    pub raw_bytes: u64,
    /// Stored bytes fetched, summed over ranks.
    pub stored_bytes: u64,
    /// Chunks fetched by at least one rank.
    pub distinct_chunks: usize,
    /// Stored bytes of those chunks (each once).
    pub distinct_stored_bytes: u64,
    /// Objects touched by at least one rank.
    pub distinct_objects: usize,
    /// `raw_bytes / bytes_needed`: 1.0 means nothing is fetched that is not used.
    pub read_amplification: f64,
}

/// What `ckpt plan` computes.
#[derive(Debug, Clone, Serialize)]
pub struct PlanReport {
    /// Run.
    pub run: String,
    /// Step.
    pub step: u64,
    /// The layout saved under.
    pub from_layout: String,
    /// The new layout.
    pub to_layout: String,
    /// Ranks of the new layout.
    pub world: u32,
    /// Tensors without recorded placement (read whole by every rank).
    pub unplaced: Vec<String>,
    /// Per new rank.
    pub ranks: Vec<RankPlan>,
    /// Totals.
    pub totals: PlanTotals,
    /// The rank `--rank` asked to show in detail.
    #[serde(skip)]
    pub detail: Option<u32>,
}

/// Plan restoring a step onto another layout.
pub async fn plan(store: &Store, args: &PlanArgs, ui: &Ui) -> Result<PlanReport> {
    let layout = target_layout(args)?;
    let step = super::shared::resolve(store, &args.ckpt).await?;
    let reader = StepReader::open(store, &args.ckpt.run, step).await?;
    let commit = reader.commit().clone();
    let unplaced: Vec<String> = commit
        .tensors
        .iter()
        .filter(|t| t.placement.is_none())
        .map(|t| t.name.clone())
        .collect();

    let pb = ui.items(layout.world() as u64, "planning");
    let mut ranks = Vec::with_capacity(layout.world() as usize);
    let mut all = Distinct::default();
    let mut totals = PlanTotals::default();
    for r in 0..layout.world() {
        let rank = plan_rank(store, &reader, &layout, r, &mut all).await?;
        totals.bytes_needed += rank.bytes_needed;
        totals.raw_bytes += rank.raw_bytes;
        totals.stored_bytes += rank.stored_bytes;
        ranks.push(rank);
        pb.inc(1);
    }
    pb.finish_and_clear();
    totals.distinct_chunks = all.chunks.len();
    totals.distinct_stored_bytes = all.chunks.values().sum();
    totals.distinct_objects = all.objects.len();
    totals.read_amplification = if totals.bytes_needed == 0 {
        1.0
    } else {
        totals.raw_bytes as f64 / totals.bytes_needed as f64
    };
    Ok(PlanReport {
        run: commit.run.clone(),
        step: commit.step,
        from_layout: commit.layout.to_string(),
        to_layout: layout.to_string(),
        world: layout.world(),
        unplaced,
        ranks,
        totals,
        detail: args.rank,
    })
}

/// The layout planned for (`--layout`, `--zero`), checked against `--rank`.
fn target_layout(args: &PlanArgs) -> Result<Layout> {
    let mut layout: Layout = args
        .layout
        .parse()
        .map_err(|e: ckpt_store::Error| CliError::usage(format!("--layout: {}", e.message())))?;
    if let Some(z) = args.zero {
        layout.zero = z;
        layout
            .validate()
            .map_err(|e| CliError::usage(format!("--zero: {}", e.message())))?;
    }
    if let Some(r) = args.rank
        && r >= layout.world()
    {
        return Err(CliError::usage(format!(
            "--rank {r} is outside the layout {layout} ({} ranks)",
            layout.world()
        )));
    }
    Ok(layout)
}

/// The distinct chunks (stored bytes) and objects every rank of the plan reads.
#[derive(Default)]
struct Distinct {
    chunks: HashMap<ChunkId, u64>,
    objects: HashSet<String>,
}

/// What rank `r` of `layout` reads of the reader's step; its chunks and objects also go into
/// `all`.
async fn plan_rank(
    store: &Store,
    reader: &StepReader,
    layout: &Layout,
    r: u32,
    all: &mut Distinct,
) -> Result<RankPlan> {
    let commit = reader.commit();
    let wanted = restore_boxes(&commit.tensors, layout, r).map_err(|e| {
        CliError::usage(format!(
            "{}@{} cannot be placed on {layout}: {}",
            commit.run,
            commit.step,
            e.message()
        ))
    })?;
    let mut reads = Vec::with_capacity(wanted.len());
    let mut chunks: HashMap<ChunkId, (u64, u64)> = HashMap::new();
    let mut objects: BTreeSet<String> = BTreeSet::new();
    let mut needed = 0u64;
    for Wanted {
        name,
        bbox,
        unplaced,
    } in wanted
    {
        let plan = reader.plan(&name, &bbox).await?;
        needed += plan.bytes_needed();
        let mut cr = Vec::with_capacity(plan.chunks.len());
        for pc in &plan.chunks {
            let object = store.keys().object_of(&pc.chunk).to_string();
            chunks.insert(pc.chunk.id, (pc.chunk.len as u64, pc.chunk.stored as u64));
            all.chunks.insert(pc.chunk.id, pc.chunk.stored as u64);
            objects.insert(object.clone());
            all.objects.insert(object.clone());
            cr.push(ChunkRead {
                chunk: pc.chunk.id.to_hex(),
                object,
                from_rank: pc.rank,
                raw_bytes: pc.chunk.len as u64,
                stored_bytes: pc.chunk.stored as u64,
                used_bytes: pc.copies.iter().map(|c| c.len).sum(),
            });
        }
        reads.push(TensorRead {
            bytes: plan.bytes_needed(),
            tensor: name,
            bbox,
            unplaced,
            chunks: cr,
        });
    }
    let c = layout.coords(r);
    Ok(RankPlan {
        rank: r,
        dp: c.dp,
        tp: c.tp,
        pp: c.pp,
        boxes: reads.len(),
        bytes_needed: needed,
        chunks: chunks.len(),
        raw_bytes: chunks.values().map(|c| c.0).sum(),
        stored_bytes: chunks.values().map(|c| c.1).sum(),
        objects: objects.len(),
        reads,
    })
}

impl Report for PlanReport {
    fn print(&self, w: &mut dyn Write) -> std::io::Result<()> {
        writeln!(
            w,
            "{}@{}: saved as {}, planned onto {} ({} ranks); nothing was read but manifests",
            self.run, self.step, self.from_layout, self.to_layout, self.world
        )?;
        if !self.unplaced.is_empty() {
            let shown: Vec<String> = self.unplaced.iter().take(5).map(|n| fmt::name(n)).collect();
            writeln!(
                w,
                "note: {} tensor(s) have no recorded placement ({}{}): they were imported or \
                 saved without placement specs, so every rank is planned to read them whole, \
                 as if replicated",
                self.unplaced.len(),
                shown.join(", "),
                if self.unplaced.len() > 5 { ", ..." } else { "" }
            )?;
        }
        let mut t = Table::new(&[
            ("RANK", Align::Right),
            ("DP", Align::Right),
            ("TP", Align::Right),
            ("PP", Align::Right),
            ("BOXES", Align::Right),
            ("NEEDS", Align::Right),
            ("CHUNKS", Align::Right),
            ("FETCHES", Align::Right),
            ("STORED", Align::Right),
            ("OBJECTS", Align::Right),
        ]);
        for r in &self.ranks {
            t.row(vec![
                r.rank.to_string(),
                r.dp.to_string(),
                r.tp.to_string(),
                r.pp.to_string(),
                r.boxes.to_string(),
                fmt::bytes(r.bytes_needed),
                r.chunks.to_string(),
                fmt::bytes(r.raw_bytes),
                fmt::bytes(r.stored_bytes),
                r.objects.to_string(),
            ]);
        }
        write!(w, "{}", t.render())?;
        let tt = &self.totals;
        writeln!(
            w,
            "total: ranks need {}, fetch {} raw ({} stored; read amplification {:.2}x); \
             {} distinct chunks ({} stored) in {} objects",
            fmt::bytes(tt.bytes_needed),
            fmt::bytes(tt.raw_bytes),
            fmt::bytes(tt.stored_bytes),
            tt.read_amplification,
            tt.distinct_chunks,
            fmt::bytes(tt.distinct_stored_bytes),
            tt.distinct_objects
        )?;
        if let Some(r) = self.detail.and_then(|d| self.ranks.get(d as usize)) {
            writeln!(w)?;
            writeln!(w, "rank {} reads:", r.rank)?;
            for rd in &r.reads {
                writeln!(
                    w,
                    "  \"{}\" {}  {}{}",
                    fmt::name(&rd.tensor),
                    rd.bbox,
                    fmt::bytes(rd.bytes),
                    if rd.unplaced {
                        " (no placement: whole)"
                    } else {
                        ""
                    }
                )?;
                for c in &rd.chunks {
                    writeln!(
                        w,
                        "    chunk {} of saved rank {}: uses {} of {} ({} stored) from {}",
                        &c.chunk[..12],
                        c.from_rank,
                        fmt::bytes(c.used_bytes),
                        fmt::bytes(c.raw_bytes),
                        fmt::bytes(c.stored_bytes),
                        c.object
                    )?;
                }
            }
        }
        Ok(())
    }
}
