//! `ckpt inspect RUN@STEP [--tensor NAME]`: layout, tensors (dtype, shape, shards, chunks,
//! codecs), blobs; with `--tensor`, statistics read from the data.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

use ckpt_store::placement::{Placement, flat_range_boxes};
use ckpt_store::{ChunkId, ChunkRef, Layout, NdBox, RankManifest, StepReader, Store, WriteStats};
use futures::{StreamExt, stream};
use serde::Serialize;

use super::shared::all_manifests;
use super::shared::fmt::{self, Align, Table};
use super::shared::parse::{CkptRef, ckpt_ref};
use super::shared::values::{Summary, decode};
use super::{CliError, Report, Result, Ui};

/// Arguments of `ckpt inspect`.
#[derive(Debug, Clone, clap::Args)]
pub struct InspectArgs {
    /// The checkpoint: RUN@STEP, RUN@latest or RUN.
    #[arg(value_parser = ckpt_ref)]
    pub ckpt: CkptRef,
    /// Show one tensor's shards and statistics of its values (reads the tensor).
    #[arg(long, value_name = "NAME", conflicts_with = "raw")]
    pub tensor: Option<String>,
    /// Print the commit record as stored (JSON), or with --rank that rank's manifest.
    #[arg(long)]
    pub raw: bool,
    /// With --raw: the manifest of this rank.
    #[arg(long, value_name = "R", requires = "raw")]
    pub rank: Option<u32>,
}

impl InspectArgs {
    /// Inspect `ckpt`.
    pub fn new(ckpt: CkptRef) -> Self {
        InspectArgs {
            ckpt,
            tensor: None,
            raw: false,
            rank: None,
        }
    }
}

/// A stored document (commit record or rank manifest), printed as JSON whatever `--json` says.
#[derive(Debug, Clone, Serialize)]
#[serde(transparent)]
pub struct RawDocument(pub serde_json::Value);

impl Report for RawDocument {
    fn print(&self, w: &mut dyn Write) -> std::io::Result<()> {
        serde_json::to_writer_pretty(&mut *w, &self.0).map_err(std::io::Error::other)?;
        writeln!(w)
    }
}

/// The commit record of a step, or one rank's manifest, as stored.
pub async fn raw(store: &Store, args: &InspectArgs) -> Result<RawDocument> {
    let step = super::shared::resolve(store, &args.ckpt).await?;
    let v = match args.rank {
        None => serde_json::to_value(store.log().read_commit(&args.ckpt.run, step).await?.0),
        Some(r) => {
            let reader = StepReader::open(store, &args.ckpt.run, step).await?;
            serde_json::to_value(&*reader.manifest(r).await?)
        }
    }
    .map_err(|e| CliError::error(format!("serializing: {e}")))?;
    Ok(RawDocument(v))
}

/// What `ckpt inspect` shows.
#[derive(Debug, Clone, Serialize)]
pub struct InspectReport {
    /// Run.
    pub run: String,
    /// Step.
    pub step: u64,
    /// Step id: blake3 of the commit record.
    pub id: String,
    /// The layout at save time (`dp=2,tp=2,pp=1`).
    pub layout: String,
    /// The same, as numbers.
    pub mesh: Layout,
    /// World size.
    pub world: u32,
    /// Job generation that committed.
    pub generation: u64,
    /// Commit time, RFC 3339.
    pub time: String,
    /// Format version of the commit record.
    pub format: u32,
    /// Bytes of tensors and blobs.
    pub logical_bytes: u64,
    /// Stored bytes of the distinct chunks referenced.
    pub stored_bytes: u64,
    /// Distinct chunks referenced.
    pub chunks: u64,
    /// What the save cost, summed over ranks.
    pub write_stats: WriteStats,
    /// Per rank.
    pub ranks: Vec<RankRow>,
    /// Per tensor, by name.
    pub tensors: Vec<TensorRow>,
    /// Per blob.
    pub blobs: Vec<BlobRow>,
    /// With `--tensor`: its shards and value statistics.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tensor: Option<TensorDetail>,
    /// The sentinel's comparison of the data-parallel replicas at the commit (the commit
    /// record's, with every mismatch listed there), when any replica was hashed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replicas: Option<ckpt_store::ReplicaReport>,
}

