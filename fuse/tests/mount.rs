//! Real kernel mounts (root, /dev/fuse and fusermount3: each test skips with one line saying
//! what is missing, and fails instead where `CKPT_TEST_REQUIRE_ALL` is set, as in CI). Every mount is cleaned up by a guard, with `umount -l` as the last resort.

mod common;

use std::collections::BTreeSet;
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ckpt_fuse::{MountHandle, MountOptions, mounted_at, spawn_mount};
use ckpt_store::require;
use ckpt_store::testing::Need;
use ckpt_store::{DType, ErrorKind, Layout, StepReader, Store};
use common::*;

/// A mount that is always taken down.
struct Mounted {
    handle: Option<MountHandle>,
    path: PathBuf,
    _dir: tempfile::TempDir,
}

impl Mounted {
    fn new(store: Store, cache_bytes: u64) -> Mounted {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mnt");
        std::fs::create_dir(&path).unwrap();
        let opts = MountOptions {
            mountpoint: path.clone(),
            cache_bytes,
            allow_other: false,
        };
        let handle = spawn_mount(store, &opts).unwrap_or_else(|e| {
            panic!(
                "mounting failed: {e}. These tests need root, /dev/fuse and fusermount3 \
                 (scripts/install-test-deps.sh installs fuse3)"
            )
        });
        assert!(mounted_at(handle.mountpoint()).is_some());
        let path = handle.mountpoint().to_path_buf();
        Mounted {
            handle: Some(handle),
            path,
            _dir: dir,
        }
    }

    fn p(&self, rel: &str) -> PathBuf {
        self.path.join(rel)
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        drop(self.handle.take());
        if mounted_at(&self.path).is_some() {
            let _ = Command::new("umount").arg("-l").arg(&self.path).status();
        }
    }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Every path below `root`, relative, with whether it is a directory (symlinks not followed).
fn walk(root: &Path) -> BTreeSet<(String, bool)> {
    let mut out = BTreeSet::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let ft = e.file_type().unwrap();
            let rel = e
                .path()
                .strip_prefix(root)
                .unwrap()
                .to_string_lossy()
                .into_owned();
            out.insert((rel, ft.is_dir()));
            if ft.is_dir() {
                stack.push(e.path());
            }
        }
    }
    out
}

#[test]
fn sharded_checkpoint_through_the_kernel() {
    require!(Need::Fuse, "sharded_checkpoint_through_the_kernel");
    let rt = rt();
    let ts = test_store();
    let (e1, e2) = rt.block_on(sharded_run(&ts.store));
    let committed_ms = rt.block_on(async {
        StepReader::open(&ts.store, "train", 2)
            .await
            .unwrap()
            .commit()
            .committed_ms
    });
    let m = Mounted::new(ts.store.clone(), 1 << 20);

    // The whole tree, exactly.
    let mut want: BTreeSet<(String, bool)> = BTreeSet::new();
    want.insert(("train".into(), true));
    want.insert(("train/latest".into(), false));
    for (step, e) in [(1, &e1), (2, &e2)] {
        let s = format!("train/{step}");
        for d in ["", "/tensors", "/ranks", "/blobs"] {
            want.insert((format!("{s}{d}"), true));
        }
        want.insert((format!("{s}/COMMIT.json"), false));
        want.insert((format!("{s}/model.safetensors"), false));
        for n in e.tensors.keys() {
            want.insert((format!("{s}/tensors/{n}"), false));
        }
        for (r, per) in &e.rank_boxes {
            want.insert((format!("{s}/ranks/{r}"), true));
            for n in per.keys() {
                want.insert((format!("{s}/ranks/{r}/{n}"), false));
            }
        }
        for (r, n) in e.blobs.keys() {
            want.insert((format!("{s}/blobs/{r}"), true));
            want.insert((format!("{s}/blobs/{r}/{n}"), false));
        }
    }
    assert_eq!(walk(&m.path), want);

    // `latest` is a relative link to the newest committed step.
    assert_eq!(
        std::fs::read_link(m.p("train/latest")).unwrap(),
        PathBuf::from("2")
    );
    assert_eq!(
        std::fs::canonicalize(m.p("train/latest")).unwrap(),
        m.p("train/2")
    );
    assert!(!m.p("train/3").exists(), "an uncommitted step is hidden");

    // Every file's bytes and exact size; mtime is the commit time; read-only.
    for (n, t) in &e2.tensors {
        let p = m.p(&format!("train/latest/tensors/{n}"));
        let md = std::fs::metadata(&p).unwrap();
        assert_eq!(md.len(), t.bytes.len() as u64, "{n}");
        let mtime = md.modified().unwrap();
        assert_eq!(mtime, ckpt_fuse::CkptFs::commit_time(committed_ms), "{n}");
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&md.permissions()) & 0o777,
            0o444
        );
        assert!(std::fs::read(&p).unwrap() == t.bytes, "tensor {n}");
    }
    for (r, per) in &e2.rank_boxes {
        for n in per.keys() {
            let got = std::fs::read(m.p(&format!("train/2/ranks/{r}/{n}"))).unwrap();
            assert!(got == e2.rank_file(*r, n), "rank {r} {n}");
        }
    }
    for ((r, n), b) in &e1.blobs {
        assert_eq!(
            &std::fs::read(m.p(&format!("train/1/blobs/{r}/{n}"))).unwrap(),
            b
        );
    }
    let j: serde_json::Value =
        serde_json::from_slice(&std::fs::read(m.p("train/2/COMMIT.json")).unwrap()).unwrap();
    assert_eq!(j["step"], 2);
    assert_eq!(j["layout"]["tp"], 2);
    assert_eq!(j["layout"]["zero"], 1);

    // Writes are refused.
    let e = std::fs::OpenOptions::new()
        .write(true)
        .open(m.p("train/2/COMMIT.json"))
        .unwrap_err();
    assert!(
        matches!(e.raw_os_error(), Some(libc::EROFS) | Some(libc::EACCES)),
        "{e}"
    );
    assert!(std::fs::create_dir(m.p("train/new")).is_err());
    assert!(std::fs::remove_file(m.p("train/2/COMMIT.json")).is_err());
}

