//! Helpers shared by the trainer's integration tests (each test binary uses some of them).
#![allow(dead_code)]

use ckpt_store::{CodecPolicy, DedupIndex, Layout, RankWrite, ShardIn, StepReader, Store};
use ckpt_trainer::runtime;

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
        let w = RankWrite {
            run: "r".into(),
            step: 1,
            rank: 0,
            layout: Layout::SINGLE,
            generation: 0,
            node: None,
        };
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