/// One rank's manifest.
#[derive(Debug, Clone, Serialize)]
pub struct RankRow {
    /// Rank.
    pub rank: u32,
    /// Size of its manifest object.
    pub manifest_bytes: u64,
    /// Shards it wrote.
    pub shards: usize,
    /// Shards it holds as a replica of another rank's.
    pub replicas: usize,
    /// Blobs.
    pub blobs: usize,
    /// Bytes it was responsible for.
    pub logical_bytes: u64,
    /// Bytes it wrote.
    pub written_bytes: u64,
}

/// One tensor.
#[derive(Debug, Clone, Serialize)]
pub struct TensorRow {
    /// Name.
    pub name: String,
    /// dtype.
    pub dtype: String,
    /// Global shape.
    pub shape: Vec<u64>,
    /// Bytes.
    pub bytes: u64,
    /// Written shards.
    pub shards: usize,
    /// Replica references (data-parallel copies not written again).
    pub replicas: usize,
    /// Chunks.
    pub chunks: usize,
    /// Stored bytes of its distinct chunks.
    pub stored_bytes: u64,
    /// Chunks per codec.
    pub codecs: BTreeMap<String, u64>,
    /// How the writer placed it, if recorded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub placement: Option<Placement>,
}

/// One blob.
#[derive(Debug, Clone, Serialize)]
pub struct BlobRow {
    /// The rank that saved it.
    pub rank: u32,
    /// Name.
    pub name: String,
    /// Bytes.
    pub len: u64,
    /// Chunks.
    pub chunks: usize,
}

/// One tensor in detail.
#[derive(Debug, Clone, Serialize)]
pub struct TensorDetail {
    /// The summary row.
    #[serde(flatten)]
    pub row: TensorRow,
    /// Its shards.
    pub shard_list: Vec<ShardRow>,
    /// Statistics of the values.
    pub stats: Summary,
    /// Seconds spent reading.
    pub read_seconds: f64,
}

/// One shard of a tensor.
#[derive(Debug, Clone, Serialize)]
pub struct ShardRow {
    /// The rank whose manifest lists its chunks.
    pub rank: u32,
    /// The box.
    #[serde(rename = "box")]
    pub bbox: NdBox,
    /// Bytes.
    pub bytes: u64,
    /// Chunks.
    pub chunks: usize,
    /// Stored bytes.
    pub stored_bytes: u64,
    /// Chunks per codec.
    pub codecs: BTreeMap<String, u64>,
    /// Ranks holding the same box as a replica.
    pub replicas: Vec<u32>,
}

fn codec_counts<'a>(chunks: impl Iterator<Item = &'a ChunkRef>) -> BTreeMap<String, u64> {
    let mut m = BTreeMap::new();
    for c in chunks {
        *m.entry(c.codec.name().to_string()).or_default() += 1;
    }
    m
}

fn distinct_stored<'a>(chunks: impl Iterator<Item = &'a ChunkRef>) -> (usize, u64) {
    let mut seen: HashMap<ChunkId, u64> = HashMap::new();
    for c in chunks {
        seen.insert(c.id, c.stored as u64);
    }
    (seen.len(), seen.values().sum())
}

