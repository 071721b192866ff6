//! `ckpt import FILE... --run NAME --step N`: safetensors files (or a Hugging Face
//! `model.safetensors.index.json`) into a new single-rank checkpoint, the starting point of a
//! fine-tuning run.
//!
//! Files are streamed, never loaded whole: each tensor is cut into chunks aligned to its start
//! exactly as a save cuts a whole tensor, so chunks the store already holds (from the newest
//! step of any run) cost a hash, not a write.
//!
//! Headers are hostile until checked: the header length is bounded before anything is
//! allocated, every tensor's dtype, shape and offsets are checked against each other and
//! against the file's size, overlapping tensors and duplicate names are refused, and names
//! with control characters are refused. The reference parser (`safetensors`) then checks the
//! header again. Files named by an index must be plain names beside it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt as stdfmt;
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;
use std::time::Instant;

use bytes::Bytes;
use ckpt_store::model::validate_name;
use ckpt_store::{
    ChunkIn, DType, DedupIndex, Layout, NdBox, RankManifest, RankWrite, Store, TensorShard,
    assemble_manifest, validate_run,
};
use futures::{StreamExt, stream};
use serde::de::{Deserializer, MapAccess, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::shared::fmt;
use super::{CliError, Report, Result, Ui};

/// The largest header accepted, as in the reference implementation.
pub const MAX_HEADER: u64 = 100_000_000;

/// Name of the blob that keeps the files' `__metadata__`.
pub const METADATA_BLOB: &str = "safetensors.metadata";

/// Arguments of `ckpt import`.
#[derive(Debug, Clone, clap::Args)]
pub struct ImportArgs {
    /// safetensors files, or one model.safetensors.index.json naming them.
    #[arg(required = true, value_name = "FILE")]
    pub files: Vec<PathBuf>,
    /// The run to create the step in.
    #[arg(long, value_name = "NAME")]
    pub run: String,
    /// The step number (must not exist yet).
    #[arg(long, value_name = "N")]
    pub step: u64,
}

/// One tensor of a safetensors file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StTensor {
    /// Name.
    pub name: String,
    /// dtype.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<u64>,
    /// First byte, relative to the data section.
    pub begin: u64,
    /// One past the last byte.
    pub end: u64,
}

/// A checked safetensors header.
#[derive(Debug, Clone)]
pub struct StFile {
    /// The file.
    pub path: PathBuf,
    /// Where the data section starts (8 + header length).
    pub data_start: u64,
    /// Tensors in file order.
    pub tensors: Vec<StTensor>,
    /// `__metadata__`.
    pub metadata: BTreeMap<String, String>,
}

/// A JSON object's entries in document order, duplicates kept (serde maps keep the last).
struct Entries(Vec<(String, Value)>);

impl<'de> Deserialize<'de> for Entries {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Entries;
            fn expecting(&self, f: &mut stdfmt::Formatter) -> stdfmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut m: A,
            ) -> std::result::Result<Entries, A::Error> {
                let mut v = Vec::new();
                while let Some((k, val)) = m.next_entry::<String, Value>()? {
                    v.push((k, val));
                }
                Ok(Entries(v))
            }
        }
        d.deserialize_map(V)
    }
}

fn bad(path: &Path, msg: impl stdfmt::Display) -> CliError {
    CliError::error(format!("{}: {msg}", path.display()))
        .hint("the file is not a valid safetensors file; nothing was imported")
}

