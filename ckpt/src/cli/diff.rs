//! `ckpt diff A B`: tensors added, removed and changed between two checkpoints, with the bytes
//! that differ and the chunks the two share.
//!
//! Tensors saved with the same shard boxes are compared chunk by chunk: a chunk id both sides
//! hold is equal without reading it (content addressing), so only differing chunks are
//! fetched. Tensors saved under different layouts are read whole from both sides and compared.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Write;
use std::sync::Arc;

use ckpt_store::placement::flat_range_boxes;
use ckpt_store::{ChunkId, ChunkRef, DType, NdBox, RankManifest, StepReader, Store, TensorEntry};
use futures::{StreamExt, TryStreamExt, stream};
use indicatif::ProgressBar;
use serde::Serialize;

use super::shared::all_manifests;
use super::shared::fmt::{self, Align, Table};
use super::shared::parse::{CkptRef, ckpt_ref};
use super::shared::values::decode;
use super::{Report, Result, Ui};

/// Arguments of `ckpt diff`.
#[derive(Debug, Clone, clap::Args)]
pub struct DiffArgs {
    /// The older checkpoint: RUN@STEP, RUN@latest or RUN.
    #[arg(value_parser = ckpt_ref)]
    pub a: CkptRef,
    /// The newer checkpoint.
    #[arg(value_parser = ckpt_ref)]
    pub b: CkptRef,
    /// Compare chunk ids only; read no data (bytes that differ are then unknown).
    #[arg(long)]
    pub quick: bool,
}

/// One side of a diff.
#[derive(Debug, Clone, Serialize)]
pub struct Side {
    /// Run.
    pub run: String,
    /// Step.
    pub step: u64,
    /// Layout.
    pub layout: String,
}

/// A tensor only one side has.
#[derive(Debug, Clone, Serialize)]
pub struct TensorBrief {
    /// Name.
    pub name: String,
    /// dtype.
    pub dtype: String,
    /// Shape.
    pub shape: Vec<u64>,
    /// Bytes.
    pub bytes: u64,
}

/// A tensor both sides have, with different contents.
#[derive(Debug, Clone, Serialize)]
pub struct TensorChange {
    /// Name.
    pub name: String,
    /// `values`, `dtype`, `shape`, `dtype and shape`, or `unknown` (`--quick` on tensors saved
    /// under different layouts: their chunks cannot be compared without reading).
    pub what: String,
    /// dtype in A.
    pub dtype_a: String,
    /// dtype in B.
    pub dtype_b: String,
    /// Shape in A.
    pub shape_a: Vec<u64>,
    /// Shape in B.
    pub shape_b: Vec<u64>,
    /// Bytes in B.
    pub bytes: u64,
    /// Bytes that differ (unknown with `--quick` when the layouts differ).
    pub bytes_differ: Option<u64>,
    /// Elements with at least one differing byte.
    pub elements_differ: Option<u64>,
    /// Largest absolute difference of a differing element (floating point and integers).
    pub max_abs_diff: Option<f64>,
    /// Distinct chunks of B's tensor that A's tensor also has.
    pub chunks_shared: u64,
    /// Distinct chunks of B's tensor.
    pub chunks_total: u64,
}

/// Blobs added, removed and changed, as `NAME of rank R`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct BlobDiff {
    /// Only in B.
    pub added: Vec<String>,
    /// Only in A.
    pub removed: Vec<String>,
    /// Different bytes.
    pub changed: Vec<String>,
    /// Same bytes.
    pub unchanged: usize,
}

/// Totals of a diff.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DiffTotals {
    /// Tensors in both.
    pub tensors_compared: usize,
    /// Bytes of the tensors in both (B's size).
    pub bytes_compared: u64,
    /// Bytes read from the store to compare (both sides).
    pub bytes_read: u64,
    /// Bytes that differ.
    pub bytes_differ: u64,
    /// Distinct chunks of B that A also references.
    pub chunks_shared: u64,
    /// Distinct chunks of B.
    pub chunks_total: u64,
    /// Stored bytes of the shared chunks (what B costs nothing for).
    pub stored_bytes_shared: u64,
}