/// Python reads a safetensors file whole (`load(bytes)`) and memory-mapped (`load_file`),
/// printing every tensor's dtype, shape and bytes.
const PY_LOAD: &str = r#"
import json, sys
from safetensors.numpy import load, load_file
path = sys.argv[1]
with open(path, "rb") as f:
    whole = load(f.read())
mapped = load_file(path)
out = {}
for name, a in whole.items():
    b = mapped[name]
    assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), name
    out[name] = {"dtype": str(a.dtype), "shape": list(a.shape), "hex": a.tobytes().hex()}
print(json.dumps(out))
"#;

fn numpy_name(d: DType) -> &'static str {
    match d {
        DType::F64 => "float64",
        DType::F32 => "float32",
        DType::F16 => "float16",
        DType::I64 => "int64",
        DType::I32 => "int32",
        DType::U8 => "uint8",
        other => panic!("no numpy dtype for {other}"),
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn model_safetensors_equals_export_and_loads_in_python() {
    require!(
        Need::Fuse,
        "model_safetensors_equals_export_and_loads_in_python"
    );
    require!(
        Need::Python,
        "model_safetensors_equals_export_and_loads_in_python"
    );
    let rt = rt();
    let ts = test_store();
    // numpy has no bfloat16: the same 4-rank tp+ZeRO layout with f16 in its place.
    let specs: Vec<_> = specs()
        .into_iter()
        .map(|mut s| {
            if s.dtype == DType::Bf16 {
                s.dtype = DType::F16;
            }
            s
        })
        .collect();
    let exp = rt.block_on(save(&ts.store, "np", 7, layout(), &specs, 3, true));
    let export = rt.block_on(export_bytes(&ts.store, "np", 7));
    let m = Mounted::new(ts.store.clone(), 1 << 20);
    let model = m.p("np/7/model.safetensors");

    // cmp against the bytes export writes, through a file on disk like `ckpt export`'s.
    let exported = m._dir.path().join("export.safetensors");
    std::fs::write(&exported, &export).unwrap();
    let st = Command::new("cmp")
        .arg(&model)
        .arg(&exported)
        .status()
        .unwrap();
    assert!(
        st.success(),
        "cmp of the mounted model.safetensors and the export differ"
    );

    let out = Command::new(python())
        .arg("-c")
        .arg(PY_LOAD)
        .arg(&model)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "python failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let got = got.as_object().unwrap();
    assert_eq!(got.len(), exp.tensors.len());
    for (n, t) in &exp.tensors {
        let g = &got[n];
        assert_eq!(g["dtype"], numpy_name(t.dtype), "{n}");
        assert_eq!(g["shape"], serde_json::json!(t.shape), "{n}");
        assert_eq!(g["hex"].as_str().unwrap(), hex(&t.bytes), "{n}");
    }
}

fn read_range(f: &File, off: u64, len: usize) -> std::io::Result<Vec<u8>> {
    let mut buf = vec![0u8; len];
    f.read_exact_at(&mut buf, off)?;
    Ok(buf)
}

#[test]
fn random_reads_equal_the_exported_file() {
    require!(Need::Fuse, "random_reads_equal_the_exported_file");
    let rt = rt();
    let ts = test_store();
    rt.block_on(sharded_run(&ts.store));
    let export = rt.block_on(export_bytes(&ts.store, "train", 2));
    let m = Mounted::new(ts.store.clone(), 256 << 10);
    let path = m.p("train/2/model.safetensors");
    let buffered = File::open(&path).unwrap();
    let direct = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)
        .unwrap();
    let mut rng = Rng(1234);
    for i in 0..500 {
        let f = if i % 2 == 0 { &buffered } else { &direct };
        let off = rng.below(export.len() as u64);
        let max = export.len() as u64 - off;
        let len = rng.below(max.min(if i % 10 == 0 { 200_000 } else { 5000 }) + 1) as usize;
        let got = read_range(f, off, len).unwrap();
        assert!(
            got == export[off as usize..off as usize + len],
            "read {len} at {off} ({})",
            if i % 2 == 0 { "buffered" } else { "O_DIRECT" }
        );
    }
    // Reading past the end returns nothing.
    let mut buf = [0u8; 16];
    assert_eq!(buffered.read_at(&mut buf, export.len() as u64).unwrap(), 0);
    let st = m.handle.as_ref().unwrap().fs().cache_stats();
    assert!(st.bytes <= 256 << 10, "{st:?}");
}

