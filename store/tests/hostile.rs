//! A tampered store cannot crash a reader: every decoder of stored bytes (chunk objects, packs,
//! commit records, rank manifests) fed arbitrary bytes and mutated valid encodings returns an
//! error or the correct value, never panics, and allocates only what the bounds allow.

use bytes::Bytes;
use ckpt_store::codec::{self, CodecPolicy, HEADER_LEN};
use ckpt_store::pack::{PACK_HEADER_LEN, PackBuilder, parse_pack};
use ckpt_store::testing::det_bytes;
use ckpt_store::testing::fuzz::{apply, mutation};
use ckpt_store::writer::{RankWrite, ShardDesc, ShardIn};
use ckpt_store::{
    ChunkId, CommitRecord, DType, DedupIndex, Layout, NdBox, RankManifest, SafetensorsView,
    StepReader, Store,
};
use object_store::PutMode;
use proptest::prelude::*;

/// Data that each codec wants: runs of a few values, so zstd and byte planes get chosen.
fn chunk_data() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..600),
        prop::collection::vec(prop::sample::select(vec![0u8, 1, 0x3f, 0x80]), 0..3000),
        (1..4000usize, any::<u64>()).prop_map(|(n, seed)| {
            // bf16-like: random low bytes, few distinct high bytes.
            let r = det_bytes(seed, n * 2);
            r.chunks_exact(2)
                .flat_map(|p| [p[0], 0x3c | (p[1] & 1)])
                .collect()
        }),
    ]
}

/// A chunk header with fields drawn near the valid ones, then arbitrary payload.
fn chunk_like() -> impl Strategy<Value = Vec<u8>> {
    (
        any::<bool>(),
        0..5u8,
        prop::sample::select(vec![0u8, 1, 2, 3, 4, 8, 255]),
        0..3u8,
        prop_oneof![0..4096u64, any::<u64>()],
        prop::collection::vec(any::<u8>(), 0..300),
    )
        .prop_map(|(magic, codec, elem, transform, raw, payload)| {
            let mut v = Vec::with_capacity(HEADER_LEN + payload.len());
            v.extend_from_slice(if magic { b"CKPC" } else { b"CKPX" });
            v.extend_from_slice(&[1, codec, elem, transform]);
            v.extend_from_slice(&raw.to_le_bytes());
            v.extend_from_slice(&payload);
            v
        })
}

