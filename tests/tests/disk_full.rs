//! A local store on a real, small file system (a size-limited tmpfs) that fills up during a
//! save: the save fails with a "no space" error that says where, every committed step still
//! verifies and restores bit for bit, `ckpt gc` runs on the full disk (library and CLI) and
//! frees space, and the next save succeeds (issue 13.5, FORMAT.md "A full disk").

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use ckpt_store::testing::{Need, Tmpfs, det_bytes, tiny_config};
use ckpt_store::{ErrorKind, GcOptions, Layout, StepReader, Store, StoreConfig, VerifyScope};
use ckpt_tests::bin;
use ckpt_trainer::{Checkpointer, CheckpointerConfig, HostTensor, SaveState, SaveTensor, runtime};

const RUN: &str = "full";
const MIB: usize = 1 << 20;
const TIMEOUT: Duration = Duration::from_secs(60);

fn read(store: &Store, step: u64, name: &str) -> Vec<u8> {
    runtime().block_on(async {
        StepReader::open(store, RUN, step)
            .await
            .unwrap_or_else(|e| panic!("opening step {step}: {e}"))
            .read_tensor(name)
            .await
            .unwrap_or_else(|e| panic!("step {step} tensor {name}: {e}"))
    })
}

fn verify_step(store: &Store, step: u64) {
    let v = runtime()
        .block_on(store.verify(&VerifyScope::Step(RUN.into(), step), None))
        .unwrap();
    assert!(v.is_clean(), "step {step} is damaged: {v:?}");
}

/// Fill what is left of the file system holding `path` with a file that nothing deletes.
fn fill_up(path: &Path) {
    let mut f = std::fs::File::create(path).unwrap();
    let block = vec![0xa5u8; 64 << 10];
    loop {
        match f.write_all(&block) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
            Err(e) => panic!("filling {}: {e}", path.display()),
        }
    }
    // What a partial write took stays; the last page may hold a few bytes more.
    let _ = f.write_all(&block[..1]);
    let _ = f.sync_all();
}

/// A full disk after a failed save, with every committed step intact.
struct Full {
    _dir: tempfile::TempDir,
    fs: Tmpfs,
    root: PathBuf,
    store: Store,
    ck: Checkpointer,
    w: HostTensor,
    b: HostTensor,
    /// Step 1's and step 2's `w`.
    w1: Vec<u8>,
    w2: Vec<u8>,
}

