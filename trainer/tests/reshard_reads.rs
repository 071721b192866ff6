//! A resharded restore reads the chunks it needs only part of through the page cache, so the
//! other rank processes of the node, which need the other parts, find them there: the disk
//! serves each chunk once per node, as buffered reads of shared files do for DCP. Chunks a
//! restore needs whole still go around the page cache (`O_DIRECT`). Measured by the disk reads
//! the kernel counts for this process (`/proc/self/io`), on a real local directory store.

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use common::Counted;

use bytes::Bytes;
use ckpt_store::{CodecPolicy, DType, ErrorKind, NdBox, ShardDesc, ShardIn, StepReader, Store};
use ckpt_trainer::{HostTensor, MemorySink, RestoreTarget, restore_targets};

const CHUNK: usize = 1 << 20;
/// Rows and columns of each saved tensor: 4 MiB of f32, 4 chunks of 256 rows.
const ROWS: u64 = 1024;
const COLS: u64 = 1024;

/// Tensors `w` and `v`, each `ROWS` x `COLS` f32 of distinct bytes, saved by one rank as step 1
/// of run `r` (large objects are written with `O_DIRECT`: none of it is in the page cache).
fn save(store: &Store) -> Vec<Vec<u8>> {
    let data: Vec<Vec<u8>> = (0..2u64)
        .map(|t| {
            (0..ROWS * COLS * 4)
                .map(|i| ((i * 7 + t * 13 + i / 4093) % 251) as u8)
                .collect()
        })
        .collect();
    let shards = ["w", "v"]
        .iter()
        .zip(&data)
        .map(|(name, d)| ShardIn {
            shard: ShardDesc::boxed(
                *name,
                DType::F32,
                vec![ROWS, COLS],
                NdBox::full(&[ROWS, COLS]),
            ),
            data: Some(Bytes::copy_from_slice(d)),
        })
        .collect();
    common::commit_one_rank(store, shards);
    data
}

/// Restore `bbox` of `tensor` with a fresh reader (a rank process of its own: no chunk cache
/// shared with the others); its bytes and the disk reads it cost.
fn restore(
    store: &Store,
    rt: &tokio::runtime::Runtime,
    tensor: &str,
    bbox: NdBox,
) -> (Vec<u8>, u64) {
    let host = Arc::new(HostTensor::zeroed((bbox.numel() * 4) as usize));
    let target = RestoreTarget {
        name: tensor.into(),
        dtype: DType::F32,
        shape: vec![ROWS, COLS],
        bbox,
        sink: host.clone() as Arc<dyn MemorySink>,
    };
    let before = common::disk_read_bytes();
    let reader = rt.block_on(StepReader::open(store, "r", 1)).unwrap();
    rt.block_on(restore_targets(&reader, &[target], 64 << 20))
        .unwrap();
    let read = common::disk_read_bytes() - before;
    let bytes = host.read().clone();
    (bytes, read)
}

/// The columns `c0 .. c0 + n` of a row-major `ROWS` x `COLS` f32 tensor.
fn columns(data: &[u8], c0: u64, n: u64) -> Vec<u8> {
    let row = (COLS * 4) as usize;
    data.chunks(row)
        .flat_map(|r| r[(c0 * 4) as usize..((c0 + n) * 4) as usize].to_vec())
        .collect()
}

#[test]
fn the_ranks_of_a_resharded_restore_read_each_chunk_from_the_disk_once() {
    let dir = tempfile::tempdir().unwrap();
    let store = common::local_store(dir.path(), CHUNK, CodecPolicy::Raw);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let data = save(&store);
    let size = ROWS * COLS * 4;

    // `w` saved whole, restored as two column halves (Shard(0) -> Shard(1)): every chunk (a
    // block of rows) is needed half by each rank.
    let half = |r: u64| NdBox {
        offsets: vec![0, r * COLS / 2],
        lengths: vec![ROWS, COLS / 2],
    };
    let (got0, read0) = restore(&store, &rt, "w", half(0));
    assert_eq!(got0, columns(&data[0], 0, COLS / 2), "rank 0's columns");
    let (got1, read1) = restore(&store, &rt, "w", half(1));
    assert_eq!(
        got1,
        columns(&data[0], COLS / 2, COLS / 2),
        "rank 1's columns"
    );
    assert!(
        read0 >= size,
        "the first rank reads every chunk of w from the disk: {read0} bytes of {size}"
    );
    assert!(
        read1 < size / 8,
        "the second rank finds the chunks in the page cache: {read1} bytes read of {size}"
    );

    // `v` restored whole, twice: whole chunks go around the page cache, so a second reader
    // reads them again (a process that restores alone keeps the page cache for others).
    let full = NdBox::full(&[ROWS, COLS]);
    let (got, first) = restore(&store, &rt, "v", full.clone());
    assert_eq!(got, data[1]);
    let (got, second) = restore(&store, &rt, "v", full);
    assert_eq!(got, data[1]);
    assert!(
        first >= size && second >= size,
        "whole chunks are read with O_DIRECT each time: {first} and {second} bytes of {size}"
    );
}

