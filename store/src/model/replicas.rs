//! The sentinel's comparison of data-parallel replicas (issue 29): which chunks of a replica a
//! rank hashes at a step ([`SdcCheck`], [`sampled_chunks`]), and what the committer finds when
//! it compares them with the writer's chunk ids ([`compare_replicas`], [`ReplicaReport`]).
//!
//! Replicas hold bytes that must be identical. One rank writes a replicated shard; every other
//! holder records a reference ([`TensorShard::replica_of`]) and, with the check on, the ids
//! (blake3 of the plain bytes, as a chunk id) of the chunks of its own copy it hashed
//! ([`TensorShard::hashed`], cut as the writer cuts the box). The committer compares them
//! with the writer's chunk ids before it commits: a difference is silent corruption on one
//! side (a flipped bit in a rank's memory or arithmetic). With three or more holders, the
//! ids a strict majority holds are taken as right and the ranks outside it are named
//! suspect; with two, both sides are named.
//!
//! Which chunks are hashed is a pure function of the tensor, the box, the chunk's index and
//! the step, so every holder of a shard hashes the same chunks (the majority needs the same
//! chunks from each), and the sample rotates from step to step: a chunk is hashed at about a
//! fraction `F` of the checkpoints, spread evenly (an irrational rotation), so corruption that
//! stays in a rank's state is found within about `1/F` checkpoints.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{NdBox, RankManifest};
use crate::error::{Error, Result};
use crate::id::ChunkId;

/// How much of its replicas a rank hashes at each checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SdcCheck {
    /// Nothing: replicas are references only.
    Off,
    /// A rotating sample of about this fraction of each replica's chunks (0 < F < 1).
    Sample(f64),
    /// Every chunk of every replica.
    Full,
}

impl SdcCheck {
    /// The default: a sample of 5 % of the replicas' chunks, which costs a save about 5 % of
    /// its hashing of replicated state (BENCHMARKS.md, "The sentinel").
    pub const DEFAULT: SdcCheck = SdcCheck::Sample(0.05);

    /// Whether replicas are hashed at all.
    pub fn is_on(&self) -> bool {
        !matches!(self, SdcCheck::Off)
    }

    /// The fraction of chunks hashed.
    pub fn fraction(&self) -> f64 {
        match self {
            SdcCheck::Off => 0.0,
            SdcCheck::Sample(f) => *f,
            SdcCheck::Full => 1.0,
        }
    }
}

// A sample's fraction is never NaN (parsing and the constructors keep it in (0, 1)), so
// equality is an equivalence.
impl Eq for SdcCheck {}

impl Default for SdcCheck {
    fn default() -> Self {
        SdcCheck::DEFAULT
    }
}

impl std::fmt::Display for SdcCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SdcCheck::Off => f.write_str("off"),
            SdcCheck::Full => f.write_str("full"),
            SdcCheck::Sample(x) => write!(f, "sample={x}"),
        }
    }
}

impl std::str::FromStr for SdcCheck {
    type Err = Error;

    /// `full`, `off`, or `sample=F` with `0 < F <= 1` (`sample=1` is `full`).
    fn from_str(s: &str) -> Result<Self> {
        let bad = || {
            Error::invalid(format!(
                "sdc check {s:?}: expected full, off or sample=F with F a fraction above 0 and at most 1 (e.g. sample=0.05)"
            ))
        };
        match s.trim() {
            "full" => Ok(SdcCheck::Full),
            "off" => Ok(SdcCheck::Off),
            t => {
                let f: f64 = t
                    .strip_prefix("sample=")
                    .ok_or_else(bad)?
                    .trim()
                    .parse()
                    .map_err(|_| bad())?;
                if !(f > 0.0 && f <= 1.0) {
                    return Err(bad());
                }
                Ok(if f >= 1.0 {
                    SdcCheck::Full
                } else {
                    SdcCheck::Sample(f)
                })
            }
        }
    }
}

