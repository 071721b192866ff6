//! Any box of a saved tensor restores bit for bit, whichever way its chunks reach the target:
//! into plain host memory (each chunk's runs written straight from it as it is hashed) and into
//! a sink that pays per write (the box gathered in pieces first). Random shapes of 1 to 3
//! dimensions, random boxes (rows cut short, columns cut, single elements), chunk sizes that cut
//! rows anywhere (up to 1 MiB: several hash blocks of a chunk), raw and compressed chunks, read
//! budgets from one chunk up, on a real local directory store.

mod common;

use std::sync::Arc;

use bytes::Bytes;
use ckpt_store::testing::Rng;
use ckpt_store::{DType, NdBox, ShardDesc, ShardIn, StepReader};
use ckpt_trainer::{HostTensor, MemorySink, RestoreTarget, restore_targets, runtime};

/// Host memory that does not say its short writes are cheap: the gathered path.
struct Gathered(HostTensor);

impl MemorySink for Gathered {
    fn len(&self) -> usize {
        MemorySink::len(&self.0)
    }

    fn write_at(&self, offset: usize, src: &[u8]) -> ckpt_store::Result<()> {
        self.0.write_at(offset, src)
    }
}

/// The bytes of box `bx` of a row-major tensor of `shape` (`elem` bytes an element), row-major.
fn cut(data: &[u8], shape: &[u64], bx: &NdBox, elem: usize) -> Vec<u8> {
    let mut out = Vec::new();
    let n = bx.numel();
    let mut idx = vec![0u64; shape.len()];
    for _ in 0..n {
        let flat = idx
            .iter()
            .zip(&bx.offsets)
            .zip(shape)
            .fold(0u64, |acc, ((i, o), s)| acc * s + i + o) as usize;
        out.extend_from_slice(&data[flat * elem..(flat + 1) * elem]);
        // The next index of the box, the last dimension fastest.
        for d in (0..idx.len()).rev() {
            idx[d] += 1;
            if idx[d] < bx.lengths[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    out
}

#[test]
fn random_boxes_restore_bit_for_bit_into_host_memory_and_gathered() {
    // A fixed seed: a failure names a case that fails again.
    let mut rng = Rng(0x5eed_0001);
    for case in 0..16u64 {
        let raw = case % 2 == 0;
        let dims = 1 + rng.below(3) as usize;
        // Up to about 1 MiB a tensor, so a chunk of 1 MiB spans several hash blocks of 256 KiB
        // and runs cross their boundaries.
        let side = [250_000, 500, 64][dims - 1];
        let shape: Vec<u64> = (0..dims).map(|_| 1 + rng.below(side)).collect();
        let n: u64 = shape.iter().product();
        let data: Vec<u8> = (0..n * 4)
            .map(|i| ((i * 31 + case * 7 + i / 997) % 253) as u8)
            .collect();
        let chunk = [4096usize, 12288, 65536, 1 << 20][rng.below(4) as usize];
        let dir = tempfile::tempdir().unwrap();
        let store = common::local_store(dir.path(), chunk, common::raw_or_compressed(raw));
        common::commit_one_rank(
            &store,
            vec![ShardIn {
                shard: ShardDesc::boxed("t", DType::F32, shape.clone(), NdBox::full(&shape)),
                data: Some(Bytes::from(data.clone())),
            }],
        );
        let reader = runtime()
            .block_on(StepReader::open(&store, "r", 1))
            .unwrap();
        for _ in 0..6 {
            let (mut offsets, mut lengths) = (Vec::new(), Vec::new());
            for &s in &shape {
                let o = rng.below(s);
                offsets.push(o);
                lengths.push(1 + rng.below(s - o));
            }
            let bx = NdBox { offsets, lengths };
            let want = cut(&data, &shape, &bx, 4);
            let budget = chunk << rng.below(5);
            for cheap in [true, false] {
                // Garbage first: a byte the restore does not write shows.
                let host = HostTensor::from_vec(vec![0xAB; want.len()]);
                let sink: Arc<dyn MemorySink> = if cheap {
                    Arc::new(host.clone())
                } else {
                    Arc::new(Gathered(host.clone()))
                };
                let target = RestoreTarget {
                    name: "t".into(),
                    dtype: DType::F32,
                    shape: shape.clone(),
                    bbox: bx.clone(),
                    sink,
                };
                let what = format!(
                    "case {case}: shape {shape:?}, box {bx}, chunks of {chunk}, budget {budget}, raw {raw}, host memory {cheap}"
                );
                let st = runtime()
                    .block_on(restore_targets(&reader, &[target], budget))
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                assert_eq!(st.bytes_copied, want.len() as u64, "{what}");
                assert!(*host.read() == want, "{what}: the bytes differ");
            }
        }
    }
}