/// A box cut across the saved rows (`Shard(0)` -> `Shard(1)`) in host memory is written
/// straight from each chunk as it is hash-checked: each chunk is fetched once, however small
/// the read budget (a restore that gathered the box in pieces of the budget fetched every
/// chunk once per piece it overlapped), the bytes are exact, and a damaged chunk is refused
/// with an error naming the tensor.
#[test]
fn a_box_cut_across_the_rows_fetches_each_chunk_once_and_refuses_a_damaged_one() {
    // Raw chunks arrive unchecked (hashed block by block as their runs are copied out);
    // compressed ones arrive decoded and checked.
    for raw in [true, false] {
        cut_across_the_rows(raw);
    }
}

fn cut_across_the_rows(raw: bool) {
    let dir = tempfile::tempdir().unwrap();
    let store = common::local_store(dir.path(), CHUNK, common::raw_or_compressed(raw));
    // The same step in a second store (a local tier's remote): what a damaged chunk is read
    // again from.
    let other = tempfile::tempdir().unwrap();
    let backup = common::local_store(other.path(), CHUNK, common::raw_or_compressed(raw));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let data = save(&store);
    save(&backup);
    let half = NdBox {
        offsets: vec![0, COLS / 2],
        lengths: vec![ROWS, COLS / 2],
    };
    let want = columns(&data[0], COLS / 2, COLS / 2);
    let restore_half = |budget: usize, fallback: bool| {
        let sink = Counted::new(HostTensor::from_vec(vec![0xAB; (ROWS * COLS * 2) as usize]));
        let target = RestoreTarget {
            name: "w".into(),
            dtype: DType::F32,
            shape: vec![ROWS, COLS],
            bbox: half.clone(),
            sink: sink.clone() as Arc<dyn MemorySink>,
        };
        let mut reader = rt.block_on(StepReader::open(&store, "r", 1)).unwrap();
        if fallback {
            reader = reader.with_fallback(backup.clone());
        }
        rt.block_on(restore_targets(&reader, &[target], budget))
            .map(|st| (st, sink))
    };
    // A budget of 1 MiB: a gathered piece would be 64 KiB, 32 rows of the half.
    let (st, sink) = restore_half(1 << 20, false).unwrap();
    assert!(*sink.host.read() == want, "rank 1's columns (raw {raw})");
    let chunks = ROWS * COLS * 4 / CHUNK as u64;
    assert_eq!(
        st.chunks, chunks,
        "each of the {chunks} chunks fetched once (raw {raw}): {st:?}"
    );
    assert_eq!(st.bytes_copied, ROWS * COLS * 2, "{st:?}");
    assert_eq!(
        st.stored_bytes < st.raw_bytes,
        !raw,
        "compressed chunks are stored smaller (raw {raw}): {st:?}"
    );
    // Raw chunks arrive unchecked and are hashed a block at a time, each block's runs
    // written at once (4 blocks of 256 KiB a chunk); compressed ones arrive checked and their
    // runs are written at once. Never the one-run path's fused copy.
    let many = sink.many.load(Ordering::SeqCst) as u64;
    let blocks = if raw { (CHUNK / (256 << 10)) as u64 } else { 1 };
    assert_eq!(many, chunks * blocks, "writes of many runs (raw {raw})");
    assert_eq!(sink.in_place.load(Ordering::SeqCst), 0, "raw {raw}");

    // A chunk of w damaged on the disk.
    let reader = rt.block_on(StepReader::open(&store, "r", 1)).unwrap();
    let plan = rt.block_on(reader.plan("w", &half)).unwrap();
    let object = dir
        .path()
        .join(store.keys().object_of(&plan.chunks[2].chunk).as_ref());
    common::flip_a_byte(&object);
    let e = restore_half(1 << 20, false).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "raw {raw}: {e}");
    assert!(
        e.to_string().contains("\"w\""),
        "the error names the tensor: {e}"
    );
    // With a fallback store the damaged chunk is read again from it, its runs written over
    // what the damaged bytes left, each byte counted once.
    let (st, sink) = restore_half(1 << 20, true).unwrap();
    assert!(
        *sink.host.read() == want,
        "rank 1's columns after the fallback (raw {raw})"
    );
    assert_eq!(st.fallback_chunks, 1, "{st:?}");
    assert_eq!(st.bytes_copied, ROWS * COLS * 2, "{st:?}");
}