#[test]
fn damaged_chunk_is_eio_for_exactly_the_reads_that_touch_it() {
    require!(
        Need::Fuse,
        "damaged_chunk_is_eio_for_exactly_the_reads_that_touch_it"
    );
    let rt = rt();
    let ts = test_store();
    let (_, e2) = rt.block_on(sharded_run(&ts.store));
    let d = rt.block_on(damage_chunk(&ts.store, "train", 2, "exp_avg.embed", 1));
    let export_len = rt.block_on(async {
        let r = StepReader::open(&ts.store, "train", 2).await.unwrap();
        ckpt_store::SafetensorsView::new(r.commit(), None)
            .unwrap()
            .len()
    });
    let m = Mounted::new(ts.store.clone(), 1 << 20);
    let t = &e2.tensors[&d.tensor];
    let tensor_path = m.p(&format!("train/2/tensors/{}", d.tensor));
    let model_path = m.p("train/2/model.safetensors");
    let open_direct = |p: &Path| {
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(p)
            .unwrap()
    };
    // O_DIRECT reads reach the filesystem with their exact offsets: byte-exact.
    let mut rng = Rng(99);
    let mut failed = 0;
    for (path, range, size) in [
        (&tensor_path, d.tensor_range.clone(), t.bytes.len() as u64),
        (&model_path, d.model_range.clone(), export_len),
    ] {
        let f = open_direct(path);
        for i in 0..150 {
            let off = if i % 2 == 0 {
                range.start.saturating_sub(2000) + rng.below(range.end - range.start + 4000)
            } else {
                rng.below(size)
            }
            .min(size - 1);
            let len = (1 + rng.below(3000)).min(size - off);
            let touches = off < range.end && off + len > range.start;
            match read_range(&f, off, len as usize) {
                Ok(got) => {
                    assert!(!touches, "{off}+{len} touches {range:?} but was read");
                    if path == &tensor_path {
                        assert!(got == t.bytes[off as usize..(off + len) as usize]);
                    }
                }
                Err(e) => {
                    assert!(touches, "{off}+{len} misses {range:?} but failed: {e}");
                    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
                    failed += 1;
                }
            }
        }
    }
    assert!(failed > 20, "{failed}");
    // Through the page cache the kernel reads whole pages: reads of pages that hold none of
    // the chunk's bytes succeed, even right next to it and after the kernel's read-ahead
    // tripped over it.
    let f = File::open(&tensor_path).unwrap();
    let page = 4096u64;
    let (lo, hi) = (
        d.tensor_range.start / page * page,
        d.tensor_range.end.div_ceil(page) * page,
    );
    assert!(
        lo > 0 && hi < t.bytes.len() as u64,
        "the damage is inside the file"
    );
    assert!(read_range(&f, d.tensor_range.start, 1).is_err());
    for _ in 0..200 {
        let off = rng.below(t.bytes.len() as u64);
        let len = 1 + rng.below((t.bytes.len() as u64 - off).min(6000));
        let touches_page = off < hi && off + len > lo;
        match read_range(&f, off, len as usize) {
            Ok(got) => {
                assert!(
                    !touches_page,
                    "{off}+{len} touches pages {lo}..{hi} but was read"
                );
                assert!(got == t.bytes[off as usize..(off + len) as usize]);
            }
            Err(e) => {
                assert!(
                    touches_page,
                    "{off}+{len} misses pages {lo}..{hi} but failed: {e}"
                );
                assert_eq!(e.raw_os_error(), Some(libc::EIO));
            }
        }
    }
    assert!(read_range(&f, 0, lo as usize).unwrap() == t.bytes[..lo as usize]);
    if hi < t.bytes.len() as u64 {
        assert!(
            read_range(&f, hi, (t.bytes.len() as u64 - hi) as usize).unwrap()
                == t.bytes[hi as usize..]
        );
    }
    let e = std::fs::read(&tensor_path).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EIO));
    // Everything else stays readable.
    for (n, t) in &e2.tensors {
        if *n != d.tensor {
            assert!(std::fs::read(m.p(&format!("train/2/tensors/{n}"))).unwrap() == t.bytes);
        }
    }
    for (r, n) in e2.blobs.keys() {
        std::fs::read(m.p(&format!("train/2/blobs/{r}/{n}"))).unwrap();
    }
}