/// What `ckpt diff` found.
#[derive(Debug, Clone, Serialize)]
pub struct DiffReport {
    /// The older checkpoint.
    pub a: Side,
    /// The newer checkpoint.
    pub b: Side,
    /// Tensors only B has.
    pub added: Vec<TensorBrief>,
    /// Tensors only A has.
    pub removed: Vec<TensorBrief>,
    /// Tensors whose contents differ.
    pub changed: Vec<TensorChange>,
    /// Tensors with equal contents.
    pub unchanged: usize,
    /// Their bytes.
    pub unchanged_bytes: u64,
    /// Blobs.
    pub blobs: BlobDiff,
    /// Totals.
    pub totals: DiffTotals,
    /// Whether only chunk ids were compared.
    pub quick: bool,
}

struct Sided {
    reader: StepReader,
    manifests: Vec<Arc<RankManifest>>,
}

impl Sided {
    /// The chunks of each written shard of `t`, by box.
    fn shards(&self, t: &TensorEntry) -> BTreeMap<Vec<(u64, u64)>, Vec<ChunkRef>> {
        let mut out = BTreeMap::new();
        for s in &t.shards {
            if let Some(m) = self.manifests.iter().find(|m| m.rank == s.rank)
                && let Some(sh) = m.written_shard(&t.name, &s.bbox)
            {
                let key = s
                    .bbox
                    .offsets
                    .iter()
                    .copied()
                    .zip(s.bbox.lengths.iter().copied())
                    .collect();
                out.insert(key, sh.chunks.clone());
            }
        }
        out
    }
}

/// Differences found in one comparison of byte ranges.
#[derive(Debug, Default, Clone, Copy)]
struct Delta {
    bytes: u64,
    elements: u64,
    max_abs: Option<f64>,
}

impl Delta {
    fn add(&mut self, o: Delta) {
        self.bytes += o.bytes;
        self.elements += o.elements;
        self.max_abs = match (self.max_abs, o.max_abs) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
    }
}

/// Compare `a` and `b`, which start at byte `base` of a row-major buffer of `dtype` elements.
fn compare(dtype: DType, base: u64, a: &[u8], b: &[u8]) -> Delta {
    let elem = dtype.size() as u64;
    let mut d = Delta::default();
    let mut last_elem = None;
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        if x != y {
            d.bytes += 1;
            let e = (base + i as u64) / elem;
            if last_elem != Some(e) {
                d.elements += 1;
                last_elem = Some(e);
            }
        }
    }
    if d.bytes > 0 && base.is_multiple_of(elem) && (a.len() as u64).is_multiple_of(elem) {
        let (mut va, mut vb) = (Vec::new(), Vec::new());
        decode(dtype, a, &mut va);
        decode(dtype, b, &mut vb);
        let mut m: Option<f64> = None;
        for (x, y) in va.iter().zip(&vb) {
            let diff = (x - y).abs();
            if x.to_bits() != y.to_bits() && diff.is_finite() {
                m = Some(m.map_or(diff, |v| v.max(diff)));
            }
        }
        d.max_abs = m;
    }
    // A trailing length difference (never for equal shapes) counts as different bytes.
    d.bytes += a.len().abs_diff(b.len()) as u64;
    d
}

