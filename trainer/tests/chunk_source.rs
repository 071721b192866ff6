//! A restore that takes chunks from a chunk source (a replica agent's memory, a local tier)
//! copies them unchecked and hashes them on the way, so a damaged copy from the source must
//! still never reach the caller: it is read again from the store, bit-exact, and counted as
//! the store's. On a real local directory store.

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use ckpt_store::{ChunkId, ChunkRef, ChunkSource, DType, NdBox, ShardDesc, ShardIn, StepReader};
use ckpt_trainer::{HostTensor, MemorySink, RestoreTarget, restore_targets};

const CHUNK: usize = 1 << 20;

/// Serves the chunks it was given; `damaged` ones with a byte flipped.
struct Source {
    chunks: HashMap<ChunkId, Bytes>,
    damaged: Vec<ChunkId>,
    /// The chunks the reader refused.
    refused: parking_lot::Mutex<Vec<ChunkId>>,
}

#[async_trait]
impl ChunkSource for Source {
    async fn fetch(&self, r: &ChunkRef) -> Option<Bytes> {
        let b = self.chunks.get(&r.id)?;
        if self.damaged.contains(&r.id) {
            let mut v = b.to_vec();
            v[b.len() / 2] ^= 0x10;
            return Some(Bytes::from(v));
        }
        Some(b.clone())
    }

    fn refused(&self, r: &ChunkRef) {
        self.refused.lock().push(r.id);
    }
}

#[test]
fn a_damaged_copy_from_a_chunk_source_is_read_again_from_the_store() {
    for raw in [true, false] {
        damaged_source_copy(raw);
    }
}

fn damaged_source_copy(raw: bool) {
    let dir = tempfile::tempdir().unwrap();
    let store = common::local_store(dir.path(), CHUNK, common::raw_or_compressed(raw));
    // 6 chunks of bytes that compress a little.
    let w: Vec<u8> = (0..6 * CHUNK).map(|i| ((i / 3) * 7 % 251) as u8).collect();
    let n = w.len() as u64 / 4;
    common::commit_one_rank(
        &store,
        vec![ShardIn {
            shard: ShardDesc::boxed("w", DType::F32, vec![n], NdBox::full(&[n])),
            data: Some(Bytes::copy_from_slice(&w)),
        }],
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    let reader = rt.block_on(StepReader::open(&store, "r", 1)).unwrap();
    let plan = rt.block_on(reader.plan("w", &NdBox::full(&[n]))).unwrap();
    assert_eq!(plan.chunks.len(), 6);
    // The source holds 5 of the 6 chunks, 2 of them damaged.
    let mut chunks = HashMap::new();
    for pc in &plan.chunks[..5] {
        let b = rt.block_on(store.chunks().get_chunk(&pc.chunk)).unwrap();
        chunks.insert(pc.chunk.id, b);
    }
    let damaged = vec![plan.chunks[1].chunk.id, plan.chunks[3].chunk.id];
    let src = Arc::new(Source {
        chunks,
        damaged: damaged.clone(),
        refused: Default::default(),
    });
    let reader = reader.with_source(src.clone());

    let host = Arc::new(HostTensor::from_vec(vec![0xAB; w.len()]));
    let t = [RestoreTarget {
        name: "w".into(),
        dtype: DType::F32,
        shape: vec![n],
        bbox: NdBox::full(&[n]),
        sink: host.clone() as Arc<dyn MemorySink>,
    }];
    let st = rt.block_on(restore_targets(&reader, &t, 64 << 20)).unwrap();
    assert!(*host.read() == w, "restored bytes differ (raw {raw})");
    // Only the source's good copies count as the source's; the store served the rest.
    assert_eq!(st.source_bytes, 3 * CHUNK as u64, "raw {raw}: {st:?}");
    let stored: u64 = [1, 3, 5]
        .iter()
        .map(|&i| u64::from(plan.chunks[i].chunk.stored))
        .sum();
    assert_eq!(st.stored_bytes, stored, "raw {raw}: {st:?}");
    assert_eq!(st.bytes_copied, w.len() as u64);
    // The source was told which of its copies were refused (it takes back what it counted).
    let mut refused = src.refused.lock().clone();
    refused.sort();
    let mut want = damaged;
    want.sort();
    assert_eq!(refused, want, "raw {raw}");
}