/// Check a header (the JSON after the 8-byte length) against a data section of `data_len`
/// bytes. Returns tensors in file order and the metadata.
pub fn parse_header(
    path: &Path,
    header: &[u8],
    data_len: u64,
) -> Result<(Vec<StTensor>, BTreeMap<String, String>)> {
    let text = std::str::from_utf8(header)
        .map_err(|e| bad(path, format!("the header is not UTF-8 ({e})")))?;
    let Entries(entries) = serde_json::from_str(text)
        .map_err(|e| bad(path, format!("the header is not a JSON object ({e})")))?;
    let mut seen = HashSet::new();
    let mut tensors = Vec::new();
    let mut metadata = BTreeMap::new();
    for (name, v) in entries {
        if !seen.insert(name.clone()) {
            return Err(bad(
                path,
                format!(
                    "tensor \"{}\" appears twice in the header",
                    fmt::name(&name)
                ),
            ));
        }
        if name == "__metadata__" {
            let Value::Object(m) = v else {
                return Err(bad(path, "__metadata__ is not an object"));
            };
            for (k, v) in m {
                let Value::String(s) = v else {
                    return Err(bad(
                        path,
                        format!(
                            "__metadata__ value of \"{}\" is not a string",
                            fmt::name(&k)
                        ),
                    ));
                };
                metadata.insert(k, s);
            }
            continue;
        }
        tensors.push(check_tensor(path, &name, &v, data_len)?);
    }
    tensors.sort_by_key(|t| (t.begin, t.end));
    for w in tensors.windows(2) {
        let (a, b) = (&w[0], &w[1]);
        if b.begin < a.end && a.begin < a.end && b.begin < b.end {
            return Err(bad(
                path,
                format!(
                    "tensors \"{}\" (bytes {}..{}) and \"{}\" (bytes {}..{}) overlap",
                    fmt::name(&a.name),
                    a.begin,
                    a.end,
                    fmt::name(&b.name),
                    b.begin,
                    b.end
                ),
            ));
        }
    }
    // The reference parser's own checks (contiguous offsets, sizes, dtypes it knows).
    let reference: safetensors::tensor::Metadata = serde_json::from_str(text).map_err(|e| {
        bad(
            path,
            format!("rejected by the safetensors reference parser: {e}"),
        )
    })?;
    if reference.data_len() as u64 != data_len {
        return Err(bad(
            path,
            format!(
                "the tensors end at byte {} of the data but the file holds {data_len} bytes of data",
                reference.data_len()
            ),
        ));
    }
    Ok((tensors, metadata))
}

fn check_tensor(path: &Path, name: &str, v: &Value, data_len: u64) -> Result<StTensor> {
    let shown = fmt::name(name);
    validate_name(name).map_err(|e| bad(path, format!("tensor \"{shown}\": {}", e.message())))?;
    if name.chars().any(char::is_control) {
        return Err(bad(
            path,
            format!("tensor name \"{shown}\" contains control characters"),
        ));
    }
    let t = |m: &str| bad(path, format!("tensor \"{shown}\": {m}"));
    let obj = v.as_object().ok_or_else(|| t("entry is not an object"))?;
    let dtype_s = obj
        .get("dtype")
        .and_then(Value::as_str)
        .ok_or_else(|| t("no dtype"))?;
    let dtype = DType::from_safetensors_name(dtype_s).ok_or_else(|| {
        t(&format!(
            "dtype {dtype_s:?} cannot be stored by ckpt (supported: {})",
            DType::ALL.map(|d| d.safetensors_name()).join(", ")
        ))
    })?;
    let shape: Vec<u64> = obj
        .get("shape")
        .and_then(Value::as_array)
        .ok_or_else(|| t("no shape"))?
        .iter()
        .map(|d| {
            d.as_u64()
                .ok_or_else(|| t("shape holds a value that is not a non-negative integer"))
        })
        .collect::<Result<_>>()?;
    let offs = obj
        .get("data_offsets")
        .and_then(Value::as_array)
        .filter(|a| a.len() == 2)
        .ok_or_else(|| t("data_offsets is not a pair of integers"))?;
    let (begin, end) = match (offs[0].as_u64(), offs[1].as_u64()) {
        (Some(b), Some(e)) => (b, e),
        _ => return Err(t("data_offsets is not a pair of non-negative integers")),
    };
    if end < begin {
        return Err(t(&format!(
            "data_offsets [{begin}, {end}] end before they begin"
        )));
    }
    if end > data_len {
        return Err(t(&format!(
            "data_offsets [{begin}, {end}] lie past the end of the data ({data_len} bytes; truncated file or lying header)"
        )));
    }
    let bytes = shape
        .iter()
        .try_fold(1u64, |a, &d| a.checked_mul(d))
        .and_then(|n| n.checked_mul(dtype.size() as u64))
        .ok_or_else(|| t(&format!("shape {shape:?} is too large")))?;
    if bytes != end - begin {
        return Err(t(&format!(
            "shape {shape:?} of {dtype_s} needs {bytes} bytes but data_offsets [{begin}, {end}] hold {}",
            end - begin
        )));
    }
    Ok(StTensor {
        name: name.to_string(),
        dtype,
        shape,
        begin,
        end,
    })
}

