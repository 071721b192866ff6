//! Helpers shared by the trainer's integration tests (each test binary uses some of them).
#![allow(dead_code)]

use ckpt_store::{
    CodecPolicy, DType, DedupIndex, Layout, NdBox, RankWrite, ShardIn, StepReader, Store,
};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use ckpt_trainer::{HostTensor, MemorySink, RestoreTarget, runtime};

/// The bytes of tensor `name` of committed `step` of `run`, read through a `StepReader`;
/// panics naming the step and tensor when it cannot be read.
pub fn read(store: &Store, run: &str, step: u64, name: &str) -> Vec<u8> {
    runtime().block_on(async {
        StepReader::open(store, run, step)
            .await
            .unwrap_or_else(|e| panic!("step {step} of {run}: {e}"))
            .read_tensor(name)
            .await
            .unwrap_or_else(|e| panic!("step {step} tensor {name}: {e}"))
    })
}

/// A local store in `dir` (a real directory: `DirectFs`) with chunks of `chunk` bytes, every
/// chunk stored by `codec` (no adaptive choice).
/// Every chunk stored raw (read unchecked and hashed as it is copied), or every chunk
/// compressed (decoded, checked, then copied).
pub fn raw_or_compressed(raw: bool) -> CodecPolicy {
    if raw {
        CodecPolicy::Raw
    } else {
        CodecPolicy::Compress {
            level: 1,
            min_saving_permille: 1,
        }
    }
}

pub fn local_store(dir: &std::path::Path, chunk: usize, codec: CodecPolicy) -> Store {
    let store = ckpt_store::open(dir.to_str().unwrap()).unwrap();
    let mut cfg = store.config().clone();
    cfg.chunk_size = chunk;
    cfg.adaptive_codec = false;
    cfg.codec = codec;
    store.with_config(cfg).unwrap()
}

/// Write `shards` as the one rank of step 1 of run `r` and commit it.
pub fn commit_one_rank(store: &Store, shards: Vec<ShardIn>) {
    runtime().block_on(async {
        let w = RankWrite::new("r", 1, 0, Layout::SINGLE);
        store
            .write_rank(&w, shards, vec![], &DedupIndex::new())
            .await
            .unwrap();
        store.log().commit_step("r", 1).await.unwrap();
    });
}

/// Damage the object file at `path`: one bit of its payload flipped, 100 bytes from its end.
pub fn flip_a_byte(path: &std::path::Path) {
    let mut bytes = std::fs::read(path).unwrap();
    let at = bytes.len() - 100;
    bytes[at] ^= 0x01;
    std::fs::write(path, &bytes).unwrap();
}

/// Bytes this process has had read from the block device so far
/// (`/proc/self/io`: the whole process, so a test that counts them is its binary's only one).
pub fn disk_read_bytes() -> u64 {
    let io = std::fs::read_to_string("/proc/self/io").unwrap();
    io.lines()
        .find_map(|l| l.strip_prefix("read_bytes: "))
        .expect("read_bytes in /proc/self/io")
        .trim()
        .parse()
        .unwrap()
}

/// Host memory that counts the writes of many runs and the in-place writes (a chunk written
/// straight into the memory, hashed or decoded on the way).
#[derive(Debug)]
pub struct Counted {
    pub host: HostTensor,
    pub many: AtomicUsize,
    pub in_place: AtomicUsize,
}

impl Counted {
    pub fn new(host: HostTensor) -> Arc<Self> {
        Arc::new(Counted {
            host,
            many: AtomicUsize::new(0),
            in_place: AtomicUsize::new(0),
        })
    }

    /// Memory of `n` f32 elements that starts as garbage, and the target of the whole 1-D f32
    /// tensor `name` restored into it.
    pub fn whole_f32(name: &str, n: usize) -> (Arc<Self>, RestoreTarget) {
        let sink = Counted::new(HostTensor::from_vec(vec![0xAB; n * 4]));
        let target = RestoreTarget {
            name: name.into(),
            dtype: DType::F32,
            shape: vec![n as u64],
            bbox: NdBox::full(&[n as u64]),
            sink: sink.clone() as Arc<dyn MemorySink>,
        };
        (sink, target)
    }
}

impl MemorySink for Counted {
    fn len(&self) -> usize {
        MemorySink::len(&self.host)
    }

    fn write_at(&self, offset: usize, src: &[u8]) -> ckpt_store::Result<()> {
        self.host.write_at(offset, src)
    }

    fn write_many(&self, writes: &[(usize, &[u8])]) -> ckpt_store::Result<()> {
        self.many.fetch_add(1, Ordering::SeqCst);
        self.host.write_many(writes)
    }

    fn with_memory(
        &self,
        offset: usize,
        len: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> ckpt_store::Result<()>,
    ) -> Option<ckpt_store::Result<()>> {
        self.in_place.fetch_add(1, Ordering::SeqCst);
        self.host.with_memory(offset, len, fill)
    }

    fn short_writes_cheap(&self) -> bool {
        true
    }
}