/// Compare two checkpoints.
pub async fn diff(store: &Store, args: &DiffArgs, ui: &Ui) -> Result<DiffReport> {
    let sa = super::shared::resolve(store, &args.a).await?;
    let sb = super::shared::resolve(store, &args.b).await?;
    let ra = StepReader::open(store, &args.a.run, sa).await?;
    let rb = StepReader::open(store, &args.b.run, sb).await?;
    let a = Sided {
        manifests: all_manifests(&ra).await?,
        reader: ra,
    };
    let b = Sided {
        manifests: all_manifests(&rb).await?,
        reader: rb,
    };
    let ca = a.reader.commit();
    let cb = b.reader.commit();
    let in_a: HashMap<&str, &TensorEntry> =
        ca.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    let in_b: HashMap<&str, &TensorEntry> =
        cb.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    let brief = |t: &TensorEntry| TensorBrief {
        name: t.name.clone(),
        dtype: t.dtype.to_string(),
        shape: t.shape.clone(),
        bytes: t.byte_len(),
    };
    let added: Vec<TensorBrief> = cb
        .tensors
        .iter()
        .filter(|t| !in_a.contains_key(t.name.as_str()))
        .map(brief)
        .collect();
    let removed: Vec<TensorBrief> = ca
        .tensors
        .iter()
        .filter(|t| !in_b.contains_key(t.name.as_str()))
        .map(brief)
        .collect();

    let (work, to_read) = plan_work(&a, &b, &in_a, args.quick);
    let pb = ui.bytes(to_read, "comparing");
    let mut changed = Vec::new();
    let mut totals = DiffTotals::default();
    let (mut unchanged, mut unchanged_bytes) = (0usize, 0u64);
    for w in &work {
        match compare_tensor(store, &a, &b, w, args.quick, &pb, &mut totals).await? {
            Some(c) => changed.push(c),
            None => {
                unchanged += 1;
                unchanged_bytes += w.tb.byte_len();
            }
        }
    }
    pb.finish_and_clear();

    Ok(DiffReport {
        a: Side {
            run: ca.run.clone(),
            step: ca.step,
            layout: ca.layout.to_string(),
        },
        b: Side {
            run: cb.run.clone(),
            step: cb.step,
            layout: cb.layout.to_string(),
        },
        added,
        removed,
        changed,
        unchanged,
        unchanged_bytes,
        blobs: diff_blobs(&a.manifests, &b.manifests),
        totals,
        quick: args.quick,
    })
}

/// A tensor of both steps to compare: chunk by chunk where both are stored in the same
/// shards and chunk sizes (`aligned`: the pairs of chunks that differ, with their offsets), by
/// reading them otherwise.
struct Work<'a> {
    ta: &'a TensorEntry,
    tb: &'a TensorEntry,
    aligned: Option<Vec<(u64, ChunkRef, ChunkRef)>>,
    shared: u64,
    total: u64,
    stored_shared: u64,
}

/// Which tensors of `b` (also in `a`) compare chunk by chunk, which need full reads; and the
/// bytes the comparison reads (none with `quick`).
fn plan_work<'a>(
    a: &'a Sided,
    b: &'a Sided,
    in_a: &HashMap<&str, &'a TensorEntry>,
    quick: bool,
) -> (Vec<Work<'a>>, u64) {
    let mut work = Vec::new();
    let mut to_read = 0u64;
    for tb in &b.reader.commit().tensors {
        let Some(&ta) = in_a.get(tb.name.as_str()) else {
            continue;
        };
        let sh_a = a.shards(ta);
        let sh_b = b.shards(tb);
        let ids_a: HashSet<ChunkId> = sh_a.values().flatten().map(|c| c.id).collect();
        let mut ids_b: HashMap<ChunkId, u64> = HashMap::new();
        for c in sh_b.values().flatten() {
            ids_b.insert(c.id, c.stored as u64);
        }
        let shared = ids_b.keys().filter(|id| ids_a.contains(id)).count() as u64;
        let stored_shared = ids_b
            .iter()
            .filter(|(id, _)| ids_a.contains(id))
            .map(|(_, s)| s)
            .sum();
        let same_kind = ta.dtype == tb.dtype && ta.shape == tb.shape;
        let aligned = (same_kind
            && sh_a.len() == sh_b.len()
            && sh_a.iter().zip(&sh_b).all(|((ka, ca), (kb, cb))| {
                ka == kb && ca.len() == cb.len() && ca.iter().zip(cb).all(|(x, y)| x.len == y.len)
            }))
        .then(|| {
            let mut pairs = Vec::new();
            for (ca, cb) in sh_a.values().zip(sh_b.values()) {
                let mut off = 0u64;
                for (x, y) in ca.iter().zip(cb) {
                    if x.id != y.id {
                        pairs.push((off, x.clone(), y.clone()));
                    }
                    off += x.len as u64;
                }
            }
            pairs
        });
        if !quick && same_kind {
            to_read += match &aligned {
                Some(p) => p.iter().map(|(_, x, y)| (x.len + y.len) as u64).sum(),
                None => 2 * tb.byte_len(),
            };
        }
        work.push(Work {
            ta,
            tb,
            aligned,
            shared,
            total: ids_b.len() as u64,
            stored_shared,
        });
    }
    (work, to_read)
}

