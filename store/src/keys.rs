//! The one place that maps ids and names to object keys (see FORMAT.md).
//!
//! ```text
//! <prefix>/chunks/<2 hex>/<64 hex>                       chunk object
//! <prefix>/packs/<2 hex>/<64 hex>                        pack object (small chunks)
//! <prefix>/runs/<run>/steps/<step:020>/ranks/<2 hex>/rank-<r:06>.manifest
//! <prefix>/runs/<run>/steps/<step:020>/rank-<r:06>.manifest   (records of format 2 and 3)
//! <prefix>/runs/<run>/steps/<step:020>/COMMIT            the commit record; existence = complete
//! <prefix>/runs/<run>/generations/<g:020>                generation marker
//! <prefix>/runs/<run>/fences/<1 hex>/<g:020>             a copy of it, read by writers
//! <prefix>/runs/<run>/<log name>/<part>.jsonl            append-only logs (metrics, events)
//! <prefix>/locks/writers/<2 hex>/writer-<id>            a save in flight (writer lease)
//! <prefix>/locks/sweep-<id>                             a GC sweep in progress
//! ```
//!
//! Nothing else in ckpt builds key strings.

use object_store::path::Path;

use crate::error::{Error, Result};
use crate::id::{ChunkId, Hash, PackId};
use crate::model::ChunkRef;

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
    /// `index/<2 hex>/<blake3>.part`: a part of a split commit record (format 5).
    RecordPart(crate::id::Hash),
    /// `nodes/rank-<r>.commit`: a node's commit of its ranks (`r` the first) in its local
    /// tier, in a job of several machines ([`crate::NodeCommit`]).
    NodeCommit(u32),
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

    /// The manifest of one rank of a step (commit record format 4 on):
    /// `steps/<step>/ranks/<2 hex>/rank-<r>.manifest`, the two hex digits the first byte of the
    /// blake3 of the file name, so that thousands of ranks writing their manifests in the same
    /// second spread them over 256 prefixes (S3 limits writes per prefix).
    pub fn rank_manifest(&self, run: &str, step: u64, rank: u32) -> Path {
        let name = format!("rank-{rank:06}.manifest");
        let spread = format!("{:02x}", blake3::hash(name.as_bytes()).as_bytes()[0]);
        self.step_dir(run, step)
            .join("ranks")
            .join(spread.as_str())
            .join(name)
    }

    /// Where builds before commit record format 4 put a rank's manifest:
    /// `steps/<step>/rank-<r>.manifest`. Still read (and deleted by GC).
    pub fn legacy_rank_manifest(&self, run: &str, step: u64, rank: u32) -> Path {
        self.step_dir(run, step)
            .join(format!("rank-{rank:06}.manifest"))
    }

    /// The commit record of a step.
    pub fn commit(&self, run: &str, step: u64) -> Path {
        self.step_dir(run, step).join("COMMIT")
    }

    /// The node commits of `step` ([`crate::NodeCommit`]): `steps/<step>/nodes/`.
    pub fn node_commits_dir(&self, run: &str, step: u64) -> Path {
        self.step_dir(run, step).join("nodes")
    }

    /// The commit of a node's ranks of `step`, `first` the lowest, in its local tier
    /// ([`crate::NodeCommit`]): `steps/<step>/nodes/rank-<first:06>.commit`. One per node,
    /// so nodes that share a tier (a shared file system) keep theirs apart.
    pub fn node_commit(&self, run: &str, step: u64, first: u32) -> Path {
        self.node_commits_dir(run, step)
            .join(format!("rank-{first:06}.commit"))
    }

    /// A part of a split commit record (format 5), named by the blake3 of its bytes:
    /// `steps/<step>/index/<2 hex>/<hash>.part`, the two hex digits its hash's first byte, so
    /// that thousands of restoring ranks reading their parts in the same second spread over
    /// as many prefixes as there are parts.
    pub fn record_part(&self, run: &str, step: u64, hash: &crate::id::Hash) -> Path {
        let hex = hash.to_hex();
        self.step_dir(run, step)
            .join("index")
            .join(&hex[..2])
            .join(format!("{hex}.part").as_str())
    }

    /// `runs/<run>/generations/`: one marker per started job generation.
    pub fn generations_dir(&self, run: &str) -> Path {
        self.join(["runs", run, "generations"])
    }

    /// The drain markers of `run` in a local tier (see [`crate::tier`]).
    pub fn drain_dir(&self, run: &str) -> Path {
        self.join(["runs", run, "drain"])
    }

    /// `step`'s drain marker in a local tier: `runs/<run>/drain/<step:020>.json`.
    pub fn drain_marker(&self, run: &str, step: u64) -> Path {
        self.drain_dir(run).join(format!("{step:020}.json"))
    }

    /// The step of a drain marker's key, if `path` is one.
    pub fn parse_drain_marker(&self, path: &Path) -> Option<u64> {
        let rest = self.strip(path)?;
        match rest.as_slice() {
            ["runs", _, "drain", name] => parse_step_segment(name.strip_suffix(".json")?),
            _ => None,
        }
    }

    /// The marker a supervisor creates when it starts `generation` of `run`.
    pub fn generation_marker(&self, run: &str, generation: u64) -> Path {
        self.generations_dir(run).join(format!("{generation:020}"))
    }

    /// The writers' copy of generation `generation`'s marker in fence shard `shard` (of
    /// [`FENCE_SHARDS`]): `runs/<run>/fences/<1 hex>/<g:020>`. A writer checks its fence by
    /// listing one shard (the one of its rank), so thousands of ranks checking at once read 16
    /// prefixes, not one.
    pub fn fence(&self, run: &str, shard: u32, generation: u64) -> Path {
        self.fence_dir(run, shard).join(format!("{generation:020}"))
    }

    /// `runs/<run>/fences/<1 hex>/`: one fence shard.
    pub fn fence_dir(&self, run: &str, shard: u32) -> Path {
        let s = format!("{:x}", shard % FENCE_SHARDS);
        self.join(["runs", run, "fences", &s])
    }

    /// The generation of a fence key.
    pub fn parse_fence(&self, path: &Path) -> Option<u64> {
        let rest = self.strip(path)?;
        match rest.as_slice() {
            ["runs", _, "fences", _, g] => parse_step_segment(g),
            _ => None,
        }
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

    /// `(run, step, what)` of a key under `runs/<run>/steps/`, if `path` is one (a manifest at
    /// its place of either format: [`Keys::rank_manifest`], [`Keys::legacy_rank_manifest`]).
    pub fn parse_step_object(&self, path: &Path) -> Option<(String, u64, StepObject)> {
        let rest = self.strip(path)?;
        let (run, step, name) = match rest.as_slice() {
            ["runs", run, "steps", step, name] => (run, step, name),
            ["runs", run, "steps", step, "nodes", name] => {
                let step = parse_step_segment(step)?;
                let r = name.strip_prefix("rank-")?.strip_suffix(".commit")?;
                if r.len() != 6 || !r.bytes().all(|b| b.is_ascii_digit()) {
                    return None;
                }
                let first: u32 = r.parse().ok()?;
                return Some((run.to_string(), step, StepObject::NodeCommit(first)));
            }
            ["runs", run, "steps", step, "ranks", _, name] => (run, step, name),
            ["runs", run, "steps", step, "index", _, name] => {
                let step = parse_step_segment(step)?;
                let hash = crate::id::Hash::from_hex(name.strip_suffix(".part")?).ok()?;
                return (self.record_part(run, step, &hash) == *path)
                    .then(|| (run.to_string(), step, StepObject::RecordPart(hash)));
            }
            _ => return None,
        };
        let step = parse_step_segment(step)?;
        let what = if *name == "COMMIT" && rest.len() == 5 {
            StepObject::Commit
        } else {
            let r = name.strip_prefix("rank-")?.strip_suffix(".manifest")?;
            if r.is_empty() || !r.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            let rank: u32 = r.parse().ok()?;
            // Only the exact key of either layout: a manifest under the wrong fan-out
            // directory is not one.
            if rest.len() == 7 && self.rank_manifest(run, step, rank) != *path {
                return None;
            }
            StepObject::RankManifest(rank)
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

    /// The object key a chunk reference points at (its chunk object or its pack).
    pub fn object_of(&self, r: &ChunkRef) -> Path {
        match (&r.pack, r.bases.first()) {
            (Some(p), _) => self.pack(p),
            (None, Some(b)) => self.delta_chunk(&r.id, b),
            (None, None) => self.chunk(&r.id),
        }
    }

    /// Every object reading `r` needs: its own, then its delta bases' (nearest first; the
    /// last is stored whole). One object for a chunk that is not a delta.
    pub fn chain_objects(&self, r: &ChunkRef) -> Vec<Path> {
        let mut out = vec![self.object_of(r)];
        for (i, b) in r.bases.iter().enumerate() {
            out.push(match r.bases.get(i + 1) {
                Some(next) => self.delta_chunk(b, next),
                None => self.chunk(b),
            });
        }
        out
    }
}

/// The number of fence shards ([`Keys::fence`]): a start of a generation writes one copy of its
/// marker into each.
pub const FENCE_SHARDS: u32 = 16;

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
                k.parse_step_object(&k.legacy_rank_manifest("r1", 42, 7)),
                Some(("r1".into(), 42, StepObject::RankManifest(7)))
            );
            assert_eq!(k.parse_fence(&k.fence("r1", 21, 9)), Some(9));
            assert_eq!(k.parse_lock(&k.writer_lock("x")), Some(true));
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
        assert_eq!(
            k.legacy_rank_manifest("run", 5, 3).as_ref(),
            "x/runs/run/steps/00000000000000000005/rank-000003.manifest"
        );
        let spread = k.rank_manifest("run", 5, 3);
        assert!(
            spread
                .as_ref()
                .starts_with("x/runs/run/steps/00000000000000000005/ranks/")
                && spread.as_ref().ends_with("/rank-000003.manifest"),
            "{spread}"
        );
        assert_eq!(
            k.fence("run", 17, 2).as_ref(),
            "x/runs/run/fences/1/00000000000000000002"
        );
    }

    #[test]
    fn manifests_of_many_ranks_spread_over_the_fan_out() {
        let k = Keys::new(Path::from(""));
        let mut per: std::collections::HashMap<String, u32> = Default::default();
        for r in 0..4096 {
            let p = k.rank_manifest("r", 1, r);
            *per.entry(p.as_ref().rsplit_once('/').unwrap().0.to_string())
                .or_default() += 1;
        }
        assert_eq!(per.len(), 256, "4,096 ranks use every prefix");
        assert!(per.values().all(|&n| n <= 64), "{:?}", per.values().max());
        // A manifest moved under another fan-out directory is not one.
        let other = Path::from("runs/r/steps/00000000000000000001/ranks/zz/rank-000001.manifest");
        assert_eq!(k.parse_step_object(&other), None);
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
