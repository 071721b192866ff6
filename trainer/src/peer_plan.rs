//! Where each region of a restore comes from when survivors still hold tensors in device
//! memory: pure planning and box arithmetic, compiled and tested without CUDA (the NCCL
//! exchange that executes a plan is `cuda::peer`, feature `cuda`).
//!
//! After a failure, the ranks of the new layout need boxes of every tensor. Where a survivor
//! still holds a needed region **in device memory, with the contents of the step being
//! restored**, it can send it over NCCL instead of the receiver fetching, hash-checking and
//! decompressing it from the store.
//!
//! - [`plan`] matches each needed box against the holdings, cutting it into regions sent by
//!   survivors (the least loaded one first when data-parallel replicas hold the same region;
//!   the receiver itself first) and regions left to the store, and estimates both ways with
//!   [`PeerCost`]: the peer path is taken only when every holding used is of exactly the step
//!   restored and `setup_s + busiest rank's sent or received bytes / link_bytes_per_s` is below
//!   `the busiest receiver's bytes / store_bytes_per_s`.
//! - [`rounds`] cuts the transfers into rounds of bounded temporary memory per rank.
//! - [`subtract`] is the box difference the planner cuts needed boxes with.

use std::collections::BTreeMap;
use std::ops::Range;

use ckpt_store::NdBox;

/// A region a rank holds in device memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holding {
    /// The rank (in the new communicator) holding it.
    pub rank: u32,
    /// Tensor name.
    pub tensor: String,
    /// The box held.
    pub bbox: NdBox,
    /// Bytes per element.
    pub elem: usize,
    /// The step whose values it holds.
    pub step: u64,
}

/// A box a rank of the new layout needs (the box it will hold).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Need {
    /// The rank.
    pub rank: u32,
    /// Tensor name.
    pub tensor: String,
    /// The box.
    pub bbox: NdBox,
    /// Bytes per element.
    pub elem: usize,
}

/// A region sent from one rank to another (or copied on one rank when `from == to`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transfer {
    /// Tensor name.
    pub tensor: String,
    /// The region (global coordinates).
    pub region: NdBox,
    /// Sender.
    pub from: u32,
    /// Receiver.
    pub to: u32,
    /// Bytes.
    pub bytes: u64,
}

/// A region a rank reads from the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreRead {
    /// The rank.
    pub rank: u32,
    /// Tensor name.
    pub tensor: String,
    /// The region (global coordinates).
    pub region: NdBox,
    /// Bytes.
    pub bytes: u64,
}

/// The figures the choice is made with.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PeerCost {
    /// NCCL bandwidth one rank sends or receives at (bytes/s).
    pub link_bytes_per_s: f64,
    /// Restore throughput from the store per rank (bytes/s).
    pub store_bytes_per_s: f64,
    /// Fixed cost of the peer path: creating the communicator (s).
    pub setup_s: f64,
}

impl Default for PeerCost {
    /// Conservative: 20 GB/s per rank over NCCL, 2 GB/s per rank from the store, 2 s of
    /// communicator setup.
    fn default() -> Self {
        PeerCost {
            link_bytes_per_s: 20e9,
            store_bytes_per_s: 2e9,
            setup_s: 2.0,
        }
    }
}

/// Where each needed region comes from.
#[derive(Debug, Clone, PartialEq)]
pub struct PeerPlan {
    /// The step restored.
    pub step: u64,
    /// Whether the peer path is taken (else `transfers` is empty).
    pub use_peers: bool,
    /// Why.
    pub reason: String,
    /// Regions from survivors, in the order every rank issues them.
    pub transfers: Vec<Transfer>,
    /// Regions from the store.
    pub store_reads: Vec<StoreRead>,
    /// Bytes sent between ranks (with the peer path).
    pub peer_bytes: u64,
    /// Bytes copied within a rank (with the peer path).
    pub local_bytes: u64,
    /// Estimated seconds of the transfers.
    pub est_peer_s: f64,
    /// Estimated seconds of reading the same regions from the store.
    pub est_store_s: f64,
}