/// Compare one tensor, counting into `totals`; `None` when it is unchanged (same kind and
/// either no differing chunk or no differing byte).
async fn compare_tensor(
    store: &Store,
    a: &Sided,
    b: &Sided,
    w: &Work<'_>,
    quick: bool,
    pb: &ProgressBar,
    totals: &mut DiffTotals,
) -> Result<Option<TensorChange>> {
    let (ta, tb) = (w.ta, w.tb);
    totals.tensors_compared += 1;
    totals.bytes_compared += tb.byte_len();
    totals.chunks_shared += w.shared;
    totals.chunks_total += w.total;
    totals.stored_bytes_shared += w.stored_shared;
    let what = match (ta.dtype == tb.dtype, ta.shape == tb.shape) {
        (true, true) => "values",
        (false, true) => "dtype",
        (true, false) => "shape",
        (false, false) => "dtype and shape",
    };
    let delta: Option<Delta> = if what != "values" {
        None
    } else {
        match (&w.aligned, quick) {
            (Some(pairs), true) => pairs.is_empty().then(Delta::default),
            (None, true) => None,
            (Some(pairs), false) => {
                let d = compare_pairs(store, tb.dtype, pairs, pb).await?;
                totals.bytes_read += pairs
                    .iter()
                    .map(|(_, x, y)| (x.len + y.len) as u64)
                    .sum::<u64>();
                Some(d)
            }
            (None, false) => {
                let d = compare_read(&a.reader, &b.reader, tb, pb).await?;
                totals.bytes_read += 2 * tb.byte_len();
                Some(d)
            }
        }
    };
    let same = what == "values"
        && match (&w.aligned, &delta) {
            (Some(p), _) if p.is_empty() => true,
            (_, Some(d)) => d.bytes == 0,
            _ => false,
        };
    if same {
        return Ok(None);
    }
    if let Some(d) = &delta {
        totals.bytes_differ += d.bytes;
    }
    Ok(Some(TensorChange {
        name: tb.name.clone(),
        what: if what == "values" && delta.is_none() {
            "unknown".into()
        } else {
            what.into()
        },
        dtype_a: ta.dtype.to_string(),
        dtype_b: tb.dtype.to_string(),
        shape_a: ta.shape.clone(),
        shape_b: tb.shape.clone(),
        bytes: tb.byte_len(),
        bytes_differ: delta.map(|d| d.bytes),
        elements_differ: delta.map(|d| d.elements),
        max_abs_diff: delta.and_then(|d| d.max_abs),
        chunks_shared: w.shared,
        chunks_total: w.total,
    }))
}

async fn compare_pairs(
    store: &Store,
    dtype: DType,
    pairs: &[(u64, ChunkRef, ChunkRef)],
    pb: &ProgressBar,
) -> Result<Delta> {
    let deltas: Vec<Delta> = stream::iter(pairs)
        .map(|(off, x, y)| async move {
            let (bx, by) =
                futures::try_join!(store.chunks().get_chunk(x), store.chunks().get_chunk(y))?;
            pb.inc((x.len + y.len) as u64);
            let off = *off;
            Ok::<_, super::CliError>(
                tokio::task::spawn_blocking(move || compare(dtype, off, &bx, &by))
                    .await
                    .map_err(ckpt_store::Error::from)?,
            )
        })
        .buffer_unordered(store.config().read_concurrency.max(2) / 2)
        .try_collect()
        .await?;
    let mut d = Delta::default();
    for x in deltas {
        d.add(x);
    }
    Ok(d)
}