fn check_decoded(r: ckpt_store::Result<Vec<u8>>, id: &ChunkId, len: u64) {
    if let Ok(v) = r {
        assert_eq!(ChunkId::of(&v), *id, "a decoded chunk must hash to its id");
        assert_eq!(v.len() as u64, len);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: ckpt_store::testing::proptest_cases(3000), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn chunk_decoder_takes_arbitrary_bytes(
        obj in prop_oneof![prop::collection::vec(any::<u8>(), 0..400), chunk_like()],
        expect in prop_oneof![0..5000u64, any::<u64>()],
        seed in any::<u64>(),
    ) {
        let id = ChunkId::of(&seed.to_le_bytes());
        check_decoded(codec::decode(&obj, &id, expect, &"chunk"), &id, expect);
        if let Ok(v) = codec::decode_verify(&obj, &id, &"chunk") {
            prop_assert_eq!(ChunkId::of(&v), id);
        }
        let _ = codec::parse_header(&obj, &"chunk");
    }

    #[test]
    fn chunk_decoder_takes_mutated_chunks(
        data in chunk_data(),
        elem in prop::sample::select(vec![1usize, 2, 4, 8]),
        max in any::<bool>(),
        muts in prop::collection::vec(mutation(), 1..4),
    ) {
        let data = Bytes::from(data);
        let policy = if max { CodecPolicy::MAX } else { CodecPolicy::FAST };
        let mut obj = codec::encode(&data, elem, policy).to_bytes().to_vec();
        let id = ChunkId::of(&data);
        prop_assert_eq!(codec::decode(&obj, &id, data.len() as u64, &"c").unwrap(), data.to_vec());
        apply(&mut obj, &muts);
        // Err, or exactly the original bytes.
        if let Ok(v) = codec::decode(&obj, &id, data.len() as u64, &"c") {
            prop_assert_eq!(&v[..], &data[..]);
        }
        if let Ok(v) = codec::decode_verify(&obj, &id, &"c") {
            prop_assert_eq!(&v[..], &data[..]);
        }
    }

    #[test]
    fn pack_index_parser_takes_arbitrary_and_mutated_packs(
        sizes in prop::collection::vec(0..700usize, 0..6),
        muts in prop::collection::vec(mutation(), 0..4),
        raw in prop::collection::vec(any::<u8>(), 0..200),
        use_raw in any::<bool>(),
    ) {
        let mut b = PackBuilder::new();
        let datas: Vec<Vec<u8>> = sizes.iter().enumerate().map(|(i, &n)| det_bytes(i as u64, n)).collect();
        for d in &datas {
            let bytes = Bytes::from(d.clone());
            b.add(ChunkId::of(d), d.len() as u32, codec::encode(&bytes, 1, CodecPolicy::FAST));
        }
        let (_, _, parts) = b.seal();
        let mut obj: Vec<u8> = if use_raw { raw } else { parts.concat() };
        apply(&mut obj, &muts);
        if let Ok(entries) = parse_pack(&obj, &"pack") {
            for e in entries {
                // Every entry the parser accepts can be sliced and decoded without a panic.
                prop_assert!(e.offset >= PACK_HEADER_LEN as u64);
                let end = e.offset.checked_add(e.stored as u64).unwrap();
                prop_assert!(end <= obj.len() as u64);
                let slice = &obj[e.offset as usize..end as usize];
                check_decoded(codec::decode(slice, &e.id, e.raw as u64, &"p"), &e.id, e.raw as u64);
            }
        }
    }
}

/// A real two-rank step in memory: `w` f32 [rows, cols] split by rows at `cut`, and `b`.
async fn two_rank_step(rows: u64, cols: u64, cut: u64) -> (Store, Vec<u8>) {
    let store = ckpt_store::testing::memory_store(ckpt_store::testing::tiny_config());
    let layout = Layout::new(1, 2, 1, 0).unwrap();
    let whole = det_bytes(rows * 31 + cols, (rows * cols * 4) as usize);
    let row = (cols * 4) as usize;
    let index = DedupIndex::new();
    for rank in 0..2u32 {
        let (lo, n) = if rank == 0 {
            (0, cut)
        } else {
            (cut, rows - cut)
        };
        let shards = vec![ShardIn {
            shard: ShardDesc::boxed(
                "w",
                DType::F32,
                vec![rows, cols],
                NdBox::new(vec![lo, 0], vec![n, cols]).unwrap(),
            ),
            data: Some(Bytes::copy_from_slice(
                &whole[lo as usize * row..(lo + n) as usize * row],
            )),
        }];
        let w = RankWrite::new("h", 1, rank, layout);
        store.write_rank(&w, shards, vec![], &index).await.unwrap();
    }
    store.log().commit_step("h", 1).await.unwrap();
    (store, whole)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Values a hostile writer would pick for a length, count or offset.
fn hostile_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        0..40u64,
        any::<u64>(),
        Just(u64::MAX),
        Just(u64::MAX / 2 + 1),
        Just(1 << 32)
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: ckpt_store::testing::proptest_cases(2000), failure_persistence: None, ..ProptestConfig::default() })]

    /// Raw bytes and bit flips of a real commit record: Err, or the very same record.
    #[test]
    fn commit_record_decoder_takes_arbitrary_and_mutated_bytes(
        muts in prop::collection::vec(mutation(), 1..3),
        raw in prop::collection::vec(any::<u8>(), 0..300),
        use_raw in any::<bool>(),
    ) {
        let rt = runtime();
        let (store, _) = rt.block_on(two_rank_step(6, 3, 2));
        let key = store.keys().commit("h", 1);
        let orig = rt.block_on(store.objects().get_object(&key)).unwrap().to_vec();
        let good = CommitRecord::from_bytes(&orig, "good").unwrap();
        let mut obj = if use_raw { raw } else { orig.clone() };
        apply(&mut obj, &muts);
        match CommitRecord::from_bytes(&obj, "step 1 of run h") {
            Ok(c) => prop_assert_eq!(c, good),
            Err(e) => {
                prop_assert_eq!(e.kind(), ckpt_store::ErrorKind::Corrupt, "{}", e);
                prop_assert!(e.to_string().starts_with("step 1 of run h"), "{}", e);
            }
        }
    }

    /// A writer that computes valid checksums but puts hostile shapes, boxes, ranks, dtypes
    /// and lengths in the record (or in a manifest it pins): every reader gets an error or
    /// the correct bytes.
    #[test]
    fn readers_survive_hostile_values_behind_valid_checksums(
        rows in 1..9u64,
        cols in 1..5u64,
        cut_at in 0..9u64,
        shape in prop::collection::vec(hostile_u64(), 0..3),
        offsets in prop::collection::vec(hostile_u64(), 0..3),
        lengths in prop::collection::vec(hostile_u64(), 0..3),
        rank in prop_oneof![0..3u32, any::<u32>()],
        blob_len in hostile_u64(),
        dtype in prop::sample::select(DType::ALL.to_vec()),
        target in 0..8u8,
        chunk_len in any::<u32>(),
        chunk_offset in hostile_u64(),
    ) {
        let cut = cut_at % (rows + 1);
        let rt = runtime();
        let (store, whole) = rt.block_on(two_rank_step(rows, cols, cut));
        let key = store.keys().commit("h", 1);
        let orig = rt.block_on(store.objects().get_object(&key)).unwrap().to_vec();
        let mut c = CommitRecord::from_bytes(&orig, "good").unwrap();
        let t = &mut c.tensors[0];
        match target {
            0 => t.shape = shape,
            1 => t.shards[0].bbox.offsets = offsets,
            2 => t.shards[0].bbox.lengths = lengths,
            3 => t.shards[0].rank = rank,
            4 => t.dtype = dtype,
            5 => c.blobs.push(ckpt_store::BlobLoc { rank: 0, name: "x".into(), len: blob_len }),
            6 => {
                // A manifest with hostile chunk fields, pinned by its real hash.
                let mkey = store.keys().rank_manifest("h", 1, 1);
                let mb = rt.block_on(store.objects().get_object(&mkey)).unwrap();
                let mut m: RankManifest = serde_json::from_slice(&mb).unwrap();
                let ch = &mut m.tensors[0].chunks;
                if let Some(first) = ch.first_mut() {
                    first.len = chunk_len;
                    first.offset = chunk_offset;
                    if chunk_offset % 2 == 0 {
                        first.pack = Some(ckpt_store::PackId(first.id.0));
                    }
                }
                m.tensors[0].bbox.lengths = vec![rows, cols];
                let nb = serde_json::to_vec_pretty(&m).unwrap();
                c.ranks[1].hash = ckpt_store::Hash::of(&nb);
                c.ranks[1].size = nb.len() as u64;
                rt.block_on(store.objects().put_object(&mkey, vec![nb.into()], PutMode::Overwrite)).unwrap();
            }
            _ => c.layout.tp = rank,
        }
        let forged = c.seal().unwrap();
        rt.block_on(store.objects().put_object(&key, vec![forged.clone().into()], PutMode::Overwrite)).unwrap();
        if let Ok(c) = CommitRecord::from_bytes(&forged, "forged") {
            let _ = c.logical_bytes();
            let _ = SafetensorsView::new(&c, None);
        }
        let read = rt.block_on(async {
            let r = StepReader::open(&store, "h", 1).await?;
            r.read_tensor("w").await
        });
        if let Ok(v) = &read {
            prop_assert_eq!(v, &whole, "a reader returned wrong bytes");
        }
        // Whatever readers refuse, verify reports (and verify itself never panics).
        let report = rt
            .block_on(store.verify(&ckpt_store::VerifyScope::Step("h".into(), 1), None))
            .unwrap();
        if read.is_err() {
            prop_assert!(!report.is_clean(), "a step readers refuse passed verify");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: ckpt_store::testing::proptest_cases(2000), failure_persistence: None, ..ProptestConfig::default() })]

    /// Raw bytes and mutations of a real rank manifest: parsing and validation never panic;
    /// what validates can be walked the way the read engine walks it; and a reader that
    /// pins the manifest's hash (every reader of a committed step) gets an error or the very
    /// same manifest.
    #[test]
    fn rank_manifest_decoder_takes_arbitrary_and_mutated_bytes(
        muts in prop::collection::vec(mutation(), 1..3),
        raw in prop::collection::vec(any::<u8>(), 0..300),
        use_raw in any::<bool>(),
    ) {
        let rt = runtime();
        let (store, _) = rt.block_on(two_rank_step(6, 3, 2));
        let key = store.keys().rank_manifest("h", 1, 0);
        let orig = rt.block_on(store.objects().get_object(&key)).unwrap().to_vec();
        let good: RankManifest = serde_json::from_slice(&orig).unwrap();
        let mut obj = if use_raw { raw } else { orig.clone() };
        apply(&mut obj, &muts);
        if let Ok(m) = serde_json::from_slice::<RankManifest>(&obj)
            && m.validate("m").is_ok()
        {
            for t in &m.tensors {
                let _ = (t.byte_len(), t.bbox.to_string(), t.bbox.numel());
                let mut at = 0u64;
                for c in &t.chunks {
                    at = at.checked_add(c.len as u64).unwrap();
                }
                prop_assert_eq!(at, t.byte_len());
            }
        }
        rt.block_on(store.objects().put_object(&key, vec![obj.clone().into()], PutMode::Overwrite)).unwrap();
        let (c, _) = rt.block_on(store.log().read_commit("h", 1)).unwrap();
        match rt.block_on(store.log().read_rank_manifest("h", 1, 0, Some(&c.ranks[0]))) {
            Ok(m) => prop_assert_eq!(m, good),
            Err(e) => prop_assert_eq!(e.kind(), ckpt_store::ErrorKind::Corrupt, "{}", e),
        }
    }
}