/// Read and check the header of a safetensors file.
pub fn read_file_header(path: &Path) -> Result<StFile> {
    let mut f = std::fs::File::open(path)
        .map_err(|e| CliError::error(format!("opening {}: {e}", path.display())))?;
    let len = f
        .metadata()
        .map_err(|e| CliError::error(format!("reading {}: {e}", path.display())))?
        .len();
    if len < 8 {
        return Err(bad(
            path,
            format!("{len} bytes is shorter than the 8-byte header length"),
        ));
    }
    let mut n8 = [0u8; 8];
    f.read_exact(&mut n8)
        .map_err(|e| CliError::error(format!("reading {}: {e}", path.display())))?;
    let n = u64::from_le_bytes(n8);
    if n > MAX_HEADER {
        return Err(bad(
            path,
            format!(
                "the header length {n} is larger than the {MAX_HEADER} bytes safetensors allows (damaged or not safetensors)"
            ),
        ));
    }
    if n > len - 8 {
        return Err(bad(
            path,
            format!(
                "the header length {n} is larger than the {} bytes that follow (truncated)",
                len - 8
            ),
        ));
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header)
        .map_err(|e| CliError::error(format!("reading {}: {e}", path.display())))?;
    let (tensors, metadata) = parse_header(path, &header, len - 8 - n)?;
    Ok(StFile {
        path: path.to_path_buf(),
        data_start: 8 + n,
        tensors,
        metadata,
    })
}

/// Whether `f` is a plain file name (no directories, no `..`, no control characters).
fn plain_file_name(f: &str) -> bool {
    !f.is_empty()
        && f != "."
        && f != ".."
        && !f.contains(['/', '\\', '\0'])
        && !f.chars().any(char::is_control)
}

/// The files an index json names (beside it), each with the tensors it should hold.
pub fn read_index(path: &Path) -> Result<Vec<(PathBuf, Vec<String>)>> {
    let text = std::fs::read(path)
        .map_err(|e| CliError::error(format!("reading {}: {e}", path.display())))?;
    if text.len() as u64 > MAX_HEADER {
        return Err(CliError::error(format!(
            "{}: {} bytes is too large for an index",
            path.display(),
            text.len()
        )));
    }
    let doc: Value = serde_json::from_slice(&text)
        .map_err(|e| CliError::error(format!("{}: not a JSON index ({e})", path.display())))?;
    let map = doc
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| {
            CliError::error(format!(
                "{}: no \"weight_map\" object (is it a model.safetensors.index.json?)",
                path.display()
            ))
        })?;
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut files: Vec<(PathBuf, Vec<String>)> = Vec::new();
    let mut at: HashMap<String, usize> = HashMap::new();
    for (tensor, f) in map {
        let f = f.as_str().ok_or_else(|| {
            CliError::error(format!(
                "{}: weight_map entry of \"{}\" is not a file name",
                path.display(),
                fmt::name(tensor)
            ))
        })?;
        if !plain_file_name(f) {
            return Err(CliError::error(format!(
                "{}: weight_map names file \"{}\" for tensor \"{}\"; only plain file names beside the index are read",
                path.display(),
                fmt::name(f),
                fmt::name(tensor)
            )));
        }
        let i = *at.entry(f.to_string()).or_insert_with(|| {
            files.push((dir.join(f), Vec::new()));
            files.len() - 1
        });
        files[i].1.push(tensor.clone());
    }
    files.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(files)
}

