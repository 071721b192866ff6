//! The one place that maps ids and names to object keys (see FORMAT.md).
//!
//! ```text
//! <prefix>/chunks/<2 hex>/<64 hex>                       chunk object
//! <prefix>/packs/<2 hex>/<64 hex>                        pack object (small chunks)
//! <prefix>/runs/<run>/steps/<step:020>/rank-<r:06>.manifest
//! <prefix>/runs/<run>/steps/<step:020>/COMMIT            the commit record; existence = complete
//! <prefix>/runs/<run>/<log name>/<part>.jsonl            append-only logs (metrics, events)
//! <prefix>/locks/writers/<2 hex>/writer-<id>            a save in flight (writer lease)
//! <prefix>/locks/sweep-<id>                             a GC sweep in progress
//! ```
//!
//! Nothing else in ckpt builds key strings.

use object_store::path::Path;

use crate::error::{Error, Result};
use crate::id::{ChunkId, Hash, PackId};

/// The longest run name accepted.
pub const MAX_RUN_NAME: usize = 128;

/// Check a run name: 1 to 128 of `[A-Za-z0-9._-]`, starting with a letter or digit.
///
/// Run names become key segments and file names, so anything else is refused rather than
/// escaped.
pub fn validate_run(run: &str) -> Result<()> {
    let ok_chars = run
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    let first_ok = run
        .bytes()
        .next()
        .is_some_and(|b| b.is_ascii_alphanumeric());
    if run.is_empty() || run.len() > MAX_RUN_NAME || !ok_chars || !first_ok {
        return Err(Error::invalid(format!(
            "run name {run:?} is not allowed: use 1 to {MAX_RUN_NAME} characters of A-Z a-z 0-9 . _ -, \
             starting with a letter or digit"
        )));
    }
    Ok(())
}

/// What a key under `steps/` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepObject {
    /// `rank-<r>.manifest`
    RankManifest(u32),
    /// `COMMIT`
    Commit,
}

/// Maps ids and names to keys below a prefix.
#[derive(Debug, Clone, Default)]
pub struct Keys {
    prefix: Path,
}

impl Keys {
    /// Keys below `prefix` (may be empty).
    pub fn new(prefix: Path) -> Self {
        Keys { prefix }
    }

    /// The prefix all keys live under.
    pub fn prefix(&self) -> &Path {
        &self.prefix
    }