/// `outer` minus `inner` (which lies inside it) as disjoint boxes.
pub fn subtract(outer: &NdBox, inner: &NdBox) -> Vec<NdBox> {
    let mut out = Vec::new();
    let mut rest = outer.clone();
    for d in 0..outer.ndim() {
        let (ro, rl) = (rest.offsets[d], rest.lengths[d]);
        let (io, il) = (inner.offsets[d], inner.lengths[d]);
        if io > ro {
            let mut b = rest.clone();
            b.lengths[d] = io - ro;
            out.push(b);
        }
        if ro + rl > io + il {
            let mut a = rest.clone();
            a.offsets[d] = io + il;
            a.lengths[d] = ro + rl - (io + il);
            out.push(a);
        }
        rest.offsets[d] = io;
        rest.lengths[d] = il;
    }
    out
}

/// Plan a restore of `step`: which needed regions survivors send, which come from the
/// store, and whether the peer path is worth it (see the module docs). Deterministic:
/// every rank computes the same plan from the same inputs.
pub fn plan(step: u64, needs: &[Need], holdings: &[Holding], cost: &PeerCost) -> PeerPlan {
    let usable: Vec<&Holding> = holdings.iter().filter(|h| h.step == step).collect();
    let stale = holdings.len() - usable.len();
    let mut sent: BTreeMap<u32, u64> = BTreeMap::new();
    let mut transfers = Vec::new();
    let mut reads = Vec::new();
    for n in needs.iter().filter(|n| !n.bbox.is_empty()) {
        cover(n, &usable, &mut sent, &mut transfers, &mut reads);
    }
    let (peer_bytes, local_bytes, est_peer_s, est_store_s) = estimate(&transfers, cost);
    let stale_note = if stale > 0 {
        format!(" ({stale} holdings of other steps ignored)")
    } else {
        String::new()
    };
    let (use_peers, reason) = if transfers.is_empty() {
        (
            false,
            format!(
                "no survivor holds a needed region of step {step} in device memory{stale_note}"
            ),
        )
    } else if est_peer_s < est_store_s {
        (
            true,
            format!(
                "peers send {peer_bytes} bytes (+{local_bytes} local) in ~{est_peer_s:.2} s, \
                 the store would take ~{est_store_s:.2} s{stale_note}"
            ),
        )
    } else {
        (
            false,
            format!(
                "the store (~{est_store_s:.2} s) is not slower than peers (~{est_peer_s:.2} s \
                 with setup){stale_note}"
            ),
        )
    };
    if !use_peers {
        // Everything from the store, one read per needed box.
        reads = needs
            .iter()
            .filter(|n| !n.bbox.is_empty())
            .map(|n| StoreRead {
                rank: n.rank,
                tensor: n.tensor.clone(),
                region: n.bbox.clone(),
                bytes: n.bbox.numel() * n.elem as u64,
            })
            .collect();
        transfers.clear();
    }
    PeerPlan {
        step,
        use_peers,
        reason,
        transfers,
        store_reads: reads,
        peer_bytes: if use_peers { peer_bytes } else { 0 },
        local_bytes: if use_peers { local_bytes } else { 0 },
        est_peer_s,
        est_store_s,
    }
}