/// One file imported.
#[derive(Debug, Clone, Serialize)]
pub struct ImportedFile {
    /// Path.
    pub path: String,
    /// Tensors.
    pub tensors: usize,
    /// Tensor bytes.
    pub bytes: u64,
}

/// What `ckpt import` did.
#[derive(Debug, Clone, Serialize)]
pub struct ImportReport {
    /// Run.
    pub run: String,
    /// Step.
    pub step: u64,
    /// The files read.
    pub files: Vec<ImportedFile>,
    /// Tensors imported.
    pub tensors: usize,
    /// Bytes of tensor data.
    pub logical_bytes: u64,
    /// Chunks.
    pub chunks: u64,
    /// Chunks the store already held.
    pub chunks_skipped: u64,
    /// Their bytes.
    pub bytes_skipped: u64,
    /// Objects written.
    pub objects_written: u64,
    /// Bytes written, as stored.
    pub bytes_written: u64,
    /// Chunks known before the import (the newest step of every run).
    pub dedup_chunks_known: usize,
    /// Seconds it took.
    pub seconds: f64,
}

/// Chunks of the newest committed step of every run. Call it holding a writer lease (so no GC
/// sweep runs until the new manifest references them; FORMAT.md, "What GC may delete").
async fn seed_index(store: &Store, index: &DedupIndex) -> Result<()> {
    let runs = store.log().list_runs().await?;
    let manifests: Vec<RankManifest> = stream::iter(runs)
        .map(|run| async move {
            let Ok(Some(step)) = store.log().latest_committed(&run).await else {
                return Vec::new();
            };
            super::shared::readable_manifests(store, &run, step).await
        })
        .buffer_unordered(8)
        .flat_map(stream::iter)
        .collect()
        .await;
    for m in &manifests {
        index.extend(m.chunk_refs());
    }
    Ok(())
}

