//! [`Governor`]: whether compressing pays, chunk by chunk, from what the current write measured.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use crate::codec::CodecPolicy;
use crate::store::StoreConfig;

/// Decides, chunk by chunk, whether compressing pays, from what the current write measured.
///
/// With compression the pipeline takes `max(S / (compress x cpus), S x ratio / sink)`
/// instead of `S / sink`, so compressing helps only when the compressor, on every CPU,
/// outruns the sink. On a local disk faster than the compressor chunks go raw; on a slow sink
/// (an object store) they are compressed. Only chunks that would wait for a busy writer are
/// candidates, and the first few writes go raw while the sink is measured.
///
/// The sink is measured from the writes themselves: each writer's bytes over the time its
/// writes took, times the writers. A saturated sink shares itself among the writers, so this
/// is its throughput; a sink the pipeline does not keep busy (the hashing still filling it, a
/// snapshot still copying) looks fast, as it is: no reason to compress. Bytes over the time
/// since the first write started would count the pipeline's filling as the sink's slowness:
/// a tiered save compressed its first chunks on a local disk, with the hashing short of CPU.
#[derive(Debug)]
pub(super) struct Governor {
    cpus: usize,
    written: AtomicU64,
    write_ns: AtomicU64,
    writes: AtomicU64,
    comp_bytes: AtomicU64,
    comp_ns: AtomicU64,
}

/// Writes measured before the sink's figure is trusted.
const MEASURED_WRITES: u64 = 8;

impl Governor {
    pub(super) fn new(cpus: usize) -> Self {
        Governor {
            cpus: cpus.max(1),
            written: Default::default(),
            write_ns: Default::default(),
            writes: Default::default(),
            comp_bytes: Default::default(),
            comp_ns: Default::default(),
        }
    }

    /// A write of `bytes` finished; it took `took` from its start (a writer's slot held).
    pub(super) fn record_write(&self, bytes: usize, took: Duration) {
        self.written.fetch_add(bytes as u64, Relaxed);
        self.write_ns.fetch_add(took.as_nanos() as u64, Relaxed);
        self.writes.fetch_add(1, Relaxed);
    }

    pub(super) fn record_compress(&self, bytes: usize, took: Duration) {
        self.comp_bytes.fetch_add(bytes as u64, Relaxed);
        self.comp_ns.fetch_add(took.as_nanos() as u64, Relaxed);
    }

    /// The sink's throughput (bytes/s) with every writer busy, once measured.
    fn sink(&self, writers: usize) -> Option<f64> {
        if self.writes.load(Relaxed) < MEASURED_WRITES {
            return None;
        }
        let secs = (self.write_ns.load(Relaxed) as f64 / 1e9).max(1e-9);
        Some(self.written.load(Relaxed) as f64 / secs * writers.max(1) as f64)
    }

    pub(super) fn policy(&self, cfg: &StoreConfig, writers_busy: bool) -> CodecPolicy {
        if !cfg.adaptive_codec || cfg.codec == CodecPolicy::Raw {
            return cfg.codec;
        }
        if !writers_busy {
            return CodecPolicy::Raw;
        }
        let Some(sink) = self.sink(cfg.write_concurrency) else {
            return CodecPolicy::Raw;
        };
        let (cb, cn) = (self.comp_bytes.load(Relaxed), self.comp_ns.load(Relaxed));
        // zstd-1 on byte planes, per core, on the machines measured (BENCHMARKS.md).
        let comp = if cn == 0 {
            400e6
        } else {
            cb as f64 / (cn as f64 / 1e9)
        };
        // Hashing and copying need CPU too: ask for a clear margin.
        if comp * self.cpus as f64 > sink * 1.5 {
            cfg.codec
        } else {
            CodecPolicy::Raw
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    fn cfg() -> StoreConfig {
        StoreConfig {
            cpu_threads: 2,
            write_concurrency: 8,
            ..StoreConfig::default()
        }
    }

    /// `n` writes of 4 MiB through `writers` writers sharing a sink of `gbps`.
    fn saturated(g: &Governor, n: usize, writers: usize, gbps: f64) {
        let took = Duration::from_secs_f64((4 * MIB * writers) as f64 / (gbps * 1e9));
        for _ in 0..n {
            g.record_write(4 * MIB, took);
        }
    }

    #[test]
    fn a_local_disk_takes_raw_chunks_and_a_slow_sink_compressed_ones() {
        let cfg = cfg();
        assert_ne!(
            cfg.codec,
            CodecPolicy::Raw,
            "the default compresses where it pays"
        );
        // Half of a 2 GB/s disk (another rank writes beside): 1 GB/s against 0.8 GB/s of zstd
        // on two cores.
        let disk = Governor::new(2);
        saturated(&disk, 16, 8, 1.0);
        assert_eq!(disk.policy(&cfg, true), CodecPolicy::Raw);
        // An object store at 100 MB/s.
        let slow = Governor::new(2);
        saturated(&slow, 16, 8, 0.1);
        assert_eq!(slow.policy(&cfg, true), cfg.codec);
        // Writers with a slot free: nothing waits, nothing to gain.
        assert_eq!(slow.policy(&cfg, false), CodecPolicy::Raw);
        // Measured compression slower than the sink: raw after all.
        slow.record_compress(4 * MIB, Duration::from_millis(400));
        assert_eq!(slow.policy(&cfg, true), CodecPolicy::Raw);
    }

    #[test]
    fn a_sink_is_not_judged_before_it_is_measured() {
        let cfg = cfg();
        let g = Governor::new(2);
        saturated(&g, MEASURED_WRITES as usize - 1, 8, 0.1);
        assert_eq!(g.policy(&cfg, true), CodecPolicy::Raw);
        saturated(&g, 1, 8, 0.1);
        assert_eq!(g.policy(&cfg, true), cfg.codec);
    }

    /// The pipeline's filling is not the sink's slowness: writes that come one at a time,
    /// each fast, while the hashing is short of CPU (the first chunks of a save) are a fast
    /// sink, however long the writes took to come.
    #[test]
    fn writes_that_trickle_in_from_a_slow_producer_do_not_make_a_fast_disk_look_slow() {
        let cfg = cfg();
        let g = Governor::new(2);
        for _ in 0..12 {
            // 4 MiB in 2.5 ms (one write on a 1.7 GB/s disk), then a wait for the next
            // chunk (a clock from the first write would count it against the disk).
            g.record_write(4 * MIB, Duration::from_micros(2500));
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(g.policy(&cfg, true), CodecPolicy::Raw);
    }
}