/// Cover `n`'s box from the holdings of its tensor: its own rank's first, then the ranks that
/// sent least so far (`sent`); what no holding covers is read from the store.
fn cover(
    n: &Need,
    usable: &[&Holding],
    sent: &mut BTreeMap<u32, u64>,
    transfers: &mut Vec<Transfer>,
    reads: &mut Vec<StoreRead>,
) {
    let mut pieces = vec![n.bbox.clone()];
    let mut cands: Vec<&&Holding> = usable
        .iter()
        .filter(|h| h.tensor == n.tensor && h.elem == n.elem && h.bbox.intersect(&n.bbox).is_some())
        .collect();
    cands.sort_by_key(|h| {
        (
            h.rank != n.rank,
            sent.get(&h.rank).copied().unwrap_or(0),
            h.rank,
        )
    });
    for h in cands {
        let mut next = Vec::new();
        for p in pieces {
            match p.intersect(&h.bbox) {
                Some(i) if !i.is_empty() => {
                    let bytes = i.numel() * n.elem as u64;
                    if h.rank != n.rank {
                        *sent.entry(h.rank).or_default() += bytes;
                    }
                    next.extend(subtract(&p, &i));
                    transfers.push(Transfer {
                        tensor: n.tensor.clone(),
                        region: i,
                        from: h.rank,
                        to: n.rank,
                        bytes,
                    });
                }
                _ => next.push(p),
            }
        }
        pieces = next;
        if pieces.is_empty() {
            break;
        }
    }
    for p in pieces {
        let bytes = p.numel() * n.elem as u64;
        reads.push(StoreRead {
            rank: n.rank,
            tensor: n.tensor.clone(),
            region: p,
            bytes,
        });
    }
}

/// What `transfers` cost: (bytes between peers, bytes a rank holds itself, the peers' time
/// (setup plus the busiest rank's link time), the store's time for the rank receiving most).
fn estimate(transfers: &[Transfer], cost: &PeerCost) -> (u64, u64, f64, f64) {
    let mut busy: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
    let mut recv_all: BTreeMap<u32, u64> = BTreeMap::new();
    let (mut peer_bytes, mut local_bytes) = (0u64, 0u64);
    for t in transfers {
        *recv_all.entry(t.to).or_default() += t.bytes;
        if t.from == t.to {
            local_bytes += t.bytes;
        } else {
            peer_bytes += t.bytes;
            busy.entry(t.from).or_default().0 += t.bytes;
            busy.entry(t.to).or_default().1 += t.bytes;
        }
    }
    let busiest = busy.values().map(|(s, r)| (*s).max(*r)).max().unwrap_or(0);
    let est_peer_s = if peer_bytes > 0 {
        cost.setup_s + busiest as f64 / cost.link_bytes_per_s
    } else {
        0.0
    };
    let est_store_s = recv_all.values().copied().max().unwrap_or(0) as f64 / cost.store_bytes_per_s;
    (peer_bytes, local_bytes, est_peer_s, est_store_s)
}

