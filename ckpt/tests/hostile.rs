//! Hostile input: safetensors files with lying headers, index files that point outside their
//! directory, and tensor names built to escape directories or drive terminals. Every case gets
//! a clear error (exit code 1, the file and the problem named), never a panic, never a change
//! to the store, and nothing is ever written outside `--out`.

mod common;

use bytes::Bytes;
use ckpt_store::{DType, DedupIndex, Layout, NdBox, RankWrite, ShardDesc, ShardIn};
use common::{Env, files_below, local, s3, tmp};

macro_rules! on_both {
    ($($case:ident),* $(,)?) => {
        mod on_local { $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $case() { super::$case(super::local()).await } )* }
        mod on_s3 { $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $case() { ckpt_store::require!(ckpt_store::testing::Need::S3Server, concat!(stringify!($case), " on S3")); super::$case(super::s3()).await } )* }
    };
}

on_both!(
    lying_headers_are_refused_and_the_store_is_untouched,
    index_files_cannot_reach_outside_their_directory,
    hostile_names_never_leave_out_or_reach_the_terminal,
);

/// A safetensors file from a raw header and data.
fn st(header: &str, data: &[u8]) -> Vec<u8> {
    let mut v = (header.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(header.as_bytes());
    v.extend_from_slice(data);
    v
}

fn with_len(n: u64, rest: &[u8]) -> Vec<u8> {
    let mut v = n.to_le_bytes().to_vec();
    v.extend_from_slice(rest);
    v
}

async fn lying_headers_are_refused_and_the_store_is_untouched(env: Env) {
    let nested = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "tiny",
            b"abc".to_vec(),
            "shorter than the 8-byte header length",
        ),
        (
            "huge-len",
            with_len(u64::MAX, b"{}"),
            "larger than the 100000000 bytes",
        ),
        (
            "tb-len",
            with_len(1 << 40, b"{}"),
            "larger than the 100000000 bytes",
        ),
        (
            "short-len",
            with_len(64, b"{}"),
            "larger than the 2 bytes that follow",
        ),
        (
            "past-end",
            st(
                r#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#,
                &[0; 8],
            ),
            "lie past the end of the data (8 bytes",
        ),
        (
            "overlap",
            st(
                r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#,
                &[0; 12],
            ),
            "overlap",
        ),
        (
            "size-lie",
            st(
                r#"{"w":{"dtype":"F32","shape":[1000000],"data_offsets":[0,8]}}"#,
                &[0; 8],
            ),
            "needs 4000000 bytes",
        ),
        (
            "overflow",
            st(
                r#"{"w":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,8]}}"#,
                &[0; 8],
            ),
            "too large",
        ),
        (
            "dup",
            st(
                r#"{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"w":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#,
                &[0; 2],
            ),
            "appears twice",
        ),
        (
            "ctl-name",
            st(
                r#"{"a\u001b[2Jb":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#,
                &[0],
            ),
            "control characters",
        ),
        (
            "complex",
            st(
                r#"{"w":{"dtype":"C64","shape":[1],"data_offsets":[0,8]}}"#,
                &[0; 8],
            ),
            "cannot be stored by ckpt",
        ),
        ("garbage", st("{not json", &[]), "not a JSON object"),
        ("nested", st(&nested, &[]), "not a JSON object"),
        (
            "trailing",
            st(
                r#"{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#,
                &[0; 100],
            ),
            "holds 100 bytes of data",
        ),
        (
            "gap",
            st(
                r#"{"w":{"dtype":"U8","shape":[1],"data_offsets":[5,6]}}"#,
                &[0; 6],
            ),
            "reference parser",
        ),
        (
            "meta-type",
            st(r#"{"__metadata__":{"k":[1,2]}}"#, &[]),
            "is not a string",
        ),
    ];
    let dir = tmp();
    for (name, bytes, want) in cases {
        let path = dir.path().join(format!("{name}.safetensors"));
        std::fs::write(&path, &bytes).unwrap();
        let r = env
            .ckpt(&[
                "import",
                path.to_str().unwrap(),
                "--run",
                "hostile",
                "--step",
                "1",
            ])
            .code(1);
        assert!(
            r.err.contains(want),
            "{name}: expected {want:?} in:\n{}",
            r.err
        );
        assert!(
            r.err.contains(&format!("{name}.safetensors")),
            "{name}: names the file: {}",
            r.err
        );
        assert!(
            !r.err.contains('\u{1b}'),
            "{name}: no raw escape reaches the terminal"
        );
    }
    let j = env.ckpt(&["ls", "--json"]).code(0).json();
    assert_eq!(
        j["runs"].as_array().unwrap().len(),
        0,
        "nothing was imported: {j}"
    );
    // A directory is not a file.
    env.ckpt(&[
        "import",
        dir.path().to_str().unwrap(),
        "--run",
        "hostile",
        "--step",
        "1",
    ])
    .code(1);
}