/// What a job does when a step's replicas disagree.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MismatchPolicy {
    /// Log the `replica_mismatch` event and go on (the step stays committed, the mismatch
    /// recorded in it).
    #[default]
    Warn,
    /// Stop the job (the committing rank's next call fails, naming the mismatch).
    Stop,
    /// Under a driver (`ckpt resume`, `ckpt agent`): stop the ranks, keep the suspect nodes
    /// out, restart from the newest step whose replicas agreed. The ranks themselves warn.
    Rollback,
}

impl MismatchPolicy {
    /// Its name on the command line and in records.
    pub fn name(&self) -> &'static str {
        match self {
            MismatchPolicy::Warn => "warn",
            MismatchPolicy::Stop => "stop",
            MismatchPolicy::Rollback => "rollback",
        }
    }
}

impl std::fmt::Display for MismatchPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for MismatchPolicy {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim() {
            "warn" => Ok(MismatchPolicy::Warn),
            "stop" => Ok(MismatchPolicy::Stop),
            "rollback" => Ok(MismatchPolicy::Rollback),
            _ => Err(Error::invalid(format!(
                "replica mismatch policy {s:?}: expected warn, stop or rollback"
            ))),
        }
    }
}

/// The golden ratio's fractional part: the rotation of the sample from one step to the next.
const ROTATION: f64 = 0.618_033_988_749_894_9;

/// Where in [0, 1) chunk `index` of box `bbox` of tensor `name` sits, for the sample.
fn chunk_phase(name: &str, bbox: &NdBox, index: u32) -> f64 {
    let mut h = blake3::Hasher::new();
    h.update(name.as_bytes());
    h.update(&[0]);
    for (o, l) in bbox.offsets.iter().zip(&bbox.lengths) {
        h.update(&o.to_le_bytes());
        h.update(&l.to_le_bytes());
    }
    h.update(&index.to_le_bytes());
    let b = h.finalize();
    let x = u64::from_le_bytes(b.as_bytes()[..8].try_into().expect("8 bytes"));
    (x >> 11) as f64 / (1u64 << 53) as f64
}

/// The chunks (indices, ascending) of a replica of `chunks` chunks that a holder hashes at
/// `step` under `check`: the same on every holder, rotating with the step.
pub fn sampled_chunks(
    check: SdcCheck,
    name: &str,
    bbox: &NdBox,
    chunks: u32,
    step: u64,
) -> Vec<u32> {
    match check {
        SdcCheck::Off => Vec::new(),
        SdcCheck::Full => (0..chunks).collect(),
        SdcCheck::Sample(f) => {
            let rot = (step as f64 * ROTATION).fract();
            (0..chunks)
                .filter(|&i| (chunk_phase(name, bbox, i) + rot).fract() < f)
                .collect()
        }
    }
}

/// The most chunks [`sampled_chunks`] takes of this replica at any step: what a holder's
/// staging must hold for them (a pool sized before the first save). A step samples the chunks
/// whose phase falls in a window of width `f` that rotates with it, so the bound is the most
/// phases any such window holds.
pub fn most_sampled(check: SdcCheck, name: &str, bbox: &NdBox, chunks: u32) -> u32 {
    match check {
        SdcCheck::Off => 0,
        SdcCheck::Full => chunks,
        SdcCheck::Sample(f) => {
            let mut p: Vec<f64> = (0..chunks).map(|i| chunk_phase(name, bbox, i)).collect();
            p.sort_by(f64::total_cmp);
            // Each window worth counting starts at a phase; it may wrap past 1.
            let n = p.len();
            let wrapped: Vec<f64> = p.iter().copied().chain(p.iter().map(|x| x + 1.0)).collect();
            let mut best = 0;
            let mut end = 0;
            for start in 0..n {
                end = end.max(start);
                while end < start + n && wrapped[end] < wrapped[start] + f {
                    end += 1;
                }
                best = best.max(end - start);
            }
            best as u32
        }
    }
}

/// One chunk of a replica its holder hashed: the index in the writer's cut of the box, its
/// length, and the blake3 of the holder's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HashedChunk {
    /// The chunk's index in the box (the writer's chunk list).
    #[serde(rename = "i")]
    pub index: u32,
    /// Its length.
    pub len: u32,
    /// blake3 of the holder's bytes (a chunk id).
    pub id: ChunkId,
}

