//! Helpers for `scripts/bench-fuse.sh`: make benchmark checkpoints, read a step the way
//! `ckpt export` does, mount, and time random reads.
//!
//! ```text
//! fuse_bench make  STORE RUN STEP GIB        bf16 weights, 2-way tensor parallel
//! fuse_bench many  STORE RUN STEP N          N small tensors (for ls -R)
//! fuse_bench view  STORE RUN STEP            read the whole SafetensorsView into memory
//! fuse_bench mount STORE MOUNTPOINT CACHE    mount_blocking (until umount or Ctrl-C)
//! fuse_bench rand  FILE COUNT SIZE SEED [direct]   random reads; latency percentiles
//! ```

use ckpt_store::model::cut_box as cut;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::time::Instant;

use bytes::Bytes;
use ckpt_store::placement::{TensorSpec, place_rank};
use ckpt_store::{
    DType, DedupIndex, Layout, RankWrite, SafetensorsView, ShardDesc, ShardIn, StepReader,
};
use futures::StreamExt;
use futures::stream::FuturesOrdered;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn arg(a: &[String], i: usize, what: &str) -> Res<String> {
    a.get(i)
        .cloned()
        .ok_or_else(|| format!("missing argument {i}: {what}").into())
}

/// Weight-like bf16: random signs and mantissas, exponents of values around 0.01-0.05.
fn weights(seed: u64, n: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(n * 2);
    let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    while out.len() < n * 2 {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        for k in 0..4 {
            let r = (s >> (16 * k)) as u16;
            let sign = r & 0x8000;
            let exp = 120 + (r >> 7) % 4;
            let v = sign | (exp << 7) | (r & 0x7f);
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    out.truncate(n * 2);
    out
}

async fn save(
    store: &ckpt_store::Store,
    run: &str,
    step: u64,
    layout: Layout,
    specs: &[TensorSpec],
    data: impl Fn(usize, &TensorSpec) -> Vec<u8>,
) -> Res<()> {
    // Every shard is held in memory until written (a few GiB for the benchmark model).
    let mut per_rank: Vec<Vec<ShardIn>> = vec![Vec::new(); layout.world() as usize];
    let placed: Vec<_> = (0..layout.world())
        .map(|r| place_rank(&layout, r, specs))
        .collect::<Result<_, _>>()?;
    for (i, s) in specs.iter().enumerate() {
        let whole = data(i, s);
        for (r, ps) in placed.iter().enumerate() {
            for p in ps.iter().filter(|p| p.spec == i) {
                per_rank[r].push(ShardIn {
                    shard: ShardDesc::placed(s, p.bbox.clone(), p.replica_of),
                    data: p
                        .replica_of
                        .is_none()
                        .then(|| Bytes::from(cut(&whole, &s.shape, &p.bbox, s.dtype.size()))),
                });
            }
        }
    }
    for (r, shards) in per_rank.into_iter().enumerate() {
        let w = RankWrite::new(run, step, r as u32, layout);
        store
            .write_rank(&w, shards, vec![], &DedupIndex::new())
            .await?;
    }
    store.log().commit_step(run, step).await?;
    Ok(())
}

fn spec(
    name: String,
    shape: Vec<u64>,
    dtype: DType,
    tp_dim: Option<usize>,
    order: u32,
) -> TensorSpec {
    TensorSpec::first_stage(name, dtype, &shape)
        .with_tp(tp_dim)
        .with_order(order)
}

async fn make(a: &[String]) -> Res<()> {
    let store = ckpt_store::open(&arg(a, 2, "STORE")?)?;
    let run = arg(a, 3, "RUN")?;
    let step: u64 = arg(a, 4, "STEP")?.parse()?;
    let gib: f64 = arg(a, 5, "GIB")?.parse()?;
    // [4096, 4096] bf16 = 32 MiB each; column- and row-parallel alternately over tp=2.
    let n = ((gib * 1024.0) / 32.0).round().max(1.0) as usize;
    let specs: Vec<TensorSpec> = (0..n)
        .map(|i| {
            spec(
                format!(
                    "layers.{}.{}.weight",
                    i / 2,
                    if i % 2 == 0 { "up" } else { "down" }
                ),
                vec![4096, 4096],
                DType::Bf16,
                Some(i % 2),
                i as u32,
            )
        })
        .collect();
    let layout = Layout::new(1, 2, 1, 0)?;
    let t0 = Instant::now();
    save(&store, &run, step, layout, &specs, |i, s| {
        weights(
            i as u64 + 1,
            ckpt_store::NdBox::full(&s.shape).numel() as usize,
        )
    })
    .await?;
    eprintln!(
        "saved {n} tensors ({gib} GiB) in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

async fn many(a: &[String]) -> Res<()> {
    let store = ckpt_store::open(&arg(a, 2, "STORE")?)?;
    let run = arg(a, 3, "RUN")?;
    let step: u64 = arg(a, 4, "STEP")?.parse()?;
    let n: usize = arg(a, 5, "N")?.parse()?;
    let specs: Vec<TensorSpec> = (0..n)
        .map(|i| {
            spec(
                format!("model.layers.{}.block.{}.weight", i / 10, i % 10),
                vec![64],
                DType::F32,
                None,
                i as u32,
            )
        })
        .collect();
    save(&store, &run, step, Layout::SINGLE, &specs, |i, _| {
        weights(i as u64 + 7, 128)
    })
    .await?;
    Ok(())
}

/// What `ckpt export` does without writing: 16 MiB blocks of the view, 8 in flight, in order.
async fn view(a: &[String]) -> Res<()> {
    let store = ckpt_store::open(&arg(a, 2, "STORE")?)?;
    let run = arg(a, 3, "RUN")?;
    let step: u64 = arg(a, 4, "STEP")?.parse()?;
    let reader = StepReader::open(&store, &run, step).await?;
    let v = SafetensorsView::new(reader.commit(), None)?;
    const BLOCK: u64 = 16 << 20;
    let t0 = Instant::now();
    let mut q = FuturesOrdered::new();
    let mut next = 0u64;
    let mut done = 0u64;
    loop {
        while q.len() < 8 && next < v.len() {
            let start = next;
            next = (next + BLOCK).min(v.len());
            let len = (next - start) as usize;
            let (reader, v) = (&reader, &v);
            q.push_back(async move {
                let mut buf = vec![0u8; len];
                v.read_at(reader, start, &mut buf).await.map(|(n, _)| n)
            });
        }
        let Some(r) = q.next().await else { break };
        done += r? as u64;
    }
    let s = t0.elapsed().as_secs_f64();
    println!("{} {:.3} {:.3}", done, s, done as f64 / s / 1e9);
    Ok(())
}

fn mount(a: &[String]) -> Res<()> {
    let store = ckpt_store::open(&arg(a, 2, "STORE")?)?;
    let opts = ckpt_fuse::MountOptions {
        mountpoint: arg(a, 3, "MOUNTPOINT")?.into(),
        cache_bytes: arg(a, 4, "CACHE")?.parse()?,
        allow_other: false,
    };
    ckpt_fuse::mount_blocking(store, &opts)?;
    Ok(())
}

fn rand(a: &[String]) -> Res<()> {
    let path = arg(a, 2, "FILE")?;
    let count: usize = arg(a, 3, "COUNT")?.parse()?;
    let size: usize = arg(a, 4, "SIZE")?.parse()?;
    let mut seed: u64 = arg(a, 5, "SEED")?.parse()?;
    let direct = a.get(6).is_some_and(|s| s == "direct");
    let mut o = std::fs::OpenOptions::new();
    o.read(true);
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    let f = o.open(&path)?;
    let len = f.metadata()?.len();
    let mut buf = vec![0u8; size];
    let mut lat = Vec::with_capacity(count);
    for _ in 0..count {
        seed = seed.wrapping_add(0x9E3779B97F4A7C15);
        let mut z = seed;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
        let off = (z ^ (z >> 31)) % (len - size as u64) / 4096 * 4096;
        let t = Instant::now();
        f.read_exact_at(&mut buf, off)?;
        lat.push(t.elapsed().as_secs_f64() * 1e6);
    }
    lat.sort_by(f64::total_cmp);
    let p = |q: f64| lat[((lat.len() - 1) as f64 * q) as usize];
    let mean = lat.iter().sum::<f64>() / lat.len() as f64;
    println!("{:.1} {:.1} {:.1} {:.1}", p(0.5), p(0.9), p(0.99), mean);
    Ok(())
}

fn main() -> Res<()> {
    let a: Vec<String> = std::env::args().collect();
    let rt = || {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
    };
    match a.get(1).map(String::as_str) {
        Some("make") => rt()?.block_on(make(&a)),
        Some("many") => rt()?.block_on(many(&a)),
        Some("view") => rt()?.block_on(view(&a)),
        Some("mount") => mount(&a),
        Some("rand") => rand(&a),
        _ => Err("usage: fuse_bench make|many|view|mount|rand ... (see the source)".into()),
    }
}