    fn join<'a>(&self, parts: impl IntoIterator<Item = &'a str>) -> Path {
        let mut p = self.prefix.clone();
        for part in parts {
            p = p.join(part);
        }
        p
    }

    /// `chunks/`
    pub fn chunks_dir(&self) -> Path {
        self.join(["chunks"])
    }
    /// `packs/`
    pub fn packs_dir(&self) -> Path {
        self.join(["packs"])
    }
    /// `runs/`
    pub fn runs_dir(&self) -> Path {
        self.join(["runs"])
    }

    /// The object of a chunk.
    pub fn chunk(&self, id: &ChunkId) -> Path {
        let hex = id.to_hex();
        self.join(["chunks", &hex[..2], &hex])
    }

    /// The object of chunk `id` stored as a delta on chunk `base`:
    /// `chunks/<2 hex>/<id hex>.<base hex>`. Its own key, so that a delta never replaces an
    /// object other manifests reference whole, nor a delta on another base.
    pub fn delta_chunk(&self, id: &ChunkId, base: &ChunkId) -> Path {
        let hex = id.to_hex();
        let name = format!("{hex}.{}", base.to_hex());
        self.join(["chunks", &hex[..2], &name])
    }

    /// `(id, base)` of a delta chunk key, if `path` is one.
    pub fn parse_delta_chunk(&self, path: &Path) -> Option<(ChunkId, ChunkId)> {
        let rest = self.strip(path)?;
        let ["chunks", fan, name] = rest.as_slice() else {
            return None;
        };
        let (hex, base) = name.split_once('.')?;
        if hex.len() != 64 || !hex.starts_with(fan) {
            return None;
        }
        Some((
            ChunkId(Hash::from_hex(hex).ok()?),
            ChunkId(Hash::from_hex(base).ok()?),
        ))
    }

    /// The object of a pack.
    pub fn pack(&self, id: &PackId) -> Path {
        let hex = id.to_hex();
        self.join(["packs", &hex[..2], &hex])
    }

    /// `runs/<run>/`
    pub fn run_dir(&self, run: &str) -> Path {
        self.join(["runs", run])
    }

    /// `runs/<run>/steps/`
    pub fn steps_dir(&self, run: &str) -> Path {
        self.join(["runs", run, "steps"])
    }

    /// `runs/<run>/steps/<step>/`
    pub fn step_dir(&self, run: &str, step: u64) -> Path {
        self.join(["runs", run, "steps", &step_segment(step)])
    }

    /// The manifest of one rank of a step.
    pub fn rank_manifest(&self, run: &str, step: u64, rank: u32) -> Path {
        self.step_dir(run, step)
            .join(format!("rank-{rank:06}.manifest"))
    }

    /// The commit record of a step.
    pub fn commit(&self, run: &str, step: u64) -> Path {
        self.step_dir(run, step).join("COMMIT")
    }

    /// `runs/<run>/generations/`: one marker per started job generation.
    pub fn generations_dir(&self, run: &str) -> Path {
        self.join(["runs", run, "generations"])
    }

    /// The marker a supervisor creates when it starts `generation` of `run`.
    pub fn generation_marker(&self, run: &str, generation: u64) -> Path {
        self.generations_dir(run).join(format!("{generation:020}"))
    }

    /// The generation of a marker key.
    pub fn parse_generation_marker(&self, path: &Path) -> Option<u64> {
        let rest = self.strip(path)?;
        match rest.as_slice() {
            ["runs", _, "generations", g] => parse_step_segment(g),
            _ => None,
        }
    }

    /// The checkpoint interval every rank of `generation` of `run` uses, when ranks in separate
    /// processes choose it (`--ckpt-every auto`): created once by the first rank to decide,
    /// read by the others (FORMAT.md, "The automatic interval of a generation").
    pub fn generation_interval(&self, run: &str, generation: u64) -> Path {
        self.join(["runs", run, "intervals"])
            .join(format!("{generation:020}"))
    }

    /// `locks/`: writer leases and GC sweep locks (see FORMAT.md, "What GC may delete").
    pub fn locks_dir(&self) -> Path {
        self.join(["locks"])
    }

    /// The lease a writer holds while its save may reference objects it has not yet recorded
    /// in a manifest: `locks/writers/<2 hex>/writer-<name>`, the two hex digits from the
    /// name's hash, so that thousands of ranks taking leases at once spread their writes over
    /// 256 prefixes (S3 limits writes per prefix).
    pub fn writer_lock(&self, name: &str) -> Path {
        let spread = format!("{:02x}", blake3::hash(name.as_bytes()).as_bytes()[0]);
        self.join(["locks", "writers", &spread])
            .join(format!("writer-{name}"))
    }

    /// The lock a GC holds while it sweeps.
    pub fn sweep_lock(&self, name: &str) -> Path {
        self.locks_dir().join(format!("sweep-{name}"))
    }

    /// Whether a key under `locks/` is a writer lease (`Some(true)`) or a sweep lock
    /// (`Some(false)`).
    pub fn parse_lock(&self, path: &Path) -> Option<bool> {
        let rest = self.strip(path)?;
        match rest.as_slice() {
            ["locks", "writers", _, name] if name.starts_with("writer-") => Some(true),
            // Format 2's writer leases, directly under `locks/` (still honoured by GC).
            ["locks", name] if name.starts_with("writer-") => Some(true),
            ["locks", name] if name.starts_with("sweep-") => Some(false),
            _ => None,
        }
    }

    /// `runs/<run>/<log>/`: an append-only log made of numbered parts.
    pub fn log_dir(&self, run: &str, log: &str) -> Path {
        self.join(["runs", run, log])
    }

    /// One part of an append-only log.
    pub fn log_part(&self, run: &str, log: &str, writer: &str, seq: u64) -> Path {
        self.log_dir(run, log)
            .join(format!("{writer}-{seq:012}.jsonl"))
    }

    /// The id of a chunk key, if `path` is one.
    pub fn parse_chunk(&self, path: &Path) -> Option<ChunkId> {
        self.parse_content(path, "chunks").map(ChunkId)
    }

    /// The id of a pack key, if `path` is one.
    pub fn parse_pack(&self, path: &Path) -> Option<PackId> {
        self.parse_content(path, "packs").map(PackId)
    }

    fn parse_content(&self, path: &Path, dir: &str) -> Option<Hash> {
        let rest = self.strip(path)?;
        let [d, fan, hex] = rest.as_slice() else {
            return None;
        };
        if *d != dir || hex.len() != 64 || !hex.starts_with(fan) {
            return None;
        }
        Hash::from_hex(hex).ok()
    }

    /// `(run, step, what)` of a key under `runs/<run>/steps/`, if `path` is one.
    pub fn parse_step_object(&self, path: &Path) -> Option<(String, u64, StepObject)> {
        let rest = self.strip(path)?;
        let ["runs", run, "steps", step, name] = rest.as_slice() else {
            return None;
        };
        let step = parse_step_segment(step)?;
        let what = if *name == "COMMIT" {
            StepObject::Commit
        } else {
            let r = name.strip_prefix("rank-")?.strip_suffix(".manifest")?;
            if r.is_empty() || !r.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            StepObject::RankManifest(r.parse().ok()?)
        };
        Some((run.to_string(), step, what))
    }

    /// The step number of a `runs/<run>/steps/<step>` directory key.
    pub fn parse_step_dir(&self, path: &Path) -> Option<u64> {
        let rest = self.strip(path)?;
        match rest.as_slice() {
            ["runs", _, "steps", step] => parse_step_segment(step),
            _ => None,
        }
    }

    /// The run name of a `runs/<run>` directory key.
    pub fn parse_run_dir(&self, path: &Path) -> Option<String> {
        let rest = self.strip(path)?;
        match rest.as_slice() {
            ["runs", run] => Some(run.to_string()),
            _ => None,
        }
    }

    fn strip<'a>(&self, path: &'a Path) -> Option<Vec<&'a str>> {
        let mut parts = path.as_ref().split('/').filter(|s| !s.is_empty());
        for want in self.prefix.as_ref().split('/').filter(|s| !s.is_empty()) {
            if parts.next()? != want {
                return None;
            }
        }
        Some(parts.collect())
    }
}