async fn index_files_cannot_reach_outside_their_directory(env: Env) {
    let root = tmp();
    let inner = root.path().join("model");
    std::fs::create_dir(&inner).unwrap();
    // A perfectly valid file just outside the index's directory.
    let good = st(
        r#"{"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}"#,
        &[1, 2],
    );
    std::fs::write(root.path().join("outside.safetensors"), &good).unwrap();
    std::fs::write(inner.join("inside.safetensors"), &good).unwrap();
    let cases = [
        (
            r#"{"weight_map":{"w":"../outside.safetensors"}}"#,
            "only plain file names",
        ),
        (
            r#"{"weight_map":{"w":"/etc/passwd"}}"#,
            "only plain file names",
        ),
        (r#"{"weight_map":{"w":".."}}"#, "only plain file names"),
        (
            r#"{"weight_map":{"w":"a\u0000b"}}"#,
            "only plain file names",
        ),
        (r#"{"weight_map":{"w":7}}"#, "is not a file name"),
        (r#"{"metadata":{}}"#, "no \"weight_map\""),
        (
            r#"{"weight_map":{"v":"inside.safetensors"}}"#,
            "does not hold it",
        ),
        (
            r#"{"weight_map":{"w":"inside.safetensors","x":"missing.safetensors"}}"#,
            "missing.safetensors",
        ),
    ];
    for (i, (doc, want)) in cases.iter().enumerate() {
        let idx = inner.join(format!("bad{i}.index.json"));
        std::fs::write(&idx, doc).unwrap();
        let r = env
            .ckpt(&[
                "import",
                idx.to_str().unwrap(),
                "--run",
                "hostile",
                "--step",
                "1",
            ])
            .code(1);
        assert!(
            r.err.contains(want),
            "{doc}: expected {want:?} in:\n{}",
            r.err
        );
    }
    assert_eq!(
        env.ckpt(&["ls", "--json"]).code(0).json()["runs"]
            .as_array()
            .unwrap()
            .len(),
        0
    );
    // The same index with a plain name works.
    let idx = inner.join("ok.index.json");
    std::fs::write(&idx, r#"{"weight_map":{"w":"inside.safetensors"}}"#).unwrap();
    env.ckpt(&[
        "import",
        idx.to_str().unwrap(),
        "--run",
        "fine",
        "--step",
        "1",
    ])
    .code(0);
}

async fn hostile_names_never_leave_out_or_reach_the_terminal(env: Env) {
    let names = [
        "../../escape",
        "/abs/path",
        "a/b/../../c",
        "ctl\u{1b}[2J\u{7}bell",
        "line\nbreak",
        "rtl\u{202e}gnp.exe",
        "..",
        "ok.weight",
    ];
    let shards: Vec<ShardIn> = names
        .iter()
        .enumerate()
        .map(|(i, n)| ShardIn {
            shard: ShardDesc::boxed(
                n.to_string(),
                DType::U8,
                vec![3 + i as u64],
                NdBox::full(&[3 + i as u64]),
            ),
            data: Some(Bytes::from(vec![i as u8; 3 + i])),
        })
        .collect();
    let w = RankWrite::new("evil", 1, 0, Layout::SINGLE);
    env.store
        .write_rank(&w, shards, vec![], &DedupIndex::new())
        .await
        .unwrap();
    env.store.log().commit_step("evil", 1).await.unwrap();

    let parent = tmp();
    let out = parent.path().join("out");
    env.ckpt(&["export", "evil@1", "--out", out.to_str().unwrap()])
        .code(0);
    let sharded = parent.path().join("sharded");
    env.ckpt(&[
        "export",
        "evil@1",
        "--out",
        sharded.to_str().unwrap(),
        "--max-shard-size",
        "1",
    ])
    .code(0);
    let mut want = vec!["out/model.safetensors".to_string()];
    let n = names.len();
    for i in 1..=n {
        want.push(format!("sharded/model-{i:05}-of-{n:05}.safetensors"));
    }
    want.push("sharded/model.safetensors.index.json".into());
    want.sort();
    assert_eq!(
        files_below(parent.path()),
        want,
        "only generated names, only inside --out"
    );
    let b = std::fs::read(out.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&b).unwrap();
    for (i, name) in names.iter().enumerate() {
        assert_eq!(
            st.tensor(name).unwrap().data(),
            &vec![i as u8; 3 + i][..],
            "{name:?}"
        );
    }
    // The index maps the odd names to generated files.
    let idx: serde_json::Value = serde_json::from_slice(
        &std::fs::read(sharded.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(idx["weight_map"].as_object().unwrap().len(), n);

    // Text output escapes control and bidi characters; JSON escapes by itself.
    for args in [
        vec!["inspect", "evil@1"],
        vec!["inspect", "evil@1", "--tensor", "ctl\u{1b}[2J\u{7}bell"],
        vec!["diff", "evil@1", "evil@1"],
        vec!["plan", "evil@1", "--layout", "dp=2"],
    ] {
        let r = env.ckpt(&args).code(0);
        for bad in ['\u{1b}', '\u{7}', '\u{202e}'] {
            assert!(
                !r.out.contains(bad),
                "{args:?} printed a raw {bad:?}:\n{}",
                r.out
            );
        }
    }
    let r = env.ckpt(&["inspect", "evil@1"]).code(0);
    assert!(
        r.out.contains("ctl\\u{1b}[2J\\u{7}bell") && r.out.contains("line\\u{a}break"),
        "{}",
        r.out
    );
    let j = env.ckpt(&["inspect", "evil@1", "--json"]).code(0).json();
    let got: Vec<&str> = j["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert!(
        got.contains(&"ctl\u{1b}[2J\u{7}bell"),
        "JSON keeps the exact name"
    );

    // A name safetensors cannot hold gets a clear error, and --exclude gets around it.
    let shard = ShardIn {
        shard: ShardDesc::boxed("__metadata__", DType::U8, vec![1], NdBox::full(&[1])),
        data: Some(Bytes::from_static(&[1])),
    };
    let w = RankWrite { step: 2, ..w };
    env.store
        .write_rank(&w, vec![shard], vec![], &DedupIndex::new())
        .await
        .unwrap();
    env.store.log().commit_step("evil", 2).await.unwrap();
    let meta_out = parent.path().join("meta");
    let r = env
        .ckpt(&["export", "evil@2", "--out", meta_out.to_str().unwrap()])
        .code(1);
    assert!(
        r.err.contains("__metadata__") && r.err.contains("--exclude"),
        "{}",
        r.err
    );
    let r = env
        .ckpt(&[
            "export",
            "evil@2",
            "--out",
            meta_out.to_str().unwrap(),
            "--exclude",
            "__metadata__",
        ])
        .code(2);
    assert!(r.err.contains("no tensor of evil@2 matches"), "{}", r.err);
}

/// Another user planted symbolic links in `--out` at every name `ckpt export` writes (each
/// shard, the index json, and their `.NAME.partial` temporary names), dangling or pointing at
/// a file outside: every export refuses with an error naming the link, even with `--force`,
/// and the file outside stays untouched. A leftover regular temporary file is replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_never_writes_through_a_link_planted_in_out() {
    use std::os::unix::fs::symlink;
    let env = local();
    common::save_step(&env.store, "train", 10, false, &DedupIndex::new()).await;
    let outside = tmp();
    let victim = outside.path().join("victim");
    std::fs::write(&victim, b"precious").unwrap();
    let untouched = || {
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        assert_eq!(
            common::files_below(outside.path()),
            vec!["victim".to_string()],
            "nothing was created outside --out"
        );
    };

    // The names a sharded export writes.
    let clean = tmp();
    let dir = clean.path().to_str().unwrap();
    let j = env
        .ckpt(&[
            "export",
            "train@10",
            "--out",
            dir,
            "--max-shard-size",
            "8KB",
            "--json",
        ])
        .code(0)
        .json();
    let mut names: Vec<String> = j["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["file"].as_str().unwrap().to_string())
        .collect();
    assert!(names.len() >= 2, "a sharded export: {j}");
    names.push("model.safetensors.index.json".into());
    let partials: Vec<String> = names.iter().map(|n| format!(".{n}.partial")).collect();

    for name in names.iter().chain(&partials) {
        for target in [victim.clone(), outside.path().join("not-yet")] {
            let out = tmp();
            let link = out.path().join(name);
            symlink(&target, &link).unwrap();
            let o = out.path().to_str().unwrap();
            let r = env
                .ckpt(&[
                    "export",
                    "train@10",
                    "--out",
                    o,
                    "--max-shard-size",
                    "8KB",
                    "--force",
                ])
                .code(1);
            assert!(
                r.err.contains(name.as_str()) && r.err.contains("symbolic link"),
                "the error names the link {name}: {}",
                r.err
            );
            untouched();
            assert!(
                std::fs::symlink_metadata(&link)
                    .unwrap()
                    .file_type()
                    .is_symlink(),
                "the link is left for its owner"
            );
            assert_eq!(
                common::files_below(out.path()),
                vec![name.clone()],
                "nothing else was written"
            );
        }
    }

    // A single-file export: a link at the name is refused too (without --force it is
    // "already holds" it, which a dangling link does not hide).
    for name in ["model.safetensors", ".model.safetensors.partial"] {
        let out = tmp();
        symlink(outside.path().join("not-yet"), out.path().join(name)).unwrap();
        for force in [false, true] {
            let mut args = vec!["export", "train@10", "--out", out.path().to_str().unwrap()];
            if force {
                args.push("--force");
            }
            let r = env.ckpt(&args).code(1);
            assert!(r.err.contains(name), "{}", r.err);
        }
        untouched();
    }

    // A regular leftover `.model.safetensors.partial` (an interrupted export) is replaced,
    // and what appears is a regular file.
    let out = tmp();
    std::fs::write(out.path().join(".model.safetensors.partial"), b"left over").unwrap();
    env.ckpt(&["export", "train@10", "--out", out.path().to_str().unwrap()])
        .code(0);
    assert_eq!(
        common::files_below(out.path()),
        vec!["model.safetensors".to_string()]
    );
    let single = out.path().join("model.safetensors");
    assert!(std::fs::symlink_metadata(&single).unwrap().is_file());
    assert!(std::fs::metadata(&single).unwrap().len() > 1000);
}

/// `ckpt plot --out FILE` with a link planted at FILE or at its temporary name: refused with
/// the link named, the file outside untouched; a regular FILE is replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plot_never_writes_through_a_planted_link() {
    use ckpt_store::logs::{LogWriter, METRICS};
    use std::os::unix::fs::symlink;
    let env = local();
    let mut m = LogWriter::new(&env.store, "train", METRICS, "rank-0").unwrap();
    for step in 1..=20u64 {
        m.append(&serde_json::json!({"kind":"step","step":step,"loss":3.0 / step as f64,"t_ms":1_767_000_000_000i64 + step as i64 * 1000}))
            .unwrap();
    }
    m.flush().await.unwrap();
    let outside = tmp();
    let victim = outside.path().join("victim");
    std::fs::write(&victim, b"precious").unwrap();
    let dir = tmp();
    let png = dir.path().join("loss.png");
    for name in ["loss.png", ".loss.png.partial"] {
        let link = dir.path().join(name);
        symlink(&victim, &link).unwrap();
        let r = env
            .ckpt(&["plot", "train", "--out", png.to_str().unwrap()])
            .code(1);
        assert!(
            r.err.contains(name) && r.err.contains("symbolic link"),
            "{}",
            r.err
        );
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        std::fs::remove_file(&link).unwrap();
    }
    std::fs::write(&png, b"old").unwrap();
    env.ckpt(&["plot", "train", "--out", png.to_str().unwrap()])
        .code(0);
    assert!(std::fs::read(&png).unwrap().starts_with(b"\x89PNG"));
    assert_eq!(
        common::files_below(dir.path()),
        vec!["loss.png".to_string()]
    );
}
