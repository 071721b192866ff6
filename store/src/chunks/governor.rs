//! [`Governor`]: whether compressing pays, chunk by chunk, from what the current write measured.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use crate::codec::CodecPolicy;
use crate::store::StoreConfig;

/// Decides, chunk by chunk, whether compressing pays, from what the current write measured.
///
/// With compression the pipeline takes `max(S / (compress x cpus), S x ratio / sink)`
/// instead of `S / sink`, so compressing helps only when the compressor, on every CPU,
/// outruns the sink. On a local disk faster than the compressor chunks go raw; on a slow sink
/// (an object store) they are compressed. Only chunks that would wait for a busy writer are
/// candidates, and the first few writes go raw while the sink is measured.
#[derive(Debug)]
pub(super) struct Governor {
    t0: OnceLock<Instant>,
    cpus: usize,
    written: AtomicU64,
    writes: AtomicU64,
    comp_bytes: AtomicU64,
    comp_ns: AtomicU64,
}

impl Governor {
    pub(super) fn new(cpus: usize) -> Self {
        Governor {
            t0: OnceLock::new(),
            cpus: cpus.max(1),
            written: Default::default(),
            writes: Default::default(),
            comp_bytes: Default::default(),
            comp_ns: Default::default(),
        }
    }

    /// A write is about to start: the sink's clock starts with the first one.
    pub(super) fn write_started(&self) {
        self.t0.get_or_init(Instant::now);
    }

    pub(super) fn record_write(&self, bytes: usize) {
        self.written.fetch_add(bytes as u64, Relaxed);
        self.writes.fetch_add(1, Relaxed);
    }

    pub(super) fn record_compress(&self, bytes: usize, took: Duration) {
        self.comp_bytes.fetch_add(bytes as u64, Relaxed);
        self.comp_ns.fetch_add(took.as_nanos() as u64, Relaxed);
    }

    pub(super) fn policy(&self, cfg: &StoreConfig, writers_busy: bool) -> CodecPolicy {
        if !cfg.adaptive_codec || cfg.codec == CodecPolicy::Raw {
            return cfg.codec;
        }
        if !writers_busy || self.writes.load(Relaxed) < 8 {
            return CodecPolicy::Raw;
        }
        let Some(t0) = self.t0.get() else {
            return CodecPolicy::Raw;
        };
        let secs = t0.elapsed().as_secs_f64().max(1e-6);
        let sink = self.written.load(Relaxed) as f64 / secs;
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