/// Mount a 6 MiB tmpfs, commit steps 1 and 2 (about 1.1 MiB each, incompressible), then fail
/// step 3 (8 MiB more) on a full disk; plant a temporary file a crashed write would have left,
/// and fill the last free bytes with a file the store does not own. `None`: the test is
/// skipped (one line says why).
fn full_store(test: &str) -> Option<Full> {
    if !ckpt_store::testing::available(Need::TmpfsMount, test) {
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let fs = Tmpfs::mount(dir.path(), 6 << 20).expect("mount a tmpfs");
    let root = fs.path().join("store");
    let cfg = StoreConfig {
        chunk_size: 64 << 10,
        inflight_bytes: 512 << 10,
        ..tiny_config()
    };
    let store = ckpt_store::open(root.to_str().unwrap())
        .unwrap()
        .with_config(cfg)
        .unwrap();
    let w1 = det_bytes(1, MIB);
    let w2 = det_bytes(2, MIB);
    let w = HostTensor::from_vec(w1.clone());
    let b = HostTensor::from_vec(det_bytes(3, 100_000));
    let ck = Checkpointer::new(
        store.clone(),
        CheckpointerConfig::new(RUN, 0, Layout::SINGLE),
    )
    .unwrap();
    let state = |extra: Option<&HostTensor>| SaveState {
        tensors: [
            SaveTensor::bytes("w", &w, w.read().len() as u64),
            SaveTensor::bytes("b", &b, b.read().len() as u64),
        ]
        .into_iter()
        .chain(extra.map(|t| SaveTensor::bytes("big", t, t.read().len() as u64)))
        .collect(),
        blobs: vec![],
    };
    ck.save(1, state(None))
        .unwrap()
        .wait_committed(TIMEOUT)
        .unwrap();
    w.write().copy_from_slice(&w2);
    ck.save(2, state(None))
        .unwrap()
        .wait_committed(TIMEOUT)
        .unwrap();

    // A crash of an earlier write left a partial file.
    let real = std::fs::canonicalize(&root).unwrap();
    let planted = real.join("chunks/zz/0000#1");
    std::fs::create_dir_all(planted.parent().unwrap()).unwrap();
    std::fs::write(&planted, det_bytes(5, 100_000)).unwrap();

    // Step 3 does not fit.
    let big = HostTensor::from_vec(det_bytes(4, 8 * MIB));
    let e = ck
        .save(3, state(Some(&big)))
        .unwrap()
        .wait_committed(TIMEOUT)
        .expect_err("a save larger than the file system fails");
    assert_eq!(e.kind(), ErrorKind::NoSpace, "{e}");
    let want = format!(
        "no space left on the store's file system at {}",
        real.display()
    );
    assert!(e.to_string().contains(&want), "{e}\nshould say: {want}");
    // The failed save removed its own partial files.
    let temps = runtime().block_on(store.objects().temp_files()).unwrap();
    let temps: Vec<_> = temps.into_iter().map(|t| t.path).collect();
    assert_eq!(temps, vec![planted], "the failed save left partial files");
    assert!(
        !runtime()
            .block_on(store.objects().exists(&store.keys().commit(RUN, 3)))
            .unwrap(),
        "step 3 must not be committed"
    );

    // Nothing committed is damaged.
    for (step, want) in [(1, &w1), (2, &w2)] {
        verify_step(&store, step);
        assert_eq!(&read(&store, step, "w"), want, "step {step}");
        assert_eq!(
            read(&store, step, "b"),
            det_bytes(3, 100_000),
            "step {step}"
        );
    }

    // Something else takes the rest.
    fill_up(&fs.path().join("ballast"));
    assert_eq!(fs.free_bytes(), 0, "the file system must be full");
    assert!(
        std::fs::write(real.join("probe"), b"x").is_err(),
        "no data block may be left"
    );
    Some(Full {
        _dir: dir,
        fs,
        root: real,
        store,
        ck,
        w,
        b,
        w1,
        w2,
    })
}

impl Full {
    /// After GC freed space: step 4 saves and commits, and the store verifies clean.
    fn save_again(&self) {
        assert!(
            self.fs.free_bytes() >= MIB as u64,
            "gc freed only {} bytes",
            self.fs.free_bytes()
        );
        let w4 = det_bytes(6, MIB);
        self.w.write().copy_from_slice(&w4);
        let state = SaveState {
            tensors: vec![
                SaveTensor::bytes("w", &self.w, self.w.read().len() as u64),
                SaveTensor::bytes("b", &self.b, self.b.read().len() as u64),
            ],
            blobs: vec![],
        };
        self.ck
            .save(4, state)
            .unwrap()
            .wait_committed(TIMEOUT)
            .unwrap_or_else(|e| panic!("the save after gc: {e}"));
        let v = runtime()
            .block_on(self.store.verify(&VerifyScope::Store, None))
            .unwrap();
        assert!(v.is_clean(), "{v:?}");
        assert_eq!(read(&self.store, 1, "w"), self.w1);
        assert_eq!(read(&self.store, 2, "w"), self.w2);
        assert_eq!(read(&self.store, 4, "w"), w4);
        assert_eq!(read(&self.store, 4, "b"), det_bytes(3, 100_000));
    }
}

/// The library: `Gc::run` on the full disk takes its sweep lock, deletes the chunks the
/// failed step 3 wrote and the planted partial file; then a save succeeds.
#[test]
fn gc_runs_on_a_full_disk_and_the_next_save_succeeds() {
    let Some(full) = full_store("disk_full::gc_runs_on_a_full_disk_and_the_next_save_succeeds")
    else {
        return;
    };
    // No retention: nothing is deleted before the sweep lock is written, so the lock is
    // written on the full disk.
    // No save runs: a lease lapse of zero lets it delete the planted file at once.
    let opts = GcOptions {
        grace: Duration::ZERO,
        lease_lapse: Duration::ZERO,
        ..Default::default()
    };
    let later = ckpt_store::clock::system_now() + chrono::Duration::seconds(1);
    let g = runtime()
        .block_on(full.store.gc().run(&opts, later))
        .unwrap_or_else(|e| panic!("gc on a full disk: {e}"));
    assert_eq!(g.sweep_deferred, None, "{g:?}");
    assert!(g.steps_deleted.is_empty(), "{g:?}");
    // The chunks the failed step 3 wrote before the disk was full.
    assert!(g.bytes_freed >= 2 * MIB as u64, "{g:?}");
    assert_eq!(g.temp_files_deleted, 1, "{g:?}");
    assert!(
        std::fs::read_dir(full.root.join("locks")).map_or(true, |mut d| d.next().is_none()),
        "gc left its lock behind"
    );
    full.save_again();
}

/// The CLI: `ckpt gc` on the full disk succeeds and frees space; then a save succeeds.
#[test]
fn ckpt_gc_runs_on_a_full_disk() {
    let Some(full) = full_store("disk_full::ckpt_gc_runs_on_a_full_disk") else {
        return;
    };
    let out = Command::new(bin("ckpt", "ckpt"))
        .arg("--store")
        .arg(&full.root)
        .args(["gc", "--grace", "0", "--lease-lapse", "0", "--force"])
        .env("CKPT_LOG", "warn")
        .output()
        .expect("ckpt runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "ckpt gc on a full disk failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(stdout.contains("none to delete"), "{stdout}");
    assert!(!stdout.contains("deferred"), "{stdout}");
    assert!(stdout.contains("temporary  deleted 1 file(s)"), "{stdout}");
    full.save_again();
}
