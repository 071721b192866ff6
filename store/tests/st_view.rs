//! The virtual safetensors file of a sharded step parses with the reference `safetensors`
//! crate and holds every tensor's consolidated bytes, read whole or in odd pieces.

use bytes::Bytes;
use ckpt_store::testing::{det_bytes, memory_store, tiny_config};
use ckpt_store::{
    DType, DedupIndex, Layout, NdBox, RankWrite, SafetensorsView, ShardDesc, ShardIn, StepReader,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sharded_step_as_one_safetensors_file() {
    let store = memory_store(tiny_config());
    let layout = Layout::new(2, 2, 1, 0).unwrap();
    let w = det_bytes(1, 10 * 8 * 2); // bf16 [10, 8], rows by dp, columns by tp
    let v = det_bytes(2, 7 * 4); // f32 [7], 1-d ranges
    for rank in 0..4u32 {
        let c = layout.coords(rank);
        let bx = NdBox::new(vec![c.dp as u64 * 5, c.tp as u64 * 4], vec![5, 4]).unwrap();
        let mut data = Vec::new();
        for r in 0..5 {
            let row = (c.dp as usize * 5 + r) * 16 + c.tp as usize * 8;
            data.extend_from_slice(&w[row..row + 8]);
        }
        let (lo, hi) = [(0usize, 2usize), (2, 4), (4, 6), (6, 7)][rank as usize];
        let shards = vec![
            ShardIn {
                shard: ShardDesc::boxed("w", DType::Bf16, vec![10, 8], bx),
                data: Some(Bytes::from(data)),
            },
            ShardIn {
                shard: ShardDesc::boxed(
                    "v",
                    DType::F32,
                    vec![7],
                    NdBox::new(vec![lo as u64], vec![(hi - lo) as u64]).unwrap(),
                ),
                data: Some(Bytes::copy_from_slice(&v[lo * 4..hi * 4])),
            },
        ];
        let wr = RankWrite::new("st", 1, rank, layout);
        store
            .write_rank(&wr, shards, vec![], &DedupIndex::new())
            .await
            .unwrap();
    }
    store.log().commit_step("st", 1).await.unwrap();
    let reader = StepReader::open(&store, "st", 1).await.unwrap();
    let view = SafetensorsView::new(reader.commit(), None).unwrap();
    let mut file = vec![0u8; view.len() as usize];
    let (n, _) = view.read_at(&reader, 0, &mut file).await.unwrap();
    assert_eq!(n, file.len());
    let st = safetensors::SafeTensors::deserialize(&file).unwrap();
    assert_eq!(st.tensor("w").unwrap().data(), &w[..]);
    assert_eq!(st.tensor("w").unwrap().shape(), &[10, 8]);
    assert_eq!(st.tensor("v").unwrap().data(), &v[..]);
    // Odd pieces, crossing element, row, shard and tensor boundaries, equal the whole file.
    for piece in [1usize, 3, 7, 13, 64] {
        let mut out = Vec::new();
        let mut off = 0u64;
        loop {
            let mut buf = vec![0u8; piece];
            let (n, _) = view.read_at(&reader, off, &mut buf).await.unwrap();
            if n == 0 {
                break;
            }
            out.extend_from_slice(&buf[..n]);
            off += n as u64;
        }
        assert!(out == file, "piece {piece}");
    }
    // Only some tensors.
    let only = SafetensorsView::new(reader.commit(), Some(&["v".to_string()])).unwrap();
    let mut f2 = vec![0u8; only.len() as usize];
    only.read_at(&reader, 0, &mut f2).await.unwrap();
    let st2 = safetensors::SafeTensors::deserialize(&f2).unwrap();
    assert_eq!(st2.names().len(), 1);
    assert!(SafetensorsView::new(reader.commit(), Some(&["nope".to_string()])).is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_sharing_a_cache_fetch_each_chunk_once() {
    let store = memory_store(tiny_config());
    let data = det_bytes(9, 64 * 64 * 4);
    let wr = RankWrite::new("c", 1, 0, Layout::SINGLE);
    let shard = ShardIn {
        shard: ShardDesc::boxed("w", DType::F32, vec![64, 64], NdBox::full(&[64, 64])),
        data: Some(Bytes::from(data.clone())),
    };
    store
        .write_rank(&wr, vec![shard], vec![], &DedupIndex::new())
        .await
        .unwrap();
    store.log().commit_step("c", 1).await.unwrap();
    let cache = ckpt_store::ChunkCache::new(1 << 20);
    // Two "ranks" reading column halves: both need every chunk of the rows.
    let left = NdBox::new(vec![0, 0], vec![64, 32]).unwrap();
    let right = NdBox::new(vec![0, 32], vec![64, 32]).unwrap();
    let r1 = StepReader::open(&store, "c", 1)
        .await
        .unwrap()
        .with_cache(cache.clone());
    let r2 = StepReader::open(&store, "c", 1)
        .await
        .unwrap()
        .with_cache(cache.clone());
    let mut a = vec![0u8; 64 * 32 * 4];
    let mut b = vec![0u8; 64 * 32 * 4];
    let s1 = r1.read_into("w", &left, &mut a).await.unwrap();
    let s2 = r2.read_into("w", &right, &mut b).await.unwrap();
    assert_eq!(
        s1.stored_bytes as usize,
        data.len() + 16 * 4,
        "the first reader fetches every chunk"
    );
    assert_eq!(
        s2.stored_bytes, 0,
        "the second reader finds them all in the cache"
    );
    for row in 0..64 {
        assert_eq!(
            &a[row * 128..row * 128 + 128],
            &data[row * 256..row * 256 + 128]
        );
        assert_eq!(
            &b[row * 128..row * 128 + 128],
            &data[row * 256 + 128..row * 256 + 256]
        );
    }
}
