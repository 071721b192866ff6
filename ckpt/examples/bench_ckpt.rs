//! Writes a benchmark checkpoint: `GIB` GiB of bf16 weights saved by `RANKS` tensor-parallel
//! ranks (each tensor split by rows), with values drawn like trained weights (small normal-ish
//! numbers), so the codec sees what it sees in training. Used by scripts/bench-cli.sh.
//!
//! ```text
//! cargo run --release -p ckpt --example bench_ckpt -- STORE RUN STEP GIB RANKS
//! ```

use std::time::Instant;

use bytes::Bytes;
use ckpt::store::placement::{Placement, Stage, TensorSpec, place_rank};
use ckpt::store::{DType, DedupIndex, Layout, RankWrite, ShardDesc, ShardIn};

/// Tensor rows x columns (bf16): 64 MiB each.
const ROWS: u64 = 8192;
const COLS: u64 = 4096;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a: Vec<String> = std::env::args().skip(1).collect();
    if a.len() != 5 {
        return Err("usage: bench_ckpt STORE RUN STEP GIB RANKS".into());
    }
    let (url, run) = (&a[0], &a[1]);
    let step: u64 = a[2].parse()?;
    let gib: u64 = a[3].parse()?;
    let ranks: u32 = a[4].parse()?;
    let n = (gib << 30) / (ROWS * COLS * 2);
    let specs: Vec<TensorSpec> = (0..n)
        .map(|i| TensorSpec {
            name: format!("layers.{i}.mlp.weight"),
            dtype: DType::Bf16,
            shape: vec![ROWS, COLS],
            placement: Placement {
                order: i as u32,
                tp_dim: Some(0),
                stage: Stage::Layer {
                    index: i as u32,
                    of: n as u32,
                },
                zero: None,
            },
        })
        .collect();
    let layout = Layout::new(1, ranks, 1, 0)?;
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let store = ckpt::store::open(url)?;
        let t0 = Instant::now();
        let mut bytes = 0u64;
        for rank in 0..ranks {
            let shards: Vec<ShardIn> = place_rank(&layout, rank, &specs)?
                .into_iter()
                .map(|p| {
                    let s = &specs[p.spec];
                    let len = p.bbox.numel() as usize;
                    bytes += 2 * len as u64;
                    ShardIn {
                        shard: ShardDesc::placed(s, p.bbox, p.replica_of),
                        data: Some(Bytes::from(weights(
                            p.spec as u64 * 1000 + rank as u64 + step,
                            len,
                        ))),
                    }
                })
                .collect();
            let w = RankWrite::new(run.clone(), step, rank, layout);
            store
                .write_rank(&w, shards, vec![], &DedupIndex::new())
                .await?;
        }
        store.log().commit_step(run, step).await?;
        eprintln!(
            "wrote {run}@{step}: {} tensors, {:.2} GiB over {ranks} ranks in {:.1} s",
            n,
            bytes as f64 / (1u64 << 30) as f64,
            t0.elapsed().as_secs_f64()
        );
        Ok::<_, Box<dyn std::error::Error>>(())
    })
}

/// `n` bf16 values, roughly normal with std 0.02 (sum of uniforms), from a splitmix64 stream.
fn weights(seed: u64, n: usize) -> Vec<u8> {
    let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    let mut next = || {
        s = s.wrapping_add(0x9E3779B97F4A7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
        z ^ (z >> 31)
    };
    let mut out = Vec::with_capacity(2 * n);
    for _ in 0..n.div_ceil(4) {
        let r = next();
        for k in 0..4 {
            if out.len() >= 2 * n {
                break;
            }
            let u = ((r >> (16 * k)) & 0xffff) as f32 / 65536.0;
            let v = ((r.rotate_left(17 * k as u32 + 7)) & 0xffff) as f32 / 65536.0;
            let x = (u + v - 1.0) * 0.035;
            out.extend_from_slice(&half::bf16::from_f32(x).to_le_bytes());
        }
    }
    out
}