#[test]
fn hostile_names_stay_inside_the_mount() {
    require!(Need::Fuse, "hostile_names_stay_inside_the_mount");
    let rt = rt();
    let ts = test_store();
    let exp = rt.block_on(hostile_run(&ts.store));
    let m = Mounted::new(ts.store.clone(), 1 << 20);
    let tree = walk(&m.path);
    for (rel, _) in &tree {
        let p = m.path.join(rel);
        // Every entry is a plain component, and resolves inside the mount.
        for c in Path::new(rel).components() {
            assert!(matches!(c, std::path::Component::Normal(_)), "{rel:?}");
        }
        let real = std::fs::canonicalize(&p).unwrap();
        assert!(real.starts_with(&m.path), "{rel:?} -> {}", real.display());
    }
    let files: Vec<String> = std::fs::read_dir(m.p("evil/1/tensors"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(files.len(), exp.tensors.len());
    let j: serde_json::Value =
        serde_json::from_slice(&std::fs::read(m.p("evil/1/COMMIT.json")).unwrap()).unwrap();
    for (n, t) in &exp.tensors {
        let file = j["fs_names"]["tensors"][n]
            .as_str()
            .map(String::from)
            .unwrap_or_else(|| n.clone());
        let got = std::fs::read(m.p(&format!("evil/1/tensors/{file}"))).unwrap();
        assert!(got == t.bytes, "{n:?} as {file:?}");
    }
    // The tensor called "../../../../etc/passwd" holds its own bytes, not the host's file.
    let passwd = std::fs::read(m.p("evil/1/tensors/..%2F..%2F..%2F..%2Fetc%2Fpasswd")).unwrap();
    assert!(passwd == exp.tensors["../../../../etc/passwd"].bytes);
    for ((_, n), b) in &exp.blobs {
        let file = j["fs_names"]["blobs"]["0"][n]
            .as_str()
            .map(String::from)
            .unwrap_or_else(|| n.clone());
        assert_eq!(
            &std::fs::read(m.p(&format!("evil/1/blobs/0/{file}"))).unwrap(),
            b
        );
    }
}

#[test]
fn two_readers_at_once() {
    require!(Need::Fuse, "two_readers_at_once");
    let rt = rt();
    let ts = test_store();
    let (_, e2) = rt.block_on(sharded_run(&ts.store));
    let export = rt.block_on(export_bytes(&ts.store, "train", 2));
    let m = Mounted::new(ts.store.clone(), 1 << 20);
    let exported = m._dir.path().join("export.safetensors");
    std::fs::write(&exported, &export).unwrap();
    let model = m.p("train/2/model.safetensors");
    // Two processes and two threads read the same files at the same time.
    let procs: Vec<_> = (0..2)
        .map(|_| {
            Command::new("cmp")
                .arg(&model)
                .arg(&exported)
                .stdout(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    std::thread::scope(|s| {
        for seed in 0..2u64 {
            let (m, e2, export) = (&m, &e2, &export);
            s.spawn(move || {
                let mut rng = Rng(seed);
                let f = File::open(m.p("train/2/model.safetensors")).unwrap();
                for _ in 0..200 {
                    let off = rng.below(export.len() as u64);
                    let len = rng.below((export.len() as u64 - off).min(8000) + 1) as usize;
                    assert!(
                        read_range(&f, off, len).unwrap()
                            == export[off as usize..off as usize + len]
                    );
                }
                for (n, t) in &e2.tensors {
                    let mut buf = Vec::new();
                    File::open(m.p(&format!("train/2/tensors/{n}")))
                        .unwrap()
                        .read_to_end(&mut buf)
                        .unwrap();
                    assert!(buf == t.bytes);
                }
            });
        }
    });
    for mut p in procs {
        assert!(
            p.wait().unwrap().success(),
            "a concurrent cmp saw different bytes"
        );
    }
}

#[test]
fn unmount_while_idle_and_refusal_while_busy() {
    require!(Need::Fuse, "unmount_while_idle_and_refusal_while_busy");
    let rt = rt();
    let ts = test_store();
    rt.block_on(sharded_run(&ts.store));
    let mut m = Mounted::new(ts.store.clone(), 1 << 20);
    let open = File::open(m.p("train/2/COMMIT.json")).unwrap();
    let e = m.handle.as_mut().unwrap().unmount().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Conflict, "{e}");
    assert!(e.to_string().contains("busy"), "{e}");
    // Still served.
    let mut s = String::new();
    (&open).read_to_string(&mut s).unwrap();
    assert!(s.contains("\"run\": \"train\""));
    drop(open);
    // The kernel sends the close (FUSE_RELEASE) on its own time: wait for the handle to go.
    let mut h = m.handle.take().unwrap();
    let t0 = std::time::Instant::now();
    while h.fs().open_handles() > 0 && t0.elapsed() < std::time::Duration::from_secs(10) {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(
        h.fs().open_handles(),
        0,
        "the closed file's handle was never released"
    );
    // Idle now: a clean unmount, and the session ends.
    h.unmount().unwrap();
    assert!(mounted_at(&m.path).is_none());
    assert_eq!(std::fs::read_dir(&m.path).unwrap().count(), 0);
    drop(h);
}

#[test]
fn mount_of_an_empty_store() {
    require!(Need::Fuse, "mount_of_an_empty_store");
    let ts = test_store();
    let m = Mounted::new(ts.store.clone(), 1 << 20);
    let md = std::fs::metadata(&m.path).unwrap();
    assert!(md.is_dir());
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&md.permissions()) & 0o777,
        0o555
    );
    assert_eq!(std::fs::read_dir(&m.path).unwrap().count(), 0);
    assert!(!m.p("anything").exists());
    let mut m = m;
    m.handle.take().unwrap().unmount().unwrap();
}

#[test]
fn busy_and_missing_mountpoints_are_refused_clearly() {
    require!(
        Need::Fuse,
        "busy_and_missing_mountpoints_are_refused_clearly"
    );
    let ts = test_store();
    let m = Mounted::new(ts.store.clone(), 1 << 20);
    let again = MountOptions {
        mountpoint: m.path.clone(),
        cache_bytes: 1 << 20,
        allow_other: false,
    };
    let e = spawn_mount(ts.store.clone(), &again).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Conflict);
    assert!(
        e.to_string().contains("busy") && e.to_string().contains("already mounted"),
        "{e}"
    );
    let missing = MountOptions {
        mountpoint: m._dir.path().join("missing"),
        ..again
    };
    let e = spawn_mount(ts.store.clone(), &missing).unwrap_err();
    assert!(e.to_string().contains("does not exist"), "{e}");
}

// ---- mount_blocking in a child process: signals and kill -9 ----

const CHILD_STORE: &str = "CKPT_FUSE_TEST_CHILD_STORE";
const CHILD_MOUNT: &str = "CKPT_FUSE_TEST_CHILD_MOUNT";

/// Not a test: the body of the child process the tests below start (`mount_blocking` as
/// `ckpt mount` runs it).
#[test]
#[ignore = "helper process for the mount_blocking tests"]
#[allow(
    clippy::disallowed_methods,
    reason = "a test reads its knobs and tools from the environment"
)]
fn child_mount_blocking() {
    let store = ckpt_store::open(&std::env::var(CHILD_STORE).unwrap()).unwrap();
    let opts = MountOptions {
        mountpoint: std::env::var(CHILD_MOUNT).unwrap().into(),
        cache_bytes: 1 << 20,
        allow_other: false,
    };
    ckpt_fuse::mount_blocking(store, &opts).unwrap();
}

