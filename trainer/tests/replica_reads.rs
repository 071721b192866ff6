//! In a data-parallel layout every rank restores the replicated tensors whole. The manager
//! reads them through the page cache when other rank processes of the machine will read them
//! too (the disk serves them once for the node), and around it (`O_DIRECT`, faster for one
//! reader) when its process is the job's only one on the machine
//! (`ManagerConfig::node_processes == Some(1)`). Measured by the disk reads the kernel counts
//! for this process (`/proc/self/io`; one test in this binary, so nothing else reads), each
//! "rank process" a fresh manager with no chunk cache shared with the other.

mod common;

use std::sync::Arc;

use bytes::Bytes;
use ckpt_store::placement::TensorSpec;
use ckpt_store::{CodecPolicy, DType, Layout, NdBox, ShardDesc, ShardIn, Store};
use ckpt_trainer::{CheckpointManager, CheckpointerConfig, HostTensor, ManagerConfig};

const CHUNK: usize = 1 << 20;
/// `w`: 1024 x 1024 f32, 4 MiB in 4 chunks.
const SHAPE: [u64; 2] = [1024, 1024];
const SIZE: u64 = 1024 * 1024 * 4;

/// Rank `rank` of a dp=2 job restores step 1 of run `r` with a fresh manager: the bytes of `w`
/// and the disk reads the restore cost.
fn restore(store: &Store, rank: u32, node_processes: Option<u32>) -> (Vec<u8>, u64) {
    let layout = Layout::new(2, 1, 1, 0).unwrap();
    let mut cfg = ManagerConfig::new(CheckpointerConfig::new("r", rank, layout));
    cfg.final_on_sigterm = false;
    cfg.persist_governor = None;
    cfg.node_processes = node_processes;
    let mut m = CheckpointManager::new(store.clone(), cfg).unwrap();
    let w = HostTensor::zeroed(SIZE as usize);
    m.register(
        TensorSpec::first_stage("w", DType::F32, &SHAPE),
        NdBox::full(&SHAPE),
        Arc::new(w.clone()),
    )
    .unwrap();
    let before = common::disk_read_bytes();
    assert_eq!(m.restore_latest().unwrap(), Some(1));
    let read = common::disk_read_bytes() - before;
    let bytes = w.read().clone();
    (bytes, read)
}

#[test]
fn replicas_go_through_the_page_cache_only_when_another_process_of_the_machine_reads_them() {
    let dir = tempfile::tempdir().unwrap();
    let store = common::local_store(dir.path(), CHUNK, CodecPolicy::Raw);
    // Saved with O_DIRECT: none of the chunks is in the page cache.
    let data: Vec<u8> = (0..SIZE)
        .map(|i| ((i * 7 + i / 4093) % 251) as u8)
        .collect();
    common::commit_one_rank(
        &store,
        vec![ShardIn {
            shard: ShardDesc::boxed("w", DType::F32, SHAPE.to_vec(), NdBox::full(&SHAPE)),
            data: Some(Bytes::copy_from_slice(&data)),
        }],
    );

    // Each rank alone on its machine: around the page cache, so each reads all of `w` from
    // the disk (and leaves nothing cached for anyone).
    for rank in 0..2 {
        let (got, read) = restore(&store, rank, Some(1));
        assert!(got == data, "rank {rank} restored other bytes");
        assert!(
            read >= SIZE,
            "a rank alone reads the replicas with O_DIRECT: rank {rank} read {read} bytes of {SIZE} from the disk"
        );
    }

    // Two rank processes on one machine (`Some(2)`, and `None`: not known): the first reads
    // `w` from the disk through the page cache, the second finds it there.
    for np in [Some(2), None] {
        if np.is_none() {
            evict(dir.path());
        }
        let (got, first) = restore(&store, 0, np);
        assert!(got == data, "rank 0 restored other bytes ({np:?})");
        let (got, second) = restore(&store, 1, np);
        assert!(got == data, "rank 1 restored other bytes ({np:?})");
        assert!(
            first >= SIZE,
            "the first rank reads w from the disk ({np:?}): {first} bytes of {SIZE}"
        );
        assert!(
            second < SIZE / 8,
            "the second rank finds w in the page cache ({np:?}): {second} bytes read of {SIZE}"
        );
    }
}

/// Drop every file under `dir` from the page cache.
fn evict(dir: &std::path::Path) {
    use std::os::fd::AsRawFd;
    for e in walk(dir) {
        let f = std::fs::File::open(&e).unwrap();
        // SAFETY: advice on an open descriptor; it touches no memory of ours.
        let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        assert_eq!(rc, 0, "evicting {}", e.display());
    }
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}
