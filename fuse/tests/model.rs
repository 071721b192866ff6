//! The filesystem model without a kernel: tree, contents, names, damage, cache, read-ahead.

mod common;

use std::collections::BTreeSet;
use std::ffi::OsStr;
use std::time::Duration;

use ckpt_fuse::{CkptFs, FsError, FsOptions, Kind, names};
use ckpt_store::{ErrorKind, StepReader};
use common::*;

fn opts(cache_bytes: u64) -> FsOptions {
    FsOptions {
        cache_bytes,
        readahead_min: 16 << 10,
        readahead_max: 64 << 10,
        ..FsOptions::default()
    }
}

fn names_of(v: &[ckpt_fuse::DirEntry]) -> Vec<String> {
    v.iter().map(|e| e.name.clone()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tree_of_a_sharded_run() {
    let ts = test_store();
    let (_, e2) = sharded_run(&ts.store).await;
    let fs = CkptFs::new(ts.store.clone(), opts(1 << 20));

    assert_eq!(names_of(&fs.list_path("").await.unwrap()), vec!["train"]);
    // Only committed steps; `latest` first.
    let run = fs.list_path("train").await.unwrap();
    assert_eq!(names_of(&run), vec!["latest", "1", "2"]);
    assert_eq!(run[0].kind, Kind::Symlink);
    let latest = fs.resolve("train/latest").await.unwrap();
    assert_eq!(fs.readlink(latest.ino).await.unwrap(), "2");
    assert_eq!(latest.size, 1);
    let e = fs.resolve("train/3").await.unwrap_err();
    assert!(matches!(e, FsError::NotFound(_)), "{e}");
    // Non-canonical step names do not alias.
    assert!(fs.resolve("train/02").await.is_err());
    assert!(fs.resolve("train/+2").await.is_err());

    assert_eq!(
        names_of(&fs.list_path("train/2").await.unwrap()),
        vec![
            "COMMIT.json",
            "model.safetensors",
            "tensors",
            "ranks",
            "blobs"
        ]
    );
    let tensors: Vec<String> = names_of(&fs.list_path("train/2/tensors").await.unwrap());
    assert_eq!(tensors, e2.tensors.keys().cloned().collect::<Vec<_>>());
    assert_eq!(
        names_of(&fs.list_path("train/2/ranks").await.unwrap()),
        vec!["0", "1", "2", "3"]
    );
    assert_eq!(
        names_of(&fs.list_path("train/2/blobs").await.unwrap()),
        vec!["0", "1", "2", "3"]
    );
    assert_eq!(
        names_of(&fs.list_path("train/2/blobs/3").await.unwrap()),
        vec!["big", "dataloader.json", "rng_state"]
    );
    for r in 0..4u32 {
        let files: BTreeSet<String> =
            names_of(&fs.list_path(&format!("train/2/ranks/{r}")).await.unwrap())
                .into_iter()
                .collect();
        let want: BTreeSet<String> = e2.rank_boxes[&r].keys().cloned().collect();
        assert_eq!(files, want, "rank {r}");
    }

    // Exact sizes, mtime = commit time, `..` of nested directories.
    let reader = StepReader::open(&ts.store, "train", 2).await.unwrap();
    let mtime = CkptFs::commit_time(reader.commit().committed_ms);
    for (name, t) in &e2.tensors {
        let a = fs
            .resolve(&format!("train/2/tensors/{name}"))
            .await
            .unwrap();
        assert_eq!(a.size, t.bytes.len() as u64, "{name}");
        assert_eq!(a.mtime, mtime);
        assert_eq!(a.kind, Kind::File);
    }
    let step = fs.resolve("train/2").await.unwrap();
    assert_eq!(step.mtime, mtime);
    let rank1 = fs.resolve("train/2/ranks/1").await.unwrap();
    let listing = fs.readdir(rank1.ino).await.unwrap();
    let ranks = fs.resolve("train/2/ranks").await.unwrap();
    assert_eq!((listing[0].name.as_str(), listing[0].ino), (".", rank1.ino));
    assert_eq!(
        (listing[1].name.as_str(), listing[1].ino),
        ("..", ranks.ino)
    );
    // Wrong kinds of access.
    let e = fs.read(ranks.ino, None, 0, 10).await.unwrap_err();
    assert!(matches!(e, FsError::IsDir(_)), "{e}");
    let t = fs.resolve("train/2/COMMIT.json").await.unwrap();
    assert!(matches!(
        fs.readdir(t.ino).await.unwrap_err(),
        FsError::NotDir(_)
    ));
    assert!(matches!(
        fs.lookup(t.ino, OsStr::new("x")).await.unwrap_err(),
        FsError::NotDir(_)
    ));
    assert!(matches!(
        fs.readlink(t.ino).await.unwrap_err(),
        FsError::NotSymlink(_)
    ));
    assert!(matches!(
        fs.open(t.ino, true).await.unwrap_err(),
        FsError::ReadOnly(_)
    ));
    assert!(matches!(
        fs.getattr(999_999).await.unwrap_err(),
        FsError::NotFound(_)
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_file_holds_the_saved_bytes() {
    let ts = test_store();
    let (e1, e2) = sharded_run(&ts.store).await;
    let fs = CkptFs::new(ts.store.clone(), opts(1 << 20));
    for (step, e) in [(1u64, &e1), (2, &e2)] {
        for (name, t) in &e.tensors {
            let got = fs
                .read_path(&format!("train/{step}/tensors/{name}"))
                .await
                .unwrap();
            assert!(got == t.bytes, "step {step} tensor {name}");
        }
        for (r, per) in &e.rank_boxes {
            for name in per.keys() {
                let got = fs
                    .read_path(&format!("train/{step}/ranks/{r}/{name}"))
                    .await
                    .unwrap();
                assert!(got == e.rank_file(*r, name), "step {step} rank {r} {name}");
            }
        }
        for ((r, name), b) in &e.blobs {
            let got = fs
                .read_path(&format!("train/{step}/blobs/{r}/{name}"))
                .await
                .unwrap();
            assert_eq!(&got, b, "step {step} blob {name} of rank {r}");
        }
        // model.safetensors: the bytes export writes, and a valid file.
        let model = fs
            .read_path(&format!("train/{step}/model.safetensors"))
            .await
            .unwrap();
        assert!(model == export_bytes(&ts.store, "train", step).await);
        let st = safetensors::SafeTensors::deserialize(&model).unwrap();
        assert_eq!(st.len(), e.tensors.len());
        for (name, t) in &e.tensors {
            let v = st.tensor(name).unwrap();
            assert_eq!(v.data(), &t.bytes[..], "{name}");
            assert_eq!(
                v.shape(),
                t.shape.iter().map(|&d| d as usize).collect::<Vec<_>>()
            );
        }
    }
    // ZeRO partitions really are several boxes on one rank, and replicas are listed.
    let zero_boxes =
        e2.rank_boxes[&0]["exp_avg.embed"].len() + e2.rank_boxes[&2]["exp_avg.embed"].len();
    assert!(zero_boxes >= 2);
    let holders = (0..4)
        .filter(|r| e2.rank_boxes[r].contains_key("layers.0.norm.weight"))
        .count();
    assert_eq!(holders, 4, "the replicated norm shows on every rank");

    // COMMIT.json: the commit record, pretty, in its own field order, then `fs_names`.
    let text = String::from_utf8(fs.read_path("train/2/COMMIT.json").await.unwrap()).unwrap();
    assert!(
        text.starts_with("{\n  \"checksum\": \"")
            && text.contains("\",\n  \"format\": 4,\n  \"run\": \"train\""),
        "{text}"
    );
    assert!(text.ends_with("\n}\n") && text.contains("\n  \"fs_names\": {\n    \""));
    let j: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(j["step"], 2);
    assert_eq!(j["run"], "train");
    assert_eq!(j["tensors"].as_array().unwrap().len(), e2.tensors.len());
    assert_eq!(j["fs_names"]["tensors"], serde_json::json!({}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_ranges_equal_the_exported_file() {
    let ts = test_store();
    let (_, e2) = sharded_run(&ts.store).await;
    let fs = CkptFs::new(ts.store.clone(), opts(64 << 10));
    let export = export_bytes(&ts.store, "train", 2).await;
    let model = fs.resolve("train/2/model.safetensors").await.unwrap();
    assert_eq!(model.size, export.len() as u64);
    let fh = fs.open(model.ino, false).await.unwrap();
    let mut rng = Rng(42);
    for i in 0..400 {
        let off = rng.below(export.len() as u64 + 10);
        let len = if i % 5 == 0 {
            rng.below(40_000)
        } else {
            rng.below(700)
        } as u32;
        let got = fs.read(model.ino, Some(fh), off, len).await.unwrap();
        let lo = (off as usize).min(export.len());
        let hi = (lo + len as usize).min(export.len());
        assert!(got == export[lo..hi], "read {len} at {off}");
    }
    fs.release(fh);
    // And odd ranges of rank files (partial elements at both ends).
    let name = "exp_avg.qkv";
    let holders: Vec<u32> = (0..4u32)
        .filter(|r| e2.rank_boxes[r].contains_key(name))
        .collect();
    assert!(holders.len() >= 2);
    for r in holders {
        let want = e2.rank_file(r, name);
        let a = fs
            .resolve(&format!("train/2/ranks/{r}/{name}"))
            .await
            .unwrap();
        for _ in 0..50 {
            let off = rng.below(want.len() as u64);
            let len = rng.below(3000) as u32;
            let got = fs.read(a.ino, None, off, len).await.unwrap();
            let hi = (off as usize + len as usize).min(want.len());
            assert!(got == want[off as usize..hi]);
        }
    }
    assert!(fs.cache_stats().bytes <= 64 << 10, "{:?}", fs.cache_stats());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damaged_chunk_fails_exactly_the_reads_that_touch_it() {
    let ts = test_store();
    let (_, e2) = sharded_run(&ts.store).await;
    let d = damage_chunk(&ts.store, "train", 2, "exp_avg.embed", 1).await;
    let fs = CkptFs::new(ts.store.clone(), opts(1 << 20));
    let t = &e2.tensors[&d.tensor];
    let file = fs
        .resolve(&format!("train/2/tensors/{}", d.tensor))
        .await
        .unwrap();
    let model = fs.resolve("train/2/model.safetensors").await.unwrap();
    let export_len = model.size;
    let mut rng = Rng(7);
    let mut failed = 0;
    for i in 0..300 {
        let (ino, range, size) = if i % 2 == 0 {
            (file.ino, &d.tensor_range, t.bytes.len() as u64)
        } else {
            (model.ino, &d.model_range, export_len)
        };
        // Aim near the damage half of the time.
        let off = if i % 4 < 2 {
            range.start.saturating_sub(3000) + rng.below(range.end - range.start + 6000)
        } else {
            rng.below(size)
        }
        .min(size - 1);
        let len = 1 + rng.below(5000);
        let end = (off + len).min(size);
        let touches = off < range.end && end > range.start;
        match fs.read(ino, None, off, len as u32).await {
            Ok(got) => {
                assert!(
                    !touches,
                    "read {off}..{end} touches {range:?} but succeeded"
                );
                if ino == file.ino {
                    assert!(got == t.bytes[off as usize..end as usize]);
                }
            }
            Err(e) => {
                assert!(
                    touches,
                    "read {off}..{end} misses {range:?} but failed: {e}"
                );
                let FsError::Store(s) = &e else { panic!("{e}") };
                assert_eq!(s.kind(), ErrorKind::Corrupt);
                let msg = e.to_string();
                assert!(
                    msg.contains(&d.object)
                        && msg.contains(&d.tensor)
                        && msg.contains("step 2 of run train"),
                    "{msg}"
                );
                failed += 1;
            }
        }
    }
    assert!(failed > 20, "{failed}");
    // Everything else stays readable: every other tensor, rank files that avoid it, blobs.
    for (name, t) in &e2.tensors {
        if *name != d.tensor {
            assert!(
                fs.read_path(&format!("train/2/tensors/{name}"))
                    .await
                    .unwrap()
                    == t.bytes
            );
        }
    }
    // Step 1 does not share the damaged chunk.
    fs.read_path("train/1/model.safetensors").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_names_stay_inside_and_are_mapped() {
    let ts = test_store();
    let exp = hostile_run(&ts.store).await;
    let fs = CkptFs::new(ts.store.clone(), opts(1 << 20));
    let listed = fs.list_path("evil/1/tensors").await.unwrap();
    assert_eq!(listed.len(), exp.tensors.len());
    let files: BTreeSet<&str> = listed.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(files.len(), listed.len(), "unique file names");
    for f in &files {
        assert!(names::is_safe(f), "{f:?}");
    }
    let j: serde_json::Value =
        serde_json::from_slice(&fs.read_path("evil/1/COMMIT.json").await.unwrap()).unwrap();
    let mapping = j["fs_names"]["tensors"].as_object().unwrap();
    for (name, t) in &exp.tensors {
        let file = mapping
            .get(name)
            .map(|v| v.as_str().unwrap().to_string())
            .unwrap_or_else(|| name.clone());
        assert!(files.contains(file.as_str()), "{name:?} -> {file:?}");
        let got = fs
            .read_path(&format!("evil/1/tensors/{file}"))
            .await
            .unwrap();
        assert!(got == t.bytes, "{name:?}");
        let got = fs
            .read_path(&format!("evil/1/ranks/0/{file}"))
            .await
            .unwrap();
        assert!(got == t.bytes, "{name:?}");
    }
    assert_eq!(
        mapping["../../../../etc/passwd"],
        "..%2F..%2F..%2F..%2Fetc%2Fpasswd"
    );
    assert_eq!(mapping[".."], "%2E%2E");
    assert_eq!(mapping["new\nline"], "new%0Aline");
    assert!(!mapping.contains_key("ok.name"));
    let blob_map = j["fs_names"]["blobs"]["0"].as_object().unwrap();
    for ((_, name), b) in &exp.blobs {
        let file = blob_map
            .get(name)
            .map(|v| v.as_str().unwrap().to_string())
            .unwrap_or_else(|| name.clone());
        assert!(names::is_safe(&file));
        assert_eq!(
            &fs.read_path(&format!("evil/1/blobs/0/{file}"))
                .await
                .unwrap(),
            b
        );
    }
    // Raw hostile names resolve to nothing (no entry is reached through `/` or `..`).
    let tdir = fs.resolve("evil/1/tensors").await.unwrap();
    for raw in ["..", ".", "a", "../../../../etc/passwd"] {
        assert!(
            fs.lookup(tdir.ino, OsStr::new(raw)).await.is_err(),
            "{raw:?}"
        );
    }
    // Safetensors keeps the original names.
    let model = fs.read_path("evil/1/model.safetensors").await.unwrap();
    let st = safetensors::SafeTensors::deserialize(&model).unwrap();
    assert_eq!(
        st.tensor("../../../../etc/passwd").unwrap().data(),
        &exp.tensors["../../../../etc/passwd"].bytes[..]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_named_tensor_hides_only_model_safetensors() {
    let ts = test_store();
    let layout = ckpt_store::Layout::SINGLE;
    let specs = vec![ckpt_store::TensorSpec {
        name: "__metadata__".into(),
        dtype: ckpt_store::DType::U8,
        shape: vec![5],
        placement: specs()[3].placement.clone(),
    }];
    let e = save(&ts.store, "meta", 1, layout, &specs, 5, true).await;
    let fs = CkptFs::new(ts.store.clone(), opts(1 << 20));
    assert_eq!(
        names_of(&fs.list_path("meta/1").await.unwrap()),
        vec!["COMMIT.json", "tensors", "ranks", "blobs"]
    );
    assert!(fs.resolve("meta/1/model.safetensors").await.is_err());
    assert_eq!(
        fs.read_path("meta/1/tensors/__metadata__").await.unwrap(),
        e.tensors["__metadata__"].bytes
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_fetch_only_what_they_touch_and_read_ahead_when_sequential() {
    let ts = test_store();
    let (_, e2) = sharded_run(&ts.store).await;
    let fs = CkptFs::new(ts.store.clone(), opts(1 << 20));
    let name = "exp_avg.embed"; // 12 KiB, several 4 KiB chunks on each rank
    let a = fs
        .resolve(&format!("train/2/tensors/{name}"))
        .await
        .unwrap();
    // Listing a step reads its commit record only; a tiny read fetches one chunk (plus the
    // manifests that say where it is).
    let before = ts.metrics.snapshot();
    let got = fs.read(a.ino, None, 5000, 10).await.unwrap();
    assert_eq!(got, e2.tensors[name].bytes[5000..5010]);
    let st = fs.cache_stats();
    assert_eq!(st.fetches, 1, "{st:?}");
    let gets = (ts.metrics.snapshot() - before).gets;
    assert!(gets <= 1 + 4, "{gets} GETs for one chunk");

    // Sequential reads through a handle: chunks arrive before they are asked for.
    let fh = fs.open(a.ino, false).await.unwrap();
    let size = a.size;
    let mut off = 0u64;
    let mut out = Vec::new();
    while off < size {
        let b = fs.read(a.ino, Some(fh), off, 1024).await.unwrap();
        off += b.len() as u64;
        out.extend_from_slice(&b);
        if off == 1024 {
            // Give the read-ahead a moment, then the rest of the file is in memory.
            let t0 = std::time::Instant::now();
            while fs.cache_stats().fetches < 6 && t0.elapsed() < Duration::from_secs(5) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    }
    assert!(out == e2.tensors[name].bytes);
    let st = fs.cache_stats();
    assert!(st.hits > 10, "{st:?}");
    assert!(
        st.fetches >= 6,
        "read-ahead fetched the file's chunks: {st:?}"
    );
    fs.release(fh);
    assert_eq!(fs.open_handles(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_readers_share_fetches() {
    let ts = test_store();
    let (_, e2) = sharded_run(&ts.store).await;
    let fs = std::sync::Arc::new(CkptFs::new(ts.store.clone(), opts(4 << 20)));
    let export = std::sync::Arc::new(export_bytes(&ts.store, "train", 2).await);
    let mut tasks = Vec::new();
    for seed in 0..8u64 {
        let (fs, export) = (fs.clone(), export.clone());
        tasks.push(tokio::spawn(async move {
            let a = fs.resolve("train/2/model.safetensors").await.unwrap();
            let mut rng = Rng(seed);
            for _ in 0..50 {
                let off = rng.below(export.len() as u64);
                let len = rng.below(9000) as u32;
                let got = fs.read(a.ino, None, off, len).await.unwrap();
                let hi = (off as usize + len as usize).min(export.len());
                assert!(got == export[off as usize..hi]);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let st = fs.cache_stats();
    // Every chunk of the step was fetched at most once (the cache holds them all).
    let total_chunks: u64 = {
        let r = StepReader::open(&ts.store, "train", 2).await.unwrap();
        let mut n = 0;
        for rank in 0..4 {
            let m = r.manifest(rank).await.unwrap();
            n += m.tensors.iter().map(|t| t.chunks.len() as u64).sum::<u64>();
        }
        n
    };
    assert!(
        st.fetches <= total_chunks,
        "{st:?} for {total_chunks} chunks"
    );
    assert_eq!(st.evictions, 0);
    let _ = e2;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_store_and_new_commits_appear() {
    let ts = test_store();
    let fs = CkptFs::new(
        ts.store.clone(),
        FsOptions {
            list_ttl: Duration::from_millis(50),
            ..opts(1 << 20)
        },
    );
    assert!(fs.list_path("").await.unwrap().is_empty());
    assert!(fs.resolve("train").await.is_err());
    // A run that saves while mounted shows up, and `latest` follows it.
    save(&ts.store, "train", 5, layout(), &specs(), 5, true).await;
    tokio::time::sleep(Duration::from_millis(60)).await;
    assert_eq!(names_of(&fs.list_path("").await.unwrap()), vec!["train"]);
    let l = fs.resolve("train/latest").await.unwrap();
    assert_eq!(fs.readlink(l.ino).await.unwrap(), "5");
    save(&ts.store, "train", 10, layout(), &specs(), 6, true).await;
    tokio::time::sleep(Duration::from_millis(60)).await;
    assert_eq!(fs.readlink(l.ino).await.unwrap(), "10");
    assert_eq!(
        names_of(&fs.list_path("train").await.unwrap()),
        vec!["latest", "5", "10"]
    );
}

/// A log sink for one test.
#[derive(Clone, Default)]
struct Logs(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Logs {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test(flavor = "current_thread")]
async fn damage_is_logged_with_object_and_tensor() {
    let ts = test_store();
    sharded_run(&ts.store).await;
    let d = damage_chunk(&ts.store, "train", 2, "exp_avg.embed", 1).await;
    let logs = Logs::default();
    let sink = logs.clone();
    let sub = tracing_subscriber::fmt()
        .with_writer(move || sink.clone())
        .with_ansi(false)
        .finish();
    let _g = tracing::subscriber::set_default(sub);
    let fs = CkptFs::new(ts.store.clone(), opts(1 << 20));
    assert!(fs.read_path("train/2/model.safetensors").await.is_err());
    let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    let line = text
        .lines()
        .find(|l| l.contains("WARN") && l.contains(&d.object))
        .unwrap_or_else(|| panic!("no warning names {}: {text}", d.object));
    assert!(
        line.contains("exp_avg.embed") && line.contains("step 2 of run train"),
        "{line}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readdirplus_attributes_match_lookups() {
    let ts = test_store();
    sharded_run(&ts.store).await;
    let fs = CkptFs::new(ts.store.clone(), opts(1 << 20));
    for dir in [
        "train/2/tensors",
        "train/2/ranks/1",
        "train/2/blobs/0",
        "train/2",
    ] {
        let d = fs.resolve(dir).await.unwrap();
        let fh = fs.opendir(d.ino).await.unwrap();
        let (entries, attrs) = fs.dir_entries_plus(fh).await.unwrap();
        assert_eq!(entries.len(), attrs.len());
        for (e, a) in entries.iter().zip(attrs.iter()).skip(2) {
            let looked = fs.lookup(d.ino, OsStr::new(&e.name)).await.unwrap();
            assert_eq!(a, &looked, "{dir}/{}", e.name);
        }
        fs.release(fh);
    }
    // Steps listed in a run get attributes that expire at once (no commit record read).
    let run = fs.resolve("train").await.unwrap();
    let before = ts.metrics.snapshot();
    let fh = fs.opendir(run.ino).await.unwrap();
    let (entries, attrs) = fs.dir_entries_plus(fh).await.unwrap();
    let gets = (ts.metrics.snapshot() - before).gets;
    assert_eq!(gets, 0, "listing a run opens no step");
    for (e, a) in entries.iter().zip(attrs.iter()) {
        assert_eq!(a.kind, e.kind);
        if e.name == "latest" {
            assert_eq!(a.size, 1, "the link's exact size");
        } else {
            assert_eq!(a.ttl, Duration::ZERO, "{}", e.name);
        }
    }
    fs.release(fh);
}

/// Delta chunks (issue 16): a step whose chunks are deltas on the step before reads through
/// the mount bit for bit, as the tensor file and inside `model.safetensors` (the bytes `ckpt
/// export` writes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delta_chunks_read_through_the_mount() {
    use bytes::Bytes;
    use ckpt_store::writer::{RankWrite, ShardDesc, ShardIn};
    use ckpt_store::{DType, DedupBase, Layout, NdBox, StoreConfig};
    let ts = test_store();
    let store = ts
        .store
        .clone()
        .with_config(StoreConfig {
            adaptive_codec: false,
            delta_chain: 4,
            ..ckpt_store::testing::tiny_config()
        })
        .unwrap();
    let n = 8 * 1024usize;
    let values = |step: u64| -> Vec<u8> {
        let r = ckpt_store::testing::det_bytes(3, n * 8);
        (0..n)
            .flat_map(|i| {
                let u = u64::from_le_bytes(r[i * 8..i * 8 + 8].try_into().unwrap());
                let x = ((u >> 11) as f64 / (1u64 << 53) as f64 - 0.5) * 0.04;
                let drift = 1.0 + 1e-4 * step as f64 * (((u & 0xff) as f64) / 255.0 - 0.5);
                ((x * drift) as f32).to_le_bytes()
            })
            .collect()
    };
    let mut base = DedupBase::new();
    for step in 1..=3u64 {
        let index = base.pinned(base.base_step());
        let shard = ShardIn {
            shard: ShardDesc::boxed("w", DType::F32, vec![n as u64], NdBox::full(&[n as u64])),
            data: Some(Bytes::from(values(step))),
        };
        let w = RankWrite::new("d", step, 0, Layout::SINGLE);
        let (m, _, _) = store
            .write_rank(&w, vec![shard], vec![], &index)
            .await
            .unwrap();
        store.log().commit_step("d", step).await.unwrap();
        base.seed_manifest(&m);
        if step > 1 {
            assert!(
                m.tensors[0].chunks.iter().any(|c| c.is_delta()),
                "step {step} holds deltas"
            );
        }
    }
    let fs = CkptFs::new(store.clone(), opts(1 << 20));
    for step in 1..=3u64 {
        let want = values(step);
        let t = fs.resolve(&format!("d/{step}/tensors/w")).await.unwrap();
        let got = fs.read(t.ino, None, 0, want.len() as u32).await.unwrap();
        assert!(got == want, "tensors/w of step {step}");
        let export = export_bytes(&store, "d", step).await;
        let model = fs
            .resolve(&format!("d/{step}/model.safetensors"))
            .await
            .unwrap();
        let got = fs
            .read(model.ino, None, 0, export.len() as u32)
            .await
            .unwrap();
        assert!(got == export, "model.safetensors of step {step}");
        let header = u64::from_le_bytes(export[..8].try_into().unwrap()) as usize;
        assert!(export[8 + header..] == want[..], "export of step {step}");
    }
}