/// One side of a mismatch: the ranks (and their nodes, where known) whose copies hash to `id`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaSide {
    /// The id these ranks' bytes hash to.
    pub id: ChunkId,
    /// The ranks, ascending; the writer is among them on its side.
    pub ranks: Vec<u32>,
    /// Their nodes, where the manifests say (same order; `None` for a rank saved without a
    /// driver).
    pub nodes: Vec<Option<u32>>,
}

/// A chunk whose replicas disagree.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaMismatch {
    /// The tensor.
    pub tensor: String,
    /// The replicated box.
    #[serde(rename = "box")]
    pub bbox: NdBox,
    /// The chunk's index in the box, and its byte range.
    pub chunk: u32,
    /// Byte offset of the chunk in the box's row-major bytes.
    pub offset: u64,
    /// Its length.
    pub len: u32,
    /// The rank that wrote the stored bytes.
    pub writer: u32,
    /// The sides, the largest first (ties: the writer's first).
    pub sides: Vec<ReplicaSide>,
    /// The ranks outside a strict majority (the majority's bytes are taken as right); empty
    /// when no side holds a strict majority (two holders, or a tie).
    pub suspects: Vec<u32>,
}

impl ReplicaMismatch {
    /// Whether the stored bytes (the writer's) are the suspect ones or cannot be told right.
    pub fn stored_suspect(&self) -> bool {
        self.suspects.is_empty() || self.suspects.contains(&self.writer)
    }

    /// One line naming the step's tensor, box, chunk, the sides and the suspects.
    pub fn describe(&self) -> String {
        let side = |s: &ReplicaSide| {
            let who: Vec<String> = s
                .ranks
                .iter()
                .zip(&s.nodes)
                .map(|(r, n)| match n {
                    Some(n) => format!("rank {r} (node {n})"),
                    None => format!("rank {r}"),
                })
                .collect();
            format!("{} -> {}", who.join(", "), s.id.short())
        };
        let sides: Vec<String> = self.sides.iter().map(side).collect();
        let verdict = if self.suspects.is_empty() {
            "no majority: either side may be corrupt".to_string()
        } else {
            let s: Vec<String> = self.suspects.iter().map(|r| format!("rank {r}")).collect();
            format!("suspect: {}", s.join(", "))
        };
        format!(
            "tensor {:?} box {} chunk {} (bytes {}..{}, written by rank {}): {}; {verdict}",
            self.tensor,
            self.bbox,
            self.chunk,
            self.offset,
            self.offset + u64::from(self.len),
            self.writer,
            sides.join(" vs "),
        )
    }
}

/// What the committer found comparing a step's replicas.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaReport {
    /// Replica chunks compared with the writer's.
    pub chunks_compared: u64,
    /// Their bytes.
    pub bytes_compared: u64,
    /// Chunks whose replicas disagree (at most [`MAX_MISMATCHES_LISTED`] listed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mismatches: Vec<ReplicaMismatch>,
    /// How many chunks disagree in all (more than the list when it was cut).
    #[serde(default)]
    pub mismatched_chunks: u64,
}

/// The most mismatches a commit record lists (the count goes on).
pub const MAX_MISMATCHES_LISTED: usize = 64;

impl ReplicaReport {
    /// Whether any replica disagreed.
    pub fn mismatched(&self) -> bool {
        self.mismatched_chunks > 0
    }

    /// The suspect ranks of every listed mismatch, ascending, without repeats.
    pub fn suspects(&self) -> Vec<u32> {
        let mut s: Vec<u32> = self
            .mismatches
            .iter()
            .flat_map(|m| m.suspects.iter().copied())
            .collect();
        s.sort_unstable();
        s.dedup();
        s
    }
}