fn step_segment(step: u64) -> String {
    format!("{step:020}")
}

fn parse_step_segment(s: &str) -> Option<u64> {
    if s.len() != 20 || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_with_and_without_prefix() {
        for prefix in ["", "a/b"] {
            let k = Keys::new(Path::from(prefix));
            let c = ChunkId::of(b"c");
            let p = PackId::of(b"p");
            assert_eq!(k.parse_chunk(&k.chunk(&c)), Some(c));
            assert_eq!(k.parse_pack(&k.pack(&p)), Some(p));
            assert_eq!(k.parse_chunk(&k.pack(&p)), None);
            assert_eq!(
                k.parse_step_object(&k.rank_manifest("r1", 42, 7)),
                Some(("r1".into(), 42, StepObject::RankManifest(7)))
            );
            assert_eq!(
                k.parse_step_object(&k.commit("r1", u64::MAX)),
                Some(("r1".into(), u64::MAX, StepObject::Commit))
            );
            assert_eq!(k.parse_step_dir(&k.step_dir("r", 3)), Some(3));
            assert_eq!(k.parse_run_dir(&k.run_dir("r")), Some("r".into()));
        }
        let k = Keys::new(Path::from("x"));
        assert_eq!(
            k.chunk(&ChunkId::of(b"")).as_ref(),
            format!("x/chunks/af/{}", ChunkId::of(b"").to_hex())
        );
        assert_eq!(
            k.commit("run", 5).as_ref(),
            "x/runs/run/steps/00000000000000000005/COMMIT"
        );
    }

    #[test]
    fn hostile_run_names_are_refused() {
        for bad in [
            "",
            ".",
            "..",
            "a/b",
            "-x",
            "a\0b",
            "a\nb",
            "ä",
            &"x".repeat(129),
        ] {
            assert!(validate_run(bad).is_err(), "{bad:?} accepted");
        }
        for good in ["a", "run-1", "llama_7b.v2", "0"] {
            validate_run(good).unwrap();
        }
    }

    #[test]
    fn foreign_keys_do_not_parse() {
        let k = Keys::new(Path::from("p"));
        assert_eq!(k.parse_chunk(&Path::from("q/chunks/aa/bb")), None);
        assert_eq!(
            k.parse_step_object(&Path::from("p/runs/r/steps/12/COMMIT")),
            None
        );
        assert_eq!(
            k.parse_step_object(&Path::from(
                "p/runs/r/steps/00000000000000000012/rank-x.manifest"
            )),
            None
        );
    }
}
