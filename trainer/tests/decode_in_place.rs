//! A restore decodes a chunk stored encoded (byte planes, compressed) straight into the
//! tensor's memory, each block hashed as it is written: no buffer of the decoded chunk and no
//! second copy. A damaged or missing chunk is refused by name, or read again from the fallback
//! store (a local tier's remote) when the reader has one. On a real local directory store.

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::Bytes;
use ckpt_store::{DType, ErrorKind, NdBox, ReadStats, ShardDesc, ShardIn, StepReader, Store};
use ckpt_trainer::restore_targets;
use common::Counted;

const CHUNK: usize = 1 << 20;
/// Elements of the saved f32 tensor `w`: 4 MiB, 4 chunks.
const N: usize = 1 << 20;

/// Weights that byte planes compress (their exponent plane does), saved as step 1 of run `r`.
fn save(store: &Store) -> Vec<u8> {
    let data: Vec<u8> = (0..N)
        .flat_map(|i| ((i as f32 * 0.37).sin() * 0.02).to_le_bytes())
        .collect();
    let shard = ShardIn {
        shard: ShardDesc::boxed("w", DType::F32, vec![N as u64], NdBox::full(&[N as u64])),
        data: Some(Bytes::copy_from_slice(&data)),
    };
    common::commit_one_rank(store, vec![shard]);
    data
}

/// Restore the whole of `w` into memory that starts as garbage, with a fallback store or not.
fn restore(
    store: &Store,
    fallback: Option<&Store>,
    rt: &tokio::runtime::Runtime,
) -> ckpt_store::Result<(ReadStats, Arc<Counted>)> {
    let (sink, target) = Counted::whole_f32("w", N);
    let mut reader = rt.block_on(StepReader::open(store, "r", 1))?;
    if let Some(fb) = fallback {
        reader = reader.with_fallback(fb.clone());
    }
    rt.block_on(restore_targets(&reader, &[target], 64 << 20))
        .map(|st| (st, sink))
}

#[test]
fn encoded_chunks_are_decoded_into_the_tensor_and_bad_ones_refused_or_read_from_the_fallback() {
    for raw in [false, true] {
        decoded_in_place(raw);
    }
}

fn decoded_in_place(raw: bool) {
    let dir = tempfile::tempdir().unwrap();
    let store = common::local_store(dir.path(), CHUNK, common::raw_or_compressed(raw));
    let other = tempfile::tempdir().unwrap();
    let backup = common::local_store(other.path(), CHUNK, common::raw_or_compressed(raw));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let want = save(&store);
    save(&backup);
    let chunks = (N * 4 / CHUNK) as u64;

    let (st, sink) = restore(&store, None, &rt).unwrap();
    assert!(*sink.host.read() == want, "restored bit-exact (raw {raw})");
    assert_eq!(st.chunks, chunks, "{st:?}");
    assert_eq!(
        st.stored_bytes < st.raw_bytes,
        !raw,
        "compressed chunks are stored smaller (raw {raw}): {st:?}"
    );
    // Every chunk, encoded or raw, written straight into the tensor's memory (hashed on the
    // way), never through a buffer of its own and a second copy.
    assert_eq!(
        sink.in_place.load(Ordering::SeqCst) as u64,
        chunks,
        "raw {raw}"
    );

    let reader = rt.block_on(StepReader::open(&store, "r", 1)).unwrap();
    let plan = rt
        .block_on(reader.plan("w", &NdBox::full(&[N as u64])))
        .unwrap();
    let object = |i: usize| {
        dir.path()
            .join(store.keys().object_of(&plan.chunks[i].chunk).as_ref())
    };
    // A chunk damaged on the disk: refused, naming the tensor; read again from the fallback.
    common::flip_a_byte(&object(2));
    let e = restore(&store, None, &rt).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "raw {raw}: {e}");
    assert!(
        e.to_string().contains("\"w\""),
        "the error names the tensor: {e}"
    );
    let (st, sink) = restore(&store, Some(&backup), &rt).unwrap();
    assert!(*sink.host.read() == want, "after the fallback (raw {raw})");
    assert_eq!(st.fallback_chunks, 1, "raw {raw}: {st:?}");

    // A chunk missing from the store: the same. The damaged chunk is mended first (a second
    // flip), so that the error can only be about the missing one: the restore reads chunks
    // concurrently, and with both faults either may be found first.
    common::flip_a_byte(&object(2));
    std::fs::remove_file(object(1)).unwrap();
    let e = restore(&store, None, &rt).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "raw {raw}: {e}");
    assert!(
        e.to_string().contains("missing") && e.to_string().contains("\"w\""),
        "the error names what is missing and the tensor: {e}"
    );
    let (st, sink) = restore(&store, Some(&backup), &rt).unwrap();
    assert!(*sink.host.read() == want, "after the fallback (raw {raw})");
    assert_eq!(st.fallback_chunks, 1, "raw {raw}: {st:?}");
}