async fn compare_read(
    a: &StepReader,
    b: &StepReader,
    t: &TensorEntry,
    pb: &ProgressBar,
) -> Result<Delta> {
    const SLAB: u64 = 16 << 20;
    let elem = t.dtype.size() as u64;
    let n = NdBox::full(&t.shape).numel();
    let per = (SLAB / elem).max(1);
    let mut d = Delta::default();
    for i in 0..n.div_ceil(per) {
        let (lo, hi) = (i * per, ((i + 1) * per).min(n));
        let mut ba = vec![0u8; ((hi - lo) * elem) as usize];
        let mut bb = vec![0u8; ba.len()];
        let mut at = 0usize;
        for bx in flat_range_boxes(&t.shape, lo, hi) {
            let len = (bx.numel() * elem) as usize;
            futures::try_join!(
                a.read_into(&t.name, &bx, &mut ba[at..at + len]),
                b.read_into(&t.name, &bx, &mut bb[at..at + len])
            )?;
            at += len;
        }
        pb.inc(2 * ba.len() as u64);
        let dtype = t.dtype;
        let part = tokio::task::spawn_blocking(move || compare(dtype, lo * elem, &ba, &bb))
            .await
            .map_err(ckpt_store::Error::from)?;
        d.add(part);
    }
    Ok(d)
}

fn diff_blobs(a: &[Arc<RankManifest>], b: &[Arc<RankManifest>]) -> BlobDiff {
    let key = |ms: &[Arc<RankManifest>]| -> BTreeMap<(String, u32), Vec<ChunkId>> {
        ms.iter()
            .flat_map(|m| {
                m.blobs.iter().map(move |bl| {
                    (
                        (bl.name.clone(), m.rank),
                        bl.chunks.iter().map(|c| c.id).collect(),
                    )
                })
            })
            .collect()
    };
    let (ka, kb) = (key(a), key(b));
    let label = |(n, r): &(String, u32)| format!("{} of rank {r}", fmt::name(n));
    let mut d = BlobDiff::default();
    for (k, ids) in &kb {
        match ka.get(k) {
            None => d.added.push(label(k)),
            Some(x) if x != ids => d.changed.push(label(k)),
            Some(_) => d.unchanged += 1,
        }
    }
    d.removed = ka
        .keys()
        .filter(|k| !kb.contains_key(*k))
        .map(label)
        .collect();
    d
}

impl Report for DiffReport {
    fn print(&self, w: &mut dyn Write) -> std::io::Result<()> {
        writeln!(
            w,
            "{}@{} ({}) -> {}@{} ({})",
            self.a.run, self.a.step, self.a.layout, self.b.run, self.b.step, self.b.layout
        )?;
        writeln!(
            w,
            "  tensors  {} added, {} removed, {} changed, {} unchanged ({})",
            self.added.len(),
            self.removed.len(),
            self.changed.len(),
            self.unchanged,
            fmt::bytes(self.unchanged_bytes)
        )?;
        let t = &self.totals;
        if t.chunks_total > 0 {
            writeln!(
                w,
                "  chunks   {} of {} chunks of {}@{} are shared with {}@{} ({:.0}%, {} stored)",
                t.chunks_shared,
                t.chunks_total,
                self.b.run,
                self.b.step,
                self.a.run,
                self.a.step,
                100.0 * t.chunks_shared as f64 / t.chunks_total as f64,
                fmt::bytes(t.stored_bytes_shared)
            )?;
        }
        if !self.quick {
            writeln!(
                w,
                "  bytes    {} of {} differ ({} read to compare)",
                fmt::bytes(t.bytes_differ),
                fmt::bytes(t.bytes_compared),
                fmt::bytes(t.bytes_read)
            )?;
        }
        let b = &self.blobs;
        if !(b.added.is_empty() && b.removed.is_empty() && b.changed.is_empty()) || b.unchanged > 0
        {
            writeln!(
                w,
                "  blobs    {} added, {} removed, {} changed, {} unchanged",
                b.added.len(),
                b.removed.len(),
                b.changed.len(),
                b.unchanged
            )?;
        }
        print_briefs("added", "+", &self.added, w)?;
        print_briefs("removed", "-", &self.removed, w)?;
        if !self.changed.is_empty() {
            print_changed(&self.changed, w)?;
        }
        for (title, v) in [
            ("blobs added", &b.added),
            ("blobs removed", &b.removed),
            ("blobs changed", &b.changed),
        ] {
            if !v.is_empty() {
                writeln!(w, "{title}: {}", v.join(", "))?;
            }
        }
        Ok(())
    }
}