/// Inspect a committed step.
pub async fn inspect(store: &Store, args: &InspectArgs, ui: &Ui) -> Result<InspectReport> {
    let step = super::shared::resolve(store, &args.ckpt).await?;
    let reader = StepReader::open(store, &args.ckpt.run, step).await?;
    let manifests = all_manifests(&reader).await?;
    let c = reader.commit();

    // Chunks and replicas of every tensor, from the manifests.
    let mut chunks_of: HashMap<&str, Vec<&ChunkRef>> = HashMap::new();
    let mut replicas_of: HashMap<&str, usize> = HashMap::new();
    for m in &manifests {
        for t in &m.tensors {
            if t.replica_of.is_some() {
                *replicas_of.entry(t.name.as_str()).or_default() += 1;
            } else {
                chunks_of
                    .entry(t.name.as_str())
                    .or_default()
                    .extend(&t.chunks);
            }
        }
    }
    let tensors: Vec<TensorRow> = c
        .tensors
        .iter()
        .map(|t| {
            let ch = chunks_of.get(t.name.as_str()).cloned().unwrap_or_default();
            let (_, stored) = distinct_stored(ch.iter().copied());
            TensorRow {
                name: t.name.clone(),
                dtype: t.dtype.to_string(),
                shape: t.shape.clone(),
                bytes: t.byte_len(),
                shards: t.shards.len(),
                replicas: replicas_of.get(t.name.as_str()).copied().unwrap_or(0),
                chunks: ch.len(),
                stored_bytes: stored,
                codecs: codec_counts(ch.iter().copied()),
                placement: t.placement.clone(),
            }
        })
        .collect();
    let (n_chunks, stored) = distinct_stored(manifests.iter().flat_map(|m| m.chunk_refs()));
    let ranks = manifests
        .iter()
        .map(|m| {
            let entry = c.ranks.iter().find(|e| e.rank == m.rank);
            RankRow {
                rank: m.rank,
                manifest_bytes: entry.map_or(0, |e| e.size),
                shards: m.tensors.iter().filter(|t| t.replica_of.is_none()).count(),
                replicas: m.tensors.iter().filter(|t| t.replica_of.is_some()).count(),
                blobs: m.blobs.len(),
                logical_bytes: m.stats.logical_bytes,
                written_bytes: m.stats.bytes_written,
            }
        })
        .collect();
    let blobs = manifests
        .iter()
        .flat_map(|m| {
            m.blobs.iter().map(|b| BlobRow {
                rank: m.rank,
                name: b.name.clone(),
                len: b.len,
                chunks: b.chunks.len(),
            })
        })
        .collect();

    let tensor = match &args.tensor {
        None => None,
        Some(name) => Some(tensor_detail(&reader, &manifests, &tensors, name, ui).await?),
    };
    Ok(InspectReport {
        run: c.run.clone(),
        step: c.step,
        id: reader.id().0.to_hex(),
        layout: c.layout.to_string(),
        mesh: c.layout,
        world: c.layout.world(),
        generation: c.generation,
        time: fmt::time_ms(c.committed_ms),
        format: c.format,
        logical_bytes: c.logical_bytes(),
        stored_bytes: stored,
        chunks: n_chunks as u64,
        write_stats: c.stats.clone(),
        ranks,
        tensors,
        blobs,
        tensor,
        replicas: c.replicas.clone(),
    })
}