struct Child {
    child: std::process::Child,
    mnt: PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if mounted_at(&self.mnt).is_some() {
            let _ = Command::new("umount").arg("-l").arg(&self.mnt).status();
        }
    }
}

fn start_child(store_dir: &Path) -> Child {
    let dir = tempfile::tempdir().unwrap();
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let mnt = mnt.canonicalize().unwrap();
    let child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "child_mount_blocking",
            "--nocapture",
        ])
        .env(CHILD_STORE, store_dir)
        .env(CHILD_MOUNT, &mnt)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let c = Child {
        child,
        mnt,
        _dir: dir,
    };
    let t0 = Instant::now();
    while mounted_at(&c.mnt).is_none() {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the child did not mount"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Serving, not just mounted (fusermount3 may still be handing the device over).
    assert_eq!(
        std::fs::read_dir(&c.mnt).unwrap().count(),
        1,
        "the child serves one run"
    );
    c
}

fn wait_unmounted(p: &Path, within: Duration) -> bool {
    let t0 = Instant::now();
    while mounted_at(p).is_some() {
        if t0.elapsed() > within {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

fn saved_store() -> (tempfile::TempDir, Expected) {
    let rt = rt();
    let dir = tempfile::tempdir().unwrap();
    let store = ckpt_store::open(dir.path().to_str().unwrap()).unwrap();
    let e = rt.block_on(save(
        &store,
        "train",
        4,
        Layout::SINGLE,
        &specs()[..4],
        4,
        true,
    ));
    (dir, e)
}

#[test]
fn mount_blocking_unmounts_cleanly_on_sigint_and_sigterm() {
    require!(
        Need::Fuse,
        "mount_blocking_unmounts_cleanly_on_sigint_and_sigterm"
    );
    let (store_dir, e) = saved_store();
    for sig in [libc::SIGTERM, libc::SIGINT] {
        let mut c = start_child(store_dir.path());
        let got = std::fs::read(c.mnt.join("train/latest/tensors/embed.weight")).unwrap();
        assert!(got == e.tensors["embed.weight"].bytes);
        // SAFETY: kill(2) on our own child's pid.
        assert_eq!(unsafe { libc::kill(c.child.id() as i32, sig) }, 0);
        let status = c.child.wait().unwrap();
        assert!(
            status.success(),
            "mount_blocking after signal {sig}: {status}"
        );
        assert!(
            mounted_at(&c.mnt).is_none(),
            "signal {sig} left the mount behind"
        );
        assert_eq!(std::fs::read_dir(&c.mnt).unwrap().count(), 0);
    }
}

#[test]
fn a_killed_mount_goes_away_by_itself() {
    require!(Need::Fuse, "a_killed_mount_goes_away_by_itself");
    assert!(
        ckpt_fuse::find_fusermount3().is_some(),
        "fusermount3 missing: install the fuse3 package (scripts/install-test-deps.sh)"
    );
    let (store_dir, _) = saved_store();
    let mut c = start_child(store_dir.path());
    c.child.kill().unwrap();
    c.child.wait().unwrap();
    if !wait_unmounted(&c.mnt, Duration::from_secs(10)) {
        let diag = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "ps -eo pid,ppid,stat,args | grep -v grep | grep fusermount3; \
                 for p in $(pgrep -x fusermount3); do echo fds of $p; ls -l /proc/$p/fd; done; \
                 grep {} /proc/self/mountinfo; ls -l /proc/{}/fd",
                c.mnt.display(),
                std::process::id()
            ))
            .output()
            .unwrap();
        panic!(
            "fusermount3's auto-unmount did not clear the mount of a killed process:\n{}",
            String::from_utf8_lossy(&diag.stdout)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mounting_from_inside_an_async_runtime() {
    require!(Need::Fuse, "mounting_from_inside_an_async_runtime");
    let ts = test_store();
    save(
        &ts.store,
        "train",
        1,
        Layout::SINGLE,
        &specs()[..2],
        1,
        true,
    )
    .await;
    let store = ts.store.clone();
    let m = Mounted::new(store, 1 << 20);
    let p = m.p("train/1/COMMIT.json");
    let got = tokio::task::spawn_blocking(move || std::fs::read(p))
        .await
        .unwrap()
        .unwrap();
    assert!(got.starts_with(b"{\n  \"checksum\""));
    // Dropping the guard here (in async context) unmounts too.
    drop(m);
}

/// A flipped bit in a step's commit record or in one of its rank manifests: through a fresh
/// mount every read of the step's tensors and of model.safetensors fails with EIO (never
/// returns bytes), and the other steps read exactly as saved.
#[test]
fn damaged_commit_record_or_manifest_is_eio_never_wrong_bytes() {
    use ckpt_store::ObjectStoreExt as _;
    let rt = rt();
    let ts = test_store();
    let (e1, e2) = rt.block_on(sharded_run(&ts.store));
    let commit = ts.store.keys().commit("train", 2);
    let manifest = ts.store.keys().rank_manifest("train", 2, 1);
    for key in [commit, manifest] {
        let orig = rt.block_on(ts.store.objects().get_object(&key)).unwrap();
        // The first shape's digits, the middle and the end of the object.
        let shape = orig
            .windows(8)
            .position(|w| w == b"\"shape\":")
            .expect("a shape");
        let digit = shape + orig[shape..].iter().position(u8::is_ascii_digit).unwrap();
        for (i, at) in [digit, digit + 1, orig.len() / 2, orig.len() - 2]
            .into_iter()
            .enumerate()
        {
            let mut bad = orig.to_vec();
            bad[at] ^= 1 << (i % 8);
            rt.block_on(ts.store.object_store().put(&key, bad.into()))
                .unwrap();
            let m = Mounted::new(ts.store.clone(), 1 << 20);
            let what = format!("bit {} of byte {at} of {key}", i % 8);
            let e = std::fs::read(m.p("train/2/model.safetensors"))
                .map(|b| b.len())
                .expect_err(&what);
            assert_eq!(e.raw_os_error(), Some(libc::EIO), "{what}: {e}");
            // Tensors held by the damaged rank (or all, for the record) fail too.
            let mut failed = 0;
            for (n, t) in &e2.tensors {
                match std::fs::read(m.p(&format!("train/2/tensors/{n}"))) {
                    Ok(b) => assert!(b == t.bytes, "{what}: {n} read wrong bytes"),
                    Err(e) => {
                        assert_eq!(e.raw_os_error(), Some(libc::EIO), "{what}: {n}: {e}");
                        failed += 1;
                    }
                }
            }
            assert!(failed > 0, "{what}: every tensor was read");
            for (n, t) in &e1.tensors {
                assert!(
                    std::fs::read(m.p(&format!("train/1/tensors/{n}"))).unwrap() == t.bytes,
                    "{what}: step 1's {n} differs"
                );
            }
        }
        rt.block_on(ts.store.object_store().put(&key, orig.into()))
            .unwrap();
    }
    let m = Mounted::new(ts.store.clone(), 1 << 20);
    for (n, t) in &e2.tensors {
        assert!(std::fs::read(m.p(&format!("train/2/tensors/{n}"))).unwrap() == t.bytes);
    }
}