/// A table of tensors added (`+`) or removed (`-`), under `title`; nothing when there are none.
fn print_briefs(
    title: &str,
    sign: &str,
    v: &[TensorBrief],
    w: &mut dyn Write,
) -> std::io::Result<()> {
    if v.is_empty() {
        return Ok(());
    }
    writeln!(w, "{title}:")?;
    let mut t = Table::new(&[
        ("", Align::Left),
        ("TENSOR", Align::Left),
        ("DTYPE", Align::Left),
        ("SHAPE", Align::Left),
        ("SIZE", Align::Right),
    ]);
    for x in v {
        t.row(vec![
            sign.into(),
            fmt::name(&x.name),
            x.dtype.clone(),
            fmt::shape(&x.shape),
            fmt::bytes(x.bytes),
        ]);
    }
    write!(w, "{}", t.render())
}

/// The table of changed tensors.
fn print_changed(changed: &[TensorChange], w: &mut dyn Write) -> std::io::Result<()> {
    writeln!(w, "changed:")?;
    let mut t = Table::new(&[
        ("", Align::Left),
        ("TENSOR", Align::Left),
        ("CHANGE", Align::Left),
        ("DIFFER", Align::Right),
        ("ELEMENTS", Align::Right),
        ("MAX |A-B|", Align::Right),
        ("CHUNKS SHARED", Align::Right),
    ]);
    for c in changed {
        let change = match c.what.as_str() {
            "values" => format!("{} {}", c.dtype_b, fmt::shape(&c.shape_b)),
            "unknown" => "saved under another layout: compare without --quick".into(),
            _ => format!(
                "{} {} -> {} {}",
                c.dtype_a,
                fmt::shape(&c.shape_a),
                c.dtype_b,
                fmt::shape(&c.shape_b)
            ),
        };
        t.row(vec![
            "~".into(),
            fmt::name(&c.name),
            change,
            match c.bytes_differ {
                Some(n) => format!("{} of {}", fmt::bytes(n), fmt::bytes(c.bytes)),
                None => "?".into(),
            },
            c.elements_differ.map_or("-".into(), |e| e.to_string()),
            c.max_abs_diff.map_or("-".into(), |m| format!("{m:.4e}")),
            format!("{}/{}", c.chunks_shared, c.chunks_total),
        ]);
    }
    write!(w, "{}", t.render())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compare_counts_bytes_elements_and_max() {
        let a: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let b: Vec<u8> = [1.0f32, 2.5, 3.0, -4.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let d = compare(DType::F32, 0, &a, &b);
        assert_eq!(d.elements, 2);
        assert_eq!(d.max_abs, Some(8.0));
        assert!(d.bytes >= 2 && d.bytes <= 8);
        // Unaligned base: bytes still counted, max unknown.
        let d = compare(DType::F32, 2, &a[2..], &b[2..]);
        assert_eq!(d.max_abs, None);
        assert!(d.bytes > 0);
    }
}
