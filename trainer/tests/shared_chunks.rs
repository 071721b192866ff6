//! A chunk stored once for several places that hold the same bytes (the zeros of a frozen
//! layer's optimizer moments) is restored straight into each place: bit-exact, each byte
//! hash-checked, a damaged copy refused or read again from a fallback store, on a real local
//! directory store.

mod common;

use std::sync::Arc;

use bytes::Bytes;
use ckpt_store::{DType, ErrorKind, NdBox, ShardDesc, ShardIn, StepReader, Store};
use ckpt_trainer::{HostTensor, MemorySink, RestoreTarget, restore_targets};

const CHUNK: u64 = 1 << 20;

/// A host tensor that records the length of every write into it.
struct Recording {
    host: Arc<HostTensor>,
    writes: parking_lot::Mutex<Vec<usize>>,
}

impl MemorySink for Recording {
    fn len(&self) -> usize {
        self.host.len()
    }

    fn write_at(&self, offset: usize, src: &[u8]) -> ckpt_store::Result<()> {
        self.writes.lock().push(src.len());
        self.host.write_at(offset, src)
    }

    fn with_memory(
        &self,
        offset: usize,
        len: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> ckpt_store::Result<()>,
    ) -> Option<ckpt_store::Result<()>> {
        self.writes.lock().push(len);
        self.host.with_memory(offset, len, fill)
    }
}

/// A local store in `dir` with chunks of [`CHUNK`] bytes, all stored raw (read unchecked and
/// hashed as they are copied) or all compressed (decoded, checked, then copied).
fn open(dir: &std::path::Path, raw: bool) -> Store {
    common::local_store(dir, CHUNK as usize, common::raw_or_compressed(raw))
}

/// `zeros`: 4.5 chunks of zeros (four identical chunks and a tail); `w`: 2 chunks of other
/// bytes. Saved as step 1 of run `r`.
fn save(store: &Store) -> (Vec<u8>, Vec<u8>) {
    let zeros = vec![0u8; (CHUNK * 9 / 2) as usize];
    let w: Vec<u8> = (0..2 * CHUNK).map(|i| (i * 7 % 251) as u8).collect();
    let shard = |name: &str, data: &[u8]| {
        let n = data.len() as u64 / 4;
        ShardIn {
            shard: ShardDesc::boxed(name, DType::F32, vec![n], NdBox::full(&[n])),
            data: Some(Bytes::copy_from_slice(data)),
        }
    };
    common::commit_one_rank(store, vec![shard("zeros", &zeros), shard("w", &w)]);
    (zeros, w)
}

fn targets(zeros: &[u8], w: &[u8]) -> (Vec<RestoreTarget>, Vec<Arc<Recording>>) {
    let mut out = Vec::new();
    let mut hosts = Vec::new();
    for (name, data) in [("zeros", zeros), ("w", w)] {
        let n = data.len() as u64 / 4;
        // Garbage first: a byte the restore does not write shows.
        let host = Arc::new(Recording {
            host: Arc::new(HostTensor::from_vec(vec![0xAB; data.len()])),
            writes: Default::default(),
        });
        out.push(RestoreTarget {
            name: name.into(),
            dtype: DType::F32,
            shape: vec![n],
            bbox: NdBox::full(&[n]),
            sink: host.clone() as Arc<dyn MemorySink>,
        });
        hosts.push(host);
    }
    (out, hosts)
}

/// The path of the zero chunk's object in a local store at `dir`.
fn zero_chunk_object(store: &Store, dir: &std::path::Path) -> std::path::PathBuf {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let reader = rt.block_on(StepReader::open(store, "r", 1)).unwrap();
    let plan = rt
        .block_on(reader.plan("zeros", &NdBox::full(&[CHUNK * 9 / 8])))
        .unwrap();
    // The scenario: one chunk planned for several places.
    let shared = plan
        .chunks
        .iter()
        .find(|c| c.copies.len() > 1)
        .expect("the four zero chunks are one chunk with four copies");
    assert_eq!(shared.copies.len(), 4, "{:?}", shared.copies);
    let key = store.keys().object_of(&shared.chunk);
    dir.join(key.as_ref())
}

#[test]
fn a_chunk_shared_by_several_places_restores_into_each_bit_exact() {
    for raw in [true, false] {
        shared_chunk_restores(raw);
    }
}

fn shared_chunk_restores(raw: bool) {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), raw);
    let (zeros, w) = save(&store);
    let object = zero_chunk_object(&store, dir.path());
    assert!(object.exists(), "{}", object.display());

    let rt = tokio::runtime::Runtime::new().unwrap();
    let reader = rt.block_on(StepReader::open(&store, "r", 1)).unwrap();
    let (t, hosts) = targets(&zeros, &w);
    let st = rt.block_on(restore_targets(&reader, &t, 64 << 20)).unwrap();
    assert_eq!(st.bytes_copied, (zeros.len() + w.len()) as u64);
    assert_eq!(*hosts[0].host.read(), zeros);
    assert_eq!(*hosts[1].host.read(), w);
    // Each place of the shared chunk was written straight from the chunk (one copy of each
    // byte), not gathered into a buffer first: four writes of a chunk and the tail's.
    let mut writes = hosts[0].writes.lock().clone();
    writes.sort_unstable();
    let c = CHUNK as usize;
    assert_eq!(writes, [c / 2, c, c, c, c], "raw {raw}");
    // The shared chunk was read once, not once per place.
    assert_eq!(
        st.chunks, 4,
        "zero chunk, zero tail, two chunks of w (raw {raw}): {st:?}"
    );
}

#[test]
fn a_damaged_shared_chunk_is_refused_or_read_again_from_the_fallback() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), true);
    let (zeros, w) = save(&store);
    // A second store with the same objects (a local tier's remote).
    let other = tempfile::tempdir().unwrap();
    let backup = open(other.path(), true);
    save(&backup);
    let object = zero_chunk_object(&store, dir.path());
    common::flip_a_byte(&object);

    let rt = tokio::runtime::Runtime::new().unwrap();
    let reader = rt.block_on(StepReader::open(&store, "r", 1)).unwrap();
    let (t, _) = targets(&zeros, &w);
    let e = rt
        .block_on(restore_targets(&reader, &t, 64 << 20))
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    assert!(
        e.to_string().contains("zeros"),
        "the error names the tensor: {e}"
    );

    let reader = reader.with_fallback(backup);
    let (t, hosts) = targets(&zeros, &w);
    let st = rt.block_on(restore_targets(&reader, &t, 64 << 20)).unwrap();
    assert_eq!(st.fallback_chunks, 1, "{st:?}");
    assert_eq!(
        *hosts[0].host.read(),
        zeros,
        "every place of the shared chunk rewritten"
    );
    assert_eq!(*hosts[1].host.read(), w);
}
