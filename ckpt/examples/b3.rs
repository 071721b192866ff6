//! Raw blake3 throughput over a file, the way `verify` hashes: 4 MiB chunks, one per thread
//! at a time, data already in memory. The limit `ckpt verify` is compared with in
//! scripts/bench-cli.sh.
//!
//! ```text
//! cargo run --release -p ckpt --example b3 -- FILE [THREADS]
//! ```

use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let path = a.first().ok_or("usage: b3 FILE [THREADS]")?;
    let threads: usize = match a.get(1) {
        Some(t) => t.parse()?,
        None => std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    let data = std::fs::read(path)?;
    let chunks: Vec<&[u8]> = data.chunks(4 << 20).collect();
    let t0 = Instant::now();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let digest = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut x = 0u8;
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(c) = chunks.get(i) else { break x };
                        x ^= blake3::hash(c).as_bytes()[0];
                    }
                })
            })
            .collect();
        hs.into_iter().fold(0u8, |a, h| a ^ h.join().unwrap())
    });
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "blake3 {} threads: {:.3} GiB in {:.3} s = {:.0} MiB/s (xor of first bytes {digest})",
        threads,
        data.len() as f64 / (1u64 << 30) as f64,
        secs,
        data.len() as f64 / secs / (1u64 << 20) as f64
    );
    Ok(())
}
