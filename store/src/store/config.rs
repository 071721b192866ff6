//! [`StoreConfig`]: the settings of a [`Store`](super::Store) and their checks.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::codec::{CodecPolicy, MAX_CHUNK_LEN};
use crate::error::{Error, Result};

/// Settings of a [`Store`](super::Store). Defaults suit a local disk; [`StoreConfig::for_remote`] suits
/// object stores.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StoreConfig {
    /// Chunk size for shards and blobs (default 4 MiB; at most 256 MiB).
    pub chunk_size: usize,
    /// Chunks smaller than this are packed (default 1 MiB).
    pub pack_threshold: usize,
    /// Packs are sealed when they reach this size (default 16 MiB).
    pub pack_target: usize,
    /// How hard to compress.
    pub codec: CodecPolicy,
    /// Decide per chunk from measured throughputs whether compressing pays (see `Governor`):
    /// on a sink faster than the compressor, chunks are stored raw (default on).
    pub adaptive_codec: bool,
    /// Object writes in flight (default 8).
    pub write_concurrency: usize,
    /// Object reads in flight (default 8).
    pub read_concurrency: usize,
    /// Threads hashing and encoding (default: the number of CPUs).
    pub cpu_threads: usize,
    /// Bytes of encoded chunks waiting to be written, at most (default 256 MiB).
    pub inflight_bytes: usize,
    /// Objects larger than this use multipart upload (default: never for local, 64 MiB remote).
    pub multipart_threshold: usize,
    /// Multipart part size (default 16 MiB).
    pub multipart_part: usize,
    /// A GC sweep lock not refreshed for this long is a killed GC's: a save deletes it and
    /// goes on (default 30 s; the GC refreshes its lock every sixth of it). See
    /// [`crate::lease`].
    pub sweep_lapse: Duration,
    /// The longest chain of delta chunks (issue 16): a float chunk whose region a committed
    /// base step holds may be stored as a delta on that step's chunk while the base's chain is
    /// shorter than this, so a restore reads at most `delta_chain + 1` objects per chunk and a
    /// whole chunk is stored at least every `delta_chain + 1` saves. 0 turns deltas off
    /// (the default: on the local disk the governor stores raw, and where deltas engage they
    /// cost restore time and a copy of the state, BENCHMARKS.md; `ckpt-train --delta-chain 8`
    /// turns them on). Deltas are tried only where the codec governor compresses, on a sample
    /// first (`codec::estimate_delta`).
    pub delta_chain: usize,
    /// Plain bytes of written float chunks kept in memory as the next save's delta bases, at
    /// most (default 0: a base is read back from the store, through its own chain).
    pub delta_cache_bytes: u64,
    /// A commit record larger than this is split into a root and parts of about this size
    /// (format 5, default 64 KiB): a restoring rank then reads the root and the parts of its
    /// own tensors, not the whole record (3.8 MB at 4,096 ranks of a 70B-like model).
    pub record_part_bytes: usize,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            chunk_size: 4 << 20,
            pack_threshold: 1 << 20,
            pack_target: 16 << 20,
            codec: CodecPolicy::FAST,
            adaptive_codec: true,
            write_concurrency: 8,
            read_concurrency: 8,
            cpu_threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
            inflight_bytes: 256 << 20,
            multipart_threshold: usize::MAX,
            multipart_part: 16 << 20,
            sweep_lapse: Duration::from_secs(30),
            delta_chain: 0,
            delta_cache_bytes: 0,
            record_part_bytes: 64 << 10,
        }
    }
}

impl StoreConfig {
    /// Settings for object stores: compress thoroughly (the network is the bottleneck), more
    /// requests in flight, multipart above 64 MiB.
    pub fn for_remote() -> Self {
        StoreConfig {
            codec: CodecPolicy::MAX,
            write_concurrency: 16,
            read_concurrency: 16,
            multipart_threshold: 64 << 20,
            ..StoreConfig::default()
        }
    }

    /// Byte ranges of the chunks of a buffer of `len` bytes (aligned to its start): how
    /// every shard and blob is cut.
    pub fn chunk_spans(&self, len: u64) -> impl Iterator<Item = std::ops::Range<u64>> + use<> {
        let cs = self.chunk_size as u64;
        let n = if len == 0 { 0 } else { len.div_ceil(cs) };
        (0..n).map(move |i| i * cs..((i + 1) * cs).min(len))
    }

    /// Check the settings.
    pub fn validate(&self) -> Result<()> {
        if self.chunk_size == 0 || self.chunk_size as u64 > MAX_CHUNK_LEN {
            return Err(Error::invalid(format!(
                "chunk size {} must be between 1 byte and {} MiB",
                self.chunk_size,
                MAX_CHUNK_LEN >> 20
            )));
        }
        if self.write_concurrency == 0 || self.read_concurrency == 0 || self.cpu_threads == 0 {
            return Err(Error::invalid("concurrency settings must be at least 1"));
        }
        if self.inflight_bytes < self.chunk_size {
            return Err(Error::invalid(format!(
                "in-flight budget {} must hold at least one chunk ({})",
                self.inflight_bytes, self.chunk_size
            )));
        }
        if self.inflight_bytes < self.pack_target + self.chunk_size {
            return Err(Error::invalid(format!(
                "in-flight budget {} must hold a pack ({}) and a chunk ({})",
                self.inflight_bytes, self.pack_target, self.chunk_size
            )));
        }
        if self.multipart_part < (5 << 20) && self.multipart_threshold != usize::MAX {
            return Err(Error::invalid("multipart parts must be at least 5 MiB"));
        }
        if self.delta_chain > crate::model::MAX_DELTA_CHAIN {
            return Err(Error::invalid(format!(
                "a delta chain of {} is longer than readers follow ({})",
                self.delta_chain,
                crate::model::MAX_DELTA_CHAIN
            )));
        }
        if self.record_part_bytes < 256 {
            return Err(Error::invalid(format!(
                "commit record parts of {} bytes are too small (at least 256)",
                self.record_part_bytes
            )));
        }
        if self.sweep_lapse < Duration::from_millis(60) {
            return Err(Error::invalid(format!(
                "a sweep lock's lapse of {:?} is too short to refresh it",
                self.sweep_lapse
            )));
        }
        Ok(())
    }
}