/// Cut `transfers` into rounds in which no rank needs more than `budget` bytes of temporary
/// device buffers (a transfer larger than the budget gets a round of its own). The same on
/// every rank.
pub fn rounds(transfers: &[Transfer], budget: u64) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut used: BTreeMap<u32, u64> = BTreeMap::new();
    for (i, t) in transfers.iter().enumerate() {
        let over = |r: u32| used.get(&r).copied().unwrap_or(0) + t.bytes > budget;
        if i > start && (over(t.from) || over(t.to)) {
            out.push(start..i);
            start = i;
            used.clear();
        }
        *used.entry(t.from).or_default() += t.bytes;
        if t.to != t.from {
            *used.entry(t.to).or_default() += t.bytes;
        }
        if t.bytes > budget {
            out.push(start..i + 1);
            start = i + 1;
            used.clear();
        }
    }
    if start < transfers.len() {
        out.push(start..transfers.len());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn need(rank: u32, tensor: &str, off: &[u64], len: &[u64]) -> Need {
        Need {
            rank,
            tensor: tensor.into(),
            bbox: NdBox::new(off.to_vec(), len.to_vec()).unwrap(),
            elem: 4,
        }
    }

    fn holding(rank: u32, tensor: &str, off: &[u64], len: &[u64], step: u64) -> Holding {
        Holding {
            rank,
            tensor: tensor.into(),
            bbox: NdBox::new(off.to_vec(), len.to_vec()).unwrap(),
            elem: 4,
            step,
        }
    }

    fn fast_link() -> PeerCost {
        PeerCost {
            link_bytes_per_s: 100e9,
            store_bytes_per_s: 1e9,
            setup_s: 0.0,
        }
    }

    fn rng(seed: &mut u64) -> u64 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *seed
    }

    fn random_box(seed: &mut u64, shape: &[u64]) -> NdBox {
        let mut off = Vec::new();
        let mut len = Vec::new();
        for &s in shape {
            let o = rng(seed) % s;
            off.push(o);
            len.push(1 + rng(seed) % (s - o));
        }
        NdBox::new(off, len).unwrap()
    }

    #[test]
    fn the_plan_covers_every_needed_box_exactly_once() {
        let mut seed = 0x2545f4914f6cdd1du64;
        for case in 0..200 {
            let shape: Vec<u64> = (0..1 + case % 3).map(|_| 2 + rng(&mut seed) % 12).collect();
            let holdings: Vec<Holding> = (0..rng(&mut seed) % 6)
                .map(|i| {
                    let b = random_box(&mut seed, &shape);
                    holding(i as u32, "t", &b.offsets, &b.lengths, 3)
                })
                .collect();
            let needs: Vec<Need> = (0..1 + rng(&mut seed) % 4)
                .map(|r| {
                    let b = random_box(&mut seed, &shape);
                    need(r as u32 + 2, "t", &b.offsets, &b.lengths)
                })
                .collect();
            let p = plan(3, &needs, &holdings, &fast_link());
            for n in &needs {
                let mine: Vec<NdBox> = p
                    .transfers
                    .iter()
                    .filter(|t| t.to == n.rank && n.bbox.contains(&t.region))
                    .map(|t| t.region.clone())
                    .chain(
                        p.store_reads
                            .iter()
                            .filter(|r| r.rank == n.rank && n.bbox.contains(&r.region))
                            .map(|r| r.region.clone()),
                    )
                    .collect();
                let vol: u64 = mine.iter().map(NdBox::numel).sum();
                // Needs of one rank may overlap: count only pieces inside this need, which must
                // cover it; disjointness is checked per need below when the rank has one need.
                assert!(
                    vol >= n.bbox.numel(),
                    "case {case}: {n:?} not covered by {p:?}"
                );
                if needs.iter().filter(|m| m.rank == n.rank).count() == 1 {
                    assert_eq!(vol, n.bbox.numel(), "case {case}: overlap in {p:?}");
                    for (i, a) in mine.iter().enumerate() {
                        for b in &mine[i + 1..] {
                            assert!(a.intersect(b).is_none(), "case {case}: {a} and {b} overlap");
                        }
                    }
                }
            }
            for t in &p.transfers {
                assert!(
                    holdings
                        .iter()
                        .any(|h| h.rank == t.from && h.bbox.contains(&t.region)),
                    "case {case}: {t:?} is not held by its sender"
                );
                assert_eq!(t.bytes, t.region.numel() * 4);
            }
            assert_eq!(p.use_peers, !p.transfers.is_empty());
        }
    }

    #[test]
    fn subtracting_a_box_leaves_disjoint_boxes_of_the_rest() {
        let outer = NdBox::new(vec![0, 0, 0], vec![5, 6, 7]).unwrap();
        let inner = NdBox::new(vec![1, 2, 3], vec![2, 2, 2]).unwrap();
        let rest = subtract(&outer, &inner);
        assert_eq!(rest.len(), 6);
        let vol: u64 = rest.iter().map(NdBox::numel).sum();
        assert_eq!(vol + inner.numel(), outer.numel());
        for (i, a) in rest.iter().enumerate() {
            assert!(outer.contains(a) && a.intersect(&inner).is_none());
            for b in &rest[i + 1..] {
                assert!(a.intersect(b).is_none());
            }
        }
        assert!(subtract(&outer, &outer).is_empty());
    }

    #[test]
    fn holdings_of_another_step_are_never_used() {
        let needs = [need(1, "w", &[0, 0], &[8, 8])];
        let holdings = [holding(0, "w", &[0, 0], &[8, 8], 7)];
        let p = plan(6, &needs, &holdings, &fast_link());
        assert!(!p.use_peers);
        assert!(p.transfers.is_empty());
        assert!(
            p.reason.contains("1 holdings of other steps ignored"),
            "{}",
            p.reason
        );
        assert_eq!(p.store_reads.len(), 1);
        assert_eq!(p.store_reads[0].region, needs[0].bbox);
    }

    #[test]
    fn the_store_is_chosen_when_it_is_faster() {
        let needs = [need(1, "w", &[0, 0], &[1024, 1024])];
        let holdings = [holding(0, "w", &[0, 0], &[1024, 1024], 1)];
        let slow_link = PeerCost {
            link_bytes_per_s: 1e6,
            store_bytes_per_s: 10e9,
            setup_s: 2.0,
        };
        let p = plan(1, &needs, &holdings, &slow_link);
        assert!(!p.use_peers, "{p:?}");
        assert!(p.est_peer_s > p.est_store_s);
        assert_eq!(p.store_reads.len(), 1);
        let p = plan(1, &needs, &holdings, &fast_link());
        assert!(p.use_peers, "{p:?}");
        assert_eq!(p.peer_bytes, 4 << 20);
        assert!(p.store_reads.is_empty());
    }

    #[test]
    fn replicas_share_the_sending_and_a_rank_serves_itself_first() {
        // Four data-parallel survivors hold the whole tensor; four new ranks each need a quarter.
        let holdings: Vec<Holding> = (0..4)
            .map(|r| holding(r, "w", &[0, 0], &[64, 16], 1))
            .collect();
        let needs: Vec<Need> = (0..4)
            .map(|q| need(4 + q, "w", &[16 * q as u64, 0], &[16, 16]))
            .collect();
        let p = plan(1, &needs, &holdings, &fast_link());
        let mut senders: Vec<u32> = p.transfers.iter().map(|t| t.from).collect();
        senders.sort();
        assert_eq!(senders, vec![0, 1, 2, 3], "{p:?}");
        // Rank 1 holds the top half and needs rows 8..40: its own part is a local copy.
        let p = plan(
            1,
            &[need(1, "w", &[8, 0], &[32, 16])],
            &[
                holding(0, "w", &[0, 0], &[64, 16], 1),
                holding(1, "w", &[0, 0], &[32, 16], 1),
            ],
            &fast_link(),
        );
        assert_eq!(p.local_bytes, 24 * 16 * 4, "{p:?}");
        assert_eq!(p.peer_bytes, 8 * 16 * 4, "{p:?}");
        assert!(p.transfers.iter().any(|t| t.from == 1 && t.to == 1));
        // Regions nobody holds come from the store.
        let p = plan(
            1,
            &[need(2, "w", &[0, 0], &[64, 16])],
            &[holding(0, "w", &[0, 0], &[40, 16], 1)],
            &fast_link(),
        );
        assert!(p.use_peers);
        assert_eq!(p.store_reads.len(), 1);
        assert_eq!(
            p.store_reads[0].region,
            NdBox::new(vec![40, 0], vec![24, 16]).unwrap()
        );
    }

    #[test]
    fn rounds_bound_the_temporary_memory_of_every_rank() {
        let t = |from, to, bytes| Transfer {
            tensor: "t".into(),
            region: NdBox::full(&[bytes]),
            from,
            to,
            bytes,
        };
        let ts = vec![
            t(0, 1, 40),
            t(2, 3, 40),
            t(0, 2, 40),
            t(1, 1, 40),
            t(3, 0, 200),
            t(2, 1, 10),
        ];
        let r = rounds(&ts, 100);
        // The self-copy fits beside the first three; the oversized one goes alone.
        assert_eq!(r, vec![0..4, 4..5, 5..6]);
        for round in &r {
            let mut used = std::collections::BTreeMap::<u32, u64>::new();
            for x in &ts[round.clone()] {
                *used.entry(x.from).or_default() += x.bytes;
                if x.to != x.from {
                    *used.entry(x.to).or_default() += x.bytes;
                }
            }
            assert!(
                round.len() == 1 || used.values().all(|&u| u <= 100),
                "{round:?}"
            );
        }
        assert!(rounds(&[], 100).is_empty());
    }
}