/// Compare the hashed replicas of `manifests` (one step, one generation: every rank) with the
/// writers' chunk ids; `None` when no rank hashed a replica. A replica whose writer's shard
/// is missing, or whose chunk the writer cut to another length, is not compared (coverage
/// and the writer's own checks report those).
pub fn compare_replicas(manifests: &[RankManifest]) -> Option<ReplicaReport> {
    let by_rank: BTreeMap<u32, &RankManifest> = manifests.iter().map(|m| (m.rank, m)).collect();
    // (tensor, box offsets, chunk) -> (writer, offset, len, votes rank -> id)
    type Votes = (u32, u64, u32, BTreeMap<u32, ChunkId>);
    let mut chunks: BTreeMap<(String, Vec<u64>, Vec<u64>, u32), Votes> = BTreeMap::new();
    let mut any = false;
    for m in manifests {
        for t in m.tensors.iter().filter(|t| !t.hashed.is_empty()) {
            any = true;
            let Some(w) = t.replica_of else { continue };
            let Some(ws) = by_rank.get(&w).and_then(|wm| {
                wm.tensors
                    .iter()
                    .find(|x| x.name == t.name && x.bbox == t.bbox && x.replica_of.is_none())
            }) else {
                continue;
            };
            let mut offset = 0u64;
            let offsets: Vec<u64> = ws
                .chunks
                .iter()
                .map(|c| {
                    let o = offset;
                    offset += u64::from(c.len);
                    o
                })
                .collect();
            for h in &t.hashed {
                let Some(wc) = ws.chunks.get(h.index as usize) else {
                    continue;
                };
                if wc.len != h.len {
                    continue;
                }
                let key = (
                    t.name.clone(),
                    t.bbox.offsets.clone(),
                    t.bbox.lengths.clone(),
                    h.index,
                );
                let e = chunks.entry(key).or_insert_with(|| {
                    let mut v = BTreeMap::new();
                    v.insert(w, wc.id);
                    (w, offsets[h.index as usize], wc.len, v)
                });
                e.3.insert(m.rank, h.id);
            }
        }
    }
    if !any {
        return None;
    }
    let node = |r: u32| by_rank.get(&r).and_then(|m| m.node);
    let mut report = ReplicaReport::default();
    for ((tensor, offsets, lengths, chunk), (writer, offset, len, votes)) in chunks {
        // Every vote but the writer's is a compared replica chunk.
        let compared = votes.len() as u64 - 1;
        report.chunks_compared += compared;
        report.bytes_compared += compared * u64::from(len);
        let mut sides: BTreeMap<ChunkId, Vec<u32>> = BTreeMap::new();
        for (r, id) in &votes {
            sides.entry(*id).or_default().push(*r);
        }
        if sides.len() < 2 {
            continue;
        }
        report.mismatched_chunks += 1;
        if report.mismatches.len() >= MAX_MISMATCHES_LISTED {
            continue;
        }
        let total = votes.len();
        let mut sides: Vec<ReplicaSide> = sides
            .into_iter()
            .map(|(id, ranks)| ReplicaSide {
                id,
                nodes: ranks.iter().map(|r| node(*r)).collect(),
                ranks,
            })
            .collect();
        sides.sort_by_key(|s| (std::cmp::Reverse(s.ranks.len()), !s.ranks.contains(&writer)));
        let suspects = if sides[0].ranks.len() * 2 > total {
            let mut s: Vec<u32> = sides[1..].iter().flat_map(|s| s.ranks.clone()).collect();
            s.sort_unstable();
            s
        } else {
            Vec::new()
        };
        report.mismatches.push(ReplicaMismatch {
            tensor,
            bbox: NdBox { offsets, lengths },
            chunk,
            offset,
            len,
            writer,
            sides,
            suspects,
        });
    }
    Some(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::Codec;
    use crate::model::{ChunkRef, DType, Layout, TensorShard, WriteStats};

    fn id(b: u8) -> ChunkId {
        ChunkId::of(&[b; 8])
    }

    fn shard(chunks: &[u8], replica_of: Option<u32>, hashed: &[(u32, u8)]) -> TensorShard {
        TensorShard {
            name: "w".into(),
            dtype: DType::F32,
            shape: vec![64],
            bbox: NdBox::full(&[64]),
            chunks: chunks
                .iter()
                .map(|b| ChunkRef::plain(id(*b), 64, 64, Codec::Raw))
                .collect(),
            replica_of,
            placement: None,
            hashed: hashed
                .iter()
                .map(|(i, b)| HashedChunk {
                    index: *i,
                    len: 64,
                    id: id(*b),
                })
                .collect(),
        }
    }

    fn manifest(rank: u32, t: TensorShard) -> RankManifest {
        RankManifest {
            format: 2,
            run: "r".into(),
            step: 1,
            rank,
            node: Some(10 + rank),
            layout: Layout::new(3, 1, 1, 0).unwrap(),
            generation: 0,
            created_ms: 0,
            tensors: vec![t],
            blobs: vec![],
            stats: WriteStats::default(),
        }
    }

    #[test]
    fn agreeing_replicas_are_counted_and_nothing_is_reported() {
        let ms = vec![
            manifest(0, shard(&[1, 2, 3, 4], None, &[])),
            manifest(1, shard(&[], Some(0), &[(0, 1), (2, 3)])),
            manifest(2, shard(&[], Some(0), &[(0, 1), (2, 3)])),
        ];
        let r = compare_replicas(&ms).unwrap();
        assert_eq!((r.chunks_compared, r.bytes_compared), (4, 256));
        assert!(!r.mismatched(), "{r:?}");
        // Nothing hashed: no report at all.
        let ms = vec![
            manifest(0, shard(&[1, 2], None, &[])),
            manifest(1, shard(&[], Some(0), &[])),
        ];
        assert_eq!(compare_replicas(&ms), None);
    }

    #[test]
    fn a_minority_replica_is_suspect_and_a_minority_writer_too() {
        // Rank 2's copy of chunk 2 differs: the writer and rank 1 outvote it.
        let ms = vec![
            manifest(0, shard(&[1, 2, 3, 4], None, &[])),
            manifest(1, shard(&[], Some(0), &[(0, 1), (2, 3)])),
            manifest(2, shard(&[], Some(0), &[(0, 1), (2, 9)])),
        ];
        let r = compare_replicas(&ms).unwrap();
        assert_eq!(r.mismatched_chunks, 1);
        let m = &r.mismatches[0];
        assert_eq!((m.chunk, m.offset, m.writer), (2, 128, 0));
        assert_eq!(m.suspects, vec![2]);
        assert_eq!(m.sides[0].ranks, vec![0, 1]);
        assert_eq!(m.sides[1].nodes, vec![Some(12)]);
        assert!(!m.stored_suspect());
        let line = m.describe();
        assert!(
            line.contains("rank 2 (node 12)") && line.contains("suspect: rank 2"),
            "{line}"
        );
        // The writer's bytes differ from both replicas: the stored bytes are suspect.
        let ms = vec![
            manifest(0, shard(&[1, 7, 3, 4], None, &[])),
            manifest(1, shard(&[], Some(0), &[(1, 2)])),
            manifest(2, shard(&[], Some(0), &[(1, 2)])),
        ];
        let r = compare_replicas(&ms).unwrap();
        assert_eq!(r.mismatches[0].suspects, vec![0]);
        assert!(r.mismatches[0].stored_suspect());
        assert_eq!(r.suspects(), vec![0]);
    }

    #[test]
    fn two_holders_name_both_sides_and_no_suspect() {
        let ms = vec![
            manifest(0, shard(&[1, 2], None, &[])),
            manifest(1, shard(&[], Some(0), &[(0, 1), (1, 5)])),
        ];
        let r = compare_replicas(&ms).unwrap();
        let m = &r.mismatches[0];
        assert!(m.suspects.is_empty());
        assert_eq!(m.sides.len(), 2);
        assert_eq!(
            m.sides[0].ranks,
            vec![0],
            "ties put the writer's side first"
        );
        assert!(m.describe().contains("no majority"), "{}", m.describe());
    }

    #[test]
    fn a_chunk_cut_to_another_length_or_past_the_end_is_not_compared() {
        let mut r1 = shard(&[], Some(0), &[(0, 1), (5, 1)]);
        r1.hashed[0].len = 32;
        let ms = vec![manifest(0, shard(&[1, 2], None, &[])), manifest(1, r1)];
        let r = compare_replicas(&ms).unwrap();
        assert_eq!(r.chunks_compared, 0);
        assert!(!r.mismatched());
    }

    #[test]
    fn the_sample_is_the_same_on_every_holder_rotates_and_covers_every_chunk() {
        let b = NdBox::full(&[1 << 20]);
        let f = 0.1;
        let a = sampled_chunks(SdcCheck::Sample(f), "w", &b, 1000, 40);
        assert_eq!(a, sampled_chunks(SdcCheck::Sample(f), "w", &b, 1000, 40));
        // About the fraction asked, and another set at the next checkpoint.
        assert!((60..=140).contains(&a.len()), "{}", a.len());
        let next = sampled_chunks(SdcCheck::Sample(f), "w", &b, 1000, 50);
        assert_ne!(a, next);
        // Over 40 checkpoints 10 steps apart every chunk was hashed at least once.
        let mut seen = vec![false; 1000];
        for k in 0..40u64 {
            for i in sampled_chunks(SdcCheck::Sample(f), "w", &b, 1000, k * 10) {
                seen[i as usize] = true;
            }
        }
        assert!(seen.iter().all(|s| *s), "a chunk never sampled");
        assert_eq!(sampled_chunks(SdcCheck::Full, "w", &b, 3, 1), vec![0, 1, 2]);
        assert!(sampled_chunks(SdcCheck::Off, "w", &b, 3, 1).is_empty());
    }

    #[test]
    fn sdc_check_parses_and_refuses_nonsense() {
        assert_eq!("full".parse::<SdcCheck>().unwrap(), SdcCheck::Full);
        assert_eq!("off".parse::<SdcCheck>().unwrap(), SdcCheck::Off);
        assert_eq!(
            "sample=0.05".parse::<SdcCheck>().unwrap(),
            SdcCheck::Sample(0.05)
        );
        assert_eq!("sample=1".parse::<SdcCheck>().unwrap(), SdcCheck::Full);
        for bad in ["sample=0", "sample=1.5", "sample=x", "half", "sample=-0.1"] {
            let e = bad.parse::<SdcCheck>().unwrap_err().to_string();
            assert!(e.contains("sample=F"), "{bad}: {e}");
        }
        assert_eq!(SdcCheck::Sample(0.05).to_string(), "sample=0.05");
    }

    #[test]
    fn most_sampled_bounds_every_step_and_is_the_fullest_window() {
        for (name, chunks, f) in [
            ("w", 40u32, 0.1),
            ("layers.3.mlp", 257, 0.05),
            ("b", 3, 0.5),
        ] {
            let bbox = NdBox::full(&[u64::from(chunks) * 16]);
            let check = SdcCheck::Sample(f);
            let bound = most_sampled(check, name, &bbox, chunks);
            let busiest = (0..4000)
                .map(|step| sampled_chunks(check, name, &bbox, chunks, step).len() as u32)
                .max()
                .unwrap();
            assert!(busiest <= bound, "{name}: step sampled {busiest} > {bound}");
            // The fullest window, by brute force: one starting at each chunk's phase.
            let phases: Vec<f64> = (0..chunks).map(|i| chunk_phase(name, &bbox, i)).collect();
            let brute = phases
                .iter()
                .map(|s| {
                    phases
                        .iter()
                        .filter(|p| (*p - s).rem_euclid(1.0) < f)
                        .count()
                })
                .max()
                .unwrap() as u32;
            assert_eq!(bound, brute, "{name}");
            assert!(
                bound <= chunks.max(8) / 2,
                "{name}: {bound} of {chunks} at {f}"
            );
        }
        let bbox = NdBox::full(&[64]);
        assert_eq!(most_sampled(SdcCheck::Full, "w", &bbox, 9), 9);
        assert_eq!(most_sampled(SdcCheck::Off, "w", &bbox, 9), 0);
        assert_eq!(most_sampled(SdcCheck::Sample(0.1), "w", &bbox, 0), 0);
    }
}