/// Import files into a new step.
pub async fn import(store: &Store, args: &ImportArgs, ui: &Ui) -> Result<ImportReport> {
    let t0 = Instant::now();
    validate_run(&args.run).map_err(|e| CliError::usage(e.to_string()))?;
    let files = read_inputs(&args.files)?;
    check_step_free(store, args).await?;

    let lease = store
        .gc()
        .lease_dedup_base(&args.run, &ckpt_store::writer_id(0, 0), &[])
        .await?;
    let index = DedupIndex::new();
    seed_index(store, &index).await?;
    let known = index.len();

    let meta_blob = metadata_blob(&files)?;

    // Chunk plan: per tensor (file order), then the blob.
    let mut plan: Vec<(usize, usize, usize)> = Vec::new(); // (file, tensor, chunks)
    let mut logical = 0u64;
    for (fi, f) in files.iter().enumerate() {
        for (ti, t) in f.tensors.iter().enumerate() {
            let n = store.chunk_spans(t.end - t.begin).count();
            plan.push((fi, ti, n));
            logical += t.end - t.begin;
        }
    }
    let pb = ui.bytes(
        logical,
        format!("importing into {}@{}", args.run, args.step),
    );

    // A reader thread streams chunks in plan order; the store pulls them as fast as it writes.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<ChunkIn>(8);
    let failure: Arc<Mutex<Option<CliError>>> = Arc::default();
    let reader = spawn_reader(store, &files, meta_blob.clone(), &pb, &failure, tx);
    let chunks = stream::poll_fn(move |cx| rx.poll_recv(cx));
    let put = store.chunks().put_chunks(chunks, &index).await;
    let _ = reader.join();
    pb.finish_and_clear();
    if let Some(e) = failure.lock().take() {
        return Err(e);
    }
    let put = put?;
    let s = &put.stats;
    let head = RankWrite::new(args.run.clone(), args.step, 0, Layout::SINGLE);
    let blob_len = meta_blob.as_ref().map_or(0, |b| b.len() as u64);
    let manifest = manifest_of(store, &head, &files, &plan, blob_len, logical, &put)?;
    store.log().write_rank_manifest(&manifest).await?;
    // The manifest now protects what it references; the lease may go (or lapse, on an error
    // above).
    let _ = store.gc().release_lease(lease).await;
    store.log().commit_step(&args.run, args.step).await?;
    Ok(ImportReport {
        run: args.run.clone(),
        step: args.step,
        files: files
            .iter()
            .map(|f| ImportedFile {
                path: f.path.display().to_string(),
                tensors: f.tensors.len(),
                bytes: f.tensors.iter().map(|t| t.end - t.begin).sum(),
            })
            .collect(),
        tensors: plan.len(),
        logical_bytes: logical,
        chunks: s.chunks,
        chunks_skipped: s.chunks_skipped,
        bytes_skipped: s.bytes_skipped,
        objects_written: s.objects_written,
        bytes_written: s.bytes_written,
        dedup_chunks_known: known,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// The safetensors files to import (those given, or those an index json names), their
/// headers read and checked: each file once, each tensor in one file, as the index maps them;
/// some tensor in all.
fn read_inputs(given: &[PathBuf]) -> Result<Vec<StFile>> {
    // Which files, and which tensors an index expects in each.
    let mut inputs: Vec<(PathBuf, Option<Vec<String>>)> = Vec::new();
    for f in given {
        if f.extension().is_some_and(|e| e == "json") {
            inputs.extend(read_index(f)?.into_iter().map(|(p, t)| (p, Some(t))));
        } else {
            inputs.push((f.clone(), None));
        }
    }
    let mut seen_paths = HashSet::new();
    for (p, _) in &inputs {
        if !seen_paths.insert(p.clone()) {
            return Err(CliError::usage(format!("{} is given twice", p.display())));
        }
    }
    let mut files: Vec<StFile> = Vec::new();
    let mut owner: HashMap<String, PathBuf> = HashMap::new();
    for (p, expect) in &inputs {
        let f = read_file_header(p)?;
        if let Some(expect) = expect {
            let have: HashSet<&str> = f.tensors.iter().map(|t| t.name.as_str()).collect();
            let want: HashSet<&str> = expect.iter().map(String::as_str).collect();
            if let Some(missing) = want.difference(&have).next() {
                return Err(CliError::error(format!(
                    "the index maps tensor \"{}\" to {}, which does not hold it",
                    fmt::name(missing),
                    p.display()
                )));
            }
            if let Some(extra) = have.difference(&want).next() {
                return Err(CliError::error(format!(
                    "{} holds tensor \"{}\", which the index does not map to it",
                    p.display(),
                    fmt::name(extra)
                )));
            }
        }
        for t in &f.tensors {
            if let Some(other) = owner.insert(t.name.clone(), p.clone()) {
                return Err(CliError::error(format!(
                    "tensor \"{}\" is in both {} and {}",
                    fmt::name(&t.name),
                    other.display(),
                    p.display()
                )));
            }
        }
        files.push(f);
    }
    if files.iter().all(|f| f.tensors.is_empty()) {
        return Err(CliError::error(
            "the files hold no tensors; nothing to import",
        ));
    }
    Ok(files)
}

/// An error when `--step` of `--run` exists already (committed or not).
async fn check_step_free(store: &Store, args: &ImportArgs) -> Result<()> {
    let existing = store.log().list_steps(&args.run).await?;
    if let Some(s) = existing.iter().find(|s| s.step == args.step) {
        return Err(CliError::error(format!(
            "step {} of run {} already exists ({})",
            args.step,
            args.run,
            if s.committed {
                "committed"
            } else {
                "incomplete"
            }
        ))
        .hint(format!(
            "choose another --step (`ckpt ls {}` lists the steps)",
            args.run
        )));
    }

    Ok(())
}

/// The metadata blob: every file's `__metadata__`, by file name (none when no file has any).
fn metadata_blob(files: &[StFile]) -> Result<Option<Bytes>> {
    let meta: BTreeMap<String, &BTreeMap<String, String>> = files
        .iter()
        .filter(|f| !f.metadata.is_empty())
        .map(|f| {
            (
                f.path.file_name().map_or_else(
                    || f.path.display().to_string(),
                    |n| n.to_string_lossy().into_owned(),
                ),
                &f.metadata,
            )
        })
        .collect();
    (!meta.is_empty())
        .then(|| serde_json::to_vec(&meta).map(Bytes::from))
        .transpose()
        .map_err(|e| CliError::error(format!("metadata blob: {e}")))
}

/// A thread that reads the chunks of every tensor (file order), then of the metadata blob, into
/// `tx`; a read that fails puts its error in `failure` and ends the stream.
fn spawn_reader(
    store: &Store,
    files: &[StFile],
    meta_blob: Option<Bytes>,
    pb: &indicatif::ProgressBar,
    failure: &Arc<Mutex<Option<CliError>>>,
    tx: tokio::sync::mpsc::Sender<ChunkIn>,
) -> std::thread::JoinHandle<()> {
    let files = files.to_vec();
    let spans: Vec<Vec<std::ops::Range<u64>>> = files
        .iter()
        .flat_map(|f| {
            f.tensors
                .iter()
                .map(|t| store.chunk_spans(t.end - t.begin).collect())
        })
        .collect();
    let failure = failure.clone();
    let chunk_blob = store
        .chunk_spans(meta_blob.as_ref().map_or(0, |b| b.len() as u64))
        .collect::<Vec<_>>();
    let pb = pb.clone();
    std::thread::spawn(move || {
        let mut k = 0usize;
        for f in &files {
            let file = match std::fs::File::open(&f.path) {
                Ok(x) => x,
                Err(e) => {
                    *failure.lock() = Some(CliError::error(format!(
                        "opening {}: {e}",
                        f.path.display()
                    )));
                    return;
                }
            };
            for t in &f.tensors {
                let elem = if t.dtype.is_float() {
                    t.dtype.size() as u8
                } else {
                    1
                };
                for r in &spans[k] {
                    let mut buf = vec![0u8; (r.end - r.start) as usize];
                    if let Err(e) = file.read_exact_at(&mut buf, f.data_start + t.begin + r.start) {
                        *failure.lock() = Some(CliError::error(format!(
                            "reading tensor \"{}\" from {}: {e} (was the file changed while importing?)",
                            fmt::name(&t.name),
                            f.path.display()
                        )));
                        return;
                    }
                    pb.inc(buf.len() as u64);
                    if tx
                        .blocking_send(ChunkIn {
                            data: Bytes::from(buf),
                            elem,
                            base: None,
                        })
                        .is_err()
                    {
                        return;
                    }
                }
                k += 1;
            }
        }
        if let Some(b) = meta_blob {
            for r in chunk_blob {
                let data = b.slice(r.start as usize..r.end as usize);
                if tx
                    .blocking_send(ChunkIn {
                        data,
                        elem: 1,
                        base: None,
                    })
                    .is_err()
                {
                    return;
                }
            }
        }
    })
}

/// The rank manifest of the imported step: every tensor whole (in `plan` order, with its chunk
/// count), the metadata blob of `blob_len` bytes if any, over the chunk references `put` made.
fn manifest_of(
    store: &Store,
    head: &RankWrite,
    files: &[StFile],
    plan: &[(usize, usize, usize)],
    blob_len: u64,
    logical: u64,
    put: &ckpt_store::PutReport,
) -> Result<RankManifest> {
    let tensors: Vec<(TensorShard, usize)> = plan
        .iter()
        .map(|&(fi, ti, n)| {
            let t = &files[fi].tensors[ti];
            let shard = TensorShard {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                bbox: NdBox::full(&t.shape),
                chunks: Vec::new(),
                replica_of: None,
                placement: None,
                hashed: Vec::new(),
            };
            (shard, n)
        })
        .collect();
    let blobs = if blob_len > 0 {
        vec![(
            METADATA_BLOB.to_string(),
            blob_len,
            store.chunk_spans(blob_len).count(),
        )]
    } else {
        Vec::new()
    };
    assemble_manifest(
        head,
        tensors,
        blobs,
        &put.refs,
        logical + blob_len,
        &put.stats,
    )
    .map_err(CliError::from)
}

impl Report for ImportReport {
    fn print(&self, w: &mut dyn Write) -> std::io::Result<()> {
        writeln!(
            w,
            "imported {} tensors ({}) from {} file(s) into {}@{} in {} ({})",
            self.tensors,
            fmt::bytes(self.logical_bytes),
            self.files.len(),
            self.run,
            self.step,
            fmt::duration(self.seconds),
            fmt::rate(self.logical_bytes, self.seconds)
        )?;
        writeln!(
            w,
            "  {} chunks, {} already stored ({}); wrote {} in {} objects",
            self.chunks,
            self.chunks_skipped,
            fmt::bytes(self.bytes_skipped),
            fmt::bytes(self.bytes_written),
            self.objects_written
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p() -> &'static Path {
        Path::new("x.safetensors")
    }

    #[test]
    fn header_checks_name_the_problem() {
        let ok = br#"{"__metadata__":{"format":"pt"},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]},"a":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]}}"#;
        let (ts, md) = parse_header(p(), ok, 16).unwrap();
        assert_eq!(
            ts.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(),
            ["a", "b"]
        );
        assert_eq!(md["format"], "pt");
        let cases: &[(&[u8], u64, &str)] = &[
            (br#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#, 8, "past the end"),
            (br#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#, 12, "overlap"),
            (br#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#, 8, "needs 12 bytes"),
            (br#"{"a":{"dtype":"C64","shape":[1],"data_offsets":[0,8]}}"#, 8, "cannot be stored"),
            (br#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#, 8, "appears twice"),
            (br#"{"a\u0007b":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#, 1, "control characters"),
            (br#"{"a":{"dtype":"U8","shape":[18446744073709551615,2],"data_offsets":[0,1]}}"#, 1, "too large"),
            (br#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[1,0]}}"#, 1, "end before"),
            (br#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[2,3]}}"#, 3, "reference parser"),
            (br#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#, 5, "holds 5 bytes"),
            (br#"[1,2]"#, 0, "not a JSON object"),
            (b"{\xff}", 0, "not UTF-8"),
            (br#"{"__metadata__":{"k":1}}"#, 0, "not a string"),
        ];
        for (h, len, want) in cases {
            let e = parse_header(p(), h, *len).unwrap_err().to_string();
            assert!(e.contains(want), "{}: {e}", String::from_utf8_lossy(h));
            assert!(e.contains("x.safetensors"), "{e}");
        }
    }

    #[test]
    fn index_file_names_must_be_plain() {
        for ok in ["model-00001-of-00002.safetensors", "a b.safetensors", "..x"] {
            assert!(plain_file_name(ok), "{ok}");
        }
        for bad in ["", ".", "..", "../x", "/etc/passwd", "a\\b", "a\nb", "a\0b"] {
            assert!(!plain_file_name(bad), "{bad:?}");
        }
    }
}