async fn tensor_detail(
    reader: &StepReader,
    manifests: &[Arc<RankManifest>],
    rows: &[TensorRow],
    name: &str,
    ui: &Ui,
) -> Result<TensorDetail> {
    let c = reader.commit();
    let Some(t) = c.tensor(name) else {
        let close: Vec<&str> = c
            .tensors
            .iter()
            .map(|t| t.name.as_str())
            .filter(|n| n.contains(name) || name.contains(*n))
            .take(5)
            .collect();
        let hint = if close.is_empty() {
            format!(
                "`ckpt inspect {}@{}` lists its {} tensors",
                c.run,
                c.step,
                c.tensors.len()
            )
        } else {
            format!(
                "similar names: {}",
                close
                    .iter()
                    .map(|n| fmt::name(n))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        };
        return Err(CliError::error(format!(
            "step {} of run {} has no tensor named \"{}\"",
            c.step,
            c.run,
            fmt::name(name)
        ))
        .hint(hint));
    };
    let row = rows
        .iter()
        .find(|r| r.name == t.name)
        .cloned()
        .expect("a row per tensor");
    let mut shard_list = Vec::new();
    for s in &t.shards {
        let m = manifests.iter().find(|m| m.rank == s.rank);
        let shard = m.and_then(|m| m.written_shard(&t.name, &s.bbox));
        let replicas: Vec<u32> = manifests
            .iter()
            .filter(|m| {
                m.tensors
                    .iter()
                    .any(|x| x.name == t.name && x.bbox == s.bbox && x.replica_of == Some(s.rank))
            })
            .map(|m| m.rank)
            .collect();
        let (_, stored) = distinct_stored(shard.iter().flat_map(|x| &x.chunks));
        shard_list.push(ShardRow {
            rank: s.rank,
            bbox: s.bbox.clone(),
            bytes: s.bbox.numel() * t.dtype.size() as u64,
            chunks: shard.map_or(0, |x| x.chunks.len()),
            stored_bytes: stored,
            codecs: codec_counts(shard.iter().flat_map(|x| &x.chunks)),
            replicas,
        });
    }

    let t0 = Instant::now();
    let stats = value_stats(reader, t, ui).await?;
    Ok(TensorDetail {
        row,
        shard_list,
        stats,
        read_seconds: t0.elapsed().as_secs_f64(),
    })
}

/// Statistics of tensor `t`'s values: read in slabs of whole elements, two slabs in flight.
async fn value_stats(reader: &StepReader, t: &ckpt_store::TensorEntry, ui: &Ui) -> Result<Summary> {
    const SLAB: u64 = 16 << 20;
    let elem = t.dtype.size() as u64;
    let n = NdBox::full(&t.shape).numel();
    let per = (SLAB / elem).max(1);
    let pb = ui.bytes(n * elem, format!("reading {}", fmt::name(&t.name)));
    let dtype = t.dtype;
    let ranges: Vec<(u64, u64)> = (0..n.div_ceil(per))
        .map(|i| (i * per, ((i + 1) * per).min(n)))
        .collect();
    let mut slabs = stream::iter(ranges)
        .map(|(lo, hi)| {
            let name = t.name.clone();
            let shape = t.shape.clone();
            async move {
                let mut buf = vec![0u8; ((hi - lo) * elem) as usize];
                let mut at = 0usize;
                for bx in flat_range_boxes(&shape, lo, hi) {
                    let len = (bx.numel() * elem) as usize;
                    reader.read_into(&name, &bx, &mut buf[at..at + len]).await?;
                    at += len;
                }
                Ok::<_, CliError>(buf)
            }
        })
        .buffered(2);
    let mut stats = Summary::default();
    let mut vals = Vec::new();
    while let Some(buf) = slabs.next().await {
        let buf = buf?;
        vals.clear();
        decode(dtype, &buf, &mut vals);
        stats.add(&vals);
        pb.inc(buf.len() as u64);
    }
    pb.finish_and_clear();
    Ok(stats)
}

fn codecs_text(m: &BTreeMap<String, u64>) -> String {
    if m.is_empty() {
        return "-".into();
    }
    m.iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn num(v: Option<f64>) -> String {
    match v {
        None => "-".into(),
        Some(x) if x != 0.0 && (x.abs() >= 1e6 || x.abs() < 1e-3) => format!("{x:.6e}"),
        Some(x) => format!("{x:.6}"),
    }
}

impl Report for InspectReport {
    fn print(&self, w: &mut dyn Write) -> std::io::Result<()> {
        writeln!(
            w,
            "{}@{}  (step id {})",
            self.run,
            self.step,
            &self.id[..12]
        )?;
        writeln!(
            w,
            "  layout      {} ({} ranks), generation {}",
            self.layout, self.world, self.generation
        )?;
        writeln!(w, "  committed   {}", self.time)?;
        writeln!(
            w,
            "  size        {} logical, {} stored in {} distinct chunks",
            fmt::bytes(self.logical_bytes),
            fmt::bytes(self.stored_bytes),
            self.chunks
        )?;
        let ws = &self.write_stats;
        writeln!(
            w,
            "  save        wrote {} in {} objects; {} of {} chunks already stored ({} skipped)",
            fmt::bytes(ws.bytes_written),
            ws.objects_written,
            ws.chunks_skipped,
            ws.chunks,
            fmt::bytes(ws.bytes_skipped)
        )?;
        if let Some(r) = &self.replicas {
            if r.mismatched() {
                writeln!(
                    w,
                    "  replicas    MISMATCH: {} of {} replica chunks compared differ (silent data corruption on one side)",
                    r.mismatched_chunks, r.chunks_compared
                )?;
                for m in &r.mismatches {
                    writeln!(w, "    {}", m.describe())?;
                }
                if r.mismatched_chunks > r.mismatches.len() as u64 {
                    writeln!(
                        w,
                        "    ... and {} more",
                        r.mismatched_chunks - r.mismatches.len() as u64
                    )?;
                }
            } else {
                writeln!(
                    w,
                    "  replicas    agree: {} replica chunks ({}) compared with the stored bytes",
                    r.chunks_compared,
                    fmt::bytes(r.bytes_compared)
                )?;
            }
        }
        match &self.tensor {
            Some(d) => print_tensor(d, w),
            None => self.print_tables(w),
        }
    }
}

impl InspectReport {
    /// The tables of ranks, tensors and blobs.
    fn print_tables(&self, w: &mut dyn Write) -> std::io::Result<()> {
        writeln!(w)?;
        let mut t = Table::new(&[
            ("RANK", Align::Right),
            ("SHARDS", Align::Right),
            ("REPLICAS", Align::Right),
            ("BLOBS", Align::Right),
            ("LOGICAL", Align::Right),
            ("WRITTEN", Align::Right),
            ("MANIFEST", Align::Right),
        ]);
        for r in &self.ranks {
            t.row(vec![
                r.rank.to_string(),
                r.shards.to_string(),
                r.replicas.to_string(),
                r.blobs.to_string(),
                fmt::bytes(r.logical_bytes),
                fmt::bytes(r.written_bytes),
                fmt::bytes(r.manifest_bytes),
            ]);
        }
        write!(w, "{}", t.render())?;
        writeln!(w)?;
        let mut t = Table::new(&[
            ("TENSOR", Align::Left),
            ("DTYPE", Align::Left),
            ("SHAPE", Align::Left),
            ("SIZE", Align::Right),
            ("SHARDS", Align::Right),
            ("CHUNKS", Align::Right),
            ("STORED", Align::Right),
            ("CODECS", Align::Left),
        ]);
        for r in &self.tensors {
            t.row(vec![
                fmt::name(&r.name),
                r.dtype.clone(),
                fmt::shape(&r.shape),
                fmt::bytes(r.bytes),
                if r.replicas > 0 {
                    format!("{}+{}r", r.shards, r.replicas)
                } else {
                    r.shards.to_string()
                },
                r.chunks.to_string(),
                fmt::bytes(r.stored_bytes),
                codecs_text(&r.codecs),
            ]);
        }
        write!(w, "{}", t.render())?;
        if !self.blobs.is_empty() {
            writeln!(w)?;
            let mut t = Table::new(&[
                ("BLOB", Align::Left),
                ("RANK", Align::Right),
                ("SIZE", Align::Right),
            ]);
            for b in &self.blobs {
                t.row(vec![
                    fmt::name(&b.name),
                    b.rank.to_string(),
                    fmt::bytes(b.len),
                ]);
            }
            write!(w, "{}", t.render())?;
        }
        Ok(())
    }
}

/// One tensor: its row, shards and value statistics (`--tensor`).
fn print_tensor(d: &TensorDetail, w: &mut dyn Write) -> std::io::Result<()> {
    let r = &d.row;
    writeln!(w)?;
    writeln!(w, "tensor \"{}\"", fmt::name(&r.name))?;
    writeln!(
        w,
        "  {} {}  {}  {} shards, {} replicas, {} chunks ({}), {} stored",
        r.dtype,
        fmt::shape(&r.shape),
        fmt::bytes(r.bytes),
        r.shards,
        r.replicas,
        r.chunks,
        codecs_text(&r.codecs),
        fmt::bytes(r.stored_bytes)
    )?;
    if let Some(p) = &r.placement {
        writeln!(
            w,
            "  placement: order {}, tp_dim {}, stage {:?}{}",
            p.order,
            p.tp_dim
                .map_or("none (replicated)".into(), |d| d.to_string()),
            p.stage,
            p.zero.as_ref().map_or(String::new(), |z| format!(
                ", ZeRO group {} from stage {}",
                z.group, z.from_stage
            ))
        )?;
    }
    let mut t = Table::new(&[
        ("RANK", Align::Right),
        ("BOX", Align::Left),
        ("BYTES", Align::Right),
        ("CHUNKS", Align::Right),
        ("STORED", Align::Right),
        ("CODECS", Align::Left),
        ("REPLICAS", Align::Left),
    ]);
    for s in &d.shard_list {
        t.row(vec![
            s.rank.to_string(),
            s.bbox.to_string(),
            fmt::bytes(s.bytes),
            s.chunks.to_string(),
            fmt::bytes(s.stored_bytes),
            codecs_text(&s.codecs),
            if s.replicas.is_empty() {
                "-".into()
            } else {
                s.replicas
                    .iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            },
        ]);
    }
    write!(w, "{}", t.render())?;
    let s = &d.stats;
    writeln!(
        w,
        "values ({} read in {}):",
        fmt::bytes(r.bytes),
        fmt::duration(d.read_seconds)
    )?;
    writeln!(w, "  count  {}", s.count)?;
    writeln!(w, "  min    {}", num(s.min))?;
    writeln!(w, "  max    {}", num(s.max))?;
    writeln!(w, "  mean   {}", num(s.mean))?;
    writeln!(w, "  std    {}", num(s.std))?;
    writeln!(w, "  zeros  {}", s.zeros)?;
    writeln!(w, "  nan    {}", s.nan)?;
    writeln!(w, "  inf    {}", s.inf)?;
    Ok(())
}

/// Names of the tensors of a step as a set (diff, export).
pub fn names(c: &ckpt_store::CommitRecord) -> HashSet<&str> {
    c.tensors.iter().map(|t| t.name.as_str()).collect()
}
